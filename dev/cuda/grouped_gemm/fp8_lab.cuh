/* The grouped GEMM lab's FP8 part (v3_fp8.cuh), included by grouped_gemm.cu after its helpers
 * (CK, sync_or_die, cell, enabled, fill, nanfill, gather_kernel, group_of, g_* state).
 *
 * Per projection: its own bf16 inputs (gg_inputs.h's gg_val3: magnitudes vary by row and column,
 * so the block scales differ), the weights quantized once (not timed: once a step in training),
 * then per product:
 *  1. the activations quantized on the GPU (kind 0 x rows, 1 dy rows, 2 dy and x token-major) and
 *     checked code for code and scale for scale against fp8_ref.h on the sampled rows / channels
 *     (the weights' blocks once: the first, the last, 14 random ones, Wq and WqT);
 *  2. the GEMM, its sampled outputs against (a) the same quantized math on the CPU in double from
 *     the GPU's codes and scales (per element within 2^-7 |ref| + 2^-10 sum|terms| + 1e-3, and
 *     SNR(gpu vs it) >= 40 dB: the bf16 output rounding alone gives about 59), (b) the exact bf16
 *     product (double, from the inputs): SNR >= 25 dB, printed per product as an "SNR" line with
 *     the CPU's own fp8 figure beside it. beta's old values are left out of the SNR (signal = the
 *     product).
 *  3. timing: column v3 the GEMM alone, v3q the activation quantization + the GEMM.
 */
#pragma once
#include "fp8_ref.h"
#include "gg_inputs.h"
#include "v3_fp8.cuh"
#include "v5_fp8.cuh"

#include <functional>
#include <set>

enum { SEED3_X = 11, SEED3_W = 12, SEED3_DY = 13 };
static const double FP8_SNR_MIN = 25.0, FP8_MATCH_SNR_MIN = 40.0;
static std::vector<std::string> g_snr_lines;

__global__ void fill3_kernel(bf16 *p, int64_t rows, int64_t cols, uint32_t seed) {
    const int64_t n = rows * cols;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(gg_val3(seed, i / cols, i % cols, cols));
}

struct fp8_bufs {
    int E = 0;
    int64_t in = 0, out = 0, rcap = 0, rpad = 0, kcap = 0;
    bf16 *X = nullptr, *W = nullptr, *DY = nullptr, *Y = nullptr, *DX = nullptr, *DW = nullptr;
    uint8_t *xq = nullptr, *dyq = nullptr, *Wq = nullptr, *WqT = nullptr, *xT = nullptr, *dyT = nullptr;
    float *sx = nullptr, *sdy = nullptr, *sW = nullptr, *sxT = nullptr, *sdyT = nullptr;
    std::vector<uint8_t> hWq, hWqT;
    std::vector<float> hsW;
    std::vector<int> pblk; /* host twin of the kernel's token-block prefix */
    bool wbad = false;     /* the weights' quantization mismatched (every product's cells FAIL) */
};

template <typename T> static void d2h(std::vector<T> &h, const T *d, int64_t n) {
    h.resize((size_t)n);
    CK(cudaMemcpy(h.data(), d, (size_t)n * sizeof(T), cudaMemcpyDeviceToHost));
}
static float dec8(uint8_t c) {
    static float t[256];
    static bool init = false;
    if (!init) {
        for (int i = 0; i < 256; i++) t[i] = e4m3_decode((uint8_t)i);
        init = true;
    }
    return t[c];
}

/* CPU quantization of one block given by n values v[0..n) (zeros past n up to len): codes, scale
 * (fp8_ref.h: the engine's power-of-two scale, NaN and codes 0x7F for a non-finite block) */
static float cpu_quant(const float *v, int n, int len, uint8_t *codes) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fp8_amax_fold(amax, v[i]);
    const float s = fp8_scale(amax);
    for (int i = 0; i < len; i++) codes[i] = i < n ? fp8_code(v[i], s) : 0;
    return s;
}

static int g_qbad = 0; /* quantization mismatches of the current check */
static std::string g_qfirst;
static void qmismatch(const char *what, int64_t a, int64_t b, double got, double want) {
    if (!g_qbad++) {
        char m[200];
        snprintf(m, sizeof m, "%s (%lld, %lld) got %g want %g", what, (long long)a, (long long)b, got, want);
        g_qfirst = m;
    }
}
static bool qreport(const std::string &where, const char *what, int64_t checked) { /* true: mismatches */
    if (!g_qbad) return false;
    char line[512];
    snprintf(line, sizeof line, "FAIL v3 %s quant-%s: %d of %lld checked codes/scales differ; first %s", where.c_str(), what,
             g_qbad, (long long)checked, g_qfirst.c_str());
    g_fail_lines.push_back(line);
    g_failures++;
    g_qbad = 0;
    return true;
}

