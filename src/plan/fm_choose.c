#include "fm_choose.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../bounded/fm_linear_ce.h"
#include "fm_host_mem.h"

static bool fits(const fm_plan *p, const fm_choose_opts *o) {
    return (o->budget == 0 || p->total <= o->budget) && p->host_bytes <= o->host_budget;
}

/* One point of the search; -1 in a field: as the request has it (a fixed knob). */
typedef struct cand {
    int64_t nr, ka, n_off, opt, chunk, lce;
    int64_t sb; /* streamed optimizer buckets (fm_offload_streamed_buckets); -2: search it */
} cand;

static void apply(fm_plan_req *r, const cand *c, bool *rc) {
    const int64_t L = r->cfg.num_hidden_layers;
    if (c->nr >= 0) {
        for (int64_t l = 0; l < L; l++) rc[l] = l < c->nr;
        r->recompute = rc;
    }
    if (c->ka >= 0) {
        for (int64_t l = 0; l < L; l++) rc[L + l] = c->ka != 0;
        r->keep_attention = rc + L;
    }
    if (c->n_off >= 0) r->n_offloaded_boundaries = c->n_off;
    if (c->opt >= 0) r->offload_optimizer = c->opt != 0;
    if (c->sb >= 0) { /* F = s / nb gives s buckets again (fm_offload_streamed_buckets) */
        const int64_t nb = fm_offload_buckets(fm_config_num_params(&r->cfg), r->offload_bucket);
        r->offload_fraction = nb > 0 && c->sb < nb ? (double)c->sb / (double)nb : 1.0;
    }
    if (c->chunk >= 0) r->moe_chunk_tokens = c->chunk;
    if (c->lce >= 0) {
        r->ce_block_tokens = c->lce ? FM_LCE_DEFAULT_BLOCK_TOKENS : 0;
        r->ce_block_vocab = c->lce ? FM_LCE_DEFAULT_BLOCK_VOCAB : 0;
    }
}

typedef struct search {
    bool found;
    double best_s;
    cand best;
    size_t small_total; /* the smallest device total tried, and its candidate (for the message) */
    cand small;
} search;

/* The fewest streamed optimizer buckets s in [1, nb] with which candidate c (its optimizer
 * streamed; the offloaded boundaries at their most when free) fits the device budget: the device
 * total falls as s grows (fm_offload_model_state_bound), the host bytes grow with it, so the least
 * s that fits the device is the best for both. nb when none fits. */
static int64_t fewest_streamed(fm_plan_req *r, const fm_choose_opts *o, cand c, bool free_off, bool *rc) {
    const int64_t L = r->cfg.num_hidden_layers, nb = fm_offload_buckets(fm_config_num_params(&r->cfg), r->offload_bucket);
    if (free_off) c.n_off = L >= 2 ? L : 0;
    fm_plan p;
    int64_t lo = 1, up = nb; /* up fits (checked first) */
    c.sb = nb;
    apply(r, &c, rc);
    fm_plan_compute(r, &p);
    if (p.total > o->budget) return nb;
    while (lo < up) {
        const int64_t mid = lo + (up - lo) / 2;
        c.sb = mid;
        apply(r, &c, rc);
        fm_plan_compute(r, &p);
        if (p.total <= o->budget) up = mid;
        else lo = mid + 1;
    }
    return up;
}

/* Candidate c's offloaded boundaries, when free (free_off; c->n_off 0 on entry): the fewest that
 * fit the device budget; *p gets the plan of c as resolved. */
static void resolve_off(fm_plan_req *r, const fm_choose_opts *o, cand *c, bool free_off, bool *rc, fm_plan *p) {
    const int64_t L = r->cfg.num_hidden_layers;
    apply(r, c, rc);
    fm_plan_compute(r, p);
    if (!(free_off && o->budget && p->total > o->budget && L >= 2)) return;
    /* device bytes fall as n grows (n = 1 saves nothing): the smallest n in [2, L] that fits */
    cand hi = *c;
    hi.n_off = L;
    apply(r, &hi, rc);
    fm_plan_compute(r, p);
    if (p->total > o->budget) {
        c->n_off = L; /* the smallest device total of this candidate */
        return;
    }
    int64_t lo = 2, up = L; /* up fits */
    while (lo < up) {
        const int64_t mid = lo + (up - lo) / 2;
        cand m = *c;
        m.n_off = mid;
        apply(r, &m, rc);
        fm_plan_compute(r, p);
        if (p->total <= o->budget) up = mid;
        else lo = mid + 1;
    }
    c->n_off = up;
    apply(r, c, rc);
    fm_plan_compute(r, p);
}

