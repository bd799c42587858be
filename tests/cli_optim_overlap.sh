#!/usr/bin/env bash
# The optimizer overlap (train/fm_optim_overlap.h) end to end: `train` with the update overlapped
# with the next forward (the default) gives the same losses, gradient norms, validation losses and
# checkpoint files, bit for bit, as --no-optimizer-overlap — with gradient accumulation, an
# evaluation and a save mid-run (both read the weights while an update may be in flight), the
# bounded operators with recompute, and the streamed AdamW with buckets off any alignment (the
# streamed and the on-device AdamW then give the same files too). $1: flatmoe (the CPU build) or
# flatmoe-cuda (tests/gpu/cli_cuda_overlap.sh runs this script with it).
source "$(dirname "$0")/lib_cli.sh"
cfg="$ROOT/configs/tiny.json"
common=(--config "$cfg" --data "$TEXT" --seq-len 64 --micro-batch 4 --grad-accum 2 --steps 6 --warmup 2
        --lr 3e-3 --eval-every 3 --eval-batches 2 --save-every 3 --quiet)
fields() { sed -E -e 's/,"backend":\{[^}]*\}//g' -e 's/"(tokens_per_s|step_s|elapsed_s|host_syncs|phase_ms)":[^,}]*,?//g' "$1" | grep -v '"type":"header"'; }
same() { # NAME A B: metrics (but timings) and both checkpoints identical
    local name=$1 a=$2 b=$3
    if diff <(fields "$a/metrics.jsonl") <(fields "$b/metrics.jsonl") >/dev/null; then ok
    else bad "$name: metrics differ"; diff <(fields "$a/metrics.jsonl") <(fields "$b/metrics.jsonl") | head -6 >&2; fi
    for s in 000003 000006; do
        for f in model.safetensors optimizer.safetensors; do
            cmp -s "$a/step_$s/$f" "$b/step_$s/$f" && ok || bad "$name: step_$s/$f differs"
        done
    done
}
run() { local out=$1; shift; "$FM" train "${common[@]}" --out "$TMP/$out" "$@" || bad "run $out failed"; }
run on
run off --no-optimizer-overlap
same "overlap vs serial" "$TMP/on" "$TMP/off"
bounded=(--moe-chunk-tokens 64 --ce-block-tokens 128 --ce-block-vocab 100 --recompute 0,2)
run bon "${bounded[@]}"
run boff "${bounded[@]}" --no-optimizer-overlap
same "bounded: overlap vs serial" "$TMP/bon" "$TMP/boff"
off=(--offload-optimizer --offload-optimizer-bucket 1001 --offload-optimizer-slots 2)
run son "${off[@]}"
run soff "${off[@]}" --no-optimizer-overlap
same "streamed AdamW: overlap vs serial" "$TMP/son" "$TMP/soff"
same "streamed vs on-device AdamW, overlapped" "$TMP/son" "$TMP/on"
# the help names the flag; the weights moved (the checks above compare trained models)
"$FM" train --help 2>&1 | grep -q -- "--no-optimizer-overlap" && ok || bad "train --help lacks --no-optimizer-overlap"
cmp -s "$TMP/on/step_000003/model.safetensors" "$TMP/on/step_000006/model.safetensors" &&
    bad "the weights did not change between steps 3 and 6" || ok
finish