static void fp8_setup(fp8_bufs &f, const std::vector<int64_t> &offs, int E, int64_t in, int64_t out, int64_t rcap,
                      const std::string &where) {
    f.E = E, f.in = in, f.out = out, f.rcap = rcap, f.rpad = gg_fp8_rpad(rcap), f.kcap = gg_fp8_kcap(rcap, E);
    const int64_t WN = (int64_t)E * out * in;
    CK(cudaMalloc(&f.X, rcap * in * 2));
    CK(cudaMalloc(&f.DY, rcap * out * 2));
    CK(cudaMalloc(&f.W, WN * 2));
    CK(cudaMalloc(&f.Y, rcap * out * 2));
    CK(cudaMalloc(&f.DX, rcap * in * 2));
    CK(cudaMalloc(&f.DW, WN * 2));
    CK(cudaMalloc(&f.xq, rcap * in));
    CK(cudaMalloc(&f.dyq, rcap * out));
    CK(cudaMalloc(&f.Wq, WN));
    CK(cudaMalloc(&f.WqT, WN));
    CK(cudaMalloc(&f.xT, in * f.kcap));
    CK(cudaMalloc(&f.dyT, out * f.kcap));
    CK(cudaMalloc(&f.sx, in / 128 * f.rpad * 4));
    CK(cudaMalloc(&f.sdy, out / 128 * f.rpad * 4));
    CK(cudaMalloc(&f.sW, WN / 16384 * 4));
    CK(cudaMalloc(&f.sxT, f.kcap / 128 * in * 4));
    CK(cudaMalloc(&f.sdyT, f.kcap / 128 * out * 4));
    fill3_kernel<<<2048, 256>>>(f.X, rcap, in, SEED3_X), fill3_kernel<<<2048, 256>>>(f.DY, rcap, out, SEED3_DY);
    fill3_kernel<<<2048, 256>>>(f.W, (int64_t)E * out, in, SEED3_W);
    CK(cudaGetLastError());
    CK(gg_v3_quant_weight(f.W, E, out, in, f.Wq, f.WqT, f.sW, 0));
    CK(cudaDeviceSynchronize());
    d2h(f.hWq, f.Wq, WN), d2h(f.hWqT, f.WqT, WN), d2h(f.hsW, f.sW, WN / 16384);
    f.pblk.assign(E + 1, 0);
    for (int e = 0; e < E; e++) f.pblk[e + 1] = f.pblk[e] + (int)((offs[e + 1] - offs[e] + 127) / 128);
    /* the weights' blocks: first, last, 14 random */
    const int64_t nbo = out / 128, nbi = in / 128, nblk = (int64_t)E * nbo * nbi;
    std::vector<int64_t> blks = {0, nblk - 1};
    for (int i = 0; i < 14; i++) blks.push_back(rnd(0, nblk));
    std::vector<float> v(128 * 128);
    std::vector<uint8_t> q(128 * 128);
    for (int64_t bl : blks) {
        const int64_t e = bl / (nbo * nbi), nb = bl / nbi % nbo, kb = bl % nbi;
        for (int r = 0; r < 128; r++)
            for (int k = 0; k < 128; k++) v[r * 128 + k] = gg_val3(SEED3_W, e * out + nb * 128 + r, kb * 128 + k, in);
        const float s = cpu_quant(v.data(), 128 * 128, 128 * 128, q.data());
        if (f.hsW[bl] != s) qmismatch("sW block", nb, kb, f.hsW[bl], s);
        for (int r = 0; r < 128; r++)
            for (int k = 0; k < 128; k++) {
                const int64_t n = nb * 128 + r, kk = kb * 128 + k;
                if (f.hWq[(e * out + n) * in + kk] != q[r * 128 + k]) qmismatch("Wq", n, kk, f.hWq[(e * out + n) * in + kk], q[r * 128 + k]);
                if (f.hWqT[(e * in + kk) * out + n] != q[r * 128 + k]) qmismatch("WqT", kk, n, f.hWqT[(e * in + kk) * out + n], q[r * 128 + k]);
            }
    }
    f.wbad = qreport(where, "weight", (int64_t)blks.size() * (2 * 16384 + 1));
}

static void fp8_free(fp8_bufs &f) {
    for (void *p : {(void *)f.X, (void *)f.W, (void *)f.DY, (void *)f.Y, (void *)f.DX, (void *)f.DW, (void *)f.xq, (void *)f.dyq,
                    (void *)f.Wq, (void *)f.WqT, (void *)f.xT, (void *)f.dyT, (void *)f.sx, (void *)f.sdy, (void *)f.sW,
                    (void *)f.sxT, (void *)f.sdyT})
        cudaFree(p);
    f = fp8_bufs();
}

/* the exact product of v3's bf16 inputs (double), as ref_elem; beta's old value left out */
static double ref3_elem(const fp8_bufs &f, const std::vector<int64_t> &offs, int kind, int64_t idx) {
    const int64_t in = f.in, out = f.out;
    double s = 0.0;
    if (kind == 0) {
        const int64_t r = idx / out, n = idx % out, e = group_of(offs, r);
        for (int64_t k = 0; k < in; k++) s += (double)gg_val3(SEED3_X, r, k, in) * gg_val3(SEED3_W, e * out + n, k, in);
    } else if (kind == 1) {
        const int64_t r = idx / in, k = idx % in, e = group_of(offs, r);
        for (int64_t n = 0; n < out; n++) s += (double)gg_val3(SEED3_DY, r, n, out) * gg_val3(SEED3_W, e * out + n, k, in);
    } else {
        const int64_t e = idx / (out * in), n = (idx / in) % out, k = idx % in;
        for (int64_t r = offs[e]; r < offs[e + 1]; r++) s += (double)gg_val3(SEED3_DY, r, n, out) * gg_val3(SEED3_X, r, k, in);
    }
    return s;
}

