#!/usr/bin/env bash
# Ulysses sequence parallelism on the GPU (label gpu; $1 is flatmoe-cuda): `mpirun -np 2
# flatmoe-cuda train --sp 2 --micro-batch 4` against one rank at --micro-batch 4 (the same
# sequences per step; each rank holds half of every sequence, attention all-to-alls around the
# cuDNN attention), on the small OLMoE-shaped config (4 heads, 4 kv heads: 2 per rank) and on it
# with 1 kv head (replicated on both ranks, its gradient's copies summed in bf16), at seq-len 256.
# --comm auto: one GPU -> the host-staged mpi communicator, 2+ GPUs -> nccl. The losses must match
# one rank's to bf16 tolerance (1e-2 relative per step, as tests/gpu/cli_comm_ranks.sh), and the
# working set's high-water mark must equal its bound (the head-sharded buffers are planned
# exactly). Also with the FlashAttention-2 fallback (FLATMOE_ATTENTION=fallback), and --ep 2 beside
# --sp 2 on the same two ranks (model state = bound: E/ep experts' state), and packed documents
# (--pack on) at --sp 2. Needs mpirun
# (skipped with a note otherwise).
source "$(dirname "$0")/../lib_cli.sh"
MPIRUN=$(command -v mpirun || true)
if [ -z "$MPIRUN" ]; then echo "note: no mpirun on this machine: --sp runs not tested"; finish; exit $?; fi
FLAGS=(--oversubscribe --allow-run-as-root --bind-to none --mca btl self,vader
       --mca btl_vader_single_copy_mechanism none --mca pml ob1)
python3 -c "import json, sys; c = json.load(open(sys.argv[1])); c['num_key_value_heads'] = 1; json.dump(c, open(sys.argv[2], 'w'))" \
    "$ROOT/bench/configs/small-olmoe.json" "$TMP/kv1.json"
# every memory knob given: the two ranks on one GPU see different free memory, the chooser must not run
common=(--data "$TEXT" --seq-len 256 --micro-batch 4 --steps 6 --warmup 2 --lr 3e-3 --eval-every 0 --eval-batches 1
        --no-checkpoint --comm-timeout 60 --recompute none --moe-chunk-tokens 0 --ce-block-tokens 0 --ce-block-vocab 0
        --offload-boundaries 0 --mem-budget 16GiB --report-memory)
for att in cudnn fallback; do
    for cfg in "$ROOT/bench/configs/small-olmoe.json" "$TMP/kv1.json"; do
        n=$(basename "$cfg" .json)-$att
        export FLATMOE_ATTENTION=$att # cudnn: the cuDNN fused attention; fallback: our FlashAttention-2 kernels
        "$FM" train --config "$cfg" "${common[@]}" --quiet --out "$TMP/one-$n" || bad "one-rank run $n failed"
        timeout 300 "$MPIRUN" "${FLAGS[@]}" -x FLATMOE_ATTENTION -np 2 "$FM" train --config "$cfg" \
            "${common[@]}" --sp 2 --quiet --out "$TMP/sp-$n" > "$TMP/sp-$n.log" 2>&1 ||
            { cat "$TMP/sp-$n.log" >&2; bad "mpirun -np 2 --sp 2 ($n) failed"; continue; }
        python3 - "$TMP/one-$n/metrics.jsonl" "$TMP/sp-$n/metrics.jsonl" "$n" <<'PY' && ok || bad "--sp 2 ($n) differs from one rank beyond 1e-2, or its working set's high-water mark is not its bound"
import json, sys
def steps(p): return [r for r in map(json.loads, open(p)) if r.get("type") == "step"]
a, b = steps(sys.argv[1]), steps(sys.argv[2])
la, lb = [r["loss"] for r in a], [r["loss"] for r in b]
ws = b[0]["memory"]["layer working set"]
print(sys.argv[3], "one rank:", la); print(sys.argv[3], "--sp 2:  ", lb)
print(sys.argv[3], "working set high-water", ws["high_water"], "bound", ws["bound"])
sys.exit(0 if len(la) == len(lb) == 6 and all(abs(x - y) <= 1e-2 * abs(x) for x, y in zip(la, lb))
         and ws["high_water"] == ws["bound"] else 1)
