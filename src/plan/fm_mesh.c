/* The mesh degrees: checks, flags and the chooser (fm_mesh.h). */
#include "fm_mesh.h"

#include <stdio.h>
#include <string.h>


/* the divisors of n that divide `other` too, ascending, as a list "1, 2, 4" (for messages) */
static void divisors_text(int64_t n, int64_t other, char *buf, size_t len) {
    buf[0] = 0;
    for (int64_t d = 1; d <= n && strlen(buf) + 24 < len; d++)
        if (n % d == 0 && other % d == 0)
            snprintf(buf + strlen(buf), len - strlen(buf), "%s%lld", buf[0] ? ", " : "", (long long)d);
}

static bool sp_heads_ok(const fm_config *c, int64_t sp) {
    const int64_t nkv = c->num_key_value_heads;
    return c->num_attention_heads % sp == 0 && (nkv % sp == 0 || sp % nkv == 0);
}

fm_status fm_mesh_check(const fm_config *c, int64_t T, const fm_mesh_dims *m) {
    if (m->dp < 1 || m->ep < 1 || m->sp < 1)
        return fm_error(FM_ERR_ARG, "--dp %lld, --ep %lld, --sp %lld: each degree must be >= 1; give positive degrees",
                        (long long)m->dp, (long long)m->ep, (long long)m->sp);
    if (m->gpus_per_node < 1)
        return fm_error(FM_ERR_ARG, "--gpus-per-node %lld: expected >= 1 (8 on an HGX H200 node)", (long long)m->gpus_per_node);
    const int64_t W = m->dp * m->sp, E = c->num_experts;
    char ok[256];
    if (E % m->ep != 0) {
        divisors_text(E, W, ok, sizeof ok);
        return fm_error(FM_ERR_ARG, "--ep %lld: expected a divisor of num_experts (%lld, config.json), found %lld %% %lld = "
                        "%lld; use one of %s (these also divide dp x sp = %lld)", (long long)m->ep, (long long)E,
                        (long long)E, (long long)m->ep, (long long)(E % m->ep), ok, (long long)W);
    }
    if (W % m->ep != 0) {
        divisors_text(E, W, ok, sizeof ok);
        return fm_error(FM_ERR_ARG, "--ep %lld: expected a divisor of the world dp x sp = %lld x %lld = %lld (expert groups "
                        "are drawn from the same ranks), found %lld %% %lld = %lld; use one of %s", (long long)m->ep,
                        (long long)m->dp, (long long)m->sp, (long long)W, (long long)W, (long long)m->ep,
                        (long long)(W % m->ep), ok);
    }
    if (m->sp > 1) {
        const int64_t nh = c->num_attention_heads, nkv = c->num_key_value_heads;
        if (nh % m->sp != 0) {
            divisors_text(nh, nh, ok, sizeof ok); /* (the world follows sp: dp x sp) */
            return fm_error(FM_ERR_ARG, "--sp %lld: expected a divisor of num_attention_heads (%lld, config.json; Ulysses "
                            "gives each sp rank heads / sp heads), found %lld %% %lld = %lld; use one of %s",
                            (long long)m->sp, (long long)nh, (long long)nh, (long long)m->sp, (long long)(nh % m->sp), ok);
        }
        if (!(nkv % m->sp == 0 || m->sp % nkv == 0))
            return fm_error(FM_ERR_ARG, "--sp %lld: num_key_value_heads (%lld, config.json) must be divisible by --sp or "
                            "divide it (key/value heads replicated over sp / heads ranks), found neither; use an sp that "
                            "is a multiple or a divisor of %lld", (long long)m->sp, (long long)nkv, (long long)nkv);
        if (T % m->sp != 0)
            return fm_error(FM_ERR_ARG, "--seq-len %lld: expected a multiple of --sp %lld (each sp rank holds seq-len / sp "
                            "tokens), found %lld %% %lld = %lld; use --seq-len %lld", (long long)T, (long long)m->sp,
                            (long long)T, (long long)m->sp, (long long)(T % m->sp), (long long)(T / m->sp * m->sp));
    }
    return FM_OK;
}

