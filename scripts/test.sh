#!/usr/bin/env bash
# Sets up, builds and runs every test (ctest: op tests against fp64 references and finite
# differences, the whole model's gradient, io, data, exact resume, bad inputs, a short training
# run on real text).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cd build
ctest --output-on-failure --timeout 900 "$@"
