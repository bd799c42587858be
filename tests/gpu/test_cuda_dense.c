/* CUDA backend dense ops (src/backend/cuda/cuda_*.cu) against the plain fp64 host references
 * of tests/fm_ref_ops.c (shared with the CPU tests): gemm (all transpose combinations, alpha/beta,
 * leading dimensions wider than the matrices, C bf16 and fp32, K = 0), the grouped expert GEMMs,
 * add, sumsq, convert, and the memory ops (buffer kinds; copy_async on the copy streams ordered by
 * events against the compute stream; host_sync_count at each sync point); determinism (two calls,
 * the same bits) of sumsq (whose result, a device double, is read after a stream_sync); a few
 * timings at the end (printed, not checked). The layer ops (embedding, RMSNorm, RoPE, SwiGLU,
 * AdamW) are test_cuda_layers.c's; inputs, tolerances and helpers: gpu_dense_test.h.
 */
#include "gpu_dense_test.h"

/* ---- init ------------------------------------------------------------------------------------ */

static void test_init_errors(void) {
    fm_backend b = {(const fm_ops *)1, (void *)1};
    CHECK(gt_cuda_init(NULL, 0, 64, 0) == FM_ERR_ARG);
    CHECK(gt_cuda_init(&b, -1, 64, 0) == FM_ERR_ARG);
    CHECK(b.ops == NULL && b.ctx == NULL);
    CHECK(gt_cuda_init(&b, 0, 0, 0) == FM_ERR_ARG);
    CHECK(gt_cuda_init(&b, 4096, 64, 0) == FM_ERR_ARG); /* no such device */
    CHECK_MSG(strstr(fm_errmsg(), "device") != NULL, "message: %s", fm_errmsg());
    CHECK(b.ops == NULL && b.ctx == NULL);
    /* cuBLASLt 32 MiB + the default cuDNN 64 MiB + 16 MiB scratch */
    CHECK(fm_cuda_backend_workspace_bytes(128, 0) == ((size_t)112 << 20));
    CHECK(fm_cuda_backend_workspace_bytes(128, (size_t)1 << 20) < fm_cuda_backend_workspace_bytes(128, 0));
    fm_cuda_backend_free(NULL);
    fm_backend empty = {NULL, NULL};
    fm_cuda_backend_free(&empty);
}

/* ---- gemm ------------------------------------------------------------------------------------ */

/* All four transpose combinations x C fp32/bf16, alpha/beta, leading dimensions wider than the
 * matrices (the padding must stay untouched, bit for bit), beta = 0 over a NaN C; K = 0 and
 * alpha = 0 (C = beta C). */
