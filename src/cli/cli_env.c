/* The environment, read here and nowhere below cli/ (DESIGN.md §3): the FLATMOE_* backend and
 * strategy options into fm_backend_opts, the FLATMOE_TEST_* test hooks into fm_test_hooks, the
 * thread choice's OMP_NUM_THREADS and node rank count into fm_threads_env, and the launcher's
 * variables handed to comm/ once. Each value travels down as a value; the library never calls
 * getenv (tests/cli_env.sh checks both: the messages here and that no getenv is left below). */
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "comm/fm_comm.h"

fm_status fm_backend_opts_from_env(fm_backend_opts *o) {
    FM_ASSERT(o);
    for (int i = 0; fm_backend_opts_vars[i]; i++)
        FM_TRY(fm_backend_opts_set(o, fm_backend_opts_vars[i], getenv(fm_backend_opts_vars[i])));
    return FM_OK;
}

fm_status cli_backend_default_init(fm_backend *b, int threads, int64_t max_head_dim) {
    fm_backend_opts o = fm_backend_opts_default();
    FM_TRY(fm_backend_opts_from_env(&o));
    o.threads = threads;
    o.max_head_dim = max_head_dim;
    return fm_backend_default_init_opts(b, &o);
}

/* Decimal digits alone (no sign, no space), at most 18 of them; false otherwise. */
static bool digits_i64(const char *s, int64_t *out) {
    const size_t n = strlen(s);
    if (n == 0 || n > 18) return false;
    int64_t x = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return false;
        x = 10 * x + (s[i] - '0');
    }
    *out = x;
    return true;
}

static fm_status hook_force_route(fm_test_hooks *h, const char *force) {
    if (!force || !*force) return FM_OK;
    /* FIRST (every token) or FIRST:PCT (PCT% of the tokens, the rest routed as usual) */
    char *end = NULL;
    const long long first = strtoll(force, &end, 10);
    long pct = 100;
    if (end != force && *end == ':') {
        const char *p = end + 1;
        pct = strtol(p, &end, 10);
        if (end == p) pct = -1;
    }
    if (end == force || *end || first < 0 || pct < 0 || pct > 100)
        return fm_error(FM_ERR_ARG, "FLATMOE_TEST_FORCE_ROUTE='%s': expected FIRST or FIRST:PCT (the first forced "
                        "expert >= 0, the percent of tokens forced in [0,100]), e.g. 0 or 0:90; unset it to route "
                        "normally", force);
    h->force_route = true;
    h->force_first = first;
    h->force_percent = (int)pct;
    return FM_OK;
}

static fm_status hook_signal_after(fm_test_hooks *h, const char *v) {
    if (!v || !*v) return FM_OK;
    const char *colon = strchr(v, ':');
    char rank_s[24] = "";
    int64_t rank = -1, step = -1;
    if (colon && (size_t)(colon - v) < sizeof rank_s) memcpy(rank_s, v, (size_t)(colon - v));
    if (!colon || !digits_i64(rank_s, &rank) || rank > 1 << 30 || !digits_i64(colon + 1, &step))
        return fm_error(FM_ERR_ARG, "FLATMOE_TEST_SIGNAL_AFTER='%s': expected RANK:STEP (rank RANK raises SIGINT after "
                        "step STEP; both integers >= 0), e.g. 1:3; unset it to train without the signal", v);
    h->signal_after = true;
    h->signal_rank = (int)rank;
    h->signal_step = step;
    return FM_OK;
}

static fm_status hook_ckpt_chunk(fm_test_hooks *h, const char *v) {
    if (!v || !*v) return FM_OK;
    int64_t n = 0;
    if (!digits_i64(v, &n) || n < 1)
        return fm_error(FM_ERR_ARG, "FLATMOE_TEST_CKPT_CHUNK='%s': expected a number of elements >= 1 (checkpoints "
                        "stream tensors in pieces of that many), e.g. 1000; unset it for the default pieces", v);
    h->ckpt_chunk_elems = n;
    return FM_OK;
}

/* A 0/1 hook (empty: off). */
static fm_status hook_bool(const char *var, const char *v, const char *what, bool *out) {
    if (!v || !*v || !strcmp(v, "0")) return FM_OK;
    if (strcmp(v, "1"))
        return fm_error(FM_ERR_ARG, "%s='%s': expected 1 (%s) or 0; unset it to turn the hook off", var, v, what);
    *out = true;
    return FM_OK;
}

fm_status cli_test_hooks_from_env(fm_test_hooks *h) {
    memset(h, 0, sizeof *h);
    FM_TRY(hook_force_route(h, getenv("FLATMOE_TEST_FORCE_ROUTE"))); /* adversarial routing (fm_router.h) */
    FM_TRY(hook_signal_after(h, getenv("FLATMOE_TEST_SIGNAL_AFTER")));
    FM_TRY(hook_ckpt_chunk(h, getenv("FLATMOE_TEST_CKPT_CHUNK")));
    FM_TRY(hook_bool("FLATMOE_TEST_CKPT_RESAVE", getenv("FLATMOE_TEST_CKPT_RESAVE"),
                     "a resumed run writes the loaded state again at once", &h->ckpt_resave));
    return FM_OK; /* FLATMOE_TEST_FP8_CODES: a backend option (fm_backend_opts_from_env) */
}

fm_threads_env cli_threads_env(void) {
    fm_threads_env e = {0, 1};
    const char *omp = getenv("OMP_NUM_THREADS");
    if (omp && atoi(omp) > 0) e.omp_num_threads = atoi(omp);
    static const char *const vars[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"};
    for (int i = 0; i < 3; i++) {
        const char *v = getenv(vars[i]);
        if (v && atoi(v) > 0) {
            e.local_ranks = atoi(v);
            break;
        }
    }
    return e;
}

fm_status cli_comm_env_install(void) {
    const char *vals[FM_COMM_ENV_COUNT];
    for (int i = 0; i < FM_COMM_ENV_COUNT; i++) vals[i] = getenv(fm_comm_env_names[i]);
    return fm_comm_env_set(vals);
}
