#!/usr/bin/env bash
# The CPU benchmark of the bounded operators (issue "Every memory peak bounded at launch"):
# plain twin vs bounded operator (time, measured peak) for the linear cross-entropy and the
# chunked MoE at 8K-32K tokens with a 50K vocabulary, the longest context that fits 16 GiB,
# and one training step of bench/configs/bench-50k.json at 8K tokens each way.
#   bench/run_cpu.sh BUILD_DIR [TEXT]     (run on a quiet machine; ~15 min on 2 cores)
set -euo pipefail
B=$(readlink -f "$1"); cd "$(dirname "$0")/.."
TEXT=${2:-../shared/data/tinyshakespeare.txt}
echo "== $(date -u +%F) commit $(git rev-parse --short HEAD) on $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
echo "== linear cross-entropy, H=512 V=50304, blocks 1024 x 4096"
for N in 8192 16384; do "$B/bench_linear_ce" $N 512 50304 1024 4096; done
echo "== MoE dispatch, one layer fwd+bwd"
"$B/bench_moe" 8192 16384 32768
echo "== longest context"
bash bench/longest_context.sh "$B" bench/configs/bench-50k.json 16GiB "$(nproc)"
echo "== one training step at 8192 tokens (bench-50k.json), plain twins vs bounded operators"
for mode in plain bounded; do
    rm -rf "/tmp/flatmoe-bench-$mode"
    if [ $mode = plain ]; then flags=(--recompute none --moe-chunk-tokens 0 --ce-block-tokens 0 --ce-block-vocab 0)
    else flags=(--recompute full --moe-chunk-tokens 1024 --ce-block-tokens 1024 --ce-block-vocab 4096); fi
    "$B/flatmoe" train --config bench/configs/bench-50k.json --data "$TEXT" --seq-len 8192 --micro-batch 1 --steps 1 \
        --eval-batches 1 --report-memory --mem-budget 16GiB "${flags[@]}" --out "/tmp/flatmoe-bench-$mode" |
        grep -E "^plan|^memory|^step"
done
