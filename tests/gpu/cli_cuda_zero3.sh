#!/usr/bin/env bash
# ZeRO-3 on the CUDA engine (label gpu; $1 is flatmoe-cuda): two ranks sharing the GPU through the
# mpi communicator (host-staged device buffers), --zero 3 at --micro-batch 2, against one rank at
# --micro-batch 4 on tests/data/micro.json (tied) and an untied copy of it, 12 steps:
#  - the first compared step's loss to 2e-3 relative and its gradient norm to 1e-2 (step 1, or
#    step 7 of a resume: the same bf16 weights;
#    cuBLAS may pick other kernels for the half micro-batch, and the sums run in another order; a
#    lost gradient, e.g. the tied head's part of the embedding's, moves the first gradient norm by
#    20%); every later loss and gradient norm to 2e-2 untied and 5e-2 tied (bf16 gradients summed
#    per group in another order, amplified by training: on the H200, 2026-12-01, the tied config's
#    np 2 run and its own resume at np 1 from the same step-6 weights drifted 1.2e-2 apart in six
#    steps, the untied config's 4e-4; --zero 3 --ep 2 against one rank reached 2.5e-2 at step 11,
#    --zero 3 alone 2.0e-2);
#  - or, where more, to 5 times the deviation of a one-rank twin (--micro-batch 2 --grad-accum 4: the same
#    math as --micro-batch 4 --grad-accum 2, summed in another order) from the one-rank run at that step: a
#    gradient-norm spike is ill-conditioned (on the H200, 2026-12-02, with the README as text, step 10's norm
#    was 2.05 between neighbours of 1.2, and the twin differed there by 2.1e-2, --zero 3 by 5.2e-2,
#    --zero 3 --ep 2 by 6.6e-2, while every loss agreed to 5e-5);
#  - the model state's high-water mark equals its bound on every report;
#  - a checkpoint of the np 2 run at step 6 resumes at np 1 (--zero 0) with the losses of the np 2
#    run continued, to 2e-2;
#  - the same for --zero 3 --ep 2 (the non-expert parameters sharded, each rank's experts whole).
# Without mpirun on the PATH the test says so and passes.
source "$(dirname "$0")/../lib_cli.sh"
export FLATMOE_ATTENTION=fallback OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_mpi_yield_when_idle=1
MPIEXEC=$(command -v mpirun || command -v mpiexec)
if [ -z "$MPIEXEC" ]; then echo "note: no mpirun: the ZeRO-3 GPU test is skipped"; exit 0; fi
FLAGS=(--oversubscribe --allow-run-as-root --bind-to none --mca btl self,vader
       --mca btl_vader_single_copy_mechanism none --mca pml ob1)