/* Whether candidate c with s streamed buckets (its boundaries resolved) fits both budgets. */
static bool fits_streamed(fm_plan_req *r, const fm_choose_opts *o, cand c, bool free_off, int64_t s, bool *rc) {
    fm_plan p;
    c.sb = s;
    if (free_off) c.n_off = 0;
    resolve_off(r, o, &c, free_off, rc, &p);
    return fits(&p, o);
}

/* Candidate c's streamed buckets when they are free: nb when the optimizer is on the device (then
 * unused); else the fewest that fit the device budget (fewest_streamed), or, when the boundaries
 * that then go to the host overrun the host budget (each streamed bucket's m, v leave the device,
 * so fewer boundaries need to), the fewest from there on with which both budgets hold, by
 * bisection (the boundaries resolved at each); nb when none does. */
static int64_t pick_streamed(fm_plan_req *r, const fm_choose_opts *o, cand c, bool free_off, bool *rc) {
    const int64_t nb = fm_offload_buckets(fm_config_num_params(&r->cfg), r->offload_bucket);
    c.sb = nb;
    apply(r, &c, rc);
    if (!(r->offload_optimizer && o->budget && !r->mesh.on)) return nb;
    const int64_t lo = fewest_streamed(r, o, c, free_off, rc);
    if (lo >= nb || fits_streamed(r, o, c, free_off, lo, rc)) return lo;
    if (!fits_streamed(r, o, c, free_off, nb, rc)) return nb;
    int64_t a = lo, up = nb; /* a does not fit, up does */
    while (up - a > 1) {
        const int64_t mid = a + (up - a) / 2;
        if (fits_streamed(r, o, c, free_off, mid, rc)) up = mid;
        else a = mid;
    }
    return up;
}

/* Plans candidate c (with the fewest offloaded boundaries that fit, when they are free, and the
 * fewest streamed optimizer buckets, when streamed and free) and keeps it when it fits and is
 * faster. */
static void try_cand(fm_plan_req *r, const fm_choose_opts *o, cand c, bool *rc, search *s) {
    fm_plan p;
    const bool free_off = c.n_off == -2; /* -2: search the offload count */
    if (free_off) c.n_off = 0;
    if (c.sb == -2) c.sb = pick_streamed(r, o, c, free_off, rc); /* the fraction */
    resolve_off(r, o, &c, free_off, rc, &p);
    if (p.total < s->small_total) {
        s->small_total = p.total;
        s->small = c;
    }
    if (!fits(&p, o)) return;
    fm_projection pr;
    fm_project(r, &p, o->calib, &pr);
    if (!s->found || pr.step_s < s->best_s) {
        s->found = true;
        s->best_s = pr.step_s;
        s->best = c;
    }
}

/* Every candidate over recompute counts nrs and MoE chunks `chunks` (the other knobs free per o). */
static void search_grid(fm_plan_req *r, const fm_choose_opts *o, bool *rc, search *s, const int64_t *nrs, int64_t n_nr,
                        const int64_t *chunks, int64_t n_ch) {
    const int n_ka = o->fix_keep_attention ? 1 : 2, n_opt = o->fix_offload_optimizer ? 1 : 2, n_ce = o->fix_ce ? 1 : 2;
    for (int64_t i = 0; i < n_nr; i++)
        for (int ka = 0; ka < n_ka; ka++) {
            /* keep-attention only matters for recomputed layers */
            if (!o->fix_keep_attention && ka == 1 && nrs[i] == 0) continue;
            for (int opt = 0; opt < n_opt; opt++)
                for (int64_t j = 0; j < n_ch; j++)
                    for (int ce = 0; ce < n_ce; ce++) {
                        /* a mesh of more than one rank has the vocabulary ring: linear CE only */
                        if (!o->fix_ce && ce == 0 && r->mesh.on && r->mesh.dp * r->mesh.sp > 1) continue;
                        cand c = {nrs[i], o->fix_keep_attention ? -1 : ka, o->fix_offload_boundaries ? -1 : -2,
                                  o->fix_offload_optimizer ? -1 : opt, chunks[j], o->fix_ce ? -1 : ce,
                                  o->fix_offload_fraction ? -1 : -2};
                        try_cand(r, o, c, rc, s);
                    }
        }
}

