#!/usr/bin/env bash
# Issue 12's multi-GPU runs (2-8 H200s of one host), one mode per run; logs, metrics and nvidia-smi
# samples under $OUT (default /tmp/multi-gpu), a compact summary on stdout (bench/summ_multi_gpu.py):
#   bash bench/multi_gpu.sh build        # unpack .deps, build this tree into build-gpu (bench/offload_gpu.sh build)
#   bash bench/multi_gpu.sh two          # run 1 (2 GPUs): OLMoE-1B-7B 16K, one GPU (micro-batch 2, and 1 for speed)
#                                        #   against dp 2 and ep 2 (micro-batch 1 each), 20 steps: losses, tok/s, memory
#   bash bench/multi_gpu.sh qwen [T..]   # run 2 (8 GPUs): Qwen3-30B-A3B at 32K and 128K with `flatmoe plan --world 8`'s
#                                        #   launch line, 5 steps (3 at 128K): tok/s per GPU, MFU, plan vs measured memory, step
#   bash bench/multi_gpu.sh sp8          # run 3 (8 GPUs): OLMoE-1B-7B with sp 8 at the longest fit (or the longest whose
#                                        #   projected steps fit SP8_BUDGET_S), detached: then `collect`
#   bash bench/multi_gpu.sh collect      # wait (WAIT_S, 580 s) for sp8 and print its summary
#   bash bench/multi_gpu.sh skew         # run 4 (8 GPUs): OLMoE-1B-7B --ep 8 (8 experts per rank), 32K and 64K tokens per
#                                        #   rank, FLATMOE_TEST_FORCE_ROUTE=0:90 (90% of the tokens to experts 0-7, all on
#                                        #   rank 0): uncapped (one chunk; at 64K its bound, 137 GiB of dispatch, does not
#                                        #   fit, so the plan's refusal is printed instead), capped (--ep-cap-tokens 8192),
#                                        #   capped + --llep: rows received per chunk (peak receive) and the MoE phases
#   bash bench/multi_gpu.sh kill         # run 5 (2 GPUs): rank 1 SIGKILLed, then SIGSTOPped (a hung rank: the collective
#                                        #   timeout), mid-step: the error lines and the time to the job's end
#   bash bench/multi_gpu.sh all          # every mode the GPUs allow, in order, within ALL_BUDGET_S (540 s) of estimates
#   bash bench/multi_gpu.sh pack         # tar $OUT into $OUT/pack.tgz, alone there (the device returns at most 8 files)
#   bash bench/multi_gpu.sh plans        # print the plans qwen and sp8 would run (no GPU needed)
# NCCL_NVLS_ENABLE=0 always (NVLink multicast can put GPUs shared with others out of service). Each
# rank takes the GPU of its node-local rank (OMPI_COMM_WORLD_LOCAL_RANK mod the GPUs:
# fm_train_setup.c -> fm_backend_default_select_device); the nvidia-smi samples show every GPU busy.
#
# Device sessions (each line is one `run` call, with carry [".deps", ".data"] as for
# bench/offload_gpu.sh; the device's $OUT is a fresh folder each call, so every call ends with pack,
# which leaves one $OUT/pack.tgz; build-gpu stays while the machine is warm):
#   nvidia-h200-x2 (~14 device min):
#     bash bench/multi_gpu.sh build && bash bench/multi_gpu.sh test; bash bench/multi_gpu.sh pack   (~5 min)
#     bash bench/multi_gpu.sh two; bash bench/multi_gpu.sh pack                                     (~6 min)
#     bash bench/multi_gpu.sh kill; bash bench/multi_gpu.sh pack                                    (~3 min)
#     (or, after build: ALL_BUDGET_S=560 bash bench/multi_gpu.sh all; bash bench/multi_gpu.sh pack: two, kill)
#   nvidia-h200-x8 (~28 device min of the 30; a command may run 10 min at most):
#     bash bench/multi_gpu.sh build; bash bench/multi_gpu.sh pack                                   (~4 min)
#     bash bench/multi_gpu.sh skew; bash bench/multi_gpu.sh pack                                    (~6 min)
#     bash bench/multi_gpu.sh qwen; bash bench/multi_gpu.sh pack                                    (~7 min: 32K, 128K)
#     bash bench/multi_gpu.sh kill; bash bench/multi_gpu.sh sp8; bash bench/multi_gpu.sh pack       (~4 min; sp8 detached)
#     bash bench/multi_gpu.sh collect; bash bench/multi_gpu.sh pack                                 (~7 min)
#     (kill is optional here when an x2 session ran it; two, on GPUs 0-1, costs ~6 min more)
# Device-minute estimates (startup is most of a short run: OLMoE-1B-7B ~45 s, Qwen3-30B-A3B ~60 s):
#   build 3-5; two 5-6 (four runs of 20 steps); kill 2-3; qwen 32K 2, 128K 4-5; skew 5-6 (five
#   runs of 4 steps); sp8 startup 2-3 plus STEPS x the projected step (SP8_BUDGET_S bounds it:
#   360 s by default: about 1.8M tokens; 600 s: 2.3M; the longest fit, 6.3M tokens, projects 2,816 s
#   a step and 4M 952 s: a session of its own with SP8_T=4194304 SP8_STEPS=1 and collect twice).
#
# Knobs: OUT, TEXT (the training text; .data/tinyshakespeare.txt), FM (the binary; build-gpu/flatmoe-cuda),
# MEMB (--mem-budget of every run but qwen/sp8's launch lines, 136GiB: the same on every rank so they
# choose the same knobs), STEPS_TWO (20), QSTEPS (5 below 128K, else 3), QDEVMEM_RETRY (137GiB), SKEW_STEPS (4), SKEW_ROUTE (0:90), SKEW_TS ("32768 65536"),
# SKEW_CAP (8192), SKEW_NP (8), SKEW_BASE=1 (add a capped run with the router's own choice), KILL_NP (2),
# KILL_T (4096), KILL_AFTER (5 s after step 2), KILL_TIMEOUT (--comm-timeout, 30 s), SP8_T, SP8_SP (8),
# SP8_STEPS (2), SP8_BUDGET_S (360), DEVMEM (plan's --device-mem, 139GiB), ALL_BUDGET_S (540).
# CPU check of the logic (no GPU; tiny configs, the mpi communicator, oversubscribed CPU ranks):
#   DRY=1 bash bench/multi_gpu.sh all        (FM=build/flatmoe; DRY_GPUS=4 pretends 4 GPUs)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/multi-gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
D=/tmp/flatmoe-deps-root
if [ -d .deps ] && [ ! -d $D ]; then for f in .deps/*.deb; do dpkg -x "$f" $D; done; fi
export LD_LIBRARY_PATH="$D/usr/lib/x86_64-linux-gnu/openblas-openmp:$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
if ! command -v mpirun >/dev/null && [ -x $D/usr/bin/mpirun ]; then export PATH="$D/usr/bin:$PATH" OPAL_PREFIX=$D/usr; fi
SUMM="python3 $ROOT/bench/summ_multi_gpu.py"
DRY=${DRY:-0}
if [ "$DRY" = 1 ]; then # CPU ranks: the same modes on tiny configs, so the parsing and summaries run end to end
    FM=${FM:-build/flatmoe}; COMM=mpi; NGPU=${DRY_GPUS:-4}; BACKEND=cpu; EXTRA=(--threads 1)
    OVERSUB=(--oversubscribe); export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_mpi_yield_when_idle=1
    OLMOE=bench/configs/small-olmoe.json; QWEN=configs/tiny.json
    T_TWO=256; T_QWEN="256 512"; QWORLD=4; SKEW_TS=${SKEW_TS:-"128 256"}; SKEW_CAP=${SKEW_CAP:-32}; SKEW_NP=${SKEW_NP:-4}
    LLEP_X=(--llep-min-piece 16); MEMB=${MEMB:-1GiB}; DEVMEM=${DEVMEM:-128MiB}; SP8_SP=${SP8_SP:-4}; KILL_T=${KILL_T:-64}
    KILL_CFG=bench/configs/small-olmoe.json; KILL_TIMEOUT=${KILL_TIMEOUT:-4}; KILL_AFTER=${KILL_AFTER:-1}
    SP8_BUDGET_S=${SP8_BUDGET_S:-2}; SP8_LO=512; SP8_HI=1048576; SP8_STEP=256
else
    FM=${FM:-build-gpu/flatmoe-cuda}; COMM=nccl; BACKEND=cuda; EXTRA=()
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); OVERSUB=()
    OLMOE=configs/olmoe-1b-7b.json; QWEN=configs/qwen3-30b-a3b.json
    T_TWO=16384; T_QWEN="32768 131072"; QWORLD=8; SKEW_TS=${SKEW_TS:-"32768 65536"}; SKEW_CAP=${SKEW_CAP:-8192}; SKEW_NP=${SKEW_NP:-8}
    LLEP_X=(); MEMB=${MEMB:-136GiB}; DEVMEM=${DEVMEM:-139GiB}; SP8_SP=${SP8_SP:-8}; KILL_T=${KILL_T:-4096}
    KILL_CFG=${KILL_CFG:-configs/olmoe-1b-7b.json}; KILL_TIMEOUT=${KILL_TIMEOUT:-30}; KILL_AFTER=${KILL_AFTER:-5}
    SP8_BUDGET_S=${SP8_BUDGET_S:-360}; SP8_LO=1048576; SP8_HI=16777216; SP8_STEP=8192
fi
FM=$(readlink -f "$FM" 2>/dev/null || echo "$FM")
TEXT=${TEXT:-$ROOT/.data/tinyshakespeare.txt}
[ -f "$TEXT" ] || TEXT=/work/shared/data/tinyshakespeare.txt
MPI=(mpirun --allow-run-as-root --bind-to none --mca btl self,vader --mca btl_vader_single_copy_mechanism none
     --mca pml ob1 "${OVERSUB[@]}")
export FLATMOE_PROFILE=${FLATMOE_PROFILE:-1} # the per-phase step times (FLATMOE_PROFILE=0: off)

need() { # mode, GPUs it needs: 0 when present, else says it is skipped
    if [ "$NGPU" -lt "$2" ]; then echo "== $1: SKIPPED: needs $2 GPUs, found $NGPU (nvidia-smi -L)"; return 1; fi
}
maxpos() { python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('max_position_embeddings', 0))" "$1"; }
DATA=(); VF=0.3
data_for() { # T: DATA (the text passed n times) and VF so that both splits hold a window of T + 1 tokens
    local s n; s=$(stat -c %s "$TEXT")
    n=$(( (($1 + 2) * 10 + s * 3 - 1) / (s * 3) )); [ "$n" -ge 1 ] || n=1
    DATA=(); for ((i = 0; i < n; i++)); do DATA+=("$TEXT"); done; VF=0.3
}
smi_start() { # NAME: sample every GPU's memory.used twice a second until smi_stop
    SMI_PID=""
    command -v nvidia-smi >/dev/null && [ "$DRY" != 1 ] || return 0
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/$1.smi" 2>/dev/null &
    SMI_PID=$!
}
smi_stop() { [ -n "${SMI_PID:-}" ] && kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null; SMI_PID=""; }
# train NAME NP CONFIG T STEPS FLAGS...: one run (NP 1: no mpirun, the single-rank path), its log,
# rank 0's metrics and the GPUs' samples under $OUT; prints the exit and the wall time
train() {
    local name=$1 np=$2 cfg=$3 T=$4 steps=$5; shift 5
    local dir=/tmp/mg-$name; rm -rf "$dir"
    data_for "$T"
    local mp=(); [ "$T" -gt "$(maxpos "$cfg")" ] && [[ " $* " != *" --max-position-embeddings "* ]] && mp=(--max-position-embeddings "$T")
    local cmd=("$FM" train --config "$cfg" --data "${DATA[@]}" --val-fraction "$VF" --seq-len "$T" --steps "$steps"
               --warmup 1 --lr 1e-4 --min-lr 1e-5 --eval-every 0 --eval-batches 1 --no-checkpoint --report-memory
               --log-every 1 "${mp[@]}" "${EXTRA[@]}" --out "$dir" "$@")
    [ "$np" -gt 1 ] && cmd=("${MPI[@]}" -np "$np" "${cmd[@]}" --comm "$COMM")
    echo "$cfg" > "$OUT/$name.cfg"
    echo "${cmd[*]}" > "$OUT/$name.cmd"
    smi_start "$name"
    local t0=$SECONDS
    timeout "${RUN_TIMEOUT:-590}" "${cmd[@]}" > "$OUT/$name.log" 2>&1
    local rc=$?
    smi_stop
    cp "$dir/metrics.jsonl" "$OUT/$name.jsonl" 2>/dev/null
    echo "== $name: np $np, exit $rc, wall $((SECONDS - t0)) s: ${cmd[*]:0:3} ... ${*}"
    return $rc
}
# plan_line CONFIG T WORLD [plan flags]: the plan's output to $OUT/plan-*.txt; prints its launch line
plan_file() { echo "$OUT/plan-$(basename "$1" .json)-$2-w$3.txt"; } # CONFIG T WORLD
plan_line() {
    local cfg=$1 T=$2 W=$3; shift 3
    local f; f=$(plan_file "$cfg" "$T" "$W")
    "$FM" plan --config "$cfg" --backend "$BACKEND" --seq-len "$T" --world "$W" --device-mem "$DEVMEM" "$@" > "$f" 2>&1 || return 1
    grep -q '^launch: mpirun' "$f" || return 1 # "launch: none": the mesh does not fit
    grep -m1 '^launch: ' "$f" | sed 's/^launch: //'
}
plan_step() { grep -m1 '^projected step:' "$(plan_file "$1" "$2" "$3")" 2>/dev/null | sed -E 's/^projected step: ([0-9.e+]+) s.*/\1/'; }
# launch LINE: the plan's "mpirun -np N flatmoe-cuda train ... --data DATA ..." as NP and FLAGS (the train flags)
launch_split() {
    L_NP=$(sed -E 's/^mpirun -np ([0-9]+) .*/\1/' <<< "$1")
    read -r -a L_FLAGS <<< "$(sed -E 's/^mpirun -np [0-9]+ [^ ]+ train //; s/--data DATA //; s/--config [^ ]+ //; s/--seq-len [0-9]+ //' <<< "$1")"
}

