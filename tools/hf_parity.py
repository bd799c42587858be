#!/usr/bin/env python3
"""Hugging Face parity of flatmoe's CPU backend (fp32).

For each model family (OlmoeForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM) this builds a
small random model with transformers, saves it, and compares against flatmoe (tools/fm_hf_grad):
  1. transformers -> flatmoe: the loss, the logits and every parameter's gradient on one batch;
  2. flatmoe -> transformers: a checkpoint flatmoe trained (`flatmoe train`, 2 steps) loads in
     transformers and gives the same logits as flatmoe on the same batch.
Tolerance: relative 1e-5 (normalized error ||a-b|| / ||b|| per tensor; loss relative error).
Router losses are off (router_aux_loss_coef 0): transformers computes the load-balancing loss
over all layers' tokens pooled, flatmoe per layer (Switch Transformer / Megatron), so only the
cross-entropy is comparable.

  python3 tools/hf_parity.py BUILD_DIR [TEXT_FILE] [--tol T] [--flatmoe NAME]
(--tol 3e-2 and --flatmoe flatmoe-cuda for the bf16 CUDA build, whose fm_hf_grad then runs on the GPU)
Needs torch, transformers and safetensors (the H200 machine has them). Exit status 1 on failure.
"""
import json
import os
import subprocess
import sys
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file

TOL = 1e-5
FLATMOE = "flatmoe"


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


def nerr(a, b):
    a = a.double()
    b = b.double()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def fm_grad(build, model_dir, ids, out):
    batch = os.path.join(out, "batch.safetensors")
    save_file({"input_ids": ids.float().contiguous()}, batch)
    res = os.path.join(out, "fm.safetensors")
    tool = "fm_hf_grad_cuda" if FLATMOE.endswith("cuda") else "fm_hf_grad"
    subprocess.run([os.path.join(build, tool), model_dir, batch, res], check=True)
    return load_file(res)


def expert_grad(fm, prefix, e_count, which):
    return torch.stack([fm[f"grad.{prefix}.{e}.{which}.weight"] for e in range(e_count)])


def compare_grads(name, model, fm, failures):
    worst = 0.0
    n = 0
    for pname, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach()
        if "grad." + pname not in fm and "grad." + pname.replace(".mlp.", ".block_sparse_moe.") in fm:
            pname = pname.replace(".mlp.", ".block_sparse_moe.")  # transformers 5 Mixtral in memory
        key = "grad." + pname
        if key in fm:
            ours = fm[key]
        elif pname.endswith("experts.gate_up_proj") or pname.endswith("experts.down_proj"):
            # transformers 5 fuses experts: gate_up [E, 2I, H], down [E, H, I]
            mix = name == "mixtral"
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
        if e > TOL:
            failures.append(f"{name}: gradient of {pname}: normalized error {e:.3g} > {TOL}")
    print(f"  {name}: {n} gradients compared, worst normalized error {worst:.3g}")


def main():
    global TOL, FLATMOE
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("text", nargs="?")
    ap.add_argument("--tol", type=float, default=TOL)
    ap.add_argument("--flatmoe", default=FLATMOE)
    a = ap.parse_args()
    TOL, FLATMOE = a.tol, a.flatmoe
    build = os.path.abspath(a.build)
    text = a.text
    torch.manual_seed(0)
    failures = []
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; flatmoe binary {FLATMOE}, "
          f"tolerance {TOL}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in configs():
            d = os.path.join(tmp, name)
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
            model.save_pretrained(d, safe_serialization=True)
            names = sorted(load_file(os.path.join(d, "model.safetensors")).keys())
            with open(os.path.join(d, "config.json")) as f:
                print(f"{name}: config.json keys: {sorted(json.load(f).keys())}")
            print(f"{name}: saved {len(names)} tensors, e.g. {[n for n in names if 'expert' in n][:2]}")
            ids = torch.randint(0, cfg.vocab_size, (2, 24))
            # 1. transformers -> flatmoe
            model.zero_grad()
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            fm = fm_grad(build, d, ids, tmp)
            le = abs(float(fm["loss"][0]) - out.loss.item()) / abs(out.loss.item())
            lg = nerr(fm["logits"], out.logits.detach())
            print(f"  {name}: loss transformers {float(out.loss):.7f} flatmoe {float(fm['loss'][0]):.7f} "
                  f"(rel {le:.3g}); logits normalized error {lg:.3g}")
            if le > TOL:
                failures.append(f"{name}: loss relative error {le:.3g}")
            if lg > TOL:
                failures.append(f"{name}: logits normalized error {lg:.3g}")
            compare_grads(name, model, fm, failures)
            # 2. flatmoe -> transformers
            if text:
                run = os.path.join(tmp, name + "-run")
                subprocess.run([os.path.join(build, FLATMOE), "train", "--config", os.path.join(d, "config.json"),
                                "--data", text, "--seq-len", "32", "--micro-batch", "2", "--steps", "2",
                                "--quiet", "--out", run], check=True)
                ck = os.path.join(run, "step_000002")
                back = transformers.AutoModelForCausalLM.from_pretrained(ck, attn_implementation="eager").float()
                with torch.no_grad():
                    ref = back(input_ids=ids).logits
                fm2 = fm_grad(build, ck, ids, tmp)
                e = nerr(fm2["logits"], ref)
                print(f"  {name}: flatmoe checkpoint in transformers: logits normalized error {e:.3g}")
                if e > TOL:
                    failures.append(f"{name}: flatmoe checkpoint logits in transformers differ: {e:.3g}")
    for f in failures:
        print("FAIL " + f)
    print(f"{'parity ok' if not failures else 'parity FAILED'}: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
