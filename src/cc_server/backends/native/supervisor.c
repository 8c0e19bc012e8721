/*
 * libcc-create-supervisor: decides every syscall of a sandbox that can bring a new name into
 * existence, and with the write policy's path rules every one that can change a name or a file
 * that exists, from seccomp user notifications. Loaded into the server process with ctypes; its
 * worker threads never run Python.
 *
 * The rules: a name matching one of the session's globs is never created; with path rules, a
 * protected path (a pattern below a writable root, an absolute path, a name on the way to one)
 * is never created, written, truncated, removed, renamed, linked or re-moded (the opens for
 * writing, truncate, unlink(at), rmdir and the chmod calls are trapped only then), no object of
 * a kernel filesystem is opened for a task, and a pathname Unix socket is connected to only if
 * it was bound inside the sandbox (do_connect; the connect is made by the launcher's connector).
 * Everything else the process asked for is done for it, in its view of the filesystem, and the
 * result handed back. The supervisor never answers SECCOMP_USER_NOTIF_FLAG_CONTINUE: the kernel would then
 * re-read memory the process can still change after the check.
 *
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
 *
 * Fail-closed: anything that cannot be decoded or emulated is refused with an error; if the
 * supervisor is gone, the kernel fails every trapped call with ENOSYS.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <limits.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/magic.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/sock_diag.h>
#include <linux/unix_diag.h>
#include <linux/openat2.h>
#include <linux/seccomp.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define CCS_ABI_VERSION 9

#ifndef SECCOMP_ADDFD_FLAG_SEND
#define SECCOMP_ADDFD_FLAG_SEND (1UL << 1)
#endif
#ifndef SECCOMP_IOCTL_NOTIF_SET_FLAGS
#define SECCOMP_IOCTL_NOTIF_SET_FLAGS SECCOMP_IOW(4, __u64)
#endif
#ifndef SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP
#define SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP (1UL << 0)
#endif
#ifndef PIDFD_THREAD
#define PIDFD_THREAD O_EXCL
#endif
#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif
#ifndef PROC_SUPER_MAGIC
#define PROC_SUPER_MAGIC 0x9fa0
#endif
/* fchmodat2 (Linux 6.6) has the same number on every architecture; older headers lack it. */
#define NR_FCHMODAT2 452
#define PROC_ROOT_INO 1

#if defined(__x86_64__)
#define NATIVE_ARCH AUDIT_ARCH_X86_64
#define X32_SYSCALL_BIT 0x40000000
#elif defined(__aarch64__)
#define NATIVE_ARCH AUDIT_ARCH_AARCH64
#define X32_SYSCALL_BIT 0
#else
#error "libcc-create-supervisor: unsupported architecture"
#endif

#define MAX_SYMLINKS 40           /* the kernel's limit (MAXSYMLINKS) */
#define MAX_GROUPS 65536          /* NGROUPS_MAX */
#define STATUS_BYTES 8192         /* /proc/<tid>/status is ~1.5 KiB; groups can make it longer */
#define REPORT_TARGET_MAX 1024    /* a report stays below PIPE_BUF, so writes are atomic */
#define HELPER_POLL_MS 100        /* how often pending FIFO helpers are checked for dead tasks */
#define STOP_RESCUE_MS 10         /* while stopping: how often waiting helpers are released */
#define MAX_HELPERS 64            /* FIFO opens waiting at once; more are refused with EAGAIN */
#define MAX_PENDING 32            /* state changes tracked at once; more turn the cache off */
#define MAX_CONNECTS 64           /* connects the connector runs at once (launcher.c) */
#define MAX_OWN_WORKTREES 64      /* .git/worktrees/<name> directories a sandbox made, tracked */
#define MAX_PREFIXES 256          /* proper prefixes of the path patterns (prefix_hits) */
#define PIN_IDLE_MS 1             /* a worker and a task held to one CPU for a run of opens
                                     (hold_here) get their own affinity back after this long
                                     without a call */
#define CROWD_MS 10               /* after calls of two tasks overlap: how long every worker polls
                                     and opens are answered without holding a task to a CPU */

enum { KIND_REFUSED = 'R', KIND_ERROR = 'E' };

struct helper;

/* A glob of ASCII letters and digits and punctuation with no metacharacter ("x.pem", ".env"),
 * or one with a single leading "*" ("*.pem"), is tested with a byte comparison that folds ASCII
 * case; any other glob, and every name with a byte outside ASCII, goes to fnmatch. */
enum glob_kind { GLOB_FNMATCH, GLOB_LITERAL, GLOB_SUFFIX };
struct glob_form {
    enum glob_kind kind;
    const char *text; /* the literal, or the suffix after the "*" */
    size_t len;
};

struct ccs {
    int listener;
    int report_fd;
    int stop_fd;    /* eventfd: readable once stopping */
    int proc_fd;    /* the host's /proc, O_PATH */
    char *glob_blob;
    char **globs;
    struct glob_form *forms; /* one per glob: how glob_match may test it without fnmatch */
    int nglobs;
    /* Path rules (see path_refused): patterns matched below the scope roots, the exempt roots
     * inside them, and absolute paths refused wherever they are. All point into glob_blob. */
    char **pats;
    bool *pat_tree; /* X followed by slash-star-star: X and all below it; else exact */
    const char **pat_last; /* an exact pattern's last component: a cheap first test */
    bool *pat_last_literal; /* ... with no glob character in it (compared as a string) */
    char **pat_first;      /* a tree pattern's first component, when it is a literal */
    int npats;
    char **prefixes; /* the proper prefixes of the patterns of several components (prefix_hits) */
    int nprefixes;
    char **roots;
    int nroots;
    char **exempts;
    int nexempts;
    char **absolutes;
    int nabsolutes;
    uid_t uid;
    gid_t gid;
    bool switch_id; /* workers take on uid and gid (a root server's sandbox identity) */
    gid_t *groups;  /* sorted */
    int ngroups;
    int nworkers;
    pthread_t *threads;
    pthread_mutex_t recv_lock; /* poll(0) + RECV, so a RECV never blocks */
    pthread_mutex_t lock; /* ready counting, helpers, standby workers */
    pthread_cond_t cond;
    pthread_cond_t crowd_cond; /* standby workers wait here until calls overlap (crowded) */
    atomic_int next_worker;    /* each worker's index, in the order they start */
    atomic_llong crowded_until; /* CLOCK_MONOTONIC ns until which calls count as overlapping */
    int ready, failed;
    char setup_error[256];
    struct helper *helpers;
    atomic_int nhelpers;
    atomic_int stopping;
    atomic_ullong handled, refused, errors, dropped_reports, busy_ns;
    /* Calls that change what /proc/<tid>/status says or whom a tid names (umask, the
     * credential calls, another thread's exec): each bumps state_gen, which makes every cached
     * task_info stale, and stays in `pending` until it has surely run (see state_settled). */
    atomic_ullong state_gen;
    atomic_int npending;
    atomic_bool cache_off; /* a change could not be tracked: status is read for every call */
    struct pending {
        pid_t tid;
        int status_fd;
        bool is_umask;
        mode_t want; /* the umask it sets */
    } pending[MAX_PENDING];
    atomic_ullong cache_hits;
    atomic_ullong replies_here; /* opens answered with the task kept on the worker's CPU */
    /* The task hold_here holds to a CPU, if any (one at a time), under pin_lock. */
    pthread_mutex_t pin_lock;
    atomic_int pin_tid; /* 0: none */
    int pin_pidfd;      /* the task's own pidfd (a dup), or -1 */
    int pin_cpu;
    cpu_set_t pin_saved; /* its affinity before */
    bool sync_wake; /* SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP was accepted */
    bool reply_here; /* answer opens on the worker's CPU (hold_here) */
    /* connect(2), done by the launcher's connector inside the sandbox (do_connect): its
     * control socket, a sock_diag socket of the sandbox's network namespace, the calls it has
     * not answered yet (answered by conn_main). */
    int conn_fd, diag_fd;
    char **sockdirs; /* 's' entries: host listeners below these may be connected to */
    int nsockdirs;
    pthread_mutex_t diag_lock, conn_lock;
    pthread_t conn_thread;
    bool conn_started, conn_dead;
    uint64_t conn_pending[MAX_CONNECTS];
    int nconn_pending;
    /* The linked-worktree directories (.git/worktrees/<name>) this sandbox made itself: in those
     * the worktree patterns (commondir, config.worktree) do not apply (own_worktree). */
    pthread_mutex_t wt_lock;
    struct {
        dev_t dev;
        ino_t ino;
        int fd; /* held open, so the inode (and its number) cannot be freed and reused */
    } own_wt[MAX_OWN_WORKTREES];
    int nown_wt;
};

struct helper {
    struct helper *next;
    struct ccs *s;
    uint64_t id;
    int obj_fd;    /* O_PATH fd of the FIFO */
    int flags;     /* the process's open flags, minus O_CREAT|O_EXCL */
    bool cloexec;
};

/* What the trapping task is, from /proc/<tid>/status. */
struct task_info {
    mode_t umask;
    uid_t fsuid;
    gid_t fsgid;
    long ns_tgid, ns_tid; /* in the task's own pid namespace */
    gid_t groups[256];
    int ngroups;          /* -1: more than fit, compared as a mismatch */
};

