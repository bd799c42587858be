/* The mesh planner (plan/fm_mesh.h, fm_mesh_bound.h): the degrees' checks and their messages;
 * a mesh rank's live sets against hand arithmetic from the config (ZeRO-3 shard, experts / ep,
 * gathered slots, the local sequence, Ulysses' buffers, NCCL groups) and against the bounded
 * operators' own bound functions; the collectives' projected time by hand at synthetic links;
 * the chooser's picks checked against properties computed here (ep divides E and the world, the
 * plan fits, no smaller ep fits at the largest sp, no smaller sp fits at the chosen ep, the
 * choice has the most tokens/s of the candidates that fit); the calibration table's optional
 * mesh links (old files load with the nominal figures). */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "fm_test.h"
#include "model/fm_attn_sp.h"
#include "bounded/fm_linear_ce.h"
#include "bounded/fm_linear_ce_ring.h"
#include "bounded/fm_moe_ep.h"
#include "plan/fm_choose.h"
#include "plan/fm_mesh.h"
#include "plan/fm_plan.h"
#include "plan/fm_project.h"
#include "train/fm_offload_adamw.h"
#include "train/fm_optim.h"

static void base_req(fm_plan_req *req, const char *cfg, int64_t T, fm_plan_target tgt) {
    memset(req, 0, sizeof *req);
    req->model_state_bytes = fm_model_state_bound;
    req->offload_state_bytes = fm_offload_model_state_bound;
    req->offload_bucket = FM_OFFLOAD_DEFAULT_BUCKET;
    req->offload_slots = 2;
    CHECK(fm_config_load(&req->cfg, cfg) == FM_OK);
    req->B = 1;
    req->T = T;
    req->grad_accum = 1;
    req->threads = 1;
    req->target = tgt;
}

static fm_mesh_dims dims(int64_t dp, int64_t ep, int64_t sp) {
    fm_mesh_dims m = {true, dp, ep, sp, 8};
    return m;
}

static bool has(const char *msg, const char *a, const char *b, const char *c) {
    return strstr(msg, a) && strstr(msg, b) && strstr(msg, c);
}

