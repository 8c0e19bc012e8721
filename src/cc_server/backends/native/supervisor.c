/*
 * Per notification (see handle()):
 *   1. know the trapping thread: its /proc/<tid> and what its status says (umask, fsuid,
 *      fsgid, groups, pids in its own namespace), read once and then kept per worker while
 *      the thread lives and nothing could have changed it (struct tid_entry); copy the path
 *      strings with process_vm_readv; then SECCOMP_IOCTL_NOTIF_ID_VALID: the fds and the
 *      bytes belong to the live task. From here on only the copies are used.
 *   2. resolve each path ourselves, component by component, with O_PATH|O_NOFOLLOW fds,
 *      starting at the thread's root, cwd or fd (from /proc/<tid>), so the walk stays in the
 *      sandbox's mounts: symlinks are spliced in by hand (at most 40; absolute ones restart at
 *      the sandbox's root), ".." never climbs above that root, procfs "self" and "thread-self"
 *      are the trapping task, other procfs links are the kernel's to follow. The result is a
 *      pinned parent directory fd and the final name, which is the name that is checked and
 *      the only name the emulation can create (every *at call below uses that fd and name, and
 *      opens add O_NOFOLLOW).
 *      An open whose path holds no symlink, no magic link and no ".." above its start, and
 *      whose name matches no glob, takes a shortcut with the same result: one openat2 with
 *      RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH (open_beneath).
 *   3. emulate: openat (then hand the fd over with SECCOMP_IOCTL_NOTIF_ADDFD, on this CPU:
 *      hold_here), renameat2, linkat, symlinkat, mknodat, mkdirat, bind (on the process's
 *      own socket, fetched with pidfd_getfd). A refused name gets EACCES and one "refused"
 *      record on the report pipe.
 *
 * Credentials: worker threads drop every capability (per-thread, permanently) and keep the
 * server's uid and gids, which are the sandbox's own (bwrap maps exactly one uid and gid), or,
 * for a root server, take on the sandbox's host identity (uid, gid, no groups; per thread, see
 * switch_identity); a notification from a task whose fsuid, fsgid or groups differ is refused. Each worker has its
 * own fs_struct (unshare(CLONE_FS)) so it can take on the process's umask.
 *
 * umask(2), the set*id calls and execve(at) are trapped too, only so that the cache of step 1
 * stays true: none creates a name, and each is let run (SECCOMP_USER_NOTIF_FLAG_CONTINUE) once
 * noted (see state_change). So are clone, clone3, fork, vfork and sched_{set,get}affinity, only
 * so that a task held to a CPU for a run of opens gets its affinity back first (see
 * hold_here). Every call that can create a name is emulated, never continued.
 *
 * Threads: the first worker polls the listener and takes every call while they come from one
 * task at a time. The kernel wakes it on the trapping task's CPU when
 * SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP took, and an open is answered with the task kept on that
 * CPU (hold_here), so a create costs no wake-up of another (idle, halted) vCPU. The other
 * workers stand by: a poller more would be woken with the first for every call. When a call of
 * another task was already waiting as the first worker finished one, tasks are trapping on
 * several CPUs: for CROWD_MS every worker polls and takes one notification each (poll + RECV
 * under a mutex, so RECV never blocks), and no task is held to a CPU. An open of an existing
 * FIFO that would block is finished by a detached helper thread, so no FIFO can stall the
 * workers; a helper whose process died, or that is still waiting when the supervisor stops, is
 * released by opening its FIFO O_RDWR once.
 */
#include "supervisor.h"

#define CCS_ABI_VERSION 10

/* The thread-locals several files share (declared, and explained, in supervisor.h). */
__thread cpu_set_t worker_cpus;
__thread bool worker_cpus_known;
__thread int worker_held_on = -1;
__thread char judged[PATH_MAX + NAME_MAX + 2];

/* The calls that change a task's umask or fs credentials, or (an exec by a thread that does
 * not lead its group, which takes over the leader's id) what a thread id stands for: trapped so
 * the cache can follow. */
