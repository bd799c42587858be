/* Multi-head latent attention (model/fm_mla.h) against a reference computed another way: layer 0's
 * attention block (x_mid = x + o_proj(attention)) of a deepseek_v3 model parsed from config.json
 * text, checked against a direct fp64 transcription of transformers' DeepseekV3Attention
 * (modeling_deepseek_v3.py): q_b_proj(q_a_layernorm(q_a_proj(.))) or q_proj, kv_a_proj_with_mqa
 * split into compressed_kv | k_pe, kv_a_layernorm, kv_b_proj split per head into k_nope | v,
 * apply_rotary_pos_emb_interleave (or apply_rotary_pos_emb) on q_rot and the one k_rot, k_rot
 * broadcast to the heads, softmax(q k^T scaling) with scaling = qk_head_dim^-0.5 mscale^2, the
 * unpadded v (no zero columns here), o_proj. The RoPE frequencies are flatmoe's (fm_rope_inv_freq,
 * tested in test_attn against transformers' formulas); everything else is written here.
 * fp32 against fp64 over sums of <= 16 terms of O(1) values: relative 1e-5 of the output's scale.
 * Also: config parsing (defaults, q_lora_rank null, written back), the parameter table's names and
 * count against fm_config_num_params, the plan's bytes against the layout measured, and packed
 * documents (a document inside a packed row as alone). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "backend/cpu/fm_backend_cpu.h"
#include "fm_test.h"
#include "fm_test_model.h"
#include "model/fm_mla.h"
#include "model/fm_model.h"
#include "model/fm_rope.h"
#include "schedule/fm_schedule.h"

static fm_backend g_be;

static const char *k_cfg =
    "{\"model_type\": \"deepseek_v3\", \"vocab_size\": 32, \"hidden_size\": 16, \"intermediate_size\": 20,"
    " \"moe_intermediate_size\": 8, \"num_hidden_layers\": 2, \"num_attention_heads\": 2,"
    " \"q_lora_rank\": %s, \"kv_lora_rank\": 6, \"qk_nope_head_dim\": 4, \"qk_rope_head_dim\": 4, \"v_head_dim\": 6,"
    " \"n_routed_experts\": 4, \"num_experts_per_tok\": 2, \"n_group\": 2, \"topk_group\": 1,"
    " \"first_k_dense_replace\": 1, \"max_position_embeddings\": 64, \"rope_interleave\": %s,"
    " \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 16,"
    " \"mscale\": 1.0, \"mscale_all_dim\": 0.8}, \"initializer_range\": 0.4}";

/* y [n, out] = x [n, in] W^T, W [out, in] fp32, in fp64. */
static void lin(double *y, const double *x, const float *W, int64_t n, int64_t in, int64_t out) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t o = 0; o < out; o++) {
            double s = 0;
            for (int64_t j = 0; j < in; j++) s += x[i * in + j] * W[o * in + j];
            y[i * out + o] = s;
        }
}

/* RMSNorm of each row of x [n, d] in place, weight w [d]. */
static void rms(double *x, const float *w, int64_t n, int64_t d, double eps) {
    for (int64_t i = 0; i < n; i++) {
        double ss = 0;
        for (int64_t j = 0; j < d; j++) ss += x[i * d + j] * x[i * d + j];
        const double r = 1.0 / sqrt(ss / (double)d + eps);
        for (int64_t j = 0; j < d; j++) x[i * d + j] *= r * w[j];
    }
}

/* transformers' rotary embedding of one dr-vector v at position t (interleaved: the pairs reordered
 * first, as apply_rotary_pos_emb_interleave does), into out. */
static void rope_hf(double *out, const double *v, int64_t dr, int64_t t, const double *inv, double af, bool il) {
    double u[64];
    for (int64_t j = 0; j < dr; j++) u[j] = il ? (j < dr / 2 ? v[2 * j] : v[2 * (j - dr / 2) + 1]) : v[j];
    for (int64_t j = 0; j < dr; j++) {
        const double ang = (double)t * inv[j % (dr / 2)];
        const double rot = j < dr / 2 ? -u[j + dr / 2] : u[j - dr / 2];
        out[j] = u[j] * cos(ang) * af + rot * sin(ang) * af;
    }
}

