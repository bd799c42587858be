#include "fm_calibrate.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../backend/fm_backend_default.h"
#include "../backend/fm_backend_plan.h"
#include "../backend/fm_fp8_layout.h"
#include "fm_choose.h"
#include "fm_plan_device.h"
#include "fm_project.h"

#define MAX_REPS 5

typedef struct cal {
    const fm_calibrate_opts *o;
    fm_backend be;
    bool gpu;
    int reps;
} cal;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void logf_(const cal *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void logf_(const cal *c, const char *fmt, ...) {
    if (!c->o->log) return;
    char line[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    c->o->log(c->o->user, line);
}

static void *dev_alloc(cal *c, size_t bytes, const char *what, fm_status *st) {
    if (*st) return NULL;
    void *p = c->be.ops->mem_alloc(c->be.ctx, bytes);
    if (!p) *st = fm_error(FM_ERR_NOMEM, "calibrate: cannot allocate %.1f MiB of device memory for %s; free the device "
                           "or use --quick", bytes / 1048576.0, what);
    return p;
}

static void dev_free(cal *c, void *p) {
    if (p) c->be.ops->mem_free(c->be.ctx, p);
}

/* Fills n activation elements with values in [-0.5, 0.5) (random data: zeros would let a GPU
 * clock higher than in training): one host block, uploaded, then doubled with device copies. */
static void fill_act(cal *c, void *dst, int64_t n) {
    const int64_t blk = n < (1 << 20) ? n : (1 << 20);
    const size_t es = sizeof(fm_act);
    unsigned char *h = fm_malloc((size_t)blk * es);
    if (!h) return; /* the values do not matter for correctness */
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (int64_t i = 0; i < blk; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        const float f = (float)((s >> 40) & 0xFFFF) / 65536.0f - 0.5f;
        if (es == 4) memcpy(h + i * 4, &f, 4);
        else {
            uint32_t b;
            memcpy(&b, &f, 4);
            const uint16_t hb = (uint16_t)(b >> 16);
            memcpy(h + i * 2, &hb, 2);
        }
    }
    c->be.ops->copy(c->be.ctx, dst, h, (size_t)blk * es, FM_COPY_H2D);
    fm_free(h);
    int64_t done = blk;
    while (done < n) {
        const int64_t m = done < n - done ? done : n - done;
        c->be.ops->copy(c->be.ctx, (char *)dst + done * es, dst, (size_t)m * es, FM_COPY_D2D);
        done += m;
    }
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef void (*op_fn)(cal *c, void *arg);

/* Seconds of one call of fn: one warm-up, then of reps calls (each ended by a sync) the median on
 * a GPU, the minimum on the CPU (whose cores other processes share: interference only adds). */
static double time_op(cal *c, op_fn fn, void *arg, int reps) {
    double t[MAX_REPS];
    if (reps > MAX_REPS) reps = MAX_REPS;
    fn(c, arg);
    c->be.ops->sync(c->be.ctx);
    for (int i = 0; i < reps; i++) {
        const double t0 = now_s();
        fn(c, arg);
        c->be.ops->sync(c->be.ctx);
        t[i] = now_s() - t0;
    }
    qsort(t, (size_t)reps, sizeof t[0], cmp_d);
    const double med = c->gpu ? t[reps / 2] : t[0];
    return med > 1e-9 ? med : 1e-9;
}

/* Throughput: reps calls back to back and one sync, per call (the GPU: the median of 3 such
 * batches). The expert GEMMs use it: in the model the host enqueues gate, up and down
 * one after the other, so each call's host work (cuBLAS's grouped call builds and uploads its
 * pointer arrays) overlaps the previous call's kernels, which time_op's sync after every call
 * exposes. (Session 8's 4K projection charged 74 ms for experts the profile measured at 47 ms:
 * cuBLAS's grouped call timed one call at a time at 250-290 TFLOP/s, 421 inside the model; this
 * is the suspected cause, to be confirmed by the next calibration on the H200.) */
static double time_op_pipelined(cal *c, op_fn fn, void *arg, int reps) {
    if (reps < 1) reps = 1;
    fn(c, arg);
    c->be.ops->sync(c->be.ctx);
    double t[3];
    const int nb = c->gpu ? 3 : 1; /* the CPU's times are steady: one batch (as many calls as time_op) */
    for (int b = 0; b < nb; b++) {
        const double t0 = now_s();
        for (int i = 0; i < reps; i++) fn(c, arg);
        c->be.ops->sync(c->be.ctx);
        t[b] = (now_s() - t0) / reps;
    }
    qsort(t, (size_t)nb, sizeof t[0], cmp_d);
    const double v = t[nb / 2];
    return v > 1e-9 ? v : 1e-9;
}

/* ---- GEMMs ------------------------------------------------------------------------------ */
typedef struct gemm_arg { fm_act *A, *B, *C; int64_t M, K, N; } gemm_arg;
static void run_gemm(cal *c, void *p) {
    gemm_arg *g = p; /* a linear layer's forward: C [M,N] = A [M,K] B^T, B [N,K] */
    c->be.ops->gemm(c->be.ctx, false, true, g->M, g->N, g->K, 1.0f, g->A, g->K, g->B, g->K, 0.0f, g->C, FM_ACT_DTYPE, g->N);
}

static fm_status cal_gemm(cal *c, fm_calib *out) {
    const int64_t K = c->gpu ? 2048 : 1024;
    int64_t ms_gpu[] = {1024, 4096, 16384, 65536}, ms_cpu[] = {256, 1024, 2048, 4096};
    const int n = c->gpu ? 4 : c->o->quick ? 3 : 4;
    const int64_t *ms = c->gpu ? ms_gpu : ms_cpu, Mmax = ms[n - 1];
    fm_status st = FM_OK;
    gemm_arg g = {dev_alloc(c, (size_t)Mmax * K * sizeof(fm_act), "the GEMM's A", &st),
                  dev_alloc(c, (size_t)K * K * sizeof(fm_act), "the GEMM's B", &st),
                  dev_alloc(c, (size_t)Mmax * K * sizeof(fm_act), "the GEMM's C", &st), 0, K, K};
    if (st == FM_OK) {
        fill_act(c, g.A, Mmax * K);
        fill_act(c, g.B, K * K);
        out->gemm.n = 0;
        for (int i = 0; i < n; i++) {
            g.M = ms[i];
            const double t = time_op(c, run_gemm, &g, c->reps);
            const double r = 2.0 * (double)g.M * K * K / t;
            fm_calib_add(&out->gemm, (double)g.M, r);
            logf_(c, "gemm          M %6lld x K %lld x N %lld      %8.3f ms  %8.2f TFLOP/s", (long long)g.M, (long long)K,
                  (long long)K, 1e3 * t, r / 1e12);
        }
        st = c->be.ops->status(c->be.ctx);
    }
    dev_free(c, g.A);
    dev_free(c, g.B);
    dev_free(c, g.C);
    return st;
}

/* ---- grouped expert GEMMs --------------------------------------------------------------- */
typedef struct exp_arg {
    fm_act *x, *W, *y, *dx, *dW;
    int64_t *offs;
    int64_t E, H, I, rows;
    bool bwd, sm90; /* sm90: the sync-free ops (FLATMOE_EXPERT_GEMM=sm90), rows = offs[E] */
} exp_arg;
/* --expert-precision fp8 on E4M3 codes: one product as model/fm_experts_fp8.c runs it, its
 * quantization included (the weight's, done once per layer per pass there, and the activation
 * operands'). fwd: q(W), q(x) rows, y = x W^T. bwd: q(W), q(dy) rows, dx = dy W, q(dy), q(x)
 * tokens, dW += dy^T x (the layer shares x's tokens between gate and up: charged here per product,
 * a little pessimistic). Buffers of fm_fp8_layout.h: w8, a8 rows, t0/t1 tokens. */
typedef struct exp8_arg {
    exp_arg *e;
    void *w8, *a8, *t0, *t1;
} exp8_arg;
static void run_exp8(cal *c, void *p) {
    const exp8_arg *q = p;
    const exp_arg *a = q->e;
    const fm_ops *o = c->be.ops;
    void *ctx = c->be.ctx;
    const int64_t in = a->H, out = a->I, R = a->rows;
    o->fp8_quant_weight(ctx, q->w8, a->W, a->E, out, in);
    if (!a->bwd) {
        o->fp8_quant_rows(ctx, q->a8, a->x, a->offs, R, a->E, in);
        o->expert_fp8_gemm(ctx, 0, a->y, 0.0f, q->a8, q->w8, a->offs, R, a->E, in, out);
        return;
    }
    o->fp8_quant_rows(ctx, q->a8, a->y, a->offs, R, a->E, out);
    o->expert_fp8_gemm(ctx, 1, a->dx, 0.0f, q->a8, q->w8, a->offs, R, a->E, in, out);
    o->fp8_quant_tokens(ctx, q->t0, a->y, a->offs, R, a->E, out);
    o->fp8_quant_tokens(ctx, q->t1, a->x, a->offs, R, a->E, in);
    o->expert_fp8_gemm(ctx, 2, a->dW, 1.0f, q->t0, q->t1, a->offs, R, a->E, in, out);
}

/* One layer-sized weight's quantization (fp8_quant_weight of W [E, I, H] into w8), the rate the
 * projection charges the weight codes at (fm_calib.fp8_weight_quant_bw). */
static void run_wq(cal *c, void *p) {
    const exp8_arg *q = p;
    c->be.ops->fp8_quant_weight(c->be.ctx, q->w8, q->e->W, q->e->E, q->e->I, q->e->H);
}

static void run_exp(cal *c, void *p) {
    exp_arg *a = p;
    const fm_ops *o = c->be.ops;
    if (a->sm90 && a->bwd)
        o->expert_linear_bwd_dev(c->be.ctx, a->dx, 0.0f, a->dW, a->y, a->x, a->W, a->offs, a->rows, a->E, a->H, a->I);
    else if (a->sm90) o->expert_linear_fwd_dev(c->be.ctx, a->y, a->x, a->W, a->offs, a->rows, a->E, a->H, a->I);
    else if (a->bwd) fm_expert_linear_bwd(&c->be, a->dx, 0.0f, a->dW, a->y, a->x, a->W, a->offs, a->E, a->H, a->I);
    else fm_expert_linear_fwd(&c->be, a->y, a->x, a->W, a->offs, a->E, a->H, a->I);
}

/* The experts' rate per rows-per-expert point is measured on the three products the MoE layer runs
 * (fm_experts.c): gate and up, H -> I each, then down, I -> H, and is their FLOPs over their summed
 * time, which is how the projection (fm_project.c) charges the experts' FLOPs. Before, only the
 * H -> I product was timed, and without the 512 and 4,096 rows-per-expert points (4K and 32K tokens
 * of OLMoE-1B-7B): the projection at 4K then charged 67.7 ms for experts measured at 42-46 ms. */
static fm_status cal_experts(cal *c, fm_calib *out) {
    const int64_t E = c->gpu ? 64 : 8, H = c->gpu ? 2048 : 512, I = c->gpu ? 1024 : 256;
    int64_t r_gpu[] = {16, 64, 256, 512, 1024, 2048, 4096}, r_cpu[] = {16, 128, 1024};
    const int n = c->gpu ? 7 : c->o->quick ? 2 : 3;
    const int64_t *rs = c->gpu ? r_gpu : r_cpu, R = rs[n - 1] * E;
    const int64_t in = H > I ? H : I; /* the wider of the products' inputs and outputs */
    fm_status st = FM_OK;
    exp_arg a = {dev_alloc(c, (size_t)R * in * sizeof(fm_act), "the experts' x", &st),
                 dev_alloc(c, (size_t)E * I * H * sizeof(fm_act), "the experts' W", &st),
                 dev_alloc(c, (size_t)R * in * sizeof(fm_act), "the experts' y", &st),
                 dev_alloc(c, (size_t)R * in * sizeof(fm_act), "the experts' dx", &st),
                 dev_alloc(c, (size_t)E * I * H * sizeof(fm_act), "the experts' dW", &st), NULL, E, H, I, 0, false,
                 false};
    void *offs = st ? NULL : c->be.ops->buffer_alloc(c->be.ctx, FM_BUFFER_PINNED, (size_t)(E + 1) * sizeof(int64_t));
    if (!st && !offs) st = fm_error(FM_ERR_NOMEM, "calibrate: cannot allocate the expert offsets in pinned memory");
    a.offs = offs;
    if (st == FM_OK) {
        fill_act(c, a.x, R * in);
        fill_act(c, a.W, E * I * H);
        fill_act(c, a.y, R * in);
        out->expert_fwd.n = out->expert_bwd.n = 0;
        out->expert_fwd_sm90.n = out->expert_bwd_sm90.n = 0;
        const int64_t prod[3][2] = {{H, I}, {H, I}, {I, H}}; /* gate, up, down: input -> output width */
        out->expert_fwd_fp8.n = out->expert_bwd_fp8.n = 0;
        /* the sm90 kernel too when the backend runs it (FLATMOE_EXPERT_GEMM=sm90): its own curves;
         * and the fp8 code ops where the backend serves them (pass 2: expert_*_fp8) */
        const bool sm90 = c->be.ops->expert_sync_free && c->be.ops->expert_sync_free(c->be.ctx, E, H, I, R);
        const bool fp8 = fm_backend_fp8_codes_serves(&c->be, E, H, I, R);
        const int64_t M = H > I ? H : I, kcap = fm_fp8_kcap(R, E);
        exp8_arg q = {&a, NULL, NULL, NULL, NULL};
        if (fp8) {
            q.w8 = dev_alloc(c, (size_t)fm_fp8_weight_bytes(E, I, H), "the fp8 weight codes", &st);
            q.a8 = dev_alloc(c, (size_t)fm_fp8_rows_bytes(R, M), "the fp8 row codes", &st);
            q.t0 = dev_alloc(c, (size_t)fm_fp8_tokens_bytes(kcap, M), "the fp8 token codes", &st);
            q.t1 = dev_alloc(c, (size_t)fm_fp8_tokens_bytes(kcap, M), "the fp8 token codes", &st);
        }
        for (int pass = 0; pass < 3 && st == FM_OK; pass++) {
            if ((pass == 1 && !sm90) || (pass == 2 && !fp8)) continue;
            for (int i = 0; i < n; i++) {
                for (int64_t e = 0; e <= E; e++) a.offs[e] = e * rs[i];
                a.sm90 = pass == 1, a.rows = rs[i] * E;
                double f = 0, tf = 0, tb = 0;
                for (int p = 0; p < 3; p++) {
                    a.H = prod[p][0], a.I = prod[p][1];
                    f += 2.0 * (double)(rs[i] * E) * (double)a.H * (double)a.I;
                    a.bwd = false;
                    tf += pass == 2 ? time_op_pipelined(c, run_exp8, &q, c->reps) : time_op_pipelined(c, run_exp, &a, c->reps);
                    a.bwd = true;
                    tb += pass == 2 ? time_op_pipelined(c, run_exp8, &q, c->reps) : time_op_pipelined(c, run_exp, &a, c->reps);
                }
                fm_calib_curve *cf = pass == 2 ? &out->expert_fwd_fp8 : pass == 1 ? &out->expert_fwd_sm90 : &out->expert_fwd;
                fm_calib_curve *cb = pass == 2 ? &out->expert_bwd_fp8 : pass == 1 ? &out->expert_bwd_sm90 : &out->expert_bwd;
                fm_calib_add(cf, (double)rs[i], f / tf);
                fm_calib_add(cb, (double)rs[i], 2.0 * f / tb);
                logf_(c, "experts%s  %lld x %5lld rows, %lld -> 2 x %lld -> %lld   fwd %8.3f ms %7.2f TFLOP/s, bwd %8.3f ms %7.2f TFLOP/s",
                      pass == 2 ? " fp8 " : pass == 1 ? " sm90" : "     ", (long long)E, (long long)rs[i], (long long)H,
                      (long long)I, (long long)H, 1e3 * tf, f / tf / 1e12, 1e3 * tb, 2.0 * f / tb / 1e12);
            }
        }
        if (fp8 && st == FM_OK) { /* the weights' quantization alone: 4 bytes a weight element */
            a.H = H, a.I = I;
            const double t = time_op_pipelined(c, run_wq, &q, c->reps);
            out->fp8_weight_quant_bw = 4.0 * (double)(E * I * H) / t;
            logf_(c, "fp8 weights   %lld x %lld x %lld quantized (codes + transposed codes)  %8.3f ms  %8.1f GB/s", (long long)E,
                  (long long)I, (long long)H, 1e3 * t, out->fp8_weight_quant_bw / 1e9);
        } else out->fp8_weight_quant_bw = 0;
        dev_free(c, q.w8);
        dev_free(c, q.a8);
        dev_free(c, q.t0);
        dev_free(c, q.t1);
        if (st == FM_OK) st = c->be.ops->status(c->be.ctx);
    }
    if (offs) c->be.ops->buffer_free(c->be.ctx, FM_BUFFER_PINNED, offs);
    dev_free(c, a.x);
    dev_free(c, a.W);
    dev_free(c, a.y);
    dev_free(c, a.dx);
    dev_free(c, a.dW);
    return st;
}

/* ---- attention -------------------------------------------------------------------------- */
typedef struct att_arg { fm_act *q, *k, *v, *o, *d, *dq, *dk, *dv; float *lse; int64_t T, nh, hd; bool bwd; } att_arg;
static void run_att(cal *c, void *p) {
    att_arg *a = p;
    if (a->bwd)
        c->be.ops->attention_bwd(c->be.ctx, a->dq, a->dk, a->dv, a->d, a->q, a->k, a->v, a->o, a->lse, 1, a->T, a->nh,
                                 a->nh, a->hd, NULL);
    else c->be.ops->attention_fwd(c->be.ctx, a->o, a->lse, a->q, a->k, a->v, 1, a->T, a->nh, a->nh, a->hd, NULL);
}

static int64_t att_tmax(const fm_calibrate_opts *o, bool gpu) {
    return gpu ? (o->quick ? 65536 : 262144) : (o->quick ? 1024 : 2048);
}

static fm_status cal_attention(cal *c, fm_calib *out) {
    const int64_t nh = c->gpu || !c->o->quick ? 16 : 4, hd = c->gpu || !c->o->quick ? 128 : 64;
    const int64_t Tmax = att_tmax(c->o, c->gpu), D = nh * hd;
    const size_t bytes = (size_t)Tmax * D * sizeof(fm_act);
    fm_status st = FM_OK;
    fm_act *b[8];
    const char *names[8] = {"q", "k", "v", "out", "d out", "dq", "dk", "dv"};
    for (int i = 0; i < 8; i++) {
        char w[48];
        snprintf(w, sizeof w, "the attention's %s", names[i]);
        b[i] = dev_alloc(c, bytes, w, &st);
    }
    float *lse = dev_alloc(c, (size_t)Tmax * nh * 4, "the attention's lse", &st);
    if (st == FM_OK) {
        for (int i = 0; i < 5; i++) fill_act(c, b[i], Tmax * D);
        att_arg a = {b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], lse, 0, nh, hd, false};
        out->att_fwd.n = out->att_bwd.n = 0;
        const int64_t T0 = c->gpu ? 1024 : c->o->quick ? 128 : 256;
        for (int64_t T = T0; T <= Tmax && out->att_fwd.n < FM_CALIB_MAX_POINTS; T *= 2) {
            a.T = T;
            const int reps = T >= 65536 ? 1 : c->reps; /* the long ones are seconds each */
            a.bwd = false;
            const double tf = time_op(c, run_att, &a, reps);
            a.bwd = true;
            const double tb = time_op(c, run_att, &a, reps);
            const double ff = 2.0 * (double)T * (double)T * (double)D, fb = 5.0 * (double)T * (double)T * (double)D;
            fm_calib_add(&out->att_fwd, (double)T, ff / tf);
            fm_calib_add(&out->att_bwd, (double)T, fb / tb);
            logf_(c, "attention     T %7lld, %lld heads x %lld   fwd %9.3f ms %7.2f TFLOP/s, bwd %9.3f ms %7.2f TFLOP/s",
                  (long long)T, (long long)nh, (long long)hd, 1e3 * tf, ff / tf / 1e12, 1e3 * tb, fb / tb / 1e12);
            if ((st = c->be.ops->status(c->be.ctx))) break;
        }
    }
    for (int i = 0; i < 8; i++) dev_free(c, b[i]);
    dev_free(c, lse);
    return st;
}

/* ---- memory-bound: dispatch, elementwise, AdamW ----------------------------------------- */
typedef struct mem_arg { fm_act *x, *xe, *out, *p, *g; float *w, *master, *m, *v; int32_t *rr, *rw; int64_t n, N, k, H; int which; } mem_arg;
static void run_mem(cal *c, void *p) {
    mem_arg *a = p;
    const fm_ops *o = c->be.ops;
    if (a->which == 0) {
        o->moe_gather(c->be.ctx, a->xe, a->x, a->rr, a->N * a->k, a->k, a->H);
        o->moe_combine_fwd(c->be.ctx, a->out, a->xe, a->w, a->rw, a->N, a->k, a->H);
    } else if (a->which == 1) {
        o->add(c->be.ctx, a->x, a->xe, a->n);
    } else {
        o->adamw(c->be.ctx, a->p, a->g, a->master, a->m, a->v, FM_DTYPE_F32, a->n, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f,
                 0.1f, 0.05f, 1.0f);
    }
}

static fm_status cal_memory(cal *c, fm_calib *out) {
    const size_t a = sizeof(fm_act);
    fm_status st = FM_OK;
    /* dispatch: N tokens x k routes of H, a strided permutation of the routes */
    const int64_t N = c->gpu ? 16384 : c->o->quick ? 1024 : 4096, k = 8, H = c->gpu ? 2048 : 512, R = N * k;
    mem_arg m = {0};
    m.N = N, m.k = k, m.H = H;
    m.x = dev_alloc(c, (size_t)N * H * a, "the dispatch's x", &st);
    m.xe = dev_alloc(c, (size_t)R * H * a, "the dispatch's rows", &st);
    m.out = dev_alloc(c, (size_t)N * H * a, "the combine's output", &st);
    m.w = dev_alloc(c, (size_t)R * 4, "the top-k weights", &st);
    m.rr = dev_alloc(c, (size_t)R * 4, "the row -> route map", &st);
    m.rw = dev_alloc(c, (size_t)R * 4, "the route -> row map", &st);
    int32_t *h = st ? NULL : fm_malloc((size_t)R * 8);
    if (!st && !h) st = fm_error(FM_ERR_NOMEM, "calibrate: out of host memory for the dispatch maps");
    if (st == FM_OK) {
        for (int64_t r = 0; r < R; r++) {
            const int32_t row = (int32_t)((r * 7919) % R); /* 7919 is odd and R a power of 2: a bijection */
            h[r] = row;         /* route -> row */
            h[R + row] = (int32_t)r; /* row -> route */
        }
        c->be.ops->copy(c->be.ctx, m.rw, h, (size_t)R * 4, FM_COPY_H2D);
        c->be.ops->copy(c->be.ctx, m.rr, h + R, (size_t)R * 4, FM_COPY_H2D);
        fill_act(c, m.x, N * H);
        m.which = 0;
        const double t = time_op(c, run_mem, &m, c->reps);
        const double bytes = (double)R * H * a * 3.0 + (double)N * H * a; /* gather r+w, combine r, out w */
        out->dispatch_bw = bytes / t;
        logf_(c, "dispatch      %lld tokens x top-%lld x %lld (gather + combine)  %8.3f ms  %8.1f GB/s", (long long)N,
              (long long)k, (long long)H, 1e3 * t, bytes / t / 1e9);
        /* elementwise: y += x over R*H elements */
        const int64_t n = N * H; /* x += out: both N x H */
        mem_arg e = m;
        e.which = 1;
        e.n = n;
        e.xe = m.out;
        const double te = time_op(c, run_mem, &e, c->reps);
        out->elementwise_bw = 3.0 * (double)n * a / te;
        logf_(c, "elementwise   add over %lld elements            %8.3f ms  %8.1f GB/s", (long long)n, 1e3 * te,
              out->elementwise_bw / 1e9);
        st = c->be.ops->status(c->be.ctx);
    }
    fm_free(h);
    dev_free(c, m.x);
    dev_free(c, m.xe);
    dev_free(c, m.out);
    dev_free(c, m.w);
    dev_free(c, m.rr);
    dev_free(c, m.rw);
    if (st) return st;
    /* AdamW over n parameters, fp32 moments; the CPU's weights are the master */
    const int64_t n = c->gpu ? (int64_t)128 << 20 : c->o->quick ? (int64_t)2 << 20 : (int64_t)8 << 20;
    mem_arg w = {0};
    w.which = 2;
    w.n = n;
    w.p = dev_alloc(c, (size_t)n * a, "AdamW's weights", &st);
    w.g = dev_alloc(c, (size_t)n * a, "AdamW's gradients", &st);
    if (a != 4) w.master = dev_alloc(c, (size_t)n * 4, "AdamW's master", &st);
    w.m = dev_alloc(c, (size_t)n * 4, "AdamW's m", &st);
    w.v = dev_alloc(c, (size_t)n * 4, "AdamW's v", &st);
    if (st == FM_OK) {
        fill_act(c, w.g, n);
        const double t = time_op(c, run_mem, &w, c->reps);
        const double bytes = (double)n * fm_project_adamw_bytes((int)a, false, FM_MASTER_FP32);
        out->adamw_bw = bytes / t;
        logf_(c, "adamw         %lld parameters (fp32 moments)    %8.3f ms  %8.1f GB/s", (long long)n, 1e3 * t,
              out->adamw_bw / 1e9);
        st = c->be.ops->status(c->be.ctx);
    }
    dev_free(c, w.p);
    dev_free(c, w.g);
    dev_free(c, w.master);
    dev_free(c, w.m);
    dev_free(c, w.v);
    return st;
}

/* ---- the host link ---------------------------------------------------------------------- */
typedef struct link_arg { void *d_in, *d_out, *h_in, *h_out; size_t bytes; int which; } link_arg;
static void run_link(cal *c, void *p) {
    link_arg *l = p;
    const fm_ops *o = c->be.ops;
    if (l->which & 1) o->copy_async(c->be.ctx, l->d_in, l->h_in, l->bytes, FM_COPY_H2D, FM_STREAM_COPY_IN);
    if (l->which & 2) o->copy_async(c->be.ctx, l->h_out, l->d_out, l->bytes, FM_COPY_D2H, FM_STREAM_COPY_OUT);
    if (l->which & 1) o->stream_sync(c->be.ctx, FM_STREAM_COPY_IN);
    if (l->which & 2) o->stream_sync(c->be.ctx, FM_STREAM_COPY_OUT);
}

static fm_status cal_link(cal *c, fm_calib *out) {
    const size_t bytes = c->gpu ? (size_t)512 << 20 : c->o->quick ? (size_t)16 << 20 : (size_t)64 << 20;
    fm_status st = FM_OK;
    link_arg l = {dev_alloc(c, bytes, "the link's device buffer (in)", &st),
                  dev_alloc(c, bytes, "the link's device buffer (out)", &st), NULL, NULL, bytes, 0};
    if (st == FM_OK) {
        l.h_in = c->be.ops->buffer_alloc(c->be.ctx, FM_BUFFER_PINNED, bytes);
        l.h_out = c->be.ops->buffer_alloc(c->be.ctx, FM_BUFFER_PINNED, bytes);
        if (!l.h_in || !l.h_out)
            st = fm_error(FM_ERR_NOMEM, "calibrate: cannot pin 2 x %.0f MiB of host memory for the link", bytes / 1048576.0);
    }
    if (st == FM_OK) {
        l.which = 1;
        const double t_in = time_op(c, run_link, &l, c->reps);
        l.which = 2;
        const double t_out = time_op(c, run_link, &l, c->reps);
        l.which = 3;
        const double t_both = time_op(c, run_link, &l, c->reps);
        out->h2d = (double)bytes / t_in;
        out->d2h = (double)bytes / t_out;
        out->h2d_duplex = out->d2h_duplex = (double)bytes / t_both;
        logf_(c, "host link     %.0f MiB: h2d %.1f GB/s, d2h %.1f GB/s, both at once %.1f GB/s each way", bytes / 1048576.0,
              out->h2d / 1e9, out->d2h / 1e9, out->h2d_duplex / 1e9);
        st = c->be.ops->status(c->be.ctx);
    }
    if (l.h_in) c->be.ops->buffer_free(c->be.ctx, FM_BUFFER_PINNED, l.h_in);
    if (l.h_out) c->be.ops->buffer_free(c->be.ctx, FM_BUFFER_PINNED, l.h_out);
    dev_free(c, l.d_in);
    dev_free(c, l.d_out);
    return st;
}

static double peak_of(const char *kind, const fm_calib *t, bool gpu) {
    if (gpu) {
        if (!strcmp(kind, "h100") || !strcmp(kind, "h200") || !strcmp(kind, "h800") || !strcmp(kind, "gh200")) return 989e12;
        if (!strcmp(kind, "b200") || !strcmp(kind, "gb200")) return 2250e12;
        if (!strcmp(kind, "a100") || !strcmp(kind, "a800")) return 312e12;
    }
    double best = 0; /* else the best GEMM rate measured (the CPU: what BLAS reaches) */
    for (int i = 0; i < t->gemm.n; i++)
        if (t->gemm.rate[i] > best) best = t->gemm.rate[i];
    return best;
}

fm_status fm_calibrate_run(const fm_calibrate_opts *o, fm_calib *out) {
    memset(out, 0, sizeof *out);
    cal c = {.o = o, .gpu = sizeof(fm_act) != 4, .reps = sizeof(fm_act) != 4 ? 3 : 5};
    snprintf(out->backend, sizeof out->backend, "%s", c.gpu ? "cuda" : "cpu");
    out->act_bytes = (int)sizeof(fm_act);
    fm_calib_mesh_link_default(out, out->backend); /* not measured here: the nominal links */
    if (c.gpu) { /* the context and libraries first, on an otherwise idle device */
        fm_device_budget d;
        FM_TRY(fm_device_budget_measure(128, &d));
        out->context_bytes = (double)d.context_bytes;
        snprintf(out->device, sizeof out->device, "%s", d.name);
        logf_(&c, "device        %s: %.1f MiB, %.1f MiB free with the context; the libraries and kernels took %.1f MiB; "
              "context + libraries %.1f MiB", d.name, d.total / 1048576.0, d.free_start / 1048576.0,
              d.library_bytes / 1048576.0, d.context_bytes / 1048576.0);
    } else {
        fm_device_name(out->device, sizeof out->device);
        logf_(&c, "device        %s", out->device);
    }
    fm_calib_kind_of(out->backend, out->device, out->kind);
    out->host_pinnable_bytes = (double)fm_host_mem_budget_default();
    /* the caller's options (FLATMOE_EXPERT_GEMM=sm90: the sm90 expert curves too) */
    fm_backend_opts bo = o->backend ? *o->backend : fm_backend_opts_default();
    bo.threads = o->threads;
    bo.max_head_dim = 128;
    bo.profile = false;
    /* cuDNN's workspace sized for the longest attention backward measured (as a run plans it) */
    bo.gpu_workspace = c.gpu ? fm_cuda_cudnn_workspace_auto(1, att_tmax(o, true), 16, 16, 128) : 0;
    FM_TRY(fm_backend_default_init_opts(&c.be, &bo));
    const double t0 = now_s();
    fm_status st = cal_gemm(&c, out);
    if (st == FM_OK) st = cal_experts(&c, out);
    if (st == FM_OK) st = cal_attention(&c, out);
    if (st == FM_OK) st = cal_memory(&c, out);
    if (st == FM_OK) st = cal_link(&c, out);
    fm_backend_default_free(&c.be);
    if (st) return fm_error(st, "calibrate: %s", fm_errmsg());
    out->peak_flops = peak_of(out->kind, out, c.gpu);
    snprintf(out->source, sizeof out->source, "measured by flatmoe calibrate%s", o->quick ? " --quick" : "");
    logf_(&c, "done in %.1f s; peak for MFU %.4g TFLOP/s", now_s() - t0, out->peak_flops / 1e12);
    return FM_OK;
}
