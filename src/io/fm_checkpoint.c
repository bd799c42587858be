#define _GNU_SOURCE
#include "fm_checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fm_atomic.h"

static const char *const k_ckpt_files[4] = {FM_CKPT_MODEL_FILE, FM_CKPT_OPTIM_FILE,
                                            FM_CKPT_CONFIG_FILE, FM_CKPT_STATE_FILE};

fm_status fm_write_file_atomic(const char *path, const void *data, size_t n) {
    if (n > 0 && !data) return fm_error(FM_ERR_ARG, "%s: NULL data for %zu bytes", path ? path : "?", n);
    fm_atomic_file f;
    FM_TRY(fm_atomic_open(&f, path));
    FM_TRY(fm_atomic_write(&f, data, n)); /* aborts (removes the .tmp) on failure */
    return fm_atomic_commit(&f);
}

fm_status fm_ckpt_read_text(const char *path, char **out_text) {
    if (!out_text) return fm_error(FM_ERR_ARG, "fm_ckpt_read_text: NULL out_text");
    *out_text = NULL;
    if (!path || !*path) return fm_error(FM_ERR_ARG, "fm_ckpt_read_text: empty path");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        return fm_error(FM_ERR_IO, "%s: cannot open: %s%s", path, strerror(e),
                        e == ENOENT ? " (incomplete checkpoint or wrong folder?)" : "");
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return fm_error(FM_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return fm_error(FM_ERR_IO, "%s: %s", path,
                        S_ISDIR(sb.st_mode) ? "is a folder, expected a file" : "not a regular file");
    }
    size_t n = (size_t)sb.st_size;
    char *buf = fm_malloc(n + 1);
    if (!buf) {
        close(fd);
        return fm_error(FM_ERR_NOMEM, "%s: out of memory for %zu bytes", path, n);
    }
    size_t done = 0;
    while (done < n) {
        ssize_t r = read(fd, buf + done, n - done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            int e = errno;
            close(fd);
            fm_free(buf);
            return fm_error(FM_ERR_IO, "%s: read failed after %zu of %zu bytes: %s", path, done, n,
                            r == 0 ? "file shrank while reading" : strerror(e));
        }
        done += (size_t)r;
    }
    close(fd);
    buf[n] = '\0';
    *out_text = buf;
    return FM_OK;
}

/* ----------------------------------------------------------------------------------------- */
/* Folder helpers                                                                            */

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    (void)ftw;
    remove(p); /* best effort: keep going so as much as possible is removed */
    return 0;
}

/* Removes a file or folder tree (no-op if missing). Returns false if something remains. */
static bool rm_rf(const char *path) {
    struct stat sb;
    if (lstat(path, &sb) != 0) return errno == ENOENT;
    nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return lstat(path, &sb) != 0 && errno == ENOENT;
}

static fm_status make_dir(const char *path) {
    if (fm_fault_hit())
        return fm_error(FM_ERR_IO, "%s: cannot create folder: %s (injected fault)", path, strerror(EIO));
    if (mkdir(path, 0755) != 0 && errno != EEXIST)
        return fm_error(FM_ERR_IO, "%s: cannot create folder: %s", path, strerror(errno));
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return fm_error(FM_ERR_IO, "%s: exists but is not a folder (move it away or pick another "
                                   "run folder)", path);
    return FM_OK;
}

/* mkdir -p. */
static fm_status make_dirs(const char *path);
fm_status fm_mkdirs(const char *path) { return make_dirs(path); }

static fm_status make_dirs(const char *path) {
    char buf[PATH_MAX];
    size_t len = strlen(path);
    if (len >= sizeof buf) return fm_error(FM_ERR_ARG, "%s: path too long", path);
    memcpy(buf, path, len + 1);
    while (len > 1 && buf[len - 1] == '/') buf[--len] = '\0';
    struct stat sb;
    if (stat(buf, &sb) == 0) {
        if (S_ISDIR(sb.st_mode)) return FM_OK;
        return fm_error(FM_ERR_IO, "%s: exists but is not a folder (expected a run folder)", buf);
    }
    for (size_t i = 1; i < len; i++) {
        if (buf[i] != '/') continue;
        buf[i] = '\0';
        if (stat(buf, &sb) != 0) FM_TRY(make_dir(buf));
        buf[i] = '/';
    }
    return make_dir(buf);
}

