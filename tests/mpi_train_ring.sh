#!/usr/bin/env bash
# Ring-DTP in the trainer (--vocab-parallel ring; README "Many ranks", bounded/fm_linear_ce_ring.h)
# under mpirun, as ctest runs it:
#   bash tests/mpi_train_ring.sh MPIEXEC FLATMOE MODE      MODE: np2 | np4 | bad
# Every run trains 20 steps with the flag and is compared with one rank WITHOUT it (the one-rank
# linear cross-entropy over the whole head, the same blocks) by tests/mpi_compare.py: losses, aux,
# z and validation to 1e-6 relative, grad norm to 1e-3 (see compare below), final weights and Adam
# state to 5e-4 of each tensor's scale (tests/mpi_train.sh's tolerances and their reasons). One rank's reference
# runs at the micro-batch of all the data-parallel ranks together.
# np2: -np 2 dp 2 on tests/data/micro.json (tied embeddings, V 256: two shards of 128 rows),
#   moving activations (N = 64 tokens per rank <= V/P) and moving weight shards (seq-len 64,
#   N = 256 > V/P); an untied head with V = 257 (shards 129 and 128); --zero 1; --zero 3 (the
#   head group gathered as for the one-rank op, each rank computing with its shard's rows); the
#   default blocks (no --ce-block flag); -np 2 --sp 2; -np 2 --ep 2; 10 ring steps at np 2 resumed
#   for 10 at one rank without the flag against 20 one-rank steps. The vocabulary live set's
#   --report-memory high-water mark equals its bound and `flatmoe plan --vocab-parallel ring`'s
#   figure for it (both modes, and with --zero 3 the model state's too), every other live set
#   within its bound.
# np4: -np 4 dp 4 (activations), dp 4 moving weights, -np 4 --sp 2 (dp 2 x sp 2), the untied
#   V = 257 head (shards 65, 65, 65, 62) under --zero 0 and --zero 3, --ep 2 --sp 2, each against
#   one rank; high-water == plan at np 4.
# bad: the flag on one rank only, an unknown value (train and plan), plain logits with the flag:
#   each a clear error naming the flag.
set -u
source "$(dirname "$0")/lib_mpi.sh"
mpi_tmp mpi-ring
MICRO="$ROOT/tests/data/micro.json" SP="$ROOT/tests/data/micro_sp.json"
UNTIED="$TMP/untied.json" # micro.json with its own LM head and V = 257 (byte tokens use 0..255)
python3 -c "import json, sys; c = json.load(open(sys.argv[1])); c.update(tie_word_embeddings=False, vocab_size=257);
json.dump(c, open(sys.argv[2], 'w'))" "$MICRO" "$UNTIED"
COMMON=(--grad-accum 2 --steps 20 --warmup 2 --lr 3e-3 --eval-every 10 --eval-batches 2 --threads 1 --quiet --expert-counts-every 1)
CE=(--ce-block-tokens 16 --ce-block-vocab 64)
# compare REF RUN: grad norm to 1e-3 (tests/mpi_train_sp.sh's reason: a token whose router scores
# nearly tie may pick another expert when sums run in another order; on the fortunes text, the
# fallback data, plain -np 2 dp at seq-len 64 WITHOUT the ring moves step 17's norm by 1.35e-4
# while the losses stay within 1e-7), the rest at mpi_compare.py's tolerances
compare() { python3 "$ROOT/tests/mpi_compare.py" "$1" "$2" --grad-norm-tol 1e-3; }
# memory RUN PLAN_FLAGS...: the vocabulary set's high-water == its bound == the plan's figure;
# every live set within its bound
memory() {
    local run=$1 plan; shift
    plan=$("$FM" plan --recompute none --moe-chunk-tokens 0 --offload-boundaries 0 --vocab-parallel ring --json "$@" \
        2>/dev/null) || { bad "plan --vocab-parallel ring $*: failed"; return 1; }
    python3 - "$run/metrics.jsonl" "$plan" <<'PY'
import json, sys
mem = [r for r in map(json.loads, open(sys.argv[1])) if r.get("type", "step") == "step"][0]["memory"]
plan = json.loads(sys.argv[2])
ok = all(v["high_water"] <= v["bound"] for v in mem.values())
v = mem["vocabulary projection"]
planned = plan["live_sets"]["vocabulary projection"]
ok = ok and v["high_water"] == v["bound"] == planned and mem["model state"]["bound"] == plan["live_sets"]["model state"]
print(f"memory: vocabulary high-water {v['high_water']} B, bound {v['bound']} B, plan {planned} B; model state bound "
      f"{mem['model state']['bound']} B, plan {plan['live_sets']['model state']} B; all within bounds: "
      + ("ok" if ok else "FAILED " + json.dumps(mem)))
sys.exit(0 if ok else 1)
PY
}
one() { # out config seq-len micro-batch, extra flags: the one-rank linear CE, no ring
    local out=$1 cfg=$2 T=$3 B=$4; shift 4
    "$FM" train --config "$cfg" --data "$TEXT" --seq-len "$T" --micro-batch "$B" "${COMMON[@]}" "$@" --out "$out" \
        >/dev/null || bad "one-rank $out failed"
}
# ring NP out config seq-len micro-batch, extra flags: the ring run, checked against REF ($REF)
ring() {
    local np=$1 out=$2 cfg=$3 T=$4 B=$5; shift 5
    mpi "$np" train --config "$cfg" --data "$TEXT" --seq-len "$T" --micro-batch "$B" "${COMMON[@]}" --vocab-parallel ring \
        "$@" --out "$out" || { bad "np $np ring $out failed"; return 1; }
    compare "$REF" "$out" || bad "np $np --vocab-parallel ring ($(basename "$out")) differs from the one-rank linear CE"
}
case $MODE in
np2)
    one "$TMP/one_a" "$MICRO" 32 4 "${CE[@]}"
    REF=$TMP/one_a ring 2 "$TMP/act" "$MICRO" 32 2 "${CE[@]}" --report-memory
    memory "$TMP/act" --config "$MICRO" --seq-len 32 --micro-batch 2 --dp 2 "${CE[@]}" || bad "np 2 activations: memory"
    REF=$TMP/one_a ring 2 "$TMP/z1" "$MICRO" 32 2 "${CE[@]}" --zero 1
    REF=$TMP/one_a ring 2 "$TMP/z3" "$MICRO" 32 2 "${CE[@]}" --zero 3 --report-memory
    memory "$TMP/z3" --config "$MICRO" --seq-len 32 --micro-batch 2 --dp 2 --zero 3 "${CE[@]}" || bad "np 2 --zero 3: memory"
    REF=$TMP/one_a ring 2 "$TMP/ep" "$MICRO" 32 2 "${CE[@]}" --ep 2
    one "$TMP/one_sp" "$SP" 32 4 "${CE[@]}"
    REF=$TMP/one_sp ring 2 "$TMP/sp" "$SP" 32 4 "${CE[@]}" --sp 2
    one "$TMP/one_w" "$MICRO" 64 8 "${CE[@]}"
    REF=$TMP/one_w ring 2 "$TMP/wts" "$MICRO" 64 4 "${CE[@]}" --report-memory
    grep -q '"vocabulary projection"' "$TMP/wts/metrics.jsonl" || bad "np 2 weights: no memory record"
    memory "$TMP/wts" --config "$MICRO" --seq-len 64 --micro-batch 4 --dp 2 "${CE[@]}" || bad "np 2 weights: memory"
    one "$TMP/one_u" "$UNTIED" 32 4 "${CE[@]}"
    REF=$TMP/one_u ring 2 "$TMP/untied" "$UNTIED" 32 2 "${CE[@]}"
    one "$TMP/one_d" "$MICRO" 32 4 --ce-block-tokens 1024 --ce-block-vocab 4096 # the flag's default blocks
    REF=$TMP/one_d ring 2 "$TMP/dflt" "$MICRO" 32 2
    # 10 steps at np 2 with the ring, 10 more at one rank without it: 20 one-rank steps (checkpoints
    # hold the whole head whatever the shards)
    mpi 2 train --config "$MICRO" --data "$TEXT" --seq-len 32 --micro-batch 2 "${COMMON[@]}" "${CE[@]}" --vocab-parallel ring \
        --exit-after 10 --out "$TMP/res" || bad "np 2 ring first half failed"
    "$FM" train --config "$MICRO" --data "$TEXT" --seq-len 32 --micro-batch 4 "${COMMON[@]}" "${CE[@]}" --resume \
        --out "$TMP/res" >/dev/null 2>"$TMP/res.err" || bad "np 1 resume of a ring run failed: $(cat "$TMP/res.err")"
    compare "$TMP/one_a" "$TMP/res" || bad "np 2 ring -> np 1 differs from 20 one-rank steps" ;;
