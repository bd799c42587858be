#!/usr/bin/env python3
"""Writes the seed corpora of fuzz/corpus/<target>/ (small files, committed; run again only to
change them): python3 fuzz/make_corpus.py. Each seed is a valid input of its harness's framing
(fuzz/fm_fuzz.h fuzz_take: a 4-byte little-endian length, then the bytes), so the fuzzer starts
inside the parsers' accepting paths and mutates out of them."""
import json, os, shutil, struct, sys

ROOT = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(ROOT, "corpus")


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def piece(b):
    return struct.pack("<I", len(b)) + b


# ---- config.json: the tree's small configs and each family's fields
for src in ["configs/tiny.json", "tests/data/micro.json", "tests/data/micro_sp.json"]:
    put("config", os.path.basename(src), open(os.path.join(ROOT, "..", src), "rb").read())
base = {"vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 64, "num_experts_per_tok": 2}
put("config", "qwen3.json", json.dumps(dict(base, model_type="qwen3_moe", moe_intermediate_size=16, num_experts=4,
                                            head_dim=16, rope_theta=1e6, norm_topk_prob=True, decoder_sparse_step=1,
                                            mlp_only_layers=[], rms_norm_eps=1e-6)))
put("config", "mixtral.json", json.dumps(dict(base, model_type="mixtral", intermediate_size=16, num_local_experts=4,
                                              sliding_window=None, rope_theta=1e6, tie_word_embeddings=False)))
put("config", "olmoe_v5.json", json.dumps(dict(base, model_type="olmoe", intermediate_size=16, num_experts=4,
                                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                               router_aux_loss_coef=0.01, hidden_act="silu")))

# ---- safetensors: F32, BF16, F16, F64, I32 tensors, metadata, a scalar
def safetensors(tensors, meta=None):
    hdr, data = {}, b""
    if meta is not None:
        hdr["__metadata__"] = meta
    for name, dtype, shape, raw in tensors:
        hdr[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data

f32 = struct.pack("<6f", 1, -2, 3.5, 0, 1e-3, 65504)
put("safetensors", "f32.safetensors", safetensors([("w", "F32", [2, 3], f32)], {"format": "pt"}))
put("safetensors", "mixed.safetensors", safetensors([
    ("a.bf16", "BF16", [4], struct.pack("<4H", 0x3F80, 0xC000, 0x7F80, 0x0001)),
    ("b.f16", "F16", [2, 2], struct.pack("<4H", 0x3C00, 0xC000, 0x7C00, 0x0001)),
    ("c.f64", "F64", [2], struct.pack("<2d", 1e300, -0.5)),
    ("d.i32", "I32", [3], struct.pack("<3i", 1, -1, 7)),
    ("e.scalar", "F32", [], struct.pack("<f", 2.0)),
    ("f.empty", "F32", [0, 4], b"")]))

# ---- data: byte 0 layout (0 text, 1 shard, 2 shard + mask, 3 Megatron, 4 Megatron + mask), byte 1 vocab
def shard(tokens, version):
    magic = 20240520 if version == 1 else 20240801
    hdr = struct.pack("<3i", magic, version, len(tokens)) + b"\0" * (1024 - 12)
    return hdr + struct.pack("<%d%s" % (len(tokens), "H" if version == 1 else "I"), *tokens)

def mask(bits):
    return b"FMMASK01" + struct.pack("<Q", len(bits)) + bytes(bits)

def megatron(seqs, code=8, doc_idx=None):
    fmt = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 8: "H"}[code]
    es = struct.calcsize(fmt)
    sizes, ptrs, at = [], [], 0
    for s in seqs:
        sizes.append(len(s)); ptrs.append(at); at += len(s) * es
    docs = list(range(len(seqs) + 1)) if doc_idx is None else doc_idx
    idx = b"MMIDIDX\0\0" + struct.pack("<Q", 1) + bytes([code]) + struct.pack("<QQ", len(seqs), len(docs))
    idx += struct.pack("<%di" % len(seqs), *sizes) + struct.pack("<%dq" % len(seqs), *ptrs)
    idx += struct.pack("<%dq" % len(docs), *docs)
    binf = b"".join(struct.pack("<%d%s" % (len(s), fmt), *s) for s in seqs)
    return idx, binf

toks = [1, 2, 3, 250, 0, 17, 42, 99]
put("data", "text", bytes([0, 0]) + piece(b"To be, or not to be: that is the question.\n"))
put("data", "shard_v1", bytes([1, 2]) + piece(shard(toks, 1)))
put("data", "shard_v7", bytes([1, 4]) + piece(shard(toks, 7)))
put("data", "shard_mask", bytes([2, 0]) + piece(shard(toks, 7)) + piece(mask([0, 0, 1, 1, 1, 0, 1, 1])))
idx, binf = megatron([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
put("data", "megatron_u16", bytes([3, 2]) + piece(idx) + piece(binf))
idx, binf = megatron([[1, 2, 3], [4, 5]], code=4)
put("data", "megatron_i32_mask", bytes([4, 2]) + piece(idx) + piece(binf) + piece(mask([1, 0, 1, 1, 0])))

# ---- tokenizer: (tokenizer.json as a piece) + the text
def gpt2_chars():
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, k = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + k); k += 1
    return out

g = gpt2_chars()
bl_vocab = {g[b]: b for b in range(256)}
bl_vocab.update({"Ġt": 256, "he": 257, "Ġthe": 258})
bytelevel = {"added_tokens": [{"id": 259, "content": "<|endoftext|>", "special": True}],
             "normalizer": None,
             "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
             "decoder": {"type": "ByteLevel"},
             "model": {"type": "BPE", "vocab": bl_vocab, "merges": ["Ġ t", "h e", "Ġt he"]}}
sp_vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
sp_vocab.update({"<0x%02X>" % b: 3 + b for b in range(256)})
sp_vocab.update({"▁": 259, "a": 260, "b": 261, "▁a": 262, "ab": 263})
sentencepiece = {"added_tokens": [{"id": 1, "content": "<s>", "special": True}, {"id": 2, "content": "</s>", "special": True}],
                 "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                                    {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
                 "pre_tokenizer": None,
                 "decoder": {"type": "Sequence", "decoders": [
                     {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
                     {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
                 "model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": True, "fuse_unk": True,
                           "vocab": sp_vocab, "merges": ["▁ a", "a b"]}}
split = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
             {"type": "Split", "pattern": {"Regex": "\\s+|[0-9]"}, "behavior": "Isolated", "invert": False},
             {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}]},
         "normalizer": {"type": "NFC"},
         "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "▁": 2, "1": 3, " ": 4, "ab": 5}, "merges": [["a", "b"]],
                   "ignore_merges": True}}
noids = {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}
for name, tok, text in [("bytelevel", bytelevel, "the cat<|endoftext|> Ġthe\xff"),
                        ("sentencepiece", sentencepiece, "ab a\u00e9 b</s>"),
                        ("split", split, "ab  1 a\u0301b"), ("noids", noids, "aza")]:
    put("tokenizer", name, piece(json.dumps(tok).encode()) + text.encode("utf-8", "surrogatepass"))

# ---- prepare: byte 0 shard size, byte 1 flags, then JSONL
put("prepare", "text", bytes([7, 0]) + b'{"text": "abc the"}\n\n{"text": "ab\\u00e9"}\n')
put("prepare", "completion", bytes([3, 0]) + b'{"prompt": "th", "completion": "abc"}\n')
put("prepare", "chat", bytes([63, 1]) + json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "ab"}]}).encode() + b"\n")

