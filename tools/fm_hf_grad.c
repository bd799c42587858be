/* Hugging Face parity helper: loads a model folder (config.json + model.safetensors, written by
 * transformers or by flatmoe), runs one forward and backward on the CPU backend (fp32) over a
 * batch, and writes the loss, the logits and every parameter's gradient (HF names, per expert)
 * to a safetensors file, for tools/hf_parity.py to compare against transformers.
 *
 *   fm_hf_grad MODEL_DIR BATCH.safetensors OUT.safetensors
 *
 * BATCH holds "input_ids" [B,T] as F32 (exact below 2^24). As in transformers' causal-LM loss
 * with labels = input_ids, position t predicts input_ids[t+1]; the last position is ignored.
 * Runs on the build's backend (CPU fp32, or CUDA bf16 in the CUDA build).
 * OUT holds "loss" [1] (mean cross-entropy over B*(T-1) tokens, without router losses),
 * "logits" [B,T,V], "grad.<name>" for every parameter (router loss coefficients are taken
 * from the config; set them to 0 for a pure cross-entropy comparison), and "router_topk.<i>"
 * [B*T, k] for the i-th MoE layer (in model order; dense layers have none): the experts its
 * router chose in the logits' forward, as F32, in the router's order (none when the layers share
 * one saved set, which recompute would do; the inference load keeps each layer's). */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "backend/fm_backend_default.h"
#include "io/fm_safetensors.h"
#include "train/fm_trainer.h"
#include "schedule/fm_schedule.h"