np4)
    one "$TMP/one_a" "$MICRO" 32 4 "${CE[@]}"
    REF=$TMP/one_a ring 4 "$TMP/act" "$MICRO" 32 1 "${CE[@]}" --report-memory
    memory "$TMP/act" --config "$MICRO" --seq-len 32 --micro-batch 1 --dp 4 "${CE[@]}" || bad "np 4 activations: memory"
    one "$TMP/one_w" "$MICRO" 64 8 "${CE[@]}"
    REF=$TMP/one_w ring 4 "$TMP/wts" "$MICRO" 64 2 "${CE[@]}" --report-memory
    memory "$TMP/wts" --config "$MICRO" --seq-len 64 --micro-batch 2 --dp 4 "${CE[@]}" || bad "np 4 weights: memory"
    one "$TMP/one_sp" "$SP" 32 4 "${CE[@]}"
    REF=$TMP/one_sp ring 4 "$TMP/sp" "$SP" 32 2 "${CE[@]}" --sp 2 --report-memory
    memory "$TMP/sp" --config "$SP" --seq-len 32 --micro-batch 2 --dp 2 --sp 2 --zero 0 "${CE[@]}" ||
        bad "np 4 --sp 2: memory"
    one "$TMP/one_u" "$UNTIED" 32 4 "${CE[@]}"
    REF=$TMP/one_u ring 4 "$TMP/untied" "$UNTIED" 32 1 "${CE[@]}"
    REF=$TMP/one_u ring 4 "$TMP/untied_z3" "$UNTIED" 32 1 "${CE[@]}" --zero 3 --report-memory
    memory "$TMP/untied_z3" --config "$UNTIED" --seq-len 32 --micro-batch 1 --dp 4 --zero 3 "${CE[@]}" ||
        bad "np 4 --zero 3 untied: memory"
    one "$TMP/one_m" "$MICRO" 32 4 "${CE[@]}"
    REF=$TMP/one_m ring 4 "$TMP/epsp" "$MICRO" 32 2 "${CE[@]}" --ep 2 --sp 2 ;;
