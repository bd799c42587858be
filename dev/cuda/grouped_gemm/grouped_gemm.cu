/* Grouped expert GEMM lab driver: builds every case, validates every version against a CPU
 * reference, times it with CUDA events and prints one table (TFLOP/s, median of GG_ITERS).
 * Exits 1 if any version gave a wrong result, 2 on a setup error, 3 on a hang.
 *
 * Cases: the OLMoE expert shapes (E 64, H 2048, I 1024; projection "gu" = gate or up, in H out I;
 * "dn" = down, in I out H) at 256..4,096 rows per expert, uniform, skewed (rows in [avg/2,
 * 3avg/2)) and hot (one expert with half the rows); edge cases first: a small one checked in full,
 * empty groups, one group with every row, and row tensors past 2^31 elements. Products (see
 * gg_common.cuh): fwd (beta 0), dx (beta 1 for gu, as the up projection's backward accumulates
 * into dxe; 0 for dn), dW (beta 1: dW += dy^T x, the backend's form). Inputs are a hash of each
 * element's index (multiples of 1/8 in [-1, 1], so every fp32 sum is exact and the only error is
 * the final bf16 rounding); the reference recomputes them on the host, so nothing big is copied.
 *
 * The FP8 option (v3, v3q: v3_fp8.cuh; v5, v5a, v5b, v5c: v5_fp8.cuh) has its own inputs, quantizers
 * and checks: fp8_lab.cuh.
 *
 * Environment: GG_VERSIONS (e.g. "v1,v2.128,v3"), GG_CASES (substring of case names), GG_ITERS (20),
 * GG_NOTIME=1 (validate only), GG_LIST=1 (print the cases, no GPU), GG_DW_BETA=0 (dW without +=). Build and run: make -C dev/cuda/grouped_gemm run
 */
#include "v0_cublas.cuh"
#include "v1_mma.cuh"
#include "v2_wgmma.cuh"
#include "v4_pingpong.cuh"
#include "gg_inputs.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

/* ---- inputs: gg_inputs.h (a hash of (tensor seed, flat index); multiples of 1/8 in [-1, 1]) ---- */
enum { SEED_X = 1, SEED_W = 2, SEED_DY = 3, SEED_DX0 = 4, SEED_DW0 = 5 };

__global__ void fill_kernel(bf16 *p, int64_t n, uint32_t seed) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(gg_val(seed, (uint64_t)i));
}
__global__ void nan_kernel(bf16 *p, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        p[i] = __ushort_as_bfloat16((unsigned short)0x7FC0);
}
__global__ void gather_kernel(const bf16 *c, const int64_t *idx, int n, float *out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __bfloat162float(c[idx[i]]);
}

static std::string g_current = "setup"; /* the version and case being run, for error messages */
static void die(const char *what, cudaError_t e) {
    fflush(stdout);
    fprintf(stderr, "grouped_gemm: %s (during %s): %s\n", what, g_current.c_str(), cudaGetErrorString(e));
    exit(2);
}
#define CK(x)                                                                                                  \
    do {                                                                                                       \
        cudaError_t e_ = (x);                                                                                  \
        if (e_ != cudaSuccess) die(#x, e_);                                                                    \
    } while (0)

/* Wait for the stream with a wall-clock limit (a deadlocked pipeline must not eat the session). */
static void sync_or_die(const char *ver, const char *cs, int secs) {
    cudaEvent_t ev;
    CK(cudaEventCreate(&ev));
    CK(cudaEventRecord(ev, 0));
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
        const cudaError_t q = cudaEventQuery(ev);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) {
            fprintf(stderr, "grouped_gemm: %s on %s: %s (the context is lost; rerun with GG_VERSIONS without it)\n", ver,
                    cs, cudaGetErrorString(q));
            exit(2);
        }
        if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(secs)) {
            fprintf(stderr, "grouped_gemm: %s on %s: no completion after %d s (hang)\n", ver, cs, secs);
            fflush(stdout);
            _exit(3);
        }
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    cudaEventDestroy(ev);
}

