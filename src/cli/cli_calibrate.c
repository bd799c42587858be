/* flatmoe calibrate: measures this build's backend's rates into a calibration table for the
 * planner's step-time projection (plan/fm_calibrate.h). On a GPU:
 *   flatmoe-cuda calibrate --out configs/calib/h200.json */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "backend/fm_backend.h"
#include "plan/fm_calibrate.h"

static void print_line(void *user, const char *line) {
    (void)user;
    printf("%s\n", line);
    fflush(stdout);
}

int cmd_calibrate(int argc, char **argv) {
    static fm_run_spec sp; /* the flags (run/fm_spec_flags.c rows of calibrate) */
    fm_spec_default(&sp, FM_CMD_CALIBRATE);
    int r = cli_parse_spec("calibrate", "--out FILE [--backend cpu|cuda] [--quick]", argc, argv, &sp);
    if (r) return r == 1 ? 0 : r;
    const char *out = sp.calibrate.out, *backend = sp.calibrate.backend;
    const bool quick = sp.calibrate.quick;
    const int threads = sp.calibrate.threads;
    if (!out) return cli_usage_error("calibrate", "%s", "--out is required (e.g. --out configs/calib/cpu.json)");
    const char *mine = sizeof(fm_act) == 4 ? "cpu" : "cuda";
    if (backend && strcmp(backend, "cpu") && strcmp(backend, "cuda"))
        return cli_usage_error("calibrate", "--backend: expected cpu or cuda, found '%s'", backend);
    if (backend && strcmp(backend, mine))
        return cli_usage_error("calibrate", "--backend %s: this binary measures its own backend; run flatmoe-cuda "
                               "calibrate for cuda, flatmoe calibrate for cpu", backend);
    if (threads < 0) return cli_usage_error("calibrate", "%s", "--threads must be >= 0 (0 = all cores)");
    fm_backend_opts bo = fm_backend_opts_default();
    fm_status s = fm_backend_opts_from_env(&bo); /* FLATMOE_EXPERT_GEMM=sm90: the sm90 expert curves too */
    if (s) return cli_fail("calibrate", s);
    const fm_calibrate_opts o = {quick, threads, print_line, NULL, &bo};
    fm_calib c;
    s = fm_calibrate_run(&o, &c);
    if (s) return cli_fail("calibrate", s);
    if ((s = fm_calib_save(&c, out))) return cli_fail("calibrate", s);
    printf("wrote %s (%s, kind %s)\n", out, c.device, c.kind);
    return 0;
}
