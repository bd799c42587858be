/* The communicator table's shared parts (fm_comm.h): element types, the argument checks and
 * messages every implementation uses, the host-value wrappers, the process groups per mesh
 * axis, and the run's world (the launcher's rank and size, the node-local rank, the choice
 * between self, mpi and nccl). */
#include "fm_comm.h"
#include "fm_comm_nccl.h" /* fm_comm_world_create_kind */

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

size_t fm_comm_dtype_size(fm_comm_dtype t) {
    switch (t) {
    case FM_COMM_F32: return 4;
    case FM_COMM_F64: return 8;
    case FM_COMM_I64: return 8;
    case FM_COMM_BF16: return 2;
    case FM_COMM_BYTE: return 1;
    default: return 0;
    }
}

const char *fm_comm_dtype_name(fm_comm_dtype t) {
    switch (t) {
    case FM_COMM_F32: return "fp32";
    case FM_COMM_F64: return "fp64";
    case FM_COMM_I64: return "int64";
    case FM_COMM_BF16: return "bf16";
    case FM_COMM_BYTE: return "byte";
    default: return "?";
    }
}

const char *fm_comm_op_name(fm_comm_op op) {
    switch (op) {
    case FM_COMM_SUM: return "sum";
    case FM_COMM_MAX: return "max";
    default: return "?";
    }
}

const char *fm_mesh_axis_name(fm_mesh_axis axis) {
    static const char *const names[FM_AXIS_COUNT] = {"world", "dp", "ep", "sp"};
    return (int)axis >= 0 && axis < FM_AXIS_COUNT ? names[axis] : "?";
}

const char *fm_comm_describe(char *buf, size_t n, const char *collective, fm_comm_dtype dtype, int op, int64_t count) {
    char ty[48], cnt[48] = "";
    if (fm_comm_dtype_size(dtype)) snprintf(ty, sizeof ty, "%s", fm_comm_dtype_name(dtype));
    else snprintf(ty, sizeof ty, "dtype %d", (int)dtype);
    if (op >= 0) {
        const size_t l = strlen(ty);
        if (op < FM_COMM_OP_COUNT) snprintf(ty + l, sizeof ty - l, " %s", fm_comm_op_name((fm_comm_op)op));
        else snprintf(ty + l, sizeof ty - l, " op %d", op);
    }
    if (count >= 0) snprintf(cnt, sizeof cnt, ", %lld element%s", (long long)count, count == 1 ? "" : "s");
    snprintf(buf, n, "%s(%s%s)", collective, ty, cnt);
    return buf;
}

fm_status fm_comm_check_timeout(int rank, int size, const char *what, double timeout_s, double dflt, double *eff) {
    if (!(timeout_s >= 0))
        return fm_error(FM_ERR_ARG, "rank %d of %d: %s: timeout %g s must be >= 0 (0: the default, %g s)", rank, size,
                        what, timeout_s, dflt);
    *eff = timeout_s == 0 ? dflt : timeout_s;
    return FM_OK;
}

fm_status fm_comm_check_type(int rank, int size, const char *what, fm_comm_dtype dtype, int op) {
    if (fm_comm_dtype_size(dtype) == 0)
        return fm_error(FM_ERR_ARG, "rank %d of %d: %s: unknown element type %d (expected fp32, fp64, int64, bf16 "
                        "or byte)", rank, size, what, (int)dtype);
    if (op >= FM_COMM_OP_COUNT)
        return fm_error(FM_ERR_ARG, "rank %d of %d: %s: unknown reduction %d (expected sum or max)", rank, size, what,
                        op);
    if (op >= 0 && dtype == FM_COMM_BYTE)
        return fm_error(FM_ERR_ARG, "rank %d of %d: %s: bytes cannot be reduced (use fp32, fp64, int64 or bf16)", rank,
                        size, what);
    return FM_OK;
}

fm_status fm_comm_check_buf(int rank, int size, const char *what, const char *buf_name, const void *buf,
                            int64_t count) {
    if (count < 0)
        return fm_error(FM_ERR_ARG, "rank %d of %d: %s: %s count %lld is negative", rank, size, what, buf_name,
                        (long long)count);
    if (count > 0 && !buf)
        return fm_error(FM_ERR_ARG, "rank %d of %d: %s: %s buffer is NULL with %lld element%s", rank, size, what,
                        buf_name, (long long)count, count == 1 ? "" : "s");
    return FM_OK;
}

