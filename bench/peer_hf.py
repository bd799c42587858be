#!/usr/bin/env python3
"""The PyTorch peer for the GPU benchmark: Hugging Face transformers' causal-LM model of a config
(OlmoeForCausalLM for configs/olmoe-1b-7b.json) in bf16 with SDPA attention, the `grouped_mm`
experts backend and fused AdamW, trained at micro-batch 1 for each sequence length, with and
without gradient checkpointing, until out of memory.

  python3 bench/peer_hf.py CONFIG.json SEQ_LEN [SEQ_LEN ...] [--steps 3] [--json OUT.jsonl]
                           [--compile] [--grad-accum G] [--no-ckpt | --ckpt-only] [--layers N]

--compile compiles each decoder layer with torch.compile (what torchtitan does, and what a careful
PyTorch user runs); --grad-accum G makes a step of G micro-batches (loss / G each, one AdamW
step); --no-ckpt / --ckpt-only run only the plain or only the checkpointed variant; --layers N
keeps the config's first N layers (the real shapes of a model too large for one GPU).

One model and optimizer (initialized on the GPU) serve every length. For each (length,
checkpointing) it runs 1 warm-up step and `steps - 1` timed ones and prints the
median step time, tokens/s, model TFLOP/s (6*N_active + 6*heads*head_dim*span per token, span the
layers' attention spans: the count flatmoe's planner uses; hardware FLOPs add one forward when checkpointing), MFU against the
989 TFLOP/s dense bf16 peak, peak GPU memory (torch.cuda.max_memory_allocated) and the model
state (bf16 weights, grads and AdamW moments: 8 bytes per parameter).
"""
import argparse
import json
import statistics
import sys
import time

import torch
import transformers

PEAK = 989e12


def attention_span(cfg, T):
    """Sum over layers of each layer's attention span at length T, as flatmoe's planner counts it
    (fm_config_attention_span): T for a causal layer, 2 x the mean keys per query for a
    sliding-window layer (gpt_oss's layer_types)."""
    W = getattr(cfg, "sliding_window", None) or 0
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    span = 0.0
    for t in types[:cfg.num_hidden_layers]:
        if t == "sliding_attention" and 0 < W < T:
            span += 2.0 * (W * (W + 1) / 2.0 + (T - W) * W) / T
        else:
            span += T
    return span


def active_params(cfg, model):
    """(N_active, nh * qk head dim): the parameters one token uses, counted from the model (every
    parameter but the routed experts', which count k/E of theirs, shared experts whole, and the
    untied embedding table, a lookup), so
    that MLA, shared experts, dense layers and biases are counted as built. The attention width is
    heads x the q/k head dim (MLA: qk_nope_head_dim + qk_rope_head_dim), as flatmoe's planner."""
    E = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or getattr(cfg, "n_routed_experts")
    k = cfg.num_experts_per_tok
    n = 0.0
    tied = getattr(cfg, "tie_word_embeddings", False)
    for name, p in model.named_parameters():
        if "embed_tokens" in name and not tied:  # a lookup, not a matmul (the head counts: flatmoe's n_active)
            continue
        routed = ".experts." in name and "shared_experts" not in name
        n += p.numel() * (k / E if routed else 1.0)
    nh = cfg.num_attention_heads
    if getattr(cfg, "qk_nope_head_dim", None):
        hd = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    else:
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    return n, nh * hd


