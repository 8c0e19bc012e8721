/*
 * The emulation of each call that can create or change a name: open (with the openat2 shortcut,
 * open_beneath, and FIFO helpers), mknod, mkdir, symlink, link, rename, unlink, rmdir, truncate
 * and the chmod calls, each done for the task in its view after the rules are asked.
 */
#include "supervisor.h"

/* --- emulation ----------------------------------------------------------------------------- */

static __thread mode_t thread_umask = (mode_t)-1;

void set_umask(mode_t m) {
    if (thread_umask != m) {
        umask(m);
        thread_umask = m;
    }
}

/* Whether `fd` is an object of a kernel filesystem (procfs, sysfs, nsfs and their kin). The
 * supervisor never hands one to a task: it opens with the credentials of the sandbox's user
 * namespace owner, which the kernel grants every capability in that namespace (a non-dumpable
 * PID 1's /proc/1/mem, the namespace's own sysctls), so such an open would give the task more
 * reach than its own. The task opens them itself, without O_CREAT (which is never trapped). */
#define DEPUTY_REFUSED "an object of procfs, sysfs or another kernel filesystem: opened with " \
                       "O_CREAT, it would be opened with more privilege than the task has"
/* /dev/tty (5:0) opened by the supervisor would be the server's own controlling terminal: a
 * sandboxed command has none (a new session), so it gets what the kernel would answer it. */
static bool is_dev_tty(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 && S_ISCHR(st.st_mode) && major(st.st_rdev) == 5 &&
           minor(st.st_rdev) == 0;
}

bool kernel_object(int fd) {
    struct statfs sf;
    if (fstatfs(fd, &sf) != 0)
        return true;
    switch ((unsigned long)sf.f_type) {
    case PROC_SUPER_MAGIC:
    case 0x62656572: /* SYSFS_MAGIC */
    case 0x6e736673: /* NSFS_MAGIC */
    case 0x73636673: /* SECURITYFS_MAGIC */
    case 0x64626720: /* DEBUGFS_MAGIC */
    case 0x74726163: /* TRACEFS_MAGIC */
    case 0xcafe4a11: /* BPF_FS_MAGIC */
    case 0x27e0eb: /* CGROUP_SUPER_MAGIC */
    case 0x63677270: /* CGROUP2_SUPER_MAGIC */
    case 0x42494e4d: /* BINFMTFS_MAGIC */
    case 0x50494446: /* PID_FS_MAGIC */
        return true;
    default:
        return false;
    }
}

static void *fifo_helper(void *arg);

/* Finish an open of an existing FIFO without stalling a worker. Takes `obj_fd`. */
static void open_fifo(struct req *q, int obj_fd, int flags) {
    struct ccs *s = q->s;
    bool cloexec = flags & O_CLOEXEC;
    int acc = flags & O_ACCMODE;
    char self[64];
    snprintf(self, sizeof self, "/proc/self/fd/%d", obj_fd);
    int base = (flags & ~(O_CREAT | O_EXCL | O_NOFOLLOW)) | O_CLOEXEC | O_NOCTTY;
    if ((flags & O_NONBLOCK) || acc == O_RDWR || acc == O_WRONLY) {
        int fd = open(self, base | O_NONBLOCK);
        if (fd >= 0) {
            if (!(flags & O_NONBLOCK))
                fcntl(fd, F_SETFL, flags & (O_APPEND | O_DIRECT | O_NOATIME));
            close(obj_fd);
            respond_fd(s, q->n->id, (pid_t)q->n->pid, fd, cloexec);
            return;
        }
        if ((flags & O_NONBLOCK) || errno != ENXIO) {
            int err = errno;
            close(obj_fd);
            respond(s, q->n->id, 0, err);
            return;
        }
    }
    /* O_RDONLY, or O_WRONLY with no reader yet: this open blocks until the other end comes. */
    struct helper *h = calloc(1, sizeof *h);
    pthread_mutex_lock(&s->lock);
    bool room = h && s->nhelpers < MAX_HELPERS && !atomic_load(&s->stopping);
    if (room) {
        h->s = s;
        h->id = q->n->id;
        h->obj_fd = obj_fd;
        h->flags = base & ~O_CLOEXEC;
        h->cloexec = cloexec;
        h->next = s->helpers;
        s->helpers = h;
        s->nhelpers++;
    }
    pthread_mutex_unlock(&s->lock);
    pthread_t th;
    pthread_attr_t attr;
    if (room) {
        worker_release_cpu(); /* the helper inherits this thread's affinity */
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &attr, fifo_helper, h);
        pthread_attr_destroy(&attr);
        if (rc == 0)
            return;
        pthread_mutex_lock(&s->lock);
        for (struct helper **pp = &s->helpers; *pp; pp = &(*pp)->next) {
            if (*pp == h) {
                *pp = h->next;
                break;
            }
        }
        s->nhelpers--;
        pthread_cond_broadcast(&s->cond);
        pthread_mutex_unlock(&s->lock);
    }
    free(h);
    close(obj_fd);
    report_error(q, "", "too many FIFO opens waiting at once");
    respond(s, q->n->id, 0, EAGAIN);
}

