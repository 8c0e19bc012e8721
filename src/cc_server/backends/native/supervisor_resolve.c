/*
 * Path resolution in the task's view: from its root, cwd or fd, component by component with
 * O_PATH|O_NOFOLLOW fds (resolve), or with one openat2 where that gives the same (resolve_fast),
 * to a pinned parent directory and a final name (struct resolved).
 */
#include "supervisor.h"

/* --- small helpers --------------------------------------------------------------------- */

void close_fd(int *fd) {
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

void res_init(struct resolved *r) {
    r->kind = RES_NAME;
    r->dir_fd = -1;
    r->obj_fd = -1;
    r->name[0] = '\0';
    r->trailing_slash = false;
}

void res_close(struct resolved *r) {
    close_fd(&r->dir_fd);
    close_fd(&r->obj_fd);
}

/* --- path resolution in the task's view ---------------------------------------------------- */

/* The task's root, opened once per notification or kept by the task cache (q->root_fd; closed
 * by handle() unless the cache's). */
int open_root(struct req *q) {
    if (q->root_fd < 0) {
        int err = task_start_fd(q, true, &q->root_fd, &q->root_borrowed);
        if (err) {
            q->root_fd = -1;
            return err;
        }
    }
    return 0;
}

int get_root(struct req *q, int *out) {
    int err = open_root(q);
    if (err)
        return err;
    *out = fcntl(q->root_fd, F_DUPFD_CLOEXEC, 0);
    return *out < 0 ? errno : 0;
}

static int mount_identity(int fd, uint64_t *dev, uint64_t *ino, uint64_t *mnt) {
    struct statx sx;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_INO | STATX_MNT_ID, &sx) < 0)
        return errno;
    *dev = ((uint64_t)sx.stx_dev_major << 32) | sx.stx_dev_minor;
    *ino = sx.stx_ino;
    *mnt = sx.stx_mnt_id;
    return 0;
}

static int is_task_root(struct req *q, int fd, bool *yes) {
    if (!q->root_known) {
        int root;
        int err = get_root(q, &root);
        if (err)
            return err;
        err = mount_identity(root, &q->root_dev, &q->root_ino, &q->root_mnt);
        close(root);
        if (err)
            return err;
        q->root_known = true;
    }
    uint64_t dev = 0, ino = 0, mnt = 0;
    int err = mount_identity(fd, &dev, &ino, &mnt);
    if (err)
        return err;
    *yes = dev == q->root_dev && ino == q->root_ino && mnt == q->root_mnt;
    return 0;
}

/* Whether the procfs directory `fd` (where a magic link is met) is the task's own process's:
 * /proc/<its pid>/..., in its view. */
static bool own_proc_dir(struct req *q, int fd) {
    char path[PATH_MAX];
    if (!fd_path(fd, path, sizeof path) || strncmp(path, "/proc/", 6) != 0 || q->ti.ns_tgid <= 0)
        return false;
    char *end;
    long pid = strtol(path + 6, &end, 10);
    return end != path + 6 && (*end == '/' || *end == '\0') && pid == q->ti.ns_tgid;
}

#define DEPUTY_LINK "another process's procfs link: the supervisor would follow it with more " \
                    "reach than the task has"

static bool is_procfs_root(int fd, bool *in_procfs) {
    struct statfs sf;
    struct stat st;
    *in_procfs = fstatfs(fd, &sf) == 0 && sf.f_type == PROC_SUPER_MAGIC;
    return *in_procfs && fstat(fd, &st) == 0 && st.st_ino == PROC_ROOT_INO;
}

/* The directory a path starts from: the task's root, the thread's cwd or the task's fd. A fd
 * that is not a directory is ENOTDIR here only with `check_dir` (a lookup from it fails with
 * ENOTDIR anyway). */
int start_dir(struct req *q, int dirfd, const char *path, bool check_dir, int *out) {
    if (path[0] == '/')
        return get_root(q, out);
    if (dirfd == AT_FDCWD) {
        bool cached;
        int err = task_start_fd(q, false, out, &cached);
        if (!err && cached) {
            *out = fcntl(*out, F_DUPFD_CLOEXEC, 0); /* the caller's own */
            err = *out < 0 ? errno : 0;
        }
        return err;
    }
    if (dirfd < 0)
        return EBADF;
    /* The task's own open file, through its pidfd (1 us; reopening /proc/<tid>/fd/N costs 3). */
    *out = q->pidfd >= 0 ? (int)syscall(SYS_pidfd_getfd, q->pidfd, dirfd, 0) : -1;
    if (*out < 0 && q->pidfd >= 0 && errno == EBADF)
        return EBADF;
    if (*out < 0) { /* no pidfd, or refused (EPERM, ENOSYS): the procfs link leads there too */
        char name[32];
        snprintf(name, sizeof name, "fd/%d", dirfd);
        *out = openat(q->proc_fd, name, O_PATH | O_CLOEXEC);
        if (*out < 0)
            return errno == ENOENT ? EBADF : errno;
    }
    struct stat st;
    if (check_dir && (fstat(*out, &st) < 0 || !S_ISDIR(st.st_mode))) {
        close_fd(out);
        return ENOTDIR;
    }
    return 0;
}

