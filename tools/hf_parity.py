#!/usr/bin/env python3
"""Hugging Face parity of flatmoe's CPU backend (fp32) and of its CUDA backend (bf16).

For each model family (OlmoeForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM,
Qwen3MoeForCausalLM with dense layers: decoder_sparse_step 2, mlp_only_layers [0], and, when the
installed transformers has them, Glm4MoeForCausalLM, DeepseekV3ForCausalLM with and without
q_lora_rank, DeepseekV2ForCausalLM (group_limited_greedy and greedy), GptOssForCausalLM) this builds a
small random model with transformers, saves it, and compares against flatmoe (tools/fm_hf_grad),
after checking that flatmoe counts the parameters transformers built:
  1. transformers -> flatmoe: the loss, the logits and every parameter's gradient on one batch;
  2. flatmoe -> transformers: a checkpoint flatmoe trained (`flatmoe train`, 2 steps) loads in
     transformers and gives the same logits as flatmoe on the same batch.
Tolerance: relative 1e-5 (normalized error ||a-b|| / ||b|| per tensor; loss relative error).
Router losses are off (router_aux_loss_coef 0): transformers computes the load-balancing loss
over all layers' tokens pooled, flatmoe per layer (Switch Transformer / Megatron), so only the
cross-entropy is comparable.

  python3 tools/hf_parity.py BUILD_DIR [TEXT_FILE] [--tol T] [--flatmoe NAME]
        [--bf16-baseline {auto,on,off}] [--factor F] [--floor E] [--bf16-device {auto,cpu,cuda}]
        [--json [FILE]]
  python3 tools/hf_parity.py --self-test      (pure Python, needs neither torch nor a build)
(--tol 3e-2 and --flatmoe flatmoe-cuda for the bf16 CUDA build, whose fm_hf_grad then runs on the GPU)
Needs torch, transformers and safetensors (the H200 machine has them). Exit status 1 on failure.

bf16 baseline (the CUDA build). flatmoe-cuda computes in bf16, so its errors against fp32
transformers are measured against what bf16 itself costs: the same model, in transformers, cast to
bf16 (model.to(torch.bfloat16), weights rounded from the same fp32 values), on the same batch, on
the GPU when torch.cuda.is_available() (else the CPU; --bf16-device overrides), with the same
metrics against the same fp32 reference (transformers fp32 on the CPU). Each quantity (the loss,
the logits, every gradient tensor and, with TEXT_FILE, the checkpoint logits) then passes when
        flatmoe_err <= max(FLOOR, FACTOR * transformers_bf16_err)
with FACTOR 2.0 and FLOOR 1e-2 by default (FLOOR keeps quantities where bf16 transformers happens
to be very close to fp32 from failing on noise; FACTOR allows flatmoe a different, not worse in
kind, bf16 rounding: other GEMM splits, fp32 router). It prints a table per model:
    quantity | flatmoe-bf16 err | transformers-bf16 err | ratio | bound | pass
(ratio = flatmoe err / transformers-bf16 err). --tol is then informational only: the number of
quantities above it is printed and in the JSON. --bf16-baseline auto (the default) turns this on
when --flatmoe names a CUDA binary (ends in "cuda", e.g. flatmoe-cuda), and leaves the fp32 path
(every quantity <= --tol, default 1e-5) exactly as before otherwise; on/off force it.
Routing flips: in this mode the per-layer router logits of transformers fp32 and bf16 are taken
(output_router_logits=True, or forward hooks on the MoE blocks' `gate` modules) and the tokens
whose top-k expert set differs from fp32's are counted per layer (ties broken towards the lower
expert index). flatmoe's own routing is counted too: fm_hf_grad writes `router_topk.<i>` for the
i-th MoE layer ([B*T, k] expert ids as F32, the layers transformers' router logits cover), so a
gradient over its bound beside flatmoe flips on that layer reads as a routing flip, not an
arithmetic error (a case with no flips and a miss is the error).
--json prints (or with FILE, writes) one JSON object per model at the end: the mode, the
tolerances, losses, every quantity's errors, bound and verdict, and the routing flips.
"""
import copy
import json
import math
import os
import re
import subprocess
import sys
import tempfile

# torch, transformers and safetensors are imported in main() (import_hf), so that --help and
# --self-test work on a machine without them.
torch = None
transformers = None
load_file = None
save_file = None

TOL = 1e-5
FLATMOE = "flatmoe"
FACTOR = 2.0   # bf16 baseline: flatmoe may be this many times as far from fp32 as transformers-bf16 is
FLOOR = 1e-2   # bf16 baseline: ... or this far (normalized / relative error), whichever is larger


def import_hf():
    global torch, transformers, load_file, save_file
    import torch as _torch
    import transformers as _transformers
    from safetensors.torch import load_file as _load_file, save_file as _save_file
    torch, transformers, load_file, save_file = _torch, _transformers, _load_file, _save_file


