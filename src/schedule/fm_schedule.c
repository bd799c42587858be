/* The layer schedule (fm_schedule.h). */
#include "fm_schedule.h"

const char *fm_hook_point_name(fm_hook_point p) {
    static const char *const names[FM_HOOK_COUNT] = {"before_forward", "after_forward", "before_backward",
                                                     "after_backward",  "before_embed",  "before_head",
                                                     "after_head_backward", "before_embed_backward",
                                                     "after_embed_backward"};
    return p >= 0 && p < FM_HOOK_COUNT ? names[p] : "?";
}

void fm_schedule_init(fm_schedule *s, const fm_model *m) {
    memset(s, 0, sizeof *s);
    s->recompute.layers = m->a.recompute;
    s->recompute.L = m->cfg.num_hidden_layers;
    s->recompute.keep_attention = m->a.keep_attention;
}

fm_status fm_schedule_add_hook(fm_schedule *s, fm_hook_fn fn, void *user) {
    if (!fn) return fm_error(FM_ERR_ARG, "fm_schedule_add_hook: the hook function is NULL");
    if (s->n_hooks >= FM_SCHEDULE_MAX_HOOKS)
        return fm_error(FM_ERR_ARG, "fm_schedule_add_hook: the schedule already has %d hooks (the most it holds)",
                        FM_SCHEDULE_MAX_HOOKS);
    s->hooks[s->n_hooks].fn = fn;
    s->hooks[s->n_hooks].user = user;
    s->hooks[s->n_hooks].groups = false;
    s->n_hooks++;
    return FM_OK;
}

fm_status fm_schedule_add_group_hook(fm_schedule *s, fm_hook_fn fn, void *user) {
    FM_TRY(fm_schedule_add_hook(s, fn, user));
    s->hooks[s->n_hooks - 1].groups = true;
    return FM_OK;
}

static fm_status run_hooks(fm_schedule *s, fm_model *m, fm_hook_point p, int64_t l) {
    const bool group_point = p >= FM_HOOK_BEFORE_EMBED;
    for (int i = 0; i < s->n_hooks; i++)
        if (!group_point || s->hooks[i].groups) FM_TRY(s->hooks[i].fn(s->hooks[i].user, m, p, l));
    return FM_OK;
}

/* Embedding and the layers' forwards (their router loss terms land in m->a.results). */
/* The optimizer overlap's wait for parameter group g (0: embedding, 1 + l: layer l, L + 1: head). */
static void wait_params(const fm_schedule *s, fm_model *m, int64_t g) {
    if (s->param_ready) m->be.ops->event_wait(m->be.ctx, FM_STREAM_COMPUTE, s->param_event0 + (int)g);
}

static fm_status forward_layers(fm_schedule *s, fm_model *m, const fm_batch *b) {
    const int64_t L = m->cfg.num_hidden_layers;
    wait_params(s, m, 0);
    FM_TRY(run_hooks(s, m, FM_HOOK_BEFORE_EMBED, -1));
    FM_TRY(fm_model_embed_forward(m, b));
    for (int64_t l = 0; l < L; l++) {
        wait_params(s, m, 1 + l);
        FM_TRY(run_hooks(s, m, FM_HOOK_BEFORE_FORWARD, l));
        FM_TRY(fm_model_layer_forward(m, l, fm_model_boundary(m, l + 1)));
        FM_TRY(run_hooks(s, m, FM_HOOK_AFTER_FORWARD, l));
    }
    return FM_OK;
}

/* Offloaded boundaries share rotating slots: backward reads them only if a policy restores them. */
static fm_status check_restores(const fm_schedule *s, const fm_model *m) {
    if (m->a.n_offloaded_boundaries > s->restores_boundaries)
        return fm_error(FM_ERR_ARG, "backward: the layout offloads %lld boundaries but the schedule's hooks restore "
                        "%lld; attach the offload policy (fm_sco_attach)", (long long)m->a.n_offloaded_boundaries,
                        (long long)s->restores_boundaries);
    return FM_OK;
}

