#!/usr/bin/env bash
# flatmoe plan on the real configs (fast, no data, no model), its verdicts and JSON; train under
# --mem-budget: refused before allocating when it cannot fit, knobs chosen when it can, and the
# measured high-water mark of every arena within its planned bound.
source "$(dirname "$0")/lib_cli.sh"
cfg0="$ROOT/configs/tiny.json"
for c in olmoe-1b-7b qwen3-30b-a3b mixtral-8x7b; do
    start=$(date +%s%N)
    "$FM" plan --config "$ROOT/configs/$c.json" --seq-len 32768 > "$TMP/$c.txt" || bad "plan $c failed"
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    [ $ms -lt 1000 ] && ok || bad "plan $c took $ms ms"
    grep -q "^total" "$TMP/$c.txt" && grep -q "FLOPs per token" "$TMP/$c.txt" && ok || bad "plan $c: no total or FLOPs line"
    "$FM" plan --config "$ROOT/configs/$c.json" --seq-len 32768 --json > "$TMP/$c.json" || bad "plan --json $c failed"
    if command -v python3 >/dev/null; then python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$TMP/$c.json" && ok || bad "plan --json $c is not JSON"; fi
done
cat "$TMP/olmoe-1b-7b.txt"
# A budget that cannot hold the model state: exit 1, the verdict names the live set.
"$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len 4096 --device-mem 80GiB > "$TMP/nofit.txt" 2> "$TMP/nofit.err"
[ $? -eq 1 ] && ok || bad "plan over budget should exit 1"
grep -q "model state" "$TMP/nofit.err" && ok || bad "over-budget message lacks the live set: $(cat "$TMP/nofit.err")"
# Chosen knobs: qwen3 at 64K tokens in 560 GiB needs chunking and the linear CE.
"$FM" plan --config "$ROOT/configs/qwen3-30b-a3b.json" --seq-len 65536 --device-mem 560GiB --json > "$TMP/choose.json" || bad "plan could not choose knobs"
grep -q '"fits":true' "$TMP/choose.json" && ok || bad "chosen plan does not fit: $(cat "$TMP/choose.json")"
# A GPU run planned from this build: bf16 activations and the CUDA workspaces (cuDNN 256 MiB
# as given, cuBLASLt 32 MiB, scratch 16 MiB).
g=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len 4096 --backend cuda --gpu-workspace 256MiB --json)
grep -q '"attention tiles":318767104' <<<"$g" && ok || bad "cuda plan: workspaces not 256 + 32 + 16 MiB: $g"
# Without --gpu-workspace the planner sizes cuDNN's for the attention backward: OLMoE (16 heads
# of 128) needs 16 x T x 128 x 4 B of fp32 dQ + row sums + 1 MiB: 130 MiB at 16K; at 256K a
# 4-head chunk (517 MiB) under the 1 GiB cap; never under 64 MiB (4K).
for tw in "4096 64" "16384 130" "262144 517"; do
    set -- $tw
    a=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len "$1" --backend cuda --json |
        sed -E 's/.*"attention tiles":([0-9]+).*/\1/')
    [ "$a" = $(( ($2 + 48) * 1048576 )) ] && ok || bad "cuda plan at T=$1: attention set $a, expected cuDNN $2 MiB + 48 MiB"
done
c=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len 4096 --backend cpu --json)
bnd() { sed -E 's/.*"checkpoint boundaries":([0-9]+).*/\1/' <<<"$1"; }
[ "$(bnd "$g")" -lt "$(bnd "$c")" ] && ok || bad "bf16 boundaries should be smaller than fp32 ones"
# OLMoE-1B-7B at 384K on an H200's budget: fp32 moments do not fit and the message names
# --bf16-moments; with it the plan fits (12 B/param of model state)
# (no host memory: --host-mem-budget 0 forbids offload, so nothing else can take the model state)
expect_fail "384K OLMoE, fp32 moments, no host memory" "--bf16-moments" "$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" \
    --backend cuda --seq-len 393216 --device-mem 141093MiB --host-mem-budget 0
