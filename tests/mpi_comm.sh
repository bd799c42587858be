#!/usr/bin/env bash
# The MPI communicator's tests (tests/test_comm_mpi.c) under mpirun, as ctest runs them:
#   bash tests/mpi_comm.sh MPIEXEC TEST_BINARY MODE     MODE: np2 | np4 | timeout | killed
# np2, np4: every collective, groups and bad arguments at 2 and 4 ranks; the job must exit 0.
# timeout: rank 0 skips a collective; ranks 1..3 must get FM_ERR_IO after ~2 s and rank 0 ends the
#   job with MPI_Abort(0) once they agree: exit 0 and "timeout test: passed".
# killed: rank 1 _exit(3)s before a collective; the job must end within 60 s with a non-zero
#   status (Open MPI tears it down when a rank exits non-zero).
# mpirun's flags: tests/lib_mpi.sh.
set -u
source "$(dirname "$0")/lib_mpi.sh"
BIN=$2
out=$(mktemp); trap 'rm -f "$out"' EXIT
run() { # np, then the binary's arguments; sets rc and secs
    local np=$1; shift
    local t0=$SECONDS
    timeout 60 "$MPIEXEC" "${FLAGS[@]}" -np "$np" "$BIN" "$@" >"$out" 2>&1
    rc=$? secs=$((SECONDS - t0))
    cat "$out"
    echo "== mpirun -np $np $* : exit $rc after ${secs} s"
}
case $MODE in
np2) run 2 all; [ $rc -eq 0 ] && [ "$(grep -c ' 0 failed' "$out")" -eq 2 ] ;;
np4) run 4 all; [ $rc -eq 0 ] && [ "$(grep -c ' 0 failed' "$out")" -eq 4 ] ;;
timeout)
    run 4 timeout
    [ $rc -eq 0 ] && grep -q "timeout test: passed" "$out" && [ "$(grep -c 'timed out after 2 s' "$out")" -eq 3 ] ;;
killed)
    run 4 killed
    if [ $rc -eq 0 ] || [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        echo "FAIL: the job with a killed rank ended with status $rc (0: the survivors went on; 124/137: it hung)"
        exit 1
    fi
    grep -q "rank 1: exiting abruptly" "$out" && echo "killed rank: the job ended with status $rc in ${secs} s" ;;
*) echo "unknown mode $MODE"; exit 2 ;;
esac
