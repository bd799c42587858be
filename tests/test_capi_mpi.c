/* libflatmoe across ranks (include/flatmoe.h "many ranks"; docs/rl.md), run by tests/mpi_capi.sh:
 *     [mpirun -np W] test_capi_mpi OUT [flatmoe_open options...]
 * One global batch of 8 packed sequences (micro config, --seq-len 32, 128 tokens): at W ranks rank
 * q takes sequences [8q/W, 8(q+1)/W) at --micro-batch 4/W (its share of the budget, as `flatmoe
 * train` splits a micro-batch over data-parallel ranks). Every rank: the log-probs and entropies
 * of its share, two policy-gradient steps (token-mean with clip and a k3 KL, then
 * seq-mean-token-mean with dual clip and an entropy bonus: both aggregations' global
 * denominators), the log-probs after them, a collective save (OUT/ckpt) and a collective weight
 * export (rank 0 writes OUT/export.idx and OUT/export.bin). OUT/rank<q>.txt gets each value under
 * its GLOBAL token index, so tests/capi_mpi_compare.py compares a W-rank run with the one-rank
 * run line by line. At W > 1 it also checks here: flatmoe_generate and flatmoe_sleep refused
 * (FLATMOE_ERR_UNSUPPORTED); a batch refused on the last rank only (or an argument: topk over
 * the session's K, a NULL spec) makes every rank return an
 * error (that rank its own, naming the token; the others how many ranks refused) and the next
 * call runs normally (no rank left waiting in a collective). Exit 0 when every check here
 * passed; the comparison is the script's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../include/flatmoe.h"

extern char **environ;

enum { NSEQ = 8, NTOK = 128, PROMPT = 4 };
static const int64_t lens_all[NSEQ] = {20, 12, 16, 16, 25, 7, 10, 22};

static int failed;
#define CHECK(c, ...)                                                                                                  \
    do {                                                                                                               \
        if (!(c)) {                                                                                                    \
            failed++;                                                                                                  \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #c);                                               \
            fprintf(stderr, __VA_ARGS__);                                                                              \
            fprintf(stderr, "\n");                                                                                     \
        }                                                                                                              \
    } while (0)

/* A fixed pseudo-random value in [0, 1) of (i, salt): the same on every rank and layout. */
static double u01(uint64_t i, uint64_t salt) {
    uint64_t x = i * 0x9E3779B97F4A7C15ull + salt * 0xD1B54A32D192ED03ull + 1;
    x ^= x >> 31, x *= 0xBF58476D1CE4E5B9ull, x ^= x >> 27, x *= 0x94D049BB133111EBull, x ^= x >> 31;
    return (double)(x >> 11) / 9007199254740992.0;
}

typedef struct share {
    int64_t t0, n, s0, ns; /* first global token, tokens, first sequence, sequences */
    int32_t tok[NTOK];
    uint8_t mask[NTOK];
    float adv[NTOK], old[NTOK], ref[NTOK];
} share;

static void make_share(share *sh, int rank, int W) {
    sh->s0 = NSEQ * rank / W;
    const int64_t s1 = NSEQ * (rank + 1) / W;
    sh->ns = s1 - sh->s0;
    sh->t0 = 0;
    for (int64_t i = 0; i < sh->s0; i++) sh->t0 += lens_all[i];
    sh->n = 0;
    for (int64_t i = sh->s0; i < s1; i++)
        for (int64_t j = 0; j < lens_all[i]; j++, sh->n++) {
            const int64_t g = sh->t0 + sh->n;
            sh->tok[sh->n] = (int32_t)(u01((uint64_t)g, 1) * 256);
            sh->mask[sh->n] = j >= PROMPT;
            sh->adv[sh->n] = (float)(2 * u01((uint64_t)i, 2) - 1); /* one advantage per sequence (GRPO's) */
        }
}

static flatmoe_batch batch_of(const share *sh) {
    flatmoe_batch b;
    memset(&b, 0, sizeof b);
    b.n_tokens = sh->n;
    b.tokens = sh->tok;
    b.n_seqs = sh->ns;
    b.seq_lens = lens_all + sh->s0;
    b.loss_mask = sh->mask;
    return b;
}

static void put_values(FILE *f, const char *tag, const share *sh, const float *v) {
    for (int64_t t = 0; t < sh->n; t++) fprintf(f, "%s %lld %.9g\n", tag, (long long)(sh->t0 + t), (double)v[t]);
}

