/* libflatmoe's save (include/flatmoe.h flatmoe_save): the session's checkpoint through the
 * trainer's own writer (src/train/fm_train_ckpt.c: model.safetensors, optimizer.safetensors,
 * config.json, state.json with the run spec and the step; io/fm_checkpoint.h: a temporary
 * folder renamed when complete), so that `--ckpt DIR` reopens it and `flatmoe sample`/`eval` read it. */
#include <stdlib.h>
#include <string.h>

#include "../run/fm_spec_resume.h"
#include "fm_capi.h"

int flatmoe_save(flatmoe_session *s, const char *dir) {
    if (!s) return fm_error(FM_ERR_ARG, "flatmoe_save: the session is NULL");
    if (!dir || !dir[0])
        return fm_error(FM_ERR_ARG, "flatmoe_save: dir is %s; give the run folder the checkpoint goes under "
                        "(DIR/step_NNNNNN)", dir ? "empty" : "NULL");
    FM_TRY(fm_capi_awake(s, "flatmoe_save"));
    run *r = &s->r;
    fm_step_ws_flush(&r->step, &r->m); /* an overlapped update still in flight lands first */
    char *spec_json = fm_spec_to_json(&s->spec); /* state.json's "spec" (cJSON's allocator) */
    if (!spec_json) return fm_error(FM_ERR_NOMEM, "flatmoe_save: out of memory for the run spec");
    const char *out0 = s->o.out_dir, *spec0 = s->o.spec_json;
    s->o.out_dir = dir;
    s->o.spec_json = spec_json;
    s->ts.opt_step = r->opt.step;
    s->ts.threads = s->o.threads;
    const fm_status st = fm_train_save_checkpoint(r, &s->ts);
    s->o.out_dir = out0;
    s->o.spec_json = spec0;
    free(spec_json);
    return st;
}
