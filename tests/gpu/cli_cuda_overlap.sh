#!/usr/bin/env bash
# The optimizer overlap on the CUDA engine (label gpu; $1 is flatmoe-cuda): tests/cli_optim_overlap.sh
# with our deterministic attention kernels (FLATMOE_ATTENTION=fallback: cuDNN's backward sums dQ
# with atomics, so two runs need not agree in the last bit). Here the update really runs on the
# update stream while the next step's forward runs on the compute stream.
export FLATMOE_ATTENTION=fallback
exec bash "$(dirname "$0")/../cli_optim_overlap.sh" "$@"
