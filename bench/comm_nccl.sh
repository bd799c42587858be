#!/usr/bin/env bash
# The nccl communicator's overhead with one rank, against today's single-rank path (no
# communicator: the self one), on the training step (issue "Many ranks", Must show):
#   bash bench/comm_nccl.sh            (on the H200, from the repository root)
# For each config (CONFIGS: bench/configs/small-olmoe.json at T=256 x 8 sequences, where fixed
# costs show, and configs/olmoe-1b-7b.json at T=4096 x 1, the real shape), runs STEPS (default
# 30) steps four ways: self (no --comm), --comm nccl (deferred checks: collectives enqueued on the
# stream, checked at the step's sync points), --comm nccl --comm-check collective (each collective
# waited for: a host sync per collective, the router's statistics per layer included), and
# --comm mpi (host-staged through MPI), and prints the median step time over the steps after the
# first 5, with its ratio to self, and the host syncs per step. FLATMOE_ATTENTION=fallback keeps
# runs bit-comparable; the script also checks that the losses agree bit for bit with self.
# Environment: STEPS, OUTDIR (default /tmp/bench-comm-nccl), REBUILD=0 reuses build-gpu.
set -uo pipefail
STEPS=${STEPS:-30}
OUTDIR=${OUTDIR:-/tmp/bench-comm-nccl}
mkdir -p "$OUTDIR"
D=/tmp/flatmoe-deps-root
if [ -d .deps ] && [ ! -d $D ]; then for f in .deps/*.deb; do dpkg -x "$f" $D; done; fi
export LD_LIBRARY_PATH="$D/usr/lib/x86_64-linux-gnu/openblas-openmp:$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
if [ ! -x build-gpu/flatmoe-cuda ] || [ "${REBUILD:-1}" = 1 ]; then
    cmake -S . -B build-gpu -DFLATMOE_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_INCLUDE_PATH=$D/usr/include \
        "-DCMAKE_LIBRARY_PATH=$D/usr/lib/x86_64-linux-gnu/openblas-openmp;$D/usr/lib/x86_64-linux-gnu" | grep -i "nccl\|mpi"
    cmake --build build-gpu -j"$(nproc)" --target flatmoe-cuda 2>&1 | grep -E " error"; ls build-gpu/flatmoe-cuda >/dev/null || exit 1
fi
TEXT=${TEXT:-.data/tinyshakespeare.txt}
[ -f "$TEXT" ] || TEXT=../shared/data/tinyshakespeare.txt
export FLATMOE_ATTENTION=fallback
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
median() { # metrics.jsonl: median step_s and host_syncs of the steps after the first 5
    python3 - "$1" <<'PY'
import json, sys, statistics
rs = [json.loads(l) for l in open(sys.argv[1]) if '"type":"step"' in l][5:]
print("%.6f %d" % (statistics.median(r["step_s"] for r in rs), statistics.median(r["host_syncs"] for r in rs)))
PY
}
losses() { grep '"type":"step"' "$1" | grep -o '"loss":[^,]*,"aux_loss":[^,]*,"z_loss":[^,]*' ; }
printf "| config | T x B | communicator | median step (s) | vs self | host syncs/step | losses = self |\n|---|---|---|---|---|---|---|\n" > "$OUTDIR/table.md"
for spec in "bench/configs/small-olmoe.json 256 8" "configs/olmoe-1b-7b.json 4096 1"; do
    read -r cfg T B <<<"$spec"
    name=$(basename "$cfg" .json)
    base=""
    for variant in self nccl nccl-collective mpi; do
        case $variant in
        self) extra=() ;; nccl) extra=(--comm nccl) ;;
        nccl-collective) extra=(--comm nccl --comm-check collective) ;; mpi) extra=(--comm mpi) ;;
        esac
        out="$OUTDIR/$name-$variant"
        rm -rf "$out"
        build-gpu/flatmoe-cuda train --config "$cfg" --data "$TEXT" --seq-len "$T" --micro-batch "$B" --steps "$STEPS" \
            --warmup 2 --lr 1e-4 --min-lr 1e-5 --eval-every 0 --eval-batches 1 --no-checkpoint --quiet \
            "${extra[@]}" --out "$out" > "$out.log" 2>&1
        rc=$?
        if [ $rc -ne 0 ]; then echo "$name $variant: exit $rc"; tail -3 "$out.log"; continue; fi
        read -r med syn <<<"$(median "$out/metrics.jsonl")"
        [ -z "$base" ] && base=$med
        same=$([ "$variant" = self ] && echo - || { cmp -s <(losses "$OUTDIR/$name-self/metrics.jsonl") <(losses "$out/metrics.jsonl") && echo yes || echo NO; })
        ratio=$(python3 -c "print('%.3f' % ($med / $base))")
        echo "$name T=$T B=$B $variant: median step ${med} s (x$ratio of self), host syncs/step $syn, losses = self: $same"
        printf "| %s | %s x %s | %s | %s | %s | %s | %s |\n" "$name" "$T" "$B" "$variant" "$med" "$ratio" "$syn" "$same" >> "$OUTDIR/table.md"
    done
done
cat "$OUTDIR/table.md"
