#!/usr/bin/env bash
# Exact resume: 4 steps, save, resume, 4 more steps gives the same losses, gradient norms and
# final weights, bit for bit, as 8 steps straight. Also with gradient accumulation, recompute
# and the metrics file rewritten after a crash-like stop.
source "$(dirname "$0")/lib_cli.sh"
cfg="$ROOT/tests/data/micro.json"
common=(--config "$cfg" --data "$TEXT" --seq-len 32 --micro-batch 4 --grad-accum 2 --steps 8 --warmup 2
        --lr 3e-3 --eval-every 3 --eval-batches 2 --threads 2 --quiet --expert-counts-every 1)
"$FM" train "${common[@]}" --out "$TMP/straight" || bad "straight run failed"
"$FM" train "${common[@]}" --out "$TMP/split" --exit-after 4 || bad "first half failed"
[ -d "$TMP/split/step_000004" ] && ok || bad "no checkpoint after --exit-after 4"
"$FM" train "${common[@]}" --out "$TMP/split" --resume --recompute full || bad "resumed run failed"
# the step records (not the header and summary records, which name each invocation's flags and
# times); the expert load is compared with the losses: the recomputed forward is not counted twice
fields() { grep '"type":"step"' "$1" | sed -E -e 's/,"backend":\{[^}]*\}//g' -e 's/"(tokens_per_s|step_s|elapsed_s|val_loss|host_syncs)":[^,}]*,?//g'; }
steps_in() { grep -c '"type":"step"' "$1"; }
if diff <(fields "$TMP/straight/metrics.jsonl") <(fields "$TMP/split/metrics.jsonl") >/dev/null; then ok
else bad "metrics differ between straight and resumed runs"; diff <(fields "$TMP/straight/metrics.jsonl") <(fields "$TMP/split/metrics.jsonl") | head >&2; fi
[ "$(steps_in "$TMP/split/metrics.jsonl")" -eq 8 ] && ok || bad "metrics.jsonl should have 8 step records"
[ "$(head -1 "$TMP/split/metrics.jsonl" | grep -c '"type":"header"')" -eq 1 ] && ok || bad "metrics.jsonl does not start with a header record"
[ "$(grep -c '"type":"header"' "$TMP/split/metrics.jsonl")" -eq 2 ] && ok || bad "a resumed run should have a header record per invocation"
[ "$(grep -c '"type":"summary"' "$TMP/split/metrics.jsonl")" -eq 1 ] && [ "$(tail -1 "$TMP/split/metrics.jsonl" | grep -c '"type":"summary"')" -eq 1 ] &&
    ok || bad "a resumed run should end with one summary record (the resume drops the first invocation's)"
for f in model.safetensors optimizer.safetensors; do
    cmp -s "$TMP/straight/step_000008/$f" "$TMP/split/step_000008/$f" && ok || bad "$f differs after resume"
done
# The same with the bounded operators (chunked MoE, linear cross-entropy) in both runs.
bounded=(--moe-chunk-tokens 16 --ce-block-tokens 32 --ce-block-vocab 100)
"$FM" train "${common[@]}" "${bounded[@]}" --out "$TMP/bstraight" || bad "bounded straight run failed"
"$FM" train "${common[@]}" "${bounded[@]}" --out "$TMP/bsplit" --exit-after 4 || bad "bounded first half failed"
"$FM" train "${common[@]}" "${bounded[@]}" --out "$TMP/bsplit" --resume || bad "bounded resumed run failed"
cmp -s "$TMP/bstraight/step_000008/model.safetensors" "$TMP/bsplit/step_000008/model.safetensors" && ok || bad "bounded: weights differ after resume"
if diff <(fields "$TMP/bstraight/metrics.jsonl") <(fields "$TMP/bsplit/metrics.jsonl") >/dev/null; then ok
else bad "bounded: metrics differ between straight and resumed runs"; fi
# bf16 Adam moments: exact resume too (checkpoints hold them widened to fp32, exactly), and they
# are a different run from fp32 moments (the flag is not ignored).
"$FM" train "${common[@]}" --bf16-moments --out "$TMP/hstraight" || bad "bf16-moments straight run failed"
"$FM" train "${common[@]}" --bf16-moments --out "$TMP/hsplit" --exit-after 4 || bad "bf16-moments first half failed"
"$FM" train "${common[@]}" --bf16-moments --out "$TMP/hsplit" --resume || bad "bf16-moments resumed run failed"
for f in model.safetensors optimizer.safetensors; do
    cmp -s "$TMP/hstraight/step_000008/$f" "$TMP/hsplit/step_000008/$f" && ok || bad "bf16 moments: $f differs after resume"