fm_status fm_comm_check_disjoint(int rank, int size, const char *what, const char *a_name, const void *a, size_t na,
                                 const char *b_name, const void *b, size_t nb) {
    if (na == 0 || nb == 0) return FM_OK;
    const uintptr_t a0 = (uintptr_t)a, b0 = (uintptr_t)b;
    if (a0 < b0 + nb && b0 < a0 + na)
        return fm_error(FM_ERR_ARG, "rank %d of %d: %s: %s [%p, +%zu bytes) overlaps %s [%p, +%zu bytes); use "
                        "separate buffers (or the in-place form the collective allows)", rank, size, what, a_name, a,
                        na, b_name, b, nb);
    return FM_OK;
}

fm_status fm_comm_check_blocks(int r, int W, const char *tag, const char *what, const void *send, const void *recv,
                               int64_t count, fm_comm_dtype dtype, bool send_whole, bool *in_place) {
    if (count > INT64_MAX / W)
        return fm_error(FM_ERR_ARG, "rank %d of %d%s: %s: %d x %lld elements overflow", r, W, tag, what, W,
                        (long long)count);
    const size_t b = (size_t)count * fm_comm_dtype_size(dtype), wb = (size_t)W * b;
    const void *whole = send_whole ? send : recv, *block = send_whole ? recv : send;
    *in_place = block == (const char *)whole + (size_t)r * b; /* MPI's and NCCL's in-place forms */
    if (*in_place) return FM_OK;
    return fm_comm_check_disjoint(r, W, what, "send", send, send_whole ? wb : b, "recv", recv, send_whole ? b : wb);
}

/* The byte extent [lo, hi) of the nonempty blocks (lo == hi: none). */
static void extent(const int64_t *counts, const int64_t *displs, int W, size_t es, size_t *lo, size_t *hi) {
    *lo = SIZE_MAX, *hi = 0;
    for (int q = 0; q < W; q++) {
        if (counts[q] == 0) continue;
        const size_t a = (size_t)displs[q] * es, b = a + (size_t)counts[q] * es;
        if (a < *lo) *lo = a;
        if (b > *hi) *hi = b;
    }
    if (*lo > *hi) *lo = *hi = 0;
}

fm_status fm_comm_check_all_to_all_v(int r, int W, const char *tag, const char *what, const void *send,
                                     const int64_t *send_counts, const int64_t *send_displs, const void *recv,
                                     const int64_t *recv_counts, const int64_t *recv_displs, fm_comm_dtype dtype,
                                     int64_t total[2], int64_t *biggest) {
    if (!send_counts || !send_displs || !recv_counts || !recv_displs)
        return fm_error(FM_ERR_ARG, "rank %d of %d%s: %s: send_counts, send_displs, recv_counts and recv_displs must "
                        "be host arrays of %d elements (the communicator's size), found %s NULL", r, W, tag, what, W,
                        !send_counts ? "send_counts" : !send_displs ? "send_displs" : !recv_counts ? "recv_counts"
                                                                                                     : "recv_displs");
    const int64_t *arr[4] = {send_counts, send_displs, recv_counts, recv_displs};
    static const char *const names[4] = {"send_counts", "send_displs", "recv_counts", "recv_displs"};
    total[0] = total[1] = *biggest = 0;
    for (int a = 0; a < 4; a++)
        for (int q = 0; q < W; q++) {
            if (arr[a][q] < 0)
                return fm_error(FM_ERR_ARG, "rank %d of %d%s: %s: %s[%d] = %lld is negative", r, W, tag, what,
                                names[a], q, (long long)arr[a][q]);
            if (a % 2 == 0) total[a / 2] += arr[a][q];
            if (a % 2 == 0 && arr[a][q] > *biggest) *biggest = arr[a][q];
        }
    if (send_counts[r] != recv_counts[r])
        return fm_error(FM_ERR_ARG, "rank %d of %d%s: %s: rank %d sends %lld elements to itself (send_counts[%d]) but "
                        "expects %lld from itself (recv_counts[%d]); they must be equal", r, W, tag, what, r,
                        (long long)send_counts[r], r, (long long)recv_counts[r], r);
    FM_TRY(fm_comm_check_buf(r, W, what, "send", send, total[0]));
    FM_TRY(fm_comm_check_buf(r, W, what, "recv", recv, total[1]));
    const size_t es = fm_comm_dtype_size(dtype);
    size_t slo, shi, rlo, rhi;
    extent(send_counts, send_displs, W, es, &slo, &shi);
    extent(recv_counts, recv_displs, W, es, &rlo, &rhi);
    if (shi > slo && rhi > rlo)
        FM_TRY(fm_comm_check_disjoint(r, W, what, "send blocks", (const char *)send + slo, shi - slo, "recv blocks",
                                      (const char *)recv + rlo, rhi - rlo));
    return FM_OK;
}

