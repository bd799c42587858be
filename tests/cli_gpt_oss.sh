#!/usr/bin/env bash
# gpt_oss (transformers' GptOssForCausalLM) end to end on tests/data/gpt_oss_tiny.json (3 layers:
# sliding, full, sliding with a window of 16 keys at 64-token sequences; attention sinks; q/k/v/o
# biases; the router's Linear bias; the experts' biases and the clamped SwiGLU; YaRN): the loss
# falls; every arena's high-water mark equals its planned bound, plain and bounded (recompute,
# chunked MoE, linear CE), as `flatmoe plan` prints them; the checkpoint holds the sinks, the router
# bias and the experts' biases under their names, its config.json the file's own bytes; a resume
# continues bit for bit; eval reads the checkpoint; and --expert-precision fp8 is refused with
# its message.
source "$(dirname "$0")/lib_cli.sh"
CFG="$ROOT/tests/data/gpt_oss_tiny.json"
base=(--config "$CFG" --data "$TEXT" --seq-len 64 --micro-batch 2 --threads 2 --seed 3 --warmup 2 --lr 3e-3
      --eval-every 10 --eval-batches 1)

# check_memory and plan_same: tests/lib_cli.sh

"$FM" train "${base[@]}" --steps 30 --report-memory --out "$TMP/plain" > "$TMP/plain.log" 2>&1 || bad "plain run failed: $(tail -3 "$TMP/plain.log")"
check_memory plain "$TMP/plain.log"
plan_same plain "$TMP/plain.log" "$CFG"
python3 - "$TMP/plain/metrics.jsonl" <<'PY' && ok || bad "the loss does not fall"
import json, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if r.get("type") == "step"]
first, last = steps[0]["loss"], steps[-1]["loss"]
print(f"gpt_oss: loss {first:.4f} at step 1, {last:.4f} at step {steps[-1]['step']}")
assert last < first - 1.0, (first, last)
PY
bounded=(--recompute 0,1 --moe-chunk-tokens 48 --ce-block-tokens 64 --ce-block-vocab 64)
"$FM" train "${base[@]}" --steps 4 --report-memory "${bounded[@]}" --out "$TMP/bounded" > "$TMP/bounded.log" 2>&1 || bad "bounded run failed: $(tail -3 "$TMP/bounded.log")"
check_memory bounded "$TMP/bounded.log"
plan_same bounded "$TMP/bounded.log" "$CFG" "${bounded[@]}"

ck="$TMP/plain/step_000030"
python3 - "$ck/model.safetensors" <<'PY' && ok || bad "the checkpoint's gpt_oss tensors"
import json, struct, sys
f = open(sys.argv[1], "rb"); h = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
for l in (0, 1, 2):
    assert h[f"model.layers.{l}.self_attn.sinks"]["shape"] == [4]
    assert h[f"model.layers.{l}.self_attn.o_proj.bias"]["shape"] == [64]
    assert h[f"model.layers.{l}.mlp.router.weight"]["shape"] == [8, 64]
    assert h[f"model.layers.{l}.mlp.router.bias"]["shape"] == [8]
    assert h[f"model.layers.{l}.mlp.experts.7.gate_proj.bias"]["shape"] == [48]
    assert h[f"model.layers.{l}.mlp.experts.7.down_proj.bias"]["shape"] == [64]
    assert f"model.layers.{l}.mlp.gate.weight" not in h
PY
cmp -s "$CFG" "$ck/config.json" && ok || bad "the checkpoint's config.json is not the file as read"
e=$("$FM" eval --ckpt "$ck" --data "$TEXT" --seq-len 64 --micro-batch 1 --threads 2 --max-batches 2 2>&1 | sed -n 's/^loss \([^ ]*\) .*/\1/p')
[ -n "$e" ] && ok || bad "eval of the checkpoint printed no loss"

# a resume continues bit for bit
"$FM" train "${base[@]}" --steps 6 --quiet --out "$TMP/straight" || bad "straight run failed"
"$FM" train "${base[@]}" --steps 6 --quiet --exit-after 3 --out "$TMP/split" || bad "split run failed"
"$FM" train "${base[@]}" --steps 6 --quiet --resume --out "$TMP/split" || bad "resume failed"
cmp -s "$TMP/straight/step_000006/model.safetensors" "$TMP/split/step_000006/model.safetensors" && ok || bad "resume: weights differ"

# refusals
expect_fail "fp8 experts" "--expert-precision bf16" "$FM" train "${base[@]}" --steps 1 --expert-precision fp8 --out "$TMP/x1"
finish
