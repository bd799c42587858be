#!/usr/bin/env python3
"""Makes the tokenizer golden data of tests/data/tok/ with Hugging Face `tokenizers` (run on a
machine that has it; nothing is downloaded):

  python3 tools/tok_golden.py TRAIN_TEXT OUT_DIR      # e.g. .data/tinyshakespeare.txt tests/data/tok

It trains three small tokenizers, one in each shipped family's tokenizer.json format, on TRAIN_TEXT
plus a mixed corpus, and writes
  OUT_DIR/{olmoe,qwen3,mixtral}/tokenizer.json
  OUT_DIR/corpus/*.txt      the mixed corpus (raw bytes; some files hold invalid UTF-8)
  OUT_DIR/golden.json       {"versions": {...}, "ids": {family: {file: [ids]}},
                             "decode": {family: {file: text}}}
How each family is built (what flatmoe's reader must match):
  olmoe   GPT-NeoX style: no normalizer, ByteLevel pre-tokenizer (GPT-2 regex), ByteLevel decoder,
          merges written as "a b" strings; added tokens <|endoftext|> (special), <|padding|>.
  qwen3   NFC normalizer; Sequence[Split(Qwen2's regex, Isolated), ByteLevel(use_regex=false)];
          ByteLevel decoder; merges as [a, b] pairs; <|endoftext|>, <|im_start|>, <|im_end|>.
  mixtral Llama/sentencepiece style: normalizer Sequence[Prepend("▁"), Replace(" ", "▁")], no
          pre-tokenizer, BPE with byte_fallback and fuse_unk, <unk> <s> </s> then <0x00>..<0xFF>
          at ids 0..258, decoder Sequence[Replace("▁"," "), ByteFallback, Fuse, Strip(" ",1,0)].
Input bytes are decoded with bytes.decode("utf-8", errors="replace") before encoding (what a
reader of invalid UTF-8 sees); ids are from encode(text, add_special_tokens=False) (no
post-processor), decode from decode(ids, skip_special_tokens=False).
"""
import json, os, sys
import tokenizers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, normalizers, trainers, Regex

QWEN_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
            r"\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = {
    "english.txt": ("The quick brown fox jumps over the lazy dog. I'LL say it's DONE, we're here; "
                    "they've gone, you'd know. Don't stop! 'Tis the season... \"Quoted\" (parens) "
                    "[brackets] {braces}\nNumbers: 0 7 42 1234567 3.14159 -2e10 1,000,000 10%\n"
                    "Email: someone@example.com, URL: https://example.org/a?b=c&d=e#f\n").encode(),
    "code.txt": (b"#include <stdio.h>\nint main(int argc, char **argv) {\n\tfor (int i = 0; i < argc; i++)\n"
                 b"\t\tprintf(\"%d: %s\\n\", i, argv[i]);\n    return 0;\n}\n\ndef f(x, *args, **kw):\n"
                 b"    \"\"\"Docstring.\"\"\"\n    return [y ** 2 for y in range(x) if y % 3 == 0]  # comment\n"
                 b"x=a->b;y+=1;z<<=2;if(a&&b||!c){}\r\n"),
    "cjk.txt": ("日本語のテキストです。東京は日本の首都です。\n中文文本：北京是中国的首都，人口众多。\n"
                "한국어 텍스트입니다. 서울은 한국의 수도입니다.\n混合 mixed 文本 text 123 ４５６ ｆｕｌｌｗｉｄｔｈ\n").encode(),
    "emoji.txt": ("Emoji: 😀 😃 👍🏽 👨‍👩‍👧‍👦 🇩🇪 🏳️‍🌈 ❤️ ✨🚀 — dashes – and “curly quotes” … ™ © ½ ∑ ∞ ≠\n"
                  "Combining: e\u0301 a\u0308 n\u0303 (decomposed) vs é ä ñ (composed); Å \u212b ﬁ ligature\n").encode(),
    "whitespace.txt": b"  leading spaces\ttab\t\ttabs   three spaces    \n\n\nnewlines\r\n\r\ncrlf  \n"
                      b"trailing   \n \n\xc2\xa0nbsp\xc2\xa0 \xe3\x80\x80ideographic space\xe2\x80\x83em space\n"
                      b"        eight spaces\n\x0bvertical tab\x0cform feed end ",
    "invalid.txt": b"valid start \xff\xfe bad bytes \xc0\xaf overlong \xed\xa0\x80 surrogate \xe6\x97 truncated "
                   b"\xf0\x9f\x98 truncated emoji \x80 lone continuation \xf8\x88\x80\x80\x80 five-byte ok end\n",
    "special.txt": b"<|endoftext|>Hello<|endoftext|> world <|im_start|>user\nhi there<|im_end|>\n"
                   b"<|im_start|>assistant\nok<|im_end|><|padding|> <s> </s> <unk> <|endoftext|>",
}