static void gemm_case(int64_t M, int64_t N, int64_t K) {
    for (int ct = 0; ct < 2; ct++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                const fm_dtype c_type = ct ? FM_DTYPE_BF16 : FM_DTYPE_F32;
                const size_t cs = fm_dtype_size(c_type);
                const int64_t arows = ta ? K : M, acols = ta ? M : K, lda = acols + 5;
                const int64_t brows = tb ? N : K, bcols = tb ? K : N, ldb = bcols + 3;
                const int64_t ldc = N + 7;
                float *A = fnew(arows * lda), *Bm = fnew(brows * ldb), *C0 = fnew(M * ldc), *Cg = fnew(M * ldc);
                fill_normal_bf(A, arows * lda, 1.0);
                fill_normal_bf(Bm, brows * ldb, 1.0);
                fill_normal(C0, M * ldc, 1.0);
                if (ct) gt_round_bf16(C0, M * ldc);
                double *ab = dnew(M * N), *ref = dnew(M * N);
                double *Ad = fm_ref_widen(A, arows * lda), *Bd = fm_ref_widen(Bm, brows * ldb);
                fm_ref_gemm(ab, ta, tb, M, N, K, Ad, lda, Bd, ldb);
                free(Ad), free(Bd);
                const float alpha = 0.7f, beta = 0.3f;
                void *dA = up_act(A, arows * lda), *dB = up_act(Bm, brows * ldb);
                void *dC = gt_upload(&g_be, C0, M * ldc, c_type);
                void *c_before = down_raw(dC, (size_t)(M * ldc) * cs);
                OPS->gemm(CTX, ta, tb, M, N, K, alpha, dA, lda, dB, ldb, beta, dC, c_type, ldc);
                void *c_after = down_raw(dC, (size_t)(M * ldc) * cs);
                gt_download(&g_be, Cg, dC, M * ldc, c_type);
                float *got = fnew(M * N);
                for (int64_t i = 0; i < M; i++)
                    for (int64_t j = 0; j < N; j++) {
                        ref[i * N + j] = alpha * ab[i * N + j] + (double)beta * C0[i * ldc + j];
                        got[i * N + j] = Cg[i * ldc + j];
                    }
                const double tol = ct ? GT_TOL_BF16 : GT_TOL_F32;
                char what[96];
                snprintf(what, sizeof what, "gemm %lldx%lldx%lld (%d,%d) C %s alpha,beta", (long long)M,
                         (long long)N, (long long)K, ta, tb, ct ? "bf16" : "f32");
                CHECK_ERR(what, gt_nerr(got, ref, M * N), tol);
                if (ct) CHECK_ULPS(what, got, ref, M * N, gt_rms(ref, M * N) / 64, ULPS_REDUCTION);
                bool pad_ok = true;
                for (int64_t i = 0; i < M; i++)
                    if (!same_bits((char *)c_after + (size_t)(i * ldc + N) * cs,
                                   (char *)c_before + (size_t)(i * ldc + N) * cs, (size_t)(ldc - N) * cs))
                        pad_ok = false;
                CHECK_MSG(pad_ok, "%s: columns between N and ldc were written", what);
                /* beta = 0 overwrites a NaN C */
                dfree(dC);
                dC = up_nan(M * ldc, c_type);
                OPS->gemm(CTX, ta, tb, M, N, K, 1.0f, dA, lda, dB, ldb, 0.0f, dC, c_type, ldc);
                gt_download(&g_be, Cg, dC, M * ldc, c_type);
                for (int64_t i = 0; i < M; i++)
                    for (int64_t j = 0; j < N; j++) got[i * N + j] = Cg[i * ldc + j];
                snprintf(what, sizeof what, "gemm %lldx%lldx%lld (%d,%d) C %s beta=0 over NaN", (long long)M,
                         (long long)N, (long long)K, ta, tb, ct ? "bf16" : "f32");
                CHECK_ERR(what, gt_nerr(got, ab, M * N), tol);
                if (ct) CHECK_ULPS(what, got, ab, M * N, gt_rms(ab, M * N) / 64, ULPS_REDUCTION);
                dfree(dA), dfree(dB), dfree(dC);
                free(A), free(Bm), free(C0), free(Cg), free(ab), free(ref), free(got), free(c_before),
                    free(c_after);
            }
}

static void test_gemm(void) {
    gemm_case(37, 29, 23);
    gemm_case(130, 96, 517); /* several tiles, a long K */
    /* K = 0 and alpha = 0: C = beta C, both C types. */
    for (int ct = 0; ct < 2; ct++) {
        const fm_dtype t = ct ? FM_DTYPE_BF16 : FM_DTYPE_F32;
        float C[6] = {1, 2, 3, 4, 5, 6}, got[6];
        void *dC = gt_upload(&g_be, C, 6, t), *dA = up_act(C, 6);
        OPS->gemm(CTX, false, false, 2, 3, 0, 1.0f, dA, 0, dA, 3, 0.5f, dC, t, 3);
        gt_download(&g_be, got, dC, 6, t);
        CHECK_MSG(got[0] == 0.5f && got[5] == 3.0f, "gemm K=0 (C %s): %g %g", ct ? "bf16" : "f32", got[0], got[5]);
        OPS->gemm(CTX, false, false, 2, 3, 1, 0.0f, dA, 1, dA, 3, 0.0f, dC, t, 3);
        gt_download(&g_be, got, dC, 6, t);
        CHECK_MSG(got[0] == 0.0f && got[5] == 0.0f, "gemm alpha=0 beta=0 (C %s)", ct ? "bf16" : "f32");
        dfree(dC), dfree(dA);
    }
}

/* ---- grouped expert GEMMs -------------------------------------------------------------------- */

/* expert_linear_fwd/bwd against an fp64 per-expert reference: rows[e] rows per expert (zeros
 * allowed: that expert's dW must stay bit for bit what it was), y over a NaN buffer (every row
 * written), dx with beta 1 over a random dx and with beta 0 over NaN, dW accumulated. */
