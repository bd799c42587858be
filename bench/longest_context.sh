#!/usr/bin/env bash
# Longest context (tokens, micro-batch 1) whose plan fits a budget, found by bisection over
# `flatmoe plan`: plain twins (no recompute, unchunked MoE, plain logits) against the bounded
# operators chosen by the planner. train allocates exactly the plan (asserted at start-up), so
# the plan is the run's peak.
#   bench/longest_context.sh BUILD_DIR CONFIG BUDGET [THREADS]
set -euo pipefail
FM=$1/flatmoe; cfg=$2; budget=$3; threads=${4:-2}
fits() { # $1 seq-len, rest: flags
    local T=$1; shift
    "$FM" plan --config "$cfg" --seq-len "$T" --device-mem "$budget" --threads "$threads" --json "$@" 2>/dev/null | grep -q '"fits":true'
}
longest() {
    local lo=1 hi=1
    while fits $((hi * 2)) "$@"; do hi=$((hi * 2)); [ $hi -ge 268435456 ] && break; done
    lo=$hi; hi=$((hi * 2))
    while [ $((hi - lo)) -gt 1 ]; do local mid=$(((lo + hi) / 2)); if fits $mid "$@"; then lo=$mid; else hi=$mid; fi; done
    echo $lo
}
plain=$(longest --recompute none --moe-chunk-tokens 0 --ce-block-tokens 0 --ce-block-vocab 0)
bounded=$(longest)
echo "longest context in $budget ($cfg, micro-batch 1): plain twins $plain tokens; bounded operators (chosen) $bounded tokens"
"$FM" plan --config "$cfg" --seq-len "$bounded" --device-mem "$budget" --threads "$threads" | sed -n '2p;/^total/p'