/* Calls an older filter trapped so that a CPU pin was released first; this one traps none of
 * them (a held task never runs its own code with the pin: see hold_here). Let run. */
static bool is_pin_point(int nr) {
    switch (nr) {
    case SYS_clone:
    case SYS_clone3:
#ifdef SYS_fork
    case SYS_fork:
#endif
#ifdef SYS_vfork
    case SYS_vfork:
#endif
    case SYS_sched_setaffinity:
    case SYS_sched_getaffinity: return true;
    default: return false;
    }
}

/* The calls that change a thread's cwd or root (see fs_change). */
static bool is_fs_change(int nr) {
    switch (nr) {
    case SYS_chdir:
    case SYS_fchdir:
    case SYS_chroot:
    case SYS_pivot_root:
    case SYS_setns:
    case SYS_unshare: return true;
    default: return false;
    }
}

static bool is_state_change(int nr) {
    switch (nr) {
    case SYS_umask:
    case SYS_setuid:
    case SYS_setgid:
    case SYS_setreuid:
    case SYS_setregid:
    case SYS_setresuid:
    case SYS_setresgid:
    case SYS_setfsuid:
    case SYS_setfsgid:
    case SYS_setgroups:
    case SYS_execve:
    case SYS_execveat: return true;
    default: return false;
    }
}

static const char *syscall_name(int nr) {
    switch (nr) {
#ifdef SYS_open
    case SYS_open: return "open";
#endif
#ifdef SYS_creat
    case SYS_creat: return "creat";
#endif
    case SYS_openat: return "openat";
#ifdef SYS_mknod
    case SYS_mknod: return "mknod";
#endif
    case SYS_mknodat: return "mknodat";
#ifdef SYS_mkdir
    case SYS_mkdir: return "mkdir";
#endif
    case SYS_mkdirat: return "mkdirat";
#ifdef SYS_symlink
    case SYS_symlink: return "symlink";
#endif
    case SYS_symlinkat: return "symlinkat";
#ifdef SYS_link
    case SYS_link: return "link";
#endif
    case SYS_linkat: return "linkat";
#ifdef SYS_rename
    case SYS_rename: return "rename";
#endif
#ifdef SYS_renameat
    case SYS_renameat: return "renameat";
#endif
    case SYS_renameat2: return "renameat2";
    case SYS_bind: return "bind";
    case SYS_connect: return "connect";
#ifdef SYS_unlink
    case SYS_unlink: return "unlink";
#endif
#ifdef SYS_rmdir
    case SYS_rmdir: return "rmdir";
#endif
    case SYS_unlinkat: return "unlinkat";
#ifdef SYS_truncate
    case SYS_truncate: return "truncate";
#endif
#ifdef SYS_chmod
    case SYS_chmod: return "chmod";
#endif
    case SYS_fchmodat: return "fchmodat";
    case SYS_fchmod: return "fchmod";
    case NR_FCHMODAT2: return "fchmodat2";
    default: return NULL;
    }
}

static int arg_int(uint64_t v) { return (int)(uint32_t)v; }

