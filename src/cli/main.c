/* flatmoe command line: train | sample | eval | plan | calibrate | report | version. Parsing and printing only; the work is in
 * the library. This file dispatches to the command (cli_<command>.c) and prints the top help. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "core/fm_log.h"
#include "train/fm_build_info.h"

static void top_help(void) {
    printf("flatmoe: train Mixture-of-Experts language models with every memory peak bounded at launch\n\n"
           "usage: flatmoe <command> [flags]\n\ncommands:\n"
           "  train    train a model from a Hugging Face config.json on text or token shards\n"
           "  sample   generate text from a checkpoint\n"
           "  eval     validation loss and perplexity of a checkpoint on files\n"
           "  plan     memory per live set, FLOPs and projected step time for a config and shape, without running\n"
           "  calibrate  measure this backend's rates for plan's step-time projection (configs/calib/)\n"
           "  report   draw a run's curves (loss, learning rate, tokens/s, expert load, memory) as PNG or SVG\n"
           "  prepare  tokenize text and JSONL files into token shards with loss masks\n"
           "  version  print flatmoe's version and the commit it was built from (also --version)\n\n"
           "'flatmoe <command> --help' lists a command's flags.\n");
}

int main(int argc, char **argv) {
    fm_log_set(fm_log_stdio, NULL); /* the library's lines: info to stdout, the rest to stderr */
    if (cli_comm_env_install() != FM_OK) { /* the launcher's variables, for comm/ (cli_env.c) */
        fprintf(stderr, "flatmoe: error: %s\n", fm_errmsg());
        return 1;
    }
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        top_help();
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--version") || !strcmp(cmd, "version")) {
        printf("flatmoe %s (commit %s, %s build)\n", fm_build_version(), fm_build_commit(), fm_build_backend());
        return 0;
    }
    if (!strcmp(cmd, "report")) return cmd_report(argc - 2, argv + 2);
    if (!strcmp(cmd, "train")) return cmd_train(argc - 2, argv + 2);
    if (!strcmp(cmd, "sample")) return cmd_sample(argc - 2, argv + 2);
    if (!strcmp(cmd, "eval")) return cmd_eval(argc - 2, argv + 2);
    if (!strcmp(cmd, "plan")) return cmd_plan(argc - 2, argv + 2);
    if (!strcmp(cmd, "calibrate")) return cmd_calibrate(argc - 2, argv + 2);
    if (!strcmp(cmd, "prepare")) return cmd_prepare(argc - 2, argv + 2);
    static const char *const cmds[] = {"train", "sample", "eval", "plan", "prepare", "calibrate", "report", "version"};
    const char *near = NULL;
    int best = 3; /* suggest within 2 edits */
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        const int d = cli_edit_distance(cmd, cmds[i]);
        if (d < best) best = d, near = cmds[i];
    }
    if (near) fprintf(stderr, "flatmoe: unknown command '%s'; did you mean '%s'? ('flatmoe --help' lists them)\n", cmd, near);
    else fprintf(stderr, "flatmoe: unknown command '%s'; expected train, sample, eval, plan, calibrate, report, prepare or version ('flatmoe --help')\n", cmd);
    return 2;
}
