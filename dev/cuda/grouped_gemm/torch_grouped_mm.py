#!/usr/bin/env python3
"""torch._grouped_mm at the grouped GEMM lab's shapes (grouped_gemm.cu's cases, the same row counts:
the same xorshift64 stream), printed in the lab's table format, TFLOP/s = 2*R*in*out / median time.

Products as in gg_common.cuh, W [E, out, in]: fwd y = x W^T (_grouped_mm(x, W.transpose(-2, -1),
offs)), dx = dy W (_grouped_mm(dy, W, offs)), dW = dy^T x per group (_grouped_mm(dy.t(), x, offs):
a fresh dW, not accumulated as the lab's dW += does), and fwd+bwd = autograd over the forward
(torch.autograd.grad: one forward and both gradients, the issue's "forward+backward" measurement).
Edge cases are left out (timing only). Run: python3 dev/cuda/grouped_gemm/torch_grouped_mm.py [LAB...]
With LAB (the lab's table, e.g. gg_lab.txt; several are merged cell by cell), each row is the lab's row plus a torch column and
"ours/torch" (the best of the sync-free versions v1, v2.*, v4 over torch), and with a v3 column "v3/ours"
(the FP8 GEMM over that best bf16 one); without it, torch alone.
Environment: GG_CASES (substring), GG_ITERS (20)."""
import os
import sys
import torch

ITERS = max(1, int(os.environ.get("GG_ITERS", "20")))
M64 = (1 << 64) - 1
state = [0x1234567]


def rng():
    s = state[0]
    s ^= (s << 13) & M64
    s ^= s >> 7
    s ^= (s << 17) & M64
    state[0] = s
    return s


def rnd(lo, hi):
    return lo + rng() % (hi - lo) if hi > lo else lo


def cases():
    E, out = 64, []
    for e in range(E):  # grouped_gemm.cu's empty-groups case draws first
        if not (e % 3 == 0 or e == E - 1):
            rnd(1, 700)
    for avg in (256, 512, 1024, 2048, 4096):
        out.append((f"uniform-{avg}", avg, [avg] * E))
        out.append((f"skew-{avg}", avg, [rnd(avg // 2, 3 * avg // 2) for _ in range(E)]))
        rest = E * avg // 2
        q = rest // (E - 1)
        out.append((f"hot-{avg}", avg, [E * avg // 2 if e == 5 else rnd(q // 2, 3 * q // 2) for e in range(E)]))
    return out


def timed(fn):
    for _ in range(2):
        fn()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(ITERS + 1)]
    ev[0].record()
    for i in range(ITERS):
        fn()
        ev[i + 1].record()
    torch.cuda.synchronize()
    ms = sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(ITERS))
    return ms[ITERS // 2]


def read_lab(paths):
    """The lab's table from one or more lab outputs (several: one run per version after a crash;
    a cell is taken from the first file where it is not "-"): header columns and
    {(case, prj, product): line}."""
    cols, rows = None, {}
    for path in paths:
        try:
            lines = open(path).read().splitlines()
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if not f or line.startswith("#") or line.startswith("FAIL"):
                continue
            if f[0] == "case":
                cols = cols or f
                continue
            if not cols or len(f) != len(cols):
                continue
            key = (f[0], f[1], f[2])
            if key in rows:
                old = rows[key].split()
                f = [o if o != "-" else n for o, n in zip(old, f)]
            rows[key] = f"{f[0]:<13} {f[1]:<3} {f[2]:<7} {f[3]:>6} {f[4]:>8}" + "".join(f" {c:>7}" for c in f[5:])
    return cols, rows


def emit(lab, name, proj, prod, avg, R, cell, tf):
    cols, rows = lab
    if cols is None:
        print(f"{name:<13} {proj:<3} {prod:<7} {avg:>6} {R:>8} {cell}", flush=True)
        return
    line = rows.get((name, proj, prod))
    if line is None:
        line = f"{name:<13} {proj:<3} {prod:<7} {avg:>6} {R:>8}" + "".join(f" {'-':>7}" for _ in cols[5:])
    ours, fp8 = [], None
    for c, v in zip(cols, line.split()):
        try:
            if c.startswith("v1") or c.startswith("v2") or c.startswith("v4"):
                ours.append(float(v))
            elif c == "v3":
                fp8 = float(v)
        except ValueError:
            pass
    ratio = f"{max(ours) / tf:7.2f}" if ours and tf else f"{'-':>7}"
    if "v3" in cols:  # the FP8 GEMM over the best bf16 one (the target: >= 1.4 from 2,048 rows)
        ratio += f" {fp8 / max(ours):7.2f}" if ours and fp8 else f" {'-':>7}"
    if line.split()[4] != str(R):  # the lab had other row counts: the comparison is void
        ratio += " R-mismatch"
    print(f"{line} {cell} {ratio}", flush=True)


def main():
    gm = torch._grouped_mm
    dev = torch.device("cuda")
    lab = read_lab(sys.argv[1:]) if len(sys.argv) > 1 else (None, {})
    print(f"# torch._grouped_mm on {torch.cuda.get_device_name()} (torch {torch.__version__}); "
          f"TFLOP/s = 2*R*in*out / median time of {ITERS} calls; torch's dW is a fresh tensor, ours dW +=")
    if lab[0] is None:
        print(f"{'case':<13} {'prj':<3} {'product':<7} {'avg':>6} {'R':>8} {'torch':>7}")
    else:
        print(" ".join(f"{c:>7}" if i >= 5 else c for i, c in enumerate(lab[0])) + f" {'torch':>7} {'ours/t':>7}"
              + (f" {'v3/ours':>7}" if "v3" in lab[0] else ""))
    filt = os.environ.get("GG_CASES", "")
    H, I = 2048, 1024
    for name, avg, counts in cases():
        if filt and filt not in name:
            continue
        R = sum(counts)
        offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
        for proj, fin, fout in (("gu", H, I), ("dn", I, H)):
            x = torch.randn(R, fin, device=dev, dtype=torch.bfloat16)
            W = torch.randn(len(counts), fout, fin, device=dev, dtype=torch.bfloat16) * 0.02
            dy = torch.randn(R, fout, device=dev, dtype=torch.bfloat16)
            flops = 2.0 * R * fin * fout
            prods = (
                ("fwd", flops, lambda: gm(x, W.transpose(-2, -1), offs=offs)),
                ("dx", flops, lambda: gm(dy, W, offs=offs)),
                ("dW", flops, lambda: gm(dy.t(), x, offs=offs)),
            )
            xg, Wg = x.detach().requires_grad_(True), W.detach().requires_grad_(True)

            def fwd_bwd():
                y = gm(xg, Wg.transpose(-2, -1), offs=offs)
                return torch.autograd.grad(y, (xg, Wg), dy)

            for prod, fl, fn in prods + (("fwd+bwd", 3 * flops, fwd_bwd),):
                tf = None
                try:
                    tf = fl / (timed(fn) * 1e-3) / 1e12
                    cell = f"{tf:7.1f}"
                except Exception as exc:  # an unsupported layout or shape: say so, go on
                    cell = f"{'n/a':>7}"
                    print(f"# {name} {proj} {prod}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                emit(lab, name, proj, prod, avg, R, cell, tf)
            del x, W, dy, xg, Wg


if __name__ == "__main__":
    main()