h=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 393216 --device-mem 141093MiB --bf16-moments --host-mem-budget 0)
grep -q "fits in" <<<"$h" && grep -q "12 B/param" <<<"$h" && ok || bad "384K OLMoE with --bf16-moments: $h"
# With host memory the chooser may stream the optimizer from the host instead: it fits with fp32 moments.
h=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 393216 --device-mem 141093MiB --host-mem-budget 100GiB --no-optimizer-overlap)
grep -q "fits in" <<<"$h" && grep -q "^host (pinned)" <<<"$h" && ok || bad "384K OLMoE with 100 GiB of host memory: $h"
# The projected step time, tokens/s and MFU next to the memory table, and in the JSON (the optimizer
# serial here: overlapped with the next forward its time may be hidden and its line absent).
grep -Eq "^projected step: [0-9.e+]+ s, [0-9]+ tokens/s, MFU [0-9.]+% of 989 TFLOP/s" <<<"$h" && ok || bad "plan: no projected step line: $h"
grep -q "^  attention " <<<"$h" && grep -q "^  optimizer " <<<"$h" && ok || bad "plan: no phases in the projection"
j=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 131072 --device-mem 141093MiB --json 2>/dev/null)
python3 -c "import json,sys; d=json.loads(sys.argv[1]); p=d['projected']; assert p['step_s']>0 and p['tokens_per_s']>0 and 0<p['mfu']<1 and d['context_bytes']>0 and d['fits'], d" "$j" && ok || bad "plan --json: no projection: $j"
# --device-mem is the device's memory: the CUDA context and libraries (the calibration table's
# figure from this build) and 256 MiB for late kernels come off it; --mem-budget is the sets' own.
b1=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 4096 --device-mem 141GiB --json 2>/dev/null | sed -E 's/.*"budget_bytes":([0-9]+).*/\1/')
c1=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 4096 --device-mem 141GiB --json 2>/dev/null | sed -E 's/.*"context_bytes":([0-9]+).*/\1/')
[ $(( b1 + c1 )) -eq $(( 141 << 30 )) ] && [ "$c1" -gt $(( 256 << 20 )) ] && ok || bad "--device-mem 141GiB: budget $b1 + context $c1"
b2=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 4096 --mem-budget 141GiB --json 2>/dev/null | sed -E 's/.*"budget_bytes":([0-9]+).*/\1/')
[ "$b2" -eq $(( 141 << 30 )) ] && ok || bad "--mem-budget 141GiB: budget $b2"
expect_fail "--device-mem and --mem-budget" "not both" "$FM" plan --config "$ROOT/configs/tiny.json" --seq-len 64 --device-mem 1GiB --mem-budget 1GiB
# A host budget too small for the offload the user asked for: refused, the advice names what works.
# (--mem-budget 1TiB: without a device budget a CUDA plan's verdict is an H200's, which the device
# side fails first)
expect_fail "offload over the host budget" "pinned host memory needed" "$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" \
    --backend cuda --seq-len 65536 --offload-optimizer --host-mem-budget 1GiB --mem-budget 1TiB
# Advice: 80 GiB cannot hold OLMoE's fp32 model state with no host memory; every knob it names fits
# when applied (and --micro-batch is not named at micro-batch 1).
out=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 65536 --device-mem 80GiB --host-mem-budget 0 2>&1 >/dev/null)
grep -q "2 ranks with --zero 3" <<<"$out" && ! grep -q -- "--micro-batch" <<<"$out" && ok || bad "advice at 80 GiB: $out"
# The rank count advised is the trainer's own ZeRO-3 run (its model-state bound, no streamed
# optimizer beside it): --dp W --zero 3 fits and --dp W-1 --zero 3 does not (Mixtral on an H100:
# the bf16 weights and grads alone are 187 GB, so offload is no way out).
mx=$("$FM" plan --config "$ROOT/configs/mixtral-8x7b.json" --seq-len 4096 --gpu h100 2>&1 >/dev/null)
W=$(grep -oE "any one of: .*[0-9]+ ranks with --zero 3" <<<"$mx" | grep -oE "[0-9]+ ranks" | grep -oE "[0-9]+")
if [ -n "$W" ] && [ "$W" -gt 2 ]; then
    "$FM" plan --config "$ROOT/configs/mixtral-8x7b.json" --seq-len 4096 --gpu h100 --dp "$W" --zero 3 >/dev/null 2>&1 && ok ||
        bad "advice named $W ranks with --zero 3, which does not fit: $mx"
    "$FM" plan --config "$ROOT/configs/mixtral-8x7b.json" --seq-len 4096 --gpu h100 --dp $((W - 1)) --zero 3 >/dev/null 2>&1 &&
        bad "advice named $W ranks, but $((W - 1)) fit" || ok
else bad "no rank advice for Mixtral-8x7B on an H100: $mx"; fi
# (the --bf16-moments item alone: a state recipe's item names it beside --master-weights, checked below)
if grep -q -- "--bf16-moments (AdamW" <<<"$out"; then
    "$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 65536 --device-mem 80GiB --host-mem-budget 0 --bf16-moments >/dev/null && ok || bad "advice named --bf16-moments, which does not fit"
fi
if grep -q -- "--master-weights bf16-sr --bf16-moments" <<<"$out"; then
    "$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 65536 --device-mem 80GiB --host-mem-budget 0 --master-weights bf16-sr --bf16-moments >/dev/null && ok || bad "advice named --master-weights bf16-sr --bf16-moments, which does not fit"
