#!/usr/bin/env bash
# The state recipes (--master-weights fp32 | bf16-kahan | bf16-sr): each resumes exactly (N steps,
# save, resume, N more = 2N straight, bit for bit: stochastic rounding's bits are a hash of the
# seed, the step and the index), each is a different run from fp32's, bf16-sr repeats for a seed;
# the checkpoints hold fp32 weights that load under another recipe (with a warning); metrics.jsonl
# and state.json record the recipe; plan prints its bytes per parameter; the flag's bad values
# and unsupported companions are refused.
source "$(dirname "$0")/lib_cli.sh"
cfg="$ROOT/tests/data/micro.json"
common=(--config "$cfg" --data "$TEXT" --seq-len 32 --micro-batch 4 --grad-accum 2 --steps 8 --warmup 2
        --lr 3e-3 --eval-every 3 --eval-batches 2 --threads 2 --quiet)
fields() { grep '"type":"step"' "$1" | sed -E -e 's/,"backend":\{[^}]*\}//g' -e 's/"(tokens_per_s|step_s|elapsed_s|val_loss|host_syncs)":[^,}]*,?//g'; }
"$FM" train "${common[@]}" --out "$TMP/fp32" || bad "fp32 run failed"
for rc in bf16-kahan bf16-sr; do
    for mom in "" --bf16-moments; do
        t="$rc$mom"
        "$FM" train "${common[@]}" --master-weights $rc $mom --out "$TMP/s$t" || bad "$t straight run failed"
        "$FM" train "${common[@]}" --master-weights $rc $mom --out "$TMP/p$t" --exit-after 4 || bad "$t first half failed"
        "$FM" train "${common[@]}" --out "$TMP/p$t" --resume || bad "$t resume failed" # the spec restores the recipe
        for f in model.safetensors optimizer.safetensors; do
            cmp -s "$TMP/s$t/step_000008/$f" "$TMP/p$t/step_000008/$f" && ok || bad "$t: $f differs after resume"
        done
        if diff <(fields "$TMP/s$t/metrics.jsonl") <(fields "$TMP/p$t/metrics.jsonl") >/dev/null; then ok
        else bad "$t: metrics differ between straight and resumed runs"; fi
        cmp -s "$TMP/fp32/step_000008/model.safetensors" "$TMP/s$t/step_000008/model.safetensors" &&
            bad "$t gave the fp32 run's weights" || ok
        grep -Eq "\"master_weights\":[[:space:]]*\"$rc\"" "$TMP/s$t/step_000008/state.json" && ok || bad "$t: state.json lacks master_weights"
        python3 - "$TMP/s$t/metrics.jsonl" "$rc" "${mom:+bf16}" <<'PY' && ok || bad "$t: metrics.jsonl's header lacks the recipe"
import json, sys
h = json.loads(open(sys.argv[1]).readline())
r = h["plan"]["state_recipe"]
mom = sys.argv[3] or "fp32"
want = 4 + 4 + (2 if sys.argv[2] == "bf16-kahan" else 0) + (4 if mom == "bf16" else 8)  # CPU: fp32 weights, grads
assert h["flags"]["master_weights"] == sys.argv[2] and r["master_weights"] == sys.argv[2], r
assert r["moments"] == mom and r["bytes_per_param"] == want, (r, want)
PY
    done
done
# the Kahan buffer is saved (fp32 on disk), stochastic rounding keeps none
grep -q 'kahan_comp\.' "$TMP/sbf16-kahan/step_000008/optimizer.safetensors" && ok || bad "no kahan_comp tensors in the Kahan run's optimizer file"
grep -q 'kahan_comp\.' "$TMP/sbf16-sr/step_000008/optimizer.safetensors" && bad "kahan_comp tensors in the sr run's optimizer file" || ok
# bf16-sr repeats for a seed (the straight run above, again) and differs for another
"$FM" train "${common[@]}" --master-weights bf16-sr --out "$TMP/sr2" || bad "sr second run failed"
cmp -s "$TMP/sbf16-sr/step_000008/model.safetensors" "$TMP/sr2/step_000008/model.safetensors" && ok || bad "bf16-sr did not repeat"
# across recipes: an fp32 checkpoint resumes under bf16-kahan (buffer from zero) and back, warned
"$FM" train "${common[@]}" --out "$TMP/x" --exit-after 4 || bad "cross first half failed"
w=$("$FM" train "${common[@]}" --master-weights bf16-kahan --out "$TMP/x" --resume --exit-after 6 2>&1 >/dev/null) || bad "fp32 -> kahan resume failed: $w"
grep -q "checkpoint was trained with --master-weights fp32" <<<"$w" && ok || bad "no warning on fp32 -> bf16-kahan: $w"
w=$("$FM" train "${common[@]}" --master-weights fp32 --out "$TMP/x" --resume 2>&1 >/dev/null) || bad "kahan -> fp32 resume failed: $w"
grep -q "checkpoint was trained with --master-weights bf16-kahan" <<<"$w" && ok || bad "no warning on bf16-kahan -> fp32: $w"
[ -f "$TMP/x/step_000008/model.safetensors" ] && ok || bad "the cross-recipe run did not finish"
# plan: the recipe's bytes per parameter, the model state without the fp32 master
p=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 4096 --device-mem 80GiB --master-weights bf16-sr --bf16-moments)
grep -q "master weights bf16-sr, moments bf16 (8 B/param)" <<<"$p" && ok || bad "plan does not print bf16-sr's 8 B/param: $p"
grep -q "fits in" <<<"$p" && grep -q -- "--master-weights bf16-sr" <<<"$p" && ok || bad "plan bf16-sr at 80GiB: no fit or no flag: $p"
j=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 4096 --master-weights bf16-kahan --json)
python3 -c 'import json,sys; j=json.loads(sys.argv[1]); assert j["master_weights"]=="bf16-kahan" and j["state_bytes_per_param"]==14, j' "$j" && ok || bad "plan --json lacks the recipe"
# refused: an unknown recipe, and companions the recipe does not run with yet
expect_fail "unknown recipe" "--master-weights: expected" "$FM" train "${common[@]}" --master-weights bf16 --out "$TMP/u1"
expect_fail "recipe with offload" "--master-weights bf16-sr with --offload-optimizer" \
    "$FM" train "${common[@]}" --master-weights bf16-sr --offload-optimizer --out "$TMP/u2"
finish
