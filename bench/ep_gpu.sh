#!/usr/bin/env bash
# Expert parallelism (--ep) on one GPU shared by 2 ranks through the mpi communicator (host-staged
# collectives: a correctness check, not a speed one), against one rank of the same CUDA build:
#   bash bench/ep_gpu.sh [BUILD_DIR] [TEXT]          (default build-cuda, the shared tinyshakespeare)
# Runs 20 steps of bench/configs/small-olmoe.json (E = 8, top-2) at 4 sequences of 256 tokens per
# step: one rank at --micro-batch 4; mpirun -np 2 --micro-batch 2 with --ep 2 (plain, and --llep
# with --llep-min-piece 64), --ep-cap-tokens 128 (4 chunks per rank); and prints every rank's
# dispatch high-water against R_max, the model state per rank, and the worst loss difference
# (bf16: the ranks' reductions and the expert GEMMs' row grouping differ, so expect ~1e-3
# relative, not the CPU's 1e-6; a real bug -- a lost rank's tokens, wrong experts -- is >= 1e-2).
# --mem-budget is given so that both ranks plan the same (each would measure the shared GPU's free
# memory at another moment and could choose other knobs: the EP collectives must match).
set -u
BUILD=${1:-build-cuda}
TEXT=${2:-/work/shared/data/tinyshakespeare.txt}
FM=$(readlink -f "$BUILD/flatmoe-cuda") # the CUDA engine (a CUDA build's plain `flatmoe` is the CPU one)
[ -x "$FM" ] || FM=$(readlink -f "$BUILD/flatmoe")
echo "ep_gpu: $FM"
TMP=$(mktemp -d /tmp/flatmoe-ep-gpu.XXXXXX); trap 'rm -rf "$TMP"' EXIT
C=(--config bench/configs/small-olmoe.json --data "$TEXT" --seq-len 256 --grad-accum 1 --steps 20 --warmup 2
   --lr 1e-3 --eval-every 0 --quiet --no-checkpoint --mem-budget 8GiB --moe-chunk-tokens 128)
MPI=(mpirun --oversubscribe --allow-run-as-root --bind-to none --mca btl self,vader --mca btl_vader_single_copy_mechanism none --mca pml ob1 -np 2)
"$FM" train "${C[@]}" --micro-batch 4 --report-memory --out "$TMP/one" >/dev/null || { echo "one-rank run failed"; exit 1; }
"${MPI[@]}" "$FM" train "${C[@]}" --micro-batch 2 --ep 2 --report-memory --out "$TMP/ep2" | grep "ep dispatch" ||
    { echo "np 2 --ep 2 failed"; exit 1; }
"${MPI[@]}" "$FM" train "${C[@]}" --micro-batch 2 --ep 2 --llep --llep-min-piece 64 --report-memory --out "$TMP/llep" |
    grep "ep dispatch" || { echo "np 2 --ep 2 --llep failed"; exit 1; }
python3 - "$TMP" <<'PY'
import json, sys
d = sys.argv[1]
steps = lambda r: [x for x in map(json.loads, open(f"{d}/{r}/metrics.jsonl")) if x.get("type", "step") == "step"]
a = steps("one")
for run in ("ep2", "llep"):
    b = steps(run)
    worst = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b))
    ms = b[0]["memory"]["model state"]
    print(f"{run}: {len(b)} steps, losses within {worst:.2e} relative of one rank ({a[-1]['loss']:.4f} -> "
          f"{b[-1]['loss']:.4f}); model state per rank {ms['bound']} B (one rank "
          f"{a[0].get('memory', {}).get('model state', {}).get('bound', 'n/a')}); ep_dispatch {b[0].get('ep_dispatch')}")
    if len(b) != 20 or worst > 1e-2: print(f"FAIL: {run}"); sys.exit(1)
print("ep_gpu: passed")
PY