done
if diff <(fields "$TMP/hstraight/metrics.jsonl") <(fields "$TMP/hsplit/metrics.jsonl") >/dev/null; then ok
else bad "bf16 moments: metrics differ between straight and resumed runs"; fi
cmp -s "$TMP/straight/step_000008/model.safetensors" "$TMP/hstraight/step_000008/model.safetensors" &&
    bad "bf16 moments gave the fp32-moment run's weights" || ok
# state.json records the moments' dtype; resuming with the other one warns
grep -Eq '"adam_moments":[[:space:]]*"bf16"' "$TMP/hsplit/step_000008/state.json" && ok || bad "state.json lacks adam_moments bf16"
# (the run spec in state.json restores --bf16-moments on a resume that does not give it; an older
# state.json without "spec" resumes with the flags given, so without it: fp32 moments, warned)
"$FM" train "${common[@]}" --bf16-moments --out "$TMP/hswitch" --exit-after 4 || bad "bf16-moments switch run failed"
cp -r "$TMP/hswitch" "$TMP/hkeep"
w=$("$FM" train "${common[@]}" --out "$TMP/hkeep" --resume 2>&1 >/dev/null)
grep -q "checkpoint was trained with" <<<"$w" && bad "a resume without --bf16-moments did not keep the run's bf16 moments: $w" || ok
cmp -s "$TMP/hsplit/step_000008/model.safetensors" "$TMP/hkeep/step_000008/model.safetensors" && ok ||
    bad "a resume without --bf16-moments: the weights differ from the bf16-moment run's"
python3 - "$TMP/hswitch/step_000004/state.json" <<'PY'
import json, sys
p = sys.argv[1]; s = json.load(open(p)); del s["spec"]; json.dump(s, open(p, "w"), indent=1)
PY
w=$("$FM" train "${common[@]}" --out "$TMP/hswitch" --resume 2>&1 >/dev/null)
grep -q "checkpoint was trained with --bf16-moments" <<<"$w" && ok || bad "no warning when resuming a bf16-moment run (no spec) with fp32 moments: $w"
# --resume without --steps continues to the run's own total (state.json's steps), not the default
nosteps=(--config "$cfg" --data "$TEXT" --seq-len 32 --micro-batch 4 --warmup 2 --lr 3e-3 --eval-every 0
         --eval-batches 1 --threads 2 --quiet)
"$FM" train "${nosteps[@]}" --steps 6 --exit-after 3 --out "$TMP/nosteps" || bad "nosteps first half failed"
"$FM" train "${nosteps[@]}" --out "$TMP/nosteps" --resume || bad "nosteps resume failed"
[ -d "$TMP/nosteps/step_000006" ] && [ "$(steps_in "$TMP/nosteps/metrics.jsonl")" -eq 6 ] && ok ||
    bad "--resume without --steps did not stop at the run's 6 steps: $(ls "$TMP/nosteps")"
