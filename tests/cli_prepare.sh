#!/usr/bin/env bash
# flatmoe prepare: text and JSONL to llm.c shards with loss masks, read back with --decode
# (shard text = input text + EOS; masked runs = the prompts and chat headers), the mask sidecar's
# exact bytes, sharding, and bad inputs (clear message, non-zero exit, no shards left behind).
# Tokenizers: tests/data/tok/{olmoe,qwen3,mixtral} (tools/tok_golden.py); FM_TOKDIR overrides.
source "$(dirname "$0")/lib_cli.sh"
TOK=${FM_TOKDIR:-$ROOT/tests/data/tok}
OLMOE=$TOK/olmoe

# 1. two text files, one document each, EOS after each: the shard decodes to exactly that
head -c 3000 "$TEXT" > "$TMP/a.txt"
printf 'Second document.\nIt has two lines.\n' > "$TMP/b.txt"
"$FM" prepare --tokenizer "$OLMOE" --input "$TMP/a.txt" "$TMP/b.txt" --out "$TMP/t" > "$TMP/t.log" 2>&1 \
    && ok || bad "prepare of two text files failed: $(cat "$TMP/t.log")"
grep -q "prepared 2 documents" "$TMP/t.log" && ok || bad "summary: $(cat "$TMP/t.log")"
[ -f "$TMP/t_000000.bin" ] && [ ! -e "$TMP/t_000001.bin" ] && ok || bad "expected exactly one shard t_000000.bin"
[ ! -e "$TMP/t_000000.bin.mask" ] && ok || bad "plain text must have no mask"
{ cat "$TMP/a.txt"; printf '<|endoftext|>'; cat "$TMP/b.txt"; printf '<|endoftext|>'; } > "$TMP/t.want"
"$FM" prepare --tokenizer "$OLMOE" --decode "$TMP/t_000000.bin" > "$TMP/t.got" && cmp -s "$TMP/t.want" "$TMP/t.got" \
    && ok || bad "the text shard does not decode to the input + EOS"
# header: magic 20240801, version 7, and the count matches the file size
read -r magic version count <<<"$(od -An -t u4 -N 12 "$TMP/t_000000.bin")"
size=$(stat -c %s "$TMP/t_000000.bin")
[ "$magic" = 20240801 ] && [ "$version" = 7 ] && [ $((1024 + 4 * count)) -eq "$size" ] \
    && ok || bad "shard header: magic $magic version $version count $count size $size"

# 2. sharding: --shard-tokens 300 splits the same tokens over ceil(count / 300) shards
"$FM" prepare --tokenizer "$OLMOE" --input "$TMP/a.txt" "$TMP/b.txt" --out "$TMP/s" --shard-tokens 300 > /dev/null 2>&1 \
    && ok || bad "prepare --shard-tokens 300 failed"
n_shards=$(ls "$TMP"/s_*.bin | wc -l)
[ "$n_shards" -eq $(((count + 299) / 300)) ] && ok || bad "$n_shards shards for $count tokens at 300 per shard"
for f in "$TMP"/s_*.bin; do "$FM" prepare --tokenizer "$OLMOE" --decode "$f"; done > "$TMP/s.got"
cmp -s "$TMP/t.want" "$TMP/s.got" && ok || bad "the shards together do not decode to the input"

# 3. JSONL: text, prompt/completion and chat records; masks on prompts and chat headers
cat > "$TMP/d.jsonl" <<'EOF'
{"prompt": "Question: what is two and two?\nAnswer:", "completion": " four."}

{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]}
{"text": "A plain document in JSONL."}
{"messages": [{"role": "user", "content": "only a question"}]}
EOF
"$FM" prepare --tokenizer "$OLMOE" --input "$TMP/d.jsonl" --out "$TMP/j" > "$TMP/j.log" 2>&1 \
    && ok || bad "prepare of JSONL failed: $(cat "$TMP/j.log")"
