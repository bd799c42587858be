#!/usr/bin/env python3
"""Golden values for tests/test_attn.c: RoPE inverse frequencies and attention factors of the
rope types flatmoe builds (model/fm_rope.h), computed in fp64 from transformers' formulas
(modeling_rope_utils.py: _compute_default_rope_parameters, _compute_linear_scaling_rope_parameters,
_compute_yarn_parameters, written out again here with the math module, no torch). Not needed to
build or test: its output is pasted into the C test as constants.

    python3 tools/rope_golden.py
"""
import math


def yarn(dim, base, factor, omax, beta_fast=32, beta_slow=1, mscale=None, mscale_all_dim=None,
         attention_factor=None, truncate=True):
    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def corr_dim(nrot):
        return dim * math.log(omax / (nrot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    inv = []
    for i in range(dim // 2):
        pos_freq = base ** (2 * i / dim)
        extrap, interp = 1.0 / pos_freq, 1.0 / (factor * pos_freq)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrap_factor = 1 - ramp
        inv.append(interp * (1 - extrap_factor) + extrap * extrap_factor)
    return inv, attention_factor


CASES = {
    # Qwen3's long-context recipe: rope_scaling {"rope_type": "yarn", "factor": 4.0,
    # "original_max_position_embeddings": 32768}, head_dim 128, rope_theta 1e6
    "qwen3": dict(dim=128, base=1e6, factor=4.0, omax=32768),
    # DeepSeek-V3's: factor 40, original 4096, beta 32/1, mscale = mscale_all_dim = 1.0, rope dim 64, theta 10000
    "deepseek": dict(dim=64, base=10000.0, factor=40.0, omax=4096, mscale=1.0, mscale_all_dim=1.0),
    # mscale != mscale_all_dim, truncate false, small dims (the ramp inside [0, dim/2))
    "mscale": dict(dim=16, base=10000.0, factor=8.0, omax=64, beta_fast=16, beta_slow=2, mscale=0.707,
                   mscale_all_dim=1.0, truncate=False),
}

if __name__ == "__main__":
    for name, kw in CASES.items():
        inv, af = yarn(**kw)
        print(f"{name}: attention_factor {af!r}")
        for i in range(len(inv)):
            print(f"  inv_freq[{i}] = {inv[i]!r}")