# --resume without the shape flags continues with the run's shape (state.json), not the defaults:
# the same metrics and weights as the straight run
shapeless=(--data "$TEXT" --warmup 2 --lr 3e-3 --eval-every 3 --eval-batches 2 --threads 2 --quiet --expert-counts-every 1)
"$FM" train "${common[@]}" --out "$TMP/shape" --exit-after 4 || bad "shape first half failed"
o=$("$FM" train "${shapeless[@]}" --out "$TMP/shape" --resume 2>&1) || bad "resume without shape flags failed: $o"
grep -q "warning" <<<"$o" && bad "resume without shape flags warned: $o" || ok
if diff <(fields "$TMP/straight/metrics.jsonl") <(fields "$TMP/shape/metrics.jsonl") >/dev/null &&
   cmp -s "$TMP/straight/step_000008/model.safetensors" "$TMP/shape/step_000008/model.safetensors"; then ok
else bad "resume without shape flags did not continue the run's shape"; fi
# --resume past the run's end trains nothing and says so
o=$("$FM" train "${shapeless[@]}" --out "$TMP/shape" --resume --steps 4 2>&1)
grep -q "nothing to train" <<<"$o" && ok || bad "resume past the end did not say so: $o"
# A damaged newest checkpoint is not skipped silently: --resume refuses, naming it and the file.
cp -r "$TMP/split" "$TMP/damaged"; rm "$TMP/damaged/step_000008/state.json"
expect_fail "resume past an incomplete checkpoint" "step_000008 is an incomplete checkpoint (no state.json)" \
    "$FM" train "${common[@]}" --out "$TMP/damaged" --resume --steps 10
[ -f "$TMP/damaged/step_000008/model.safetensors" ] && ok || bad "the damaged checkpoint was touched"
# Starting over an existing run without --resume is refused (nothing is overwritten).
expect_fail "existing run without --resume" "already holds checkpoints" "$FM" train "${common[@]}" --out "$TMP/split"
# A stop after step 6 without a checkpoint: resume from step 4 rewrites metrics lines 5..6.
"$FM" train "${common[@]}" --out "$TMP/crash" --save-every 4 --exit-after 4 || bad "crash run part 1"
head -4 "$TMP/crash/metrics.jsonl" > "$TMP/m4"; echo '{"step":5,"loss":99}' >> "$TMP/crash/metrics.jsonl"
"$FM" train "${common[@]}" --out "$TMP/crash" --resume || bad "crash resume"
if diff <(fields "$TMP/straight/metrics.jsonl") <(fields "$TMP/crash/metrics.jsonl") >/dev/null; then ok
else bad "metrics after a crash and resume differ from the straight run"; fi
# Checkpoint offload (--offload-boundaries) changes no bit: a straight run with every boundary
# offloaded matches the plain straight run, and a run split with offload 1 then offload all plus
# recompute matches it too (exact resume across the flag).
"$FM" train "${common[@]}" --offload-boundaries all --report-memory --out "$TMP/ostraight" || bad "offload straight run failed"
cmp -s "$TMP/straight/step_000008/model.safetensors" "$TMP/ostraight/step_000008/model.safetensors" && ok || bad "offload all: weights differ from no offload"
grep -q '"host_pinned":{"bound":' "$TMP/ostraight/metrics.jsonl" && ok || bad "offload: no host_pinned record with --report-memory"
mfields() { fields "$1" | sed -E -e 's/,"memory":.*//' -e 's/,?\}?$//'; }
if diff <(mfields "$TMP/straight/metrics.jsonl") <(mfields "$TMP/ostraight/metrics.jsonl") >/dev/null; then ok
else bad "offload all: metrics differ from no offload"; diff <(mfields "$TMP/straight/metrics.jsonl") <(mfields "$TMP/ostraight/metrics.jsonl") | head >&2; fi
"$FM" train "${common[@]}" --offload-boundaries 1 --out "$TMP/osplit" --exit-after 4 || bad "offload first half failed"
"$FM" train "${common[@]}" --offload-boundaries all --recompute 1 --out "$TMP/osplit" --resume || bad "offload resumed run failed"
for f in model.safetensors optimizer.safetensors; do
    cmp -s "$TMP/straight/step_000008/$f" "$TMP/osplit/step_000008/$f" && ok || bad "offload: $f differs after resume"
