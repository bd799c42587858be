#!/usr/bin/env bash
# No hidden options (DESIGN.md §3): the environment is read only in src/cli/ (cli_env.c) and
# handed down as values. Checks (1) that no getenv is left in src/ outside src/cli/ (the CUDA
# backend's .cu files included), so it cannot come back; (2) that a malformed value of each
# variable the CLI reads fails with one message naming the variable, the value and the form
# expected, and a non-zero exit; (3) that the values still travel: FLATMOE_CALIB_DIR picks the
# table, a bad FLATMOE_EP_SCHEDULE is refused by the expert-parallel operator on every rank (under
# mpirun, when found) and ignored by a run without --ep (as before), a bad launcher rank is named.
source "$(dirname "$0")/lib_cli.sh"
cfg="$ROOT/tests/data/micro.json"
base=(--data "$TEXT" --seq-len 16 --micro-batch 2 --steps 2 --threads 2 --quiet)

# (1) getenv in library code: none (comments included, so a new call cannot hide behind one)
found=$(grep -rn --include='*.c' --include='*.h' --include='*.cu' --include='*.cuh' getenv "$ROOT/src" |
        grep -v "^$ROOT/src/cli/")
if [ -z "$found" ]; then ok; echo "ok  no getenv in src/ outside src/cli/"
else bad "getenv below src/cli/ (read the variable in src/cli/cli_env.c and pass the value down): $found"; fi
# ... and the CLI does read them (a check that cannot pass by grepping the wrong folder)
grep -q 'getenv' "$ROOT/src/cli/cli_env.c" && ok || bad "src/cli/cli_env.c reads no environment variable"

# (2) every variable's malformed value: named, with the value and the form expected
train_bad() { # VAR VALUE NEEDLE
    expect_fail "train with $1=$2" "$3" env "$1=$2" "$FM" train --config "$cfg" "${base[@]}" --out "$TMP/a"
}
train_bad FLATMOE_PROFILE maybe "FLATMOE_PROFILE=maybe: expected 0 or 1"
train_bad FLATMOE_ATTENTION cuDNN "FLATMOE_ATTENTION=cuDNN: expected auto, cudnn or fallback"
train_bad FLATMOE_ATTENTION_VERBOSE 2 "FLATMOE_ATTENTION_VERBOSE=2: expected 0 or 1"
train_bad FLATMOE_EXPERT_GEMM bogus "FLATMOE_EXPERT_GEMM=bogus: expected auto, cublas, loop, grouped or sm90"
train_bad FLATMOE_FP8_GEMM v4 "FLATMOE_FP8_GEMM=v4: expected v3, v5, v5a, v5b or v5c"
train_bad FLATMOE_UPDATE_BLOCKS -1 "FLATMOE_UPDATE_BLOCKS=-1: expected an integer in [0, 1048576]"
train_bad FLATMOE_TEST_FP8_CODES yes "FLATMOE_TEST_FP8_CODES=yes: expected 1"
train_bad FLATMOE_TEST_FORCE_ROUTE x "FLATMOE_TEST_FORCE_ROUTE='x': expected FIRST or FIRST:PCT"
train_bad FLATMOE_TEST_FORCE_ROUTE 0:101 "FLATMOE_TEST_FORCE_ROUTE='0:101': expected FIRST or FIRST:PCT"
train_bad FLATMOE_TEST_SIGNAL_AFTER 3 "FLATMOE_TEST_SIGNAL_AFTER='3': expected RANK:STEP"
train_bad FLATMOE_TEST_SIGNAL_AFTER 0:x "FLATMOE_TEST_SIGNAL_AFTER='0:x': expected RANK:STEP"
train_bad FLATMOE_TEST_SIGNAL_AFTER -1:2 "FLATMOE_TEST_SIGNAL_AFTER='-1:2': expected RANK:STEP"
train_bad FLATMOE_TEST_CKPT_CHUNK 0 "FLATMOE_TEST_CKPT_CHUNK='0': expected a number of elements >= 1"
train_bad FLATMOE_TEST_CKPT_CHUNK 12k "FLATMOE_TEST_CKPT_CHUNK='12k': expected a number of elements >= 1"
train_bad FLATMOE_TEST_CKPT_RESAVE yes "FLATMOE_TEST_CKPT_RESAVE='yes': expected 1"
train_bad OMPI_COMM_WORLD_RANK x "environment variable OMPI_COMM_WORLD_RANK = \"x\": expected a rank"
# plan reads the backend's variables too
expect_fail "plan with FLATMOE_FP8_GEMM=v4" "FLATMOE_FP8_GEMM=v4: expected v3, v5, v5a, v5b or v5c" \
    env FLATMOE_FP8_GEMM=v4 "$FM" plan --config "$cfg" --seq-len 16
