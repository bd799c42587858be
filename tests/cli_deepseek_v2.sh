#!/usr/bin/env bash
# deepseek_v2 (DeepSeek-V2 / V2-Lite / V2.5: deepseek_v3's multi-head latent attention and MoE layout
# with DeepSeek-V2's softmax router, model/fm_config_deepseek_v2.c) end to end on
# tests/data/deepseek_v2_tiny.json (group_limited_greedy: 4 groups of 2 keeping 2, k 3,
# routed_scaling_factor 16, q_lora_rank 24, 2 shared experts, layer 0 dense, YaRN with mscale_all_dim)
# and tests/data/deepseek_v2_lite_tiny.json (greedy, q_lora_rank null): the loss falls; every arena's
# high-water mark is within 64 B of its planned bound and the bounds are `flatmoe plan`'s; the
# checkpoint holds transformers' names and shapes (no e_score_correction_bias: the softmax router has
# no selection bias) and its config.json is the file's own bytes; a resume continues bit for bit; a
# Hugging Face folder in transformers 5's fused expert layout loads and gives eval's loss; refusals
# name the field or the flag.
source "$(dirname "$0")/lib_cli.sh"
CFG="$ROOT/tests/data/deepseek_v2_tiny.json"
LITE="$ROOT/tests/data/deepseek_v2_lite_tiny.json"
base=(--data "$TEXT" --seq-len 64 --micro-batch 2 --threads 2 --seed 3 --warmup 2 --lr 3e-3 --eval-every 10
      --eval-batches 1)

for c in "$CFG" "$LITE"; do
    n=$(basename "$c" .json)
    "$FM" train --config "$c" "${base[@]}" --steps 30 --report-memory --out "$TMP/$n" > "$TMP/$n.log" 2>&1 ||
        bad "$n: plain run failed: $(tail -3 "$TMP/$n.log")"
    check_memory "$n" "$TMP/$n.log"
    plan_same "$n" "$TMP/$n.log" "$c"
    python3 - "$TMP/$n/metrics.jsonl" <<'PY' && ok || bad "$n: the loss does not fall"
import json, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if r.get("type") == "step"]
first, last = steps[0]["loss"], steps[-1]["loss"]
print(f"deepseek_v2: loss {first:.4f} at step 1, {last:.4f} at step {steps[-1]['step']}")
assert last < first - 1.0, (first, last)
PY
    cmp -s "$c" "$TMP/$n/step_000030/config.json" && ok || bad "$n: the checkpoint's config.json is not the file as read"
done

python3 - "$TMP/deepseek_v2_tiny/step_000030/model.safetensors" "$TMP/deepseek_v2_lite_tiny/step_000030/model.safetensors" <<'PY' && ok || bad "the checkpoint's tensors"
import json, struct, sys
def header(p):
    f = open(p, "rb"); return json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
h, q = header(sys.argv[1]), header(sys.argv[2])
for l in (0, 1, 2):
    a = f"model.layers.{l}.self_attn."
    assert h[a + "q_a_proj.weight"]["shape"] == [24, 64] and h[a + "q_b_proj.weight"]["shape"] == [4 * 20, 24]
    assert q[a + "q_proj.weight"]["shape"] == [4 * 20, 64] and a + "q_a_proj.weight" not in q
    for t in (h, q):
        assert t[a + "kv_a_proj_with_mqa.weight"]["shape"] == [16 + 8, 64]
        assert t[a + "kv_b_proj.weight"]["shape"] == [4 * (12 + 16), 16]
        assert t[a + "o_proj.weight"]["shape"] == [64, 4 * 16]
for t in (h, q):
    assert t["model.layers.0.mlp.gate_proj.weight"]["shape"] == [96, 64]
    for l in (1, 2):
        m = f"model.layers.{l}.mlp."
        assert t[m + "gate.weight"]["shape"] == [8, 64]
        assert t[m + "shared_experts.gate_proj.weight"]["shape"] == [2 * 32, 64]
        assert t[m + "experts.7.down_proj.weight"]["shape"] == [64, 32]
    assert not [k for k in t if "e_score_correction_bias" in k], "a selection bias was saved"
PY