sed 's/"tie_word_embeddings": true/"tie_word_embeddings": false/' "$ROOT/tests/data/micro.json" > "$TMP/untied.json"
compare() { # REF RUN FIRST_STEP LATER_TOL TWIN_A TWIN_B (the noise floor: TWIN_B's deviation from TWIN_A)
    python3 - "$1" "$2" "$3" "$4" "$5" "$6" <<'PY'
import json, sys
steps = lambda d: {r["step"]: r for r in map(json.loads, open(d + "/metrics.jsonl")) if r.get("type", "step") == "step"}
a, b, first, later = steps(sys.argv[1]), steps(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
ta, tb = steps(sys.argv[5]), steps(sys.argv[6])
dev = lambda x, y, s, k: abs(x[s][k] - y[s][k]) / max(abs(x[s][k]), 1e-30)
ok, worst = True, 0.0
for s in sorted(b):
    if s < first: continue
    for k in ("loss", "grad_norm"):
        rel = dev(a, b, s, k)
        # the first compared step: the same weights; later: bf16 drift, or 5 x the twin's at a spike
        tol = (2e-3 if k == "loss" else 1e-2) if s == first else max(later, 5 * dev(ta, tb, s, k))
        worst = max(worst, rel)
        if rel > tol:
            ok = False
            print(f"FAIL: {sys.argv[2]}: step {s} {k} {b[s][k]!r} vs {a[s][k]!r} (relative {rel:.2e} > {tol})")
    mem = b[s].get("memory", {}).get("model state")
    if mem and mem["high_water"] != mem["bound"]:
        ok = False; print(f"FAIL: {sys.argv[2]}: step {s}: model state high-water {mem['high_water']} != bound {mem['bound']}")
print(f"{sys.argv[2]}: within {worst:.2e} relative: " + ("ok" if ok else "FAILED"))
sys.exit(0 if ok else 1)
PY
}
for cfg in "$ROOT/tests/data/micro.json" "$TMP/untied.json"; do
    name=$(basename "$cfg" .json)
    tol=$([ "$name" = micro ] && echo 5e-2 || echo 2e-2) # tied (micro) drifts more: see the header
    common=(--config "$cfg" --data "$TEXT" --seq-len 32 --grad-accum 2 --steps 12 --warmup 2 --lr 3e-3
            --eval-every 6 --eval-batches 2 --quiet --report-memory)
    "$FM" train "${common[@]}" --micro-batch 4 --out "$TMP/$name-one" || bad "$name: one rank failed"
    "$FM" train "${common[@]}" --micro-batch 2 --grad-accum 4 --out "$TMP/$name-twin" ||
        bad "$name: the one-rank twin failed"
    twin=("$TMP/$name-one" "$TMP/$name-twin") # (the later --grad-accum wins)
    timeout 300 "$MPIEXEC" "${FLAGS[@]}" -np 2 "$FM" train "${common[@]}" --micro-batch 2 --zero 3 --out "$TMP/$name-z3" ||
        bad "$name: np 2 --zero 3 failed"
    compare "$TMP/$name-one" "$TMP/$name-z3" 1 "$tol" "${twin[@]}" && ok || bad "$name: np 2 --zero 3 differs from one rank"
    timeout 300 "$MPIEXEC" "${FLAGS[@]}" -np 2 "$FM" train "${common[@]}" --micro-batch 2 --zero 3 --exit-after 6 \
        --out "$TMP/$name-half" || bad "$name: np 2 --zero 3 first half failed"
    "$FM" train "${common[@]}" --micro-batch 4 --resume --out "$TMP/$name-half" || bad "$name: np 1 resume failed"
    compare "$TMP/$name-z3" "$TMP/$name-half" 7 "$tol" "${twin[@]}" && ok || bad "$name: the np 1 resume differs from the np 2 run"
    # --zero 3 --ep 2: the non-expert parameters sharded, each rank's 2 experts whole
    timeout 300 "$MPIEXEC" "${FLAGS[@]}" -np 2 "$FM" train "${common[@]}" --micro-batch 2 --zero 3 --ep 2 \
        --out "$TMP/$name-z3ep" || bad "$name: np 2 --zero 3 --ep 2 failed"
    compare "$TMP/$name-one" "$TMP/$name-z3ep" 1 "$tol" "${twin[@]}" && ok || bad "$name: np 2 --zero 3 --ep 2 differs from one rank"
    timeout 300 "$MPIEXEC" "${FLAGS[@]}" -np 2 "$FM" train "${common[@]}" --micro-batch 2 --zero 3 --ep 2 \
        --exit-after 6 --out "$TMP/$name-z3ep-half" || bad "$name: np 2 --zero 3 --ep 2 first half failed"
    "$FM" train "${common[@]}" --micro-batch 4 --resume --out "$TMP/$name-z3ep-half" ||
        bad "$name: np 1 resume of --zero 3 --ep 2 failed"
    compare "$TMP/$name-z3ep" "$TMP/$name-z3ep-half" 7 "$tol" "${twin[@]}" && ok ||
        bad "$name: the np 1 resume differs from the np 2 --zero 3 --ep 2 run"
done
finish
