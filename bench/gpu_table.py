#!/usr/bin/env python3
"""The GPU benchmark's table (bench/run_gpu.sh writes OUTDIR; this prints it as Markdown for
bench/RESULTS.md).

    python3 bench/gpu_table.py OUTDIR [PEAK_TFLOPS]

Reads OUTDIR/fm-<T>.jsonl and fm-<T>.log (flatmoe-cuda train: metrics per step, the plan line,
"flops per token", the --report-memory table) and OUTDIR/peer.jsonl (bench/peer_hf.py). For each
sequence length and system: the median tokens/s of the steps after the first, model and hardware
TFLOP/s (hardware includes recomputed forwards), MFU against PEAK_TFLOPS (default 989, the H200's
dense bf16 peak), the memory (flatmoe: its plan and the device in use; the peer: torch's peak),
model state and the rest; then flatmoe's high-water mark per live set against its plan. The peer
at each length is the faster of its runs with and without gradient checkpointing; "vs peer" is
flatmoe's tokens/s over that.
"""
import glob
import json
import os
import re
import statistics
import sys

GIB = 1024.0 ** 3


def flatmoe_runs(outdir):
    runs = {}
    for path in glob.glob(os.path.join(outdir, "fm-*.jsonl")):
        name = re.search(r"fm-(\d+)\.jsonl$", path)
        if not name:  # not a run of run_gpu.sh (fm-<T>.jsonl)
            continue
        T = int(name.group(1))
        steps = [json.loads(l) for l in open(path) if l.strip()]
        steps = [s for s in steps if "tokens_per_s" in s]
        if not steps:
            continue
        timed = [s for s in steps if s["step"] > 1] or steps
        r = {"T": T, "tps": statistics.median(s["tokens_per_s"] for s in timed), "n": len(timed)}
        log = os.path.join(outdir, f"fm-{T}.log")
        text = open(log).read() if os.path.exists(log) else ""
        m = re.search(r"^flops per token: model ([0-9.e+]+), hardware ([0-9.e+]+)", text, re.M)
        if m:
            r["fl_model"], r["fl_hw"] = float(m.group(1)), float(m.group(2))
        m = re.search(r"^plan: ([0-9.]+) MiB = model state ([0-9.]+).*?; (recompute .*)$", text, re.M)
        if m:
            r["plan_gib"], r["state_gib"], r["knobs"] = float(m.group(1)) / 1024, float(m.group(2)) / 1024, m.group(3)
        m = re.search(r"^memory: device in use ([0-9.]+) MiB", text, re.M)
        if m:
            r["device_gib"] = float(m.group(1)) / 1024
        sets = re.findall(r"^memory: (\S.*?)\s+(\d+)\s+(\d+)\s+([0-9.]+)%$", text, re.M)
        r["sets"] = {}
        for name, bound, hw, _ in sets:  # the last report wins
            r["sets"][name.strip()] = (int(bound), int(hw))
        runs[T] = r
    return runs


def peer_runs(outdir):
    path = os.path.join(outdir, "peer.jsonl")
    best = {}
    if not os.path.exists(path):
        return best
    for l in open(path):
        if not l.strip():
            continue
        p = json.loads(l)
        if "tokens_per_s" not in p or not p.get("tokens_per_s"):
            continue
        T = p["seq_len"]
        if T not in best or p["tokens_per_s"] > best[T]["tokens_per_s"]:
            best[T] = p
    return best


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: gpu_table.py OUTDIR [PEAK_TFLOPS]")
    outdir = sys.argv[1]
    if not os.path.isdir(outdir):
        sys.exit(f"gpu_table.py: {outdir} is not a folder; give bench/run_gpu.sh's OUTDIR")
    try:
        peak = float(sys.argv[2]) * 1e12 if len(sys.argv) > 2 else 989e12
    except ValueError:
        sys.exit(f"gpu_table.py: PEAK_TFLOPS must be a number (e.g. 989), found '{sys.argv[2]}'")
    fm, peer = flatmoe_runs(outdir), peer_runs(outdir)
    if not fm and not peer:
        sys.exit(f"gpu_table.py: {outdir} holds no fm-<T>.jsonl and no peer.jsonl (was bench/run_gpu.sh run with OUTDIR={outdir}?)")
    print("| T | system | knobs | tokens/s | vs peer | model TFLOP/s | hw TFLOP/s | MFU | memory | model state | beyond |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for T in sorted(set(fm) | set(peer)):
        p = peer.get(T)
        if p:
            print(f"| {T // 1024}K | peer | {'ckpt' if p['checkpointing'] else 'no ckpt'} | {p['tokens_per_s']:,.0f} | "
                  f"| {p['model_tflops']:.1f} | {p['hardware_tflops']:.1f} | {100 * p['mfu']:.1f}% | "
                  f"{p['peak_gib']:.1f} GiB | {p['model_state_gib']:.1f} | {p['peak_gib'] - p['model_state_gib']:.1f} |")
        r = fm.get(T)
        if r:
            vs = f"{r['tps'] / p['tokens_per_s']:.2f}x" if p else "peer n/a"
            mt = r["tps"] * r.get("fl_model", 0) / 1e12
            ht = r["tps"] * r.get("fl_hw", 0) / 1e12
            mem = f"{r.get('plan_gib', 0):.1f} GiB plan, {r.get('device_gib', 0):.1f} device"
            st = r.get("state_gib", 0)
            print(f"| {T // 1024}K | flatmoe | {r.get('knobs', '')} | {r['tps']:,.0f} | {vs} | {mt:.1f} | {ht:.1f} | "
                  f"{100 * mt * 1e12 / peak:.1f}% | {mem} | {st:.1f} | {r.get('plan_gib', 0) - st:.1f} |")
    print()
    print("flatmoe high-water mark per live set against its plan (--report-memory):")
    print()
    if not fm:
        return
    names = list(next(iter(fm.values()))["sets"].keys())
    print("| T | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for T in sorted(fm):
        sets = fm[T]["sets"]
        cells = [f"{hw / GIB:.2f}/{b / GIB:.2f} GiB ({100 * hw / b:.0f}%)" if b else "-" for b, hw in sets.values()]
        print(f"| {T // 1024}K | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
