/* v0: the backend's expert GEMMs today (src/backend/cuda/cuda_gemm.cu expert_gemm, default "auto"
 * form), restated for the lab: the offsets come back to the host first (a synchronous
 * device-to-host copy, part of the timed call), experts with >= 1024 rows get their own
 * cublasGemmEx over a multiple of 256 rows (dW: all rows), the rest go 128 at a time into one
 * cublasGemmGroupedBatchedEx call, its pointer arrays written by a one-block kernel from
 * by-value parameters. gg_v0_grouped_launch is the pure grouped form (FLATMOE_EXPERT_GEMM=grouped).
 * cuBLAS works column-major: the row-major C = op(A) op(B) is C^T = op(B)^T op(A)^T.
 */
#pragma once
#include "gg_common.cuh"
#include <cublas_v2.h>
#include <climits>
#include <vector>

namespace v0 {

constexpr int GROUP_MAX = 128, OWN_ROWS = 1024, QUANTUM = 256;

struct ptrs {
    const void *a[GROUP_MAX], *b[GROUP_MAX];
    void *c[GROUP_MAX];
};
__global__ void ptrs_kernel(ptrs p, int n, const void **out) {
    const int i = threadIdx.x;
    if (i < n) out[i] = p.a[i], out[GROUP_MAX + i] = p.b[i], out[2 * GROUP_MAX + i] = p.c[i];
}

struct state {
    cublasHandle_t h = nullptr;
    const void **dev = nullptr; /* 3 * GROUP_MAX device pointers */
    std::vector<int64_t> offs;
};
static state &st() {
    static state s;
    if (!s.h) {
        cublasCreate(&s.h);
        cudaMalloc((void **)&s.dev, 3 * GROUP_MAX * sizeof(void *));
    }
    return s;
}

/* Row-major per-group products (the backend's expert_rows): kind 0 y_e = x_e W_e^T; 1 dx_e =
 * beta dx_e + dy_e W_e; 2 dW_e += dy_e^T x_e. */
static cudaError_t run(const gg_problem &p, cudaStream_t stream, int64_t own) {
    state &s = st();
    cublasSetStream(s.h, stream);
    s.offs.resize(p.E + 1);
    cudaError_t err = cudaMemcpyAsync(s.offs.data(), p.offs, (p.E + 1) * sizeof(int64_t), cudaMemcpyDeviceToHost, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) return err;
    const int kind = p.kind;
    const int64_t in = p.in, out = p.out;
    const bool ta = kind == 2, tb = kind == 0;
    const int lda = (int)(kind == 0 ? in : out), ldb = (int)in, ldc = (int)(kind == 0 ? out : in);
    const float one = 1.0f, cbeta = kind == 0 ? 0.0f : kind == 1 ? p.beta : 1.0f;
    const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    ptrs pp;
    int M[GROUP_MAX], N[GROUP_MAX], K[GROUP_MAX], n = 0;
    cublasStatus_t cs = CUBLAS_STATUS_SUCCESS;
    auto flush = [&]() {
        if (!n) return;
        ptrs_kernel<<<1, GROUP_MAX, 0, stream>>>(pp, n, s.dev);
        cublasOperation_t oa[GROUP_MAX], ob[GROUP_MAX];
        int la[GROUP_MAX], lb[GROUP_MAX], lc[GROUP_MAX], sz[GROUP_MAX];
        float al[GROUP_MAX], be[GROUP_MAX];
        for (int g = 0; g < n; g++) oa[g] = opa, ob[g] = opb, la[g] = lda, lb[g] = ldb, lc[g] = ldc, sz[g] = 1, al[g] = 1.0f, be[g] = cbeta;
        const cublasStatus_t r = cublasGemmGroupedBatchedEx(s.h, ob, oa, N, M, K, al, s.dev + GROUP_MAX, CUDA_R_16BF, lb, s.dev,
                                                            CUDA_R_16BF, la, be, const_cast<void *const *>(s.dev + 2 * GROUP_MAX),
                                                            CUDA_R_16BF, lc, n, sz, CUBLAS_COMPUTE_32F);
        if (r != CUBLAS_STATUS_SUCCESS) cs = r;
        n = 0;
    };
    auto problem = [&](int64_t e, int64_t r, int64_t mm, const void **a, const void **b, void **c, int64_t *MM, int64_t *NN, int64_t *KK) {
        const bf16 *We = p.B + e * out * in;
        if (kind == 0) *a = p.A + r * in, *b = We, *c = p.C + r * out, *MM = mm, *NN = out, *KK = in;
        else if (kind == 1) *a = p.A + r * out, *b = We, *c = p.C + r * in, *MM = mm, *NN = in, *KK = out;
        else *a = p.A + r * out, *b = p.B + r * in, *c = p.C + e * out * in, *MM = out, *NN = in, *KK = mm;
    };
    for (int64_t e = 0; e < p.E; e++) {
        const int64_t r0 = s.offs[e], m = s.offs[e + 1] - r0;
        if (m <= 0) continue;
        if (m > INT_MAX) return GG_NOT_SERVED;
        int64_t mo = 0;
        const void *a, *b;
        void *c;
        int64_t MM, NN, KK;
        if (m >= own) {
            const int64_t qn = (own == 1 || kind == 2) ? 1 : QUANTUM;
            mo = m / qn * qn;
            problem(e, r0, mo, &a, &b, &c, &MM, &NN, &KK);
            const cublasStatus_t r = cublasGemmEx(s.h, opb, opa, (int)NN, (int)MM, (int)KK, &one, b, CUDA_R_16BF, ldb, a,
                                                  CUDA_R_16BF, lda, &cbeta, c, CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F,
                                                  CUBLAS_GEMM_DEFAULT);
            if (r != CUBLAS_STATUS_SUCCESS) cs = r;
        }
        if (mo < m) {
            problem(e, r0 + mo, m - mo, &a, &b, &c, &MM, &NN, &KK);
            pp.a[n] = a, pp.b[n] = b, pp.c[n] = c, M[n] = (int)MM, N[n] = (int)NN, K[n] = (int)KK;
            if (++n == GROUP_MAX) flush();
        }
    }
    flush();
    if (cs != CUBLAS_STATUS_SUCCESS) return cudaErrorUnknown;
    return cudaGetLastError();
}

} // namespace v0

/* v0 as the backend's default (auto) form, and the pure grouped form; p.beta for dW must be 1
 * (the backend's only dW form: dW_e += dy_e^T x_e). */
static cudaError_t gg_v0_launch(const gg_problem &p, cudaStream_t stream) {
    if (p.kind == 2 && p.beta != 1.0f) return GG_NOT_SERVED;
    return v0::run(p, stream, v0::OWN_ROWS);
}
static cudaError_t gg_v0_grouped_launch(const gg_problem &p, cudaStream_t stream) {
    if (p.kind == 2 && p.beta != 1.0f) return GG_NOT_SERVED;
    return v0::run(p, stream, INT64_MAX);
}
