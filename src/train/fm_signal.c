/* Graceful stop on SIGINT / SIGTERM (fm_signal.h). */
#define _POSIX_C_SOURCE 200809L
#include "fm_signal.h"

#include <signal.h>
#include <string.h>

static volatile sig_atomic_t g_stop;   /* the first stop signal this process received (or fm_stop_request's) */
static volatile sig_atomic_t g_follow; /* a stop another rank received, followed here (fm_stop_follow); kept
                                        * apart so that this process's own first signal is not its second */

static void on_stop(int sig) {
    if (g_stop) { /* the second signal: no more waiting for the step */
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    g_stop = sig;
}

void fm_stop_install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    g_stop = 0;
    g_follow = 0;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

int fm_stop_requested(void) { return g_stop ? (int)g_stop : (int)g_follow; }

void fm_stop_request(int sig) { g_stop = sig; }

void fm_stop_follow(int sig) { g_follow = sig; }

const char *fm_signal_name(int sig) {
    static char buf[16];
    if (sig == SIGINT) return "SIGINT";
    if (sig == SIGTERM) return "SIGTERM";
    memcpy(buf, "signal ", 7);
    int n = sig < 0 ? 0 : sig > 99 ? 99 : sig;
    int p = 7;
    if (n >= 10) buf[p++] = (char)('0' + n / 10);
    buf[p++] = (char)('0' + n % 10);
    buf[p] = 0;
    return buf;
}