fi
# calibrate --quick on this build writes a table that plan then reads; bad tables are refused.
start=$(date +%s)
"$FM" calibrate --quick --out "$TMP/calib.json" > "$TMP/calib.log" || bad "calibrate --quick failed: $(tail -3 "$TMP/calib.log")"
echo "calibrate --quick: $(( $(date +%s) - start )) s"; cat "$TMP/calib.log"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['format']=='flatmoe-calibration' and d['backend']=='cpu' and len(d['attention_fwd'])>=3 and d['link']['h2d']>0, d" "$TMP/calib.json" && ok || bad "calibrate wrote no valid table"
[ ! -e "$TMP/calib.json.tmp" ] && ok || bad "calibrate left its temporary file"
p=$("$FM" plan --config "$cfg0" --seq-len 256 --micro-batch 4 --threads 2 --mem-budget 1GiB --calib "$TMP/calib.json")
grep -q "projection: calibration table $TMP/calib.json" <<<"$p" && grep -q "^projected step" <<<"$p" && ok || bad "plan --calib: $p"
# the fp8 code ops' curves (expert_*_fp8): measured where the backend serves them (the CPU's reference
# ops under FLATMOE_TEST_FP8_CODES=1), absent otherwise; plan projects fp8 on codes with them
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert 'expert_fwd_fp8' not in d, d.keys()" "$TMP/calib.json" \
    && ok || bad "calibrate wrote fp8 curves without the fp8 code ops"
FLATMOE_TEST_FP8_CODES=1 "$FM" calibrate --quick --out "$TMP/calib8.json" > "$TMP/calib8.log" || bad "calibrate --quick (fp8 codes) failed: $(tail -3 "$TMP/calib8.log")"
grep "experts fp8" "$TMP/calib8.log"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert len(d['expert_fwd_fp8']) >= 2 and len(d['expert_bwd_fp8']) >= 2, d.keys()" \
    "$TMP/calib8.json" && ok || bad "calibrate (fp8 codes) wrote no expert_fwd_fp8 / expert_bwd_fp8 curves"
python3 - "$TMP/calib8.json" "$TMP/calib8x.json" <<'PY' # the same table with fp8 rates 100x the bf16 ones
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("expert_fwd", "expert_bwd"):
    d[k + "_fp8"] = [dict(p, **{kk: vv * 100 for kk, vv in p.items() if kk != "rows_per_expert"}) for p in d[k]]
# and the weight quantization 100x as fast: the codes path charges it apart, and on a slow CPU the
# measured figure alone can outweigh the 100x GEMMs (the comparison is of the curves, not of it)
if "fp8_weight_quant" in d["bandwidth"]:
    d["bandwidth"]["fp8_weight_quant"] *= 100
json.dump(d, open(sys.argv[2], "w"))
PY
pp() { "$FM" plan --config "$ROOT/configs/tiny.json" --seq-len 256 --micro-batch 4 --threads 2 --calib "$TMP/calib8x.json" --expert-precision fp8 | grep "^projected step"; }
p_emu=$(pp); p_codes=$(FLATMOE_TEST_FP8_CODES=1 pp)
echo "fp8 emulated: $p_emu"; echo "fp8 codes:    $p_codes"
python3 -c "import sys; f=lambda s: float(s.split()[2]); assert f(sys.argv[2]) < f(sys.argv[1]), sys.argv" "$p_emu" "$p_codes" \
    && ok || bad "plan's fp8 projection on codes does not use the fp8 curves"
echo '{"format":"flatmoe-calibration","version":1}' > "$TMP/bad.json"
expect_fail "plan --calib bad table" "\"backend\" must be a string" "$FM" plan --config "$cfg0" --seq-len 64 --calib "$TMP/bad.json"
expect_fail "plan --calib missing table" "cannot open the calibration table" "$FM" plan --config "$cfg0" --seq-len 64 --calib "$TMP/none.json"
expect_fail "calibrate without --out" "--out is required" "$FM" calibrate --quick
expect_fail "calibrate, other backend" "this binary measures its own backend" "$FM" calibrate --backend cuda --out "$TMP/x.json"
expect_fail "bad --backend" "expected cpu or cuda" "$FM" plan --config "$ROOT/configs/tiny.json" --seq-len 64 --backend tpu
expect_fail "bad --device-mem" "unknown unit" "$FM" plan --config "$ROOT/configs/tiny.json" --seq-len 128 --device-mem 12parsecs

