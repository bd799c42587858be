#!/usr/bin/env bash
# Exact resume on the CUDA engine (label gpu; $1 is flatmoe-cuda): 4 steps, save, resume, 4 more
# steps give the same losses, gradient norms and final weights and optimizer state, bit for bit, as
# 8 steps straight — on configs/tiny.json, plain and with the bounded operators (chunked MoE,
# linear cross-entropy), the resumed half with recompute; and under the bf16 state recipes
# (--master-weights bf16-kahan | bf16-sr). Modeled on tests/cli_resume.sh.
# FLATMOE_ATTENTION=fallback: our bitwise-deterministic attention kernels (cuDNN's backward sums
# dQ with atomics, so two identical runs need not agree in the last bit). Everything else on the
# CUDA backend is deterministic by construction (no floating-point atomics; cuBLAS is
# bitwise reproducible for the same shapes on the same GPU).
source "$(dirname "$0")/../lib_cli.sh"
export FLATMOE_ATTENTION=fallback
cfg="$ROOT/configs/tiny.json"
common=(--config "$cfg" --data "$TEXT" --seq-len 64 --micro-batch 4 --grad-accum 2 --steps 8 --warmup 2
        --lr 3e-3 --eval-every 3 --eval-batches 2 --quiet)
fields() { grep '"type":"step"' "$1" | sed -E -e 's/,"backend":\{[^}]*\}//g' -e 's/"(tokens_per_s|step_s|elapsed_s|val_loss|host_syncs|mfu)":[^,}]*,?//g'; }
same_run() { # NAME STRAIGHT SPLIT: metrics (but timings) and the step-8 checkpoint identical
    local name=$1 a=$2 b=$3
    if diff <(fields "$a/metrics.jsonl") <(fields "$b/metrics.jsonl") >/dev/null; then ok
    else bad "$name: metrics differ between straight and resumed runs"; diff <(fields "$a/metrics.jsonl") <(fields "$b/metrics.jsonl") | head >&2; fi
    [ "$(grep -c '"type":"step"' "$b/metrics.jsonl")" -eq 8 ] && ok || bad "$name: metrics.jsonl should have 8 step records"
    for f in model.safetensors optimizer.safetensors; do
        cmp -s "$a/step_000008/$f" "$b/step_000008/$f" && ok || bad "$name: $f differs after resume"
    done
}
# plain: resumed half with full recompute (bit-identical to none under the deterministic attention)
"$FM" train "${common[@]}" --out "$TMP/straight" || bad "straight run failed"
"$FM" train "${common[@]}" --out "$TMP/split" --exit-after 4 || bad "first half failed"
[ -d "$TMP/split/step_000004" ] && ok || bad "no checkpoint after --exit-after 4"
"$FM" train "${common[@]}" --out "$TMP/split" --resume --recompute full || bad "resumed run failed"
same_run plain "$TMP/straight" "$TMP/split"
# a second straight run: the engine is deterministic run to run (else the checks above mean little)
"$FM" train "${common[@]}" --out "$TMP/straight2" || bad "second straight run failed"
cmp -s "$TMP/straight/step_000008/model.safetensors" "$TMP/straight2/step_000008/model.safetensors" && ok ||
    bad "two identical straight runs gave different weights (non-deterministic kernels?)"
# bounded operators in both runs: chunked MoE (4 chunks of the 256-token micro-batch), linear CE
# (2 token blocks x 3 vocabulary blocks of tiny's 256); resumed half also recomputes layers 0,2
bounded=(--moe-chunk-tokens 64 --ce-block-tokens 128 --ce-block-vocab 100)
"$FM" train "${common[@]}" "${bounded[@]}" --out "$TMP/bstraight" || bad "bounded straight run failed"
"$FM" train "${common[@]}" "${bounded[@]}" --out "$TMP/bsplit" --exit-after 4 || bad "bounded first half failed"
"$FM" train "${common[@]}" "${bounded[@]}" --out "$TMP/bsplit" --resume --recompute 0,2 || bad "bounded resumed run failed"
same_run bounded "$TMP/bstraight" "$TMP/bsplit"
# the state recipes (--master-weights): bf16 weights with no fp32 master; the Kahan buffer and the
# stochastic rounding's bits (a hash of seed, step and index) resume exactly too, and each is a
# different run from the fp32 master's
for rc in bf16-kahan bf16-sr; do
    "$FM" train "${common[@]}" --master-weights $rc --bf16-moments --out "$TMP/${rc}straight" || bad "$rc straight run failed"
    "$FM" train "${common[@]}" --master-weights $rc --bf16-moments --out "$TMP/${rc}split" --exit-after 4 || bad "$rc first half failed"
    "$FM" train "${common[@]}" --out "$TMP/${rc}split" --resume || bad "$rc resumed run failed"
    same_run "$rc" "$TMP/${rc}straight" "$TMP/${rc}split"
    cmp -s "$TMP/straight/step_000008/model.safetensors" "$TMP/${rc}straight/step_000008/model.safetensors" &&
        bad "$rc gave the fp32 master's weights" || ok
done
# the bounded run is a different computation in bf16 (not the plain run's bits), but close
cmp -s "$TMP/straight/step_000008/model.safetensors" "$TMP/bstraight/step_000008/model.safetensors" &&
    echo "note: bounded and plain runs gave identical weights" >&2
finish
