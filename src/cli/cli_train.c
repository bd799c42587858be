/* flatmoe train: the flags into the run spec (run/fm_run_spec.h; with --resume the run's own from
 * its state.json), its trainer options, then fm_train. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "io/fm_checkpoint.h"
#include "comm/fm_comm.h"
#include "comm/fm_comm_nccl.h"
#include "plan/fm_plan.h"
#include "run/fm_spec_check.h"
#include "run/fm_spec_finetune.h"
#include "run/fm_spec_resume.h"
#include "train/fm_signal.h"
#include "train/fm_trainer.h"

/* --init-from DIR with a tokenizer.json: its ids must fit DIR's config.json vocab_size. */
static fm_status init_tokenizer_fits(const char *dir) {
    char tj[4200], cj[4200];
    snprintf(tj, sizeof tj, "%s/tokenizer.json", dir);
    snprintf(cj, sizeof cj, "%s/config.json", dir);
    if (access(tj, R_OK) != 0 || access(cj, R_OK) != 0) return FM_OK;
    fm_config cfg;
    FM_TRY(fm_config_load(&cfg, cj));
    fm_tokenizer tok;
    FM_TRY(fm_tokenizer_load(&tok, tj));
    fm_status s = cli_tokenizer_fits(&tok, cfg.vocab_size, cj, NULL);
    fm_tokenizer_free(&tok);
    return s;
}

int cmd_train(int argc, char **argv) {
    static fm_run_spec sp; /* every flag (run/fm_spec_flags.c rows of train) */
    fm_spec_default(&sp, FM_CMD_TRAIN);
    int r = cli_parse_spec("train", "(--config C | --init-from DIR) --data FILES [flags]", argc, argv, &sp);
    if (r) return r == 1 ? 0 : r;
    fm_status s;
    int rank = 0, size = 1; /* many ranks: rank 0 prints what every rank would */
    (void)fm_comm_launcher(&rank, &size, NULL);
    char ft_out[512]; /* --init-from without --out: runs/ft-NAME, before the resume looks there */
    if ((s = fm_spec_finetune_out(&sp, ft_out, sizeof ft_out))) return cli_fail("train", s);
    if (ft_out[0] && rank == 0 && !sp.train.quiet) printf("%s\n", ft_out);
    const bool steps_given = fm_spec_given(&sp, "steps"), epochs_given = fm_spec_given(&sp, "epochs");
    /* --resume: the run's own flags from its latest state.json, the ones given again overriding them */
    /* (said under --quiet too: these are not step lines) */
    if ((s = fm_spec_resume(&sp, rank == 0, NULL))) return cli_fail("train", s);
    if (steps_given && sp.train.epochs > 0) /* the epochs count the steps (fm_train_setup): --steps would be ignored */
        return cli_fail("train", fm_error(FM_ERR_ARG, "--steps %lld and --epochs %lld%s contradict each other: the epochs "
                                          "decide the number of steps; drop --steps, or give --epochs 0 to train "
                                          "--steps steps", (long long)sp.train.steps, (long long)sp.train.epochs,
                                          epochs_given ? "" : " (the run's)"));
    /* --init-from starting a run (not a --resume of one): the flags not given take fine-tuning
     * values (run/fm_spec_finetune.h), said once */
    char ft_said[512] = "", latest[4096];
    const bool resuming = sp.train.resume && fm_ckpt_find_latest(sp.train.out_dir, latest, sizeof latest, NULL) == FM_OK;
    if (!resuming && (s = fm_spec_finetune_defaults(&sp, ft_said, sizeof ft_said))) return cli_fail("train", s);
    if (ft_said[0] && rank == 0 && !sp.train.quiet) printf("%s\n", ft_said);
    if ((s = fm_spec_check(&sp))) return cli_fail("train", s);
    fm_train_opts o = fm_spec_train_opts(&sp);
    if ((s = fm_backend_opts_from_env(&o.backend))) return cli_fail("train", s); /* FLATMOE_* -> init options */
    if ((s = cli_test_hooks_from_env(&o.test_hooks))) return cli_fail("train", s); /* FLATMOE_TEST_* */
    char *spec_json = fm_spec_to_json(&sp); /* saved whole in each checkpoint's state.json; freed after the run */
    if (!spec_json) return cli_fail("train", fm_error(FM_ERR_NOMEM, "out of memory for the run spec"));
    o.spec_json = spec_json;
    o.threads_env = cli_threads_env(); /* OMP_NUM_THREADS, the node's ranks: --threads 0's choice */
    static char init_dir[4096]; /* --init-from a flatmoe run folder: its latest checkpoint (an HF-format folder) */
    if (o.init_from) {
        char probe[4200];
        snprintf(probe, sizeof probe, "%s/config.json", o.init_from);
        if (access(probe, R_OK) != 0 && fm_ckpt_find_latest(o.init_from, init_dir, sizeof init_dir, NULL) == FM_OK) {
            if (!o.quiet && rank == 0) printf("--init-from %s: its latest checkpoint, %s\n", o.init_from, init_dir);
            o.init_from = init_dir;
        }
    }
    if (o.init_from && (s = init_tokenizer_fits(o.init_from))) return cli_fail("train", s);
    fm_stop_install(); /* SIGINT/SIGTERM: finish the step, save, exit 128 + signal; a second one: at once */
    s = fm_train(&o);
    free(spec_json); /* cJSON's allocator (fm_spec_to_json) */
    o.spec_json = NULL;
    /* many ranks: a failure on one rank ends every rank (the message names this one); success
     * finalizes MPI when the world initialized it */
    if (s && size > 1) {
        fflush(stdout);
        char own[32]; /* messages that already name the rank are not prefixed twice */
        snprintf(own, sizeof own, "rank %d of %d: ", rank, size);
        const char *msg = fm_errmsg();
        if (!strncmp(msg, own, strlen(own))) msg += strlen(own);
        fprintf(stderr, "flatmoe train: error on rank %d of %d: %s\nflatmoe train: rank %d ends the job (MPI_Abort)\n",
                rank, size, msg, rank);
        fflush(stderr);
        fm_comm_mpi_abort(s == FM_ERR_ARG ? 2 : 1);
        return s == FM_ERR_ARG ? 2 : 1;
    }
    if (!s && fm_comm_mpi_finalize() != FM_OK) return cli_fail("train", FM_ERR_IO);
    if (s) return cli_fail("train", s);
    const int sig = fm_stop_requested(); /* stopped by SIGINT/SIGTERM after a checkpoint: 128 + signal */
    return sig ? 128 + sig : 0;
}