cfg="$ROOT/configs/tiny.json"
common=(--config "$cfg" --data "$TEXT" --seq-len 256 --micro-batch 4 --steps 2 --threads 2 --eval-batches 1)
expect_fail "train over --mem-budget" "--mem-budget" "$FM" train "${common[@]}" --mem-budget 20MiB --recompute none --out "$TMP/over"
[ ! -d "$TMP/over" ] && ok || bad "a refused run created its run folder"
# Plain plan of this shape, then a budget below it: train must choose knobs that fit.
full=$("$FM" plan --config "$cfg" --seq-len 256 --micro-batch 4 --threads 2 --json | sed -E 's/.*"total_bytes":([0-9]+).*/\1/')
budget=$(( full * 3 / 5 ))
"$FM" train "${common[@]}" --mem-budget "$budget" --report-memory --out "$TMP/fit" > "$TMP/fit.log" || bad "train under a fitting budget failed: $(tail -3 "$TMP/fit.log")"
grep "^plan:" "$TMP/fit.log"; grep "^memory:" "$TMP/fit.log" | tail -8
# Every arena's measured high-water mark <= its bound, and >= 90% of it (a step fills them all).
while read -r name bound hw; do
    [ "$hw" -le "$bound" ] && ok || bad "$name: high-water $hw exceeds bound $bound"
    [ $(( hw * 10 )) -ge $(( bound * 9 )) ] && ok || bad "$name: high-water $hw is under 90% of bound $bound"
done < <(grep "^memory:" "$TMP/fit.log" | awk '/live set/{n=0} {a[n++]=$0} END{for(i=0;i<n;i++) print a[i]}' | \
         grep -v "attention\|live set" | \
         sed -E 's/^memory: (.*[a-z)]) +([0-9]+) +([0-9]+) .*/\1|\2|\3/' | tr '|' ' ' | awk '{hw=$NF; b=$(NF-1); $NF=""; $(NF)=""; print $1"_"$2, b, hw}')
# The linear cross-entropy's blocks are clamped to N x V, as the call clamps them (micro.json:
# V = 256, N = 2 x 16 = 32 tokens): its bound is what the step takes (high-water = bound), not the
# default 1024 x 4096 strip.
"$FM" train --config "$ROOT/tests/data/micro.json" --data "$TEXT" --seq-len 16 --micro-batch 2 --steps 1 --threads 2 \
    --eval-batches 1 --ce-block-tokens 1024 --report-memory --no-checkpoint --out "$TMP/lce" > "$TMP/lce.log" || bad "the linear-CE run failed"
read -r vb vhw < <(grep "^memory: vocabulary projection" "$TMP/lce.log" | awk '{print $(NF-2), $(NF-1)}')
[ -n "$vb" ] && [ "$vb" = "$vhw" ] && [ "$vb" -lt 65536 ] && ok ||
    bad "linear CE at N 32, V 256: vocabulary bound ${vb:-?} B, high-water ${vhw:-?} B (want equal, < 64 KiB)"
# The trainer used the chooser of `plan` (same budgets, same table): the same knobs.
pj=$("$FM" plan --config "$cfg" --seq-len 256 --micro-batch 4 --threads 2 --mem-budget "$budget" --json 2>/dev/null)
nr=$(sed -E 's/.*"recomputed_layers":([0-9]+).*/\1/' <<<"$pj")
grep -q "recompute $nr of" "$TMP/fit.log" && ok || bad "train chose other knobs than plan (recompute $nr): $(grep '^plan:' "$TMP/fit.log")"
grep -q '"memory":{' "$TMP/fit/metrics.jsonl" && ok || bad "metrics.jsonl lacks the memory report"
# Measuring memory changes nothing: the same run without --report-memory gives the same losses.
knobs=$(grep "^plan:" "$TMP/fit.log" | sed -E 's/.*recompute ([0-9]+) of.*/\1/')
"$FM" train "${common[@]}" --mem-budget "$budget" --out "$TMP/fit2" --quiet || bad "train without --report-memory failed"
loss() { grep '"type":"step"' "$1" | sed -E 's/.*"loss":([^,]*),.*/\1/'; }
[ "$(loss "$TMP/fit/metrics.jsonl")" = "$(loss "$TMP/fit2/metrics.jsonl")" ] && ok || bad "--report-memory changed the losses"
# --offload-boundaries: the boundaries' bound counts L+1 - n + min(n, 2) tensors, and the host line
# gives n x N x H x 4 B (tiny.json: L = 4, H = 128; N = 4 x 256 tokens: 512 KiB a boundary).
"$FM" plan --config "$cfg" --seq-len 256 --micro-batch 4 --threads 2 --backend cpu --offload-boundaries all > "$TMP/off.txt" || bad "plan --offload-boundaries failed"
grep -Eq "^host \(pinned\): +2097152 .*4 offloaded boundaries" "$TMP/off.txt" && ok || bad "plan: no host line for 4 offloaded boundaries: $(grep host "$TMP/off.txt")"
grep -q "= 3) x N x H" "$TMP/off.txt" && ok || bad "plan: boundaries bound does not count 3 tensors"
"$FM" plan --config "$cfg" --seq-len 256 --micro-batch 4 --threads 2 --backend cpu > "$TMP/nooff.txt"
grep -q "^host (pinned)" "$TMP/nooff.txt" && bad "plan: a host line without offload" || ok
j=$("$FM" plan --config "$cfg" --seq-len 256 --micro-batch 4 --threads 2 --backend cpu --offload-boundaries 1 --json)
grep -q '"offloaded_boundaries":1,"host_pinned_bytes":524288' <<<"$j" && ok || bad "plan --json: no host bytes: $j"
# --no-recompute-keep-attention: the chooser may not keep attention (it would at 128K with a budget)
h=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 131072 --mem-budget 135GiB --recompute full --moe-chunk-tokens 4096 --ce-block-tokens 1024 --no-recompute-keep-attention 2>/dev/null)
grep -q "recompute 16 of 16 layers;" <<<"$h" && ! grep -q "keep their attention" <<<"$h" && ok || bad "--no-recompute-keep-attention still keeps attention: $(grep ^shape <<<"$h")"
h=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 131072 --mem-budget 135GiB --recompute full --moe-chunk-tokens 4096 --ce-block-tokens 1024 2>/dev/null)
grep -q "keep their attention" <<<"$h" && ok || bad "the chooser no longer keeps attention at 128K under 135 GiB: $(grep ^shape <<<"$h")"
expect_fail "plan keep and no-keep" "give one" "$FM" plan --config "$ROOT/configs/tiny.json" --seq-len 64 --recompute-keep-attention --no-recompute-keep-attention

