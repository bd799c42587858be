/* Ulysses sequence parallelism for attention (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv
 * 2309.14509, section 3): the sp ranks of a sequence-parallel group each hold a contiguous 1/sp
 * slice of every sequence's tokens. Around the backend's attention op (unchanged), an
 * all-to-all moves q, k and v from sequence-sharded [B, T/sp, heads, hd] to head-sharded
 * [B, T, heads/sp, hd]; attention runs over the full sequence on this rank's heads; the output
 * goes back to sequence-sharded by the transposed all-to-all. Backward: q, k, v and the output
 * and its gradient to head-sharded, the attention backward, the q/k/v gradients back.
 *
 * Heads. Rank s of the group holds query heads [s nh/sp, (s+1) nh/sp) and the key/value heads
 * they read (query head h reads kv head h / (nh/nkv)): with nkv >= sp, kv heads
 * [s nkv/sp, (s+1) nkv/sp); with nkv < sp, the one kv head s / (sp/nkv), REPLICATED on the
 * sp/nkv ranks that need it (each sends its tokens' copy to each of them; in backward the
 * copies' gradients are summed on the way back, in rank order). So the backend's GQA mapping
 * (local query head j reads local kv head j / (nh/nkv)) is the global one. Requires nh % sp == 0
 * and (nkv % sp == 0 or sp % nkv == 0) (fm_attn_sp_check).
 *
 * Layouts (fm_act, row-major): sequence-sharded q [B, Tl, nh, hd], k and v [B, Tl, nkv, hd]
 * (Tl = T/sp: this rank's positions s Tl .. s Tl + Tl - 1 of each row); head-sharded
 * qh/oh [B, T, nh_l, hd] (nh_l = nh/sp), kh/vh [B, T, nkv_l, hd] (nkv_l = max(1, nkv/sp)); the
 * log-sum-exp lse [B, nh_l, T] fp32, head-sharded (as many elements as [B, nh, Tl]: it lives in
 * the layer's saved lse buffer). One all-to-all moves rows of (token, head group): a gather of
 * rows into per-destination blocks (gather_rows), all_to_all_v with equal blocks, and a scatter
 * of the received blocks [source][b][t] into [b][source Tl + t] (scatter_rows), with int32 index
 * tables made at launch.
 *
 * Memory (one layer at a time, in the working-set live set, fm_attn_sp_bytes): qh, oh, dqh, doh
 * (B T nh_l hd each), kh, vh, dkh, dvh (B T nkv_l hd each), the send and receive blocks
 * (max(B Tl nh hd, sp B Tl nkv_l hd) each) and five index tables of at most sp B Tl int32.
 * Nothing is allocated in a step (the host count arrays are made once, by fm_attn_sp_init).
 *
 * Precision: in bf16 (the CUDA build) a replicated kv head's gradient copies are summed by the
 * backend's add, rounded to bf16 at each of the sp/nkv - 1 additions (one rank's attention
 * backward accumulates them in fp32); exact in fp32 up to the order of the sum.
 */
#ifndef FM_ATTN_SP_H
#define FM_ATTN_SP_H

#include "../backend/fm_backend.h"
#include "../comm/fm_comm.h"
#include "../core/fm_arena.h"
#include "fm_config.h"

/* The shape of a sequence-parallel attention: micro-batch B, this rank's positions Tl per row
 * (the full sequence is T = sp Tl), heads nh, kv heads nkv, head_dim hd, sp ranks. */
typedef struct fm_attn_sp_dims {
    int64_t B, Tl, nh, nkv, hd;
    int sp;
} fm_attn_sp_dims;

typedef struct fm_attn_sp {
    fm_attn_sp_dims d;
    int rank;                 /* this rank of the sp group (0 in measure mode) */
    int64_t T, N_l;           /* full sequence sp Tl; local tokens B Tl */
    int64_t nh_l, nkv_l;      /* heads per rank: nh/sp, max(1, nkv/sp) */
    int64_t kv_groups, kv_rep; /* kv row groups per token min(nkv, sp); ranks per kv head sp/kv_groups */
    const fm_comm *comm;      /* the sp group, over the backend's memory; NULL when sp == 1 */
    /* backend memory (the working-set arena) */
    int32_t *pack_q, *pack_kv; /* [sp N_l]: send row q N_l + n <- local row n sp + q (q) or
                                  n kv_groups + q / kv_rep (kv) */
    int32_t *back_q, *back_kv; /* [N_l sp], [N_l kv_groups]: local row n g + j <- received row
                                  j rep N_l + n (g, rep = sp, 1 for q) */
    int32_t *unpack;          /* [sp N_l]: received row p N_l + b Tl + t <-> head-sharded row b T + p Tl + t */
    fm_act *qh, *kh, *vh, *oh, *dqh, *dkh, *dvh, *doh;
    fm_act *send, *recv;      /* one all-to-all's blocks */
    int64_t *counts, *displs; /* host [2 sp]: q-sized blocks [0, sp), kv-sized [sp, 2 sp] (fm_attn_sp_init) */
} fm_attn_sp;

/* Whether config c can run with --sp sp at --seq-len seq_len: sp >= 1, seq_len % sp == 0,
 * num_attention_heads % sp == 0, and num_key_value_heads % sp == 0 or sp % num_key_value_heads
 * == 0. Errors: FM_ERR_ARG naming --sp, the field, the expected and found values and the fix
 * ("--sp 3: num_attention_heads (4) must be divisible by --sp; use --sp 1, 2 or 4"). */
