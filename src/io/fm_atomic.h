/* Atomic file replacement (src/io's, also data/'s loss-mask writer): write "<path>.tmp", fsync it, rename it over
 * `path`, fsync the parent folder. A reader sees the old file or the complete new one, never a
 * partial one, and a failure at any point removes the .tmp file and leaves `path` untouched.
 *
 * Every write, fsync and rename first calls fm_fault_hit() and treats `true` as a failed call
 * with EIO (fault injection for tests, STYLE.md "SQLite and Redis"). The fsync of the parent
 * folder after the rename is not a fault point: the new file is already in place by then, and a
 * fault there would report failure for a file that was in fact replaced.
 */
#ifndef FM_ATOMIC_H
#define FM_ATOMIC_H

#include <limits.h>

#include "../core/fm_core.h"

#ifndef PATH_MAX
#define PATH_MAX 4096
#endif

typedef struct fm_atomic_file {
    int fd; /* -1 when not open */
    char path[PATH_MAX];
    char tmp[PATH_MAX];
} fm_atomic_file;

/* Creates (truncating) "<path>.tmp" for writing. FM_ERR_ARG when the path is too long, FM_ERR_IO
 * (path, errno text) when it cannot be created. On error nothing is left to clean up. */
fm_status fm_atomic_open(fm_atomic_file *f, const char *path);

/* Appends n bytes (any size; loops over partial writes). On error the file is aborted. */
fm_status fm_atomic_write(fm_atomic_file *f, const void *data, size_t n);

/* fsync, close, rename over `path`, fsync the parent folder. On error the .tmp file is removed
 * and `path` is untouched (unless the error is the final folder fsync, which says so). */
fm_status fm_atomic_commit(fm_atomic_file *f);

/* Closes and removes the .tmp file. Safe after a failed call and on a closed file. */
void fm_atomic_abort(fm_atomic_file *f);

/* fsync of a folder (so a rename or a new entry in it is durable). FM_ERR_IO on failure.
 * `fault_point`: whether fm_fault_hit() is consulted first. */
fm_status fm_fsync_dir(const char *dir, bool fault_point);

/* fsync of the folder holding `path` ("." when the path has no '/'). */
fm_status fm_fsync_parent(const char *path, bool fault_point);

#endif
