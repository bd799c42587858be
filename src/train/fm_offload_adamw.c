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

size_t fm_offload_adamw_state_bytes_split(int64_t n_params, int64_t bucket, int64_t slots, bool bf16_moments,
                                          int64_t resident) {
    const size_t R = (size_t)resident, mb = bf16_moments ? 2 : 4;
    const size_t res = R ? fm_arena_round(R * sizeof(float)) + 2 * fm_arena_round(R * mb) : 0;
    return res + fm_offload_adamw_state_bytes(n_params - resident, bucket, slots, bf16_moments);
}

size_t fm_offload_adamw_host_bytes_split(int64_t n_params, bool bf16_moments, int64_t resident) {
    const size_t n = (size_t)n_params, s = (size_t)(n_params - resident);
    return fm_arena_round(n * sizeof(float)) + 2 * fm_arena_round(s * (bf16_moments ? 2 : 4));
}

size_t fm_offload_model_state_bound(const fm_config *cfg, size_t a, bool bf16_moments, int64_t bucket, int64_t slots,
                                    double fraction, size_t *host, char desc[200]) {
    const int64_t n = fm_config_num_params(cfg), R = fm_offload_resident_params(n, bucket, fraction);
    if (host) *host = fm_offload_adamw_host_bytes_split(n, bf16_moments, R);
    if (desc) {
        if (R > 0)
            snprintf(desc, 200, "%d B/param (%s weight, grad) x %lld params + %d B/param resident x %lld + %lld slots x "
                     "%lld x %d B staging; host master 4 B x %lld, m, v %d B x %lld", (int)(2 * a),
                     a == 4 ? "fp32" : "bf16", (long long)n, bf16_moments ? 8 : 12, (long long)R, (long long)slots,
                     (long long)eff_bucket(n - R, bucket), bf16_moments ? 8 : 12, (long long)n, bf16_moments ? 4 : 8,
                     (long long)(n - R));
        else
            snprintf(desc, 200, "%d B/param (%s weight, grad) x %lld params + %lld slots x %lld x %d B staging (master, "
                     "Adam m, v); host %d B/param", (int)(2 * a), a == 4 ? "fp32" : "bf16", (long long)n, (long long)slots,
                     (long long)eff_bucket(n, bucket), bf16_moments ? 8 : 12, bf16_moments ? 8 : 12);
    }
    return fm_param_store_bytes_no_master(cfg, a) + fm_offload_adamw_state_bytes_split(n, bucket, slots, bf16_moments, R);
}

fm_status fm_offload_adamw_create_split(fm_offload_adamw *opt, fm_adamw *adam, int64_t n_params, int64_t bucket,
                                        int64_t slots, double fraction, const fm_backend *be) {
    memset(opt, 0, sizeof *opt);
    if (bucket < 1)
        return fm_error(FM_ERR_ARG, "--offload-optimizer-bucket %lld: must be >= 1 parameters", (long long)bucket);
    if (slots < 1 || slots > FM_OFFLOAD_MAX_SLOTS)
        return fm_error(FM_ERR_ARG, "--offload-optimizer-slots %lld: must be in [1, %d]", (long long)slots,
                        FM_OFFLOAD_MAX_SLOTS);
    if (!(fraction > 0 && fraction <= 1))
        return fm_error(FM_ERR_ARG, "--optimizer-offload-fraction %g: must be in (0, 1] (the share of the optimizer's "
                        "buckets that stream from the host)", fraction);
    const int64_t R = fm_offload_resident_params(n_params, bucket, fraction);
    opt->adam = adam;
    opt->n_params = n_params;
    opt->resident = R;
    opt->bucket = eff_bucket(n_params - R, bucket);
    opt->slots = (int)slots;
    opt->be = *be;
    const bool half = adam->moments_dtype == FM_DTYPE_BF16;
    const size_t bytes = fm_offload_adamw_host_bytes_split(n_params, half, R), n = (size_t)n_params;
    const size_t ns = (size_t)(n_params - R);
    if (fm_arena_init_backend_kind(&opt->host, "optimizer state (host)", bytes, &opt->be, FM_BUFFER_PINNED))
        return fm_error(FM_ERR_NOMEM, "memory: cannot allocate the offloaded optimizer state (%.3f GiB of pinned host "
                        "memory for %lld parameters, %lld of them streamed)%s", bytes / 1073741824.0,
                        (long long)n_params, (long long)ns, half ? "" : "; try --bf16-moments");
    opt->h_master = fm_arena_alloc(&opt->host, n * sizeof(float));
    opt->h_m = fm_arena_alloc(&opt->host, ns * fm_dtype_size(adam->moments_dtype));
    opt->h_v = fm_arena_alloc(&opt->host, ns * fm_dtype_size(adam->moments_dtype));
    return FM_OK;
}