/* One notification being handled. */
struct req {
    struct ccs *s;
    struct seccomp_notif *n;
    const char *sysname;
    const char *action; /* a refusal's verb (refuse), when not file-write-create */
    int proc_fd;   /* /proc/<tid> */
    int pidfd;     /* the thread's pidfd, or -1 (before 6.9, a thread that does not lead) */
    int root_fd;   /* the task's root, opened on first use */
    bool root_known;
    uint64_t root_dev, root_ino, root_mnt;
    struct task_info ti;
};

enum res_kind { RES_NAME, RES_OBJECT, RES_DIR };

/* Where a path leads: a name in a pinned directory, an existing object reached through a
 * procfs link, or a directory named by ".", ".." or a trailing "/" alone. */
struct resolved {
    enum res_kind kind;
    int dir_fd;      /* RES_NAME: the parent; RES_DIR: the directory */
    int obj_fd;      /* RES_OBJECT */
    char name[NAME_MAX + 1];
    bool trailing_slash;
};

static __thread mode_t thread_umask = (mode_t)-1;
static __thread cpu_set_t worker_cpus; /* the worker's own affinity, read when it starts */
static __thread bool worker_cpus_known;
static __thread int worker_held_on = -1; /* the CPU hold_here holds this worker to, or -1 */

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Whether calls of several tasks have overlapped in the last CROWD_MS (see worker()). */
static bool crowded(struct ccs *s) { return now_ns() < atomic_load(&s->crowded_until); }

/* Give this worker its own affinity back (see hold_here). */
static void worker_release_cpu(void) {
    if (worker_held_on >= 0) {
        sched_setaffinity(0, sizeof worker_cpus, &worker_cpus);
        worker_held_on = -1;
    }
}

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
};
static __thread struct tid_entry tid_cache[TID_CACHE];
static __thread unsigned tid_next;

static void tid_entry_reset(struct tid_entry *e) {
    e->tid = 0;
    e->proc_fd = e->status_fd = e->pidfd = -1;
    e->gen = 0;
}

static void tid_cache_init(void) {
    for (int i = 0; i < TID_CACHE; i++)
        tid_entry_reset(&tid_cache[i]);
}

static void tid_entry_close(struct tid_entry *e) {
    if (e->proc_fd >= 0)
        close(e->proc_fd);
    if (e->status_fd >= 0)
        close(e->status_fd);
    if (e->pidfd >= 0)
        close(e->pidfd);
    tid_entry_reset(e);
}

static void tid_cache_clear(void) {
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
static bool task_alive(int pidfd) {
    return syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) == 0 || errno == EPERM;
}

/* --- small helpers --------------------------------------------------------------------- */

static void close_fd(int *fd) {
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

static void res_init(struct resolved *r) {
    r->kind = RES_NAME;
    r->dir_fd = -1;
    r->obj_fd = -1;
    r->name[0] = '\0';
    r->trailing_slash = false;
}

static void res_close(struct resolved *r) {
    close_fd(&r->dir_fd);
    close_fd(&r->obj_fd);
}

static void put_u32(char *p, uint32_t v) { memcpy(p, &v, 4); }

/* One record: u32 length, then kind, syscall, target, name, detail, keeper, action, resolved,
 * each NUL-terminated (keeper: a decimal pid, or empty; action: the reference page's verb of a
 * refusal, file-write-create and the like; resolved: the path that was judged, in the task's
 * view, or empty). */
static void report_keeper(struct ccs *s, char kind, const char *sysname, const char *target,
                          const char *name, const char *detail, long keeper, const char *action,
                          const char *resolved) {
    char buf[4 + 2 + 32 + REPORT_TARGET_MAX + 8 + NAME_MAX + 1 + 512 + 24 + 32 +
             REPORT_TARGET_MAX + 8];
    size_t off = 4;
    buf[off++] = kind;
    buf[off++] = '\0';
    const char *fields[4] = {sysname, target, name, detail};
    size_t limits[4] = {31, REPORT_TARGET_MAX, NAME_MAX, 511};
    for (int i = 0; i < 4; i++) {
        const char *f = fields[i] ? fields[i] : "";
        size_t len = strnlen(f, limits[i]);
        memcpy(buf + off, f, len);
        off += len;
        if (i == 1 && f[len] != '\0') { /* a target cut short says so */
            memcpy(buf + off, "...", 3);
            off += 3;
        }
        buf[off++] = '\0';
    }
    if (keeper > 0)
        off += (size_t)snprintf(buf + off, 24, "%ld", keeper);
    buf[off++] = '\0';
    const char *tail[2] = {action, resolved};
    size_t tail_limits[2] = {31, REPORT_TARGET_MAX};
    for (int i = 0; i < 2; i++) {
        const char *f = tail[i] ? tail[i] : "";
        size_t len = strnlen(f, tail_limits[i]);
        memcpy(buf + off, f, len);
        off += len;
        if (i == 1 && f[len] != '\0') {
            memcpy(buf + off, "...", 3);
            off += 3;
        }
        buf[off++] = '\0';
    }
    put_u32(buf, (uint32_t)(off - 4));
    ssize_t n;
    do {
        n = write(s->report_fd, buf, off);
    } while (n < 0 && errno == EINTR);
    if (n != (ssize_t)off)
        atomic_fetch_add(&s->dropped_reports, 1);
}

static void report(struct ccs *s, char kind, const char *sysname, const char *target,
                   const char *name, const char *detail) {
    report_keeper(s, kind, sysname, target, name, detail, 0, NULL, NULL);
}

static void report_error(struct req *q, const char *target, const char *fmt, ...) {
    char detail[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    atomic_fetch_add(&q->s->errors, 1);
    report(q->s, KIND_ERROR, q->sysname, target, "", detail);
}

/* Let the call run as it is: only for calls that create no name (state_change, pin points). */
static void respond_continue(struct ccs *s, uint64_t id) {
    struct seccomp_notif_resp resp;
    memset(&resp, 0, sizeof resp);
    resp.id = id;
    resp.flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
    ioctl(s->listener, SECCOMP_IOCTL_NOTIF_SEND, &resp);
}

static void respond(struct ccs *s, uint64_t id, int64_t val, int err) {
    struct seccomp_notif_resp resp;
    memset(&resp, 0, sizeof resp);
    resp.id = id;
    resp.val = err ? 0 : val;
    resp.error = err ? -err : 0;
    /* ENOENT: the task died or was killed meanwhile; nothing waits for the answer. */
    ioctl(s->listener, SECCOMP_IOCTL_NOTIF_SEND, &resp);
}

/* Give the held task (if any) its affinity back: unless something else changed it meanwhile
 * (the host, or its cpuset), or the task is gone. Called with pin_lock held. */
static void pin_restore_locked(struct ccs *s) {
    pid_t tid = atomic_load(&s->pin_tid);
    if (tid == 0)
        return;
    cpu_set_t now, held;
    CPU_ZERO(&held);
    CPU_SET(s->pin_cpu, &held);
    bool alive = s->pin_pidfd < 0 || task_alive(s->pin_pidfd);
    if (alive && sched_getaffinity(tid, sizeof now, &now) == 0 && CPU_EQUAL(&now, &held) &&
        sched_setaffinity(tid, sizeof s->pin_saved, &s->pin_saved) < 0 && errno != ESRCH) {
        /* Its cpuset changed meanwhile: every CPU it may use, rather than this one alone. */
        cpu_set_t all;
        memset(&all, 0xff, sizeof all);
        if (sched_setaffinity(tid, sizeof all, &all) < 0 && errno != ESRCH) {
            atomic_fetch_add(&s->errors, 1);
            report(s, KIND_ERROR, "openat", "", "", "cannot give the task its CPU affinity back");
        }
    }
    if (s->pin_pidfd >= 0)
        close(s->pin_pidfd);
    s->pin_pidfd = -1;
    atomic_store(&s->pin_tid, 0);
}

/* Give the held task, if any, its affinity back. */
static void pin_release(struct ccs *s) {
    if (atomic_load(&s->pin_tid) == 0)
        return;
    pthread_mutex_lock(&s->pin_lock);
    pin_restore_locked(s);
    pthread_mutex_unlock(&s->pin_lock);
}

/*
 * Keep the task of an open on this CPU for the answer, which hands its fd over. The kernel wakes
 * the task for SECCOMP_IOCTL_NOTIF_ADDFD with an ordinary wake-up, never on the waker's CPU (the
 * sync wake-up flag covers only the notification and SECCOMP_IOCTL_NOTIF_SEND), so the scheduler
 * puts it on another CPU whenever one is idle; and an idle vCPU here halts, so that wake-up costs
 * ~20 us. So for a run of opens the task and this worker are allowed this CPU alone: this worker
 * first (it stays so for the run: see PIN_IDLE_MS), then the task, unless it already is (it stays
 * so for the run too). respond_fd then answers with ADDFD_FLAG_SEND: the task wakes here, installs
 * the fd and returns from its call. The worker is SCHED_BATCH, so its own wake-up (the ioctl's
 * end) does not preempt the task: it runs when the task next sleeps, typically in its next
 * trapped call. A create then costs two context switches, not four.
 * The task runs its own code with the pin between its opens, and gets its affinity back
 * (pin_release) before anything can inherit or read it through a call: a clone, clone3, fork,
 * vfork, exec or sched_{set,get}affinity of it is trapped and first releases it; and when the
 * run ends: PIN_IDLE_MS without a call, a call of another task, or calls of tasks overlapping.
 * Only /proc/<pid>/status shows the pin meanwhile. Returns whether the task is held here.
 */
static bool hold_here(struct ccs *s, pid_t tid, int pidfd) {
    if (!s->reply_here || !worker_cpus_known || crowded(s))
        return false; /* tasks on several CPUs: holding them to this one would crowd it */
    int cpu = sched_getcpu();
    if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &worker_cpus))
        return false;
    cpu_set_t here;
    CPU_ZERO(&here);
    CPU_SET(cpu, &here);
    if (worker_held_on != cpu) {
        if (sched_setaffinity(0, sizeof here, &here) < 0)
            return false;
        worker_held_on = cpu;
    }
    pthread_mutex_lock(&s->pin_lock);
    bool held = atomic_load(&s->pin_tid) == tid && s->pin_cpu == cpu;
    if (!held) {
        pin_restore_locked(s); /* another task, or this one on another CPU */
        cpu_set_t task_cpus;
        /* A task already held to one CPU, or kept off this one, is left alone. */
        if (sched_getaffinity(tid, sizeof task_cpus, &task_cpus) == 0 &&
            CPU_ISSET(cpu, &task_cpus) && CPU_COUNT(&task_cpus) >= 2 &&
            sched_setaffinity(tid, sizeof here, &here) == 0) {
            s->pin_pidfd = pidfd >= 0 ? fcntl(pidfd, F_DUPFD_CLOEXEC, 0) : -1;
            s->pin_cpu = cpu;
            s->pin_saved = task_cpus;
            atomic_store(&s->pin_tid, tid);
            held = true;
        }
    }
    pthread_mutex_unlock(&s->pin_lock);
    return held;
}

