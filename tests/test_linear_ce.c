/* Linear cross-entropy (src/bounded/fm_linear_ce.c) and its strip ops on the CPU backend.
 *
 * 1. A/B: the blocked operator against its plain twin (full N x V logits) for many shapes and
 *    block sizes (blocks not dividing N or V, Nb >= N, Vb >= V, Nb = 1), with ignore_index
 *    tokens, token weights, z-loss and the logprob / entropy outputs: loss, per-token loss, dh,
 *    dW within normalized error 2e-6 (fp32, reassociation only), and both against an fp64
 *    reference written here (1e-5).
 * 2. Logits near the fp32 exp range (|logit| ~ 1e4..8e4, where sum exp(l) overflows any float):
 *    everything finite and equal to the fp64 reference.
 * 3. The plain twin (and the blocked one) against central finite differences in fp64 of the
 *    reference objective J = sum_t w_t (loss_t + s lse_t^2), every element of dh and dW.
 * 4. Conventions: dh ASSIGNED (poisoned with NaN before), dW ACCUMULATED (pre-filled), forward
 *    only when dh = dW = NULL, all tokens ignored, N = 0.
 * 5. Bound: a real arena of exactly fm_linear_ce_bound_bytes does not overrun; its high-water
 *    mark is <= the bound and >= 90% of it; ws->used is restored; a measuring arena records the
 *    same peak; the plain twin's peak is fm_linear_ce_plain_bytes >= N V 4.
 * 6. Determinism: the same bits with 1 and 2 threads.
 *
 * Error measure: nerr = max|got - ref| / max(max|ref|, floor), NaN/Inf infinite.
 */
#include "backend/cpu/fm_backend_cpu.h"
#include "bounded/fm_linear_ce.h"
#include "core/fm_rng.h"
#include "fm_test.h"

#include <stdint.h>
#include <time.h>

static fm_backend g_be;

typedef void (*lce_fn)(const fm_backend *, fm_arena *, float *, fm_act *, fm_act *, const fm_act *, const fm_act *,
                       const int32_t *, int64_t, int64_t, int64_t, float, const fm_lce_opts *, double *);

/* Runs the operator (or its twin) and reads its sums at a sync point: returns the loss sum and
 * sets *zt (may be NULL) to the z term, as the operator returned them before it left them in
 * backend memory. */
static double lce_sync(lce_fn f, const fm_backend *be, fm_arena *ws, float *loss, fm_act *dh, fm_act *dW,
                       const fm_act *h, const fm_act *W, const int32_t *tg, int64_t N, int64_t H, int64_t V, float gs,
                       const fm_lce_opts *opts, double *zt) {
    double sums[2] = {-1, -1}; /* backend memory is host memory on the CPU */
    f(be, ws, loss, dh, dW, h, W, tg, N, H, V, gs, opts, sums);
    return fm_linear_ce_read(be, sums, opts ? opts->z_loss : 0.0f, zt);
}
static fm_rng g_rng;

/* ---- helpers ---------------------------------------------------------------------------- */

static void fill_normal(float *x, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(scale * fm_rng_normal(&g_rng));
}
static void fill_const(float *x, int64_t n, float c) {
    for (int64_t i = 0; i < n; i++) x[i] = c;
}
static bool all_finite(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return false;
    return true;
}
static double nerr(const float *got, const double *ref, int64_t n, double floor) {
    double num = 0, den = floor;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) return INFINITY;
        double d = fabs((double)got[i] - ref[i]);
        num = d > num ? d : num;
        den = fabs(ref[i]) > den ? fabs(ref[i]) : den;
    }
    return num / den;
}
/* nerr of two float arrays (b the reference). */
static double nerr_ff(const float *a, const float *b, int64_t n, double floor) {
    double *bd = dnew(n);
    for (int64_t i = 0; i < n; i++) bd[i] = b[i];
    double e = nerr(a, bd, n, floor);
    free(bd);
    return e;
}

/* ---- the fp64 reference ----------------------------------------------------------------- */

typedef struct ref_out {
    double *loss, *lse, *logprob, *entropy, *dh, *dW; /* [N] x4, [N,H], [V,H] */
    double ce, zsum;                                  /* sum w loss, sum w lse^2 (valid rows) */
} ref_out;

/* Naive fp64: full logits per row, softmax, loss, and the gradient of
 * J = sum_t w_t (loss_t + s lse_t^2) times grad_scale. Inputs in double. */
