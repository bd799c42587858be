/* Expert-parallel MoE (DESIGN.md §2 "expert dispatch" and §6): the experts of a layer are
 * partitioned over the ranks of an ep process group (contiguous blocks: rank q of the group owns
 * experts [q*E_loc, (q+1)*E_loc), E_loc = E/ep), and the dispatch and combine of the chunked MoE
 * (fm_moe_dispatch.h) become all-to-all-v exchanges of token rows, in token chunks with a
 * per-source cap c and strided membership (PipelinedLLEP, arXiv 2609.14306 §3: K chunks, token
 * t of a rank -> chunk t mod K). K is the same on every rank of the group (fm_moe_ep_chunks: the
 * all-reduce max of each rank's ceil(N/c)), so every rank runs every chunk's collectives, a rank
 * with zero tokens too, and each source contributes at most ceil(N/K) <= c tokens to a chunk.
 *
 * One chunk, forward (every rank is a source of its tokens and the owner of its experts):
 *   source: gather the chunk's rows (x, top-k), dispatch them expert-major over all E experts
 *           (fm_moe_dispatch: the rows for rank q are then one contiguous block);
 *   all:    agree on the chunk's routing counts: one all_reduce_host (sum) of a [ep, E+5] int64
 *           table (each rank's per-expert counts, its K, its chunk size, an error flag, its cap
 *           and a fingerprint of its placement options), so
 *           every rank knows every count and takes the same decision (an error on one rank is
 *           an error on all, never a hang);
 *   all:    all_to_all_v of the rows to their owners (receive buffer: source-major);
 *   owner:  permute them expert-major over its E_loc experts and hand them to the caller (the
 *           dispatch phase ends: fm_moe_ep_next delivers an fm_moe_ep_work), which runs the
 *           experts on them (the MoE glue, model/fm_moe_layer.c, through the experts' table:
 *           any expert precision; this operator moves rows and never calls an expert); at the
 *           caller's next step (the combine phase) permute the outputs back to source-major;
 *   all:    all_to_all_v of the outputs back to their sources;
 *   source: combine with the router weights (fm_moe_combine) and scatter to the layer's rows.
 * Backward, per chunk: the forward's dispatch and experts are recomputed (as the one-rank chunked
 * MoE does: nothing is kept between chunks), the outputs come back for the combine's backward
 * (dtopk_w = dot(dy, ye) and dye = w * dy, on the source), dye goes to the owners, the caller runs
 * the experts' backward there (their weight gradients stay with them, accumulated), and the input
 * gradients of the rows come back to the source, which sums each token's k rows
 * (fm_moe_dispatch_backward). Exchanges per chunk: forward 1 count all-reduce + 2 row
 * all-to-all-v; backward 1 + 4 (a chunk whose least-loaded placement moves rows adds 3 weight
 * all-to-all-v in forward, and 3 weight + 3 gradient all-to-all-v in backward; with the experts'
 * biases, d->bias, one more each way: 4 and 4 + 4).
 *
 * Exactness: per route the arithmetic is the one-rank MoE's (the same gather, SwiGLU, combine
 * in the same j order); only the row grouping of the expert GEMMs differs (which rows share one
 * GEMM), so outputs, input gradients and dtopk_w equal the one-rank MoE's up to the GEMM's
 * blocking, and expert weight gradients up to fp32 reassociation (tests/test_moe_ep.c: 1e-6).
 *
 * The bound (fm_moe_ep_bound_bytes): a receiver gets from each of the ep sources at most
 * c * min(k, E_loc) rows per chunk (a token's k experts are distinct, and at most E_loc of them
 * live on one rank), so its receive buffer holds at most R_max = ep * c * min(k, E_loc) rows of
 * H activations per direction -- DESIGN.md's E_p*k*c*H*b with E_p the ep degree, tightened by
 * min(k, E_loc) -- whatever the router does; the owner's expert intermediates are those of R_max
 * rows and the source's buffers those of c tokens. Routing that would exceed it (duplicate
 * experts in a token's top-k) is refused on every rank before anything is sent.
 *
 * Overlap (the pipelined schedule, plain EP): the chunks form a software pipeline. In forward,
 * iteration i issues, in this order: chunk i+1's gather and dispatch on the op stream (no host
 * wait yet; backend event FM_MOE_EP_EVENT and a communicator mark after it); chunk i's expert
 * GEMMs (after joining chunk i's row exchange); then the host waits for chunk i+1's dispatch
 * only (event_sync FM_MOE_EP_EVENT: the "MoE offsets" sync point, one per chunk as before; it
 * waits for the op stream up to chunk i+1's dispatch, behind chunk i-1's GEMMs, while chunk i's
 * GEMMs stay queued, so the device does not idle), agrees chunk i+1's count table (the host
 * all-reduce; the device runs chunk i's GEMMs meanwhile), uploads its permutation (copy_async on
 * the op stream) and issues chunk i+1's row exchange to the owners (fm_comm_all_to_all_v_async,
 * after the mark); then chunk i's outputs back to their sources (async, after chunk i's GEMMs);
 * then chunk i-1's combine and scatter (after joining chunk i-1's return). So chunk i+1's
 * dispatch exchange overlaps chunk i's expert GEMMs, and chunk i's combine exchange overlaps
 * chunk i+1's dispatch and GEMMs. Backward, iteration j: chunk j+1's gather/dispatch, chunk j's
 * expert recompute, chunk j+1's agreement and row exchange, chunk j's outputs back, chunk j's
 * combine backward, dye out, chunk j's expert backward, its row gradients back (async), chunk
 * j-1's dispatch backward and scatter: chunk j+1's dispatch overlaps chunk j's recompute GEMMs
 * and chunk j's input-gradient return overlaps chunk j+1's; the round trip between a chunk's
 * recompute and its backward (outputs back, combine backward, dye out) stays exposed, since
 * the owner's expert intermediates are one set. The communication stream is FIFO, so the
 * exchanges are issued in the order that keeps each behind only what it needs. The caller issues
 * "chunk i's expert GEMMs" (fm_moe_ep_next's work): the step that delivers chunk i's work has
 * issued everything before them (chunk i+1's gather and dispatch, chunk i's join), the step after
 * it issues everything after them, in the order above.
 * Buffers this needs twice (fm_moe_ep_bound: sets = 2): the receive buffer, the source's
 * outgoing and returned rows, the owner's permutation (device and host), its expert offsets and
 * the all-to-all counts; the route index and router weights thrice (three chunks' routing is
 * live: the one being combined, the one at the owners, the one being dispatched); the expert
 * intermediates, the count table and the rest once.
 * Which schedule runs (fm_moe_ep_ws.schedule, set after layout from FLATMOE_EP_SCHEDULE; the
 * count table carries it, so ranks that differ fail at chunk 0 alike): FM_MOE_EP_AUTO (the
 * default) pipelines when the
 * communicator has async exchanges (fm_comm_has_async: nccl) and the layout has two sets;
 * FM_MOE_EP_SERIAL runs the chunks one after another (today's order); FM_MOE_EP_PIPELINED
 * pipelines on any communicator (on the blocking self and mpi communicators the exchanges then
 * complete at once: the same results, no overlap -- the tests compare it with the serial one).
 * Both schedules do the same arithmetic on the same rows in the same order per chunk, and the
 * experts' weight gradients accumulate chunk by chunk in the same order, so every output and
 * gradient is bit-identical between them. Least-loaded placement (LLEP) runs serially (its
 * layout has one set): a spilled chunk's weight exchange would need the hosted experts' weights
 * twice as well.
 *
 * Least-loaded placement (LLEP, arXiv 2601.17111; fm_moe_llep.h), an option of the layout: per
 * chunk, from the agreed count table (no extra collective), when the busiest rank's routed rows
 * exceed lambda (1.3) x the mean, the heaviest experts' rows spill in contiguous ranges to the
 * least-loaded ranks. The native rank sends each spilled expert's weights to its helpers (3
 * all_to_all_v: gate, up, down) before the chunk's experts run, and in backward the helpers send
 * that expert's weight gradients back (3 more), which the native rank adds to its own (with
 * d->bias, gpt_oss: the expert's biases, gate [I], up [I], down [H], packed into one run of
 * B = 2I + H per expert, travel in a 4th all_to_all_v beside the weights, which the helper unpacks
 * into the hosted experts' bias arrays; their gradients come back packed the same way in a 4th,
 * added into the native rank's bias gradients as the weights' are); sources
 * pack their outgoing rows by helper (one gather) and unpack the returned rows (one scatter). A
 * helper hosts at most max_foreign experts per chunk and never more rows than the plain bound
 * R_max, so the receive buffer and expert intermediates keep plain EP's bound; LLEP adds the
 * hosted experts' weights (biases) and gradients and the native rank's staging (fm_moe_ep_bound.llep).
 * The weights sent are the stored ones (the caller's w); the caller runs the hosted experts in
 * the layer's precision from them (fp8: quantized per work into ws->hosted, operands of
 * max_foreign experts over R_max rows, also in the llep part). Exact as plain EP is (only which
 * rank runs which rows' GEMMs changes; fp8's wgrad tiles follow the rows, tests/test_model_ep.c). */