fm_status fm_mesh_from_flags(const fm_config *c, int64_t T, const fm_mesh_flags *f, fm_mesh_dims *m, bool *choose_ep,
                             bool *choose_sp) {
    memset(m, 0, sizeof *m);
    *choose_ep = *choose_sp = false;
    m->on = true;
    m->gpus_per_node = f->gpus_per_node ? f->gpus_per_node : 8;
    if (f->world < 0 || f->dp < 0 || f->ep < 0 || f->sp < 0 || f->gpus_per_node < 0)
        return fm_error(FM_ERR_ARG, "--world %lld, --dp %lld, --ep %lld, --sp %lld, --gpus-per-node %lld: expected "
                        "positive values", (long long)f->world, (long long)f->dp, (long long)f->ep, (long long)f->sp,
                        (long long)f->gpus_per_node);
    m->ep = f->ep ? f->ep : 1;
    if (!f->world) {
        m->dp = f->dp ? f->dp : 1;
        m->sp = f->sp ? f->sp : 1;
        return fm_mesh_check(c, T, m);
    }
    const int64_t W = f->world;
    if (f->dp && f->sp && f->dp * f->sp != W)
        return fm_error(FM_ERR_ARG, "--dp %lld x --sp %lld = %lld but --world is %lld: expected dp x sp = world (the world "
                        "is the dp x sp ranks); give --sp %lld, or drop --dp/--sp and let the chooser pick",
                        (long long)f->dp, (long long)f->sp, (long long)(f->dp * f->sp), (long long)W,
                        (long long)(W % f->dp == 0 ? W / f->dp : 1));
    if (f->dp && W % f->dp != 0)
        return fm_error(FM_ERR_ARG, "--dp %lld: expected a divisor of --world %lld (sp = world / dp), found %lld %% %lld = "
                        "%lld; give a dp that divides the world", (long long)f->dp, (long long)W, (long long)W,
                        (long long)f->dp, (long long)(W % f->dp));
    if (f->sp && W % f->sp != 0)
        return fm_error(FM_ERR_ARG, "--sp %lld: expected a divisor of --world %lld (dp = world / sp), found %lld %% %lld = "
                        "%lld; give an sp that divides the world", (long long)f->sp, (long long)W, (long long)W,
                        (long long)f->sp, (long long)(W % f->sp));
    m->sp = f->sp ? f->sp : f->dp ? W / f->dp : 1;
    m->dp = W / m->sp;
    *choose_sp = !f->sp && !f->dp;
    *choose_ep = !f->ep;
    /* what is fixed must be valid now (a free degree is 1 here, always valid) */
    return fm_mesh_check(c, T, m);
}

/* Plans mesh m per rank with the single-rank chooser from `base`; req ends holding it. */
static void plan_at(fm_plan_req *req, const fm_plan_req *base, const fm_choose_opts *o, bool *rc, const fm_mesh_dims *m,
                    fm_mesh_cand *out) {
    *req = *base;
    req->mesh = *m;
    memset(out, 0, sizeof *out);
    out->m = *m;
    out->fits = fm_plan_fit(req, o, rc, &out->plan, &out->proj) == FM_OK;
}