/* The search; req ends holding the best candidate (or the smallest one when none fits). MoE chunks
 * below FM_PLAN_MIN_CHUNK tokens are tried only when nothing else fits (slow, but a small model
 * under a tight budget then still boots). */
static bool search_all(fm_plan_req *r, const fm_choose_opts *o, bool *rc) {
    const int64_t L = r->cfg.num_hidden_layers, N = r->B * r->T;
    search s = {.small_total = SIZE_MAX};
    int64_t nrs[1025], n_nr = 0;
    if (o->fix_recompute) nrs[n_nr++] = -1;
    else
        for (int64_t n = 0; n <= L && n_nr < 1025; n++)
            if (!(n == 1 && L > 1)) nrs[n_nr++] = n; /* one recomputed layer saves nothing (the shared set) */
    int64_t chunks[64], n_ch = 0;
    if (o->fix_moe_chunk) chunks[n_ch++] = -1;
    else {
        if (!(r->mesh.on && r->mesh.ep > 1)) chunks[n_ch++] = 0; /* unchunked: the plain twin (EP is chunked) */
        for (int64_t c = N;; c = (c + 1) / 2) {
            if (c < FM_PLAN_MIN_CHUNK) c = FM_PLAN_MIN_CHUNK;
            chunks[n_ch++] = c;
            if (c <= FM_PLAN_MIN_CHUNK || n_ch >= 64) break;
        }
    }
    search_grid(r, o, rc, &s, nrs, n_nr, chunks, n_ch);
    if (!s.found && !o->fix_moe_chunk) { /* the fallback: chunks of FM_PLAN_MIN_CHUNK / 2 .. 1 tokens */
        int64_t small[64], n_small = 0;
        for (int64_t c = (N < FM_PLAN_MIN_CHUNK ? N : FM_PLAN_MIN_CHUNK) / 2; c >= 1 && n_small < 64; c /= 2)
            small[n_small++] = c;
        search_grid(r, o, rc, &s, nrs, n_nr, small, n_small);
    }
    apply(r, s.found ? &s.best : &s.small, rc);
    return s.found;
}

static void describe(const fm_plan_req *r, const fm_plan *p, char *b, size_t n) {
    snprintf(b, n, "recompute %lld of %lld layers%s, %lld offloaded boundaries, optimizer %s, MoE %s%lld, %s",
             (long long)p->n_recomputed, (long long)r->cfg.num_hidden_layers,
             p->n_keep_attention ? " keeping attention" : "", (long long)p->n_offloaded_boundaries,
             r->offload_optimizer ? (p->offload_streamed_buckets < p->offload_buckets ? "partly streamed from the host"
                                                                                       : "streamed from the host")
                                  : "on the device",
             r->moe_chunk_tokens > 0 ? "chunks of " : "unchunked", (long long)(r->moe_chunk_tokens > 0 ? r->moe_chunk_tokens : 0),
             (r->ce_block_tokens > 0 || r->ce_block_vocab > 0) ? "linear CE" : "plain logits");
    if (r->moe_chunk_tokens <= 0) { /* drop the 0 after "unchunked" */
        char *z = strstr(b, "unchunked0");
        if (z) memmove(z + 9, z + 10, strlen(z + 10) + 1);
    }
}

static bool any_free(const fm_choose_opts *o) {
    return !(o->fix_recompute && o->fix_keep_attention && o->fix_offload_boundaries && o->fix_offload_optimizer &&
             o->fix_moe_chunk && o->fix_ce && o->fix_offload_fraction);
}