grep -q "prepared 4 documents" "$TMP/j.log" && ok || bad "JSONL summary: $(cat "$TMP/j.log")"
[ -f "$TMP/j_000000.bin.mask" ] && ok || bad "JSONL with prompts must have a mask"
printf '%s' '[[Question: what is two and two?
Answer:]] four.<|endoftext|>[[<|system|>
Be brief.
<|user|>
Hi there
<|assistant|>
]]Hello!
<|endoftext|>A plain document in JSONL.<|endoftext|>[[<|user|>
only a question
<|endoftext|>]]' > "$TMP/j.want"
"$FM" prepare --tokenizer "$OLMOE" --decode "$TMP/j_000000.bin" --show-mask > "$TMP/j.got" && cmp -s "$TMP/j.want" "$TMP/j.got" \
    && ok || bad "the JSONL shard's masked runs differ: $(diff "$TMP/j.want" "$TMP/j.got" | head -20)"
# the sidecar: "FMMASK01", uint64 LE count = the shard's count, then one byte (0 or 1) per token
read -r jcount <<<"$(od -An -t u4 -j 8 -N 4 "$TMP/j_000000.bin")"
[ "$(head -c 8 "$TMP/j_000000.bin.mask")" = FMMASK01 ] && ok || bad "mask magic"
read -r mcount <<<"$(od -An -t u8 -j 8 -N 8 "$TMP/j_000000.bin.mask")"
[ "$mcount" = "$jcount" ] && [ "$(stat -c %s "$TMP/j_000000.bin.mask")" -eq $((16 + jcount)) ] \
    && ok || bad "mask count $mcount vs shard count $jcount"
bytes=$(od -An -v -t u1 -j 16 "$TMP/j_000000.bin.mask" | tr -s ' \n' '\n' | grep -v '^$' | sort -u | tr '\n' ' ')
[ "$bytes" = "0 1 " ] && ok || bad "mask bytes are not 0/1: $bytes"
# the summary counts the masked tokens: as many as the zero bytes
zeros=$(od -An -v -t u1 -j 16 "$TMP/j_000000.bin.mask" | tr -s ' \n' '\n' | grep -c '^0$')
grep -q "($zeros masked)" "$TMP/j.log" && ok || bad "summary's masked count vs $zeros zero bytes: $(cat "$TMP/j.log")"
# --no-eos: one EOS fewer per document
"$FM" prepare --tokenizer "$OLMOE" --input "$TMP/d.jsonl" --out "$TMP/n" --no-eos > /dev/null 2>&1 && ok || bad "--no-eos failed"
read -r ncount <<<"$(od -An -t u4 -j 8 -N 4 "$TMP/n_000000.bin")"
[ "$ncount" -eq $((jcount - 4)) ] && ok || bad "--no-eos: $ncount tokens, expected $((jcount - 4))"

# 3b. prepare again to the same prefix: the earlier run's outputs it does not replace are removed,
# so the new data set is read alone (a stale mask beside a text shard; stale shards past the last)
"$FM" prepare --tokenizer "$OLMOE" --input "$TMP/a.txt" --out "$TMP/j" > /dev/null 2>&1 && ok || bad "text prepare over JSONL"
[ ! -e "$TMP/j_000000.bin.mask" ] && "$FM" prepare --tokenizer "$OLMOE" --decode "$TMP/j_000000.bin" > /dev/null 2>&1 \
    && ok || bad "the JSONL run's mask was left beside the text shard"
"$FM" prepare --tokenizer "$OLMOE" --input "$TMP/a.txt" "$TMP/b.txt" --out "$TMP/s" > "$TMP/s2.log" 2>&1 \
    && grep -q "removed $((n_shards - 1)) shards of an earlier prepare" "$TMP/s2.log" && ok || bad "re-prepare: $(cat "$TMP/s2.log")"
[ "$(ls "$TMP" | grep -c '^s_')" -eq 2 ] && ok || bad "stale shards left: $(ls "$TMP" | grep '^s_')"

# 4. the other families: Qwen3 (NFC, its regex) reads back exactly; Mixtral (sentencepiece style)
printf 'Caf\xc3\xa9 na\xc3\xafve \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e text 123.\n' > "$TMP/u.txt"
"$FM" prepare --tokenizer "$TOK/qwen3" --input "$TMP/u.txt" --out "$TMP/q" --no-eos > /dev/null 2>&1 && ok || bad "qwen3 prepare"
"$FM" prepare --tokenizer "$TOK/qwen3" --decode "$TMP/q_000000.bin" > "$TMP/q.got" && cmp -s "$TMP/u.txt" "$TMP/q.got" \
    && ok || bad "qwen3 shard does not decode to the input"
