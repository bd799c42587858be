/* Ulysses sequence parallelism for attention (fm_attn_sp.h; DeepSpeed-Ulysses, arXiv 2309.14509). */
#include "fm_attn_sp.h"

#include <stdio.h>
#include <string.h>

#define OPS (be->ops)
#define CTX (be->ctx)

static const fm_comm_dtype act_comm_dtype = sizeof(fm_act) == sizeof(float) ? FM_COMM_F32 : FM_COMM_BF16;

/* The --sp values that divide both head counts' rules, for the error's fix ("1, 2 or 4"). */
static void valid_sp_list(const fm_config *c, int64_t seq_len, char *buf, size_t n) {
    size_t used = 0;
    buf[0] = 0;
    int64_t cand[64], nc = 0;
    for (int64_t p = 1; p <= c->num_attention_heads && nc < 64; p++) {
        const int64_t kv = c->num_key_value_heads;
        if (c->num_attention_heads % p || (kv % p && p % kv) || (seq_len > 0 && seq_len % p)) continue;
        cand[nc++] = p;
    }
    for (int64_t i = 0; i < nc && used + 24 < n; i++)
        used += (size_t)snprintf(buf + used, n - used, "%s%lld", i == 0 ? "" : i + 1 == nc ? " or " : ", ",
                                 (long long)cand[i]);
}

fm_status fm_attn_sp_check(const fm_config *c, int64_t sp, int64_t seq_len) {
    char ok[256];
    if (sp < 1) return fm_error(FM_ERR_ARG, "--sp must be >= 1 (sequence-parallel ranks; 1 = off), found %lld", (long long)sp);
    if (sp == 1) return FM_OK;
    const int64_t nh = c->num_attention_heads, nkv = c->num_key_value_heads;
    if (seq_len % sp != 0) {
        valid_sp_list(c, seq_len, ok, sizeof ok);
        return fm_error(FM_ERR_ARG, "--sp %lld: --seq-len (%lld) must be divisible by --sp (each sequence-parallel rank "
                        "holds seq-len/sp tokens of every sequence); found remainder %lld; use --seq-len %lld or %lld, "
                        "or --sp %s", (long long)sp, (long long)seq_len, (long long)(seq_len % sp),
                        (long long)(seq_len / sp * sp > 0 ? seq_len / sp * sp : sp), (long long)((seq_len / sp + 1) * sp),
                        ok[0] ? ok : "1");
    }
    valid_sp_list(c, seq_len, ok, sizeof ok);
    if (nh % sp != 0)
        return fm_error(FM_ERR_ARG, "--sp %lld: num_attention_heads (%lld) of the model config must be divisible by --sp "
                        "(Ulysses gives each sequence-parallel rank nh/sp heads); found remainder %lld; use --sp %s",
                        (long long)sp, (long long)nh, (long long)(nh % sp), ok[0] ? ok : "1");
    if (nkv % sp != 0 && sp % nkv != 0)
        return fm_error(FM_ERR_ARG, "--sp %lld: num_key_value_heads (%lld) must be divisible by --sp, or divide it (then "
                        "each kv head is replicated on sp/num_key_value_heads ranks); found neither; use --sp %s",
                        (long long)sp, (long long)nkv, ok[0] ? ok : "1");
    return FM_OK;
}

/* Derived sizes of dims d (sp > 1). */
static void derive(fm_attn_sp *s, const fm_attn_sp_dims *d) {
    FM_ASSERT(d->sp > 1 && d->B >= 1 && d->Tl >= 1 && d->hd >= 1);
    FM_ASSERT(d->nh % d->sp == 0 && (d->nkv % d->sp == 0 || d->sp % d->nkv == 0) && d->nh % d->nkv == 0);
    s->d = *d;
    s->T = d->Tl * d->sp;
    s->N_l = d->B * d->Tl;
    s->nh_l = d->nh / d->sp;
    s->nkv_l = d->nkv >= d->sp ? d->nkv / d->sp : 1;
    s->kv_groups = d->nkv >= d->sp ? d->sp : d->nkv;
    s->kv_rep = d->sp / s->kv_groups;
}

