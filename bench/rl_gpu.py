#!/usr/bin/env python3
"""Issue 29's GPU timings: the log-prob pass and a GRPO step on packed batches, flatmoe (libflatmoe-cuda
through python/flatmoe) against PyTorch (transformers' model of the same config, bf16, SDPA, fused
AdamW: bench/peer_hf.py's peer, plus a plain PyTorch GRPO loss over its logits).

  python3 bench/rl_gpu.py flatmoe CONFIG T [T ...] [--docs 8] [--steps 3] [--json OUT] [-- FLATMOE OPTIONS...]
  python3 bench/rl_gpu.py peer    CONFIG T [T ...] [--docs 8] [--steps 3] [--json OUT] [--compile]

The batch of T tokens is --docs documents of T / docs tokens each (random ids from --seed): flatmoe
packs them into one row of --seq-len T (attention stops at each document's end, positions restart:
docs/rl.md "Batches"); the peer runs them as a [docs, T / docs] batch, the same attention work. The
second half of each document is its response (the loss mask); each document gets one advantage (+1
or -1, GRPO's normalized reward) on all its response tokens.

Per length, each side times (1 warm-up, then the median of --steps - 1):
  logprobs    a forward only: per-token log-probs and entropies of the batch (flatmoe: Session.logprobs,
              through the linear cross-entropy, never N x V; the peer: the logits, then log_softmax,
              gather and the entropy over them, under torch.no_grad, as verl's plain path does);
  train_step  forward, the clipped surrogate (clip 0.2 / 0.28, token-mean over the response tokens,
              old log-probs = the logprobs pass's), backward, AdamW step (flatmoe: Session.train_step
              with loss "pg"; the peer: the same formula over its logits, then AdamW).
An out-of-memory ends that side's lengths ("the longest batch each fits"). flatmoe's state recipe and
knobs are the options after `--` (default: --master-weights bf16-sr --bf16-moments, the peer's 8 bytes
per parameter); its session is opened once per length (the plan is per shape) and closed after.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def make_batch(V, T, docs, seed):
    """tokens int32 [T], seq_lens int64 [docs], loss_mask uint8 [T], advantages float32 [T]."""
    rng = np.random.default_rng(seed)
    L = T // docs
    tokens = rng.integers(0, V, size=docs * L, dtype=np.int64).astype(np.int32)
    seq_lens = np.full(docs, L, np.int64)
    mask = np.zeros(docs * L, np.uint8)
    adv = np.zeros(docs * L, np.float32)
    for d in range(docs):
        mask[d * L + L // 2:(d + 1) * L] = 1
        adv[d * L:(d + 1) * L] = 1.0 if rng.random() < 0.5 else -1.0
    return tokens, seq_lens, mask, adv


def timed(fn, steps):
    times, out = [], None
    for s in range(steps):
        t0 = time.perf_counter()
        out = fn()
        if s > 0:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run_flatmoe(a, opts):
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import flatmoe
    V = json.load(open(a.config))["vocab_size"]
    for T in a.seq_len:
        tokens, seq_lens, mask, adv = make_batch(V, T, a.docs, a.seed)
        res = dict(system="flatmoe", seq_len=T, docs=a.docs, options=" ".join(opts))
        try:
            t0 = time.perf_counter()
            s = flatmoe.Session("--config", a.config, "--backend", a.backend, "--seq-len", str(T), "--micro-batch", "1",
                                "--lr", "1e-6", "--min-lr", "1e-7", "--warmup", "0", *opts)
            res["open_s"] = time.perf_counter() - t0
            t_lp, (lp, ent) = timed(lambda: s.logprobs(tokens, seq_lens, entropy=True), a.steps)
            old = lp.copy()
            t_st, st = timed(lambda: s.train_step(tokens, seq_lens, loss_mask=mask, advantages=adv, old_logprobs=old,
                                                  loss="pg", agg="token-mean", clip_low=0.2, clip_high=0.28), a.steps)
            res.update(logprobs_s=t_lp, train_step_s=t_st, logprobs_tok_s=T / t_lp, train_step_tok_s=T / t_st,
                       mean_logprob=float(lp[mask == 1].mean()), mean_entropy=float(ent[mask == 1].mean()),
                       loss=st["loss"], grad_norm=st["grad_norm"], clip_frac=st["clip_frac"])
            s.close()
        except flatmoe.FlatmoeError as e:
            res.update(error=str(e).splitlines()[0][:300])
        report(a, res)
        if "error" in res:
            break


def run_peer(a):
    import torch
    sys.path.insert(0, HERE)
    from peer_hf import build
    cfg, model, experts = build(a.config)
    if a.compile:
        for layer in model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    V = cfg.vocab_size
    for T in a.seq_len:
        tokens, seq_lens, mask, adv = make_batch(V, T, a.docs, a.seed)
        L = T // a.docs
        ids = torch.from_numpy(tokens.astype(np.int64)).view(a.docs, L).cuda()
        m = torch.from_numpy(mask).view(a.docs, L)[:, 1:].cuda().float()  # the first token has no log-prob
        A = torch.from_numpy(adv).view(a.docs, L)[:, 1:].cuda()
        res = dict(system="torch-peer", seq_len=T, docs=a.docs, experts=experts, compiled=a.compile)

        def logp_ent(logits):  # log p of the next tokens and the entropies, [docs, L - 1] fp32
            lsm = logits[:, :-1].float().log_softmax(-1)
            lp = lsm.gather(-1, ids[:, 1:, None]).squeeze(-1)
            ent = -(lsm.exp() * lsm).sum(-1)
            return lp, ent

        def logprobs():
            with torch.no_grad():
                lp, ent = logp_ent(model(input_ids=ids).logits)
            torch.cuda.synchronize()
            return lp, ent

        def train_step(old):
            lp = model(input_ids=ids).logits
            lp = lp[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            ratio = torch.exp(lp - old)
            surr = torch.maximum(-A * ratio, -A * ratio.clamp(1 - 0.2, 1 + 0.28))  # PPO's clipped surrogate
            loss = (surr * m).sum() / m.sum()  # token-mean over the response tokens
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            return float(loss), float(gn)

        try:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            t_lp, (lp, ent) = timed(logprobs, a.steps)
            res["logprobs_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            old = lp.detach()
            torch.cuda.reset_peak_memory_stats()
            t_st, (loss, gn) = timed(lambda: train_step(old), a.steps)
            res.update(logprobs_s=t_lp, train_step_s=t_st, logprobs_tok_s=T / t_lp, train_step_tok_s=T / t_st,
                       mean_logprob=float(lp[m == 1].mean()), mean_entropy=float(ent[m == 1].mean()), loss=loss,
                       grad_norm=gn, train_peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        except torch.OutOfMemoryError:
            res.update(error="out of memory", peak_gib=torch.cuda.max_memory_allocated() / 2**30)
            opt.zero_grad(set_to_none=True)
        report(a, res)
        if "error" in res:
            break


def report(a, r):
    if "error" in r:
        print(f"{r['system']} T={r['seq_len']:>7}: {r['error']}", flush=True)
    else:
        print(f"{r['system']} T={r['seq_len']:>7}: logprobs {r['logprobs_s'] * 1e3:8.1f} ms ({r['logprobs_tok_s']:8.0f} tok/s)  "
              f"train_step {r['train_step_s'] * 1e3:8.1f} ms ({r['train_step_tok_s']:8.0f} tok/s)  "
              f"mean logp {r['mean_logprob']:.4f} entropy {r['mean_entropy']:.4f} loss {r['loss']:.4g}", flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(r) + "\n")


def main():
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("side", choices=["flatmoe", "peer"])
    ap.add_argument("config")
    ap.add_argument("seq_len", type=int, nargs="+")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--backend", default="cuda", help="flatmoe's build: cuda (libflatmoe-cuda.so) or cpu (a check)")
    ap.add_argument("--compile", action="store_true", help="the peer: torch.compile each decoder layer")
    a = ap.parse_args(argv)
    for T in a.seq_len:
        if T % a.docs:
            ap.error(f"seq_len {T} is not a multiple of --docs {a.docs}")
    if a.side == "flatmoe":
        run_flatmoe(a, extra or ["--master-weights", "bf16-sr", "--bf16-moments"])
    else:
        run_peer(a)


if __name__ == "__main__":
    main()