void fm_comm_free(fm_comm *c) {
    if (!c) return;
    if (c->ops && c->ctx) c->ops->destroy(c->ctx);
    c->ops = NULL;
    c->ctx = NULL;
}

/* ---- host-value wrappers --------------------------------------------------------------------- */

static fm_status host_reduce(const fm_comm *c, void *vals, int64_t n, fm_comm_dtype t, fm_comm_op op, double to) {
    return c->ops->all_reduce_host(c->ctx, vals, n, t, op, to);
}

fm_status fm_comm_allreduce_sum_f64(const fm_comm *c, double *vals, int64_t n, double timeout_s) {
    return host_reduce(c, vals, n, FM_COMM_F64, FM_COMM_SUM, timeout_s);
}
fm_status fm_comm_allreduce_max_f64(const fm_comm *c, double *vals, int64_t n, double timeout_s) {
    return host_reduce(c, vals, n, FM_COMM_F64, FM_COMM_MAX, timeout_s);
}
fm_status fm_comm_allreduce_sum_f32(const fm_comm *c, float *vals, int64_t n, double timeout_s) {
    return host_reduce(c, vals, n, FM_COMM_F32, FM_COMM_SUM, timeout_s);
}
fm_status fm_comm_allreduce_max_f32(const fm_comm *c, float *vals, int64_t n, double timeout_s) {
    return host_reduce(c, vals, n, FM_COMM_F32, FM_COMM_MAX, timeout_s);
}
fm_status fm_comm_allreduce_sum_i64(const fm_comm *c, int64_t *vals, int64_t n, double timeout_s) {
    return host_reduce(c, vals, n, FM_COMM_I64, FM_COMM_SUM, timeout_s);
}
fm_status fm_comm_allreduce_max_i64(const fm_comm *c, int64_t *vals, int64_t n, double timeout_s) {
    return host_reduce(c, vals, n, FM_COMM_I64, FM_COMM_MAX, timeout_s);
}

/* ---- process groups -------------------------------------------------------------------------- */

void fm_comm_group_free(fm_comm_group *g) {
    if (!g) return;
    for (int a = 0; a < FM_AXIS_COUNT; a++) {
        if (a != FM_AXIS_WORLD) fm_comm_free(&g->axis[a].comm);
        g->axis[a].comm.ops = NULL;
        g->axis[a].comm.ctx = NULL;
        g->axis[a].degree = 0;
    }
}

