/* A session's host scratch (fm_capi.h; docs/rl.md "Memory of a session"): every host buffer a
 * libflatmoe session uses beside the plan's live sets -- the packed batch as the model reads it,
 * the per-token arrays of its log-prob and policy-gradient calls, the staging of the routes and
 * of the top-k log-probs, flatmoe_generate's sampling scratch and, with --kv-cache, its KV cache
 * and the cached decoder's scratch -- carved from ONE host arena allocated at open. The arena's
 * size is the same carving run over a measuring arena (core/fm_arena.h), so the bound holds by
 * construction, and `flatmoe plan --library` prints it before anything is allocated
 * (fm_capi_host_bytes). The session's calls allocate nothing. */
#include <stdlib.h>
#include <string.h>

#include "fm_capi.h"

static int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

#define TAKE(ptr, n) ((ptr) = fm_arena_alloc(a, sizeof *(ptr) * (size_t)(n)))

/* The KV cache and the cached decoder's scratch (flatmoe_kv.c): for N = the budget,
 * K, V [L, N, nkv hd] fp32; x, ln, o [N, H]; q, att [N, nh hd]; k, v [N, nkv hd]; rlog, probs
 * [N, E]; rstd [N nh]; pos [N] int32; slot, first [N] int64; topk_idx [N, k] int32; topk_w [N, k];
 * lse [N]; hid [3 I_max + H] (one token's SwiGLU; I_max the larger of the expert and dense widths). */
static void carve_kv(fm_capi_kv *kv, const fm_config *c, int64_t N, fm_arena *a) {
    const int64_t H = c->hidden_size, L = c->num_hidden_layers, nh = c->num_attention_heads;
    const int64_t qd = nh * c->head_dim, kd = c->num_key_value_heads * c->head_dim, E = imax(c->num_experts, 1);
    const int64_t I = imax(imax(c->moe_intermediate_size, c->dense_intermediate_size), 1), k = c->num_experts_per_tok;
    TAKE(kv->K, L * N * kd);
    TAKE(kv->V, L * N * kd);
    TAKE(kv->x, N * H);
    TAKE(kv->ln, N * H);
    TAKE(kv->o, N * H);
    TAKE(kv->q, N * qd);
    TAKE(kv->att, N * qd);
    TAKE(kv->k, N * kd);
    TAKE(kv->v, N * kd);
    TAKE(kv->rlog, N * E);
    TAKE(kv->probs, N * E);
    TAKE(kv->rstd, N * nh);
    TAKE(kv->pos, N);
    TAKE(kv->slot, N);
    TAKE(kv->first, N);
    TAKE(kv->hid, 3 * I + H);
    TAKE(kv->topk_idx, N * k);
    TAKE(kv->topk_w, N * k);
    TAKE(kv->lse, N);
}

/* Every host buffer of session s (its cfg, B, T, budget, topk_max, L_moe, k and
 * spec.library.kv_cache set), in one order, from arena a; returns the KV cache's share. */
static size_t carve(flatmoe_session *s, fm_arena *a) {
    const int64_t n = s->budget, V = s->r.cfg.vocab_size;
    fm_batch *b = &s->fb; /* fm_batch_alloc + fm_batch_alloc_docs's buffers (model/fm_batch.h), one rank */
    TAKE(b->tokens, n);
    TAKE(b->targets, n);
    TAKE(b->pos, n);
    TAKE(b->doc_start, n);
    TAKE(s->pos_of, n);
    TAKE(s->seq_of, n);
    TAKE(s->in_loss, n);
    TAKE(s->tok_loss, n);
    TAKE(s->tok_ent, n);
    TAKE(s->logp, n);
    TAKE(s->ent, n);
    TAKE(s->coef, n);
    TAKE(s->seq_count, n);
    TAKE(s->weight, n);
    TAKE(s->ent_coef, n);
    TAKE(s->ent_weight, n);
    s->routes = NULL;
    if (s->L_moe * s->k > 0) TAKE(s->routes, s->L_moe * s->k * n);
    s->topk_lp = NULL, s->topk_id = NULL;
    if (s->topk_max > 0) {
        TAKE(s->topk_lp, s->topk_max * n);
        TAKE(s->topk_id, s->topk_max * n);
    }
    fm_capi_gen *g = &s->gen; /* flatmoe_generate's sampling scratch */
    TAKE(g->tok, n);
    TAKE(g->lens, n);
    TAKE(g->start, n);
    TAKE(g->row, V);
    TAKE(g->probs, V);
    TAKE(g->order, V);
    if (!s->spec.library.kv_cache) return 0;
    const size_t before = a->used;
    carve_kv(&s->kv, &s->r.cfg, n, a);
    return a->used - before;
}

size_t fm_capi_host_bytes(const fm_config *c, int64_t B, int64_t T, int64_t topk, bool kv_cache, size_t *kv_bytes) {
    flatmoe_session *s = calloc(1, sizeof *s); /* the fields carve reads; nothing is allocated from it */
    FM_ASSERT(s);
    s->r.cfg = *c;
    s->B = B, s->T = T, s->budget = B * T, s->topk_max = topk;
    s->L_moe = fm_config_num_moe_layers(c);
    s->k = c->num_experts_per_tok;
    s->spec.library.kv_cache = kv_cache;
    fm_arena a;
    fm_arena_init_measure(&a, "library host scratch");
    const size_t kv = carve(s, &a);
    if (kv_bytes) *kv_bytes = kv;
    free(s);
    return a.used;
}

fm_status fm_capi_host_alloc(flatmoe_session *s) {
    s->L_moe = fm_config_num_moe_layers(&s->r.cfg);
    s->k = s->r.cfg.num_experts_per_tok;
    if (s->spec.library.kv_cache) FM_TRY(fm_capi_kv_check(s)); /* refused before any byte is taken */
    size_t kv = 0;
    const size_t bytes = fm_capi_host_bytes(&s->r.cfg, s->B, s->T, s->topk_max, s->spec.library.kv_cache, &kv);
    fm_status st = fm_arena_init(&s->host, "library host scratch", bytes);
    if (st != FM_OK)
        return fm_error(FM_ERR_NOMEM, "flatmoe_open: cannot allocate the session's host scratch, %zu bytes for %lld "
                        "tokens (%zu of them --kv-cache's); lower --micro-batch x --seq-len%s", bytes,
                        (long long)s->budget, kv, kv ? " or drop --kv-cache" : "");
    memset(s->host.base, 0, s->host.capacity);
    const size_t got = carve(s, &s->host);
    FM_ASSERT(s->host.used == bytes && got == kv); /* the same carving: exact by construction */
    fm_batch *b = &s->fb; /* as fm_batch_alloc_docs leaves a batch: positions 0 .. T-1 per row, one document */
    b->B = s->B, b->T = s->T, b->T_full = 0, b->t0 = 0;
    for (int64_t i = 0; i < s->budget; i++) b->pos[i] = (int32_t)(i % s->T); 
    s->kv.on = s->spec.library.kv_cache;
    s->kv.bytes = kv;
    return FM_OK;
}

void fm_capi_host_free(flatmoe_session *s) {
    fm_arena_free(&s->host);
    memset(&s->fb, 0, sizeof s->fb);
    memset(&s->gen, 0, sizeof s->gen);
    memset(&s->kv, 0, sizeof s->kv);
}
