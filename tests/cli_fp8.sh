#!/usr/bin/env bash
# --expert-precision fp8 end to end (model/fm_experts_fp8.h): a few training steps with finite
# losses close to (but not equal to) the native run's, every arena's high-water mark equal to its
# bound with the fp8 copies in the expert live set (plain, chunked + recompute + grad-accum), the
# flag in metrics.jsonl's header, state.json and plan's lines and --json, plan's expert bytes
# larger by exactly 3 E H I + 2 N k max(H, I) elements, a resume with the other precision warned
# about, and bad values / unsupported combinations refused with a clear message; the fast path's
# code ops (CPU reference, FLATMOE_TEST_FP8_CODES=1) against the emulation.
source "$(dirname "$0")/lib_cli.sh"
cfg="$ROOT/configs/tiny.json" # H 128, I 128, E 8, top-2: whole 128-wide tiles
shape=(--seq-len 64 --micro-batch 4)
# The sanitized pass (scripts/test.sh, FLATMOE_TEST_SANITIZED=1): a quarter of the tokens per
# micro-batch (32 x 2), every check the same; at 64 x 4 the CPU's E4M3 code ops under
# AddressSanitizer and UBSan ran past 900 s. 64 tokens still span two --moe-chunk-tokens 48 chunks.
[ "${FLATMOE_TEST_SANITIZED:-0}" = 1 ] && shape=(--seq-len 32 --micro-batch 2)
base=(--config "$cfg" --data "$TEXT" "${shape[@]}" --steps 3 --threads 2 --eval-every 3 --eval-batches 1 --seed 7)