static void test_checks(void) {
    fm_config qwen, mix;
    CHECK(fm_config_load(&qwen, "configs/qwen3-30b-a3b.json") == FM_OK); /* E 128, 32 heads, 4 kv heads */
    CHECK(fm_config_load(&mix, "configs/mixtral-8x7b.json") == FM_OK);   /* E 8, 32 heads, 8 kv heads */
    fm_mesh_dims m = dims(8, 8, 1);
    CHECK(fm_mesh_check(&qwen, 4096, &m) == FM_OK);
    m = dims(4, 3, 2); /* 3 does not divide 128 */
    CHECK(fm_mesh_check(&qwen, 4096, &m) == FM_ERR_ARG);
    CHECK_MSG(has(fm_errmsg(), "--ep 3", "num_experts (128", "use one of 1, 2, 4, 8"), "%s", fm_errmsg());
    m = dims(2, 8, 2); /* ep 8 does not divide the world 4 */
    CHECK(fm_mesh_check(&qwen, 4096, &m) == FM_ERR_ARG);
    CHECK_MSG(has(fm_errmsg(), "--ep 8", "dp x sp = 2 x 2 = 4", "use one of"), "%s", fm_errmsg());
    m = dims(1, 1, 3); /* 3 does not divide 32 heads */
    CHECK(fm_mesh_check(&qwen, 4095, &m) == FM_ERR_ARG);
    CHECK_MSG(has(fm_errmsg(), "--sp 3", "num_attention_heads (32", "use one of"), "%s", fm_errmsg());
    m = dims(1, 1, 16); /* 16 divides 32 heads; 4 kv heads divide 16: replicated, fine */
    CHECK(fm_mesh_check(&qwen, 4096, &m) == FM_OK);
    CHECK(fm_mesh_kv_heads(&qwen, 16) == 1 && fm_mesh_kv_heads(&qwen, 2) == 2 && fm_mesh_kv_heads(&qwen, 1) == 4);
    m = dims(1, 1, 4);
    CHECK(fm_mesh_check(&mix, 4098, &m) == FM_ERR_ARG); /* 4098 % 4 */
    CHECK_MSG(has(fm_errmsg(), "--seq-len 4098", "--sp 4", "use --seq-len 4096"), "%s", fm_errmsg());
    m = dims(0, 1, 1);
    CHECK(fm_mesh_check(&mix, 4096, &m) == FM_ERR_ARG);
    /* flags */
    bool ce, cs;
    fm_mesh_flags f = {8, 4, 0, 4, 0}; /* dp 4 x sp 4 = 16 != 8 */
    CHECK(fm_mesh_from_flags(&mix, 4096, &f, &m, &ce, &cs) == FM_ERR_ARG);
    CHECK_MSG(has(fm_errmsg(), "--dp 4 x --sp 4 = 16", "--world is 8", "give --sp 2"), "%s", fm_errmsg());
    f = (fm_mesh_flags){8, 3, 0, 0, 0};
    CHECK(fm_mesh_from_flags(&mix, 4096, &f, &m, &ce, &cs) == FM_ERR_ARG);
    CHECK_MSG(has(fm_errmsg(), "--dp 3", "divisor of --world 8", "found 8 % 3 = 2"), "%s", fm_errmsg());
    f = (fm_mesh_flags){8, 2, 0, 0, 4};
    CHECK(fm_mesh_from_flags(&mix, 4096, &f, &m, &ce, &cs) == FM_OK);
    CHECK(m.on && m.dp == 2 && m.sp == 4 && m.ep == 1 && ce && !cs && m.gpus_per_node == 4);
    f = (fm_mesh_flags){8, 0, 0, 0, 0};
    CHECK(fm_mesh_from_flags(&mix, 4096, &f, &m, &ce, &cs) == FM_OK);
    CHECK(ce && cs && m.dp * m.sp == 8 && m.gpus_per_node == 8);
    f = (fm_mesh_flags){0, 2, 2, 2, 0}; /* no world: dp x sp */
    CHECK(fm_mesh_from_flags(&mix, 4096, &f, &m, &ce, &cs) == FM_OK);
    CHECK(!ce && !cs && m.dp == 2 && m.sp == 2 && m.ep == 2);
    f = (fm_mesh_flags){0, 1, 16, 1, 0}; /* ep 16 > the 8 experts */
    CHECK(fm_mesh_from_flags(&mix, 4096, &f, &m, &ce, &cs) == FM_ERR_ARG);
}

static size_t rnd(double b) { return fm_arena_round((size_t)b); }

/* OLMoE (L 16, H 2048, I 1024, E 64, k 8, V 50304, 16 heads of 128) as one rank of dp 4 x sp 2
 * with ep 4 on the CUDA target (a = 2), T = 8192, MoE chunks of 1024. */
