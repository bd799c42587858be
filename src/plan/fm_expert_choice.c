/* The expert GEMMs' form under FLATMOE_EXPERT_GEMM (fm_expert_choice.h). */
#include "fm_expert_choice.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../backend/fm_backend_plan.h"
#include "../backend/fm_fp8_layout.h"
#include "fm_project.h"

static bool has_curves(const fm_calib *cb) { return cb->expert_fwd_sm90.n > 0 && cb->expert_bwd_sm90.n > 0; }

static int ep_of(const fm_plan_req *r) {
    const int e = r->mesh.on ? (int)r->mesh.ep : r->ep;
    return e > 1 ? e : 1;
}

static bool served(const fm_plan_req *r) {
    const fm_config *c = &r->cfg;
    return fm_cuda_sm90_expert_gemm_serves(c->num_experts, c->hidden_size, c->moe_intermediate_size,
                                           r->B * r->T * c->num_experts_per_tok);
}

/* The first condition of the rule that fails (FM_EXPERT_WHY_FASTER: none does), time aside. */
static fm_expert_why candidate(const fm_plan_req *r, const fm_expert_ask *a, const fm_calib *cb, bool forced,
                               bool check_ep) {
    if (!a->cuda_bf16) return FM_EXPERT_WHY_NOT_CUDA;
    if (r->expert_fp8) return FM_EXPERT_WHY_FP8;
    if (check_ep && ep_of(r) > 1) return FM_EXPERT_WHY_EP;
    if (!served(r)) return FM_EXPERT_WHY_SHAPE;
    if (forced) return FM_EXPERT_WHY_FASTER; /* the backend checks the device itself, and refuses */
    if (!a->device_sm90) return FM_EXPERT_WHY_DEVICE;
    if (!has_curves(cb)) return FM_EXPERT_WHY_NO_CURVES;
    return FM_EXPERT_WHY_FASTER;
}

void fm_expert_choose(const fm_plan_req *r, const fm_plan *p, const fm_expert_ask *a, const fm_calib *cb,
                      fm_expert_choice *out) {
    memset(out, 0, sizeof *out);
    out->requested = a->requested;
    out->E = r->cfg.num_experts, out->H = r->cfg.hidden_size, out->I = r->cfg.moe_intermediate_size;
    out->ep = ep_of(r);
    out->rows_per_expert = fm_project_rows_per_expert(r, p);
    out->fp8_codes = r->expert_fp8 && r->expert_fp8_codes;
    if (a->cuda_bf16 && has_curves(cb)) {
        out->projected = true;
        out->sm90_s = fm_project_expert_s(r, p, cb, true);
        out->cublas_s = fm_project_expert_s(r, p, cb, false);
    }
    if (a->requested != FM_EXPERT_GEMM_AUTO) { /* forced */
        out->gemm = a->requested;
        out->why = FM_EXPERT_WHY_FORCED;
        if (a->requested == FM_EXPERT_GEMM_SM90) {
            const fm_expert_why w = candidate(r, a, cb, true, true);
            out->sm90 = w == FM_EXPERT_WHY_FASTER;
            if (!out->sm90) out->why = w;
        }
        return;
    }
    out->gemm = a->cuda_bf16 ? FM_EXPERT_GEMM_CUBLAS : FM_EXPERT_GEMM_AUTO; /* the CPU has no use for it */
    out->why = candidate(r, a, cb, false, true);
    if (out->why != FM_EXPERT_WHY_FASTER) return;
    out->sm90 = out->sm90_s < out->cublas_s; /* ties: cuBLAS */
    if (out->sm90) out->gemm = FM_EXPERT_GEMM_SM90;
    else out->why = FM_EXPERT_WHY_NOT_FASTER;
}

void fm_expert_choice_prepare(fm_plan_req *r, const fm_expert_ask *a, const fm_calib *cb) {
    r->expert_sync_free =
        a->requested == FM_EXPERT_GEMM_SM90 && candidate(r, a, cb, true, true) == FM_EXPERT_WHY_FASTER;
    /* ep aside: a mesh search may change the mesh's ep, and fm_project_expert_sm90 keeps --ep on cuBLAS */
    r->expert_gemm_auto =
        a->requested == FM_EXPERT_GEMM_AUTO && candidate(r, a, cb, false, false) == FM_EXPERT_WHY_FASTER;
}

void fm_expert_choice_finish(fm_plan_req *r, const fm_plan *p, const fm_expert_ask *a, const fm_calib *cb,
                             fm_expert_choice *out) {
    fm_expert_choose(r, p, a, cb, out);
    r->expert_sync_free = out->sm90;
    r->expert_gemm_auto = false;
}