static int die(const char *what) {
    fprintf(stderr, "fm_hf_grad: %s: %s\n", what, fm_errmsg());
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: fm_hf_grad MODEL_DIR BATCH.safetensors OUT.safetensors\n");
        return 2;
    }
    fm_safetensors bst;
    if (fm_st_open(&bst, argv[2])) return die("batch");
    const fm_st_tensor *ids_t = fm_st_find(&bst, "input_ids");
    if (!ids_t || ids_t->ndim != 2) {
        fprintf(stderr, "fm_hf_grad: %s: expected an \"input_ids\" tensor [B,T]\n", argv[2]);
        return 1;
    }
    const int64_t B = ids_t->shape[0], T = ids_t->shape[1];
    float *ids = fm_malloc(sizeof(float) * (size_t)(B * T));
    if (fm_st_read_f32(&bst, "input_ids", ids, 2, ids_t->shape)) return die("batch");
    fm_st_close(&bst);

    fm_backend be;
    char cpath[4200];
    snprintf(cpath, sizeof cpath, "%s/config.json", argv[1]);
    fm_config cfg;
    if (fm_config_load(&cfg, cpath)) return die("config");
    if (fm_backend_default_init(&be, 0, cfg.head_dim)) return die("backend");
    fm_model m;
    fm_param_store ps;
    memset(&ps, 0, sizeof ps);
    if (fm_load_for_inference(&m, &ps, argv[1], be, B, T, NULL)) return die("model");
    fm_batch batch;
    if (fm_batch_alloc(&batch, B, T, true)) return die("batch");
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            batch.tokens[b * T + t] = (int32_t)ids[b * T + t];
            batch.targets[b * T + t] = t + 1 < T ? (int32_t)ids[b * T + t + 1] : -100;
        }
    fm_batch tokens_only = batch;
    tokens_only.targets = NULL;
    /* logits first (forward without targets keeps them), then the training forward/backward */
    const int64_t V = cfg.vocab_size;
    float *logits = fm_malloc(sizeof(float) * (size_t)(B * T * V));
    fm_schedule_default_forward(&m, &tokens_only, NULL);
    for (int64_t r = 0; r < B * T; r++) fm_model_logits_row(&m, r, logits + r * V);
    /* flatmoe's routing of this forward: each MoE layer's top-k experts [B*T, k] as F32, from the
     * layer's saved router state (tools/hf_parity.py counts its flips against transformers fp32) */
    const int64_t Lm = fm_config_num_moe_layers(&cfg), K = cfg.num_experts_per_tok, N = B * T;
    float *routes = Lm > 0 ? fm_malloc(sizeof(float) * (size_t)(Lm * N * K)) : NULL;
    int32_t *ri = Lm > 0 ? fm_malloc(sizeof(int32_t) * (size_t)(N * K)) : NULL;
    bool routes_ok = Lm > 0 && routes && ri;
    for (int64_t l = 0, i = 0; routes_ok && l < cfg.num_hidden_layers; l++) {
        if (!fm_config_layer_is_moe(&cfg, l)) continue;
        const int32_t *idx = m.a.acts[l].router.topk_idx;
        for (int64_t j = 0; j < l && routes_ok; j++) /* a shared (recomputed) saved set holds one layer's */
            if (fm_config_layer_is_moe(&cfg, j) && m.a.acts[j].router.topk_idx == idx) routes_ok = false;
        if (!routes_ok || !idx) break;
        be.ops->copy(be.ctx, ri, idx, sizeof(int32_t) * (size_t)(N * K), FM_COPY_D2H);
        for (int64_t q = 0; q < N * K; q++) routes[i * N * K + q] = (float)ri[q];
        i++;
    }
    be.ops->mem_set(be.ctx, m.p.grads, 0, sizeof(fm_act) * (size_t)m.p.n_params);
    fm_loss l;
    fm_schedule_default_forward(&m, &batch, &l);
    fm_schedule_default_backward(&m, 1.0f);
    float loss = (float)l.ce;

    /* gradients to the host in fp32 (bf16 in the CUDA build: the high half of the fp32 bits) */
    float *grads = fm_malloc(sizeof(float) * (size_t)m.p.n_params);
    if (sizeof(fm_act) == sizeof(float)) {
        be.ops->copy(be.ctx, grads, m.p.grads, sizeof(float) * (size_t)m.p.n_params, FM_COPY_D2H);
    } else {
        uint16_t *h = fm_malloc(sizeof(uint16_t) * (size_t)m.p.n_params);
        be.ops->copy(be.ctx, h, m.p.grads, sizeof(uint16_t) * (size_t)m.p.n_params, FM_COPY_D2H);
        for (int64_t i = 0; i < m.p.n_params; i++) {
            uint32_t u = (uint32_t)h[i] << 16;
            memcpy(&grads[i], &u, 4);
        }
        fm_free(h);
    }
    const int nr = routes_ok ? (int)Lm : 0;
    const int n = m.p.n_tensors + 2 + nr;
    fm_named_tensor *t = fm_malloc(sizeof(fm_named_tensor) * (size_t)n);
    char (*names)[160] = fm_malloc(sizeof(*names) * (size_t)n);
    t[0] = (fm_named_tensor){"loss", &loss, 1, {1}};
    t[1] = (fm_named_tensor){"logits", logits, 3, {B, T, V}};
    for (int i = 0; i < m.p.n_tensors; i++) {
        const fm_param *p = &m.p.table[i];
        snprintf(names[i], sizeof names[i], "grad.%s", p->name);
        t[i + 2] = (fm_named_tensor){names[i], grads + p->offset, p->ndim, {p->shape[0], p->shape[1]}};
    }
    for (int i = 0; i < nr; i++) { /* router_topk.<i>: the i-th MoE layer's */
        snprintf(names[m.p.n_tensors + i], sizeof names[0], "router_topk.%d", i);
        t[m.p.n_tensors + 2 + i] = (fm_named_tensor){names[m.p.n_tensors + i], routes + (int64_t)i * N * K, 2, {N, K}};
    }
    if (fm_st_write(argv[3], t, n, NULL)) return die("output");
    printf("fm_hf_grad: %s: loss %.7f over %lld tokens (aux %.3g, z %.3g), %d gradients, %d layers' routes\n", argv[1],
           l.ce, (long long)l.n_valid, l.aux, l.z, m.p.n_tensors, nr);
    fm_free(routes);
    fm_free(ri);
    fm_free(ids);
    fm_free(logits);
    fm_free(grads);
    fm_free(t);
    fm_free(names);
    fm_model_free(&m);
    fm_param_store_free(&ps);
    fm_backend_default_free(&be);
    fm_batch_free(&batch);
    return 0;
}
