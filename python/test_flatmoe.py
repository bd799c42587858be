"""The Python binding (python/flatmoe) over libflatmoe.so on a micro config (ctest python_flatmoe).
Exit 77 (skipped) where numpy is not importable. Checks, each against something computed another way:
  - log-probs of every vocabulary entry after one prefix sum to 1 (exp), and their entropy
    -sum p log p equals the library's entropy at that position (fp32: 1e-4);
  - each sequence's first token has log-prob and entropy 0; entropy in [0, log V];
  - SFT steps on one batch lower its loss; a PG step returns finite statistics in range; with
    entropy_coef its loss is the mean -A less c times the mean entropy (ratio 1: on-policy);
  - the routes taken have the shape [N, num_moe_layers, top_k] and distinct ids; replaying them gives
    the same log-probs bit for bit, replaying others changes them; a bad id raises naming it;
  - the top-5 log-probs after a prefix are the 5 largest of that prefix's whole-vocabulary log-probs;
  - a batch over the token budget raises FlatmoeError naming the budget;
  - save, then a --ckpt session gives the same log-probs bit for bit; export_weights reassembled
    equals the saved model.safetensors rounded to bf16 (numpy's own rounding), no bucket over its size;
  - generate is deterministic per seed and its log-probs equal logprobs on prompt + completion;
  - sleep refuses log-probs until wake, after which they are the same bit for bit;
  - a step with a non-finite gradient norm is refused (the weights unchanged); the binding refuses arrays
    a cast would change (int64 ids over int32, float ids, a mask not 0/1), unknown loss/agg/kl names, and
    a closed session; --init-from, save, --ckpt continues bit for bit (the fine-tuning defaults restored);
    --moe-router-bias-update-rate is refused (a session's step does not move the bias); a second session at
    another --threads leaves the first's log-probs bit for bit (each call runs at its session's count)."""
import json
import math
import os
import sys
import tempfile

try:
    import numpy as np
except ImportError:
    print("numpy is not importable: the binding's test is skipped")
    sys.exit(77)

import flatmoe

CFG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 32,
       "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
       "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 64,
       "rope_theta": 10000.0, "rms_norm_eps": 1e-06, "attention_bias": False, "num_experts": 4,
       "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
       "router_aux_loss_coef": 0.01, "initializer_range": 0.2, "tie_word_embeddings": False, "torch_dtype": "float32"}

failed = 0


def read_safetensors(path):
    """{name: float32 array} of an F32 safetensors file (8-byte header length, JSON header, data)."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    hdr = json.loads(raw[8:8 + n])
    out = {}
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        assert v["dtype"] == "F32", v
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(raw[8 + n + a:8 + n + b], np.float32).reshape(v["shape"])
    return out


def bf16_bits(a):
    """fp32 -> bf16 bits, round to nearest even (finite values)."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def check(cond, what):
    global failed
    if not cond:
        failed += 1
        print("FAIL", what)