static void check_layer0(bool q_lora, bool il) {
    char text[2048];
    snprintf(text, sizeof text, k_cfg, q_lora ? "5" : "null", il ? "true" : "false");
    fm_config c;
    CHECK(fm_config_parse(&c, text, "mla.json") == FM_OK);
    CHECK(c.mla && c.head_dim == 8 && c.num_key_value_heads == 2 && c.q_lora_rank == (q_lora ? 5 : 0) &&
          fm_config_rotary_dim(&c) == 4 && c.rope_interleave == il);
    fm_model m;
    CHECK(fm_test_model_create(&m, &c, g_be) == FM_OK);
    const int64_t B = 2, T = 5, N = B * T;
    CHECK(fm_model_layout(&m, B, T, NULL) == FM_OK);
    fm_model_init_weights(&m, 11);
    fm_test_fill_batch(&m, 12, -1);
    fm_loss loss;
    CHECK(fm_schedule_default_forward(&m, fm_test_batch_of(&m), &loss) == FM_OK && isfinite(loss.ce));
    const int64_t H = 16, nh = 2, dn = 4, dr = 4, dv = 6, dq = 8, rkv = 6, rq = 5;
    const fm_layer_ptrs *w = &m.p.w.layers[0];
    const double eps = c.rms_norm_eps;
    static double ln1[10 * 16], qa[10 * 5], q[10 * 16], kva[10 * 10], ckv[10 * 6], kvb[10 * 20], att[10 * 12],
        o[10 * 16];
    for (int64_t i = 0; i < N * H; i++) ln1[i] = m.a.boundary[0][i];
    rms(ln1, w->ln1, N, H, eps);
    if (q_lora) {
        lin(qa, ln1, w->wqa, N, H, rq);
        rms(qa, w->qa_norm, N, rq, eps);
        lin(q, qa, w->wq, N, rq, nh * dq);
    } else {
        lin(q, ln1, w->wq, N, H, nh * dq);
    }
    lin(kva, ln1, w->wkva, N, H, rkv + dr);
    for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < rkv; j++) ckv[i * rkv + j] = kva[i * (rkv + dr) + j];
    rms(ckv, w->kva_norm, N, rkv, eps);
    lin(kvb, ckv, w->wkvb, N, rkv, nh * (dn + dv));
    double inv[32];
    fm_rope_inv_freq(&c, inv);
    const double af = fm_rope_attention_factor(&c);
    const double ms = 0.1 * 0.8 * log(4.0) + 1.0; /* yarn_get_mscale(factor 4, mscale_all_dim 0.8) */
    const double scaling = 1.0 / sqrt((double)dq) * ms * ms;
    CHECK(fabs(fm_mla_softmax_factor(&c) - ms * ms) < 1e-12);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < nh; h++)
            for (int64_t t = 0; t < T; t++) {
                const int64_t n = b * T + t;
                double qr[8], kr[8], sc[8], mx = -1e300, z = 0;
                rope_hf(qr, q + n * nh * dq + h * dq + dn, dr, t, inv, af, il);
                for (int64_t s = 0; s <= t; s++) {
                    const int64_t ns = b * T + s;
                    rope_hf(kr, kva + ns * (rkv + dr) + rkv, dr, s, inv, af, il);
                    double d = 0;
                    for (int64_t j = 0; j < dn; j++) d += q[n * nh * dq + h * dq + j] * kvb[ns * nh * (dn + dv) + h * (dn + dv) + j];
                    for (int64_t j = 0; j < dr; j++) d += qr[j] * kr[j];
                    sc[s] = d * scaling;
                    mx = fmax(mx, sc[s]);
                }
                for (int64_t s = 0; s <= t; s++) z += exp(sc[s] - mx);
                for (int64_t j = 0; j < dv; j++) {
                    double a = 0;
                    for (int64_t s = 0; s <= t; s++)
                        a += exp(sc[s] - mx) / z * kvb[(b * T + s) * nh * (dn + dv) + h * (dn + dv) + dn + j];
                    att[n * nh * dv + h * dv + j] = a;
                }
            }
    lin(o, att, w->wo, N, nh * dv, H);
    double err = 0, scale = 0;
    for (int64_t i = 0; i < N * H; i++) {
        const double ref = m.a.boundary[0][i] + o[i];
        err = fmax(err, fabs(m.a.acts[0].x_mid[i] - ref));
        scale = fmax(scale, fabs(o[i]));
    }
    printf("MLA layer 0 (%s, %s RoPE): max |x_mid - reference| %.3g, output scale %.3g\n",
           q_lora ? "q_lora_rank 5" : "q_proj", il ? "interleaved" : "rotate_half", err, scale);
    CHECK_MSG(scale > 1e-2 && err <= 1e-5 * scale, "MLA x_mid differs from transformers' formulas by %g (scale %g)", err,
              scale);
    /* the parameter table: HF names and count */
    CHECK(fm_params_find(&m.p, "model.layers.1.self_attn.kv_a_proj_with_mqa.weight") != NULL);
    CHECK(fm_params_find(&m.p, "model.layers.0.self_attn.kv_b_proj.weight")->shape[0] == nh * (dn + dv));
    CHECK((fm_params_find(&m.p, "model.layers.0.self_attn.q_a_proj.weight") != NULL) == q_lora);
    CHECK((fm_params_find(&m.p, "model.layers.0.self_attn.q_proj.weight") != NULL) == !q_lora);
    CHECK(fm_params_find(&m.p, "model.layers.0.self_attn.k_proj.weight") == NULL);
    CHECK(fm_params_find(&m.p, "model.layers.0.self_attn.o_proj.weight")->shape[1] == nh * dv);
    CHECK(m.p.n_params == fm_config_num_params(&c));
    /* the plan's bytes are the layout's (recompute of both layers too: the shared set) */
    for (int rc = 0; rc < 2; rc++) {
        bool rec[2] = {true, true};
        fm_layout_opts lo = {0};
        lo.recompute = rc ? rec : NULL;
        size_t bytes[FM_LIVE_COUNT];
        fm_model_plan_bytes(&c, B, T, &lo, bytes);
        const size_t acts = fm_model_layer_acts_bytes(&c, B, T, sizeof(float)) +
                            (rc ? 0 : fm_model_dense_layer_acts_bytes(&c, B, T, sizeof(float)));
        CHECK_MSG(bytes[FM_LIVE_LAYER_ACTS] == acts, "layer activations: layout %zu, formula %zu", bytes[FM_LIVE_LAYER_ACTS],
                  acts);
        CHECK_MSG(bytes[FM_LIVE_WORKING_SET] == fm_model_working_set_bytes(&c, N, sizeof(float)) +
                                                    fm_attn_sp_bytes(&(fm_attn_sp_dims){B, T, nh, nh, dq, 1}, sizeof(float)),
                  "working set: layout %zu, formula %zu", bytes[FM_LIVE_WORKING_SET],
                  fm_model_working_set_bytes(&c, N, sizeof(float)));
    }
    /* written back: the canonical form parses to the same config */
    char *js = fm_config_to_json(&c);
    fm_config c2;
    CHECK(js && fm_config_parse(&c2, js, "canonical") == FM_OK && c2.mla && c2.q_lora_rank == c.q_lora_rank &&
          c2.head_dim == c.head_dim && c2.rope_interleave == il && c2.first_k_dense_replace == 1 &&
          fm_config_num_params(&c2) == fm_config_num_params(&c));
    CHECK(js && !strstr(js, "\"head_dim\"")); /* transformers' head_dim is qk_rope_head_dim: never written */
    fm_free(js);
    fm_test_model_free(&m);
}