static void test_rank_bounds(void) {
    fm_plan_req req;
    base_req(&req, "configs/olmoe-1b-7b.json", 8192, FM_PLAN_TARGET_CUDA);
    req.moe_chunk_tokens = 1024;
    req.ce_block_tokens = FM_LCE_DEFAULT_BLOCK_TOKENS;
    req.ce_block_vocab = FM_LCE_DEFAULT_BLOCK_VOCAB;
    req.mesh = dims(4, 4, 2);
    fm_plan p;
    fm_plan_compute(&req, &p);
    const double L = 16, H = 2048, I = 1024, E = 64, V = 50304, a = 2, W = 8;
    const double n = (double)fm_config_num_params(&req.cfg), n_exp = L * E * 3 * H * I;
    CHECK((double)fm_mesh_expert_params(&req.cfg) == n_exp);
    const double layer_ne = (n - n_exp - 2 * V * H - H) / L;
    const double U = fmax(layer_ne, V * H);
    CHECK((double)fm_mesh_gather_unit(&req.cfg) == U);
    const double held = ceil((n - n_exp) / W) + n_exp / 4;
    CHECK((double)p.n_params_rank == held);
    CHECK_MSG(p.bytes[FM_LIVE_MODEL_STATE] == rnd(16 * held) + 3 * rnd(U * a), "model state %zu vs %zu",
              p.bytes[FM_LIVE_MODEL_STATE], rnd(16 * held) + 3 * rnd(U * a));
    /* sequence-shaped sets: those of one rank holding T / sp = 4096 tokens */
    fm_plan_req one = req;
    memset(&one.mesh, 0, sizeof one.mesh);
    one.T = 4096;
    fm_plan q;
    fm_plan_compute(&one, &q);
    /* boundaries: the one-rank set of 4096 tokens, but the packed documents' starts [B, 8192] and
     * the RoPE tables [8192, head_dim / 2] of cos and sin cover the whole rows (fm_batch.h) */
    const double B = (double)req.B, hd2 = 64;
    CHECK_MSG(p.bytes[FM_LIVE_BOUNDARIES] == q.bytes[FM_LIVE_BOUNDARIES] + (rnd(4 * B * 8192) - rnd(4 * B * 4096)) +
                                                 2 * (rnd(4 * 8192 * hd2) - rnd(4 * 4096 * hd2)),
              "boundaries %zu vs one rank's %zu", p.bytes[FM_LIVE_BOUNDARIES], q.bytes[FM_LIVE_BOUNDARIES]);
    CHECK(p.bytes[FM_LIVE_LAYER_ACTS] == q.bytes[FM_LIVE_LAYER_ACTS]);
    CHECK(p.bytes[FM_LIVE_WORKING_SET] == q.bytes[FM_LIVE_WORKING_SET]);
    /* expert dispatch: the EP operator's bound, R_max = ep c min(k, E/ep) = 4 x 1024 x 8 */
    const fm_moe_dims md = {2048, 1024, 64, 8};
    fm_moe_ep_bound b;
    CHECK(p.bytes[FM_LIVE_EXPERT] == fm_moe_ep_bound_bytes(&md, 4, 1024, 2, NULL, &b));
    CHECK(b.rows_max == 4 * 1024 * 8);
    CHECK(p.moe_K == 4);
    /* vocabulary: the ring's bound over P = 8 for 4096 tokens + final norm and two vectors */
    fm_lce_opts lo = fm_lce_opts_default();
    lo.block_tokens = FM_LCE_DEFAULT_BLOCK_TOKENS;
    lo.block_vocab = FM_LCE_DEFAULT_BLOCK_VOCAB;
    CHECK(p.bytes[FM_LIVE_VOCAB] == fm_linear_ce_ring_bound_bytes_a(FM_LCE_RING_AUTO, 4096, 2048, 50304, 8, true, true, &lo, 2) +
                                        rnd(4096 * H * a) + 2 * rnd(4096 * 4.0));
    /* communication: the trainer's Ulysses buffers (fm_attn_sp_bytes: 4 head-sharded [T, 8 x 128]
     * + 4 [T, 8 x 128] (16 kv heads / 2) + the send and receive blocks [4096, 2048] + its index
     * tables) + the reduce-scatter's shard + 4 groups (world, ep 4, sp 2, expert replicas 2) */
    const double qd_loc = 8 * 128, kd_loc = 8 * 128;
    const fm_attn_sp_dims sd = {1, 4096, 16, 16, 128, 2};
    const size_t sp_bytes = fm_attn_sp_bytes(&sd, 2);
    CHECK(sp_bytes >= 4 * rnd(8192 * qd_loc * a) + 4 * rnd(8192 * kd_loc * a) + 2 * rnd(4096 * 2048 * a));
    const size_t comm = sp_bytes + rnd(ceil(U / W) * a) + 4 * FM_MESH_NCCL_GROUP_BYTES;
    CHECK_MSG(p.comm_bytes == comm, "comm %zu vs %zu", p.comm_bytes, comm);
    size_t sum = p.comm_bytes;
    for (int i = 0; i < FM_PLAN_SETS; i++) sum += p.bytes[i];
    CHECK(p.total == sum);
    CHECK(p.tokens_per_step == 8192 * 4); /* dp 4 sequences; sp ranks share theirs */
    /* the offloaded optimizer: device 2a per param + 2 slots of staging, host 12 B per param */
    req.offload_optimizer = true;
    fm_plan po;
    fm_plan_compute(&req, &po);
    const double beta = fmin((double)FM_OFFLOAD_DEFAULT_BUCKET, held);
    CHECK(po.bytes[FM_LIVE_MODEL_STATE] == rnd(held * 2 * a) + 2 * rnd(beta * 12) + 3 * rnd(U * a));
    CHECK(po.host_optimizer_bytes == rnd(held * 12));
    CHECK(po.host_bytes >= po.host_optimizer_bytes);
    /* ep = 1: every rank holds all experts; no EP groups */
    req.offload_optimizer = false;
    req.mesh = dims(8, 1, 1);
    fm_plan_compute(&req, &p);
    CHECK((double)p.n_params_rank == ceil((n - n_exp) / W) + n_exp);
    CHECK(p.comm_bytes == rnd(ceil(U / W) * a) + FM_MESH_NCCL_GROUP_BYTES); /* the world's group only: the experts'
                                                                               grads are all-reduced over it */
}

