#!/usr/bin/env python3
"""Summaries for bench/multi_gpu.sh (issue 12): one run's log and metrics, compact.

  summ_multi_gpu.py run OUT NAME GPUS [REF]   one training run: losses (against REF's, the max
                                              relative difference), tokens/s per GPU, MFU, the
                                              plan's projected step against the measured one,
                                              rank 0's live sets (bound vs high-water), every
                                              rank's ep dispatch (rows received per chunk against
                                              R_max, and their bytes), each GPU's peak memory
                                              (nvidia-smi samples) against the plan, the MoE
                                              phases (router + dispatch + experts) per step and
                                              per layer, error lines
  summ_multi_gpu.py smi FILE                  each GPU's peak memory.used in a sample file

Inputs: OUT/NAME.log (the launch's stdout and stderr: rank 0 prints, ranks > 0 are quiet except
their "rank r of W: ep dispatch" lines), OUT/NAME.jsonl (rank 0's metrics.jsonl), OUT/NAME.smi
(nvidia-smi --query-gpu=index,memory.used samples; absent on CPU ranks), OUT/NAME.cfg (the
config's path, for H and L). Steady state: steps >= 3 when there are 3 or more (step 1 pays the
first launch costs and, under --report-memory, step 2 runs with no optimizer update beside it:
README), else the last step.
"""
import json
import os
import re
import sys


def load_steps(path):
    rows = []
    try:
        for line in open(path):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("type", "step") == "step":
                rows.append(r)
    except OSError:
        pass
    return rows


def steady(rows):
    s = [r for r in rows if r.get("step", 0) >= 3]
    return s if s else rows[-1:]


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def smi_peaks(path):
    peaks = {}
    try:
        for line in open(path):
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 2 or not parts[0].isdigit():
                continue
            try:
                peaks[int(parts[0])] = max(peaks.get(int(parts[0]), 0), float(parts[1]))
            except ValueError:
                continue
    except OSError:
        return None
    return peaks or None


def fmt(x, spec="%.4g"):
    return "n/a" if x is None else spec % x


