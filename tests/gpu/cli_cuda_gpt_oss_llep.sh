#!/usr/bin/env bash
# gpt_oss under --ep 2 --llep on the GPU (label gpu; $1 is flatmoe-cuda; issue 26): `mpirun -np 2
# flatmoe-cuda train --ep 2 --llep --llep-lambda 1 --llep-min-piece 1 --micro-batch 2` against one
# rank at --micro-batch 4 on tests/data/gpt_oss_tiny.json (8 experts with biases, the clamped
# SwiGLU, sinks and sliding windows). The placement spills at any imbalance, so the helper rank runs
# the spilled experts with the biases received beside their weights (device copies around one packed
# exchange) and sends their bias gradients back into the native rank's. --comm auto: one GPU -> the
# host-staged mpi communicator, 2+ GPUs -> nccl. The losses must match one rank's to bf16 tolerance
# (1e-2 relative per step, as tests/gpu/cli_comm_ranks.sh), both ranks must report chunk passes that
# moved rows, and every arena's high-water mark must stay within its bound (the expert dispatch's
# LLEP part holds the hosted experts' biases). Needs mpirun (skipped with a note otherwise).
source "$(dirname "$0")/../lib_cli.sh"
MPIRUN=$(command -v mpirun || true)
if [ -z "$MPIRUN" ]; then echo "note: no mpirun on this machine: --ep --llep runs not tested"; finish; exit $?; fi
FLAGS=(--oversubscribe --allow-run-as-root --bind-to none --mca btl self,vader
       --mca btl_vader_single_copy_mechanism none --mca pml ob1)
# every memory knob given: the two ranks on one GPU see different free memory, the chooser must not run
common=(--config "$ROOT/tests/data/gpt_oss_tiny.json" --data "$TEXT" --seq-len 64 --steps 6 --warmup 2 --lr 1e-3
        --eval-every 0 --eval-batches 1 --no-checkpoint --comm-timeout 60 --recompute none --moe-chunk-tokens 0
        --ce-block-tokens 0 --ce-block-vocab 0 --offload-boundaries 0 --mem-budget 4GiB --report-memory)
"$FM" train "${common[@]}" --micro-batch 4 --quiet --out "$TMP/one" || bad "one-rank run failed"
timeout 300 "$MPIRUN" "${FLAGS[@]}" -np 2 "$FM" train "${common[@]}" --micro-batch 2 --ep 2 --llep --llep-lambda 1 \
    --llep-min-piece 1 --out "$TMP/llep" > "$TMP/llep.log" 2>&1 ||
    { cat "$TMP/llep.log" >&2; bad "mpirun -np 2 --ep 2 --llep failed"; }
for q in 0 1; do
    grep -qE "^rank $q of 2: ep dispatch: .*LLEP chunk passes that moved rows [1-9]" "$TMP/llep.log" && ok ||
        bad "--llep: rank $q moved no rows: $(grep "rank $q of 2: ep dispatch" "$TMP/llep.log" | tail -1)"
done
python3 - "$TMP/one/metrics.jsonl" "$TMP/llep/metrics.jsonl" <<'PY' && ok || bad "--ep 2 --llep differs from one rank beyond 1e-2, or an arena's high-water mark passed its bound"
import json, sys
def steps(p): return [r for r in map(json.loads, open(p)) if r.get("type") == "step"]
a, b = steps(sys.argv[1]), steps(sys.argv[2])
la, lb = [r["loss"] for r in a], [r["loss"] for r in b]
mem = b[0]["memory"]
print("one rank:        ", la); print("--ep 2 --llep:   ", lb)
print("expert dispatch", mem["expert dispatch"])
sys.exit(0 if len(la) == len(lb) == 6 and all(abs(x - y) <= 1e-2 * abs(x) for x, y in zip(la, lb))
         and all(v["high_water"] <= v["bound"] for v in mem.values()) else 1)
PY
finish
