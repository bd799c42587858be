/* OffloadStreamAdamW: AdamW over host-resident state streamed through device slots
 * (fm_offload_adamw.h). */
#include "fm_offload_adamw.h"

#include <math.h>
#include <stdio.h>

static int64_t eff_bucket(int64_t n_params, int64_t bucket) { return bucket < n_params ? bucket : n_params; }

size_t fm_offload_adamw_state_bytes(int64_t n_params, int64_t bucket, int64_t slots, bool bf16_moments) {
    const size_t b = (size_t)eff_bucket(n_params, bucket), mb = bf16_moments ? 2 : 4;
    return (size_t)slots * (fm_arena_round(b * sizeof(float)) + 2 * fm_arena_round(b * mb));
}

size_t fm_offload_adamw_host_bytes(int64_t n_params, bool bf16_moments) {
    const size_t n = (size_t)n_params;
    return fm_arena_round(n * sizeof(float)) + 2 * fm_arena_round(n * (bf16_moments ? 2 : 4));
}

size_t fm_offload_model_state_bound(const fm_config *cfg, size_t a, bool bf16_moments, int64_t bucket, int64_t slots,
                                    size_t *host, char desc[200]) {
    const int64_t n = fm_config_num_params(cfg);
    if (host) *host = fm_offload_adamw_host_bytes(n, bf16_moments);
    if (desc)
        snprintf(desc, 200, "%d B/param (%s weight, grad) x %lld params + %lld slots x %lld x %d B staging (master, "
                 "Adam m, v); host %d B/param", (int)(2 * a), a == 4 ? "fp32" : "bf16", (long long)n, (long long)slots,
                 (long long)eff_bucket(n, bucket), bf16_moments ? 8 : 12, bf16_moments ? 8 : 12);
    return fm_param_store_bytes_no_master(cfg, a) + fm_offload_adamw_state_bytes(n, bucket, slots, bf16_moments);
}

fm_status fm_offload_adamw_create(fm_offload_adamw *opt, fm_adamw *adam, int64_t n_params, int64_t bucket,
                                  int64_t slots, const fm_backend *be) {
    memset(opt, 0, sizeof *opt);
    if (bucket < 1)
        return fm_error(FM_ERR_ARG, "--offload-optimizer-bucket %lld: must be >= 1 parameters", (long long)bucket);
    if (slots < 1 || slots > FM_OFFLOAD_MAX_SLOTS)
        return fm_error(FM_ERR_ARG, "--offload-optimizer-slots %lld: must be in [1, %d]", (long long)slots,
                        FM_OFFLOAD_MAX_SLOTS);
    opt->adam = adam;
    opt->n_params = n_params;
    opt->bucket = eff_bucket(n_params, bucket);
    opt->slots = (int)slots;
    opt->be = *be;
    const bool half = adam->moments_dtype == FM_DTYPE_BF16;
    const size_t bytes = fm_offload_adamw_host_bytes(n_params, half), n = (size_t)n_params;
    if (fm_arena_init_backend_kind(&opt->host, "optimizer state (host)", bytes, &opt->be, FM_BUFFER_PINNED))
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the offloaded optimizer state (%.3f GiB of pinned host "
                        "memory for %lld parameters)%s", bytes / 1073741824.0, (long long)n_params,
                        half ? "" : "; try --bf16-moments");
    opt->h_master = fm_arena_alloc(&opt->host, n * sizeof(float));
    opt->h_m = fm_arena_alloc(&opt->host, n * fm_dtype_size(adam->moments_dtype));
    opt->h_v = fm_arena_alloc(&opt->host, n * fm_dtype_size(adam->moments_dtype));
    return FM_OK;
}

void fm_offload_adamw_free(fm_offload_adamw *opt) {
    fm_arena_free(&opt->host);
    memset(opt, 0, sizeof *opt);
}

static size_t offload_state_bytes(const void *self, int64_t n_params) {
    const fm_offload_adamw *o = self;
    return fm_offload_adamw_state_bytes(n_params, o->bucket, o->slots, o->adam->moments_dtype == FM_DTYPE_BF16);
}

static void offload_init(void *self, fm_param_store *ps, const fm_backend *be) {
    fm_offload_adamw *o = self;
    (void)be;
    const size_t b = (size_t)o->bucket, mb = fm_dtype_size(o->adam->moments_dtype);
    for (int s = 0; s < o->slots; s++) {
        o->d_master[s] = fm_param_store_take(ps, b * sizeof(float));
        o->d_m[s] = fm_param_store_take(ps, b * mb);
        o->d_v[s] = fm_param_store_take(ps, b * mb);
        o->used[s] = false;
    }
    /* host state starts at zero (the master is written by the weights' init or a checkpoint) */
    memset(o->h_m, 0, (size_t)o->n_params * mb);
    memset(o->h_v, 0, (size_t)o->n_params * mb);
    o->adam->step = 0;
}

static void offload_step_begin(void *self) {
    fm_offload_adamw *o = self;
    o->adam->step++;
    o->step_fresh = true;
}

