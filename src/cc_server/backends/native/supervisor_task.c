/*
 * The trapping task, read from the host's /proc: the per-worker cache of what its status says
 * (struct tid_entry), the state changes that make that stale (state_change, state_settled), its
 * credentials, the bytes of its call (process_vm_readv), and the keeper it runs under.
 */
#include "supervisor.h"

/* Per worker: what was read of the tasks seen last. A task's next call then costs one
 * pidfd_send_signal instead of a 9 us read of /proc/<tid>/status, as long as:
 *   - the entry is still the same task: its pidfd pins the task's struct pid, and signal 0
 *     through it fails with ESRCH once that task is gone (its tid may then be someone new);
 *   - nothing the entry holds has changed: the umask and the fs credentials change only
 *     through umask(2) and the set*id calls, and a thread id changes hands only when another
 *     thread of the group execs; the filter traps all three, and each such call bumps
 *     s->state_gen (the entry records the generation it was read in) and is "pending" until
 *     it has surely run, during which nothing is cached (state_settled).
 * Without a pidfd for the thread (before Linux 6.9 a thread that does not lead its group has
 * none) the status is read for every call, as it is while anything is pending. */
#define TID_CACHE 16
struct tid_entry {
    pid_t tid;
    int proc_fd;
    int status_fd;
    int pidfd;
    unsigned long long gen; /* s->state_gen when `ti` was read; 0: not reusable */
    struct task_info ti;
    /* The thread's cwd and root (O_PATH), or -1, each valid while s->fs_gen is what it was
     * when they were opened (see task_start_fd). */
    int cwd_fd, root_fd;
    unsigned long long cwd_gen, root_gen;
};
static __thread struct tid_entry tid_cache[TID_CACHE];
static __thread unsigned tid_next;

static void tid_entry_reset(struct tid_entry *e) {
    e->tid = 0;
    e->proc_fd = e->status_fd = e->pidfd = -1;
    e->gen = 0;
    e->cwd_fd = e->root_fd = -1;
    e->cwd_gen = e->root_gen = 0;
}

void tid_cache_init(void) {
    for (int i = 0; i < TID_CACHE; i++)
        tid_entry_reset(&tid_cache[i]);
}

static void tid_entry_close(struct tid_entry *e) {
    if (e->cwd_fd >= 0)
        close(e->cwd_fd);
    if (e->root_fd >= 0)
        close(e->root_fd);
    if (e->proc_fd >= 0)
        close(e->proc_fd);
    if (e->status_fd >= 0)
        close(e->status_fd);
    if (e->pidfd >= 0)
        close(e->pidfd);
    tid_entry_reset(e);
}

void tid_cache_clear(void) {
    for (int i = 0; i < TID_CACHE; i++)
        tid_entry_close(&tid_cache[i]);
}

static int tid_entry_open(int host_proc, pid_t tid, struct tid_entry *e) {
    /* The pidfd first: if the tid is reused before the /proc entry is opened, the pidfd's task
     * is the one that is gone, so what is read below is never taken from the cache. */
    e->pidfd = (int)syscall(SYS_pidfd_open, tid, PIDFD_THREAD);
    if (e->pidfd < 0 && errno == EINVAL) /* before 6.9: only a thread-group leader has one */
        e->pidfd = (int)syscall(SYS_pidfd_open, tid, 0);
    char name[32];
    snprintf(name, sizeof name, "%d", (int)tid);
    e->proc_fd = openat(host_proc, name, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (e->proc_fd < 0) {
        int err = errno == ENOENT ? ESRCH : errno;
        tid_entry_close(e);
        return err;
    }
    e->status_fd = openat(e->proc_fd, "status", O_RDONLY | O_CLOEXEC);
    if (e->status_fd < 0) {
        int err = errno == ENOENT ? ESRCH : errno;
        tid_entry_close(e);
        return err;
    }
    e->tid = tid;
    return 0;
}

/* Whether the task a pidfd pins is still there (EPERM: it is, we may not signal it). */
bool task_alive(int pidfd) {
    return syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) == 0 || errno == EPERM;
}

/* --- reading the task ---------------------------------------------------------------------- */

/* Copy a NUL-terminated string from the task, page by page (a string may end just before an
 * unmapped page). Returns 0 or an errno. */