/* Packed documents (model/fm_batch.h): a row holding document A (4 tokens) then document B (6)
 * gives, on B's tokens, the layer-0 output of B alone (RoPE positions restart, attention stays
 * inside the document: q_pe's and the one k_pe's rotations and the kv_start mask through MLA's
 * assembly). Different GEMM row counts may block the sums differently: 1e-5 of the scale. */
static void test_packed(void) {
    char text[2048];
    snprintf(text, sizeof text, k_cfg, "5", "true");
    fm_config c;
    CHECK(fm_config_parse(&c, text, "mla.json") == FM_OK);
    fm_model m;
    CHECK(fm_test_model_create(&m, &c, g_be) == FM_OK);
    CHECK(fm_model_layout(&m, 1, 10, NULL) == FM_OK);
    fm_model_init_weights(&m, 21);
    fm_test_fill_batch(&m, 22, -1);
    fm_batch *b = fm_test_batch_of(&m);
    int32_t pos[10] = {0, 1, 2, 3, 0, 1, 2, 3, 4, 5}, start[10] = {0, 0, 0, 0, 4, 4, 4, 4, 4, 4};
    int32_t tok[6];
    memcpy(tok, b->tokens + 4, sizeof tok);
    b->pos = pos;
    b->doc_start = start;
    fm_loss loss;
    CHECK(fm_schedule_default_forward(&m, b, &loss) == FM_OK);
    const int64_t H = c.hidden_size;
    float packed[6 * 16];
    memcpy(packed, m.a.acts[0].x_mid + 4 * H, sizeof packed);
    b->pos = b->doc_start = NULL;
    fm_model_set_shape(&m, 1, 6);
    b = fm_test_batch_of(&m);
    fm_test_fill_batch(&m, 23, -1);
    memcpy(b->tokens, tok, sizeof tok);
    CHECK(fm_schedule_default_forward(&m, b, &loss) == FM_OK);
    double err = 0, scale = 0;
    for (int64_t i = 0; i < 6 * H; i++) {
        err = fmax(err, fabs(packed[i] - m.a.acts[0].x_mid[i]));
        scale = fmax(scale, fabs(m.a.acts[0].x_mid[i]));
    }
    printf("MLA packed: document B's layer-0 output within %.3g of B alone (scale %.3g)\n", err, scale);
    CHECK_MSG(scale > 1e-2 && err <= 1e-5 * scale, "MLA packed: %g (scale %g)", err, scale);
    fm_test_model_free(&m);
}