static void *fifo_helper(void *arg) {
    struct helper *h = arg;
    struct ccs *s = h->s;
    char self[64];
    snprintf(self, sizeof self, "/proc/self/fd/%d", h->obj_fd);
    int fd;
    do {
        fd = open(self, h->flags | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    int err = errno;
    pthread_mutex_lock(&s->lock);
    for (struct helper **pp = &s->helpers; *pp; pp = &(*pp)->next) {
        if (*pp == h) {
            *pp = h->next;
            break;
        }
    }
    close(h->obj_fd);
    pthread_mutex_unlock(&s->lock);
    if (fd >= 0)
        respond_fd(s, h->id, 0, fd, h->cloexec); /* a helper keeps no CPU affinity to give */
    else
        respond(s, h->id, 0, err);
    pthread_mutex_lock(&s->lock);
    s->nhelpers--;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    free(h);
    return NULL;
}

/* Release FIFO helpers whose task is gone (or all of them when stopping): opening the FIFO
 * O_RDWR once satisfies whichever end the helper waits for. */
void rescue_helpers(struct ccs *s, bool all) {
    pthread_mutex_lock(&s->lock);
    for (struct helper *h = s->helpers; h; h = h->next) {
        if (all || !id_valid(s, h->id)) {
            char self[64];
            snprintf(self, sizeof self, "/proc/self/fd/%d", h->obj_fd);
            int fd = open(self, O_RDWR | O_NONBLOCK | O_CLOEXEC);
            if (fd >= 0)
                close(fd);
        }
    }
    pthread_mutex_unlock(&s->lock);
}

/* The verb of a refused open: a new name is created, an existing file's data written (or
 * truncated), or, for an O_CREAT open of an existing object that asked only to read, read. */
static const char *open_action(int flags, bool exists) {
    if (!exists)
        return "file-write-create";
    if ((flags & O_ACCMODE) == O_RDONLY && !(flags & O_TRUNC))
        return "file-read-data";
    return "file-write-data";
}

static const int SETFL_KEEP = O_APPEND | O_DIRECT | O_NOATIME;

/* A name HEAD, objects or refs is checked and made (or renamed to, or from; a HEAD opened with
 * O_CREAT too) under one lock, so completes_shape sees what a create of another thread just
 * made: two threads making the last two of the three at once would each find the other
 * missing. The name is the last component of the path as the task passed it (the one a resolve
 * without following the final symlink ends in); an open's is the name it resolved to. */
static pthread_mutex_t shape_lock = PTHREAD_MUTEX_INITIALIZER;

static bool shape_last(const char *path) {
    size_t n = strlen(path);
    while (n > 0 && path[n - 1] == '/')
        n--;
    size_t start = n;
    while (start > 0 && path[start - 1] != '/')
        start--;
    size_t len = n - start;
    const char *c = path + start;
    return (len == 4 && memcmp(c, "HEAD", 4) == 0) || (len == 7 && memcmp(c, "objects", 7) == 0) ||
           (len == 4 && memcmp(c, "refs", 4) == 0);
}

static bool shape_lock_for(const char *a, const char *b) {
    if (!shape_last(a) && !(b && shape_last(b)))
        return false;
    pthread_mutex_lock(&shape_lock);
    return true;
}

static void shape_unlock(bool locked) {
    if (locked)
        pthread_mutex_unlock(&shape_lock);
}

/* Whether an open that succeeded with these flags made the file it opened (O_CREAT | O_EXCL):
 * a new regular file, so no terminal and no object of a kernel filesystem (none of them makes
 * a file by open), and the checks for those are skipped. */
static bool made_here(int flags) {
    return (flags & (O_CREAT | O_EXCL)) == (O_CREAT | O_EXCL) && (flags & O_TMPFILE) != O_TMPFILE;
}

/*
 * Where open_beneath starts: the task's root (q->root_fd, kept for the notification), or its
 * thread's cwd or its dirfd (`*owned`: the caller closes it). Returns 0 or an errno.
 */
static int beneath_start(struct req *q, int dirfd, const char *path, int *out, bool *owned) {
    *owned = false;
    if (path[0] == '/') {
        int err = open_root(q);
        *out = q->root_fd;
        return err;
    }
    if (dirfd == AT_FDCWD) {
        bool cached;
        int err = task_start_fd(q, false, out, &cached);
        *owned = !err && !cached;
        return err;
    }
    int err = start_dir(q, dirfd, path, false, out);
    *owned = !err;
    return err;
}

/*
 * The fast path of an open with O_CREAT, and the common one: when no symlink, no procfs magic
 * link and no ".." above the start lies on the path, one openat2 from the start directory with
 * RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH and O_NOFOLLOW opens (and
 * creates) it. That is what resolve() then openat() on its parent do, in one call instead of
 * three: the only name it can create is the path's last component, which is the name checked.
 * Returns true when the call has been answered; false when nothing was created and the full
 * path must be taken (a symlink or ".." in the way, a FIFO or socket, flags openat2 rejects, or
 * a name that matches a glob: the walk tells a missing parent from a missing name).
 */
static bool open_beneath(struct req *q, int dirfd, const char *path, int flags, mode_t mode) {
    struct ccs *s = q->s;
    size_t len = strlen(path);
    if ((flags & O_PATH) || len == 0 || path[len - 1] == '/')
        return false;
    const char *slash = strrchr(path, '/');
    const char *name = slash ? slash + 1 : path;
    const char *glob;
    if (strlen(name) > NAME_MAX || strcmp(name, ".") == 0 || strcmp(name, "..") == 0 ||
        glob_match(s, name, &glob) || ((flags & O_CREAT) && strcmp(name, "HEAD") == 0))
        return false; /* the walk decides (a HEAD under shape_lock) */
    int start;
    bool owned;
    int err = beneath_start(q, dirfd, path, &start, &owned);
    if (err) {
        respond(s, q->n->id, 0, err);
        return true;
    }
    const char *rel = path;
    while (*rel == '/')
        rel++;
    if (has_path_rules(s) && !lexically_clear(s, start, rel, name, flags & O_CREAT)) {
        /* A path rule needs the pinned directory: the parent first (one openat2, nothing on
         * the way a symlink or a magic link; for a bare name, the start directory itself), the
         * rules on its path and the name, then the open of that one name from it. A refusal,
         * or anything unusual, goes to the walk, which decides the same and reports it. */
        size_t dlen = (size_t)(name - rel);
        if (dlen) {
            char dir[PATH_MAX];
            memcpy(dir, rel, dlen);
            dir[dlen] = '\0';
            struct open_how dh = {
                .flags = O_PATH | O_DIRECTORY | O_CLOEXEC,
                .resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH,
            };
            int parent = (int)syscall(SYS_openat2, start, dir, &dh, sizeof dh);
            if (owned)
                close(start);
            if (parent < 0)
                return false;
            start = parent;
            owned = true;
        }
        if (path_refused(s, start, name, &glob) ||
            ((flags & O_CREAT) && ancestor_refused(s, start, name, &glob))) {
            if (owned)
                close(start);
            return false;
        }
        rel = name;
    }
    /* As in do_open's walk: O_NONBLOCK keeps an existing FIFO from blocking this worker (with
     * O_EXCL the name cannot exist). */
    int f = flags | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY;
    if (!(flags & O_EXCL))
        f |= O_NONBLOCK;
    struct open_how how = {
        .flags = (uint64_t)(unsigned)f,
        .mode = mode & 07777, /* openat2 refuses other bits; open(2) drops them */
        .resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH,
    };
    int fd = (int)syscall(SYS_openat2, start, rel, &how, sizeof how);
    err = fd < 0 ? errno : 0;
    if (owned)
        close(start);
    if (err == ELOOP || err == EXDEV || err == EAGAIN || err == ENOSYS || err == E2BIG ||
        err == EINVAL || err == ENXIO)
        return false;
    if (err) {
        respond(s, q->n->id, 0, err);
        return true;
    }
    if (!made_here(flags) && is_dev_tty(fd)) {
        close(fd);
        respond(s, q->n->id, 0, ENXIO);
        return true;
    }
    if (!made_here(flags) && kernel_object(fd)) {
        judge_path(fd, "");
        close(fd);
        q->action = open_action(flags, true);
        refuse(q, path, name, DEPUTY_REFUSED);
        return true;
    }
    struct stat st;
    if ((flags & O_ACCMODE) == O_RDONLY && !(flags & O_NONBLOCK) &&
        (fstat(fd, &st) < 0 || S_ISFIFO(st.st_mode))) {
        close(fd); /* a FIFO that must wait for a writer: open_fifo, from the walk */
        return false;
    }
    if (!(flags & O_NONBLOCK) && !(flags & O_EXCL))
        fcntl(fd, F_SETFL, flags & SETFL_KEEP);
    respond_fd(s, q->n->id, (pid_t)q->n->pid, fd, flags & O_CLOEXEC);
    return true;
}

void do_open(struct req *q, int dirfd, uint64_t path_addr, int flags, mode_t mode) {
    struct ccs *s = q->s;
    char path[PATH_MAX];
    int err = copy_string(q->n->pid, path_addr, path, sizeof path);
    if (err == ESRCH || !id_valid(s, q->n->id))
        return;
    if (err) {
        respond(s, q->n->id, 0, err);
        return;
    }
    set_umask(q->ti.umask);
    if (open_beneath(q, dirfd, path, flags, mode))
        return;
    bool cloexec = flags & O_CLOEXEC;
    bool opath = flags & O_PATH;
    bool tmpfile = (flags & O_TMPFILE) == O_TMPFILE; /* O_EXCL there means "never linked" */
    bool follow = opath || tmpfile ? !(flags & O_NOFOLLOW) : !(flags & (O_EXCL | O_NOFOLLOW));
    struct resolved r;
    err = resolve(q, dirfd, path, follow, &r);
    if (err) {
        respond(s, q->n->id, 0, err);
        return;
    }
    const char *glob = NULL;
    int fd = -1;
    if (opath) { /* O_PATH ignores O_CREAT: nothing is created */
        int f = (flags & ~(O_CREAT | O_EXCL)) | O_CLOEXEC;
        if (r.kind == RES_OBJECT) {
            fd = fcntl(r.obj_fd, F_DUPFD_CLOEXEC, 0);
        } else if (r.kind == RES_DIR) {
            fd = fcntl(r.dir_fd, F_DUPFD_CLOEXEC, 0);
        } else {
            fd = openat(r.dir_fd, r.name, f | O_NOFOLLOW);
        }
        err = fd < 0 ? errno : 0;
    } else if (tmpfile) {
        /* A file with no name (trapped for its write access): nothing to judge until a link
         * names it, and linkat is decided then. */
        fd = r.kind == RES_DIR      ? openat(r.dir_fd, ".", flags | O_CLOEXEC, mode)
             : r.kind == RES_OBJECT ? openat(r.obj_fd, ".", flags | O_CLOEXEC, mode)
                                    : openat(r.dir_fd, r.name, flags | O_NOFOLLOW | O_CLOEXEC, mode);
        err = fd < 0 ? errno : 0;
    } else if (r.kind == RES_DIR) {
        err = EISDIR;
    } else if (r.kind == RES_OBJECT) {
        if (flags & O_EXCL) {
            err = EEXIST;
        } else if (object_refused(q, r.obj_fd, &glob)) {
            q->action = open_action(flags, true);
            refuse(q, path, path, glob); /* an existing protected object, through a link */
            res_close(&r);
            return;
        } else {
            struct stat st;
            if (fstat(r.obj_fd, &st) == 0 && S_ISFIFO(st.st_mode)) {
                open_fifo(q, r.obj_fd, flags);
                r.obj_fd = -1;
                res_close(&r);
                return;
            }
            char self[64];
            snprintf(self, sizeof self, "/proc/self/fd/%d", r.obj_fd);
            fd = open(self, (flags & ~(O_CREAT | O_EXCL)) | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
            err = fd < 0 ? errno : 0;
        }
    } else if (r.trailing_slash) {
        err = EISDIR;
    } else {
        /* A matching name may be opened only if it exists: O_CREAT is dropped, so this open
         * can never create it, whatever happens to the directory meanwhile. */
        bool locked = (flags & O_CREAT) && shape_lock_for(r.name, NULL);
        struct stat named;
        bool named_exists = fstatat(r.dir_fd, r.name, &named, AT_SYMLINK_NOFOLLOW) == 0;
        if (path_refused(s, r.dir_fd, r.name, &glob) ||
            ((flags & O_CREAT) && !named_exists && ancestor_refused(s, r.dir_fd, r.name, &glob))) {
            shape_unlock(locked);
            struct stat st;
            bool exists = fstatat(r.dir_fd, r.name, &st, AT_SYMLINK_NOFOLLOW) == 0;
            q->action = open_action(flags, exists);
            refuse(q, path, r.name, glob); /* protected: neither created nor opened */
            res_close(&r);
            return;
        }
        bool matches = glob_refused(s, r.dir_fd, r.name, &glob);
        if (matches && (flags & O_EXCL)) {
            shape_unlock(locked);
            refuse_at(q, path, r.dir_fd, r.name, glob);
            res_close(&r);
            return;
        }
        /* O_NONBLOCK: an existing FIFO must not block this worker (see open_fifo); with O_EXCL
         * the name cannot exist, so there is no FIFO to meet. */
        int f = (matches ? flags & ~O_CREAT : flags) | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY;
        if (!(flags & O_EXCL))
            f |= O_NONBLOCK;
        fd = openat(r.dir_fd, r.name, f, mode);
        err = fd < 0 ? errno : 0;
        shape_unlock(locked);
        if (matches && err == ENOENT) {
            refuse_at(q, path, r.dir_fd, r.name, glob);
            res_close(&r);
            return;
        }
        struct stat st;
        bool fifo = false;
        if (err == ENXIO && !(flags & O_NONBLOCK)) /* a FIFO without a reader, or a socket */
            fifo = fstatat(r.dir_fd, r.name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISFIFO(st.st_mode);
        else if (!err && (flags & O_ACCMODE) == O_RDONLY && !(flags & O_NONBLOCK))
            fifo = fstat(fd, &st) == 0 && S_ISFIFO(st.st_mode); /* must wait for a writer */
        if (fifo) {
            int obj = openat(r.dir_fd, r.name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
            close_fd(&fd);
            res_close(&r);
            if (obj < 0)
                respond(s, q->n->id, 0, errno);
            else
                open_fifo(q, obj, flags);
            return;
        }
    }
    if (err) {
        res_close(&r);
        respond(s, q->n->id, 0, err);
        return;
    }
    bool made = !opath && !tmpfile && r.kind == RES_NAME && made_here(flags);
    if (!opath && !made && is_dev_tty(fd)) {
        close(fd);
        res_close(&r);
        respond(s, q->n->id, 0, ENXIO);
        return;
    }
    if (!opath && !made && kernel_object(fd)) {
        judge_path(fd, "");
        close(fd);
        q->action = open_action(flags, true);
        refuse(q, path, r.kind == RES_NAME ? r.name : path, DEPUTY_REFUSED);
        res_close(&r);
        return;
    }
    res_close(&r);
    if (!(flags & O_NONBLOCK) && !(flags & O_EXCL) && !opath)
        fcntl(fd, F_SETFL, flags & SETFL_KEEP);
    respond_fd(s, q->n->id, (pid_t)q->n->pid, fd, cloexec);
}

/* A name about to be created by mknod, mkdir, symlink, link or bind: checked, then made. */
int name_for_create(struct req *q, const char *path, struct resolved *r, bool is_mkdir,
                    bool *refused) {
    *refused = false;
    if (r->kind == RES_DIR)
        return EEXIST;
    if (r->kind == RES_OBJECT)
        return EEXIST;
    struct stat existing;
    if (fstatat(r->dir_fd, r->name, &existing, AT_SYMLINK_NOFOLLOW) == 0)
        return EEXIST; /* nothing would be made: the kernel's answer, not a refusal */
    const char *glob;
    if (glob_refused(q->s, r->dir_fd, r->name, &glob) ||
        path_refused(q->s, r->dir_fd, r->name, &glob) ||
        completes_shape(q->s, r->dir_fd, r->name, &glob) ||
        (!is_mkdir && (ancestor_refused(q->s, r->dir_fd, r->name, &glob) ||
                       carry_refused(q->s, r->dir_fd, r->name, NULL, &glob)))) {
        refuse_at(q, path, r->dir_fd, r->name, glob);
        *refused = true;
        return 0;
    }
    if (r->trailing_slash && !is_mkdir) {
        struct stat st;
        return fstatat(r->dir_fd, r->name, &st, AT_SYMLINK_NOFOLLOW) == 0 ? EEXIST : ENOENT;
    }
    return 0;
}

static bool read_path(struct req *q, uint64_t addr, char *buf, size_t size, int *err) {
    *err = copy_string(q->n->pid, addr, buf, size);
    return *err != ESRCH;
}

/* Both path arguments of a two-path call (link, rename), copied and checked still live. False
 * when the call is gone or has been answered (a bad address gets its errno). */
static bool read_two_paths(struct req *q, uint64_t a, char pa[PATH_MAX], uint64_t b,
                           char pb[PATH_MAX]) {
    int err, err2 = 0;
    if (!read_path(q, a, pa, PATH_MAX, &err) || !read_path(q, b, pb, PATH_MAX, &err2) ||
        !id_valid(q->s, q->n->id))
        return false;
    if (err || err2) {
        respond(q->s, q->n->id, 0, err ? err : err2);
        return false;
    }
    return true;
}

void do_mknod_mkdir(struct req *q, int dirfd, uint64_t addr, mode_t mode, dev_t dev,
                    bool is_mkdir) {
    struct ccs *s = q->s;
    char path[PATH_MAX];
    int err;
    if (!read_path(q, addr, path, sizeof path, &err) || !id_valid(s, q->n->id))
        return;
    if (err) {
        respond(s, q->n->id, 0, err);
        return;
    }
    set_umask(q->ti.umask);
    struct resolved r;
    bool locked = shape_lock_for(path, NULL);
    err = resolve(q, dirfd, path, false, &r);
    bool refused = false;
    if (!err)
        err = name_for_create(q, path, &r, is_mkdir, &refused);
    if (!err && !refused) {
        int rc = is_mkdir ? mkdirat(r.dir_fd, r.name, mode) : mknodat(r.dir_fd, r.name, mode, dev);
        err = rc < 0 ? errno : 0;
        if (!err && is_mkdir)
            note_worktree_dir(s, r.dir_fd, r.name);
    }
    shape_unlock(locked);
    res_close(&r);
    if (!refused)
        respond(s, q->n->id, 0, err);
}

void do_symlink(struct req *q, uint64_t target_addr, int dirfd, uint64_t addr) {
    struct ccs *s = q->s;
    char target[PATH_MAX], path[PATH_MAX];
    int err, err2 = 0;
    if (!read_path(q, target_addr, target, sizeof target, &err) ||
        !read_path(q, addr, path, sizeof path, &err2) || !id_valid(s, q->n->id))
        return;
    if (err || err2) {
        respond(s, q->n->id, 0, err ? err : err2);
        return;
    }
    if (target[0] == '\0') {
        respond(s, q->n->id, 0, ENOENT);
        return;
    }
    struct resolved r;
    bool locked = shape_lock_for(path, NULL);
    err = resolve(q, dirfd, path, false, &r);
    bool refused = false;
    if (!err)
        err = name_for_create(q, path, &r, false, &refused);
    if (!err && !refused)
        err = symlinkat(target, r.dir_fd, r.name) < 0 ? errno : 0;
    shape_unlock(locked);
    res_close(&r);
    if (!refused)
        respond(s, q->n->id, 0, err);
}

#ifndef AT_EMPTY_PATH
#define AT_EMPTY_PATH 0x1000
#endif

void do_link(struct req *q, int olddirfd, uint64_t old_addr, int newdirfd,
             uint64_t new_addr, int flags) {
    struct ccs *s = q->s;
    char oldp[PATH_MAX], newp[PATH_MAX];
    int err;
    if (!read_two_paths(q, old_addr, oldp, new_addr, newp))
        return;
    if (flags & ~(AT_SYMLINK_FOLLOW | AT_EMPTY_PATH)) {
        respond(s, q->n->id, 0, EINVAL);
        return;
    }
    int obj = -1;
    if (oldp[0] == '\0' && (flags & AT_EMPTY_PATH)) {
        /* The task's own fd (an O_TMPFILE file, typically). Linking it by fd needs nothing the
         * task could not do itself with linkat("/proc/self/fd/N", AT_SYMLINK_FOLLOW). */
        if (olddirfd == AT_FDCWD) {
            obj = openat(q->proc_fd, "cwd", O_PATH | O_CLOEXEC);
        } else if (olddirfd < 0) {
            errno = EBADF;
        } else {
            char name[32];
            snprintf(name, sizeof name, "fd/%d", olddirfd);
            obj = openat(q->proc_fd, name, O_PATH | O_CLOEXEC);
            if (obj < 0 && errno == ENOENT)
                errno = EBADF;
        }
        err = obj < 0 ? errno : 0;
    } else {
        struct resolved ro;
        err = resolve(q, olddirfd, oldp, flags & AT_SYMLINK_FOLLOW, &ro);
        if (!err) {
            if (ro.kind == RES_OBJECT) {
                obj = ro.obj_fd;
                ro.obj_fd = -1;
            } else if (ro.kind == RES_DIR) {
                err = EPERM; /* a directory cannot be hard-linked */
            } else {
                obj = openat(ro.dir_fd, ro.name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
                err = obj < 0 ? errno : 0;
                struct stat st;
                if (!err && ro.trailing_slash && fstat(obj, &st) == 0 && !S_ISDIR(st.st_mode))
                    err = ENOTDIR;
            }
            res_close(&ro);
        }
    }
    /* A second name for a protected file would let an O_CREAT open of the alias write it. */
    struct stat ost;
    const char *oglob;
    if (!err && fstat(obj, &ost) == 0 && ost.st_nlink > 0 && path_refused(s, obj, "", &oglob)) {
        refuse(q, oldp, oldp, oglob);
        close_fd(&obj);
        return;
    }
    struct resolved rn;
    res_init(&rn);
    bool refused = false;
    bool locked = shape_lock_for(newp, NULL);
    if (!err)
        err = resolve(q, newdirfd, newp, false, &rn);
    if (!err)
        err = name_for_create(q, newp, &rn, false, &refused);
    if (!err && !refused)
        err = linkat(obj, "", rn.dir_fd, rn.name, AT_EMPTY_PATH) < 0 ? errno : 0;
    shape_unlock(locked);
    close_fd(&obj);
    res_close(&rn);
    if (!refused)
        respond(s, q->n->id, 0, err);
}

/* Whether `name` in `dir_fd` is a mount point in the task's view (the pinned directory is in
 * the task's mount namespace, so the lookup crosses its mounts): the kernel refuses a rename of
 * one with EBUSY for the task, and the supervisor, whose own namespace lacks those mounts, must
 * answer the same (the read-only binds pin protected paths and their parents that way). */
static bool is_mount_point(int dir_fd, const char *name) {
    struct statx stx;
    if (statx(dir_fd, name, AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT, STATX_TYPE, &stx) != 0)
        return false;
    return (stx.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT) &&
           (stx.stx_attributes & STATX_ATTR_MOUNT_ROOT);
}

static void rename_paths(struct req *q, int olddirfd, const char *oldp, int newdirfd,
                         const char *newp, unsigned flags) {
    struct ccs *s = q->s;
    int err;
    struct resolved ro, rn;
    res_init(&rn);
    err = resolve(q, olddirfd, oldp, false, &ro);
    if (!err)
        err = resolve(q, newdirfd, newp, false, &rn);
    if (!err && (ro.kind != RES_NAME || rn.kind != RES_NAME))
        err = (ro.kind == RES_OBJECT || rn.kind == RES_OBJECT) ? EXDEV : EBUSY;
    if (!err) {
        const char *glob;
        /* Names that receive an inode: the new one, and with RENAME_EXCHANGE the old too. */
        if (glob_refused(s, rn.dir_fd, rn.name, &glob) ||
            ((flags & RENAME_EXCHANGE) && glob_refused(s, ro.dir_fd, ro.name, &glob))) {
            bool new_side = glob_refused(s, rn.dir_fd, rn.name, &glob);
            q->action = "file-write-rename";
            if (new_side)
                refuse_at(q, newp, rn.dir_fd, rn.name, glob);
            else
                refuse_at(q, oldp, ro.dir_fd, ro.name, glob);
            res_close(&ro);
            res_close(&rn);
            return;
        }
        /* A protected path may be neither the new name nor the old one (moved away, a
         * protected path could be rebuilt around its rule). */
        if (path_refused(s, rn.dir_fd, rn.name, &glob) ||
            ancestor_refused(s, rn.dir_fd, rn.name, &glob) ||
            worktree_dir_refused(s, rn.dir_fd, rn.name, &glob)) { /* RENAME_EXCHANGE moves it */
            q->action = "file-write-rename";
            refuse(q, newp, rn.name, glob);
            res_close(&ro);
            res_close(&rn);
            return;
        }
        char to[PATH_MAX + NAME_MAX + 2], from[PATH_MAX + NAME_MAX + 2];
        to[0] = from[0] = '\0';
        if (judge_path(rn.dir_fd, rn.name))
            snprintf(to, sizeof to, "%s", judged);
        if (judge_path(ro.dir_fd, ro.name))
            snprintf(from, sizeof from, "%s", judged);
        if (path_refused(s, ro.dir_fd, ro.name, &glob) ||
            ancestor_refused(s, ro.dir_fd, ro.name, &glob) ||
            worktree_dir_refused(s, ro.dir_fd, ro.name, &glob) ||
            shape_refused(s, ro.dir_fd, ro.name, false, &glob) ||
            carry_refused(s, ro.dir_fd, ro.name, to, &glob)) {
            q->action = "file-write-rename";
            refuse(q, oldp, ro.name, glob);
            res_close(&ro);
            res_close(&rn);
            return;
        }
        struct stat oldst;
        bool old_is_file = fstatat(ro.dir_fd, ro.name, &oldst, AT_SYMLINK_NOFOLLOW) == 0 &&
                           S_ISREG(oldst.st_mode) && !(flags & RENAME_EXCHANGE);
        if (carry_refused(s, rn.dir_fd, rn.name, (flags & RENAME_EXCHANGE) ? from : NULL, &glob) ||
            shape_refused(s, rn.dir_fd, rn.name, old_is_file, &glob) ||
            completes_shape(s, rn.dir_fd, rn.name, &glob)) {
            q->action = "file-write-rename";
            refuse(q, newp, rn.name, glob);
            res_close(&ro);
            res_close(&rn);
            return;
        }
        if ((flags & RENAME_EXCHANGE) && completes_shape(s, ro.dir_fd, ro.name, &glob)) {
            q->action = "file-write-rename";
            refuse(q, oldp, ro.name, glob);
            res_close(&ro);
            res_close(&rn);
            return;
        }
        if (is_mount_point(ro.dir_fd, ro.name) || is_mount_point(rn.dir_fd, rn.name))
            err = EBUSY;
        if (!err && (ro.trailing_slash || rn.trailing_slash)) { /* both must be directories */
            struct stat st;
            if (fstatat(ro.dir_fd, ro.name, &st, AT_SYMLINK_NOFOLLOW) < 0)
                err = errno;
            else if (!S_ISDIR(st.st_mode))
                err = ENOTDIR;
        }
    }
    if (!err)
        err = syscall(SYS_renameat2, ro.dir_fd, ro.name, rn.dir_fd, rn.name, flags) < 0 ? errno : 0;
    res_close(&ro);
    res_close(&rn);
    respond(s, q->n->id, 0, err);
}

void do_rename(struct req *q, int olddirfd, uint64_t old_addr, int newdirfd,
               uint64_t new_addr, unsigned flags) {
    char oldp[PATH_MAX], newp[PATH_MAX];
    if (!read_two_paths(q, old_addr, oldp, new_addr, newp))
        return;
    bool locked = shape_lock_for(newp, oldp);
    rename_paths(q, olddirfd, oldp, newdirfd, newp, flags);
    shape_unlock(locked);
}

/* --- changes to names and files that exist (trapped with path rules only) ----------------- */

/* One path argument, copied and checked still live; false when the call is gone or answered. */
static bool read_one_path(struct req *q, uint64_t addr, char path[PATH_MAX]) {
    int err;
    if (!read_path(q, addr, path, PATH_MAX, &err) || !id_valid(q->s, q->n->id))
        return false;
    if (err) {
        respond(q->s, q->n->id, 0, err);
        return false;
    }
    return true;
}

/* unlink, unlinkat and rmdir: a protected name is not removed (it could then be made again
 * with other content, or a protected directory replaced). */
void do_unlink(struct req *q, int dirfd, uint64_t addr, int flags) {
    struct ccs *s = q->s;
    char path[PATH_MAX];
    if (!read_one_path(q, addr, path))
        return;
    if (flags & ~AT_REMOVEDIR) {
        respond(s, q->n->id, 0, EINVAL);
        return;
    }
    struct resolved r;
    int err = resolve(q, dirfd, path, false, &r);
    if (!err && r.kind == RES_DIR)
        err = (flags & AT_REMOVEDIR) ? EBUSY : EISDIR; /* ".", "..", "/": the kernel's answers */
    else if (!err && r.kind == RES_OBJECT)
        err = EBUSY;
    const char *glob;
    if (!err && kernel_object(r.dir_fd)) {
        judge_path(r.dir_fd, r.name);
        q->action = "file-write-unlink";
        refuse(q, path, r.name, DEPUTY_REFUSED);
        res_close(&r);
        return;
    }
    if (!err && (path_refused(s, r.dir_fd, r.name, &glob) ||
                 ancestor_refused(s, r.dir_fd, r.name, &glob) ||
                 worktree_dir_refused(s, r.dir_fd, r.name, &glob) ||
                 shape_refused(s, r.dir_fd, r.name, false, &glob))) {
        q->action = "file-write-unlink";
        refuse(q, path, r.name, glob);
        res_close(&r);
        return;
    }
    if (!err && is_mount_point(r.dir_fd, r.name))
        err = EBUSY;
    if (!err && r.trailing_slash && !(flags & AT_REMOVEDIR)) {
        struct stat st;
        err = fstatat(r.dir_fd, r.name, &st, AT_SYMLINK_NOFOLLOW) < 0 ? errno
              : S_ISDIR(st.st_mode)                                   ? EISDIR
                                                                      : ENOTDIR;
    }
    if (!err)
        err = unlinkat(r.dir_fd, r.name, flags) < 0 ? errno : 0;
    res_close(&r);
    respond(s, q->n->id, 0, err);
}

/* The existing object a path names, followed or not: an O_PATH fd of it, after the path rules
 * (`action` names the verb of a refusal). Returns -1 when the call has been answered. */
static int existing_object(struct req *q, int dirfd, const char *path, bool follow,
                           bool empty_path, const char *action) {
    struct ccs *s = q->s;
    int obj = -1, err = 0, parent = -1; /* parent and pname: a name in a pinned directory */
    char pname[NAME_MAX + 1] = "";
    if (path[0] == '\0' && empty_path) {
        err = start_dir(q, dirfd, "", false, &obj); /* the task's own fd, or its cwd */
    } else {
        struct resolved r;
        err = resolve(q, dirfd, path, follow, &r);
        if (!err && r.kind == RES_OBJECT) {
            obj = r.obj_fd;
            r.obj_fd = -1;
        } else if (!err && r.kind == RES_DIR) {
            obj = fcntl(r.dir_fd, F_DUPFD_CLOEXEC, 0);
            err = obj < 0 ? errno : 0;
        } else if (!err) {
            obj = openat(r.dir_fd, r.name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
            err = obj < 0 ? errno : 0;
            struct stat st;
            if (!err && r.trailing_slash && fstat(obj, &st) == 0 && !S_ISDIR(st.st_mode))
                err = ENOTDIR;
            if (!err) {
                parent = fcntl(r.dir_fd, F_DUPFD_CLOEXEC, 0);
                snprintf(pname, sizeof pname, "%s", r.name);
            }
        }
        res_close(&r);
    }
    if (err) {
        close_fd(&obj);
        close_fd(&parent);
        respond(s, q->n->id, 0, err);
        return -1;
    }
    const char *glob;
    q->action = action;
    if (kernel_object(obj)) {
        close_fd(&parent);
        judge_path(obj, "");
        close(obj);
        refuse(q, path, path, DEPUTY_REFUSED);
        return -1;
    }
    bool refused = parent >= 0 ? path_refused(s, parent, pname, &glob)
                               : object_refused(q, obj, &glob);
    close_fd(&parent);
    if (refused) {
        close(obj);
        refuse(q, path, path, glob);
        return -1;
    }
    return obj;
}

/* truncate: the file's data, like an open for writing. */
void do_truncate(struct req *q, uint64_t addr, int64_t length) {
    char path[PATH_MAX];
    if (!read_one_path(q, addr, path))
        return;
    int obj = existing_object(q, AT_FDCWD, path, true, false, "file-write-data");
    if (obj < 0)
        return;
    struct stat st;
    int err = fstat(obj, &st) < 0 ? errno : S_ISDIR(st.st_mode) ? EISDIR
                                          : !S_ISREG(st.st_mode) ? EINVAL
                                                                 : 0;
    if (!err) {
        char self[64];
        snprintf(self, sizeof self, "/proc/self/fd/%d", obj);
        int fd = open(self, O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
        err = fd < 0 ? errno : ftruncate(fd, length) < 0 ? errno : 0;
        if (fd >= 0)
            close(fd);
    }
    close(obj);
    respond(q->s, q->n->id, 0, err);
}

/* chmod, fchmodat, fchmodat2: a protected file's mode (a hook made executable runs). The set-id
 * bits never get here: the sandbox's own filter refuses them first. */
void do_chmod(struct req *q, int dirfd, uint64_t addr, mode_t mode, int flags) {
    char path[PATH_MAX];
    if (!read_one_path(q, addr, path))
        return;
    if (flags & ~(AT_SYMLINK_NOFOLLOW | AT_EMPTY_PATH)) {
        respond(q->s, q->n->id, 0, EINVAL);
        return;
    }
    int obj = existing_object(q, dirfd, path, !(flags & AT_SYMLINK_NOFOLLOW),
                              flags & AT_EMPTY_PATH, "file-write-mode");
    if (obj < 0)
        return;
    struct stat st;
    int err = fstat(obj, &st) < 0 ? errno : S_ISLNK(st.st_mode) ? EOPNOTSUPP : 0;
    if (!err) {
        char self[64];
        snprintf(self, sizeof self, "/proc/self/fd/%d", obj);
        err = fchmodat(AT_FDCWD, self, mode & 07777, 0) < 0 ? errno : 0;
    }
    close(obj);
    respond(q->s, q->n->id, 0, err);
}

/* fchmod: the mode of a file the task has open (for reading, say: no trapped open judged it). */
void do_fchmod(struct req *q, int fd, mode_t mode) {
    if (fd < 0) {
        respond(q->s, q->n->id, 0, EBADF);
        return;
    }
    int obj = existing_object(q, fd, "", true, true, "file-write-mode");
    if (obj < 0)
        return;
    char self[64];
    snprintf(self, sizeof self, "/proc/self/fd/%d", obj);
    int err = fchmodat(AT_FDCWD, self, mode & 07777, 0) < 0 ? errno : 0;
    close(obj);
    respond(q->s, q->n->id, 0, err);
}