int copy_string(pid_t pid, uint64_t addr, char *buf, size_t size) {
    if (addr == 0)
        return EFAULT;
    size_t got = 0;
    long page = getpagesize();
    while (got < size) {
        uint64_t at = addr + got;
        size_t chunk = (size_t)page - (size_t)(at % (uint64_t)page);
        if (chunk > size - got)
            chunk = size - got;
        struct iovec local = {.iov_base = buf + got, .iov_len = chunk};
        struct iovec remote = {.iov_base = (void *)(uintptr_t)at, .iov_len = chunk};
        ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
        if (n <= 0)
            return n == 0 ? EFAULT : (errno == ESRCH ? ESRCH : EFAULT);
        char *nul = memchr(buf + got, '\0', (size_t)n);
        if (nul)
            return 0;
        got += (size_t)n;
    }
    return ENAMETOOLONG;
}

int copy_bytes(pid_t pid, uint64_t addr, void *buf, size_t len) {
    struct iovec local = {.iov_base = buf, .iov_len = len};
    struct iovec remote = {.iov_base = (void *)(uintptr_t)addr, .iov_len = len};
    ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n == (ssize_t)len)
        return 0;
    return n < 0 && errno == ESRCH ? ESRCH : EFAULT;
}

static const char *status_field(const char *text, const char *key) {
    size_t klen = strlen(key);
    const char *p = text;
    while (p && *p) {
        if (strncmp(p, key, klen) == 0)
            return p + klen;
        p = strchr(p, '\n');
        if (p)
            p++;
    }
    return NULL;
}

static long last_number(const char *field) {
    long value = 0;
    while (field && *field && *field != '\n') {
        while (*field == ' ' || *field == '\t')
            field++;
        if (!isdigit((unsigned char)*field))
            break;
        value = strtol(field, (char **)&field, 10);
    }
    return value;
}

static bool nth_number(const char *field, int n, unsigned long *out) {
    for (int i = 0; field && i <= n; i++) {
        while (*field == ' ' || *field == '\t')
            field++;
        if (!isdigit((unsigned char)*field))
            return false;
        char *end;
        unsigned long v = strtoul(field, &end, 10);
        if (i == n) {
            *out = v;
            return true;
        }
        field = end;
    }
    return false;
}

int cmp_gid(const void *a, const void *b) {
    gid_t x = *(const gid_t *)a, y = *(const gid_t *)b;
    return x < y ? -1 : x > y;
}