mode_two() { # run 1: OLMoE-1B-7B at 16K: one GPU against dp 2 and ep 2 (20 steps each)
    need two 2 || return 0
    local S=${STEPS_TWO:-20} B=(--mem-budget "$MEMB")
    CUDA_VISIBLE_DEVICES=0 train two-one "1" $OLMOE $T_TWO $S --micro-batch 2 "${B[@]}"
    [ "${ONE_MB1:-1}" = 1 ] && CUDA_VISIBLE_DEVICES=0 train two-one-mb1 1 $OLMOE $T_TWO $S --micro-batch 1 "${B[@]}"
    train two-dp2 2 $OLMOE $T_TWO $S --micro-batch 1 "${B[@]}"
    train two-ep2 2 $OLMOE $T_TWO $S --micro-batch 1 --ep 2 "${B[@]}"
    echo "== two: summary (tokens/s per GPU: dp/ep runs over 2 GPUs; losses against one GPU at micro-batch 2, the same global batch)"
    $SUMM run "$OUT" two-one 1
    [ "${ONE_MB1:-1}" = 1 ] && $SUMM run "$OUT" two-one-mb1 1
    $SUMM run "$OUT" two-dp2 2 two-one
    $SUMM run "$OUT" two-ep2 2 two-one
}

mode_qwen() { # run 2: Qwen3-30B-A3B with the chooser's mesh on 8 GPUs
    need qwen $QWORLD || return 0
    local T line
    for T in ${*:-$T_QWEN}; do
        pf=$(plan_file $QWEN "$T" $QWORLD)
        line=$(plan_line $QWEN "$T" $QWORLD) || { echo "== qwen $T: the plan failed:"; tail -3 "$pf"; continue; }
        echo "== qwen $T: plan (dp ep sp fits device-GiB host-GiB step-s tokens/s MFU):$(grep -m1 'chosen' "$pf" | sed 's/  */ /g'); projected step $(plan_step $QWEN "$T" $QWORLD) s"
        echo "   launch: $line"
        launch_split "$line"
        local steps=${QSTEPS:-$([ "$T" -ge 131072 ] && echo 3 || echo 5)}
        train qwen-$T "$L_NP" $QWEN "$T" "$steps" "${L_FLAGS[@]}"
        if [ $? -ne 0 ] && grep -qE "MiB (of device memory )?needed but" "$OUT/qwen-$T.log"; then
            # the trainer's own plan (one head gather more under --zero 3 + ring: the plan's note) did
            # not fit this GPU's measured budget: plan again with less and retry once
            echo "   the trainer's plan did not fit: $(grep -m1 -oE 'plan: [0-9.]+ MiB (of device memory )?needed but.{0,60}' "$OUT/qwen-$T.log")"
            line=$(DEVMEM=${QDEVMEM_RETRY:-137GiB} plan_line $QWEN "$T" $QWORLD) && {
                echo "   retry with the plan at --device-mem ${QDEVMEM_RETRY:-137GiB}: $line"
                mv "$OUT/qwen-$T.log" "$OUT/qwen-$T-refused.log"; launch_split "$line"
                train qwen-$T "$L_NP" $QWEN "$T" "$steps" "${L_FLAGS[@]}"; }
        fi
        $SUMM run "$OUT" qwen-$T "$L_NP"
        echo "   mesh plan (--world $QWORLD): $(grep -m1 '^projected step:' "$pf")"
    done
}

