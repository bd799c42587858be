#!/usr/bin/env bash
# ctest python_flatmoe (and python_grpo_toy: run_test.sh SCRIPT ARGS...): runs python/test_flatmoe.py,
# or SCRIPT with ARGS, with the first python3 that imports numpy (the
# PATH's, else Debian's /usr/bin/python3, where scripts/setup.sh installs python3-numpy); exit 77
# (skipped) where none does, or under the sanitized build (FLATMOE_TEST_SANITIZED=1: an
# ASan-instrumented libflatmoe.so cannot be loaded into an uninstrumented Python).
if [ "${FLATMOE_TEST_SANITIZED:-0}" = 1 ]; then
    echo "the sanitized build's libflatmoe.so cannot load into python3: the binding's test is skipped"
    exit 77
fi
for py in python3 /usr/bin/python3; do
    if command -v "$py" >/dev/null && "$py" -c "import numpy" 2>/dev/null; then
        if [ $# -gt 0 ]; then exec "$py" "$@"; fi
        exec "$py" "$(dirname "$0")/test_flatmoe.py"
    fi
done
echo "no python3 here imports numpy (apt-get install python3-numpy): the binding's test is skipped"
exit 77