fm_status fm_offload_adamw_create(fm_offload_adamw *opt, fm_adamw *adam, int64_t n_params, int64_t bucket,
                                  int64_t slots, const fm_backend *be) {
    return fm_offload_adamw_create_split(opt, adam, n_params, bucket, slots, 1.0, be);
}

void fm_offload_adamw_free(fm_offload_adamw *opt) {
    fm_arena_free(&opt->host);
    memset(opt, 0, sizeof *opt);
}

static size_t offload_state_bytes(const void *self, int64_t n_params) {
    const fm_offload_adamw *o = self;
    return fm_offload_adamw_state_bytes_split(n_params, o->bucket, o->slots, o->adam->moments_dtype == FM_DTYPE_BF16,
                                              o->resident);
}

static void offload_init(void *self, fm_param_store *ps, const fm_backend *be) {
    fm_offload_adamw *o = self;
    const size_t b = (size_t)o->bucket, mb = fm_dtype_size(o->adam->moments_dtype), R = (size_t)o->resident;
    o->d_res_master = NULL, o->d_res_m = o->d_res_v = NULL;
    if (R > 0) { /* the resident state; its moments start at zero, its master comes from the host's */
        o->d_res_master = fm_param_store_take(ps, R * sizeof(float));
        o->d_res_m = fm_param_store_take(ps, R * mb);
        o->d_res_v = fm_param_store_take(ps, R * mb);
        be->ops->mem_set(be->ctx, o->d_res_m, 0, R * mb);
        be->ops->mem_set(be->ctx, o->d_res_v, 0, R * mb);
    }
    for (int s = 0; s < o->slots; s++) {
        o->d_master[s] = fm_param_store_take(ps, b * sizeof(float));
        o->d_m[s] = fm_param_store_take(ps, b * mb);
        o->d_v[s] = fm_param_store_take(ps, b * mb);
        o->used[s] = false;
    }
    /* host state starts at zero (the master is written by the weights' init or a checkpoint) */
    const size_t ns = (size_t)(o->n_params - o->resident);
    memset(o->h_m, 0, ns * mb);
    memset(o->h_v, 0, ns * mb);
    o->pull = R > 0;
    o->pull_wait = false;
    o->adam->step = 0;
}

static void offload_step_begin(void *self) {
    fm_offload_adamw *o = self;
    o->adam->step++;
    o->step_fresh = true;
    if (o->pull) { /* the host master's resident part is the newer (init, a load or a save): copy it in */
        const fm_ops *ops = o->be.ops;
        ops->copy_async(o->be.ctx, o->d_res_master, o->h_master, (size_t)o->resident * sizeof(float), FM_COPY_H2D,
                        FM_STREAM_OPT_COPY_IN);
        ops->event_record(o->be.ctx, FM_OFFLOAD_PULL_EVENT, FM_STREAM_OPT_COPY_IN);
        o->pull = false;
        o->pull_wait = true;
    }
}

/* The update of flat elements [r0, r1) (tensors t0 .. t1-1 of m's table, *ti the first that ends
 * after r0, advanced) whose master, m and v are at ms, mm, mv for element base: one launch per
 * contiguous run of tensors with one weight-decay flag, clipped to the range. */
