#!/usr/bin/env bash
# train --init-from a Hugging Face model folder (olmoe and qwen3_moe; fp32, bf16, fp16; one file or
# sharded with an index; per-expert or fused experts): the loss of step 1 (the loaded weights,
# before any update) equals `eval` of the folder on the same window; a missing tensor, a wrong
# shape and a wrong dtype are refused naming the tensor; an extra tensor is a warning; --config
# next to --init-from is refused; --resume refuses a model.safetensors edited after the checkpoint
# was written (and --resume-trust-optimizer overrides); loss masks: a masked target's token does
# not move the loss, an unmasked one does, in train and eval. The folders are made from flatmoe's
# own checkpoints by tests/fm_hf_fixture.c (built next to flatmoe).
source "$(dirname "$0")/lib_cli.sh"
FX=$(dirname "$FM")/fm_hf_fixture
[ -x "$FX" ] || { echo "fm_hf_fixture not built next to $FM"; exit 1; }
T=32
head -c $((T + 1)) "$TEXT" > "$TMP/one.txt"    # one window: train's only start and eval's only window
cat > "$TMP/qwen3.json" <<'EOF'
{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 32,
 "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
 "num_key_value_heads": 1, "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 64,
 "rope_theta": 10000.0, "rms_norm_eps": 1e-06, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": true,
 "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.01, "tie_word_embeddings": false}
EOF
one=(--data "$TMP/one.txt" --val-data "$TMP/one.txt" --seq-len $T --micro-batch 1 --threads 2 --quiet)
step1_loss() { grep -m1 '"step":1,' "$1/metrics.jsonl" | sed -E 's/.*"loss":([^,]*).*/\1/'; }
eval_loss() { "$FM" eval --ckpt "$1" --data "$2" --seq-len $T --micro-batch 1 --threads 2 | sed -n 's/^loss \([^ ]*\) .*/\1/p'; }
close() { awk -v a="$1" -v b="$2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && b != "" && d <= 1e-4) }'; }

for model in olmoe qwen3; do
    cfg="$ROOT/tests/data/micro.json"; [ $model = qwen3 ] && cfg="$TMP/qwen3.json"
    "$FM" train --config "$cfg" --data "$TEXT" --seq-len $T --micro-batch 2 --steps 3 --threads 2 --quiet \
        --out "$TMP/$model-src" || bad "$model: source run failed"
    src="$TMP/$model-src/step_000003"
    for v in "--dtype f32" "--dtype bf16" "--dtype f16 --shards 3" "--fuse --dtype bf16 --shards 2" "--fuse"; do
        name=$model-$(tr -d ' -' <<<"$v")
        # shellcheck disable=SC2086
        "$FX" "$src" "$TMP/$name" $v || { bad "$name: fixture failed"; continue; }
        "$FM" train --init-from "$TMP/$name" "${one[@]}" --steps 1 --out "$TMP/run-$name" || { bad "$name: train --init-from failed"; continue; }
        a=$(step1_loss "$TMP/run-$name"); b=$(eval_loss "$TMP/$name" "$TMP/one.txt")
        if close "$a" "$b"; then ok; echo "ok  $name: step-1 loss $a = eval $b"; else bad "$name: step-1 loss $a, eval of the folder $b"; fi
        [ ! -f "$TMP/run-$name/step_000001/optimizer.safetensors" ] && bad "$name: no checkpoint" || ok
        grep -Eq '"optimizer_step":[[:space:]]*1[,[:space:]]' "$TMP/run-$name/step_000001/state.json" && ok || bad "$name: optimizer did not start at step 0"
    done
    # fp16 weights are not fp32 ones: the folder's values, not a random init, were used
    a=$(eval_loss "$TMP/$model-dtypef32" "$TMP/one.txt"); b=$(eval_loss "$src" "$TMP/one.txt")
    [ "$a" = "$b" ] && ok || bad "$model: the fp32 folder's eval $a differs from its source checkpoint's $b"
done

src="$TMP/olmoe-src/step_000003"
"$FX" "$src" "$TMP/drop" --drop model.norm.weight
expect_fail "missing tensor" "no tensor named 'model.norm.weight'" "$FM" train --init-from "$TMP/drop" "${one[@]}" --steps 1 --out "$TMP/r-drop"
expect_fail "missing tensor: never random" "never initialized at random" "$FM" train --init-from "$TMP/drop" "${one[@]}" --steps 1 --out "$TMP/r-drop"
"$FX" "$src" "$TMP/reshape" --reshape model.layers.1.self_attn.q_proj.weight --shards 2
expect_fail "wrong shape" "tensor 'model.layers.1.self_attn.q_proj.weight' has the wrong shape: expected [32, 32], found [33, 32]" \
    "$FM" train --init-from "$TMP/reshape" "${one[@]}" --steps 1 --out "$TMP/r-shape"
"$FX" "$src" "$TMP/retype" --retype model.layers.0.mlp.gate.weight --dtype bf16
expect_fail "wrong dtype" "tensor 'model.layers.0.mlp.gate.weight' (shape [4, 32]) has dtype I32; expected F32, BF16 or F16" \
    "$FM" train --init-from "$TMP/retype" "${one[@]}" --steps 1 --out "$TMP/r-type"
[ ! -d "$TMP/r-drop" ] && [ ! -d "$TMP/r-shape" ] && [ ! -d "$TMP/r-type" ] && ok || bad "a refused --init-from left a run folder"
"$FX" "$src" "$TMP/extra" --extra model.layers.0.self_attn.rotary_emb.inv_freq
out=$("$FM" train --init-from "$TMP/extra" "${one[@]}" --steps 1 --out "$TMP/r-extra" 2>&1 >/dev/null) && ok || bad "an extra tensor failed the run: $out"
grep -q "warning: --init-from.*1 tensor of .* is not a parameter of this olmoe model and was ignored: 'model.layers.0.self_attn.rotary_emb.inv_freq'" <<<"$out" \
    && ok || bad "no warning naming the extra tensor: $out"
expect_fail "--config with --init-from" "both give the model config" \
    "$FM" train --init-from "$TMP/olmoe-dtypef32" --config "$ROOT/configs/tiny.json" "${one[@]}" --steps 1 --out "$TMP/r-cfg"
"$FM" train --init-from "$TMP/olmoe-dtypef32" --config "$TMP/olmoe-dtypef32/config.json" "${one[@]}" --steps 1 \
    --out "$TMP/r-samecfg" && ok || bad "--config naming the folder's own config.json was refused"
mkdir -p "$TMP/noweights" && cp "$cfg" "$TMP/noweights/config.json"
expect_fail "no weights" "holds neither model.safetensors nor model.safetensors.index.json" \
    "$FM" train --init-from "$TMP/noweights" "${one[@]}" --steps 1 --out "$TMP/r-noweights"

# --resume: a model.safetensors edited after the checkpoint was written is refused; the fix works.
"$FM" train --init-from "$TMP/olmoe-dtypebf16" "${one[@]}" --steps 3 --exit-after 1 --out "$TMP/edit" || bad "edit run failed"
cp -r "$TMP/edit" "$TMP/edit-ok"
f="$TMP/edit/step_000001/model.safetensors"
printf '\x41' | dd of="$f" bs=1 seek=$(($(stat -c %s "$f") - 3)) conv=notrunc 2>/dev/null
expect_fail "resume: edited weights" "model.safetensors disagrees with the optimizer's master copy at tensor" \
    "$FM" train "${one[@]}" --steps 3 --out "$TMP/edit" --resume
expect_fail "resume: names the way on" "--resume-trust-optimizer" "$FM" train "${one[@]}" --steps 3 --out "$TMP/edit" --resume
"$FM" train "${one[@]}" --steps 3 --out "$TMP/edit" --resume --resume-trust-optimizer && ok || bad "--resume-trust-optimizer was refused"
"$FM" train "${one[@]}" --steps 3 --out "$TMP/edit-ok" --resume && ok || bad "an untouched checkpoint was refused on resume"
# --resume with a checkpoint wins over --init-from (and says so)
out=$("$FM" train --init-from "$TMP/qwen3-dtypef32" "${one[@]}" --steps 4 --out "$TMP/edit-ok" --resume 2>&1 >/dev/null) \
    && grep -q "is not used" <<<"$out" && ok || bad "--resume with --init-from: $out"

# A Hugging Face folder whose config.json leaves num_key_value_heads out: transformers'
# Qwen3MoeConfig builds 4 kv heads, so its k_proj is [4 x head_dim, hidden] = [16, 32]; flatmoe
# builds the same and loads it (an explicit 8 would need [32, 32]: refused, naming the tensor).
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c.update(num_attention_heads=8, head_dim=4)
del c["num_key_value_heads"]; json.dump(c, open(sys.argv[2], "w"))' "$TMP/qwen3.json" "$TMP/qwen3-nokv.json"
"$FM" train --config "$TMP/qwen3-nokv.json" "${one[@]}" --steps 1 --out "$TMP/nokv-src" >/dev/null || bad "no kv heads: source run failed"
"$FX" "$TMP/nokv-src/step_000001" "$TMP/nokv" --dtype bf16 || bad "no kv heads: fixture failed"
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c.pop("num_key_value_heads", None)
json.dump(c, open(sys.argv[1], "w"))' "$TMP/nokv/config.json"
python3 -c 'import json, struct, sys; f = open(sys.argv[1], "rb"); n = struct.unpack("<Q", f.read(8))[0]
h = json.loads(f.read(n)); sys.exit(h["model.layers.0.self_attn.k_proj.weight"]["shape"] != [16, 32])' \
    "$TMP/nokv/model.safetensors" && ok || bad "no kv heads: the folder's k_proj is not [16, 32]"
"$FM" train --init-from "$TMP/nokv" "${one[@]}" --steps 1 --out "$TMP/run-nokv" && ok || bad "no kv heads: --init-from failed"
a=$(step1_loss "$TMP/run-nokv"); b=$(eval_loss "$TMP/nokv" "$TMP/one.txt")
close "$a" "$b" && ok || bad "no kv heads: step-1 loss $a, eval of the folder $b"
cp -r "$TMP/nokv" "$TMP/kv8"
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["num_key_value_heads"] = 8
json.dump(c, open(sys.argv[1], "w"))' "$TMP/kv8/config.json"
expect_fail "explicit kv heads 8" "model.layers.0.self_attn.k_proj.weight' has the wrong shape: expected [32, 32], found [16, 32]" \
    "$FM" train --init-from "$TMP/kv8" "${one[@]}" --steps 1 --out "$TMP/r-kv8"

# Loss masks: the second half of the targets masked; changing the last token (only ever a target)
# moves the loss without the mask and not with it; the masked loss is another loss.
ck="$TMP/olmoe-dtypef32"
"$FX" shard "$TMP/m.bin" "$TMP/one.txt" tail && "$FX" shard "$TMP/m2.bin" "$TMP/one.txt" tail $T=7 \
    && "$FX" shard "$TMP/u.bin" "$TMP/one.txt" none && "$FX" shard "$TMP/u2.bin" "$TMP/one.txt" none $T=7 \
    || bad "shard fixture failed"
lm=$(eval_loss "$ck" "$TMP/m.bin"); lm2=$(eval_loss "$ck" "$TMP/m2.bin"); lu=$(eval_loss "$ck" "$TMP/u.bin"); lu2=$(eval_loss "$ck" "$TMP/u2.bin")
echo "eval: masked $lm / $lm2 (last target changed), unmasked $lu / $lu2"
[ -n "$lm" ] && [ "$lm" = "$lm2" ] && ok || bad "eval: changing a masked target moved the loss ($lm -> $lm2)"
[ -n "$lu" ] && [ "$lu" != "$lu2" ] && ok || bad "eval: changing an unmasked target did not move the loss ($lu -> $lu2)"
[ "$lm" != "$lu" ] && ok || bad "eval: the mask changed nothing ($lm)"
[ "$lu" = "$(eval_loss "$ck" "$TMP/one.txt")" ] && ok || bad "eval: the unmasked shard's loss differs from the text's"
for d in m m2 u u2; do
    "$FM" train --init-from "$ck" --data "$TMP/$d.bin" --val-data "$TMP/$d.bin" --seq-len $T --micro-batch 1 --threads 2 \
        --quiet --steps 1 --out "$TMP/mask-$d" || bad "train on $d.bin failed"
done
tm=$(step1_loss "$TMP/mask-m"); tm2=$(step1_loss "$TMP/mask-m2"); tu=$(step1_loss "$TMP/mask-u"); tu2=$(step1_loss "$TMP/mask-u2")
echo "train: masked $tm / $tm2, unmasked $tu / $tu2"
[ -n "$tm" ] && [ "$tm" = "$tm2" ] && ok || bad "train: changing a masked target moved the loss ($tm -> $tm2)"
[ -n "$tu" ] && [ "$tu" != "$tu2" ] && ok || bad "train: changing an unmasked target did not move the loss ($tu -> $tu2)"
close "$tm" "$lm" && ok || bad "train's masked step-1 loss $tm differs from eval's $lm"
printf 'FMMASK01\x05\0\0\0\0\0\0\0\0\1\0\1\1' > "$TMP/m.bin.mask"
expect_fail "bad mask" "loss mask for 5 tokens, but" "$FM" eval --ckpt "$ck" --data "$TMP/m.bin" --seq-len $T --threads 2
# the folder's tokenizer goes into every checkpoint of the run (sample and eval find it there), on
# through a resume
# (a tokenizer whose ids do not fit the model's vocab_size is refused at load, naming both sizes)
bad_tk="$TMP/olmoe-badtok"; cp -r "$TMP/olmoe-dtypef32" "$bad_tk"; cp "$ROOT/tests/data/tok/olmoe/tokenizer.json" "$bad_tk/"
expect_fail "tokenizer larger than the model" "has vocab_size 256: the tokenizer is not this model's" \
    "$FM" train --init-from "$bad_tk" "${one[@]}" --steps 1 --out "$TMP/r-badtok"
sed 's/"vocab_size": 256/"vocab_size": 3072/' "$ROOT/tests/data/micro.json" > "$TMP/micro3072.json"
"$FM" train --config "$TMP/micro3072.json" "${one[@]}" --steps 1 --out "$TMP/v3072" >/dev/null || bad "vocab 3072 source run failed"
tk="$TMP/olmoe-tok"; "$FX" "$TMP/v3072/step_000001" "$tk" --dtype f32 || bad "vocab 3072 fixture failed"
cp "$ROOT/tests/data/tok/olmoe/tokenizer.json" "$tk/"
"$FM" train --init-from "$tk" "${one[@]}" --steps 2 --exit-after 1 --out "$TMP/run-tok" >/dev/null || bad "tokenizer: run failed"
cmp -s "$tk/tokenizer.json" "$TMP/run-tok/step_000001/tokenizer.json" && ok || bad "tokenizer: the checkpoint lacks the folder's tokenizer.json"
"$FM" train --init-from "$tk" "${one[@]}" --steps 2 --resume --out "$TMP/run-tok" >/dev/null 2>&1 || bad "tokenizer: resume failed"
cmp -s "$tk/tokenizer.json" "$TMP/run-tok/step_000002/tokenizer.json" && ok || bad "tokenizer: the resumed run's checkpoint lacks tokenizer.json"
[ ! -f "$TMP/run-olmoe-dtypef32/step_000001/tokenizer.json" ] && ok || bad "tokenizer: a folder without one gave the checkpoint one"

# the fine-tuning defaults (run/fm_spec_finetune.h): the flags not given take them, said at start,
# kept in state.json; --out is runs/ft-NAME under the working folder
loud=(--data "$TMP/one.txt" --val-data "$TMP/one.txt" --seq-len $T --threads 2 --log-every 1)
(cd "$TMP" && "$FM" train --init-from "$tk" "${loud[@]}" --steps 2 --weight-decay 0.01) > "$TMP/ft.out" 2>&1 || bad "fine-tuning defaults: run failed: $(cat "$TMP/ft.out")"
grep -qF -- "--out runs/ft-olmoe-tok (the default with --init-from" "$TMP/ft.out" && ok || bad "fine-tuning defaults: no --out line: $(cat "$TMP/ft.out")"
grep -qF -- "--lr 2e-5, --min-lr 0, --warmup 0, --micro-batch 8 (the fine-tuning defaults" "$TMP/ft.out" && ok ||
    bad "fine-tuning defaults: the line lacks the values (or names the given --weight-decay): $(cat "$TMP/ft.out")"
st="$TMP/runs/ft-olmoe-tok/step_000002/state.json"
python3 -c 'import json,sys; s=json.load(open(sys.argv[1]))["spec"]; sys.exit(not (s["lr"]==2e-5 and s["micro-batch"]==8 and s["weight-decay"]==0.01 and s["warmup"]==0))' "$st" \
    && ok || bad "fine-tuning defaults: state.json's spec lacks them: $(cat "$st")"
# no warmup, cosine from 2e-5 to --min-lr 0 over 2 steps: step 1 at half the peak (a from-scratch
# default would print 2e-3's schedule)
grep -q 'step *1/2 .*lr 1.00e-05' "$TMP/ft.out" && ok || bad "fine-tuning defaults: step 1's lr is not 1e-5: $(cat "$TMP/ft.out")"
# a --resume continues with the run's own values: an --init-from given again takes no defaults
"$FM" train --config "$TMP/micro3072.json" "${loud[@]}" --micro-batch 1 --steps 2 --exit-after 1 --out "$TMP/scratch" >/dev/null 2>&1 \
    || bad "scratch run failed"
out=$("$FM" train --init-from "$tk" "${loud[@]}" --steps 2 --resume --out "$TMP/scratch" 2>&1) || bad "resume with --init-from failed: $out"
# (the from-scratch schedule: warmup 50 to 2e-3, so step 2 at 2e-3 x 2 / 50)
! grep -q "fine-tuning defaults" <<<"$out" && grep -q 'step *2/2 .*lr 8.00e-05' <<<"$out" && ok ||
    bad "a resume with --init-from took the fine-tuning defaults: $out"
# --init-from a flatmoe run folder: its latest checkpoint
out=$("$FM" train --init-from "$TMP/run-tok" --data "$TMP/one.txt" --val-data "$TMP/one.txt" --seq-len $T --micro-batch 1 --threads 2 --steps 1 --out "$TMP/run-fromrun" 2>&1) && grep -q "its latest checkpoint" <<<"$out" && ok ||
    bad "--init-from a run folder: $out"

finish
