#!/usr/bin/env bash
# "Same results" check of the engine-core v2 refactor (issue 9): 20 training steps of
# configs/tiny.json and of one small config per model_type (fixed seed, fixed threads), plain and
# with the bounded operators, printing each run's loss sequence (as exact %.17g) and the sha256
# of its final model.safetensors and optimizer.safetensors. Run it on two commits and diff.
#   bench/same_results.sh FLATMOE_BIN [TEXT] > out.txt
set -euo pipefail
BIN=$(readlink -f "$1"); cd "$(dirname "$0")/.."
TEXT=${2:-../shared/data/tinyshakespeare.txt}
[ -f "$TEXT" ] || TEXT=tests/data/$(ls tests/data | grep -m1 '\.txt$')
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
run() { # name config extra-flags...
    local name=$1 cfg=$2; shift 2
    "$BIN" train --config "$cfg" --data "$TEXT" --steps 20 --seq-len 64 --micro-batch 4 --grad-accum 2 \
        --warmup 5 --seed 1234 --threads 2 --eval-every 10 --eval-batches 2 --quiet --out "$tmp/$name" "$@" >/dev/null
    echo "== $name $*"
    python3 - "$tmp/$name/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "loss" in r: print(r["step"], repr(r["loss"]), repr(r.get("grad_norm")), repr(r.get("val_loss")))
PY
    local ck; ck=$(ls -d "$tmp/$name"/step_* | tail -1)
    (cd "$ck" && sha256sum model.safetensors optimizer.safetensors)
}
for cfg in configs/tiny.json bench/configs/small-olmoe.json bench/configs/small-mixtral.json; do
    n=$(basename "$cfg" .json)
    run "$n-plain" "$cfg" --recompute none --moe-chunk-tokens 0 --ce-block-tokens 0 --ce-block-vocab 0
    run "$n-bounded" "$cfg" --recompute 0,2 --moe-chunk-tokens 48 --ce-block-tokens 96 --ce-block-vocab 64
done
run tiny-bf16m configs/tiny.json --bf16-moments
