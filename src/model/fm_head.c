/* The pieces of the model outside its layers (fm_model.h): the token embedding, and the head —
 * final RMSNorm, LM head and cross-entropy (plain logits, the linear cross-entropy of
 * bounded/fm_linear_ce.h, or its ring over the ranks, bounded/fm_linear_ce_ring.h, under
 * --vocab-parallel ring) — forward and backward. */
#include "fm_model.h"

#include <string.h>

#include "../bounded/fm_linear_ce.h"
#include "../bounded/fm_linear_ce_ring.h"

#define OPS (m->be.ops)
#define CTX (m->be.ctx)
#define PHASE(p) fm_phase_mark(&m->be, FM_PHASE_##p)

fm_status fm_model_embed_forward(fm_model *m, const fm_batch *b) {
    const int64_t N = m->a.N, H = m->cfg.hidden_size;
    const size_t bytes = sizeof(int32_t) * (size_t)N;
    FM_TRY(fm_batch_check(b, m->a.B, m->a.T, m->cfg.vocab_size));
    PHASE(OTHER);
    /* sync point "token upload": the previous upload has left the pinned staging */
    OPS->event_sync(CTX, FM_EVENT_TOKENS);
    memcpy(m->a.pin_tokens, b->tokens, bytes);
    OPS->copy_async(CTX, m->a.tokens, m->a.pin_tokens, bytes, FM_COPY_H2D, FM_STREAM_COMPUTE);
    if (b->targets) {
        memcpy(m->a.pin_targets, b->targets, bytes);
        OPS->copy_async(CTX, m->a.targets, m->a.pin_targets, bytes, FM_COPY_H2D, FM_STREAM_COMPUTE);
    }
    m->a.docs = b->doc_start != NULL;
    m->a.n_seg = m->a.B;
    if (m->a.docs) {
        /* under sequence parallelism: pos is this rank's slice, doc_start the whole rows (fm_batch.h) */
        const int64_t sp = m->mesh.sp > 1 ? m->mesh.sp : 1, Tf = b->T_full > 0 ? b->T_full : b->T;
        const int64_t t0 = b->T_full > 0 ? b->t0 : 0;
        if (Tf != sp * m->a.T || t0 != (int64_t)m->mesh.sp_rank * m->a.T)
            return fm_error(FM_ERR_ARG, "batch: document starts for rows of %lld tokens at slice %lld, but the model "
                            "runs --sp %lld (rank %d): expected rows of %lld tokens and slice %lld; fill the batch "
                            "with fm_batch_alloc_docs_sp(b, %lld, %d)", (long long)Tf, (long long)t0, (long long)sp,
                            m->mesh.sp_rank, (long long)(sp * m->a.T), (long long)m->mesh.sp_rank * m->a.T,
                            (long long)sp, m->mesh.sp_rank);
        const size_t fbytes = bytes * (size_t)sp;
        if (sp == 1) { /* the documents (the router's sequence-wise loss runs without --sp only) */
            m->a.n_seg = 0;
            for (int64_t n = 0; n < N; n++) m->a.n_seg += b->doc_start[n] == (int32_t)(n % m->a.T);
        }
        memcpy(m->a.pin_doc_pos, b->pos, bytes);
        memcpy(m->a.pin_doc_start, b->doc_start, fbytes);
        OPS->copy_async(CTX, m->a.doc_pos, m->a.pin_doc_pos, bytes, FM_COPY_H2D, FM_STREAM_COMPUTE);
        OPS->copy_async(CTX, m->a.doc_start, m->a.pin_doc_start, fbytes, FM_COPY_H2D, FM_STREAM_COMPUTE);
    }
    OPS->event_record(CTX, FM_EVENT_TOKENS, FM_STREAM_COMPUTE);
    OPS->embedding_fwd(CTX, m->a.boundary[0], m->a.tokens, m->p.w.embed, N, H);
    return FM_OK;
}

fm_status fm_model_embed_backward(fm_model *m, const fm_act *dx0) {
    PHASE(OTHER);
    OPS->embedding_bwd(CTX, m->p.g.embed, dx0, m->a.tokens, m->a.N, m->cfg.hidden_size);
    return FM_OK;
}