def configs():
    common = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                  router_aux_loss_coef=0.0, output_router_logits=False, tie_word_embeddings=False,
                  initializer_range=0.1)
    yield "olmoe", transformers.OlmoeConfig(intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                            norm_topk_prob=False, rope_theta=10000.0, **common)
    yield "qwen3_moe", transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                                   num_experts_per_tok=2, norm_topk_prob=True, head_dim=16,
                                                   rope_theta=1e6, decoder_sparse_step=1, mlp_only_layers=[],
                                                   **common)
    yield "mixtral", transformers.MixtralConfig(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                                rope_theta=1e6, sliding_window=None, **common)
    # dense layers among MoE layers (Qwen3MoeDecoderLayer: MoE when (i + 1) % decoder_sparse_step == 0
    # and i not in mlp_only_layers): layers 0 (mlp_only_layers) and 2 ((2 + 1) % 2 != 0) are a
    # Qwen3MoeMLP of intermediate_size, 1 and 3 MoE
    dense = dict(common, num_hidden_layers=4)
    yield "qwen3_moe_dense", transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                                         num_experts_per_tok=2, norm_topk_prob=True, head_dim=16,
                                                         rope_theta=1e6, decoder_sparse_step=2, mlp_only_layers=[0],
                                                         **dense)
    # GLM-4.5 (Glm4MoeForCausalLM): DeepSeek-V3's sigmoid router (groups: 2 of 4 kept, a random
    # e_score_correction_bias set after the build), a shared expert, layer 0 dense; Glm4MoeConfig's
    # partial rotary (0.5) and q/k/v biases
    if hasattr(transformers, "Glm4MoeConfig"):
        glm = dict(common, num_hidden_layers=3)
        yield "glm4_moe", transformers.Glm4MoeConfig(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                                                     num_experts_per_tok=2, n_shared_experts=1, n_group=4,
                                                     topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
                                                     norm_topk_prob=True, use_qk_norm=True, head_dim=16,
                                                     partial_rotary_factor=0.5, attention_bias=True,
                                                     rope_theta=1e6, **glm)
    # DeepSeek-V3 (DeepseekV3ForCausalLM): glm4_moe's MoE block (as above) with multi-head latent
    # attention (model/fm_mla.h): q_lora_rank (q_a_proj, q_a_layernorm, q_b_proj) and interleaved RoPE
    # with YaRN whose mscale_all_dim scales the softmax (mscale != mscale_all_dim: the cos/sin
    # factor too); and Moonlight's shape, q_lora_rank None (q_proj), rotate_half RoPE, no scaling.
    # v_head_dim 16 < qk_nope + qk_rope 20: flatmoe pads v with zero columns
    if hasattr(transformers, "DeepseekV3Config"):
        ds = dict(common, num_hidden_layers=3, num_key_value_heads=4)  # eager attention repeats k by nh // nkv
        mla = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                   n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
                   norm_topk_prob=True, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16,
                   rope_theta=10000.0)
        yield "deepseek_v3", transformers.DeepseekV3Config(
            q_lora_rank=24, rope_interleave=True, **mla,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                          "mscale_all_dim": 0.8}, **ds)
        yield "deepseek_v3_noq", transformers.DeepseekV3Config(q_lora_rank=None, rope_interleave=False, **mla, **ds)
    # DeepSeek-V2 (DeepseekV2ForCausalLM; docs/models.md): deepseek_v3's attention with DeepSeek-V2's
    # router: softmax scores, "group_limited_greedy" (groups scored by their largest score, 2 of 4
    # kept) with k 3 and routed_scaling_factor 2.5, no renormalization, two shared experts, and YaRN
    # with mscale_all_dim (transformers applies mscale_all_dim^2 to DeepseekV2Attention's softmax
    # scale since its PR #47435: an older transformers fails this case on the logits, and the
    # _lite case, without rope_scaling, then tells the router from the attention); and
    # DeepSeek-V2-Lite's shape: "greedy", q_lora_rank None, scaling 1
    if hasattr(transformers, "DeepseekV2Config"):
        ds2 = dict(common, num_hidden_layers=3, num_key_value_heads=4)
        mla2 = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
                    n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=12,
                    qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000.0)
        yield "deepseek_v2", transformers.DeepseekV2Config(
            q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.5,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                          "mscale_all_dim": 0.8}, **mla2, **ds2)
        yield "deepseek_v2_lite", transformers.DeepseekV2Config(q_lora_rank=None, topk_method="greedy",
                                                                routed_scaling_factor=1.0, **mla2, **ds2)
    # the attention parts of issue 26 (docs/formats.md): q/k/v/o biases (made non-zero after init:
    # transformers starts them at 0), YaRN (an original context of 16 so the ramp bends within the
    # 24-token sequences; Qwen3's long-context recipe in small), linear RoPE scaling
    yield "qwen3_moe_bias", transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                                        num_experts_per_tok=2, norm_topk_prob=True, head_dim=16,
                                                        rope_theta=1e6, attention_bias=True, **common)
    yield "olmoe_bias", transformers.OlmoeConfig(intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                                 norm_topk_prob=False, rope_theta=10000.0, attention_bias=True,
                                                 **common)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    yield "qwen3_moe_yarn", transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                                        num_experts_per_tok=2, norm_topk_prob=True, head_dim=16,
                                                        rope_theta=10000.0, rope_scaling=yarn, **common)
    # head_dim given: transformers 5's YaRN reads config.head_dim, which MixtralConfig leaves None
    yield "mixtral_yarn_mscale", transformers.MixtralConfig(
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, rope_theta=10000.0, sliding_window=None,
        head_dim=16,
        rope_scaling=dict(yarn, mscale=0.707, mscale_all_dim=1.0, beta_fast=16, beta_slow=2), **common)
    yield "olmoe_linear", transformers.OlmoeConfig(intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                                   norm_topk_prob=False, rope_theta=10000.0,
                                                   rope_scaling={"rope_type": "linear", "factor": 2.0}, **common)
    # GPT-OSS (GptOssForCausalLM, issue 26; docs/models.md): sliding (window 8 in 24-token
    # sequences) and full layers, attention sinks, q/k/v/o biases, the router's bias, the experts'
    # biases and the clamped SwiGLU (limit 1.5, so some gates and ups clamp), GptOssConfig's YaRN
    if hasattr(transformers, "GptOssConfig"):
        oss = dict(common, num_hidden_layers=3)
        yield "gpt_oss", transformers.GptOssConfig(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                                   head_dim=16, sliding_window=8, swiglu_limit=1.5,
                                                   layer_types=["sliding_attention", "full_attention",
                                                                "sliding_attention"], **oss)