static void synth(fm_calib *c, double flops, double bw, double intra, double inter) {
    memset(c, 0, sizeof *c);
    snprintf(c->backend, sizeof c->backend, "cuda");
    c->act_bytes = 2;
    c->peak_flops = flops;
    fm_calib_curve *cv[5] = {&c->gemm, &c->expert_fwd, &c->expert_bwd, &c->att_fwd, &c->att_bwd};
    for (int i = 0; i < 5; i++) fm_calib_add(cv[i], 1024, flops);
    c->elementwise_bw = c->dispatch_bw = c->adamw_bw = c->h2d = c->d2h = c->h2d_duplex = c->d2h_duplex = bw;
    c->intra_node_bw = intra;
    c->inter_node_bw = inter;
}

static void test_projection(void) {
    fm_calib c;
    /* compute ~free (1e30 FLOP/s and B/s): every collective is exposed */
    synth(&c, 1e30, 1e30, 1e11, 1e10);
    /* the link helpers */
    CHECK_CLOSE(fm_mesh_ring_s(8e9, 8, 8, 8, &c), 8e9 * 7 / 8 / 1e11, 1e-12);
    CHECK_CLOSE(fm_mesh_ring_s(8e9, 8, 16, 8, &c), 8e9 * 7 / 8 / 1e10, 1e-12);
    CHECK(fm_mesh_ring_s(8e9, 1, 1, 8, &c) == 0);
    CHECK_CLOSE(fm_mesh_all_to_all_s(8e9, 8, 8, 8, &c), 7 * 1e9 / 1e11, 1e-12);
    /* 16 ranks over 2 nodes: 7 peers on the node, 8 off it */
    CHECK_CLOSE(fm_mesh_all_to_all_s(16e9, 16, 16, 8, &c), fmax(7 * 1e9 / 1e11, 8 * 1e9 / 1e10), 1e-12);

    fm_plan_req req;
    base_req(&req, "configs/olmoe-1b-7b.json", 8192, FM_PLAN_TARGET_CUDA);
    req.moe_chunk_tokens = 8192; /* one chunk per rank: EP hides nothing */
    req.ce_block_tokens = FM_LCE_DEFAULT_BLOCK_TOKENS;
    req.ce_block_vocab = FM_LCE_DEFAULT_BLOCK_VOCAB;
    req.mesh = dims(4, 2, 2);
    fm_plan p;
    fm_projection pr;
    fm_plan_compute(&req, &p);
    fm_project(&req, &p, &c, &pr);
    const double L = 16, H = 2048, V = 50304, a = 2, N = 4096, qd = 2048, kd = 2048, W = 8;
    CHECK(p.moe_K == 1);
    /* SP: 6 (qd + kd) N a bytes per layer, all-to-all over 2 ranks of a node */
    CHECK_CLOSE(pr.sec[FM_PROJ_SP], L * (6 * (qd + kd) * N * a / 2) / 1e11, 1e-9);
    /* EP: 6 all-to-alls of N k H a per layer over 2 ranks, not hidden (K = 1) */
    CHECK_CLOSE(pr.sec[FM_PROJ_EP], L * 6 * (N * 8 * H * a / 2) / 1e11, 1e-9);
    /* ZeRO-3: per layer gather (fwd) + gather and reduce-scatter (bwd), + the first gather, + the
     * embedding's gather and reduce-scatter, + the experts' all-reduce over W / ep = 4 replicas
     * (strided: span 8 <= 8, NVLink) */
    const double n = (double)fm_config_num_params(&req.cfg), n_exp = (double)fm_mesh_expert_params(&req.cfg);
    const double lp = (n - n_exp - 2 * V * H - H) / L;
    const double tg = lp * a * 7 / 8 / 1e11, te = V * H * a * 7 / 8 / 1e11, ar = 2 * (n_exp / 2 * a) * 3 / 4 / 1e11;
    CHECK_CLOSE(pr.sec[FM_PROJ_ZERO3], L * 3 * tg + tg + 2 * te + ar, 1e-9);
    /* ring: activations (4096 <= 50304 / 8): P - 1 hops of N (H a + 16) + N (2 H a + 16), + one */
    const double msg = N * (H * a + 16) + N * (2 * H * a + 16);
    CHECK_CLOSE(pr.sec[FM_PROJ_RING], 7 * msg / 1e11 + msg / 1e11, 1e-9);
    double sum = 0;
    for (int i = 0; i < FM_PROJ_PHASES; i++) sum += pr.sec[i];
    CHECK_CLOSE(pr.step_s, sum, 1e-12);
    /* MFU against the world's peak */
    CHECK_CLOSE(pr.mfu, p.flops_model_token * (double)p.tokens_per_step / pr.step_s / 1e30 / W, 1e-9);
    /* 4 GPUs per node: the world's rings cross nodes (ZeRO-3 at the slower link); ep and sp groups
     * of 2 stay on a node */
    req.mesh.gpus_per_node = 4;
    fm_projection p4;
    fm_project(&req, &p, &c, &p4);
    CHECK(p4.sec[FM_PROJ_ZERO3] > 9 * pr.sec[FM_PROJ_ZERO3]);
    CHECK_CLOSE(p4.sec[FM_PROJ_SP], pr.sec[FM_PROJ_SP], 1e-12);
    CHECK_CLOSE(p4.sec[FM_PROJ_EP], pr.sec[FM_PROJ_EP], 1e-12);
    /* slow compute hides ZeRO-3 and the ring; SP is never hidden */
    synth(&c, 1e9, 1e9, 1e11, 1e10);
    req.mesh.gpus_per_node = 8;
    fm_project(&req, &p, &c, &pr);
    CHECK(pr.sec[FM_PROJ_SP] > 0);
    CHECK_CLOSE(pr.sec[FM_PROJ_ZERO3], tg + 2 * te, 1e-9);
    /* one rank: no collective phases */
    memset(&req.mesh, 0, sizeof req.mesh);
    fm_plan_compute(&req, &p);
    fm_project(&req, &p, &c, &pr);
    CHECK(pr.sec[FM_PROJ_ZERO3] == 0 && pr.sec[FM_PROJ_EP] == 0 && pr.sec[FM_PROJ_SP] == 0 && pr.sec[FM_PROJ_RING] == 0);
    CHECK(p.comm_bytes == 0 && p.n_params_rank == 0);
}