# the "train flags" line reproduces the chosen plan: planning again with exactly those flags gives
# the same total (here at 1M tokens, where the chooser sets every knob)
a=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --seq-len 1048576 --device-mem 141GiB --host-mem-budget 110GiB 2>/dev/null)
flags=$(sed -n 's/^train flags: //p' <<<"$a")
# shellcheck disable=SC2086
b=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --backend cuda --device-mem 141GiB --host-mem-budget 110GiB $flags 2>/dev/null)
[ -n "$flags" ] && [ "$(grep '^total' <<<"$a")" = "$(grep '^total' <<<"$b")" ] && [ "$(grep '^shape' <<<"$a")" = "$(grep '^shape' <<<"$b")" ] && ok ||
    bad "the train flags line ($flags) does not reproduce the plan: $(grep -E '^(shape|total)' <<<"$a") / $(grep -E '^(shape|total)' <<<"$b")"

# on the CPU target the line names the thread count the attention scratch was planned for
# (--threads 0 resolved as train resolves it: the cores not busy now), so train repeats the bound
c=$("$FM" plan --config "$ROOT/configs/tiny.json" --seq-len 256 --micro-batch 4 --backend cpu --mem-budget 1GiB --host-mem-budget 8GiB 2>/dev/null)
cflags=$(sed -n 's/^train flags: //p' <<<"$c")
grep -qE -- "--threads [1-9][0-9]*$" <<<"$cflags" && ok || bad "CPU train flags name no thread count: $cflags"
# shellcheck disable=SC2086
d=$("$FM" plan --config "$ROOT/configs/tiny.json" --backend cpu --mem-budget 1GiB --host-mem-budget 8GiB $cflags 2>/dev/null) # fixed: MemAvailable moves
[ "$(grep '^total' <<<"$c")" = "$(grep '^total' <<<"$d")" ] && ok || bad "the CPU train flags ($cflags) do not reproduce the plan"
"$FM" plan --config "$ROOT/configs/tiny.json" --seq-len 256 --micro-batch 4 --backend cpu --threads 3 | grep -q -- "^train flags: .* --threads 3$" &&
    ok || bad "plan --threads 3: the train flags line does not say --threads 3"
! grep -q -- "--threads" <<<"$(sed -n 's/^train flags: //p' <<<"$a")" && ok || bad "CUDA train flags name a CPU thread count"

# A mesh (plan/fm_mesh.h): --world alone chooses the degrees; the candidates, the per-rank table with
# its communication buffers, the collectives' phases and a launch line; replanning the mesh with the
# train flags it prints (explicit --zero 3 --dp --ep --sp, with --world: without it they plan the
# trainer's own run) gives the same per-rank total.
m=$("$FM" plan --config "$ROOT/configs/qwen3-30b-a3b.json" --backend cuda --seq-len 32768 --world 8 --device-mem 139GiB --host-mem-budget 110GiB 2>/dev/null) || bad "plan --world 8 failed"
grep -q "<- chosen" <<<"$m" && grep -q "^communication buffers" <<<"$m" && grep -qE "^launch: mpirun( --allow-run-as-root)? -np 8 flatmoe-cuda train" <<<"$m" &&
    grep -q "EP all-to-all" <<<"$m" && grep -q "NOMINAL" <<<"$m" && ok || bad "plan --world 8: no candidates, comm row, launch line or collectives: $m"
