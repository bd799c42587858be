/* flatmoe command line: train | sample | eval | plan | calibrate. Parsing and printing only; the work is in
 * the library. This file dispatches to the command (cli_<command>.c) and prints the top help. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static void top_help(void) {
    printf("flatmoe: train Mixture-of-Experts language models with every memory peak bounded at launch\n\n"
           "usage: flatmoe <command> [flags]\n\ncommands:\n"
           "  train    train a model from a Hugging Face config.json on text or token shards\n"
           "  sample   generate text from a checkpoint\n"
           "  eval     validation loss and perplexity of a checkpoint on files\n"
           "  plan     memory per live set, FLOPs and projected step time for a config and shape, without running\n"
           "  calibrate  measure this backend's rates for plan's step-time projection (configs/calib/)\n"
           "  prepare  tokenize text and JSONL files into token shards with loss masks\n\n"
           "'flatmoe <command> --help' lists a command's flags.\n");
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        top_help();
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "train")) return cmd_train(argc - 2, argv + 2);
    if (!strcmp(cmd, "sample")) return cmd_sample(argc - 2, argv + 2);
    if (!strcmp(cmd, "eval")) return cmd_eval(argc - 2, argv + 2);
    if (!strcmp(cmd, "plan")) return cmd_plan(argc - 2, argv + 2);
    if (!strcmp(cmd, "calibrate")) return cmd_calibrate(argc - 2, argv + 2);
    if (!strcmp(cmd, "prepare")) return cmd_prepare(argc - 2, argv + 2);
    fprintf(stderr, "flatmoe: unknown command '%s'; expected train, sample, eval, plan, calibrate or prepare ('flatmoe --help')\n", cmd);
    return 2;
}
