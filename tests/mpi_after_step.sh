#!/usr/bin/env bash
# bash tests/mpi_after_step.sh RUN_DIR [SECONDS]: returns once RUN_DIR/metrics.jsonl holds a step
# record (rank 0 writes it: MPI is up and the setup's collectives are done on every rank), then
# SECONDS more (default 1), so that a signal sent after it lands mid-run; it stops waiting after
# 60 s. The failure tests' ranks signal themselves after it rather than a fixed time after their
# start: a SIGSTOP landing in MPI_Init (which has no timeout) hung the job, and a SIGTERM landing
# before the first step stops without a checkpoint; a slow machine's setup can take seconds.
set -u
for _ in $(seq 600); do
    grep -qsF '"type":"step"' "$1/metrics.jsonl" && break
    sleep 0.1
done
sleep "${2:-1}"