/* Does the mesh m fit (the single-rank chooser with every knob free)? */
static bool fits_at(const fm_plan_req *base, const fm_choose_opts *o, fm_mesh_dims m) {
    fm_plan_req r = *base;
    r.mesh = m;
    const int64_t L = r.cfg.num_hidden_layers;
    bool rc[2 * L];
    memset(rc, 0, sizeof rc);
    r.recompute = rc;
    r.keep_attention = rc + L;
    fm_plan p;
    fm_projection pr;
    return fm_plan_fit(&r, o, rc, &p, &pr) == FM_OK && p.total <= o->budget;
}

static bool sp_valid(const fm_config *c, int64_t sp, int64_t T, int64_t W) {
    return W % sp == 0 && c->num_attention_heads % sp == 0 && T % sp == 0 &&
           (c->num_key_value_heads % sp == 0 || sp % c->num_key_value_heads == 0);
}

static void check_choice(const char *cfg, int64_t T, int64_t world, double budget_gib) {
    fm_plan_req req;
    base_req(&req, cfg, T, FM_PLAN_TARGET_CUDA);
    req.ce_block_tokens = FM_LCE_DEFAULT_BLOCK_TOKENS;
    req.ce_block_vocab = FM_LCE_DEFAULT_BLOCK_VOCAB;
    fm_calib cal;
    fm_calib_default(&cal, "cuda");
    const fm_choose_opts o = {(size_t)(budget_gib * 1073741824.0), "--mem-budget", (size_t)14 << 30, "host", &cal,
                              false, false, false, false, false, true};
    const fm_mesh_flags f = {world, 0, 0, 0, 8};
    bool ce, cs;
    CHECK(fm_mesh_from_flags(&req.cfg, T, &f, &req.mesh, &ce, &cs) == FM_OK);
    const fm_plan_req base = req;
    const int64_t L = req.cfg.num_hidden_layers, E = req.cfg.num_experts;
    bool rc[2 * L];
    memset(rc, 0, sizeof rc);
    req.recompute = rc;
    req.keep_attention = rc + L;
    fm_mesh_choice *ch = fm_malloc(sizeof *ch);
    const fm_status s = fm_mesh_choose(&req, &o, rc, ce, cs, ch);
    CHECK_MSG(s == FM_OK, "%s T=%lld world %lld: %s", cfg, (long long)T, (long long)world, fm_errmsg());
    if (s) {
        fm_free(ch);
        return;
    }
    CHECK(ch->best >= 0 && ch->best < ch->n && ch->n >= 1);
    const fm_mesh_cand *b = &ch->cand[ch->best];
    CHECK(b->fits && b->plan.total <= o.budget);
    CHECK(E % b->m.ep == 0 && world % b->m.ep == 0 && b->m.dp * b->m.sp == world);
    CHECK(sp_valid(&req.cfg, b->m.sp, T, world));
    CHECK(req.mesh.dp == b->m.dp && req.mesh.ep == b->m.ep && req.mesh.sp == b->m.sp);
    /* the chosen candidate is the fastest of those that fit */
    for (int i = 0; i < ch->n; i++)
        if (ch->cand[i].fits) CHECK(ch->cand[i].proj.tokens_per_s <= b->proj.tokens_per_s);
    /* ep0: no smaller valid ep fits even at the largest valid sp; ep0 itself does */
    int64_t sp_max = 1;
    for (int64_t d = 1; d <= world; d++)
        if (sp_valid(&req.cfg, d, T, world)) sp_max = d;
    fm_mesh_dims m = base.mesh;
    m.sp = sp_max;
    m.dp = world / sp_max;
    for (int64_t e = 1; e < ch->ep0; e++)
        if (E % e == 0 && world % e == 0) {
            m.ep = e;
            CHECK_MSG(!fits_at(&base, &o, m), "%s: ep %lld < ep0 %lld fits", cfg, (long long)e, (long long)ch->ep0);
        }
    m.ep = ch->ep0;
    CHECK(fits_at(&base, &o, m));
    /* sp0: no smaller valid sp fits at ep0 */
    for (int64_t d = 1; d < ch->sp0; d++)
        if (sp_valid(&req.cfg, d, T, world)) {
            m.sp = d;
            m.dp = world / d;
            CHECK_MSG(!fits_at(&base, &o, m), "%s: sp %lld < sp0 %lld fits", cfg, (long long)d, (long long)ch->sp0);
        }
    /* every candidate is near the point: ep in {ep0, next}, sp in {sp0, next} */
    for (int i = 0; i < ch->n; i++) CHECK(ch->cand[i].m.ep >= ch->ep0 && ch->cand[i].m.sp >= ch->sp0);
    fm_free(ch);
}

