/* The logging callback (DESIGN.md §8, ggml's ggml_log_set habit): library code never prints; it
 * hands each line to the sink the client installed. The CLI's sink writes FM_LOG_INFO to stdout
 * and every other level to stderr, verbatim; with no sink installed the lines are dropped.
 *
 * A line is the caller's text exactly as it would have been printed, its own "\n" included, so a
 * sink that writes it unchanged reproduces the output byte for byte. Levels:
 *   FM_LOG_INFO   progress and results (step lines, the plan, "resumed from ...")
 *   FM_LOG_NOTE   something the user may want to know ("note: ...")
 *   FM_LOG_WARN   something likely wrong that does not stop the run ("warning: ...")
 *   FM_LOG_ERROR  a failure being reported before a status is returned
 * The sink is process-wide (one client per process); set it before any library call and do not
 * change it while other threads may log. fm_log itself is thread-safe when the sink is. */
#ifndef FM_LOG_H
#define FM_LOG_H

#include <stdarg.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fm_log_level { FM_LOG_INFO = 0, FM_LOG_NOTE, FM_LOG_WARN, FM_LOG_ERROR } fm_log_level;

/* Receives one formatted line (NUL-terminated; at most 64 KiB, longer text is cut) and the
 * user pointer given to fm_log_set. */
typedef void (*fm_log_fn)(void *user, fm_log_level level, const char *text);

/* Installs the sink (NULL: drop every line). */
void fm_log_set(fm_log_fn fn, void *user);

/* Formats (printf) and hands the text to the sink. */
void fm_log(fm_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void fm_logv(fm_log_level level, const char *fmt, va_list ap);

/* The sink the CLI installs: FM_LOG_INFO to stdout, flushed (progress lines are read live, by
 * people and by tests following a run), the others to stderr (stdout flushed first, so the two
 * streams interleave in order), written unchanged. */
void fm_log_stdio(void *user, fm_log_level level, const char *text);

#ifdef __cplusplus
}
#endif

#endif
