/* Least-loaded expert placement for one chunk (fm_moe_llep.h). */
#include "fm_moe_llep.h"

#include <math.h>
#include <string.h>

fm_llep_opts fm_llep_defaults(void) {
    fm_llep_opts o = {true, 1.3, 1.0, 1024, 2};
    return o;
}

#define R4(x) fm_arena_round((size_t)(x) * 4)
#define R8(x) fm_arena_round((size_t)(x) * 8)

size_t fm_llep_plan_bytes(int P, int64_t E, int64_t F) {
    const int64_t PF = (int64_t)P * F;
    return R8(E) + R8(E + 1) + R4(PF) + R8(PF) + R4(P) + R4(PF) + R8(P) + R8(2 * (int64_t)P + E) + 2 * R4(PF) +
           R8(PF);
}

#define TAKE(ar, type, count) ((type *)fm_arena_alloc((ar), sizeof(type) * (size_t)(count)))

void fm_llep_plan_layout(fm_llep_plan *pl, fm_arena *host, int P, int64_t E, int64_t F) {
    const int64_t PF = (int64_t)P * F;
    memset(pl, 0, sizeof *pl);
    pl->P = P, pl->F = (int)F, pl->E = E, pl->El = E / P;
    pl->native_len = TAKE(host, int64_t, E);
    pl->piece_start = TAKE(host, int64_t, E + 1);
    pl->piece_rank = TAKE(host, int32_t, PF);
    pl->piece_len = TAKE(host, int64_t, PF);
    pl->nforeign = TAKE(host, int32_t, P);
    pl->foreign = TAKE(host, int32_t, PF);
    pl->rows = TAKE(host, int64_t, P);
    pl->work = TAKE(host, int64_t, 2 * (int64_t)P + E);
    pl->tmp_expert = TAKE(host, int32_t, PF);
    pl->tmp_rank = TAKE(host, int32_t, PF);
    pl->tmp_len = TAKE(host, int64_t, PF);
}

void fm_llep_place(fm_llep_plan *pl, const int64_t *load, int64_t rows_max, const fm_llep_opts *o) {
    const int P = pl->P;
    const int64_t E = pl->E, El = pl->El, F = pl->F;
    int64_t *native = pl->work, *hosted = pl->work + P, *order = pl->work + 2 * (int64_t)P;
    int64_t T = 0, Lmax = 0;
    for (int q = 0; q < P; q++) {
        native[q] = 0;
        for (int64_t e = q * El; e < (q + 1) * El; e++) native[q] += load[e];
        T += native[q];
        if (native[q] > Lmax) Lmax = native[q];
        pl->rows[q] = native[q], pl->nforeign[q] = 0, hosted[q] = 0;
    }
    pl->spill = false;
    for (int64_t e = 0; e <= E; e++) pl->piece_start[e] = 0;
    for (int64_t e = 0; e < E; e++) pl->native_len[e] = load[e];
    if (!o || !o->on || T == 0 || (double)Lmax <= o->lambda * (double)T / P) return;

    int64_t m = (int64_t)ceil(o->alpha * (double)T / P);
    if (m < 1) m = 1;
    const int64_t min_piece = o->min_piece > 0 ? o->min_piece : 1;
    for (int q = 0; q < P; q++) pl->rows[q] = 0;
    /* experts by load, descending; ties by index (insertion sort: E is small) */
    for (int64_t i = 0; i < E; i++) {
        int64_t j = i;
        while (j > 0 && load[order[j - 1]] < load[i]) order[j] = order[j - 1], j--;
        order[j] = i;
    }
    /* place, recording pieces in visit order (a helper hosts an expert at most once: after a
     * piece it is full, or the expert's rest is placed) */
    int64_t np = 0;
    for (int64_t i = 0; i < E; i++) {
        const int64_t e = order[i], oq = e / El;
        if (load[e] == 0) continue;
        int64_t keep = m - pl->rows[oq];
        keep = keep < 0 ? 0 : keep > load[e] ? load[e] : keep;
        int64_t r = load[e] - keep;
        while (r > 0 && r >= min_piece) {
            int h = -1;
            for (int q = 0; q < P; q++) {
                if (q == oq || pl->nforeign[q] >= F || pl->rows[q] >= m) continue;
                if (rows_max - native[q] - hosted[q] <= 0) continue;
                if (h < 0 || pl->rows[q] < pl->rows[h]) h = q;
            }
            if (h < 0) break;
            int64_t piece = m - pl->rows[h];
            if (piece > r) piece = r;
            if (piece < min_piece) piece = min_piece; /* <= r */
            if (piece > rows_max - native[h] - hosted[h]) piece = rows_max - native[h] - hosted[h];
            pl->tmp_expert[np] = (int32_t)e, pl->tmp_rank[np] = (int32_t)h, pl->tmp_len[np] = piece, np++;
            pl->rows[h] += piece, hosted[h] += piece;
            pl->foreign[(int64_t)h * F + pl->nforeign[h]++] = (int32_t)e;
            r -= piece;
        }
        pl->native_len[e] = keep + r;
        pl->rows[oq] += keep + r;
    }
    pl->spill = np > 0;
    /* pieces in expert order (stable: each expert's pieces keep their placing order) */
    for (int64_t t = 0; t < np; t++) pl->piece_start[pl->tmp_expert[t] + 1]++;
    for (int64_t e = 0; e < E; e++) pl->piece_start[e + 1] += pl->piece_start[e];
    {
        int64_t *next = order; /* order is no longer needed: next free piece slot per expert */
        for (int64_t e = 0; e < E; e++) next[e] = pl->piece_start[e];
        for (int64_t t = 0; t < np; t++) {
            const int64_t at = next[pl->tmp_expert[t]]++;
            pl->piece_rank[at] = pl->tmp_rank[t], pl->piece_len[at] = pl->tmp_len[t];
        }
    }
    /* hosted experts ascending per rank */
    for (int q = 0; q < P; q++) {
        int32_t *f = pl->foreign + (int64_t)q * F;
        for (int i = 1; i < pl->nforeign[q]; i++) {
            const int32_t v = f[i];
            int j = i;
            while (j > 0 && f[j - 1] > v) f[j] = f[j - 1], j--;
            f[j] = v;
        }
    }
}

void fm_llep_range(const fm_llep_plan *pl, int64_t e, int q, int64_t *start, int64_t *len) {
    *start = 0, *len = 0;
    if (q == e / pl->El) {
        *len = pl->native_len[e];
        return;
    }
    int64_t s = pl->native_len[e];
    for (int64_t t = pl->piece_start[e]; t < pl->piece_start[e + 1]; t++) {
        if (pl->piece_rank[t] == q) {
            *start = s, *len = pl->piece_len[t];
            return;
        }
        s += pl->piece_len[t];
    }
}