static void expert_case(const char *label, int64_t E, const int64_t *rows, int64_t in, int64_t out) {
    int64_t *off = calloc((size_t)E + 1, sizeof *off);
    for (int64_t e = 0; e < E; e++) off[e + 1] = off[e] + rows[e];
    const int64_t R = off[E], nw = E * out * in;
    const int64_t Rr = R > 0 ? R : 1;
    float *x = fnew(Rr * in), *W = fnew(nw), *dy = fnew(Rr * out), *dx0 = fnew(Rr * in), *dW0 = fnew(nw);
    fill_normal_bf(x, R * in, 1.0);
    fill_normal_bf(W, nw, 1.0);
    fill_normal_bf(dy, R * out, 1.0);
    fill_normal_bf(dx0, R * in, 1.0);
    fill_normal_bf(dW0, nw, 1.0);
    double *ry = dnew(Rr * out), *rdx = dnew(Rr * in), *rdx0 = dnew(Rr * in), *rdW = fm_ref_widen(dW0, nw);
    {
        double *xd = fm_ref_widen(x, Rr * in), *Wd = fm_ref_widen(W, nw), *dyd = fm_ref_widen(dy, Rr * out);
        fm_ref_expert_linear_fwd(ry, xd, Wd, off, E, in, out);
        fm_ref_expert_linear_bwd(rdx0, rdW, dyd, xd, Wd, off, E, in, out); /* dW accumulated onto dW0 */
        for (int64_t i = 0; i < R * in; i++) rdx[i] = rdx0[i] + dx0[i];
        free(xd), free(Wd), free(dyd);
    }
    void *dX = up_act(x, Rr * in), *dWt = up_act(W, nw), *dDY = up_act(dy, Rr * out);
    void *dY = up_nan(Rr * out, FM_DTYPE_BF16), *dDX = up_act(dx0, Rr * in), *dDW = up_act(dW0, nw);
    void *dW_before = down_raw(dDW, (size_t)nw * 2);
    fm_expert_linear_fwd(&g_be, dY, dX, dWt, off, E, in, out);
    fm_expert_linear_bwd(&g_be, dDX, 1.0f, dDW, dDY, dX, dWt, off, E, in, out);
    int64_t ng = nw;
    if (Rr * in > ng) ng = Rr * in;
    if (Rr * out > ng) ng = Rr * out;
    float *got = fnew(ng);
    char what[128];
    if (R > 0) {
        down_act(got, dY, R * out);
        snprintf(what, sizeof what, "expert_linear_fwd %s (E %lld, R %lld)", label, (long long)E, (long long)R);
        CHECK_ERR(what, gt_nerr(got, ry, R * out), GT_TOL_BF16);
        CHECK_ULPS(what, got, ry, R * out, gt_rms(ry, R * out) / 64, ULPS_REDUCTION);
        down_act(got, dDX, R * in);
        snprintf(what, sizeof what, "expert_linear_bwd dx beta=1 %s", label);
        CHECK_ERR(what, gt_nerr(got, rdx, R * in), GT_TOL_BF16);
        /* accumulated into a bf16 output (beta 1): measured on the H200, results near a cancellation
         * sit on the grid of the operands' magnitude (e.g. -3 x 2^-7 for fp64 -0.0261), as if the
         * product were rounded before the add; counted in ulps of max|ref| (two roundings, 3) */
        CHECK_ULPS(what, got, rdx, R * in, gt_maxabs(rdx, R * in), 3);
    }
    down_act(got, dDW, nw);
    snprintf(what, sizeof what, "expert_linear_bwd dW %s", label);
    CHECK_ERR(what, gt_nerr(got, rdW, nw), GT_TOL_BF16);
    CHECK_ULPS(what, got, rdW, nw, gt_maxabs(rdW, nw), 3); /* accumulated (+=) into bf16: as dx above */
    void *dW_after = down_raw(dDW, (size_t)nw * 2);
    bool idle_ok = true;
    for (int64_t e = 0; e < E; e++)
        if (rows[e] == 0 && !same_bits((char *)dW_after + (size_t)(e * out * in) * 2,
                                       (char *)dW_before + (size_t)(e * out * in) * 2, (size_t)(out * in) * 2))
            idle_ok = false;
    CHECK_MSG(idle_ok, "expert_linear_bwd %s: an expert with no rows changed its dW", label);
    /* beta = 0 over NaN, dW not checked again */
    dfree(dDX);
    dDX = up_nan(Rr * in, FM_DTYPE_BF16);
    fm_expert_linear_bwd(&g_be, dDX, 0.0f, dDW, dDY, dX, dWt, off, E, in, out);
    if (R > 0) {
        down_act(got, dDX, R * in);
        snprintf(what, sizeof what, "expert_linear_bwd dx beta=0 over NaN %s", label);
        CHECK_ERR(what, gt_nerr(got, rdx0, R * in), GT_TOL_BF16);
        CHECK_ULPS(what, got, rdx0, R * in, gt_rms(rdx0, R * in) / 64, ULPS_REDUCTION);
    }
    dfree(dX), dfree(dWt), dfree(dDY), dfree(dY), dfree(dDX), dfree(dDW);
    free(off), free(x), free(W), free(dy), free(dx0), free(dW0), free(ry), free(rdx), free(rdx0), free(rdW),
        free(got), free(dW_before), free(dW_after);
}