def nerr(a, b):
    a = a.double()
    b = b.double()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


# ---- the bf16-baseline criterion and routing counts: pure Python (see --self-test) ----

def bf16_mode(choice, flatmoe):
    """Whether the bf16 baseline is on: 'on'/'off' force it; 'auto' when the binary is a CUDA one."""
    if choice == "on":
        return True
    if choice == "off":
        return False
    return os.path.basename(flatmoe).endswith("cuda")


def judge(fm_err, hf_err, factor, floor):
    """(bound, ratio, ok) for one quantity: ok when fm_err <= max(floor, factor * hf_err).
    A non-finite transformers-bf16 error gives the floor as bound; a non-finite flatmoe error fails."""
    bound = max(floor, factor * hf_err) if math.isfinite(hf_err) else floor
    if hf_err > 0 and math.isfinite(hf_err):
        ratio = fm_err / hf_err
    else:
        ratio = 0.0 if fm_err == 0 else math.inf
    ok = math.isfinite(fm_err) and fm_err <= bound
    return bound, ratio, ok


def topk_sets(rows, k):
    """Top-k expert sets of router logit (or probability) rows; ties go to the lower expert index."""
    return [frozenset(sorted(range(len(r)), key=lambda e: (-r[e], e))[:k]) for r in rows]


def topk_ties(rows, k):
    """Rows whose k-th and (k+1)-th largest values are equal (the top-k set is then ambiguous)."""
    n = 0
    for r in rows:
        s = sorted(r, reverse=True)
        if len(s) > k and s[k - 1] == s[k]:
            n += 1
    return n


def count_flips(a, b):
    """Number of tokens whose expert sets differ between a and b (lists of sets, same order)."""
    if len(a) != len(b):
        raise ValueError(f"routing of {len(a)} vs {len(b)} tokens")
    return sum(1 for x, y in zip(a, b) if x != y)


def routing_flips(ref_layers, other_layers, k):
    """Per-layer flip counts of other against ref (each a list, per layer, of router rows)."""
    return [count_flips(topk_sets(r, k), topk_sets(o, k)) for r, o in zip(ref_layers, other_layers)]


def fmt(x):
    if x is None:
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.3g}"


def table(rows):
    """Lines of the side-by-side table; rows are dicts with quantity, fm_err, hf_err, ratio, bound, ok."""
    head = ("quantity", "flatmoe-bf16 err", "transformers-bf16 err", "ratio", "bound", "pass")
    body = [(r["quantity"], fmt(r["fm_err"]), fmt(r["hf_err"]), fmt(r["ratio"]), fmt(r["bound"]),
             "yes" if r["ok"] else "NO") for r in rows]
    w = [max(len(c[i]) for c in [head] + body) for i in range(len(head))]

    def line(c):
        return "  " + " | ".join(c[i].ljust(w[i]) if i == 0 else c[i].rjust(w[i]) for i in range(len(c)))
    return [line(head), "  " + "-|-".join("-" * x for x in w)] + [line(c) for c in body]