#ifndef FM_MOE_EP_H
#define FM_MOE_EP_H

#include "../comm/fm_comm.h"
#include "fm_moe_dispatch.h"
#include "fm_moe_llep.h"

/* The byte bound of one EP layer's chunk working set, by part (bytes, each buffer rounded as
 * fm_arena_alloc rounds; a = bytes per activation, R_max = ep * c * min(k, E_loc)):
 * S = sets (2 for plain EP: the pipelined schedule's second set; 1 with LLEP), T = 3 when S = 2
 * (three chunks' routing live), else 1:
 *   recv    = S*r(R_max*H*a)                      the receive buffer (both directions reuse it)
 *   send    = 2*S*r(c*k*H*a)                      the source's outgoing rows (x, then dye) and
 *                                                 returned rows (ye, then dxe)
 *   source  = 3*r(c*H*a) + (2+3T)*r(c*k*4)        the chunk's x, y|dy, dx rows; top-k idx, dw;
 *                                                 T x (w, route index row_route, route_row)
 *   experts = 3*r(R_max*H*a) + 6*r(R_max*I*a) + S*r(R_max*4)
 *                                                 owner: xe, ye|dye, dxe; h_gate, h_up, h_act,
 *                                                 dact, dh_gate, dh_up; the permutation
 *   llep    = 6*r(F*I*H*a) + 3*r(PM*I*H*a) + r(c*k*4) + fm_moe_fp8_bytes(d_host, R_max)
 *             (+ with d->bias: 3*r(F*B*a) + r(PM*B*a), B = 2I + H: the hosted experts' biases,
 *             their gradients, a helper's packed run of them and the native rank's staging)
 *                                                 (0 without LLEP; F = max_foreign,
 *                                                 PM = (ep-1)*min(F, E_loc)) hosted experts'
 *                                                 weights and gradients (gate, up, down), the
 *                                                 native rank's staging of the weights it sends
 *                                                 and the gradients it gets back, the sources'
 *                                                 packing order; with d->fp8 the hosted experts'
 *                                                 own quantized weights and operands (d_host =
 *                                                 fm_moe_ep_hosted_dims(d, F), R_max rows)
 *   device  = recv + send + source + experts + fp8 + llep   (what fm_moe_ep_ws_layout takes from `dev`)
 *   fp8     = fm_moe_fp8_bytes(d_loc, R_max)         with d->fp8 (0 otherwise): the experts'
 *                                                 quantized weights of E_loc experts and
 *                                                 operands of R_max rows (the owner's
 *                                                 exp_ws; d_loc = fm_moe_ep_local_dims)
 *   host    = r((E+1)*8) + S*r((E_loc+1)*8) + r(ep*(E+5)*8) + (4S+1)*r(ep*8) + S*r(R_max*4)
 *             (+ with LLEP: r(c*k*4) + 4*r(ep*8) + r((F+1)*8) + r(E*8) + r(PM*4) + the plan,
 *             fm_llep_plan_bytes; + with d->bias 4*r(ep*8), the biases' exchange counts)
 *                                                 expert offsets, the count table, the all-to-all
 *                                                 counts, displacements and cursors, the
 *                                                 permutation's host copy
 * None of it depends on N, on the routing or on L. */
