#!/usr/bin/env bash
# The nccl communicator in the trainer, one rank (label gpu; $1 is flatmoe-cuda): a small
# OLMoE-shaped config (bench/configs/small-olmoe.json) trained 6 steps on today's single-rank path
# (no communicator: the self one) and with --comm nccl, in both check modes (deferred: checked at
# the step's sync points through the backend's wait hook; collective: each collective waited
# for). Over one rank every collective
# is the identity (an in-place sum over one rank) or a copy, so the losses, gradient norms,
# validation losses and the final weights must be BIT-IDENTICAL to the single-rank run.
# FLATMOE_ATTENTION=fallback: our bitwise-deterministic attention kernels (as cli_cuda_resume.sh).
source "$(dirname "$0")/../lib_cli.sh"
export FLATMOE_ATTENTION=fallback
cfg="$ROOT/bench/configs/small-olmoe.json"
common=(--config "$cfg" --data "$TEXT" --seq-len 64 --micro-batch 4 --grad-accum 2 --steps 6 --warmup 2
        --lr 3e-3 --eval-every 3 --eval-batches 2)
fields() { grep '"type":"step"' "$1" | sed -E -e 's/,"backend":\{[^}]*\}//g' -e 's/"(tokens_per_s|step_s|elapsed_s|host_syncs|mfu|time_ms)":[^,}]*,?//g'; }
syncs() { grep -o '"host_syncs":[0-9]*' "$1" | tail -1; }
"$FM" train "${common[@]}" --quiet --out "$TMP/self" || bad "single-rank run failed"
if ! "$FM" train "${common[@]}" --comm nccl --out "$TMP/nccl" > "$TMP/nccl.log" 2>&1; then
    if grep -q "built without NCCL" "$TMP/nccl.log"; then
        echo "note: this flatmoe-cuda has no NCCL (CMake found none): nothing to compare"; finish; exit $?
    fi
    cat "$TMP/nccl.log" >&2; bad "--comm nccl run failed"
fi
grep -q "^communicator: nccl over 1 rank" "$TMP/nccl.log" && ok || bad "--comm nccl did not say it runs on nccl"
"$FM" train "${common[@]}" --quiet --comm nccl --comm-check collective --out "$TMP/ncclc" || bad "--comm nccl --comm-check collective failed"
runs=(nccl ncclc)
for r in "${runs[@]}"; do
    if diff <(fields "$TMP/self/metrics.jsonl") <(fields "$TMP/$r/metrics.jsonl") >/dev/null; then ok
    else bad "$r: step records differ from the single-rank run"; diff <(fields "$TMP/self/metrics.jsonl") <(fields "$TMP/$r/metrics.jsonl") | head >&2; fi
    [ "$(grep -c '"type":"step"' "$TMP/$r/metrics.jsonl")" -eq 6 ] && ok || bad "$r: expected 6 step records"
    cmp -s "$TMP/self/step_000006/model.safetensors" "$TMP/$r/step_000006/model.safetensors" && ok ||
        bad "$r: final weights differ from the single-rank run"
    echo "$r: last step's $(syncs "$TMP/$r/metrics.jsonl") (single-rank: $(syncs "$TMP/self/metrics.jsonl"))"
done
# a bad --comm is refused by name
expect_fail "bad --comm" "expected auto, mpi or nccl" "$FM" train "${common[@]}" --comm gloo --out "$TMP/bad"
expect_fail "bad --comm-check" "expected deferred or collective" "$FM" train "${common[@]}" --comm-check never --out "$TMP/bad"
finish
