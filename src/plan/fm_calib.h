/* The calibration table (docs/plan.md "Calibration table"): the measured rates of one device
 * kind that the step-time projection (fm_project.h) turns FLOPs and bytes into seconds with.
 * Written by `flatmoe calibrate` (fm_calibrate.h) as JSON, read with cJSON; shipped per kind in
 * configs/calib/<kind>.json. When none is found the planner uses a built-in default table and
 * says so.
 *
 * Rates that depend on a size are curves of (x, rate) points, interpolated linearly in log x and
 * held constant beyond the first and last point: GEMM FLOP/s against M (rows), grouped expert
 * GEMM FLOP/s against rows per expert, causal attention FLOP/s against the sequence length T
 * (short sequences run slower). FLOP counts are the projection's (fm_project.h), so a rate
 * measured with them and a time projected with them agree by construction.
 */
#ifndef FM_CALIB_H
#define FM_CALIB_H

#include <stdbool.h>
#include <stddef.h>

#include "../core/fm_core.h"

#define FM_CALIB_FORMAT "flatmoe-calibration"
#define FM_CALIB_VERSION 1
#define FM_CALIB_MAX_POINTS 16

typedef struct fm_calib_curve {
    int n;                            /* points, ascending x, 0..FM_CALIB_MAX_POINTS */
    double x[FM_CALIB_MAX_POINTS];    /* rows, rows per expert, or T */
    double rate[FM_CALIB_MAX_POINTS]; /* FLOP/s, > 0 */
} fm_calib_curve;

typedef struct fm_calib {
    char backend[8];      /* "cpu" or "cuda": the backend that measured it */
    char device[128];     /* the device's name (cudaGetDeviceProperties, or the CPU's model name) */
    char kind[32];        /* the file's kind: "cpu", "h200", ... (configs/calib/<kind>.json) */
    char source[600];     /* where it came from: the file path, or "built-in default (...)" */
    int act_bytes;        /* bytes of an activation element on that backend (4 CPU, 2 CUDA) */
    double peak_flops;    /* the dense peak MFU is measured against (H100/H200 bf16: 989e12) */
    fm_calib_curve gemm;        /* dense GEMM [M,K]x[K,N], K = N = hidden-sized, by M */
    fm_calib_curve expert_fwd;  /* grouped expert GEMM forward, by rows per expert */
    fm_calib_curve expert_bwd;  /* grouped expert GEMM backward (dx and dW), by rows per expert */
    fm_calib_curve expert_fwd_sm90, expert_bwd_sm90; /* the same for the sm90 kernel
                                  (FLATMOE_EXPERT_GEMM=sm90), measured when calibrate runs with it;
                                  n = 0: absent (the projection then uses expert_fwd/bwd) */
    fm_calib_curve expert_fwd_fp8, expert_bwd_fp8; /* --expert-precision fp8 on E4M3 codes (the
                                  backend's fp8 code ops, quantization included), measured when
                                  the backend serves them; n = 0: absent (the projection then
                                  uses the sm90 curves, else expert_fwd/bwd) */
    fm_calib_curve att_fwd;     /* causal attention forward (2 B T^2 heads hd FLOPs), by T */
    fm_calib_curve att_bwd;     /* causal attention backward (5 B T^2 heads hd FLOPs), by T */
    double elementwise_bw;      /* B/s of a bandwidth-bound elementwise op (add: 3 n a bytes) */
    double dispatch_bw;         /* B/s of the MoE gather and combine (row moves) */
    double adamw_bw;            /* B/s of the AdamW step (fm_project_adamw_bytes per parameter) */
    double fp8_weight_quant_bw; /* B/s of fp8_quant_weight, 4 bytes counted per weight element (bf16
                                   read, the codes and the transposed codes written), measured with
                                   the fp8 curves (optional in the file: "bandwidth"."fp8_weight_quant");
                                   0: absent (the projection then uses elementwise_bw) */
    double h2d, d2h;            /* B/s of copy_async between device and pinned memory, each alone */
    double h2d_duplex, d2h_duplex; /* B/s of each direction while both run at once */
    double context_bytes;       /* device bytes the CUDA context and libraries take (0 CPU) */
    double host_pinnable_bytes; /* the measuring host's default --host-mem-budget (0: unknown) */
    /* The links a mesh's collectives cross (plan/fm_mesh.h), B/s per GPU per direction: within a
     * node (NVLink) and across nodes (InfiniBand). Optional in the file ("mesh_link": {"intra_node",
     * "inter_node", "measured"}); absent, fm_calib_mesh_link_default's NOMINAL figures, not
     * measured (mesh_link_measured false). */
    double intra_node_bw, inter_node_bw;
    bool mesh_link_measured;
} fm_calib;