static void test_expert_linear(void) {
    {
        const int64_t rows[6] = {5, 0, 17, 1, 0, 40};
        expert_case("mixed, two idle experts", 6, rows, 48, 24);
    }
    {
        const int64_t rows[4] = {0, 0, 61, 0};
        expert_case("every row to one expert", 4, rows, 32, 40);
    }
    {
        const int64_t rows[5] = {1100, 3, 0, 1030, 50}; /* experts over FM_CUDA_GROUP_ROWS_MAX: own calls */
        expert_case("busy experts beside small ones", 5, rows, 16, 8);
    }
    {
        const int64_t rows[3] = {0, 0, 0};
        expert_case("no rows", 3, rows, 16, 8);
    }
    {
        enum { EB = 300 }; /* more experts than one grouped call takes */
        int64_t rows[EB];
        for (int e = 0; e < EB; e++) rows[e] = (e % 7 == 3) ? 0 : (int64_t)fm_rng_below(&g_rng, 9);
        expert_case("300 experts", EB, rows, 24, 16);
    }
}

/* ---- add, sumsq ------------------------------------------------------------------------------ */

/* y += x is one rounding of the fp32 sum: bit-exact against the host's. Aligned (vector path)
 * and one element off (scalar path). */
static void test_add(void) {
    const int64_t n = 100003;
    for (int off = 0; off < 2; off++) {
        float *y = fnew(n + 1), *x = fnew(n + 1), *got = fnew(n + 1);
        fill_normal_bf(y, n + 1, 1.0);
        fill_normal_bf(x, n + 1, 1.0);
        void *dy = up_act(y, n + 1), *dx = up_act(x, n + 1);
        OPS->add(CTX, off ? off1(dy) : dy, off ? off1(dx) : dx, n);
        down_act(got, dy, n + 1);
        bool exact = true;
        for (int64_t i = 0; i < n + 1; i++) {
            const bool in = off ? i >= 1 : i < n;
            const float want = in ? gt_bf16_to_f32(gt_f32_to_bf16(y[i] + x[i])) : y[i];
            if (memcmp(&want, &got[i], 4)) exact = false;
        }
        CHECK_MSG(exact, "add (offset %d): not the bf16 rounding of the fp32 sum, or wrote outside [0,n)", off);
        double *ref = dnew(n);
        for (int64_t i = 0; i < n; i++) ref[i] = (double)y[i + off] + (double)x[i + off];
        char what[64];
        snprintf(what, sizeof what, "add (offset %d)", off);
        CHECK_ULPS(what, got + off, ref, n, 0.0, ULPS_ELEMENTWISE);
        free(ref);
        dfree(dy), dfree(dx);
        free(y), free(x), free(got);
    }
}

/* sumsq into a device double: close to the fp64 sum, the same bits on a second call, n = 0
 * assigns +0; accumulate adds the same bits a fresh call gives to the old value (and n = 0 with
 * accumulate leaves it). */
static void test_sumsq(void) {
    const int64_t ns[] = {0, 1, 5, 255, 257, 1000003, 3000017};
    double *d_out = gt_dev_f64(&g_be, 3);
    for (size_t c = 0; c < sizeof ns / sizeof ns[0]; c++)
        for (int off = 0; off < 2; off++) {
            const int64_t m = ns[c];
            float *z = fnew(m + 1);
            fill_normal_bf(z, m + 1, 3.0);
            double ref = 0;
            for (int64_t i = off; i < m + off; i++) ref += (double)z[i] * z[i];
            void *dz = up_act(z, m + 1);
            void *p = off ? off1(dz) : dz;
            gt_write_f64(&g_be, d_out, 12345.0); /* assigned, whatever it held */
            OPS->sumsq(CTX, d_out, p, m, false);
            OPS->sumsq(CTX, d_out + 1, p, m, false);
            const double got = gt_read_f64(&g_be, d_out), again = gt_read_f64(&g_be, d_out + 1);
            CHECK_CLOSE(got, ref, 1e-12);
            CHECK_MSG(same_bits(&got, &again, sizeof got), "sumsq(n=%lld, offset %d) not deterministic",
                      (long long)m, off);
            /* accumulate: 0.5 + s, then + s again (each the same bits as got) */
            gt_write_f64(&g_be, d_out + 2, 0.5);
            OPS->sumsq(CTX, d_out + 2, p, m, true);
            OPS->sumsq(CTX, d_out + 2, p, m, true);
            const double acc = gt_read_f64(&g_be, d_out + 2), want = (0.5 + got) + got;
            CHECK_MSG(same_bits(&acc, &want, sizeof acc), "sumsq(n=%lld, offset %d) accumulate: %.17g, want %.17g",
                      (long long)m, off, acc, want);
            dfree(dz);
            free(z);
        }
    dfree(d_out);
}

/* ---- convert, memory ops --------------------------------------------------------------------- */

static uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> bf16 round to nearest even, bit for bit against gpu_test.h's (ties both ways, Inf,
 * overflow to Inf, subnormals, NaN stays NaN); bf16 -> fp32 exact; same type: a copy, in place a
 * no-op. */
static void test_convert(void) {
    const int64_t n = 10007;
    float *x = fnew(n), *back = fnew(n);
    fill_normal(x, n, 10.0);
    x[0] = u2f(0x3F808000u); /* tie, even below: 0x3F80 */
    x[1] = u2f(0x3F818000u); /* tie, even above: 0x3F82 */
    x[2] = u2f(0xBF808001u); /* just above a tie */
    x[3] = INFINITY, x[4] = -INFINITY, x[5] = NAN, x[6] = FLT_MAX, x[7] = -0.0f;
    x[8] = u2f(0x00000123u), x[9] = u2f(0x807F8000u), x[10] = u2f(0x7F7F8000u);
    void *dx = up_f32(x, n), *db = up_nan(n, FM_DTYPE_BF16), *df = up_nan(n, FM_DTYPE_F32);
    OPS->convert(CTX, db, FM_DTYPE_BF16, dx, FM_DTYPE_F32, n);
    uint16_t *hb = down_raw(db, (size_t)n * 2);
    bool ok = true;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t want = gt_f32_to_bf16(x[i]);
        if (isnan(x[i]) ? !isnan(gt_bf16_to_f32(hb[i])) : hb[i] != want) {
            if (ok) fprintf(stderr, "convert f32->bf16 [%lld]: 0x%08x -> 0x%04x, want 0x%04x\n", (long long)i,
                            f2u(x[i]), hb[i], want);
            ok = false;
        }
    }
    CHECK_MSG(ok, "convert f32->bf16 is not round-to-nearest-even");
    OPS->convert(CTX, df, FM_DTYPE_F32, db, FM_DTYPE_BF16, n);
    down_f32(back, df, n);
    ok = true;
    for (int64_t i = 0; i < n; i++) {
        const float want = gt_bf16_to_f32(hb[i]);
        if (isnan(want) ? !isnan(back[i]) : f2u(back[i]) != f2u(want)) ok = false;
    }
    CHECK_MSG(ok, "convert bf16->f32 is not exact");
    OPS->convert(CTX, db, FM_DTYPE_BF16, db, FM_DTYPE_BF16, n); /* in place, same type */
    uint16_t *hb2 = down_raw(db, (size_t)n * 2);
    CHECK_MSG(same_bits(hb, hb2, (size_t)n * 2), "convert bf16->bf16 in place changed the data");
    void *df2 = up_nan(n, FM_DTYPE_F32);
    OPS->convert(CTX, df2, FM_DTYPE_F32, dx, FM_DTYPE_F32, n);
    float *h2 = down_raw(df2, (size_t)n * 4);
    CHECK_MSG(same_bits(h2, x, (size_t)n * 4), "convert f32->f32 is not a copy");
    dfree(dx), dfree(db), dfree(df), dfree(df2);
    free(x), free(back), free(hb), free(hb2), free(h2);
}

static void test_memory(void) {
    const size_t nb = 100001;
    unsigned char *p = OPS->mem_alloc(CTX, nb);
    CHECK(p != NULL);
    CHECK_MSG(((uintptr_t)p & 255u) == 0, "mem_alloc: %p is not 256-byte aligned", (void *)p);
    unsigned char *h = down_raw(p, nb);
    bool zero = true;
    for (size_t i = 0; i < nb; i++)
        if (h[i]) zero = false;
    CHECK_MSG(zero, "mem_alloc: not zero-filled");
    OPS->mem_set(CTX, p + 3, 0xAB, 777);
    free(h);
    h = down_raw(p, nb);
    bool ok = h[2] == 0 && h[3 + 777] == 0;
    for (size_t i = 3; i < 3 + 777; i++)
        if (h[i] != 0xAB) ok = false;
    CHECK_MSG(ok, "mem_set: wrong bytes");
    unsigned char *q = OPS->mem_alloc(CTX, nb);
    OPS->copy(CTX, q, p, nb, FM_COPY_D2D);
    unsigned char *h2 = down_raw(q, nb);
    CHECK_MSG(same_bits(h, h2, nb), "copy D2D: bytes differ");
    OPS->sync(CTX);
    /* An allocation the device cannot serve is NULL, and the backend stays usable. */
    void *huge = OPS->mem_alloc(CTX, (size_t)1 << 50);
    CHECK(huge == NULL);
    CHECK_MSG(OPS->status(CTX) == FM_OK, "an allocation the device cannot serve must not set the sticky status");
    float one = 2.0f;
    void *d = up_act(&one, 1);
    double *d_sq = gt_dev_f64(&g_be, 1);
    OPS->sumsq(CTX, d_sq, d, 1, false);
    CHECK(gt_read_f64(&g_be, d_sq) == 4.0);
    dfree(d), dfree(d_sq);
    OPS->mem_free(CTX, NULL);
    dfree(p), dfree(q);
    free(h), free(h2);
}

