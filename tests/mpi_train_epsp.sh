#!/usr/bin/env bash
# Expert parallelism beside Ulysses sequence parallelism in the trainer (--ep E --sp S, --zero 0 or 3;
# README "Many ranks") under mpirun, as ctest runs it:
#   bash tests/mpi_train_epsp.sh MPIEXEC FLATMOE MODE      MODE: runs | adversarial | resume | bad
# The world is dp x sp ranks (sp groups: contiguous blocks of S); the ep groups are contiguous
# blocks of E ranks drawn from the same world, so an ep group may hold ranks of other sequence
# slices (np 4 --ep 4 --sp 2) or exactly one sequence's slices (np 4 --ep 2 --sp 2).
# runs: 20 steps of tests/data/micro_sp.json (4 heads, 2 kv heads, E = 4 experts, top-2) at
#   np 4 --ep 2 --sp 2 (dp 2), np 4 --ep 4 --sp 2 (dp 2; one expert per rank) and np 2 --ep 2 --sp 2
#   (dp 1) give the losses of one rank at --micro-batch 4 to 1e-6 relative (loss, aux, z, validation;
#   grad norm 1e-5; final weights and Adam state within 5e-4 of each tensor's scale: tests/mpi_train.sh
#   says why), under the checkpoint's full Hugging Face names; each rank's model state is E/ep
#   experts' (its high-water mark equal to its bound, 16 B/param of the local table); every live
#   set's bound equals `flatmoe plan --ep E --sp S --zero 0`'s (the trainer's own run, not a mesh) and
#   holds its high-water mark. Under --mem-budget the chooser keeps AdamW on the device. The same three
#   meshes with --zero 3 (the mesh planner's layout, train/fm_zero3.h: each rank's E/ep experts whole,
#   the rest sharded over all dp x sp ranks) give the same losses; every live set's bound equals
#   `flatmoe plan --ep E --sp S --dp D --zero 3`'s and holds its high-water mark, the model state's
#   high-water mark equal to its bound and below the --zero 0 run's.
# adversarial: FLATMOE_TEST_FORCE_ROUTE=0 (fm_router.h's test hook) sends every token to experts 0
#   and 1: at np 4 --ep 2 --sp 2 they live on ranks 0 and 2 (ranks 1 and 3 receive no rows), at
#   np 4 --ep 4 --sp 2 on ranks 0 and 1 (ranks 2 and 3 receive none), at np 2 --ep 2 --sp 2 on rank
#   0; the losses still match one rank under the same routing, every rank's rows received per chunk
#   stay within R_max = ep x cap x min(k, E/ep), the loaded ranks reach it and the expert-dispatch
#   arena's high-water mark equals its planned bound; --llep --llep-min-piece 1 at np 4 --ep 2 --sp 2
#   spills the hot experts to the idle rank of each ep group (rows received drop to half of R_max)
#   and still matches; np 4 --ep 2 --sp 2 --zero 3 under the same routing matches too.
# resume: 10 steps at np 4 --ep 2 --sp 2, 10 more at one rank; and 10 at one rank, 10 more at np 4
#   --ep 4 --sp 2: both end with the losses and weights of 20 uninterrupted one-rank steps; and 10 at
#   np 4 --ep 2 --sp 2 --zero 3, 10 more at np 2 --ep 2 --sp 2 --zero 3 (the shards over 4 ranks read
#   back over 2) likewise.
# bad: what still does not go together (--zero 1 beside --ep, in train and plan) and an --ep that
#   does not divide the ranks or num_experts: a clear error naming the flags, non-zero exit.
set -u
source "$(dirname "$0")/lib_mpi.sh"
mpi_tmp mpi-epsp
CFG="$ROOT/tests/data/micro_sp.json"
COMMON=(--config "$CFG" --data "$TEXT" --seq-len 32 --grad-accum 2 --steps 20 --warmup 2 --lr 3e-3
        --eval-every 10 --eval-batches 2 --threads 1 --quiet --expert-counts-every 1)