/* the quantized math from the GPU's codes and scales (double); *abs = sum of |terms| */
struct fp8_host {
    std::vector<uint8_t> a, b;
    std::vector<float> sa, sb;
};
static double refq_elem(const fp8_bufs &f, const fp8_host &h, const std::vector<int64_t> &offs, int kind, int64_t idx, double *abs) {
    const int64_t in = f.in, out = f.out, kbi = in / 128, kbo = out / 128;
    double s = 0.0, sabs = 0.0;
    auto block = [&](const uint8_t *x, const uint8_t *y, double scale) {
        double d = 0.0, da = 0.0;
        for (int k = 0; k < 128; k++) {
            const double t = (double)dec8(x[k]) * dec8(y[k]);
            d += t, da += std::fabs(t);
        }
        s += scale * d, sabs += std::fabs(scale) * da;
    };
    if (kind == 0) {
        const int64_t r = idx / out, n = idx % out, e = group_of(offs, r);
        for (int64_t kb = 0; kb < kbi; kb++)
            block(&h.a[r * in + kb * 128], &f.hWq[(e * out + n) * in + kb * 128],
                  (double)h.sa[kb * f.rpad + r] * f.hsW[(e * kbo + n / 128) * kbi + kb]);
    } else if (kind == 1) {
        const int64_t r = idx / in, k = idx % in, e = group_of(offs, r);
        for (int64_t kb = 0; kb < kbo; kb++)
            block(&h.a[r * out + kb * 128], &f.hWqT[(e * in + k) * out + kb * 128],
                  (double)h.sa[kb * f.rpad + r] * f.hsW[(e * kbo + kb) * kbi + k / 128]);
    } else {
        const int64_t e = idx / (out * in), n = (idx / in) % out, k = idx % in;
        for (int64_t b = f.pblk[e]; b < f.pblk[e + 1]; b++)
            block(&h.a[n * f.kcap + b * 128], &h.b[k * f.kcap + b * 128], (double)h.sa[b * out + n] * h.sb[b * in + k]);
    }
    *abs = sabs;
    return s;
}

/* Check the GPU's activation codes for the sampled outputs against the CPU's quantization. */
static bool check_act_quant(const fp8_bufs &f, const fp8_host &h, const std::vector<int64_t> &offs, int kind,
                            const std::vector<int64_t> &idx, const std::string &where) {
    int64_t checked = 0;
    float v[128];
    uint8_t q[128];
    if (kind != 2) {
        const int64_t C = kind == 0 ? f.in : f.out, N = kind == 0 ? f.out : f.in;
        const uint32_t seed = kind == 0 ? SEED3_X : SEED3_DY;
        std::set<int64_t> rows;
        for (int64_t i : idx) rows.insert(i / N);
        for (int64_t r : rows)
            for (int64_t b = 0; b < C / 128; b++) {
                for (int k = 0; k < 128; k++) v[k] = gg_val3(seed, r, b * 128 + k, C);
                const float s = cpu_quant(v, 128, 128, q);
                if (h.sa[b * f.rpad + r] != s) qmismatch("row scale (row, block)", r, b, h.sa[b * f.rpad + r], s);
                for (int k = 0; k < 128; k++)
                    if (h.a[r * C + b * 128 + k] != q[k]) qmismatch("row code (row, k)", r, b * 128 + k, h.a[r * C + b * 128 + k], q[k]);
                checked += 129;
            }
        return qreport(where, kind == 0 ? "x" : "dy", checked);
    }
    /* dW: the channels of the sampled elements, every token block of their group */
    std::set<std::pair<int64_t, int64_t>> chans[2]; /* (group, channel) of dyT and xT */
    for (int64_t i : idx) {
        const int64_t e = i / (f.out * f.in);
        chans[0].insert({e, (i / f.in) % f.out}), chans[1].insert({e, i % f.in});
    }
    for (int w = 0; w < 2; w++) {
        const int64_t C = w == 0 ? f.out : f.in;
        const uint32_t seed = w == 0 ? SEED3_DY : SEED3_X;
        const std::vector<uint8_t> &aT = w == 0 ? h.a : h.b;
        const std::vector<float> &sT = w == 0 ? h.sa : h.sb;
        for (const auto &ec : chans[w]) {
            const int64_t e = ec.first, c = ec.second;
            for (int64_t b = f.pblk[e]; b < f.pblk[e + 1]; b++) {
                const int64_t t0 = offs[e] + (b - f.pblk[e]) * 128;
                const int n = (int)std::min<int64_t>(128, offs[e + 1] - t0);
                for (int t = 0; t < n; t++) v[t] = gg_val3(seed, t0 + t, c, C);
                const float s = cpu_quant(v, n, 128, q);
                if (sT[b * C + c] != s) qmismatch(w == 0 ? "dyT scale (block, channel)" : "xT scale (block, channel)", b, c, sT[b * C + c], s);
                for (int t = 0; t < 128; t++)
                    if (aT[c * f.kcap + b * 128 + t] != q[t])
                        qmismatch(w == 0 ? "dyT code (channel, padded token)" : "xT code (channel, padded token)", c, b * 128 + t,
                                  aT[c * f.kcap + b * 128 + t], q[t]);
                checked += 129;
            }
        }
    }
    return qreport(where, "dyT/xT", checked);
}

/* The checks of one v3 product (this file's header, 1 and 2): h holds the GPU's activation codes
 * and scales, got the sampled outputs. Pushes the SNR line; false (with a FAIL line) if wrong. */
/* The references of the sampled outputs (they depend on the inputs and the GPU's codes, not on the
 * GEMM): the quantized math q, its sum of |terms| abs, the exact bf16 product x; computed once a
 * product for every FP8 column. */
