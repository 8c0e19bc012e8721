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
 * Fail-closed: anything that cannot be decoded or emulated is refused with an error; if the
 * supervisor is gone, the kernel fails every trapped call with ENOSYS.
 *
 * The files (one library; only the ccs_* API is exported):
 *   supervisor.c          the notification loop: decoding (handle, dispatch), the worker threads
 *                         and the C API (ccs_start, ccs_stop, ccs_stats)
 *   supervisor_task.c     the trapping task, from /proc: its status cache, state changes,
 *                         credentials
 *   supervisor_resolve.c  path resolution in the task's view
 *   supervisor_rules.c    the name globs and the write policy's path rules
 *   supervisor_emulate.c  the emulation of each call that creates or changes a name
 *   supervisor_sockets.c  bind, and connect through the launcher's connector
 *   supervisor_cpu.c      CPU holds (hold_here) and the crowd check
 *   supervisor_report.c   records on the report pipe and answers to the kernel
 */
#ifndef CC_SUPERVISOR_H
#define CC_SUPERVISOR_H

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
#define MAX_FS_INFLIGHT 32        /* cwd or root changes tracked at once; more turn that cache off */
#define MAX_CONNECTS 64           /* connects the connector runs at once (launcher.c) */
#define MAX_OWN_WORKTREES 64      /* .git/worktrees/<name> directories a sandbox made, tracked */
#define MAX_PREFIXES 256          /* proper prefixes of the path patterns (prefix_hits) */
#define PIN_IDLE_MS 1             /* a worker held to its CPU for a run of opens (hold_here) gets
                                     its own affinity back after this long without a call */
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
    /* Calls that change a thread's cwd or root (chdir, fchdir; chroot, pivot_root, setns and
     * unshare too, which the sandbox's own filter refuses before they reach this one): each
     * bumps fs_gen, which makes every cached cwd and root stale, and stays in `fs_inflight`
     * (under `lock`) until it has surely run: its thread makes another call or is gone (no fd is held for it). A cwd or
     * root is cached only when none is in flight (see task_start_fd). */
    atomic_ullong fs_gen;
    atomic_int nfs_inflight;
    atomic_bool fs_cache_off; /* a change could not be tracked: cwd and root opened every call */
    struct fs_change {
        pid_t tid; /* retired at its next call, or once no thread has that id (thread_alive) */
    } fs_inflight[MAX_FS_INFLIGHT];
    atomic_ullong replies_here; /* opens answered with the task kept on the worker's CPU */
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
    /* The mounts of the sandbox's mount namespace (their ids, sorted), read once from the first
     * judged call's task (own_mount); mnt_state 0: not read, 1: read, -1: could not be. */
    pthread_mutex_t mnt_lock;
    atomic_int mnt_state;
    uint64_t *mnt_ids;
    int nmnt_ids;
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
    bool root_borrowed; /* root_fd is the task cache's (not closed by handle()) */
    struct tid_entry *entry; /* the task's cache entry (read_task_info) */
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

/* Only the C API is exported (the library is built with -fvisibility=hidden). */
#define CCS_API __attribute__((visibility("default")))

/* What follows binds inside the library: direct calls, local thread-locals. */
#pragma GCC visibility push(hidden)

/* Per worker thread (defined in supervisor.c). */
extern __thread cpu_set_t worker_cpus; /* the worker's own affinity, read when it starts */
extern __thread bool worker_cpus_known;
extern __thread int worker_held_on; /* the CPU hold_here holds this worker to, or -1 */
/* The path the last check of this worker judged, in the task's view (reported as a refusal's
 * resolved target; empty when unknown). */
extern __thread char judged[PATH_MAX + NAME_MAX + 2];

/* supervisor_task.c */
void tid_cache_init(void);
void tid_cache_clear(void);
bool task_alive(int pidfd);
int copy_string(pid_t pid, uint64_t addr, char *buf, size_t size);
int copy_bytes(pid_t pid, uint64_t addr, void *buf, size_t len);
int cmp_gid(const void *a, const void *b);
void state_change(struct ccs *s, struct seccomp_notif *n);
int read_task_info(struct req *q);
bool same_credentials(struct ccs *s, struct task_info *ti);
long keeper_of(struct ccs *s, pid_t tid);