/* Hand `fd` to the task as the syscall's result (its thread `tid`, or 0 for no hold: see
 * hold_here); our copy is closed. */
static void respond_fd(struct ccs *s, uint64_t id, pid_t tid, int pidfd, int fd, bool cloexec) {
    bool held = tid > 0 && hold_here(s, tid, pidfd);
    struct seccomp_notif_addfd addfd;
    memset(&addfd, 0, sizeof addfd);
    addfd.id = id;
    addfd.flags = SECCOMP_ADDFD_FLAG_SEND;
    addfd.srcfd = (uint32_t)fd;
    addfd.newfd_flags = cloexec ? O_CLOEXEC : 0;
    int r = ioctl(s->listener, SECCOMP_IOCTL_NOTIF_ADDFD, &addfd);
    int err = errno;
    close(fd);
    if (r >= 0 && held)
        atomic_fetch_add(&s->replies_here, 1);
    else if (r < 0 && err != ENOENT && err != ESRCH) /* ENOENT, ESRCH: gone, nobody waits */
        respond(s, id, 0, err);                        /* e.g. EMFILE: the task's fd limit */
}

static bool id_valid(struct ccs *s, uint64_t id) {
    return ioctl(s->listener, SECCOMP_IOCTL_NOTIF_ID_VALID, &id) == 0;
}

static struct glob_form glob_form_of(const char *glob) {
    struct glob_form f = {.kind = GLOB_FNMATCH, .text = glob, .len = 0};
    const char *lit = glob[0] == '*' ? glob + 1 : glob;
    for (const char *c = lit; *c; c++) {
        if ((unsigned char)*c >= 0x80 || strchr("*?[]\\", *c))
            return f;
    }
    f.kind = lit == glob ? GLOB_LITERAL : GLOB_SUFFIX;
    f.text = lit;
    f.len = strlen(lit);
    return f;
}

static bool ascii_name(const char *name, size_t *len) {
    size_t i = 0;
    for (; name[i]; i++) {
        if ((unsigned char)name[i] >= 0x80)
            return false;
    }
    *len = i;
    return true;
}

static bool ascii_caseeq(const char *a, const char *b, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned char x = (unsigned char)a[i], y = (unsigned char)b[i];
        if (x >= 'A' && x <= 'Z')
            x = (unsigned char)(x - 'A' + 'a');
        if (y >= 'A' && y <= 'Z')
            y = (unsigned char)(y - 'A' + 'a');
        if (x != y)
            return false;
    }
    return true;
}

/* Whether `name` matches a glob, case-insensitively (fnmatch with FNM_CASEFOLD; an ASCII name
 * against a glob of glob_form_of's two simple kinds is compared directly: the same answer, at a
 * tenth of the cost, and ASCII letters fold as ASCII in every locale). */
static bool glob_match(struct ccs *s, const char *name, const char **which) {
    size_t len = 0;
    bool ascii = ascii_name(name, &len);
    for (int i = 0; i < s->nglobs; i++) {
        const struct glob_form *f = &s->forms[i];
        bool hit;
        if (ascii && f->kind == GLOB_LITERAL)
            hit = len == f->len && ascii_caseeq(name, f->text, len);
        else if (ascii && f->kind == GLOB_SUFFIX)
            hit = len >= f->len && ascii_caseeq(name + len - f->len, f->text, f->len);
        else
            hit = fnmatch(s->globs[i], name, FNM_CASEFOLD) == 0;
        if (hit) {
            *which = s->globs[i];
            return true;
        }
    }
    return false;
}

static bool has_path_rules(const struct ccs *s) { return s->npats > 0 || s->nabsolutes > 0; }

/* `path` is `root` or below it. */
static bool path_under(const char *path, const char *root) {
    size_t n = strlen(root);
    while (n > 1 && root[n - 1] == '/')
        n--;
    if (n == 1 && root[0] == '/')
        return true;
    return strncmp(path, root, n) == 0 && (path[n] == '\0' || path[n] == '/');
}

/* This process's /proc/self/fd, opened once (ccs_start): a link read from it skips the lookup
 * of /proc, self and fd that every path through /proc/self/fd/N repeats (4 of a ~10 us readlink
 * here). -1 until then, or when it could not be opened: the full path is used. */
static _Atomic int self_fds = -1;

static void open_self_fds(void) {
    if (atomic_load(&self_fds) >= 0)
        return;
    int fd = open("/proc/self/fd", O_PATH | O_DIRECTORY | O_CLOEXEC);
    int none = -1;
    if (fd >= 0 && !atomic_compare_exchange_strong(&self_fds, &none, fd))
        close(fd); /* another supervisor of this process opened it first */
}

/* readlink of /proc/self/fd/<fd>. */
static ssize_t read_fd_link(int fd, char *buf, size_t size) {
    char name[32];
    int dir = atomic_load(&self_fds);
    if (dir >= 0) {
        snprintf(name, sizeof name, "%d", fd);
        return readlinkat(dir, name, buf, size);
    }
    snprintf(name, sizeof name, "/proc/self/fd/%d", fd);
    return readlink(name, buf, size);
}

/* The path of an open file in the task's view (its /proc/self/fd link), in `buf`: false when it
 * is not a path there (a pipe, a socket), too long, or gone (" (deleted)"). */
static bool fd_path(int fd, char *buf, size_t size) {
    ssize_t n = read_fd_link(fd, buf, size - 1);
    if (n <= 0 || (size_t)n >= size - 1 || buf[0] != '/' ||
        (n > 10 && memcmp(buf + n - 10, " (deleted)", 10) == 0)) {
        buf[0] = '\0';
        return false;
    }
    buf[n] = '\0';
    return true;
}

/* Whether the pinned directory `dir_fd` is at or below an exempt root (a runner's own state
 * directory, a mount of its own in the task's view): the create-time globs do not apply there,
 * so Claude Code's own session keys (sessions/N.HASH.key) are made. A name there cannot reach a
 * writable bind by a rename or a link (another mount: EXDEV); a copy creates its names where the
 * globs apply. A directory whose path cannot be read is not exempt. */
static bool dir_exempt(const struct ccs *s, int dir_fd) {
    char full[PATH_MAX];
    if (s->nexempts == 0 || !fd_path(dir_fd, full, sizeof full))
        return false;
    for (int i = 0; i < s->nexempts; i++)
        if (path_under(full, s->exempts[i]))
            return true;
    return false;
}

/* Whether a glob refuses `name` in the pinned directory `dir_fd`. */
static bool glob_refused(struct ccs *s, int dir_fd, const char *name, const char **which) {
    return glob_match(s, name, which) && !dir_exempt(s, dir_fd);
}

