#!/usr/bin/env bash
# Ulysses sequence parallelism in the trainer (--sp; README "Sequence parallelism") under mpirun,
# as ctest runs it:
#   bash tests/mpi_train_sp.sh MPIEXEC FLATMOE MODE      MODE: np2 | np4 | attn | bad
# np2: -np 2 --sp 2 at --micro-batch 4 gives the losses of one rank at --micro-batch 4 over 20
#   steps to 1e-6 relative (loss, aux, z, validation; grad norm 1e-3; final weights and Adam state
#   to 5e-4 of each tensor's scale, tests/mpi_train.sh's tolerances and their reasons), for
#   tests/data/micro_sp.json (4 heads, 2 kv heads: one per rank) and tests/data/micro.json (2 heads,
#   1 kv head: replicated on both ranks); the same with recompute, keep-attention, chunked MoE
#   the linear cross-entropy and an offloaded boundary; every live set's high-water mark within its bound, the working
#   set's (where the head-sharded buffers live) equal to it and to `flatmoe plan --sp 2 --zero 0`'s; and a
#   run of 10 steps at -np 2 --sp 2 resumed for 10 at one rank ends as 20 one-rank steps. ZeRO beside
#   --sp (train/fm_zero3.h: the shards over all dp x sp ranks): -np 2 --sp 2 --zero 3 and --zero 1
#   against the same one rank, every live set's bound equal to `flatmoe plan --sp 2 --zero Z`'s and
#   holding its high-water mark, the model state's high-water mark equal to its bound. Packed
#   documents (--pack on, issue 28): -np 2 --sp 2 against one rank, for both configs.
# np4: -np 4 --sp 2 (dp 2, --micro-batch 2), -np 4 --sp 4 (kv heads replicated on 2 ranks each)
#   and a qwen3_moe config (QK-norm per head) at -np 4 --sp 4, against one rank at
#   --micro-batch 4. ZeRO beside --sp: -np 4 --sp 2 --zero 3 and --zero 1 (dp 2: the shards over the 4
#   ranks) and -np 4 --sp 4 --zero 3 against one rank, the --zero 3 bounds equal to `flatmoe plan --sp 2
#   --dp 2 --zero 3`'s; 10 steps at -np 4 --sp 2 --zero 3 resumed for 10 at -np 2 --sp 2 --zero 3 (a
#   shard of W = 4 read back as one of W = 2) end as 20 one-rank steps.
# attn: q/k/v/o biases and YaRN (issue 26) at -np 2 --sp 2, plain and packed, against one rank.
# bad: an --sp that does not divide the ranks, --seq-len or the heads, and --sp with --zero 3 and
#   --offload-optimizer, each
#   a clear error naming the flag, the expected and found values and the fix; a rank that stops
#   answering ends the job within the timeout with a message naming the rank and the collective.
set -u
source "$(dirname "$0")/lib_mpi.sh"
mpi_tmp mpi-sp
SP="$ROOT/tests/data/micro_sp.json" MICRO="$ROOT/tests/data/micro.json"
COMMON=(--data "$TEXT" --seq-len 32 --grad-accum 2 --steps 20 --warmup 2 --lr 3e-3
        --eval-every 10 --eval-batches 2 --threads 1 --quiet --expert-counts-every 1)