/* ---- versions ---- */
typedef cudaError_t (*launch_fn)(const gg_problem &, cudaStream_t);
struct version {
    const char *name;
    launch_fn fn;
};
static const version VERSIONS[] = {
    {"v0", gg_v0_launch},            /* cuBLAS, as the backend (auto: own calls >= 1024 rows) */
    {"v0g", gg_v0_grouped_launch},   /* cuBLAS, one grouped call */
    {"v1", gg_v1_launch},            /* mma.sync + cp.async, persistent, sync-free */
    {"v2.128", gg_v2_launch<128>},   /* wgmma + TMA, 128x128 tiles */
    {"v2.256", gg_v2_launch<256>},   /* wgmma + TMA, 128x256 tiles */
    {"v2.128p", gg_v2_launch<128, true>}, /* the same, one k-block of wgmmas kept in flight */
    {"v2.256p", gg_v2_launch<256, true>},
    {"v4", gg_v4_launch<false>},     /* ping-pong consumers, TMA source load + TMA store epilogue */
    {"v4r", gg_v4_launch<true>},     /* the same mainloop, register epilogue (old values batched) */
};
constexpr int NV = sizeof(VERSIONS) / sizeof(VERSIONS[0]);

/* ---- cases ---- */
struct gcase {
    std::string name;
    int64_t H, I, avg;
    std::vector<int64_t> counts;
    bool full, timed;
};

static uint64_t rng_state = 0x1234567ull;
static uint64_t rng() {
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return rng_state;
}
static int64_t rnd(int64_t lo, int64_t hi) { return hi > lo ? lo + (int64_t)(rng() % (uint64_t)(hi - lo)) : lo; }

static std::vector<gcase> make_cases() {
    std::vector<gcase> v;
    const int E = 64;
    v.push_back({"small-full", 512, 256, 0, {0, 1, 130, 257, 63}, true, false});
    {
        gcase c{"empty-groups", 2048, 1024, 256, {}, false, true};
        for (int e = 0; e < E; e++) c.counts.push_back((e % 3 == 0 || e == E - 1) ? 0 : rnd(1, 700));
        v.push_back(c);
    }
    {
        gcase c{"one-group", 2048, 1024, 128, std::vector<int64_t>(E, 0), false, true};
        c.counts[17] = 8192;
        v.push_back(c);
    }
    v.push_back({"past-2^31", 2048, 1024, 574289, {600000, 548577}, false, false});
    for (int64_t avg : {256, 512, 1024, 2048, 4096}) {
        gcase u{"uniform-" + std::to_string(avg), 2048, 1024, avg, std::vector<int64_t>(E, avg), false, true};
        gcase s{"skew-" + std::to_string(avg), 2048, 1024, avg, {}, false, true};
        for (int e = 0; e < E; e++) s.counts.push_back(rnd(avg / 2, 3 * avg / 2));
        gcase h{"hot-" + std::to_string(avg), 2048, 1024, avg, {}, false, true};
        const int64_t rest = E * avg / 2, q = rest / (E - 1);
        for (int e = 0; e < E; e++) h.counts.push_back(e == 5 ? E * avg / 2 : rnd(q / 2, 3 * q / 2));
        v.push_back(u), v.push_back(s), v.push_back(h);
    }
    return v;
}

/* ---- the CPU reference of one output element (gg_common.cuh's definitions), in double ---- */
struct host_problem {
    int kind, E;
    int64_t in, out;
    double beta;
    const std::vector<int64_t> *offs;
};
static int group_of(const std::vector<int64_t> &offs, int64_t r) {
    return (int)(std::upper_bound(offs.begin(), offs.end(), r) - offs.begin()) - 1;
}
static double ref_elem(const host_problem &h, int64_t idx) {
    const std::vector<int64_t> &offs = *h.offs;
    const int64_t in = h.in, out = h.out;
    double s = 0.0;
    if (h.kind == 0) {
        const int64_t r = idx / out, n = idx % out;
        const int e = group_of(offs, r);
        for (int64_t k = 0; k < in; k++)
            s += (double)gg_val(SEED_X, r * in + k) * gg_val(SEED_W, ((int64_t)e * out + n) * in + k);
        return s;
    }
    if (h.kind == 1) {
        const int64_t r = idx / in, k = idx % in;
        const int e = group_of(offs, r);
        for (int64_t n = 0; n < out; n++)
            s += (double)gg_val(SEED_DY, r * out + n) * gg_val(SEED_W, ((int64_t)e * out + n) * in + k);
        return s + (h.beta != 0.0 ? h.beta * gg_val(SEED_DX0, idx) : 0.0);
    }
    const int64_t e = idx / (out * in), n = (idx / in) % out, k = idx % in;
    for (int64_t r = offs[e]; r < offs[e + 1]; r++) s += (double)gg_val(SEED_DY, r * out + n) * gg_val(SEED_X, r * in + k);
    return s + h.beta * gg_val(SEED_DW0, idx);
}

