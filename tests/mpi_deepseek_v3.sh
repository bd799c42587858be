#!/usr/bin/env bash
# deepseek_v3 (multi-head latent attention, model/fm_mla.h) across ranks, as ctest runs it:
#   bash tests/mpi_deepseek_v3.sh MPIEXEC FLATMOE
# 20 steps of tests/data/deepseek_v3_tiny.json (q_lora_rank, interleaved RoPE, YaRN with
# mscale_all_dim, a dense layer 0, shared experts, the sigmoid router with groups, one MTP layer)
# against one rank at --micro-batch 4: np 2 replicas, np 2
# --ep 2 (the experts split, MLA's weights replicated like every attention weight), np 2 --sp 2
# (Ulysses: the assembled q', k', v' of head dim qk_nope + qk_rope head-sharded by the plain
# attention's all-to-alls), np 2 --zero 1 and np 2 --zero 3 --ep 2 (MLA's weights sharded with their
# layer's group); and tests/data/deepseek_v3_tiny_noq.json (q_lora_rank
# null, rotate_half RoPE) at np 2 --ep 2 --sp 2 (np 4 would oversubscribe CI's two cores further).
# Losses to 1e-6, gradient norms and tensors as tests/mpi_compare.py's defaults (tests/mpi_train.sh
# says why), up to a routing flip: every step logs its expert counts, and where a near-tie of the
# router picks another expert under the ranks' summation order (the noq --ep 2 --sp 2 run at step 12
# under OpenBLAS's Haswell kernels), mpi_compare.py holds the steps before it to those tolerances and
# compares nothing after it. --eval-every 5 so that a flip after step 5 leaves a validation loss to
# compare. Without --moe-router-bias-update-rate (tests/mpi_glm4.sh covers it across ranks): with
# it, the bias's +-0.01 moves turned a near-tie of the router at step 20's evaluation into a
# validation loss 1.44e-5 off one rank's at np 2 (replicas, --sp 2, --zero 1 alike; --ep 2 passed),
# while every training loss agreed to 1e-6.
set -u
source "$(dirname "$0")/lib_mpi.sh"
mpi_tmp mpi-dsv3
for cfg in deepseek_v3_tiny deepseek_v3_tiny_noq; do
    COMMON=(--config "$ROOT/tests/data/$cfg.json" --data "$TEXT" --seq-len 32 --steps 20 --warmup 2 --lr 3e-3
            --eval-every 5 --eval-batches 2 --threads 1 --quiet --expert-counts-every 1)
    "$FM" train "${COMMON[@]}" --micro-batch 4 --out "$TMP/$cfg-one" >/dev/null || bad "$cfg: one-rank run failed"
    runs=("ep2:--ep 2" "sp2:--sp 2 --micro-batch 4" "rep:" "zero1:--zero 1" "zero3:--zero 3 --ep 2")
    [ "$cfg" = deepseek_v3_tiny_noq ] && runs=("epsp:--ep 2 --sp 2 --micro-batch 4")
    for run in "${runs[@]}"; do
        name=${run%%:*}; flags=(${run#*:})
        mb=(--micro-batch 2)
        [[ " ${flags[*]} " == *" --sp "* ]] && mb=()
        mpi 2 train "${COMMON[@]}" "${mb[@]}" "${flags[@]}" --out "$TMP/$cfg-$name" >/dev/null ||
            bad "$cfg: np 2 ${flags[*]} failed"
        compare "$TMP/$cfg-one" "$TMP/$cfg-$name" || bad "$cfg: np 2 ${flags[*]} differs from one rank at --micro-batch 4"
    done
done
mpi_finish mpi_deepseek_v3