const char *fm_expert_choice_form(const fm_expert_choice *ch) {
    if (ch->fp8_codes) return ch->why == FM_EXPERT_WHY_NOT_CUDA ? "fp8-cpu-codes" : "fp8-sm90";
    if (ch->why == FM_EXPERT_WHY_NOT_CUDA) return "cpu";
    if (ch->sm90) return "sm90";
    if (ch->gemm == FM_EXPERT_GEMM_GROUPED) return "grouped";
    if (ch->gemm == FM_EXPERT_GEMM_LOOP) return "loop";
    return "cublas";
}

static const char *why_key(fm_expert_why w) {
    switch (w) {
    case FM_EXPERT_WHY_FORCED: return "forced";
    case FM_EXPERT_WHY_FASTER: return "faster";
    case FM_EXPERT_WHY_NOT_FASTER: return "not_faster";
    case FM_EXPERT_WHY_NOT_CUDA: return "not_cuda";
    case FM_EXPERT_WHY_EP: return "ep";
    case FM_EXPERT_WHY_SHAPE: return "shape";
    case FM_EXPERT_WHY_DEVICE: return "device";
    case FM_EXPERT_WHY_NO_CURVES: return "no_curves";
    case FM_EXPERT_WHY_FP8: return "fp8";
    }
    return "?";
}

/* Milliseconds as words: one decimal from 1 ms, three significant digits below. */
static const char *ms(double s, char *b, size_t n) {
    snprintf(b, n, s >= 1e-3 ? "%.1f" : "%.3g", 1e3 * s);
    return b;
}

void fm_expert_choice_why(const fm_expert_choice *ch, char *buf, size_t n) {
    char m1[32], m2[32];
    const bool forced = ch->requested != FM_EXPERT_GEMM_AUTO;
    char head[64];
    if (forced) snprintf(head, sizeof head, "FLATMOE_EXPERT_GEMM=%s", fm_expert_gemm_name(ch->requested));
    else snprintf(head, sizeof head, "auto");
    const char *tail = forced ? "" : "; FLATMOE_EXPERT_GEMM forces one";
    switch (ch->why) {
    case FM_EXPERT_WHY_FORCED:
        if (ch->projected)
            snprintf(buf, n, "%s; projected sm90 %s ms per step, cuBLAS %s ms at %.0f rows per expert", head,
                     ms(ch->sm90_s, m1, sizeof m1), ms(ch->cublas_s, m2, sizeof m2), ch->rows_per_expert);
        else snprintf(buf, n, "%s", head);
        return;
    case FM_EXPERT_WHY_FASTER:
    case FM_EXPERT_WHY_NOT_FASTER:
        snprintf(buf, n, "%s: projected %s ms per step against %s %s ms at %.0f rows per expert%s", head,
                 ms(ch->sm90 ? ch->sm90_s : ch->cublas_s, m1, sizeof m1), ch->sm90 ? "cuBLAS" : "sm90",
                 ms(ch->sm90 ? ch->cublas_s : ch->sm90_s, m2, sizeof m2), ch->rows_per_expert, tail);
        return;
    case FM_EXPERT_WHY_NOT_CUDA:
        snprintf(buf, n, "%s: not the CUDA backend in bf16", head);
        return;
    case FM_EXPERT_WHY_EP:
        snprintf(buf, n, "%s: expert parallelism (ep %d) needs the expert counts on the host for its all-to-all",
                 head, ch->ep);
        return;
    case FM_EXPERT_WHY_SHAPE:
        snprintf(buf, n, "%s: the sm90 kernel does not serve E %lld, H %lld, I %lld (it needs H and I multiples of "
                 "128, 1 <= E <= 256)", head, (long long)ch->E, (long long)ch->H, (long long)ch->I);
        return;
    case FM_EXPERT_WHY_DEVICE:
        snprintf(buf, n, "%s: the device is not compute capability 9.0 (the sm90 kernel's)%s", head, tail);
        return;
    case FM_EXPERT_WHY_NO_CURVES:
        snprintf(buf, n, "%s: the calibration table has no sm90 curves (expert_fwd_sm90, expert_bwd_sm90; "
                 "FLATMOE_EXPERT_GEMM=sm90 flatmoe-cuda calibrate measures them)%s", head, tail);
        return;
    case FM_EXPERT_WHY_FP8:
        if (ch->fp8_codes)
            snprintf(buf, n, "%s: --expert-precision fp8 runs on E4M3 codes, our FP8 grouped GEMM for sm_90 (sync-free)", head);
        else snprintf(buf, n, "%s: --expert-precision fp8 quantizes the operands for cuBLAS's forms", head);
        return;
    }
    snprintf(buf, n, "%s", head);
}