static bool pattern_hits(const struct ccs *s, const char *rel, const char *name,
                         const char **which) {
    size_t nlen = 0;
    bool ascii = ascii_name(name, &nlen); /* a literal is then compared as glob_match does */
    for (int i = 0; i < s->npats; i++) {
        const char *last = s->pat_last[i];
        if (last && (ascii && s->pat_last_literal[i]
                         ? strlen(last) != nlen || !ascii_caseeq(last, name, nlen)
                         : fnmatch(last, name, FNM_CASEFOLD) != 0))
            continue; /* an exact pattern must end in this name */
        if (s->pat_first[i] && !strcasestr(rel, s->pat_first[i]))
            continue; /* a tree pattern's first component must be in the path */
        int flags = FNM_PATHNAME | FNM_CASEFOLD | (s->pat_tree[i] ? FNM_LEADING_DIR : 0);
        for (const char *at = rel; at; at = strchr(at, '/')) {
            if (*at == '/')
                at++;
            if (fnmatch(s->pats[i], at, flags) == 0) {
                *which = s->pats[i];
                return true;
            }
        }
    }
    return false;
}

/* A `HEAD` anywhere but in a repository's own git directory: with `objects/` and `refs/` beside
 * it, host git takes that directory for a bare repository (its default safe.bareRepository=all)
 * and honours its `config` (core.fsmonitor runs at the next `git status` below it). git itself
 * writes a `HEAD` only inside a `.git` directory. */
#define BARE_HEAD "HEAD outside a .git directory: host git would take its directory for a bare " \
                  "repository and run what its config names"
static bool bare_head(const char *rel, const char *name) {
    if (strcmp(name, "HEAD") != 0)
        return false;
    /* In a repository's own git directory, at any depth (logs/HEAD, refs/remotes/x/HEAD,
     * worktrees/<name>/HEAD) it is git's. */
    return !(strncmp(rel, ".git/", 5) == 0 || strstr(rel, "/.git/") != NULL);
}

/* Whether the path rules refuse `full` (an absolute path in the task's view): an absolute
 * path at or below it, else a pattern matching the components below the outermost scope root
 * that holds it, unless an exempt root (a runner's own state directory) holds it. */
/* `full` below the outermost scope root that holds it (NULL: none does, a runner's state
 * directory holds it, or it is that root itself): where the patterns are matched. */
static const char *rel_below_root(const struct ccs *s, const char *full) {
    if (s->npats == 0)
        return NULL;
    const char *root = NULL;
    size_t best = 0;
    for (int i = 0; i < s->nroots; i++) {
        size_t n = strlen(s->roots[i]);
        if (path_under(full, s->roots[i]) && (root == NULL || n < best)) {
            root = s->roots[i];
            best = n;
        }
    }
    if (root == NULL)
        return NULL;
    for (int i = 0; i < s->nexempts; i++)
        if (path_under(full, s->exempts[i]))
            return NULL;
    const char *rel = full + best;
    while (*rel == '/')
        rel++;
    return *rel ? rel : NULL;
}

/* Whether `rel` (below a root) ends in a proper prefix of a pattern of several components
 * (`.config` of the pattern `.config/git` and all below, `.git/worktrees/x` of a worktree's
 * `commondir` pattern):
 * what is renamed, exchanged, linked or symlinked to such a name would bring the protected
 * path in with it, or take it away to be made again. */
#define PATH_UNKNOWN_CARRY "(the directory's path could not be read)"
#define ON_PATTERN_WAY "a directory on the way to a protected path: what is moved or linked " \
                       "there would carry protected files in or out"
static bool prefix_hits(const struct ccs *s, const char *rel) {
    for (int i = 0; i < s->nprefixes; i++)
        for (const char *at = rel; at; at = strchr(at, '/')) {
            if (*at == '/')
                at++;
            if (fnmatch(s->prefixes[i], at, FNM_PATHNAME | FNM_CASEFOLD) == 0)
                return true;
        }
    return false;
}

/* A name moved out of a repository's `.git` directory: with a `HEAD`, `objects` and `refs` it
 * would be a bare repository elsewhere, with the config and hooks it brought. */
#define OUT_OF_GIT "moved out of a .git directory: it would be a repository host git honours"
static bool in_git_dir(const char *rel) {
    return strncmp(rel, ".git/", 5) == 0 || strstr(rel, "/.git/") != NULL;
}

static bool full_path_refused(const struct ccs *s, const char *full, const char *name,
                              const char **which) {
    for (int i = 0; i < s->nabsolutes; i++) {
        if (path_under(full, s->absolutes[i])) {
            *which = s->absolutes[i];
            return true;
        }
    }
    const char *rel = rel_below_root(s, full);
    if (rel == NULL)
        return false;
    if (bare_head(rel, name)) {
        *which = BARE_HEAD;
        return true;
    }
    return pattern_hits(s, rel, name, which);
}

#define PATH_UNKNOWN "(the directory's path could not be read)"


/* The path the last check of this worker judged, in the task's view (reported as a refusal's
 * resolved target; empty when unknown). */
static __thread char judged[PATH_MAX + NAME_MAX + 2];

/* `name` in the pinned directory `dir_fd` (or the object `dir_fd` itself, for an empty name) as
 * an absolute path in the task's view: the fd's link, never the string the task passed. Kept in
 * `judged`. False when the path cannot be read (gone, or not in the task's view). */
static bool judge_path(int dir_fd, const char *name) {
    if (!fd_path(dir_fd, judged, PATH_MAX))
        return false;
    size_t n = strlen(judged);
    if (name[0]) {
        if (n > 1)
            judged[n++] = '/';
        snprintf(judged + n, sizeof judged - (size_t)n, "%s", name);
    }
    return true;
}

/* A linked worktree's own files (commondir, config.worktree) steer host git in every worktree
 * whose pointer names that directory: protected, except in a directory this sandbox made itself
 * (`git worktree add` to the sandbox's /tmp: no pointer on the host names it, unless a stale one
 * of a pruned worktree of that very name is left). */
#define WORKTREE_PATTERNS ".git/worktrees/"
static bool own_worktree(struct ccs *s, int dir_fd) {
    struct stat st;
    if (fstat(dir_fd, &st) != 0)
        return false;
    bool own = false;
    pthread_mutex_lock(&s->wt_lock);
    for (int i = 0; i < s->nown_wt && !own; i++)
        own = s->own_wt[i].dev == st.st_dev && s->own_wt[i].ino == st.st_ino;
    pthread_mutex_unlock(&s->wt_lock);
    return own;
}

/* Whether `dir_fd` is a repository's `.git/worktrees` (the path rules on). */
static bool is_worktrees_dir(const struct ccs *s, int dir_fd) {
    static const char suffix[] = "/.git/worktrees";
    if (s->npats == 0 || !judge_path(dir_fd, ""))
        return false;
    size_t n = strlen(judged), k = sizeof suffix - 1;
    return n >= k && strcmp(judged + n - k, suffix) == 0;
}

/* Whether `name` in `dir_fd` is a linked worktree's directory this sandbox did not make: it may
 * not be removed or moved away (its name could then be made again, as the sandbox's own, with
 * another commondir, which the host's pointer to that name would follow). */
