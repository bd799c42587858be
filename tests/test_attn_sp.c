/* Ulysses sequence-parallel attention (src/model/fm_attn_sp.h) on CPU ranks.
 *   test_attn_sp [self]  one rank: fm_attn_sp_check's errors (naming --sp, the field, the values
 *                        and the fix), fm_attn_sp_bytes against the layout measured over a
 *                        measuring arena; a plain ctest
 *   test_attn_sp all     under mpirun (tests/mpi_comm.sh np2 | np4): sp over the world and over
 *                        groups of 2 (fm_comm_group_create), for head counts with nkv >= sp,
 *                        nkv < sp (kv heads replicated) and nkv = 1.
 * Every rank makes the same global tensors (same seed) [B, T, heads, hd] and takes its slice of
 * positions, so each can compute the reference itself; nothing it checks against comes through
 * the communicator under test. Checks:
 * - the layout transform: seq_to_heads of the rank's slice equals a plain gather of its heads
 *   from the global tensor (q-sized and kv-sized, replicated kv heads included), bit for bit;
 *   heads_to_seq of the plain gather gives the slice back (q), or the slice times the number of
 *   ranks holding each kv head (kv: the replicas' sum; the values are dyadic, so exact);
 * - attention: fm_attn_sp_forward's output and lse, and fm_attn_sp_backward's dq, dk, dv, equal the
 *   one-rank attention of the whole sequence (the backend's attention_fwd/bwd on [B, T, nh, nkv]),
 *   sliced: out, lse and dq bit for bit (each head's arithmetic is the same), dk and dv to 1e-6
 *   of their scale (replicated heads' copies are summed in another order); the same with packed
 *   documents (issue 28): the whole rows' doc_start [B, T], documents crossing the slices;
 * - the arena: the layout takes exactly fm_attn_sp_bytes, and the run writes nothing past it. */
#include <math.h>
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "comm/fm_comm.h"
#include "core/fm_rng.h"
#include "fm_test.h"
#include "model/fm_attn_sp.h"

static fm_backend g_be;
static int g_world_rank;

typedef struct sp_case {
    int64_t B, Tl, nh, nkv, hd;
} sp_case;

static const sp_case cases[] = {
    {2, 5, 4, 2, 8},  /* sp 2: one kv head per rank; sp 4: each kv head on 2 ranks */
    {1, 3, 8, 1, 4},  /* one kv head on every rank */
    {3, 4, 4, 4, 16}, /* as many kv heads as query heads */
    {2, 7, 8, 8, 8},
};

/* dyadic values k/16, |k| <= 64: sums of a few stay exact in fp32 */
static void fill_dyadic(float *x, int64_t n, fm_rng *r) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)((int64_t)fm_rng_below(r, 129) - 64) / 16.0f;
}
static void fill_normal(float *x, int64_t n, fm_rng *r) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)((double)fm_rng_below(r, 1u << 24) / (double)(1u << 24) * 2.0 - 1.0);
}

/* rows [b, s Tl + t] of g [B, T, w] -> local [B, Tl, w] */
static void slice_seq(float *local, const float *g, int64_t B, int64_t T, int64_t Tl, int s, int64_t w) {
    for (int64_t b = 0; b < B; b++)
        memcpy(local + b * Tl * w, g + (b * T + (int64_t)s * Tl) * w, sizeof(float) * (size_t)(Tl * w));
}
/* heads [h0, h0 + nl) of g [B*T, nhg, hd] -> out [B*T, nl, hd] */
static void gather_heads(float *out, const float *g, int64_t BT, int64_t nhg, int64_t h0, int64_t nl, int64_t hd) {
    for (int64_t n = 0; n < BT; n++)
        memcpy(out + n * nl * hd, g + (n * nhg + h0) * hd, sizeof(float) * (size_t)(nl * hd));
}

static double max_abs(const float *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)x[i]));
    return m;
}
static double max_diff(const float *a, const float *b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - (double)b[i]));
    return m;
}

