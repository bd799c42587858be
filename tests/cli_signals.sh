#!/usr/bin/env bash
# SIGTERM / SIGINT during `train`: the step in flight finishes, a checkpoint of it is written, the
# summary record closes metrics.jsonl, a message says what happened, and the exit status is
# 128 + the signal (143, 130); --resume then continues exactly: the same weights, optimizer state
# and step records as a run never interrupted. A second signal ends the process at once.
source "$(dirname "$0")/lib_cli.sh"
cfg="$ROOT/tests/data/micro.json"
common=(--config "$cfg" --data "$TEXT" --seq-len 32 --micro-batch 4 --grad-accum 2 --steps 400 --warmup 2
        --lr 3e-3 --eval-every 0 --eval-batches 2 --threads 2 --quiet --expert-counts-every 1)
fields() { grep '"type":"step"' "$1" | sed -E -e 's/,"backend":\{[^}]*\}//g' -e 's/"(tokens_per_s|step_s|elapsed_s|val_loss|host_syncs)":[^,}]*,?//g'; }
# wait_steps FILE N: until FILE holds N step records (at most 120 s)
wait_steps() {
    local n
    for _ in $(seq 1200); do n=$(grep -c '"type":"step"' "$1" 2>/dev/null); [ "${n:-0}" -ge "$2" ] && return 0; sleep 0.1; done
    return 1
}

# stop SIGNAL NAME: start a run, signal it after 3 steps, check the stop
stop() {
    local sig=$1 dir=$TMP/$2 want=$3
    "$FM" train "${common[@]}" --out "$dir" > "$dir.out" 2> "$dir.err" &
    local pid=$!
    wait_steps "$dir/metrics.jsonl" 3 || bad "$2: the run made no progress"
    kill -"$sig" $pid
    wait $pid; local rc=$?
    [ $rc -eq "$want" ] && ok || bad "$2: exit $rc after SIG$sig, expected $want: $(cat "$dir.err")"
    local n; n=$(grep -c '"type":"step"' "$dir/metrics.jsonl")
    [ "$n" -ge 3 ] && [ "$n" -lt 400 ] && ok || bad "$2: $n steps recorded"
    local ck; ck=$(printf "%s/step_%06d" "$dir" "$n")
    [ -f "$ck/model.safetensors" ] && [ -f "$ck/state.json" ] && ok || bad "$2: no checkpoint of the last step $n: $(ls "$dir")"
    grep -q "SIG$sig received: finished step $n, saved $ck; continue with --resume" "$dir.err" && ok ||
        bad "$2: message: $(cat "$dir.err")"
    tail -1 "$dir/metrics.jsonl" | grep -q "\"type\":\"summary\".*\"stopped_by\":\"SIG$sig\"" && ok ||
        bad "$2: no summary record naming SIG$sig: $(tail -1 "$dir/metrics.jsonl" | head -c 300)"
    ls "$dir" | grep -q tmp && bad "$2: a temporary file was left: $(ls "$dir")" || ok
    echo "ok  $2: stopped after step $n with exit $rc"
    STOPPED_AT=$n
}
stop TERM term 143
# resume for 3 more steps and compare with a straight run stopped at the same step (the same
# --steps: the learning-rate schedule depends on it)
total=$((STOPPED_AT + 3))
"$FM" train "${common[@]}" --exit-after 3 --out "$TMP/term" --resume || bad "resume after SIGTERM failed"
"$FM" train "${common[@]}" --exit-after $total --out "$TMP/straight" || bad "straight run failed"
ck=$(printf "step_%06d" $total)
for f in model.safetensors optimizer.safetensors; do
    cmp -s "$TMP/straight/$ck/$f" "$TMP/term/$ck/$f" && ok || bad "$f differs between the resumed and the straight run"
done
if diff <(fields "$TMP/straight/metrics.jsonl") <(fields "$TMP/term/metrics.jsonl") >/dev/null; then ok
else bad "step records differ after the SIGTERM resume"; diff <(fields "$TMP/straight/metrics.jsonl") <(fields "$TMP/term/metrics.jsonl") | head -4 >&2; fi
stop INT int 130
# The printed "continue with --resume" works as printed: `train --out DIR --resume` alone (no
# --config, --data or other flag) continues the run from its state.json's run spec, and its final
# weights and optimizer state are those of a run never interrupted, byte for byte.
"$FM" train --out "$TMP/int" --resume > "$TMP/int2.out" 2>&1 || bad "train --out DIR --resume alone after SIGINT failed: $(tail -3 "$TMP/int2.out")"
"$FM" train "${common[@]}" --out "$TMP/straight400" || bad "straight 400-step run failed"
for f in model.safetensors optimizer.safetensors; do
    cmp -s "$TMP/straight400/step_000400/$f" "$TMP/int/step_000400/$f" && ok ||
        bad "$f differs between 'train --out DIR --resume' after SIGINT and the straight run"
done

# A second signal while the first waits for the step in flight ends the process at once: no
# summary record, no checkpoint of that step. The steps here take about a second (2 x 16 x 256
# tokens of tiny.json on 2 cores), the signals come 0.1 s apart.
"$FM" train --config "$ROOT/configs/tiny.json" --data "$TEXT" --seq-len 256 --micro-batch 16 --grad-accum 2 \
    --steps 100 --eval-every 0 --threads 2 --quiet --out "$TMP/twice" > /dev/null 2> "$TMP/twice.err" &
pid=$!
wait_steps "$TMP/twice/metrics.jsonl" 1 || bad "twice: the run made no progress"
kill -TERM $pid; sleep 0.1; kill -TERM $pid
wait $pid; rc=$?
[ $rc -eq 143 ] && ok || bad "two SIGTERMs: exit $rc, expected 143"
grep -q '"type":"summary"' "$TMP/twice/metrics.jsonl" && bad "two SIGTERMs: the run still finished its step and wrote a summary" || ok
ls "$TMP/twice" | grep -q '^step_' && bad "two SIGTERMs: a checkpoint was written: $(ls "$TMP/twice")" || ok
finish
