#!/usr/bin/env bash
# glm4_moe (GLM-4.5's Glm4MoeForCausalLM: DeepSeek-V3's sigmoid router with e_score_correction_bias
# and groups, a shared expert beside the routed ones, first_k_dense_replace dense layers) end to
# end on tests/data/glm4_tiny.json (3 layers, layer 0 dense; 8 experts in 4 groups keeping 2, top-2;
# routed_scaling_factor 2.5; use_qk_norm; GLM-4.5's partial rotary 0.5 and q/k/v biases; one MTP
# layer): the loss falls; every arena's high-water
# mark equals its planned bound, plain and bounded (recompute, chunked MoE, linear CE), as `flatmoe
# plan` prints them; the checkpoint holds the Hugging Face names (mlp.gate.e_score_correction_bias,
# mlp.shared_experts.*, the dense layer's mlp.*_proj) and no MTP layer, its config.json the file's
# own bytes; --moe-router-bias-update-rate moves the bias (0 leaves it at zero) and a resume
# continues bit for bit; a Hugging Face folder with an MTP layer's tensors loads (they are skipped,
# as transformers skips them) and gives eval's loss; and what flatmoe refuses, with its message.
source "$(dirname "$0")/lib_cli.sh"
CFG="$ROOT/tests/data/glm4_tiny.json"
base=(--config "$CFG" --data "$TEXT" --seq-len 64 --micro-batch 2 --threads 2 --seed 3 --warmup 2 --lr 3e-3
      --eval-every 10 --eval-batches 1)

bias_of() { # SAFETENSORS: the biases of layers 1 and 2, one line
    python3 - "$1" <<'PY'
import json, struct, sys
f = open(sys.argv[1], "rb"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n))
for l in (1, 2):
    a, b = h[f"model.layers.{l}.mlp.gate.e_score_correction_bias"]["data_offsets"]; f.seek(8 + n + a)
    print(" ".join(f"{x:.6g}" for x in struct.unpack(f"<{(b - a) // 4}f", f.read(b - a))), end=" ")
PY
}

"$FM" train "${base[@]}" --steps 30 --report-memory --out "$TMP/plain" > "$TMP/plain.log" 2>&1 || bad "plain run failed: $(tail -3 "$TMP/plain.log")"
check_memory plain "$TMP/plain.log"
plan_same plain "$TMP/plain.log" "$CFG"
python3 - "$TMP/plain/metrics.jsonl" <<'PY' && ok || bad "the loss does not fall, or the expert load lists the dense layer"
import json, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if r.get("type") == "step"]
first, last = steps[0]["loss"], steps[-1]["loss"]
print(f"glm4_moe: loss {first:.4f} at step 1, {last:.4f} at step {steps[-1]['step']}")
assert last < first - 1.0, (first, last)
assert all(len(r["expert_load_max_mean"]) == 2 for r in steps)  # layers 1 and 2
PY
bounded=(--recompute 0,1 --moe-chunk-tokens 48 --ce-block-tokens 64 --ce-block-vocab 64)
"$FM" train "${base[@]}" --steps 4 --report-memory "${bounded[@]}" --out "$TMP/bounded" > "$TMP/bounded.log" 2>&1 || bad "bounded run failed: $(tail -3 "$TMP/bounded.log")"
check_memory bounded "$TMP/bounded.log"
plan_same bounded "$TMP/bounded.log" "$CFG" "${bounded[@]}"

ck="$TMP/plain/step_000030"
python3 - "$ck/model.safetensors" <<'PY' && ok || bad "the checkpoint's glm4_moe tensors"
import json, struct, sys
f = open(sys.argv[1], "rb"); h = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
assert h["model.layers.0.mlp.gate_proj.weight"]["shape"] == [96, 64] and "model.layers.0.mlp.gate.weight" not in h
for l in (1, 2):
    assert h[f"model.layers.{l}.mlp.gate.weight"]["shape"] == [8, 64]
    assert h[f"model.layers.{l}.mlp.gate.e_score_correction_bias"] == {**h[f"model.layers.{l}.mlp.gate.e_score_correction_bias"], "dtype": "F32", "shape": [8]}
    assert h[f"model.layers.{l}.mlp.shared_experts.gate_proj.weight"]["shape"] == [32, 64]
    assert h[f"model.layers.{l}.mlp.shared_experts.down_proj.weight"]["shape"] == [64, 32]
    assert h[f"model.layers.{l}.mlp.experts.7.down_proj.weight"]["shape"] == [64, 32]
    assert h[f"model.layers.{l}.self_attn.q_norm.weight"]["shape"] == [16]