/* From the gradient of boundary L in grad buffer 0: the layers' backwards (recomputing what the
 * policy says) and the embedding's. */
static fm_status backward_layers(fm_schedule *s, fm_model *m, float scale) {
    const int64_t L = m->cfg.num_hidden_layers;
    fm_act *dy = fm_model_grad_buffer(m, 0), *dx = fm_model_grad_buffer(m, 1);
    for (int64_t l = L - 1; l >= 0; l--) {
        FM_TRY(run_hooks(s, m, FM_HOOK_BEFORE_BACKWARD, l));
        /* Re-run the forward from the saved boundary into the shared set; the output goes to dx,
         * free until layer_backward assigns it, so boundary l+1 stays as it was. A keep-attention
         * layer's recompute skips the attention forward: its att and lse were kept. */
        if (fm_recompute_layer(&s->recompute, l))
            FM_TRY(fm_model_layer_recompute(m, l, dx, fm_recompute_keeps_attention(&s->recompute, l)));
        FM_TRY(fm_model_layer_backward(m, l, dy, dx, scale));
        fm_act *t = dy;
        dy = dx;
        dx = t;
        FM_TRY(run_hooks(s, m, FM_HOOK_AFTER_BACKWARD, l));
    }
    FM_TRY(run_hooks(s, m, FM_HOOK_BEFORE_EMBED_BACKWARD, -1));
    FM_TRY(fm_model_embed_backward(m, dy));
    return run_hooks(s, m, FM_HOOK_AFTER_EMBED_BACKWARD, -1);
}

fm_status fm_schedule_forward(fm_schedule *s, fm_model *m, const fm_batch *b, fm_loss *out) {
    fm_loss r;
    FM_TRY(forward_layers(s, m, b));
    wait_params(s, m, m->cfg.num_hidden_layers + 1);
    FM_TRY(run_hooks(s, m, FM_HOOK_BEFORE_HEAD, m->cfg.num_hidden_layers));
    FM_TRY(fm_model_head_forward(m, b, &r));
    if (out) fm_model_read_loss(m, out);
    return FM_OK;
}

fm_status fm_schedule_backward(fm_schedule *s, fm_model *m, float scale) {
    FM_TRY(check_restores(s, m));
    FM_TRY(fm_model_head_backward(m, scale));
    FM_TRY(run_hooks(s, m, FM_HOOK_AFTER_HEAD_BACKWARD, m->cfg.num_hidden_layers));
    return backward_layers(s, m, scale);
}

fm_status fm_schedule_train_step(fm_schedule *s, fm_model *m, const fm_batch *b, float scale, fm_loss *out) {
    fm_loss r;
    FM_TRY(check_restores(s, m));
    if (!b->targets) return fm_error(FM_ERR_ARG, "training step: the batch has no targets (fm_batch.targets NULL)");
    FM_TRY(forward_layers(s, m, b));
    wait_params(s, m, m->cfg.num_hidden_layers + 1);
    FM_TRY(run_hooks(s, m, FM_HOOK_BEFORE_HEAD, m->cfg.num_hidden_layers));
    FM_TRY(fm_model_head_train(m, b, scale, &r));
    FM_TRY(run_hooks(s, m, FM_HOOK_AFTER_HEAD_BACKWARD, m->cfg.num_hidden_layers));
    FM_TRY(backward_layers(s, m, scale));
    if (out) fm_model_read_loss(m, out);
    return FM_OK;
}

fm_status fm_schedule_default_forward(fm_model *m, const fm_batch *b, fm_loss *out) {
    fm_schedule s;
    fm_schedule_init(&s, m);
    return fm_schedule_forward(&s, m, b, out);
}

fm_status fm_schedule_default_backward(fm_model *m, float scale) {
    fm_schedule s;
    fm_schedule_init(&s, m);
    return fm_schedule_backward(&s, m, scale);
}

fm_status fm_schedule_default_train_step(fm_model *m, const fm_batch *b, float scale, fm_loss *out) {
    fm_schedule s;
    fm_schedule_init(&s, m);
    return fm_schedule_train_step(&s, m, b, scale, out);
}