def run(out, name, gpus, ref=None):
    log_path, js = os.path.join(out, name + ".log"), os.path.join(out, name + ".jsonl")
    log = open(log_path, errors="replace").read() if os.path.exists(log_path) else ""
    rows = load_steps(js)
    H = L = None
    try:
        cfg = json.load(open(open(os.path.join(out, name + ".cfg")).read().strip()))
        H, L = cfg.get("hidden_size"), cfg.get("num_hidden_layers")
    except (OSError, ValueError):
        pass
    print("-- %s: %d steps in metrics" % (name, len(rows)))
    for l in log.splitlines():
        if re.search(r"error|Error|ERROR|refused|does not fit|noticed that|Abort|timed out|did not complete", l):
            print("   error line: " + l[:240])
    if not rows:
        return
    losses = [r.get("loss") for r in rows]
    print("   losses: " + " ".join("%.5f" % x for x in losses[:3]) + (" ... %.5f" % losses[-1] if len(losses) > 3 else ""))
    if ref:
        rr = {r["step"]: r for r in load_steps(os.path.join(out, ref + ".jsonl"))}
        d = [(abs(r["loss"] - rr[r["step"]]["loss"]) / abs(rr[r["step"]]["loss"]), r["step"]) for r in rows
             if r["step"] in rr and rr[r["step"]].get("loss")]
        if d:
            worst = max(d)
            print("   loss vs %s: max relative difference %.3e (step %d) over %d steps%s" %
                  (ref, worst[0], worst[1], len(d), "" if worst[0] <= 2e-2 else "  ** above the bf16 tolerance 2e-2 **"))
        else:
            print("   loss vs %s: no common steps" % ref)
    st = steady(rows)
    step_s, mfu = mean([r.get("step_s") for r in st]), mean([r.get("mfu") for r in st])
    # tokens/s over the steady steps as their tokens over their time (a mean of per-step rates
    # disagrees with the mean step time when the steps differ)
    tim = [(r.get("tokens_per_s"), r.get("step_s")) for r in st]
    tim = [(a * b, b) for a, b in tim if a is not None and b]
    tps = sum(a for a, _ in tim) / sum(b for _, b in tim) if tim else None
    print("   steady (steps %s): step %s s, %s tokens/s (%s per GPU over %d), MFU %s" % (
        ",".join(str(r["step"]) for r in st), fmt(step_s), fmt(tps, "%.0f"),
        fmt(tps / gpus if tps else None, "%.0f"), gpus, fmt(100 * mfu if mfu is not None else None, "%.1f%%")))
    m = re.findall(r"^projected step: ([0-9.e+]+) s, ([0-9]+) tokens/s, MFU ([0-9.]+)%", log, re.M)
    if m:
        p = float(m[-1][0])
        print("   plan (train's, per rank): projected step %.4g s, %s tokens/s, MFU %s%%; measured/projected %s" % (
            p, m[-1][1], m[-1][2], fmt(step_s / p if step_s and p else None, "%.3f")))
    pl = re.findall(r"^plan: .*", log, re.M)
    if pl:
        print("   " + pl[0][:300])
    ph = [r.get("phase_ms") for r in st if r.get("phase_ms")]
    if ph:
        moe = mean([p.get("router", 0) + p.get("dispatch", 0) + p.get("experts", 0) for p in ph])
        print("   phases (rank 0, steady, ms/step): " + ", ".join("%s %.1f" % (k, mean([p.get(k, 0) for p in ph])) for k in ph[0]) +
              "; MoE (router+dispatch+experts) %.1f ms/step%s" % (moe, ", %.2f ms per layer" % (moe / L) if L else ""))
    # rank 0's live sets: the last table printed (after the last step)
    tables = re.split(r"^memory: live set .*$", log, flags=re.M)
    if len(tables) > 1:
        last = tables[-1]
        items = re.findall(r"^memory: (.+?)\s+(\d+)\s+(\d+|\(backend\))\s*([0-9.]*%?)\s*$", last, re.M)
        if items:
            print("   rank 0 live sets (bound -> high-water MiB): " + "; ".join(
                "%s %.1f -> %s" % (n.strip(), int(b) / 2**20, ("%.1f" % (int(h) / 2**20)) if h.isdigit() else h) for n, b, h, _ in items))
        dev = re.findall(r"^memory: device in use ([0-9.]+) MiB of ([0-9.]+) MiB \(plan ([0-9.]+) MiB", last, re.M)
        if dev:
            print("   rank 0 device in use %s MiB of %s (plan %s MiB)" % dev[-1])
    # the other ranks' one-line reports (fm_train_metrics.c), the last of each rank
    others = {}
    for rk, body in re.findall(r"^rank (\d+) of \d+: memory \(high-water / bound, B\): (.*)$", log, re.M):
        others[int(rk)] = body
    for rk, body in sorted(others.items()):
        sets = re.findall(r"([a-z ()]+?) (\d+) / (\d+)", body)
        over = [n.strip() for n, h, b in sets if int(h) > int(b)]
        dev = re.search(r"device in use ([0-9.]+) MiB of ([0-9.]+) MiB \(plan ([0-9.]+) MiB\)", body)
        print("   rank %d live sets: %s%s" % (rk, "every high-water <= its bound" if not over else
              "OVER BOUND: " + ", ".join(over), "; device in use %s MiB of %s (plan %s MiB)" % dev.groups() if dev else ""))
    ep = {}
    for rk, w, hi, rmax, sent, llep in re.findall(
            r"rank (\d+) of (\d+): ep dispatch: rows received per chunk high (\d+) of R_max (\d+).*?sent high (\d+); LLEP chunk passes that moved rows (\d+)", log):
        ep[int(rk)] = (int(hi), int(rmax), int(sent), int(llep))
    if ep:
        rb = lambda rows_: (" (%.1f MiB)" % (rows_ * H * 2 / 2**20)) if H else ""
        top = max(ep.items(), key=lambda kv: kv[1][0])
        print("   ep dispatch, last report per rank (rows received per chunk high / R_max; bf16 rows of H): " + "; ".join(
            "r%d %d/%d" % (k, v[0], v[1]) for k, v in sorted(ep.items())))
        print("   peak receive: rank %d, %d rows%s of R_max %d%s; LLEP chunk passes %s" % (
            top[0], top[1][0], rb(top[1][0]), top[1][1], rb(top[1][1]), ",".join(str(v[3]) for _, v in sorted(ep.items()))))
    pk = smi_peaks(os.path.join(out, name + ".smi"))
    if pk:
        plan_mib = re.findall(r"^plan: ([0-9.]+) MiB", log, re.M)
        print("   GPU peak memory.used (nvidia-smi, MiB): " + ", ".join("gpu%d %.0f" % (g, v) for g, v in sorted(pk.items())) +
              ("; plan %s MiB per rank + the CUDA context and NCCL" % plan_mib[0] if plan_mib else ""))


def main():
    if len(sys.argv) >= 5 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] else None)
    elif len(sys.argv) == 3 and sys.argv[1] == "smi":
        print(smi_peaks(sys.argv[2]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
