#!/usr/bin/env bash
# v5's device run in one command (issue 14), from the repo root on the H200:
#   bash dev/cuda/grouped_gemm/v5_gpu.sh
# 1. builds the lab (make grouped_gemm, ptxas's report in ptxas.txt: spills and serialized wgmmas counted);
# 2. smoke: each v5 variant alone, validation only (GG_NOTIME=1), on the edge cases small-full (every
#    element checked, partial m-tiles, groups starting at odd rows), empty-groups, one-group (8,192
#    rows: dW with 64 k-blocks a tile), and empty-groups with GG_DW_BETA=0 (the beta-0 dW kernel, tiles
#    of empty groups with no k-block); each call bounded (the lab's watchdog: 60 s, exit 3; timeout 150 s);
# 3. the lab's table (make run: validation + timing of every case, then torch) for v3, v4 and every
#    variant whose smoke neither crashed (exit 2) nor hung (exit 3 / 124): a wrong one (exit 1) stays,
#    so that its FAIL lines show. GG_CASES, GG_ITERS, GG_DW_BETA set by the caller apply to step 3.
# Files in $OUT (or the lab folder): smoke_<version>_<case>.txt / .err, gg_lab*.txt, gg_compare.txt.
# Exit status: step 3's (make run: 0 all correct, 1 a wrong result, 2 crash, 3 hang). Then the dx and dW rows
# of the 512- and 2,048-row cases (make run shows fwd and fwd+bwd only).
set -u
cd "$(dirname "$0")" || exit 2
OUTDIR=${OUT:-.}
# ptxas's report kept (-Xptxas -v: the same code; only the log differs): spills, and C7514 / C7517 (wgmma
# serialized / waits injected) that would make OVL a loss. Here (CUDA 13.0): none for any kernel.
make grouped_gemm NVFLAGS="-O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v" > "$OUTDIR/ptxas.txt" 2>&1 ||
    { tail -n 20 "$OUTDIR/ptxas.txt"; exit 2; }
if grep -q "ptxas info" "$OUTDIR/ptxas.txt"; then
    echo "# ptxas ($(nvcc --version | tail -n 1)): $(grep -c 'C751[47]' "$OUTDIR/ptxas.txt") C7514/C7517 lines;" \
        "$(grep -E 'bytes spill' "$OUTDIR/ptxas.txt" | grep -vc ' 0 bytes spill stores') kernels with spills (ptxas.txt)"
else
    echo "# grouped_gemm was up to date: no ptxas report"
fi
keep="v3,v4"
for v in v5 v5a v5b v5c; do
    st=0
    for c in small-full empty-groups one-group empty-groups/dwbeta0; do
        name=${c%/*}
        beta=1
        [ "$c" != "$name" ] && beta=0
        tag="${v}_${name}$([ $beta = 0 ] && echo _dwbeta0)"
        GG_VERSIONS=$v GG_CASES=$name GG_NOTIME=1 GG_DW_BETA=$beta timeout 150 ./grouped_gemm > "$OUTDIR/smoke_$tag.txt" 2> "$OUTDIR/smoke_$tag.err"
        s=$?
        echo "# smoke $v $c: exit $s; $(grep -E '^# (all versions|FAILED)' "$OUTDIR/smoke_$tag.txt") $(tail -n 1 "$OUTDIR/smoke_$tag.err")"
        grep -E "^FAIL " "$OUTDIR/smoke_$tag.txt" | head -n 3
        [ $s -gt $st ] && st=$s
        [ $s -ge 2 ] && break # a crash or hang: the variant's other smoke cases are skipped (a hang costs 60 s)
    done
    if [ $st -le 1 ]; then keep="$keep,$v"; else echo "# $v dropped from the table (smoke exit $st)"; fi
done
echo "# lab + torch: GG_VERSIONS=$keep"
GG_VERSIONS=$keep make run
st=$?
# make run shows the fwd and fwd+bwd rows; the dx and dW rows of the 512- and 2,048-row cases too
f="$OUTDIR/gg_compare.txt"
grep -qE "^case " "$f" 2>/dev/null || f="$OUTDIR/gg_lab.txt"
echo "# dx and dW rows ($f):"
grep -E "^case |^(uniform|skew|hot)-(512|2048) .* (dx|dW) " "$f"
exit $st