static void ref_lce(ref_out *r, const double *h, const double *W, const int32_t *tg,
                    const float *wt, int64_t N, int64_t H, int64_t V, double s, double gs,
                    int32_t ign) {
    double *l = dnew(V);
    r->ce = r->zsum = 0;
    for (int64_t i = 0; i < N * H; i++) r->dh[i] = 0;
    for (int64_t i = 0; i < V * H; i++) r->dW[i] = 0;
    for (int64_t n = 0; n < N; n++) {
        double mx = -INFINITY;
        for (int64_t v = 0; v < V; v++) {
            double a = 0;
            for (int64_t k = 0; k < H; k++) a += h[n * H + k] * W[v * H + k];
            l[v] = a;
            mx = a > mx ? a : mx;
        }
        double z = 0, pl = 0;
        for (int64_t v = 0; v < V; v++) z += exp(l[v] - mx);
        const double lse = mx + log(z);
        for (int64_t v = 0; v < V; v++) pl += exp(l[v] - lse) * (l[v] - mx);
        r->lse[n] = lse;
        r->entropy[n] = log(z) - pl; /* -sum p log p = lse - sum p l */
        if (tg[n] == ign) {
            r->loss[n] = r->logprob[n] = 0;
            continue;
        }
        const int32_t t = tg[n];
        const double w = wt ? wt[n] : 1.0;
        r->loss[n] = (mx - l[t]) + log(z);
        r->logprob[n] = -r->loss[n];
        r->ce += w * r->loss[n];
        r->zsum += w * lse * lse;
        for (int64_t v = 0; v < V; v++) {
            const double p = exp(l[v] - lse);
            const double g = gs * w * ((1.0 + 2.0 * s * lse) * p - (v == t ? 1.0 : 0.0));
            if (g == 0.0) continue;
            for (int64_t k = 0; k < H; k++) {
                r->dh[n * H + k] += g * W[v * H + k];
                r->dW[v * H + k] += g * h[n * H + k];
            }
        }
    }
    free(l);
}

/* grad_scale * J(h, W) in fp64, for finite differences. */
static double ref_objective(const double *h, const double *W, const int32_t *tg, const float *wt,
                            int64_t N, int64_t H, int64_t V, double s, double gs, int32_t ign) {
    double J = 0;
    double *l = dnew(V);
    for (int64_t n = 0; n < N; n++) {
        if (tg[n] == ign) continue;
        double mx = -INFINITY;
        for (int64_t v = 0; v < V; v++) {
            double a = 0;
            for (int64_t k = 0; k < H; k++) a += h[n * H + k] * W[v * H + k];
            l[v] = a;
            mx = a > mx ? a : mx;
        }
        double z = 0;
        for (int64_t v = 0; v < V; v++) z += exp(l[v] - mx);
        const double lse = mx + log(z), w = wt ? wt[n] : 1.0;
        J += w * ((lse - l[tg[n]]) + s * lse * lse);
    }
    free(l);
    return gs * J;
}

static ref_out ref_alloc(int64_t N, int64_t H, int64_t V) {
    ref_out r = {dnew(N), dnew(N), dnew(N), dnew(N), dnew(N * H), dnew(V * H), 0, 0};
    return r;
}
static void ref_free(ref_out *r) {
    free(r->loss); free(r->lse); free(r->logprob); free(r->entropy); free(r->dh); free(r->dW);
}

/* ---- one problem ------------------------------------------------------------------------ */

typedef struct problem {
    int64_t N, H, V;
    float *h, *W, *wt; /* wt NULL: no token weights */
    int32_t *tg;
    double *hd, *Wd;
} problem;

/* Random problem: h ~ hscale N(0,1), W ~ N(0,1)/sqrt(H); a fraction `ign_frac` of targets
 * ignored (-100); token weights in [0, 2) when `weights`. */
static problem problem_make(int64_t N, int64_t H, int64_t V, double hscale, double ign_frac,
                            bool weights) {
    problem p = {N, H, V, fnew(N * H), fnew(V * H), weights ? fnew(N) : NULL, inew(N), dnew(N * H),
                 dnew(V * H)};
    fill_normal(p.h, N * H, hscale);
    fill_normal(p.W, V * H, 1.0 / sqrt((double)H));
    for (int64_t n = 0; n < N; n++) {
        p.tg[n] = fm_rng_uniform_d(&g_rng) < ign_frac ? -100 : (int32_t)fm_rng_below(&g_rng, (uint64_t)V);
        if (weights) p.wt[n] = (float)(2.0 * fm_rng_uniform_d(&g_rng));
    }
    for (int64_t i = 0; i < N * H; i++) p.hd[i] = p.h[i];
    for (int64_t i = 0; i < V * H; i++) p.Wd[i] = p.W[i];
    return p;
}
static void problem_free(problem *p) {
    free(p->h); free(p->W); free(p->wt); free(p->tg); free(p->hd); free(p->Wd);
}