def train_texts(path):
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    lines = text.splitlines(keepends=True)
    chunks = ["".join(lines[i:i + 50]) for i in range(0, len(lines), 50)]
    extra = [v.decode("utf-8", errors="replace") for v in CORPUS.values()]
    return chunks + extra * 20

def byte_level(texts, with_nfc, split_regex, special, vocab_size):
    tok = Tokenizer(models.BPE())
    if with_nfc:
        tok.normalizer = normalizers.NFC()
    if split_regex:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=special,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, tr)
    return tok

def sentencepiece_like(texts, vocab_size):
    norm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = norm
    # training only: split words at "▁" so the trainer sees words, not whole documents
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tr = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=["<unk>", "<s>", "</s>"],
                             limit_alphabet=120, show_progress=False)
    tok.train_from_iterator(texts, tr)
    j = json.loads(tok.to_str())
    # Llama's layout: <unk> <s> </s>, then the 256 byte tokens, then the learned pieces
    old = sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for piece, _ in old:
        if piece not in vocab:
            vocab[piece] = len(vocab)
    j["model"]["vocab"] = vocab
    for a in j["added_tokens"]:
        a["id"] = vocab[a["content"]]
    j["pre_tokenizer"] = None
    j["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return Tokenizer.from_str(json.dumps(j))

def main():
    train_path, out = sys.argv[1], sys.argv[2]
    texts = train_texts(train_path)
    toks = {
        "olmoe": byte_level(texts, False, None, ["<|endoftext|>", "<|padding|>"], 3000),
        "qwen3": byte_level(texts, True, QWEN_PAT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 3000),
        "mixtral": sentencepiece_like(texts, 3000),
    }
    os.makedirs(os.path.join(out, "corpus"), exist_ok=True)
    for name, data in CORPUS.items():
        with open(os.path.join(out, "corpus", name), "wb") as f:
            f.write(data)
    with open(train_path, "rb") as f:
        shakes = f.read()[:20000]
    with open(os.path.join(out, "corpus", "shakespeare.txt"), "wb") as f:
        f.write(shakes)
    files = dict(CORPUS, **{"shakespeare.txt": shakes})
    gold = {"versions": {"tokenizers": tokenizers.__version__}, "ids": {}, "decode": {}}
    for fam, tok in toks.items():
        d = os.path.join(out, fam)
        os.makedirs(d, exist_ok=True)
        j = json.loads(tok.to_str())
        if fam == "olmoe":  # the older merges format: "a b" strings
            j["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]]
        s = json.dumps(j, ensure_ascii=False, indent=1)
        with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(s)
        tok = Tokenizer.from_str(s)  # golden from exactly the file written
        gold["ids"][fam], gold["decode"][fam] = {}, {}
        for name, data in sorted(files.items()):
            text = data.decode("utf-8", errors="replace")
            ids = tok.encode(text, add_special_tokens=False).ids
            gold["ids"][fam][name] = ids
            gold["decode"][fam][name] = tok.decode(ids, skip_special_tokens=False)
        print(fam, "vocab", tok.get_vocab_size(), {n: len(v) for n, v in gold["ids"][fam].items()})
    with open(os.path.join(out, "golden.json"), "w", encoding="utf-8") as f:
        json.dump(gold, f, ensure_ascii=False)

if __name__ == "__main__":
    main()