/* Output elements to check: all of them for a full case; else, per group, its first, last and two
 * random rows at columns 0, N-1 and 8 random ones (fwd, dx), or 16 elements of dW_e including its
 * corners (every group, empty ones too), plus 256 anywhere. */
static std::vector<int64_t> samples(const host_problem &h, bool full) {
    const std::vector<int64_t> &offs = *h.offs;
    const int64_t R = offs[h.E], N = h.kind == 0 ? h.out : h.in, total = h.kind == 2 ? h.E * h.out * h.in : R * N;
    std::vector<int64_t> v;
    if (full) {
        for (int64_t i = 0; i < total; i++) v.push_back(i);
        return v;
    }
    for (int e = 0; e < h.E; e++) {
        const int64_t r0 = offs[e], m = offs[e + 1] - r0;
        if (h.kind == 2) {
            const int64_t base = (int64_t)e * h.out * h.in;
            for (int64_t c : {(int64_t)0, h.in - 1, (h.out - 1) * h.in, h.out * h.in - 1}) v.push_back(base + c);
            for (int i = 0; i < 12; i++) v.push_back(base + rnd(0, h.out * h.in));
            continue;
        }
        if (m == 0) continue;
        for (int64_t r : {r0, r0 + m - 1, rnd(r0, r0 + m), rnd(r0, r0 + m)}) {
            v.push_back(r * N), v.push_back(r * N + N - 1);
            for (int i = 0; i < 8; i++) v.push_back(r * N + rnd(0, N));
        }
    }
    for (int i = 0; i < 256; i++) v.push_back(rnd(0, total));
    return v;
}

/* ---- one case ---- */
struct cell {
    bool ran = false, ok = true, na = false;
    double ms = 0.0, err = 0.0;
    int64_t bad = -1, nbad = 0;
    float got = 0.0f;
    double want = 0.0;
};
static bool enabled(const char *name) {
    const char *s = getenv("GG_VERSIONS");
    if (!s || !*s) return true;
    std::string list = std::string(",") + s + ",";
    return list.find(std::string(",") + name + ",") != std::string::npos;
}
static int g_iters = 20, g_failures = 0;
/* dW's beta: 1 (dW += dy^T x, the backend's form) unless GG_DW_BETA=0 (the first touch: dW = dy^T x,
 * nothing read; v0 serves only 1 and shows n/a) */
static float g_dw_beta = 1.0f;
static bool g_notime = false;
static std::vector<std::string> g_fail_lines;

static void fill(bf16 *p, int64_t n, uint32_t seed) {
    fill_kernel<<<2048, 256>>>(p, n, seed);
    CK(cudaGetLastError());
}
static void nanfill(bf16 *p, int64_t n) {
    nan_kernel<<<2048, 256>>>(p, n);
    CK(cudaGetLastError());
}

#include "fp8_lab.cuh"

/* table columns: the bf16 versions, then the FP8 ones (fp8_lab.cuh's FP8_VERSIONS: v3 its GEMM
 * alone, v3q the activations' quantization + v3, v5* the v5_fp8.cuh variants) */
constexpr int NC = NV + NF8;
static const char *col_name(int v) { return v < NV ? VERSIONS[v].name : FP8_VERSIONS[v - NV].name; }

static void print_row(const std::string &cs, const char *proj, const char *prod, int64_t avg, int64_t R, double flops,
                      const cell *c) {
    printf("%-13s %-3s %-7s %6lld %8lld", cs.c_str(), proj, prod, (long long)avg, (long long)R);
    for (int v = 0; v < NC; v++) {
        if (!c[v].ran) printf(" %7s", "-");
        else if (c[v].na) printf(" %7s", "n/a");
        else if (!c[v].ok) printf(" %7s", "FAIL");
        else if (c[v].ms <= 0.0) printf(" %7s", "ok");
        else printf(" %7.1f", flops / (c[v].ms * 1e-3) / 1e12);
    }
    printf("\n");
    fflush(stdout);
}