/* fit without advice: the plan and whether it fits */
static bool fit_quiet(fm_plan_req *r, const fm_choose_opts *o, bool *rc, fm_plan *p) {
    if (o->budget > 0 && any_free(o)) search_all(r, o, rc);
    fm_plan_compute(r, p);
    return fits(p, o);
}

/* The FP8 weight cache, where it is the chooser's (fm_plan_req.expert_fp8_cache_auto): on when the
 * plan chosen without it still fits both budgets with it. It gives the same bits and only saves
 * the weight quantization at each use (on the H200, OLMoE-1B-7B at 4K: 6.4 ms a step, session 12's
 * step 2), so memory the plan does not need is spent on it, and nothing else is given up
 * for it: the other knobs stay as chosen. */
static void auto_fp8_cache(fm_plan_req *req, const fm_choose_opts *o, fm_plan *out) {
    if (!req->expert_fp8_cache_auto || !req->expert_fp8_codes || req->layout.expert_fp8_cache) return;
    req->layout.expert_fp8_cache = true;
    fm_plan p;
    fm_plan_compute(req, &p);
    if (fits(&p, o)) *out = p;
    else req->layout.expert_fp8_cache = false;
}

fm_status fm_plan_fit(fm_plan_req *req, const fm_choose_opts *o, bool *rc, fm_plan *out, fm_projection *proj) {
    const fm_plan_req given = *req;
    const bool ok = fit_quiet(req, o, rc, out);
    if (ok) auto_fp8_cache(req, o, out);
    fm_project(req, out, o->calib, proj);
    if (ok) return FM_OK;
    int big = 0;
    for (int i = 1; i < FM_PLAN_SETS; i++)
        if (out->bytes[i] > out->bytes[big]) big = i;
    char advice[1600];
    fm_plan_advise(&given, o, advice, sizeof advice);
    const char *bn = o->budget_name ? o->budget_name : "--mem-budget";
    const char *hn = o->host_budget_name ? o->host_budget_name : "--host-mem-budget";
    if (o->budget && out->total > o->budget)
        return fm_error(FM_ERR_NOMEM, "plan: %.1f MiB of device memory needed but %s is %.1f MiB; the largest live set "
                        "is %s (%.1f MiB)%s. %s", out->total / 1048576.0, bn, o->budget / 1048576.0,
                        fm_plan_set_name(big), out->bytes[big] / 1048576.0,
                        any_free(o) ? " (the smallest plan the chooser found)" : "", advice);
    char who[600];
    fm_host_mem_describe(who, sizeof who); /* what holds the host's memory */
    return fm_error(FM_ERR_NOMEM, "plan: %.1f MiB of pinned host memory needed but %s is %.1f MiB (%s). %s",
                    out->host_bytes / 1048576.0, hn, o->host_budget / 1048576.0, who, advice);
}

/* Does req (with the knobs free per o) fit? Works on a copy with its own recompute tables; *step_s
 * (when given) gets the fitting plan's projected step time. */
static bool try_fit_s(const fm_plan_req *req, const fm_choose_opts *o, char *desc, size_t n, double *step_s) {
    const int64_t L = req->cfg.num_hidden_layers;
    fm_plan_req r = *req;
    bool *rc = fm_malloc((size_t)(2 * L));
    if (!rc) return false;
    for (int64_t l = 0; l < L; l++) {
        rc[l] = req->recompute ? req->recompute[l] : false;
        rc[L + l] = req->keep_attention ? req->keep_attention[l] : false;
    }
    r.recompute = rc;
    r.keep_attention = rc + L;
    fm_plan p;
    const bool ok = fm_plan_check_shape(&r.cfg, r.B, r.T) == FM_OK && fit_quiet(&r, o, rc, &p);
    if (ok && desc) describe(&r, &p, desc, n);
    if (ok && step_s) {
        fm_projection pr;
        fm_project(&r, &p, o->calib, &pr);
        *step_s = pr.step_s;
    }
    fm_free(rc);
    return ok;
}