typedef struct fm_moe_ep_bound {
    int64_t rows_max; /* R_max: rows a receiver may get per chunk per direction */
    int sets;         /* 2: plain EP, laid out for the pipelined schedule; 1: with LLEP (serial) */
    size_t recv, send, source, experts, fp8, llep, device, host;
} fm_moe_ep_bound;

/* Checks the EP geometry: ep >= 1, E % ep == 0, c >= 1, ep * (E+5) <= FM_COMM_HOST_MAX_ELEMS
 * (the count table travels through all_reduce_host). Errors: FM_ERR_ARG naming the value, the
 * expected one and the fix. */
fm_status fm_moe_ep_check(const fm_moe_dims *d, int ep, int64_t c);

/* The dims the experts see at an owner of ep ranks (E % ep == 0): d with E = E/ep (this rank's
 * experts), k = 1 (one row per route received) and the host offsets (sync_free false: the
 * owner's offsets come from the agreed count table); the precision fields (fp8, fp8_codes,
 * fp8_cache_layers) as d's. */
fm_moe_dims fm_moe_ep_local_dims(const fm_moe_dims *d, int ep);

/* The dims of E_host experts hosted for other ranks in a spilled chunk (least-loaded placement):
 * d with E = E_host, k = 1, sync_free false and no weight cache (fp8_cache_layers 0: hosted
 * experts change from chunk to chunk, their precision's form is made per work); fp8, fp8_codes
 * as d's. */