losses() { python3 -c '
import json, sys
print(" ".join(repr(r["loss"]) for r in map(json.loads, open(sys.argv[1])) if "loss" in r))' "$1"; }

"$FM" train "${base[@]}" --report-memory --out "$TMP/native" > "$TMP/native.log" 2>&1 || bad "native run failed: $(tail -3 "$TMP/native.log")"
"$FM" train "${base[@]}" --report-memory --expert-precision fp8 --out "$TMP/fp8" > "$TMP/fp8.log" 2>&1 || bad "fp8 run failed: $(tail -3 "$TMP/fp8.log")"
grep -q "expert GEMMs fp8" "$TMP/fp8.log" && ok || bad "the fp8 run's header does not say fp8"
check_memory plain "$TMP/fp8.log"
ln=$(losses "$TMP/native/metrics.jsonl"); lf=$(losses "$TMP/fp8/metrics.jsonl")
echo "native losses: $ln"; echo "fp8 losses:    $lf"
python3 - "$ln" "$lf" <<'PY' && ok || bad "fp8 losses not finite / not close to native / identical to native"
import math, sys
a = [float(x) for x in sys.argv[1].split()]; b = [float(x) for x in sys.argv[2].split()]
assert len(a) == len(b) == 3 and all(math.isfinite(x) for x in b)
assert all(abs(x - y) < 0.05 for x, y in zip(a, b)), (a, b)
assert a != b
PY
# flatmoe eval scores with native experts and says so for an fp8 checkpoint (not for a native one)
"$FM" eval --ckpt "$TMP/fp8" --data "$TEXT" --max-batches 1 --threads 2 > "$TMP/eval8.txt" 2>&1 &&
    grep -q "^experts: native precision (the checkpoint trained with --expert-precision fp8" "$TMP/eval8.txt" && ok ||
    bad "eval of the fp8 checkpoint: $(cat "$TMP/eval8.txt")"
"$FM" eval --ckpt "$TMP/native" --data "$TEXT" --max-batches 1 --threads 2 > "$TMP/eval16.txt" 2>&1 &&
    ! grep -q "^experts:" "$TMP/eval16.txt" && ok || bad "eval of the native checkpoint: $(cat "$TMP/eval16.txt")"
grep -m1 '"type": *"header"' "$TMP/fp8/metrics.jsonl" | grep -q '"expert_precision":[[:space:]]*"fp8"' && ok || bad "metrics header lacks expert_precision fp8"
grep -m1 '"type": *"header"' "$TMP/native/metrics.jsonl" | grep -q '"expert_precision":[[:space:]]*"bf16"' && ok || bad "metrics header lacks expert_precision bf16"
grep -q '"expert_precision":[[:space:]]*"fp8"' "$TMP/fp8/step_000003/state.json" && ok || bad "state.json lacks expert_precision fp8"

# the fast path's E4M3 code ops (the CPU's reference of them, FLATMOE_TEST_FP8_CODES=1): the same
# recipe as the emulation, so the same losses up to fp32 summation order (and a flipped rounding)
FLATMOE_TEST_FP8_CODES=1 "$FM" train "${base[@]}" --report-memory --expert-precision fp8 --out "$TMP/codes" \
    > "$TMP/codes.log" 2>&1 || bad "fp8 codes run failed: $(tail -3 "$TMP/codes.log")"
grep -q "expert GEMMs fp8 (blockwise E4M3, on E4M3 codes" "$TMP/codes.log" && ok || bad "the codes run's header does not say codes"
grep -q "expert GEMMs fp8 (blockwise E4M3, emulated)" "$TMP/fp8.log" && ok || bad "the emulated run's header does not say emulated"
grep -m1 '"type": *"header"' "$TMP/codes/metrics.jsonl" | grep -q '"expert_fp8_path":[[:space:]]*"codes"' && ok || bad "metrics header lacks expert_fp8_path codes"
grep -m1 '"type": *"header"' "$TMP/fp8/metrics.jsonl" | grep -q '"expert_fp8_path":[[:space:]]*"emulated"' && ok || bad "metrics header lacks expert_fp8_path emulated"
check_memory codes "$TMP/codes.log"
lc=$(losses "$TMP/codes/metrics.jsonl"); echo "fp8 codes losses: $lc"
python3 - "$lf" "$lc" <<'PY' && ok || bad "fp8 codes losses not within 1e-3 of the emulated fp8 run"
import math, sys
a = [float(x) for x in sys.argv[1].split()]; b = [float(x) for x in sys.argv[2].split()]
assert len(a) == len(b) == 3 and all(math.isfinite(x) for x in b)
assert all(abs(x - y) < 1e-3 for x, y in zip(a, b)), (a, b)
PY
FLATMOE_TEST_FP8_CODES=1 "$FM" train "${base[@]}" --report-memory --expert-precision fp8 --moe-chunk-tokens 48 --recompute 0,2 \
    --grad-accum 2 --out "$TMP/codes_chunk" > "$TMP/codes_chunk.log" 2>&1 || bad "fp8 codes chunked run failed: $(tail -3 "$TMP/codes_chunk.log")"
check_memory codes_chunked "$TMP/codes_chunk.log"

# FLATMOE_PROFILE=1: the quantization is its own phase (fp8_quant), beside the expert GEMMs (experts);
# zero without fp8. Both the emulation and the codes path charge it.
pq() { python3 -c '
import json, sys
r = [r for r in map(json.loads, open(sys.argv[1])) if r.get("type", "step") == "step"][-1]["phase_ms"]
print("pos" if r["fp8_quant"] > 0 and r["experts"] > 0 else "zero" if r["fp8_quant"] == 0 else "bad %r" % r)' "$1"; }
for v in emu codes native; do
    env $([ $v = codes ] && echo FLATMOE_TEST_FP8_CODES=1) FLATMOE_PROFILE=1 "$FM" train "${base[@]}" --steps 1 --eval-every 0 \
        --no-checkpoint $([ $v = native ] || echo --expert-precision fp8) --out "$TMP/prof-$v" > "$TMP/prof-$v.log" 2>&1 \
        || bad "profiled $v run failed: $(tail -2 "$TMP/prof-$v.log")"
    want=$([ $v = native ] && echo zero || echo pos)
    [ "$(pq "$TMP/prof-$v/metrics.jsonl")" = "$want" ] && grep -q "fp8_quant" "$TMP/prof-$v.log" && ok \
        || bad "$v: the fp8_quant phase is not $want: $(pq "$TMP/prof-$v/metrics.jsonl")"
done

# --fp8-weight-cache: every layer's weight codes kept for the step, quantized once a step: the same
# bits as quantizing at every forward, backward and recompute (so the invalidation after each
# update and before each evaluation is right), high-water = bound with the cache in the expert set
wc=(--expert-precision fp8 --grad-accum 2 --recompute 0,2 --eval-every 2 --steps 4)
FLATMOE_TEST_FP8_CODES=1 "$FM" train "${base[@]}" "${wc[@]}" --no-fp8-weight-cache --out "$TMP/wc0" > "$TMP/wc0.log" 2>&1 || bad "fp8 codes (no cache) failed: $(tail -3 "$TMP/wc0.log")"
FLATMOE_TEST_FP8_CODES=1 "$FM" train "${base[@]}" "${wc[@]}" --fp8-weight-cache --report-memory --out "$TMP/wc1" > "$TMP/wc1.log" 2>&1 \
    || bad "fp8 codes with --fp8-weight-cache failed: $(tail -3 "$TMP/wc1.log")"
vl() { python3 -c '
import json, sys
print(" ".join(repr((r.get("loss"), r.get("val_loss"))) for r in map(json.loads, open(sys.argv[1])) if r.get("type", "step") == "step"))' "$1"; }
[ -n "$(vl "$TMP/wc0/metrics.jsonl")" ] && [ "$(vl "$TMP/wc0/metrics.jsonl")" = "$(vl "$TMP/wc1/metrics.jsonl")" ] && ok \
    || bad "--fp8-weight-cache changed the losses: $(vl "$TMP/wc0/metrics.jsonl") vs $(vl "$TMP/wc1/metrics.jsonl")"
check_memory weight_cache "$TMP/wc1.log"
grep -q "every layer's weight codes kept" "$TMP/wc1.log" && grep -m1 '"type": *"header"' "$TMP/wc1/metrics.jsonl" | grep -q '"fp8_weight_cache":[[:space:]]*true' \
    && ok || bad "the cache run's header / metrics do not say --fp8-weight-cache"
expect_fail "--fp8-weight-cache on the emulation" "--fp8-weight-cache keeps the E4M3 weight codes" \
    "$FM" train "${base[@]}" --expert-precision fp8 --fp8-weight-cache --out "$TMP/bad"
expect_fail "--fp8-weight-cache without fp8" "--expert-precision is bf16" "$FM" train "${base[@]}" --fp8-weight-cache --out "$TMP/bad"
expect_fail "plan --fp8-weight-cache on the emulation" "--fp8-weight-cache keeps the E4M3 weight codes" \
    "$FM" plan --config "$cfg" --seq-len 64 --expert-precision fp8 --fp8-weight-cache
# the refusals name the reason found (fm_expert_fp8_codes_why), and --no-fp8-weight-cache without fp8 is refused too
expect_fail "--fp8-weight-cache on the CPU's emulation: the reason" "emulated, since the backend is cpu" \
    "$FM" train "${base[@]}" --expert-precision fp8 --fp8-weight-cache --out "$TMP/bad"
expect_fail "plan --fp8-weight-cache under FLATMOE_EXPERT_GEMM=cublas" "FLATMOE_EXPERT_GEMM=cublas keeps the emulation" \
    env FLATMOE_EXPERT_GEMM=cublas "$FM" plan --config "$cfg" --seq-len 64 --backend cuda --expert-precision fp8 --fp8-weight-cache
expect_fail "--no-fp8-weight-cache without fp8" "--no-fp8-weight-cache is for --expert-precision fp8's weight codes, but --expert-precision is bf16" \
    "$FM" train "${base[@]}" --no-fp8-weight-cache --out "$TMP/bad"
expect_fail "plan --no-fp8-weight-cache without fp8" "--no-fp8-weight-cache is for --expert-precision fp8's weight codes, but --expert-precision is bf16" \
    "$FM" plan --config "$cfg" --seq-len 64 --no-fp8-weight-cache
[ ! -e "$TMP/bad" ] && ok || bad "a refused run wrote its --out folder"
# a budget that the bf16 experts fit (32,387,776 B) and the fp8 emulation's copies do not (34,091,712 B), every
# chooser knob fixed: the advice names --expert-precision bf16
fx=(--config "$cfg" --seq-len 32 --micro-batch 2 --threads 2 --recompute none --moe-chunk-tokens 0 --offload-boundaries 0
    --ce-block-tokens 0 --ce-block-vocab 0 --mem-budget 33000000)
"$FM" plan "${fx[@]}" > /dev/null 2>&1 && ok || bad "the bf16 plan at 33,000,000 B does not fit"
expect_fail "plan: fp8 over the budget" "--expert-precision bf16 (the fp8 experts' quantized operands out of the expert live set)" \
    "$FM" plan "${fx[@]}" --expert-precision fp8
expect_fail "train: fp8 over the budget" "--expert-precision bf16 (the fp8 experts'" \
    "$FM" train "${fx[@]}" --data "$TEXT" --steps 1 --expert-precision fp8 --out "$TMP/bad"

# chunked MoE + recompute + grad-accum
"$FM" train "${base[@]}" --report-memory --expert-precision fp8 --moe-chunk-tokens 48 --recompute 0,2 --grad-accum 2 \
    --out "$TMP/chunk" > "$TMP/chunk.log" 2>&1 || bad "fp8 chunked run failed: $(tail -3 "$TMP/chunk.log")"
check_memory chunked "$TMP/chunk.log"
python3 -c 'import sys, math; v = [float(x) for x in sys.argv[1].split()]; assert len(v) == 3 and all(math.isfinite(x) for x in v)' \
    "$(losses "$TMP/chunk/metrics.jsonl")" && ok || bad "fp8 chunked losses not finite"

# resume with the other precision given: warned (without the flag the run spec in state.json keeps fp8)
"$FM" train "${base[@]}" --steps 4 --resume --expert-precision bf16 --out "$TMP/fp8" > "$TMP/resume.log" 2>&1 || bad "resume failed: $(tail -3 "$TMP/resume.log")"
grep -q "warning: resuming with --expert-precision bf16, but the checkpoint was trained with --expert-precision fp8" "$TMP/resume.log" \
    && ok || bad "no warning on a resume with another --expert-precision: $(grep -i warn "$TMP/resume.log")"

# resume a codes run on the emulation (no FLATMOE_TEST_FP8_CODES): the same precision, no warning
"$FM" train "${base[@]}" --steps 4 --resume --expert-precision fp8 --out "$TMP/codes" > "$TMP/resume_path.log" 2>&1 \
    && ! grep -q "warning" "$TMP/resume_path.log" && grep -q '"expert_fp8_path":[[:space:]]*"emulated"' "$TMP/codes/metrics.jsonl" \
    && ok || bad "a codes run resumed on the emulation: $(grep -i "warn\|error" "$TMP/resume_path.log")"

# plan: the expert live set grows by exactly the fp8 term (plain: N = 4 x 64, k = 2)
pj() { "$FM" plan --config "$cfg" --seq-len 64 --micro-batch 4 --moe-chunk-tokens 0 --threads 2 --json "$@" 2>/dev/null; }
b16=$(pj); b8=$(pj --expert-precision fp8)
python3 - "$b16" "$b8" <<'PY' && ok || bad "plan's fp8 expert bytes are not the bf16 ones + 3 E H I + 2 N k max(H,I)"
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
r = lambda n: (n + 63) // 64 * 64
E, H, I, N, k = 8, 128, 128, 256, 2
term = 3 * r(E * H * I * 4) + 2 * r(N * k * max(H, I) * 4)
assert b["expert_precision"] == "fp8" and a["expert_precision"] == "bf16"
assert b["live_sets"]["expert dispatch"] == a["live_sets"]["expert dispatch"] + term, (a["live_sets"], b["live_sets"], term)
assert b["total_bytes"] == a["total_bytes"] + term
print("plan: expert dispatch", a["live_sets"]["expert dispatch"], "->", b["live_sets"]["expert dispatch"], "(+%d)" % term)
PY
# plan --json says which path (README: recorded in plan --json) and plans the codes run's arenas
# exactly: its expert dispatch bound is the one the codes run above allocated (--report-memory)
pjc=$(FLATMOE_TEST_FP8_CODES=1 "$FM" plan "${base[@]:0:2}" "${shape[@]}" --threads 2 --expert-precision fp8 --json 2>/dev/null)
python3 - "$b8" "$pjc" "$(grep -m1 '^memory: expert dispatch' "$TMP/codes.log")" <<'PY' && ok || bad "plan --json's expert_fp8_path / codes bytes do not match the run"
import json, sys
e, c = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert e.get("expert_fp8_path") == "emulated" and c.get("expert_fp8_path") == "codes", (e.get("expert_fp8_path"), c.get("expert_fp8_path"))
assert c["live_sets"]["expert dispatch"] == int(sys.argv[3].split()[3]), (c["live_sets"], sys.argv[3])
PY
"$FM" plan --config "$cfg" --seq-len 64 --micro-batch 4 --expert-precision fp8 2>/dev/null | grep -q "^train flags:.*--expert-precision fp8" \
    && ok || bad "plan's train flags line lacks --expert-precision fp8"

expect_fail "train --expert-precision fp16" "--expert-precision: expected bf16 or fp8, found 'fp16'" "$FM" train "${base[@]}" --expert-precision fp16 --out "$TMP/bad"
expect_fail "plan --expert-precision fp16" "--expert-precision: expected bf16 or fp8, found 'fp16'" "$FM" plan --config "$cfg" --seq-len 64 --expert-precision fp16
# fp8 with --ep runs (no refusal): tests/cli_fp8_codes_mpi.sh checks --ep 2 against one rank
expect_fail "plan fp8 with --sp 2 (a mesh plan)" "--expert-precision fp8 with a mesh plan" "$FM" plan --config "$cfg" --seq-len 64 --micro-batch 2 --sp 2 --expert-precision fp8
finish
