#!/usr/bin/env bash
# GPU benchmark, flatmoe-cuda and the PyTorch peer in one invocation on one H200 (issue "CUDA
# backend: train on one H200 in bf16"): OLMoE-1B-7B, micro-batch 1, the given sequence lengths.
#   bash bench/run_gpu.sh [SEQ_LEN ...]     (default 4096 16384)
# flatmoe's knobs are chosen by its planner for --mem-budget (the GPU's memory less a margin).
set -uo pipefail
LENS=${*:-4096 16384}
D=/tmp/flatmoe-deps-root
if [ -d .deps ] && [ ! -d $D ]; then for f in .deps/*.deb; do dpkg -x "$f" $D; done; fi
export LD_LIBRARY_PATH="$D/usr/lib/x86_64-linux-gnu/openblas-openmp:$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
cmake -S . -B build-gpu -DFLATMOE_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_INCLUDE_PATH=$D/usr/include \
    "-DCMAKE_LIBRARY_PATH=$D/usr/lib/x86_64-linux-gnu/openblas-openmp;$D/usr/lib/x86_64-linux-gnu" >/dev/null || exit 1
cmake --build build-gpu -j"$(nproc)" --target flatmoe-cuda 2>&1 | grep -E " error" ; ls build-gpu/flatmoe-cuda || exit 1
TEXT=${TEXT:-.data/tinyshakespeare.txt}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
for T in $LENS; do
    echo "== flatmoe-cuda, OLMoE-1B-7B, T=$T"
    build-gpu/flatmoe-cuda train --config configs/olmoe-1b-7b.json --data "$TEXT" --seq-len "$T" --micro-batch 1 \
        --steps 4 --warmup 1 --lr 1e-4 --eval-every 0 --eval-batches 1 --mem-budget 132GiB --max-position-embeddings 1048576 --gpu-workspace 256MiB --report-memory --no-checkpoint \
        --out "/tmp/bench-fm-$T" 2>&1 | grep -E "^plan|^step|^memory|error" | head -30
    nvidia-smi --query-gpu=memory.used --format=csv,noheader
done
echo "== PyTorch peer (transformers, bf16, SDPA, grouped_mm experts, fused AdamW)"
PYTHONUNBUFFERED=1 python3 bench/peer_hf.py configs/olmoe-1b-7b.json $LENS --steps 3 --json /tmp/peer.jsonl 2>&1 | grep -v Warning