/* Buffer kinds: each non-NULL and zero-filled (PINNED and HOST read on the host, DEVICE through a
 * copy), a pinned allocation the host cannot serve is NULL without touching the sticky status. */
static void test_buffers(void) {
    const size_t nb = 300007;
    for (int kind = 0; kind < FM_BUFFER_KINDS; kind++) {
        unsigned char *p = OPS->buffer_alloc(CTX, (fm_buffer_kind)kind, nb);
        CHECK_MSG(p != NULL, "buffer_alloc kind %d: NULL", kind);
        if (!p) continue;
        unsigned char *h = kind == FM_BUFFER_DEVICE ? down_raw(p, nb) : p;
        bool zero = true;
        for (size_t i = 0; i < nb; i++) zero &= h[i] == 0;
        CHECK_MSG(zero, "buffer_alloc kind %d: not zero-filled", kind);
        if (kind != FM_BUFFER_DEVICE) memset(p, 0x5A, nb); /* host-writable */
        else free(h);
        OPS->buffer_free(CTX, (fm_buffer_kind)kind, p);
    }
    OPS->buffer_free(CTX, FM_BUFFER_PINNED, NULL);
    CHECK(OPS->buffer_alloc(CTX, FM_BUFFER_PINNED, (size_t)1 << 52) == NULL);
    CHECK_MSG(OPS->status(CTX) == FM_OK, "a failed pinned allocation set the sticky status: %s", fm_errmsg());
}

/* copy_async on the copy-in and copy-out streams, ordered against the compute stream by events:
 * pinned host -> device on copy-in; compute waits for it (event_wait) and converts fp32 -> bf16
 * -> fp32 (exact on these values); copy-out waits for compute and copies the result to pinned
 * memory; the host waits once (event_sync) and checks every value. 64 MiB, so that a missing
 * wait would let a kernel or copy run over data not yet there. No host sync before the
 * event_sync. Done twice (the events and buffers reused). */
static void test_streams(void) {
    const int64_t n = (int64_t)1 << 24;
    const size_t bytes = (size_t)n * 4;
    float *hin = OPS->buffer_alloc(CTX, FM_BUFFER_PINNED, bytes), *hout = OPS->buffer_alloc(CTX, FM_BUFFER_PINNED, bytes);
    void *a = OPS->mem_alloc(CTX, bytes), *c16 = OPS->mem_alloc(CTX, (size_t)n * 2), *b = OPS->mem_alloc(CTX, bytes);
    CHECK(hin && hout && a && c16 && b);
    if (!(hin && hout && a && c16 && b)) return;
    const int ev_in = FM_EVENT_FIRST_FREE, ev_done = FM_EVENT_FIRST_FREE + 1, ev_out = FM_EVENT_FIRST_FREE + 2;
    for (int rep = 0; rep < 2; rep++) {
        for (int64_t i = 0; i < n; i++) hin[i] = 0.5f * (float)((i * 7 + rep) % 251 - 125); /* exact in bf16 */
        for (int64_t i = 0; i < n; i++) hout[i] = NAN;
        OPS->mem_set(CTX, b, 0xff, bytes);
        OPS->sync(CTX);
        const uint64_t h0 = OPS->host_sync_count(CTX);
        OPS->copy_async(CTX, a, hin, bytes, FM_COPY_H2D, FM_STREAM_COPY_IN);
        OPS->event_record(CTX, ev_in, FM_STREAM_COPY_IN);
        OPS->event_wait(CTX, FM_STREAM_COMPUTE, ev_in);
        OPS->convert(CTX, c16, FM_DTYPE_BF16, a, FM_DTYPE_F32, n);
        OPS->convert(CTX, b, FM_DTYPE_F32, c16, FM_DTYPE_BF16, n);
        OPS->event_record(CTX, ev_done, FM_STREAM_COMPUTE);
        OPS->event_wait(CTX, FM_STREAM_COPY_OUT, ev_done);
        OPS->copy_async(CTX, hout, b, bytes, FM_COPY_D2H, FM_STREAM_COPY_OUT);
        OPS->event_record(CTX, ev_out, FM_STREAM_COPY_OUT);
        CHECK_MSG(OPS->host_sync_count(CTX) == h0, "copy_async / event_record / event_wait made the host wait");
        OPS->event_sync(CTX, ev_out);
        CHECK_MSG(OPS->host_sync_count(CTX) == h0 + 1, "event_sync is not one host sync");
        int64_t bad = -1;
        for (int64_t i = 0; i < n && bad < 0; i++)
            if (hout[i] != hin[i]) bad = i;
        CHECK_MSG(bad < 0, "streams (pass %d): element %lld is %g, want %g", rep, (long long)bad,
                  bad < 0 ? 0.0 : (double)hout[bad], bad < 0 ? 0.0 : (double)hin[bad]);
    }
    /* stream_sync of each copy stream counts one host sync each */
    const uint64_t h1 = OPS->host_sync_count(CTX);
    OPS->stream_sync(CTX, FM_STREAM_COPY_IN);
    OPS->stream_sync(CTX, FM_STREAM_COPY_OUT);
    CHECK(OPS->host_sync_count(CTX) == h1 + 2);
    CHECK_MSG(OPS->status(CTX) == FM_OK, "status after the stream test: %s", fm_errmsg());
    OPS->buffer_free(CTX, FM_BUFFER_PINNED, hin), OPS->buffer_free(CTX, FM_BUFFER_PINNED, hout);
    dfree(a), dfree(c16), dfree(b);
}