/* Outputs of one call. */
typedef struct run_out {
    float *loss, *dh, *dW, *logprob, *entropy;
    double ce, zterm;
    size_t high;
} run_out;

static run_out run_alloc(const problem *p) {
    run_out o = {fnew(p->N), fnew(p->N * p->H), fnew(p->V * p->H), fnew(p->N), fnew(p->N), 0, 0, 0};
    return o;
}
static void run_free(run_out *o) {
    free(o->loss); free(o->dh); free(o->dW); free(o->logprob); free(o->entropy);
}

/* Runs the blocked (plain = false) or plain operator on a fresh arena of exactly its bound,
 * with dh poisoned (NaN), dW zeroed, loss/logprob/entropy poisoned. */
static void run_op(run_out *o, const problem *p, bool plain, int64_t Nb, int64_t Vb, float z_loss,
                   float gs, bool outs) {
    fm_lce_opts opts = fm_lce_opts_default();
    opts.block_tokens = Nb;
    opts.block_vocab = Vb;
    opts.z_loss = z_loss;
    opts.token_weight = p->wt;
    opts.out_logprob = outs ? o->logprob : NULL;
    opts.out_entropy = outs ? o->entropy : NULL;
    fill_const(o->dh, p->N * p->H, NAN);
    fill_const(o->dW, p->V * p->H, 0.0f);
    fill_const(o->loss, p->N, NAN);
    fill_const(o->logprob, p->N, NAN);
    fill_const(o->entropy, p->N, NAN);
    fm_arena ws;
    const size_t cap = plain ? fm_linear_ce_plain_bytes(p->N, p->V) : fm_linear_ce_bound_bytes(Nb, Vb);
    FM_ASSERT(fm_arena_init(&ws, "vocabulary projection", cap) == FM_OK);
    o->ce = lce_sync(plain ? fm_linear_ce_plain : fm_linear_ce, &g_be, &ws, o->loss, o->dh, o->dW, p->h, p->W,
                                                        p->tg, p->N, p->H, p->V, gs, &opts, &o->zterm);
    CHECK(ws.used == 0);
    o->high = ws.high;
    fm_arena_free(&ws);
}

/* ---- 1. A/B and fp64 ---------------------------------------------------------------------- */

typedef struct ab_case {
    int64_t N, H, V, Nb, Vb;
    double ign;
    bool weights;
    float z_loss;
    bool outs;
} ab_case;

static double g_worst_ab = 0, g_worst_ref = 0, g_worst_q[7];

static void test_ab(const ab_case *c) {
    const float gs = 1.0f / 7.0f;
    problem p = problem_make(c->N, c->H, c->V, 1.5, c->ign, c->weights);
    run_out b = run_alloc(&p), q = run_alloc(&p);
    run_op(&b, &p, false, c->Nb, c->Vb, c->z_loss, gs, c->outs);
    run_op(&q, &p, true, 0, 0, c->z_loss, gs, c->outs);
    ref_out r = ref_alloc(c->N, c->H, c->V);
    ref_lce(&r, p.hd, p.Wd, p.tg, p.wt, c->N, c->H, c->V, c->z_loss, gs, -100);

    const int64_t N = c->N, H = c->H, V = c->V;
    double e[6] = {
        fabs(b.ce - q.ce) / fmax(fabs(q.ce), 1.0), nerr_ff(b.loss, q.loss, N, 1e-30),
        nerr_ff(b.dh, q.dh, N * H, 1e-30),         nerr_ff(b.dW, q.dW, V * H, 1e-30),
        c->outs ? nerr_ff(b.logprob, q.logprob, N, 1e-30) : 0,
        c->outs ? nerr_ff(b.entropy, q.entropy, N, 1e-30) : 0,
    };
    const char *what[6] = {"sum", "loss", "dh", "dW", "logprob", "entropy"};
    for (int i = 0; i < 6; i++) {
        CHECK_MSG(e[i] <= 2e-6, "A/B %s nerr %.3g (N %lld H %lld V %lld Nb %lld Vb %lld)", what[i], e[i],
                  (long long)N, (long long)H, (long long)V, (long long)c->Nb, (long long)c->Vb);
        g_worst_ab = fmax(g_worst_ab, e[i]);
        g_worst_q[i] = fmax(g_worst_q[i], e[i]);
    }
    CHECK_CLOSE(b.zterm, q.zterm, 2e-6);
    /* both against fp64 */
    for (int k = 0; k < 2; k++) {
        const run_out *o = k ? &q : &b;
        double f[7] = {
            fabs(o->ce - r.ce) / fmax(fabs(r.ce), 1.0), nerr(o->loss, r.loss, N, 1e-30),
            nerr(o->dh, r.dh, N * H, 1e-30), nerr(o->dW, r.dW, V * H, 1e-30),
            c->outs ? nerr(o->logprob, r.logprob, N, 1e-30) : 0,
            c->outs ? nerr(o->entropy, r.entropy, N, 1e-30) : 0,
            fabs(o->zterm - c->z_loss * r.zsum) / fmax(fabs(c->z_loss * r.zsum), 1.0),
        };
        for (int i = 0; i < 7; i++) {
            CHECK_MSG(f[i] <= 1e-5, "%s vs fp64: %s nerr %.3g (N %lld H %lld V %lld Nb %lld Vb %lld)",
                      k ? "plain" : "blocked", i < 6 ? what[i] : "zterm", f[i], (long long)N,
                      (long long)H, (long long)V, (long long)c->Nb, (long long)c->Vb);
            g_worst_ref = fmax(g_worst_ref, f[i]);
        }
    }
    /* ignored rows: loss 0, dh rows 0 */
    bool ign_ok = true;
    for (int64_t n = 0; n < N; n++)
        if (p.tg[n] == -100) {
            ign_ok = ign_ok && b.loss[n] == 0.0f && q.loss[n] == 0.0f;
            for (int64_t k = 0; k < H; k++) ign_ok = ign_ok && b.dh[n * H + k] == 0.0f;
        }
    CHECK(ign_ok);
    run_free(&b);
    run_free(&q);
    ref_free(&r);
    problem_free(&p);
}

