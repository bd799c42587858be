#!/usr/bin/env bash
# `flatmoe plan` for the real configs of the newer families (issue 26's "plan for every new real
# config at 4K, 32K and 128K on one GPU and on 8 and 64 GPUs"): one markdown row per config x
# sequence length x world, from `plan --json` (nothing runs; projections of the planner with the
# H100 calibration table). micro-batch 1, --host-mem-budget 1600GiB per 8-GPU node (200 GiB a rank
# at --world 8 and 64; the whole 1600 GiB for one GPU's host).
#   bash bench/plan_families.sh FLATMOE_BIN [CONFIG...]   (default: the six configs below)
set -uo pipefail
BIN=$(readlink -f "${1:?usage: bench/plan_families.sh FLATMOE_BIN [CONFIG...]}"); shift
cd "$(dirname "$0")/.."
CONFIGS=("$@")
[ ${#CONFIGS[@]} -gt 0 ] || CONFIGS=(configs/deepseek-v3.json configs/moonlight-16b-a3b.json configs/gpt-oss-20b.json
                                     configs/gpt-oss-120b.json configs/glm-4.5-air.json configs/qwen3-235b-a22b.json)
echo "| config | tokens | GPUs | fits | mesh (dp x sp, ep) | device / rank | pinned host / rank | step | tokens/s | MFU |"
echo "|---|---:|---:|---|---|---:|---:|---:|---:|---:|"
for cfg in "${CONFIGS[@]}"; do
    for T in 4096 32768 131072; do
        for W in 1 8 64; do
            world=(); [ "$W" -gt 1 ] && world=(--world "$W")
            "$BIN" plan --config "$cfg" --gpu h100 --micro-batch 1 --seq-len "$T" --host-mem-budget 1600GiB "${world[@]}" \
                --json 2>/dev/null |
            python3 -c '
import json, sys
cfg, T, W = sys.argv[1:4]
try:
    d = json.load(sys.stdin)
except ValueError:
    name = cfg.rsplit("/", 1)[-1][:-5]  # no JSON: plan refused (with --world: no mesh of W ranks fits)
    print("| %s | %dK | %s | **no** (no mesh fits) | | | | | | |" % (name, int(T) // 1024, W)); sys.exit()
m, p = d.get("mesh") or {"dp": 1, "sp": d["sp"], "ep": d["ep"]}, d.get("projected") or {}
gib = lambda b: "%.1f GiB" % (b / 2**30)
fits = "yes" if d["fits"] else "**no**"
step = "%.2f s" % p["step_s"] if p else ""
tps = "{:,.0f}".format(p["tokens_per_s"]) if p else ""
mfu = "%.1f%%" % (100 * p["mfu"]) if p else ""
name = cfg.rsplit("/", 1)[-1][:-5]
print("| %s | %dK | %s | %s | %d x %d, ep %d | %s | %s | %s | %s | %s |" % (name, int(T) // 1024, W, fits, m["dp"], m["sp"],
      m["ep"], gib(d["total_bytes"]), gib(d["host_pinned_bytes"]), step, tps, mfu))
' "$cfg" "$T" "$W"
        done
    done
done