static bool is_dir(const char *path) {
    struct stat sb;
    return lstat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* snprintf that reports truncation as FM_ERR_ARG. */
static fm_status join(char *out, size_t cap, const char *dir, const char *name) {
    int w = snprintf(out, cap, "%s/%s", dir, name);
    if (w < 0 || (size_t)w >= cap)
        return fm_error(FM_ERR_ARG, "%s/%s: path too long (limit %zu bytes)", dir, name, cap - 1);
    return FM_OK;
}

/* ----------------------------------------------------------------------------------------- */
/* Writing a checkpoint                                                                      */

static fm_status write_contents(const char *tmp, int64_t step, const fm_named_tensor *model,
                                int n_model, const fm_named_tensor *optim, int n_optim,
                                const char *config_json, const char *state_json) {
    /* 4 KiB of slack for the file names and the writer's ".tmp" suffix. */
    char p[PATH_MAX + 64];
    char step_s[32];
    snprintf(step_s, sizeof step_s, "%" PRId64, step);
    const char *meta[] = {"format", "pt", "step", step_s, NULL};
    FM_TRY(join(p, sizeof p, tmp, FM_CKPT_MODEL_FILE));
    FM_TRY(fm_st_write(p, model, n_model, meta));
    FM_TRY(join(p, sizeof p, tmp, FM_CKPT_OPTIM_FILE));
    FM_TRY(fm_st_write(p, optim, n_optim, meta));
    FM_TRY(join(p, sizeof p, tmp, FM_CKPT_CONFIG_FILE));
    FM_TRY(fm_write_file_atomic(p, config_json, strlen(config_json)));
    FM_TRY(join(p, sizeof p, tmp, FM_CKPT_STATE_FILE));
    FM_TRY(fm_write_file_atomic(p, state_json, strlen(state_json)));
    return fm_fsync_dir(tmp, true);
}

fm_status fm_ckpt_write(const char *run_dir, int64_t step, const fm_named_tensor *model,
                        int n_model, const fm_named_tensor *optim, int n_optim,
                        const char *config_json, const char *state_json, char *out_dir,
                        size_t out_cap) {
    if (!run_dir || !*run_dir) return fm_error(FM_ERR_ARG, "fm_ckpt_write: empty run folder");
    if (step < 0) return fm_error(FM_ERR_ARG, "%s: checkpoint step %" PRId64 " is negative", run_dir, step);
    if (!config_json || !state_json)
        return fm_error(FM_ERR_ARG, "%s: checkpoint needs config_json and state_json text", run_dir);
    char name[64], final_[PATH_MAX], tmp[PATH_MAX], aside[PATH_MAX];
    snprintf(name, sizeof name, "step_%06" PRId64, step);
    FM_TRY(join(final_, sizeof final_, run_dir, name));
    snprintf(name, sizeof name, ".tmp.step_%06" PRId64, step);
    FM_TRY(join(tmp, sizeof tmp, run_dir, name));
    snprintf(name, sizeof name, ".tmp.old.step_%06" PRId64, step);
    FM_TRY(join(aside, sizeof aside, run_dir, name));
    if (out_dir && strlen(final_) >= out_cap)
        return fm_error(FM_ERR_ARG, "%s: out_dir buffer of %zu bytes is too small for the path",
                        final_, out_cap);

    FM_TRY(make_dirs(run_dir));
    /* Leftovers of a crashed write of this step. A crash between moving the old folder aside
     * and renaming the new one in leaves the old, complete checkpoint at `aside` and no final
     * folder: put it back first. Anything else under a .tmp.* name is incomplete: remove it. */
    if (is_dir(aside) && !is_dir(final_)) rename(aside, final_);
    if (!rm_rf(tmp) || !rm_rf(aside))
        return fm_error(FM_ERR_IO, "%s: cannot remove the leftover temporary folder %s or %s "
                                   "(check permissions)", run_dir, tmp, aside);
    fm_status s = make_dir(tmp);
    if (s != FM_OK) goto fail;
    s = write_contents(tmp, step, model, n_model, optim, n_optim, config_json, state_json);
    if (s != FM_OK) goto fail;

    bool moved_aside = false;
    if (is_dir(final_)) {
        if (fm_fault_hit()) {
            s = fm_error(FM_ERR_IO, "%s: cannot move the existing checkpoint aside to %s: %s "
                                    "(injected fault)", final_, aside, strerror(EIO));
            goto fail;
        }
        if (rename(final_, aside) != 0) {
            s = fm_error(FM_ERR_IO, "%s: cannot move the existing checkpoint aside to %s: %s",
                         final_, aside, strerror(errno));
            goto fail;
        }
        moved_aside = true;
    }
    int rc, e = EIO;
    bool injected = fm_fault_hit();
    if (injected) rc = -1;
    else {
        rc = rename(tmp, final_);
        e = errno;
    }
    if (rc != 0) {
        if (moved_aside && rename(aside, final_) != 0) {
            s = fm_error(FM_ERR_IO, "%s: cannot rename to %s: %s%s; and moving the previous "
                                    "checkpoint back failed too (%s): it is now at %s",
                         tmp, final_, strerror(e), injected ? " (injected fault)" : "",
                         strerror(errno), aside);
            rm_rf(tmp);
            return s;
        }
        s = fm_error(FM_ERR_IO, "%s: cannot rename to %s: %s%s", tmp, final_, strerror(e),
                     injected ? " (injected fault)" : "");
        goto fail;
    }
    /* The new checkpoint is in place: nothing below is a fault point or undoes it. */
    s = fm_fsync_dir(run_dir, false);
    if (moved_aside) rm_rf(aside); /* a leftover is removed by the next write of this step */
    if (out_dir) snprintf(out_dir, out_cap, "%s", final_);
    if (s != FM_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", fm_errmsg());
        return fm_error(FM_ERR_IO, "%s: checkpoint written and renamed into place, but it may not "
                                   "survive a power loss: %s", final_, why);
    }
    return FM_OK;
fail:
    rm_rf(tmp);
    return s;
}

/* ----------------------------------------------------------------------------------------- */
/* Finding the latest checkpoint                                                             */

/* "step_<1..18 digits>" -> step; false for anything else. */
static bool parse_step_name(const char *s, int64_t *step) {
    if (strncmp(s, "step_", 5) != 0) return false;
    s += 5;
    int64_t v = 0;
    int nd = 0;
    for (; *s; s++, nd++) {
        if (*s < '0' || *s > '9' || nd >= 18) return false;
        v = v * 10 + (*s - '0');
    }
    if (nd == 0) return false;
    *step = v;
    return true;
}

fm_status fm_ckpt_find_latest(const char *run_dir, char *out_dir, size_t cap, int64_t *out_step) {
    if (!run_dir || !*run_dir) return fm_error(FM_ERR_ARG, "fm_ckpt_find_latest: empty run folder");
    DIR *d = opendir(run_dir);
    if (!d) {
        int e = errno;
        return fm_error(FM_ERR_IO, "%s: cannot open run folder: %s%s", run_dir, strerror(e),
                        e == ENOENT ? " (no checkpoint was written there yet?)" : "");
    }
    int64_t best = -1;
    int incomplete = 0;
    char best_name[300] = "", p[PATH_MAX], q[PATH_MAX];
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        int64_t step;
        if (!parse_step_name(de->d_name, &step)) continue;
        if (join(p, sizeof p, run_dir, de->d_name) != FM_OK || !is_dir(p)) continue;
        bool complete = true;
        for (int i = 0; i < 4 && complete; i++) {
            struct stat sb;
            complete = join(q, sizeof q, p, k_ckpt_files[i]) == FM_OK && stat(q, &sb) == 0 &&
                       S_ISREG(sb.st_mode);
        }
        if (!complete) {
            incomplete++;
            continue;
        }
        if (step > best) {
            best = step;
            snprintf(best_name, sizeof best_name, "%s", de->d_name);
        }
    }
    closedir(d);
    if (best < 0)
        return fm_error(FM_ERR_IO,
                        "%s: no checkpoint found (expected a folder step_NNNNNN holding %s, %s, "
                        "%s and %s%s)",
                        run_dir, FM_CKPT_MODEL_FILE, FM_CKPT_OPTIM_FILE, FM_CKPT_CONFIG_FILE,
                        FM_CKPT_STATE_FILE,
                        incomplete ? "; step_* folders missing some of these were ignored" : "");
    FM_TRY(join(p, sizeof p, run_dir, best_name));
    if (out_dir) {
        if (strlen(p) >= cap)
            return fm_error(FM_ERR_ARG, "%s: out_dir buffer of %zu bytes is too small for the path",
                            p, cap);
        memcpy(out_dir, p, strlen(p) + 1);
    }
    if (out_step) *out_step = best;
    return FM_OK;
}

bool fm_ckpt_find_incomplete(const char *run_dir, int64_t above, char *out, size_t cap, const char **missing) {
    DIR *d = opendir(run_dir);
    if (!d) return false;
    bool found = false;
    char p[PATH_MAX], q[PATH_MAX];
    struct dirent *de;
    while (!found && (de = readdir(d)) != NULL) {
        int64_t step;
        if (!parse_step_name(de->d_name, &step) || step <= above) continue;
        if (join(p, sizeof p, run_dir, de->d_name) != FM_OK || !is_dir(p)) continue;
        for (int i = 0; i < 4; i++) {
            struct stat sb;
            if (join(q, sizeof q, p, k_ckpt_files[i]) != FM_OK || stat(q, &sb) != 0 || !S_ISREG(sb.st_mode)) {
                snprintf(out, cap, "%s", p);
                if (missing) *missing = k_ckpt_files[i];
                found = true;
                break;
            }
        }
    }
    closedir(d);
    return found;
}