flags=$(sed -n 's/^train flags: //p' <<<"$m")
grep -q -- "--zero 3 --dp [0-9]* --ep [0-9]* --sp [0-9]*" <<<"$flags" && ok || bad "mesh train flags lack the degrees: $flags"
# shellcheck disable=SC2086
b=$("$FM" plan --config "$ROOT/configs/qwen3-30b-a3b.json" --backend cuda --device-mem 139GiB --host-mem-budget 110GiB --world 8 $flags 2>/dev/null)
[ "$(grep '^total' <<<"$m")" = "$(grep '^total' <<<"$b")" ] && [ -n "$(grep '^total' <<<"$b")" ] && ok ||
    bad "the mesh train flags ($flags) do not reproduce the plan: $(grep '^total' <<<"$m") / $(grep '^total' <<<"$b")"
# the per-rank model state falls with ep (experts / ep) and the JSON carries the mesh
j1=$("$FM" plan --config "$ROOT/configs/mixtral-8x7b.json" --backend cuda --seq-len 4096 --world 8 --zero 3 --dp 8 --ep 2 --json 2>/dev/null)
j8=$("$FM" plan --config "$ROOT/configs/mixtral-8x7b.json" --backend cuda --seq-len 4096 --world 8 --zero 3 --dp 8 --ep 8 --json 2>/dev/null)
ms() { sed -E 's/.*"model state":([0-9]+).*/\1/' <<<"$1"; }
[ "$(ms "$j8")" -lt "$(ms "$j1")" ] && grep -q '"mesh":{"world":8,"dp":8,"ep":8,"sp":1' <<<"$j8" &&
    grep -q '"communication buffers":' <<<"$j8" && ok || bad "mesh JSON: model state not falling with ep, or no mesh: $j8"
if command -v python3 >/dev/null; then python3 -c "import json,sys; json.loads(sys.argv[1])" "$j8" && ok || bad "mesh --json is not JSON"; fi
# --zero 0 (or 3) with --ep and/or --sp (no --world) plans the trainer's own run (replicas of the
# non-expert state, or their ZeRO-3 shards over dp x sp; E/ep experts per rank; tests/mpi_train_epsp.sh
# and mpi_train_sp.sh check it against the arenas): no mesh, the degrees in the JSON and the train
# flags, the model state falling with ep and with --zero 3; with --world it is the mesh
t1=$("$FM" plan --config "$ROOT/configs/qwen3-30b-a3b.json" --backend cuda --seq-len 32768 --sp 8 --zero 0 --json 2>/dev/null)
t8=$("$FM" plan --config "$ROOT/configs/qwen3-30b-a3b.json" --backend cuda --seq-len 32768 --ep 8 --sp 8 --zero 0 --json 2>/dev/null)
[ -n "$t8" ] && [ "$(ms "$t8")" -lt "$(ms "$t1")" ] && grep -q '"sp":8,"ep":8,' <<<"$t8" && ! grep -q '"mesh":' <<<"$t8" && ok ||
    bad "plan --ep 8 --sp 8 --zero 0: not the trainer's run: $t8"
t=$("$FM" plan --config "$ROOT/configs/qwen3-30b-a3b.json" --backend cuda --seq-len 32768 --ep 8 --sp 8 --zero 0 2>/dev/null)
grep -q "^train flags: .* --ep 8 --sp 8$" <<<"$t" && ! grep -q "^mesh:" <<<"$t" && ok || bad "plan --ep 8 --sp 8 --zero 0: train flags: $t"
t=$("$FM" plan --config "$ROOT/configs/qwen3-30b-a3b.json" --backend cuda --seq-len 32768 --world 8 --ep 8 --sp 8 --zero 3 2>/dev/null)
grep -q "^mesh: world 8 = dp 1 x sp 8, ep 8" <<<"$t" && ok || bad "plan --world 8 --ep 8 --sp 8 --zero 3: not the mesh: $t"
z8=$("$FM" plan --config "$ROOT/configs/qwen3-30b-a3b.json" --backend cuda --seq-len 32768 --ep 8 --sp 8 --zero 3 --json 2>/dev/null)
[ -n "$z8" ] && [ "$(ms "$z8")" -lt "$(ms "$t8")" ] && grep -q '"sp":8,"ep":8,' <<<"$z8" && ! grep -q '"mesh":' <<<"$z8" && ok ||
    bad "plan --ep 8 --sp 8 --zero 3: not the trainer's ZeRO-3 run (model state below --zero 0's $(ms "$t8")): $z8"