# a resume continues bit for bit
"$FM" train --config "$CFG" "${base[@]}" --steps 6 --quiet --out "$TMP/straight" || bad "straight run failed"
"$FM" train --config "$CFG" "${base[@]}" --steps 6 --quiet --exit-after 3 --out "$TMP/split" || bad "split run failed"
"$FM" train --config "$CFG" "${base[@]}" --steps 6 --quiet --resume --out "$TMP/split" || bad "resume failed"
cmp -s "$TMP/straight/step_000006/model.safetensors" "$TMP/split/step_000006/model.safetensors" && ok || bad "resume: weights differ"

# transformers 5's layout (DeepseekV2Experts: mlp.experts.gate_up_proj [E, 2I, H], gate rows first,
# and down_proj [E, H, I]) in a Hugging Face folder: --init-from's step-1 loss is eval's of the checkpoint
ck="$TMP/deepseek_v2_tiny/step_000030"
mkdir -p "$TMP/hf"
cp "$CFG" "$TMP/hf/config.json"
python3 - "$ck/model.safetensors" "$TMP/hf/model.safetensors" <<'PY' || bad "fusing the experts failed"
import json, re, struct, sys
b = open(sys.argv[1], "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n]); data = b[8 + n:]
def raw(k): o = h[k]["data_offsets"]; return data[o[0]:o[1]]
out, blobs, off = {}, [], 0
def put(name, shape, blob):
    global off
    out[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(blob)]}; blobs.append(blob); off += len(blob)
for k in sorted(h):
    if k == "__metadata__" or ".experts." in k: continue
    put(k, h[k]["shape"], raw(k))
for l in (1, 2):
    m = f"model.layers.{l}.mlp.experts."
    put(m + "gate_up_proj", [8, 64, 64], b"".join(raw(f"{m}{e}.gate_proj.weight") + raw(f"{m}{e}.up_proj.weight") for e in range(8)))
    put(m + "down_proj", [8, 64, 32], b"".join(raw(f"{m}{e}.down_proj.weight") for e in range(8)))
hb = json.dumps(out).encode(); hb += b" " * (-len(hb) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))
PY
head -c 65 "$TEXT" > "$TMP/one.txt"
one=(--data "$TMP/one.txt" --val-data "$TMP/one.txt" --seq-len 64 --micro-batch 1 --threads 2 --quiet)
"$FM" train --init-from "$TMP/hf" "${one[@]}" --steps 1 --out "$TMP/ft" 2> "$TMP/ft.err" || bad "--init-from the fused layout failed: $(tail -2 "$TMP/ft.err")"
a=$(grep -m1 '"step":1,' "$TMP/ft/metrics.jsonl" | sed -E 's/.*"loss":([^,]*).*/\1/')
e=$("$FM" eval --ckpt "$ck" --data "$TMP/one.txt" --seq-len 64 --micro-batch 1 --threads 2 | sed -n 's/^loss \([^ ]*\) .*/\1/p')
awk -v a="$a" -v b="$e" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && b != "" && d <= 1e-4) }' && ok ||
    bad "--init-from the fused layout: step-1 loss ($a) is not eval's ($e)"

# refusals
mk() { python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); exec(sys.argv[3]); json.dump(c, open(sys.argv[2], "w"))' "$CFG" "$TMP/$1.json" "$2"; }
mk noaux 'c["topk_method"] = "noaux_tc"'
expect_fail "topk_method noaux_tc" "\"noaux_tc\"" "$FM" train --config "$TMP/noaux.json" --data "$TEXT" --steps 1 --out "$TMP/x1"
mk nok 'del c["num_experts_per_tok"]'
expect_fail "num_experts_per_tok absent" "\"num_experts_per_tok\" is absent" "$FM" train --config "$TMP/nok.json" --data "$TEXT" --steps 1 --out "$TMP/x2"
mk freq 'c["moe_layer_freq"] = 2'
expect_fail "moe_layer_freq 2" "\"moe_layer_freq\" is 2" "$FM" train --config "$TMP/freq.json" --data "$TEXT" --steps 1 --out "$TMP/x3"
expect_fail "--moe-seq-aux-loss-coeff" "--moe-seq-aux-loss-coeff" "$FM" train --config "$CFG" --data "$TEXT" --steps 1 --moe-seq-aux-loss-coeff 1e-4 --out "$TMP/x4"
expect_fail "--moe-router-bias-update-rate" "--moe-router-bias-update-rate" "$FM" train --config "$CFG" --data "$TEXT" --steps 1 --moe-router-bias-update-rate 1e-3 --out "$TMP/x5"
finish