static void run_projection(const gcase &gc, const char *proj, int64_t in, int64_t out) {
    const int E = (int)gc.counts.size();
    std::vector<int64_t> offs(E + 1, 0);
    for (int e = 0; e < E; e++) offs[e + 1] = offs[e] + gc.counts[e];
    const int64_t R = offs[E], rcap = std::max<int64_t>(R, 1);
    bf16 *X, *W, *Y, *DY, *DX, *DW;
    int64_t *doffs;
    CK(cudaMalloc(&X, rcap * in * 2));
    CK(cudaMalloc(&W, (int64_t)E * out * in * 2));
    CK(cudaMalloc(&Y, rcap * out * 2));
    CK(cudaMalloc(&DY, rcap * out * 2));
    CK(cudaMalloc(&DX, rcap * in * 2));
    CK(cudaMalloc(&DW, (int64_t)E * out * in * 2));
    CK(cudaMalloc(&doffs, (E + 1) * sizeof(int64_t)));
    CK(cudaMemcpy(doffs, offs.data(), (E + 1) * sizeof(int64_t), cudaMemcpyHostToDevice));
    fill(X, rcap * in, SEED_X), fill(W, (int64_t)E * out * in, SEED_W), fill(DY, rcap * out, SEED_DY);
    CK(cudaDeviceSynchronize());

    const char *prods[3] = {"fwd", "dx", "dW"};
    const double flops = 2.0 * (double)R * in * out;
    cell sum[NC];
    for (int v = 0; v < NC; v++) sum[v].ran = true;
    fp8_bufs f8;
    const bool fp8_on = fp8_any_enabled();
    if (fp8_on) {
        g_current = "v3 setup " + gc.name + "/" + proj;
        fp8_setup(f8, offs, E, in, out, rcap, gc.name + "/" + proj);
    }
    for (int kind = 0; kind < 3; kind++) {
        gg_problem p;
        p.kind = kind, p.E = E, p.in = in, p.out = out, p.rcap = rcap, p.offs = doffs;
        p.beta = kind == 0 ? 0.0f : kind == 1 ? (strcmp(proj, "gu") == 0 ? 1.0f : 0.0f) : g_dw_beta;
        p.A = kind == 0 ? X : DY;
        p.B = kind == 2 ? X : W;
        p.C = kind == 0 ? Y : kind == 1 ? DX : DW;
        const int64_t csize = kind == 0 ? rcap * out : kind == 1 ? rcap * in : (int64_t)E * out * in;
        const host_problem hp{kind, E, in, out, (double)p.beta, &offs};
        const std::vector<int64_t> idx = samples(hp, gc.full);
        std::vector<double> want(idx.size());
        for (size_t i = 0; i < idx.size(); i++) want[i] = ref_elem(hp, idx[i]);
        int64_t *didx;
        float *dgot;
        CK(cudaMalloc(&didx, idx.size() * sizeof(int64_t)));
        CK(cudaMalloc(&dgot, idx.size() * sizeof(float)));
        CK(cudaMemcpy(didx, idx.data(), idx.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
        std::vector<float> got(idx.size());
        const std::string where = gc.name + "/" + proj + "/" + prods[kind];

        cell c[NC];
        for (int v = 0; v < NV; v++) {
            if (!enabled(VERSIONS[v].name)) continue;
            c[v].ran = true;
            /* C's prior content: the hash for beta != 0 (the reference reads it), NaN otherwise
             * (an unwritten element fails) */
            if (p.beta != 0.0f) fill(p.C, csize, kind == 1 ? SEED_DX0 : SEED_DW0);
            else nanfill(p.C, csize);
            CK(cudaDeviceSynchronize());
            g_current = std::string(VERSIONS[v].name) + " " + where;
            if (getenv("GG_VERBOSE")) fprintf(stderr, "[run] %s\n", g_current.c_str());
            const cudaError_t le = VERSIONS[v].fn(p, 0);
            if (le == GG_NOT_SERVED) { c[v].na = true; continue; }
            if (le != cudaSuccess) {
                fprintf(stderr, "grouped_gemm: %s on %s: launch: %s\n", VERSIONS[v].name, where.c_str(), cudaGetErrorString(le));
                c[v].ok = false;
                continue;
            }
            sync_or_die(VERSIONS[v].name, where.c_str(), 60);
            gather_kernel<<<(unsigned)((idx.size() + 255) / 256), 256>>>(p.C, didx, (int)idx.size(), dgot);
            CK(cudaGetLastError());
            CK(cudaMemcpy(got.data(), dgot, idx.size() * sizeof(float), cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < idx.size(); i++) {
                const double d = std::fabs((double)got[i] - want[i]), tol = 0.0078125 * std::fabs(want[i]) + 1e-3;
                if (!(d <= tol)) { /* NaN fails too */
                    c[v].nbad++;
                    if (c[v].ok || d > c[v].err || d != d) c[v].err = d, c[v].bad = idx[i], c[v].got = got[i], c[v].want = want[i];
                    c[v].ok = false;
                }
            }
            if (!c[v].ok) {
                char line[512];
                const int64_t b = c[v].bad, N = kind == 0 ? out : in;
                char at[160];
                if (kind == 2) snprintf(at, sizeof at, "dW[e %lld][n %lld][k %lld]", (long long)(b / (out * in)),
                                        (long long)(b / in % out), (long long)(b % in));
                else {
                    const int64_t r = b / N;
                    const int e = group_of(offs, r);
                    snprintf(at, sizeof at, "row %lld (group %d, its row %lld of %lld) col %lld", (long long)r, e,
                             (long long)(r - offs[e]), (long long)(offs[e + 1] - offs[e]), (long long)(b % N));
                }
                snprintf(line, sizeof line, "FAIL %s %s: %lld of %zu checked wrong; worst %s got %g want %g",
                         VERSIONS[v].name, where.c_str(), (long long)c[v].nbad, idx.size(), at, c[v].got, c[v].want);
                g_fail_lines.push_back(line);
                if (gc.full) { /* where the wrong elements are: by row and column mod 64 (a layout
                                * or swizzle mistake shows as a pattern) */
                    int byr[64] = {0}, byc[64] = {0};
                    for (size_t i = 0; i < idx.size(); i++) {
                        const double d = std::fabs((double)got[i] - want[i]), tol = 0.0078125 * std::fabs(want[i]) + 1e-3;
                        if (d <= tol) continue;
                        const int64_t rr = kind == 2 ? idx[i] / in % out : idx[i] / N, cc = idx[i] % N;
                        byr[rr % 64]++, byc[cc % 64]++;
                    }
                    std::string m = "FAILMAP " + std::string(VERSIONS[v].name) + " " + where + " wrong by row%64:";
                    for (int i = 0; i < 64; i++) m += " " + std::to_string(byr[i]);
                    m += " | by col%64:";
                    for (int i = 0; i < 64; i++) m += " " + std::to_string(byc[i]);
                    g_fail_lines.push_back(m);
                }
                g_failures++;
                continue;
            }
            if (!gc.timed || g_notime) continue;
            /* timing: 2 warmups, then g_iters calls, each between two events; the median */
            for (int w = 0; w < 2; w++) CK(VERSIONS[v].fn(p, 0));
            std::vector<cudaEvent_t> ev(g_iters + 1);
            for (auto &e : ev) CK(cudaEventCreate(&e));
            CK(cudaEventRecord(ev[0], 0));
            for (int i = 0; i < g_iters; i++) {
                CK(VERSIONS[v].fn(p, 0));
                CK(cudaEventRecord(ev[i + 1], 0));
            }
            sync_or_die(VERSIONS[v].name, where.c_str(), 120);
            std::vector<float> ms(g_iters);
            for (int i = 0; i < g_iters; i++) CK(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
            for (auto &e : ev) cudaEventDestroy(e);
            std::sort(ms.begin(), ms.end());
            c[v].ms = ms[g_iters / 2];
        }
        if (fp8_on) fp8_kind(f8, kind, p.beta, offs, doffs, idx, didx, dgot, gc.timed, where, c + NV);
        for (int v = 0; v < NC; v++) { /* fwd+bwd: the three products' times summed */
            if (!c[v].ran) sum[v].ran = false;
            if (c[v].na) sum[v].na = true;
            if (!c[v].ok) sum[v].ok = false;
            sum[v].ms = (c[v].ms > 0.0 && sum[v].ms >= 0.0) ? sum[v].ms + c[v].ms : -1.0;
        }
        print_row(gc.name, proj, prods[kind], gc.avg, R, flops, c);
        cudaFree(didx), cudaFree(dgot);
    }
    print_row(gc.name, proj, "fwd+bwd", gc.avg, R, 3.0 * flops, sum);
    cudaFree(X), cudaFree(W), cudaFree(Y), cudaFree(DY), cudaFree(DX), cudaFree(DW), cudaFree(doffs);
    if (fp8_on) fp8_free(f8);
}

/* Host self-test of the shared tile list (gg_common.cuh), run before anything touches the GPU:
 * over every case, kind and tile shape, each tile of each group is listed exactly once. */
static bool sched_selftest(const std::vector<gcase> &cases) {
    static gg_sched s;
    for (const gcase &gc : cases) {
        const int E = (int)gc.counts.size();
        s.offs[0] = 0;
        for (int e = 0; e < E; e++) s.offs[e + 1] = s.offs[e] + gc.counts[e];
        for (int kind = 0; kind < 3; kind++)
            for (int BN : {128, 256}) {
                gg_problem p{};
                p.kind = kind, p.E = E, p.in = gc.H, p.out = gc.I, p.beta = 1.0f;
                gg_sched_prefix(s, p, 128, BN);
                const int ntn = (int)(gg_ndim(p) / BN);
                std::vector<std::vector<char>> seen(E);
                for (int e = 0; e < E; e++) seen[e].assign((size_t)gg_group_tiles(p, gc.counts[e], 128, BN), 0);
                for (int t = 0; t < s.tile[E]; t++) {
                    const gg_tile g = gg_tile_of(s, p, t, BN);
                    const int64_t i = (int64_t)g.mt * ntn + g.nt;
                    if (g.e < 0 || g.e >= E || g.r0 != s.offs[g.e] || g.me != gc.counts[g.e] || i >= (int64_t)seen[g.e].size() ||
                        seen[g.e][i]++) {
                        fprintf(stderr, "grouped_gemm: tile list wrong: case %s kind %d BN %d tile %d -> e %d mt %d nt %d\n",
                                gc.name.c_str(), kind, BN, t, g.e, g.mt, g.nt);
                        return false;
                    }
                }
                for (int e = 0; e < E; e++)
                    for (char c : seen[e])
                        if (c != 1) {
                            fprintf(stderr, "grouped_gemm: tile list misses a tile of group %d (case %s kind %d)\n", e,
                                    gc.name.c_str(), kind);
                            return false;
                        }
            }
    }
    return true;
}

int main() {
    if (getenv("GG_ITERS")) g_iters = std::max(1, atoi(getenv("GG_ITERS")));
    g_notime = getenv("GG_NOTIME") && atoi(getenv("GG_NOTIME"));
    if (getenv("GG_DW_BETA")) g_dw_beta = (float)atof(getenv("GG_DW_BETA"));
    const char *filter = getenv("GG_CASES");
    const std::vector<gcase> cases = make_cases();
    if (!sched_selftest(cases)) return 2;
    if (!fp8_tma_selftest(cases, getenv("GG_FP8_HOSTSIM") != nullptr)) return 2; /* v3's TMA boxes (fp8_lab.cuh) */
    if (getenv("GG_FP8_HOSTSIM")) return fp8_hostsim(); /* the FP8 checks on the CPU alone (fp8_lab.cuh) */
    if (getenv("GG_LIST")) { /* the cases only, no GPU: name, rows, first counts */
        for (const gcase &gc : cases) {
            int64_t R = 0;
            for (int64_t m : gc.counts) R += m;
            printf("%-16s E %3zu R %8lld counts", gc.name.c_str(), gc.counts.size(), (long long)R);
            for (size_t e = 0; e < gc.counts.size() && e < 6; e++) printf(" %lld", (long long)gc.counts[e]);
            printf("\n");
        }
        return 0;
    }
    int dev;
    cudaDeviceProp prop;
    CK(cudaGetDevice(&dev));
    CK(cudaGetDeviceProperties(&prop, dev));
    printf("# grouped expert GEMM lab on %s (sm_%d%d, %d SMs); TFLOP/s = 2*R*in*out / median time of %d calls\n",
           prop.name, prop.major, prop.minor, prop.multiProcessorCount, g_iters);
    printf("# gu: in H=2048 out I=1024 (gate, up); dn: in I out H (down); fwd y=x W^T, dx=dy W, dW+=dy^T x; "
           "'ok' = validated, not timed\n");
    printf("%-13s %-3s %-7s %6s %8s", "case", "prj", "product", "avg", "R");
    for (int v = 0; v < NC; v++) printf(" %7s", col_name(v));
    printf("\n");
    for (const gcase &gc : cases) {
        if (filter && *filter && gc.name.find(filter) == std::string::npos) continue;
        run_projection(gc, "gu", gc.H, gc.I);
        run_projection(gc, "dn", gc.I, gc.H);
    }
    for (const std::string &l : g_snr_lines) printf("%s\n", l.c_str());
    for (const std::string &l : g_fail_lines) printf("%s\n", l.c_str());
    printf("# %s: %d wrong result(s)\n", g_failures ? "FAILED" : "all versions correct", g_failures);
    return g_failures ? 1 : 0;
}
