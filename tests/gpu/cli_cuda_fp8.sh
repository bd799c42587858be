#!/usr/bin/env bash
# --expert-precision fp8 on the CUDA engine (label gpu; $1 is flatmoe-cuda): configs/tiny.json
# 20 steps with bf16 experts and with fp8 experts on both paths: on an sm_90 device the E4M3 codes
# (our FP8 grouped GEMM, sm90/gg_sm90_fp8.cu; FLATMOE_EXPERT_GEMM auto and sm90), and the emulation
# (the CUDA fake quantization in front of the cuBLAS grouped GEMMs; FLATMOE_EXPERT_GEMM=cublas):
# finite fp8 losses within 0.05 of bf16's at every step and not all equal to them, the two paths
# within 0.03 of each other (the same recipe; only the fp32 sums' order differs), the metrics
# header naming the path; every arena's high-water mark equal to its bound; two runs of a path the
# same bits (deterministic); fp8 chunked + recompute on each path.
source "$(dirname "$0")/../lib_cli.sh"
export FLATMOE_ATTENTION=fallback # bitwise-deterministic attention (cli_cuda_resume.sh says why)
cfg="$ROOT/configs/tiny.json"
common=(--config "$cfg" --data "$TEXT" --seq-len 128 --micro-batch 8 --steps 20 --warmup 5 --lr 2e-3 --eval-every 10
        --eval-batches 2 --seed 11 --report-memory --no-checkpoint)
losses() { python3 -c '
import json, sys
print(" ".join(repr(r["loss"]) for r in map(json.loads, open(sys.argv[1])) if "loss" in r))' "$1"; }
"$FM" train "${common[@]}" --out "$TMP/bf16" > "$TMP/bf16.log" 2>&1 || bad "bf16 run failed: $(tail -3 "$TMP/bf16.log")"
path_of() { grep -m1 '"type": *"header"' "$1" | grep -o '"expert_fp8_path": *"[a-z]*"' | grep -o '[a-z]*"$' | tr -d '"'; }
"$FM" train "${common[@]}" --expert-precision fp8 --out "$TMP/fp8" > "$TMP/fp8.log" 2>&1 || bad "fp8 run failed: $(tail -3 "$TMP/fp8.log")"
"$FM" train "${common[@]}" --expert-precision fp8 --out "$TMP/fp8b" > "$TMP/fp8b.log" 2>&1 || bad "second fp8 run failed"
FLATMOE_EXPERT_GEMM=cublas "$FM" train "${common[@]}" --expert-precision fp8 --out "$TMP/emu" > "$TMP/emu.log" 2>&1 \
    || bad "fp8 emulated run failed: $(tail -3 "$TMP/emu.log")"
FLATMOE_EXPERT_GEMM=cublas "$FM" train "${common[@]}" --expert-precision fp8 --out "$TMP/emub" > "$TMP/emub.log" 2>&1 \
    || bad "second fp8 emulated run failed"
p8=$(path_of "$TMP/fp8/metrics.jsonl"); pe=$(path_of "$TMP/emu/metrics.jsonl")
echo "fp8 paths: default $p8, FLATMOE_EXPERT_GEMM=cublas $pe"
[ "$pe" = emulated ] && ok || bad "FLATMOE_EXPERT_GEMM=cublas with fp8 ran '$pe', not the emulation"
[ "$p8" = codes ] || [ "$p8" = emulated ] && ok || bad "no expert_fp8_path in the header: '$p8'"
a=$(losses "$TMP/bf16/metrics.jsonl"); b=$(losses "$TMP/fp8/metrics.jsonl"); c=$(losses "$TMP/fp8b/metrics.jsonl")
e=$(losses "$TMP/emu/metrics.jsonl"); f=$(losses "$TMP/emub/metrics.jsonl")
echo "bf16:         $a"; echo "fp8 ($p8): $b"; echo "fp8 emulated: $e"
python3 - "$a" "$b" "$e" <<'PY' && ok || bad "fp8 losses not finite / not within 0.05 of bf16 / all equal to bf16 / the paths apart"
import math, sys
a, b, e = ([float(x) for x in s.split()] for s in sys.argv[1:4])
assert len(a) == len(b) == len(e) == 20 and all(math.isfinite(x) for x in b + e)
for v in (b, e):
    assert max(abs(x - y) for x, y in zip(a, v)) < 0.05, max(abs(x - y) for x, y in zip(a, v))
    assert a != v
assert max(abs(x - y) for x, y in zip(b, e)) < 0.03, ("codes vs emulated", max(abs(x - y) for x, y in zip(b, e)))
PY
[ "$b" = "$c" ] && ok || bad "two fp8 runs differ: $b vs $c"
[ "$e" = "$f" ] && ok || bad "two fp8 emulated runs differ: $e vs $f"
for log in "$TMP/fp8.log" "$TMP/emu.log"; do
    while read -r set bound hw; do
        [ "$hw" -le "$bound" ] && [ $(( hw + 64 )) -ge "$bound" ] && ok || bad "$log: $set: high-water $hw vs bound $bound"
    done < <(grep "^memory:" "$log" | grep -v "live set\|attention\|device in use" | sed -E 's/^memory: +(.*[a-z)]) +([0-9]+) +([0-9]+) .*/\1|\2|\3/' | \
             awk -F'|' '{gsub(/ /, "_", $1); print $1, $2, $3}')
done
for g in auto cublas; do
    FLATMOE_EXPERT_GEMM=$g "$FM" train "${common[@]}" --expert-precision fp8 --moe-chunk-tokens 256 --recompute full --out "$TMP/chunk-$g" \
        > "$TMP/chunk-$g.log" 2>&1 && ok || bad "fp8 chunked + recompute ($g) failed: $(tail -3 "$TMP/chunk-$g.log")"
done
if [ "$p8" = codes ]; then # FLATMOE_EXPERT_GEMM=sm90 asks for the same path
    FLATMOE_EXPERT_GEMM=sm90 "$FM" train "${common[@]}" --steps 2 --expert-precision fp8 --out "$TMP/sm90" > "$TMP/sm90.log" 2>&1 \
        && [ "$(path_of "$TMP/sm90/metrics.jsonl")" = codes ] && ok || bad "FLATMOE_EXPERT_GEMM=sm90 with fp8: $(tail -3 "$TMP/sm90.log")"
fi
finish