# compare REF RUN: 20 step records, losses to 1e-6 relative, final tensors to 5e-4 of their scale
# (grad norm to 1e-3: a token whose router scores nearly tie may pick another expert when the sums
# run in another order, which moved one step's norm by 1.1e-4 in the qwen3 case, at --sp 2 as at
# --sp 4, while the losses stayed within 1e-7)
compare() { python3 "$ROOT/tests/mpi_compare.py" "$1" "$2" --grad-norm-tol 1e-3; }
# memory RUN CONFIG SP MB [ZERO DP]: every high-water mark within its bound and every bound equal to
# `flatmoe plan --sp SP --dp DP --zero ZERO`'s (the trainer's run over dp x sp ranks, not a mesh; ZERO
# 0, DP 1 when left out) for the same shape; the working set's high-water mark equal to its bound, and
# under --zero 1/3 the model state's (the shards, the gather slots and the gradient buffer)
memory() {
    local plan; plan=$("$FM" plan --config "$2" --seq-len 32 --micro-batch "$4" --sp "$3" --dp "${6:-1}" --zero "${5:-0}" \
        --recompute none --moe-chunk-tokens 0 --ce-block-tokens 0 --ce-block-vocab 0 --offload-boundaries 0 --json \
        2>/dev/null) || { echo "plan --sp $3 --dp ${6:-1} --zero ${5:-0} failed"; return 1; }
    python3 - "$1/metrics.jsonl" "$plan" "${5:-0}" <<'PY'
import json, sys
mem = [r for r in map(json.loads, open(sys.argv[1])) if r.get("type", "step") == "step"][0]["memory"]
plan, zero = json.loads(sys.argv[2])["live_sets"], int(sys.argv[3])
ok = all(v["high_water"] <= v["bound"] for v in mem.values())
for k, v in mem.items():
    if plan.get(k) != v["bound"]: ok = False; print(f"FAIL: {k}: bound {v['bound']} B, plan {plan.get(k)} B")
ws, ms = mem["layer working set"], mem["model state"]
ok = ok and ws["high_water"] == ws["bound"] and (zero == 0 or ms["high_water"] == ms["bound"])
print(f"memory (--zero {zero}): working set high-water {ws['high_water']} B, model state high-water {ms['high_water']} "
      f"of {ms['bound']} B; every bound = the plan's, within it: " + ("ok" if ok else "FAILED " + json.dumps(mem)))
sys.exit(0 if ok else 1)
PY
}
one() { # out config extra flags: the one-rank reference at --micro-batch 4
    local out=$1 cfg=$2; shift 2
    "$FM" train --config "$cfg" "${COMMON[@]}" --micro-batch 4 "$@" --out "$out" >/dev/null || bad "one-rank $out failed"
}
# packed_docs COUNT MAXLEN: COUNT documents of 3 to MAXLEN byte tokens (seed 7) in the llm.c shard
# $TMP/w.bin with its FMDOCS01 index $TMP/w.docs (tests/packed_docs.py), and PACK, the
# flags that train on them with --pack on at --micro-batch 4 (the one-rank reference's shape)
packed_docs() {
    python3 "$ROOT/tests/packed_docs.py" "$TMP/w" "$1" "$2"
    PACK=(--data "$TMP/w.bin" --val-fraction 0.2 --seq-len 32 --grad-accum 2 --steps 20 --warmup 2 --lr 3e-3
          --eval-every 10 --eval-batches 1 --threads 1 --quiet --pack on --micro-batch 4)
}
case $MODE in
np2)
    for cfg in "$SP" "$MICRO"; do
        n=$(basename "$cfg" .json)
        one "$TMP/one_$n" "$cfg"
        mpi 2 train --config "$cfg" "${COMMON[@]}" --micro-batch 4 --sp 2 --report-memory --out "$TMP/sp_$n" ||
            bad "np 2 --sp 2 $n failed"
        compare "$TMP/one_$n" "$TMP/sp_$n" || bad "np 2 --sp 2 ($n) differs from one rank"
        memory "$TMP/sp_$n" "$cfg" 2 4 || bad "np 2 --sp 2 ($n): memory"
    done
    BOUNDED=(--recompute full --recompute-keep-attention --moe-chunk-tokens 16 --ce-block-tokens 16 --ce-block-vocab 64
             --offload-boundaries 1)
    one "$TMP/one_b" "$SP" "${BOUNDED[@]}"
    mpi 2 train --config "$SP" "${COMMON[@]}" --micro-batch 4 --sp 2 "${BOUNDED[@]}" --out "$TMP/sp_b" ||
        bad "np 2 --sp 2 with the bounded operators failed"
    compare "$TMP/one_b" "$TMP/sp_b" || bad "np 2 --sp 2 with recompute/keep-attention/chunks/linear CE differs"
    # 10 steps at np 2 --sp 2, 10 more at one rank: 20 uninterrupted one-rank steps
    mpi 2 train --config "$SP" "${COMMON[@]}" --micro-batch 4 --sp 2 --exit-after 10 --out "$TMP/res" ||
        bad "np 2 --sp 2 first half failed"
    "$FM" train --config "$SP" "${COMMON[@]}" --micro-batch 4 --resume --out "$TMP/res" 2>"$TMP/res.err" >/dev/null ||
        bad "np 1 resume of an --sp 2 run failed"
    grep -q "will not match" "$TMP/res.err" && bad "resume at np 1 warned: $(cat "$TMP/res.err")"
    compare "$TMP/one_micro_sp" "$TMP/res" || bad "np 2 --sp 2 -> np 1 differs from 20 one-rank steps"
    # ZeRO beside --sp: the shards over both ranks (each holds half the model state), the one rank's losses
    for z in 3 1; do
        mpi 2 train --config "$SP" "${COMMON[@]}" --micro-batch 4 --sp 2 --zero $z --report-memory --out "$TMP/z${z}" ||
            bad "np 2 --sp 2 --zero $z failed"
        compare "$TMP/one_micro_sp" "$TMP/z${z}" || bad "np 2 --sp 2 --zero $z differs from one rank"
        memory "$TMP/z${z}" "$SP" 2 4 $z 1 || bad "np 2 --sp 2 --zero $z: memory"
    done
    # packed documents (issue 28): 40 documents of 3 to 120 byte tokens in an llm.c shard with its
    # FMDOCS01 index (as tests/cli_pack.sh writes them), --pack on: rows of whole documents that
    # cross the ranks' halves; each rank keeps its half of the tokens and positions and the whole
    # rows' document starts. -np 2 --sp 2 against one rank, at the tolerances above.
    packed_docs 40 120
    for cfg in "$SP" "$MICRO"; do
        n=$(basename "$cfg" .json)
        "$FM" train --config "$cfg" "${PACK[@]}" --out "$TMP/pone_$n" >/dev/null || bad "one-rank packed $n failed"
        mpi 2 train --config "$cfg" "${PACK[@]}" --sp 2 --report-memory --out "$TMP/psp_$n" ||
            bad "np 2 --sp 2 --pack on $n failed"
        compare "$TMP/pone_$n" "$TMP/psp_$n" || bad "np 2 --sp 2 --pack on ($n) differs from one rank"
        memory "$TMP/psp_$n" "$cfg" 2 4 || bad "np 2 --sp 2 --pack on ($n): memory"
    done ;;
