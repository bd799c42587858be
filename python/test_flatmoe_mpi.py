"""python/flatmoe across ranks (tests/mpi_capi.sh python): run as
    [mpirun -np W] python3 python/test_flatmoe_mpi.py OUT
Every rank opens the same Session (the binding hands the launcher's variables over, and the library
initializes MPI: no mpi4py here), takes its share of one batch of 8 packed sequences at
--micro-batch 4/W, and writes OUT/py_rank<q>.txt: its log-probs under their global token index, then
the statistics of one SFT and one PG step (the global terms, the same on every rank). The module
finalizes MPI at exit (flatmoe.finalize: the library initialized it); mpirun fails the run when a
rank exits without finalizing. The script compares W ranks with one rank. At W > 1, a batch the binding
refuses on one rank only (ValueError) makes the others raise FlatmoeError ("1 of the ranks refused")
instead of waiting in the collective."""
import os
import sys

import numpy as np

import flatmoe

out = sys.argv[1]
W = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
s = flatmoe.Session("--config", os.path.join(root, "tests/data/micro.json"), "--seq-len", "32", "--micro-batch",
                    str(4 // W), "--seed", "7", "--lr", "3e-3", "--warmup", "0", "--threads", "1", "--quiet",
                    "--ce-block-tokens", "16", "--ce-block-vocab", "64")
info = s.info
assert info["n_ranks"] == W, info
q = info["rank"]
lens = np.array([20, 12, 16, 16, 25, 7, 10, 22], np.int64)
rng = np.random.default_rng(3)
tokens = rng.integers(0, 256, lens.sum()).astype(np.int32)
adv_seq = rng.uniform(-1, 1, len(lens)).astype(np.float32)
s0, s1 = 8 * q // W, 8 * (q + 1) // W
t0, t1 = int(lens[:s0].sum()), int(lens[:s1].sum())
mine, my_lens = tokens[t0:t1], lens[s0:s1]
mask = np.concatenate([(np.arange(n) >= 4).astype(np.uint8) for n in my_lens])
adv = np.concatenate([np.full(n, adv_seq[s0 + i], np.float32) for i, n in enumerate(my_lens)])
lp, ent = s.logprobs(mine, my_lens)
st1 = s.train_step(mine, my_lens, loss_mask=mask)
st2 = s.train_step(mine, my_lens, loss_mask=mask, advantages=adv, old_logprobs=lp, loss="pg", agg="seq-mean-token-sum")
with open(os.path.join(out, f"py_rank{q}.txt"), "w") as f:
    for t, v in enumerate(lp):
        f.write(f"lp {t0 + t} {v:.9g}\n")
    for k, st in ((1, st1), (2, st2)):
        f.write(f"stats {k} {st['loss']:.17g} {st['grad_norm']:.17g} {st['n_loss_tokens']} {st['n_loss_seqs']}\n")
if W > 1:  # a batch the binding refuses on the last rank only (a mask of 0.5): every rank raises, none waits
    bad = mask.astype(np.float32) * (0.5 if q == W - 1 else 1.0)
    try:
        s.train_step(mine, my_lens, loss_mask=bad)
        raise SystemExit(f"rank {q}: a refused batch stepped")
    except ValueError as e:
        assert q == W - 1 and "loss_mask" in str(e), (q, e)
    except flatmoe.FlatmoeError as e:
        assert q != W - 1 and "1 of the" in str(e), (q, e)
    s.logprobs(mine, my_lens)  # the next call runs
s.close()
print(f"test_flatmoe_mpi rank {q} of {W}: ok")