def jnum(x):
    """JSON-safe number: non-finite floats as the strings 'inf', '-inf', 'nan'."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def jclean(o):
    if isinstance(o, dict):
        return {k: jclean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [jclean(v) for v in o]
    return jnum(o)


def self_test():
    """Checks of the pure-Python parts (criterion, routing counts, table, JSON); exit status 1 on failure."""
    bad = []

    def check(cond, what):
        if not cond:
            bad.append(what)

    b, r, ok = judge(0.134, 0.07, 2.0, 1e-2)
    check(abs(b - 0.14) < 1e-12 and abs(r - 0.134 / 0.07) < 1e-12 and ok, "judge: within 2x")
    b, r, ok = judge(0.264, 0.05, 2.0, 1e-2)
    check(abs(b - 0.1) < 1e-12 and not ok, "judge: over 2x fails")
    b, r, ok = judge(0.005, 0.0, 2.0, 1e-2)
    check(b == 1e-2 and r == math.inf and ok, "judge: floor with a zero baseline")
    b, r, ok = judge(0.0, 0.0, 2.0, 1e-2)
    check(r == 0.0 and ok, "judge: both zero")
    b, r, ok = judge(0.02, 0.004, 2.0, 1e-2)
    check(b == 1e-2 and not ok, "judge: floor binds")
    check(judge(0.01, 0.004, 2.0, 1e-2)[2], "judge: equal to the bound passes")
    check(not judge(float("nan"), 0.1, 2.0, 1e-2)[2], "judge: NaN flatmoe error fails")
    check(not judge(float("inf"), 0.1, 2.0, 1e-2)[2], "judge: inf flatmoe error fails")
    b, r, ok = judge(0.005, float("nan"), 2.0, 1e-2)
    check(b == 1e-2 and ok, "judge: NaN baseline falls back to the floor")

    check(bf16_mode("auto", "flatmoe-cuda") and not bf16_mode("auto", "flatmoe"), "bf16_mode auto")
    check(bf16_mode("auto", "build-gpu/flatmoe-cuda"), "bf16_mode auto with a path")
    check(bf16_mode("on", "flatmoe") and not bf16_mode("off", "flatmoe-cuda"), "bf16_mode on/off")

    rows32 = [[0.9, 0.1, 0.5, 0.2], [0.1, 0.2, 0.3, 0.4], [1.0, 1.0, 0.0, 1.0]]
    sets = topk_sets(rows32, 2)
    check(sets == [frozenset({0, 2}), frozenset({2, 3}), frozenset({0, 1})], f"topk_sets {sets}")
    check(topk_ties(rows32, 2) == 1 and topk_ties(rows32, 1) == 1, "topk_ties")
    rows16 = [[0.9, 0.1, 0.5, 0.2], [0.1, 0.2, 0.41, 0.4], [1.0, 0.9, 0.0, 1.0]]
    check(count_flips(topk_sets(rows32, 2), topk_sets(rows16, 2)) == 1, "count_flips: one swap")
    check(routing_flips([rows32, rows32], [rows16, rows32], 2) == [1, 0], "routing_flips per layer")
    check(count_flips(topk_sets(rows32, 2), topk_sets([[0.5, 0.1, 0.9, 0.2]] + rows32[1:], 2)) == 0,
          "count_flips: order inside the set does not matter")
    try:
        count_flips([frozenset()], [])
        bad.append("count_flips: length mismatch not caught")
    except ValueError:
        pass

    rows = [dict(quantity="loss", fm_err=4.2e-4, hf_err=1e-3, ratio=0.42, bound=1e-2, ok=True),
            dict(quantity="model.layers.0.mlp.gate.weight", fm_err=0.264, hf_err=0.0, ratio=math.inf,
                 bound=1e-2, ok=False)]
    lines = table(rows)
    check(len(lines) == 4 and all(l.startswith("  ") for l in lines), "table: 2 header + 2 rows, indented")
    check(len({l.index("|") for l in lines if "|" in l}) == 1, "table: aligned first column")
    check(lines[3].split("|")[3].strip() == "inf" and lines[3].endswith("NO"), "table: inf ratio, NO")
    check("flatmoe-bf16 err" in lines[0] and "transformers-bf16 err" in lines[0], "table: header")
    rec = jclean({"model": "x", "quantities": rows, "nan": float("nan")})
    s = json.dumps(rec, allow_nan=False)
    back = json.loads(s)
    check(back["quantities"][1]["ratio"] == "inf" and back["nan"] == "nan", "json: non-finite as strings")
    for b_ in bad:
        print("self-test FAIL " + b_)
    print(f"self-test {'ok' if not bad else 'FAILED'}: {len(bad)} failures")
    return 1 if bad else 0


# ---- flatmoe and transformers runs ----

def fm_grad(build, model_dir, ids, out):
    batch = os.path.join(out, "batch.safetensors")
    save_file({"input_ids": ids.float().contiguous()}, batch)
    res = os.path.join(out, "fm.safetensors")
    tool = "fm_hf_grad_cuda" if FLATMOE.endswith("cuda") else "fm_hf_grad"
    subprocess.run([os.path.join(build, tool), model_dir, batch, res], check=True)
    return load_file(res)


def expert_grad(fm, prefix, e_count, which):
    return torch.stack([fm[f"grad.{prefix}.{e}.{which}.weight"] for e in range(e_count)])


def oss_expert_grad(pname, g, fm):
    """flatmoe's per-expert gradients in the layout of GptOssExperts' fused parameter pname (shape
    of g): gate_up_proj [E, H, 2I] (gate and up interleaved along 2I), gate_up_proj_bias [E, 2I],
    down_proj [E, I, H], down_proj_bias [E, H]; None for another parameter."""
    prefix, leaf = pname.rsplit(".", 1)
    E = g.shape[0]
    if leaf == "gate_up_proj":
        gu = torch.stack([expert_grad(fm, prefix, E, "gate_proj"), expert_grad(fm, prefix, E, "up_proj")], dim=2)
        return gu.reshape(E, -1, gu.shape[-1]).transpose(1, 2)  # [E, I, 2, H] -> [E, 2I, H] -> [E, H, 2I]
    if leaf == "gate_up_proj_bias":
        gb = torch.stack([fm[f"grad.{prefix}.{e}.gate_proj.bias"] for e in range(E)])
        ub = torch.stack([fm[f"grad.{prefix}.{e}.up_proj.bias"] for e in range(E)])
        return torch.stack([gb, ub], dim=2).reshape(E, -1)
    if leaf == "down_proj":
        return expert_grad(fm, prefix, E, "down_proj").transpose(1, 2)  # [E, H, I] -> [E, I, H]
    if leaf == "down_proj_bias":
        return torch.stack([fm[f"grad.{prefix}.{e}.down_proj.bias"] for e in range(E)])
    return None


def fuse_gpt_oss(ck, out):
    """A copy of flatmoe checkpoint folder ck at out with GptOss's fused expert tensors (flatmoe writes
    them per expert: docs/models.md), for transformers' from_pretrained."""
    import shutil
    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(ck, "config.json"), os.path.join(out, "config.json"))
    t = load_file(os.path.join(ck, "model.safetensors"))
    res = {k: v for k, v in t.items() if ".mlp.experts." not in k}
    layers = sorted({int(k.split(".")[2]) for k in t if ".mlp.experts." in k})
    for l in layers:
        p = f"model.layers.{l}.mlp.experts"
        E = len({k.split(".")[5] for k in t if k.startswith(p + ".")})
        st = lambda w: torch.stack([t[f"{p}.{e}.{w}"] for e in range(E)])
        gu = torch.stack([st("gate_proj.weight"), st("up_proj.weight")], dim=2)  # [E, I, 2, H]
        res[f"{p}.gate_up_proj"] = gu.reshape(E, -1, gu.shape[-1]).transpose(1, 2).contiguous()
        res[f"{p}.gate_up_proj_bias"] = torch.stack([st("gate_proj.bias"), st("up_proj.bias")], dim=2).reshape(E, -1)
        res[f"{p}.down_proj"] = st("down_proj.weight").transpose(1, 2).contiguous()
        res[f"{p}.down_proj_bias"] = st("down_proj.bias")
    save_file(res, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def compare_grads(name, model, fm, failures, check=True):
    """Compares every gradient; returns [(parameter name, normalized error)]. With check=False the
    errors are not held against TOL here (the bf16 baseline judges them); missing or misshapen
    gradients are failures either way."""
    worst = 0.0
    n = 0
    errs = []
    for pname, p in model.named_parameters():
        if p.grad is None:
            continue
        hf_name = pname
        g = p.grad.detach()
        if "grad." + pname not in fm and "grad." + pname.replace(".mlp.", ".block_sparse_moe.") in fm:
            pname = pname.replace(".mlp.", ".block_sparse_moe.")  # transformers 5 Mixtral in memory
        key = "grad." + pname
        if key in fm:
            ours = fm[key]
        elif name.startswith("gpt_oss") and oss_expert_grad(pname, g, fm) is not None:
            ours = oss_expert_grad(pname, g, fm)
        elif pname.endswith("experts.gate_up_proj") or pname.endswith("experts.down_proj"):
            # transformers 5 fuses experts: gate_up [E, 2I, H], down [E, H, I]
            mix = name.startswith("mixtral")
            if mix:
                pname = pname.replace(".mlp.", ".block_sparse_moe.")
            prefix = pname.rsplit(".", 1)[0]
            E = g.shape[0]
            gn, un, dn = ("w1", "w3", "w2") if mix else ("gate_proj", "up_proj", "down_proj")
            if pname.endswith("gate_up_proj"):
                ours = torch.cat([expert_grad(fm, prefix, E, gn), expert_grad(fm, prefix, E, un)], dim=1)
            else:
                ours = expert_grad(fm, prefix, E, dn)
        else:
            failures.append(f"{name}: flatmoe has no gradient for {pname}")
            continue
        if tuple(ours.shape) != tuple(g.shape):
            failures.append(f"{name}: {pname}: shape {tuple(ours.shape)} vs {tuple(g.shape)}")
            continue
        e = nerr(ours, g)
        worst = max(worst, e)
        n += 1
        errs.append((hf_name, e))
        if check and e > TOL:
            failures.append(f"{name}: gradient of {pname}: normalized error {e:.3g} > {TOL}")
    print(f"  {name}: {n} gradients compared, worst normalized error {worst:.3g}")
    return errs


def bf16_device(choice):
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def bf16_copy(model, device):
    """The same model in bf16 (weights rounded from its fp32 values), without gradients. RoPE's
    inv_freq buffers stay fp32, as from_pretrained(dtype=torch.bfloat16) leaves them (transformers
    computes them in fp32 and upcasts to fp32 in the forward); model.to(bfloat16) alone would round
    them and add a position-dependent angle error that is not part of bf16 compute."""
    mb = copy.deepcopy(model)
    mb.zero_grad(set_to_none=True)
    mb.to(device=device, dtype=torch.bfloat16)
    for bname, b in model.named_buffers():
        if "inv_freq" in bname.rsplit(".", 1)[-1]:
            owner, _, leaf = bname.rpartition(".")
            mod = mb.get_submodule(owner) if owner else mb
            mod._buffers[leaf] = b.detach().clone().to(device)
    return mb


def hf_bf16_run(model, ids, device):
    """transformers in bf16 on the batch: (model, loss, logits fp32 on CPU, {name: gradient fp32 on CPU})."""
    with torch.random.fork_rng(devices=[]):
        mb = bf16_copy(model, device)
        x = ids.to(device)
        out = mb(input_ids=x, labels=x)
        out.loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in mb.named_parameters() if p.grad is not None}
    return mb, float(out.loss), out.logits.detach().float().cpu(), grads