struct fp8_refs {
    std::vector<double> q, abs, x;
};
static void fp8_refs_fill(fp8_refs &r, const fp8_bufs &f, const fp8_host &h, const std::vector<int64_t> &offs, int kind,
                          const std::vector<int64_t> &idx) {
    r.q.resize(idx.size()), r.abs.resize(idx.size()), r.x.resize(idx.size());
    for (size_t i = 0; i < idx.size(); i++) r.q[i] = refq_elem(f, h, offs, kind, idx[i], &r.abs[i]), r.x[i] = ref3_elem(f, offs, kind, idx[i]);
}

static bool fp8_check(const fp8_bufs &f, const fp8_host &h, const std::vector<int64_t> &offs, int kind, float beta,
                      const std::vector<int64_t> &idx, const std::vector<float> &got, const std::string &where,
                      const char *ver = "v3", int qstate = -1, const fp8_refs *refs = nullptr) {
    /* qstate: the activation quantizers' verdict when already checked for this product (1 bad), -1 check here;
     * refs: the references when already computed (fp8_refs_fill), else computed here */
    const bool qbad = qstate < 0 ? check_act_quant(f, h, offs, kind, idx, where) : qstate != 0;
    fp8_refs own;
    if (!refs) fp8_refs_fill(own, f, h, offs, kind, idx), refs = &own;
    snr_acc vs_bf16, cpu_bf16, vs_q;
    int64_t nbad = 0, worst = -1;
    double werr = -1.0, wgot = 0.0, wwant = 0.0;
    for (size_t i = 0; i < idx.size(); i++) {
        const double old = beta != 0.0f ? (double)beta * gg_val(kind == 1 ? SEED_DX0 : SEED_DW0, (uint64_t)idx[i]) : 0.0;
        const double q = refs->q[i], x = refs->x[i], sabs = refs->abs[i];
        const double g = (double)got[i] - old, d = std::fabs(g - q), tol = 0.0078125 * std::fabs(q + old) + sabs / 1024.0 + 1e-3;
        vs_bf16.add(x, g), cpu_bf16.add(x, q), vs_q.add(q, g);
        if (!(d <= tol)) {
            nbad++;
            if (d > werr || d != d) werr = d, worst = idx[i], wgot = got[i], wwant = q + old;
        }
    }
    const bool ok = nbad == 0 && vs_q.db() >= FP8_MATCH_SNR_MIN && vs_bf16.db() >= FP8_SNR_MIN;
    char line[512];
    snprintf(line, sizeof line, "SNR %-3s %-22s %6.1f dB vs bf16 (the CPU's fp8 math %6.1f dB); %6.1f dB vs the fp8 reference; %zu elements",
             ver, where.c_str(), vs_bf16.db(), cpu_bf16.db(), vs_q.db(), idx.size());
    g_snr_lines.push_back(line);
    if (!ok) {
        snprintf(line, sizeof line, "FAIL %s %s: %lld of %zu checked beyond tolerance (worst flat index %lld got %g want %g); SNR %.1f dB "
                 "vs bf16 (min %.0f), %.1f vs the fp8 reference (min %.0f)", ver, where.c_str(), (long long)nbad, idx.size(),
                 (long long)worst, wgot, wwant, vs_bf16.db(), FP8_SNR_MIN, vs_q.db(), FP8_MATCH_SNR_MIN);
        g_fail_lines.push_back(line);
        g_failures++;
        return false;
    }
    return !qbad && !f.wbad; /* a quantizer mismatch was counted by qreport */
}

/* The FP8 columns of the table: GEMMs over the same quantized operands (v3_fp8.cuh's layouts),
 * each validated on its own (a wrong one fails alone); q: the column times the activations'
 * quantization + the GEMM of column base (validated there). */
struct fp8_version {
    const char *name;
    cudaError_t (*fn)(const gg_fp8_problem &, cudaStream_t);
    bool q;
    int base;
};
static const fp8_version FP8_VERSIONS[] = {
    {"v3", gg_v3_launch, false, 0},            /* v3_fp8.cuh */
    {"v3q", gg_v3_launch, true, 0},            /* quantization + v3 */
    {"v5", gg_v5_launch<true, 1>, false, 2},   /* v5_fp8.cuh: promotion overlapped + TMA-store epilogue, 1 C buffer */
    {"v5a", gg_v5_launch<false, 1>, false, 3}, /* TMA-store epilogue alone (v3's promotion) */
    {"v5b", gg_v5_launch<true, 0>, false, 4},  /* overlapped promotion alone (v3's register epilogue) */
    {"v5c", gg_v5_launch<true, 2>, false, 5},  /* v5 with 2 C buffers (4 stages) */
};
constexpr int NF8 = sizeof(FP8_VERSIONS) / sizeof(FP8_VERSIONS[0]);
static bool fp8_any_enabled() {
    for (const fp8_version &v : FP8_VERSIONS)
        if (enabled(v.name)) return true;
    return false;
}

