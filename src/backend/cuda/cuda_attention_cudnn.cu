/* The cuDNN path of the CUDA attention (cuda_attention.h): cuDNN's fused flash attention
 * through the cuDNN 9 graph ("backend") API, for the shapes cuDNN serves.
 *
 * The cuDNN graphs are the composite SDPA patterns that cuDNN's fused attention engines match
 * (the graphs the cuDNN frontend's SDPA nodes lower to; written here against the C API):
 *
 * forward  S = Q K^T (fp32) -> * scale -> causal select (row >= col ? S : lowest)
 *          -> softmax with stats: M = rowmax S, E = exp(S - M), Z = rowsum E,
 *             Stats = M + log Z (the natural-log lse of the scaled scores, = our lse),
 *             P = E / Z (bf16) -> O = P V
 * backward Dsum = rowsum(dO o O) (fp32 tensor in the workspace), S as above,
 *          P = exp(S - Stats); dV = P^T dO; dP = dO V^T; dS = P o (dP - Dsum) * scale;
 *          dK = dS^T Q; dQacc = dS K (fp32 tensor in the workspace, zeroed) -> dQ = identity(dQacc)
 *          With nkv < nh, dV and dK are formed per query head and reduced (summed) over each
 *          group of nh/nkv heads.
 * Tensors are 4-D [b, h, s, d]; our [B,T,h,hd] layout ("BSHD") is expressed by strides
 * (b: T*h*hd, h: hd, s: h*hd, d: 1); K and V enter transposed ([b, h, d, s]) as the pattern wants.
 * Plans are built at the first call of a shape and cached in att_state, refusals too, so no step
 * rebuilds anything. Everything cuDNN needs besides its inputs and outputs lives in the fixed
 * c->cudnn_workspace: the plan's own workspace and the backward's fp32 dQ accumulator
 * (B*nh*T*hd*4 bytes) and row sums. When they do not fit, the call is split into chunks that do
 * (Bc batch elements with all heads, else one batch element and a few kv heads with their query
 * heads: strided views of the same tensors, one plan for all chunks); when not even one kv head's
 * chunk fits, or cuDNN refuses the shape (e.g. hd % 8 != 0), our kernels serve the call.
 * Since cuDNN's backward accumulates dQ with atomics it is not bitwise deterministic; our
 * kernels are. */
#include "cuda_attention_state.h"

#include <float.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if FM_ATT_CUDNN