static void test_chooser(void) {
    check_choice("configs/qwen3-30b-a3b.json", 32768, 8, 138);
    check_choice("configs/mixtral-8x7b.json", 32768, 8, 138);
    check_choice("configs/mixtral-8x7b.json", 262144, 8, 138);
    check_choice("configs/olmoe-1b-7b.json", 65536, 4, 60);
    check_choice("configs/olmoe-1b-7b.json", 4096, 2, 70);
    /* Mixtral cannot fit at world 2 in 40 GiB: a clear failure */
    fm_plan_req req;
    base_req(&req, "configs/mixtral-8x7b.json", 4096, FM_PLAN_TARGET_CUDA);
    req.ce_block_tokens = FM_LCE_DEFAULT_BLOCK_TOKENS;
    req.ce_block_vocab = FM_LCE_DEFAULT_BLOCK_VOCAB;
    fm_calib cal;
    fm_calib_default(&cal, "cuda");
    const fm_choose_opts o = {(size_t)40 << 30, "--mem-budget", (size_t)14 << 30, "host", &cal,
                              false, false, false, false, false, true};
    const fm_mesh_flags f = {2, 0, 0, 0, 8};
    bool ce, cs;
    CHECK(fm_mesh_from_flags(&req.cfg, 4096, &f, &req.mesh, &ce, &cs) == FM_OK);
    bool rc[64] = {0};
    fm_mesh_choice *ch = fm_malloc(sizeof *ch);
    CHECK(fm_mesh_choose(&req, &o, rc, ce, cs, ch) == FM_ERR_NOMEM);
    CHECK_MSG(has(fm_errmsg(), "no mesh of --world 2 fits", "ep 2 x sp 2", "--world"), "%s", fm_errmsg());
    /* a world with no ep dividing both it and E = 8 other than 1 still plans (ep 1) */
    fm_free(ch);
}