static void run_case(const fm_comm *comm, const sp_case *cs) {
    const int sp = fm_comm_size(comm), s = fm_comm_rank(comm);
    if (cs->nh % sp || (cs->nkv % sp && sp % cs->nkv)) return;
    const int64_t B = cs->B, Tl = cs->Tl, T = Tl * sp, nh = cs->nh, nkv = cs->nkv, hd = cs->hd;
    const int64_t BT = B * T, Nl = B * Tl, nhl = nh / sp, nkvl = nkv >= sp ? nkv / sp : 1;
    const int64_t kv0 = nkv >= sp ? s * nkvl : s / (sp / nkv), rep = nkv >= sp ? 1 : sp / nkv;
    const fm_attn_sp_dims d = {B, Tl, nh, nkv, hd, sp};
    const size_t bytes = fm_attn_sp_bytes(&d, sizeof(float));
    fm_arena ar;
    FM_ASSERT(fm_arena_init_backend(&ar, "sp", bytes, &g_be) == FM_OK);
    fm_arena_paint(&ar);
    fm_attn_sp a;
    fm_attn_sp_layout(&a, &ar, &d);
    CHECK_MSG(ar.used == bytes, "layout takes %zu bytes, fm_attn_sp_bytes %zu", ar.used, bytes);
    CHECK(fm_attn_sp_init(&a, &g_be, comm) == FM_OK);
    CHECK(a.nh_l == nhl && a.nkv_l == nkvl && a.kv_rep == rep);

    fm_rng r;
    fm_rng_seed(&r, 1000 + (uint64_t)(cs - cases));
    float *qg = fnew(BT * nh * hd), *kg = fnew(BT * nkv * hd), *vg = fnew(BT * nkv * hd), *dog = fnew(BT * nh * hd);
    float *ql = fnew(Nl * nh * hd), *kl = fnew(Nl * nkv * hd), *vl = fnew(Nl * nkv * hd), *dol = fnew(Nl * nh * hd);
    float *qh_ref = fnew(BT * nhl * hd), *kh_ref = fnew(BT * nkvl * hd), *qh = fnew(BT * nhl * hd);
    float *kh = fnew(BT * nkvl * hd), *back_q = fnew(Nl * nh * hd), *back_k = fnew(Nl * nkv * hd);

    /* 1. the layout transform against a plain gather */
    fill_dyadic(qg, BT * nh * hd, &r);
    fill_dyadic(kg, BT * nkv * hd, &r);
    slice_seq(ql, qg, B, T, Tl, s, nh * hd);
    slice_seq(kl, kg, B, T, Tl, s, nkv * hd);
    gather_heads(qh_ref, qg, BT, nh, s * nhl, nhl, hd);
    gather_heads(kh_ref, kg, BT, nkv, kv0, nkvl, hd);
    CHECK(fm_attn_sp_seq_to_heads(&a, &g_be, qh, ql, false) == FM_OK);
    CHECK(fm_attn_sp_seq_to_heads(&a, &g_be, kh, kl, true) == FM_OK);
    CHECK_MSG(max_diff(qh, qh_ref, BT * nhl * hd) == 0, "q seq->heads differs from the plain gather (case %d, sp %d)",
              (int)(cs - cases), sp);
    CHECK_MSG(max_diff(kh, kh_ref, BT * nkvl * hd) == 0, "kv seq->heads differs from the plain gather (case %d, sp %d)",
              (int)(cs - cases), sp);
    CHECK(fm_attn_sp_heads_to_seq(&a, &g_be, back_q, qh_ref, false) == FM_OK);
    CHECK(fm_attn_sp_heads_to_seq(&a, &g_be, back_k, kh_ref, true) == FM_OK);
    CHECK_MSG(max_diff(back_q, ql, Nl * nh * hd) == 0, "q heads->seq is not the slice (case %d)", (int)(cs - cases));
    for (int64_t i = 0; i < Nl * nkv * hd; i++) kl[i] *= (float)rep; /* the replicas' sum */
    CHECK_MSG(max_diff(back_k, kl, Nl * nkv * hd) == 0, "kv heads->seq is not %lld x the slice (case %d)",
              (long long)rep, (int)(cs - cases));

    /* 2. attention against the one-rank attention of the whole sequence: causal rows, then packed
     * documents (issue 28: the whole rows' starts, with documents that cross the ranks' slices) */
    int32_t *starts = malloc(sizeof(int32_t) * (size_t)BT);
    FM_ASSERT(starts);
    for (int64_t b = 0; b < B; b++) /* row b: a first document of 1 + b % 4 tokens, then lengths 1 to 5 */
        for (int64_t t = 0, st = 0, len = 1 + b % 4; t < T; t++) {
            if (t - st == len) { st = t; len = 1 + (len + b + 2) % 5; }
            starts[b * T + t] = (int32_t)st;
        }
    double ek = 0, ev = 0;
    for (int pk = 0; pk < 2; pk++) {
        const int32_t *docs = pk ? starts : NULL;
        fill_normal(qg, BT * nh * hd, &r);
        fill_normal(kg, BT * nkv * hd, &r);
        fill_normal(vg, BT * nkv * hd, &r);
        fill_normal(dog, BT * nh * hd, &r);
        float *og = fnew(BT * nh * hd), *lseg = fnew(B * nh * T), *dqg = fnew(BT * nh * hd), *dkg = fnew(BT * nkv * hd),
              *dvg = fnew(BT * nkv * hd);
        g_be.ops->attention_fwd(g_be.ctx, og, lseg, qg, kg, vg, B, T, nh, nkv, hd, docs);
        g_be.ops->attention_bwd(g_be.ctx, dqg, dkg, dvg, dog, qg, kg, vg, og, lseg, B, T, nh, nkv, hd, docs);
        slice_seq(ql, qg, B, T, Tl, s, nh * hd);
        slice_seq(kl, kg, B, T, Tl, s, nkv * hd);
        slice_seq(vl, vg, B, T, Tl, s, nkv * hd);
        slice_seq(dol, dog, B, T, Tl, s, nh * hd);
        float *o = fnew(Nl * nh * hd), *lse = fnew(B * nhl * T), *dq = fnew(Nl * nh * hd), *dk = fnew(Nl * nkv * hd),
              *dv = fnew(Nl * nkv * hd), *ref = fnew(BT * nh * hd + B * nh * T);
        CHECK(fm_attn_sp_forward(&a, &g_be, o, lse, ql, kl, vl, docs) == FM_OK);
        slice_seq(ref, og, B, T, Tl, s, nh * hd);
        CHECK_MSG(max_diff(o, ref, Nl * nh * hd) == 0, "attention output differs from the one-rank one by %g (case %d%s)",
                  max_diff(o, ref, Nl * nh * hd), (int)(cs - cases), pk ? ", packed" : "");
        for (int64_t b = 0; b < B; b++) /* lse [B, nh, T] -> this rank's heads [B, nhl, T] */
            memcpy(ref + b * nhl * T, lseg + (b * nh + s * nhl) * T, sizeof(float) * (size_t)(nhl * T));
        CHECK_MSG(max_diff(lse, ref, B * nhl * T) == 0, "lse differs from the one-rank one (case %d%s)", (int)(cs - cases), pk ? ", packed" : "");
        CHECK(fm_attn_sp_backward(&a, &g_be, dq, dk, dv, dol, ql, kl, vl, o, lse, docs) == FM_OK);
        slice_seq(ref, dqg, B, T, Tl, s, nh * hd);
        CHECK_MSG(max_diff(dq, ref, Nl * nh * hd) == 0, "dq differs from the one-rank one by %g (case %d%s)",
                  max_diff(dq, ref, Nl * nh * hd), (int)(cs - cases), pk ? ", packed" : "");
        slice_seq(ref, dkg, B, T, Tl, s, nkv * hd);
        ek = max_diff(dk, ref, Nl * nkv * hd) / fmax(max_abs(ref, Nl * nkv * hd), 1e-30);
        slice_seq(ref, dvg, B, T, Tl, s, nkv * hd);
        ev = max_diff(dv, ref, Nl * nkv * hd) / fmax(max_abs(ref, Nl * nkv * hd), 1e-30);
        CHECK_MSG(ek <= 1e-6 && ev <= 1e-6, "dk/dv differ from the one-rank ones by %.3g / %.3g of their scale (case %d%s)",
                  ek, ev, (int)(cs - cases), pk ? ", packed" : "");
        free(og); free(lseg); free(dqg); free(dkg); free(dvg); free(o); free(lse); free(dq); free(dk); free(dv);
        free(ref);
    }
    free(starts);
    CHECK_MSG(fm_arena_touched(&ar) <= bytes, "wrote %zu bytes past the %zu-byte bound", fm_arena_touched(&ar), bytes);
    printf("rank %d (world %d) sp %d B %lld Tl %lld nh %lld nkv %lld (kv on %lld rank%s): layout ok, dk %.2g dv %.2g\n",
           s, g_world_rank, sp, (long long)B, (long long)Tl, (long long)nh, (long long)nkv, (long long)rep,
           rep == 1 ? "" : "s", ek, ev);
    free(qg); free(kg); free(vg); free(dog); free(ql); free(kl); free(vl); free(dol);
    free(qh_ref); free(kh_ref); free(qh); free(kh); free(back_q); free(back_k);
    fm_attn_sp_free(&a);
    fm_arena_free(&ar);
}