# ---- state.json (as flatmoe writes it, with its run spec) and a bare spec object
spec = {"config": "configs/tiny.json", "data": ["a.txt", "b.txt"], "seq-len": 64, "micro-batch": 8, "steps": 100,
        "lr": 0.001, "recompute": "full", "bf16-moments": True, "expert-precision": "fp8", "seed": "42"}
state = {"step": 50, "optimizer_step": 50, "tokens_seen": 25600, "data_rng_state": "0123456789abcdef", "seed": "1337",
         "seq_len": 64, "micro_batch": 8, "grad_accum": 1, "steps": 100, "threads": 2,
         "schedule": {"lr": 0.001, "min_lr": 0.0001, "warmup": 50}, "adam_moments": "fp32", "expert_precision": "bf16",
         "data_cursor": {"rng_state": "0123456789abcdef", "rank": 0, "world": 1, "train_tokens": 1000000},
         "data_parallel": 1, "spec": spec, "format": "flatmoe-state-1"}
put("state", "state.json", json.dumps(state, indent=1))
put("state", "spec.json", json.dumps(spec))
# ---- pack: 12 bytes (layout, vocab, T - 1, rows - 1, flags, seed[4], seek epoch/document/position),
# then the shard or .idx, the .docs or .bin, the mask
def docs_index(starts, n_tokens):
    return b"FMDOCS01" + struct.pack("<QQ", n_tokens, len(starts)) + struct.pack("<%dQ" % len(starts), *starts)

