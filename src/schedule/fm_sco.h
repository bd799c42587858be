/* Selective checkpoint offload (SCO; arXiv 2609.14306), a schedule policy: the first n_off
 * checkpoint boundaries in forward order (boundary 0 .. n_off-1; never boundary L, the head's
 * input) are copied to pinned host memory once their layer's forward has read them, and brought
 * back in backward just before the layer that reads them, so that on the device they share two
 * rotating slots (boundary l lives in slot l % 2; the layout, model/fm_layout.c, points them
 * there: fm_layout_opts.n_offloaded_boundaries).
 *
 * Order, with 2 slots s = l % 2 and events on the backend's streams (backend/fm_backend.h):
 *   forward, BEFORE_FORWARD(l), l+1 < n_off: compute waits for the last copy of slot (l+1) % 2
 *     (the copy-out of boundary l-1) before layer l writes boundary l+1 there;
 *   forward, AFTER_FORWARD(l), l < n_off: an event on compute after layer l (the last reader of
 *     boundary l, and after whatever wrote it); the copy-out stream waits for it and copies
 *     boundary l to host slot l; the slot's event is recorded after the copy;
 *   backward, BEFORE_BACKWARD(l) (before the layer's recompute), l < n_off: if boundary l is not
 *     on its way back (l = L-1: no layer above prefetched it) it is copied in now; compute waits
 *     for its copy-in; then boundary l-1 is prefetched on the copy-in stream into the other slot
 *     (after compute's last read of it, boundary l+1's backward, and after all copy-outs), so it
 *     arrives while layer l runs. At most two restored boundaries sit on the device.
 * Every offloaded boundary is restored from the host copy, also the last one or two, which the
 * slots still hold from the forward (a residency shortcut is left for later: it saves two copies
 * per micro-batch). On the CPU every copy completes at once; the events order nothing there.
 *
 * Bound (DESIGN.md §2), beside the policy as fm_recompute.h's:
 *   device boundaries = (L+1 - n_off + min(n_off, 2)) x N x H x b   (the residual-stream part
 *     of the boundaries live set; n_off = 0: L+1 tensors; n_off = 1: still L+1, boundary 0 has a
 *     slot of its own and only gains a host copy; n_off >= 2: L+3 - n_off, down to 3 at n_off = L)
 *   host (pinned) = n_off x N x H x b   (each rounded to 64 bytes as the arenas round)
 * with b = sizeof(fm_act). Loss and gradients are bit-identical to no offload: a copy is exact.
 * Plain twin: no offload (n_off = 0), every boundary in its own tensor. */
#ifndef FM_SCO_H
#define FM_SCO_H

#include "fm_schedule.h"

/* Events the policy uses: FM_EVENT_FIRST_FREE + FM_SCO_EVENT_BASE .. + FM_SCO_EVENTS - 1. */
#define FM_SCO_EVENT_BASE 0
#define FM_SCO_EVENTS 4

typedef struct fm_sco {
    int64_t n_off;     /* offloaded boundaries, 0 .. L */
    int64_t L;
    size_t bytes;      /* one boundary: N_cap x H x sizeof(fm_act) */
    fm_arena host;     /* pinned: n_off boundaries of `bytes` (rounded) */
    fm_act **host_b;   /* [n_off] host copies */
    int64_t in_flight[2]; /* the boundary whose copy-in into slot s was issued this backward (-1: none) */
    int ev_compute, ev_out, ev_slot[2];
    uint64_t copies_out, copies_in; /* counts since create (tests, reports) */
} fm_sco;

/* Parses --offload-boundaries for a model of L layers: NULL, "" or "0": off; "all": L (every
 * boundary but L); an integer in [0, L]. Errors: FM_ERR_ARG naming the flag, the value found
 * and the range. */
fm_status fm_sco_parse(const char *spec, int64_t L, int64_t *n_off);

/* The policy's bound: residual-stream tensors on the device, L+1 - n_off + min(n_off, 2)
 * (fm_model_boundary_tensors), and host bytes, n_off x round64(N x H x act_bytes). */
int64_t fm_sco_device_boundaries(int64_t L, int64_t n_off);
size_t fm_sco_host_bytes(int64_t N, int64_t H, int64_t n_off, size_t act_bytes);

/* Creates the policy for model m, whose layout offloads m->a.n_offloaded_boundaries boundaries
 * (fm_layout_opts.n_offloaded_boundaries; 0 is allowed and does nothing): its pinned host arena
 * of fm_sco_host_bytes from m's backend, sized at launch for m's laid-out shape. Errors:
 * FM_ERR_NOMEM naming the bytes. */
fm_status fm_sco_create(fm_sco *p, fm_model *m);

/* Adds the policy as a hook of s (fm_schedule_add_hook) and records in s that it restores the
 * layout's offloaded boundaries. Errors: fm_schedule_add_hook's. */
fm_status fm_sco_attach(fm_sco *p, fm_schedule *s);

/* The hook itself (what fm_sco_attach adds; user = the fm_sco). Never fails. */
fm_status fm_sco_hook(void *user, fm_model *m, fm_hook_point point, int64_t layer);

/* Frees the host arena; call before the backend is freed. Safe on a zeroed p. */
void fm_sco_free(fm_sco *p);

#endif
