#include "fm_core.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local char g_errmsg[2048];

fm_status fm_error(fm_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_errmsg, sizeof g_errmsg, fmt, ap);
    va_end(ap);
    return status;
}

const char *fm_errmsg(void) { return g_errmsg; }

const char *fm_status_name(fm_status s) {
    switch (s) {
    case FM_OK: return "FM_OK";
    case FM_ERR_ARG: return "FM_ERR_ARG";
    case FM_ERR_IO: return "FM_ERR_IO";
    case FM_ERR_FORMAT: return "FM_ERR_FORMAT";
    case FM_ERR_CONFIG: return "FM_ERR_CONFIG";
    case FM_ERR_NOMEM: return "FM_ERR_NOMEM";
    case FM_ERR_NUMERIC: return "FM_ERR_NUMERIC";
    case FM_ERR_UNSUPPORTED: return "FM_ERR_UNSUPPORTED";
    }
    return "FM_ERR_?";
}

FM_NORETURN void fm_abort(const char *file, int line, const char *msg) {
    fflush(stdout);
    fprintf(stderr, "flatmoe: internal error at %s:%d: %s\n", file, line, msg);
    abort();
}

static int64_t g_fault_countdown = 0; /* 0: disabled */

void fm_fault_set(int64_t n) { g_fault_countdown = n; }

bool fm_fault_hit(void) {
    if (g_fault_countdown <= 0) return false;
    if (--g_fault_countdown == 0) return true;
    return false;
}

void *fm_malloc(size_t bytes) {
    if (fm_fault_hit()) return NULL;
    if (bytes == 0) bytes = 1;
    if (bytes > SIZE_MAX - 63) return NULL; /* the rounding below would wrap */
    size_t rounded = (bytes + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, rounded);
    if (p) memset(p, 0, rounded);
    return p;
}

void fm_free(void *ptr) { free(ptr); }
