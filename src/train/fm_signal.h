/* A graceful stop of a training run on SIGINT or SIGTERM: the first signal only records itself
 * (the loop finishes the current step, writes a checkpoint and returns FM_ERR_INTERRUPTED); a
 * second one restores the default action and re-raises, so the process ends at once.
 * POSIX sigaction with SA_RESTART (interrupted reads and writes of a checkpoint are restarted,
 * not failed). */
#ifndef FM_SIGNAL_H
#define FM_SIGNAL_H

#include <stdbool.h>

/* Installs the handlers for SIGINT and SIGTERM (the CLI calls it before fm_train; a library user
 * that never calls it keeps its own handlers, and fm_stop_requested stays 0). Calling it again
 * clears a recorded signal. */
void fm_stop_install(void);

/* The signal number (SIGINT 2, SIGTERM 15) of the first stop signal received since
 * fm_stop_install, else that of fm_stop_follow's, or 0. Async-signal-safe to read. */
int fm_stop_requested(void);

/* Records `sig` as if it had been received (tests and embedders that stop a run themselves). */
void fm_stop_request(int sig);

/* Records a stop that another rank of the launch received (the trainer's agreed stop flag): from
 * now fm_stop_requested returns `sig` (the run stops alike and exits 128 + sig) while no signal of
 * this process's own came, but it is not this process's first signal: one arriving later is
 * recorded as the first, not taken for a second (which would end the process at once, unsaved). */
void fm_stop_follow(int sig);

/* "SIGINT", "SIGTERM" or "signal N" (a static string; N up to 99). */
const char *fm_signal_name(int sig);

#endif
