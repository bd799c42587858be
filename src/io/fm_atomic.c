#define _GNU_SOURCE
#include "fm_atomic.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

fm_status fm_atomic_open(fm_atomic_file *f, const char *path) {
    f->fd = -1;
    f->path[0] = f->tmp[0] = '\0';
    if (!path || !*path) return fm_error(FM_ERR_ARG, "atomic write: empty output path");
    int a = snprintf(f->path, sizeof f->path, "%s", path);
    int b = snprintf(f->tmp, sizeof f->tmp, "%s.tmp", path);
    if (a < 0 || b < 0 || (size_t)b >= sizeof f->tmp)
        return fm_error(FM_ERR_ARG, "%s: path too long (limit %d bytes)", path, PATH_MAX - 5);
    if (fm_fault_hit())
        return fm_error(FM_ERR_IO, "%s: cannot create: %s (injected fault)", f->tmp, strerror(EIO));
    int fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        int e = errno;
        return fm_error(FM_ERR_IO, "%s: cannot create: %s%s", f->tmp, strerror(e),
                        e == ENOENT ? " (does the folder exist?)" : "");
    }
    f->fd = fd;
    return FM_OK;
}

void fm_atomic_abort(fm_atomic_file *f) {
    if (f->fd >= 0) {
        close(f->fd);
        f->fd = -1;
    }
    if (f->tmp[0]) unlink(f->tmp);
    f->tmp[0] = '\0';
}

fm_status fm_atomic_write(fm_atomic_file *f, const void *data, size_t n) {
    FM_ASSERT(f->fd >= 0);
    if (n == 0) return FM_OK;
    if (fm_fault_hit()) {
        fm_status s = fm_error(FM_ERR_IO, "%s: write of %zu bytes failed: %s (injected fault)",
                               f->tmp, n, strerror(EIO));
        fm_atomic_abort(f);
        return s;
    }
    const char *p = data;
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(f->fd, p + done, n - done);
        if (w < 0) {
            if (errno == EINTR) continue;
            int e = errno;
            fm_status s = fm_error(FM_ERR_IO, "%s: write of %zu bytes failed: %s%s", f->tmp,
                                   n - done, strerror(e),
                                   e == ENOSPC ? " (free some disk space)" : "");
            fm_atomic_abort(f);
            return s;
        }
        done += (size_t)w;
    }
    return FM_OK;
}

fm_status fm_fsync_dir(const char *dir, bool fault_point) {
    if (fault_point && fm_fault_hit())
        return fm_error(FM_ERR_IO, "%s: fsync of folder failed: %s (injected fault)", dir,
                        strerror(EIO));
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return fm_error(FM_ERR_IO, "%s: cannot open folder to fsync: %s", dir, strerror(errno));
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    /* Some file systems do not support fsync on a folder; that is not a failure to write. */
    if (rc != 0 && e != EINVAL && e != ENOTSUP)
        return fm_error(FM_ERR_IO, "%s: fsync of folder failed: %s", dir, strerror(e));
    return FM_OK;
}

fm_status fm_fsync_parent(const char *path, bool fault_point) {
    char dir[PATH_MAX];
    const char *slash = strrchr(path, '/');
    if (!slash) return fm_fsync_dir(".", fault_point);
    size_t len = (size_t)(slash - path);
    if (len == 0) len = 1; /* "/file" -> "/" */
    if (len >= sizeof dir) return fm_error(FM_ERR_ARG, "%s: path too long", path);
    memcpy(dir, path, len);
    dir[len] = '\0';
    return fm_fsync_dir(dir, fault_point);
}

fm_status fm_atomic_commit(fm_atomic_file *f) {
    FM_ASSERT(f->fd >= 0);
    fm_status s;
    if (fm_fault_hit()) {
        s = fm_error(FM_ERR_IO, "%s: fsync failed: %s (injected fault)", f->tmp, strerror(EIO));
        fm_atomic_abort(f);
        return s;
    }
    if (fsync(f->fd) != 0) {
        s = fm_error(FM_ERR_IO, "%s: fsync failed: %s", f->tmp, strerror(errno));
        fm_atomic_abort(f);
        return s;
    }
    int rc = close(f->fd);
    f->fd = -1;
    if (rc != 0) {
        s = fm_error(FM_ERR_IO, "%s: close failed: %s", f->tmp, strerror(errno));
        fm_atomic_abort(f);
        return s;
    }
    if (fm_fault_hit()) {
        s = fm_error(FM_ERR_IO, "%s: cannot rename to %s: %s (injected fault)", f->tmp, f->path,
                     strerror(EIO));
        fm_atomic_abort(f);
        return s;
    }
    if (rename(f->tmp, f->path) != 0) {
        s = fm_error(FM_ERR_IO, "%s: cannot rename to %s: %s", f->tmp, f->path, strerror(errno));
        fm_atomic_abort(f);
        return s;
    }
    f->tmp[0] = '\0';
    s = fm_fsync_parent(f->path, false);
    if (s != FM_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", fm_errmsg());
        return fm_error(s, "%s: written and renamed into place, but %s", f->path, why);
    }
    return FM_OK;
}
