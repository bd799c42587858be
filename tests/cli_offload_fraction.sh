#!/usr/bin/env bash
# --optimizer-offload-fraction F (train/fm_offload_adamw.h): the last ceil(F x buckets) buckets of
# the streamed AdamW stream, the first keep their state on the device and are updated there by the
# same op. On the CPU: 8 steps with F = 0.5, F = 1 and no offload give the same checkpoints and
# step records bit for bit; F may change on resume (0.5, then 0.25) with the same bits; the plan's
# bounds (model state, pinned host) equal the measured high-water marks for F = 0.5 and follow F;
# the chooser's pick under a budget between the all-streamed and the all-resident plans is the
# fewest streamed buckets that fit (strictly between 0 and 1), and OLMoE-1B-7B at 4K on an 80 GB
# card streams part of its state; bad values are refused.
source "$(dirname "$0")/lib_cli.sh"
cfg="$ROOT/tests/data/micro.json"
common=(--config "$cfg" --data "$TEXT" --seq-len 32 --micro-batch 4 --grad-accum 2 --steps 8 --warmup 2
        --lr 3e-3 --eval-every 3 --eval-batches 2 --threads 2 --quiet --expert-counts-every 1)
off=(--offload-optimizer --offload-optimizer-bucket 1000 --offload-optimizer-slots 2)
fields() { grep '"type":"step"' "$1" | sed -E -e 's/,"backend":\{[^}]*\}//g' -e 's/"(tokens_per_s|step_s|elapsed_s|val_loss|host_syncs)":[^,}]*,?//g' -e 's/,"memory":.*//' -e 's/,?\}?$//'; }
same_run() { # same_run NAME DIR: DIR's step-8 checkpoint and step records are the plain run's
    for f in model.safetensors optimizer.safetensors; do
        cmp -s "$TMP/plain/step_000008/$f" "$2/step_000008/$f" && ok || bad "$1: $f differs from the plain AdamW run"
    done
    if diff <(fields "$TMP/plain/metrics.jsonl") <(fields "$2/metrics.jsonl") >/dev/null; then ok
    else bad "$1: step records differ from the plain AdamW run"; diff <(fields "$TMP/plain/metrics.jsonl") <(fields "$2/metrics.jsonl") | head >&2; fi
}
"$FM" train "${common[@]}" --out "$TMP/plain" || bad "plain run failed"
"$FM" train "${common[@]}" "${off[@]}" --out "$TMP/f1" || bad "F = 1 run failed"
# (F = 0.5 saves at steps 3 and 6 too: the resident master is copied back for the save and in again
# for the next step within the run)
"$FM" train "${common[@]}" "${off[@]}" --optimizer-offload-fraction 0.5 --report-memory --save-every 3 --out "$TMP/f05" ||
    bad "F = 0.5 run failed"
same_run "F = 1" "$TMP/f1"
same_run "F = 0.5" "$TMP/f05"
# the split ran: half of the buckets resident (header's plan record), not a run that ignored F
grep -q '"optimizer_offload":{"fraction":0.5,"buckets":[0-9]*,"streamed_buckets":[0-9]*,"resident_params":[1-9]' \
    "$TMP/f05/metrics.jsonl" && ok || bad "F = 0.5: the header's plan has no resident part: $(head -1 "$TMP/f05/metrics.jsonl" | grep -o '"optimizer_offload":{[^}]*}')"
# F changes on resume (it changes no numerics): 0.5 for 4 steps, then 0.25, and the bf16 moments too
"$FM" train "${common[@]}" "${off[@]}" --optimizer-offload-fraction 0.5 --out "$TMP/r" --exit-after 4 || bad "F resume: first half failed"
"$FM" train "${common[@]}" "${off[@]}" --optimizer-offload-fraction 0.25 --out "$TMP/r" --resume || bad "F resume: second half failed"
same_run "F 0.5 then 0.25 on resume" "$TMP/r"

# bounds = the measured high-water marks for F = 0.5 (the summary's memory record: every arena's)
python3 - "$TMP/f05/metrics.jsonl" <<'EOF' && ok || bad "F = 0.5: a bound is not its high-water mark"
import json, sys
s = [json.loads(l) for l in open(sys.argv[1]) if '"type":"summary"' in l][-1]["memory"]
for k in ("model state", "host (pinned)"):
    b, h = s[k]["bound"], s[k]["high_water"]
    if b != h: sys.exit(f"{k}: bound {b}, high-water {h}")
EOF
# the plan (json) gives the same bounds as the run, and they follow F: less F, more device, less host
plan() { "$FM" plan --config "$cfg" --seq-len 32 --micro-batch 4 --threads 2 "$@" --json 2>/dev/null; }
python3 - "$TMP/f05/metrics.jsonl" "$(plan "${off[@]}" --optimizer-offload-fraction 0.5)" \
    "$(plan "${off[@]}")" "$(plan "${off[@]}" --optimizer-offload-fraction 0.01)" <<'EOF' && ok || bad "plan's offload fraction bounds"