/* ---- timings (printed, not checked) ---------------------------------------------------------- */

/* Device buffer of n random bf16 values in [-1, 1) (fp32 staged through convert). */
static void *rand_act(int64_t n) {
    float *h = fnew(n);
    for (int64_t i = 0; i < n; i++) h[i] = (float)(fm_rng_u64(&g_rng) >> 40) * (2.0f / 16777216.0f) - 1.0f;
    void *f = up_f32(h, n), *b = OPS->mem_alloc(CTX, (size_t)n * 2 + 256);
    OPS->convert(CTX, b, FM_DTYPE_BF16, f, FM_DTYPE_F32, n);
    dfree(f);
    free(h);
    return b;
}

#define TIME_OP(label, reps, bytes, flops, call)                                                         \
    do {                                                                                                 \
        call;                                                                                            \
        OPS->sync(CTX);                                                                                  \
        const double t0_ = now_s();                                                                      \
        for (int r_ = 0; r_ < (reps); r_++) call;                                                        \
        OPS->sync(CTX);                                                                                  \
        const double dt_ = (now_s() - t0_) / (reps);                                                     \
        printf("time %-44s %9.3f ms", label, dt_ * 1e3);                                                  \
        if ((bytes) > 0) printf("  %7.0f GB/s", (double)(bytes) / dt_ * 1e-9);                          \
        if ((flops) > 0) printf("  %7.1f TFLOP/s", (double)(flops) / dt_ * 1e-12);                      \
        printf("\n");                                                                                    \
    } while (0)

