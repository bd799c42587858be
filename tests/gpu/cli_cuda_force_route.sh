#!/usr/bin/env bash
# FLATMOE_TEST_FORCE_ROUTE on the CUDA engine (label gpu): tests/cli_force_route.sh run with
# flatmoe-cuda, so the forced routing (plain and skewed) goes through the backend's router_force op
# on the device inside training: the same routes per expert, the mod-E and 1:0 identities bit for
# bit (FLATMOE_ATTENTION=fallback: our bitwise-deterministic attention kernels, as
# cli_cuda_resume.sh; cuDNN's backward sums dQ with atomics), the refusals.
export FLATMOE_ATTENTION=fallback
exec bash "$(dirname "$0")/../cli_force_route.sh" "$@"