printf 'Hello world, this is text.' > "$TMP/m.txt"
"$FM" prepare --tokenizer "$TOK/mixtral" --input "$TMP/m.txt" --out "$TMP/m" --no-eos > /dev/null 2>&1 && ok || bad "mixtral prepare"
"$FM" prepare --tokenizer "$TOK/mixtral" --decode "$TMP/m_000000.bin" > "$TMP/m.got" && cmp -s "$TMP/m.txt" "$TMP/m.got" \
    && ok || bad "mixtral shard does not decode to the input: $(cat "$TMP/m.got")"

# 5. bad inputs: a message naming the file (and line), non-zero exit, nothing left behind
printf '{"text": "fine"}\n{"text": "broken",\n' > "$TMP/bad.jsonl"
expect_fail "--decode of a missing shard" "--decode $TMP/none.bin: cannot open the shard" "$FM" prepare --tokenizer "$OLMOE" --decode "$TMP/none.bin"
expect_fail "malformed JSON line" "bad.jsonl:2: malformed JSON at column 18" "$FM" prepare --tokenizer "$OLMOE" --input "$TMP/bad.jsonl" --out "$TMP/x"
printf '{"text": "fine"}\n{"title": "no text"}\n' > "$TMP/keys.jsonl"
expect_fail "record with no known key" "keys.jsonl:2: a record with none of the known keys (found: title)" \
    "$FM" prepare --tokenizer "$OLMOE" --input "$TMP/keys.jsonl" --out "$TMP/x"
printf '{"prompt": "p"}\n' > "$TMP/half.jsonl"
expect_fail "prompt without completion" "half.jsonl:1: a prompt/completion record needs both" \
    "$FM" prepare --tokenizer "$OLMOE" --input "$TMP/half.jsonl" --out "$TMP/x"
# a failure after full shards were written leaves none of them
expect_fail "late error removes written shards" "bad.jsonl:2" \
    "$FM" prepare --tokenizer "$OLMOE" --input "$TMP/a.txt" "$TMP/bad.jsonl" --out "$TMP/x" --shard-tokens 100
[ -z "$(ls "$TMP" | grep '^x_')" ] && ok || bad "files left behind after an error: $(ls "$TMP" | grep '^x_')"
expect_fail "missing input" "nope.txt: cannot open input" "$FM" prepare --tokenizer "$OLMOE" --input "$TMP/nope.txt" --out "$TMP/x"
expect_fail "missing tokenizer" "nowhere" "$FM" prepare --tokenizer "$TMP/nowhere" --input "$TMP/a.txt" --out "$TMP/x"
echo '{"model": {"type": "WordPiece", "vocab": {}}}' > "$TMP/wp.json"
expect_fail "unsupported tokenizer model" 'model type "WordPiece"' "$FM" prepare --tokenizer "$TMP/wp.json" --input "$TMP/a.txt" --out "$TMP/x"
expect_fail "bad --format" "--format csv" "$FM" prepare --tokenizer "$OLMOE" --input "$TMP/a.txt" --out "$TMP/x" --format csv
: > "$TMP/empty.txt"
expect_fail "no text at all" "no tokens were made" "$FM" prepare --tokenizer "$OLMOE" --input "$TMP/empty.txt" --out "$TMP/x" --no-eos
[ -z "$(ls "$TMP" | grep '^x_')" ] && ok || bad "files left behind: $(ls "$TMP" | grep '^x_')"
# 6. train on a prepared shard, then sample and eval with the tokenizer (given, or the
#    checkpoint's tokenizer.json); sample refuses non-finite logits
sed 's/"vocab_size": 256/"vocab_size": 3072/' "$ROOT/tests/data/micro.json" > "$TMP/micro3072.json"
"$FM" prepare --tokenizer "$OLMOE" --input "$TMP/a.txt" --out "$TMP/one" > /dev/null 2>&1 && ok || bad "prepare of one file"
"$FM" train --config "$TMP/micro3072.json" --data "$TMP/one_000000.bin" --seq-len 16 --micro-batch 2 --steps 2 \
    --threads 2 --quiet --out "$TMP/run" > /dev/null 2>&1 && ok || bad "train on a prepared shard failed"
