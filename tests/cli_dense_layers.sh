#!/usr/bin/env bash
# qwen3_moe with dense layers (decoder_sparse_step 2, mlp_only_layers [0]: layers 0 and 2 a dense
# SwiGLU MLP of intermediate_size, 1 and 3 MoE) end to end: training's loss falls; every arena's
# high-water mark equals its planned bound (plain, and recompute + chunked MoE + linear CE), as
# `flatmoe plan` prints them; metrics' expert load lists the MoE layers only; the checkpoint
# holds model.layers.N.mlp.{gate,up,down}_proj.weight and no router there; a resume continues
# bit for bit; a Hugging Face folder of it (bf16, fused experts) loads with --init-from.
source "$(dirname "$0")/lib_cli.sh"
FX=$(dirname "$FM")/fm_hf_fixture
python3 -c 'import json, sys; c = json.load(open(sys.argv[1]))
c.update(decoder_sparse_step=2, mlp_only_layers=[0], intermediate_size=96)
json.dump(c, open(sys.argv[2], "w"), indent=1)' "$ROOT/configs/tiny.json" "$TMP/dense.json"
base=(--config "$TMP/dense.json" --data "$TEXT" --seq-len 64 --micro-batch 2 --threads 2 --seed 3 --warmup 2
      --lr 3e-3 --eval-every 10 --eval-batches 1)

"$FM" train "${base[@]}" --steps 30 --report-memory --out "$TMP/plain" > "$TMP/plain.log" 2>&1 || bad "plain run failed: $(tail -3 "$TMP/plain.log")"
check_memory plain "$TMP/plain.log"
plan_same plain "$TMP/plain.log" "$TMP/dense.json"
python3 - "$TMP/plain/metrics.jsonl" <<'PY' && ok || bad "the loss does not fall, or the expert load lists dense layers"
import json, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if r.get("type") == "step"]
first, last = steps[0]["loss"], steps[-1]["loss"]
print(f"dense layers: loss {first:.4f} at step 1, {last:.4f} at step {steps[-1]['step']}")
assert last < first - 1.0, (first, last)
assert all(len(r["expert_load_max_mean"]) == 2 for r in steps)  # layers 1 and 3
PY
bounded=(--recompute 0,1 --moe-chunk-tokens 48 --ce-block-tokens 64 --ce-block-vocab 64)
"$FM" train "${base[@]}" --steps 4 --report-memory "${bounded[@]}" --out "$TMP/bounded" > "$TMP/bounded.log" 2>&1 || bad "bounded run failed: $(tail -3 "$TMP/bounded.log")"
check_memory bounded "$TMP/bounded.log"
plan_same bounded "$TMP/bounded.log" "$TMP/dense.json" "${bounded[@]}"

ck="$TMP/plain/step_000030"
python3 - "$ck/model.safetensors" <<'PY' && ok || bad "the checkpoint's dense-layer tensors"
import json, struct, sys
f = open(sys.argv[1], "rb"); h = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
for l in (0, 2):
    assert h[f"model.layers.{l}.mlp.gate_proj.weight"]["shape"] == [96, 128]
    assert h[f"model.layers.{l}.mlp.down_proj.weight"]["shape"] == [128, 96]
    assert f"model.layers.{l}.mlp.gate.weight" not in h and f"model.layers.{l}.mlp.experts.0.up_proj.weight" not in h
for l in (1, 3):
    assert h[f"model.layers.{l}.mlp.gate.weight"]["shape"] == [8, 128] and f"model.layers.{l}.mlp.gate_proj.weight" not in h
PY
# resume: 2 + 2 steps = 4 straight, bit for bit
"$FM" train "${base[@]}" --steps 4 --quiet --out "$TMP/straight" || bad "straight run failed"
"$FM" train "${base[@]}" --steps 4 --quiet --exit-after 2 --out "$TMP/split" || bad "split run failed"
"$FM" train "${base[@]}" --steps 4 --quiet --resume --out "$TMP/split" || bad "resume failed"
cmp -s "$TMP/straight/step_000004/model.safetensors" "$TMP/split/step_000004/model.safetensors" && ok || bad "resume: weights differ"
# a Hugging Face folder (bf16, experts fused as transformers 5 saves them): step 1's loss = eval
"$FX" "$ck" "$TMP/hf" --dtype bf16 --fuse || bad "fixture failed"
head -c 65 "$TEXT" > "$TMP/one.txt"
one=(--data "$TMP/one.txt" --val-data "$TMP/one.txt" --seq-len 64 --micro-batch 1 --threads 2 --quiet)
"$FM" train --init-from "$TMP/hf" "${one[@]}" --steps 1 --out "$TMP/ft" || bad "--init-from the folder failed"
a=$(grep -m1 '"step":1,' "$TMP/ft/metrics.jsonl" | sed -E 's/.*"loss":([^,]*).*/\1/')
b=$("$FM" eval --ckpt "$TMP/hf" --data "$TMP/one.txt" --seq-len 64 --micro-batch 1 --threads 2 | sed -n 's/^loss \([^ ]*\) .*/\1/p')
awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && b != "" && d <= 1e-4) }' && ok ||
    bad "--init-from: step-1 loss $a, eval of the folder $b"
finish