fm_moe_dims fm_moe_ep_hosted_dims(const fm_moe_dims *d, int64_t E_host);

/* The bound of the chunk working set of one EP layer (see fm_moe_ep_bound) for the global dims d
 * (E = all experts), ep ranks and cap c tokens per source per chunk, with least-loaded
 * placement when llep && llep->on; fills *b when non-NULL and returns b->device (0 when
 * fm_moe_ep_check fails). act_bytes: sizeof(fm_act) of the build the plan is for (4 CPU, 2 CUDA). */
size_t fm_moe_ep_bound_bytes(const fm_moe_dims *d, int ep, int64_t c, size_t act_bytes, const fm_llep_opts *llep,
                             fm_moe_ep_bound *b);

/* Which chunk schedule the operator runs (fm_moe_ep.h "Overlap"). */
typedef enum fm_moe_ep_schedule {
    FM_MOE_EP_AUTO = 0,  /* pipelined when the communicator has async exchanges and sets == 2 */
    FM_MOE_EP_SERIAL,    /* one chunk after another */
    FM_MOE_EP_PIPELINED, /* pipelined on any communicator (needs sets == 2; else serial) */
} fm_moe_ep_schedule;

/* The backend event the pipelined schedule records after a chunk's dispatch and the host waits
 * on (fm_backend.h's pool: past fm_offload_adamw's, below the optimizer overlap's). */
#define FM_MOE_EP_EVENT (FM_EVENT_FIRST_FREE + 64)

/* The working set of the EP operator for one chunk (any layer: nothing survives a chunk), laid
 * out once at launch. Pointers are backend memory unless marked host. With two sets (plain EP)
 * the per-chunk pointers below (recv, perm, perm_host, src.xe, src.ye, src.row_route,
 * src.route_row, topk_w, exp.offsets and the four count arrays) are views the operator points at
 * the current chunk's set (the *_s arrays). */
