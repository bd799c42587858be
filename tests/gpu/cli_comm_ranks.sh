#!/usr/bin/env bash
# Two GPU ranks in the trainer (label gpu; $1 is flatmoe-cuda): `mpirun -np 2 flatmoe-cuda train
# --micro-batch 2` against one rank at --micro-batch 4 (the same sequences per step), on the small
# OLMoE-shaped config. --comm auto must pick the communicator by the GPUs: on one GPU the two ranks
# share it through the host-staged mpi communicator (NCCL cannot put two ranks on one GPU); with
# 2+ GPUs each rank takes the GPU of its node-local rank and auto picks nccl. The losses must
# match one rank's to bf16 tolerance (1e-2 relative per step: the gradients are summed in bf16 in
# another order). Needs mpirun (skipped with a note otherwise).
source "$(dirname "$0")/../lib_cli.sh"
export FLATMOE_ATTENTION=fallback
MPIRUN=$(command -v mpirun || true)
if [ -z "$MPIRUN" ]; then echo "note: no mpirun on this machine: two-rank runs not tested"; finish; exit $?; fi
FLAGS=(--oversubscribe --allow-run-as-root --bind-to none --mca btl self,vader
       --mca btl_vader_single_copy_mechanism none --mca pml ob1)
cfg="$ROOT/bench/configs/small-olmoe.json"
common=(--config "$cfg" --data "$TEXT" --seq-len 64 --steps 6 --warmup 2 --lr 3e-3 --eval-every 0 --eval-batches 1
        --no-checkpoint --comm-timeout 60)
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); ngpu=${ngpu:-0}
want=$([ "$ngpu" -ge 2 ] && echo nccl || echo mpi)
"$FM" train "${common[@]}" --micro-batch 4 --quiet --out "$TMP/one" || bad "one-rank run failed"
timeout 300 "$MPIRUN" "${FLAGS[@]}" -np 2 "$FM" train "${common[@]}" --micro-batch 2 --out "$TMP/two" > "$TMP/two.log" 2>&1 ||
    { cat "$TMP/two.log" >&2; bad "mpirun -np 2 run failed"; }
grep -q "^communicator: $want over 2 ranks" "$TMP/two.log" && ok ||
    { grep "^communicator" "$TMP/two.log" >&2; bad "--comm auto on $ngpu GPU(s) should pick $want"; }
python3 - "$TMP/one/metrics.jsonl" "$TMP/two/metrics.jsonl" <<'PY' && ok || bad "two-rank losses differ from one rank's beyond 1e-2"
import json, sys
def losses(p): return [json.loads(l)["loss"] for l in open(p) if '"type":"step"' in l]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
print("one rank:", a); print("two ranks:", b)
sys.exit(0 if len(a) == len(b) == 6 and all(abs(x - y) <= 1e-2 * abs(x) for x, y in zip(a, b)) else 1)
PY
finish
