/* The logging callback: one process-wide sink (fm_log.h). */
#include "fm_log.h"

#include <stdio.h>
#include <stdlib.h>

static fm_log_fn log_fn;
static void *log_user;

void fm_log_set(fm_log_fn fn, void *user) {
    log_fn = fn;
    log_user = user;
}

void fm_logv(fm_log_level level, const char *fmt, va_list ap) {
    if (!log_fn) return;
    char small[1024];
    va_list ap2;
    va_copy(ap2, ap);
    const int n = vsnprintf(small, sizeof small, fmt, ap2);
    va_end(ap2);
    if (n < 0) return;
    if ((size_t)n < sizeof small) {
        log_fn(log_user, level, small);
        return;
    }
    const size_t cap = (size_t)n + 1 < 65536 ? (size_t)n + 1 : 65536;
    char *big = malloc(cap);
    if (!big) { /* no memory for the long form: the cut one still says something */
        log_fn(log_user, level, small);
        return;
    }
    vsnprintf(big, cap, fmt, ap);
    log_fn(log_user, level, big);
    free(big);
}

void fm_log(fm_log_level level, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fm_logv(level, fmt, ap);
    va_end(ap);
}

void fm_log_stdio(void *user, fm_log_level level, const char *text) {
    (void)user;
    if (level == FM_LOG_INFO) { /* progress lines: seen as they come, also through a pipe or a file */
        fputs(text, stdout);
        fflush(stdout);
        return;
    }
    fflush(stdout);
    fputs(text, stderr);
    fflush(stderr);
}