def router_rows(model, ids, n_experts):
    """Per-layer router logits (or probabilities) as lists of rows [B*T][E]; None if not obtainable."""
    dev = next(model.parameters()).device
    x = ids.to(dev)
    layers = None
    try:
        with torch.no_grad():
            out = model(input_ids=x, output_router_logits=True)
        rl = getattr(out, "router_logits", None)
        if rl:
            layers = [t[0] if isinstance(t, (tuple, list)) else t for t in rl]
    except Exception as ex:  # noqa: BLE001 - fall back to hooks
        print(f"  (output_router_logits failed: {type(ex).__name__}: {ex}; trying hooks on the gates)")
    if not layers or not all(torch.is_tensor(t) and t.shape[-1] == n_experts for t in layers):
        got = []
        hooks = []
        for mname, mod in model.named_modules():
            w = getattr(mod, "weight", None)
            if mname.endswith(".gate") and torch.is_tensor(w) and w.dim() == 2 and w.shape[0] == n_experts:
                hooks.append(mod.register_forward_hook(
                    lambda m, i, o: got.append(o[0] if isinstance(o, (tuple, list)) else o)))
        try:
            with torch.no_grad():
                model(input_ids=x)
        finally:
            for h in hooks:
                h.remove()
        layers = got if got and all(t.shape[-1] == n_experts for t in got) else None
    if not layers:
        return None
    return [t.detach().float().cpu().reshape(-1, n_experts).tolist() for t in layers]


