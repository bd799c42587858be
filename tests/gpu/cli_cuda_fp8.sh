#!/usr/bin/env bash
# --expert-precision fp8 on the CUDA engine (label gpu; $1 is flatmoe-cuda): configs/tiny.json
# 20 steps with bf16 experts and with fp8 experts (the CUDA fake quantization, cuda_fp8.cu, in
# front of the cuBLAS grouped GEMMs): finite fp8 losses within 0.05 of bf16's at every step and
# not all equal to them; every arena's high-water mark equal to its bound; two fp8 runs the same
# bits (the quantizer is deterministic); fp8 chunked + recompute runs too; the sm90 kernel
# (FLATMOE_EXPERT_GEMM=sm90) is refused with fp8.
source "$(dirname "$0")/../lib_cli.sh"
export FLATMOE_ATTENTION=fallback # bitwise-deterministic attention (cli_cuda_resume.sh says why)
cfg="$ROOT/configs/tiny.json"
common=(--config "$cfg" --data "$TEXT" --seq-len 128 --micro-batch 8 --steps 20 --warmup 5 --lr 2e-3 --eval-every 10
        --eval-batches 2 --seed 11 --report-memory --no-checkpoint)
losses() { python3 -c '
import json, sys
print(" ".join(repr(r["loss"]) for r in map(json.loads, open(sys.argv[1])) if "loss" in r))' "$1"; }
"$FM" train "${common[@]}" --out "$TMP/bf16" > "$TMP/bf16.log" 2>&1 || bad "bf16 run failed: $(tail -3 "$TMP/bf16.log")"
"$FM" train "${common[@]}" --expert-precision fp8 --out "$TMP/fp8" > "$TMP/fp8.log" 2>&1 || bad "fp8 run failed: $(tail -3 "$TMP/fp8.log")"
"$FM" train "${common[@]}" --expert-precision fp8 --out "$TMP/fp8b" > "$TMP/fp8b.log" 2>&1 || bad "second fp8 run failed"
a=$(losses "$TMP/bf16/metrics.jsonl"); b=$(losses "$TMP/fp8/metrics.jsonl"); c=$(losses "$TMP/fp8b/metrics.jsonl")
echo "bf16: $a"; echo "fp8:  $b"
python3 - "$a" "$b" <<'PY' && ok || bad "fp8 losses not finite / not within 0.05 of bf16 / all equal to bf16"
import math, sys
a = [float(x) for x in sys.argv[1].split()]; b = [float(x) for x in sys.argv[2].split()]
assert len(a) == len(b) == 20 and all(math.isfinite(x) for x in b)
assert max(abs(x - y) for x, y in zip(a, b)) < 0.05, max(abs(x - y) for x, y in zip(a, b))
assert a != b
PY
[ "$b" = "$c" ] && ok || bad "two fp8 runs differ: $b vs $c"
for log in "$TMP/fp8.log"; do
    while read -r set bound hw; do
        [ "$hw" -le "$bound" ] && [ $(( hw + 64 )) -ge "$bound" ] && ok || bad "$set: high-water $hw vs bound $bound"
    done < <(grep "^memory:" "$log" | grep -v "live set\|attention\|device in use" | sed -E 's/^memory: +(.*[a-z)]) +([0-9]+) +([0-9]+) .*/\1|\2|\3/' | \
             awk -F'|' '{gsub(/ /, "_", $1); print $1, $2, $3}')
done
"$FM" train "${common[@]}" --expert-precision fp8 --moe-chunk-tokens 256 --recompute full --out "$TMP/chunk" > "$TMP/chunk.log" 2>&1 \
    && ok || bad "fp8 chunked + recompute failed: $(tail -3 "$TMP/chunk.log")"
expect_fail "fp8 with FLATMOE_EXPERT_GEMM=sm90" "--expert-precision fp8 with FLATMOE_EXPERT_GEMM=sm90" \
    env FLATMOE_EXPERT_GEMM=sm90 "$FM" train "${common[@]}" --expert-precision fp8 --out "$TMP/bad"
finish
