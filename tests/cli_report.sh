#!/usr/bin/env bash
# `flatmoe report RUN_DIR`: after a tiny train, the report draws every chart as a valid, non-empty
# PNG (and SVG with --format svg) through gnuplot, leaves no temporary file, and fails clearly
# without gnuplot or without a run. Also the records it reads: the header record opens
# metrics.jsonl, each step's expert counts add up to tokens x top-k per layer (the same with the
# layers recomputed and the MoE chunked: a recompute is not counted again), the summary closes it.
source "$(dirname "$0")/lib_cli.sh"
cfg="$ROOT/tests/data/micro.json"
run=(--config "$cfg" --data "$TEXT" --seq-len 32 --micro-batch 4 --grad-accum 2 --steps 6 --warmup 2 --lr 3e-3
     --eval-every 3 --eval-batches 2 --threads 2 --quiet --expert-counts-every 1)
"$FM" train "${run[@]}" --out "$TMP/run" || bad "train failed"
m=$TMP/run/metrics.jsonl
head -1 "$m" | grep -q '^{"type":"header","step":0,"flatmoe_version":"[0-9.]*","git_commit":"[^"]*"' && ok ||
    bad "metrics.jsonl does not start with the header record: $(head -c 200 "$m")"
for k in '"config":{"architectures"' '"flags":{' '"plan":{"bytes":{"model state":' '"host":{"hostname":' '"seed":1337'; do
    head -1 "$m" | grep -qF "$k" && ok || bad "header record lacks $k"
done
tail -1 "$m" | grep -q '^{"type":"summary",.*"final_val_loss":[0-9]' && tail -1 "$m" | grep -q '"high_water":[0-9]' && ok ||
    bad "metrics.jsonl does not end with a summary record with high-water marks: $(tail -1 "$m" | head -c 300)"
# expert counts: micro.json routes each of 2 x 4 x 32 tokens of a step to top-k experts in every layer
k=$(python3 -c "import json; print(json.load(open('$cfg'))['num_experts_per_tok'])")
check_counts() { # FILE NAME
    python3 - "$1" "$((2 * 4 * 32 * k))" <<'PY' && ok || bad "$2: expert counts do not add up"
import json, sys
want = int(sys.argv[2]); n = 0
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("type") != "step": continue
    n += 1
    for layer, mm in zip(r["expert_counts"], r["expert_load_max_mean"]):
        assert sum(layer) == want, (r["step"], layer, want)
        assert abs(max(layer) * len(layer) / sum(layer) - mm) < 1e-3, (layer, mm)
assert n == 6, n
PY
}
check_counts "$m" plain
counts() { grep '"type":"step"' "$1" | grep -o '"expert_counts":[^a-z]*'; }
# full recompute is bit-identical to none: every step's counts must be the same
"$FM" train "${run[@]}" --recompute full --out "$TMP/rc" || bad "recompute run failed"
check_counts "$TMP/rc/metrics.jsonl" "recompute"
[ -n "$(counts "$m")" ] && [ "$(counts "$m")" = "$(counts "$TMP/rc/metrics.jsonl")" ] && ok || bad "recompute changed the expert counts"
# the chunked MoE (recomputed chunk by chunk in backward) with recompute: step 1 routes the same
# weights, so its counts are the same (later steps differ in the last bits of the expert grads)
"$FM" train "${run[@]}" --recompute 0 --moe-chunk-tokens 16 --out "$TMP/ch" || bad "chunked run failed"
check_counts "$TMP/ch/metrics.jsonl" "chunked + recompute"
[ "$(counts "$m" | head -1)" = "$(counts "$TMP/ch/metrics.jsonl" | head -1)" ] && ok || bad "chunking changed step 1's expert counts"

# PNG (the default) into RUN_DIR/report
"$FM" report "$TMP/run" > "$TMP/report.log" && ok || bad "report failed: $(cat "$TMP/report.log")"
for c in loss lr tokens_per_s expert_load memory; do
    f=$TMP/run/report/$c.png
    [ -s "$f" ] && [ "$(head -c 8 "$f" | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ] && ok || bad "$f is not a PNG"
done
ls "$TMP/run/report" | grep -q '\.tmp' && bad "report left temporary files: $(ls "$TMP/run/report")" || ok
# SVG into --out
"$FM" report "$TMP/run" --format svg --out "$TMP/svg" > /dev/null && ok || bad "report --format svg failed"
for c in loss lr tokens_per_s expert_load memory; do
    f=$TMP/svg/$c.svg
    [ -s "$f" ] && head -c 400 "$f" | grep -q '<svg' && tail -c 100 "$f" | grep -q '</svg>' && ok || bad "$f is not an SVG"
done
# errors: no gnuplot, no run, a bad format, an unknown flag
expect_fail "report without gnuplot" "gnuplot not executable at /nonexistent/gnuplot" \
    env FLATMOE_GNUPLOT=/nonexistent/gnuplot "$FM" report "$TMP/run"
expect_fail "report of a folder without metrics" "metrics.jsonl: cannot read it" "$FM" report "$TMP/none"
expect_fail "report --format jpg" "--format must be png or svg" "$FM" report "$TMP/run" --format jpg
expect_fail "report unknown flag" "did you mean --format?" "$FM" report "$TMP/run" --fromat svg
# version and the nearest-flag suggestion
v=$("$FM" --version) && grep -Eq '^flatmoe [0-9]+\.[0-9]+\.[0-9]+ \(commit [^ ]+, (cpu|cuda) build\)$' <<<"$v" && ok || bad "--version: $v"
[ "$("$FM" version)" = "$v" ] && ok || bad "flatmoe version differs from --version"
head -1 "$m" | grep -qF "\"git_commit\":\"$(sed -E 's/.*commit ([^,]*),.*/\1/' <<<"$v")\"" && ok || bad "the header's commit is not --version's"
expect_fail "misspelt flag" "unknown flag '--lerning-rate'; did you mean --lr?" "$FM" train --lerning-rate 1e-3
expect_fail "misspelt flag" "did you mean --micro-batch?" "$FM" train --micro-bach 4
finish