fits_sp8() { plan_line $OLMOE "$1" "$SP8_W" --sp "$SP8_SP" > /dev/null; }
SP8_W=$SP8_SP
# sp8_pick: SP8_RUN_T = SP8_T, else the longest context `flatmoe plan --world SP8_SP --sp SP8_SP` fits
# (bisection in steps of SP8_STEP), else, when SP8_STEPS of its projected step pass SP8_BUDGET_S, the
# longest whose projected steps fit the budget; returns 1 when not even SP8_LO fits
sp8_pick() {
    local lo hi mid T steps=${SP8_STEPS:-2} p
    if [ -n "${SP8_T:-}" ]; then T=$SP8_T; else
        lo=$SP8_LO hi=$SP8_HI # bisection in steps of SP8_STEP: lo fits, hi does not
        fits_sp8 $lo || { echo "== sp8: not even $lo tokens fit"; tail -3 "$(plan_file $OLMOE $lo $SP8_W)"; return 1; }
        while [ $((hi - lo)) -gt $SP8_STEP ]; do
            mid=$(( (lo + hi) / 2 / SP8_STEP * SP8_STEP ))
            if fits_sp8 $mid; then lo=$mid; else hi=$mid; fi
        done
        echo "== sp8: the longest fit is $lo tokens (sp $SP8_SP; $hi does not fit); projected step $(plan_step $OLMOE $lo $SP8_W) s"
        T=$lo
        p=$(plan_step $OLMOE $T $SP8_W)
        if python3 -c "import sys; sys.exit(0 if $steps * $p <= $SP8_BUDGET_S else 1)"; then :; else
            lo=$SP8_LO hi=$T # the longest whose projected steps fit the budget
            while [ $((hi - lo)) -gt $SP8_STEP ]; do
                mid=$(( (lo + hi) / 2 / SP8_STEP * SP8_STEP ))
                fits_sp8 $mid; p=$(plan_step $OLMOE $mid $SP8_W)
                if python3 -c "import sys; sys.exit(0 if $steps * $p <= $SP8_BUDGET_S else 1)"; then lo=$mid; else hi=$mid; fi
            done
            T=$lo
            echo "   running $T tokens instead: $steps steps of its projected $(plan_step $OLMOE $T $SP8_W) s fit SP8_BUDGET_S=$SP8_BUDGET_S (SP8_T=N runs N)"
        fi
    fi
    SP8_RUN_T=$T
}
mode_sp8() { # run 3: OLMoE-1B-7B with sp 8 at the longest context the chooser fits (or that the budget allows)
    need sp8 "$SP8_W" || return 0
    sp8_pick || return 0
    local T=$SP8_RUN_T steps=${SP8_STEPS:-2} line
    line=$(plan_line $OLMOE "$T" "$SP8_W" --sp "$SP8_SP") || { echo "== sp8 $T: the plan failed"; return 0; }
    echo "== sp8 $T: launch: $line"
    local SD=/tmp/multi-gpu-sp8; rm -rf "$SD"; mkdir -p "$SD"; cp "$(plan_file $OLMOE "$T" $SP8_W)" "$SD"/ 2>/dev/null
    launch_split "$line"
    OUT=$SD setsid nohup bash "$0" _sp8run "$T" "$L_NP" "$steps" "${L_FLAGS[@]}" > "$SD/summary.txt" 2>&1 < /dev/null &
    echo "   started detached (rank 0's log: $SD/sp8-$T.log); collect with: bash bench/multi_gpu.sh collect"
}

