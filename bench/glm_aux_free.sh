#!/usr/bin/env bash
# Aux-loss-free balancing (DeepSeek-V3 §2.1.2; --moe-router-bias-update-rate) on a small
# glm4_moe-shaped config (4 layers, the first dense, 16 routed experts in 4 groups keeping 2,
# top-4, a shared expert, routed_scaling_factor 2.5) started from a skewed selection bias
# (e_score_correction_bias 0.2 on experts 0-3 of every MoE layer, 0 elsewhere: those four take
# nearly every token): 300 CPU steps with the rate R against R = 0, printing each run's expert
# load (max/mean over experts, averaged over the MoE layers; 1 = even, E/k = 4 = all on k experts)
# at steps 1, 25, 50, 100, ..., 300 and the final loss.
#   bench/glm_aux_free.sh FLATMOE_BIN [TEXT] [R]
set -euo pipefail
BIN=$(readlink -f "$1"); cd "$(dirname "$0")/.."
TEXT=${2:-../shared/data/tinyshakespeare.txt}
R=${3:-1e-3}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 - "$tmp/cfg.json" <<'PY'
import json, sys
json.dump({"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 256, "hidden_size": 128,
           "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 1024, "partial_rotary_factor": 1.0,
           "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
           "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
           "tie_word_embeddings": False}, open(sys.argv[1], "w"), indent=1)
PY
common=(--data "$TEXT" --seq-len 64 --micro-batch 4 --threads 2 --seed 7 --quiet --eval-every 0 --no-checkpoint)
"$BIN" train --config "$tmp/cfg.json" --data "$TEXT" --seq-len 64 --micro-batch 1 --threads 2 --steps 1 --lr 1e-9 \
    --min-lr 0 --warmup 0 --quiet --out "$tmp/init" >/dev/null
python3 - "$tmp/init/step_000001/model.safetensors" <<'PY'
import json, struct, sys
p = sys.argv[1]; b = bytearray(open(p, "rb").read()); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
for k, v in h.items():
    if k.endswith("e_score_correction_bias"):
        a, _ = v["data_offsets"]
        for e in range(4): b[8 + n + a + 4 * e: 8 + n + a + 4 * e + 4] = struct.pack("<f", 0.2)
open(p, "wb").write(b)
PY
for rate in 0 "$R"; do
    "$BIN" train --init-from "$tmp/init/step_000001" "${common[@]}" --steps 300 --lr 2e-3 --warmup 20 \
        --moe-router-bias-update-rate "$rate" --out "$tmp/r$rate" >/dev/null
    python3 - "$tmp/r$rate/metrics.jsonl" "$rate" <<'PY'
import json, sys
steps = {r["step"]: r for r in map(json.loads, open(sys.argv[1])) if r.get("type") == "step"}
m = lambda s: sum(steps[s]["expert_load_max_mean"]) / len(steps[s]["expert_load_max_mean"])
pts = [1, 25, 50, 100, 150, 200, 250, 300]
print(f"R={sys.argv[2]}: load max/mean " + " ".join(f"{s}:{m(s):.2f}" for s in pts) +
      f" | mean of steps 251-300 {sum(m(s) for s in range(251, 301)) / 50:.3f} | loss {steps[300]['loss']:.4f}")
PY
done