expect_fail "plan with FLATMOE_TEST_FP8_CODES=2" "FLATMOE_TEST_FP8_CODES=2: expected 1" \
    env FLATMOE_TEST_FP8_CODES=2 "$FM" plan --config "$cfg" --seq-len 16
# an empty value is unset, for every variable
env FLATMOE_PROFILE= FLATMOE_TEST_SIGNAL_AFTER= FLATMOE_TEST_CKPT_CHUNK= FLATMOE_TEST_CKPT_RESAVE= \
    FLATMOE_TEST_FP8_CODES= FLATMOE_EP_SCHEDULE= FLATMOE_CALIB_DIR= "$FM" train --config "$cfg" "${base[@]}" \
    --out "$TMP/empty" > "$TMP/empty.log" 2>&1 && ok || bad "empty variables failed: $(tail -3 "$TMP/empty.log")"

# (3) the values travel down
# FLATMOE_CALIB_DIR: <dir>/cpu.json is the table plan and train use
mkdir -p "$TMP/calib"
cp "$ROOT/configs/calib/cpu.json" "$TMP/calib/cpu.json"
out=$(FLATMOE_CALIB_DIR="$TMP/calib" "$FM" plan --config "$cfg" --seq-len 16 2>&1)
grep -qF "projection: calibration table $TMP/calib/cpu.json" <<<"$out" && ok ||
    bad "FLATMOE_CALIB_DIR=$TMP/calib: plan did not use its cpu.json: $(grep -m1 projection <<<"$out")"
out=$("$FM" plan --config "$cfg" --seq-len 16 2>&1)
grep -qF "$TMP/calib" <<<"$out" && bad "without FLATMOE_CALIB_DIR plan still used $TMP/calib" || ok
# FLATMOE_TEST_CKPT_RESAVE=1 on a resume: the loaded state is written again (its files are newer)
"$FM" train --config "$cfg" "${base[@]}" --out "$TMP/rs" > /dev/null 2>&1 || bad "the run to resume failed"
touch -d '2000-01-01' "$TMP/rs/step_000002/model.safetensors"
FLATMOE_TEST_CKPT_RESAVE=1 "$FM" train --config "$cfg" "${base[@]}" --steps 2 --resume --out "$TMP/rs" \
    > "$TMP/rs.log" 2>&1 || bad "FLATMOE_TEST_CKPT_RESAVE=1 resume failed: $(tail -3 "$TMP/rs.log")"
[ "$TMP/rs/step_000002/model.safetensors" -nt "$ROOT/CMakeLists.txt" ] && ok ||
    bad "FLATMOE_TEST_CKPT_RESAVE=1: the resumed run did not write the loaded state again"
# a bad FLATMOE_EP_SCHEDULE: a run without --ep never asks (as before the CLI read it)
FLATMOE_EP_SCHEDULE=overlap "$FM" train --config "$cfg" "${base[@]}" --out "$TMP/noep" > "$TMP/noep.log" 2>&1 && ok ||
    bad "FLATMOE_EP_SCHEDULE=overlap without --ep failed: $(tail -3 "$TMP/noep.log")"
# ... and one with --ep refuses it at the first chunk, on every rank alike
MPIEXEC=$(command -v mpirun || true)
if [ -n "$MPIEXEC" ]; then
    FLAGS=(--oversubscribe --allow-run-as-root --bind-to none --mca btl self,vader
           --mca btl_vader_single_copy_mechanism none --mca pml ob1)
    out=$(OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_mpi_yield_when_idle=1 FLATMOE_EP_SCHEDULE=overlap OMP_NUM_THREADS=1 \
          timeout 120 "$MPIEXEC" "${FLAGS[@]}" -x FLATMOE_EP_SCHEDULE -np 2 "$FM" train --config "$cfg" \
          --data "$TEXT" --seq-len 16 --micro-batch 1 --steps 1 --threads 1 --quiet --ep 2 --out "$TMP/ep" 2>&1); rc=$?
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q "rank 0's FLATMOE_EP_SCHEDULE is not one of auto, serial, pipelined" <<<"$out"
    then ok; echo "ok  FLATMOE_EP_SCHEDULE=overlap with --ep 2 (exit $rc)"
    else bad "FLATMOE_EP_SCHEDULE=overlap with --ep 2: rc $rc: $(tail -5 <<<"$out")"; fi
else
    echo "mpirun not found: the --ep check of FLATMOE_EP_SCHEDULE is skipped"
fi
finish
