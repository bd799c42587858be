#!/usr/bin/env bash
# What a new user met following the README from a fresh clone (installed binary, fine-tuning,
# contradictory flags): each case here failed, or misled, before its fix.
source "$(dirname "$0")/lib_cli.sh"
cfg="$ROOT/tests/data/micro.json"
base=(--data "$TEXT" --seq-len 16 --micro-batch 2 --threads 2 --quiet)

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

finish