bad)
    expect() { # np, needle, then train's flags
        local np=$1 needle=$2; shift 2
        out=$(mpi "$np" train --config "$MICRO" --data "$TEXT" --seq-len 32 --micro-batch 2 "${COMMON[@]}" --out "$TMP/bad" \
            "$@" 2>&1); rc=$?
        if [ $rc -eq 0 ] || ! grep -qF -- "$needle" <<<"$out"; then bad "np $np $*: rc $rc, no '$needle': $out"
        else echo "ok: np $np $*: $(grep -m1 -F -- "$needle" <<<"$out")"; fi
    }
    expect 2 "--vocab-parallel: expected off or ring, found 'tensor'" --vocab-parallel tensor
    expect 2 "--vocab-parallel ring with --ce-block-tokens 0 --ce-block-vocab 0 (plain logits)" --vocab-parallel ring \
        --ce-block-tokens 0 --ce-block-vocab 0
    # the flag on rank 1 only: the ranks' flags are compared before any other collective
    export FM MICRO TEXT TMP
    cmd='x=; [ "$OMPI_COMM_WORLD_RANK" = 1 ] && x="--vocab-parallel ring"; exec "$FM" train --config "$MICRO" --data "$TEXT" --seq-len 32 --micro-batch 2 --steps 2 --threads 1 --quiet --ce-block-tokens 16 --comm-timeout 20 --out "$TMP/one_rank" $x'
    out=$(timeout 60 "$MPIEXEC" "${FLAGS[@]}" -np 2 bash -c "$cmd" 2>&1); rc=$?
    needle="--vocab-parallel differs between the ranks of this launch"
    if [ $rc -eq 0 ] || [ $rc -eq 124 ] || ! grep -qF -- "$needle" <<<"$out"; then bad "flag on one rank: rc $rc: $out"
    else echo "ok: flag on one rank: $(grep -m1 -F -- "$needle" <<<"$out")"; fi
    out=$("$FM" plan --config "$MICRO" --seq-len 32 --dp 2 --vocab-parallel ring --ce-block-tokens 0 --ce-block-vocab 0 2>&1)
    rc=$?
    { [ $rc -ne 0 ] && grep -qF -- "--vocab-parallel ring with --ce-block-tokens 0 --ce-block-vocab 0" <<<"$out"; } ||
        bad "plan --vocab-parallel ring with plain logits: rc $rc: $out"
    out=$("$FM" plan --config "$MICRO" --seq-len 32 --dp 2 --vocab-parallel tensor 2>&1); rc=$?
    { [ $rc -ne 0 ] && grep -qF -- "--vocab-parallel: expected off or ring" <<<"$out"; } ||
        bad "plan --vocab-parallel tensor: rc $rc: $out" ;;
*) echo "unknown mode $MODE"; exit 2 ;;
esac
mpi_finish "mpi_train_ring $MODE"
