#!/usr/bin/env bash
# The engine-core v2 checks on one H200 (issue 9), in parts so each fits a device call:
#   bash bench/core_v2_gpu.sh build     # unpack .deps, build this tree (build-gpu) and the previous
#                                       # main (.old/prev.tar.gz -> /tmp/prev/build-gpu) side by side
#   bash bench/core_v2_gpu.sh test      # ctest -L gpu, then the mutation checks (a broken bf16 path
#                                       # must make test_cuda_model fail)
#   bash bench/core_v2_gpu.sh bench [T ...]  # OLMoE-1B-7B tokens/s and host syncs per step, previous
#                                       # main then this tree at each length (default 4K 16K 64K 128K)
# Logs go to $OUT (or /tmp/core-v2).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/core-v2}
mkdir -p "$OUT"
D=/tmp/flatmoe-deps-root
if [ -d .deps ] && [ ! -d $D ]; then for f in .deps/*.deb; do dpkg -x "$f" $D; done; fi
export LD_LIBRARY_PATH="$D/usr/lib/x86_64-linux-gnu/openblas-openmp:$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
CM=(-DFLATMOE_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_INCLUDE_PATH=$D/usr/include
    "-DCMAKE_LIBRARY_PATH=$D/usr/lib/x86_64-linux-gnu/openblas-openmp;$D/usr/lib/x86_64-linux-gnu")
TEXT=${TEXT:-$PWD/.data/tinyshakespeare.txt}
case "${1:-}" in
build)
    rm -rf /tmp/prev && mkdir -p /tmp/prev && tar -xzf .old/prev.tar.gz -C /tmp/prev
    (cmake -S /tmp/prev -B /tmp/prev/build-gpu "${CM[@]}" >/dev/null && \
        cmake --build /tmp/prev/build-gpu -j8 --target flatmoe-cuda > "$OUT/build-prev.log" 2>&1; echo "prev build: $?") &
    cmake -S . -B build-gpu "${CM[@]}" > "$OUT/build-new.log" 2>&1 && cmake --build build-gpu -j12 >> "$OUT/build-new.log" 2>&1
    echo "new build: $?"; grep -E "error|warning" "$OUT/build-new.log" | head -20
    wait; ls -la build-gpu/flatmoe-cuda /tmp/prev/build-gpu/flatmoe-cuda ;;
test)
    (cd build-gpu && ctest -L gpu --output-on-failure --timeout 600 > "$OUT/ctest-gpu.log" 2>&1; echo "ctest -L gpu: $?")
    grep -E "Test +#|tests passed|FAIL" "$OUT/ctest-gpu.log" | head -40
    # mutations: each a broken bf16 path on a copy of the tree; test_cuda_model must fail
    for mut in rz half; do
        rm -rf /tmp/mut && mkdir /tmp/mut && cp -r src tests configs tools bench CMakeLists.txt /tmp/mut/
        if [ $mut = rz ]; then  # truncate instead of round in the fp32 -> bf16 conversion
            sed -i 's/dst\[i\] = __float2bfloat16_rn(src\[i\]);/dst[i] = __float2bfloat16_rz(src[i]);/' /tmp/mut/src/backend/cuda/cuda_elementwise.cu
            grep -c "__float2bfloat16_rz(src" /tmp/mut/src/backend/cuda/cuda_elementwise.cu
        else  # the linear-CE gradient strip converted for only half of its elements
            sed -i 's/    ops->convert(ctx, copy, FM_ACT_DTYPE, g, FM_DTYPE_F32, n);/    ops->convert(ctx, copy, FM_ACT_DTYPE, g, FM_DTYPE_F32, n \/ 2);/' /tmp/mut/src/bounded/fm_linear_ce.c
            grep -c "FM_DTYPE_F32, n / 2" /tmp/mut/src/bounded/fm_linear_ce.c
        fi
        cmake -S /tmp/mut -B /tmp/mut/b "${CM[@]}" >/dev/null && cmake --build /tmp/mut/b -j12 --target test_cuda_model >/dev/null 2>&1
        (cd /tmp/mut && ./b/test_cuda_model > "$OUT/mut-$mut.log" 2>&1; echo "mutation $mut: test_cuda_model exit $? (must be non-zero)")
        grep -m3 FAIL "$OUT/mut-$mut.log"; tail -1 "$OUT/mut-$mut.log"
    done ;;
bench)
    shift; LENS=${*:-4096 16384 65536 131072}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    for T in $LENS; do
        steps=$([ "$T" -ge 65536 ] && echo 3 || echo 5)
        vf=$([ "$T" -ge 100000 ] && echo 0.3 || echo 0.1)
        for which in prev new; do
            bin=$([ $which = prev ] && echo /tmp/prev/build-gpu/flatmoe-cuda || echo build-gpu/flatmoe-cuda)
            rm -rf "/tmp/b-$which-$T"
            "$bin" train --config configs/olmoe-1b-7b.json --data "$TEXT" --seq-len "$T" --micro-batch 1 --steps "$steps" \
                --warmup 1 --lr 1e-4 --min-lr 1e-5 --eval-every 0 --eval-batches 1 --val-fraction "$vf" \
                --max-position-embeddings 1048576 --no-checkpoint --out "/tmp/b-$which-$T" > "$OUT/$which-$T.log" 2>&1
            echo "== $which T=$T exit $?: $(grep -m1 '^plan' "$OUT/$which-$T.log" | cut -c1-160)"
            cp "/tmp/b-$which-$T/metrics.jsonl" "$OUT/$which-$T.jsonl" 2>/dev/null
            python3 - "$OUT/$which-$T.jsonl" <<'PY'
import json, sys, statistics
try: rows = [r for r in map(json.loads, open(sys.argv[1])) if r.get("type", "step") == "step"]
except Exception as e: print("  no metrics:", e); sys.exit()
later = [r for r in rows if r["step"] > 1]
print("  tokens/s per step:", [round(r["tokens_per_s"]) for r in rows], " host syncs per step:", [r.get("host_syncs") for r in rows],
      " median after step 1: %.0f" % statistics.median([r["tokens_per_s"] for r in later]) if later else "")
PY
        done
    done ;;
*) echo "usage: bash bench/core_v2_gpu.sh build|test|bench [T ...]"; exit 2 ;;
esac
