#!/usr/bin/env bash
# A short training run on real English text: the validation loss must fall well below the
# uniform-byte loss (ln 256 = 5.55) and the starting loss; then sample and eval the checkpoint.
source "$(dirname "$0")/lib_cli.sh"
"$FM" train --config "$ROOT/configs/tiny.json" --data "$TEXT" --steps 80 --seq-len 64 --micro-batch 16 \
    --warmup 10 --lr 3e-3 --eval-every 40 --eval-batches 8 --log-every 20 --threads 2 --out "$TMP/nested/runs/run" | tee "$TMP/log"
mv "$TMP/nested/runs/run" "$TMP/run" # --out creates missing parent folders
first=$(grep -m1 '"type":"step"' "$TMP/run/metrics.jsonl" | sed -E 's/.*"loss":([0-9.e+-]+).*/\1/')
val=$(grep '"type":"step"' "$TMP/run/metrics.jsonl" | tail -1 | sed -E 's/.*"val_loss":([0-9.e+-]+).*/\1/')
echo "first training loss $first, final validation loss $val"
awk -v a="$first" 'BEGIN{exit !(a > 5.0)}' && ok || bad "first loss $first should be near ln 256"
awk -v v="$val" 'BEGIN{exit !(v < 3.0)}' && ok || bad "validation loss $val did not fall below 3.0"
out=$("$FM" sample --ckpt "$TMP/run" --prompt "The " --max-new-tokens 40 --seed 1 --threads 2) && ok || bad "sample failed"
[ "${#out}" -ge 40 ] && ok || bad "sample printed too little: $out"
out2=$("$FM" sample --ckpt "$TMP/run" --prompt "The " --max-new-tokens 40 --seed 1 --threads 2)
[ "$out" = "$out2" ] && ok || bad "sampling with the same seed is not deterministic"
"$FM" eval --ckpt "$TMP/run/step_000080" --data "$TEXT" --max-batches 4 --threads 2 > "$TMP/eval" && ok || bad "eval failed"
grep -q "perplexity" "$TMP/eval" && ok || bad "eval printed no perplexity"
# FLATMOE_PROFILE=1: a per-phase line per step, and phase_ms in metrics.jsonl whose phases add up
# to the step's time (the same interval: from the previous step's end to this one's).
FLATMOE_PROFILE=1 "$FM" train --config "$ROOT/configs/tiny.json" --data "$TEXT" --steps 3 --seq-len 64 --micro-batch 8 \
    --threads 2 --no-checkpoint --out "$TMP/prof" > "$TMP/prof.log" && ok || bad "profiled run failed"
[ "$(grep -c '^profile step' "$TMP/prof.log")" = 3 ] && ok || bad "expected 3 profile lines: $(cat "$TMP/prof.log")"
while read -r line; do
    ph=$(grep -o '"phase_ms":{[^}]*}' <<<"$line")
    step=$(sed -E 's/.*"step_s":([0-9.e+-]+).*/\1/' <<<"$line")
    [ "$(grep -o '"[a-z]*":' <<<"${ph#*\{}" | tr -d '":' | sort | tr '\n' ' ')" = "attention dense dispatch experts loss optimizer other router " ] &&
        ok || bad "phase names: $ph"
    tot=$(grep -o ':[0-9.]*' <<<"${ph#*\{}" | tr -d ':' | awk '{s += $1} END {print s}')
    awk -v t="$tot" -v s="$step" 'BEGIN{d = t - 1e3 * s; if (d < 0) d = -d; exit !(t > 0 && d <= 200 * s + 2)}' &&
        ok || bad "phase_ms adds up to $tot ms, the step took $step s: $ph"
done < <(grep '"type":"step"' "$TMP/prof/metrics.jsonl")
"$FM" train --config "$ROOT/configs/tiny.json" --data "$TEXT" --steps 1 --seq-len 64 --micro-batch 8 --threads 2 \
    --no-checkpoint --out "$TMP/noprof" > "$TMP/noprof.log" && ok || bad "unprofiled run failed"
! grep -q "phase_ms" "$TMP/noprof/metrics.jsonl" && ! grep -q "^profile" "$TMP/noprof.log" && ok ||
    bad "a run without FLATMOE_PROFILE printed a profile"
finish
