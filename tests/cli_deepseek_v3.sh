#!/usr/bin/env bash
# deepseek_v3 (DeepSeek-V3 / Kimi-K2 / Moonlight: glm4_moe's MoE block with multi-head latent
# attention, model/fm_mla.h) end to end on tests/data/deepseek_v3_tiny.json (3 layers, layer 0
# dense; q_lora_rank 24, kv_lora_rank 16, q/k head 12 + 8, v 16 padded to 20; YaRN with
# mscale_all_dim; interleaved RoPE; one MTP layer) and its q_lora_rank null twin: the loss falls;
# every arena's high-water mark is within 64 B of its planned bound and the bounds are `flatmoe
# plan`'s, plain and bounded (recompute with keep-attention, chunked MoE, linear CE); the checkpoint
# holds transformers' MLA names and shapes (q_a_proj, q_a_layernorm, q_b_proj or q_proj,
# kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj [H, heads x v_head_dim]) and no MTP layer,
# its config.json the file's own bytes; a resume continues bit for bit; a Hugging Face folder with
# an MTP layer's tensors loads and gives eval's loss; refusals name the field.
source "$(dirname "$0")/lib_cli.sh"
CFG="$ROOT/tests/data/deepseek_v3_tiny.json"
NOQ="$ROOT/tests/data/deepseek_v3_tiny_noq.json"
base=(--data "$TEXT" --seq-len 64 --micro-batch 2 --threads 2 --seed 3 --warmup 2 --lr 3e-3 --eval-every 10
      --eval-batches 1)

# check_memory and plan_same: tests/lib_cli.sh

for c in "$CFG" "$NOQ"; do
    n=$(basename "$c" .json)
    "$FM" train --config "$c" "${base[@]}" --steps 30 --report-memory --out "$TMP/$n" > "$TMP/$n.log" 2>&1 ||
        bad "$n: plain run failed: $(tail -3 "$TMP/$n.log")"
    check_memory "$n" "$TMP/$n.log"
    plan_same "$n" "$TMP/$n.log" "$c"
    python3 - "$TMP/$n/metrics.jsonl" <<'PY' && ok || bad "$n: the loss does not fall"
import json, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if r.get("type") == "step"]
first, last = steps[0]["loss"], steps[-1]["loss"]
print(f"deepseek_v3: loss {first:.4f} at step 1, {last:.4f} at step {steps[-1]['step']}")
assert last < first - 1.0, (first, last)
PY
    cmp -s "$c" "$TMP/$n/step_000030/config.json" && ok || bad "$n: the checkpoint's config.json is not the file as read"
done
bounded=(--recompute 0,1 --recompute-keep-attention --moe-chunk-tokens 48 --ce-block-tokens 64 --ce-block-vocab 64)
"$FM" train --config "$CFG" "${base[@]}" --steps 4 --report-memory "${bounded[@]}" --out "$TMP/bounded" > "$TMP/bounded.log" 2>&1 ||
    bad "bounded run failed: $(tail -3 "$TMP/bounded.log")"
check_memory bounded "$TMP/bounded.log"
plan_same bounded "$TMP/bounded.log" "$CFG" "${bounded[@]}"

ck="$TMP/deepseek_v3_tiny/step_000030"
python3 - "$ck/model.safetensors" "$TMP/deepseek_v3_tiny_noq/step_000030/model.safetensors" <<'PY' && ok || bad "the checkpoint's MLA tensors"
import json, struct, sys
def header(p):
    f = open(p, "rb"); return json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
h, q = header(sys.argv[1]), header(sys.argv[2])
for l in (0, 1, 2):
    a = f"model.layers.{l}.self_attn."
    assert h[a + "q_a_proj.weight"]["shape"] == [24, 64] and h[a + "q_a_layernorm.weight"]["shape"] == [24]
    assert h[a + "q_b_proj.weight"]["shape"] == [4 * 20, 24] and a + "q_proj.weight" not in h
    assert q[a + "q_proj.weight"]["shape"] == [4 * 20, 64] and a + "q_a_proj.weight" not in q
    for t in (h, q):
        assert t[a + "kv_a_proj_with_mqa.weight"]["shape"] == [16 + 8, 64]
        assert t[a + "kv_a_layernorm.weight"]["shape"] == [16]
        assert t[a + "kv_b_proj.weight"]["shape"] == [4 * (12 + 16), 16]
        assert t[a + "o_proj.weight"]["shape"] == [64, 4 * 16]
        assert not [k for k in t if k.startswith(a) and ("k_proj" in k or "v_proj" in k or k.endswith(".bias"))]
