#!/usr/bin/env python3
"""A many-rank libflatmoe session against one rank (tests/mpi_capi.sh):
    python3 tests/capi_mpi_compare.py REF RUN
Each folder holds rank<q>.txt (tests/test_capi_mpi.c: values under their global token index),
ckpt/step_000002/model.safetensors (fp32) and export.idx / export.bin (rank 0's collective export).
Tolerances, and why:
 - log-probs and entropies before any step (lp0, ent0): 2e-5 absolute. The same weights and the same
   sequences, but each rank's rows are other rows of the GEMMs (fewer of them), so the fp32 sums
   may run in another order (BLAS kernels by row count): a few ulps of values of size ~5.
 - after two steps (lp2): 1e-4 absolute: the weights then differ by the fp32 noise of the summed
   gradients (below).
 - loss terms and statistics: 1e-5 relative (fp64 sums of those fp32 log-probs, in another order);
   loss-token and sequence counts: exactly (the global denominators: a count that is one rank's
   would halve them).
 - gradient norm: 1e-3 relative (tests/mpi_compare.py's bound and reason: a router tie may flip);
   a gradient scaled by one rank's counts moves it by far more.
 - every saved fp32 tensor after two steps: within 5e-4 of its largest value (tests/mpi_train.sh's
   bound for the summed-gradient noise through AdamW).
 - each run's export reassembled: its own model.safetensors rounded to bf16 (nearest even), bit
   for bit. Prints a verdict; exits 1 on any difference."""
import glob, json, struct, sys
import array

ref, run = sys.argv[1], sys.argv[2]
ok = True


def fail(msg):
    global ok
    ok = False
    print("FAIL: " + msg)


def lines(d):
    vals, stats = {}, {}
    files = sorted(glob.glob(d + "/rank*.txt"))
    if not files: fail(f"{d}: no rank*.txt")
    for fn in files:
        for ln in open(fn):
            p = ln.split()
            if p[0] == "stats":
                stats.setdefault(int(p[1]), []).append([float(x) for x in p[2:10]] + [int(p[10]), int(p[11])])
            else:
                vals[(p[0], int(p[1]))] = float(p[2])
    return vals, stats


va, sa = lines(ref)
vb, sb = lines(run)
if set(va) != set(vb): fail(f"the tokens differ: {len(va)} values vs {len(vb)}")
worst = {}
for key, x in va.items():
    if key not in vb: continue
    tol = 1e-4 if key[0] == "lp2" else 2e-5
    d = abs(x - vb[key])
    worst[key[0]] = max(worst.get(key[0], 0.0), d)
    if d > tol: fail(f"{key[0]} token {key[1]}: {vb[key]!r} vs one rank's {x!r} (|d| {d:.2e} > {tol})")
names = ["loss", "pg_loss", "kl", "entropy", "ratio_mean", "clip_frac", "tis_mean", "grad_norm"]
for step in (1, 2):
    if step not in sa or step not in sb: fail(f"step {step}: no stats"); continue
    r = sa[step][0]
    for q, s in enumerate(sb[step]):  # every rank reports the global terms
        for i, n in enumerate(names):
            tol = 1e-3 if n == "grad_norm" else 1e-5
            rel = abs(s[i] - r[i]) / max(abs(r[i]), 1e-12)
            worst[n] = max(worst.get(n, 0.0), rel)
            if rel > tol: fail(f"step {step} rank {q}: {n} {s[i]!r} vs one rank's {r[i]!r} ({rel:.2e} > {tol})")
        if s[8:] != r[8:]: fail(f"step {step} rank {q}: loss tokens, sequences {s[8:]} vs one rank's {r[8:]}")


def tensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]; hdr = json.loads(f.read(n)); data = f.read()
    out = {}
    for k, v in hdr.items():
        if k == "__metadata__": continue
        s, e = v["data_offsets"]; t = array.array("f"); t.frombytes(data[s:e]); out[k] = t
    return out


ta = tensors(ref + "/ckpt/step_000002/model.safetensors")
tb = tensors(run + "/ckpt/step_000002/model.safetensors")
if set(ta) != set(tb): fail(f"checkpoint tensor names differ: {sorted(set(ta) ^ set(tb))}")
tw = 0.0
for k in ta:
    if k not in tb: continue
    scale = max(max(abs(v) for v in ta[k]), 1e-30)
    d = max(abs(a - b) for a, b in zip(ta[k], tb[k])) / scale
    tw = max(tw, d)
    if d > 5e-4: fail(f"tensor {k}: differs by {d:.2e} of its scale (> 5e-4)")


def bf16(x):  # fp32 -> bf16 bits, round to nearest even (fm_f32_to_bf16)
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16 & 0xFFFF


for d, t in ((ref, ta), (run, tb)):
    got = {}
    with open(d + "/export.bin", "rb") as fb:
        for ln in open(d + "/export.idx"):
            name, off, nb = ln.split(); off, nb = int(off), int(nb)
            got.setdefault(name, {})[off] = fb.read(nb)
    if set(got) != set(t): fail(f"{d}: the export's names differ from the checkpoint's"); continue
    for name, pieces in got.items():
        blob = b"".join(pieces[o] for o in sorted(pieces))
        want = struct.pack(f"<{len(t[name])}H", *[bf16(v) for v in t[name]])
        if blob != want: fail(f"{d}: export of {name} differs from the checkpoint rounded to bf16")
print("capi np 2 vs one rank: worst " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())) +
      f", tensors {tw:.2e} of scale: " + ("ok" if ok else "FAILED"))
sys.exit(0 if ok else 1)