/* ---- 2. logits near the fp32 exp range ----------------------------------------------------- */

static void test_large_logits(void) {
    const int64_t N = 40, H = 16, V = 300;
    /* Integer h in [-4000, 4000] and W in [-2, 2]: every logit is an integer below 2^24 in
     * magnitude, so the fp32 gemm forms it exactly in any order and the fp64 reference sees the
     * same logits (otherwise ~1e-7 |logit| of gemm rounding moves near-tied softmax outputs).
     * Logits ~ 13000 N(0,1), up to ~5e4..8e4; sum exp(l) overflows fp32 beyond 88.7. */
    problem p = problem_make(N, H, V, 1.0, 0.1, true);
    for (int64_t i = 0; i < N * H; i++)
        p.hd[i] = p.h[i] = (float)((int64_t)fm_rng_below(&g_rng, 8001) - 4000);
    for (int64_t i = 0; i < V * H; i++)
        p.Wd[i] = p.W[i] = (float)((int64_t)fm_rng_below(&g_rng, 5) - 2);
    /* rows 2j+1 = rows 2j for the first half: exact ties, so softmax, entropy and gradient are
     * not all one-hot (a tied top pair has p = 1/2 each, entropy log 2) */
    for (int64_t v = 0; v + 1 < V / 2; v += 2)
        for (int64_t k = 0; k < H; k++) p.Wd[(v + 1) * H + k] = p.W[(v + 1) * H + k] = p.W[v * H + k];
    double lmax = 0;
    for (int64_t n = 0; n < N; n++)
        for (int64_t v = 0; v < V; v++) {
            double a = 0;
            for (int64_t k = 0; k < H; k++) a += p.hd[n * H + k] * p.Wd[v * H + k];
            lmax = fmax(lmax, fabs(a));
        }
    printf("large logits: max |logit| %.3g\n", lmax);
    CHECK(lmax > 3e4 && lmax < 1.3e5);
    const float zl = 1e-6f, gs = 0.01f;
    run_out b = run_alloc(&p), q = run_alloc(&p);
    run_op(&b, &p, false, 16, 64, zl, gs, true);
    run_op(&q, &p, true, 0, 0, zl, gs, true);
    ref_out r = ref_alloc(N, H, V);
    ref_lce(&r, p.hd, p.Wd, p.tg, p.wt, N, H, V, zl, gs, -100);
    int64_t tied = 0;
    for (int64_t n = 0; n < N; n++) tied += r.entropy[n] > 0.5;
    printf("large logits: %lld of %lld tokens with a tied top pair (entropy log 2)\n", (long long)tied,
           (long long)N);
    CHECK(tied >= 2);
    for (int k = 0; k < 2; k++) {
        const run_out *o = k ? &q : &b;
        CHECK(all_finite(o->loss, N) && all_finite(o->dh, N * H) && all_finite(o->dW, V * H) &&
              all_finite(o->logprob, N) && all_finite(o->entropy, N) && isfinite(o->ce) &&
              isfinite(o->zterm));
        double el = nerr(o->loss, r.loss, N, 1.0), eh = nerr(o->dh, r.dh, N * H, 1e-30),
               ew = nerr(o->dW, r.dW, V * H, 1e-30), ee = nerr(o->entropy, r.entropy, N, 1.0);
        CHECK_MSG(el <= 1e-5, "large logits %s loss nerr %.3g", k ? "plain" : "blocked", el);
        CHECK_MSG(eh <= 1e-5, "large logits %s dh nerr %.3g", k ? "plain" : "blocked", eh);
        CHECK_MSG(ew <= 1e-5, "large logits %s dW nerr %.3g", k ? "plain" : "blocked", ew);
        CHECK_MSG(ee <= 1e-5, "large logits %s entropy nerr %.3g", k ? "plain" : "blocked", ee);
        CHECK_CLOSE(o->ce, r.ce, 1e-5);
        CHECK_CLOSE(o->zterm, zl * r.zsum, 1e-5);
        printf("large logits (%s) vs fp64: loss %.1e dh %.1e dW %.1e entropy %.1e\n",
               k ? "plain" : "blocked", el, eh, ew, ee);
    }
    run_free(&b);
    run_free(&q);
    ref_free(&r);
    problem_free(&p);
}