# bad mesh input: flag, expected, found, fix
expect_fail "plan dp x sp != world" "--dp 4 x --sp 4 = 16 but --world is 8" "$FM" plan --config "$ROOT/configs/qwen3-30b-a3b.json" --seq-len 4096 --world 8 --dp 4 --sp 4
expect_fail "plan ep not dividing E" "use one of" "$FM" plan --config "$ROOT/configs/mixtral-8x7b.json" --seq-len 4096 --dp 6 --ep 3
expect_fail "plan sp not dividing heads" "num_attention_heads (16" "$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len 4096 --dp 1 --sp 3
expect_fail "plan seq-len not divisible by sp" "use --seq-len 4096" "$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len 4097 --sp 2
expect_fail "plan --world without a budget" "needs a budget" "$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len 4096 --world 8
expect_fail "plan --zero 1 with a mesh" "expected 3" "$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len 4096 --world 2 --dp 2 --zero 1
expect_fail "plan mesh plain logits" "Ring-DTP" "$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len 4096 --world 2 --dp 2 --sp 1 --ep 1 --ce-block-tokens 0 --ce-block-vocab 0
expect_fail "plan mesh too small" "no mesh of --world 2 fits" "$FM" plan --config "$ROOT/configs/mixtral-8x7b.json" --backend cuda --seq-len 4096 --world 2 --mem-budget 40GiB

# a degree given as 0 is refused, as train refuses --ep 0 / --sp 0 (left out: chosen or 1)
for f in "--ep 0" "--sp 0" "--world 0"; do
    out=$("$FM" plan --config "$ROOT/configs/tiny.json" --seq-len 64 --micro-batch 1 $f 2>&1) && bad "plan $f accepted" ||
        { grep -q "degrees must be >= 1 (or left out), found $f" <<<"$out" && ok || bad "plan $f: $out"; }
done
# a mesh that does not fit prints no launch line (it would be refused)
out=$("$FM" plan --config "$ROOT/configs/qwen3-30b-a3b.json" --backend cuda --seq-len 32768 --world 8 --dp 8 --ep 1 --sp 1 \
      --device-mem 40GiB 2>&1)
grep -q "^launch: none (this mesh does not fit" <<<"$out" && ! grep -q "^launch: mpirun" <<<"$out" && ok ||
    bad "a mesh that does not fit: $(grep launch <<<"$out")"
# plan --json carries the checkpoint staging the text prints
j=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len 64 --micro-batch 1 --json 2>/dev/null | tail -1)
t=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len 64 --micro-batch 1 2>/dev/null | awk '/^checkpoint staging:/ {print $3}')
[ -n "$t" ] && python3 -c "import json,sys; sys.exit(0 if json.loads(sys.argv[1])['checkpoint_staging_bytes'] == int(sys.argv[2]) else 1)" "$j" "$t" &&
    ok || bad "plan --json checkpoint_staging_bytes vs the text's $t"
# A budget only MoE chunks under FM_PLAN_MIN_CHUNK (256 tokens) meet: the chooser falls back to them
# (before, it refused a run that fits), and train boots with them within every bound.
sm=$("$FM" plan --config "$cfg" --seq-len 256 --micro-batch 8 --threads 2 --mem-budget 47MiB 2>&1) &&
    grep -qE "^shape: .*MoE chunked, [0-9]+ chunks of <= (128|64|32|16|8|4|2|1) tokens" <<<"$sm" && ok ||
    bad "47 MiB: no fallback to chunks under 256 tokens: $(grep -E '^shape|error' <<<"$sm")"
"$FM" train --config "$cfg" --data "$TEXT" --seq-len 256 --micro-batch 8 --steps 1 --threads 2 --eval-every 0 \
    --mem-budget 47MiB --report-memory --out "$TMP/smallchunk" > "$TMP/smallchunk.log" 2>&1 && ok ||
    bad "train at 47 MiB (small chunks) failed: $(tail -3 "$TMP/smallchunk.log")"
grep -E "^memory: [a-z ]+ [0-9]+ +[0-9]+ " "$TMP/smallchunk.log" | awk '$(NF-1) + 0 > $(NF-2) + 0 {x=1} END {exit x}' && ok ||
    bad "train at 47 MiB: a high-water mark over its bound: $(grep '^memory:' "$TMP/smallchunk.log")"
# --gpu presets and the local device: `plan --backend cuda` always gives a verdict. --gpu h100 /
# h200 plan the preset's memory (81559 / 143771 MiB, what the cards report); an H100 without its
# own calibration table takes the H200's rates, said so; a CUDA plan naming no device on a build
# without a GPU plans for an H200, said so.
o=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len 4096 --gpu h100 2>&1) || bad "plan --gpu h100 failed: $o"
grep -q "fits in .*--gpu h100 81559.0 MiB less" <<<"$o" && ok || bad "plan --gpu h100: no verdict on the preset's memory: $o"
if [ ! -f "$ROOT/configs/calib/h100.json" ] && [ -f "$ROOT/configs/calib/h200.json" ]; then
    grep -q "the projected times use the H200's rates" <<<"$o" && grep -q "calib/h200.json" <<<"$o" && ok ||
        bad "plan --gpu h100 without h100.json: the H200's rates not said: $o"