def build(path, layers=None):
    cfg = transformers.AutoConfig.from_pretrained(path) if not path.endswith(".json") else None
    if cfg is None:
        with open(path) as f:
            d = json.load(f)
        d.pop("quantization_config", None)  # gpt-oss's MXFP4: the peer trains bf16 weights, as flatmoe
        if layers:  # the real config's first `layers` layers (bench/families_gpu.sh truncates flatmoe's alike)
            d["num_hidden_layers"] = layers
            if isinstance(d.get("layer_types"), list):
                d["layer_types"] = d["layer_types"][:layers]
        cls = transformers.CONFIG_MAPPING[d["model_type"]]
        cfg = cls(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    kw = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
    with torch.device("cuda"):  # initialize on the GPU: minutes faster than on the host for 7B
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="grouped_mm", **kw)
            experts = "grouped_mm"
        except (TypeError, ValueError) as e:  # an older transformers: default experts
            print(f"note: experts_implementation=grouped_mm refused ({e}); default experts", file=sys.stderr)
            model = transformers.AutoModelForCausalLM.from_config(cfg, **kw)
            experts = "default"
    model.config.use_cache = False
    model.train()
    return cfg, model, experts


def run(cfg, model, experts, opt, T, steps, ckpt, grad_accum=1, compiled=False):
    torch.cuda.empty_cache()
    if ckpt:
        model.gradient_checkpointing_enable()
    else:
        model.gradient_checkpointing_disable()
    n_params = sum(p.numel() for p in model.parameters())
    n_act, h_attn = active_params(cfg, model)
    span = attention_span(cfg, T)
    flops_tok = 6 * n_act + 6 * h_attn * span
    hw_tok = flops_tok + (2 * n_act + 2 * h_attn * span if ckpt else 0)
    res = dict(system="hf-peer", seq_len=T, checkpointing=ckpt, experts=experts, params=n_params,
               grad_accum=grad_accum, compiled=compiled)
    times = []
    try:
        torch.cuda.reset_peak_memory_stats()
        for s in range(steps):
            batches = [torch.randint(0, cfg.vocab_size, (1, T), device="cuda") for _ in range(grad_accum)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for ids in batches:
                loss = model(input_ids=ids, labels=ids).loss
                (loss / grad_accum).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if s > 0:
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        tok = T * grad_accum
        res.update(step_s=t, tokens_per_s=tok / t, model_tflops=flops_tok * tok / t / 1e12,
                   hardware_tflops=hw_tok * tok / t / 1e12, mfu=flops_tok * tok / t / PEAK,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30, model_state_gib=8 * n_params / 2**30,
                   loss=float(loss))
    except torch.OutOfMemoryError:
        res.update(oom=True, peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        opt.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("seq_len", type=int, nargs="+")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--no-ckpt", action="store_true", help="only without gradient checkpointing")
    ap.add_argument("--ckpt-only", action="store_true", help="only with gradient checkpointing")
    ap.add_argument("--layers", type=int, help="keep the config's first N layers (num_hidden_layers, layer_types)")
    a = ap.parse_args()
    out = open(a.json, "a") if a.json else None
    stop = {False: False, True: False}
    cfg, model, experts = build(a.config, a.layers)  # one model and optimizer for every length (state persists)
    if a.compile:
        for layer in model.model.layers:
            layer.compile()
    variants = [False] if a.no_ckpt else [True] if a.ckpt_only else [False, True]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    for T in a.seq_len:
        for ckpt in variants:
            if stop[ckpt]:
                continue
            r = run(cfg, model, experts, opt, T, a.steps, ckpt, a.grad_accum, a.compile)
            if r.get("oom"):
                stop[ckpt] = True
                print(f"hf-peer T={T:>7} ckpt={int(ckpt)}: out of memory (peak {r['peak_gib']:.1f} GiB)", flush=True)
            else:
                print(f"hf-peer T={T:>7} ckpt={int(ckpt)} compile={int(a.compile)} G={a.grad_accum}: {r['tokens_per_s']:9.0f} tok/s  {r['model_tflops']:6.1f} "
                      f"model TFLOP/s  MFU {100 * r['mfu']:5.1f}%  peak {r['peak_gib']:6.1f} GiB "
                      f"(model state {r['model_state_gib']:.1f})", flush=True)
            if out:
                out.write(json.dumps(r) + "\n")
                out.flush()


if __name__ == "__main__":
    main()