typedef struct fm_moe_ep_ws {
    int ep, rank;           /* the group's size and this rank's index in it */
    int64_t E_loc, c;       /* experts per rank; the per-source cap */
    int64_t rows_per_src;   /* c * min(k, E_loc): the most rows one source sends one owner */
    int64_t rows_max;       /* R_max = ep * rows_per_src */
    /* source side */
    int32_t *topk_idx;      /* [c,k] */
    float *topk_w, *dtopk_w; /* [c,k] */
    fm_act *xc, *yc, *dxc;  /* [c,H]: the chunk's inputs; outputs (forward) or output grads (backward); input grads */
    fm_moe_routes src;      /* over all E experts, c tokens: offsets [E+1] (host), row_route, route_row [c*k],
                               xe [c*k,H] (rows out: x, then dye), ye [c*k,H] (rows back: ye, then dxe);
                               h_gate, h_up, h_act are NULL */
    /* owner side */
    fm_act *recv;           /* [R_max,H] source-major rows (in, then out) */
    int32_t *perm;          /* [R_max]: expert-major row i is recv row perm[i] */
    fm_moe_routes exp;      /* over the E_loc local experts, R_max rows: offsets [E_loc+1] (host), xe, ye
                               [R_max,H], h_gate, h_up, h_act [R_max,I]; row_route, route_row NULL */
    fm_moe_ws exp_ws;       /* the experts' backward: dye (= exp.ye), dxe [R_max,H], dact, dh_gate, dh_up
                               [R_max,I] */
    /* host */
    int64_t *table;         /* [ep, E+5]: per rank its E counts, K, chunk size, error flag, c, options */
    int64_t *send_counts, *send_displs, *recv_counts, *recv_displs; /* [ep], elements */
    int64_t *cursor;        /* [ep] scratch */
    int32_t *perm_host;     /* [R_max] */
    /* least-loaded placement (llep.on; otherwise these are NULL and spill is false) */
    fm_llep_opts llep;
    int64_t F, pairs_max;   /* hosted experts per rank; (ep-1)*min(F, E_loc) */
    fm_llep_plan plan;      /* the current chunk's placement (host) */
    bool spill;             /* the current chunk moves rows */
    int64_t rows_out;       /* the current chunk's outgoing rows (n*k) */
    int32_t *pack, *pack_host;          /* [c*k]: outgoing row i is expert-major row pack[i] */
    fm_act *fw[3], *fg[3];  /* [F, I*H] each: hosted experts' gate, up, down weights and gradients */
    fm_act *stage[3];       /* [PM, I*H] each: weights out to helpers, their gradients back */
    int32_t *pair_local;    /* [PM] host: the local expert of each staged pair */
    int64_t *load;          /* [E] host: rows per expert in the chunk */
    int64_t *foff;          /* [F+1] host: the hosted experts' row offsets (from 0) */
    int64_t *wsend_counts, *wsend_displs, *wrecv_counts, *wrecv_displs; /* [ep] host, elements */
    /* with d->bias (NULL otherwise), B = 2I + H: hosted experts' biases and gradients [F*B] each, as
     * gate [F,I], up [F,I], down [F,H] at offsets 0, F*I, 2F*I; a helper's packed biases in and
     * gradients out [F,B]; the native rank's staging [PM,B] (expert e's run: gate, up, down) */
    fm_act *fb, *fbg, *bpack, *bstage;
    int64_t *bsend_counts, *bsend_displs, *brecv_counts, *brecv_displs; /* [ep] host, elements */
    fm_moe_ws hosted;       /* with d->fp8: the hosted experts' own precision operands (fm_moe_ws_fp8_layout
                               over F experts, R_max rows, no weight cache); the rest NULL */
    /* the pipelined schedule's sets (sets == 2; NULL otherwise) */
    int sets;                    /* 2 or 1 (fm_moe_ep_bound.sets) */
    fm_moe_ep_schedule schedule; /* auto after layout; the caller's (FLATMOE_EP_SCHEDULE) by fm_moe_ep_ws_set_schedule */
    bool schedule_bad;           /* FLATMOE_EP_SCHEDULE held another value: refused at the first chunk */
    fm_act *recv_s[2], *xe_s[2], *ye_s[2];
    int32_t *perm_s[2], *perm_host_s[2];
    int64_t *exp_off_s[2], *cnt_s[2][4]; /* host: expert offsets; send counts/displs, recv counts/displs */
    int32_t *row_route_s[3], *route_row_s[3];
    float *topk_w_s[3];
    /* measured (reset by the caller when it wants; the operator only raises them) */
    int64_t pipelined_calls; /* forward and backward calls that ran the pipelined schedule */
    int64_t recv_rows_high; /* most rows this rank received in one chunk */
    int64_t send_rows_high; /* most rows this rank sent in one chunk */
    int64_t llep_chunks;    /* chunk passes (forward and backward each count) whose placement moved rows */
} fm_moe_ep_ws;