/* One product of the FP8 columns: fills c[0 .. NF8) (FP8_VERSIONS' order). */
static void fp8_kind(fp8_bufs &f, int kind, float beta, const std::vector<int64_t> &offs, const int64_t *doffs,
                     const std::vector<int64_t> &idx, const int64_t *didx, float *dgot, bool timed, const std::string &where,
                     cell *c) {
    bool on[NF8], need[NF8]; /* need: the GEMM is validated (its column or a q column on it is on) */
    bool any = false;
    for (int v = 0; v < NF8; v++) on[v] = enabled(FP8_VERSIONS[v].name), need[v] = false, any |= on[v];
    if (!any) return;
    for (int v = 0; v < NF8; v++)
        if (on[v]) c[v].ran = true, need[FP8_VERSIONS[v].base] = true;
    const int E = f.E;
    const int64_t in = f.in, out = f.out;
    gg_fp8_problem p;
    p.kind = kind, p.E = E, p.in = in, p.out = out, p.rcap = f.rcap, p.kcap = f.kcap, p.beta = beta, p.offs = doffs;
    p.A = kind == 0 ? f.xq : kind == 1 ? f.dyq : f.dyT;
    p.B = kind == 0 ? f.Wq : kind == 1 ? f.WqT : f.xT;
    p.sA = kind == 0 ? f.sx : kind == 1 ? f.sdy : f.sdyT;
    p.sB = kind == 2 ? f.sxT : f.sW;
    p.C = kind == 0 ? f.Y : kind == 1 ? f.DX : f.DW;
    auto quant = [&]() -> cudaError_t {
        if (kind == 0) return gg_v3_quant_rows(f.X, in, doffs, E, f.rcap, f.xq, f.sx, 0);
        if (kind == 1) return gg_v3_quant_rows(f.DY, out, doffs, E, f.rcap, f.dyq, f.sdy, 0);
        const cudaError_t e = gg_v3_quant_tokens_t(f.DY, out, doffs, E, f.kcap, f.dyT, f.sdyT, 0);
        return e != cudaSuccess ? e : gg_v3_quant_tokens_t(f.X, in, doffs, E, f.kcap, f.xT, f.sxT, 0);
    };
    g_current = "v3 quantization " + where;
    CK(quant());
    sync_or_die("v3 quantization", where.c_str(), 60);
    fp8_host h; /* the GPU's activation codes and scales, checked once for every column */
    if (kind == 0) d2h(h.a, f.xq, f.rcap * in), d2h(h.sa, f.sx, in / 128 * f.rpad);
    else if (kind == 1) d2h(h.a, f.dyq, f.rcap * out), d2h(h.sa, f.sdy, out / 128 * f.rpad);
    else {
        d2h(h.a, f.dyT, out * f.kcap), d2h(h.sa, f.sdyT, f.kcap / 128 * out);
        d2h(h.b, f.xT, in * f.kcap), d2h(h.sb, f.sxT, f.kcap / 128 * in);
    }
    const int qstate = check_act_quant(f, h, offs, kind, idx, where) ? 1 : 0;
    fp8_refs refs;
    fp8_refs_fill(refs, f, h, offs, kind, idx);
    const int64_t csize = kind == 0 ? f.rcap * out : kind == 1 ? f.rcap * in : (int64_t)E * out * in;
    std::vector<float> got(idx.size());
    for (int v = 0; v < NF8; v++) { /* validation of each GEMM */
        const fp8_version &fv = FP8_VERSIONS[v];
        if (!need[v] || fv.q) continue;
        if (beta != 0.0f) fill(p.C, csize, kind == 1 ? SEED_DX0 : SEED_DW0);
        else nanfill(p.C, csize);
        CK(cudaDeviceSynchronize());
        g_current = std::string(fv.name) + " " + where;
        if (getenv("GG_VERBOSE")) fprintf(stderr, "[run] %s\n", g_current.c_str());
        const cudaError_t le = fv.fn(p, 0);
        if (le == GG_NOT_SERVED) {
            c[v].na = true;
            continue;
        }
        if (le != cudaSuccess) {
            fprintf(stderr, "grouped_gemm: %s on %s: launch: %s\n", fv.name, where.c_str(), cudaGetErrorString(le));
            g_fail_lines.push_back(std::string("FAIL ") + fv.name + " " + where + ": launch: " + cudaGetErrorString(le));
            c[v].ok = false;
            g_failures++;
            continue;
        }
        sync_or_die(fv.name, where.c_str(), 60);
        gather_kernel<<<(unsigned)((idx.size() + 255) / 256), 256>>>(p.C, didx, (int)idx.size(), dgot);
        CK(cudaGetLastError());
        CK(cudaMemcpy(got.data(), dgot, idx.size() * sizeof(float), cudaMemcpyDeviceToHost));
        if (!fp8_check(f, h, offs, kind, beta, idx, got, where, fv.name, qstate, &refs)) c[v].ok = false;
    }
    for (int v = 0; v < NF8; v++) { /* a q column shares its GEMM's verdict */
        const fp8_version &fv = FP8_VERSIONS[v];
        if (fv.q) c[v].na = c[fv.base].na, c[v].ok = c[fv.base].ok;
    }
    if (!timed || g_notime) return;
    for (int v = 0; v < NF8; v++) {
        const fp8_version &fv = FP8_VERSIONS[v];
        if (!on[v] || c[v].na || !c[v].ok) continue;
        auto call = [&]() {
            if (fv.q) CK(quant());
            CK(fv.fn(p, 0));
        };
        g_current = std::string(fv.name) + " timing " + where;
        for (int w = 0; w < 2; w++) call();
        std::vector<cudaEvent_t> ev(g_iters + 1);
        for (auto &e : ev) CK(cudaEventCreate(&e));
        CK(cudaEventRecord(ev[0], 0));
        for (int i = 0; i < g_iters; i++) {
            call();
            CK(cudaEventRecord(ev[i + 1], 0));
        }
        sync_or_die(fv.name, where.c_str(), 120);
        std::vector<float> ms(g_iters);
        for (int i = 0; i < g_iters; i++) CK(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
        for (auto &e : ev) cudaEventDestroy(e);
        std::sort(ms.begin(), ms.end());
        c[v].ms = ms[g_iters / 2];
    }
}

/* ---- host check of v3's TMA boxes (v3_fp8.cuh's boxes_of, which the producer issues; v5 too)
 * and of v5's C boxes (v5_fp8.cuh's c_box: whole tiles only, each box inside C and the group) ----
 * Over every case, projection, kind, tile and k-block of the lab: each box starts at a global
 * address that is a multiple of 16 bytes along its innermost dimension (the rule whose breach, in
 * the row-scale box of 7ba8ac5, raised cudaErrorIllegalInstruction on the H200), starts inside its
 * tensor, and the consumers' row scales (lead + 0..127) lie inside the row-scale box. The cases must
 * also keep covering groups that start at rows not a multiple of 4 (where the old box start broke
 * the rule), or the check proves nothing. Run before any GPU work and by make check (verbose: one
 * summary line). Returns false, with a message on stderr, on the first violation. */
static bool fp8_tma_selftest(const std::vector<gcase> &cases, bool verbose) {
    static gg_sched s;
    int64_t boxes = 0, old_bad = 0, cboxes = 0, partial = 0;
    for (const gcase &gc : cases) {
        const int E = (int)gc.counts.size();
        std::vector<int> pblk(E + 1, 0);
        s.offs[0] = 0;
        for (int e = 0; e < E; e++) {
            s.offs[e + 1] = s.offs[e] + gc.counts[e];
            pblk[e + 1] = pblk[e] + (int)((gc.counts[e] + 127) / 128);
        }
        const int64_t rcap = std::max<int64_t>(s.offs[E], 1), rpad = gg_fp8_rpad(rcap), kcap = gg_fp8_kcap(rcap, E);
        for (int proj = 0; proj < 2; proj++) {
            const int64_t in = proj ? gc.I : gc.H, out = proj ? gc.H : gc.I;
            for (int kind = 0; kind < 3; kind++) {
                gg_problem p{};
                p.kind = kind, p.E = E, p.in = in, p.out = out, p.beta = 1.0f;
                gg_sched_prefix(s, p, v3::BM, v3::BN);
                const int64_t K = kind == 0 ? in : out; /* kinds 0/1: the reduction; kind 2 its channels are out, in */
                const int64_t inner[4] = {kind == 2 ? kcap : K, kind == 2 ? kcap : K, kind == 2 ? out : rpad, in};
                const int64_t outer[4] = {kind == 2 ? out : rcap, kind == 2 ? in : E * (kind == 0 ? out : in),
                                          kind == 2 ? kcap / 128 : K / 128, kcap / 128};
                const int64_t N = kind == 0 ? out : in, crows = kind == 2 ? E * out : rcap; /* C's tensor map (v5) */
                for (int ti = 0; ti < s.tile[E]; ti++) {
                    const gg_tile t = gg_tile_of(s, p, ti, v3::BN);
                    /* v5's C boxes (v5::c_box; old-C loads and TMA stores use the same): a whole TMA tile, every box
                     * 16-byte aligned, inside C and inside the tile's group (kinds 0/1: its rows; kind 2: dW_e) */
                    const bool tt = v5::tma_tile(kind, t);
                    if (!tt && (kind == 2 || (int64_t)(t.mt + 1) * v3::BM <= t.me)) {
                        fprintf(stderr, "grouped_gemm: v5 tile %d of %s kind %d is whole but not stored by TMA\n", ti, gc.name.c_str(), kind);
                        return false;
                    }
                    for (int i = 0; tt && i < 4; i++, cboxes++) {
                        int c0, c1;
                        v5::c_box(kind, t, out, i, &c0, &c1);
                        const int64_t glo = kind == 2 ? (int64_t)t.e * out : t.r0, ghi = kind == 2 ? glo + out : t.r0 + t.me;
                        if ((int64_t)c0 * 2 % 16 != 0 || c0 < 0 || c0 + 64 > N || c1 < glo || c1 + 64 > ghi || c1 + 64 > crows ||
                            (c0 - t.nt * v3::BN) != 64 * (i & 1) || (c1 - (glo + (int64_t)t.mt * v3::BM)) != 64 * (i >> 1)) {
                            fprintf(stderr,
                                    "grouped_gemm: v5 C box %d of %s/%s kind %d tile %d starts at (%d, %d) of a {%lld, %lld} bf16 "
                                    "tensor, group rows [%lld, %lld): must be 16-byte aligned, inside C and the group, at its "
                                    "half / column chunk\n",
                                    i, gc.name.c_str(), proj ? "dn" : "gu", kind, ti, c0, c1, (long long)N, (long long)crows,
                                    (long long)glo, (long long)ghi);
                            return false;
                        }
                    }
                    if (!tt) partial++;
                    const int nk = kind == 2 ? (int)((t.me + v3::BK - 1) / v3::BK) : (int)(K / v3::BK);
                    const int brow = kind == 2 ? 0 : (int)(t.e * (kind == 0 ? out : in)), pb = kind == 2 ? pblk[t.e] : 0;
                    for (int kb = 0; kb < nk; kb++) {
                        const v3::stage_boxes b = kind == 0   ? v3::boxes_of<0>(t, kb, brow, pb)
                                                  : kind == 1 ? v3::boxes_of<1>(t, kb, brow, pb)
                                                              : v3::boxes_of<2>(t, kb, brow, pb);
                        for (int i = 0; i < b.n; i++, boxes++)
                            if ((int64_t)b.c0[i] * v3::box_elem(i) % 16 != 0 || b.c0[i] < 0 || b.c1[i] < 0 || b.c0[i] >= inner[i] ||
                                b.c1[i] >= outer[i]) {
                                fprintf(stderr,
                                        "grouped_gemm: v3 TMA box %d of %s/%s kind %d tile %d k-block %d starts at (%d, %d) of a "
                                        "{%lld, %lld} tensor of %d-byte elements: the inner start must be a multiple of 16 bytes "
                                        "and inside the tensor\n",
                                        i, gc.name.c_str(), proj ? "dn" : "gu", kind, ti, kb, b.c0[i], b.c1[i], (long long)inner[i],
                                        (long long)outer[i], v3::box_elem(i));
                                return false;
                            }
                        if (b.lead < 0 || b.lead + v3::BM > v3::box_inner(kind, 2)) {
                            fprintf(stderr, "grouped_gemm: v3 row scales %d..%d of %s kind %d tile %d lie outside the %d-scale box\n",
                                    b.lead, b.lead + v3::BM - 1, gc.name.c_str(), kind, ti, v3::box_inner(kind, 2));
                            return false;
                        }
                        if (kind != 2 && (t.r0 + (int64_t)t.mt * v3::BM) % 4 != 0) old_bad++;
                    }
                }
            }
        }
    }
    if (old_bad == 0) {
        fprintf(stderr, "grouped_gemm: no case has a group starting at a row not a multiple of 4: the v3 TMA check proves nothing\n");
        return false;
    }
    if (partial == 0) {
        fprintf(stderr, "grouped_gemm: no case has a partial m-tile: the v5 C-box check proves nothing about them\n");
        return false;
    }
    if (verbose) {
        printf("# v3 TMA boxes: %lld checked, every start 16-byte aligned (the row-scale start of 7ba8ac5 was not in %lld)\n",
               (long long)boxes, (long long)old_bad);
        printf("# v5 C boxes (old-C loads, TMA stores): %lld checked, 16-byte aligned, inside C and the tile's group; %lld partial "
               "m-tiles stored from registers (v5's A / B / scale boxes are v3's, above)\n", (long long)cboxes, (long long)partial);
    }
    return true;
}

/* ---- GG_FP8_HOSTSIM=1: the checks above on the CPU alone (no GPU; make check runs it) ----
 * The quantization kernels' outputs are emulated on the CPU in their layouts (the kernels' index
 * formulas, fp8_ref.h's arithmetic) and the GEMM's output as a perfect one (the fp8 math rounded
 * to bf16), on small-full's groups (0, 1, 130, 257, 63 rows) for both projections and all three
 * products; every check must pass and its SNR match the host check's. Then two planted faults
 * must fail: outputs 3% off (the fp8 reference check), one block quantized with the old fp32
 * amax / 448 scale instead of the engine's power of two, and one row scale and one code changed
 * (the quantizer check). Tests the layouts and indexing of this file's references and checks. */
static void emu_rows(const fp8_bufs &f, uint32_t seed, int64_t C, int64_t R, fp8_host &h) {
    h.a.assign((size_t)(f.rcap * C), 0), h.sa.assign((size_t)(C / 128 * f.rpad), 0.0f);
    float v[128];
    for (int64_t r = 0; r < R; r++)
        for (int64_t b = 0; b < C / 128; b++) {
            for (int k = 0; k < 128; k++) v[k] = gg_val3(seed, r, b * 128 + k, C);
            h.sa[b * f.rpad + r] = cpu_quant(v, 128, 128, &h.a[r * C + b * 128]);
        }
}
static void emu_tokens_t(const fp8_bufs &f, const std::vector<int64_t> &offs, uint32_t seed, int64_t C, std::vector<uint8_t> &aT,
                         std::vector<float> &sT) {
    aT.assign((size_t)(C * f.kcap), 0xFF), sT.assign((size_t)(f.kcap / 128 * C), NAN); /* unwritten: NaN codes */
    float v[128];
    uint8_t q[128];
    for (int e = 0; e < f.E; e++)
        for (int64_t b = f.pblk[e]; b < f.pblk[e + 1]; b++) {
            const int64_t t0 = offs[e] + (b - f.pblk[e]) * 128;
            const int n = (int)std::min<int64_t>(128, offs[e + 1] - t0);
            for (int64_t c = 0; c < C; c++) {
                for (int t = 0; t < n; t++) v[t] = gg_val3(seed, t0 + t, c, C);
                sT[b * C + c] = cpu_quant(v, n, 128, q);
                memcpy(&aT[c * f.kcap + b * 128], q, 128);
            }
        }
}
static void emu_weights(fp8_bufs &f) {
    const int64_t in = f.in, out = f.out, WN = (int64_t)f.E * out * in;
    f.hWq.assign((size_t)WN, 0), f.hWqT.assign((size_t)WN, 0), f.hsW.assign((size_t)(WN / 16384), 0.0f);
    std::vector<float> v(16384);
    std::vector<uint8_t> q(16384);
    for (int64_t e = 0; e < f.E; e++)
        for (int64_t nb = 0; nb < out / 128; nb++)
            for (int64_t kb = 0; kb < in / 128; kb++) {
                for (int r = 0; r < 128; r++)
                    for (int k = 0; k < 128; k++) v[r * 128 + k] = gg_val3(SEED3_W, e * out + nb * 128 + r, kb * 128 + k, in);
                f.hsW[(e * (out / 128) + nb) * (in / 128) + kb] = cpu_quant(v.data(), 16384, 16384, q.data());
                for (int r = 0; r < 128; r++)
                    for (int k = 0; k < 128; k++) {
                        f.hWq[(e * out + nb * 128 + r) * in + kb * 128 + k] = q[r * 128 + k];
                        f.hWqT[(e * in + kb * 128 + k) * out + nb * 128 + r] = q[r * 128 + k];
                    }
            }
}

static int fp8_hostsim() {
    const std::vector<int64_t> counts = {0, 1, 130, 257, 63};
    const int E = (int)counts.size();
    std::vector<int64_t> offs(E + 1, 0);
    for (int e = 0; e < E; e++) offs[e + 1] = offs[e] + counts[e];
    const int64_t R = offs[E];
    int bad = 0;
    for (int proj = 0; proj < 2; proj++) {
        fp8_bufs f;
        f.E = E, f.in = proj == 0 ? 512 : 256, f.out = proj == 0 ? 256 : 512, f.rcap = R;
        f.rpad = gg_fp8_rpad(R), f.kcap = gg_fp8_kcap(R, E);
        f.pblk.assign(E + 1, 0);
        for (int e = 0; e < E; e++) f.pblk[e + 1] = f.pblk[e] + (int)((counts[e] + 127) / 128);
        emu_weights(f);
        for (int kind = 0; kind < 3; kind++) {
            const float beta = kind == 0 ? 0.0f : kind == 1 ? (proj == 0 ? 1.0f : 0.0f) : 1.0f;
            fp8_host h;
            if (kind == 0) emu_rows(f, SEED3_X, f.in, R, h);
            else if (kind == 1) emu_rows(f, SEED3_DY, f.out, R, h);
            else emu_tokens_t(f, offs, SEED3_DY, f.out, h.a, h.sa), emu_tokens_t(f, offs, SEED3_X, f.in, h.b, h.sb);
            const host_problem hp{kind, E, f.in, f.out, (double)beta, &offs};
            const std::vector<int64_t> idx = samples(hp, true);
            std::vector<float> got(idx.size()), off(idx.size());
            for (size_t i = 0; i < idx.size(); i++) {
                double sabs;
                const float old = beta != 0.0f ? beta * gg_val(kind == 1 ? SEED_DX0 : SEED_DW0, (uint64_t)idx[i]) : 0.0f;
                const float fin = (float)refq_elem(f, h, offs, kind, idx[i], &sabs);
                got[i] = __bfloat162float(__float2bfloat16(fin + old));
                off[i] = __bfloat162float(__float2bfloat16(fin * 1.03f + old));
            }
            const std::string where = std::string("hostsim/") + (proj ? "dn/" : "gu/") + (kind == 0 ? "fwd" : kind == 1 ? "dx" : "dW");
            const int f0 = g_failures;
            if (!fp8_check(f, h, offs, kind, beta, idx, got, where)) bad++, printf("FAIL hostsim: %s's perfect output fails\n", where.c_str());
            if (fp8_check(f, h, offs, kind, beta, idx, off, where + "(3% off)"))
                bad++, printf("FAIL hostsim: %s's output 3%% off passes\n", where.c_str());
            { /* a quantizer with the old convention (scale amax / 448, codes e4m3(v / s)) on one checked block */
                fp8_host o = h;
                const int64_t C = kind == 0 ? f.in : f.out;
                float v[128], amax = 0.0f;
                for (int k = 0; k < 128; k++) {
                    v[k] = kind == 2 ? gg_val3(SEED3_DY, offs[2] + k, 5, f.out) : gg_val3(kind == 0 ? SEED3_X : SEED3_DY, 0, k, C);
                    amax = std::max(amax, std::fabs(v[k]));
                }
                const float s = amax / 448.0f;
                for (int k = 0; k < 128; k++) (kind == 2 ? o.a[5 * f.kcap + f.pblk[2] * 128 + k] : o.a[k]) = e4m3_encode(v[k] / s);
                (kind == 2 ? o.sa[f.pblk[2] * f.out + 5] : o.sa[0]) = s;
                g_qbad = 0;
                if (!check_act_quant(f, o, offs, kind, idx, where + "(amax/448 scales)"))
                    bad++, printf("FAIL hostsim: %s's block quantized with amax / 448 scales is not found\n", where.c_str());
                else if (g_fail_lines.back().find("checked codes/scales differ") != std::string::npos)
                    printf("# hostsim: %s with one amax/448 block: %s\n", where.c_str(), g_fail_lines.back().c_str() + 5);
            }
            h.sa[kind == 2 ? f.pblk[2] * f.out + 5 : 1 * f.rpad + 0] *= 2.0f; /* a scale of a checked block */
            h.a[kind == 2 ? 7 * f.kcap + f.pblk[3] * 128 + 3 : 2 * (kind == 0 ? f.in : f.out) + 9] ^= 1; /* a code */
            g_qbad = 0;
            const bool qb = check_act_quant(f, h, offs, kind, idx, where + "(planted)");
            if (!qb || g_fail_lines.empty() || g_fail_lines.back().find("2 of") == std::string::npos)
                bad++, printf("FAIL hostsim: %s's planted scale and code are not both found (%s)\n", where.c_str(),
                              g_fail_lines.empty() ? "-" : g_fail_lines.back().c_str());
            g_failures = f0; /* the planted faults' FAIL lines are not the lab's */
            while (!g_fail_lines.empty() && g_fail_lines.back().find("hostsim/") != std::string::npos) g_fail_lines.pop_back();
        }
    }
    for (const std::string &l : g_snr_lines) printf("%s\n", l.c_str());
    printf("# fp8 host simulation %s: %d problem(s)\n", bad ? "FAILED" : "passed", bad);
    return bad ? 1 : 0;
}
