#!/usr/bin/env bash
# FLATMOE_TEST_FORCE_ROUTE (the router's test hook, fm_router.h; the backend op router_force) on
# one CPU rank, read back from the step records' expert_counts (tests/data/micro.json: E = 4, top-2):
#   FIRST: every token's top-2 is FIRST, FIRST+1 (mod E): 3 -> experts 3 and 0, nothing else;
#     FIRST = 4 is FIRST = 0 (mod E): the same losses bit for bit;
#   FIRST:PCT: PCT% of each router call's tokens forced (spread evenly), the rest routed as usual:
#     1:50 gives experts 1 and 2 at least half of the routes each and the others some; 1:0 is the
#     router's own choice (the losses of a run without the variable, bit for bit);
#   malformed values (x, 1:101, 1:, -2, 2:50x) are refused with a message naming the variable.
source "$(dirname "$0")/lib_cli.sh"
cfg="$ROOT/tests/data/micro.json"
common=(--config "$cfg" --data "$TEXT" --seq-len 32 --micro-batch 2 --steps 3 --warmup 1 --eval-every 0
        --threads 1 --quiet --no-checkpoint --expert-counts-every 1)
run() { # NAME VALUE ("" = unset)
    if [ -n "$2" ]; then FLATMOE_TEST_FORCE_ROUTE=$2 "$FM" train "${common[@]}" --out "$TMP/$1" >/dev/null 2>"$TMP/$1.err"
    else (unset FLATMOE_TEST_FORCE_ROUTE; "$FM" train "${common[@]}" --out "$TMP/$1" >/dev/null 2>"$TMP/$1.err"); fi ||
        bad "$1 ($2): train failed: $(cat "$TMP/$1.err")"
}
# counts NAME: every step's per-expert routes summed over layers and steps, as "c0 c1 c2 c3"
counts() {
    python3 - "$TMP/$1/metrics.jsonl" <<'PY'
import json, sys
tot = None
for l in open(sys.argv[1]):
    r = json.loads(l)
    if r.get("type", "step") != "step" or "expert_counts" not in r: continue
    for layer in r["expert_counts"]:
        tot = list(layer) if tot is None else [a + b for a, b in zip(tot, layer)]
print(" ".join(map(str, tot or [])))
PY
}
losses() { grep -o '"loss":[^,]*' "$TMP/$1/metrics.jsonl" | tr '\n' ' '; }
run plain ""; run f3 3; run f0 0; run f4 4; run half 1:50; run none 1:0
routes=$((2 * 32 * 3 * 2 * 2)) # tokens per step x steps x layers x k = 2 routes per token
read -r c0 c1 c2 c3 <<<"$(counts f3)"
[ "$c1" = 0 ] && [ "$c2" = 0 ] && [ "$c0" = $((routes / 2)) ] && [ "$c3" = $((routes / 2)) ] && ok ||
    bad "FLATMOE_TEST_FORCE_ROUTE=3: routes per expert $c0 $c1 $c2 $c3, expected $((routes / 2)) 0 0 $((routes / 2))"
[ "$(losses f0)" = "$(losses f4)" ] && ok || bad "FIRST 4 and 0 differ (mod E): $(losses f0) vs $(losses f4)"
[ "$(losses f0)" != "$(losses plain)" ] && ok || bad "FIRST 0 gave the unforced run's losses"
read -r c0 c1 c2 c3 <<<"$(counts half)"
[ "$c1" -ge $((routes / 4)) ] && [ "$c2" -ge $((routes / 4)) ] && [ $((c0 + c3)) -gt 0 ] &&
    [ $((c0 + c1 + c2 + c3)) = $routes ] && ok ||
    bad "FLATMOE_TEST_FORCE_ROUTE=1:50: routes per expert $c0 $c1 $c2 $c3 (want >= $((routes / 4)) for 1 and 2, some for 0 and 3)"
[ "$(losses none)" = "$(losses plain)" ] && ok || bad "1:0 changed the losses: $(losses none) vs $(losses plain)"
for v in x 1:101 1: -2 2:50x; do
    expect_fail "FLATMOE_TEST_FORCE_ROUTE=$v" "FLATMOE_TEST_FORCE_ROUTE" env FLATMOE_TEST_FORCE_ROUTE="$v" \
        "$FM" train "${common[@]}" --out "$TMP/bad"
done
finish
