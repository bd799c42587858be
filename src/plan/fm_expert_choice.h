/* The expert GEMMs' form of a CUDA run (issue 14): FLATMOE_EXPERT_GEMM=auto, the default, picks
 * our sync-free sm90 kernel (backend/cuda/sm90/gg_sm90.h) or cuBLAS's grouped call by the
 * calibration table's projected time; sm90, cublas, grouped and loop force one form. The trainer
 * (train/fm_train_setup.c) and `flatmoe plan` (cli/cli_plan.c) decide it the same way, so plan
 * and train agree, and the trainer creates its backend with the result (fm_expert_choice.gemm
 * into fm_backend_opts.expert_gemm): no setter, no extra host synchronization.
 *
 * The rule (auto): sm90 when all of these hold, else cuBLAS (the backend's cublas form):
 *   - the CUDA backend in bf16 (not the CPU build's fp32);
 *   - not --expert-precision fp8 (its fake quantization feeds the cuBLAS forms);
 *   - no expert parallelism (--ep and a mesh's ep <= 1: the all-to-all needs the counts on the host);
 *   - the kernel serves the shape (fm_cuda_sm90_expert_gemm_serves: E, H, I, N k rows);
 *   - the device is compute capability 9.0 (a plan for the table's device takes the table's word:
 *     its sm90 curves were measured running the kernel);
 *   - the table has both sm90 curves (expert_fwd_sm90, expert_bwd_sm90);
 *   - fm_project_expert_s (the expert GEMMs' seconds per step: the three products forward and
 *     backward at k c / E rows per expert of a chunk of c tokens, and the forwards recomputed) is
 *     smaller with the sm90 curves than with cuBLAS's; a tie is cuBLAS.
 * The chunk size and the form are decided together: fm_expert_choice_prepare marks the request
 * (fm_plan_req.expert_gemm_auto) so that the chooser's projection (fm_plan_fit) times every
 * candidate at its own better form, and fm_expert_choice_finish settles the form at the chunk it
 * chose (the same comparison, so the printed projection is the chosen form's).
 * Plain arithmetic, no device, no I/O. */
#ifndef FM_EXPERT_CHOICE_H
#define FM_EXPERT_CHOICE_H

#include "../backend/fm_backend_opts.h"
#include "fm_calib.h"
#include "fm_plan.h"

/* Why the form is what it is. */
typedef enum fm_expert_why {
    FM_EXPERT_WHY_FORCED = 0,  /* FLATMOE_EXPERT_GEMM named the form */
    FM_EXPERT_WHY_FASTER,      /* auto: sm90 projected faster */
    FM_EXPERT_WHY_NOT_FASTER,  /* auto: cuBLAS projected as fast or faster */
    FM_EXPERT_WHY_NOT_CUDA,    /* not the CUDA backend in bf16 (the CPU runs its own loop) */
    FM_EXPERT_WHY_EP,          /* --ep (or a mesh's ep) > 1 */
    FM_EXPERT_WHY_SHAPE,       /* the sm90 kernel does not serve the layer's shape */
    FM_EXPERT_WHY_DEVICE,      /* the device is not compute capability 9.0 */
    FM_EXPERT_WHY_NO_CURVES,   /* the calibration table has no sm90 curves */
    FM_EXPERT_WHY_FP8,         /* --expert-precision fp8: its emulation runs the cuBLAS forms */
} fm_expert_why;

/* What the decision is asked with, besides the request and the table. */
typedef struct fm_expert_ask {
    fm_expert_gemm requested; /* FLATMOE_EXPERT_GEMM (fm_backend_opts.expert_gemm; auto when unset) */
    bool cuda_bf16;           /* the run's backend is CUDA in bf16 */
    bool device_sm90;         /* its device runs the sm90 kernel (fm_backend_default_expert_sm90_ok;
                                 a cross plan: true, the table's device) */
    bool cpu_fp8_codes;       /* off CUDA: the test hook FLATMOE_TEST_FP8_CODES=1 (fm_backend_opts
                                 .cpu_fp8_codes): the CPU backend serves the FP8 code path */
} fm_expert_ask;

typedef struct fm_expert_choice {
    fm_expert_gemm requested; /* as asked */
    fm_expert_gemm gemm;      /* what the backend is created with: requested, with auto resolved to
                                 sm90 or cublas on CUDA (left auto off CUDA, which ignores it) */
    bool sm90;                /* the expert GEMMs run as the sm90 kernel (fm_plan_req.expert_sync_free) */
    bool fp8_codes;           /* --expert-precision fp8 on E4M3 codes (fm_plan_req.expert_fp8_codes):
                                 our FP8 grouped GEMM; form "fp8-sm90" (on the CPU, the test
                                 hook FLATMOE_TEST_FP8_CODES=1's reference ops: "fp8-cpu-codes") */
    fm_expert_why why;
    bool projected;           /* sm90_s and cublas_s hold both forms' times (the table has the sm90
                                 curves and the run is CUDA; else both 0) */
    double sm90_s, cublas_s;  /* fm_project_expert_s of each form: seconds per step */
    double rows_per_expert;   /* fm_project_rows_per_expert of the plan */
    int64_t E, H, I;          /* the layer's shape (for the message) */
    int ep;                   /* the expert-parallel degree asked (for the message) */
} fm_expert_choice;