/* ---- 3. finite differences ---------------------------------------------------------------- */

static void test_finite_differences(void) {
    const int64_t N = 7, H = 5, V = 13;
    const float zl = 0.05f, gs = 0.25f;
    problem p = problem_make(N, H, V, 1.0, 0.0, true);
    p.tg[2] = -100; /* one ignored token */
    run_out b = run_alloc(&p), q = run_alloc(&p);
    run_op(&q, &p, true, 0, 0, zl, gs, false);
    run_op(&b, &p, false, 3, 4, zl, gs, false);
    double *fdh = dnew(N * H), *fdw = dnew(V * H);
    const double eps = 1e-5;
    for (int64_t i = 0; i < N * H; i++) {
        const double x0 = p.hd[i];
        p.hd[i] = x0 + eps;
        const double jp = ref_objective(p.hd, p.Wd, p.tg, p.wt, N, H, V, zl, gs, -100);
        p.hd[i] = x0 - eps;
        const double jm = ref_objective(p.hd, p.Wd, p.tg, p.wt, N, H, V, zl, gs, -100);
        p.hd[i] = x0;
        fdh[i] = (jp - jm) / (2 * eps);
    }
    for (int64_t i = 0; i < V * H; i++) {
        const double x0 = p.Wd[i];
        p.Wd[i] = x0 + eps;
        const double jp = ref_objective(p.hd, p.Wd, p.tg, p.wt, N, H, V, zl, gs, -100);
        p.Wd[i] = x0 - eps;
        const double jm = ref_objective(p.hd, p.Wd, p.tg, p.wt, N, H, V, zl, gs, -100);
        p.Wd[i] = x0;
        fdw[i] = (jp - jm) / (2 * eps);
    }
    const double J = ref_objective(p.hd, p.Wd, p.tg, p.wt, N, H, V, zl, gs, -100);
    for (int k = 0; k < 2; k++) {
        const run_out *o = k ? &q : &b;
        const double eh = nerr(o->dh, fdh, N * H, 1e-30), ew = nerr(o->dW, fdw, V * H, 1e-30);
        printf("finite differences (%s): dh nerr %.2e, dW nerr %.2e\n", k ? "plain" : "blocked", eh, ew);
        CHECK_MSG(eh <= 1e-5, "%s dh vs finite differences: nerr %.3g", k ? "plain" : "blocked", eh);
        CHECK_MSG(ew <= 1e-5, "%s dW vs finite differences: nerr %.3g", k ? "plain" : "blocked", ew);
        CHECK_CLOSE(gs * (o->ce + o->zterm), J, 1e-6);
    }
    free(fdh);
    free(fdw);
    run_free(&b);
    run_free(&q);
    problem_free(&p);
}

/* ---- 4. conventions -------------------------------------------------------------------------- */