def pack_head(layout, T, rows, flags, seek=(0, 0, 0)):
    return bytes([layout, 0, T - 1, rows - 1, flags, 7, 0, 0, 0]) + bytes(seek)

ptoks = [5, 6, 7, 8, 9, 1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
pstarts = [0, 5, 9, 10]  # documents of 5, 4, 1 (no training position) and 10 tokens
put("pack", "shard_docs", pack_head(0, 10, 2, 0) + piece(shard(ptoks, 7)) + piece(docs_index(pstarts, len(ptoks))))
put("pack", "shard_docs_refuse_long", pack_head(0, 8, 2, 0) + piece(shard(ptoks, 7)) + piece(docs_index(pstarts, len(ptoks))))
put("pack", "shard_docs_split_long", pack_head(0, 4, 3, 2) + piece(shard(ptoks, 1)) + piece(docs_index(pstarts, len(ptoks))))
put("pack", "shard_docs_mask_pad", pack_head(1, 12, 2, 1 | 16, (1, 2, 3)) + piece(shard(ptoks, 7))
    + piece(docs_index(pstarts, len(ptoks))) + piece(mask([i % 3 != 0 for i in range(len(ptoks))])))
put("pack", "shard_docs_two_parts_split", pack_head(0, 16, 4, 4 | 32) + piece(shard(ptoks, 7))
    + piece(docs_index(pstarts, len(ptoks))))
idx, binf = megatron([[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]], doc_idx=[0, 2, 2, 4, 5])
put("pack", "megatron_docs", pack_head(2, 6, 2, 0) + piece(idx) + piece(binf))
idx, binf = megatron([[1, 2, 3], [4, 5], [6, 7, 8, 9]], code=4, doc_idx=[0, 1, 3])
put("pack", "megatron_docs_mask", pack_head(3, 4, 2, 2 | 4 | 8) + piece(idx) + piece(binf) + piece(mask([1, 0, 1, 1, 0, 1, 1, 1, 1])))

# ---- rlbatch: a 16-byte header (B - 1, T - 1, V - 1, flags, n_tokens mode, delta, n_seqs mode,
# loss + 1, agg + 1, kl + 1, five indexes into the harness's table of spec values, entropy off),
# then tokens (byte - 2), sequence lengths (byte - 1), the loss mask, the floats (logp, A, old,
# rollout, ref per token)
def rl(B, T, V, flags, toks, lens, mask_, loss=0, agg=0, kl=0, clips=(1, 1, 0, 0, 0), floats=None):
    h = bytes([B - 1, T - 1, V - 1, flags, 0, 0, 0, loss + 1, agg + 1, kl + 1]) + bytes(clips) + bytes([0])
    if floats is None:
        floats = []
        for t in range(len(toks)):
            floats += [-0.5 - 0.1 * (t % 7), 1.0 if t % 2 else -1.0, -0.6, -0.55, -0.7]
    return (piece(h) + piece(bytes(x + 2 for x in toks)) + piece(bytes(l + 1 for l in lens)) + piece(bytes(mask_))
            + piece(struct.pack("<%df" % len(floats), *floats)))

rtoks = [3, 9, 4, 1, 7, 7, 2, 0, 5, 6, 8]
put("rlbatch", "sft", rl(2, 8, 16, 0, rtoks, [4, 3, 4], [0, 0, 1, 1, 0, 1, 1, 0, 0, 1, 1]))
put("rlbatch", "sft_all_targets_no_mask", rl(2, 8, 16, 1 | 8, rtoks, [4, 3, 4], []))
put("rlbatch", "grpo", rl(3, 6, 12, 0, rtoks, [5, 6], [0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1], loss=1, agg=2, kl=2,
                           clips=(1, 2, 4, 5, 1)))
put("rlbatch", "ppo_dual_k1_tokensum", rl(4, 4, 10, 0, rtoks, [2, 2, 3, 4], [1] * 11, loss=1, agg=1, kl=1,
                                          clips=(1, 1, 4, 0, 3)))
put("rlbatch", "refused_over_budget", rl(1, 4, 16, 0, rtoks, [4, 3, 4], [1] * 11))
print("wrote", OUT)