/* supervisor_resolve.c */
void close_fd(int *fd);
void res_init(struct resolved *r);
void res_close(struct resolved *r);
int open_root(struct req *q);
void fs_retire(struct ccs *s, pid_t tid);
void fs_change(struct ccs *s, struct seccomp_notif *n);
int task_start_fd(struct req *q, bool root, int *out, bool *cached);
int get_root(struct req *q, int *out);
int start_dir(struct req *q, int dirfd, const char *path, bool check_dir, int *out);
int resolve(struct req *q, int dirfd, const char *path, bool follow_final,
            struct resolved *out);

/* supervisor_rules.c */
struct glob_form glob_form_of(const char *glob);
bool glob_match(struct ccs *s, const char *name, const char **which);
bool has_path_rules(const struct ccs *s);
bool path_under(const char *path, const char *root);
void open_self_fds(void);
bool fd_path(int fd, char *buf, size_t size);
void begin_judging(struct req *q);
void end_judging(struct req **q);
bool view_path(int fd, char *buf, size_t size);
bool glob_refused(struct ccs *s, int dir_fd, const char *name, const char **which);
bool judge_path(int dir_fd, const char *name);
bool worktree_dir_refused(struct ccs *s, int dir_fd, const char *name, const char **which);
void note_worktree_dir(struct ccs *s, int dir_fd, const char *name);
bool carry_refused(const struct ccs *s, int dir_fd, const char *name, const char *to,
                   const char **which);
bool shape_refused(const struct ccs *s, int dir_fd, const char *name, bool replacing_by_file,
                   const char **which);
bool completes_shape(const struct ccs *s, int dir_fd, const char *name, const char **which);
bool path_refused(const struct ccs *s, int dir_fd, const char *name, const char **which);
bool ancestor_refused(const struct ccs *s, int dir_fd, const char *name, const char **which);
bool lexically_clear(const struct ccs *s, int start, const char *rel, const char *name,
                     bool creating);
bool object_refused(struct req *q, int obj, const char **which);

/* supervisor_emulate.c */
bool kernel_object(int fd);
void set_umask(mode_t m);
void rescue_helpers(struct ccs *s, bool all);
void do_open(struct req *q, int dirfd, uint64_t path_addr, int flags, mode_t mode);
int name_for_create(struct req *q, const char *path, struct resolved *r, bool is_mkdir,
                    bool *refused);
void do_mknod_mkdir(struct req *q, int dirfd, uint64_t addr, mode_t mode, dev_t dev,
                    bool is_mkdir);
void do_symlink(struct req *q, uint64_t target_addr, int dirfd, uint64_t addr);
void do_link(struct req *q, int olddirfd, uint64_t old_addr, int newdirfd,
             uint64_t new_addr, int flags);
void do_rename(struct req *q, int olddirfd, uint64_t old_addr, int newdirfd,
               uint64_t new_addr, unsigned flags);
void do_unlink(struct req *q, int dirfd, uint64_t addr, int flags);
void do_truncate(struct req *q, uint64_t addr, int64_t length);
void do_chmod(struct req *q, int dirfd, uint64_t addr, mode_t mode, int flags);
void do_fchmod(struct req *q, int fd, mode_t mode);

/* supervisor_sockets.c */
void *conn_main(void *arg);
void do_connect(struct req *q, int sockfd, uint64_t addr_ptr, uint64_t addrlen);
void do_bind(struct req *q, int sockfd, uint64_t addr_ptr, uint64_t addrlen);

/* supervisor_cpu.c */
long long now_ns(void);
bool crowded(struct ccs *s);
void worker_release_cpu(void);
bool hold_here(struct ccs *s, pid_t tid, int *cpu, cpu_set_t *saved);
void hold_release(struct ccs *s, pid_t tid, int cpu, const cpu_set_t *saved);

/* supervisor_report.c */
void report(struct ccs *s, char kind, const char *sysname, const char *target,
            const char *name, const char *detail);
void report_error(struct req *q, const char *target, const char *fmt, ...);
void respond_continue(struct ccs *s, uint64_t id);
void respond(struct ccs *s, uint64_t id, int64_t val, int err);
void respond_fd(struct ccs *s, uint64_t id, pid_t tid, int fd, bool cloexec);
bool id_valid(struct ccs *s, uint64_t id);
void report_refusal(struct req *q, const char *target, const char *name,
                    const char *rule, const char *action);
void refuse(struct req *q, const char *target, const char *name, const char *glob);
void refuse_at(struct req *q, const char *target, int dir_fd, const char *name,
               const char *glob);

#pragma GCC visibility pop

#endif