# a tokenizer far smaller than the model's vocabulary (3000 of 4096 ids) is not its own: refused
sed 's/"vocab_size": 256/"vocab_size": 4096/' "$ROOT/tests/data/micro.json" > "$TMP/micro4096.json"
"$FM" train --config "$TMP/micro4096.json" --data "$TMP/one_000000.bin" --seq-len 16 --micro-batch 2 --steps 1 \
    --threads 2 --quiet --out "$TMP/run4096" > /dev/null 2>&1 || bad "the vocab 4096 run failed"
expect_fail "tokenizer far smaller than the model" "has a vocabulary of 3000 but the model $TMP/run4096/step_000001/config.json has vocab_size 4096: 27% of the model's ids" \
    "$FM" sample --ckpt "$TMP/run4096" --tokenizer "$OLMOE" --prompt "ROMEO:" --max-new-tokens 2 --threads 2
ck="$TMP/run/step_000002"
"$FM" sample --ckpt "$TMP/run" --tokenizer "$OLMOE" --prompt "ROMEO:" --max-new-tokens 8 --temperature 0 --threads 2 \
    > "$TMP/s1.txt" 2>&1 && ok || bad "sample with --tokenizer: $(cat "$TMP/s1.txt")"
[ "$(head -c 6 "$TMP/s1.txt")" = "ROMEO:" ] && ok || bad "sample output does not start with the prompt: $(cat "$TMP/s1.txt")"
cp "$OLMOE/tokenizer.json" "$ck/"
"$FM" sample --ckpt "$TMP/run" --prompt "ROMEO:" --max-new-tokens 8 --temperature 0 --threads 2 > "$TMP/s2.txt" 2>&1
cmp -s "$TMP/s1.txt" "$TMP/s2.txt" && ok || bad "the checkpoint's tokenizer.json is not used: $(cat "$TMP/s2.txt")"
"$FM" eval --ckpt "$TMP/run" --data "$TMP/a.txt" --seq-len 16 --threads 2 > "$TMP/e1.txt" 2>&1 && ok || bad "eval on text with a tokenizer"
"$FM" eval --ckpt "$TMP/run" --data "$TMP/one_000000.bin" --seq-len 16 --threads 2 > "$TMP/e2.txt" 2>&1 && ok || bad "eval on the shard"
[ "$(grep '^loss' "$TMP/e1.txt")" = "$(grep '^loss' "$TMP/e2.txt")" ] && grep -q '^loss [0-9]' "$TMP/e1.txt" \
    && ok || bad "eval of the text (tokenized) and of its shard differ: $(grep '^loss' "$TMP/e1.txt") vs $(grep '^loss' "$TMP/e2.txt")"
# eval --data on chat JSONL (with the checkpoint's tokenizer): refused like train, the prepare command named
printf '{"messages": [{"role": "user", "content": "hi"}]}\n' > "$TMP/chat.jsonl"
expect_fail "eval on JSONL with a tokenizer" "looks like JSON/JSONL (it starts with '{'), not text" \
    "$FM" eval --ckpt "$TMP/run" --data "$TMP/chat.jsonl" --seq-len 16 --threads 2
expect_fail "eval on JSONL names prepare" "flatmoe prepare --tokenizer MODEL_DIR --input $TMP/chat.jsonl" \
    "$FM" eval --ckpt "$TMP/run" --data "$TMP/chat.jsonl" --seq-len 16 --threads 2
cp -r "$TMP/run" "$TMP/nan"
f="$TMP/nan/step_000002/model.safetensors"
head -c 4096 /dev/zero | tr '\0' '\377' | dd of="$f" bs=4096 seek=$(( $(stat -c %s "$f") / 4096 - 1 )) conv=notrunc 2>/dev/null
expect_fail "sample with NaN weights" "the checkpoint's weights are damaged or diverged" "$FM" sample --ckpt "$TMP/nan" --prompt "ROMEO:" --max-new-tokens 4 --threads 2
finish