/* The nominal mesh links of a backend: "cuda" an H200 HGX node, NVLink 450 GB/s per direction per
 * GPU within a node (NVLink 4, 18 links x 25 GB/s) and 50 GB/s per GPU across nodes (one 400 Gb/s
 * InfiniBand NDR adapter per GPU); "cpu" 5 GB/s both (MPI over shared memory / Ethernet, a guess).
 * Nominal datasheet figures, not measured: the achieved bus bandwidth of NCCL is lower. Sets
 * intra_node_bw, inter_node_bw and mesh_link_measured = false. Never fails. */
void fm_calib_mesh_link_default(fm_calib *c, const char *backend);

/* The built-in default table for a backend ("cpu" or "cuda"), with source set to say so. The
 * CUDA one is an H200 (bf16) estimate from the measurements of issue 10 (docs/plan.md); the CPU
 * one a small two-core machine's. Never fails. */
void fm_calib_default(fm_calib *c, const char *backend);

/* Loads and validates a table. Errors: FM_ERR_IO (cannot read `path`), FM_ERR_FORMAT naming the
 * file and the field that is missing, of the wrong type, out of range (rates must be finite and
 * > 0, curve x ascending and > 0, at most FM_CALIB_MAX_POINTS points) or of another format or
 * version, with the fix (re-run `flatmoe calibrate`). */
fm_status fm_calib_load(fm_calib *c, const char *path);

/* Writes a table as JSON to `path` (written under a temporary name, then renamed). Errors:
 * FM_ERR_IO naming the path. */
fm_status fm_calib_save(const fm_calib *c, const char *path);

/* The table for planning a run on `backend` ("cpu" or "cuda"): `path` when given (errors of
 * fm_calib_load), else <dir>/<kind>.json when dir is a non-empty folder name (the CLI passes
 * FLATMOE_CALIB_DIR: fm_backend_opts.calib_dir; NULL: none), else <source
 * dir>/configs/calib/<kind>.json (found as <binary's folder>/../configs/calib), else, for an installed
 * binary, <binary's folder>/../share/flatmoe/calib/<kind>.json (kind: "cpu"; for CUDA the device kind from `device_name` ("h200"
 * for an NVIDIA H200, "h100", ...), or "h200" when the name is NULL), else the built-in default
 * (not an error: *note says which was used, e.g. for printing). A shipped file that exists but is
 * malformed is an error. */
fm_status fm_calib_find(fm_calib *c, const char *path, const char *dir, const char *backend, const char *device_name,
                        char note[1400]);

/* The kind ("h200", "h100", "a100", "cpu", else a lowercase token of the name) of a device. */
void fm_calib_kind_of(const char *backend, const char *device_name, char kind[32]);

/* A curve's rate at x (> 0): linear in log x between points, constant beyond the ends. */
double fm_calib_rate(const fm_calib_curve *cv, double x);

/* Appends a point (x ascending is the caller's duty). No-op when the curve is full. */
void fm_calib_add(fm_calib_curve *cv, double x, double rate);

#endif