mode_skew() { # run 4: dispatch under skew, --ep over SKEW_NP ranks, at each of SKEW_TS tokens per rank
    need skew "$SKEW_NP" || return 0
    local S=${SKEW_STEPS:-4} B=(--mem-budget "$MEMB" --micro-batch 1 --ep "$SKEW_NP") T runs=() pf
    export FLATMOE_TEST_FORCE_ROUTE=${SKEW_ROUTE:-0:90}
    echo "== skew: $OLMOE --ep $SKEW_NP, $SKEW_TS tokens per rank, FLATMOE_TEST_FORCE_ROUTE=$FLATMOE_TEST_FORCE_ROUTE, cap $SKEW_CAP"
    for T in $SKEW_TS; do
        # uncapped: the whole micro-batch in one chunk; the plan says first whether its bound fits
        pf="$OUT/plan-skew-uncapped-$T.txt"
        if "$FM" plan --config $OLMOE --backend "$BACKEND" --seq-len "$T" --dp "$SKEW_NP" --ep "$SKEW_NP" --zero 0 \
               --moe-chunk-tokens "$T" --mem-budget "$MEMB" $([ "$T" -gt "$(maxpos $OLMOE)" ] && echo --max-position-embeddings "$T") > "$pf" 2>&1; then
            train skew-uncapped-$T "$SKEW_NP" $OLMOE "$T" $S "${B[@]}" --ep-cap-tokens "$T"; runs+=(skew-uncapped-$T)
        else
            echo "== skew-uncapped-$T: not run: the plan refuses it under --mem-budget $MEMB: $(grep -m1 '^expert dispatch' "$pf" | sed 's/  */ /g' | cut -c1-160)"
            grep -m1 -oE "error: plan: [0-9.]+ MiB of device memory needed but [^;]*" "$pf" | sed 's/^/   /'
        fi
        train skew-capped-$T "$SKEW_NP" $OLMOE "$T" $S "${B[@]}" --ep-cap-tokens "$SKEW_CAP"; runs+=(skew-capped-$T)
        train skew-llep-$T "$SKEW_NP" $OLMOE "$T" $S "${B[@]}" --ep-cap-tokens "$SKEW_CAP" --llep "${LLEP_X[@]}"; runs+=(skew-llep-$T)
        if [ "${SKEW_BASE:-0}" = 1 ]; then
            FLATMOE_TEST_FORCE_ROUTE= train skew-routed-$T "$SKEW_NP" $OLMOE "$T" $S "${B[@]}" --ep-cap-tokens "$SKEW_CAP"
            runs+=(skew-routed-$T)
        fi
    done
    unset FLATMOE_TEST_FORCE_ROUTE
    for r in "${runs[@]}"; do $SUMM run "$OUT" $r "$SKEW_NP"; done
}