PY
    done
done
# --ep 2 beside --sp 2 on the two ranks (dp 1: the ep group is the sequence's two sp ranks, 4 of the 8
# experts each): the same losses as one rank to bf16 tolerance, the model state's high-water mark
# equal to its bound (E/ep experts' state) and the expert dispatch's within its bound
export FLATMOE_ATTENTION=cudnn
n=small-olmoe-cudnn
timeout 300 "$MPIRUN" "${FLAGS[@]}" -x FLATMOE_ATTENTION -np 2 "$FM" train --config "$ROOT/bench/configs/small-olmoe.json" \
    "${common[@]}" --ep 2 --sp 2 --quiet --out "$TMP/epsp" > "$TMP/epsp.log" 2>&1 ||
    { cat "$TMP/epsp.log" >&2; bad "mpirun -np 2 --ep 2 --sp 2 failed"; }
python3 - "$TMP/one-$n/metrics.jsonl" "$TMP/epsp/metrics.jsonl" <<'PY' && ok || bad "--ep 2 --sp 2 differs from one rank beyond 1e-2, or its memory is not within its bounds"
import json, sys
def steps(p): return [r for r in map(json.loads, open(p)) if r.get("type") == "step"]
a, b = steps(sys.argv[1]), steps(sys.argv[2])
la, lb = [r["loss"] for r in a], [r["loss"] for r in b]
mem = b[0]["memory"]
print("one rank:       ", la); print("--ep 2 --sp 2:  ", lb)
print("model state", mem["model state"], "expert dispatch", mem["expert dispatch"])
sys.exit(0 if len(la) == len(lb) == 6 and all(abs(x - y) <= 1e-2 * abs(x) for x, y in zip(la, lb))
         and mem["model state"]["high_water"] == mem["model state"]["bound"]
         and all(v["high_water"] <= v["bound"] for v in mem.values()) else 1)
PY
# packed documents (issue 28) under --sp 2 on the GPU: 120 documents of 3 to 300 byte tokens
# (tests/packed_docs.py) in rows of 256 whose documents cross the ranks' halves; each rank keeps its
# half of the tokens and RoPE positions and the whole rows' document starts (our attention kernels
# mask at the boundaries: cuDNN's path does not take packed rows). Against one rank, to bf16
# tolerance; the working set's high-water mark equal to its bound.
python3 "$ROOT/tests/packed_docs.py" "$TMP/w" 120 300
unset FLATMOE_ATTENTION
pk=(--data "$TMP/w.bin" --val-fraction 0.2 --pack on "${common[@]:2}")
"$FM" train --config "$ROOT/bench/configs/small-olmoe.json" "${pk[@]}" --quiet --out "$TMP/pone" || bad "one-rank packed run failed"
timeout 300 "$MPIRUN" "${FLAGS[@]}" -np 2 "$FM" train --config "$ROOT/bench/configs/small-olmoe.json" "${pk[@]}" --sp 2 \
    --quiet --out "$TMP/psp" > "$TMP/psp.log" 2>&1 || { cat "$TMP/psp.log" >&2; bad "mpirun -np 2 --sp 2 --pack on failed"; }
python3 - "$TMP/pone/metrics.jsonl" "$TMP/psp/metrics.jsonl" <<'PY' && ok || bad "--sp 2 --pack on differs from one rank beyond 1e-2, or its working set's high-water mark is not its bound"
import json, sys
def steps(p): return [r for r in map(json.loads, open(p)) if r.get("type") == "step"]
a, b = steps(sys.argv[1]), steps(sys.argv[2])
la, lb = [r["loss"] for r in a], [r["loss"] for r in b]
ws = b[0]["memory"]["layer working set"]
print("packed, one rank:", la); print("packed, --sp 2:  ", lb)
print("packed, working set high-water", ws["high_water"], "bound", ws["bound"])
sys.exit(0 if len(la) == len(lb) == 6 and all(abs(x - y) <= 1e-2 * abs(x) for x, y in zip(la, lb))
         and ws["high_water"] == ws["bound"] else 1)
PY
finish
