#!/usr/bin/env bash
# libflatmoe across ranks (include/flatmoe.h "many ranks"; docs/rl.md), as ctest runs it:
#   bash tests/mpi_capi.sh MPIEXEC TEST_CAPI_MPI MODE      MODE: dp | zero1 | ep2 | python
# tests/test_capi_mpi.c once on one rank (the whole 8-sequence batch at --micro-batch 4) and once
# at np 2 (each rank half of the sequences at --micro-batch 2): dp replicas, --zero 1 (the
# optimizer state sharded), or --ep 2 (two experts per rank); tests/capi_mpi_compare.py then holds
# the two to: the log-probs and entropies per global token, before and after two PG steps (token-mean
# and seq-mean-token-mean: the global denominators), the steps' loss terms and statistics, the
# loss-token and sequence counts exactly, the gradient norm, every saved fp32 tensor, and each run's
# collective export equal to its own checkpoint rounded to bf16 (tolerances: the compare script).
# python: python/test_flatmoe_mpi.py through the binding (FLATMOE_LIB) at np 1 and np 2 under
# mpirun, the library initializing MPI and the binding finalizing it at exit: log-probs per global
# token within 2e-5, an SFT and a PG step's loss within 1e-5 relative and their loss-token and
# sequence counts exactly (the compare script's reasons); skipped (77) where no python3 imports numpy.
set -u
source "$(dirname "$0")/lib_mpi.sh"
mpi_tmp mpi-capi
export FLATMOE_SOURCE_DIR="$ROOT"
if [ "$MODE" = python ]; then
    # not under the sanitized build (pass S): python3 is not built with ASan, whose runtime must
    # come first in the process (python/run_test.sh skips the same way)
    if [ "${FLATMOE_TEST_SANITIZED:-0}" = 1 ]; then echo "sanitized build: the binding's test is skipped"; exit 77; fi
    PY=""
    for p in python3 /usr/bin/python3; do command -v "$p" >/dev/null && "$p" -c "import numpy" 2>/dev/null && { PY=$p; break; }; done
    [ -n "$PY" ] || { echo "no python3 here imports numpy: skipped"; exit 77; }
    export PYTHONPATH="$ROOT/python" FLATMOE_LIB
    mkdir -p "$TMP/ref" "$TMP/run"
    FM=$PY
    mpi 1 "$ROOT/python/test_flatmoe_mpi.py" "$TMP/ref" || bad "the binding at np 1 failed"
    mpi 2 "$ROOT/python/test_flatmoe_mpi.py" "$TMP/run" || bad "the binding at np 2 failed (or a rank did not finalize MPI)"
    python3 - "$TMP/ref" "$TMP/run" <<'PY' || bad "the binding at np 2 differs from np 1"
import glob, sys
def read(d):
    lp, st = {}, {}
    for fn in glob.glob(d + "/py_rank*.txt"):
        for ln in open(fn):
            p = ln.split()
            if p[0] == "lp": lp[int(p[1])] = float(p[2])
            else: st.setdefault(int(p[1]), []).append((float(p[2]), float(p[3]), int(p[4]), int(p[5])))
    return lp, st
(la, sa), (lb, sb) = read(sys.argv[1]), read(sys.argv[2])
ok = set(la) == set(lb) and len(la) == 128
d = max(abs(la[t] - lb[t]) for t in la) if ok else float("inf")
ok = ok and d <= 2e-5
for k in (1, 2):
    r = sa[k][0]
    for s in sb[k]:
        ok = ok and abs(s[0] - r[0]) <= 1e-5 * abs(r[0]) and abs(s[1] - r[1]) <= 1e-3 * r[1] and s[2:] == r[2:]
print(f"binding np 2 vs np 1: worst log-prob {d:.2e}, steps {sb} vs {sa}: " + ("ok" if ok else "FAILED"))
sys.exit(0 if ok else 1)
PY
    mpi_finish "mpi_capi_python"
    exit
fi
case "$MODE" in
    dp) EXTRA=() ;;
    zero1) EXTRA=(--zero 1) ;;
    ep2) EXTRA=(--ep 2) ;;
    *) echo "mpi_capi.sh: unknown mode '$MODE' (dp | zero1 | ep2)" >&2; exit 2 ;;
esac
mkdir -p "$TMP/ref" "$TMP/run"
"$FM" "$TMP/ref" || bad "the one-rank run failed"
mpi 2 "$TMP/run" "${EXTRA[@]}" || bad "the np 2 run (${EXTRA[*]:-dp}) failed"
python3 "$ROOT/tests/capi_mpi_compare.py" "$TMP/ref" "$TMP/run" || bad "np 2 ${EXTRA[*]:-dp} differs from one rank"
mpi_finish "mpi_capi_$MODE"
