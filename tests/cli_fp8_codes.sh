#!/usr/bin/env bash
# --expert-precision fp8's fast path on E4M3 codes (the CPU's reference of the code ops,
# FLATMOE_TEST_FP8_CODES=1) in the combinations tests/cli_fp8.sh leaves out:
#   - exact resume across --fp8-weight-cache: 4 steps straight without the cache give the same
#     losses, gradient norms and final weights, bit for bit, as 2 steps with the cache, a resume,
#     and 2 more without it (grad accumulation, MoE chunks, recompute, an evaluation between steps);
#   - --threads 2 gives the numbers of --threads 1 to the BLAS's rounding (the code ops' own bits
#     do not depend on the thread count: test_fp8_codes checks that by construction; the dense
#     GEMMs' do, on some OpenBLAS kernels, e.g. OPENBLAS_CORETYPE=Haswell);
#   - adversarial routing (FLATMOE_TEST_FORCE_ROUTE): all routes on two experts (six empty), and
#     half of them forced in chunks of 12 tokens (some experts empty in a chunk): the codes and the
#     emulation agree on the same weights (--lr 1e-20: the weights stay put, so each step compares
#     the two paths at one point; the paths differ only in fp32 summation order, which can flip
#     one E4M3 rounding of a requantized operand, hence the tolerance), high-water = bound;
#   - a hidden size that is not a multiple of 128: the codes path falls back to the emulation, in
#     train and plan alike (the same bytes), and --fp8-weight-cache is refused naming the sizes;
#   - a --mem-budget that the weight cache overflows: the error advises dropping --fp8-weight-cache,
#     and without either cache flag the planner leaves the cache off there; with room for it, the
#     planner keeps it (train and plan say so), --no-fp8-weight-cache keeps it off, both flags are refused.
source "$(dirname "$0")/lib_cli.sh"
cfg="$ROOT/configs/tiny.json" # H 128, I 128, E 8, top-2
base=(--config "$cfg" --data "$TEXT" --seq-len 32 --micro-batch 2 --threads 1 --seed 7 --expert-precision fp8 --eval-batches 1)
codes() { FLATMOE_TEST_FP8_CODES=1 "$FM" train "$@"; }
emu() { (unset FLATMOE_TEST_FP8_CODES; "$FM" train "$@"); }