fm_status fm_mesh_choose(fm_plan_req *req, const fm_choose_opts *o, bool *rc, bool choose_ep, bool choose_sp,
                         fm_mesh_choice *ch) {
    memset(ch, 0, sizeof *ch);
    const fm_config *c = &req->cfg;
    const int64_t W = req->mesh.dp * req->mesh.sp;
    ch->world = W;
    ch->best = -1;
    ch->chose_ep = choose_ep;
    ch->chose_sp = choose_sp;
    int64_t eps[64], sps[64];
    int n_ep = 0, n_sp = 0;
    for (int64_t d = 1; d <= W && n_ep < 64; d++)
        if (W % d == 0 && c->num_experts % d == 0 && (choose_ep || d == req->mesh.ep)) eps[n_ep++] = d;
    for (int64_t d = 1; d <= W && n_sp < 64; d++)
        if (W % d == 0 && sp_heads_ok(c, d) && req->T % d == 0 && (choose_sp || d == req->mesh.sp)) sps[n_sp++] = d;
    if (n_ep == 0)
        return fm_error(FM_ERR_ARG, "--world %lld: no expert-parallel degree divides both the world and num_experts (%lld); "
                        "give a world with a common divisor", (long long)W, (long long)c->num_experts);
    if (n_sp == 0)
        return fm_error(FM_ERR_ARG, "--world %lld: no sequence-parallel degree divides the world, num_attention_heads (%lld) "
                        "and --seq-len %lld", (long long)W, (long long)c->num_attention_heads, (long long)req->T);
    const fm_plan_req base = *req;
    fm_mesh_cand probe;
    fm_mesh_dims m = base.mesh;
    /* ep: the smallest with which some plan fits at the largest sp */
    int iep = -1, isp = -1;
    m.sp = sps[n_sp - 1];
    m.dp = W / m.sp;
    for (int i = 0; i < n_ep && iep < 0; i++) {
        m.ep = eps[i];
        plan_at(req, &base, o, rc, &m, &probe);
        if (probe.fits) iep = i;
    }
    if (iep < 0) { /* req holds the largest ep at the largest sp: its verdict */
        fm_plan p;
        fm_projection pr;
        fm_status s = fm_plan_fit(req, o, rc, &p, &pr);
        char why[2048];
        snprintf(why, sizeof why, "%s", s ? fm_errmsg() : "");
        return fm_error(s ? s : FM_ERR_NOMEM, "no mesh of --world %lld fits, not even ep %lld x sp %lld (dp %lld), the "
                        "smallest per-rank plan; give more ranks (--world) or a shorter --seq-len. Per rank: %s",
                        (long long)W, (long long)m.ep, (long long)m.sp, (long long)m.dp, why);
    }
    ch->ep0 = eps[iep];
    /* sp: the smallest that fits at that ep */
    m.ep = eps[iep];
    for (int i = 0; i < n_sp && isp < 0; i++) {
        m.sp = sps[i];
        m.dp = W / m.sp;
        plan_at(req, &base, o, rc, &m, &probe);
        if (probe.fits) isp = i;
    }
    if (isp < 0) isp = n_sp - 1; /* cannot happen: it fit at the largest */
    ch->sp0 = sps[isp];
    /* the candidates around the point */
    for (int a = iep; a <= iep + 1 && a < n_ep; a++)
        for (int b = isp; b <= isp + 1 && b < n_sp && ch->n < FM_MESH_MAX_CANDS; b++) {
            m.ep = eps[a];
            m.sp = sps[b];
            m.dp = W / m.sp;
            fm_mesh_cand *cd = &ch->cand[ch->n++];
            plan_at(req, &base, o, rc, &m, cd);
            /* fastest = most tokens/s: the candidates' steps differ in tokens (dp x micro-batch sequences) */
            if (cd->fits && (ch->best < 0 || cd->proj.tokens_per_s > ch->cand[ch->best].proj.tokens_per_s)) ch->best = ch->n - 1;
        }
    /* req ends holding the choice (its knobs: plan it again) */
    fm_mesh_cand fin;
    plan_at(req, &base, o, rc, &ch->cand[ch->best].m, &fin);
    return FM_OK;
}

void fm_mesh_print_choice(const fm_mesh_choice *ch, FILE *f) {
    fprintf(f, "mesh: --world %lld; ", (long long)ch->world);
    if (ch->chose_ep)
        fprintf(f, "ep >= %lld by expert memory (the smallest dividing num_experts and the world with which a plan fits "
                "at the largest sp; the next larger is a candidate too); ", (long long)ch->ep0);
    if (ch->chose_sp)
        fprintf(f, "sp >= %lld %s; ", (long long)ch->sp0,
                ch->sp0 == 1 ? "(the whole sequence fits on a rank; the next larger is a candidate too)"
                             : "(the smallest with which the local sequence fits; the next larger is a candidate too)");
    fprintf(f, "dp = world / sp. Candidates (per rank; step projected):\n");
    fprintf(f, "  %4s %4s %4s  %-4s %12s %12s %12s %12s %7s\n", "dp", "ep", "sp", "fits", "device GiB", "host GiB", "step s",
            "tokens/s", "MFU");
    for (int i = 0; i < ch->n; i++) {
        const fm_mesh_cand *c = &ch->cand[i];
        fprintf(f, "  %4lld %4lld %4lld  %-4s %12.3f %12.3f %12.4g %12.0f %6.1f%%%s\n", (long long)c->m.dp,
                (long long)c->m.ep, (long long)c->m.sp, c->fits ? "yes" : "no", c->plan.total / 1073741824.0,
                c->plan.host_bytes / 1073741824.0, c->proj.step_s, c->proj.tokens_per_s, 100.0 * c->proj.mfu,
                i == ch->best ? "   <- chosen (most tokens/s that fits)" : "");
    }
    fprintf(f, "\n");
}