static void dispatch(struct req *q) {
    const __u64 *a = q->n->data.args;
    switch (q->n->data.nr) {
#ifdef SYS_open
    case SYS_open: do_open(q, AT_FDCWD, a[0], arg_int(a[1]), (mode_t)a[2]); break;
#endif
#ifdef SYS_creat
    case SYS_creat: do_open(q, AT_FDCWD, a[0], O_CREAT | O_WRONLY | O_TRUNC, (mode_t)a[1]); break;
#endif
    case SYS_openat: do_open(q, arg_int(a[0]), a[1], arg_int(a[2]), (mode_t)a[3]); break;
#ifdef SYS_mknod
    case SYS_mknod: do_mknod_mkdir(q, AT_FDCWD, a[0], (mode_t)a[1], (dev_t)(uint32_t)a[2], false); break;
#endif
    case SYS_mknodat:
        do_mknod_mkdir(q, arg_int(a[0]), a[1], (mode_t)a[2], (dev_t)(uint32_t)a[3], false);
        break;
#ifdef SYS_mkdir
    case SYS_mkdir: do_mknod_mkdir(q, AT_FDCWD, a[0], (mode_t)a[1], 0, true); break;
#endif
    case SYS_mkdirat: do_mknod_mkdir(q, arg_int(a[0]), a[1], (mode_t)a[2], 0, true); break;
#ifdef SYS_symlink
    case SYS_symlink: do_symlink(q, a[0], AT_FDCWD, a[1]); break;
#endif
    case SYS_symlinkat: do_symlink(q, a[0], arg_int(a[1]), a[2]); break;
#ifdef SYS_link
    case SYS_link: do_link(q, AT_FDCWD, a[0], AT_FDCWD, a[1], 0); break;
#endif
    case SYS_linkat:
        do_link(q, arg_int(a[0]), a[1], arg_int(a[2]), a[3], arg_int(a[4]));
        break;
#ifdef SYS_rename
    case SYS_rename: do_rename(q, AT_FDCWD, a[0], AT_FDCWD, a[1], 0); break;
#endif
#ifdef SYS_renameat
    case SYS_renameat: do_rename(q, arg_int(a[0]), a[1], arg_int(a[2]), a[3], 0); break;
#endif
    case SYS_renameat2:
        do_rename(q, arg_int(a[0]), a[1], arg_int(a[2]), a[3], (unsigned)a[4]);
        break;
    case SYS_bind: do_bind(q, arg_int(a[0]), a[1], a[2]); break;
    case SYS_connect: do_connect(q, arg_int(a[0]), a[1], a[2]); break;
#ifdef SYS_unlink
    case SYS_unlink: do_unlink(q, AT_FDCWD, a[0], 0); break;
#endif
#ifdef SYS_rmdir
    case SYS_rmdir: do_unlink(q, AT_FDCWD, a[0], AT_REMOVEDIR); break;
#endif
    case SYS_unlinkat: do_unlink(q, arg_int(a[0]), a[1], arg_int(a[2])); break;
#ifdef SYS_truncate
    case SYS_truncate: do_truncate(q, a[0], (int64_t)a[1]); break;
#endif
#ifdef SYS_chmod
    case SYS_chmod: do_chmod(q, AT_FDCWD, a[0], (mode_t)a[1], 0); break;
#endif
    case SYS_fchmodat: do_chmod(q, arg_int(a[0]), a[1], (mode_t)a[2], 0); break;
    case SYS_fchmod: do_fchmod(q, arg_int(a[0]), (mode_t)a[1]); break;
    case NR_FCHMODAT2: do_chmod(q, arg_int(a[0]), a[1], (mode_t)a[2], arg_int(a[3])); break;
    default: break; /* not reached: handle() decoded it */
    }
}

static void handle(struct ccs *s, struct seccomp_notif *n) {
    atomic_fetch_add(&s->handled, 1);
    struct req q = {.s = s, .n = n, .proc_fd = -1, .pidfd = -1, .root_fd = -1};
    /* What judge_path checks a path against, for this call only. */
    struct req *judging_q __attribute__((cleanup(end_judging))) = &q;
    begin_judging(judging_q);
    fs_retire(s, (pid_t)n->pid); /* its own earlier cwd or root change has run */
    judged[0] = '\0';
    q.sysname = syscall_name(n->data.nr);
    if (n->data.arch != NATIVE_ARCH || (X32_SYSCALL_BIT && (n->data.nr & X32_SYSCALL_BIT)) ||
        (q.sysname == NULL && !is_state_change(n->data.nr) && !is_pin_point(n->data.nr) &&
         !is_fs_change(n->data.nr))) {
        q.sysname = "?";
        report_error(&q, "", "undecodable notification: arch %#x nr %d", n->data.arch,
                     n->data.nr);
        respond(s, n->id, 0, ENOSYS);
        return;
    }
    if (is_pin_point(n->data.nr)) {
        respond_continue(s, n->id);
        return;
    }
    if (is_state_change(n->data.nr)) {
        state_change(s, n);
        return;
    }
    if (is_fs_change(n->data.nr)) {
        fs_change(s, n);
        return;
    }
    int err = read_task_info(&q);
    if (err) {
        /* Alive but unreadable (ESRCH while the id is valid: our /proc shows another pid
         * namespace): refused, never let through. */
        if (id_valid(s, n->id)) {
            report_error(&q, "", "cannot read /proc/%u/status: %s", n->pid, strerror(err));
            respond(s, n->id, 0, EPERM);
        }
        return;
    }
    if (!same_credentials(s, &q.ti)) {
        if (id_valid(s, n->id)) {
            report_error(&q, "", "task %u runs with other credentials (fsuid %u, fsgid %u)",
                         n->pid, q.ti.fsuid, q.ti.fsgid);
            respond(s, n->id, 0, EACCES);
        }
        return;
    }
    dispatch(&q);
    if (!q.root_borrowed)
        close_fd(&q.root_fd);
}