MPI_ENV=(-x FLATMOE_TEST_FORCE_ROUTE)
export FLATMOE_TEST_FORCE_ROUTE=""
one_rank() { # DIR: 20 one-rank steps at --micro-batch 4 (under the current FLATMOE_TEST_FORCE_ROUTE)
    "$FM" train "${COMMON[@]}" --micro-batch 4 --out "$1" >/dev/null || bad "one-rank run $1 failed"
}
# memory RUN MB EP SP CAP: every live set's bound equals `flatmoe plan --ep EP --sp SP --zero 0`'s for
# the same shape and holds its high-water mark; the model state's bound = high-water = 16 B x the
# local table (39424 params less the other ranks' experts: 2 layers x (4 - 4/EP) x 3 x 32 x 32)
memory() {
    local plan; plan=$("$FM" plan --config "$CFG" --seq-len 32 --micro-batch "$2" --ep "$3" --sp "$4" --zero 0 \
        --recompute none --moe-chunk-tokens "$5" --ce-block-tokens 0 --ce-block-vocab 0 --offload-boundaries 0 \
        --json 2>/dev/null) || bad "plan --ep $3 --sp $4 --zero 0 failed"
    python3 - "$1/metrics.jsonl" "$3" "$plan" <<'PY'
import json, sys
mem = [r for r in map(json.loads, open(sys.argv[1])) if r.get("type", "step") == "step"][0]["memory"]
ep, plan = int(sys.argv[2]), json.loads(sys.argv[3])["live_sets"]
ok = all(v["high_water"] <= v["bound"] for v in mem.values())
for k, v in mem.items():
    if plan.get(k) != v["bound"]: ok = False; print(f"FAIL: {k}: bound {v['bound']} B, plan {plan.get(k)} B")
n = 39424 - 2 * (4 - 4 // ep) * 3 * 32 * 32
ms = mem["model state"]
ok = ok and ms["bound"] == ms["high_water"] == 16 * n
print(f"memory: every bound = plan --ep {ep} --zero 0, within it; model state {ms['high_water']} B = 16 B x {n} "
      "params: " + ("ok" if ok else "FAILED " + json.dumps(mem)))
sys.exit(0 if ok else 1)
PY
}
# memory_z3 RUN MB EP SP DP ZERO0_RUN: every live set's bound equals `flatmoe plan --ep EP --sp SP --dp DP
# --zero 3`'s and holds its high-water mark; the model state's high-water mark equals its bound and is
# below the --zero 0 run ZERO0_RUN's (the non-expert parameters sharded over dp x sp)
memory_z3() {
    local plan; plan=$("$FM" plan --config "$CFG" --seq-len 32 --micro-batch "$2" --ep "$3" --sp "$4" --dp "$5" --zero 3 \
        --recompute none --moe-chunk-tokens 0 --ce-block-tokens 0 --ce-block-vocab 0 --offload-boundaries 0 \
        --json 2>/dev/null) || { echo "plan --ep $3 --sp $4 --dp $5 --zero 3 failed"; return 1; }
    python3 - "$1/metrics.jsonl" "$6/metrics.jsonl" "$plan" <<'PY'
import json, sys
first = lambda p: [r for r in map(json.loads, open(p)) if r.get("type", "step") == "step"][0]["memory"]
mem, z0, plan = first(sys.argv[1]), first(sys.argv[2]), json.loads(sys.argv[3])["live_sets"]
ok = all(v["high_water"] <= v["bound"] for v in mem.values())
for k, v in mem.items():
    if plan.get(k) != v["bound"]: ok = False; print(f"FAIL: {k}: bound {v['bound']} B, plan {plan.get(k)} B")
ms = mem["model state"]
ok = ok and ms["high_water"] == ms["bound"] < z0["model state"]["bound"]
print(f"memory: every bound = plan --zero 3, within it; model state {ms['high_water']} B = its bound, --zero 0's "
      f"{z0['model state']['bound']} B: " + ("ok" if ok else "FAILED " + json.dumps(mem)))
sys.exit(0 if ok else 1)
PY
}
# dispatch LOG RUN NP EP CAP LOADED...: every rank's "rows received per chunk high X of R_max R" within
# R = EP x CAP x min(2, 4/EP), the LOADED ranks' high equal to R, the others' 0; the expert-dispatch
# arena's high-water mark equals its bound
dispatch() {
    python3 - "$@" <<'PY'
import json, re, sys
log, run, np, ep, cap = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
loaded = [int(x) for x in sys.argv[6:]]
rmax = ep * cap * min(2, 4 // ep)
high = {}
for l in open(log):
    m = re.match(r"rank (\d+) of \d+: ep dispatch: rows received per chunk high (\d+) of R_max (\d+)", l)
    if m: high[int(m[1])] = max(high.get(int(m[1]), 0), int(m[2])); assert int(m[3]) == rmax, l
ok = sorted(high) == list(range(np))  # every rank of every ep group reported
ok = ok and all(high[q] == (rmax if q in loaded else 0) for q in high)
ed = [r for r in map(json.loads, open(run + "/metrics.jsonl")) if r.get("type", "step") == "step"][0]["memory"]["expert dispatch"]
ok = ok and ed["high_water"] == ed["bound"]
print(f"{run}: rows received per chunk by rank {high}, R_max {rmax}, loaded ranks {loaded}; expert dispatch "
      f"high-water {ed['high_water']} of bound {ed['bound']}: " + ("ok" if ok else "FAILED"))
sys.exit(0 if ok else 1)
PY
}
# the runs: np, micro-batch (4 x sp / np: the one rank's 4 sequences per step), ep, sp
RUNS=("4 2 2 2" "4 2 4 2" "2 4 2 2")
case $MODE in
runs)
    one_rank "$TMP/one"
    for r in "${RUNS[@]}"; do
        read -r np mb ep sp <<<"$r"
        out="$TMP/np${np}ep${ep}sp$sp" t0=$SECONDS
        mpi "$np" train "${COMMON[@]}" --micro-batch "$mb" --ep "$ep" --sp "$sp" --report-memory --out "$out" \
            >"$out.log" 2>&1 || { bad "np $np --ep $ep --sp $sp failed"; cat "$out.log" >&2; }
        echo "== mpirun -np $np train --micro-batch $mb --ep $ep --sp $sp: $((SECONDS - t0)) s"
        compare "$TMP/one" "$out" || bad "np $np --ep $ep --sp $sp differs from one rank at --micro-batch 4"
        memory "$out" "$mb" "$ep" "$sp" 0 || bad "np $np --ep $ep --sp $sp: memory"
        # --zero 3: the same mesh with the non-expert parameters sharded over the np ranks
        mpi "$np" train "${COMMON[@]}" --micro-batch "$mb" --ep "$ep" --sp "$sp" --zero 3 --report-memory --out "$out.z3" \
            >"$out.z3.log" 2>&1 || { bad "np $np --ep $ep --sp $sp --zero 3 failed"; cat "$out.z3.log" >&2; }
        compare "$TMP/one" "$out.z3" || bad "np $np --ep $ep --sp $sp --zero 3 differs from one rank at --micro-batch 4"
        memory_z3 "$out.z3" "$mb" "$ep" "$sp" $((np / sp)) "$out" || bad "np $np --ep $ep --sp $sp --zero 3: memory"
    done
    # under a budget the chooser keeps AdamW on the device (the streamed one is not built for --ep)
    mpi 2 train "${COMMON[@]}" --micro-batch 4 --ep 2 --sp 2 --seq-len 64 --mem-budget 1GiB --steps 2 --no-checkpoint --out "$TMP/budget" \
        >"$TMP/budget.log" 2>&1 || { bad "np 2 --ep 2 --sp 2 --mem-budget 1GiB failed"; cat "$TMP/budget.log" >&2; } ;;
adversarial)
    export FLATMOE_TEST_FORCE_ROUTE=0
    one_rank "$TMP/one"
    # local tokens N = mb x 32 / sp; cap = N / chunks; the ranks holding experts 0 and 1 are loaded
    for r in "4 2 2 2 16 0 2" "4 2 4 2 8 0 1" "2 4 2 2 16 0"; do
        read -r np mb ep sp cap loaded <<<"$r"
        out="$TMP/a_np${np}ep${ep}sp$sp"
        mpi "$np" train "${COMMON[@]}" --micro-batch "$mb" --ep "$ep" --sp "$sp" --ep-cap-tokens "$cap" --report-memory \
            --out "$out" >"$out.log" 2>&1 || { bad "adversarial np $np --ep $ep --sp $sp failed"; cat "$out.log" >&2; }
        compare "$TMP/one" "$out" || bad "adversarial np $np --ep $ep --sp $sp differs from one rank"
        # shellcheck disable=SC2086
        dispatch "$out.log" "$out" "$np" "$ep" "$cap" $loaded || bad "adversarial np $np --ep $ep --sp $sp: the dispatch's bound"
        memory "$out" "$mb" "$ep" "$sp" "$cap" || bad "adversarial np $np --ep $ep --sp $sp: memory"
    done
    # least-loaded placement: in each ep group the hot experts' rows spill to the idle rank (1, 3)
    out="$TMP/l_np4ep2sp2"
    mpi 4 train "${COMMON[@]}" --micro-batch 2 --ep 2 --sp 2 --ep-cap-tokens 16 --llep --llep-min-piece 1 --report-memory \
        --out "$out" >"$out.log" 2>&1 || { bad "adversarial np 4 --ep 2 --sp 2 --llep failed"; cat "$out.log" >&2; }
    compare "$TMP/one" "$out" || bad "adversarial np 4 --ep 2 --sp 2 --llep differs from one rank"
    for q in 1 3; do
        grep -q "rank $q of 4: ep dispatch: rows received per chunk high 32 of R_max 64.*moved rows [1-9]" "$out.log" ||
            bad "--llep moved no rows to rank $q: $(grep "rank $q of 4: ep dispatch" "$out.log" | tail -1)"
    done
    # --zero 3 under the same routing: the loaded ranks' experts whole, the rest sharded
    out="$TMP/a_np4ep2sp2z3"
    mpi 4 train "${COMMON[@]}" --micro-batch 2 --ep 2 --sp 2 --zero 3 --ep-cap-tokens 16 --report-memory --out "$out" \
        >"$out.log" 2>&1 || { bad "adversarial np 4 --ep 2 --sp 2 --zero 3 failed"; cat "$out.log" >&2; }
    compare "$TMP/one" "$out" || bad "adversarial np 4 --ep 2 --sp 2 --zero 3 differs from one rank"
    dispatch "$out.log" "$out" 4 2 16 0 2 || bad "adversarial np 4 --ep 2 --sp 2 --zero 3: the dispatch's bound" ;;