fm_status fm_comm_group_create(fm_comm_group *g, const fm_comm *world, int dp, int ep, int sp) {
    if (!g) return fm_error(FM_ERR_ARG, "fm_comm_group_create: the group is NULL");
    memset(g, 0, sizeof *g);
    for (int a = 0; a < FM_AXIS_COUNT; a++) {
        g->axis[a].axis = (fm_mesh_axis)a;
        g->axis[a].name = fm_mesh_axis_name((fm_mesh_axis)a);
    }
    if (!world || !world->ops || !world->ctx)
        return fm_error(FM_ERR_ARG, "fm_comm_group_create: no world communicator");
    const int W = fm_comm_size(world), r = fm_comm_rank(world);
    if (dp < 1 || ep < 1 || sp < 1)
        return fm_error(FM_ERR_ARG, "rank %d of %d: mesh degrees dp %d, ep %d, sp %d must each be >= 1", r, W, dp, ep,
                        sp);
    if (W == 1 && (dp != 1 || ep != 1 || sp != 1))
        return fm_error(FM_ERR_ARG, "rank 0 of 1: mesh degrees dp %d, ep %d, sp %d need more ranks than the 1 "
                        "running; with one rank every degree is 1", dp, ep, sp);
    if ((int64_t)dp * sp != W)
        return fm_error(FM_ERR_ARG, "rank %d of %d: mesh degrees dp %d, ep %d, sp %d: dp x sp = %lld ranks, but %d "
                        "ranks are running (the world is dp x sp ranks; ep divides it and adds none)", r, W, dp, ep,
                        sp, (long long)dp * sp, W);
    if (W % ep != 0)
        return fm_error(FM_ERR_ARG, "rank %d of %d: mesh degrees dp %d, ep %d, sp %d: ep %d does not divide dp x sp "
                        "= %d ranks", r, W, dp, ep, sp, ep, W);
    g->axis[FM_AXIS_WORLD].comm = *world;
    g->axis[FM_AXIS_WORLD].degree = W;
    /* r = dp_index * sp + sp_index (fm_comm.h); key r orders each axis by world rank */
    const int dp_index = r / sp, sp_index = r % sp;
    const int color[FM_AXIS_COUNT] = {0, sp_index, r / ep, dp_index};
    const int degree[FM_AXIS_COUNT] = {W, dp, ep, sp};
    for (int a = FM_AXIS_DP; a < FM_AXIS_COUNT; a++) {
        const fm_status st = world->ops->split(world->ctx, color[a], r, &g->axis[a].comm);
        if (st != FM_OK) {
            fm_comm_group_free(g);
            return st;
        }
        g->axis[a].degree = fm_comm_size(&g->axis[a].comm);
        if (g->axis[a].degree != degree[a]) {
            const int got = g->axis[a].degree;
            fm_comm_group_free(g);
            return fm_error(FM_ERR_UNSUPPORTED, "rank %d of %d: the %s axis's split of the '%s' world communicator "
                            "has %d rank%s, expected %d: this communicator does not serve meshes over %d ranks", r, W,
                            fm_mesh_axis_name((fm_mesh_axis)a), world->ops->name, got, got == 1 ? "" : "s",
                            degree[a], W);
        }
    }
    return FM_OK;
}

/* ---- the run's world ------------------------------------------------------------------------- */

/* ---- the launcher's environment, as the client handed it ------------------------------------ */

const char *const fm_comm_env_names[FM_COMM_ENV_COUNT] = {
    "OMPI_COMM_WORLD_RANK",       "OMPI_COMM_WORLD_SIZE",       "PMI_RANK",        "PMI_SIZE",
    "SLURM_PROCID",               "SLURM_NTASKS",               "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALRANKID",            "MPI_LOCALNRANKS", "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",      "NCCL_NVLS_ENABLE"};
static char *g_env[FM_COMM_ENV_COUNT]; /* copies; NULL: unset */

fm_status fm_comm_env_set(const char *const values[FM_COMM_ENV_COUNT]) {
    char *copy[FM_COMM_ENV_COUNT] = {0};
    for (int i = 0; i < FM_COMM_ENV_COUNT; i++) {
        if (!values || !values[i]) continue;
        copy[i] = strdup(values[i]);
        if (!copy[i]) {
            for (int j = 0; j < i; j++) free(copy[j]);
            return fm_error(FM_ERR_NOMEM, "fm_comm_env_set: no memory for the value of %s (%zu bytes)",
                            fm_comm_env_names[i], strlen(values[i]) + 1);
        }
    }
    for (int i = 0; i < FM_COMM_ENV_COUNT; i++) {
        free(g_env[i]);
        g_env[i] = copy[i];
    }
    return FM_OK;
}

const char *fm_comm_env_get(const char *name) {
    for (int i = 0; name && i < FM_COMM_ENV_COUNT; i++)
        if (!strcmp(name, fm_comm_env_names[i])) return g_env[i];
    return NULL;
}

