#!/usr/bin/env bash
# A checkpoint's config.json is the config.json read (model/fm_config.h: fm_config_json_as_read):
# every field kept, those flatmoe does not use too (bos/eos_token_id, torch_dtype, architectures,
# a dense intermediate_size that is not the experts', rope_parameters), byte for byte; only
# max_position_embeddings changes, under --max-position-embeddings (replaced, or added where the
# file leaves it out). --init-from of such a checkpoint works and a resume keeps the file.
source "$(dirname "$0")/lib_cli.sh"
T=32
cat > "$TMP/extra.json" <<'EOF'
{
  "architectures": ["Qwen3MoeForCausalLM"],
  "model_type": "qwen3_moe",
  "bos_token_id": 151643,
  "eos_token_id": [151645, 151643],
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "vocab_size": 256, "hidden_size": 32, "intermediate_size": 6144, "moe_intermediate_size": 16,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
  "max_position_embeddings": 64,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
  "rms_norm_eps": 1e-06, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": true,
  "router_aux_loss_coef": 0.001, "use_cache": true, "attention_dropout": 0.0,
  "custom_nested": {"a": [1, {"b": "}\"]"}], "max_position_embeddings": 7}
}
EOF
run=(--data "$TEXT" --seq-len $T --micro-batch 2 --threads 2 --quiet)
"$FM" train --config "$TMP/extra.json" "${run[@]}" --steps 2 --exit-after 1 --out "$TMP/a" || bad "train failed"
cmp -s "$TMP/extra.json" "$TMP/a/step_000001/config.json" && ok || bad "config.json differs from the one read: $(diff "$TMP/extra.json" "$TMP/a/step_000001/config.json")"
"$FM" train --config "$TMP/extra.json" "${run[@]}" --steps 2 --resume --out "$TMP/a" || bad "resume failed"
cmp -s "$TMP/extra.json" "$TMP/a/step_000002/config.json" && ok || bad "the resumed run's config.json differs from the one read"
"$FM" train --init-from "$TMP/a/step_000002" "${run[@]}" --steps 1 --out "$TMP/b" && ok || bad "--init-from the checkpoint failed"
cmp -s "$TMP/extra.json" "$TMP/b/step_000001/config.json" && ok || bad "--init-from's checkpoint config.json differs from the one read"
# --max-position-embeddings: that field alone changes (the nested one of the same name does not)
"$FM" train --config "$TMP/extra.json" "${run[@]}" --steps 1 --max-position-embeddings 128 --out "$TMP/c" || bad "train --max-position-embeddings failed"
same_but() { # A B: B is A with max_position_embeddings 128, every other field equal
    python3 -c 'import json, sys
a = json.load(open(sys.argv[1])); b = json.load(open(sys.argv[2]))
a["max_position_embeddings"] = 128
sys.exit(a != b)' "$1" "$2"
}
same_but "$TMP/extra.json" "$TMP/c/step_000001/config.json" && ok || bad "--max-position-embeddings: config.json is not the file with 128: $(cat "$TMP/c/step_000001/config.json")"
grep -q '"rope_theta": 10000.0' "$TMP/c/step_000001/config.json" && ok || bad "a float's spelling changed"
# left out of the file (transformers' default 32768 for qwen3_moe): added
grep -v '"max_position_embeddings": 64,' "$TMP/extra.json" > "$TMP/nomax.json"
"$FM" train --config "$TMP/nomax.json" "${run[@]}" --steps 1 --max-position-embeddings 128 --out "$TMP/d" || bad "train without the field failed"
same_but "$TMP/nomax.json" "$TMP/d/step_000001/config.json" && ok || bad "an absent max_position_embeddings was not added: $(cat "$TMP/d/step_000001/config.json")"
"$FM" train --init-from "$TMP/d/step_000001" "${run[@]}" --steps 1 --out "$TMP/e" && ok || bad "--init-from after the field was added failed"
finish