static void offload_step_range(void *self, fm_model *m, int t0, int t1, double lr, float grad_scale) {
    fm_offload_adamw *o = self;
    const fm_adamw *a = o->adam;
    FM_ASSERT(a->step > 0 && t0 >= 0 && t1 <= m->p.n_tensors && m->p.n_params == o->n_params);
    if (t0 >= t1) return;
    const fm_ops *ops = m->be.ops;
    void *ctx = m->be.ctx;
    const float bc1 = (float)(1.0 - pow(a->beta1, (double)a->step));
    const float bc2 = (float)(1.0 - pow(a->beta2, (double)a->step));
    const size_t mb = fm_dtype_size(a->moments_dtype);
    const int64_t e0 = m->p.table[t0].offset, e1 = m->p.table[t1 - 1].offset + m->p.table[t1 - 1].numel;
    int ti = t0;           /* first tensor that ends after the bucket's start */
    for (int64_t b0 = e0; b0 < e1; b0 += o->bucket, o->bucket_no++) {
        const int64_t b1 = b0 + o->bucket < e1 ? b0 + o->bucket : e1, nb = b1 - b0;
        const int s = (int)(o->bucket_no % o->slots);
        const int ev_in = FM_OFFLOAD_EVENT0 + 3 * s, ev_up = ev_in + 1, ev_out = ev_in + 2;
        /* copy-in: after the copy-out that last used this slot; a step's first also after the last
         * copy-out of the step before (a range read now may have been written then from another
         * slot: with more slots than a step has buckets, slot reuse alone would not order them) */
        if (o->step_fresh && o->bucket_no > 0) {
            const int last = (int)((o->bucket_no - 1) % o->slots);
            ops->event_wait(ctx, FM_STREAM_OPT_COPY_IN, FM_OFFLOAD_EVENT0 + 3 * last + 2);
        }
        o->step_fresh = false;
        if (o->used[s]) ops->event_wait(ctx, FM_STREAM_OPT_COPY_IN, ev_out);
        ops->copy_async(ctx, o->d_master[s], o->h_master + b0, (size_t)nb * sizeof(float), FM_COPY_H2D, FM_STREAM_OPT_COPY_IN);
        ops->copy_async(ctx, o->d_m[s], (char *)o->h_m + (size_t)b0 * mb, (size_t)nb * mb, FM_COPY_H2D, FM_STREAM_OPT_COPY_IN);
        ops->copy_async(ctx, o->d_v[s], (char *)o->h_v + (size_t)b0 * mb, (size_t)nb * mb, FM_COPY_H2D, FM_STREAM_OPT_COPY_IN);
        ops->event_record(ctx, ev_in, FM_STREAM_OPT_COPY_IN);
        /* update: one launch per contiguous same-decay run of tensors inside the bucket */
        ops->event_wait(ctx, FM_STREAM_OPS, ev_in); /* the op stream: compute, or update under the overlap */
        while (ti < t1 && m->p.table[ti].offset + m->p.table[ti].numel <= b0) ti++;
        int i = ti;
        while (i < t1 && m->p.table[i].offset < b1) {
            const bool decay = m->p.table[i].decay;
            const int64_t r0 = m->p.table[i].offset > b0 ? m->p.table[i].offset : b0;
            int64_t end = m->p.table[i].offset + m->p.table[i].numel;
            int j = i + 1;
            while (j < t1 && m->p.table[j].offset < b1 && m->p.table[j].decay == decay && m->p.table[j].offset == end) {
                end = m->p.table[j].offset + m->p.table[j].numel;
                j++;
            }
            const int64_t r1 = end < b1 ? end : b1;
            if (r1 > r0) {
                const size_t so = (size_t)(r0 - b0);
                ops->adamw(ctx, m->p.params + r0, m->p.grads + r0, o->d_master[s] + so, (char *)o->d_m[s] + so * mb,
                           (char *)o->d_v[s] + so * mb, a->moments_dtype, r1 - r0, (float)lr, (float)a->beta1,
                           (float)a->beta2, (float)a->eps, decay ? (float)a->weight_decay : 0.0f, bc1, bc2, grad_scale);
            }
            if (end > b1) break; /* the tensor continues in the next bucket */
            i = j;
        }
        ops->event_record(ctx, ev_up, FM_STREAM_OPS);
        /* copy-out: after the update */
        ops->event_wait(ctx, FM_STREAM_OPT_COPY_OUT, ev_up);
        ops->copy_async(ctx, o->h_master + b0, o->d_master[s], (size_t)nb * sizeof(float), FM_COPY_D2H, FM_STREAM_OPT_COPY_OUT);
        ops->copy_async(ctx, (char *)o->h_m + (size_t)b0 * mb, o->d_m[s], (size_t)nb * mb, FM_COPY_D2H, FM_STREAM_OPT_COPY_OUT);
        ops->copy_async(ctx, (char *)o->h_v + (size_t)b0 * mb, o->d_v[s], (size_t)nb * mb, FM_COPY_D2H, FM_STREAM_OPT_COPY_OUT);
        ops->event_record(ctx, ev_out, FM_STREAM_OPT_COPY_OUT);
        o->used[s] = true;
    }
}

static int offload_state_tensors(void *self, fm_optim_state *out, int cap) {
    fm_offload_adamw *o = self;
    FM_ASSERT(cap >= 3);
    out[0] = (fm_optim_state){"exp_avg.", o->h_m, o->adam->moments_dtype, true};
    out[1] = (fm_optim_state){"exp_avg_sq.", o->h_v, o->adam->moments_dtype, true};
    out[2] = (fm_optim_state){"master.", o->h_master, FM_DTYPE_F32, true};
    return 3;
}

const fm_optimizer_ops fm_offload_adamw_ops = {"offload-stream-adamw", offload_state_bytes, offload_init,
                                               offload_step_begin, offload_step_range, offload_state_tensors};
