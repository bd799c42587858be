/* Test hooks: behaviours only tests ask for (adversarial routing, a signal at a given step,
 * checkpoints in small pieces, ...). The CLI fills this struct from FLATMOE_TEST_* variables
 * (cli/cli_env.c); library code reads the struct it is handed and never the environment
 * (DESIGN.md §3: the environment is read only in cli/). A zeroed struct turns every hook off. */
#ifndef FM_TEST_HOOKS_H
#define FM_TEST_HOOKS_H

#include <stdbool.h>
#include <stdint.h>

typedef struct fm_test_hooks {
    /* FLATMOE_TEST_FORCE_ROUTE=FIRST[:PCT]: the router's forced routing (model/fm_router.h):
     * every token's top-k becomes experts FIRST .. FIRST+k-1 (mod E), or only PCT% of them */
    bool force_route;
    int64_t force_first; /* >= 0 */
    int force_percent;   /* [0, 100] */
    /* FLATMOE_TEST_SIGNAL_AFTER=RANK:STEP: rank RANK raises SIGINT after step STEP */
    bool signal_after;
    int signal_rank;
    int64_t signal_step;
    /* FLATMOE_TEST_CKPT_CHUNK=N: checkpoints stream tensors in pieces of N elements (> 0) */
    int64_t ckpt_chunk_elems;
    /* FLATMOE_TEST_CKPT_RESAVE=1: a resumed run writes the loaded state again at once */
    bool ckpt_resave;
    /* FLATMOE_TEST_FP8_CODES=1 is a backend option (fm_backend_opts.cpu_fp8_codes): the CPU
     * backend and the planner read it there */
} fm_test_hooks;

#endif
