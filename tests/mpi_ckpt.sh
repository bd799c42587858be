#!/usr/bin/env bash
# The sharded trainers' checkpoints through the bounded staging (src/train/fm_train_ckpt_stream.h)
# under mpirun, as ctest runs it:
#   bash tests/mpi_ckpt.sh MPIEXEC FLATMOE
# bytes: a one-rank checkpoint of tests/data/micro.json (4 steps), resumed at np 2 and np 4 with
#   --zero 1, --zero 3, --ep 2 and --ep 2 --zero 3 (each rank reads only its ranges) and written
#   again at once by those ranks (FLATMOE_TEST_CKPT_RESAVE: rank 0 streams every piece from its
#   owner), gives model.safetensors and optimizer.safetensors byte-identical to the one rank's;
#   pieces of 1000 elements (FLATMOE_TEST_CKPT_CHUNK) cut most tensors into several, and ZeRO-1/2
#   shards and ZeRO-3 pieces cut pieces between owners. A 4-step run at np 4 --zero 3 writes the
#   same bytes with 1000-element pieces as with whole tensors (the piece size changes no byte).
# staging: the checkpoint staging's bound (metrics.jsonl's final record, rank 0) is 8 B x min(piece,
#   largest tensor) and its high-water mark equals it where rank 0 owns a whole piece (1000-element
#   pieces; np 2 --zero 1 with whole tensors), is within it otherwise (np 4 --zero 3 with whole
#   tensors: rank 0 sends only its quarter), and --report-memory prints it after a resume.
set -u
source "$(dirname "$0")/lib_mpi.sh"
mpi_tmp mpi-ckpt
BASE=(--config "$ROOT/tests/data/micro.json" --data "$TEXT" --seq-len 32 --grad-accum 2 --steps 4 --warmup 2
      --lr 3e-3 --eval-every 10 --eval-batches 2 --threads 1)
COMMON=("${BASE[@]}" --quiet)
same() { # DIR_A DIR_B what: both safetensors files byte for byte
    for f in model.safetensors optimizer.safetensors; do
        cmp -s "$1/$f" "$2/$f" || bad "$3: $f differs from the reference"
    done
}
# the final record's checkpoint staging: bound == 8 x min(chunk, largest tensor), and high_water
# == bound (eq: rank 0 owns a whole piece, so it holds a full piece received and a full one sent)
# or <= bound (le)
staging() { # metrics.jsonl chunk what eq|le
    python3 - "$1" "$2" "$3" "$4" <<'PY' || bad "$3: the checkpoint staging's high-water mark"
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
cs = [r for r in recs if "checkpoint staging" in r.get("memory", {})][-1]["memory"]["checkpoint staging"]
largest = 256 * 32  # micro.json's embedding [256, 32] is its largest tensor
bound = 8 * min(int(sys.argv[2]), largest)
hw = cs["high_water"]
ok = cs["bound"] == bound and (hw == bound if sys.argv[4] == "eq" else 0 < hw <= bound)
print(f"{sys.argv[3]}: checkpoint staging bound {cs['bound']} B (expected {bound}), high-water {hw} B "
      f"({'=' if sys.argv[4] == 'eq' else '<='} bound): "
      + ("ok" if ok else "FAILED"))
sys.exit(0 if ok else 1)
PY
}
export FLATMOE_TEST_CKPT_CHUNK=1000
"$FM" train "${COMMON[@]}" --micro-batch 4 --out "$TMP/ref" >/dev/null || bad "one-rank run failed"
REF="$TMP/ref/step_000004"
for c in "2 --zero 1" "4 --zero 1" "2 --zero 3" "4 --zero 3" "2 --ep 2" "4 --ep 2 --zero 3"; do
    set -- $c; np=$1; shift
    name="np$np$(echo "$@" | tr -d ' -')"
    mkdir -p "$TMP/$name" && cp -r "$REF" "$TMP/$name/"
    FLATMOE_TEST_CKPT_RESAVE=1 mpi "$np" train "${COMMON[@]}" --micro-batch $((4 / np)) "$@" --resume \
        --out "$TMP/$name" >"$TMP/$name.log" 2>&1 || { bad "np $np $*: resume and write failed"; cat "$TMP/$name.log" >&2; }
    same "$REF" "$TMP/$name/step_000004" "np $np $* (read by ranges, written by pieces)"
    echo "== np $np $*: read and written again: $(cmp -s "$REF/optimizer.safetensors" "$TMP/$name/step_000004/optimizer.safetensors" && echo identical || echo DIFFERENT)"
done
# the piece size changes no byte of a sharded run's files
mpi 4 train "${BASE[@]}" --micro-batch 1 --zero 3 --report-memory --out "$TMP/z3a" >"$TMP/z3a.log" 2>&1 ||
    bad "np 4 --zero 3 (1000-element pieces) failed"
FLATMOE_TEST_CKPT_CHUNK= mpi 4 train "${COMMON[@]}" --micro-batch 1 --zero 3 --out "$TMP/z3b" >/dev/null 2>&1 ||
    bad "np 4 --zero 3 (whole tensors) failed"
same "$TMP/z3a/step_000004" "$TMP/z3b/step_000004" "np 4 --zero 3, 1000-element pieces against whole tensors"
staging "$TMP/z3a/metrics.jsonl" 1000 "np 4 --zero 3, 1000-element pieces" eq
staging "$TMP/z3b/metrics.jsonl" 4194304 "np 4 --zero 3, whole tensors" le
# np 2 --zero 1 with whole tensors: rank 0's shard holds the largest tensor whole (the bound is reached)
FLATMOE_TEST_CKPT_CHUNK= mpi 2 train "${COMMON[@]}" --micro-batch 2 --zero 1 --out "$TMP/z1" >/dev/null 2>&1 ||
    bad "np 2 --zero 1 (whole tensors) failed"
staging "$TMP/z1/metrics.jsonl" 4194304 "np 2 --zero 1, whole tensors" eq
# --report-memory's table after a resume (the load staged): the line with its bound
mpi 2 train "${BASE[@]}" --steps 5 --micro-batch 2 --zero 3 --resume --report-memory --out "$TMP/z3a" >"$TMP/z3r.log" 2>&1 ||
    bad "np 2 --zero 3 resume with --report-memory failed"
grep -q "^memory: checkpoint staging  *8000 " "$TMP/z3r.log" || bad "--report-memory printed no checkpoint staging line"
[ $FAILED -eq 0 ] && echo "mpi_ckpt: all passed" || echo "mpi_ckpt: $FAILED failed"
exit $((FAILED > 0))
