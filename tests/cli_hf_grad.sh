#!/usr/bin/env bash
# tools/fm_hf_grad (tools/hf_parity.py's flatmoe side) writes each MoE layer's routing as
# router_topk.<i> [B*T, k] (i over the MoE layers in model order; hf_parity counts its flips against
# transformers fp32). Checked against the gradients of the same run, independently: on a qwen3_moe
# with 16 experts, a dense layer between two MoE layers and 1 x 4 tokens (8 routes of 16 experts),
# an expert none of the first 3 tokens chose (the last position is in no loss) has exactly zero
# gradient in its gate, up and down weights, and each one they chose a non-zero gradient; two router_topk tensors (not three: the dense layer has none),
# each row k distinct ids in [0, 16). Also the loss and the tensors' count.
source "$(dirname "$0")/lib_cli.sh"
TOOL="$(dirname "$FM")/fm_hf_grad"
[ -x "$TOOL" ] || { echo "no fm_hf_grad beside $FM: skipped"; exit 77; }
cat > "$TMP/cfg.json" <<'JSON'
{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 32,
 "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
 "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64, "num_experts": 16, "num_experts_per_tok": 2,
 "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [1], "router_aux_loss_coef": 0.0,
 "tie_word_embeddings": false}
JSON
"$FM" train --config "$TMP/cfg.json" --data "$TEXT" --seq-len 16 --micro-batch 2 --steps 1 --quiet --out "$TMP/run" \
    > /dev/null || bad "train"
python3 - "$TMP/batch.safetensors" <<'PY'
import json, struct, sys
ids = [5.0, 17.0, 99.0, 42.0]
hdr = json.dumps({"input_ids": {"dtype": "F32", "shape": [1, 4], "data_offsets": [0, 16]}}).encode()
open(sys.argv[1], "wb").write(struct.pack("<Q", len(hdr)) + hdr + struct.pack("<4f", *ids))
PY
"$TOOL" "$TMP/run/step_000001" "$TMP/batch.safetensors" "$TMP/out.safetensors" > "$TMP/tool.log" 2>&1 ||
    bad "fm_hf_grad: $(cat "$TMP/tool.log")"
python3 - "$TMP/out.safetensors" <<'PY' && ok || bad "router_topk against the expert gradients"
import array, json, struct, sys
f = open(sys.argv[1], "rb"); n = struct.unpack("<Q", f.read(8))[0]; hdr = json.loads(f.read(n)); data = f.read()
def get(k):
    s, e = hdr[k]["data_offsets"]; a = array.array("f"); a.frombytes(data[s:e]); return a
routes = sorted(k for k in hdr if k.startswith("router_topk."))
ok = routes == ["router_topk.0", "router_topk.1"]
for i, layer in zip(range(2), (0, 2)):  # the MoE layers are 0 and 2 (mlp_only_layers [1])
    r = get(f"router_topk.{i}")
    ok &= hdr[f"router_topk.{i}"]["shape"] == [4, 2]
    rows = [r[j:j + 2] for j in range(0, len(r), 2)]
    ok &= all(len(set(row)) == 2 and all(v == int(v) and 0 <= v < 16 for v in row) for row in rows)
    chosen = {int(v) for row in rows[:-1] for v in row}  # the last position predicts nothing: no gradient
    for e in range(16):
        g = [max(abs(x) for x in get(f"grad.model.layers.{layer}.mlp.experts.{e}.{w}.weight"))
             for w in ("gate_proj", "up_proj", "down_proj")]
        if (e in chosen) != (max(g) > 0):
            ok = False; print(f"layer {layer} expert {e}: chosen {e in chosen}, largest gradient {max(g)}")
    print(f"MoE layer {layer} (router_topk.{i}): the tokens in the loss chose {sorted(chosen)}; the others' "
          "gradients are 0")
sys.exit(0 if ok else 1)
PY
grep -q "2 layers' routes" "$TMP/tool.log" && ok || bad "tool log: $(cat "$TMP/tool.log")"
echo "cli_hf_grad: $PASSED passed, $FAILED failed"
[ $FAILED -eq 0 ]
