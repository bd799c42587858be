#!/usr/bin/env bash
# Last check of a session on the H200: build, ctest -L gpu, and the checkpoint offload's A/B on the
# CUDA engine (tiny.json, deterministic attention: --offload-boundaries all must give the same
# metrics and weights as no offload).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/final}; mkdir -p "$OUT"
D=/tmp/flatmoe-deps-root
[ -d $D ] || for f in .deps/*.deb; do dpkg -x "$f" $D; done
export LD_LIBRARY_PATH="$D/usr/lib/x86_64-linux-gnu/openblas-openmp:$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
cmake -S . -B build-gpu -DFLATMOE_CUDA=ON -DFLATMOE_MPI=OFF -DCMAKE_BUILD_TYPE=Release -DCMAKE_INCLUDE_PATH=$D/usr/include \
    "-DCMAKE_LIBRARY_PATH=$D/usr/lib/x86_64-linux-gnu/openblas-openmp;$D/usr/lib/x86_64-linux-gnu" > "$OUT/build.log" 2>&1 &&
    cmake --build build-gpu -j16 >> "$OUT/build.log" 2>&1; echo "build: $?"; grep -E " error|warning:" "$OUT/build.log" | head
(cd build-gpu && ctest -L gpu --output-on-failure > "$OUT/ctest.log" 2>&1; echo "ctest -L gpu: $?"); grep -E "Test +#|tests passed" "$OUT/ctest.log"
for off in 0 all; do
    rm -rf /tmp/sco-$off
    FLATMOE_ATTENTION=fallback build-gpu/flatmoe-cuda train --config configs/tiny.json --data .data/tinyshakespeare.txt --steps 6 \
        --seq-len 128 --micro-batch 8 --recompute 1,2 --offload-boundaries $off --report-memory --quiet --out /tmp/sco-$off > "$OUT/sco-$off.log" 2>&1
    echo "sco $off: exit $?"
done
python3 - <<'PY'
import json
def rows(p): return [(r["step"], r["loss"], r["grad_norm"], r.get("val_loss")) for r in map(json.loads, open(p)) if r.get("type", "step") == "step"]
a, b = rows("/tmp/sco-0/metrics.jsonl"), rows("/tmp/sco-all/metrics.jsonl")
print("sco metrics:", "same" if a == b and len(a) == 6 else "DIFFER %s vs %s" % (a[:2], b[:2]))
PY
cmp /tmp/sco-0/step_000006/model.safetensors /tmp/sco-all/step_000006/model.safetensors && echo "sco weights: bit-identical"
grep -h "host_syncs" /tmp/sco-all/metrics.jsonl | head -1 | grep -o '"host_syncs":[0-9]*'
