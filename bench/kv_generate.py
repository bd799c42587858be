"""flatmoe_generate with and without --kv-cache on the CPU (docs/rl.md "Sampling with a KV cache"):
    PYTHONPATH=python FLATMOE_LIB=build/libflatmoe.so OMP_NUM_THREADS=1 python3 bench/kv_generate.py [CONFIG]
Fresh weights of CONFIG (configs/tiny.json), 4 prompts of 32 tokens, 64 new tokens each (greedy, no
stop token), --seq-len 128 --micro-batch 4 --threads 1: the wall time of flatmoe_generate (best of
3 after a warm-up call) in each mode, and whether the two gave the same tokens."""
import os
import sys
import time

import numpy as np

import flatmoe

cfg = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.json")
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 256, 32).astype(np.int32) for _ in range(4)]
res = {}
for kv in (False, True):
    opts = ["--config", cfg, "--seq-len", "128", "--micro-batch", "4", "--threads", "1", "--seed", "1", "--quiet"]
    s = flatmoe.Session(*(opts + (["--kv-cache"] if kv else [])))
    s.generate(prompts, max_new=64, temperature=0)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        toks, lens, _lp = s.generate(prompts, max_new=64, temperature=0)
        best = min(best, time.perf_counter() - t)
    res[kv] = (best, toks)
    s.close()
    print(f"{'--kv-cache' if kv else 'whole prefix'}: {best:.3f} s for 4 x 64 new tokens "
          f"({4 * 64 / best:.0f} tokens/s)")
print(f"speed-up {res[False][0] / res[True][0]:.2f}x; same tokens: {bool(np.array_equal(res[False][1], res[True][1]))}")
