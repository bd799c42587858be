#!/usr/bin/env bash
# train --init-from a Hugging Face folder under the sharded trainers, each rank reading only its
# ranges through the checkpoint staging (src/train/fm_train_ckpt_stream.h), as ctest runs it:
#   bash tests/mpi_init_from.sh MPIEXEC FLATMOE
# A 3-step run of tests/data/micro.json gives the source weights; tests/fm_hf_fixture.c turns them
# into Hugging Face folders (fp32 model.safetensors; bf16 in 2 shards with an index and experts
# fused per layer: gate_up_proj [E, 2I, H], down_proj [E, H, I]). 20 steps --init-from each folder
# at np 2 and np 4 with --zero 3, np 2 with --zero 1, np 2 --ep 2 and np 4 --ep 2 --zero 3 agree with
# one rank's (tests/mpi_compare.py); pieces of 1000 elements (FLATMOE_TEST_CKPT_CHUNK) cut most
# tensors into several, and under --zero 3 rank 0's "initialized from" line gives the staging's
# high-water right after the read: equal to its bound 8 B x 1000 (rank 0 holds ranges of >= 2000
# elements: a piece fills both halves), where the old code staged all n_params and printed none. Fused experts under --ep are not read (as before: a shape mismatch).
set -u
MPIEXEC=$1 FM=$(readlink -f "$2")
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FX=$(dirname "$FM")/fm_hf_fixture
[ -x "$FX" ] || { echo "fm_hf_fixture not built next to $FM"; exit 1; }
FLAGS=(--oversubscribe --allow-run-as-root --bind-to none --mca btl self,vader
       --mca btl_vader_single_copy_mechanism none --mca pml ob1)
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_mpi_yield_when_idle=1
TMP=$(mktemp -d /tmp/flatmoe-mpi-init-from.XXXXXX); trap 'rm -rf "$TMP"' EXIT
TEXT="$ROOT/../shared/data/tinyshakespeare.txt"
[ -f "$TEXT" ] || TEXT=/usr/share/games/fortunes/fortunes
[ -f "$TEXT" ] || TEXT="$ROOT/README.md"
RUN=(--data "$TEXT" --seq-len 32 --grad-accum 2 --steps 20 --warmup 2 --lr 3e-3 --eval-every 10 --eval-batches 2
     --threads 1)
FAILED=0
bad() { FAILED=$((FAILED + 1)); echo "FAIL: $*" >&2; }
mpi() { local np=$1; shift; timeout 120 "$MPIEXEC" "${FLAGS[@]}" -np "$np" "$FM" "$@"; }
compare() { python3 "$ROOT/tests/mpi_compare.py" "$1" "$2"; }
export FLATMOE_TEST_CKPT_CHUNK=1000

"$FM" train --config "$ROOT/tests/data/micro.json" --data "$TEXT" --seq-len 32 --steps 3 --micro-batch 4 --threads 1 \
    --quiet --out "$TMP/src" ||
    bad "source run failed"
SRC="$TMP/src/step_000003"
"$FX" "$SRC" "$TMP/f32" --dtype f32 || bad "fixture f32 failed"
"$FX" "$SRC" "$TMP/fused" --dtype bf16 --shards 2 --fuse || bad "fixture bf16 sharded fused failed"
for hf in f32 fused; do
    "$FM" train --init-from "$TMP/$hf" "${RUN[@]}" --micro-batch 4 --quiet --out "$TMP/$hf-1" ||
        bad "$hf: np 1 --init-from failed"
    for c in "2 --zero 3" "4 --zero 3" "2 --zero 1" "2 --ep 2" "4 --ep 2 --zero 3"; do
        set -- $c; np=$1; shift
        # fused experts under --ep: not read (each rank's table holds E/ep experts; the fused
        # tensors hold all E, refused as a shape mismatch, as before)
        [ $hf = fused ] && [ "$2" = 2 ] && [ "$1" = --ep ] && continue
        name="$hf-np$np$(echo "$@" | tr -d ' -')"
        mpi "$np" train --init-from "$TMP/$hf" "${RUN[@]}" --micro-batch $((4 / np)) "$@" --out "$TMP/$name" \
            >"$TMP/$name.log" 2>"$TMP/$name.err" || { bad "$hf: np $np $* --init-from failed"; cat "$TMP/$name.err" >&2; }
        grep -q "warning" "$TMP/$name.err" && bad "$hf: np $np $* --init-from warned: $(cat "$TMP/$name.err")"
        compare "$TMP/$hf-1" "$TMP/$name" || bad "$hf: np $np $* --init-from differs from one rank"
        # ZeRO-3 (any backend) reads by ranges: rank 0's line (it speaks for all), high-water ==
        # bound == 8000 B (its ranges hold >= 2000 elements)
        case "$*" in *"--zero 3"*)
            python3 - "$TMP/$name.log" "$np" <<'PY' || bad "$hf: np $np $*: the staging's high-water after --init-from"
import re, sys
hw = [(int(a), int(b)) for a, b in re.findall(r"through the checkpoint staging: high-water (\d+) of (\d+) B",
                                               open(sys.argv[1]).read())]
ok = hw == [(8000, 8000)]
print(f"{sys.argv[1]}: rank 0 of {sys.argv[2]} read by ranges, staging high-water, bound: {hw} (want [(8000, 8000)]): "
      + ("ok" if ok else "FAILED"))
sys.exit(0 if ok else 1)
PY
            ;;
        esac
    done
done
[ $FAILED -eq 0 ] && echo "mpi_init_from: all passed" || echo "mpi_init_from: $FAILED failed"
exit $((FAILED > 0))