/* Lays out w from `dev` (backend memory; fm_moe_ep_bound.device bytes) and `host` (host memory
 * the backend can copy to asynchronously -- pinned on a GPU, as fm_moe_routes_layout's `host`:
 * the dispatch's expert offsets are written there by the backend; .host bytes) for the global dims d, an ep group of size ep in which this rank is `rank`, cap
 * c, and least-loaded placement llep (NULL or llep->on false: plain EP; every rank of the group
 * must pass the same). A measuring arena gives the bytes. With d->fp8 the owner's experts working
 * set (w->exp_ws) also holds the fp8 operands (fm_moe_ws_fp8_layout over fm_moe_ep_local_dims(d),
 * R_max rows). With d->bias and LLEP it also holds the hosted experts' biases (fb, fbg, bpack,
 * bstage and the counts bsend_* / brecv_*). Errors: those of fm_moe_ep_check; FM_ERR_ARG for a rank outside [0, ep), LLEP
 * options out of range (lambda < 1, alpha <= 0, min_piece < 1, max_foreign < 1), or d->fp8 with
 * least-loaded placement (the hosted experts arrive as weights, not quantized copies).
 * w->schedule is auto (fm_moe_ep_ws_set_schedule sets another). */
fm_status fm_moe_ep_ws_layout(fm_moe_ep_ws *w, fm_arena *dev, fm_arena *host, const fm_moe_dims *d, int ep,
                              int rank, int64_t c, const fm_llep_opts *llep);

/* Sets the schedule w runs (after fm_moe_ep_ws_layout, which leaves auto): schedule is an
 * fm_moe_ep_schedule (0 auto, 1 serial, 2 pipelined: the CLI's FLATMOE_EP_SCHEDULE, carried in
 * fm_backend_opts.ep_schedule), for A/B runs of the trainer (the same losses bit for bit; the step
 * time shows the overlap). Every rank of a group must pass the same (mpirun -x). Any other value
 * (-1: the variable held another word) does not fail here: the first forward or backward refuses
 * it on every rank of the group (FM_ERR_ARG, naming the rank). */
void fm_moe_ep_ws_set_schedule(fm_moe_ep_ws *w, int schedule);

/* The number of chunks every rank of the group runs: K = max over ranks of ceil(N_r / c) (at
 * least 1: a group whose ranks all have zero tokens still runs one chunk). A collective call
 * (all_reduce_host max) on comm; N >= 0, c >= 1. Each rank's chunks then hold ceil((N-j)/K)
 * <= c tokens (fm_moe_chunk_size) in the strided order fm_moe_chunk_order(tok, N, K).
 * timeout_s: as fm_comm.h (0: the communicator's default). Errors: FM_ERR_ARG (N < 0, c < 1:
 * local, before the collective), the communicator's (FM_ERR_IO: a timeout or transport error). */
fm_status fm_moe_ep_chunks(const fm_comm *comm, int64_t N, int64_t c, double timeout_s, int64_t *K);

/* ---- a pass over the chunks, driven by the MoE glue (the operator moves rows and never calls an
 * expert: Megatron-Core's token dispatcher, whose dispatch and combine phases surround the
 * experts' forward(permuted_tokens, tokens_per_expert) in the MoE layer) -------------------------
 * A pass is begun (fm_moe_ep_fwd_begin / fm_moe_ep_bwd_begin) and then stepped by
 * fm_moe_ep_next, which per chunk issues the operator's dispatch phase and hands the caller the
 * rows this rank computes (fm_moe_ep_work); the caller runs the experts on them (any precision:
 * model/fm_experts.h's tables) and calls fm_moe_ep_next again, which issues the combine phase
 * (outputs or input gradients back to their sources) and the next chunk's dispatch, in the
 * schedule's order ("Overlap" above: under the pipelined schedule the call that delivers chunk
 * i's rows has already issued chunk i+1's gather and dispatch, and the call after chunk i's
 * experts issues chunk i+1's row exchange before chunk i's return). A forward pass delivers one
 * work per chunk (kind FORWARD); a backward pass two (the recompute, FORWARD, then BACKWARD).
 *
 *   fm_moe_ep_pass p;  fm_moe_ep_work *wk;
 *   FM_TRY(fm_moe_ep_fwd_begin(&p, ...));
 *   while ((st = fm_moe_ep_next(&p, &wk)) == FM_OK && wk) { run the experts on *wk }
 *   FM_TRY(st);
 */

