/* Checkpoints of the sharded trainers (--zero 1, --zero 3, --ep; README "Checkpoints") through one
 * bounded host staging buffer, whatever n_params: the host live set "checkpoint staging".
 *
 * Save (rank 0 writes): the safetensors header is known from the tables before any data, so
 * rank 0's writer (io/fm_safetensors.h, fetch_range) writes it and then streams each tensor in
 * pieces of at most C elements, in file order; for each piece every rank takes part in one
 * all-to-all-v over a host-memory world communicator in which the piece's owners send their
 * (at most one, contiguous) part of it to rank 0: the ZeRO-1/2 shard ranges (rank q holds flat
 * [q S, (q + 1) S)), the ZeRO-3 pieces (fm_zero3.h: group g's element b_g + i on dp rank
 * i / p_g) and whole parts, and under --ep the lowest world rank that holds an expert's tensor
 * (every rank holds the replicated ones: rank 0 sends them to itself). The other ranks walk the
 * same (file, tensor, piece) sequence. The files are the bytes fm_ckpt_write writes from full
 * host buffers (the same writer and header; tests/mpi_ckpt.sh compares them).
 *
 * Load (every rank): each rank reads only the element ranges of its own storage (its shard's
 * intersection with every tensor, its experts, or everything for replicas) from
 * optimizer.safetensors with pread (fm_st_read_f32_range, dtype converted), C elements at a
 * time, and checks model.safetensors' same ranges against the master (rounded to the stored
 * dtype); resume at another world size therefore reads other ranges of the same files. ZeRO-3's
 * initial weights are drawn the same way, range by range into the shard (fm_ckpt_stream_init_zero3;
 * the draw is counter-based, fm_params_init_weights_range).
 *
 * Bound: two host buffers of C_e = min(C, the largest tensor's elements) fp32 each (a piece
 * being received and the sender's own part; on load, the piece and its model-file check):
 * 8 C_e bytes per rank, allocated once at fm_ckpt_stage_init (the plan's line "checkpoint
 * staging", fm_ckpt_stage_bound). C is FM_CKPT_CHUNK_ELEMS (the test hook
 * FLATMOE_TEST_CKPT_CHUNK=N sets it to N elements, to cut tensors into many pieces). */
#ifndef FM_TRAIN_CKPT_STREAM_H
#define FM_TRAIN_CKPT_STREAM_H

#include "../comm/fm_comm.h"
#include "../model/fm_config.h"
#include "../core/fm_test_hooks.h"

/* The timeout of a save's collectives (and the barrier after it): while rank 0 writes (and
 * fsyncs a file of tens of GB) the others wait in the next piece's exchange, which
 * --comm-timeout's default 300 s would otherwise count (the larger of the two is used). */
#define FM_CKPT_SAVE_TIMEOUT_S (4.0 * 3600.0)

/* Elements of one staged piece (4 Mi: 16 MiB per buffer, 32 MiB in all). */
#define FM_CKPT_CHUNK_ELEMS ((int64_t)4 << 20)

/* States a checkpoint names per tensor: the weights (model file), master., exp_avg., exp_avg_sq.
 * and bf16-kahan's buffer (FM_KAHAN_PREFIX). */
#define FM_CKPT_MAX_STATES 5

struct fm_ckpt_src;

typedef struct fm_ckpt_stage {
    int64_t chunk;          /* C_e: elements per piece */
    float *send, *recv;     /* [chunk] each, host memory: one allocation of `bytes` */
    size_t bytes;           /* 8 C_e: the bound */
    size_t high;            /* high-water mark of the bytes in use at once (save or load) */
    fm_comm host;           /* several ranks: the world over host memory (mpi) */
    bool host_ok;
    double timeout_s;       /* the save's collectives' (FM_CKPT_SAVE_TIMEOUT_S or --comm-timeout) */
    int64_t *cnt;           /* [4 W]: all-to-all-v counts and displacements */
    int n_full;             /* tensors of the checkpoint's table (--ep: all experts) */
    int *owner;             /* [n_full]: the lowest world rank holding tensor i */
    bool *shared;           /* [n_full]: every rank holds tensor i (replicated, or ZeRO-3's pieces) */
    int64_t *lo;            /* [n_full]: offset of tensor i in this rank's table (-1: not held) */
    int *z3world;           /* [z3.W]: the lowest world rank of ZeRO-3 rank q */
    struct fm_ckpt_src *src; /* [4 n_full]: the writer's fetch contexts */
    void *states;           /* the save's state descriptors (fm_train_ckpt_stream.c) */
} fm_ckpt_stage;

/* The bound of the staging (bytes) for pieces of `chunk` elements (<= 0: FM_CKPT_CHUNK_ELEMS)
 * when the largest tensor has max_numel elements: 8 min(chunk, max_numel). */
size_t fm_ckpt_stage_bound(int64_t max_numel, int64_t chunk);

/* The largest tensor of a config (elements: the embedding or head V H, an attention projection,
 * one expert's or the dense MLP's [I, H]), for the plan's line. */
int64_t fm_ckpt_max_tensor_numel(const fm_config *c);

/* The chunk in effect: the test hook's (FLATMOE_TEST_CKPT_CHUNK, fm_test_hooks.ckpt_chunk_elems)
 * when > 0, else FM_CKPT_CHUNK_ELEMS. h may be NULL (no hooks). */
int64_t fm_ckpt_chunk_elems(const fm_test_hooks *h);

#endif
