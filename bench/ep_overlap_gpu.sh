#!/usr/bin/env bash
# The expert-parallel chunk pipeline on GPUs (src/bounded/fm_moe_ep.h "Overlap"): NP ranks with a
# GPU each, --comm nccl, --ep NP, the pipelined schedule (the default under nccl) against the
# serial one (FLATMOE_EP_SCHEDULE=serial), which does the same arithmetic in the same order:
#   bash bench/ep_overlap_gpu.sh [BUILD_DIR] [TEXT] [NP]    (default build-cuda, the shared
#                                                          tinyshakespeare, 2; needs NP GPUs)
# Runs 20 steps of bench/configs/small-olmoe.json at --micro-batch 4 x 1024 tokens per rank with
# --moe-chunk-tokens 256 (16 chunks per rank and layer), serial twice and pipelined once. Checks:
# the serial run repeats itself exactly (else the kernels are not deterministic and the
# comparison below is to 1e-3 relative instead of exact), the pipelined losses equal the serial
# ones, and prints each run's median step time (steps 5..20) and the pipelined speed-up.
set -u
BUILD=${1:-build-cuda}
TEXT=${2:-/work/shared/data/tinyshakespeare.txt}
NP=${3:-2}
FM=$(readlink -f "$BUILD/flatmoe-cuda")
[ -x "$FM" ] || FM=$(readlink -f "$BUILD/flatmoe")
echo "ep_overlap_gpu: $FM, $NP ranks"
TMP=$(mktemp -d /tmp/flatmoe-ep-overlap.XXXXXX); trap 'rm -rf "$TMP"' EXIT
C=(--config bench/configs/small-olmoe.json --data "$TEXT" --seq-len 1024 --grad-accum 1 --steps 20 --warmup 2
   --lr 1e-3 --eval-every 0 --quiet --no-checkpoint --mem-budget 32GiB --moe-chunk-tokens 256 --micro-batch 4 --ep "$NP" --comm nccl)
MPI=(mpirun --oversubscribe --allow-run-as-root --bind-to none -np "$NP" -x FLATMOE_EP_SCHEDULE)
for run in serial serial_again pipelined; do
    s=${run%_again}
    FLATMOE_EP_SCHEDULE=$s "${MPI[@]}" "$FM" train "${C[@]}" --out "$TMP/$run" > "$TMP/$run.log" 2>&1 ||
        { cat "$TMP/$run.log"; echo "FAIL: the $run run"; exit 1; }
done
python3 - "$TMP" <<'PY'
import json, statistics, sys
d = sys.argv[1]
steps = lambda r: [x for x in map(json.loads, open(f"{d}/{r}/metrics.jsonl")) if x.get("type", "step") == "step"]
s, s2, p = steps("serial"), steps("serial_again"), steps("pipelined")
exact = all(a["loss"] == b["loss"] for a, b in zip(s, s2))
rel = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(s, p))
same = all(a["loss"] == b["loss"] for a, b in zip(s, p)) if exact else rel <= 1e-3
med = lambda r: statistics.median(x["step_s"] for x in r[4:])
print(f"serial repeats itself exactly: {exact}; pipelined vs serial losses: "
      f"{'identical' if rel == 0 else f'within {rel:.2e} relative'}: {'ok' if same else 'FAILED'}")
print(f"median step: serial {med(s):.4f} s, again {med(s2):.4f} s, pipelined {med(p):.4f} s "
      f"(speed-up {med(s) / med(p):.3f}x)")
sys.exit(0 if same and len(p) == 20 else 1)
PY