static int read_status(int fd, char *text, size_t size) {
    size_t got = 0;
    for (;;) {
        ssize_t n = pread(fd, text + got, size - 1 - got, (off_t)got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return errno;
        got += (size_t)n;
        if (n == 0 || got >= size - 1)
            break;
    }
    text[got] = '\0';
    return got ? 0 : ESRCH;
}

/* The umask a status text shows, or -1. */
static int status_umask(const char *text) {
    const char *f = status_field(text, "Umask:");
    return f ? (int)(strtoul(f, NULL, 8) & 0777) : -1;
}

/*
 * Retire the pending state changes that have surely run, and say whether none is left (then a
 * task_info read from now on stays true until state_gen moves). A change by thread Y is over
 * when Y is making another call (`tid`: its earlier one has returned) or when Y is gone. A
 * umask change that is the only one pending is also over when Y's status already shows the
 * umask it sets: if it has not run yet, running it changes nothing. (With two pending, the
 * other may run in between and the first then does change it back.)
 */
static bool state_settled(struct ccs *s, pid_t tid) {
    if (atomic_load(&s->cache_off))
        return false;
    if (atomic_load(&s->npending) == 0)
        return true;
    pthread_mutex_lock(&s->lock);
    int n = atomic_load(&s->npending);
    for (int pass = 0; pass < 2 && n > 0; pass++) {
        if (pass == 1 && n != 1)
            break;
        for (int i = 0; i < n;) {
            struct pending *p = &s->pending[i];
            bool over = pass == 0 && p->tid == tid;
            if (!over) {
                char text[STATUS_BYTES];
                int err = read_status(p->status_fd, text, sizeof text);
                over = err == ESRCH ||
                       (pass == 1 && !err && p->is_umask && status_umask(text) == (int)p->want);
            }
            if (over) {
                close(p->status_fd);
                *p = s->pending[--n];
            } else {
                i++;
            }
        }
    }
    atomic_store(&s->npending, n);
    pthread_mutex_unlock(&s->lock);
    return n == 0;
}

/* Whether a set*id call by this task cannot change its fs credentials: its real, effective,
 * saved and fs ids are one uid and one gid, and it lacks CAP_SETUID and CAP_SETGID even in its
 * permitted set (so no capset can bring them back; no_new_privs keeps exec from adding them).
 * Such a task may only "change" to the ids it has, and setgroups is refused to it. This is
 * every task in a sandbox: the launcher leaves no capability. */
static bool ids_fixed(const char *text) {
    const char *keys[2] = {"Uid:", "Gid:"};
    for (int k = 0; k < 2; k++) {
        unsigned long first, v;
        const char *f = status_field(text, keys[k]);
        if (!nth_number(f, 0, &first))
            return false;
        for (int i = 1; i < 4; i++)
            if (!nth_number(f, i, &v) || v != first)
                return false;
    }
    const char *f = status_field(text, "CapPrm:");
    if (!f)
        return false;
    unsigned long long prm = strtoull(f, NULL, 16);
    return !(prm & ((1ULL << CAP_SETUID) | (1ULL << CAP_SETGID)));
}

/* umask(2), a set*id call or an exec: recorded as pending, then let run (none creates a name,
 * so there is nothing to check and nothing the task could change under us). A set*id call that
 * cannot change anything (ids_fixed) and an exec by a group leader leave the cache as it is. */
void state_change(struct ccs *s, struct seccomp_notif *n) {
    pid_t tid = (pid_t)n->pid;
    state_settled(s, tid); /* this thread's earlier change has run */
    bool is_umask = n->data.nr == SYS_umask;
    bool is_exec = n->data.nr == SYS_execve || n->data.nr == SYS_execveat;
    bool track = true;
    int fd = -1;
    if (is_exec) {
        /* A group leader keeps its id through exec (no_new_privs keeps its ids): only another
         * thread's exec, which takes over the leader's id, is tracked. pidfd_open without
         * PIDFD_THREAD succeeds for a leader only. */
        int pfd = (int)syscall(SYS_pidfd_open, tid, 0);
        if (pfd >= 0)
            close(pfd);
        track = pfd < 0 && errno != ESRCH;
    }
    if (track) {
        char name[48];
        snprintf(name, sizeof name, "%d/status", (int)tid);
        fd = openat(s->proc_fd, name, O_RDONLY | O_CLOEXEC);
        if (fd < 0 && errno == ENOENT) {
            track = false; /* the task is gone: its call will never run */
        } else if (fd >= 0 && !is_umask && !is_exec) {
            char text[STATUS_BYTES];
            if (read_status(fd, text, sizeof text) == 0 && ids_fixed(text)) {
                close(fd);
                fd = -1;
                track = false;
            }
        }
    }
    if (track) {
        pthread_mutex_lock(&s->lock);
        int np = atomic_load(&s->npending);
        if (fd < 0 || np >= MAX_PENDING) {
            atomic_store(&s->cache_off, true); /* untracked: never trust a cached status again */
            if (fd >= 0)
                close(fd);
        } else {
            s->pending[np] = (struct pending){.tid = tid, .status_fd = fd, .is_umask = is_umask,
                                              .want = (mode_t)(n->data.args[0] & 0777)};
            atomic_store(&s->npending, np + 1);
        }
        atomic_fetch_add(&s->state_gen, 1);
        pthread_mutex_unlock(&s->lock);
    }
    respond_continue(s, n->id);
}

static int parse_status(const char *text, struct task_info *ti) {
    unsigned long v;
    int um = status_umask(text);
    if (um < 0)
        return EPROTO;
    ti->umask = (mode_t)um;
    if (!nth_number(status_field(text, "Uid:"), 3, &v))
        return EPROTO;
    ti->fsuid = (uid_t)v;
    if (!nth_number(status_field(text, "Gid:"), 3, &v))
        return EPROTO;
    ti->fsgid = (gid_t)v;
    ti->ns_tgid = last_number(status_field(text, "NStgid:"));
    ti->ns_tid = last_number(status_field(text, "NSpid:"));
    ti->ngroups = 0;
    const char *f = status_field(text, "Groups:");
    while (f && *f && *f != '\n') {
        while (*f == ' ' || *f == '\t')
            f++;
        if (!isdigit((unsigned char)*f))
            break;
        if (ti->ngroups >= (int)(sizeof ti->groups / sizeof ti->groups[0])) {
            ti->ngroups = -1;
            break;
        }
        ti->groups[ti->ngroups++] = (gid_t)strtoul(f, (char **)&f, 10);
    }
    if (ti->ngroups > 0)
        qsort(ti->groups, (size_t)ti->ngroups, sizeof(gid_t), cmp_gid);
    return 0;
}

/* What the trapping task is: from the cache when it is surely still true, else read from its
 * status (see struct tid_entry). */
int read_task_info(struct req *q) {
    struct ccs *s = q->s;
    pid_t tid = (pid_t)q->n->pid;
    /* The generation is taken before anything is read: a change that comes after it makes
     * what is read now stale for the next call, never for this one (they run concurrently). */
    unsigned long long gen = atomic_load(&s->state_gen);
    bool settled = state_settled(s, tid);
    struct tid_entry *e = NULL;
    for (int i = 0; i < TID_CACHE; i++) {
        if (tid_cache[i].tid == tid) {
            e = &tid_cache[i];
            break;
        }
    }
    char text[STATUS_BYTES];
    int err = ESRCH;
    if (e) {
        if (settled && e->gen == gen && task_alive(e->pidfd)) {
            atomic_fetch_add(&s->cache_hits, 1);
            q->ti = e->ti;
            q->proc_fd = e->proc_fd;
            q->pidfd = e->pidfd;
            q->entry = e;
            return 0;
        }
        err = read_status(e->status_fd, text, sizeof text);
        if (err)
            tid_entry_close(e); /* the task we cached is gone: the tid may be someone new */
    }
    if (err) {
        e = &tid_cache[tid_next++ % TID_CACHE];
        tid_entry_close(e);
        err = tid_entry_open(s->proc_fd, tid, e);
        if (err)
            return err;
        err = read_status(e->status_fd, text, sizeof text);
        if (err) {
            tid_entry_close(e);
            return err;
        }
    }
    e->gen = 0;
    err = parse_status(text, &e->ti);
    if (err)
        return err;
    if (settled && e->pidfd >= 0)
        e->gen = gen;
    q->ti = e->ti;
    q->proc_fd = e->proc_fd; /* borrowed from the cache */
    q->pidfd = e->pidfd;
    q->entry = e;
    return 0;
}

bool same_credentials(struct ccs *s, struct task_info *ti) {
    if (ti->fsuid != s->uid || ti->fsgid != s->gid || ti->ngroups != s->ngroups)
        return false;
    return ti->ngroups == 0 ||
           memcmp(ti->groups, s->groups, (size_t)ti->ngroups * sizeof(gid_t)) == 0;
}

/* From /proc/<pid>/status: its parent (PPid:), its pid in its own PID namespace (the last
 * NSpid: number) and how deep that namespace is (how many NSpid: numbers); false when the
 * process is gone. */
static bool parent_and_inner(struct ccs *s, pid_t pid, long *parent, long *inner, int *levels) {
    char name[32], text[STATUS_BYTES];
    snprintf(name, sizeof name, "%d/status", (int)pid);
    int fd = openat(s->proc_fd, name, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    int err = read_status(fd, text, sizeof text);
    close(fd);
    unsigned long v;
    if (err || !nth_number(status_field(text, "PPid:"), 0, &v))
        return false;
    *parent = (long)v;
    const char *nspid = status_field(text, "NSpid:");
    for (*levels = 0; nth_number(nspid, *levels, &v);)
        ++*levels;
    *inner = last_number(nspid);
    return *inner > 0;
}

/*
 * In a session sandbox, the keeper the task runs under, as the sandbox numbers it: the ancestor
 * whose parent is the sandbox's PID 1 (each keeper is a subreaper, so what its command leaves is
 * reparented to it, never past it). The task is asleep in its call, so its ancestry is there to
 * be read; 0 when it cannot be found, or when the walk would leave the task's PID namespace
 * (the task is that PID 1).
 */
long keeper_of(struct ccs *s, pid_t tid) {
    long parent, inner, up_parent, up_inner;
    int levels, up_levels;
    if (!parent_and_inner(s, tid, &parent, &inner, &levels))
        return 0;
    for (int depth = 0; depth < 4096 && parent > 0; depth++) {
        if (!parent_and_inner(s, (pid_t)parent, &up_parent, &up_inner, &up_levels) ||
            up_levels != levels)
            return 0;
        if (up_inner == 1)
            return inner;
        parent = up_parent;
        inner = up_inner;
    }
    return 0;
}

/* Whether thread `tid` may still be running (a tid reused since makes it look so: then only
 * that thread's next call retires its entry; nothing is held open meanwhile). */
static bool thread_alive(pid_t tid) {
    int fd = (int)syscall(SYS_pidfd_open, tid, PIDFD_THREAD);
    if (fd < 0 && errno == EINVAL)
        fd = (int)syscall(SYS_pidfd_open, tid, 0);
    if (fd >= 0) {
        close(fd);
        return true;
    }
    return errno != ESRCH;
}

/* Whether no cwd or root change is in flight (retiring those of threads that are gone), with
 * the generation then in `gen`. */
static bool fs_stable(struct ccs *s, unsigned long long *gen) {
    if (atomic_load(&s->fs_cache_off))
        return false;
    *gen = atomic_load(&s->fs_gen);
    if (atomic_load(&s->nfs_inflight) == 0)
        return true;
    pthread_mutex_lock(&s->lock);
    int n = atomic_load(&s->nfs_inflight);
    for (int i = 0; i < n;) {
        struct fs_change *c = &s->fs_inflight[i];
        if (!thread_alive(c->tid)) {
            *c = s->fs_inflight[--n];
        } else {
            i++;
        }
    }
    atomic_store(&s->nfs_inflight, n);
    pthread_mutex_unlock(&s->lock);
    *gen = atomic_load(&s->fs_gen);
    return n == 0;
}

/* A call of thread `tid` has begun: its own cwd or root changes before it have run. */
void fs_retire(struct ccs *s, pid_t tid) {
    if (atomic_load(&s->nfs_inflight) == 0)
        return;
    pthread_mutex_lock(&s->lock);
    int n = atomic_load(&s->nfs_inflight);
    for (int i = 0; i < n;) {
        struct fs_change *c = &s->fs_inflight[i];
        if (c->tid == tid) {
            *c = s->fs_inflight[--n];
        } else {
            i++;
        }
    }
    atomic_store(&s->nfs_inflight, n);
    pthread_mutex_unlock(&s->lock);
}

/* chdir, fchdir, chroot, pivot_root, setns or unshare: the cwd and root caches are stale from
 * now on, and none is filled until this call has surely run; let it run. */
void fs_change(struct ccs *s, struct seccomp_notif *n) {
    pid_t tid = (pid_t)n->pid;
    pthread_mutex_lock(&s->lock);
    int k = atomic_load(&s->nfs_inflight);
    if (k < MAX_FS_INFLIGHT) {
        s->fs_inflight[k] = (struct fs_change){.tid = tid};
        atomic_store(&s->nfs_inflight, k + 1);
    } else {
        atomic_store(&s->fs_cache_off, true);
    }
    atomic_fetch_add(&s->fs_gen, 1);
    pthread_mutex_unlock(&s->lock);
    respond_continue(s, n->id);
}

/*
 * The task's cwd or root ("cwd", "root"), O_PATH: the cached one while no change of either has
 * been trapped since it was opened, else opened from /proc/<tid>/ (a procfs link: ~3 us here,
 * more under load), and kept when no change was in flight before or during that open (any
 * later change bumps fs_gen first). The fd is the cache's (`*cached`) or the caller's.
 */
int task_start_fd(struct req *q, bool root, int *out, bool *cached) {
    struct tid_entry *e = q->entry;
    int *slot = e ? (root ? &e->root_fd : &e->cwd_fd) : NULL;
    unsigned long long *slot_gen = e ? (root ? &e->root_gen : &e->cwd_gen) : NULL;
    *cached = false;
    if (slot && *slot >= 0 && *slot_gen == atomic_load(&q->s->fs_gen) &&
        !atomic_load(&q->s->fs_cache_off)) {
        *out = *slot;
        *cached = true;
        return 0;
    }
    unsigned long long gen = 0;
    bool keep = slot && fs_stable(q->s, &gen);
    int fd = openat(q->proc_fd, root ? "root" : "cwd", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? ESRCH : errno;
    if (keep && atomic_load(&q->s->fs_gen) == gen && atomic_load(&q->s->nfs_inflight) == 0) {
        close_fd(slot);
        *slot = fd;
        *slot_gen = gen;
        *cached = true;
    }
    *out = fd;
    return 0;
}