static void test_conventions(void) {
    const int64_t N = 33, H = 12, V = 150;
    problem p = problem_make(N, H, V, 1.0, 0.2, false);
    run_out a = run_alloc(&p);
    run_op(&a, &p, false, 8, 40, 0.0f, 1.0f, false);
    CHECK(all_finite(a.dh, N * H)); /* assigned over the NaN poison */
    fm_arena ws;
    FM_ASSERT(fm_arena_init(&ws, "vocabulary projection", fm_linear_ce_bound_bytes(8, 40)) == FM_OK);
    fm_lce_opts opts = fm_lce_opts_default();
    opts.block_tokens = 8;
    opts.block_vocab = 40;
    /* dW accumulates: pre-filled with the first result, it doubles */
    float *dW2 = fnew(V * H), *dh2 = fnew(N * H), *loss2 = fnew(N);
    memcpy(dW2, a.dW, (size_t)(V * H) * sizeof(float));
    double ce2 = lce_sync(fm_linear_ce, &g_be, &ws, loss2, dh2, dW2, p.h, p.W, p.tg, N, H, V, 1.0f, &opts, NULL);
    double *twice = dnew(V * H);
    for (int64_t i = 0; i < V * H; i++) twice[i] = 2.0 * a.dW[i];
    CHECK_MSG(nerr(dW2, twice, V * H, 1e-30) <= 1e-6, "dW does not accumulate");
    CHECK(ce2 == a.ce); /* same bits run to run */
    CHECK(memcmp(dh2, a.dh, (size_t)(N * H) * sizeof(float)) == 0);
    /* forward only (dh = dW = NULL): same loss, in one pass */
    fill_const(loss2, N, NAN);
    double ce3 = lce_sync(fm_linear_ce, &g_be, &ws, loss2, NULL, NULL, p.h, p.W, p.tg, N, H, V, 1.0f, &opts, NULL);
    CHECK(ce3 == a.ce && memcmp(loss2, a.loss, (size_t)N * sizeof(float)) == 0);
    /* all tokens ignored: sum 0, dh 0, dW unchanged */
    int32_t *allign = inew(N);
    for (int64_t n = 0; n < N; n++) allign[n] = -100;
    fill_const(dh2, N * H, NAN);
    memcpy(dW2, a.dW, (size_t)(V * H) * sizeof(float));
    double zt = -1;
    double ce4 = lce_sync(fm_linear_ce, &g_be, &ws, loss2, dh2, dW2, p.h, p.W, allign, N, H, V, 1.0f, &opts, &zt);
    bool zero = true;
    for (int64_t i = 0; i < N * H; i++) zero = zero && dh2[i] == 0.0f;
    for (int64_t n = 0; n < N; n++) zero = zero && loss2[n] == 0.0f;
    CHECK(ce4 == 0.0 && zt == 0.0 && zero);
    CHECK(memcmp(dW2, a.dW, (size_t)(V * H) * sizeof(float)) == 0);
    /* N = 0 */
    CHECK(lce_sync(fm_linear_ce, &g_be, &ws, loss2, dh2, dW2, p.h, p.W, p.tg, 0, H, V, 1.0f, &opts, NULL) == 0.0);
    fm_arena_free(&ws);
    /* NULL opts = defaults: the same as explicit default options */
    FM_ASSERT(fm_arena_init(&ws, "vocabulary projection", fm_linear_ce_bound_bytes(0, 0)) == FM_OK);
    fm_lce_opts d = fm_lce_opts_default();
    double ce5 = lce_sync(fm_linear_ce, &g_be, &ws, loss2, NULL, NULL, p.h, p.W, p.tg, N, H, V, 1.0f, NULL, NULL);
    double ce6 = lce_sync(fm_linear_ce, &g_be, &ws, a.loss, NULL, NULL, p.h, p.W, p.tg, N, H, V, 1.0f, &d, NULL);
    CHECK(ce5 == ce6);
    fm_arena_free(&ws);
    free(allign);
    free(twice);
    free(dW2);
    free(dh2);
    free(loss2);
    run_free(&a);
    problem_free(&p);
}

/* ---- 5. the bound ------------------------------------------------------------------------------ */