typedef enum fm_moe_ep_work_kind {
    FM_MOE_EP_WORK_FORWARD = 0, /* the experts' forward: r->h_gate, h_up, h_act [rows,I] and r->ye [rows,H]
                                   from r->xe */
    FM_MOE_EP_WORK_BACKWARD,    /* their backward, right after this chunk's FORWARD work: from rws->dye [rows,H]
                                   rws->dxe assigned and the weight gradients accumulated (+=) */
} fm_moe_ep_work_kind;

/* One chunk's rows at this rank (all views of the working set; valid until the next
 * fm_moe_ep_next). Each part is the expert-major rows of one dispatch with k = 1 (one row per
 * route), as model/fm_experts.h's tables take them: the caller runs part 1 with
 * fm_moe_ep_local_dims' dims and this rank's E_loc experts' weights (in its precision's form,
 * quantized into rws when fp8: the working set's exp_ws holds those operands), and part 2, when
 * hosted_E > 0, with hd and hw (the hosted experts' weights as stored: the caller makes their
 * precision's form into hws). An empty part (0 rows) needs no call. */
typedef struct fm_moe_ep_work {
    fm_moe_ep_work_kind kind;
    int64_t chunk;         /* 0-based, of the pass's K */
    /* part 1: this rank's own experts (rank*E_loc ..), offsets [E_loc+1] host in r */
    int64_t rows;          /* their rows (Rn) */
    fm_moe_routes *r;      /* xe, h_gate, h_up, h_act, ye [R_max rows] (ws->exp) */
    fm_moe_ws *rws;        /* dye, dxe, dact, dh_gate, dh_up and the precision's operands (ws->exp_ws) */
    /* part 2: least-loaded placement, a spilled chunk: the experts hosted here for other ranks
     * (hosted_E 0 otherwise), their rows after part 1's */
    int64_t hosted_E, hosted_rows;
    fm_moe_dims hd;        /* H, I, E = hosted_E, k = 1, d's precision, no weight cache */
    fm_moe_routes hr;      /* offsets [hosted_E+1] host (from 0), the buffers of r past part 1's rows */
    fm_moe_ws hws;         /* rws's buffers past part 1's rows; the precision's operands: ws->hosted's */
    fm_moe_weights hw;     /* gate, up [hosted_E,I,H], down [hosted_E,H,I] and, with d->bias, their biases
                              b_gate, b_up [hosted_E,I], b_down [hosted_E,H]: received from their native ranks */
    fm_moe_grads hg;       /* their weight (and bias) gradients: zeroed before a BACKWARD work, after it sent
                              back and added into the native ranks' g */
} fm_moe_ep_work;

/* One chunk in flight in a pass: its tokens, rows received, the marks and tickets of its exchanges. */
typedef struct fm_moe_ep_chunk {
    int64_t n, R;
    const int32_t *tok;
    int mark;   /* the op stream after this chunk's last op before an exchange */
    int ticket; /* its latest exchange */
} fm_moe_ep_chunk;

/* A pass's state (the caller's, on its stack; filled by the begin functions, read only by the
 * operator). */
typedef struct fm_moe_ep_pass {
    const fm_backend *be;
    const fm_comm *comm;
    const fm_moe_dims *d;
    fm_moe_dims dl;           /* the dims at the owner (fm_moe_ep_local_dims) */
    const fm_moe_weights *w;  /* this rank's experts as stored (a spilled chunk sends them to helpers) */
    const fm_moe_grads *g;    /* backward: their gradients (a spilled chunk's hosted gradients added here) */
    fm_moe_ep_ws *ws;
    double timeout_s;
    const char *what;         /* "forward" | "backward" */
    int64_t K;
    bool pipe;                /* the pipelined schedule */
    bool backward;
    /* the layer's tensors */
    fm_act *y, *dx;
    float *dtopk_w;
    const fm_act *x, *dy;
    const int32_t *topk_idx, *chunk_tokens;
    const float *topk_w;
    int64_t N;
    /* progress */
    int64_t err;              /* this rank's chunk-0 flag (fm_moe_ep_internal.h) */
    int64_t j, start;         /* the chunk whose work is out; the next chunk's first token in chunk_tokens */
    int stage;                /* 0: none out; 1: j's FORWARD work out; 2: j's BACKWARD work out; 3: done */
    fm_moe_ep_chunk ch[3];    /* chunk i at ch[i % 3] */
    fm_moe_ep_work work;
} fm_moe_ep_pass;