/* Decides the form for request r, planned as p (its chunk: p->moe_c_eff), with table cb, as this
 * header's rule says. Reads r's shape, B, T, ep, mesh and chunk; ignores its expert_sync_free and
 * expert_gemm_auto. Forced forms: sm90 runs the kernel only where the CUDA run can (bf16, ep <= 1,
 * served; the backend refuses a device that is not 9.0); the others never. Never fails. */
void fm_expert_choose(const fm_plan_req *r, const fm_plan *p, const fm_expert_ask *a, const fm_calib *cb,
                      fm_expert_choice *out);

/* Before fm_plan_fit: sets r->expert_sync_free (forced sm90 where the run can) and
 * r->expert_gemm_auto (auto with every condition of the rule but the time and ep met: a mesh
 * search may change the mesh's ep, and fm_project_expert_sm90 keeps ep > 1 on cuBLAS), clears
 * them otherwise. Never fails. */
void fm_expert_choice_prepare(fm_plan_req *r, const fm_expert_ask *a, const fm_calib *cb);

/* After fm_plan_fit picked r's knobs and planned p: fm_expert_choose, then r->expert_sync_free =
 * out->sm90 and r->expert_gemm_auto = false (a projection of r from here on times the chosen
 * form). Never fails. */
void fm_expert_choice_finish(fm_plan_req *r, const fm_plan *p, const fm_expert_ask *a, const fm_calib *cb,
                             fm_expert_choice *out);

/* "sm90", "cublas", "grouped", "loop": the form the run's expert GEMMs take (sm90 forced on an
 * unserved shape: "cublas"); "cpu" off CUDA (the CPU backend's own per-expert GEMMs). */
const char *fm_expert_choice_form(const fm_expert_choice *ch);

/* The reason as words, e.g. "auto: projected 39.1 ms per step against cuBLAS 58.2 ms at 512 rows
 * per expert; FLATMOE_EXPERT_GEMM forces one" (NUL-terminated, truncated to n). */
void fm_expert_choice_why(const fm_expert_choice *ch, char *buf, size_t n);

/* The one line plan and train print (no newline): "expert GEMM: <form> (<why>)". */
void fm_expert_choice_line(const fm_expert_choice *ch, char *buf, size_t n);

/* The choice as one JSON object (no newline), e.g. {"form":"sm90","requested":"auto",
 * "why":"faster","sm90_s":0.0391,"cublas_s":0.0582,"rows_per_expert":512} (the times null when
 * not projected), for plan --json and the trainer's metrics header. Errors: FM_ERR_ARG when it
 * does not fit buf[cap] (buf then ""); FM_EXPERT_CHOICE_JSON_MAX always fits. */
#define FM_EXPERT_CHOICE_JSON_MAX 256
fm_status fm_expert_choice_json(const fm_expert_choice *ch, char *buf, size_t cap);

/* --expert-precision fp8's path (model/fm_experts_fp8.h), decided before the backend exists, as
 * the backend's expert_fp8_serves then answers: the fast path on E4M3 codes for a CUDA run on an
 * sm_90 device (a->device_sm90) with FLATMOE_EXPERT_GEMM auto or sm90 (cublas, grouped and loop
 * keep the emulation, the plain twin), or on the CPU under FLATMOE_TEST_FP8_CODES=1 (the code
 * ops' reference); hidden and intermediate sizes multiples of 128, at most 256 experts, the
 * dispatch's rows (B T k) and the padded token count below 2^31; under --ep the same for the
 * owner's E/ep experts over ep x B T x min(k, E/ep) rows (its receive bound for any cap). False
 * without fp8. */
bool fm_expert_fp8_codes(const fm_plan_req *r, const fm_expert_ask *a);

/* Why fm_expert_fp8_codes(r, a) is false, as one clause naming the input and the value found
 * (e.g. "--expert-precision is bf16", "hidden_size 96 and moe_intermediate_size 128 are not both
 * multiples of 128 (...)", "FLATMOE_EXPERT_GEMM=cublas keeps the emulation (...)"), for the errors
 * of --fp8-weight-cache; "" when it is true. Writes at most cap bytes (cap >= 1). Never fails. */
void fm_expert_fp8_codes_why(const fm_plan_req *r, const fm_expert_ask *a, char *buf, size_t cap);

#endif