for l in (0, 1, 2):  # Glm4MoeAttention: q, k, v biased (attention_bias), o_proj never
    assert h[f"model.layers.{l}.self_attn.q_proj.bias"]["shape"] == [64]
    assert h[f"model.layers.{l}.self_attn.k_proj.bias"]["shape"] == [32]
    assert h[f"model.layers.{l}.self_attn.v_proj.bias"]["shape"] == [32]
    assert f"model.layers.{l}.self_attn.o_proj.bias" not in h
assert not [k for k in h if k.startswith("model.layers.3.")], "an MTP layer was saved"
PY
cmp -s "$CFG" "$ck/config.json" && ok || bad "the checkpoint's config.json is not the file as read"
[ "$(bias_of "$ck/model.safetensors")" = "0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 " ] && ok || bad "rate 0 moved the bias: $(bias_of "$ck/model.safetensors")"

# --moe-router-bias-update-rate: the bias moves by multiples of the rate; a resume continues bit for bit
rate=(--moe-router-bias-update-rate 0.01)
"$FM" train "${base[@]}" "${rate[@]}" --steps 6 --quiet --out "$TMP/straight" || bad "straight run failed"
"$FM" train "${base[@]}" "${rate[@]}" --steps 6 --quiet --exit-after 3 --out "$TMP/split" || bad "split run failed"
"$FM" train "${base[@]}" --steps 6 --quiet --resume --out "$TMP/split" || bad "resume failed"
cmp -s "$TMP/straight/step_000006/model.safetensors" "$TMP/split/step_000006/model.safetensors" && ok || bad "resume: weights differ"
b=$(bias_of "$TMP/straight/step_000006/model.safetensors")
python3 -c 'import sys; v = [float(x) for x in sys.argv[1].split()]
assert len(v) == 16 and max(abs(x) for x in v) >= 0.01 and all(abs(round(x / 0.01) * 0.01 - x) < 1e-6 for x in v), v' "$b" \
    && ok || bad "the bias after 6 steps at rate 0.01: $b"

# --moe-seq-aux-loss-coeff: DeepSeek-V3's sequence-wise balance loss, reported as aux_loss (0 without
# it: the plain run), its alpha in the header's flags; the training loss still falls
"$FM" train "${base[@]}" --steps 12 --quiet --moe-seq-aux-loss-coeff 0.01 --out "$TMP/seqaux" || bad "--moe-seq-aux-loss-coeff run failed"
python3 - "$TMP/seqaux/metrics.jsonl" "$TMP/plain/metrics.jsonl" <<'PY' && ok || bad "the sequence-wise loss is not reported"
import json, sys
rs = list(map(json.loads, open(sys.argv[1])))
hdr = [r for r in rs if r.get("type") == "header"][0]
assert hdr["flags"]["moe_seq_aux_loss_coeff"] == 0.01, hdr["flags"]
steps = [r for r in rs if r.get("type") == "step"]
# per layer sum_i f_i P_i is about 1 when balanced (E / k at worst): alpha x that
assert all(0.002 < r["aux_loss"] < 0.01 * 8 / 2 + 1e-9 for r in steps), [r["aux_loss"] for r in steps]
assert steps[-1]["loss"] < steps[0]["loss"], (steps[0]["loss"], steps[-1]["loss"])
plain = [r for r in map(json.loads, open(sys.argv[2])) if r.get("type") == "step"]
assert all(r["aux_loss"] == 0 for r in plain)
print("sequence-wise aux loss:", [round(r["aux_loss"], 5) for r in steps[:3]], "...")
PY