fi
o=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len 4096 --gpu h200 2>&1) || bad "plan --gpu h200 failed: $o"
grep -q "fits in .*--gpu h200 143771.0 MiB less" <<<"$o" && ok || bad "plan --gpu h200: no verdict: $o"
expect_fail "--gpu with --device-mem" "keep one" "$FM" plan --config "$cfg0" --seq-len 64 --gpu h200 --device-mem 80GiB
expect_fail "--gpu a100" "--gpu: expected h100 or h200, found 'a100'" "$FM" plan --config "$cfg0" --seq-len 64 --gpu a100
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    o=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len 4096 --backend cuda 2>&1) || bad "plan --backend cuda failed: $o"
    grep -q "the verdict is for an H200, on the flags as given" <<<"$o" && grep -q "fits in" <<<"$o" && ok ||
        bad "plan --backend cuda without a device: no verdict: $o"
fi
# A plan that does not fit prints no train flags and no launch line as if it did.
"$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len 4096 --device-mem 80GiB --host-mem-budget 0 > "$TMP/nf.txt" 2>/dev/null
grep -q "^train flags: none (this plan does not fit" "$TMP/nf.txt" && ! grep -q "^launch:" "$TMP/nf.txt" && ok ||
    bad "a plan that does not fit printed flags: $(grep -E '^(train flags|launch)' "$TMP/nf.txt")"
# plan takes every flag its "train flags" line prints (--max-position-embeddings included), and
# the same flags give the same plan.
o=$("$FM" plan --config "$cfg0" --seq-len 2048 --micro-batch 2 --backend cpu --threads 2 --mem-budget 2GiB 2>/dev/null) || bad "plan past max_position_embeddings failed"
tf=$(sed -n 's/^train flags: //p' <<<"$o")
grep -q -- "--max-position-embeddings 2048" <<<"$tf" && ok || bad "train flags lack --max-position-embeddings: $tf"
# shellcheck disable=SC2086
o2=$("$FM" plan --config "$cfg0" --backend cpu --mem-budget 2GiB $tf 2>&1) && ok || bad "plan refused its own train flags ($tf): $o2"
[ "$(grep -E '^(shape|total)' <<<"$o2")" = "$(grep -E '^(shape|total)' <<<"$o")" ] && ok ||
    bad "plan with its own train flags planned another run: $(grep -E '^(shape|total)' <<<"$o2") / $(grep -E '^(shape|total)' <<<"$o")"
# train and plan refuse the same combination with the same message
expect_fail "train --zero 1 --ep 2" "--zero 1 with --ep 2: ZeRO-1/2 shards the optimizer state" \
    "$FM" train --config "$cfg0" --data "$TEXT" --seq-len 64 --zero 1 --ep 2 --out "$TMP/z1ep"
expect_fail "plan --zero 1 --ep 2" "--zero 1 with --ep 2: ZeRO-1/2 shards the optimizer state" \
    "$FM" plan --config "$cfg0" --data "$TEXT" --seq-len 64 --zero 1 --ep 2
# The launch line runs as printed: a small plan's line, with --data, starts a run (2 steps here).
o=$("$FM" plan --config "$cfg0" --seq-len 64 --micro-batch 2 --backend cpu --threads 2 --mem-budget 1GiB --data "$TEXT" 2>/dev/null)
line=$(sed -n 's/^launch: //p' <<<"$o")
[ -n "$line" ] && ok || bad "a one-rank plan printed no launch line: $o"
eval "$line --steps 2 --eval-every 0 --eval-batches 1 --quiet --out $TMP/launched" > "$TMP/launched.log" 2>&1 &&
    [ -d "$TMP/launched/step_000002" ] && ok || bad "the launch line did not run as printed ($line): $(tail -3 "$TMP/launched.log")"
# The trainer's own run over several ranks (--dp 2 --zero 3): its launch line starts with mpirun -np 2
# (and --allow-run-as-root when planned as root, which Open MPI otherwise refuses).
o=$("$FM" plan --config "$cfg0" --seq-len 64 --micro-batch 2 --backend cpu --threads 2 --mem-budget 1GiB --dp 2 --zero 3 2>/dev/null)
want="^launch: mpirun -np 2 "; [ "$(id -u)" = 0 ] && want="^launch: mpirun --allow-run-as-root -np 2 "
grep -qE "${want}[^ ]*flatmoe train .*--dp 2 --zero 3" <<<"$o" && ok || bad "--dp 2 --zero 3: the launch line is not mpirun -np 2: $(grep '^launch' <<<"$o")"
finish
