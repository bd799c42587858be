#!/usr/bin/env bash
# GPU benchmark, flatmoe-cuda and the PyTorch peer in one invocation on one H200 (issue "CUDA
# backend: train on one H200 in bf16"): OLMoE-1B-7B, micro-batch 1, the given sequence lengths.
#   bash bench/run_gpu.sh [SEQ_LEN ...]     (default 4096 16384)
# Environment: FM=0 skips flatmoe, PEER=0 skips the peer, STEPS (default 6; 3 from 64K on),
# OUTDIR (default /tmp/bench-gpu: each flatmoe run's metrics.jsonl and log, peer.jsonl, table.md),
# APPEND=1 appends the table, with the date, GPU and commit, to bench/log/run_gpu-DATE.md (then update
# bench/RESULTS.md's current table by hand).
# flatmoe chooses its knobs for the GPU's memory (no --mem-budget: the planner takes the device's
# free memory less a reserve) and runs with FLATMOE_PROFILE=1 (a per-phase time breakdown per
# step). bench/gpu_table.py turns OUTDIR into a table in RESULTS.md's form.
set -uo pipefail
LENS=${*:-4096 16384}
OUTDIR=${OUTDIR:-/tmp/bench-gpu}
mkdir -p "$OUTDIR"
D=/tmp/flatmoe-deps-root
if [ -d .deps ] && [ ! -d $D ]; then for f in .deps/*.deb; do dpkg -x "$f" $D; done; fi
export LD_LIBRARY_PATH="$D/usr/lib/x86_64-linux-gnu/openblas-openmp:$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
if [ ! -x build-gpu/flatmoe-cuda ] || [ "${REBUILD:-1}" = 1 ]; then
    cmake -S . -B build-gpu -DFLATMOE_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_INCLUDE_PATH=$D/usr/include \
        "-DCMAKE_LIBRARY_PATH=$D/usr/lib/x86_64-linux-gnu/openblas-openmp;$D/usr/lib/x86_64-linux-gnu" >/dev/null || exit 1
    cmake --build build-gpu -j"$(nproc)" --target flatmoe-cuda 2>&1 | grep -E " error" ; ls build-gpu/flatmoe-cuda >/dev/null || exit 1
fi
TEXT=${TEXT:-.data/tinyshakespeare.txt}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [ "${FM:-1}" = 1 ]; then
    for T in $LENS; do
        steps=${STEPS:-$([ "$T" -ge 65536 ] && echo 3 || echo 6)}
        # tinyshakespeare's 10% validation split is 111K tokens: long windows need a larger split
        vf=$([ "$T" -ge 100000 ] && echo 0.3 || echo 0.1)
        echo "== flatmoe-cuda, OLMoE-1B-7B, T=$T, $steps steps"
        rm -rf "/tmp/bench-fm-$T"
        FLATMOE_PROFILE=1 build-gpu/flatmoe-cuda train --config configs/olmoe-1b-7b.json --data "$TEXT" --seq-len "$T" \
            --micro-batch 1 --steps "$steps" --warmup 1 --lr 1e-4 --min-lr 1e-5 --eval-every 0 --eval-batches 1 --val-fraction "$vf" \
            --max-position-embeddings 1048576 --report-memory --no-checkpoint \
            --out "/tmp/bench-fm-$T" > "$OUTDIR/fm-$T.log" 2>&1
        echo "exit $?"
        grep -E "^memory budget|^plan|^step|^profile|^memory|error" "$OUTDIR/fm-$T.log" | head -40
        cp "/tmp/bench-fm-$T/metrics.jsonl" "$OUTDIR/fm-$T.jsonl" 2>/dev/null
    done
fi
if [ "${PEER:-1}" = 1 ]; then
    echo "== PyTorch peer (transformers, bf16, SDPA, grouped_mm experts, fused AdamW)"
    PYTHONUNBUFFERED=1 python3 bench/peer_hf.py configs/olmoe-1b-7b.json $LENS --steps 3 --json "$OUTDIR/peer.jsonl" 2>&1 |
        grep -v Warning
fi
echo "== table (bench/gpu_table.py $OUTDIR)"
python3 bench/gpu_table.py "$OUTDIR" | tee "$OUTDIR/table.md"
if [ "${APPEND:-0}" = 1 ]; then
    {
        echo
        echo "## $(date -u +%F) — bench/run_gpu.sh $LENS (appended by the script)"
        echo
        echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1);" \
             "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown); STEPS=${STEPS:-default} FM=${FM:-1} PEER=${PEER:-1}"
        echo
        cat "$OUTDIR/table.md"
    } >> "bench/log/run_gpu-$(date -u +%F).md"
    echo "appended to bench/log/run_gpu-$(date -u +%F).md"
fi