namespace {

/* Unique ids of the non-virtual tensors (the variant pack's keys). */
enum {
    U_Q = 1, U_K, U_V, U_O, U_DO, U_STATS, U_SCALE, U_NEGINF, U_ONE, U_DQ, U_DK, U_DV, U_DSUM, U_DQACC,
    U_VIRTUAL = 100
};

/* Graph variants tried in order until cuDNN accepts one (bits of `variant`). The frontend's
 * lowering changed across versions; each of these was emitted by some frontend release:
 *   VAR_DSUM_VIRTUAL  rowsum(dO o O) left virtual (else an fp32 tensor in the workspace)
 *   VAR_DP_ONE        dP multiplied by a by-value 1 (the dropout-mask slot) before - Dsum
 *   VAR_MASK_AFTER    the causal select applied after "- Stats" in the backward (else before)
 * cuDNN 9.14 on an H200 accepts the first (0) for every shape it serves. */
enum { VAR_DSUM_VIRTUAL = 1, VAR_DP_ONE = 2, VAR_MASK_AFTER = 4 };
static const int k_bwd_variants[] = {0, VAR_DSUM_VIRTUAL | VAR_DP_ONE, VAR_MASK_AFTER,
                                     VAR_DSUM_VIRTUAL, VAR_DP_ONE, VAR_DSUM_VIRTUAL | VAR_DP_ONE | VAR_MASK_AFTER};

/* ---- a descriptor set under construction: every created descriptor is recorded (and kept
 * alive with its plan); the first failure stops the rest and leaves its reason in `err`. ------ */
typedef struct gb {
    att_plan *p;
    bool ok;
    char err[512];
    int64_t next_virtual;
} gb;

void gb_fail(gb *g, const char *what, cudnnStatus_t s) {
    if (!g->ok) return;
    g->ok = false;
    char msg[256] = "";
    cudnnGetLastErrorString(msg, sizeof msg);
    snprintf(g->err, sizeof g->err, "%s: %s%s%s", what, cudnnGetErrorString(s), msg[0] ? " -- " : "", msg);
}

BD gb_new(gb *g, cudnnBackendDescriptorType_t t) {
    if (!g->ok) return NULL;
    if (g->p->ndesc >= ATT_MAX_DESC) {
        g->ok = false;
        snprintf(g->err, sizeof g->err, "too many descriptors");
        return NULL;
    }
    BD d = NULL;
    cudnnStatus_t s = cudnnBackendCreateDescriptor(t, &d);
    if (s != CUDNN_STATUS_SUCCESS) {
        gb_fail(g, "cudnnBackendCreateDescriptor", s);
        return NULL;
    }
    g->p->desc[g->p->ndesc++] = d;
    return d;
}

void gb_set(gb *g, BD d, cudnnBackendAttributeName_t a, cudnnBackendAttributeType_t t, int64_t n, const void *v) {
    if (!g->ok) return;
    cudnnStatus_t s = cudnnBackendSetAttribute(d, a, t, n, v);
    if (s != CUDNN_STATUS_SUCCESS) {
        char what[64];
        snprintf(what, sizeof what, "cudnnBackendSetAttribute(%d)", (int)a);
        gb_fail(g, what, s);
    }
}

void gb_fin(gb *g, BD d, const char *what) {
    if (!g->ok) return;
    cudnnStatus_t s = cudnnBackendFinalize(d);
    if (s != CUDNN_STATUS_SUCCESS) gb_fail(g, what, s);
}

BD tensor(gb *g, int64_t uid, cudnnDataType_t dt, const int64_t dim[4], const int64_t str[4], bool virt,
          bool by_value = false) {
    BD d = gb_new(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t align = 16;
    gb_set(g, d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
    gb_set(g, d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim);
    gb_set(g, d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, str);
    gb_set(g, d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    gb_set(g, d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    gb_set(g, d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt);
    if (by_value) gb_set(g, d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    gb_fin(g, d, "tensor");
    return d;
}

/* A virtual tensor [a,b,c,d] with packed strides, or the given ones. */
BD vt(gb *g, cudnnDataType_t dt, int64_t a, int64_t b, int64_t c, int64_t d, const int64_t *str = NULL) {
    const int64_t dim[4] = {a, b, c, d};
    const int64_t packed[4] = {b * c * d, c * d, d, 1};
    return tensor(g, g->next_virtual++, dt, dim, str ? str : packed, true);
}

BD scalar(gb *g, int64_t uid) {
    const int64_t one[4] = {1, 1, 1, 1};
    return tensor(g, uid, CUDNN_DATA_FLOAT, one, one, false, true);
}

/* y = mode(x [, b [, t]]) */
BD pw(gb *g, cudnnPointwiseMode_t mode, cudnnDataType_t prec, BD x, BD b, BD t, BD y, int64_t axis = -1) {
    BD desc = gb_new(g, CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    gb_set(g, desc, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    gb_set(g, desc, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    if (axis >= 0) gb_set(g, desc, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    gb_fin(g, desc, "pointwise descriptor");
    BD op = gb_new(g, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    gb_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &desc);
    gb_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    if (b) gb_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    if (t) gb_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t);
    gb_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    const float one = 1.0f;
    gb_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
    if (b) gb_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    gb_fin(g, op, "pointwise operation");
    return op;
}

BD matmul(gb *g, BD a, BD b, BD c) {
    BD desc = gb_new(g, CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t ct = CUDNN_DATA_FLOAT;
    gb_set(g, desc, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &ct);
    gb_fin(g, desc, "matmul descriptor");
    BD op = gb_new(g, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    gb_set(g, op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a);
    gb_set(g, op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    gb_set(g, op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c);
    gb_set(g, op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &desc);
    gb_fin(g, op, "matmul operation");
    return op;
}

BD reduction(gb *g, cudnnReduceTensorOp_t mode, BD x, BD y) {
    BD desc = gb_new(g, CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t ct = CUDNN_DATA_FLOAT;
    gb_set(g, desc, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    gb_set(g, desc, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &ct);
    gb_fin(g, desc, "reduction descriptor");
    BD op = gb_new(g, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    gb_set(g, op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    gb_set(g, op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    gb_set(g, op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &desc);
    gb_fin(g, op, "reduction operation");
    return op;
}

BD reshape(gb *g, BD x, BD y) {
    BD op = gb_new(g, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    gb_set(g, op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    gb_set(g, op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    gb_fin(g, op, "reshape operation");
    return op;
}

/* S3 = causal select of S2: row >= col ? S2 : lowest. */
void causal_select(gb *g, BD *ops, int *n, BD S2, BD neginf, BD S3, int64_t B, int64_t nh, int64_t T) {
    BD row = vt(g, CUDNN_DATA_INT32, B, nh, T, T), col = vt(g, CUDNN_DATA_INT32, B, nh, T, T);
    BD mask = vt(g, CUDNN_DATA_BOOLEAN, B, nh, T, T);
    ops[(*n)++] = pw(g, CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, S2, NULL, NULL, row, 2);
    ops[(*n)++] = pw(g, CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, S2, NULL, NULL, col, 3);
    ops[(*n)++] = pw(g, CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, NULL, mask);
    ops[(*n)++] = pw(g, CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, S2, neginf, mask, S3);
}

/* Strides of our [B,T,h,hd] tensors as [b, h, s, d], and transposed ([b, h, d, s]). */
void bshd(int64_t T, int64_t h, int64_t hd, int64_t str[4]) {
    str[0] = T * h * hd, str[1] = hd, str[2] = h * hd, str[3] = 1;
}
void bshd_t(int64_t T, int64_t h, int64_t hd, int64_t str[4]) {
    str[0] = T * h * hd, str[1] = hd, str[2] = 1, str[3] = h * hd;
}

/* The operation graph of one direction; NULL (with g->err) when cuDNN refuses it. */
BD build_graph(gb *g, cudnnHandle_t handle, bool bwd, int variant, const att_geom *ge) {
    BD ops[40];
    int n = 0;
    const cudnnDataType_t BF = CUDNN_DATA_BFLOAT16, F = CUDNN_DATA_FLOAT;
    const int64_t B = ge->B, T = ge->T, nh = ge->nh, nkv = ge->nkv, hd = ge->hd;
    int64_t sq[4], sk[4], skt[4], svt[4];
    bshd(T, ge->NH, hd, sq);
    bshd(T, ge->NKV, hd, sk);
    bshd_t(T, ge->NKV, hd, skt);
    bshd_t(T, ge->NKV, hd, svt);
    const int64_t dq[4] = {B, nh, T, hd}, dk[4] = {B, nkv, T, hd}, dkt[4] = {B, nkv, hd, T};
    /* Stats is a head range of lse [B, NH, T]; the row sums below are packed [B, nh, T]. */
    const int64_t dst[4] = {B, nh, T, 1}, sst[4] = {ge->NH * T, T, 1, 1}, spk[4] = {nh * T, T, 1, 1};

    BD Q = tensor(g, U_Q, BF, dq, sq, false);
    BD KT = tensor(g, U_K, BF, dkt, skt, false);
    BD O = tensor(g, U_O, BF, dq, sq, false);
    BD STATS = tensor(g, U_STATS, F, dst, sst, false);
    BD SCALE = scalar(g, U_SCALE), NEGINF = scalar(g, U_NEGINF);

    if (!bwd) {
        BD V = tensor(g, U_V, BF, dk, sk, false);
        BD S = vt(g, F, B, nh, T, T), S2 = vt(g, F, B, nh, T, T), S3 = vt(g, F, B, nh, T, T);
        ops[n++] = matmul(g, Q, KT, S);
        ops[n++] = pw(g, CUDNN_POINTWISE_MUL, F, S, SCALE, NULL, S2);
        causal_select(g, ops, &n, S2, NEGINF, S3, B, nh, T);
        BD M = vt(g, F, B, nh, T, 1), SUB = vt(g, F, B, nh, T, T), E = vt(g, F, B, nh, T, T);
        BD Z = vt(g, F, B, nh, T, 1), LOGZ = vt(g, F, B, nh, T, 1), P = vt(g, BF, B, nh, T, T);
        ops[n++] = reduction(g, CUDNN_REDUCE_TENSOR_MAX, S3, M);
        ops[n++] = pw(g, CUDNN_POINTWISE_SUB, F, S3, M, NULL, SUB);
        ops[n++] = pw(g, CUDNN_POINTWISE_EXP, F, SUB, NULL, NULL, E);
        ops[n++] = reduction(g, CUDNN_REDUCE_TENSOR_ADD, E, Z);
        ops[n++] = pw(g, CUDNN_POINTWISE_LOG, F, Z, NULL, NULL, LOGZ);
        ops[n++] = pw(g, CUDNN_POINTWISE_ADD, F, M, LOGZ, NULL, STATS);
        ops[n++] = pw(g, CUDNN_POINTWISE_DIV, F, E, Z, NULL, P);
        ops[n++] = matmul(g, P, V, O);
    } else {
        BD VT = tensor(g, U_V, BF, dkt, svt, false);
        BD DO = tensor(g, U_DO, BF, dq, sq, false);
        BD DQ = tensor(g, U_DQ, BF, dq, sq, false);
        BD DK = tensor(g, U_DK, BF, dk, sk, false);
        BD DV = tensor(g, U_DV, BF, dk, sk, false);
        const int64_t pq[4] = {nh * T * hd, T * hd, hd, 1};
        BD DQACC = tensor(g, U_DQACC, F, dq, pq, false);
        BD ONE = scalar(g, U_ONE); /* the Dsum (and, in VAR_DP_ONE, dP) dropout-scale slot */

        /* Dsum = rowsum(dO o O) * 1 */
        const int64_t s_doo[4] = {nh * T * hd, T * hd, nh * hd, 1};
        BD DOO = vt(g, F, B, nh, T, hd, s_doo), DRED = vt(g, F, B, nh, T, 1, spk);
        BD DSUM = (variant & VAR_DSUM_VIRTUAL) ? vt(g, F, B, nh, T, 1, spk) : tensor(g, U_DSUM, F, dst, spk, false);
        ops[n++] = pw(g, CUDNN_POINTWISE_MUL, F, DO, O, NULL, DOO);
        ops[n++] = reduction(g, CUDNN_REDUCE_TENSOR_ADD, DOO, DRED);
        ops[n++] = pw(g, CUDNN_POINTWISE_MUL, F, DRED, ONE, NULL, DSUM);

        /* P = exp(causal(S * scale) - Stats) */
        BD S = vt(g, F, B, nh, T, T), S2 = vt(g, F, B, nh, T, T), S3 = vt(g, F, B, nh, T, T);
        BD S4 = vt(g, F, B, nh, T, T), P = vt(g, F, B, nh, T, T);
        ops[n++] = matmul(g, Q, KT, S);
        ops[n++] = pw(g, CUDNN_POINTWISE_MUL, F, S, SCALE, NULL, S2);
        if (!(variant & VAR_MASK_AFTER)) {
            causal_select(g, ops, &n, S2, NEGINF, S3, B, nh, T);
            ops[n++] = pw(g, CUDNN_POINTWISE_SUB, F, S3, STATS, NULL, S4);
        } else {
            ops[n++] = pw(g, CUDNN_POINTWISE_SUB, F, S2, STATS, NULL, S3);
            causal_select(g, ops, &n, S3, NEGINF, S4, B, nh, T);
        }
        ops[n++] = pw(g, CUDNN_POINTWISE_EXP, F, S4, NULL, NULL, P);

        /* dV = P^T dO (per query head, then summed over each group when nkv < nh) */
        const int64_t s_t[4] = {nh * T * T, T * T, 1, T};
        BD PT = vt(g, BF, B, nh, T, T, s_t);
        ops[n++] = reshape(g, P, PT);
        if (nh == nkv) {
            ops[n++] = matmul(g, PT, DO, DV);
        } else {
            BD DVF = vt(g, BF, B, nh, T, hd);
            ops[n++] = matmul(g, PT, DO, DVF);
            ops[n++] = reduction(g, CUDNN_REDUCE_TENSOR_ADD, DVF, DV);
        }

        /* dS = P o (dO V^T [* 1] - Dsum) * scale */
        BD DP = vt(g, F, B, nh, T, T), DP2 = vt(g, F, B, nh, T, T), DS0 = vt(g, F, B, nh, T, T);
        BD DS = vt(g, F, B, nh, T, T);
        ops[n++] = matmul(g, DO, VT, DP);
        BD dp_in = DP;
        if (variant & VAR_DP_ONE) {
            BD DP1 = vt(g, F, B, nh, T, T);
            ops[n++] = pw(g, CUDNN_POINTWISE_MUL, F, DP, ONE, NULL, DP1);
            dp_in = DP1;
        }
        ops[n++] = pw(g, CUDNN_POINTWISE_SUB, F, dp_in, DSUM, NULL, DP2);
        ops[n++] = pw(g, CUDNN_POINTWISE_MUL, F, DP2, P, NULL, DS0);
        ops[n++] = pw(g, CUDNN_POINTWISE_MUL, F, DS0, SCALE, NULL, DS);

        /* dK = dS^T Q */
        BD DST = vt(g, BF, B, nh, T, T, s_t);
        ops[n++] = reshape(g, DS, DST);
        if (nh == nkv) {
            ops[n++] = matmul(g, DST, Q, DK);
        } else {
            BD DKF = vt(g, BF, B, nh, T, hd);
            ops[n++] = matmul(g, DST, Q, DKF);
            ops[n++] = reduction(g, CUDNN_REDUCE_TENSOR_ADD, DKF, DK);
        }

        /* dQ = dS K, accumulated in fp32 */
        BD KV = vt(g, BF, B, nkv, T, hd, sk);
        ops[n++] = reshape(g, KT, KV);
        ops[n++] = matmul(g, DS, KV, DQACC);
        ops[n++] = pw(g, CUDNN_POINTWISE_IDENTITY, F, DQACC, NULL, NULL, DQ);
    }
    if (!g->ok) return NULL;
    BD graph = gb_new(g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    gb_set(g, graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, n, ops);
    gb_set(g, graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    gb_fin(g, graph, "operation graph");
    return g->ok ? graph : NULL;
}

size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

void plan_release(att_plan *p) {
    for (int i = p->ndesc - 1; i >= 0; i--) cudnnBackendDestroyDescriptor(p->desc[i]);
    memset(p, 0, sizeof *p);
}

void note(att_state *st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st->note, sizeof st->note, fmt, ap);
    va_end(ap);
    if (st->verbose) fprintf(stderr, "flatmoe attention: %s\n", st->note);
}

/* Tries the heuristics' engine configs of one graph; true with p->plan set on the first that
 * finalizes and fits next to `extra` bytes in the workspace. */
bool pick_plan(gb *g, cudnnHandle_t handle, BD graph, size_t extra, size_t cap, att_plan *p) {
    const cudnnBackendHeurMode_t modes[2] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK};
    for (int mi = 0; mi < 2; mi++) {
        gb h = *g;
        BD heur = gb_new(&h, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
        gb_set(&h, heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph);
        gb_set(&h, heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &modes[mi]);
        gb_fin(&h, heur, "engine heuristics");
        int64_t count = 0;
        if (h.ok) {
            cudnnStatus_t s = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                       CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, NULL);
            if (s != CUDNN_STATUS_SUCCESS) gb_fail(&h, "heuristics result count", s);
        }
        if (count > 8) count = 8;
        if (!h.ok || count <= 0) {
            if (h.ok) snprintf(h.err, sizeof h.err, "heuristics mode %d: no engine config", (int)modes[mi]);
            snprintf(g->err, sizeof g->err, "%s", h.err);
            continue;
        }
        BD cfg[8];
        for (int i = 0; i < count; i++) cfg[i] = gb_new(&h, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
        int64_t got = 0;
        if (h.ok) {
            cudnnStatus_t s = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                       CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, cfg);
            if (s != CUDNN_STATUS_SUCCESS) gb_fail(&h, "heuristics results", s);
        }
        char last[512] = "";
        for (int i = 0; h.ok && i < got; i++) {
            gb e = h;
            BD plan = gb_new(&e, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
            gb_set(&e, plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
            gb_set(&e, plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg[i]);
            gb_fin(&e, plan, "execution plan");
            int64_t ws = 0, nws = 0;
            if (e.ok) {
                cudnnStatus_t s = cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                           CUDNN_TYPE_INT64, 1, &nws, &ws);
                if (s != CUDNN_STATUS_SUCCESS) gb_fail(&e, "plan workspace size", s);
            }
            if (!e.ok) {
                snprintf(last, sizeof last, "%s", e.err);
                continue;
            }
            if (align256((size_t)ws) + extra > cap) {
                snprintf(last, sizeof last, "plan needs %lld + %zu workspace bytes, the cuDNN workspace has %zu",
                         (long long)ws, extra, cap);
                continue;
            }
            p->plan = plan;
            p->ws = ws;
            return true;
        }
        snprintf(g->err, sizeof g->err, "%s", h.ok ? (last[0] ? last : "no config finalized") : h.err);
    }
    return false;
}

/* The cached plan of a shape, built at its first call (NULL: cuDNN does not serve it). */
att_plan *get_plan(fm_cuda_ctx *c, att_state *st, bool bwd, const att_geom *ge) {
    const int64_t B = ge->B, T = ge->T, nh = ge->nh, nkv = ge->nkv, hd = ge->hd;
    att_plan *victim = &st->plans[0];
    for (int i = 0; i < ATT_MAX_PLANS; i++) {
        att_plan *p = &st->plans[i];
        if (p->used && p->bwd == (int)bwd && !memcmp(&p->geo, ge, sizeof *ge)) {
            p->last_use = ++st->tick;
            return p->ok ? p : NULL;
        }
        if (!p->used) {
            if (victim->used) victim = p;
        } else if (victim->used && p->last_use < victim->last_use) victim = p;
    }
    att_plan *p = victim;
    if (p->used) plan_release(p);
    p->used = true;
    p->bwd = bwd;
    p->geo = *ge;
    p->last_use = ++st->tick;

    const size_t cap = c->cudnn_workspace ? c->cudnn_workspace_bytes : 0;
    const int nvar = bwd ? (int)(sizeof k_bwd_variants / sizeof k_bwd_variants[0]) : 1;
    char first_err[512] = "";
    for (int vi = 0; vi < nvar; vi++) {
        const int variant = bwd ? k_bwd_variants[vi] : 0;
        const int keep = p->ndesc;
        gb g = {p, true, "", U_VIRTUAL};
        size_t extra = 0;
        if (bwd) {
            p->off_dqacc = 0; /* relative; shifted past the plan's workspace below */
            extra = align256((size_t)(B * nh * T * hd) * sizeof(float));
            p->off_dsum = extra;
            if (!(variant & VAR_DSUM_VIRTUAL)) extra += align256((size_t)(B * nh * T) * sizeof(float));
        }
        if (extra > cap) {
            snprintf(g.err, sizeof g.err, "the backward's fp32 dQ accumulator needs %zu bytes, the cuDNN "
                     "workspace has %zu", extra, cap);
        } else {
            BD graph = build_graph(&g, c->cudnn, bwd, variant, ge);
            if (graph && pick_plan(&g, c->cudnn, graph, extra, cap, p)) {
                p->ok = true;
                p->variant = variant;
                const size_t base = align256((size_t)p->ws);
                p->off_dqacc += base;
                p->off_dsum += base;
                p->total = base + extra;
                if (st->verbose)
                    fprintf(stderr, "flatmoe attention: cuDNN %s plan B=%lld T=%lld nh=%lld nkv=%lld hd=%lld "
                            "(of %lld/%lld heads; graph variant %d, workspace %zu bytes)\n", bwd ? "backward" : "forward",
                            (long long)B, (long long)T, (long long)nh, (long long)nkv, (long long)hd,
                            (long long)ge->NH, (long long)ge->NKV, variant, p->total);
                return p;
            }
        }
        if (!first_err[0]) snprintf(first_err, sizeof first_err, "%s", g.err);
        if (st->verbose)
            fprintf(stderr, "flatmoe attention: cuDNN %s graph variant %d refused: %s\n", bwd ? "backward" : "forward",
                    variant, g.err);
        /* drop this variant's descriptors */
        for (int i = p->ndesc - 1; i >= keep; i--) cudnnBackendDestroyDescriptor(p->desc[i]);
        p->ndesc = keep;
    }
    note(st, "cuDNN refused %s B=%lld T=%lld nh=%lld nkv=%lld hd=%lld: %s", bwd ? "backward" : "forward",
         (long long)B, (long long)T, (long long)nh, (long long)nkv, (long long)hd, first_err);
    p->ok = false;
    return NULL;
}

bool execute(fm_cuda_ctx *c, att_state *st, att_plan *p, int n, const int64_t *uids, void **ptrs) {
    BD vp = NULL;
    cudnnStatus_t s = cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp);
    void *ws = c->cudnn_workspace;
    if (s == CUDNN_STATUS_SUCCESS) s = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids);
    if (s == CUDNN_STATUS_SUCCESS) s = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs);
    if (s == CUDNN_STATUS_SUCCESS) s = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    if (s == CUDNN_STATUS_SUCCESS) s = cudnnBackendFinalize(vp);
    if (s == CUDNN_STATUS_SUCCESS) s = cudnnSetStream(c->cudnn, c->stream);
    if (s == CUDNN_STATUS_SUCCESS) s = cudnnBackendExecute(c->cudnn, p->plan, vp);
    if (vp) cudnnBackendDestroyDescriptor(vp);
    if (s != CUDNN_STATUS_SUCCESS) {
        char msg[256] = "";
        cudnnGetLastErrorString(msg, sizeof msg);
        note(st, "cuDNN execution failed (%s%s%s); this shape now uses our kernels", cudnnGetErrorString(s),
             msg[0] ? ": " : "", msg);
        p->ok = false; /* keep the entry: never again for this shape */
        return false;
    }
    return true;
}

} // namespace

/* Runs one direction on cuDNN, chunk by chunk (strided views of the full tensors; one plan
 * serves every chunk). false: cuDNN does not serve this call (nothing usable was written). */
bool fm_att_cudnn_run(fm_cuda_ctx *c, att_state *st, bool bwd, bf16 *out, float *lse, bf16 *dq, bf16 *dk, bf16 *dv,
                      const bf16 *dout, const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *o, int64_t B,
                      int64_t T, int64_t nh, int64_t nkv, int64_t hd, int64_t *nchunks) {
    const void *ptrs_in[9] = {out, dq, dk, dv, dout, q, k, v, o};
    for (int i = 0; i < 9; i++)
        if (ptrs_in[i] && !aligned16(ptrs_in[i])) return false;
    if (hd % 8) return false; /* cuDNN's fused attention needs hd % 8 == 0 */
    const size_t cap = c->cudnn_workspace ? c->cudnn_workspace_bytes : 0;
    int64_t Bc = B, kc = nkv;
    if (!fm_cuda_attention_pick_chunks(cap, bwd, B, T, nh, nkv, hd, &Bc, &kc)) {
        note(st, "cuDNN %s B=%lld T=%lld nh=%lld nkv=%lld hd=%lld: even one kv head's chunk needs more than the "
             "%zu-byte cuDNN workspace", bwd ? "backward" : "forward", (long long)B, (long long)T, (long long)nh,
             (long long)nkv, (long long)hd, cap);
        return false;
    }
    const int64_t grp = nh / nkv, nhc = kc * grp;
    const att_geom ge = {Bc, T, nhc, kc, hd, nh, nkv};
    att_plan *p = get_plan(c, st, bwd, &ge);
    if (!p) return false;
    float scale = (float)(1.0 / sqrt((double)hd)), neginf = -FLT_MAX, one = 1.0f;
    char *ws = (char *)c->cudnn_workspace;
    *nchunks = 0;
    for (int64_t b0 = 0; b0 < B; b0 += Bc)
        for (int64_t g0 = 0; g0 < nkv; g0 += kc) {
            const int64_t qo = b0 * T * nh * hd + g0 * grp * hd, ko = b0 * T * nkv * hd + g0 * hd;
            const int64_t lo = (b0 * nh + g0 * grp) * T;
            bool ok;
            if (!bwd) {
                const int64_t uids[7] = {U_Q, U_K, U_V, U_O, U_STATS, U_SCALE, U_NEGINF};
                void *ptrs[7] = {(void *)(q + qo), (void *)(k + ko), (void *)(v + ko), out + qo, lse + lo, &scale,
                                 &neginf};
                ok = execute(c, st, p, 7, uids, ptrs);
            } else {
                void *dqacc = ws + p->off_dqacc, *dsum = ws + p->off_dsum;
                if (!FM_CUDA_OK(c, cudaMemsetAsync(dqacc, 0, (size_t)(Bc * nhc * T * hd) * sizeof(float), c->stream)))
                    return true; /* recorded (status): the step is lost, so the fallback is not run either */
                const int64_t uids[14] = {U_Q,  U_K,    U_V,  U_O,  U_DO, U_STATS, U_SCALE,
                                          U_NEGINF, U_ONE, U_DQ, U_DK, U_DV, U_DQACC, U_DSUM};
                void *ptrs[14] = {(void *)(q + qo), (void *)(k + ko),    (void *)(v + ko), (void *)(o + qo),
                                  (void *)(dout + qo), (void *)(lse + lo), &scale,           &neginf,
                                  &one,               dq + qo,            dk + ko,          dv + ko,
                                  dqacc,              dsum};
                ok = execute(c, st, p, (p->variant & VAR_DSUM_VIRTUAL) ? 13 : 14, uids, ptrs);
            }
            if (!ok) return false; /* the caller recomputes everything with our kernels */
            ++*nchunks;
        }
    return true;
}

void fm_att_cudnn_free(att_state *st) {
    for (int i = 0; i < ATT_MAX_PLANS; i++)
        if (st->plans[i].used) plan_release(&st->plans[i]);
}

#endif /* FM_ATT_CUDNN */