#define BA(x) fm_arena_round((size_t)(x) * a)
#define B4(x) fm_arena_round((size_t)(x) * 4)

size_t fm_attn_sp_bytes(const fm_attn_sp_dims *d, size_t a) {
    if (d->sp <= 1) return 0;
    fm_attn_sp s;
    memset(&s, 0, sizeof s);
    derive(&s, d);
    const int64_t sp = d->sp, Nf = s.N_l * sp; /* the full sequences' tokens */
    const int64_t qn = Nf * s.nh_l * d->hd, kn = Nf * s.nkv_l * d->hd;
    const int64_t blk = qn > kn ? qn : kn; /* N_l nh hd == Nf nh_l hd */
    /* index tables: pack_q, pack_kv, back_q, back_kv, unpack; qh, oh, dqh, doh; kh, vh, dkh, dvh;
     * send and receive blocks */
    return 3 * B4(Nf) + B4(s.N_l * sp) + B4(s.N_l * s.kv_groups) + 4 * BA(qn) + 4 * BA(kn) + 2 * BA(blk);
}

#define TAKE(type, count) ((type *)fm_arena_alloc(ar, sizeof(type) * (size_t)(count)))

void fm_attn_sp_layout(fm_attn_sp *s, fm_arena *ar, const fm_attn_sp_dims *d) {
    memset(s, 0, sizeof *s);
    if (d->sp <= 1) {
        s->d = *d;
        s->d.sp = 1;
        return;
    }
    derive(s, d);
    const int64_t sp = d->sp, Nf = s->N_l * sp;
    const int64_t qn = Nf * s->nh_l * d->hd, kn = Nf * s->nkv_l * d->hd, blk = qn > kn ? qn : kn;
    s->pack_q = TAKE(int32_t, Nf);
    s->pack_kv = TAKE(int32_t, Nf);
    s->unpack = TAKE(int32_t, Nf);
    s->back_q = TAKE(int32_t, s->N_l * sp);
    s->back_kv = TAKE(int32_t, s->N_l * s->kv_groups);
    s->qh = TAKE(fm_act, qn);
    s->oh = TAKE(fm_act, qn);
    s->dqh = TAKE(fm_act, qn);
    s->doh = TAKE(fm_act, qn);
    s->kh = TAKE(fm_act, kn);
    s->vh = TAKE(fm_act, kn);
    s->dkh = TAKE(fm_act, kn);
    s->dvh = TAKE(fm_act, kn);
    s->send = TAKE(fm_act, blk);
    s->recv = TAKE(fm_act, blk);
}

fm_status fm_attn_sp_init(fm_attn_sp *s, const fm_backend *be, const fm_comm *comm) {
    if (s->d.sp <= 1) return FM_OK;
    const int sp = s->d.sp;
    if (!comm || fm_comm_size(comm) != sp)
        return fm_error(FM_ERR_ARG, "sequence parallelism over %d ranks needs a communicator of %d ranks (the sp group), "
                        "found %s of %d", sp, sp, comm ? "one" : "none", comm ? fm_comm_size(comm) : 0);
    s->comm = comm;
    s->rank = fm_comm_rank(comm);
    const int64_t N_l = s->N_l, Tl = s->d.Tl, T = s->T, G = s->kv_groups, rep = s->kv_rep, Nf = N_l * sp;
    s->counts = fm_malloc(sizeof(int64_t) * (size_t)(4 * sp));
    int32_t *h = fm_malloc(sizeof(int32_t) * (size_t)(5 * Nf));
    if (!s->counts || !h) {
        fm_free(h);
        fm_attn_sp_free(s);
        return fm_error(FM_ERR_NOMEM, "memory: the sequence-parallel index tables (%lld tokens)", (long long)Nf);
    }
    s->displs = s->counts + 2 * sp;
    const int64_t wq = s->nh_l * s->d.hd, wk = s->nkv_l * s->d.hd;
    for (int q = 0; q < sp; q++) {
        s->counts[q] = N_l * wq;
        s->displs[q] = q * N_l * wq;
        s->counts[sp + q] = N_l * wk;
        s->displs[sp + q] = q * N_l * wk;
    }
    int32_t *pq = h, *pk = h + Nf, *un = h + 2 * Nf, *bq = h + 3 * Nf, *bk = h + 4 * Nf;
    for (int64_t q = 0; q < sp; q++)
        for (int64_t n = 0; n < N_l; n++) {
            pq[q * N_l + n] = (int32_t)(n * sp + q);
            pk[q * N_l + n] = (int32_t)(n * G + q / rep);
            bq[n * sp + q] = (int32_t)(q * N_l + n);
        }
    for (int64_t j = 0; j < G; j++)
        for (int64_t n = 0; n < N_l; n++) bk[n * G + j] = (int32_t)(j * rep * N_l + n);
    for (int64_t p = 0; p < sp; p++)
        for (int64_t b = 0; b < s->d.B; b++)
            for (int64_t t = 0; t < Tl; t++) un[p * N_l + b * Tl + t] = (int32_t)(b * T + p * Tl + t);
    const size_t tb = sizeof(int32_t) * (size_t)Nf;
    OPS->copy(CTX, s->pack_q, pq, tb, FM_COPY_H2D);
    OPS->copy(CTX, s->pack_kv, pk, tb, FM_COPY_H2D);
    OPS->copy(CTX, s->unpack, un, tb, FM_COPY_H2D);
    OPS->copy(CTX, s->back_q, bq, tb, FM_COPY_H2D);
    OPS->copy(CTX, s->back_kv, bk, sizeof(int32_t) * (size_t)(N_l * G), FM_COPY_H2D);
    fm_free(h);
    return FM_OK;
}