resume)
    one_rank "$TMP/one"
    mpi 4 train "${COMMON[@]}" --micro-batch 2 --ep 2 --sp 2 --exit-after 10 --out "$TMP/a" >/dev/null ||
        bad "np 4 --ep 2 --sp 2 first half failed"
    "$FM" train "${COMMON[@]}" --micro-batch 4 --resume --out "$TMP/a" 2>"$TMP/a.err" >/dev/null || bad "np 1 resume failed"
    grep -q "will not match" "$TMP/a.err" && bad "resume at np 1 warned: $(cat "$TMP/a.err")"
    compare "$TMP/one" "$TMP/a" || bad "np 4 --ep 2 --sp 2 -> np 1 differs from 20 one-rank steps"
    "$FM" train "${COMMON[@]}" --micro-batch 4 --exit-after 10 --out "$TMP/b" >/dev/null || bad "np 1 first half failed"
    mpi 4 train "${COMMON[@]}" --micro-batch 2 --ep 4 --sp 2 --resume --out "$TMP/b" 2>"$TMP/b.err" >/dev/null ||
        bad "np 4 --ep 4 --sp 2 resume failed: $(cat "$TMP/b.err")"
    grep -q "will not match" "$TMP/b.err" && bad "resume at np 4 --ep 4 --sp 2 warned: $(cat "$TMP/b.err")"
    compare "$TMP/one" "$TMP/b" || bad "np 1 -> np 4 --ep 4 --sp 2 differs from 20 one-rank steps"
    mpi 4 train "${COMMON[@]}" --micro-batch 2 --ep 2 --sp 2 --zero 3 --exit-after 10 --out "$TMP/c" >/dev/null ||
        bad "np 4 --ep 2 --sp 2 --zero 3 first half failed"
    mpi 2 train "${COMMON[@]}" --micro-batch 4 --ep 2 --sp 2 --zero 3 --resume --out "$TMP/c" 2>"$TMP/c.err" >/dev/null ||
        bad "np 2 --ep 2 --sp 2 --zero 3 resume failed: $(cat "$TMP/c.err")"
    grep -q "will not match" "$TMP/c.err" && bad "resume at np 2 --zero 3 warned: $(cat "$TMP/c.err")"
    compare "$TMP/one" "$TMP/c" || bad "np 4 -> np 2 --ep 2 --sp 2 --zero 3 differs from 20 one-rank steps" ;;
