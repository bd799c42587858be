#!/usr/bin/env bash
# What a new user met following the README from a fresh clone (installed binary, fine-tuning,
# contradictory flags): each case here failed, or misled, before its fix.
source "$(dirname "$0")/lib_cli.sh"
cfg="$ROOT/tests/data/micro.json"
base=(--data "$TEXT" --seq-len 16 --micro-batch 2 --threads 2 --quiet)
head -c 4000 "$TEXT" > "$TMP/small.txt" # an epoch of a few steps (a binary that ignored the refusal still ends soon)
small=(--data "$TMP/small.txt" --seq-len 16 --micro-batch 2 --threads 2 --quiet)

# The installed flatmoe (scripts/setup.sh: cmake --install) finds the calibration tables that the
# built one finds in configs/calib: plan's projection is the README's, not the built-in estimate.
BUILD=$(dirname "$FM")
if [ -f "$BUILD/cmake_install.cmake" ]; then
    cmake --install "$BUILD" --prefix "$TMP/prefix" > /dev/null && ok || bad "cmake --install failed"
    (cd "$TMP" && "$TMP/prefix/bin/flatmoe" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 4096 \
        --device-mem 79GiB) > "$TMP/plan_installed.txt" 2>&1
    grep -q "^projection: calibration table $TMP/prefix/bin/../share/flatmoe/calib/h200.json" "$TMP/plan_installed.txt" && ok ||
        bad "the installed flatmoe plan did not use PREFIX/share/flatmoe/calib/h200.json: $(head -3 "$TMP/plan_installed.txt")"
    "$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 4096 --device-mem 79GiB 2>&1 |
        grep -v "^projection:\|(rates:" > "$TMP/plan_built.txt"
    grep -v "^projection:\|(rates:" "$TMP/plan_installed.txt" | diff - "$TMP/plan_built.txt" > /dev/null && ok ||
        bad "the installed and the built flatmoe plan differently"
else
    echo "skipped the install case: $BUILD has no cmake_install.cmake"
fi

# --steps with --epochs: the epochs decide the steps, so --steps was silently ignored; refused,
# also on a --resume of a run started with --epochs
expect_fail "--steps with --epochs" "--steps 3 and --epochs 2 contradict each other" \
    "$FM" train --config "$cfg" "${small[@]}" --steps 3 --epochs 2 --out "$TMP/ep"
"$FM" train --config "$cfg" "${small[@]}" --epochs 1 --exit-after 1 --out "$TMP/ep1" > /dev/null 2>&1 && ok ||
    bad "an --epochs run failed"
expect_fail "--resume --steps of an --epochs run" "--epochs 1 (the run's) contradict" \
    "$FM" train --out "$TMP/ep1" --resume --steps 5 --quiet
"$FM" train --out "$TMP/ep1" --resume --epochs 0 --steps 2 --quiet > "$TMP/ep0.log" 2>&1 && ok ||
    bad "--resume --epochs 0 --steps 2 of an --epochs run failed: $(tail -3 "$TMP/ep0.log")"

# --init-from a folder with a tokenizer and text --data: train reads text one token per byte (ids
# 0..255 of that vocabulary), silently, where eval and sample encode it with the tokenizer: a
# warning naming the prepare command; token shards of that tokenizer get none
FX=$(dirname "$FM")/fm_hf_fixture
sed 's/"vocab_size": 256/"vocab_size": 3072/' "$cfg" > "$TMP/micro3072.json"
"$FM" train --config "$TMP/micro3072.json" "${base[@]}" --steps 1 --out "$TMP/v3072" > /dev/null 2>&1 || bad "vocab 3072 run failed"
"$FX" "$TMP/v3072/step_000001" "$TMP/hf" --dtype f32 > /dev/null || bad "fm_hf_fixture failed"
cp "$ROOT/tests/data/tok/olmoe/tokenizer.json" "$TMP/hf/"
ft=(--seq-len 16 --micro-batch 2 --threads 2 --steps 1 --quiet)
out=$("$FM" train --init-from "$TMP/hf" --data "$TEXT" "${ft[@]}" --out "$TMP/ft-text" 2>&1 >/dev/null) || bad "--init-from with text failed: $out"
grep -qF "warning: --data $TEXT is text, which train reads one token per byte" <<<"$out" &&
    grep -qF "flatmoe prepare --tokenizer $TMP/hf --input $TEXT --out PREFIX" <<<"$out" && ok ||
    bad "--init-from a folder with a tokenizer and text --data: no warning naming the prepare command: $out"
head -c 20000 "$TEXT" > "$TMP/part.txt"
"$FM" prepare --tokenizer "$TMP/hf" --input "$TMP/part.txt" --out "$TMP/tok/part" > /dev/null || bad "prepare failed"
out=$("$FM" train --init-from "$TMP/hf" --data "$TMP/tok/part_000000.bin" "${ft[@]}" --out "$TMP/ft-tok" 2>&1 >/dev/null) ||
    bad "--init-from with token shards failed: $out"
! grep -q "one token per byte" <<<"$out" && ok || bad "token shards got the text warning: $out"

# a count below 1 names the flag and the value found (it listed all four flags)
expect_fail "--steps 0" "--steps must be >= 1, found 0" "$FM" train --config "$cfg" "${small[@]}" --steps 0 --out "$TMP/s0"
expect_fail "--micro-batch -1" "--micro-batch must be >= 1, found -1" \
    "$FM" train --config "$cfg" "${small[@]}" --micro-batch -1 --steps 1 --out "$TMP/s0"

finish
