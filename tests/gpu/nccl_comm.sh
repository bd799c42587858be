#!/usr/bin/env bash
# The nccl communicator's multi-rank tests (tests/gpu/test_comm_nccl.c; label gpu), as ctest runs them:
#   bash tests/gpu/nccl_comm.sh MPIEXEC TEST_BINARY MODE     MODE: np2 | timeout
# np2: every collective at 2 ranks, one GPU each (a rank that sends and receives nothing in
#   all_to_all_v included); the job must exit 0 with "0 failed" on both ranks.
# timeout: rank 1 never joins; rank 0's collective must fail after ~2 s with FM_ERR_IO naming the
#   rank, the collective and the timeout (collective mode, and deferred mode at the backend's
#   stream_sync); "timeout test: passed".
# NCCL cannot put two ranks on one GPU: with fewer than 2 GPUs both modes SKIP (exit 77) with a
# message saying so (the one-rank test, test_comm_nccl one, runs on any GPU).
set -u
MPIEXEC=$1 BIN=$2 MODE=$3
ndev=$("$BIN" devices 2>/dev/null || echo 0)
if [ "${ndev:-0}" -lt 2 ]; then
    echo "SKIP: nccl_comm $MODE needs 2 GPUs (one per rank; NCCL cannot share a GPU between ranks), found ${ndev:-0}"
    exit 77
fi
FLAGS=(--oversubscribe --allow-run-as-root --bind-to none --mca btl self,vader
       --mca btl_vader_single_copy_mechanism none --mca pml ob1)
out=$(mktemp); trap 'rm -f "$out"' EXIT
t0=$SECONDS
timeout 120 "$MPIEXEC" "${FLAGS[@]}" -np 2 "$BIN" $([ "$MODE" = np2 ] && echo all || echo timeout) >"$out" 2>&1
rc=$?
cat "$out"
echo "== mpirun -np 2 $MODE: exit $rc after $((SECONDS - t0)) s"
case $MODE in
np2) [ $rc -eq 0 ] && [ "$(grep -c ' 0 failed' "$out")" -eq 2 ] ;;
timeout) [ $rc -eq 0 ] && grep -q "timeout test: passed" "$out" ;;
*) echo "unknown mode $MODE"; exit 2 ;;
esac
