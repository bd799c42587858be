#!/usr/bin/env python3
"""GRPO on a verifiable toy task with libflatmoe (docs/rl.md; issue 29): reverse a string of digits.

The policy is a tiny Qwen3-MoE drawn from --seed (no pretraining), over a 16-token vocabulary
(tokens 0-9 are the digits, 10 is '>'). A prompt is D random digits then '>'; the completion is D
tokens sampled by flatmoe's own batched sampler (Session.generate); the reward is the fraction of the
D positions that hold the reversed prompt's digit (1: all right), checked by a plain Python function.
Each iteration samples --group completions of each of --prompts prompts, normalizes the rewards
within each group (GRPO: A = (r - mean_group) / (std_group + 1e-4), Shao et al. 2024, arXiv
2402.03300 §4.1.2; the same A on every completion token), and takes one policy-gradient step on the
clipped surrogate (loss "pg", agg seq-mean-token-mean, clip 0.2 / 0.28) with the sampler's log-probs
as old_logprobs. It prints the mean reward of each iteration.

  PYTHONPATH=python FLATMOE_LIB=build/libflatmoe.so python3 examples/grpo_toy.py

--min-rise R (CI: the ctest python_grpo_toy, CMakeLists.txt): exit 1 unless the mean reward of the last 10 iterations
exceeds that of the first 10 by at least R."""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import flatmoe  # noqa: E402

VOCAB, SEP = 16, 10
CFG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": VOCAB, "hidden_size": 64,
       "intermediate_size": 128, "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 64,
       "rope_theta": 10000.0, "rms_norm_eps": 1e-06, "attention_bias": False, "num_experts": 4,
       "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
       "router_aux_loss_coef": 0.01, "initializer_range": 0.05, "tie_word_embeddings": False,
       "torch_dtype": "float32"}


def reward(prompt, completion, digits):
    """Fraction of the positions of completion that hold the reversed prompt's digits."""
    want = prompt[:digits][::-1]
    got = list(completion[:digits]) + [-1] * (digits - len(completion))
    return sum(int(a == b) for a, b in zip(want, got)) / digits


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--digits", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO's group)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--min-rise", type=float, default=None)
    ap.add_argument("--curve", default=None, help="write the per-iteration mean rewards here (JSON)")
    a = ap.parse_args()
    D = a.digits
    seq = 2 * D + 1
    T = 2 * seq + 2  # two sequences to a row
    n_seqs = a.prompts * a.group
    rows = (n_seqs + 1) // 2
    rng = np.random.default_rng(a.seed)
    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "config.json")
        with open(cfg, "w") as f:
            json.dump(CFG, f)
        s = flatmoe.Session("--config", cfg, "--seq-len", str(T), "--micro-batch", str(rows), "--threads",
                            str(a.threads), "--seed", str(a.seed), "--lr", str(a.lr), "--warmup", "0", "--steps",
                            str(a.iters), "--min-lr", str(a.lr), "--grad-clip", "1.0", "--ce-block-tokens", "64",
                            "--ce-block-vocab", str(VOCAB), "--quiet")
        curve = []
        t0 = time.time()
        for it in range(a.iters):
            base = rng.integers(0, 10, (a.prompts, D))
            prompts = [np.append(p, SEP) for p in base for _ in range(a.group)]
            toks, lens, lp = s.generate(prompts, max_new=D, temperature=a.temperature, seed=a.seed * 100003 + it)
            r = np.array([reward(p, toks[i, :lens[i]], D) for i, p in enumerate(prompts)])
            g = r.reshape(a.prompts, a.group)
            adv = ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-4)).reshape(-1)
            seqs = [np.concatenate([p, toks[i, :lens[i]]]) for i, p in enumerate(prompts)]
            mask = np.concatenate([np.r_[np.zeros(len(p)), np.ones(lens[i])] for i, p in enumerate(prompts)])
            A = np.concatenate([np.full(len(q), adv[i]) for i, q in enumerate(seqs)])
            old = np.concatenate([np.r_[np.zeros(len(p)), lp[i, :lens[i]]] for i, p in enumerate(prompts)])
            st = s.train_step(np.concatenate(seqs), [len(q) for q in seqs], loss_mask=mask, advantages=A,
                              old_logprobs=old, loss="pg", agg="seq-mean-token-mean", clip_low=0.2, clip_high=0.28)
            curve.append(float(r.mean()))
            print(f"iter {it + 1:4d}  reward {r.mean():.3f}  solved {np.mean(r == 1):.3f}  entropy {st['entropy']:.3f}  "
                  f"grad_norm {st['grad_norm']:.3f}  {time.time() - t0:6.1f} s", flush=True)
        s.close()
    k = min(10, len(curve) // 2)
    first, last = float(np.mean(curve[:k])), float(np.mean(curve[-k:]))
    print(f"mean reward: first {k} iterations {first:.3f}, last {k} {last:.3f}, rise {last - first:+.3f} "
          f"({time.time() - t0:.1f} s)")
    if a.curve:
        with open(a.curve, "w") as f:
            json.dump({"rewards": curve, "first": first, "last": last, "args": vars(a)}, f)
    if a.min_rise is not None and last - first < a.min_rise:
        print(f"FAIL: the mean reward rose by {last - first:.3f}, under --min-rise {a.min_rise}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
