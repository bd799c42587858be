#!/usr/bin/env bash
# The attention parts of issue 26 end to end (docs/formats.md): qwen3_moe with q/k/v/o biases
# (attention_bias) and YaRN RoPE (rope_scaling, an original context of 32 under a 64-token
# sequence): training's loss falls; every arena's high-water mark equals its planned bound, as
# `flatmoe plan` prints them (plain, and recompute + chunked MoE + linear CE); the checkpoint holds
# the biases under Hugging Face's names and its config.json is the file as read, byte for byte; a
# resume continues bit for bit; a Hugging Face folder of it (bf16) loads with --init-from; other
# rope types are refused naming the supported ones.
source "$(dirname "$0")/lib_cli.sh"
FX=$(dirname "$FM")/fm_hf_fixture
python3 -c 'import json, sys; c = json.load(open(sys.argv[1]))
c.update(attention_bias=True, max_position_embeddings=128,
         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
json.dump(c, open(sys.argv[2], "w"), indent=1)' "$ROOT/configs/tiny.json" "$TMP/attn.json"
base=(--config "$TMP/attn.json" --data "$TEXT" --seq-len 64 --micro-batch 2 --threads 2 --seed 3 --warmup 2
      --lr 3e-3 --eval-every 10 --eval-batches 1)

"$FM" train "${base[@]}" --steps 30 --report-memory --out "$TMP/plain" > "$TMP/plain.log" 2>&1 || bad "plain run failed: $(tail -3 "$TMP/plain.log")"
check_memory plain "$TMP/plain.log"
plan_same plain "$TMP/plain.log" "$TMP/attn.json"
python3 - "$TMP/plain/metrics.jsonl" <<'PY' && ok || bad "the loss does not fall"
import json, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if r.get("type") == "step"]
first, last = steps[0]["loss"], steps[-1]["loss"]
print(f"biases + yarn: loss {first:.4f} at step 1, {last:.4f} at step {steps[-1]['step']}")
assert last < first - 1.0, (first, last)
PY
bounded=(--recompute 0,1 --moe-chunk-tokens 48 --ce-block-tokens 64 --ce-block-vocab 64)
"$FM" train "${base[@]}" --steps 4 --report-memory "${bounded[@]}" --out "$TMP/bounded" > "$TMP/bounded.log" 2>&1 || bad "bounded run failed: $(tail -3 "$TMP/bounded.log")"
check_memory bounded "$TMP/bounded.log"
plan_same bounded "$TMP/bounded.log" "$TMP/attn.json" "${bounded[@]}"

ck="$TMP/plain/step_000030"
python3 - "$ck/model.safetensors" <<'PY' && ok || bad "the checkpoint's bias tensors"
import json, struct, sys
f = open(sys.argv[1], "rb"); h = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
for l in range(4):
    for p, n in (("q", 128), ("k", 64), ("v", 64), ("o", 128)):
        assert h[f"model.layers.{l}.self_attn.{p}_proj.bias"]["shape"] == [n], (l, p)
PY
cmp -s "$TMP/attn.json" "$ck/config.json" && ok || bad "the checkpoint's config.json is not the file as read"
# resume: 2 + 2 steps = 4 straight, bit for bit
"$FM" train "${base[@]}" --steps 4 --quiet --out "$TMP/straight" || bad "straight run failed"
"$FM" train "${base[@]}" --steps 4 --quiet --exit-after 2 --out "$TMP/split" || bad "split run failed"
"$FM" train "${base[@]}" --steps 4 --quiet --resume --out "$TMP/split" || bad "resume failed"
cmp -s "$TMP/straight/step_000004/model.safetensors" "$TMP/split/step_000004/model.safetensors" && ok || bad "resume: weights differ"
# a Hugging Face folder (bf16): step 1's loss = eval of the folder
"$FX" "$ck" "$TMP/hf" --dtype bf16 || bad "fixture failed"
head -c 65 "$TEXT" > "$TMP/one.txt"
one=(--data "$TMP/one.txt" --val-data "$TMP/one.txt" --seq-len 64 --micro-batch 1 --threads 2 --quiet)
"$FM" train --init-from "$TMP/hf" "${one[@]}" --steps 1 --out "$TMP/ft" || bad "--init-from the folder failed"
a=$(grep -m1 '"step":1,' "$TMP/ft/metrics.jsonl" | sed -E 's/.*"loss":([^,]*).*/\1/')
b=$("$FM" eval --ckpt "$TMP/hf" --data "$TMP/one.txt" --seq-len 64 --micro-batch 1 --threads 2 | sed -n 's/^loss \([^ ]*\) .*/\1/p')
awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && b != "" && d <= 1e-4) }' && ok ||
    bad "--init-from: step-1 loss $a, eval of the folder $b"
# refused: another rope type, naming the supported ones
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
json.dump(c, open(sys.argv[2], "w"))' "$TMP/attn.json" "$TMP/llama3.json"
expect_fail "rope_type llama3" 'supports only "default", "linear" and "yarn"' "$FM" plan --config "$TMP/llama3.json" --seq-len 64
finish