static void update_range(const fm_offload_adamw *o, fm_model *m, int *ti, int t1, int64_t r0, int64_t r1, int64_t base,
                         float *ms, void *mm, void *mv, double lr, float grad_scale, float bc1, float bc2) {
    const fm_adamw *a = o->adam;
    const size_t mb = fm_dtype_size(a->moments_dtype);
    while (*ti < t1 && m->p.table[*ti].offset + m->p.table[*ti].numel <= r0) (*ti)++;
    int i = *ti;
    while (i < t1 && m->p.table[i].offset < r1) {
        const bool decay = m->p.table[i].decay;
        const int64_t q0 = m->p.table[i].offset > r0 ? m->p.table[i].offset : r0;
        int64_t end = m->p.table[i].offset + m->p.table[i].numel;
        int j = i + 1;
        while (j < t1 && m->p.table[j].offset < r1 && m->p.table[j].decay == decay && m->p.table[j].offset == end) {
            end = m->p.table[j].offset + m->p.table[j].numel;
            j++;
        }
        const int64_t q1 = end < r1 ? end : r1;
        if (q1 > q0) {
            const size_t so = (size_t)(q0 - base);
            m->be.ops->adamw(m->be.ctx, m->p.params + q0, m->p.grads + q0, ms + so, (char *)mm + so * mb,
                             (char *)mv + so * mb, a->moments_dtype, q1 - q0, (float)lr, (float)a->beta1,
                             (float)a->beta2, (float)a->eps, decay ? (float)a->weight_decay : 0.0f, bc1, bc2, grad_scale);
        }
        if (end > r1) break; /* the tensor continues past the range */
        i = j;
    }
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
    const int64_t R = o->resident;
    int ti = t0;           /* first tensor that ends after the range's start */
    if (e0 < R) {          /* the resident part: updated in place on the device */
        if (o->pull_wait) ops->event_wait(ctx, FM_STREAM_OPS, FM_OFFLOAD_PULL_EVENT);
        o->pull_wait = false;
        update_range(o, m, &ti, t1, e0, e1 < R ? e1 : R, 0, o->d_res_master, o->d_res_m, o->d_res_v, lr, grad_scale,
                     bc1, bc2);
    }
    /* the streamed part: buckets from max(e0, R); host element p of m, v is at p - R */
    for (int64_t b0 = e0 > R ? e0 : R; b0 < e1; b0 += o->bucket, o->bucket_no++) {
        const int64_t b1 = b0 + o->bucket < e1 ? b0 + o->bucket : e1, nb = b1 - b0, h0 = b0 - R;
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
        ops->copy_async(ctx, o->d_m[s], (char *)o->h_m + (size_t)h0 * mb, (size_t)nb * mb, FM_COPY_H2D, FM_STREAM_OPT_COPY_IN);
        ops->copy_async(ctx, o->d_v[s], (char *)o->h_v + (size_t)h0 * mb, (size_t)nb * mb, FM_COPY_H2D, FM_STREAM_OPT_COPY_IN);
        ops->event_record(ctx, ev_in, FM_STREAM_OPT_COPY_IN);
        /* update: one launch per contiguous same-decay run of tensors inside the bucket */
        ops->event_wait(ctx, FM_STREAM_OPS, ev_in); /* the op stream: compute, or update under the overlap */
        update_range(o, m, &ti, t1, b0, b1, b0, o->d_master[s], o->d_m[s], o->d_v[s], lr, grad_scale, bc1, bc2);
        ops->event_record(ctx, ev_up, FM_STREAM_OPS);
        /* copy-out: after the update */
        ops->event_wait(ctx, FM_STREAM_OPT_COPY_OUT, ev_up);
        ops->copy_async(ctx, o->h_master + b0, o->d_master[s], (size_t)nb * sizeof(float), FM_COPY_D2H, FM_STREAM_OPT_COPY_OUT);
        ops->copy_async(ctx, (char *)o->h_m + (size_t)h0 * mb, o->d_m[s], (size_t)nb * mb, FM_COPY_D2H, FM_STREAM_OPT_COPY_OUT);
        ops->copy_async(ctx, (char *)o->h_v + (size_t)h0 * mb, o->d_v[s], (size_t)nb * mb, FM_COPY_D2H, FM_STREAM_OPT_COPY_OUT);
        ops->event_record(ctx, ev_out, FM_STREAM_OPT_COPY_OUT);
        o->used[s] = true;
    }
}

static int offload_state_tensors(void *self, fm_optim_state *out, int cap) {
    fm_offload_adamw *o = self;
    FM_ASSERT(cap >= 3);
    if (o->resident > 0 && !o->pull) { /* the resident master back into the host's view (the caller synced) */
        o->be.ops->copy(o->be.ctx, o->h_master, o->d_res_master, (size_t)o->resident * sizeof(float), FM_COPY_D2H);
        o->pull = true; /* a load may now write the host's: the next step copies it in */
        o->pull_wait = false;
    }
    out[0] = (fm_optim_state){"exp_avg.", o->h_m, o->adam->moments_dtype, true, o->d_res_m, o->resident};
    out[1] = (fm_optim_state){"exp_avg_sq.", o->h_v, o->adam->moments_dtype, true, o->d_res_v, o->resident};
    out[2] = (fm_optim_state){"master.", o->h_master, FM_DTYPE_F32, true, NULL, 0};
    return 3;
}

const fm_optimizer_ops fm_offload_adamw_ops = {"offload-stream-adamw", offload_state_bytes, offload_init,
                                               offload_step_begin, offload_step_range, offload_state_tensors};
