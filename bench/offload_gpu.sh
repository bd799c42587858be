#!/usr/bin/env bash
# Issue 10's GPU checks on one H200, in parts so each fits a device call (logs to $OUT):
#   bash bench/offload_gpu.sh build          # unpack .deps, build this tree into build-gpu
#   bash bench/offload_gpu.sh test           # ctest -L gpu
#   bash bench/offload_gpu.sh tok            # tokenizer goldens with HF tokenizers -> $OUT/tok.tar.gz
#   bash bench/offload_gpu.sh keepatt [T]    # full recompute vs --recompute-keep-attention (128K)
#   bash bench/offload_gpu.sh sco [T]        # streamed AdamW, checkpoint offload off vs all (256K)
#   bash bench/offload_gpu.sh overlap        # the optimizer overlap on and off at 4K and 16K (and G = 16, bf16 moments)
#   bash bench/offload_gpu.sh peer [T...]     # the PyTorch peer, compiled or not, checkpointed or not (+ 4K G=16)
#   bash bench/offload_gpu.sh ours [T...]     # flatmoe with the chooser's knobs (+ 4K G=16, --bf16-moments)
#   bash bench/offload_gpu.sh ranks           # --ep on 2 ranks sharing the GPU; the nccl communicator's overhead
#   bash bench/offload_gpu.sh lab             # the grouped GEMM kernel lab (dev/cuda/grouped_gemm)
#   bash bench/offload_gpu.sh long            # 512K (chooser), then the longest fit (1.25M, detached: collect)
#   bash bench/offload_gpu.sh longest         # the longest fit alone (1.25M, detached: collect)
#   bash bench/offload_gpu.sh sm90 [T...]     # the sync-free expert GEMMs against cuBLAS (issue 14)
#   bash bench/offload_gpu.sh autogemm [T...] # FLATMOE_EXPERT_GEMM=auto's pick in train (4K: sm90, 32K: cuBLAS)
#   bash bench/offload_gpu.sh verify          # build + ctest -L gpu + the lab's checks (a session's first call)
#   bash bench/offload_gpu.sh updblocks [n..] # FLATMOE_UPDATE_BLOCKS A/B at 4K (6 steps each; UPD_FLAGS: more train flags)
#   bash bench/offload_gpu.sh pack            # tar $OUT into one file (the device returns at most 8)
#   bash bench/offload_gpu.sh fp8loss         # 200 steps at 4K, --expert-precision bf16 vs fp8 (issue 14)
#   bash bench/offload_gpu.sh streamopt       # 128K, 5 steps: the streamed AdamW's own copy streams
#   bash bench/offload_gpu.sh fp8codes [T...] # the FP8 fast path: its GPU test, then OLMoE steps bf16 / fp8 codes / fp8 emulated
#   bash bench/offload_gpu.sh calib           # calibrate with FLATMOE_EXPERT_GEMM=sm90 (bf16, sm90 and fp8 curves) -> $OUT/h200.json
#   bash bench/offload_gpu.sh fp8next         # the rewritten FP8 quantizers' test and the lab's v5 variants (then pack)
#   bash bench/offload_gpu.sh next            # session 12's first call: the FP8 tests, 4K bf16 vs fp8 runs (then pack)
#   bash bench/offload_gpu.sh next2           # its second: 16K bf16 vs fp8, calib, the 200-step loss curves (then pack)
#   bash bench/offload_gpu.sh state           # issue 25: recipe GPU tests, calibrate, 4K bf16-sr / fp32 and the peer
#   bash bench/offload_gpu.sh s17             # session 17: build, ctest -L gpu, hf_parity new cases, offload fraction at 79 GiB
#   bash bench/offload_gpu.sh rl [T..]         # issue 29: logprobs and a GRPO step, libflatmoe-cuda against the compiled peer (8K, 32K, 128K)
#   bash bench/offload_gpu.sh fam CFG N [T..]  # issue 26: a real config's first N layers, flatmoe (plan vs high-water) and the compiled peer
#   bash bench/offload_gpu.sh s19b            # session 19's second call: fam of gpt-oss-20b (2 layers) and DeepSeek-V2-Lite (4 layers)
#   bash bench/offload_gpu.sh s19             # session 19: build, the whole ctest -L gpu, parity of deepseek_v2/v3 and gpt_oss, packed
#   bash bench/offload_gpu.sh s18             # session 18 (under 300 s): build, the unrun GPU tests, parity of deepseek_v3/gpt_oss, f32cap 4K
#   bash bench/offload_gpu.sh run NAME T STEPS FLAGS...   # one OLMoE-1B-7B run, summarized
# (COPIES=n passes the text n times, VF the validation fraction: long windows need both)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/offload-gpu}
mkdir -p "$OUT"
D=/tmp/flatmoe-deps-root
if [ -d .deps ] && [ ! -d $D ]; then for f in .deps/*.deb; do dpkg -x "$f" $D; done; fi
export LD_LIBRARY_PATH="$D/usr/lib/x86_64-linux-gnu/openblas-openmp:$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
CM=(-DFLATMOE_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_INCLUDE_PATH=$D/usr/include
    "-DCMAKE_LIBRARY_PATH=$D/usr/lib/x86_64-linux-gnu/openblas-openmp;$D/usr/lib/x86_64-linux-gnu")
TEXT=${TEXT:-$PWD/.data/tinyshakespeare.txt}
BIN=${BIN:-build-gpu/flatmoe-cuda}
summ() { # metrics.jsonl: every step's loss (repr), ms, tokens/s, host syncs, phases
python3 - "$1" <<'PY'
import json, sys
try: rows = [json.loads(l) for l in open(sys.argv[1])]
except Exception as e: print("  no metrics:", e); sys.exit()
for r in rows:
    if r.get("type", "step") != "step": continue
    print("  step %d loss %r gnorm %r tok/s %.0f syncs %s phases %s" % (r["step"], r.get("loss"), r.get("grad_norm"),
          r.get("tokens_per_s", 0), r.get("host_syncs"), r.get("phase_ms")))
PY
}
run1() { # name T steps flags...
    local name=$1 T=$2 steps=$3; shift 3
    rm -rf "/tmp/r-$name"
    local t0=$(date +%s)
    local data=("$TEXT"); for ((i = 1; i < ${COPIES:-1}; i++)); do data+=("$TEXT"); done
    FLATMOE_PROFILE=1 "$BIN" train --config "${CONFIG:-configs/olmoe-1b-7b.json}" --data "${data[@]}" --seq-len "$T" --micro-batch 1 \
        --steps "$steps" --warmup 1 --lr 1e-4 --min-lr 1e-5 --eval-every 0 --eval-batches 1 --val-fraction "${VF:-0.3}" \
        --max-position-embeddings ${MAXPOS:-1048576} --no-checkpoint --report-memory --out "/tmp/r-$name" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name T=$T exit $? wall $(( $(date +%s) - t0 )) s flags: $*"
    grep -E "^plan|high-water|error|Error" "$OUT/$name.log" | cut -c1-200 | head -14
    cp "/tmp/r-$name/metrics.jsonl" "$OUT/$name.jsonl" 2>/dev/null; summ "$OUT/$name.jsonl"
}
case "${1:-}" in
build)
    t0=$(date +%s)
    cmake -S . -B build-gpu "${CM[@]}" > "$OUT/build.log" 2>&1 && cmake --build build-gpu -j16 -- -k >> "$OUT/build.log" 2>&1
    echo "build: $? in $(( $(date +%s) - t0 )) s"; grep -E "error|warning" "$OUT/build.log" | head -20; true ;;
test)
    (cd build-gpu && ctest -L gpu --output-on-failure --timeout 240 > "$OUT/ctest-gpu.log" 2>&1; echo "ctest -L gpu: $?")
    grep -E "Test +#|tests passed|FAIL" "$OUT/ctest-gpu.log" | head -40 ;;
tok)
    rm -rf /tmp/tok && python3 tools/tok_golden.py "$TEXT" /tmp/tok > "$OUT/tok.log" 2>&1; echo "tok_golden: $?"
    tail -5 "$OUT/tok.log"; tar -czf "$OUT/tok.tar.gz" -C /tmp tok 2>/dev/null ;;
keepatt)
    T=${2:-131072}; F=(--recompute full --moe-chunk-tokens 4096 --ce-block-tokens 1024)
    run1 full-$T "$T" 3 "${F[@]}"
    run1 keepatt-$T "$T" 3 "${F[@]}" --recompute-keep-attention ;;
sco)
    T=${2:-262144}; F=(--recompute full --moe-chunk-tokens 4096 --ce-block-tokens 1024 --offload-optimizer)
    run1 sco-off-$T "$T" 2 "${F[@]}"
    run1 sco-all-$T "$T" 2 "${F[@]}" --offload-boundaries all ;;
overlap)
    for T in 4096 16384; do
        run1 ovl-on-$T $T 6
        run1 ovl-off-$T $T 6 --no-optimizer-overlap
    done
    run1 ovl-on-4096-bf16 4096 6 --bf16-moments
    run1 ovl-off-4096-bf16 4096 6 --bf16-moments --no-optimizer-overlap
    run1 ovl-on-4096-g16 4096 4 --grad-accum 16
    run1 ovl-off-4096-g16 4096 4 --grad-accum 16 --no-optimizer-overlap ;;
million) # OLMoE-1B-7B at 1,048,576 tokens (issue 10): ~10 min a step, so it runs detached (setsid)
    # and `collect` (the next call, while the machine is warm) waits for it and prints the summary.
    # Device plan 134.8 GiB, pinned host 109.3 GiB (8 boundaries of 4 GiB + 12 B/param of AdamW).
    mkdir -p /tmp/m1; OUT=/tmp/m1 COPIES=3 VF=0.34 setsid nohup bash bench/offload_gpu.sh run m1 1048576 ${STEPS:-2} \
        --recompute full --moe-chunk-tokens 4096 --ce-block-tokens 1024 --offload-optimizer \
        --offload-boundaries ${NOFF:-8} > /tmp/m1/summary.txt 2>&1 < /dev/null &
    echo "started; collect with: bash bench/offload_gpu.sh collect" ;;
long|longest) # issue 10's "alone" lengths: 512K with the chooser's knobs (2 steps, ~5 min with pinning;
    # `long` only, measured in session 8), then the longest fit, 1,245,184 tokens with --bf16-moments
    # (plan: 884 s a step), one step, detached like `million` (then: bash bench/offload_gpu.sh collect)
    [ "$1" = long ] && COPIES=3 VF=0.34 run1 ours-524288 524288 2
    mkdir -p /tmp/m1; MAXPOS=${LONG_T:-1245184} OUT=/tmp/m1 COPIES=4 VF=0.3 setsid nohup bash bench/offload_gpu.sh run m1 ${LONG_T:-1245184} ${STEPS:-1} \
        --bf16-moments > /tmp/m1/summary.txt 2>&1 < /dev/null &
    echo "started the longest fit; collect with: bash bench/offload_gpu.sh collect" ;;
collect)
    for i in $(seq 1 ${WAIT_S:-580}); do grep -q "^== m1" /tmp/m1/summary.txt 2>/dev/null && sleep 5 && break; sleep 1; done
    cat /tmp/m1/summary.txt; cp /tmp/m1/* "$OUT"/ 2>/dev/null; tail -5 /tmp/m1/m1.log ;;
calib) # the H200 calibration table (plan/fm_calibrate.h) with every expert curve (cuBLAS, sm90, fp8 codes:
    # FLATMOE_EXPERT_GEMM=sm90 times the sm90 kernel): commit it as configs/calib/h200.json after reading it
    t0=$(date +%s); FLATMOE_EXPERT_GEMM=${CAL_EXPERT_GEMM:-sm90} "$BIN" calibrate --out "$OUT/h200.json" > "$OUT/calib.log" 2>&1
    echo "calibrate: $? in $(( $(date +%s) - t0 )) s"; tail -40 "$OUT/calib.log" ;;
lengths) # the chooser's own knobs (no memory flag) at each length, 3 steps
    shift; for T in ${*:-32768 65536}; do run1 len-$T $T 3; done ;;
finetune) # issue 13 on the GPU machine (transformers there): the CUDA engine's CLI tests after the
    # merges, the fine-tune check with both builds, and the run records' device and MFU
    (cd build-gpu && ctest -L gpu -R cli_cuda --output-on-failure > "$OUT/ctest-cli.log" 2>&1; echo "ctest -L gpu -R cli_cuda: $?")
    grep -E "Test +#|tests passed" "$OUT/ctest-cli.log"
    for b in build-gpu/flatmoe build-gpu/flatmoe-cuda; do
        [ -x "$b" ] || { echo "no $b"; continue; }
        PYTHONUNBUFFERED=1 timeout 240 python3 tools/hf_finetune_check.py --flatmoe "$b" --tokenizer tests/data/tok \
            --threads 16 > "$OUT/finetune-$(basename "$b").log" 2>&1; echo "hf_finetune_check $b: exit $?"
        grep -E "PASS|FAIL" "$OUT/finetune-$(basename "$b").log" | cut -c1-220
    done
    rm -rf /tmp/mfu; "$BIN" train --config configs/tiny.json --data "$TEXT" --steps 20 --no-checkpoint --quiet --out /tmp/mfu
    head -1 /tmp/mfu/metrics.jsonl | grep -o '"host":{[^}]*}'; grep -o '"mfu":[^,]*' /tmp/mfu/metrics.jsonl | tail -2 ;;
peer) # issue 10's side by side, the peer's half: compiled and not, checkpointed and not, at each length
    # (3 steps; the fastest that fits is the peer's figure), then 4K with 16 accumulated micro-batches
    shift; L=${*:-4096 16384 32768 65536 131072}
    for c in --compile ""; do
        PYTHONUNBUFFERED=1 timeout 560 python3 bench/peer_hf.py configs/olmoe-1b-7b.json $L --steps 3 $c \
            --json "$OUT/peer${c:+-compiled}.jsonl" 2>&1 | grep -E "^hf-peer" ; done
    PYTHONUNBUFFERED=1 python3 bench/peer_hf.py configs/olmoe-1b-7b.json 4096 --steps 3 --compile --grad-accum 16 \
        --no-ckpt --json "$OUT/peer-g16.jsonl" 2>&1 | grep -E "^hf-peer" ;;
ours) # issue 10's side by side, flatmoe's half: the chooser's own knobs at each length (3 steps), then
    # 4K with 16 accumulated micro-batches and with --bf16-moments
    shift; for T in ${*:-4096 16384 32768 65536 131072}; do
        COPIES=$([ "$T" -ge 262144 ] && echo 3 || echo 1) VF=$([ "$T" -ge 262144 ] && echo 0.34 || echo 0.3) run1 ours-$T $T 3; done
    run1 ours-4096-g16 4096 2 --grad-accum 16
    run1 ours-4096-bf16 4096 3 --bf16-moments
    run1 ours-4096-g16-bf16 4096 2 --grad-accum 16 --bf16-moments ;;
state) # issue 25's first call (about 9 minutes): the GPU tests the state recipes touch, OLMoE-1B-7B at
    # 4K with the peer's state bytes (--master-weights bf16-sr --bf16-moments) and with fp32 master
    # weights (the chooser's knobs), plan's projection of each, the compiled peer, then the card's
    # calibration table; everything packed into $OUT/state.tgz (the device returns at most 8 files)
    card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $card"
    kind=$(grep -q H100 <<<"$card" && echo h100 || echo h200)
    (cd build-gpu && FLATMOE_TEST_NO_BENCH=1 timeout ${TEST_S:-120} ctest -R "test_cuda_layers|cli_cuda_resume" \
        --output-on-failure > "$OUT/ctest-state.log" 2>&1; echo "ctest state: $?")
    grep -E "Test +#|tests passed|FAIL" "$OUT/ctest-state.log" | head
    for f in "--master-weights bf16-sr --bf16-moments" ""; do
        "$BIN" plan --config configs/olmoe-1b-7b.json --seq-len 4096 $f 2>&1 | grep -E "^(shape|projected step|  optimizer|note)" | cut -c1-330
    done
    timeout ${RUN_S:-90} bash "$0" run state-sr-4096 4096 4 --master-weights bf16-sr --bf16-moments
    timeout ${RUN_S:-90} bash "$0" run state-fp32-4096 4096 3
    PYTHONUNBUFFERED=1 timeout ${PEER_S:-110} python3 bench/peer_hf.py configs/olmoe-1b-7b.json 4096 --steps 3 --compile \
        --json "$OUT/peer-compiled.jsonl" 2>&1 | grep -E "^hf-peer"
    tar -czf /tmp/state.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/state.tgz "$OUT"/
    [ "$kind" = h200 ] && [ -z "${CAL_S:-}" ] && CAL_S=1 # configs/calib/h200.json exists: no time spent on it
    t0=$(date +%s); FLATMOE_EXPERT_GEMM=sm90 timeout ${CAL_S:-75} "$BIN" calibrate --out "$OUT/$kind.json" > "$OUT/calib.log" 2>&1
    echo "calibrate ($kind): $? in $(( $(date +%s) - t0 )) s"
    [ -s "$OUT/$kind.json" ] && "$BIN" plan --config configs/olmoe-1b-7b.json --seq-len 4096 --calib "$OUT/$kind.json" \
        2>&1 | grep -E "^projected step" | cut -c1-200 ;;
ranks) # issue 11 on one GPU: expert parallelism with 2 ranks sharing it, the nccl communicator's overhead
    # at one rank (the ctest -L gpu part, `test`, runs cli_cuda_zero3/cli_cuda_sp/test_comm_nccl/cli_comm_*)
    bash bench/ep_gpu.sh build-gpu "$TEXT" > "$OUT/ep_gpu.log" 2>&1; echo "ep_gpu: $?"; tail -12 "$OUT/ep_gpu.log"
    REBUILD=0 bash bench/comm_nccl.sh > "$OUT/comm_nccl.log" 2>&1; echo "comm_nccl: $?"; tail -14 "$OUT/comm_nccl.log" ;;
lab) # issue 14's kernel lab: validate and time every grouped GEMM version, torch._grouped_mm beside it
    OUT="$OUT" timeout 560 make -C dev/cuda/grouped_gemm run > "$OUT/lab.log" 2>&1; echo "lab: $?"; tail -60 "$OUT/lab.log" ;;
verify) # the first call of a session after CUDA changes: build, ctest -L gpu (the sm90 engine test and
    # test_comm_nccl among them), the lab's host checks and v3/v4's validation on the small full case
    bash "$0" build && bash "$0" test
    (cd dev/cuda/grouped_gemm && timeout 240 make check > "$OUT/lab-check.log" 2>&1; echo "lab make check: $?";
     tail -3 "$OUT/lab-check.log"; GG_CASES=small-full GG_NOTIME=1 timeout 120 ./grouped_gemm > "$OUT/lab-small.txt" 2>&1;
     echo "lab small-full: $?"; grep -E "FAIL|SNR|^small-full.*fwd\+bwd" "$OUT/lab-small.txt" | head -20) ;;
sm90) # issue 14: the sync-free expert GEMMs (FLATMOE_EXPERT_GEMM=sm90) against cuBLAS (cublas) with the
    # chooser's knobs, 3 steps each, host syncs per step in the summary (T list: ${@:2}, default 4K..64K)
    shift; for T in ${*:-4096 16384 32768 65536}; do
        FLATMOE_EXPERT_GEMM=cublas run1 gemm-cublas-$T $T 3
        FLATMOE_EXPERT_GEMM=sm90 run1 gemm-sm90-$T $T 3
    done ;;
updblocks) # the optimizer overlap's update stream at low priority with a capped AdamW grid
    # (FLATMOE_UPDATE_BLOCKS) against today's, 4K, 6 steps each: steps 3..6 are the steady state
    # (--report-memory waits for step 1's update, so step 2 has none beside it). The first value runs
    # twice: cuDNN's attention backward is not deterministic, so two runs of the same binary differ
    # (session 12: 1.2e-4 at step 3, 1.1e-3 by step 6); each run's largest loss difference from the first is printed
    # beside that repeat's (FLATMOE_ATTENTION=fallback makes them bit-identical, at other speeds)
    shift; NS=(${*:-0 132 264 528})
    FLATMOE_UPDATE_BLOCKS=${NS[0]} run1 upd-rep 4096 6 ${UPD_FLAGS:-}
    for n in "${NS[@]}"; do FLATMOE_UPDATE_BLOCKS=$n run1 upd-$n 4096 6 ${UPD_FLAGS:-}; done
    python3 - "$OUT" "${NS[@]}" <<'PY'
import json, sys
out, ns = sys.argv[1], sys.argv[2:]
def steps(name): return [r for r in map(json.loads, open(f"{out}/upd-{name}.jsonl")) if r.get("type", "step") == "step"]
ref = [r["loss"] for r in steps(ns[0])]
rep = max(abs(a - b) for a, b in zip(ref, [r["loss"] for r in steps("rep")]))
for n in ns:
    rows = steps(n)
    tail = [r["tokens_per_s"] for r in rows if r["step"] >= 3]
    d = max(abs(a - b) for a, b in zip(ref, [r["loss"] for r in rows]))
    print(f"FLATMOE_UPDATE_BLOCKS={n}: steps 3..{rows[-1]['step']} mean {sum(tail)/len(tail):.0f} tok/s, "
          f"largest loss difference from {ns[0]}'s {d:.2e} (a repeat of {ns[0]}: {rep:.2e})")
PY
    ;;
fp8loss) # issue 14: OLMoE-1B-7B at 4K, 200 steps, --expert-precision bf16 then fp8 (on E4M3 codes on an
    # sm_90 GPU, the weight cache as the planner picks it): both loss curves and each run's step time
    for p in bf16 fp8; do run1 fp8loss-$p 4096 ${STEPS:-200} --expert-precision $p --log-every 20; done
    python3 - "$OUT" <<'PY'
import json, sys
c = {p: [r for r in map(json.loads, open(f"{sys.argv[1]}/fp8loss-{p}.jsonl")) if r.get("type", "step") == "step"]
     for p in ("bf16", "fp8")}
for s in (1, 10, 25, 50, 100, 150, 200):
    row = [next((r["loss"] for r in c[p] if r["step"] == s), None) for p in ("bf16", "fp8")]
    if None not in row: print(f"step {s:4d}: bf16 {row[0]:.4f} fp8 {row[1]:.4f} (fp8 - bf16 {row[1] - row[0]:+.4f})")
for p in ("bf16", "fp8"):
    t = [r["tokens_per_s"] for r in c[p] if r["step"] >= 3]
    print(f"{p}: mean {sum(t) / len(t):.0f} tok/s over steps 3..{c[p][-1]['step']}")
PY
    ;;
fp8codes) # issue 14's FP8 fast path (E4M3 codes, our sm_90 FP8 grouped GEMM): its GPU test (the code
    # ops against the C reference, with timings at OLMoE's shape), the FP8 CLI test, then OLMoE-1B-7B
    # steps at each T (default 4K, 16K): bf16, fp8 on codes without the weight cache, fp8 on codes with
    # the planner's choice of the cache (the default), fp8 emulated (FLATMOE_EXPERT_GEMM=cublas)
    cmake --build build-gpu -j16 --target test_cuda_fp8_codes > "$OUT/fp8codes-build.log" 2>&1 || tail -20 "$OUT/fp8codes-build.log"
    ./build-gpu/test_cuda_fp8_codes > "$OUT/fp8codes-test.log" 2>&1; echo "== test_cuda_fp8_codes exit $?"; tail -25 "$OUT/fp8codes-test.log"
    (cd build-gpu && ctest -R cli_cuda_fp8 --output-on-failure > "$OUT/fp8codes-cli.log" 2>&1; echo "== cli_cuda_fp8 exit $?"; tail -5 "$OUT/fp8codes-cli.log")
    shift; for T in ${*:-4096 16384}; do
        bash "$0" fp8codes-runs $T
        FLATMOE_EXPERT_GEMM=cublas run1 fp8-emu-$T $T ${STEPS:-4} --expert-precision fp8
    done ;;
streamopt) # the streamed AdamW beside checkpoint offload under the overlap (128K, the chooser's knobs,
    # 5 steps): with its own copy streams, steps 3..5 should be as fast as step 2 less the update's
    # non-hidden part (session 7: step 3's dense phase waited 1.8 s behind the optimizer's copies)
    run1 streamopt-131072 131072 ${STEPS:-5} ;;
pack) # every file under $OUT into one $OUT/pack.tgz (the device returns at most 8 files)
    (cd "$OUT" && tar czf /tmp/pack.tgz --exclude=pack.tgz . && rm -rf ./* && mv /tmp/pack.tgz .); ls -la "$OUT" ;;
autogemm) # FLATMOE_EXPERT_GEMM=auto's pick (plan/fm_expert_choice.h) in train: its line, the metrics
    # header's expert_gemm and the backend it created, 3 steps each (T list: ${@:2}, default 4K, 32K)
    shift; for T in ${*:-4096 32768}; do
        FLATMOE_EXPERT_GEMM=auto run1 gemm-auto-$T $T 3; grep "^expert GEMM:" "$OUT/gemm-auto-$T.log"
        head -1 "$OUT/gemm-auto-$T.jsonl" | grep -o '"expert_gemm":{[^}]*}'
        grep -m1 '"type":"step"' "$OUT/gemm-auto-$T.jsonl" | grep -o '"expert_gemm":"[a-z0-9]*"'
    done ;;
next) # session 11's unrun work, the first call of session 12 (~7 min): build, test_cuda_fp8_fused (the fused
    # quantization ops against the unfused ones and the reference, byte for byte, and their timings; memcheck
    # with SAN=1), test_cuda_fp8_codes (every FP8 schedule after the refactor), cli_cuda_fp8 and cli_cuda_zero3
    # (its twin-based tolerance), OLMoE-1B-7B at 4K: bf16 / fp8 without the cache / fp8 with the planner's
    # cache -> pack. Then the second call: bash bench/offload_gpu.sh next2
    bash "$0" build
    timeout 150 ./build-gpu/test_cuda_fp8_fused > "$OUT/fp8fused-test.log" 2>&1; echo "== test_cuda_fp8_fused exit $?"
    grep -E "FAIL|passed|ms|GB/s" "$OUT/fp8fused-test.log" | head -30
    [ -n "${SAN:-}" ] && { FLATMOE_TEST_NO_BENCH=1 timeout 200 compute-sanitizer --tool memcheck ./build-gpu/test_cuda_fp8_fused \
        > "$OUT/fp8fused-memcheck.log" 2>&1; echo "== memcheck exit $?"; tail -3 "$OUT/fp8fused-memcheck.log"; }
    timeout 150 ./build-gpu/test_cuda_fp8_codes > "$OUT/fp8codes-test.log" 2>&1; echo "== test_cuda_fp8_codes exit $?"
    grep -E "FAIL|passed|GB/s|TFLOP/s" "$OUT/fp8codes-test.log" | tail -14
    (cd build-gpu && ctest -R 'cli_cuda_fp8|cli_cuda_zero3' --output-on-failure --timeout 150 > "$OUT/next-cli.log" 2>&1
     echo "== cli_cuda_fp8, cli_cuda_zero3: $?"; grep -E "Test +#|FAIL" "$OUT/next-cli.log" | head)
    STEPS=4 bash "$0" fp8codes-runs 4096
    bash "$0" pack > /dev/null ;;
next2) # session 12's second call (~8 min, the machine warm with next's build): 16K bf16 / fp8 / fp8 with the
    # planner's cache, the calibration with the v5 FP8 GEMM and the fused ops (commit its fp8 curves), the
    # 200-step loss curves at 4K (bf16 against fp8 on codes) -> pack
    STEPS=4 bash "$0" fp8codes-runs 16384
    bash "$0" calib | tail -12
    bash "$0" fp8loss
    bash "$0" pack > /dev/null ;;
fp8codes-runs) shift; for T in ${*:-4096 16384}; do
        run1 fp8-bf16-$T $T ${STEPS:-4}
        run1 fp8-codes-$T $T ${STEPS:-4} --expert-precision fp8 --no-fp8-weight-cache
        grep -o '"expert_fp8_path": *"[a-z]*"' "$OUT/fp8-codes-$T.jsonl" | head -1
        run1 fp8-auto-$T $T ${STEPS:-4} --expert-precision fp8; grep -o '"fp8_weight_cache": *[a-z]*' "$OUT/fp8-auto-$T.jsonl" | head -1
    done ;;
fp8next) # session 10's unrun FP8 work, first call of the next session (~8 min): build, the rewritten
    # quantizers against the C reference byte for byte (corner cases included) and their GB/s, the engine's
    # FP8 GEMM schedules (v3, then FLATMOE_FP8_GEMM's v5 variants: every GEMM check, timings), the FP8 CLI
    # test, then the lab's v5 variants (smoke each alone, then v3/v4/v5* timed at the 512-row cases;
    # GG_CASES overrides) -> pack
    bash "$0" build
    timeout 300 ./build-gpu/test_cuda_fp8_codes > "$OUT/fp8codes-test.log" 2>&1; echo "== test_cuda_fp8_codes exit $?"
    grep -E "FAIL|passed|== schedule|GB/s|TFLOP/s" "$OUT/fp8codes-test.log" | head -40
    [ -n "${SAN:-}" ] && { FLATMOE_TEST_NO_BENCH=1 timeout 400 compute-sanitizer --tool memcheck ./build-gpu/test_cuda_fp8_codes \
        > "$OUT/fp8codes-memcheck.log" 2>&1; echo "== memcheck exit $?"; tail -4 "$OUT/fp8codes-memcheck.log"; }
    (cd build-gpu && ctest -R cli_cuda_fp8 --output-on-failure > "$OUT/fp8codes-cli.log" 2>&1; echo "== cli_cuda_fp8 exit $?")
    GG_CASES=${GG_CASES:-512} timeout 300 bash dev/cuda/grouped_gemm/v5_gpu.sh 2>&1 | tail -45
    bash "$0" pack > /dev/null ;;
s17) # session 17's one call (about 8 minutes): build, every GPU test, Hugging Face parity of the new
    # cases (CPU fp32 and CUDA bf16; the bf16 YaRN/dense cases at seeds 1 and 2: a routing flip moves
    # with the seed, an arithmetic error does not), then issue 25's partial optimizer offload on a
    # device budget of an H100's (--mem-budget 79GiB: the chooser picks F), 4K and 4K x 16
    card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $card"
    bash "$0" build
    (cd build-gpu && FLATMOE_TEST_NO_BENCH=1 timeout ${TEST_S:-240} ctest -L gpu -R "${GPU_TESTS:-.}" --output-on-failure --timeout 150 \
        > "$OUT/ctest-gpu.log" 2>&1; echo "ctest -L gpu: $?")
    grep -E "Test +#|tests passed|FAIL|rows within" "$OUT/ctest-gpu.log" | grep -v " Passed " | head -30
    grep -c " Passed " "$OUT/ctest-gpu.log"
    NEW=${NEW:-deepseek_v3,deepseek_v3_noq,gpt_oss,mixtral_yarn_mscale,olmoe_linear}
    timeout 60 python3 tools/hf_parity.py build-gpu README.md --only "$NEW" > "$OUT/parity-cpu.log" 2>&1
    echo "parity cpu ($NEW): $?"; grep -E "^  [a-z0-9_]+: (loss|[0-9]+ grad|flatmoe ch)|Error" "$OUT/parity-cpu.log" | cut -c1-160
    for s in ${SEEDS:-0 1 2}; do
        only=$NEW,qwen3_moe_yarn,qwen3_moe_dense; [ $s = 0 ] || only=qwen3_moe_yarn,qwen3_moe_dense
        timeout 60 python3 tools/hf_parity.py build-gpu README.md --tol 3e-2 --flatmoe flatmoe-cuda --seed $s --only "$only" \
            > "$OUT/parity-gpu-$s.log" 2>&1
        echo "parity gpu seed $s ($only): $?"; grep -E ": loss transformers|NO$|Error" "$OUT/parity-gpu-$s.log" | cut -c1-150 | head -24
    done
    timeout 100 bash "$0" run f32cap-4096 4096 3 --mem-budget 79GiB
    [ -n "${NO_G16:-}" ] || timeout 110 bash "$0" run f32cap-4096-g16 4096 3 --mem-budget 79GiB --grad-accum 16
    tar -czf /tmp/s17.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/s17.tgz "$OUT"/ ;;
rl) # issue 29's GPU timings (bench/rl_gpu.py): log-probs and a GRPO step on packed batches of OLMoE-1B-7B,
    # libflatmoe-cuda (8 B/param: --master-weights bf16-sr --bf16-moments) against the compiled peer
    shift; Ts=${*:-8192 32768 131072}
    FLATMOE_LIB=build-gpu/libflatmoe-cuda.so PYTHONUNBUFFERED=1 timeout ${RL_S:-240} python3 bench/rl_gpu.py flatmoe \
        configs/olmoe-1b-7b.json $Ts --json "$OUT/rl-flatmoe.jsonl" 2>&1 | grep -vE "^\s*$" | tail -8
    PYTHONUNBUFFERED=1 timeout ${PEER_S:-240} python3 bench/rl_gpu.py peer configs/olmoe-1b-7b.json $Ts --compile \
        --json "$OUT/rl-peer.jsonl" 2>&1 | grep -E "^torch-peer|Error" ;;
fam) # issue 26's side by side: a real config's first LAYERS layers (bench/peer_hf.py --layers alike),
    # flatmoe with the chooser's knobs (plan bound against high-water, 3 steps) and the compiled peer
    # (plain, then checkpointed) at each length: bash bench/offload_gpu.sh fam configs/gpt-oss-20b.json 2 4096 32768
    cfg=$2 layers=$3; shift 3; Ts=${*:-4096 32768}; name=$(basename "$cfg" .json)-L$layers
    python3 - "$cfg" "$layers" "/tmp/$name.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); n = int(sys.argv[2]); d["num_hidden_layers"] = n
if isinstance(d.get("layer_types"), list): d["layer_types"] = d["layer_types"][:n]
json.dump(d, open(sys.argv[3], "w"), indent=1)
PY
    mp=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['max_position_embeddings'])" "$cfg")
    for T in $Ts; do CONFIG=/tmp/$name.json MAXPOS=$mp run1 "$name-$T" "$T" 3; done
    PYTHONUNBUFFERED=1 timeout ${PEER_S:-400} python3 bench/peer_hf.py "$cfg" $Ts --layers "$layers" --steps 3 --compile \
        --json "$OUT/peer-$name.jsonl" 2>&1 | grep -E "^hf-peer|Error" ;;
s19b) # session 19's second call (a warm machine, build-gpu there): issue 26's side by side of gpt-oss-20b's
    # first 2 layers and DeepSeek-V2-Lite's first 4 at 4K and 32K (flatmoe's plan against its high-water,
    # the compiled peer), then packed
    [ -x "$BIN" ] || bash "$0" build
    PEER_S=${PEER_S:-150} timeout 280 bash "$0" fam configs/gpt-oss-20b.json 2 4096 32768
    PEER_S=${PEER_S:-150} timeout 280 bash "$0" fam configs/deepseek-v2-lite.json 4 4096 32768
    bash "$0" pack ;;
s19) # session 19's first call: build, the whole `ctest -L gpu`, Hugging Face parity of the families
    # added since the last GPU run (CPU fp32 and CUDA bf16), then everything packed into $OUT/pack.tgz
    card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $card"
    bash "$0" build
    (cd build-gpu && FLATMOE_TEST_NO_BENCH=1 timeout ${TEST_S:-300} ctest -L gpu --output-on-failure --timeout 150 \
        > "$OUT/ctest-gpu.log" 2>&1; echo "ctest -L gpu: $?")
    grep -E "Test +#|tests passed|FAIL|Not Run" "$OUT/ctest-gpu.log" | grep -v " Passed " | head -50
    grep -c " Passed " "$OUT/ctest-gpu.log"
    if grep -q "tests failed" "$OUT/ctest-gpu.log"; then # the failed ones again on cudaMalloc: VMM's doing or not
        (cd build-gpu && FLATMOE_CUDA_VMM=0 FLATMOE_TEST_NO_BENCH=1 timeout 150 ctest --rerun-failed --output-on-failure \
            --timeout 100 > "$OUT/ctest-novmm.log" 2>&1; echo "rerun with FLATMOE_CUDA_VMM=0: $?")
        grep -E "Test +#|tests passed" "$OUT/ctest-novmm.log" | head -20
    fi
    NEW=${NEW:-deepseek_v2,deepseek_v2_lite,deepseek_v3,deepseek_v3_noq,gpt_oss}
    timeout 80 python3 tools/hf_parity.py build-gpu README.md --only "$NEW" > "$OUT/parity-cpu.log" 2>&1
    echo "parity cpu ($NEW): $?"; grep -E "^  [a-z0-9_]+: (loss|[0-9]+ grad|flatmoe ch)|Error|NO$|PASS|FAIL" "$OUT/parity-cpu.log" | cut -c1-180 | head -30
    timeout 80 python3 tools/hf_parity.py build-gpu README.md --tol 3e-2 --flatmoe flatmoe-cuda --only "$NEW" \
        > "$OUT/parity-gpu.log" 2>&1
    echo "parity gpu ($NEW): $?"; grep -E ": loss transformers|NO$|Error|PASS|FAIL|flip" "$OUT/parity-gpu.log" | cut -c1-180 | head -30
    [ -n "${NO_RL:-}" ] || RL_S=70 PEER_S=90 bash "$0" rl 8192 32768
    bash "$0" pack ;;
s18) # session 18's one call, with 383 s of device time left: each part has its own limit, most
    # wanted first, and writes its log to $OUT as it goes
    card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $card"
    bash "$0" build
    (cd build-gpu && FLATMOE_TEST_NO_BENCH=1 timeout 100 ctest -L gpu --output-on-failure --timeout 90 \
        -R "${GPU_TESTS:-cli_cuda_sp|router_sigmoid|gpt_oss_ops|router_seq_aux}" > "$OUT/ctest-gpu.log" 2>&1
     echo "ctest -L gpu: $?")
    grep -E "Test +#|tests passed|FAIL" "$OUT/ctest-gpu.log" | head -20
    NEW=${NEW:-deepseek_v3,deepseek_v3_noq,gpt_oss}
    timeout 50 python3 tools/hf_parity.py build-gpu README.md --only "$NEW" > "$OUT/parity-cpu.log" 2>&1
    echo "parity cpu ($NEW): $?"; grep -E "^  [a-z0-9_]+: (loss|[0-9]+ grad|flatmoe ch)|Error|NO$" "$OUT/parity-cpu.log" | cut -c1-160 | head -20
    timeout 50 python3 tools/hf_parity.py build-gpu README.md --tol 3e-2 --flatmoe flatmoe-cuda --only "$NEW" \
        > "$OUT/parity-gpu.log" 2>&1
    echo "parity gpu ($NEW): $?"; grep -E ": loss transformers|NO$|Error" "$OUT/parity-gpu.log" | cut -c1-150 | head -20
    timeout 80 bash "$0" run f32cap-4096 4096 3 --mem-budget 79GiB ;;
run) shift; run1 "$@" ;;
*) echo "usage: bash bench/offload_gpu.sh build|test|tok|keepatt|sco|overlap|calib|lengths|finetune|million|long|longest|sm90|autogemm|verify|collect|peer|ours|ranks|lab|updblocks|fp8loss|streamopt|fp8codes|fp8next|next|next2|pack|s17|s18|run"; exit 2 ;;
esac