static bool try_fit(const fm_plan_req *req, const fm_choose_opts *o, char *desc, size_t n) {
    return try_fit_s(req, o, desc, n, NULL);
}

/* The state recipes (--master-weights x moments) of fewer bytes per parameter than req's, cheapest
 * last: k of them into rc[] and bf16m[]. */
static int cheaper_recipes(const fm_plan_req *req, int rc[5], bool bf16m[5]) {
    static const int cand_rc[5] = {FM_MASTER_FP32, FM_MASTER_BF16_KAHAN, FM_MASTER_BF16_SR, FM_MASTER_BF16_KAHAN,
                                   FM_MASTER_BF16_SR};
    static const bool cand_m[5] = {true, false, false, true, true}; /* 12, 14, 12, 10, 8 B/param on bf16 */
    const int a = 2; /* the ranking: bytes on a bf16 build (the CPU build's differ by the master only) */
    const int cur = fm_master_extra_bytes((fm_master_recipe)req->state_layout.master_recipe, a) + (req->bf16_moments ? 4 : 8);
    int k = 0;
    for (int i = 0; i < 5; i++)
        if (fm_master_extra_bytes((fm_master_recipe)cand_rc[i], a) + (cand_m[i] ? 4 : 8) < cur &&
            (cand_m[i] || !req->bf16_moments))
            rc[k] = cand_rc[i], bf16m[k++] = cand_m[i];
    return k;
}

void fm_plan_recipe_note(const fm_plan_req *req, const fm_choose_opts *o, double step_s, char *buf, size_t n) {
    buf[0] = 0;
    if (req->mesh.on || req->ep > 1 || (req->state_layout.zero == 3 && req->state_layout.ranks > 1)) return;
    int rc[5], k = 0;
    bool bm[5];
    const int nc = cheaper_recipes(req, rc, bm);
    char list[900] = "";
    for (int i = 0; i < nc; i++) {
        fm_plan_req r = *req;
        r.state_layout.master_recipe = rc[i];
        r.bf16_moments = bm[i];
        fm_choose_opts f = *o;
        if (rc[i] != FM_MASTER_FP32) f.fix_offload_optimizer = true, r.offload_optimizer = false; /* no streamed master */
        if (!o->fix_offload_optimizer && rc[i] == FM_MASTER_FP32) r.offload_optimizer = false;
        double t = 0;
        if (!try_fit_s(&r, &f, NULL, 0, &t) || !(t < 0.99 * step_s)) continue;
        const size_t len = strlen(list);
        char what[80] = "";
        if (rc[i] != FM_MASTER_FP32) snprintf(what, sizeof what, "--master-weights %s", fm_master_recipe_name((fm_master_recipe)rc[i]));
        if (bm[i]) snprintf(what + strlen(what), sizeof what - strlen(what), "%s--bf16-moments", what[0] ? " " : "");
        snprintf(list + len, sizeof list - len, "%s%s: %.4g s (%.0f%% of it)", k++ ? "; " : "", what, t, 100.0 * t / step_s);
    }
    if (k)
        snprintf(buf, n, "note: a cheaper state recipe would be faster (projected step of each; this plan: %.4g s). It "
                 "changes the numerics (docs/training.md \"State recipes\"), so it is never chosen for you: %s", step_s,
                 list);
}