/* The batch's valid targets: this rank's, counted on the host, summed over m->mesh.comm. */
static fm_status count_valid(fm_model *m, const fm_batch *b, fm_loss *r) {
    int64_t valid = 0;
    FM_ASSERT(b->targets && b->B * b->T == m->a.N);
    for (int64_t n = 0; n < m->a.N; n++) valid += b->targets[n] != -100;
    if (m->mesh.comm) FM_TRY(fm_comm_allreduce_sum_i64(m->mesh.comm, &valid, 1, 0));
    m->a.n_valid = r->n_valid = valid;
    return FM_OK;
}

/* The loss sum of the batch: summed over m->mesh.comm in backend memory. */
static fm_status reduce_loss(fm_model *m) {
    if (!m->mesh.comm || (m->a.linear_ce && m->mesh.vocab_P > 1)) return FM_OK; /* Ring-DTP's sums are the group's */
    return fm_comm_all_reduce(m->mesh.comm, m->a.results + FM_RESULT_CE, m->a.results + FM_RESULT_CE, 2, FM_COMM_F64,
                              FM_COMM_SUM, 0);
}

/* The linear cross-entropy over xf and the LM head; with grads, dxf -> ws.dtmp and the head's
 * gradient accumulated, scaled by scale/valid. The loss sums land in results[CE], [ZSQ].
 * Ring-DTP (m->mesh.vocab_P > 1): fm_linear_ce_ring over m->mesh.vocab_comm with this rank's shard rows of
 * the head and of its gradient; the sums it writes are the group's. Errors: the ring's (its
 * communicator's, or arguments that differ between the ranks); FM_OK for the one-rank op. */
static fm_status linear_ce(fm_model *m, bool grads, float scale) {
    const fm_config *c = &m->cfg;
    fm_lce_opts o = fm_lce_opts_default();
    o.block_tokens = m->a.ce_block_tokens;
    o.block_vocab = m->a.ce_block_vocab;
    const int64_t valid = m->a.n_valid;
    float gs = valid ? scale / (float)valid : 0.0f;
    const fm_rl_call *rl = &m->a.rl; /* the library call's switches (fm_acts.h), each read in its phase */
    if (rl->weighted && grads) { /* the RL head: the weights carry the whole per-token coefficient */
        o.token_weight = m->a.rl_weight;
        gs = scale;
        if (rl->ent_bonus) { /* the entropy bonus: its gradient through the logits (fm_acts.h) */
            o.ent_weight = m->a.rl_ent_weight;
            o.ent_value = m->a.rl_entropy;
        }
    }
    if (rl->outputs && !grads) o.out_entropy = m->a.rl_entropy; /* the forward's entropies */
    if (rl->outputs && !grads && m->a.rl_topk_lp) { /* and top-k log-probs (fm_acts.h) */
        o.topk = m->a.opts.rl_topk;
        o.out_topk_logprob = m->a.rl_topk_lp;
        o.out_topk_id = m->a.rl_topk_id;
    }
    if (m->mesh.vocab_P > 1) {
        fm_lce_ring_opts ro = fm_lce_ring_opts_default();
        ro.lce = o;
        const int64_t off = m->mesh.vocab_first * c->hidden_size; /* this rank's rows of the [V,H] head */
        return fm_linear_ce_ring(&m->be, m->mesh.vocab_comm, &m->a.arena[FM_LIVE_VOCAB], m->a.token_loss,
                                 grads ? m->a.ws.dtmp : NULL, grads ? m->p.g.lm_head + off : NULL, m->a.xf,
                                 m->p.w.lm_head + off, m->a.targets, m->a.N, c->hidden_size, c->vocab_size, gs, &ro,
                                 m->a.results + FM_RESULT_CE, NULL);
    }
    fm_linear_ce(&m->be, &m->a.arena[FM_LIVE_VOCAB], m->a.token_loss, grads ? m->a.ws.dtmp : NULL,
                 grads ? m->p.g.lm_head : NULL, m->a.xf, m->p.w.lm_head, m->a.targets, m->a.N, c->hidden_size, c->vocab_size,
                 gs, &o, m->a.results + FM_RESULT_CE);
    return FM_OK;
}

/* final RMSNorm of boundary L into xf */
static void final_norm(fm_model *m) {
    const fm_config *c = &m->cfg;
    PHASE(DENSE);
    OPS->rmsnorm_fwd(CTX, m->a.xf, m->a.rstd_f, m->a.boundary[c->num_hidden_layers], m->p.w.final_norm, m->a.N, c->hidden_size,
                     (float)c->rms_norm_eps);
    PHASE(LOSS);
}