void fm_expert_choice_line(const fm_expert_choice *ch, char *buf, size_t n) {
    char why[400];
    fm_expert_choice_why(ch, why, sizeof why);
    const char *f = fm_expert_choice_form(ch);
    snprintf(buf, n, "expert GEMM: %s (%s)", strcmp(f, "cublas") == 0 ? "cuBLAS" : f, why);
}

fm_status fm_expert_choice_json(const fm_expert_choice *ch, char *buf, size_t cap) {
    FM_ASSERT(ch && (buf || cap == 0));
    char t[96] = "\"sm90_s\":null,\"cublas_s\":null";
    if (ch->projected) snprintf(t, sizeof t, "\"sm90_s\":%.6g,\"cublas_s\":%.6g", ch->sm90_s, ch->cublas_s);
    const int w = snprintf(buf, cap, "{\"form\":\"%s\",\"requested\":\"%s\",\"why\":\"%s\",%s,\"rows_per_expert\":%.6g}",
                           fm_expert_choice_form(ch), fm_expert_gemm_name(ch->requested), why_key(ch->why), t,
                           ch->rows_per_expert);
    if (w < 0 || (size_t)w >= cap) {
        if (cap) buf[0] = '\0';
        return fm_error(FM_ERR_ARG, "expert GEMM choice as JSON: %d bytes do not fit the %zu-byte buffer", w + 1, cap);
    }
    return FM_OK;
}

/* The experts and the most rows one call of the codes path sees: all E over the dispatch's B T k
 * rows on one rank; under --ep the owner's E/ep over at most ep x B T x min(k, E/ep) rows (its
 * R_max, fm_moe_ep_bound, for a cap of at most B T tokens). */
static void codes_shape(const fm_plan_req *r, int64_t *E, int64_t *rows) {
    const fm_config *c = &r->cfg;
    const int ep = ep_of(r);
    const int64_t El = c->num_experts / ep, k = c->num_experts_per_tok;
    *E = El;
    *rows = ep == 1 ? r->B * r->T * k : (int64_t)ep * r->B * r->T * (k < El ? k : El);
}

bool fm_expert_fp8_codes(const fm_plan_req *r, const fm_expert_ask *a) {
    const fm_config *c = &r->cfg;
    if (!r->expert_fp8) return false;
    int64_t E, rows;
    codes_shape(r, &E, &rows);
    if (!fm_fp8_layer_serves(E, c->hidden_size, c->moe_intermediate_size, rows)) return false;
    if (!a->cuda_bf16) return a->cpu_fp8_codes;
    return a->device_sm90 && (a->requested == FM_EXPERT_GEMM_AUTO || a->requested == FM_EXPERT_GEMM_SM90);
}

void fm_expert_fp8_codes_why(const fm_plan_req *r, const fm_expert_ask *a, char *buf, size_t cap) {
    const fm_config *c = &r->cfg;
    const long long H = c->hidden_size, I = c->moe_intermediate_size;
    int64_t El, R;
    codes_shape(r, &El, &R);
    const long long rows = (long long)R;
    buf[0] = '\0';
    if (fm_expert_fp8_codes(r, a)) return;
    if (!r->expert_fp8) snprintf(buf, cap, "--expert-precision is bf16");
    else if (H % 128 != 0 || I % 128 != 0 || H <= 0 || I <= 0)
        snprintf(buf, cap, "hidden_size %lld and moe_intermediate_size %lld are not both multiples of 128 (the fast path "
                 "needs sizes multiples of 128)", H, I);
    else if (El < 1 || El > 256)
        snprintf(buf, cap, "num_experts%s is %lld (the fast path takes 1 to 256%s)", ep_of(r) > 1 ? " / --ep" : "",
                 (long long)El, ep_of(r) > 1 ? " per rank" : "");
    else if (!fm_fp8_layer_serves(El, c->hidden_size, c->moe_intermediate_size, R))
        snprintf(buf, cap, "the dispatch's %lld rows (micro-batch x seq-len x top-k%s) or their padded tokens reach 2^31 "
                 "(a smaller --micro-batch or --seq-len)", rows, ep_of(r) > 1 ? ", x --ep at an owner" : "");
    else if (!a->cuda_bf16)
        snprintf(buf, cap, "the backend is cpu (the fast path needs CUDA on an sm_90 GPU: the CUDA build, or plan --backend cuda)");
    else if (!a->device_sm90) snprintf(buf, cap, "this GPU is not sm_90 (the fast path needs an H100 or H200)");
    else
        snprintf(buf, cap, "FLATMOE_EXPERT_GEMM=%s keeps the emulation (the fast path needs FLATMOE_EXPERT_GEMM auto or sm90)",
                 fm_expert_gemm_name(a->requested));
}