static void add_item(char *buf, size_t n, int *items, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void add_item(char *buf, size_t n, int *items, const char *fmt, ...) {
    size_t len = strlen(buf);
    if (len + 4 >= n) return;
    if (*items) len += (size_t)snprintf(buf + len, n - len, "; ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + len, n - len, fmt, ap);
    va_end(ap);
    (*items)++;
}

/* The fewest ranks W in [2, 1024] (more than req's own when it is already sharded) on which the trainer's ZeRO-3 run fits (try_fit of req with the
 * model state laid out as --dp W --zero 3, and --ep e where e > 1 divides both W and E and no
 * plain ZeRO-3 fits: the largest such e, the dispatch then in chunks of the micro-batch's tokens
 * when req names none), written as advice into what[n]. False when none fits. A linear scan: the
 * best e changes with W, so fitting is not monotone in W. */
static bool fewest_ranks(const fm_plan_req *req, const fm_choose_opts *o, char *what, size_t n) {
    const int64_t E = req->cfg.num_experts;
    for (int pass = 0; pass < 2; pass++) /* 0: ZeRO-3 alone; 1: ZeRO-3 beside expert parallelism */
        for (int W = req->state_layout.ranks > 1 ? req->state_layout.ranks + 1 : 2; W <= 1024; W++) {
            int e = 1;
            if (pass == 1) {
                for (int d = W; d > 1; d--)
                    if (W % d == 0 && E % d == 0) { e = d; break; }
                if (e == 1) continue;
            }
            fm_plan_req r = *req;
            r.offload_optimizer = false;
            r.state_layout.ranks = W, r.state_layout.zero = 3, r.state_layout.ep = e;
            r.ep = e;
            if (e > 1 && r.moe_chunk_tokens == 0) r.moe_chunk_tokens = r.B * r.T;
            if (!try_fit(&r, o, NULL, 0)) continue;
            if (e > 1)
                snprintf(what, n, "%d ranks with --zero 3 --ep %d (weights and optimizer state sharded, the experts "
                         "over the ep ranks: mpirun -np %d ... --zero 3 --ep %d, or plan a mesh with --world)", W, e, W, e);
            else
                snprintf(what, n, "%d ranks with --zero 3 (the model state sharded: mpirun -np %d ... --zero 3, or plan "
                         "a mesh with --world)", W, W);
            return true;
        }
    return false;
}

void fm_plan_advise(const fm_plan_req *req, const fm_choose_opts *o0, char *buf, size_t n) {
    char list[1400] = "";
    int items = 0;
    const fm_choose_opts o = *o0;
    /* 1. a fixed chooser knob, freed */
    static const char *const names[7] = {"--recompute", "--recompute-keep-attention", "--offload-boundaries",
                                         "--offload-optimizer", "--moe-chunk-tokens", "--ce-block-tokens/--ce-block-vocab",
                                         "--optimizer-offload-fraction"};
    for (int k = 0; k < 7; k++) {
        fm_choose_opts f = o;
        bool *fx[7] = {&f.fix_recompute, &f.fix_keep_attention, &f.fix_offload_boundaries, &f.fix_offload_optimizer,
                       &f.fix_moe_chunk, &f.fix_ce, &f.fix_offload_fraction};
        if (!*fx[k]) continue;
        *fx[k] = false;
        if (f.budget == 0) continue; /* nothing is chosen without a budget */
        char d[300];
        if (try_fit(req, &f, d, sizeof d)) add_item(list, sizeof list, &items, "drop %s and let the chooser pick (%s)", names[k], d);
    }
    /* 2. bf16 moments */
    if (!req->bf16_moments) {
        fm_plan_req r = *req;
        r.bf16_moments = true;
        if (try_fit(&r, &o, NULL, 0)) add_item(list, sizeof list, &items, "--bf16-moments (AdamW m and v in bf16: 4 B/param less)");
    }
    /* 2a. a cheaper state recipe (--master-weights; it changes the numerics: named, never chosen),
     *     with its projected step time */
    {
        int rc[5];
        bool bm[5];
        const int nc = req->mesh.on || req->ep > 1 ? 0 : cheaper_recipes(req, rc, bm);
        for (int i = 0; i < nc; i++) {
            if (rc[i] == FM_MASTER_FP32) continue; /* --bf16-moments alone: above */
            fm_plan_req r = *req;
            r.state_layout.master_recipe = rc[i];
            r.bf16_moments = bm[i];
            r.offload_optimizer = false; /* the streamed AdamW keeps an fp32 master */
            fm_choose_opts f = o;
            f.fix_offload_optimizer = true;
            double t = 0;
            if (try_fit_s(&r, &f, NULL, 0, &t))
                add_item(list, sizeof list, &items, "--master-weights %s%s%s (a state recipe of %d B/param less: it "
                         "changes the numerics; projected %.4g s a step)", fm_master_recipe_name((fm_master_recipe)rc[i]),
                         bm[i] && !req->bf16_moments ? " --bf16-moments" : "",
                         req->offload_optimizer ? " without --offload-optimizer" : "",
                         fm_master_extra_bytes((fm_master_recipe)req->state_layout.master_recipe, 2) +
                             (req->bf16_moments ? 4 : 8) - fm_master_extra_bytes((fm_master_recipe)rc[i], 2) -
                             (bm[i] ? 4 : 8), t);
        }
    }
    /* 2b. --fp8-weight-cache dropped: its L x 6 E H I bytes of weight codes (one layer's set instead) */
    if (req->layout.expert_fp8_cache) {
        fm_plan_req r = *req;
        r.layout.expert_fp8_cache = false;
        if (try_fit(&r, &o, NULL, 0))
            add_item(list, sizeof list, &items, "drop --fp8-weight-cache (every layer's expert weight codes, L x 6 E H I "
                     "bytes: quantized at each use instead)");
    }
    /* 2c. bf16 experts: --expert-precision fp8's buffers (quantized copies or code operands) out */
    if (req->expert_fp8) {
        fm_plan_req r = *req;
        r.expert_fp8 = r.expert_fp8_codes = r.layout.expert_fp8_cache = r.expert_fp8_cache_auto = false;
        if (try_fit(&r, &o, NULL, 0))
            add_item(list, sizeof list, &items, "--expert-precision bf16%s (the fp8 experts' quantized operands out of the "
                     "expert live set)", req->layout.expert_fp8_cache ? " without --fp8-weight-cache" : "");
    }
    /* 3. the streamed optimizer when the user fixed it off cannot be said (a switch has no off);
     *    it is a chooser knob, so a fit with it was tried. 4. a smaller micro-batch */
    if (req->B > 1) {
        int64_t lo = 0, hi = req->B - 1; /* largest B' in [1, hi] that fits; lo fits (0: none yet) */
        while (lo < hi) {
            const int64_t mid = lo + (hi - lo + 1) / 2;
            fm_plan_req r = *req;
            r.B = mid;
            if (try_fit(&r, &o, NULL, 0)) lo = mid;
            else hi = mid - 1;
        }
        if (lo >= 1) add_item(list, sizeof list, &items, "--micro-batch %lld", (long long)lo);
    }
    /* 5. a shorter sequence: the longest that fits, in steps of 1024 from 4K up */
    if (req->T > 1) {
        const int64_t g = req->T > 4096 ? 1024 : 1;
        int64_t lo = 0, hi = (req->T - 1) / g;
        while (lo < hi) {
            const int64_t mid = lo + (hi - lo + 1) / 2;
            fm_plan_req r = *req;
            r.T = mid * g;
            if (try_fit(&r, &o, NULL, 0)) lo = mid;
            else hi = mid - 1;
        }
        if (lo >= 1) add_item(list, sizeof list, &items, "--seq-len %lld%s", (long long)(lo * g),
                              g > 1 ? " (the longest that fits, in steps of 1024)" : " (the longest that fits)");
    }
    /* 6. ranks: the trainer's ZeRO-3 over W = dp ranks (its model-state bound: each rank's experts
     *    whole, so where the experts dominate only --ep shards them; no streamed optimizer beside
     *    ZeRO-3), the fewest W that fit; a mesh plan has its own degrees */
    if (!req->mesh.on) {
        char what[200];
        if (fewest_ranks(req, &o, what, sizeof what)) add_item(list, sizeof list, &items, "%s", what);
    }
    if (items) snprintf(buf, n, "It would fit with any one of: %s", list);
    else snprintf(buf, n, "No single knob makes it fit (not --micro-batch, --seq-len, --bf16-moments, offload, recompute "
                  "or ranks): it needs a larger budget, or several of them at once");
}

size_t fm_host_mem_budget_default(void) {
    fm_host_mem m;
    if (fm_host_mem_read(&m) != 0) return 0;
    const double b = m.total - fm_host_mem_reserve(m.total) - m.held;
    return b > 0 ? (size_t)b : 0;
}