#define WORKTREE_DIR "a linked worktree's directory: a pointer on the host names it"
static bool worktree_dir_refused(struct ccs *s, int dir_fd, const char *name, const char **which) {
    if (!is_worktrees_dir(s, dir_fd))
        return false;
    int fd = openat(dir_fd, name, O_PATH | O_NOFOLLOW | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return false; /* not a directory (or gone): the other rules decide */
    bool own = own_worktree(s, fd);
    close(fd);
    if (own)
        return false;
    judge_path(dir_fd, name);
    *which = WORKTREE_DIR;
    return true;
}

/* After a mkdir: a new directory directly in a repository's .git/worktrees is this sandbox's. */
static void note_worktree_dir(struct ccs *s, int dir_fd, const char *name) {
    if (!is_worktrees_dir(s, dir_fd))
        return;
    struct stat st;
    if (fstatat(dir_fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode))
        return;
    int fd = openat(dir_fd, name, O_PATH | O_NOFOLLOW | O_DIRECTORY | O_CLOEXEC);
    struct stat pinned;
    if (fd < 0 || fstat(fd, &pinned) != 0 || pinned.st_ino != st.st_ino) {
        close_fd(&fd);
        return; /* not recorded: its commondir stays protected */
    }
    pthread_mutex_lock(&s->wt_lock);
    if (s->nown_wt < MAX_OWN_WORKTREES) {
        s->own_wt[s->nown_wt].dev = st.st_dev;
        s->own_wt[s->nown_wt].ino = st.st_ino;
        s->own_wt[s->nown_wt].fd = fd;
        s->nown_wt++;
        fd = -1;
    }
    pthread_mutex_unlock(&s->wt_lock);
    close_fd(&fd);
}

/* For a rename's sides and a name made as anything but a directory: prefix_hits on its judged
 * path, and (`from_git`: the old side, with the new side's path in `to`) a move out of .git. */
static bool carry_refused(const struct ccs *s, int dir_fd, const char *name, const char *to,
                          const char **which) {
    if (s->npats == 0)
        return false;
    if (!judge_path(dir_fd, name)) {
        *which = PATH_UNKNOWN_CARRY;
        return true;
    }
    const char *rel = rel_below_root(s, judged);
    if (rel == NULL)
        return false;
    if (prefix_hits(s, rel)) {
        *which = ON_PATTERN_WAY;
        return true;
    }
    if (to != NULL && in_git_dir(rel)) {
        const char *to_rel = rel_below_root(s, to);
        if (to_rel == NULL || !in_git_dir(to_rel)) {
            *which = OUT_OF_GIT;
            return true;
        }
    }
    return false;
}

/* A repository's git directory by its shape, whatever its name (a `--separate-git-dir` store, a
 * bare repository, a bind whose root is a `.git`): a regular HEAD, objects/ and refs/. Its
 * config, commondir, config.worktree, hooks/ and modules/, and a linked worktree's commondir
 * and config.worktree below its worktrees/, are protected as a `.git`'s are. Looked at only
 * when the judged path has one of those names in it, so a create elsewhere pays a string
 * search. */
#define GIT_DIR_SHAPED "a repository's git directory (HEAD, objects, refs): host git honours " \
                       "its config and hooks"
static bool dir_or_link(int fd, const char *name) {
    struct stat st; /* git follows a symlinked objects/ or refs/ (shared object stores) */
    return fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
           (S_ISDIR(st.st_mode) || S_ISLNK(st.st_mode));
}

static bool gitdir_shaped(int fd) {
    struct stat st;
    return fstatat(fd, "HEAD", &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) &&
           dir_or_link(fd, "objects") && dir_or_link(fd, "refs");
}

/* HEAD, objects and refs of a git directory: what makes its shape. Removed or moved away (and
 * put back after its config was written), the directory would not be judged a git directory
 * while it was written. Replacing HEAD by a regular file (git's own HEAD.lock) keeps it. */
#define GIT_SHAPE "HEAD, objects or refs of a git directory: without them it would not be " \
                  "judged one while its config is written"
static bool shape_refused(const struct ccs *s, int dir_fd, const char *name, bool replacing_by_file,
                          const char **which) {
    if (s->npats == 0 || !(strcmp(name, "HEAD") == 0 || strcmp(name, "objects") == 0 ||
                           strcmp(name, "refs") == 0))
        return false;
    if (!gitdir_shaped(dir_fd))
        return false;
    if (replacing_by_file && strcmp(name, "HEAD") == 0)
        return false;
    judge_path(dir_fd, name);
    *which = GIT_SHAPE;
    return true;
}

/* Whether a directory, or one of its nearest ancestors, is a git directory (HEAD is git's
 * there: logs/HEAD, refs/remotes/x/HEAD, a separate gitdir's own HEAD). */
static bool in_shaped_gitdir(int dir_fd) {
    int cur = fcntl(dir_fd, F_DUPFD_CLOEXEC, 0);
    bool found = false;
    for (int depth = 0; cur >= 0 && depth < 6 && !found; depth++) {
        found = gitdir_shaped(cur);
        int parent = openat(cur, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
        close(cur);
        cur = parent;
    }
    close_fd(&cur);
    return found;
}

static bool git_control_name(const char *name) {
    static const char *const names[] = {"config", "commondir", "config.worktree", "hooks",
                                        "modules", NULL};
    for (int i = 0; names[i]; i++)
        if (strcmp(name, names[i]) == 0)
            return true;
    return false;
}

static bool gitdir_refused(const struct ccs *s, int dir_fd, const char *name, const char **which) {
    if (s->npats == 0 || rel_below_root(s, judged) == NULL)
        return false;
    const char *base = strrchr(judged, '/');
    base = base ? base + 1 : judged;
    bool deep = strstr(judged, "/hooks/") || strstr(judged, "/modules/") ||
                strstr(judged, "/worktrees/");
    if (!name[0]) {
        /* An object (through the task's own procfs link): its directory is not pinned here;
         * a git-control name is refused outright. */
        if (git_control_name(base) || deep) {
            *which = GIT_DIR_SHAPED;
            return true;
        }
        return false;
    }
    if (git_control_name(name) && gitdir_shaped(dir_fd)) {
        *which = GIT_DIR_SHAPED;
        return true;
    }
    if (!deep && !(strcmp(name, "commondir") == 0 || strcmp(name, "config.worktree") == 0 ||
                   strcmp(name, "gitdir") == 0 || strcmp(name, "locked") == 0))
        return false;
    /* Up from the pinned directory: below hooks/ or modules/ of a git directory, or a
     * worktree's own file in <git dir>/worktrees/<name>/. */
    bool refused = false;
    int cur = fcntl(dir_fd, F_DUPFD_CLOEXEC, 0);
    for (int depth = 0; cur >= 0 && depth < 16 && !refused; depth++) {
        char path[PATH_MAX];
        if (!fd_path(cur, path, sizeof path) || rel_below_root(s, path) == NULL)
            break; /* at (or above) the writable root: nothing further up is judged */
        const char *cur_name = strrchr(path, '/') + 1;
        int parent = openat(cur, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (parent < 0)
            break;
        if ((strcmp(cur_name, "hooks") == 0 || strcmp(cur_name, "modules") == 0) &&
            gitdir_shaped(parent))
            refused = true;
        if (!refused && depth == 0 &&
            (strcmp(name, "commondir") == 0 || strcmp(name, "config.worktree") == 0 ||
             strcmp(name, "gitdir") == 0 || strcmp(name, "locked") == 0)) {
            char ppath[PATH_MAX];
            bool known = fd_path(parent, ppath, sizeof ppath);
            int grand = known ? openat(parent, "..", O_PATH | O_DIRECTORY | O_CLOEXEC) : -1;
            if (grand >= 0 && strcmp(strrchr(ppath, '/') + 1, "worktrees") == 0 &&
                gitdir_shaped(grand) && !own_worktree((struct ccs *)s, cur))
                refused = true;
            close_fd(&grand);
        }
        close(cur);
        cur = parent;
        if (strcmp(path, "/") == 0)
            break;
    }
    close_fd(&cur);
    if (refused)
        *which = GIT_DIR_SHAPED;
    return refused;
}

/* Whether the object `fd` has no name a rule could protect: a pipe, a socket or another
 * anonymous inode (its link is "pipe:[N]" and the like, reached through /proc/self/fd/N, as
 * `echo > /dev/stderr` does), or a file whose last name is gone. */
static bool not_a_path(int fd) {
    char target[PATH_MAX];
    ssize_t n = read_fd_link(fd, target, sizeof target - 1);
    if (n > 0 && target[0] != '/')
        return true;
    struct stat st;
    return fstat(fd, &st) == 0 && !S_ISDIR(st.st_mode) && st.st_nlink == 0;
}

/* The path rules for `name` in the pinned directory `dir_fd`, on its path in the task's view
 * (judge_path). A directory whose path cannot be read is refused. */
static bool path_refused(const struct ccs *s, int dir_fd, const char *name, const char **which) {
    if (!has_path_rules(s))
        return false;
    if (!judge_path(dir_fd, name)) {
        if (name[0] == '\0' && not_a_path(dir_fd))
            return false;
        *which = PATH_UNKNOWN;
        return true;
    }
    const char *base = strrchr(judged, '/');
    if (!full_path_refused(s, judged, base ? base + 1 : judged, which))
        return gitdir_refused(s, dir_fd, name, which);
    if (strcmp(*which, BARE_HEAD) == 0 && name[0] && in_shaped_gitdir(dir_fd))
        return false; /* a HEAD of a git directory that already is one */
    return !(name[0] && strncmp(*which, WORKTREE_PATTERNS, strlen(WORKTREE_PATTERNS)) == 0 &&
             own_worktree((struct ccs *)s, dir_fd));
}

/* Whether `name` in `dir_fd` lies on the way to a protected path (an absolute rule below it): such
 * a name may not be removed, renamed or made as anything but a directory, or the protected
 * spelling would lead elsewhere (`rm L && ln -s elsewhere L` re-points L/settings.json). */
#define ON_THE_WAY "on the way to a protected path: removed or replaced, the path would lead elsewhere"
static bool ancestor_refused(const struct ccs *s, int dir_fd, const char *name, const char **which) {
    if (s->nabsolutes == 0)
        return false;
    if (!judge_path(dir_fd, name)) {
        *which = PATH_UNKNOWN;
        return true;
    }
    for (int i = 0; i < s->nabsolutes; i++) {
        if (path_under(s->absolutes[i], judged)) {
            *which = ON_THE_WAY;
            return true;
        }
    }
    return false;
}

/* --- reading the task ---------------------------------------------------------------------- */

/* Copy a NUL-terminated string from the task, page by page (a string may end just before an
 * unmapped page). Returns 0 or an errno. */
static int copy_string(pid_t pid, uint64_t addr, char *buf, size_t size) {
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

static int copy_bytes(pid_t pid, uint64_t addr, void *buf, size_t len) {
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

static int cmp_gid(const void *a, const void *b) {
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
static void state_change(struct ccs *s, struct seccomp_notif *n) {
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
static int read_task_info(struct req *q) {
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
    return 0;
}

static bool same_credentials(struct ccs *s, struct task_info *ti) {
    if (ti->fsuid != s->uid || ti->fsgid != s->gid || ti->ngroups != s->ngroups)
        return false;
    return ti->ngroups == 0 ||
           memcmp(ti->groups, s->groups, (size_t)ti->ngroups * sizeof(gid_t)) == 0;
}

/* --- path resolution in the task's view ---------------------------------------------------- */

/* The task's root, opened once per notification (q->root_fd, closed by handle()). */
static int open_root(struct req *q) {
    if (q->root_fd < 0) {
        q->root_fd = openat(q->proc_fd, "root", O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (q->root_fd < 0)
            return errno == ENOENT ? ESRCH : errno;
    }
    return 0;
}

static int get_root(struct req *q, int *out) {
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

static bool kernel_object(int fd) {
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
static void report_refusal(struct req *q, const char *target, const char *name,
                           const char *rule, const char *action);

static bool is_procfs_root(int fd, bool *in_procfs) {
    struct statfs sf;
    struct stat st;
    *in_procfs = fstatfs(fd, &sf) == 0 && sf.f_type == PROC_SUPER_MAGIC;
    return *in_procfs && fstat(fd, &st) == 0 && st.st_ino == PROC_ROOT_INO;
}

/* The directory a path starts from: the task's root, the thread's cwd or the task's fd. A fd
 * that is not a directory is ENOTDIR here only with `check_dir` (a lookup from it fails with
 * ENOTDIR anyway). */
static int start_dir(struct req *q, int dirfd, const char *path, bool check_dir, int *out) {
    if (path[0] == '/')
        return get_root(q, out);
    if (dirfd == AT_FDCWD) {
        *out = openat(q->proc_fd, "cwd", O_PATH | O_DIRECTORY | O_CLOEXEC);
        return *out < 0 ? (errno == ENOENT ? ESRCH : errno) : 0;
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
static int resolve(struct req *q, int dirfd, const char *path, bool follow_final,
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

/* --- emulation ----------------------------------------------------------------------------- */

static void set_umask(mode_t m) {
    if (thread_umask != m) {
        umask(m);
        thread_umask = m;
    }
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
static long keeper_of(struct ccs *s, pid_t tid) {
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

/* One refusal record, the call answered by the caller. */
static void report_refusal(struct req *q, const char *target, const char *name,
                           const char *rule, const char *action) {
    atomic_fetch_add(&q->s->refused, 1);
    report_keeper(q->s, KIND_REFUSED, q->sysname, target, name, rule,
                  keeper_of(q->s, (pid_t)q->n->pid), action, judged);
}

/* `q->action` names the verb (file-write-create unless the call set another); the resolved
 * target is the path the last check judged. */
static void refuse(struct req *q, const char *target, const char *name, const char *glob) {
    atomic_fetch_add(&q->s->refused, 1);
    report_keeper(q->s, KIND_REFUSED, q->sysname, target, name, glob,
                  keeper_of(q->s, (pid_t)q->n->pid),
                  q->action ? q->action : "file-write-create", judged);
    respond(q->s, q->n->id, 0, EACCES);
}

/* refuse(), after judging the path of `name` in `dir_fd` (a name glob's refusal has not). */
static void refuse_at(struct req *q, const char *target, int dir_fd, const char *name,
                      const char *glob) {
    judge_path(dir_fd, name);
    refuse(q, target, name, glob);
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
            respond_fd(s, q->n->id, (pid_t)q->n->pid, q->pidfd, fd, cloexec);
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
        respond_fd(s, h->id, 0, -1, fd, h->cloexec); /* a helper keeps no CPU affinity to give */
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
static void rescue_helpers(struct ccs *s, bool all) {
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
        glob_match(s, name, &glob))
        return false; /* the walk decides */
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
    if (has_path_rules(s)) {
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
    respond_fd(s, q->n->id, (pid_t)q->n->pid, q->pidfd, fd, flags & O_CLOEXEC);
    return true;
}

static bool object_refused(struct req *q, int obj, const char **which);

static void do_open(struct req *q, int dirfd, uint64_t path_addr, int flags, mode_t mode) {
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
        struct stat named;
        bool named_exists = fstatat(r.dir_fd, r.name, &named, AT_SYMLINK_NOFOLLOW) == 0;
        if (path_refused(s, r.dir_fd, r.name, &glob) ||
            ((flags & O_CREAT) && !named_exists && ancestor_refused(s, r.dir_fd, r.name, &glob))) {
            struct stat st;
            bool exists = fstatat(r.dir_fd, r.name, &st, AT_SYMLINK_NOFOLLOW) == 0;
            q->action = open_action(flags, exists);
            refuse(q, path, r.name, glob); /* protected: neither created nor opened */
            res_close(&r);
            return;
        }
        bool matches = glob_refused(s, r.dir_fd, r.name, &glob);
        if (matches && (flags & O_EXCL)) {
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
    respond_fd(s, q->n->id, (pid_t)q->n->pid, q->pidfd, fd, cloexec);
}

/* A name about to be created by mknod, mkdir, symlink, link or bind: checked, then made. */
static int name_for_create(struct req *q, const char *path, struct resolved *r, bool is_mkdir,
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

static void do_mknod_mkdir(struct req *q, int dirfd, uint64_t addr, mode_t mode, dev_t dev,
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
    res_close(&r);
    if (!refused)
        respond(s, q->n->id, 0, err);
}

static void do_symlink(struct req *q, uint64_t target_addr, int dirfd, uint64_t addr) {
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
    err = resolve(q, dirfd, path, false, &r);
    bool refused = false;
    if (!err)
        err = name_for_create(q, path, &r, false, &refused);
    if (!err && !refused)
        err = symlinkat(target, r.dir_fd, r.name) < 0 ? errno : 0;
    res_close(&r);
    if (!refused)
        respond(s, q->n->id, 0, err);
}

#ifndef AT_EMPTY_PATH
#define AT_EMPTY_PATH 0x1000
#endif

static void do_link(struct req *q, int olddirfd, uint64_t old_addr, int newdirfd,
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
    if (!err)
        err = resolve(q, newdirfd, newp, false, &rn);
    if (!err)
        err = name_for_create(q, newp, &rn, false, &refused);
    if (!err && !refused)
        err = linkat(obj, "", rn.dir_fd, rn.name, AT_EMPTY_PATH) < 0 ? errno : 0;
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

static void do_rename(struct req *q, int olddirfd, uint64_t old_addr, int newdirfd,
                      uint64_t new_addr, unsigned flags) {
    struct ccs *s = q->s;
    char oldp[PATH_MAX], newp[PATH_MAX];
    int err;
    if (!read_two_paths(q, old_addr, oldp, new_addr, newp))
        return;
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
            shape_refused(s, rn.dir_fd, rn.name, old_is_file, &glob)) {
            q->action = "file-write-rename";
            refuse(q, newp, rn.name, glob);
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
static void do_unlink(struct req *q, int dirfd, uint64_t addr, int flags) {
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

/* The path rules for an object the task reached with no parent pinned (its own fd, its own
 * procfs link, a directory): the parent is found by the object's path in the task's view, from
 * the task's root with no symlink on the way, and must still hold that very object; then the
 * object is judged as a name in it, as any other. Anything else is refused. */
#define PATH_MOVED "(the object is no longer where its path says)"
static bool object_refused(struct req *q, int obj, const char **which) {
    struct ccs *s = q->s;
    if (!has_path_rules(s))
        return false;
    if (!judge_path(obj, "")) {
        if (not_a_path(obj))
            return false;
        *which = PATH_UNKNOWN;
        return true;
    }
    if (strcmp(judged, "/") == 0)
        return full_path_refused(s, judged, "", which);
    char full[PATH_MAX + NAME_MAX + 2];
    snprintf(full, sizeof full, "%s", judged);
    char *slash = strrchr(full, '/');
    *slash = '\0';
    const char *base = slash + 1, *dir = full[0] ? full + 1 : "";
    int root;
    if (get_root(q, &root) != 0) {
        *which = PATH_UNKNOWN;
        return true;
    }
    struct open_how how = {
        .flags = O_PATH | O_DIRECTORY | O_CLOEXEC,
        .resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH,
    };
    int parent = dir[0] ? (int)syscall(SYS_openat2, root, dir, &how, sizeof how)
                        : fcntl(root, F_DUPFD_CLOEXEC, 0);
    close(root);
    struct stat a, b;
    bool same = parent >= 0 && fstatat(parent, base, &a, AT_SYMLINK_NOFOLLOW) == 0 &&
                fstat(obj, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
    if (!same) {
        close_fd(&parent);
        judge_path(obj, "");
        *which = PATH_MOVED;
        return true;
    }
    bool refused = path_refused(s, parent, base, which);
    close(parent);
    return refused;
}

/* truncate: the file's data, like an open for writing. */
static void do_truncate(struct req *q, uint64_t addr, int64_t length) {
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
static void do_chmod(struct req *q, int dirfd, uint64_t addr, mode_t mode, int flags) {
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
static void do_fchmod(struct req *q, int fd, mode_t mode) {
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

/* The arguments of bind or connect: the address copied (and the call checked still live), the
 * task's own socket (a dup, through its pidfd) and its family. False when the call has been
 * answered (or is gone). */
static bool socket_call(struct req *q, int sockfd, uint64_t addr_ptr, uint64_t addrlen,
                        struct sockaddr_storage *addr, int *sock, int *domain) {
    struct ccs *s = q->s;
    memset(addr, 0, sizeof *addr);
    if (addrlen > sizeof *addr || addrlen < sizeof(sa_family_t)) {
        if (id_valid(s, q->n->id))
            respond(s, q->n->id, 0, EINVAL);
        return false;
    }
    int err = copy_bytes(q->n->pid, addr_ptr, addr, (size_t)addrlen);
    if (err == ESRCH || !id_valid(s, q->n->id))
        return false;
    if (err) {
        respond(s, q->n->id, 0, err);
        return false;
    }
    int pidfd = (int)syscall(SYS_pidfd_open, q->n->pid, PIDFD_THREAD);
    if (pidfd < 0 && errno == EINVAL) /* before 6.9: only a thread-group leader has a pidfd */
        pidfd = (int)syscall(SYS_pidfd_open, q->n->pid, 0);
    if (pidfd < 0) {
        report_error(q, "", "pidfd_open: %s", strerror(errno));
        respond(s, q->n->id, 0, EPERM);
        return false;
    }
    *sock = (int)syscall(SYS_pidfd_getfd, pidfd, sockfd, 0);
    err = *sock < 0 ? errno : 0;
    close(pidfd);
    if (err) {
        respond(s, q->n->id, 0, err == ESRCH ? EBADF : err);
        return false;
    }
    socklen_t dlen = sizeof *domain;
    if (getsockopt(*sock, SOL_SOCKET, SO_DOMAIN, domain, &dlen) < 0) {
        err = errno;
        close(*sock);
        respond(s, q->n->id, 0, err);
        return false;
    }
    return true;
}

/* The path of an AF_UNIX pathname address (not abstract, not unnamed) of an AF_UNIX socket, in
 * `path` (at least sizeof(struct sockaddr_un) + 1 bytes); false for any other address. */
static bool unix_path(int domain, const struct sockaddr_storage *addr, uint64_t addrlen,
                      char *path) {
    const struct sockaddr_un *un = (const struct sockaddr_un *)addr;
    size_t off = offsetof(struct sockaddr_un, sun_path);
    if (domain != AF_UNIX || addr->ss_family != AF_UNIX || addrlen <= off ||
        un->sun_path[0] == '\0')
        return false;
    size_t len = strnlen(un->sun_path, (size_t)addrlen - off);
    memcpy(path, un->sun_path, len);
    path[len] = '\0';
    return true;
}

/* --- connect: no host listener ------------------------------------------------------------ */

/* The request and reply of launcher.c's connector. */
struct connect_request {
    uint64_t id;
    uint32_t addrlen;
    uint32_t flags; /* CONNECT_TARGET: a target fd is attached; CONNECT_BIND: bind it */
    unsigned char addr[128];
};
#define CONNECT_TARGET 1u
#define CONNECT_BIND 2u
struct connect_reply {
    uint64_t id;
    int32_t err;
    uint32_t pad;
};

#define HOST_LISTENER "a listener outside the sandbox: a host process's socket in a bind"

/* Whether a Unix socket bound in the sandbox's network namespace has the file dev:ino, asked of
 * the kernel with sock_diag (UDIAG_SHOW_VFS) through the launcher's socket of that namespace.
 * Every process of the sandbox binds there; a host process binds in the host's. */
static bool bound_inside(struct ccs *s, dev_t dev, ino_t ino, int *err) {
    struct {
        struct nlmsghdr nlh;
        struct unix_diag_req req;
    } rq = {
        .nlh = {.nlmsg_len = sizeof rq, .nlmsg_type = SOCK_DIAG_BY_FAMILY,
                .nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP},
        .req = {.sdiag_family = AF_UNIX, .udiag_states = ~0U, .udiag_show = UDIAG_SHOW_VFS},
    };
    bool found = false;
    *err = 0;
    pthread_mutex_lock(&s->diag_lock);
    struct sockaddr_nl kernel = {.nl_family = AF_NETLINK};
    if (sendto(s->diag_fd, &rq, sizeof rq, 0, (struct sockaddr *)&kernel, sizeof kernel) < 0) {
        *err = errno;
        goto out;
    }
    static __thread char buf[32768];
    for (bool done = false; !done;) {
        ssize_t n = recv(s->diag_fd, buf, sizeof buf, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            *err = errno;
            goto out;
        }
        for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)n);
             h = NLMSG_NEXT(h, n)) {
            if (h->nlmsg_type == NLMSG_DONE) {
                done = true;
                break;
            }
            if (h->nlmsg_type == NLMSG_ERROR) {
                *err = EIO;
                done = true;
                break;
            }
            struct unix_diag_msg *m = NLMSG_DATA(h);
            int len = (int)(h->nlmsg_len - NLMSG_LENGTH(sizeof *m));
            for (struct rtattr *a = (struct rtattr *)(m + 1); RTA_OK(a, len); a = RTA_NEXT(a, len)) {
                if (a->rta_type != UNIX_DIAG_VFS || RTA_PAYLOAD(a) < sizeof(struct unix_diag_vfs))
                    continue;
                struct unix_diag_vfs *v = RTA_DATA(a);
                /* The kernel's own dev_t: major in the top 12 bits, minor in the low 20. */
                if (v->udiag_vfs_ino == ino && (v->udiag_vfs_dev >> 20) == major(dev) &&
                    (v->udiag_vfs_dev & 0xfffff) == minor(dev))
                    found = true;
            }
        }
    }
out:
    pthread_mutex_unlock(&s->diag_lock);
    return found;
}

static bool sockdir_allowed(const struct ccs *s) {
    for (int i = 0; i < s->nsockdirs; i++)
        if (judged[0] && path_under(judged, s->sockdirs[i]))
            return true;
    return false;
}

/* Hand one connect to the connector; conn_main answers it. */
static void connect_via(struct req *q, int sock, int target, const void *addr, uint32_t addrlen,
                        bool bind_it) {
    struct ccs *s = q->s;
    struct connect_request rq = {
        .id = q->n->id, .addrlen = addrlen,
        .flags = (target >= 0 ? CONNECT_TARGET : 0) | (bind_it ? CONNECT_BIND : 0),
    };
    memcpy(rq.addr, addr, addrlen);
    pthread_mutex_lock(&s->conn_lock);
    int err = s->conn_dead ? ECONNREFUSED : s->nconn_pending == MAX_CONNECTS ? EAGAIN : 0;
    if (!err)
        s->conn_pending[s->nconn_pending++] = q->n->id;
    pthread_mutex_unlock(&s->conn_lock);
    if (!err) {
        int fds[2] = {sock, target};
        union {
            struct cmsghdr hdr;
            char buf[CMSG_SPACE(2 * sizeof(int))];
        } control;
        memset(&control, 0, sizeof control);
        struct iovec iov = {.iov_base = &rq, .iov_len = sizeof rq};
        size_t nfds = target >= 0 ? 2 : 1;
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                             .msg_controllen = CMSG_SPACE(nfds * sizeof(int))};
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
        memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
        if (sendmsg(s->conn_fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof rq) {
            err = errno == EAGAIN ? EAGAIN : ECONNREFUSED;
            pthread_mutex_lock(&s->conn_lock);
            for (int i = 0; i < s->nconn_pending; i++)
                if (s->conn_pending[i] == q->n->id)
                    s->conn_pending[i] = s->conn_pending[--s->nconn_pending];
            pthread_mutex_unlock(&s->conn_lock);
        }
    }
    close(sock);
    if (target >= 0)
        close(target);
    if (err)
        respond(s, q->n->id, 0, err);
}

/* The connector's answers, each to its call; when it is gone, every call it held is refused. */
static void *conn_main(void *arg) {
    struct ccs *s = arg;
    for (;;) {
        struct pollfd p[2] = {{.fd = s->conn_fd, .events = POLLIN}, {.fd = s->stop_fd, .events = POLLIN}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (p[1].revents)
            return NULL;
        struct connect_reply r;
        ssize_t n = recv(s->conn_fd, &r, sizeof r, MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            continue;
        if (n != (ssize_t)sizeof r)
            break; /* gone (killed from inside, say), or garbage */
        bool known = false;
        pthread_mutex_lock(&s->conn_lock);
        for (int i = 0; i < s->nconn_pending; i++) {
            if (s->conn_pending[i] == r.id) {
                s->conn_pending[i] = s->conn_pending[--s->nconn_pending];
                known = true;
                break;
            }
        }
        pthread_mutex_unlock(&s->conn_lock);
        if (known)
            respond(s, r.id, 0, r.err >= 0 && r.err < 4096 ? r.err : EIO);
    }
    pthread_mutex_lock(&s->conn_lock);
    s->conn_dead = true;
    int n = s->nconn_pending;
    uint64_t ids[MAX_CONNECTS];
    memcpy(ids, s->conn_pending, (size_t)n * sizeof ids[0]);
    s->nconn_pending = 0;
    pthread_mutex_unlock(&s->conn_lock);
    for (int i = 0; i < n; i++)
        respond(s, ids[i], 0, ECONNREFUSED);
    return NULL;
}

/* connect: a pathname Unix socket only if a process of the sandbox listens on it (or it lies
 * below a bind whose host listeners were allowed); every connect is made by the connector, or,
 * for a non-blocking socket of another family, here (the socket keeps its own namespace). */
static void do_connect(struct req *q, int sockfd, uint64_t addr_ptr, uint64_t addrlen) {
    struct ccs *s = q->s;
    if (s->conn_fd < 0) {
        if (id_valid(s, q->n->id)) {
            report_error(q, "", "no connector from the launcher");
            respond(s, q->n->id, 0, EPERM);
        }
        return;
    }
    struct sockaddr_storage addr;
    int sock, domain, err;
    if (!socket_call(q, sockfd, addr_ptr, addrlen, &addr, &sock, &domain))
        return;
    char path[sizeof(struct sockaddr_un) + 1];
    if (unix_path(domain, &addr, addrlen, path)) {
        struct resolved r;
        int obj = -1;
        err = resolve(q, AT_FDCWD, path, true, &r);
        if (!err && r.kind == RES_OBJECT) {
            obj = r.obj_fd;
            r.obj_fd = -1;
        } else if (!err && r.kind == RES_DIR) {
            err = ECONNREFUSED;
        } else if (!err) {
            obj = openat(r.dir_fd, r.name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
            err = obj < 0 ? errno : 0;
        }
        res_close(&r);
        struct stat st;
        if (!err && (fstat(obj, &st) < 0 || !S_ISSOCK(st.st_mode)))
            err = ECONNREFUSED; /* what the kernel says of a name that is not a socket */
        if (!err) {
            judge_path(obj, "");
            int derr = 0;
            if (!sockdir_allowed(s) && !bound_inside(s, st.st_dev, st.st_ino, &derr)) {
                close(obj);
                close(sock);
                q->action = "network-outbound";
                if (derr)
                    report_error(q, path, "sock_diag: %s", strerror(derr));
                refuse(q, path, path, derr ? "(the sandbox's sockets could not be listed)"
                                           : HOST_LISTENER);
                return;
            }
            connect_via(q, sock, obj, NULL, 0, false);
            return;
        }
        close_fd(&obj);
        close(sock);
        respond(s, q->n->id, 0, err);
        return;
    }
    /* Only an IP socket is connected here: the supervisor's reach in the sandbox's network
     * namespace (it owns its user namespace) is more than the task's, and a netlink connect
     * to a multicast group would use it. */
    int fl = fcntl(sock, F_GETFL);
    if ((domain == AF_INET || domain == AF_INET6) && fl >= 0 && (fl & O_NONBLOCK)) {
        err = connect(sock, (struct sockaddr *)&addr, (socklen_t)addrlen) < 0 ? errno : 0;
        close(sock);
        respond(s, q->n->id, 0, err);
        return;
    }
    connect_via(q, sock, -1, &addr, (uint32_t)addrlen, false);
}

static void do_bind(struct req *q, int sockfd, uint64_t addr_ptr, uint64_t addrlen) {
    struct ccs *s = q->s;
    struct sockaddr_storage addr;
    int sock, domain, err;
    if (!socket_call(q, sockfd, addr_ptr, addrlen, &addr, &sock, &domain))
        return;
    char path[sizeof(struct sockaddr_un) + 1];
    size_t path_off = offsetof(struct sockaddr_un, sun_path);
    if (unix_path(domain, &addr, addrlen, path)) {
        /* A pathname socket: a new name in the filesystem. */
        set_umask(q->ti.umask);
        struct resolved r;
        err = resolve(q, AT_FDCWD, path, false, &r);
        bool refused = false;
        if (!err)
            err = name_for_create(q, path, &r, false, &refused);
        if (err == EEXIST)
            err = EADDRINUSE; /* what bind(2) says of a name that exists */
        if (!err && !refused) {
            /* bind() resolves relative to the caller's cwd: ours is private (CLONE_FS). */
            struct sockaddr_un local;
            memset(&local, 0, sizeof local);
            local.sun_family = AF_UNIX;
            memcpy(local.sun_path, r.name, strlen(r.name));
            if (fchdir(r.dir_fd) < 0)
                err = errno;
            else
                err = bind(sock, (struct sockaddr *)&local,
                           (socklen_t)(path_off + strlen(r.name) + 1)) < 0 ? errno : 0;
        }
        res_close(&r);
        close(sock);
        if (!refused)
            respond(s, q->n->id, 0, err);
        return;
    }
    if (s->conn_fd >= 0) {
        /* Any other bind is made by the connector, with the task's own reach (a netlink
         * socket's multicast groups need CAP_NET_ADMIN, which the supervisor has there). */
        connect_via(q, sock, -1, &addr, (uint32_t)addrlen, true);
        return;
    }
    if (domain != AF_INET && domain != AF_INET6 && domain != AF_UNIX) {
        close(sock);
        respond(s, q->n->id, 0, EPERM); /* no connector (the library's own tests): not here */
        return;
    }
    if (addr.ss_family == AF_INET || addr.ss_family == AF_INET6) {
        /* The supervisor owns the sandbox's user namespace and so could bind a port the
         * process may not (it has no CAP_NET_BIND_SERVICE): refuse what it would be refused. */
        in_port_t port = addr.ss_family == AF_INET ? ((struct sockaddr_in *)&addr)->sin_port
                                                   : ((struct sockaddr_in6 *)&addr)->sin6_port;
        if (ntohs(port) != 0 && ntohs(port) < 1024) {
            close(sock);
            respond(s, q->n->id, 0, EACCES);
            return;
        }
    }
    err = bind(sock, (struct sockaddr *)&addr, (socklen_t)addrlen) < 0 ? errno : 0;
    close(sock);
    respond(s, q->n->id, 0, err);
}

/* The calls that change a task's umask or fs credentials, or (an exec by a thread that does
 * not lead its group, which takes over the leader's id) what a thread id stands for: trapped so
 * the cache can follow. */
/* Calls that could pass on or show a CPU pin (hold_here): let run once it is released. */
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
    judged[0] = '\0';
    q.sysname = syscall_name(n->data.nr);
    if (n->data.arch != NATIVE_ARCH || (X32_SYSCALL_BIT && (n->data.nr & X32_SYSCALL_BIT)) ||
        (q.sysname == NULL && !is_state_change(n->data.nr) && !is_pin_point(n->data.nr))) {
        q.sysname = "?";
        report_error(&q, "", "undecodable notification: arch %#x nr %d", n->data.arch,
                     n->data.nr);
        respond(s, n->id, 0, ENOSYS);
        return;
    }
    /* A held task keeps its pin only through a run of its own opens (see hold_here). */
    pid_t held = atomic_load(&s->pin_tid);
    if (held && (held != (pid_t)n->pid || is_pin_point(n->data.nr) ||
                 is_state_change(n->data.nr)))
        pin_release(s);
    if (is_pin_point(n->data.nr)) {
        respond_continue(s, n->id);
        return;
    }
    if (is_state_change(n->data.nr)) {
        state_change(s, n);
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
        int timeout = atomic_load(&s->nhelpers)                            ? HELPER_POLL_MS
                      : worker_held_on >= 0 || atomic_load(&s->pin_tid) ? PIN_IDLE_MS
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
            pin_release(s);
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
                pin_release(s);
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
    pthread_mutex_destroy(&s->pin_lock);
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
    free(s->glob_blob);
    free(s->groups);
    free(s->threads);
    free(s);
}

/* Stop the workers and wait for them and for every FIFO helper; then close the listener (every
 * notification still pending fails with ENOSYS) and the report fd. */
void ccs_stop(struct ccs *s);

int ccs_abi_version(void) { return CCS_ABI_VERSION; }

/*
 * Start supervising `listener` (taken over: closed by ccs_stop). `globs` holds `globs_len`
 * bytes of NUL-terminated glob patterns. Records go to `report_fd` (taken over; should be
 * non-blocking: a full pipe drops the record and counts it). `flags` bit 0: ask the kernel to
 * wake the task on the supervisor's CPU (SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP, 6.6+; ignored when
 * unsupported); bit 1: answer opens with the task kept on the worker's CPU (hold_here).
 * Returns NULL with a message in `err` on failure (then both fds are closed).
 */
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
    s->stop_fd = -1;
    s->proc_fd = -1;
    s->pin_pidfd = -1;
    pthread_mutex_init(&s->recv_lock, NULL);
    pthread_mutex_init(&s->lock, NULL);
    pthread_mutex_init(&s->pin_lock, NULL);
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

void ccs_stop(struct ccs *s) {
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
    pin_release(s); /* a task still held (it may outlive a stopped supervisor) */
    close(s->listener);
    close(s->report_fd);
    destroy(s);
}

/* Whether every worker has stopped on its own (the sandbox's tasks are all gone). */
int ccs_finished(struct ccs *s) { return atomic_load(&s->stopping); }

/* Counters: handled notifications, refusals, errors, dropped reports, the nanoseconds the
 * workers spent handling notifications (from RECV to the answer), calls answered from the task
 * cache, whether the kernel took SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP (1 or 0), and opens answered
 * with the task kept on the worker's CPU. */
void ccs_stats(struct ccs *s, unsigned long long out[8]) {
    out[0] = atomic_load(&s->handled);
    out[1] = atomic_load(&s->refused);
    out[2] = atomic_load(&s->errors);
    out[3] = atomic_load(&s->dropped_reports);
    out[4] = atomic_load(&s->busy_ns);
    out[5] = atomic_load(&s->cache_hits);
    out[6] = s->sync_wake;
    out[7] = atomic_load(&s->replies_here);
}
