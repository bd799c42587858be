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
#  - or, where more, to 5 times the deviation of a one-rank twin (--micro-batch 2 --grad-accum 4) from the
#    one-rank run at that step: a gradient-norm spike is ill-conditioned (on the H200, 2026-12-02, with the
#    README as text, step 10's norm was 2.05 between neighbours of 1.2, and the twin differed there by
#    2.1e-2, --zero 3 by 5.2e-2, --zero 3 --ep 2 by 6.6e-2, while every loss agreed to 5e-5). This twin
#    is not only another summation order: its load-balancing loss is taken over micro-batches of 2
#    sequences (--zero 3's over both ranks' 4), so its router gradients differ for real (on the CPU
#    build in fp32 on tinyshakespeare: aux loss 4e-4 apart at step 1, layer 1's router update 53% of its norm, the
#    gradient norm 2.5e-3 at step 10, where --zero 3 is within 1e-7). These tolerances miss a ZeRO-3
#    bug in a small part of the model: with rank 1's piece of layer 0's gradients dropped under --zero 3
#    (layer 0's experts never trained) every check above passed on the CPU build (worst 4.4e-2 tied,
#    8.6e-3 untied); the next check fails it;
#  - step 1's update of every tensor: model.safetensors (the fp32 master) after step 1 less the
#    initial weights (a run at --lr 1e-30), against one rank's: the elements whose update is off by
#    more than half of one rank's are at most max(25%, 3 x an order twin's) of each tensor. The order
#    twin is the same math in another summation order (--micro-batch 4 with --moe-chunk-tokens 24 and
#    the linear CE in 32 x 64 blocks: the experts' and the head's weight gradients summed otherwise).
#    AdamW's first update is lr x sign(gradient) per element (bias-corrected m / sqrt(v) = g / |g|),
#    so rounding moves only the elements whose gradient is near 0, while a lost gradient, a wrong
#    shard or the update of a wrong range moves all of a tensor's or its piece's (~50-100%);
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
update() { # INIT ONE TWIN RUN...: each RUN's step-1 update per tensor against ONE's (see the header)
    python3 - "$@" <<'PY'
import array, json, math, struct, sys
def tensors(d):
    with open(d + "/step_000001/model.safetensors", "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]; hdr = json.loads(f.read(n)); data = f.read()
    out = {}
    for k, v in hdr.items():
        if k == "__metadata__": continue
        assert v["dtype"] == "F32", (k, v["dtype"])
        s, e = v["data_offsets"]; t = array.array("f"); t.frombytes(data[s:e]); out[k] = t
    return out
w0, one, twin = (tensors(d) for d in sys.argv[1:4])
def off(run, k): # the fraction of tensor k's elements whose update is off by more than half of one rank's
    return sum(abs(r - o) > 0.5 * abs(o - z) for r, o, z in zip(run[k], one[k], w0[k])) / len(one[k])
ok, floor = True, {k: off(twin, k) for k in one}
for d in sys.argv[4:]:
    run, worst, n_bad = tensors(d), (-1.0, ""), 0
    if sorted(run) != sorted(one):
        print(f"FAIL: {d}: other tensors ({len(run)} vs {len(one)})"); ok = False; continue
    for k in one:
        f, tol = off(run, k), max(0.25, 3 * floor[k])
        worst = max(worst, (f, k))
        if f > tol:
            ok = False; n_bad += 1
            if n_bad <= 6: print(f"FAIL: {d}: {k}: step 1's update of {100 * f:.0f}% of the elements is off by more than half of one rank's (> {100 * tol:.0f}%; the order twin's {100 * floor[k]:.1f}%)")
    print(f"{d}: step 1's updates: at most {100 * worst[0]:.1f}% of a tensor's elements off ({worst[1]}; the order twin's at most "
          f"{100 * max(floor.values()):.1f}%), {n_bad} tensors over: " + ("ok" if n_bad == 0 else "FAILED"))
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
    # step 1's update of every tensor: the initial weights (an update of 1e-30), one rank, the order
    # twin and the ranks' runs, each stopped after step 1 with its checkpoint (the 12 steps' schedule)
    s1=(--exit-after 1 --eval-every 0)
    "$FM" train "${common[@]}" "${s1[@]}" --micro-batch 4 --lr 1e-30 --min-lr 0 --out "$TMP/$name-w0" ||
        bad "$name: the initial weights' run failed"
    "$FM" train "${common[@]}" "${s1[@]}" --micro-batch 4 --out "$TMP/$name-one1" || bad "$name: one rank's step 1 failed"
    "$FM" train "${common[@]}" "${s1[@]}" --micro-batch 4 --moe-chunk-tokens 24 --ce-block-tokens 32 --ce-block-vocab 64 \
        --out "$TMP/$name-order1" || bad "$name: the order twin's step 1 failed"
    timeout 300 "$MPIEXEC" "${FLAGS[@]}" -np 2 "$FM" train "${common[@]}" "${s1[@]}" --micro-batch 2 --zero 3 --out "$TMP/$name-z3s1" ||
        bad "$name: np 2 --zero 3 step 1 failed"
    timeout 300 "$MPIEXEC" "${FLAGS[@]}" -np 2 "$FM" train "${common[@]}" "${s1[@]}" --micro-batch 2 --zero 3 --ep 2 \
        --out "$TMP/$name-z3eps1" || bad "$name: np 2 --zero 3 --ep 2 step 1 failed"
    update "$TMP/$name-w0" "$TMP/$name-one1" "$TMP/$name-order1" "$TMP/$name-z3s1" "$TMP/$name-z3eps1" && ok ||
        bad "$name: a tensor's step-1 update under --zero 3 differs from one rank's"
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