# a Hugging Face folder with the MTP layer's tensors (model.layers.3.*): skipped on load
mkdir -p "$TMP/hf"
cp "$CFG" "$TMP/hf/config.json"
python3 - "$ck/model.safetensors" "$TMP/hf/model.safetensors" <<'PY'
import json, struct, sys
b = open(sys.argv[1], "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n]); data = b[8 + n:]
end = max(v["data_offsets"][1] for k, v in h.items() if k != "__metadata__")
for name, shape in (("model.layers.3.eh_proj.weight", [64, 128]), ("model.layers.3.mlp.gate.weight", [8, 64])):
    size = 4 * shape[0] * shape[1]
    h[name] = {"dtype": "F32", "shape": shape, "data_offsets": [end, end + size]}
    data = data[:end] + bytes(size) + data[end:]; end += size
hb = json.dumps(h).encode(); hb += b" " * (-len(hb) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(hb)) + hb + data)
PY
head -c 65 "$TEXT" > "$TMP/one.txt"
one=(--data "$TMP/one.txt" --val-data "$TMP/one.txt" --seq-len 64 --micro-batch 1 --threads 2 --quiet)
"$FM" train --init-from "$TMP/hf" "${one[@]}" --steps 1 --out "$TMP/ft" 2> "$TMP/ft.err" || bad "--init-from a folder with an MTP layer failed"
! grep -q "not a parameter" "$TMP/ft.err" && ok || bad "the MTP layer's tensors were not skipped silently: $(cat "$TMP/ft.err")"
a=$(grep -m1 '"step":1,' "$TMP/ft/metrics.jsonl" | sed -E 's/.*"loss":([^,]*).*/\1/')
e=$("$FM" eval --ckpt "$ck" --data "$TMP/one.txt" --seq-len 64 --micro-batch 1 --threads 2 | sed -n 's/^loss \([^ ]*\) .*/\1/p')
awk -v a="$a" -v b="$e" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && b != "" && d <= 1e-4) }' && ok ||
    bad "--init-from's step-1 loss ($a) is not eval's ($e)"
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["num_nextn_predict_layers"] = 0
json.dump(c, open(sys.argv[1], "w"))' "$TMP/hf/config.json"
"$FM" train --init-from "$TMP/hf" "${one[@]}" --steps 1 --out "$TMP/ft2" 2> "$TMP/ft2.err" || bad "--init-from failed"
grep -q "not a parameter.*model.layers.3." "$TMP/ft2.err" && ok || bad "without num_nextn_predict_layers the extra tensors were not named: $(cat "$TMP/ft2.err")"

# refusals
mk() { python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); exec(sys.argv[3]); json.dump(c, open(sys.argv[2], "w"))' "$CFG" "$TMP/$1.json" "$2"; }
# partial_rotary_factor absent is Glm4MoeConfig's 0.5: the RoPE tables (in the boundary set) are
# those of 0.5, not of 1.0
mk prf 'del c["partial_rotary_factor"]'
mk full 'c["partial_rotary_factor"] = 1.0'
boundaries() { "$FM" plan --config "$1" --seq-len 64 --micro-batch 2 --threads 2 2>&1 | sed -n 's/^checkpoint boundaries  *\([0-9][0-9]*\) .*/\1/p'; }
b_absent=$(boundaries "$TMP/prf.json") b_half=$(boundaries "$CFG") b_full=$(boundaries "$TMP/full.json")
[ -n "$b_half" ] && [ "$b_absent" = "$b_half" ] && [ "$b_half" != "$b_full" ] && ok ||
    bad "partial_rotary_factor absent: boundary set $b_absent B, 0.5: $b_half B, 1.0: $b_full B"
mk grp 'c["n_group"] = 3'
expect_fail "n_group not dividing the experts" "\"n_group\" (3)" "$FM" train --config "$TMP/grp.json" --data "$TEXT" --steps 1 --out "$TMP/x3"
mk tkg 'c["num_experts_per_tok"] = 5'
expect_fail "top-k above the kept groups' experts" "raise topk_group" "$FM" train --config "$TMP/tkg.json" --data "$TEXT" --steps 1 --out "$TMP/x4"
mk aux 'c["router_aux_loss_coef"] = 0.01'
expect_fail "an auxiliary loss on the sigmoid router" "--moe-router-bias-update-rate" "$FM" train --config "$TMP/aux.json" --data "$TEXT" --steps 1 --out "$TMP/x5"
expect_fail "the rate on a softmax router" "no selection bias" \
    "$FM" train --config "$ROOT/configs/tiny.json" --data "$TEXT" --steps 1 --moe-router-bias-update-rate 0.001 --out "$TMP/x6"
expect_fail "a negative rate" "expected a finite rate >= 0" \
    "$FM" train "${base[@]}" --steps 1 --moe-router-bias-update-rate -1 --out "$TMP/x7"
expect_fail "the rate with the streamed optimizer" "held by the streamed optimizer's buckets" \
    "$FM" train "${base[@]}" --steps 1 --moe-router-bias-update-rate 0.01 --offload-optimizer --out "$TMP/x10"
expect_fail "the sequence-wise loss on a softmax router" "set router_aux_loss_coef" \
    "$FM" train --config "$ROOT/configs/tiny.json" --data "$TEXT" --steps 1 --moe-seq-aux-loss-coeff 0.001 --out "$TMP/x8"
expect_fail "a negative sequence-wise coefficient" "expected a finite coefficient >= 0" \
    "$FM" train "${base[@]}" --steps 1 --moe-seq-aux-loss-coeff -1 --out "$TMP/x9"
finish