np4)
    one "$TMP/one" "$SP"
    mpi 4 train --config "$SP" "${COMMON[@]}" --micro-batch 2 --sp 2 --out "$TMP/dp2sp2" || bad "np 4 --sp 2 failed"
    compare "$TMP/one" "$TMP/dp2sp2" || bad "np 4 --sp 2 (dp 2) differs from one rank"
    mpi 4 train --config "$SP" "${COMMON[@]}" --micro-batch 4 --sp 4 --report-memory --out "$TMP/sp4" ||
        bad "np 4 --sp 4 failed"
    compare "$TMP/one" "$TMP/sp4" || bad "np 4 --sp 4 (kv heads on 2 ranks each) differs from one rank"
    memory "$TMP/sp4" "$SP" 4 4 || bad "np 4 --sp 4: memory"
    # qwen3_moe (QK-norm per head); its 2 kv heads replicated on 2 ranks each
    python3 -c "import json, sys; c = json.load(open(sys.argv[1])); c.update(model_type='qwen3_moe',
architectures=['Qwen3MoeForCausalLM'], moe_intermediate_size=32); json.dump(c, open(sys.argv[2], 'w'))" \
        "$SP" "$TMP/q3.json"
    one "$TMP/one_q3" "$TMP/q3.json"
    mpi 4 train --config "$TMP/q3.json" "${COMMON[@]}" --micro-batch 4 --sp 4 --out "$TMP/q3sp4" || bad "np 4 --sp 4 qwen3 failed"
    compare "$TMP/one_q3" "$TMP/q3sp4" || bad "np 4 --sp 4 (qwen3_moe) differs from one rank"
    # ZeRO beside --sp: the shards over all 4 ranks (dp 2 x sp 2, and sp 4)
    for z in 3 1; do
        mpi 4 train --config "$SP" "${COMMON[@]}" --micro-batch 2 --sp 2 --zero $z --report-memory --out "$TMP/z${z}dp2" ||
            bad "np 4 --sp 2 --zero $z failed"
        compare "$TMP/one" "$TMP/z${z}dp2" || bad "np 4 --sp 2 --zero $z (dp 2) differs from one rank"
        memory "$TMP/z${z}dp2" "$SP" 2 2 $z 2 || bad "np 4 --sp 2 --zero $z: memory"
    done
    mpi 4 train --config "$SP" "${COMMON[@]}" --micro-batch 4 --sp 4 --zero 3 --out "$TMP/z3sp4" || bad "np 4 --sp 4 --zero 3 failed"
    compare "$TMP/one" "$TMP/z3sp4" || bad "np 4 --sp 4 --zero 3 differs from one rank"
    # 10 steps at np 4 --sp 2 --zero 3 (dp 2), 10 more at np 2 --sp 2 --zero 3 (dp 1): the shards of 4
    # ranks gathered to full tensors, scattered again over 2
    mpi 4 train --config "$SP" "${COMMON[@]}" --micro-batch 2 --sp 2 --zero 3 --exit-after 10 --out "$TMP/zres" ||
        bad "np 4 --sp 2 --zero 3 first half failed"
    mpi 2 train --config "$SP" "${COMMON[@]}" --micro-batch 4 --sp 2 --zero 3 --resume --out "$TMP/zres" 2>"$TMP/zres.err" \
        >/dev/null || bad "np 2 --sp 2 --zero 3 resume failed: $(cat "$TMP/zres.err")"
    grep -q "will not match" "$TMP/zres.err" && bad "resume at np 2 --zero 3 warned: $(cat "$TMP/zres.err")"
    compare "$TMP/one" "$TMP/zres" || bad "np 4 --sp 2 --zero 3 -> np 2 --sp 2 --zero 3 differs from 20 one-rank steps" ;;