/* --- threads ------------------------------------------------------------------------------- */

static int drop_capabilities(void) {
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    return (int)syscall(SYS_capset, &hdr, data);
}

/* This thread only (raw syscalls: libc's set*id calls change every thread of the server). */
static int switch_identity(struct ccs *s) {
    if (syscall(SYS_setgroups, 0, NULL) < 0 ||
        syscall(SYS_setresgid, s->gid, s->gid, s->gid) < 0 ||
        syscall(SYS_setresuid, s->uid, s->uid, s->uid) < 0)
        return -1;
    if (syscall(SYS_setresuid, 0, 0, 0) == 0) { /* must not come back */
        errno = EPERM;
        return -1;
    }
    return 0;
}

/* Stop every worker: the polling ones see stop_fd, the standby ones crowd_cond. */
static void set_stopping(struct ccs *s) {
    pthread_mutex_lock(&s->lock);
    atomic_store(&s->stopping, 1);
    pthread_cond_broadcast(&s->crowd_cond);
    pthread_mutex_unlock(&s->lock);
}

static void *worker(void *arg) {
    struct ccs *s = arg;
    prctl(PR_SET_NAME, "cc-create-sup", 0, 0, 0);
    int err = 0;
    const char *what = NULL;
    if (unshare(CLONE_FS) < 0) {
        err = errno;
        what = "unshare(CLONE_FS)";
    } else if (s->switch_id && switch_identity(s) < 0) {
        err = errno;
        what = "switch to the sandbox identity";
    } else if (drop_capabilities() < 0) {
        err = errno;
        what = "capset";
    }
    pthread_mutex_lock(&s->lock);
    if (what) {
        s->failed++;
        snprintf(s->setup_error, sizeof s->setup_error, "%s: %s", what, strerror(err));
    }
    s->ready++;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    if (what)
        return NULL;

    tid_cache_init();
    worker_cpus_known = sched_getaffinity(0, sizeof worker_cpus, &worker_cpus) == 0;
    /* SCHED_BATCH: a worker woken while a task runs on its CPU (the end of an ADDFD, see
     * hold_here) waits for the task to sleep instead of preempting it. Same CPU share. */
    struct sched_param batch = {0};
    sched_setscheduler(0, SCHED_BATCH, &batch);
    int index = atomic_fetch_add(&s->next_worker, 1);
    pid_t last_tid = 0;
    struct seccomp_notif notif;
    while (!atomic_load(&s->stopping)) {
        if (index > 0 && !crowded(s)) {
            /* Standby: the first worker alone takes the calls of one task at a time, and a
             * second one polling would only be woken with it for every call. */
            worker_release_cpu();
            pthread_mutex_lock(&s->lock);
            while (!atomic_load(&s->stopping) && !crowded(s))
                pthread_cond_wait(&s->crowd_cond, &s->lock);
            pthread_mutex_unlock(&s->lock);
            continue;
        }
        struct pollfd p[2] = {{.fd = s->listener, .events = POLLIN},
                              {.fd = s->stop_fd, .events = POLLIN}};
        int timeout = atomic_load(&s->nhelpers) ? HELPER_POLL_MS
                      : worker_held_on >= 0     ? PIN_IDLE_MS
                                                : -1;
        if (index > 0) { /* back to standby when the crowd is gone */
            long long left = (atomic_load(&s->crowded_until) - now_ns()) / 1000000 + 1;
            if (timeout < 0 || left < timeout)
                timeout = left < 0 ? 0 : (int)left;
        }
        /* Whether a call was already waiting: then it may come from another task than the
         * last one, while that one ran (see the crowd check below). */
        int r = poll(p, 2, 0);
        bool waited = r == 0;
        if (r == 0)
            r = poll(p, 2, timeout);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 || p[1].revents) {
            set_stopping(s);
            break;
        }
        if (r == 0) {
            worker_release_cpu();
            if (atomic_load(&s->nhelpers))
                rescue_helpers(s, false);
            continue;
        }
        if (p[0].revents & POLLIN) {
            /* Every idle worker wakes for a notification; one takes it. POLLIN again under the
             * lock means one is still waiting, so RECV cannot block (a blocked RECV could not
             * see stop_fd). A worker alone needs neither: nobody else takes it, and a
             * notification whose task died meanwhile makes RECV fail with ENOENT. */
            bool got = false;
            if (s->nworkers == 1) {
                memset(&notif, 0, sizeof notif); /* RECV refuses a buffer that is not zeroed */
                got = ioctl(s->listener, SECCOMP_IOCTL_NOTIF_RECV, &notif) == 0;
            } else {
                pthread_mutex_lock(&s->recv_lock);
                struct pollfd again = {.fd = s->listener, .events = POLLIN};
                if (poll(&again, 1, 0) == 1 && (again.revents & POLLIN)) {
                    memset(&notif, 0, sizeof notif);
                    got = ioctl(s->listener, SECCOMP_IOCTL_NOTIF_RECV, &notif) == 0;
                }
                pthread_mutex_unlock(&s->recv_lock);
            }
            if (!got)
                continue; /* another worker took it, or the task died (ENOENT) */
            if (!waited && (pid_t)notif.pid != last_tid) {
                /* Another task's call waited while this worker answered the last one: tasks
                 * are trapping on several CPUs. For CROWD_MS every worker polls, and no task is
                 * held to this worker's CPU. */
                long long now = now_ns();
                if (atomic_exchange(&s->crowded_until, now + CROWD_MS * 1000000LL) <= now) {
                    pthread_mutex_lock(&s->lock);
                    pthread_cond_broadcast(&s->crowd_cond);
                    pthread_mutex_unlock(&s->lock);
                }
                worker_release_cpu();
            }
            last_tid = (pid_t)notif.pid;
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            handle(s, &notif);
            clock_gettime(CLOCK_MONOTONIC, &t1);
            atomic_fetch_add(&s->busy_ns,
                             (unsigned long long)((t1.tv_sec - t0.tv_sec) * 1000000000LL +
                                                  (t1.tv_nsec - t0.tv_nsec)));
            continue;
        }
        if (p[0].revents & (POLLHUP | POLLERR | POLLNVAL)) {
            /* Every task of the filter is gone. */
            set_stopping(s);
            break;
        }
    }
    tid_cache_clear();
    return NULL;
}