void fm_attn_sp_free(fm_attn_sp *s) {
    fm_free(s->counts);
    s->counts = s->displs = NULL;
}

fm_status fm_attn_sp_seq_to_heads(const fm_attn_sp *s, const fm_backend *be, fm_act *xh, const fm_act *x, bool kv) {
    FM_ASSERT(s->d.sp > 1 && s->counts);
    const int sp = s->d.sp;
    const int64_t w = (kv ? s->nkv_l : s->nh_l) * s->d.hd, Nf = s->N_l * sp;
    const int64_t rb = w * (int64_t)sizeof(fm_act);
    const int64_t *cnt = s->counts + (kv ? sp : 0), *dsp = s->displs + (kv ? sp : 0);
    OPS->gather_rows(CTX, s->send, x, kv ? s->pack_kv : s->pack_q, Nf, rb);
    FM_TRY(fm_comm_all_to_all_v(s->comm, s->send, cnt, dsp, s->recv, cnt, dsp, act_comm_dtype, 0));
    OPS->scatter_rows(CTX, xh, s->recv, s->unpack, Nf, rb);
    return FM_OK;
}

fm_status fm_attn_sp_heads_to_seq(const fm_attn_sp *s, const fm_backend *be, fm_act *x, const fm_act *xh, bool kv) {
    FM_ASSERT(s->d.sp > 1 && s->counts);
    const int sp = s->d.sp;
    const int64_t w = (kv ? s->nkv_l : s->nh_l) * s->d.hd, Nf = s->N_l * sp, N_l = s->N_l;
    const int64_t rb = w * (int64_t)sizeof(fm_act);
    const int64_t *cnt = s->counts + (kv ? sp : 0), *dsp = s->displs + (kv ? sp : 0);
    OPS->gather_rows(CTX, s->send, xh, s->unpack, Nf, rb);
    FM_TRY(fm_comm_all_to_all_v(s->comm, s->send, cnt, dsp, s->recv, cnt, dsp, act_comm_dtype, 0));
    const int64_t G = kv ? s->kv_groups : sp, rep = kv ? s->kv_rep : 1;
    /* a replicated kv head: the copies' gradients (from ranks j rep .. j rep + rep - 1) summed
     * into the first one's block, in rank order */
    for (int64_t j = 0; j < G && rep > 1; j++)
        for (int64_t r = 1; r < rep; r++)
            OPS->add(CTX, s->recv + (size_t)(j * rep * N_l * w), s->recv + (size_t)((j * rep + r) * N_l * w), N_l * w);
    OPS->gather_rows(CTX, x, s->recv, kv ? s->back_kv : s->back_q, N_l * G, rb);
    return FM_OK;
}