/* *out = the integer in the launcher's variable name; false when unset. */
static fm_status env_int(const char *name, int *out, bool *set) {
    const char *v = fm_comm_env_get(name);
    *set = v && *v;
    if (!*set) return FM_OK;
    char *end;
    errno = 0;
    const long x = strtol(v, &end, 10);
    if (errno || *end || x < 0 || x > 1 << 30)
        return fm_error(FM_ERR_ARG, "environment variable %s = \"%s\": expected a rank or rank count (an integer "
                        ">= 0) from the launcher", name, v);
    *out = (int)x;
    return FM_OK;
}

fm_status fm_comm_launcher(int *rank, int *size, const char **source) {
    static const char *const vars[3][3] = {{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD"},
                                           {"PMI_RANK", "PMI_SIZE", "PMI"},
                                           {"SLURM_PROCID", "SLURM_NTASKS", "SLURM"}};
    *rank = 0, *size = 1;
    if (source) *source = "none";
    for (int i = 0; i < 3; i++) {
        int r = 0, n = 0;
        bool rs, ns;
        FM_TRY(env_int(vars[i][0], &r, &rs));
        FM_TRY(env_int(vars[i][1], &n, &ns));
        if (!rs || !ns) continue;
        if (n < 1 || r >= n)
            return fm_error(FM_ERR_ARG, "the launcher's %s = %d and %s = %d: expected a rank in [0, size) of size >= 1",
                            vars[i][0], r, vars[i][1], n);
        *rank = r, *size = n;
        if (source) *source = vars[i][2];
        return FM_OK;
    }
    return FM_OK;
}

fm_status fm_comm_world_create(fm_comm *out, const struct fm_backend *be, double default_timeout_s) {
    int rank, size;
    const char *src;
    FM_TRY(fm_comm_launcher(&rank, &size, &src));
    if (size == 1) return fm_comm_self_create(out, be, default_timeout_s);
    if (!fm_comm_mpi_built())
        return fm_error(FM_ERR_UNSUPPORTED, "rank %d of %d (%s_* variables): this flatmoe was built without MPI, so "
                        "it cannot run on several ranks; install libopenmpi-dev and openmpi-bin and configure again "
                        "(cmake -DFLATMOE_MPI=ON), or launch one process", rank, size, src);
    FM_TRY(fm_comm_mpi_world(out, be, default_timeout_s, 0));
    if (fm_comm_rank(out) != rank || fm_comm_size(out) != size) {
        const int r2 = fm_comm_rank(out), n2 = fm_comm_size(out);
        fm_comm_free(out);
        return fm_error(FM_ERR_IO, "the launcher says rank %d of %d (%s_*) but MPI says rank %d of %d: launch with "
                        "the mpirun/srun of the MPI flatmoe was built with", rank, size, src, r2, n2);
    }
    return FM_OK;
}

/* ---- choosing the communicator --------------------------------------------------------------- */

const char *fm_comm_kind_name(fm_comm_kind k) {
    static const char *const names[FM_COMM_KIND_COUNT] = {"auto", "mpi", "nccl"};
    return (int)k >= 0 && k < FM_COMM_KIND_COUNT ? names[k] : "?";
}

fm_status fm_comm_kind_parse(const char *s, fm_comm_kind *out) {
    for (int k = 0; k < FM_COMM_KIND_COUNT; k++)
        if (s && !strcmp(s, fm_comm_kind_name((fm_comm_kind)k))) {
            *out = (fm_comm_kind)k;
            return FM_OK;
        }
    return fm_error(FM_ERR_ARG, "--comm \"%s\": expected auto, mpi or nccl", s ? s : "(null)");
}

fm_status fm_comm_local(int *local_rank, int *local_size, const char **source) {
    static const char *const vars[3][3] = {{"OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI"},
                                           {"MPI_LOCALRANKID", "MPI_LOCALNRANKS", "MPICH"},
                                           {"SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM"}};
    *local_rank = 0, *local_size = 1;
    if (source) *source = "none";
    for (int i = 0; i < 3; i++) {
        int r = 0, n = 0;
        bool rs, ns;
        if (env_int(vars[i][0], &r, &rs) != FM_OK) return FM_ERR_ARG;
        if (env_int(vars[i][1], &n, &ns) != FM_OK) { /* SLURM_NTASKS_PER_NODE may read "2(x3)": not ours */
            if (i == 2) break;
            return FM_ERR_ARG;
        }
        if (!rs || !ns) continue;
        if (n < 1 || r >= n)
            return fm_error(FM_ERR_ARG, "the launcher's %s = %d and %s = %d: expected a local rank in [0, size) of "
                            "size >= 1", vars[i][0], r, vars[i][1], n);
        *local_rank = r, *local_size = n;
        if (source) *source = vars[i][2];
        return FM_OK;
    }
    int rank, size;
    FM_TRY(fm_comm_launcher(&rank, &size, NULL));
    if (size == 1) return FM_OK;
    if (!fm_comm_mpi_built())
        return fm_error(FM_ERR_UNSUPPORTED, "rank %d of %d: no node-local rank from the launcher (OMPI_COMM_WORLD_"
                        "LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID) and no MPI in this build to find it", rank, size);
    FM_TRY(fm_comm_mpi_local(local_rank, local_size));
    if (source) *source = "MPI_COMM_TYPE_SHARED";
    return FM_OK;
}

fm_status fm_comm_world_create_kind(fm_comm *out, const struct fm_backend *be, double default_timeout_s,
                                    fm_comm_kind kind, int nccl_check, fm_comm_kind *chosen) {
    if (out) out->ops = NULL, out->ctx = NULL;
    if ((int)kind < 0 || kind >= FM_COMM_KIND_COUNT)
        return fm_error(FM_ERR_ARG, "fm_comm_world_create_kind: unknown communicator kind %d", (int)kind);
    int rank, size;
    FM_TRY(fm_comm_launcher(&rank, &size, NULL));
    fm_comm_kind k = kind;
    if (k == FM_COMM_KIND_AUTO) {
        if (size == 1) {
            if (chosen) *chosen = FM_COMM_KIND_AUTO; /* the self communicator */
            return fm_comm_world_create(out, be, default_timeout_s);
        }
        k = FM_COMM_KIND_MPI;
        if (fm_comm_nccl_built() && be) { /* nccl when every rank on this node has its own GPU */
            int lr = 0, ls = 1;
            FM_TRY(fm_comm_local(&lr, &ls, NULL));
            if (fm_comm_nccl_usable(be, ls, NULL, 0)) k = FM_COMM_KIND_NCCL;
        }
    }
    if (chosen) *chosen = k;
    if (k == FM_COMM_KIND_NCCL) {
        if (!fm_comm_nccl_built())
            return fm_error(FM_ERR_UNSUPPORTED, "--comm nccl: this flatmoe was built without NCCL (it needs the CUDA "
                            "build, -DFLATMOE_CUDA=ON, with nccl.h and libnccl found); use --comm mpi or auto");
        if (kind == FM_COMM_KIND_NCCL && size > 1) { /* asked for: say why it cannot serve, before NCCL does */
            int lr = 0, ls = 1;
            char why[200];
            FM_TRY(fm_comm_local(&lr, &ls, NULL));
            if (!fm_comm_nccl_usable(be, ls, why, sizeof why))
                return fm_error(FM_ERR_ARG, "rank %d of %d: --comm nccl: %s; use --comm mpi (or auto)", rank, size,
                                why);
        }
        return fm_comm_nccl_world(out, be, default_timeout_s, (fm_comm_nccl_check)nccl_check);
    }
    /* mpi, on any number of ranks */
    if (!fm_comm_mpi_built())
        return fm_error(FM_ERR_UNSUPPORTED, "rank %d of %d: --comm mpi: this flatmoe was built without MPI; install "
                        "libopenmpi-dev and openmpi-bin and configure again (cmake -DFLATMOE_MPI=ON)", rank, size);
    FM_TRY(fm_comm_mpi_world(out, be, default_timeout_s, 0));
    if (fm_comm_rank(out) != rank || fm_comm_size(out) != size) {
        const int r2 = fm_comm_rank(out), n2 = fm_comm_size(out);
        fm_comm_free(out);
        return fm_error(FM_ERR_IO, "the launcher says rank %d of %d but MPI says rank %d of %d: launch with the "
                        "mpirun/srun of the MPI flatmoe was built with", rank, size, r2, n2);
    }
    return FM_OK;
}