kill_case() { # NAME SIGNAL: rank 1 of KILL_NP gets SIGNAL KILL_AFTER s after rank 0 printed step 2
    local name=$1 sig=$2 np=${KILL_NP:-2} dir="$OUT/kill-$1"
    rm -rf "$dir" /tmp/mg-kill-$name; mkdir -p "$dir"
    data_for "$KILL_T"
    local mp=(); [ "$KILL_T" -gt "$(maxpos "$KILL_CFG")" ] && mp=(--max-position-embeddings "$KILL_T")
    local args=(train --config "$KILL_CFG" --data "${DATA[@]}" --val-fraction "$VF" --seq-len "$KILL_T" --micro-batch 1
                --steps 1000000 --warmup 1 --eval-every 0 --no-checkpoint --log-every 1 --comm "$COMM"
                --comm-timeout "$KILL_TIMEOUT" --mem-budget "$MEMB" "${mp[@]}" "${EXTRA[@]}" --out /tmp/mg-kill-$name)
    local inner; inner="echo \$\$ > $dir/pid.\$OMPI_COMM_WORLD_RANK; exec $(printf '%q ' "$FM" "${args[@]}")"
    local t0=$SECONDS
    timeout 300 "${MPI[@]}" -np "$np" bash -c "$inner" > "$dir/log" 2>&1 &
    local job=$!
    for _ in $(seq 1 480); do grep -qE '^step +2/' "$dir/log" && break; kill -0 $job 2>/dev/null || break; sleep 0.5; done
    if ! grep -qE '^step +2/' "$dir/log"; then
        wait $job; echo "== kill $name: the job never reached step 2 (exit $?):"; tail -5 "$dir/log"; return 0
    fi
    sleep "$KILL_AFTER"
    local victim; victim=$(cat "$dir/pid.1")
    local last; last=$(grep -E '^step ' "$dir/log" | tail -1 | cut -c1-80)
    local ts=$SECONDS
    kill -"$sig" "$victim"
    wait $job; local rc=$?
    local st; st=$(ps -o stat= -p "$victim" 2>/dev/null)
    [ -n "$st" ] && [[ $st != Z* ]] && { kill -KILL "$victim" 2>/dev/null; echo "   (rank 1 still there after the job, state $st: killed)"; }
    echo "== kill $name: SIG$sig to rank 1 (pid $victim) at $((ts - t0)) s, after '$last'; the job ended with status $rc $((SECONDS - ts)) s later (--comm-timeout $KILL_TIMEOUT)"
    grep -E "error|Error|ERROR|timed out|did not complete|noticed|signal|Abort" "$dir/log" | grep -v '^step ' | head -8 | cut -c1-260 | sed 's/^/   /'
}
mode_kill() { # run 5: one rank killed (then one hung) mid-step
    need kill "${KILL_NP:-2}" || return 0
    kill_case sigkill KILL
    kill_case sigstop STOP
}