static void test_calib_links(void) {
    fm_calib c;
    fm_calib_default(&c, "cuda");
    CHECK(c.intra_node_bw == 450e9 && c.inter_node_bw == 50e9 && !c.mesh_link_measured);
    /* the shipped table has them; a table without them (the old format) loads with the nominal */
    CHECK(fm_calib_load(&c, "configs/calib/h200.json") == FM_OK);
    CHECK(c.intra_node_bw == 450e9 && c.inter_node_bw == 50e9 && !c.mesh_link_measured);
    CHECK(fm_calib_load(&c, "configs/calib/cpu.json") == FM_OK);
    CHECK(c.intra_node_bw == 5e9 && c.inter_node_bw == 5e9 && !c.mesh_link_measured);
    char path[64];
    snprintf(path, sizeof path, "/tmp/fm_test_mesh_%d.json", (int)getpid());
    c.intra_node_bw = 123e9;
    c.inter_node_bw = 7e9;
    c.mesh_link_measured = true;
    CHECK(fm_calib_save(&c, path) == FM_OK);
    fm_calib d;
    CHECK(fm_calib_load(&d, path) == FM_OK);
    CHECK(d.intra_node_bw == 123e9 && d.inter_node_bw == 7e9 && d.mesh_link_measured);
    /* a malformed mesh_link is an error naming it */
    FILE *f = fopen("configs/calib/cpu.json", "rb");
    char buf[65536];
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = 0;
    char *end = strrchr(buf, '}');
    CHECK(end != NULL);
    if (end) {
        *end = 0;
        FILE *g = fopen(path, "wb");
        fprintf(g, "%s, \"mesh_link\": {\"intra_node\": -1, \"inter_node\": 5e10}}\n", buf);
        fclose(g);
        CHECK(fm_calib_load(&d, path) == FM_ERR_FORMAT);
        CHECK_MSG(strstr(fm_errmsg(), "intra_node") != NULL, "%s", fm_errmsg());
    }
    remove(path);
}

int main(void) {
    test_checks();
    test_rank_bounds();
    test_projection();
    test_chooser();
    test_calib_links();
    return fm_test_finish();
}