import json, sys
run = [json.loads(l) for l in open(sys.argv[1]) if '"type":"summary"' in l][-1]["memory"]
half, one, tiny = (json.loads(a) for a in sys.argv[2:5])
assert half["live_sets"]["model state"] == run["model state"]["bound"], (half["live_sets"], run)
assert half["host_pinned_bytes"] == run["host (pinned)"]["bound"]
o = half["optimizer_offload"]
assert o["fraction"] == 0.5 and o["streamed_buckets"] * 2 == o["buckets"] and o["resident_params"] > 0, o
assert one["optimizer_offload"]["fraction"] == 1 and one["optimizer_offload"]["resident_params"] == 0
assert tiny["optimizer_offload"]["streamed_buckets"] == 1
ms = [p["live_sets"]["model state"] for p in (one, half, tiny)]
hb = [p["host_pinned_bytes"] for p in (one, half, tiny)]
assert ms[0] < ms[1] < ms[2] and hb[0] > hb[1] > hb[2], (ms, hb)
# only the streamed part crosses the link (the CPU's table may price the update above the link)
lk = [p["optimizer_offload"]["link_s"] for p in (one, half, tiny)]
st = [p["projected"]["step_s"] for p in (one, half, tiny)]
assert lk[0] > lk[1] > lk[2] and st[0] >= st[1] >= st[2], (lk, st)
EOF

# the chooser: --offload-optimizer given, F free, every other knob fixed, a budget halfway between
# the all-streamed and the fewest-streamed plans: it picks the fewest streamed buckets that fit
fixed=(--offload-optimizer --offload-optimizer-bucket 1000 --recompute none --moe-chunk-tokens 0 --ce-block-tokens 0
       --ce-block-vocab 0 --offload-boundaries 0)
lo=$(plan "${fixed[@]}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["total_bytes"])')
hi=$(plan "${fixed[@]}" --optimizer-offload-fraction 0.01 | python3 -c 'import json,sys; print(json.load(sys.stdin)["total_bytes"])')
budget=$(( (lo + hi) / 2 ))
pick=$(plan "${fixed[@]}" --mem-budget "$budget")
python3 - "$pick" "$budget" <<'EOF' && ok || bad "chooser's offload fraction under budget $budget: $pick"
import json, sys
p, b = json.loads(sys.argv[1]), int(sys.argv[2])
o = p["optimizer_offload"]
assert p["fits"] and p["total_bytes"] <= b and 0 < o["fraction"] < 1, o
assert 1 < o["streamed_buckets"] < o["buckets"], o
EOF
s=$(python3 -c 'import json,sys; o=json.loads(sys.argv[1])["optimizer_offload"]; print(o["streamed_buckets"], o["buckets"])' "$pick")
read -r sb nb <<<"$s"
if [ -n "$sb" ]; then # one bucket fewer streamed does not fit (the pick is the least)
    less=$(plan "${fixed[@]}" --optimizer-offload-fraction "$(python3 -c "print(repr(($sb - 1) / $nb))")")
    python3 -c 'import json,sys; p=json.loads(sys.argv[1]); sys.exit(0 if p["total_bytes"] > int(sys.argv[2]) else 1)' \
        "$less" "$budget" && ok || bad "chooser: $((sb - 1)) of $nb streamed buckets fit $budget too"
fi
# the text plan names F, the streamed and resident parts and the link time, and its train flags carry F
txt=$("$FM" plan --config "$cfg" --seq-len 32 --micro-batch 4 --threads 2 "${fixed[@]}" --mem-budget "$budget" 2>/dev/null)
grep -q "offload fraction .*: the last $sb of $nb buckets stream" <<<"$txt" && ok || bad "plan text lacks the fraction: $txt"
grep -q "train flags: .*--offload-optimizer --optimizer-offload-fraction 0\." <<<"$txt" && ok || bad "train flags lack the fraction"
grep -q "streamed optimizer: host link" <<<"$txt" && ok || bad "plan text lacks the streamed link time"

# OLMoE-1B-7B at 4K with fp32 master weights on an 80 GB card (issue 25): the state (110 GB) does
# not fit beside the weights, so the optimizer streams, but only part of it: 0 < F < 1, fitting
olmoe=$("$FM" plan --config "$ROOT/configs/olmoe-1b-7b.json" --seq-len 4096 --backend cuda --device-mem 80GiB --host-mem-budget 100GiB --json 2>/dev/null)
python3 - "$olmoe" <<'EOF' && ok || bad "OLMoE-1B-7B at 4K on 80 GiB: $(head -c 600 <<<"$olmoe")"
import json, sys
p = json.loads(sys.argv[1])
o = p["optimizer_offload"]
assert p["fits"] and p["offload_optimizer"] and 0 < o["fraction"] < 1 and o["resident_params"] > 0, o
assert 0 < o["link_s"] < p["projected"]["step_s"], (o, p["projected"])
EOF

# bad values: 0, 1.5, not a number, and the fraction without the switch
expect_fail "fraction 0" "--optimizer-offload-fraction must be in (0, 1]" \
    "$FM" train "${common[@]}" "${off[@]}" --optimizer-offload-fraction 0 --out "$TMP/bad"
expect_fail "fraction 1.5" "--optimizer-offload-fraction must be in (0, 1]" \
    "$FM" train "${common[@]}" "${off[@]}" --optimizer-offload-fraction 1.5 --out "$TMP/bad"
expect_fail "fraction x" "'--optimizer-offload-fraction' expects a finite number, found 'x'" \
    "$FM" train "${common[@]}" "${off[@]}" --optimizer-offload-fraction x --out "$TMP/bad"
expect_fail "fraction without the switch" "--optimizer-offload-fraction 0.5 without --offload-optimizer" \
    "$FM" train "${common[@]}" --optimizer-offload-fraction 0.5 --out "$TMP/bad"
expect_fail "plan fraction -1" "--optimizer-offload-fraction must be in (0, 1]" \
    "$FM" plan --config "$cfg" --seq-len 32 --offload-optimizer --optimizer-offload-fraction -1
[ ! -e "$TMP/bad" ] && ok || bad "a refused run wrote its --out folder"
finish