static void destroy(struct ccs *s) {
    for (int i = 0; i < atomic_load(&s->npending); i++)
        close(s->pending[i].status_fd);
    if (s->stop_fd >= 0)
        close(s->stop_fd);
    if (s->proc_fd >= 0)
        close(s->proc_fd);
    pthread_mutex_destroy(&s->recv_lock);
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->cond);
    pthread_cond_destroy(&s->crowd_cond);
    free(s->globs);
    free(s->forms);
    free(s->pats);
    free(s->pat_tree);
    free(s->pat_last);
    free(s->pat_last_literal);
    if (s->pat_first)
        for (int i = 0; i < s->npats; i++)
            free(s->pat_first[i]);
    free(s->pat_first);
    free(s->roots);
    free(s->exempts);
    free(s->absolutes);
    free(s->sockdirs);
    if (s->prefixes)
        for (int i = 0; i < s->nprefixes; i++)
            free(s->prefixes[i]);
    free(s->prefixes);
    if (s->conn_fd >= 0)
        close(s->conn_fd);
    if (s->diag_fd >= 0)
        close(s->diag_fd);
    pthread_mutex_destroy(&s->diag_lock);
    pthread_mutex_destroy(&s->conn_lock);
    for (int i = 0; i < s->nown_wt; i++)
        close(s->own_wt[i].fd);
    pthread_mutex_destroy(&s->wt_lock);
    pthread_mutex_destroy(&s->mnt_lock);
    free(s->mnt_ids);
    free(s->glob_blob);
    free(s->groups);
    free(s->threads);
    free(s);
}