/* One rank: the checks' errors and the bytes against the measured layout. */
static void run_self(void) {
    fm_config c;
    memset(&c, 0, sizeof c);
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    CHECK(fm_attn_sp_check(&c, 1, 33) == FM_OK);
    CHECK(fm_attn_sp_check(&c, 2, 32) == FM_OK);
    CHECK(fm_attn_sp_check(&c, 4, 32) == FM_OK); /* kv heads replicated on 2 ranks each */
    CHECK(fm_attn_sp_check(&c, 4, 30) == FM_ERR_ARG);
    CHECK_MSG(strstr(fm_errmsg(), "--sp 4: --seq-len (30) must be divisible by --sp") != NULL, "%s", fm_errmsg());
    CHECK(fm_attn_sp_check(&c, 3, 33) == FM_ERR_ARG);
    CHECK_MSG(strstr(fm_errmsg(), "num_attention_heads (4)") && strstr(fm_errmsg(), "use --sp 1"), "%s", fm_errmsg());
    CHECK(fm_attn_sp_check(&c, 8, 64) == FM_ERR_ARG);
    CHECK_MSG(strstr(fm_errmsg(), "--sp 8: num_attention_heads (4)") && strstr(fm_errmsg(), "1, 2 or 4"), "%s",
              fm_errmsg());
    c.num_attention_heads = 12;
    c.num_key_value_heads = 3;
    CHECK(fm_attn_sp_check(&c, 2, 64) == FM_ERR_ARG); /* 3 kv heads over 2 ranks: neither divides */
    CHECK_MSG(strstr(fm_errmsg(), "num_key_value_heads (3)") != NULL, "%s", fm_errmsg());
    CHECK(fm_attn_sp_check(&c, 0, 64) == FM_ERR_ARG);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int sp = 2; sp <= 8; sp *= 2) {
            if (cases[i].nh % sp || (cases[i].nkv % sp && sp % cases[i].nkv)) continue;
            const fm_attn_sp_dims d = {cases[i].B, cases[i].Tl, cases[i].nh, cases[i].nkv, cases[i].hd, sp};
            fm_arena m;
            fm_arena_init_measure(&m, "sp");
            fm_attn_sp s;
            fm_attn_sp_layout(&s, &m, &d);
            CHECK_MSG(m.used == fm_attn_sp_bytes(&d, sizeof(fm_act)), "case %zu sp %d: layout %zu, bytes %zu", i, sp,
                      m.used, fm_attn_sp_bytes(&d, sizeof(fm_act)));
        }
    const fm_attn_sp_dims one = {2, 8, 4, 2, 8, 1};
    CHECK(fm_attn_sp_bytes(&one, 4) == 0);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "self";
    FM_ASSERT(fm_cpu_backend_init(&g_be, 1, 64) == FM_OK);
    if (!strcmp(mode, "self")) {
        run_self();
        fm_cpu_backend_free(&g_be);
        return fm_test_finish();
    }
    if (!fm_comm_mpi_built()) {
        printf("the mpi communicator is not in this build: skipped\n");
        return 77;
    }
    fm_comm world;
    FM_ASSERT(fm_comm_mpi_world(&world, NULL, 0, 0) == FM_OK);
    const int W = fm_comm_size(&world);
    g_world_rank = fm_comm_rank(&world);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&world, &cases[i]);
    if (W > 2 && W % 2 == 0) { /* sp groups of 2 inside the world, side by side (dp = W / 2) */
        fm_comm_group grp;
        CHECK(fm_comm_group_create(&grp, &world, W / 2, 1, 2) == FM_OK);
        CHECK(fm_comm_size(&grp.axis[FM_AXIS_SP].comm) == 2);
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&grp.axis[FM_AXIS_SP].comm, &cases[i]);
        fm_comm_group_free(&grp);
    }
    int64_t fails = fm_test_failed;
    CHECK(fm_comm_allreduce_sum_i64(&world, &fails, 1, 30) == FM_OK);
    fm_comm_free(&world);
    CHECK(fm_comm_mpi_finalize() == FM_OK);
    fm_cpu_backend_free(&g_be);
    printf("rank %d of %d: ", g_world_rank, W);
    const int rc = fm_test_finish();
    return rc ? rc : fails ? 1 : 0;
}