static void timings(void) {
    {
        const int64_t S = 8192;
        void *A = rand_act(S * S), *B = rand_act(S * S), *C = OPS->mem_alloc(CTX, (size_t)(S * S) * 4);
        TIME_OP("gemm 8192^3 (0,1) C bf16", 10, 0, 2.0 * S * S * S,
                OPS->gemm(CTX, false, true, S, S, S, 1.0f, A, S, B, S, 0.0f, C, FM_DTYPE_BF16, S));
        TIME_OP("gemm 8192^3 (1,0) C f32 beta=1", 10, 0, 2.0 * S * S * S,
                OPS->gemm(CTX, true, false, S, S, S, 1.0f, A, S, B, S, 1.0f, C, FM_DTYPE_F32, S));
        dfree(A), dfree(B), dfree(C);
    }
    {
        const int64_t N = 16384, D = 4096, nd = N * D;
        void *x = rand_act(nd), *w = rand_act(D), *g = rand_act(nd), *o = OPS->mem_alloc(CTX, (size_t)nd * 2),
             *dw = OPS->mem_alloc(CTX, (size_t)D * 2), *rs = OPS->mem_alloc(CTX, (size_t)N * 4);
        TIME_OP("rmsnorm_fwd 16384x4096", 20, 4.0 * nd, 0, OPS->rmsnorm_fwd(CTX, o, rs, x, w, N, D, 1e-6f));
        TIME_OP("rmsnorm_bwd 16384x4096", 20, 8.0 * nd, 0, OPS->rmsnorm_bwd(CTX, o, dw, g, x, w, rs, N, D));
        TIME_OP("add 64M", 20, 6.0 * nd, 0, OPS->add(CTX, o, x, nd));
        TIME_OP("swiglu_fwd 64M", 20, 6.0 * nd, 0, OPS->swiglu_fwd(CTX, o, x, g, nd));
        double *sq = gt_dev_f64(&g_be, 1);
        TIME_OP("sumsq 64M", 20, 2.0 * nd, 0, OPS->sumsq(CTX, sq, x, nd, false));
        dfree(sq);
        void *tab = OPS->mem_alloc(CTX, (size_t)4096 * 64 * 4);
        TIME_OP("rope_fwd B=4 T=4096 nh=32 hd=128", 20, 4.0 * nd, 0, OPS->rope_fwd(CTX, x, tab, tab, 4, 4096, 32, 128, 128, NULL));
        dfree(tab);
        const int64_t V = 50000, NT = 16384;
        int32_t *tok = inew(NT);
        for (int64_t i = 0; i < NT; i++) tok[i] = (int32_t)fm_rng_below(&g_rng, 1000); /* many repeats */
        void *dtok = up_i32(tok, NT), *wte = OPS->mem_alloc(CTX, (size_t)(V * D) * 2);
        TIME_OP("embedding_fwd N=16384 H=4096", 20, 4.0 * nd, 0, OPS->embedding_fwd(CTX, o, dtok, wte, NT, D));
        TIME_OP("embedding_bwd N=16384 H=4096 (1000 ids)", 5, 0, 0, OPS->embedding_bwd(CTX, wte, g, dtok, NT, D));
        dfree(x), dfree(w), dfree(g), dfree(o), dfree(dw), dfree(rs), dfree(dtok), dfree(wte);
        free(tok);
    }
    {
        /* OLMoE-1B-7B expert shapes (E 64, top-8, H 2048, I 1024): rows per expert drawn around
         * 512 (4096 tokens) and around 2048 (16K tokens), some experts twice as busy as others. */
        const int64_t E = 64, H = 2048, I = 1024;
        for (int rep = 0; rep < 2; rep++) {
            const int64_t avg = rep ? 2048 : 512;
            int64_t off[65];
            off[0] = 0;
            for (int64_t e = 0; e < E; e++) off[e + 1] = off[e] + avg / 2 + (int64_t)fm_rng_below(&g_rng, (uint64_t)avg);
            const int64_t R = off[E];
            void *x = rand_act(R * H), *W = rand_act(E * I * H), *y = rand_act(R * I), *dx = rand_act(R * H),
                 *dW = rand_act(E * I * H);
            const char *mode = getenv("FLATMOE_EXPERT_GEMM");
            char l1[96], l2[96];
            snprintf(l1, sizeof l1, "expert fwd 64x[~%lld,2048]x[1024] (%s)", (long long)avg, mode ? mode : "default");
            snprintf(l2, sizeof l2, "expert bwd 64x[~%lld,1024] (%s)", (long long)avg, mode ? mode : "default");
            TIME_OP(l1, 20, 0, 2.0 * R * H * I, fm_expert_linear_fwd(&g_be, y, x, W, off, E, H, I));
            TIME_OP(l2, 20, 0, 4.0 * R * H * I, fm_expert_linear_bwd(&g_be, dx, 0.0f, dW, y, x, W, off, E, H, I));
            dfree(x), dfree(W), dfree(y), dfree(dx), dfree(dW);
        }
    }
    {
        const int64_t n = (int64_t)1 << 27;
        void *p = rand_act(n), *g = rand_act(n), *mw = OPS->mem_alloc(CTX, (size_t)n * 4),
             *m = OPS->mem_alloc(CTX, (size_t)n * 4), *v = OPS->mem_alloc(CTX, (size_t)n * 4);
        TIME_OP("adamw 128M with master", 10, 28.0 * n, 0,
                OPS->adamw(CTX, p, g, mw, m, v, FM_DTYPE_F32, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 0.5f, 1.0f));
        TIME_OP("adamw 128M with master, bf16 moments", 10, 20.0 * n, 0,
                OPS->adamw(CTX, p, g, mw, m, v, FM_DTYPE_BF16, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 0.5f, 1.0f));
        dfree(p), dfree(g), dfree(mw), dfree(m), dfree(v);
    }
}
int main(void) {
    fm_rng_seed(&g_rng, fm_test_seed(20241129));
    const double t0 = now_s();
    test_init_errors();
    if (!dense_test_backend()) return fm_test_finish();

    test_memory();
    test_buffers();
    test_streams();
    test_convert();
    test_gemm();
    test_expert_linear();
    test_add();
    test_sumsq();
    CHECK_BACKEND_OK(&g_be); /* no op above recorded an error */
    printf("checks done in %.2f s\n", now_s() - t0);
    if (!getenv("FLATMOE_GPU_NO_TIMINGS")) timings();

    fm_cuda_backend_free(&g_be);
    CHECK(g_be.ops == NULL && g_be.ctx == NULL);
    printf("time %.2f s\n", now_s() - t0);
    return fm_test_finish();
}
