#!/usr/bin/env bash
# The main job: set up, train configs/tiny.json (a 1.8M-parameter byte-level MoE, 8 experts
# top-2) on real English text, then sample from it. Text: the files given as arguments, else
# ../shared/data/tinyshakespeare.txt when present, else the ~2.5 MB of Debian's fortunes.
# Extra training flags go in FLATMOE_TRAIN_FLAGS (e.g. "--steps 500").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -gt 0 ]; then text=("$@")
elif [ -f ../shared/data/tinyshakespeare.txt ]; then text=(../shared/data/tinyshakespeare.txt)
else mapfile -t text < <(find /usr/share/games/fortunes -type f ! -name '*.dat' ! -name '*.u8' | sort); fi
out=runs/tiny-$(date +%Y%m%d-%H%M%S)
./build/flatmoe train --config configs/tiny.json --data "${text[@]}" --steps 2000 --seq-len 128 \
    --micro-batch 16 --lr 2e-3 --min-lr 2e-4 --warmup 50 --eval-every 250 --save-every 500 --log-every 50 \
    --out "$out" ${FLATMOE_TRAIN_FLAGS:-}
./build/flatmoe sample --ckpt "$out" --prompt "${FLATMOE_PROMPT:-The }" --max-new-tokens 400 --temperature 0.8
echo
echo "run folder: $out (checkpoints, metrics.jsonl)"