static void test_bound(void) {
    const int64_t N = 300, H = 16, V = 1000, Nb = 64, Vb = 256;
    problem p = problem_make(N, H, V, 1.0, 0.1, true);
    run_out b = run_alloc(&p), q = run_alloc(&p);
    const size_t bound = fm_linear_ce_bound_bytes(Nb, Vb), plain = fm_linear_ce_plain_bytes(N, V);
    run_op(&b, &p, false, Nb, Vb, 1e-3f, 1.0f, true); /* arena capacity = bound: no overrun */
    run_op(&q, &p, true, 0, 0, 1e-3f, 1.0f, true);
    printf("bound: N %lld V %lld Nb %lld Vb %lld: blocked high %zu <= bound %zu; plain high %zu "
           "(N*V*4 = %lld)\n", (long long)N, (long long)V, (long long)Nb, (long long)Vb, b.high,
           bound, q.high, (long long)(N * V * 4));
    CHECK(b.high <= bound);
    CHECK(b.high >= bound - bound / 10);
    CHECK(b.high == bound); /* entropy asked: all four state vectors taken */
    CHECK(q.high >= (size_t)(N * V * 4));
    CHECK(q.high == plain);
    CHECK(bound == fm_arena_round(Nb * Vb * 4) + 4 * fm_arena_round(Nb * 4));

    /* ws->used comes back to its entry value; the peak sits on top of what was there */
    fm_arena ws;
    FM_ASSERT(fm_arena_init(&ws, "vocabulary projection", 128 + bound) == FM_OK);
    (void)fm_arena_alloc(&ws, 100);
    fm_lce_opts opts = fm_lce_opts_default();
    opts.block_tokens = Nb;
    opts.block_vocab = Vb;
    lce_sync(fm_linear_ce, &g_be, &ws, b.loss, b.dh, b.dW, p.h, p.W, p.tg, N, H, V, 1.0f, &opts, NULL);
    CHECK(ws.used == 128);
    CHECK(ws.high <= 128 + bound && ws.high >= 128 + bound - bound / 10);
    fm_arena_free(&ws);

    /* painted: the bytes actually written stay within the bound too */
    FM_ASSERT(fm_arena_init(&ws, "vocabulary projection", bound) == FM_OK);
    fm_arena_paint(&ws);
    opts.out_entropy = b.entropy;
    lce_sync(fm_linear_ce, &g_be, &ws, b.loss, b.dh, b.dW, p.h, p.W, p.tg, N, H, V, 1.0f, &opts, NULL);
    const size_t touched = fm_arena_touched(&ws);
    printf("bound: painted arena: %zu bytes written of %zu\n", touched, bound);
    CHECK(touched <= bound && touched >= bound - bound / 10);
    fm_arena_free(&ws);

    /* a measuring arena records the same peak, without computing: a long sequence and a large
     * vocabulary cost the blocked operator nothing more */
    fm_arena m;
    fm_arena_init_measure(&m, "vocabulary projection");
    /* (pointers are never read in measure mode) */
    lce_sync(fm_linear_ce, &g_be, &m, b.loss, NULL, NULL, p.h, p.W, p.tg, 1 << 20, 4096, 151936, 1.0f, &opts,
                 NULL);
    CHECK(m.high == bound && m.used == 0);
    fm_arena m2;
    fm_arena_init_measure(&m2, "vocabulary projection (plain)");
    fm_linear_ce_plain(&g_be, &m2, b.loss, NULL, NULL, p.h, p.W, p.tg, 1 << 14, 4096, 151936, 1.0f,
                       &opts, NULL);
    CHECK(m2.high == fm_linear_ce_plain_bytes(1 << 14, 151936));
    printf("bound: 1M tokens x V 151936: blocked %zu bytes; plain twin at 16K tokens %.1f GiB\n",
           m.high, m2.high / 1073741824.0);

    /* one call's bytes (the trainer's plan): blocks larger than N and V clamped to N x V as the
     * call clamps them, the entropy vector only when asked for: exactly the call's peak */
    CHECK(fm_linear_ce_call_bytes_a(Nb, Vb, N, V, true, sizeof(fm_act)) == bound); /* nothing to clamp */
    for (int ent = 0; ent < 2; ent++) {
        fm_arena c;
        fm_arena_init_measure(&c, "vocabulary projection (clamped)");
        fm_lce_opts co = fm_lce_opts_default();
        co.block_tokens = 4096;
        co.block_vocab = 8192;
        co.out_entropy = ent ? b.entropy : NULL;
        lce_sync(fm_linear_ce, &g_be, &c, b.loss, b.dh, b.dW, p.h, p.W, p.tg, N, H, V, 1.0f, &co, NULL);
        const size_t want = fm_linear_ce_call_bytes_a(4096, 8192, N, V, ent, sizeof(fm_act));
        CHECK_MSG(c.high == want, "blocks 4096 x 8192 at N %lld V %lld, entropy %d: peak %zu, call bytes %zu",
                  (long long)N, (long long)V, ent, c.high, want);
        CHECK(want == fm_arena_round(N * V * 4) + (ent ? 4 : 3) * fm_arena_round(N * 4) +
                          (sizeof(fm_act) == 4 ? 0 : fm_arena_round(N * V * sizeof(fm_act))));
        CHECK(want < fm_linear_ce_bound_bytes(4096, 8192));
    }
    run_free(&b);
    run_free(&q);
    problem_free(&p);
}