done
if diff <(fields "$TMP/straight/metrics.jsonl") <(fields "$TMP/osplit/metrics.jsonl") >/dev/null; then ok
else bad "offload: metrics differ between straight and resumed runs"; fi
# The streamed AdamW (--offload-optimizer: master, m, v in host memory, streamed in buckets)
# changes no bit on the CPU: a straight run matches the plain one, and runs that switch it on or
# off at the resume match the straight run (the checkpoint format is the same).
offopt=(--offload-optimizer --offload-optimizer-bucket 1000 --offload-optimizer-slots 3)
"$FM" train "${common[@]}" "${offopt[@]}" --report-memory --out "$TMP/zstraight" || bad "offload-optimizer straight run failed"
for f in model.safetensors optimizer.safetensors; do
    cmp -s "$TMP/straight/step_000008/$f" "$TMP/zstraight/step_000008/$f" && ok || bad "offload-optimizer: $f differs from AdamW"
done
if diff <(mfields "$TMP/straight/metrics.jsonl") <(mfields "$TMP/zstraight/metrics.jsonl") >/dev/null; then ok
else bad "offload-optimizer: metrics differ from AdamW"; diff <(mfields "$TMP/straight/metrics.jsonl") <(mfields "$TMP/zstraight/metrics.jsonl") | head >&2; fi
grep -q '"host_pinned":{"bound":' "$TMP/zstraight/metrics.jsonl" && ok || bad "offload-optimizer: no host_pinned record"
"$FM" train "${common[@]}" "${offopt[@]}" --out "$TMP/zon" --exit-after 4 || bad "offload-optimizer first half failed"
"$FM" train "${common[@]}" --out "$TMP/zon" --resume || bad "resume without --offload-optimizer failed"
"$FM" train "${common[@]}" --out "$TMP/zoff" --exit-after 4 || bad "plain first half failed"
"$FM" train "${common[@]}" --offload-optimizer --offload-optimizer-slots 1 --out "$TMP/zoff" --resume ||
    bad "resume with --offload-optimizer failed"
for d in zon zoff; do
    for f in model.safetensors optimizer.safetensors; do
        cmp -s "$TMP/straight/step_000008/$f" "$TMP/$d/step_000008/$f" && ok || bad "offload-optimizer switch ($d): $f differs"
    done
    if diff <(fields "$TMP/straight/metrics.jsonl") <(fields "$TMP/$d/metrics.jsonl") >/dev/null; then ok
    else bad "offload-optimizer switch ($d): metrics differ from the straight run"; fi
done
# with bf16 moments (bf16 m, v on the host): the same as the bf16-moment AdamW run
"$FM" train "${common[@]}" --bf16-moments "${offopt[@]}" --out "$TMP/zh" --exit-after 4 || bad "offload bf16 first half failed"
"$FM" train "${common[@]}" --bf16-moments "${offopt[@]}" --out "$TMP/zh" --resume || bad "offload bf16 resume failed"
for f in model.safetensors optimizer.safetensors; do
    cmp -s "$TMP/hstraight/step_000008/$f" "$TMP/zh/step_000008/$f" && ok || bad "offload-optimizer bf16: $f differs"
done
# Keep-attention recompute changes no bit either: a straight run with every layer recomputed
# keeping its attention matches the plain straight run, and a run split with it (first half
# plain, second half keep-attention on layer 1) matches too; the plan line names the policy.
"$FM" train "${common[@]}" --recompute full --recompute-keep-attention --out "$TMP/kstraight" > "$TMP/kstraight.log" || bad "keep-attention straight run failed"
grep -q '"keep_attention_layers":2,' <("$FM" plan --config "$cfg" --seq-len 32 --micro-batch 4 --recompute full --recompute-keep-attention --json) && ok || bad "keep-attention: plan --json does not count the layers"
for f in model.safetensors optimizer.safetensors; do
    cmp -s "$TMP/straight/step_000008/$f" "$TMP/kstraight/step_000008/$f" && ok || bad "keep-attention: $f differs from no recompute"