fm_status fm_model_head_forward(fm_model *m, const fm_batch *b, fm_loss *r) {
    const fm_config *c = &m->cfg;
    const int64_t N = m->a.N, H = c->hidden_size, V = c->vocab_size;
    const bool with_targets = b->targets != NULL;
    final_norm(m);
    m->a.n_valid = r->n_valid = 0;
    if (with_targets) FM_TRY(count_valid(m, b, r));
    if (m->a.linear_ce) {
        FM_ASSERT(with_targets); /* a linear-CE layout has no logits to sample from */
        FM_TRY(linear_ce(m, false, 1.0f));
        return reduce_loss(m);
    }
    fm_linear_fwd(&m->be, m->a.logits, FM_ACT_DTYPE, m->a.xf, m->p.w.lm_head, N, H, V);
    if (!with_targets) return FM_OK;
    /* The gradient (mean over valid tokens) is formed in place now: the logits are not needed
     * afterwards. fm_model_head_backward scales it for accumulation. */
    OPS->cross_entropy(CTX, m->a.token_loss, m->a.logits, m->a.logits, m->a.targets, N, V,
                       r->n_valid ? 1.0f / (float)r->n_valid : 0.0f, -100, m->a.results + FM_RESULT_CE);
    return reduce_loss(m);
}

/* From d xf in ws.dtmp: through the final norm into grad buffer 0 (the gradient of boundary L). */
static void final_norm_backward(fm_model *m) {
    const fm_config *c = &m->cfg;
    PHASE(DENSE);
    OPS->rmsnorm_bwd(CTX, m->a.ws.dx_a, m->p.g.final_norm, m->a.ws.dtmp, m->a.boundary[c->num_hidden_layers], m->p.w.final_norm,
                     m->a.rstd_f, m->a.N, c->hidden_size);
}

fm_status fm_model_head_backward(fm_model *m, float scale) {
    const fm_config *c = &m->cfg;
    PHASE(LOSS);
    if (m->a.linear_ce) {
        FM_TRY(linear_ce(m, true, scale)); /* the ring's error (its communicator's) */
    } else {
        /* m->a.logits holds dloss/dlogits (mean CE) from the forward; the GEMMs scale it (alpha)
         * for accumulation. */
        fm_linear_bwd(&m->be, m->a.ws.dtmp, 0.0f, m->p.g.lm_head, m->a.logits, m->a.xf, m->p.w.lm_head, m->a.N, c->hidden_size,
                      c->vocab_size, scale);
    }
    final_norm_backward(m);
    return FM_OK;
}

fm_status fm_model_head_train(fm_model *m, const fm_batch *b, float scale, fm_loss *r) {
    if (!b->targets) return fm_error(FM_ERR_ARG, "training step: the batch has no targets (fm_batch.targets NULL)");
    if (!m->a.linear_ce) {
        FM_TRY(fm_model_head_forward(m, b, r));
        return fm_model_head_backward(m, scale);
    }
    final_norm(m);
    FM_TRY(count_valid(m, b, r));
    FM_TRY(linear_ce(m, true, scale)); /* loss and gradients in one pass over the strips */
    FM_TRY(reduce_loss(m));
    final_norm_backward(m);
    return FM_OK;
}

void fm_model_loss_from_results(const fm_model *m, const double *results, int64_t n_valid, fm_loss *out) {
    memset(out, 0, sizeof *out);
    out->n_valid = n_valid;
    out->ce = n_valid ? results[FM_RESULT_CE] / (double)n_valid : 0.0;
    fm_router_losses(&m->router, results + FM_RESULT_LAYERS, m->cfg.num_hidden_layers, &m->cfg, &out->aux, &out->z);
}

void fm_model_read_loss(fm_model *m, fm_loss *out) {
    const int64_t n = fm_model_results_count(&m->cfg);
    OPS->copy_async(CTX, m->a.pin_results, m->a.results, sizeof(double) * (size_t)n, FM_COPY_D2H, FM_STREAM_COMPUTE);
    OPS->stream_sync(CTX, FM_STREAM_COMPUTE); /* sync point "micro-batch loss" */
    fm_model_loss_from_results(m, m->a.pin_results, m->a.n_valid, out);
}