/*
 * The fast path of resolve(): a path whose last component is an ordinary name and whose
 * directories hold no symlink resolves with one openat2 that refuses every symlink, magic link
 * and escape from `start` (RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH), which
 * is what the walk would do. Returns 0 with `out` set, an errno for the task, or -1: take the
 * walk (a symlink, a ".." above `start`, a final symlink to follow, anything unusual).
 */
static int resolve_fast(int start, const char *path, bool follow_final, struct resolved *out) {
    size_t len = strlen(path);
    if (len == 0 || path[len - 1] == '/')
        return -1;
    const char *slash = strrchr(path, '/');
    const char *name = slash ? slash + 1 : path;
    if (strlen(name) > NAME_MAX || strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
        return -1;
    int dir;
    const char *rel = path;
    while (*rel == '/')
        rel++;
    size_t dir_len = slash ? (size_t)(slash - rel) : 0;
    if (!slash || slash < rel || dir_len == 0) {
        dir = fcntl(start, F_DUPFD_CLOEXEC, 0);
        if (dir < 0)
            return errno;
    } else {
        char parent[PATH_MAX];
        if (dir_len >= sizeof parent)
            return -1;
        memcpy(parent, rel, dir_len);
        parent[dir_len] = '\0';
        struct open_how how = {
            .flags = O_PATH | O_DIRECTORY | O_CLOEXEC,
            .resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH,
        };
        dir = (int)syscall(SYS_openat2, start, parent, &how, sizeof how);
        if (dir < 0) {
            int err = errno;
            return err == ELOOP || err == EXDEV || err == EAGAIN || err == ENOSYS ||
                           err == E2BIG || err == EINVAL
                       ? -1
                       : err;
        }
    }
    if (follow_final) {
        struct stat st;
        if (fstatat(dir, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode)) {
            close(dir);
            return -1;
        }
    }
    out->kind = RES_NAME;
    out->dir_fd = dir;
    memcpy(out->name, name, strlen(name) + 1);
    return 0;
}

/*
 * Resolve `path` (as the task would, from `dirfd`) to a resolved target.
 * `follow_final`: a final symlink is followed (open with O_CREAT and without O_EXCL or
 * O_NOFOLLOW, link with AT_SYMLINK_FOLLOW). A trailing slash also follows, as in the kernel.
 * Returns 0 or an errno for the task.
 */
int resolve(struct req *q, int dirfd, const char *path, bool follow_final,
            struct resolved *out) {
    enum { CAP = 2 * PATH_MAX + 2 };
    char buf_a[CAP], buf_b[CAP];
    char *work = buf_a, *spare = buf_b;
    int cur = -1, err = 0, links = 0;
    res_init(out);
    if (path[0] == '\0') {
        err = ENOENT;
        goto done;
    }
    err = start_dir(q, dirfd, path, true, &cur);
    if (err)
        goto done;
    err = resolve_fast(cur, path, follow_final, out);
    if (err >= 0)
        goto done;
    err = 0;
    snprintf(work, CAP, "%s", path);
    const char *p = work;
    char comp[NAME_MAX + 1];
    for (;;) {
        while (*p == '/')
            p++;
        if (*p == '\0') { /* "/" or "dir/" reduced to the directory itself */
            out->kind = RES_DIR;
            out->dir_fd = cur;
            cur = -1;
            goto done;
        }
        const char *end = strchrnul(p, '/');
        size_t len = (size_t)(end - p);
        if (len > NAME_MAX) {
            err = ENAMETOOLONG;
            goto done;
        }
        memcpy(comp, p, len);
        comp[len] = '\0';
        const char *next = end;
        while (*next == '/')
            next++;
        bool last = *next == '\0';
        bool trailing = last && next != end;
        p = next;

        if (strcmp(comp, ".") == 0 || strcmp(comp, "..") == 0) {
            if (comp[1] == '.') {
                bool at_root;
                err = is_task_root(q, cur, &at_root);
                if (err)
                    goto done;
                if (!at_root) {
                    int up = openat(cur, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
                    if (up < 0) {
                        err = errno;
                        goto done;
                    }
                    close(cur);
                    cur = up;
                }
            }
            if (last) {
                out->kind = RES_DIR;
                out->dir_fd = cur;
                cur = -1;
                goto done;
            }
            continue;
        }

        struct stat st;
        if (!last) {
            int nfd = openat(cur, comp, O_PATH | O_NOFOLLOW | O_DIRECTORY | O_CLOEXEC);
            if (nfd >= 0) {
                close(cur);
                cur = nfd;
                continue;
            }
            if (errno != ENOTDIR) {
                err = errno;
                goto done;
            }
            if (fstatat(cur, comp, &st, AT_SYMLINK_NOFOLLOW) < 0) {
                err = errno;
                goto done;
            }
            if (!S_ISLNK(st.st_mode)) {
                err = ENOTDIR;
                goto done;
            }
        } else {
            if (!(follow_final || trailing) ||
                fstatat(cur, comp, &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISLNK(st.st_mode)) {
                out->kind = RES_NAME;
                out->dir_fd = cur;
                cur = -1;
                memcpy(out->name, comp, len + 1);
                out->trailing_slash = trailing;
                goto done;
            }
        }

        /* `comp` is a symlink to follow. */
        if (++links > MAX_SYMLINKS) {
            err = ELOOP;
            goto done;
        }
        bool in_procfs;
        bool proc_root = is_procfs_root(cur, &in_procfs);
        char target[PATH_MAX + 64];
        if (proc_root && (strcmp(comp, "self") == 0 || strcmp(comp, "thread-self") == 0)) {
            /* Resolved against the reader's pid namespace by the kernel: use the task's. */
            if (q->ti.ns_tgid <= 0 || q->ti.ns_tid <= 0) {
                err = ENOENT;
                goto done;
            }
            if (comp[0] == 's')
                snprintf(target, sizeof target, "%ld", q->ti.ns_tgid);
            else
                snprintf(target, sizeof target, "%ld/task/%ld", q->ti.ns_tgid, q->ti.ns_tid);
        } else if (in_procfs && !proc_root) {
            /* A procfs magic link (fd/N, cwd, root, exe, ...): the kernel follows it to the
             * task's own object. Only the task's own: another process's would be followed
             * with the supervisor's reach (it owns the sandbox's user namespace, so the
             * kernel's ptrace check passes where the task's would not). */
            if (!own_proc_dir(q, cur)) {
                judge_path(cur, comp);
                report_refusal(q, path, comp, DEPUTY_LINK,
                               q->action ? q->action : "file-write-data");
                err = EACCES;
                goto done;
            }
            int nfd = openat(cur, comp, O_PATH | O_CLOEXEC);
            if (nfd < 0) {
                err = errno;
                goto done;
            }
            close(cur);
            cur = nfd;
            if (fstat(cur, &st) < 0) {
                err = errno;
                goto done;
            }
            if (last) {
                out->kind = RES_OBJECT;
                out->obj_fd = cur;
                cur = -1;
                out->trailing_slash = trailing;
                if (trailing && !S_ISDIR(st.st_mode))
                    err = ENOTDIR;
                goto done;
            }
            if (!S_ISDIR(st.st_mode)) {
                err = ENOTDIR;
                goto done;
            }
            continue;
        } else {
            ssize_t n = readlinkat(cur, comp, target, PATH_MAX);
            if (n < 0) {
                err = errno;
                goto done;
            }
            if (n >= PATH_MAX) {
                err = ENAMETOOLONG;
                goto done;
            }
            target[n] = '\0';
            if (n == 0) {
                err = ENOENT;
                goto done;
            }
            if (target[0] == '/') {
                close(cur);
                err = get_root(q, &cur);
                if (err)
                    goto done;
            }
        }
        /* Splice: target, then what was left of the path (a trailing slash survives). */
        size_t tlen = strlen(target), rlen = strlen(p);
        if (tlen + 1 + rlen + 2 > CAP) {
            err = ENAMETOOLONG;
            goto done;
        }
        memcpy(spare, target, tlen);
        size_t off = tlen;
        if (rlen) {
            spare[off++] = '/';
            memcpy(spare + off, p, rlen);
            off += rlen;
        } else if (trailing) {
            spare[off++] = '/';
        }
        spare[off] = '\0';
        char *t = work;
        work = spare;
        spare = t;
        p = work;
    }
done:
    close_fd(&cur);
    if (err)
        res_close(out);
    return err;
}