with tempfile.TemporaryDirectory() as d:
    cfg = os.path.join(d, "config.json")
    with open(cfg, "w") as f:
        json.dump(CFG, f)
    opts = ["--config", cfg, "--seq-len", "16", "--micro-batch", "13", "--threads", "2", "--ce-block-tokens", "32",
            "--ce-block-vocab", "40", "--seed", "5", "--lr", "3e-3", "--warmup", "0", "--quiet", "--logprobs-topk", "5"]
    with flatmoe.Session(*opts) as s:
        info = s.info
        check(info["token_budget"] == 13 * 16 and info["vocab_size"] == 100, f"info {info}")
        V = 100
        # every vocabulary entry after the prefix [7]: 100 sequences of 2 tokens (8 to a row, 13 rows)
        toks = np.stack([np.full(V, 7), np.arange(V)], axis=1).reshape(-1).astype(np.int32)
        lens = np.full(V, 2, np.int64)
        lp, ent = s.logprobs(toks, lens)
        check(lp.dtype == np.float32 and lp.shape == (2 * V,), "shape and dtype")
        check(np.all(lp[0::2] == 0) and np.all(ent[0::2] == 0), "first tokens: 0")
        last = lp[1::2].astype(np.float64)
        total = math.fsum(np.exp(last))
        check(abs(total - 1.0) < 1e-4, f"sum of exp(log p) over the vocabulary: {total}")
        h_ref = -math.fsum(np.exp(last) * last)
        check(np.all(np.abs(ent[1::2] - h_ref) < 1e-4), f"entropy {ent[1]} vs -sum p log p {h_ref}")
        check(0 <= ent[1] <= math.log(V) + 1e-5, f"entropy in [0, log V]: {ent[1]}")
        # top-5 log-probs after the prefix [7]: the 5 largest of the 100 log-probs above, their ids
        lpk, tlp, tid = s.logprobs(toks[:4], np.array([2, 2], np.int64), entropy=False, topk=5)
        order = np.argsort(-last, kind="stable")[:5]
        check(tlp.shape == (4, 5) and tid.dtype == np.int32 and np.all(tid[0::2] == -1), f"top-k shapes {tlp.shape}")
        check(np.array_equal(np.sort(tid[1]), np.sort(order)) and np.allclose(tlp[1], last[order], atol=1e-5),
              f"top-5 {tid[1]} {tlp[1]} vs the full vocabulary's {order} {last[order]}")

        rng = np.random.default_rng(3)
        lens = np.array([16, 9, 7, 12, 4], np.int64)
        n = int(lens.sum())
        toks = rng.integers(0, V, n).astype(np.int32)
        mask = np.ones(n, np.uint8)
        losses = [s.train_step(toks, lens, loss_mask=mask)["loss"] for _ in range(8)]
        check(losses[-1] < losses[0] - 0.05, f"SFT losses on one batch do not fall: {losses}")
        lp0 = s.logprobs(toks, lens, entropy=False)
        adv = rng.normal(size=n).astype(np.float32)
        st = s.train_step(toks, lens, loss_mask=mask, advantages=adv, old_logprobs=lp0 - 0.1, loss="pg",
                          agg="seq-mean-token-mean", clip_high=0.28, clip_dual=3.0, kl="k3", kl_coef=0.01,
                          ref_logprobs=lp0)
        check(all(math.isfinite(v) for v in st.values()), f"finite statistics {st}")
        # the entropy bonus: the same step's loss less c times the mean entropy (token-mean, on-policy ratio 1)
        lpe, ente = s.logprobs(toks, lens)
        inl = np.ones(n, bool)
        inl[np.concatenate([[0], np.cumsum(lens)[:-1]])] = False
        ste = s.train_step(toks, lens, loss_mask=mask, advantages=adv, loss="pg", entropy_coef=0.1)
        want = -float(np.mean(adv[inl].astype(np.float64))) - 0.1 * float(np.mean(ente[inl].astype(np.float64)))
        check(abs(ste["loss"] - want) < 1e-5, f"entropy bonus: loss {ste['loss']} vs {want}")
        check(0 <= st["clip_frac"] <= 1 and st["n_loss_tokens"] == n - len(lens) and st["step"] == 9, f"stats {st}")
        # the routes taken, replayed: the same log-probs bit for bit; other routes change them; a bad id is refused
        check(info["num_moe_layers"] == 2 and info["top_k"] == 2, f"info {info}")
        lp1, routes = s.logprobs(toks, lens, entropy=False, routes=True)
        check(routes.shape == (n, 2, 2) and routes.dtype == np.int32, f"routes shape {routes.shape}")
        check(np.all((routes >= 0) & (routes < 4)) and np.all(routes[..., 0] != routes[..., 1]), "routes: distinct ids")
        lp2 = s.logprobs(toks, lens, entropy=False, routed_experts=routes)
        check(np.array_equal(lp1, lp2), "replay of the routes taken changed the log-probs")
        other = (routes + 1) % 4
        lp3 = s.logprobs(toks, lens, entropy=False, routed_experts=other)
        check(not np.array_equal(lp1, lp3), "replay of other routes left every log-prob unchanged")
        st2 = s.train_step(toks, lens, loss_mask=mask, routed_experts=other)
        check(math.isfinite(st2["loss"]) and st2["step"] == 11, f"a train step under replay: {st2}")
        bad = routes.copy()
        bad[3, 1, 0] = 9
        try:
            s.logprobs(toks, lens, routed_experts=bad)
            check(False, "an expert id out of range was accepted")
        except flatmoe.FlatmoeError as e:
            check("token 3, MoE layer 1, slot 0] is 9" in str(e), f"the bad route is named: {e}")
        try:
            s.logprobs(np.zeros(13 * 16 + 1, np.int32), np.array([16] * 13 + [1], np.int64))
            check(False, "a batch over the budget was accepted")
        except flatmoe.FlatmoeError as e:
            check("token budget of 208" in str(e), f"the budget is named: {e}")
        # save, then a --ckpt session: the same log-probs bit for bit; the export equals the saved
        # model.safetensors rounded to bf16 (nearest even), every tensor, bucket 1 byte under the largest
        run = os.path.join(d, "run")
        ck, steps_taken = s.save(run), s.info["step"]
        check(ck.endswith(f"step_{steps_taken:06d}") and os.path.isfile(os.path.join(ck, "model.safetensors")), f"saved {ck}")
        lp_saved = s.logprobs(toks, lens, entropy=False)
        st_ref = read_safetensors(os.path.join(ck, "model.safetensors"))
        largest = max(2 * a.size for a in st_ref.values())
        pieces = []
        s.export_weights(largest - 1, lambda ps: pieces.append([(p["name"], p["offset"], p["data"].size) for p in ps]))
        check(sum(2 * n for b in pieces for _, _, n in b) == sum(2 * a.size for a in st_ref.values())
              and max(sum(2 * n for _, _, n in b) for b in pieces) <= largest - 1, "bucket sizes")
        w = s.weights_bf16(bucket_bytes=largest - 1)
        check(sorted(w) == sorted(st_ref), "exported names")
        bad = [k for k, a in st_ref.items() if w[k].shape != a.shape or not np.array_equal(w[k], bf16_bits(a))]
        check(not bad, f"exported tensors differ from model.safetensors in bf16: {bad[:3]}")
        # generate: deterministic per seed; log-probs equal logprobs on prompt + completion
        prompts = [np.array([7, 3, 9]), np.array([1]), np.array([50, 51, 52, 53])]
        t1, l1, p1 = s.generate(prompts, max_new=5, temperature=1.2, top_k=20, seed=9)
        t2, l2, p2 = s.generate(prompts, max_new=5, temperature=1.2, top_k=20, seed=9)
        check(np.array_equal(t1, t2) and np.array_equal(p1, p2) and list(l1) == [5, 5, 5], "generate per seed")
        seqs = [np.concatenate([p, t1[i, :l1[i]]]) for i, p in enumerate(prompts)]
        ref = s.logprobs(np.concatenate(seqs), [len(q) for q in seqs], entropy=False)
        offs = np.cumsum([0] + [len(q) for q in seqs])
        got = np.concatenate([ref[offs[i] + len(p):offs[i + 1]] for i, p in enumerate(prompts)])
        check(np.array_equal(got, p1.reshape(-1)), f"generate's log-probs {p1.reshape(-1)[:4]} vs logprobs {got[:4]}")
        s.sleep()
        try:
            s.logprobs(toks, lens)
            check(False, "logprobs while asleep")
        except flatmoe.FlatmoeError as e:
            check("flatmoe_logprobs" in str(e) and "asleep" in str(e), f"asleep, the call named: {e}")
        s.wake()
        check(np.array_equal(s.logprobs(toks, lens, entropy=False), lp_saved), "log-probs after sleep and wake")
    with flatmoe.Session("--ckpt", run, *opts[2:]) as s2:
        check(s2.info["step"] == steps_taken, f"--ckpt step {s2.info['step']}, saved at {steps_taken}")
        check(np.array_equal(s2.logprobs(toks, lens, entropy=False), lp_saved), "--ckpt session's log-probs differ")
        # a step whose gradient overflows (entropy_coef 1e300: finite, its fp32 token weights not) is
        # refused in the library's words, and leaves the weights as they were
        try:
            s2.train_step(toks, lens, entropy_coef=1e300)
            check(False, "a non-finite gradient norm was accepted")
        except flatmoe.FlatmoeError as e:
            check(e.code == 6 and "not updated" in str(e) and "entropy_coef" in str(e) and "checkpoint" not in str(e),
                  f"the non-finite gradient: {e}")
        check(np.array_equal(s2.logprobs(toks, lens, entropy=False), lp_saved), "a refused step changed the weights")
        # the binding refuses what a cast to the C types would change silently
        for what, kw in (("tokens", {"tokens": np.where(np.arange(n) == 2, 2**32 + 5, toks.astype(np.int64))}),
                         ("tokens", {"tokens": toks + 0.5}), ("seq_lens", {"seq_lens": lens.astype(np.float64)}),
                         ("loss_mask", {"loss_mask": np.full(n, 0.5)}), ("loss_mask", {"loss_mask": np.full(n, 256)}),
                         ("routed_experts", {"routed_experts": routes.astype(np.int64) + 2**32}),
                         ("kl", {"kl": "k2"}), ("agg", {"agg": "sum"}), ("loss", {"loss": "ppo"})):
            args = {"tokens": toks, "seq_lens": lens, **kw}
            try:
                s2.train_step(args.pop("tokens"), args.pop("seq_lens"), **args)
                check(False, f"{what} {kw} was accepted")
            except ValueError as e:
                check(str(e).startswith(what + ":") and "expected" in str(e), f"{what}: {e}")
    try:
        s2.logprobs(toks, lens)
        check(False, "a closed session was used")
    except flatmoe.FlatmoeError as e:
        check("closed" in str(e), f"closed: {e}")
    # --init-from, save, --ckpt with the same other options: the fine-tuning defaults it took (--warmup 0,
    # --weight-decay 0, --min-lr 0) come back from the checkpoint, so the run continues bit for bit
    ft = ["--seq-len", "16", "--micro-batch", "13", "--threads", "2", "--ce-block-tokens", "32", "--ce-block-vocab", "40",
          "--lr", "3e-3", "--quiet"]
    with flatmoe.Session("--init-from", ck, *ft) as a:
        for _ in range(2):
            a.train_step(toks, lens)
        lp_two = a.logprobs(toks, lens, entropy=False)
    with flatmoe.Session("--init-from", ck, *ft) as b:
        b.train_step(toks, lens)
        b.save(os.path.join(d, "ft"))
    with flatmoe.Session("--ckpt", os.path.join(d, "ft"), *ft) as c:
        c.train_step(toks, lens)
        check(np.array_equal(c.logprobs(toks, lens, entropy=False), lp_two),
              "--init-from, save, --ckpt, step differs from two steps (the fine-tuning defaults lost at --ckpt?)")
    # two sessions at --threads 2 and 1 (OpenMP's and the BLAS's counts are process-wide; the CPU results depend
    # on them at 4 rows of 32 here: 4.8e-7): each call runs at its own session's count
    two = ["--config", cfg, "--seq-len", "32", "--micro-batch", "4", "--seed", "5", "--quiet"]
    t32 = np.random.default_rng(4).integers(0, 100, 128).astype(np.int32)
    with flatmoe.Session(*two, "--threads", "2") as a:
        lp_a = a.logprobs(t32, [32] * 4, entropy=False)
        with flatmoe.Session(*two, "--threads", "1") as b:
            b.logprobs(t32, [32] * 4, entropy=False)
            check(np.array_equal(a.logprobs(t32, [32] * 4, entropy=False), lp_a),
                  "a session at --threads 1 changed the log-probs of one at --threads 2")
    try:  # a session's step does not move e_score_correction_bias: refused, not ignored
        flatmoe.Session("--config", cfg, "--seq-len", "16", "--moe-router-bias-update-rate", "1e-3", "--quiet")
        check(False, "--moe-router-bias-update-rate was accepted")
    except flatmoe.FlatmoeError as e:
        check(e.code == 7 and "--moe-router-bias-update-rate" in str(e), f"bias update rate: {e}")
    try:
        flatmoe.Session("--config", cfg, "--no-such-flag", "1")
        check(False, "an unknown option was accepted")
    except flatmoe.FlatmoeError as e:
        check(e.code == 1 and "--no-such-flag" in str(e), f"unknown option: {e}")

print("python binding:", "FAILED" if failed else "passed")
sys.exit(1 if failed else 0)