fm_status fm_attn_sp_forward(const fm_attn_sp *s, const fm_backend *be, fm_act *out, float *lse, const fm_act *q,
                             const fm_act *k, const fm_act *v, const int32_t *doc_start) {
    return fm_attn_sp_forward_ext(s, be, out, lse, q, k, v, doc_start, NULL, 0);
}

fm_status fm_attn_sp_backward(const fm_attn_sp *s, const fm_backend *be, fm_act *dq, fm_act *dk, fm_act *dv,
                              const fm_act *dout, const fm_act *q, const fm_act *k, const fm_act *v,
                              const fm_act *out, const float *lse, const int32_t *doc_start) {
    return fm_attn_sp_backward_ext(s, be, dq, dk, dv, NULL, dout, q, k, v, out, lse, doc_start, NULL, 0);
}

/* The head-sharded attention runs the backend's plain op without sinks and window (the same
 * arithmetic as one rank's), else attention_ext with this rank's heads' sinks. */
fm_status fm_attn_sp_forward_ext(const fm_attn_sp *s, const fm_backend *be, fm_act *out, float *lse, const fm_act *q,
                                 const fm_act *k, const fm_act *v, const int32_t *doc_start, const fm_act *sinks,
                                 int64_t window) {
    FM_TRY(fm_attn_sp_seq_to_heads(s, be, s->qh, q, false));
    FM_TRY(fm_attn_sp_seq_to_heads(s, be, s->kh, k, true));
    FM_TRY(fm_attn_sp_seq_to_heads(s, be, s->vh, v, true));
    if (!sinks && window == 0)
        OPS->attention_fwd(CTX, s->oh, lse, s->qh, s->kh, s->vh, s->d.B, s->T, s->nh_l, s->nkv_l, s->d.hd, doc_start);
    else
        OPS->attention_ext_fwd(CTX, s->oh, lse, s->qh, s->kh, s->vh, s->d.B, s->T, s->nh_l, s->nkv_l, s->d.hd,
                               doc_start, sinks ? sinks + s->rank * s->nh_l : NULL, window);
    return fm_attn_sp_heads_to_seq(s, be, out, s->oh, false);
}

fm_status fm_attn_sp_backward_ext(const fm_attn_sp *s, const fm_backend *be, fm_act *dq, fm_act *dk, fm_act *dv,
                                  fm_act *dsinks, const fm_act *dout, const fm_act *q, const fm_act *k,
                                  const fm_act *v, const fm_act *out, const float *lse, const int32_t *doc_start,
                                  const fm_act *sinks, int64_t window) {
    FM_TRY(fm_attn_sp_seq_to_heads(s, be, s->qh, q, false));
    FM_TRY(fm_attn_sp_seq_to_heads(s, be, s->kh, k, true));
    FM_TRY(fm_attn_sp_seq_to_heads(s, be, s->vh, v, true));
    FM_TRY(fm_attn_sp_seq_to_heads(s, be, s->oh, out, false));
    FM_TRY(fm_attn_sp_seq_to_heads(s, be, s->doh, dout, false));
    const int64_t h0 = s->rank * s->nh_l;
    if (!sinks && window == 0)
        OPS->attention_bwd(CTX, s->dqh, s->dkh, s->dvh, s->doh, s->qh, s->kh, s->vh, s->oh, lse, s->d.B, s->T, s->nh_l,
                           s->nkv_l, s->d.hd, doc_start);
    else
        OPS->attention_ext_bwd(CTX, s->dqh, s->dkh, s->dvh, dsinks ? dsinks + h0 : NULL, s->doh, s->qh, s->kh, s->vh,
                               s->oh, lse, s->d.B, s->T, s->nh_l, s->nkv_l, s->d.hd, doc_start,
                               sinks ? sinks + h0 : NULL, window);
    FM_TRY(fm_attn_sp_heads_to_seq(s, be, dq, s->dqh, false));
    FM_TRY(fm_attn_sp_heads_to_seq(s, be, dk, s->dkh, true));
    return fm_attn_sp_heads_to_seq(s, be, dv, s->dvh, true);
}