/* ---- 6. determinism -------------------------------------------------------------------------
 * The same thread count gives the same bits on every call (what exact resume needs). Across
 * thread counts our strip ops give the same bits, but the BLAS may block a GEMM differently
 * (OpenBLAS's AVX-512 kernels on Xeon do), so 1 vs 2 threads is checked to 1e-6. */

static double max_rel(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static void test_threads(void) {
    const int64_t N = 200, H = 48, V = 700;
    problem p = problem_make(N, H, V, 1.0, 0.1, true);
    run_out o[3] = {run_alloc(&p), run_alloc(&p), run_alloc(&p)};
    const int threads[3] = {2, 2, 1};
    for (int k = 0; k < 3; k++) {
        fm_backend be;
        FM_ASSERT(fm_cpu_backend_init(&be, threads[k], 64) == FM_OK);
        fm_backend keep = g_be;
        g_be = be;
        run_op(&o[k], &p, false, 96, 300, 1e-3f, 0.5f, true);
        g_be = keep;
        fm_cpu_backend_free(&be);
    }
    CHECK(o[0].ce == o[1].ce && o[0].zterm == o[1].zterm);
    CHECK(memcmp(o[0].loss, o[1].loss, (size_t)N * sizeof(float)) == 0);
    CHECK(memcmp(o[0].entropy, o[1].entropy, (size_t)N * sizeof(float)) == 0);
    CHECK(memcmp(o[0].dh, o[1].dh, (size_t)(N * H) * sizeof(float)) == 0);
    CHECK(memcmp(o[0].dW, o[1].dW, (size_t)(V * H) * sizeof(float)) == 0);
    CHECK_CLOSE(o[2].ce, o[0].ce, 1e-6);
    CHECK(max_rel(o[2].loss, o[0].loss, N) < 1e-6);
    CHECK(max_rel(o[2].dh, o[0].dh, N * H) < 1e-6);
    CHECK(max_rel(o[2].dW, o[0].dW, V * H) < 1e-6);
    for (int k = 0; k < 3; k++) run_free(&o[k]);
    problem_free(&p);
}

int main(void) {
    const clock_t t0 = clock();
    fm_rng_seed(&g_rng, fm_test_seed(20240611));
    FM_ASSERT(fm_cpu_backend_init(&g_be, fm_test_threads(0), 64) == FM_OK);

    const ab_case cases[] = {
        /* N   H    V    Nb   Vb  ignore weights z_loss outs */
        {37, 24, 211, 8, 64, 0.2, true, 1e-3f, true},     /* blocks divide neither N nor V */
        {37, 24, 211, 8, 64, 0.0, false, 0.0f, false},    /* the bare loss */
        {37, 24, 211, 37, 211, 0.2, true, 1e-3f, true},   /* one block exactly */
        {37, 24, 211, 100, 1000, 0.2, true, 1e-3f, true}, /* Nb >= N, Vb >= V */
        {64, 32, 512, 16, 128, 0.1, false, 1e-4f, true},  /* blocks divide */
        {50, 16, 300, 1, 7, 0.3, true, 0.01f, true},      /* one token per block, tiny strips */
        {5, 40, 1000, 3, 333, 0.0, true, 0.0f, true},     /* few tokens, vocab tail of 1 */
        {129, 20, 2000, 50, 512, 0.25, true, 1e-4f, true}, /* more vocabulary blocks */
        {16, 8, 97, 16, 1, 0.0, false, 1e-3f, true},      /* one vocabulary entry per block */
        {300, 64, 5000, 128, 1000, 0.1, true, 1e-4f, true}, /* parallel strips, 5 x 3 blocks */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) test_ab(&cases[i]);
    printf("A/B blocked vs plain: worst nerr %.2e (sum %.1e loss %.1e dh %.1e dW %.1e logprob %.1e "
           "entropy %.1e); vs fp64: worst %.2e\n", g_worst_ab, g_worst_q[0], g_worst_q[1], g_worst_q[2],
           g_worst_q[3], g_worst_q[4], g_worst_q[5], g_worst_ref);
    test_large_logits();
    test_finite_differences();
    test_conventions();
    test_bound();
    test_threads();

    fm_cpu_backend_free(&g_be);
    printf("cpu time %.2f s\n", (double)(clock() - t0) / CLOCKS_PER_SEC);
    return fm_test_finish();
}