/* Begins a forward pass over this rank's N tokens: y [N,H] (assigned) = sum_j topk_w[n,j] *
 * expert_{topk_idx[n,j]}(x[n]) once every chunk's work has been run, with x [N,H] fm_act,
 * topk_idx [N,k] int32 (values in [0,E), distinct per token) and topk_w [N,k] fp32, all backend
 * memory; the experts of topk_idx live on their owners. w: this rank's E_loc experts as stored
 * (gate and up [E_loc,I,H], down [E_loc,H,I]: experts rank*E_loc ..; with d->bias their biases
 * b_gate, b_up [E_loc,I], b_down [E_loc,H] too), read only to send a spilled chunk's experts to
 * their helpers. comm: the ep group (its size and rank those of ws's
 * layout); its buffers must be the backend's memory (or host memory when the backend's memory is
 * host memory: the CPU). d: the global dims. K: the agreed chunk count (fm_moe_ep_chunks),
 * chunk_tokens [N] int32 backend memory (fm_moe_chunk_order(., N, K)). A collective pass: every
 * rank of comm runs it with its own N (0 allowed: x, y, topk may then be NULL), stepping it to
 * its end. timeout_s: per collective (0: the default). Errors of the begin and of every
 * fm_moe_ep_next (the same on every rank: the checks travel in the first chunk's count table):
 *   FM_ERR_ARG  a rank's schedule (fm_moe_ep_ws_set_schedule) is not auto, serial or pipelined,
 *               or it runs another schedule than the others; a rank's working set was laid out
 *               with another cap or placement options, a rank's K differs from another's, or
 *               K < 1, or a chunk of a rank holds more than c tokens (K < ceil(N/c)), or a rank
 *               would send more than c*min(k,E_loc) rows to one owner (duplicate experts in a
 *               token's top-k) -- naming the rank; comm's size/rank differ from ws's; the comm's
 *               memory is host memory but the backend's is not; with least-loaded placement, w
 *               (or, backward, g) carries biases but ws was laid out without d->bias, or the
 *               other way round (local, before any collective);
 *   FM_ERR_IO   a collective failed or timed out (the communicator's message, with the chunk):
 *               the process must stop (fm_comm_mpi_abort). */
fm_status fm_moe_ep_fwd_begin(fm_moe_ep_pass *p, const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                              const fm_moe_weights *w, fm_act *y, const fm_act *x, const int32_t *topk_idx,
                              const float *topk_w, int64_t N, int64_t K, const int32_t *chunk_tokens,
                              fm_moe_ep_ws *ws, double timeout_s);

/* Begins a backward pass: dx [N,H] and dtopk_w [N,k] assigned from dy [N,H] once every work has
 * been run, this rank's experts' weight gradients g (shapes of w) accumulated (+=) by the
 * caller's BACKWARD works over every rank's tokens routed to them (and, for a spilled chunk, by
 * the operator adding the hosted gradients its helpers send back); each chunk's forward is
 * recomputed first (its FORWARD work). Arguments, collective rules and errors: the forward's. */
fm_status fm_moe_ep_bwd_begin(fm_moe_ep_pass *p, const fm_backend *be, const fm_comm *comm, const fm_moe_dims *d,
                              const fm_moe_weights *w, const fm_moe_grads *g, fm_act *dx, float *dtopk_w,
                              const fm_act *dy, const fm_act *x, const int32_t *topk_idx, const float *topk_w,
                              int64_t N, int64_t K, const int32_t *chunk_tokens, fm_moe_ep_ws *ws,
                              double timeout_s);

/* Steps a pass: finishes the work handed out last (its rows' outputs or input gradients back to
 * their sources, combined or scattered there) and issues what comes before the next work, into
 * *work (NULL when the pass is done: every output or gradient written). Every rank of the group
 * steps alike (the exchanges are collectives), a rank with no rows too. After an error the pass
 * is done (*work NULL). Errors: those of the begin functions. */
fm_status fm_moe_ep_next(fm_moe_ep_pass *p, fm_moe_ep_work **work);

#endif