case "${1:-}" in
build) OUT=$OUT bash bench/offload_gpu.sh build ;;
test) OUT=$OUT bash bench/offload_gpu.sh test ;; # ctest -L gpu: nccl_comm_np2 and nccl_comm_timeout run on 2+ GPUs
two) mode_two ;;
qwen) shift; mode_qwen "$@" ;;
sp8) mode_sp8 ;;
_sp8run) # (detached by sp8) T NP STEPS FLAGS...
    shift; T=$1 NP=$2 ST=$3; shift 3
    [[ "$NP" =~ ^[0-9]+$ ]] || { echo "_sp8run: bad rank count '$NP'"; exit 2; }
    RUN_TIMEOUT=${SP8_RUN_TIMEOUT:-7200} train sp8-$T "$NP" $OLMOE "$T" "$ST" "$@"
    $SUMM run "$OUT" sp8-$T "$NP"
    echo "   mesh plan: $(grep -m1 '^projected step:' "$OUT"/plan-*-"$T"-w*.txt 2>/dev/null)"
    echo "== sp8 done" ;;
collect)
    SD=/tmp/multi-gpu-sp8
    for _ in $(seq 1 "${WAIT_S:-580}"); do grep -q "^== sp8 done" "$SD/summary.txt" 2>/dev/null && break
        pgrep -f "_sp8run" > /dev/null || { echo "== collect: the detached sp8 run is no longer running"; break; }
        sleep 1; done
    grep -q "^== sp8 done" "$SD/summary.txt" 2>/dev/null || echo "== collect: sp8 still running after ${WAIT_S:-580} s (call collect again); last lines:"
    cat "$SD/summary.txt" 2>/dev/null; grep -E '^(step|profile) ' "$SD"/sp8-*.log 2>/dev/null | tail -4 | cut -c1-240
    mkdir -p "$OUT/sp8"; cp "$SD"/* "$OUT/sp8/" 2>/dev/null; true ;;
skew) mode_skew ;;
kill) mode_kill ;;
plans) # what qwen and sp8 would launch (any machine: plans only)
    for T in $T_QWEN; do echo "qwen $T: $(plan_line $QWEN "$T" $QWORLD || echo 'no plan')"; echo "  $(grep -m1 '^projected step:' "$(plan_file $QWEN "$T" $QWORLD)")"; done
    sp8_pick && echo "sp8 $SP8_RUN_T: $(plan_line $OLMOE "$SP8_RUN_T" "$SP8_W" --sp "$SP8_SP")" ;;
all) # every mode that the GPUs allow, in order, skipping what the estimates say would pass the budget
    t0=$SECONDS; budget=${ALL_BUDGET_S:-540}
    declare -A EST=([two]=360 [kill]=150 [qwen]=420 [skew]=360 [sp8]=120)
    [ "$DRY" = 1 ] && EST=([two]=20 [kill]=20 [qwen]=30 [skew]=20 [sp8]=10)
    for m in two qwen skew kill sp8; do
        if [ $((SECONDS - t0 + ${EST[$m]})) -gt "$budget" ]; then
            echo "== $m: SKIPPED: ${EST[$m]} s estimated, $((budget - SECONDS + t0)) s left of ALL_BUDGET_S=$budget"; continue
        fi
        mode_$m
    done
    echo "== all: $((SECONDS - t0)) s" ;;
pack) # every file under $OUT into one $OUT/pack.tgz (the device returns at most 8 files of 16 MiB)
    (cd "$OUT" && tar czf /tmp/mg-pack.tgz --exclude=pack.tgz . && rm -rf ./* && mv /tmp/mg-pack.tgz pack.tgz); ls -la "$OUT"
    [ "$(stat -c %s "$OUT/pack.tgz")" -le $((16 * 1024 * 1024)) ] || echo "pack: over 16 MiB: the device will not return it" ;;
*) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2 ;;
esac