/* Stop the workers and wait for them and for every FIFO helper; then close the listener (every
 * notification still pending fails with ENOSYS) and the report fd. */
CCS_API void ccs_stop(struct ccs *s);

CCS_API int ccs_abi_version(void) { return CCS_ABI_VERSION; }

/*
 * Start supervising `listener` (taken over: closed by ccs_stop). `globs` holds `globs_len`
 * bytes of NUL-terminated glob patterns. Records go to `report_fd` (taken over; should be
 * non-blocking: a full pipe drops the record and counts it). `flags` bit 0: ask the kernel to
 * wake the task on the supervisor's CPU (SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP, 6.6+; ignored when
 * unsupported); bit 1: answer opens with the task kept on the worker's CPU (hold_here).
 * Returns NULL with a message in `err` on failure (then both fds are closed).
 */
CCS_API
struct ccs *ccs_start(int listener, int connector, int diag, const char *globs, size_t globs_len,
                      int report_fd, int nworkers, unsigned flags, long long identity_uid,
                      long long identity_gid, char *err, size_t errlen) {
    open_self_fds();
    struct ccs *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, errlen, "out of memory");
        close(listener);
        close(report_fd);
        if (connector >= 0)
            close(connector);
        if (diag >= 0)
            close(diag);
        return NULL;
    }
    s->listener = listener;
    s->report_fd = report_fd;
    s->conn_fd = connector;
    s->diag_fd = diag;
    pthread_mutex_init(&s->diag_lock, NULL);
    pthread_mutex_init(&s->conn_lock, NULL);
    pthread_mutex_init(&s->wt_lock, NULL);
    pthread_mutex_init(&s->mnt_lock, NULL);
    s->stop_fd = -1;
    s->proc_fd = -1;
    pthread_mutex_init(&s->recv_lock, NULL);
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cond, NULL);
    pthread_cond_init(&s->crowd_cond, NULL);
    if (nworkers < 1 || nworkers > 64 || globs_len == 0 || globs[globs_len - 1] != '\0') {
        snprintf(err, errlen, "bad arguments (workers %d, %zu glob bytes)", nworkers, globs_len);
        goto fail;
    }
    s->glob_blob = malloc(globs_len);
    if (!s->glob_blob)
        goto oom;
    memcpy(s->glob_blob, globs, globs_len);
    /* The rules: NUL-terminated entries, each "<kind>:<text>": g a name glob, p a path pattern,
     * r a scope root, x an exempt root, a an absolute path. */
    size_t entries = 0;
    for (size_t i = 0; i < globs_len; i++)
        entries += globs[i] == '\0';
    s->globs = calloc(entries, sizeof(char *));
    s->forms = calloc(entries, sizeof(struct glob_form));
    s->pats = calloc(entries, sizeof(char *));
    s->pat_tree = calloc(entries, sizeof(bool));
    s->pat_last = calloc(entries, sizeof(char *));
    s->pat_last_literal = calloc(entries, sizeof(bool));
    s->pat_first = calloc(entries, sizeof(char *));
    s->roots = calloc(entries, sizeof(char *));
    s->exempts = calloc(entries, sizeof(char *));
    s->absolutes = calloc(entries, sizeof(char *));
    s->sockdirs = calloc(entries, sizeof(char *));
    s->prefixes = calloc(MAX_PREFIXES, sizeof(char *));
    if (!s->globs || !s->forms || !s->pats || !s->pat_tree || !s->pat_last ||
        !s->pat_last_literal || !s->pat_first || !s->roots ||
        !s->exempts || !s->absolutes || !s->sockdirs || !s->prefixes)
        goto oom;
    char *g = s->glob_blob;
    for (size_t i = 0; i < entries; i++) {
        size_t len = strlen(g);
        char kind = len >= 2 && g[1] == ':' ? g[0] : '?';
        char *text = g + 2;
        g += len + 1;
        switch (kind) {
        case 'g':
            s->globs[s->nglobs] = text;
            s->forms[s->nglobs] = glob_form_of(text);
            s->nglobs++;
            break;
        case 'p': {
            size_t n = strlen(text);
            bool tree = n > 3 && strcmp(text + n - 3, "/**") == 0;
            if (tree)
                text[n - 3] = '\0';
            if (!*text || text[0] == '/') {
                snprintf(err, errlen, "bad path pattern %s", text);
                goto fail;
            }
            const char *last = strrchr(text, '/');
            s->pat_tree[s->npats] = tree;
            if (tree) {
                size_t first = strcspn(text, "/");
                if (strcspn(text, "*?[\\") >= first) {
                    s->pat_first[s->npats] = strndup(text, first);
                    if (!s->pat_first[s->npats])
                        goto oom;
                }
            }
            s->pat_last[s->npats] = tree ? NULL : (last ? last + 1 : text);
            s->pat_last_literal[s->npats] =
                !tree && strcspn(s->pat_last[s->npats], "*?[\\") == strlen(s->pat_last[s->npats]);
            s->pats[s->npats++] = text;
            /* Its proper prefixes, component by component (".git/worktrees/x" and the like). */
            for (const char *slash = strchr(text, '/'); slash; slash = strchr(slash + 1, '/')) {
                if (s->nprefixes == MAX_PREFIXES)
                    break;
                char *prefix = strndup(text, (size_t)(slash - text));
                if (!prefix)
                    goto oom;
                s->prefixes[s->nprefixes++] = prefix;
            }
            break;
        }
        case 'r':
        case 'x':
        case 'a':
        case 's':
            if (text[0] != '/') {
                snprintf(err, errlen, "a root must be absolute: %s", text);
                goto fail;
            }
            if (kind == 'r')
                s->roots[s->nroots++] = text;
            else if (kind == 'x')
                s->exempts[s->nexempts++] = text;
            else if (kind == 's')
                s->sockdirs[s->nsockdirs++] = text;
            else
                s->absolutes[s->nabsolutes++] = text;
            break;
        default:
            snprintf(err, errlen, "bad rule entry");
            goto fail;
        }
    }
    s->uid = geteuid();
    s->gid = getegid();
    if (identity_uid >= 0 || identity_gid >= 0) {
        /* A root server's sandbox runs as another uid and gid with no groups: each worker
         * thread takes them on (below), so it has no more reach than the sandbox's tasks. */
        if (identity_uid <= 0 || identity_gid <= 0 || identity_uid >= 0xFFFFFFFFll ||
            identity_gid >= 0xFFFFFFFFll) {
            snprintf(err, errlen, "bad identity %lld:%lld", identity_uid, identity_gid);
            goto fail;
        }
        s->uid = (uid_t)identity_uid;
        s->gid = (gid_t)identity_gid;
        s->switch_id = true;
    }
    int ng = s->switch_id ? 0 : getgroups(0, NULL);
    if (ng < 0 || ng > MAX_GROUPS) {
        snprintf(err, errlen, "getgroups: %s", strerror(errno));
        goto fail;
    }
    s->groups = calloc((size_t)ng + 1, sizeof(gid_t));
    if (!s->groups)
        goto oom;
    s->ngroups = s->switch_id ? 0 : getgroups(ng, s->groups);
    if (s->ngroups < 0) {
        snprintf(err, errlen, "getgroups: %s", strerror(errno));
        goto fail;
    }
    qsort(s->groups, (size_t)s->ngroups, sizeof(gid_t), cmp_gid);
    s->proc_fd = open("/proc", O_PATH | O_DIRECTORY | O_CLOEXEC);
    s->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (s->proc_fd < 0 || s->stop_fd < 0) {
        snprintf(err, errlen, "open /proc or eventfd: %s", strerror(errno));
        goto fail;
    }
    atomic_store(&s->state_gen, 1); /* 0 marks a cache entry that is never reused */
    if (flags & 1) {
        /* By value, not a pointer. Before 6.6: EINVAL, and every wake is an ordinary one. */
        unsigned long long f = SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP;
        s->sync_wake = ioctl(listener, SECCOMP_IOCTL_NOTIF_SET_FLAGS, f) == 0;
    }
    s->reply_here = flags & 2;
    s->threads = calloc((size_t)nworkers, sizeof(pthread_t));
    if (!s->threads)
        goto oom;
    /* Workers start with every signal blocked: a signal for the server (SIGINT, SIGCHLD) must
     * not land in them and interrupt an emulated call. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    if (s->conn_fd >= 0) {
        int rc = pthread_create(&s->conn_thread, NULL, conn_main, s);
        if (rc) {
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            snprintf(err, errlen, "pthread_create: %s", strerror(rc));
            goto fail;
        }
        s->conn_started = true;
    }
    for (int i = 0; i < nworkers; i++) {
        int rc = pthread_create(&s->threads[i], NULL, worker, s);
        if (rc) {
            pthread_mutex_lock(&s->lock);
            s->failed++;
            s->ready++;
            snprintf(s->setup_error, sizeof s->setup_error, "pthread_create: %s", strerror(rc));
            pthread_mutex_unlock(&s->lock);
            break;
        }
        s->nworkers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_mutex_lock(&s->lock);
    while (s->ready < s->nworkers + (s->nworkers < nworkers))
        pthread_cond_wait(&s->cond, &s->lock);
    int failed = s->failed;
    pthread_mutex_unlock(&s->lock);
    if (failed) {
        snprintf(err, errlen, "%s", s->setup_error);
        ccs_stop(s);
        return NULL;
    }
    return s;
oom:
    snprintf(err, errlen, "out of memory");
fail:
    close(listener);
    close(report_fd);
    destroy(s);
    return NULL;
}

CCS_API void ccs_stop(struct ccs *s) {
    if (!s)
        return;
    set_stopping(s);
    uint64_t one = 1;
    if (write(s->stop_fd, &one, sizeof one) < 0) {
        /* cannot fail for an eventfd below its maximum; the flag is set anyway */
    }
    for (int i = 0; i < s->nworkers; i++)
        pthread_join(s->threads[i], NULL);
    if (s->conn_started)
        pthread_join(s->conn_thread, NULL);
    pthread_mutex_lock(&s->lock);
    while (s->nhelpers > 0) {
        pthread_mutex_unlock(&s->lock);
        rescue_helpers(s, true);
        pthread_mutex_lock(&s->lock);
        struct timespec deadline;
        clock_gettime(CLOCK_REALTIME, &deadline);
        deadline.tv_nsec += STOP_RESCUE_MS * 1000000L;
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
        if (s->nhelpers > 0)
            pthread_cond_timedwait(&s->cond, &s->lock, &deadline);
    }
    pthread_mutex_unlock(&s->lock);
    close(s->listener);
    close(s->report_fd);
    destroy(s);
}

/* Whether every worker has stopped on its own (the sandbox's tasks are all gone). */
CCS_API int ccs_finished(struct ccs *s) { return atomic_load(&s->stopping); }

/* Counters: handled notifications, refusals, errors, dropped reports, the nanoseconds the
 * workers spent handling notifications (from RECV to the answer), calls answered from the task
 * cache, whether the kernel took SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP (1 or 0), and opens answered
 * with the task kept on the worker's CPU. */
CCS_API void ccs_stats(struct ccs *s, unsigned long long out[8]) {
    out[0] = atomic_load(&s->handled);
    out[1] = atomic_load(&s->refused);
    out[2] = atomic_load(&s->errors);
    out[3] = atomic_load(&s->dropped_reports);
    out[4] = atomic_load(&s->busy_ns);
    out[5] = atomic_load(&s->cache_hits);
    out[6] = s->sync_wake;
    out[7] = atomic_load(&s->replies_here);
}