def fm_router_rows(fm, n_layers, k):
    """flatmoe's top-k choices, if fm_hf_grad wrote them (router_topk.<i>: [B*T, k] expert ids, the i-th MoE layer)."""
    keys = [f"router_topk.{l}" for l in range(n_layers)]
    if not all(key in fm for key in keys):
        return None
    return [[frozenset(int(v) for v in row) for row in fm[key].reshape(-1, k).tolist()] for key in keys]


def n_experts_of(cfg):
    for a in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(cfg, a, None):
            return int(getattr(cfg, a))
    raise ValueError("config without a number of experts")


def main():
    global TOL, FLATMOE, FACTOR, FLOOR
    import argparse
    ap = argparse.ArgumentParser(
        description="Hugging Face parity of flatmoe (loss, logits, every gradient; checkpoints both ways). "
                    "fp32 builds: every quantity within --tol. bf16 (CUDA) builds: each quantity within "
                    "max(--floor, --factor x transformers-in-bf16's own error against fp32).",
        epilog="examples: python3 tools/hf_parity.py build README.md   (CPU, fp32, tol 1e-5);  "
               "python3 tools/hf_parity.py build-gpu README.md --tol 3e-2 --flatmoe flatmoe-cuda   "
               "(CUDA, bf16 baseline on automatically);  python3 tools/hf_parity.py --self-test")
    ap.add_argument("build", nargs="?", help="build folder holding the flatmoe binary and fm_hf_grad(_cuda)")
    ap.add_argument("text", nargs="?", help="text file: also train 2 steps and load the checkpoint in transformers")
    ap.add_argument("--tol", type=float, default=TOL,
                    help="fp32 mode: the tolerance of every quantity (default %(default)g); "
                         "bf16 baseline: informational (quantities above it are counted)")
    ap.add_argument("--flatmoe", default=FLATMOE, help="flatmoe binary name in BUILD (default %(default)s; "
                    "a name ending in 'cuda' also selects fm_hf_grad_cuda)")
    ap.add_argument("--bf16-baseline", choices=("auto", "on", "off"), default="auto",
                    help="also run transformers in bf16 and judge flatmoe against it: auto (default) = on "
                         "when --flatmoe ends in 'cuda'")
    ap.add_argument("--factor", type=float, default=FACTOR,
                    help="bf16 baseline: pass if flatmoe err <= max(FLOOR, FACTOR x transformers-bf16 err) "
                         "(default %(default)g)")
    ap.add_argument("--floor", type=float, default=FLOOR, help="bf16 baseline: FLOOR above (default %(default)g)")
    ap.add_argument("--bf16-device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where transformers runs in bf16: auto (default) = cuda if available, else cpu "
                         "(the fp32 reference always runs on the CPU)")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                    help="one JSON object per model at the end of stdout (or written to FILE; put --json after "
                         "BUILD_DIR and TEXT_FILE, or write --json=FILE)")
    ap.add_argument("--only", default=None, metavar="NAMES",
                    help="comma-separated case names to run (default: every case), e.g. qwen3_moe_yarn,olmoe_linear")
    ap.add_argument("--seed", type=int, default=0, help="torch's seed for the random models (default %(default)s)")
    ap.add_argument("--self-test", action="store_true", help="check the comparison logic (pure Python) and exit")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.build:
        ap.error("BUILD_DIR is required (or --self-test)")
    TOL, FLATMOE, FACTOR, FLOOR = a.tol, a.flatmoe, a.factor, a.floor
    bf16 = bf16_mode(a.bf16_baseline, FLATMOE)
    import_hf()
    build = os.path.abspath(a.build)
    text = a.text
    torch.manual_seed(a.seed)
    only = set(a.only.split(",")) if a.only else None
    failures = []
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; flatmoe binary {FLATMOE}, "
          f"tolerance {TOL}")
    dev = None
    if bf16:
        dev = bf16_device(a.bf16_device)
        print(f"bf16 baseline: transformers in bf16 on {dev} against transformers fp32 on cpu; a quantity "
              f"passes if flatmoe err <= max({FLOOR:g}, {FACTOR:g} x transformers-bf16 err) "
              f"(--tol {TOL:g} informational)")
    records = []
    summaries = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in configs():
            if only is not None and name not in only:
                continue
            d = os.path.join(tmp, name)
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
            with torch.no_grad():  # a selection bias that matters (glm4_moe's router; zeros after init)
                for mod in model.modules():
                    if torch.is_tensor(getattr(mod, "e_score_correction_bias", None)):
                        mod.e_score_correction_bias.copy_(0.05 * torch.randn_like(mod.e_score_correction_bias))
            with torch.no_grad():  # biases start at 0 in transformers: make them shape the forward
                for pn, prm in model.named_parameters():
                    if pn.endswith(".bias"):
                        prm.normal_(0.0, 0.1)
            model.save_pretrained(d, safe_serialization=True)
            names = sorted(load_file(os.path.join(d, "model.safetensors")).keys())
            with open(os.path.join(d, "config.json")) as f:
                print(f"{name}: config.json keys: {sorted(json.load(f).keys())}")
            print(f"{name}: saved {len(names)} tensors, e.g. {[n for n in names if 'expert' in n][:2]}")
            ids = torch.randint(0, cfg.vocab_size, (2, 24))
            n_fail0 = len(failures)
            # the parameter count: flatmoe's (`flatmoe plan`) against the model transformers built
            plan = subprocess.run([os.path.join(build, FLATMOE), "plan", "--config", os.path.join(d, "config.json"),
                                   "--seq-len", "32", "--micro-batch", "1"], capture_output=True, text=True)
            m = re.search(r"model \w+: (\d+) parameters", plan.stdout)
            n_hf = sum(p.numel() for p in model.parameters())  # (tied weights counted once)
            print(f"  {name}: parameters transformers {n_hf}, flatmoe {m.group(1) if m else 'n/a'}")
            if not m or int(m.group(1)) != n_hf:
                failures.append(f"{name}: flatmoe counts {m.group(1) if m else 'no'} parameters, transformers {n_hf}")
            rec = dict(model=name, mode="bf16-baseline" if bf16 else "fp32", flatmoe=FLATMOE, tol=TOL)
            # 1. transformers -> flatmoe
            model.zero_grad()
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            fm = fm_grad(build, d, ids, tmp)
            le = abs(float(fm["loss"][0]) - out.loss.item()) / abs(out.loss.item())
            lg = nerr(fm["logits"], out.logits.detach())
            print(f"  {name}: loss transformers {float(out.loss):.7f} flatmoe {float(fm['loss'][0]):.7f} "
                  f"(rel {le:.3g}); logits normalized error {lg:.3g}")
            if not bf16:
                if le > TOL:
                    failures.append(f"{name}: loss relative error {le:.3g}")
                if lg > TOL:
                    failures.append(f"{name}: logits normalized error {lg:.3g}")
            gerrs = compare_grads(name, model, fm, failures, check=not bf16)
            rec["loss"] = dict(transformers_fp32=float(out.loss), flatmoe=float(fm["loss"][0]))
            fm_q = [("loss", le), ("logits", lg)] + gerrs          # (quantity, flatmoe error)
            hf_q = {}                                              # quantity -> transformers-bf16 error
            if bf16:
                mb, bl, blog, bgr = hf_bf16_run(model, ids, dev)
                rec["loss"]["transformers_bf16"] = bl
                hf_q["loss"] = abs(bl - out.loss.item()) / abs(out.loss.item())
                hf_q["logits"] = nerr(blog, out.logits.detach())
                for pname, p in model.named_parameters():
                    if p.grad is not None and pname in bgr:
                        hf_q[pname] = nerr(bgr[pname], p.grad.detach())
                print(f"  {name}: transformers bf16 ({dev}): loss {bl:.7f} (rel {hf_q['loss']:.3g}); "
                      f"logits normalized error {hf_q['logits']:.3g}")
                # routing flips against fp32
                E, k, L = n_experts_of(cfg), int(cfg.num_experts_per_tok), int(cfg.num_hidden_layers)
                r32 = router_rows(model, ids, E)
                r16 = router_rows(mb, ids, E)
                rfm = fm_router_rows(fm, len(r32) if r32 is not None else L, k)  # the MoE layers'
                routing = dict(top_k=k, tokens=int(ids.numel()), layers=None, transformers_bf16=None,
                               flatmoe=None, transformers_bf16_ties=None)
                if r32 is not None and r16 is not None and len(r32) == len(r16):
                    routing["layers"] = len(r32)
                    fl = routing_flips(r32, r16, k)
                    routing["transformers_bf16"] = fl
                    routing["transformers_bf16_ties"] = [topk_ties(r, k) for r in r16]
                    if rfm is not None and len(rfm) == len(r32):
                        routing["flatmoe"] = [count_flips(topk_sets(r, k), f) for r, f in zip(r32, rfm)]
                    tot = len(r32) * len(r32[0])
                    fms = (f"flatmoe {sum(routing['flatmoe'])}/{tot} (per layer {routing['flatmoe']})"
                           if routing["flatmoe"] is not None else
                           "flatmoe n/a (fm_hf_grad does not write its router choices)")
                    print(f"  {name}: routing flips against transformers fp32 (top-{k} expert sets, "
                          f"{len(r32)} layers x {len(r32[0])} tokens): transformers-bf16 {sum(fl)}/{tot} "
                          f"(per layer {fl}; {sum(routing['transformers_bf16_ties'])} bf16 top-k ties); {fms}")
                else:
                    print(f"  {name}: routing flips: router logits not obtainable from transformers")
                rec["routing"] = routing
            # 2. flatmoe -> transformers
            if text:
                run = os.path.join(tmp, name + "-run")
                subprocess.run([os.path.join(build, FLATMOE), "train", "--config", os.path.join(d, "config.json"),
                                "--data", text, "--seq-len", "32", "--micro-batch", "2", "--steps", "2",
                                "--quiet", "--out", run], check=True)
                ck = os.path.join(run, "step_000002")
                if name.startswith("gpt_oss"):  # flatmoe writes the experts per expert: fuse them
                    ck = fuse_gpt_oss(ck, os.path.join(tmp, name + "-fused"))
                back = transformers.AutoModelForCausalLM.from_pretrained(ck, attn_implementation="eager").float()
                with torch.no_grad():
                    ref = back(input_ids=ids).logits
                fm2 = fm_grad(build, ck, ids, tmp)
                e = nerr(fm2["logits"], ref)
                print(f"  {name}: flatmoe checkpoint in transformers: logits normalized error {e:.3g}")
                fm_q.append(("checkpoint logits", e))
                if bf16:
                    with torch.random.fork_rng(devices=[]), torch.no_grad():
                        bb = bf16_copy(back, dev)
                        hf_q["checkpoint logits"] = nerr(bb(input_ids=ids.to(dev)).logits.float().cpu(), ref)
                elif e > TOL:
                    failures.append(f"{name}: flatmoe checkpoint logits in transformers differ: {e:.3g}")
            # verdicts
            rows = []
            for q, fe in fm_q:
                if bf16:
                    he = hf_q.get(q, math.nan)
                    bound, ratio, ok = judge(fe, he, FACTOR, FLOOR)
                    rows.append(dict(quantity=q, fm_err=fe, hf_err=he if math.isfinite(he) else None,
                                     ratio=ratio, bound=bound, ok=ok))
                    if not ok:
                        failures.append(f"{name}: {q}: flatmoe error {fe:.3g} > max({FLOOR:g}, {FACTOR:g} x "
                                        f"transformers-bf16 {fmt(he)}) = {bound:.3g}")
                else:
                    rows.append(dict(quantity=q, fm_err=fe, bound=TOL, ok=fe <= TOL))
            if bf16:
                print(f"  {name}: flatmoe-bf16 and transformers-bf16, each against transformers fp32 "
                      f"(pass: flatmoe err <= max({FLOOR:g}, {FACTOR:g} x transformers-bf16 err)):")
                for line in table(rows):
                    print(line)
                n_ok = sum(r["ok"] for r in rows)
                worst = max(rows, key=lambda r: (r["ratio"] if math.isfinite(r["ratio"]) else 1e300))
                over_tol = sum(r["fm_err"] > TOL for r in rows)
                fl = rec["routing"]["transformers_bf16"]
                summaries.append(f"  {name}: bf16 baseline: {n_ok}/{len(rows)} within bound; worst ratio "
                                 f"{fmt(worst['ratio'])} ({worst['quantity']}); worst flatmoe err "
                                 f"{fmt(max(r['fm_err'] for r in rows))}, worst transformers-bf16 err "
                                 f"{fmt(max((r['hf_err'] or 0.0) for r in rows))}; {over_tol} above --tol {TOL:g}; "
                                 f"transformers-bf16 routing flips {sum(fl) if fl is not None else 'n/a'}")
                rec.update(factor=FACTOR, floor=FLOOR, bf16_device=dev, over_tol=over_tol)
            rec["quantities"] = rows
            rec["failures"] = failures[n_fail0:]
            rec["pass"] = len(failures) == n_fail0
            records.append(rec)
    for f in failures:
        print("FAIL " + f)
    for s in summaries:  # after the FAIL lines, so that a `tail` of the output keeps them with the verdict
        print(s)
    print(f"{'parity ok' if not failures else 'parity FAILED'}: {len(failures)} failures")
    if a.json is not None:
        lines = [json.dumps(jclean(r), allow_nan=False) for r in records]
        if a.json == "-":
            for line in lines:
                print(line)
        else:
            with open(a.json, "w") as f:
                f.write("".join(line + "\n" for line in lines))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