bad)
    check() { # np, needle, flags...
        local np=$1 needle=$2; shift 2
        out=$(mpi "$np" train "${COMMON[@]}" --micro-batch 2 "$@" --out "$TMP/bad" 2>&1); rc=$?
        { [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -qF -- "$needle" <<<"$out"; } || bad "np $np $*: rc $rc: $out"
        echo "== np $np $*: exit $rc: $(grep -m1 -F -- "$needle" <<<"$out" | cut -c1-200)"
    }
    check 2 "--zero 1 with --ep 2: ZeRO-1/2 shards the optimizer state" --ep 2 --sp 2 --zero 1
    check 4 "--ep 3 does not divide the 4 ranks running" --ep 3 --sp 2
    check 2 "--ep 4 does not divide the 2 ranks running" --ep 4 --sp 2
    out=$("$FM" plan --config "$CFG" --seq-len 32 --ep 3 --sp 2 --zero 0 2>&1); rc=$?
    { [ $rc -ne 0 ] && grep -qF -- "--ep 3 does not divide num_experts 4" <<<"$out"; } ||
        bad "plan --ep 3 --sp 2 --zero 0: rc $rc: $out"
    out=$("$FM" plan --config "$CFG" --seq-len 32 --ep 2 --sp 2 --zero 1 2>&1); rc=$?
    { [ $rc -ne 0 ] && grep -qF -- "--zero 1 with --ep 2: ZeRO-1/2 shards the optimizer state" <<<"$out"; } ||
        bad "plan --ep 2 --sp 2 --zero 1: rc $rc: $out"
    out=$("$FM" plan --config "$CFG" --seq-len 32 --ep 4 --sp 2 --zero 3 2>&1); rc=$?
    { [ $rc -ne 0 ] && grep -qF -- "--ep 4 does not divide the 2 ranks running" <<<"$out"; } ||
        bad "plan --ep 4 --sp 2 --zero 3: rc $rc: $out" ;;
*) echo "unknown mode $MODE"; exit 2 ;;
esac
mpi_finish "mpi_train_epsp $MODE"