attn)
    # the attention parts of issue 26 (docs/formats.md): q/k/v/o biases and YaRN RoPE (an original
    # context of 8 under 32-token rows: the tables differ from the default's at every rotated pair
    # past the ramp), np 2 --sp 2 against one rank at the tolerances above, plain and with packed
    # documents cut across the ranks' halves (RoPE positions per rank: each rank's rows of the
    # whole row's tables); the memory bounds equal the plan's
    python3 -c 'import json, sys; c = json.load(open(sys.argv[1]))
c.update(attention_bias=True, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})
json.dump(c, open(sys.argv[2], "w"))' "$SP" "$TMP/attn.json"
    one "$TMP/one" "$TMP/attn.json"
    mpi 2 train --config "$TMP/attn.json" "${COMMON[@]}" --micro-batch 4 --sp 2 --report-memory --out "$TMP/sp" ||
        bad "np 2 --sp 2 (biases, yarn) failed"
    compare "$TMP/one" "$TMP/sp" || bad "np 2 --sp 2 (biases, yarn) differs from one rank"
    memory "$TMP/sp" "$TMP/attn.json" 2 4 || bad "np 2 --sp 2 (biases, yarn): memory"
    packed_docs 60 40
    "$FM" train --config "$TMP/attn.json" "${PACK[@]}" --out "$TMP/pone" >/dev/null || bad "one-rank packed (attn) failed"
    mpi 2 train --config "$TMP/attn.json" "${PACK[@]}" --sp 2 --out "$TMP/psp" || bad "np 2 --sp 2 --pack on (attn) failed"
    compare "$TMP/pone" "$TMP/psp" || bad "np 2 --sp 2 --pack on (biases, yarn) differs from one rank" ;;
bad)
    expect() { # np, needle, then train's flags
        local np=$1 needle=$2; shift 2
        out=$(mpi "$np" train "${COMMON[@]}" --micro-batch 2 --out "$TMP/bad" "$@" 2>&1); rc=$?
        if [ $rc -eq 0 ] || ! grep -qF -- "$needle" <<<"$out"; then bad "np $np $*: rc $rc, no '$needle': $out"
        else echo "ok: np $np $*: $(grep -m1 -F -- "$needle" <<<"$out")"; fi
    }
    expect 2 "--sp 4 does not divide the 2 ranks running" --config "$SP" --sp 4
    expect 2 "--sp 2: --seq-len (33) must be divisible by --sp" --config "$SP" --sp 2 --seq-len 33
    expect 4 "--sp 4: num_attention_heads (2) of the model config must be divisible by --sp" --config "$MICRO" --sp 4
    expect 4 "use --sp 1 or 2" --config "$MICRO" --sp 4
    expect 2 "--zero 3 and --offload-optimizer do not go together yet" --config "$SP" --sp 2 --zero 3 --offload-optimizer
    expect 4 "--dp 4 with 4 ranks leaves sp = 1, but --sp is 2" --config "$SP" --sp 2 --dp 4
    # a rank that stops answering mid-run (SIGSTOP 1 s into training: tests/mpi_after_step.sh): the
    # other's collective (an attention all-to-all, most likely) times out after --comm-timeout 4 s
    # naming its rank, and the job ends
    export FM SP TEXT TMP AFTER="$ROOT/tests/mpi_after_step.sh"
    cmd='if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then (bash "$AFTER" "$TMP/stop"; kill -STOP $$) & fi; exec "$FM" train --config "$SP" --data "$TEXT" --seq-len 32 --micro-batch 2 --sp 2 --steps 1000000 --threads 1 --quiet --eval-every 0 --no-checkpoint --comm-timeout 4 --out "$TMP/stop"'
    t0=$SECONDS
    timeout 60 "$MPIEXEC" "${FLAGS[@]}" -np 2 bash -c "$cmd" >"$TMP/stop.log" 2>&1; rc=$?
    needle="error on rank 0 of 2: [^r].* timed out after 4 s"
    echo "== stop: exit $rc after $((SECONDS - t0)) s: $(grep -m1 -E "$needle" "$TMP/stop.log")"
    if [ $rc -eq 0 ] || [ $rc -eq 124 ] || ! grep -qE "$needle" "$TMP/stop.log"; then
        bad "stop: the job ended with status $rc (0: went on; 124: hung) or without '$needle'"; cat "$TMP/stop.log" >&2
    fi
    out=$("$FM" plan --config "$SP" --seq-len 30 --sp 4 --zero 0 2>&1); rc=$?
    { [ $rc -ne 0 ] && grep -qF -- "--sp 4: --seq-len (30) must be divisible by --sp" <<<"$out"; } ||
        bad "plan --seq-len 30 --sp 4 --zero 0: rc $rc: $out" ;;
*) echo "unknown mode $MODE"; exit 2 ;;
esac
mpi_finish "mpi_train_sp $MODE"