steps() { # METRICS: "step loss grad_norm" per step record, exact reprs
    python3 -c '
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if r.get("type") == "step": print(r["step"], repr(r["loss"]), repr(r["grad_norm"]))' "$1"; }

# ---- exact resume across the weight cache ----
rs=(--steps 4 --grad-accum 2 --moe-chunk-tokens 20 --recompute 1,2 --eval-every 2 --warmup 1
    --lr 3e-3 --save-every 2)
codes "${base[@]}" "${rs[@]}" --no-fp8-weight-cache --out "$TMP/straight" > "$TMP/straight.log" 2>&1 || bad "straight run failed: $(tail -2 "$TMP/straight.log")"
codes "${base[@]}" "${rs[@]}" --fp8-weight-cache --exit-after 2 --out "$TMP/split" > "$TMP/split1.log" 2>&1 \
    || bad "first half (cache) failed: $(tail -2 "$TMP/split1.log")"
codes "${base[@]}" "${rs[@]}" --no-fp8-weight-cache --resume --out "$TMP/split" > "$TMP/split2.log" 2>&1 || bad "resume failed: $(tail -2 "$TMP/split2.log")"
grep -q "on E4M3 codes" "$TMP/split2.log" && ok || bad "the resumed run is not on E4M3 codes"
a=$(steps "$TMP/straight/metrics.jsonl"); b=$(steps "$TMP/split/metrics.jsonl")
[ "$(wc -l <<<"$a")" -eq 4 ] && [ "$a" = "$b" ] && ok || bad "resume across --fp8-weight-cache changed the steps: $a vs $b"
cmp -s "$TMP/straight/step_000004/model.safetensors" "$TMP/split/step_000004/model.safetensors" && ok \
    || bad "resume across --fp8-weight-cache: the weights differ"

# ---- threads ----
th=(--steps 2 --grad-accum 2 --moe-chunk-tokens 40 --eval-every 0 --no-checkpoint)
codes "${base[@]}" "${th[@]}" --fp8-weight-cache --out "$TMP/t1" > "$TMP/t1.log" 2>&1 || bad "threads 1 failed: $(tail -2 "$TMP/t1.log")"
codes "${base[@]}" "${th[@]}" --fp8-weight-cache --threads 2 --out "$TMP/t2" > "$TMP/t2.log" 2>&1 || bad "threads 2 failed: $(tail -2 "$TMP/t2.log")"
# Tolerances: OpenBLAS splits a GEMM's output among its threads, and some of its kernels (Haswell,
# Zen) compute a row by where it falls in their tiling, so the dense layers' sums run in another
# order: step 1's loss and norm differ by ~1e-9 and 3e-8 relative (measured, Haswell). AdamW's
# first step moves each weight by about lr whatever its gradient's size (m / sqrt(v) = +-1), so a
# gradient element near 0 whose sign differs moves a weight by 2 lr: step 2's loss moved 2e-6, its
# norm 1.9e-4 (fp8: a sum an ulp off can also flip one E4M3 rounding of a requantized operand).
# Bounds: losses 1e-5 relative, gradient norms 1e-3 (tests/mpi_train_sp.sh's, for the same
# reason); a thread that read or wrote another's rows would move them by far more.
python3 - "$TMP/t1/metrics.jsonl" "$TMP/t2/metrics.jsonl" <<'PY' && ok || bad "the codes path's numbers at --threads 2 differ from --threads 1"
import json, sys
a, b = ([r for r in map(json.loads, open(p)) if r.get("type") == "step"] for p in sys.argv[1:3])
rel = lambda x, y: abs(x - y) / max(abs(y), 1e-30)
ok = len(a) == len(b) == 2 and all(rel(x["loss"], y["loss"]) <= 1e-5 and rel(x["grad_norm"], y["grad_norm"]) <= 1e-3
                                   for x, y in zip(a, b))
for x, y in zip(a, b):
    print(f"threads 1 vs 2, step {x['step']}: loss {rel(x['loss'], y['loss']):.2g}, grad norm "
          f"{rel(x['grad_norm'], y['grad_norm']):.2g} relative")
sys.exit(0 if ok else 1)
PY

# ---- adversarial routing: codes against the emulation on the same weights ----
agree() { # NAME EMU_METRICS CODES_METRICS
    python3 - "$2" "$3" <<'PY' && ok || bad "$1: the codes and the emulation disagree (or high-water != bound)"
import json, math, sys
def load(p): return [r for r in map(json.loads, open(p)) if r.get("type") == "step"]
e, c = load(sys.argv[1]), load(sys.argv[2])
assert len(e) == len(c) == 2, (len(e), len(c))
for x, y in zip(e, c):
    assert math.isfinite(y["loss"]) and math.isfinite(y["grad_norm"])
    assert abs(x["loss"] - y["loss"]) <= 1e-4 * abs(x["loss"]), (x["loss"], y["loss"])
    assert abs(x["grad_norm"] - y["grad_norm"]) <= 2e-3 * abs(x["grad_norm"]), (x["grad_norm"], y["grad_norm"])
mem = [y["memory"] for y in c if "memory" in y] # --report-memory: the first and the last step
assert mem
for name, m in ((n, v) for d in mem for n, v in d.items()):
    assert m["high_water"] <= m["bound"] < m["high_water"] + 64, (name, m)
PY
}
fr=(--steps 2 --lr 1e-20 --min-lr 0 --eval-every 0 --no-checkpoint --report-memory)
for route in "3:" "5:50:--moe-chunk-tokens 12"; do
    r=${route%%:*}; rest=${route#*:}; pct=${rest%%:*}; extra=${rest#*:}; [ -n "$pct" ] && r="$r:$pct"
    n=route_${r/:/_}
    FLATMOE_TEST_FORCE_ROUTE=$r emu "${base[@]}" "${fr[@]}" $extra --out "$TMP/${n}_e" > "$TMP/${n}_e.log" 2>&1 \
        || bad "$n emulated failed: $(tail -2 "$TMP/${n}_e.log")"
    FLATMOE_TEST_FORCE_ROUTE=$r codes "${base[@]}" "${fr[@]}" $extra --fp8-weight-cache --out "$TMP/${n}_c" > "$TMP/${n}_c.log" 2>&1 \
        || bad "$n codes failed: $(tail -2 "$TMP/${n}_c.log")"
    agree "$n" "$TMP/${n}_e/metrics.jsonl" "$TMP/${n}_c/metrics.jsonl"
done

# ---- hidden 96: no codes path; train and plan fall back to the emulation alike ----
python3 - "$cfg" "$TMP/h96.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c.update(hidden_size=96, num_attention_heads=3, num_key_value_heads=1)
json.dump(c, open(sys.argv[2], "w"))
PY
h96=(--config "$TMP/h96.json" "${base[@]:2}")
codes "${h96[@]}" --steps 1 --eval-every 0 --no-checkpoint --report-memory --out "$TMP/h96" > "$TMP/h96.log" 2>&1 \
    || bad "hidden 96 failed: $(tail -2 "$TMP/h96.log")"
grep -q "expert GEMMs fp8 (blockwise E4M3, emulated)" "$TMP/h96.log" && ok || bad "hidden 96 did not fall back to the emulation"
pj=$(FLATMOE_TEST_FP8_CODES=1 "$FM" plan --config "$TMP/h96.json" --seq-len 32 --micro-batch 2 --threads 1 --expert-precision fp8 --json 2>/dev/null)
python3 - "$pj" "$(grep -m1 '^memory: expert dispatch' "$TMP/h96.log")" <<'PY' && ok || bad "hidden 96: plan disagrees with train"
import json, sys
p = json.loads(sys.argv[1])
assert p["expert_fp8_path"] == "emulated", p["expert_fp8_path"]
assert p["live_sets"]["expert dispatch"] == int(sys.argv[2].split()[3]), (p["live_sets"], sys.argv[2])
PY
expect_fail "--fp8-weight-cache at hidden 96" "hidden_size 96 and moe_intermediate_size 128 are not both multiples of 128 (the fast path needs sizes multiples of 128)" \
    env FLATMOE_TEST_FP8_CODES=1 "$FM" train "${h96[@]}" --steps 1 --fp8-weight-cache --out "$TMP/bad"
expect_fail "plan --fp8-weight-cache at hidden 96" "hidden_size 96 and moe_intermediate_size 128 are not both multiples of 128" \
    env FLATMOE_TEST_FP8_CODES=1 "$FM" plan --config "$TMP/h96.json" --seq-len 32 --expert-precision fp8 --fp8-weight-cache

# ---- a budget that fits without --fp8-weight-cache but not with it (32,165 and 34,469 KiB the least that fit,
# small MoE chunks included): the advice names the flag ----
mb=(--config "$cfg" --seq-len 64 --micro-batch 4 --threads 1 --expert-precision fp8 --mem-budget 33300KiB)
FLATMOE_TEST_FP8_CODES=1 "$FM" plan "${mb[@]}" > /dev/null 2>&1 && ok || bad "the 33,300 KiB plan without the cache does not fit"
expect_fail "plan: the cache over the budget" "drop --fp8-weight-cache" \
    env FLATMOE_TEST_FP8_CODES=1 "$FM" plan "${mb[@]}" --fp8-weight-cache
expect_fail "train: the cache over the budget" "drop --fp8-weight-cache" \
    env FLATMOE_TEST_FP8_CODES=1 "$FM" train "${mb[@]}" --data "$TEXT" --steps 1 --fp8-weight-cache --out "$TMP/bad"
expect_fail "plan: the cache over the budget, bf16 advised without it" "--expert-precision bf16 without --fp8-weight-cache" \
    env FLATMOE_TEST_FP8_CODES=1 "$FM" plan "${mb[@]}" --fp8-weight-cache
# the planner's own choice of the cache (neither flag): off where it does not fit beside the plan chosen
# without it (at 40,000 KiB that plan spends the room on less recompute), on where it does (60,000 KiB)
pcache() { FLATMOE_TEST_FP8_CODES=1 "$FM" plan "$@" --json 2>/dev/null | python3 -c 'import json, sys; print(json.load(sys.stdin)["fp8_weight_cache"])'; }
[ "$(pcache "${mb[@]}")" = False ] && ok || bad "at 33,300 KiB the planner kept the cache, which does not fit"
big=("${mb[@]}" --mem-budget 60000KiB) # the later --mem-budget wins
[ "$(pcache "${big[@]}")" = True ] && ok || bad "at 60,000 KiB the planner did not keep the cache"
[ "$(pcache "${big[@]}" --no-fp8-weight-cache)" = False ] && ok || bad "--no-fp8-weight-cache did not keep the cache off"
# plan's "train flags" line reproduces its choice without the budget (train without --mem-budget on the
# CPU has no device budget, so the planner would keep the cache there): off at 33,300 KiB, on at 60,000
tflags() { FLATMOE_TEST_FP8_CODES=1 "$FM" plan "$@" 2>/dev/null | sed -n 's/^train flags: //p'; }
for b in 33300KiB:false 60000KiB:true; do
    read -r -a tf <<<"$(tflags "${mb[@]}" --mem-budget "${b%%:*}")"
    [ ${#tf[@]} -gt 0 ] || bad "plan at ${b%%:*} printed no train flags"
    codes --config "$cfg" --threads 1 "${tf[@]}" --data "$TEXT" --steps 1 --eval-every 0 --no-checkpoint --out "$TMP/tf_$b" \
        > "$TMP/tf_$b.log" 2>&1 || bad "train with plan's flags at ${b%%:*} failed: $(tail -2 "$TMP/tf_$b.log")"
    grep -q "\"fp8_weight_cache\":[[:space:]]*${b#*:}" "$TMP/tf_$b/metrics.jsonl" && ok \
        || bad "plan's train flags at ${b%%:*} (${tf[*]}) do not reproduce its cache choice (${b#*:})"
done
codes "${big[@]}" --data "$TEXT" --steps 1 --eval-every 0 --no-checkpoint --report-memory --out "$TMP/auto" > "$TMP/auto.log" 2>&1 \
    || bad "train at 60,000 KiB failed: $(tail -2 "$TMP/auto.log")"
grep -q "on E4M3 codes, every layer's weight codes kept" "$TMP/auto.log" && grep -q '"fp8_weight_cache":[[:space:]]*true' "$TMP/auto/metrics.jsonl" \
    && ok || bad "train at 60,000 KiB did not keep the cache (or did not say so)"
python3 - "$TMP/auto.log" <<'PY' && ok || bad "train at 60,000 KiB: a live set over its bound, or the cache's bytes unused"
import sys
rows = {}
for l in open(sys.argv[1]):
    f = l.split()
    if l.startswith("memory: ") and len(f) >= 5 and f[-3].isdigit() and f[-2].isdigit():
        rows[" ".join(f[1:-3])] = (int(f[-3]), int(f[-2]))
assert rows and all(hw <= b for b, hw in rows.values()), rows
b, hw = rows["expert dispatch"]
assert b - hw <= 4096, rows # the weight codes' sets are carved and reached, not only counted
PY
expect_fail "both cache flags" "--no-fp8-weight-cache both given" \
    env FLATMOE_TEST_FP8_CODES=1 "$FM" train "${big[@]}" --data "$TEXT" --steps 1 --fp8-weight-cache --no-fp8-weight-cache --out "$TMP/bad"
expect_fail "plan: both cache flags" "--no-fp8-weight-cache both given" \
    env FLATMOE_TEST_FP8_CODES=1 "$FM" plan "${big[@]}" --fp8-weight-cache --no-fp8-weight-cache
finish
