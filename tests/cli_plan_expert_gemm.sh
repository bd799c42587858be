#!/usr/bin/env bash
# FLATMOE_EXPERT_GEMM=auto in `flatmoe plan --backend cuda` (plan/fm_expert_choice.h): with the
# H200 table (configs/calib/h200.json: sm90 faster up to ~2,048 rows per expert, cuBLAS at 4,096)
# OLMoE-1B-7B at 4K (512 rows per expert) runs the sm90 kernel, at 32K unchunked (4,096 rows)
# cuBLAS; each pick agrees with the table's curves (recomputed here from the file); forced forms
# as asked; a table without the sm90 curves, --ep 2 and the CPU keep cuBLAS (or print nothing);
# plan --json carries the choice.
source "$(dirname "$0")/lib_cli.sh"
unset FLATMOE_EXPERT_GEMM
CAL="$ROOT/configs/calib/h200.json"
OL="$ROOT/configs/olmoe-1b-7b.json"
plan() { "$FM" plan --backend cuda --config "$OL" --micro-batch 1 --calib "$CAL" "$@" 2>/dev/null; }
line() { grep "^expert GEMM:" <<<"$1"; }

a=$(plan --seq-len 4096)
grep -q "^expert GEMM: sm90 (auto: projected [0-9.]* ms per step against cuBLAS [0-9.]* ms at 512 rows per expert; FLATMOE_EXPERT_GEMM forces one)$" <<<"$a" &&
    ok || bad "4K: expected sm90: $(line "$a")"
b=$(plan --seq-len 32768)
grep -q "^expert GEMM: cuBLAS (auto: projected [0-9.]* ms per step against sm90 [0-9.]* ms at 4096 rows per expert" <<<"$b" &&
    ok || bad "32K: expected cuBLAS: $(line "$b")"
# the projection's expert phase is the chosen form's time
for x in "$a" "$b"; do
    ms=$(line "$x" | sed -E 's/.*projected ([0-9.]+) ms per step.*/\1/')
    ph=$(awk '$1 == "expert" && $2 == "GEMMs" {print $3}' <<<"$x")
    python3 -c "import sys; sys.exit(0 if abs(float(sys.argv[1]) - 1e3 * float(sys.argv[2])) < 0.051 else 1)" "$ms" "$ph" &&
        ok || bad "the expert phase ($ph s) is not the chosen form's $ms ms"
done
# every length's pick is the table's: sum of forward (F) and backward (2F) seconds at each curve's
# rate at k T / E rows per expert (log-linear between points, flat beyond)
for T in 2048 4096 8192 16384 32768 65536; do
    got=$(line "$(plan --seq-len $T)" | awk '{print $3}')
    want=$(python3 - "$CAL" $T <<'PY'
import json, math, sys
d = json.load(open(sys.argv[1])); rpe = int(sys.argv[2]) * 8 / 64
def rate(c):
    xs = [p["rows_per_expert"] for p in c]; rs = [p["flops"] for p in c]
    if rpe <= xs[0]: return rs[0]
    if rpe >= xs[-1]: return rs[-1]
    i = next(i for i in range(len(xs)) if xs[i] >= rpe)
    t = (math.log(rpe) - math.log(xs[i-1])) / (math.log(xs[i]) - math.log(xs[i-1]))
    return rs[i-1] + t * (rs[i] - rs[i-1])
s9 = 1 / rate(d["expert_fwd_sm90"]) + 2 / rate(d["expert_bwd_sm90"])
cb = 1 / rate(d["expert_fwd"]) + 2 / rate(d["expert_bwd"])
print("sm90" if s9 < cb else "cuBLAS")
PY
)
    [ -n "$got" ] && [ "$got" = "$want" ] && ok || bad "T=$T: plan picked '$got', the table says $want"
done
# forced forms, whatever the table says
c=$(FLATMOE_EXPERT_GEMM=cublas plan --seq-len 4096)
line "$c" | grep -q "^expert GEMM: cuBLAS (FLATMOE_EXPERT_GEMM=cublas; projected sm90 [0-9.]* ms per step, cuBLAS" && ok ||
    bad "forced cublas: $(line "$c")"
c=$(FLATMOE_EXPERT_GEMM=sm90 plan --seq-len 32768)
line "$c" | grep -q "^expert GEMM: sm90 (FLATMOE_EXPERT_GEMM=sm90;" && ok || bad "forced sm90: $(line "$c")"
c=$(FLATMOE_EXPERT_GEMM=grouped plan --seq-len 4096)
[ "$(line "$c")" = "expert GEMM: grouped (FLATMOE_EXPERT_GEMM=grouped; $(line "$c" | sed -E 's/.*; (projected.*)\)$/\1/'))" ] &&
    ok || bad "forced grouped: $(line "$c")"
# the same as the default table when --calib is left out (configs/calib/h200.json is the CUDA default)
d=$("$FM" plan --backend cuda --config "$OL" --micro-batch 1 --seq-len 4096 2>/dev/null)
[ "$(line "$d")" = "$(line "$a")" ] && ok || bad "default table: $(line "$d")"
# a table without the sm90 curves: cuBLAS, saying why
python3 - "$CAL" "$TMP/nosm90.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); d.pop("expert_fwd_sm90"); d.pop("expert_bwd_sm90"); json.dump(d, open(sys.argv[2], "w"))
PY
n=$("$FM" plan --backend cuda --config "$OL" --micro-batch 1 --seq-len 4096 --calib "$TMP/nosm90.json" 2>/dev/null)
line "$n" | grep -q "^expert GEMM: cuBLAS (auto: the calibration table has no sm90 curves" && ok || bad "no sm90 curves: $(line "$n")"
# --ep 2 (the trainer's expert parallelism): cuBLAS
e=$(plan --seq-len 4096 --ep 2 --dp 2)
line "$e" | grep -q "^expert GEMM: cuBLAS (auto: expert parallelism (ep 2)" && ok || bad "--ep 2: $(line "$e")"
# the CPU: no line, no field
p=$("$FM" plan --backend cpu --config "$OL" --micro-batch 1 --seq-len 4096 2>/dev/null)
! grep -q "^expert GEMM:" <<<"$p" && ok || bad "a CPU plan prints an expert GEMM line"
j=$("$FM" plan --backend cpu --config "$OL" --micro-batch 1 --seq-len 4096 --json 2>/dev/null)
python3 -c "import json,sys; sys.exit(0 if 'expert_gemm' not in json.loads(sys.argv[1]) else 1)" "$j" && ok || bad "CPU --json has expert_gemm"
# --json: the field, the same choice as the text
for Tf in "4096 sm90" "32768 cublas"; do
    set -- $Tf
    j=$(plan --seq-len "$1" --json)
    python3 -c "
import json, sys
e = json.loads(sys.argv[1])['expert_gemm']
ok = e['form'] == sys.argv[2] and e['requested'] == 'auto' and e['why'] == ('faster' if sys.argv[2] == 'sm90' else 'not_faster')
ok = ok and (e['sm90_s'] < e['cublas_s']) == (sys.argv[2] == 'sm90') and e['rows_per_expert'] == int(sys.argv[3]) * 8 / 64
sys.exit(0 if ok else 1)" "$j" "$2" "$1" && ok || bad "--json at $1: $(grep -o '"expert_gemm":{[^}]*}' <<<"$j")"
done
finish
