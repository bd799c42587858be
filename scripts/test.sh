#!/usr/bin/env bash
# Sets up, builds and runs every test (ctest: op tests against fp64 references and finite
# differences, the whole model's gradient, io, data, planner, exact resume, bad inputs, a short
# training run on real text). Where nvcc is installed it also compiles the CUDA build
# (-DFLATMOE_CUDA=ON: the CUDA backend, its GPU tests and flatmoe-cuda) without running the GPU
# tests (ctest -L gpu runs them on a machine with an H100/H200).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
CUDA_INC=$(dirname "$(dirname "${NVCC:-/nonexistent/bin/nvcc}")")/include
if [ -n "$NVCC" ] && [ -f "$CUDA_INC/cudnn.h" ]; then
    echo "== compiling the CUDA build with $NVCC (GPU tests are not run here)"
    cmake -S . -B build-cuda -DFLATMOE_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$NVCC" >/dev/null
    cmake --build build-cuda -j"$(nproc)"
elif [ -n "$NVCC" ]; then
    echo "== nvcc found but no cudnn.h next to it: the CUDA build is not compiled"
fi
cd build
ctest --output-on-failure --timeout 900 "$@"