fm_status fm_attn_sp_check(const fm_config *c, int64_t sp, int64_t seq_len);

/* Bytes of the sequence-parallel buffers (the layout below) for dims d and act_bytes per
 * activation element (each buffer rounded to 64 as arenas round); 0 when d->sp <= 1. */
size_t fm_attn_sp_bytes(const fm_attn_sp_dims *d, size_t act_bytes);

/* Lays the buffers out in arena ar (a measuring arena too) and fills the derived sizes; with
 * d->sp <= 1 it zeroes *s and takes nothing. Dims must pass fm_attn_sp_check's rules
 * (asserted). */
void fm_attn_sp_layout(fm_attn_sp *s, fm_arena *ar, const fm_attn_sp_dims *d);

/* After fm_attn_sp_layout over backend memory: writes the index tables (made on the host,
 * copied to the backend) and allocates the host count arrays; comm is the sp group (size d.sp,
 * over be's memory; its rank is this rank's). Nothing with sp == 1. Errors: FM_ERR_ARG (comm
 * NULL or of another size), FM_ERR_NOMEM. */
fm_status fm_attn_sp_init(fm_attn_sp *s, const fm_backend *be, const fm_comm *comm);
/* Frees what fm_attn_sp_init allocated (the arena's buffers are the arena's); safe on zeroed s. */
void fm_attn_sp_free(fm_attn_sp *s);

/* Sequence-sharded to head-sharded: x [N_l, G, rows of w elements] (G = sp for q-sized
 * tensors, kv_groups for kv: kv = false / true) -> xh [B, T, w] of this rank's head group,
 * through s->send and s->recv. w = nh_l hd (q) or nkv_l hd (kv). A collective over s->comm.
 * Errors: the communicator's (naming the rank and the all-to-all). */
fm_status fm_attn_sp_seq_to_heads(const fm_attn_sp *s, const fm_backend *be, fm_act *xh, const fm_act *x, bool kv);
/* The transpose: head-sharded xh [B, T, w] -> sequence-sharded x [N_l, G, w] (assigned), the
 * kv_rep copies of a replicated kv head summed in rank order (kv). Clobbers s->send, s->recv.
 * Errors: the communicator's. */
fm_status fm_attn_sp_heads_to_seq(const fm_attn_sp *s, const fm_backend *be, fm_act *x, const fm_act *xh, bool kv);

/* Attention forward of this rank's tokens: q [B,Tl,nh,hd], k, v [B,Tl,nkv,hd] (after QK-norm and
 * RoPE by global position) -> out [B,Tl,nh,hd] and lse [B,nh_l,T] (head-sharded; the backward
 * reads it as it is), with the backend's attention_fwd on [B, T, nh_l / nkv_l heads]. Equal to
 * the one-rank attention of the whole sequence, sliced (bit for bit on the CPU: each head's
 * arithmetic is the same). doc_start: NULL (causal rows), or packed documents' starts of the WHOLE
 * rows, [B, T] int32 backend memory (fm_batch.h; the bound's doc_start is [B sp Tl]): the head-
 * sharded attention runs on whole rows, so it reads them as they are. Errors: the communicator's. */
fm_status fm_attn_sp_forward(const fm_attn_sp *s, const fm_backend *be, fm_act *out, float *lse, const fm_act *q,
                             const fm_act *k, const fm_act *v, const int32_t *doc_start);
/* gpt_oss's attention under Ulysses (model/fm_layer_oss.h): the same all-to-alls around the
 * backend's attention_ext_fwd / _bwd, with the learned sinks of every head, sinks [nh] (this
 * rank's heads are sinks[rank nh_l ..]) and the sliding window (keys), 0: causal. The window's
 * positions are the whole sequence's (the head-sharded attention sees whole rows), so it is the
 * one-rank attention of each head. Backward adds this rank's heads' sink gradients into dsinks
 * [nh] at rank nh_l (the others untouched: the sp group's reduction of the gradients sums the
 * ranks' slices). sinks NULL and window 0: fm_attn_sp_forward / _backward (the plain op).
 * Errors: the communicator's. */
fm_status fm_attn_sp_forward_ext(const fm_attn_sp *s, const fm_backend *be, fm_act *out, float *lse, const fm_act *q,
                                 const fm_act *k, const fm_act *v, const int32_t *doc_start, const fm_act *sinks,
                                 int64_t window);
fm_status fm_attn_sp_backward_ext(const fm_attn_sp *s, const fm_backend *be, fm_act *dq, fm_act *dk, fm_act *dv,
                                  fm_act *dsinks, const fm_act *dout, const fm_act *q, const fm_act *k,
                                  const fm_act *v, const fm_act *out, const float *lse, const int32_t *doc_start,
                                  const fm_act *sinks, int64_t window);
/* Attention backward: dq [B,Tl,nh,hd], dk, dv [B,Tl,nkv,hd] assigned from dout [B,Tl,nh,hd] and
 * the forward's q, k, v, out (sequence-sharded) and lse (head-sharded); the backend's
 * attention_bwd on the head-sharded tensors. dk, dv: the sum over every query of the whole
 * sequence (replicated kv heads' copies summed); doc_start as the forward's. Errors: the communicator's. */
fm_status fm_attn_sp_backward(const fm_attn_sp *s, const fm_backend *be, fm_act *dq, fm_act *dk, fm_act *dv,
                              const fm_act *dout, const fm_act *q, const fm_act *k, const fm_act *v,
                              const fm_act *out, const float *lse, const int32_t *doc_start);

#endif