assert h["model.layers.1.mlp.gate.e_score_correction_bias"]["shape"] == [8]
assert h["model.layers.0.mlp.gate_proj.weight"]["shape"] == [96, 64]
assert not [k for k in h if k.startswith("model.layers.3.")], "an MTP layer was saved"
PY

# a resume continues bit for bit
"$FM" train --config "$CFG" "${base[@]}" --steps 6 --quiet --out "$TMP/straight" || bad "straight run failed"
"$FM" train --config "$CFG" "${base[@]}" --steps 6 --quiet --exit-after 3 --out "$TMP/split" || bad "split run failed"
"$FM" train --config "$CFG" "${base[@]}" --steps 6 --quiet --resume --out "$TMP/split" || bad "resume failed"
cmp -s "$TMP/straight/step_000006/model.safetensors" "$TMP/split/step_000006/model.safetensors" && ok || bad "resume: weights differ"

# a Hugging Face folder with the MTP layer's tensors (model.layers.3.*): skipped on load, eval's loss
mkdir -p "$TMP/hf"
cp "$CFG" "$TMP/hf/config.json"
python3 - "$ck/model.safetensors" "$TMP/hf/model.safetensors" <<'PY'
import json, struct, sys
b = open(sys.argv[1], "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n]); data = b[8 + n:]
end = max(v["data_offsets"][1] for k, v in h.items() if k != "__metadata__")
for name, shape in (("model.layers.3.eh_proj.weight", [64, 128]), ("model.layers.3.self_attn.kv_b_proj.weight", [112, 16])):
    size = 4 * shape[0] * shape[1]
    h[name] = {"dtype": "F32", "shape": shape, "data_offsets": [end, end + size]}
    data = data[:end] + bytes(size) + data[end:]; end += size
hb = json.dumps(h).encode(); hb += b" " * (-len(hb) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(hb)) + hb + data)
PY
head -c 65 "$TEXT" > "$TMP/one.txt"
one=(--data "$TMP/one.txt" --val-data "$TMP/one.txt" --seq-len 64 --micro-batch 1 --threads 2 --quiet)
"$FM" train --init-from "$TMP/hf" "${one[@]}" --steps 1 --out "$TMP/ft" 2> "$TMP/ft.err" || bad "--init-from a folder with an MTP layer failed"
a=$(grep -m1 '"step":1,' "$TMP/ft/metrics.jsonl" | sed -E 's/.*"loss":([^,]*).*/\1/')
e=$("$FM" eval --ckpt "$ck" --data "$TMP/one.txt" --seq-len 64 --micro-batch 1 --threads 2 | sed -n 's/^loss \([^ ]*\) .*/\1/p')
awk -v a="$a" -v b="$e" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && b != "" && d <= 1e-4) }' && ok ||
    bad "--init-from's step-1 loss ($a) is not eval's ($e)"

# refusals
mk() { python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); exec(sys.argv[3]); json.dump(c, open(sys.argv[2], "w"))' "$CFG" "$TMP/$1.json" "$2"; }
mk bias 'c["attention_bias"] = True'
expect_fail "attention_bias" "\"attention_bias\" is true" "$FM" train --config "$TMP/bias.json" --data "$TEXT" --steps 1 --out "$TMP/x1"
mk vdim 'c["v_head_dim"] = 24'
expect_fail "v_head_dim above the q/k head dim" "\"v_head_dim\" (24)" "$FM" train --config "$TMP/vdim.json" --data "$TEXT" --steps 1 --out "$TMP/x2"
mk hd 'c["head_dim"] = 20'
expect_fail "head_dim other than qk_rope_head_dim" "\"head_dim\" is 20" "$FM" train --config "$TMP/hd.json" --data "$TEXT" --steps 1 --out "$TMP/x3"
finish
