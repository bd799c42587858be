#!/usr/bin/env bash
# glm4_moe's aux-loss-free balancing across ranks (train/fm_router_bias.h), as ctest runs it:
#   bash tests/mpi_glm4.sh MPIEXEC FLATMOE
# 20 steps of tests/data/glm4_tiny.json with --moe-router-bias-update-rate 0.01 at np 2 (replicas,
# --micro-batch 2 each), at np 2 --ep 2, --zero 1 and --zero 3 (each rank moves the bias elements
# of its own shard) against one rank at --micro-batch 4: the step's expert
# loads are summed over the ranks before the bias moves, so every rank's bias is the one rank's
# (the final e_score_correction_bias of every MoE layer equal to the one rank's within 1e-6:
# each move is +-0.01 or 0 from integer counts, the same on every rank unless a near-tie of the
# router flips a token, which tests/mpi_compare.py's tolerances also allow), losses to 1e-6 and
# tensors as tests/mpi_train.sh; and the bias did move (else the check is empty). --zero 3 without
# the rate against one rank as well.
set -u
source "$(dirname "$0")/lib_mpi.sh"
mpi_tmp mpi-glm4
COMMON=(--config "$ROOT/tests/data/glm4_tiny.json" --data "$TEXT" --seq-len 32 --steps 20 --warmup 2 --lr 3e-3
        --eval-every 10 --eval-batches 2 --threads 1 --quiet --expert-counts-every 1 --moe-router-bias-update-rate 0.01)
"$FM" train "${COMMON[@]}" --micro-batch 4 --out "$TMP/one" >/dev/null || bad "one-rank run failed"
for run in "ep1:--ep 1" "ep2:--ep 2" "zero1:--zero 1" "zero3:--zero 3"; do
    ep=${run%%:*}; flags=(${run#*:})
    mpi 2 train "${COMMON[@]}" --micro-batch 2 "${flags[@]}" --out "$TMP/$ep" >/dev/null || bad "np 2 ${flags[*]} failed"
    compare "$TMP/one" "$TMP/$ep" || bad "np 2 ${flags[*]} differs from one rank at --micro-batch 4"
    python3 - "$TMP/one/step_000020/model.safetensors" "$TMP/$ep/step_000020/model.safetensors" <<'PY' ||
import json, struct, sys
def biases(p):
    f = open(p, "rb"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n)); out = {}
    for k, v in h.items():
        if k.endswith("e_score_correction_bias"):
            a, b = v["data_offsets"]; f.seek(8 + n + a); out[k] = struct.unpack(f"<{(b - a) // 4}f", f.read(b - a))
    return out
a, b = biases(sys.argv[1]), biases(sys.argv[2])
assert sorted(a) == sorted(b) and len(a) == 2, (sorted(a), sorted(b))
d = max(abs(x - y) for k in a for x, y in zip(a[k], b[k]))
moved = max(abs(x) for k in a for x in a[k])
print(f"bias: max |one rank - np 2| = {d:.3g}, largest |bias| {moved:.3g}")
sys.exit(0 if d <= 1e-6 and moved >= 0.01 else 1)
PY
        bad "np 2 ${flags[*]}: the selection bias differs from one rank's, or never moved"
done
# --zero 3 without the rate (the shared expert and the bias sharded with their layer's group)
NORATE=("${COMMON[@]:0:${#COMMON[@]}-2}")
"$FM" train "${NORATE[@]}" --micro-batch 4 --out "$TMP/one0" >/dev/null || bad "one-rank run without the rate failed"
mpi 2 train "${NORATE[@]}" --micro-batch 2 --zero 3 --out "$TMP/z3r0" >/dev/null || bad "np 2 --zero 3 failed"
compare "$TMP/one0" "$TMP/z3r0" || bad "np 2 --zero 3 differs from one rank at --micro-batch 4"
mpi_finish mpi_glm4