static void put_stats(FILE *f, int step, const flatmoe_step_stats *st) {
    fprintf(f, "stats %d %.17g %.17g %.17g %.17g %.17g %.17g %.17g %.17g %lld %lld\n", step, st->loss, st->pg_loss,
            st->kl, st->entropy, st->ratio_mean, st->clip_frac, st->tis_mean, st->grad_norm,
            (long long)st->n_loss_tokens, (long long)st->n_loss_seqs);
}

/* flatmoe_export_weights' callback on rank 0: each piece's name, offset and size to export.idx,
 * its bytes to export.bin. */
typedef struct sink {
    FILE *idx, *bin;
} sink;
static int take_bucket(void *user, const flatmoe_weight_piece *p, int n) {
    sink *k = user;
    for (int i = 0; i < n; i++) {
        fprintf(k->idx, "%s %lld %lld\n", p[i].name, (long long)p[i].offset, (long long)p[i].nbytes);
        if (fwrite(p[i].data, 1, (size_t)p[i].nbytes, k->bin) != (size_t)p[i].nbytes) return 1;
    }
    return 0;
}

/* At W > 1: the calls not across ranks yet are refused, and a batch refused on one rank only
 * leaves no rank waiting. */
static void refusals(flatmoe_session *s, const share *sh, int rank, int W) {
    const int32_t prompt[2] = {1, 2};
    const int64_t plen = 2;
    int32_t out[4];
    int64_t out_len;
    flatmoe_sample_spec sp = flatmoe_sample_spec_default();
    sp.max_new = 2;
    CHECK(flatmoe_generate(s, prompt, 1, &plen, &sp, out, &out_len, NULL) == FLATMOE_ERR_UNSUPPORTED, "%s",
          flatmoe_last_error());
    CHECK(strstr(flatmoe_last_error(), "several ranks") != NULL, "%s", flatmoe_last_error());
    CHECK(flatmoe_sleep(s) == FLATMOE_ERR_UNSUPPORTED, "%s", flatmoe_last_error());
    share bad = *sh;
    if (rank == W - 1) bad.tok[3] = 999; /* out of the vocabulary, on the last rank only */
    flatmoe_batch b = batch_of(&bad);
    static float lp[NTOK];
    CHECK(flatmoe_logprobs(s, &b, lp, NULL) == FLATMOE_ERR_ARG, "rank %d: a refused batch passed", rank);
    if (rank == W - 1) CHECK(strstr(flatmoe_last_error(), "tokens[3] is 999") != NULL, "%s", flatmoe_last_error());
    else CHECK(strstr(flatmoe_last_error(), "1 of the") != NULL, "%s", flatmoe_last_error());
    const flatmoe_loss_spec spec = flatmoe_loss_spec_default();
    CHECK(flatmoe_train_step(s, &b, &spec, NULL) == FLATMOE_ERR_ARG, "rank %d: a refused batch stepped", rank);
    /* an argument refused on the last rank only (topk over the session's K = 0; a NULL spec): the others
     * return too, not wait in the collective */
    const flatmoe_batch good = batch_of(sh);
    static float tl[NTOK];
    static int32_t ti[NTOK];
    CHECK(flatmoe_logprobs_ex(s, &good, lp, NULL, NULL, rank == W - 1, tl, ti) == FLATMOE_ERR_ARG,
          "rank %d: a refused topk passed", rank);
    if (rank == W - 1) CHECK(strstr(flatmoe_last_error(), "topk 1") != NULL, "%s", flatmoe_last_error());
    else CHECK(strstr(flatmoe_last_error(), "1 of the") != NULL, "%s", flatmoe_last_error());
    CHECK(flatmoe_train_step(s, &good, rank == W - 1 ? NULL : &spec, NULL) == FLATMOE_ERR_ARG,
          "rank %d: a NULL spec on one rank stepped", rank);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: [mpirun -np W] %s OUT [flatmoe_open options...]\n", argv[0]);
        return 2;
    }
    const char *out = argv[1];
    const char *src = getenv("FLATMOE_SOURCE_DIR");
    char cfg[4096];
    snprintf(cfg, sizeof cfg, "%s/tests/data/micro.json", src ? src : ".");
    /* the world's size before the session: the launcher's (the session's own check follows) */
    const char *ws = getenv("OMPI_COMM_WORLD_SIZE");
    const int W = ws ? atoi(ws) : 1;
    char mb[16];
    snprintf(mb, sizeof mb, "%d", 4 / W);
    const char *base[] = {"--config", cfg, "--seq-len", "32", "--micro-batch", mb, "--seed", "7", "--lr", "3e-3",
                          "--warmup", "0", "--threads", "1", "--quiet", "--ce-block-tokens", "16",
                          "--ce-block-vocab", "64"};
    const int nb = (int)(sizeof base / sizeof base[0]);
    const char *opts[64];
    int n_opts = 0;
    for (int i = 0; i < nb; i++) opts[n_opts++] = base[i];
    for (int i = 2; i < argc && n_opts < 64; i++) opts[n_opts++] = argv[i];
    if (flatmoe_abi_version() != FLATMOE_ABI_VERSION) return fprintf(stderr, "ABI mismatch\n"), 1;
    if (flatmoe_set_environment((const char *const *)environ) != FLATMOE_OK) return 1; /* the launcher's ranks */
    flatmoe_session *s = NULL;
    if (flatmoe_open(&s, n_opts, opts) != FLATMOE_OK) {
        fprintf(stderr, "flatmoe_open: %s\n", flatmoe_last_error());
        return 1;
    }
    flatmoe_info info;
    CHECK(flatmoe_get_info(s, &info) == FLATMOE_OK, "%s", flatmoe_last_error());
    const int rank = (int)info.rank;
    CHECK(info.n_ranks == W && info.token_budget == 32 * (4 / W), "n_ranks %lld, budget %lld", (long long)info.n_ranks,
          (long long)info.token_budget);
    static share sh;
    make_share(&sh, rank, W);
    char path[4200];
    snprintf(path, sizeof path, "%s/rank%d.txt", out, rank);
    FILE *f = fopen(path, "w");
    if (!f) return fprintf(stderr, "cannot write %s\n", path), 1;
    flatmoe_batch b = batch_of(&sh);
    static float lp[NTOK], ent[NTOK];
    CHECK(flatmoe_logprobs(s, &b, lp, ent) == FLATMOE_OK, "%s", flatmoe_last_error());
    put_values(f, "lp0", &sh, lp);
    put_values(f, "ent0", &sh, ent);
    for (int64_t t = 0; t < sh.n; t++) { /* behaviour and reference log-probs near the current ones */
        const uint64_t g = (uint64_t)(sh.t0 + t);
        sh.old[t] = lp[t] + (float)(0.4 * u01(g, 3) - 0.2);
        sh.ref[t] = lp[t] + (float)(0.2 * u01(g, 4) - 0.1);
    }
    b.advantages = sh.adv;
    b.old_logprobs = sh.old;
    b.ref_logprobs = sh.ref;
    flatmoe_loss_spec sp = flatmoe_loss_spec_default();
    sp.loss = FLATMOE_LOSS_PG;
    sp.clip_high = 0.28;
    sp.kl = FLATMOE_KL_K3;
    sp.kl_coef = 0.05;
    flatmoe_step_stats st;
    CHECK(flatmoe_train_step(s, &b, &sp, &st) == FLATMOE_OK, "%s", flatmoe_last_error());
    put_stats(f, 1, &st);
    sp.agg = FLATMOE_AGG_SEQ_MEAN_TOKEN_MEAN;
    sp.clip_dual = 3;
    sp.entropy_coef = 0.01;
    CHECK(flatmoe_train_step(s, &b, &sp, &st) == FLATMOE_OK, "%s", flatmoe_last_error());
    put_stats(f, 2, &st);
    CHECK(flatmoe_logprobs(s, &b, lp, ent) == FLATMOE_OK, "%s", flatmoe_last_error());
    put_values(f, "lp2", &sh, lp);
    fclose(f);
    snprintf(path, sizeof path, "%s/ckpt", out);
    CHECK(flatmoe_save(s, path) == FLATMOE_OK, "%s", flatmoe_last_error());
    sink k = {NULL, NULL};
    if (rank == 0) {
        snprintf(path, sizeof path, "%s/export.idx", out);
        k.idx = fopen(path, "w");
        snprintf(path, sizeof path, "%s/export.bin", out);
        k.bin = fopen(path, "wb");
        if (!k.idx || !k.bin) return fprintf(stderr, "cannot write the export files under %s\n", out), 1;
    }
    CHECK(flatmoe_export_weights(s, 4096, take_bucket, &k) == FLATMOE_OK, "%s", flatmoe_last_error());
    if (rank == 0) fclose(k.idx), fclose(k.bin);
    if (W > 1) refusals(s, &sh, rank, W);
    const flatmoe_batch again = batch_of(&sh);
    CHECK(flatmoe_logprobs(s, &again, lp, NULL) == FLATMOE_OK, "after the refusals: %s", flatmoe_last_error());
    flatmoe_close(s);
    CHECK(flatmoe_finalize() == FLATMOE_OK, "%s", flatmoe_last_error());
    printf("test_capi_mpi rank %d of %d: %s\n", rank, W, failed ? "FAILED" : "ok");
    return failed ? 1 : 0;
}