done
if diff <(fields "$TMP/straight/metrics.jsonl") <(fields "$TMP/kstraight/metrics.jsonl") >/dev/null; then ok
else bad "keep-attention: metrics differ from no recompute"; fi
"$FM" train "${common[@]}" --recompute full --recompute-keep-attention --out "$TMP/ksplit" --exit-after 4 || bad "keep-attention first half failed"
"$FM" train "${common[@]}" --recompute 1 --recompute-keep-attention --out "$TMP/ksplit" --resume || bad "keep-attention resumed run failed"
for f in model.safetensors optimizer.safetensors; do
    cmp -s "$TMP/straight/step_000008/$f" "$TMP/ksplit/step_000008/$f" && ok || bad "keep-attention: $f differs after resume"
done
if diff <(fields "$TMP/straight/metrics.jsonl") <(fields "$TMP/ksplit/metrics.jsonl") >/dev/null; then ok
else bad "keep-attention: metrics differ between straight and resumed runs"; fi
# the thread count: state.json records it; --resume without --threads keeps it (the CPU's sums
# depend on it), and another --threads is warned about
nt=(--config "$cfg" --data "$TEXT" --seq-len 32 --micro-batch 4 --steps 4 --warmup 1 --eval-every 0 --eval-batches 1)
"$FM" train "${nt[@]}" --quiet --threads 2 --out "$TMP/th_straight" || bad "threads: straight run failed"
"$FM" train "${nt[@]}" --quiet --threads 2 --exit-after 2 --out "$TMP/th_split" || bad "threads: first half failed"
grep -qE '"threads":[[:space:]]*2' "$TMP/th_split/step_000002/state.json" && ok || bad "threads: state.json lacks the thread count"
out=$(OMP_NUM_THREADS= "$FM" train "${nt[@]}" --resume --out "$TMP/th_split" 2>&1) || bad "threads: resume failed"
grep -q -- "--threads 2 (the run's" <<<"$out" && ok || bad "threads: --resume without --threads did not keep the run's count"
cmp -s "$TMP/th_straight/step_000004/model.safetensors" "$TMP/th_split/step_000004/model.safetensors" && ok ||
    bad "threads: resumed at the run's thread count, the weights differ from the straight run"
w=$("$FM" train "${nt[@]}" --quiet --steps 6 --threads 1 --resume --out "$TMP/th_split" 2>&1 >/dev/null)
grep -q "will not match an uninterrupted one" <<<"$w" && ok || bad "threads: no warning for another --threads: $w"
# the learning-rate schedule: a resume given only --data and --out keeps the run's --lr, --min-lr
# and --warmup (state.json "schedule"), so it ends with the straight run's weights
sc=(--config "$cfg" --data "$TEXT" --seq-len 32 --micro-batch 4 --steps 6 --lr 3e-3 --min-lr 1e-4 --warmup 2
    --eval-every 0 --eval-batches 1 --threads 1)
"$FM" train "${sc[@]}" --quiet --out "$TMP/sc_straight" || bad "schedule: straight run failed"
"$FM" train "${sc[@]}" --quiet --exit-after 3 --out "$TMP/sc_split" || bad "schedule: first half failed"
out=$("$FM" train --data "$TEXT" --resume --out "$TMP/sc_split" 2>&1) || bad "schedule: resume failed: $out"
grep -q -- "--resume: --lr 0.003 --min-lr 0.0001 --warmup 2" <<<"$out" && ok || bad "schedule: no --resume line for it: $out"
cmp -s "$TMP/sc_straight/step_000006/model.safetensors" "$TMP/sc_split/step_000006/model.safetensors" && ok ||
    bad "schedule: resumed without the schedule's flags, the weights differ from the straight run"