/* DeepseekV3Config's defaults (DeepSeek-V3 671B) from a file with only model_type, and what is refused. */
static void test_defaults_and_refusals(void) {
    fm_config c;
    CHECK(fm_config_parse(&c, "{\"model_type\": \"deepseek_v3\"}", "d.json") == FM_OK);
    CHECK(c.vocab_size == 129280 && c.hidden_size == 7168 && c.num_hidden_layers == 61 && c.num_attention_heads == 128 &&
          c.q_lora_rank == 1536 && c.kv_lora_rank == 512 && c.qk_nope_head_dim == 128 && c.qk_rope_head_dim == 64 &&
          c.v_head_dim == 128 && c.head_dim == 192 && c.num_experts == 256 && c.num_experts_per_tok == 8 &&
          c.n_group == 8 && c.topk_group == 4 && c.first_k_dense_replace == 3 && c.routed_scaling_factor == 2.5 &&
          c.n_shared_experts == 1 && c.norm_topk_prob && c.rope_interleave && c.dense_intermediate_size == 18432 &&
          c.moe_intermediate_size == 2048 && c.rms_norm_eps == 1e-6 && c.max_position_embeddings == 4096);
    const char *bad[] = {
        "{\"model_type\": \"deepseek_v3\", \"attention_bias\": true}",
        "{\"model_type\": \"deepseek_v3\", \"qk_rope_head_dim\": 63}",
        "{\"model_type\": \"deepseek_v3\", \"v_head_dim\": 256}",
        "{\"model_type\": \"deepseek_v3\", \"head_dim\": 192}",
        "{\"model_type\": \"deepseek_v3\", \"kv_lora_rank\": 0}",
        "{\"model_type\": \"deepseek_v3\", \"q_lora_rank\": \"x\"}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fm_status s = fm_config_parse(&c, bad[i], "bad.json");
        CHECK_MSG(s != FM_OK, "accepted %s", bad[i]);
        printf("refused: %s\n", fm_errmsg());
    }
}

int main(void) {
    CHECK(fm_cpu_backend_init(&g_be, fm_test_threads(2), 64) == FM_OK);
    test_defaults_and_refusals();
    check_layer0(true, true);
    check_layer0(false, false);
    check_layer0(true, false);
    test_packed();
    fm_cpu_backend_free(&g_be);
    return fm_test_finish();
}
