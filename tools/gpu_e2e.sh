#!/usr/bin/env bash
# End-to-end check on an H100/H200 machine (run from the repo root): builds the CPU and CUDA
# builds, runs the GPU op tests, trains configs/tiny.json on the CPU and on the GPU from the same
# seed and prints both loss curves, and runs the Hugging Face parity of the CUDA build (bf16).
#   TEXT=path/to/text bash tools/gpu_e2e.sh [STEPS]
# Without OpenBLAS/cJSON installed, Debian packages in .deps/ are unpacked (tools/device_cpu_build.sh).
set -uo pipefail
STEPS=${1:-300}
TEXT=${TEXT:-.data/tinyshakespeare.txt}
D=/tmp/flatmoe-deps-root
if [ -d .deps ] && [ ! -d $D ]; then for f in .deps/*.deb; do dpkg -x "$f" $D; done; fi
export LD_LIBRARY_PATH="$D/usr/lib/x86_64-linux-gnu/openblas-openmp:$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
cmake -S . -B build-gpu -DFLATMOE_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_INCLUDE_PATH=$D/usr/include \
    "-DCMAKE_LIBRARY_PATH=$D/usr/lib/x86_64-linux-gnu/openblas-openmp;$D/usr/lib/x86_64-linux-gnu" >/dev/null || exit 1
cmake --build build-gpu -j"$(nproc)" 2>&1 | grep -E "error|warning" ; ls build-gpu/flatmoe build-gpu/flatmoe-cuda || exit 1
echo "== GPU op tests"
(cd build-gpu && FLATMOE_TEST_NO_BENCH=1 ctest -L gpu --output-on-failure 2>&1 | tail -8)
echo "== training tiny.json: CPU (fp32) and GPU (bf16), same seed, $STEPS steps"
common=(--config configs/tiny.json --data "$TEXT" --steps "$STEPS" --eval-every 100 --log-every 100 --seed 7)
rm -rf /tmp/e2e-cpu /tmp/e2e-gpu
OMP_NUM_THREADS=8 build-gpu/flatmoe train "${common[@]}" --threads 8 --out /tmp/e2e-cpu | grep -E "^step|^plan" &
build-gpu/flatmoe-cuda train "${common[@]}" --report-memory --out /tmp/e2e-gpu | grep -E "^step|^plan|^memory"
wait
python3 - <<'PY'
import json
def load(p): return {j["step"]: j for j in map(json.loads, open(p))}
c, g = load("/tmp/e2e-cpu/metrics.jsonl"), load("/tmp/e2e-gpu/metrics.jsonl")
print("step   cpu loss   gpu loss   cpu val    gpu val")
for s in sorted(set(c) & set(g)):
    if s % 25 == 0 or s == 1 or "val_loss" in g[s]:
        print(f"{s:5d}  {c[s]['loss']:.4f}    {g[s]['loss']:.4f}    {c[s].get('val_loss', float('nan')):.4f}    {g[s].get('val_loss', float('nan')):.4f}")
PY
build-gpu/flatmoe-cuda sample --ckpt /tmp/e2e-gpu --prompt "ROMEO:" --max-new-tokens 120 --seed 1
echo "== Hugging Face parity of the CUDA build (bf16)"
python3 tools/hf_parity.py build-gpu README.md --tol 3e-2 --flatmoe flatmoe-cuda 2>&1 | grep -E "^  |FAIL|parity|Error|error|Traceback" | tail -20