# The run spec (state.json "spec"): `train --out DIR --resume` alone continues a run with every
# flag it was started with (data, evaluation and save cadence included) and ends with the
# straight run's weights and optimizer state; a flag given again overrides the run's value with a
# line saying so and takes effect; a bad value in the spec is refused naming the file, the field,
# the value and the fix.
cad=(--config "$cfg" --data "$TEXT" --seq-len 32 --micro-batch 4 --grad-accum 2 --steps 8 --warmup 2 --lr 3e-3
     --eval-every 2 --eval-batches 1 --save-every 2 --threads 2 --quiet --expert-counts-every 1)
"$FM" train "${cad[@]}" --out "$TMP/cad_straight" || bad "spec: straight run failed"
"$FM" train "${cad[@]}" --out "$TMP/cad" --exit-after 3 || bad "spec: first part failed"
grep -q '"spec"' "$TMP/cad/step_000003/state.json" && grep -q '"eval-every":[[:space:]]*2' "$TMP/cad/step_000003/state.json" &&
    ok || bad "spec: state.json lacks the run spec: $(cat "$TMP/cad/step_000003/state.json")"
cp -r "$TMP/cad" "$TMP/cad_over"
out=$("$FM" train --out "$TMP/cad" --resume 2>&1) || bad "spec: train --out DIR --resume alone failed: $out"
for s in 4 6 8; do [ -d "$TMP/cad/step_00000$s" ] || bad "spec: the restored --save-every 2 did not save step $s: $(ls "$TMP/cad")"; done
[ -d "$TMP/cad/step_000005" ] && bad "spec: a checkpoint at step 5 (--save-every not restored)" || ok
for f in model.safetensors optimizer.safetensors; do
    cmp -s "$TMP/cad_straight/step_000008/$f" "$TMP/cad/step_000008/$f" && ok || bad "spec: $f differs after --out DIR --resume alone"
done
if diff <(fields "$TMP/cad_straight/metrics.jsonl") <(fields "$TMP/cad/metrics.jsonl") >/dev/null; then ok
else bad "spec: step records differ after --out DIR --resume alone"; fi
out=$("$FM" train --out "$TMP/cad_over" --resume --eval-every 1 2>&1) || bad "spec: override resume failed: $out"
grep -q -- "--eval-every 1 overrides the run's 2" <<<"$out" && ok || bad "spec: no override line: $out"
# --quiet hides step lines only; a fixed flag given again is said, and --seed given again is not used
cp -r "$TMP/cad_straight" "$TMP/cad_fixed"
out=$("$FM" train --out "$TMP/cad_fixed" --resume --steps 9 --seed 99 --quiet 2>&1) || bad "spec: fixed-flag resume failed: $out"
grep -q -- "--steps 9 overrides the run's 8" <<<"$out" && ok || bad "spec: --quiet hid the override line: $out"
grep -q -- "note: --seed 99 is not used on --resume" <<<"$out" && ok || bad "spec: no note for --seed given again: $out"
python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); sys.exit(0 if s.get("spec",{}).get("seed") in (None,"1337",1337) and s["seed"]=="1337" else 1)' \
    "$TMP/cad_fixed/step_000009/state.json" && ok || bad "spec: --seed 99 given again reached state.json"
vals=$(grep '"type":"step"' "$TMP/cad_over/metrics.jsonl" | tail -5 | grep -c '"val_loss":[0-9]')
[ "$vals" -eq 5 ] && ok || bad "spec: --eval-every 1 given again did not evaluate every step ($vals of the last 5)"
grep -q '"eval-every":[[:space:]]*1' "$TMP/cad_over/step_000008/state.json" && ok || bad "spec: the override is not in the next state.json"
cp -r "$TMP/cad_straight" "$TMP/cad_bad"
sed -i 's/"eval-every":[[:space:]]*2/"eval-every": "often"/' "$TMP/cad_bad/step_000008/state.json"
expect_fail "spec: a bad value in state.json" "step_000008/state.json: \"spec\" field \"eval-every\" has the value 'often', which --eval-every does not take" \
    "$FM" train --out "$TMP/cad_bad" --resume --steps 9
finish
