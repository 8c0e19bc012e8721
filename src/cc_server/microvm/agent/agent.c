/*
 * cc-vm-agent: the guest side of the microVM backend. It runs as the guest's PID 1 (the
 * initramfs /init execs it) and speaks one framed protocol over a virtio-serial console port
 * (/dev/hvc0) with the server. Nothing in the guest talks to the host any other way: the guest
 * has no network device, and its only ways out are the two loopback listeners below, whose
 * connections the agent carries to the session's egress proxies on the host.
 *
 * Frame: u32 payload length, u32 channel, u8 type, then the payload (little endian).
 * A channel is one command (opened by the host with EXEC) or one outbound connection (opened by
 * the agent with NET_OPEN; those channel ids have the top bit set). See cc_server/microvm/proto.py
 * for the host's side, which defines the same numbers.
 *
 * Commands run with a reduced capability set (no CAP_SYS_ADMIN, CAP_SYS_MODULE, CAP_SYS_PTRACE,
 * ...), so they cannot undo the read-only and hidden carve-outs the agent mounts for the policy,
 * load modules, or drive the agent; the virtio port is unlinked once open.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/random.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#define AGENT_VERSION "cc-vm-agent 1"
#define MAX_PAYLOAD (64 * 1024) /* one frame's payload; the host uses the same limit */
#define MAX_CHANNELS 256        /* commands and connections alive at once */
#define HDR 9
#define SMALL_FRAME 4096 /* payloads up to this size go out with their header in one write */
#define DRAIN_AFTER_EXIT_MS 2000 /* how long a descendant may hold a command's output open */
#define HTTP_PROXY_PORT 3128
#define SOCKS_PROXY_PORT 1080
#define FREEZE_WAIT_MS 2000 /* every command stopped in the kernel: milliseconds normally */

enum {
    F_HELLO = 1, F_HELLO_OK = 2, F_EXEC = 3, F_STARTED = 4, F_STDOUT = 5, F_STDERR = 6,
    F_EXIT = 7, F_DATA = 8, F_EOF = 9, F_SIGNAL = 10, F_WINSIZE = 11, F_MOUNT = 12,
    F_RESULT = 13, F_NET_OPEN = 14, F_ABORT = 15, F_PING = 16, F_PONG = 17, F_UNMOUNT = 18,
    F_FREEZE = 19, F_THAW = 20,
};
enum { EXEC_PTY = 1, EXEC_STDIN = 2 };
enum { MOUNT_9P = 0, MOUNT_RO_BIND = 1, MOUNT_HIDE = 2 };
enum { K_FREE = 0, K_EXEC, K_NET };

struct buf { unsigned char *p; size_t len, cap; };

struct chan {
    int kind;
    uint32_t id;
    pid_t pid;
    int out, err, in;      /* exec: stdout / stderr / stdin fds (pty: out == in == master) */
    int sock;              /* net */
    int pty;
    int exited, status;
    long exit_ms;
    int in_eof;            /* host sent EOF: close `in` once `pending` is written */
    int sock_eof_sent;     /* net: guest side reached EOF */
    struct buf pending;    /* bytes for `in` / `sock` not yet written */
};

static int port_fd = -1;
static struct chan chans[MAX_CHANNELS];
static uint32_t next_net_id = 1;
static int listen_http = -1, listen_socks = -1;

static long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void logmsg(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("cc-vm-agent: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static void write_all(int fd, const void *data, size_t len) {
    const unsigned char *p = data;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) { struct pollfd w = {fd, POLLOUT, 0}; poll(&w, 1, 100); continue; }
            return; /* the host is gone; it resends HELLO when it comes back */
        }
        p += n;
        len -= (size_t)n;
    }
}

static void put32(unsigned char *p, uint32_t v) {
    p[0] = v; p[1] = v >> 8; p[2] = v >> 16; p[3] = v >> 24;
}
static uint32_t get32(const unsigned char *p) {
    return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void send_frame(uint32_t chan, int type, const void *data, size_t len) {
    unsigned char hdr[HDR];
    put32(hdr, (uint32_t)len);
    put32(hdr + 4, chan);
    hdr[8] = (unsigned char)type;
    /* One write, so one virtqueue buffer and one notification to QEMU for the whole frame. */
    if (len <= SMALL_FRAME) {
        unsigned char frame[HDR + SMALL_FRAME];
        memcpy(frame, hdr, HDR);
        if (len) memcpy(frame + HDR, data, len);
        write_all(port_fd, frame, HDR + len);
        return;
    }
    write_all(port_fd, hdr, HDR);
    write_all(port_fd, data, len);
}

static void send_result(uint32_t chan, int err, const char *msg) {
    unsigned char out[512];
    size_t n = strlen(msg);
    if (n > sizeof out - 4) n = sizeof out - 4;
    put32(out, (uint32_t)err);
    memcpy(out + 4, msg, n);
    send_frame(chan, F_RESULT, out, n + 4);
}

static void buf_add(struct buf *b, const void *data, size_t len) {
    if (b->len + len > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + len) cap *= 2;
        unsigned char *p = realloc(b->p, cap);
        if (!p) { logmsg("out of memory"); _exit(1); }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, data, len);
    b->len += len;
}

static void buf_drop(struct buf *b, size_t n) {
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
}

static struct chan *find(uint32_t id) {
    for (int i = 0; i < MAX_CHANNELS; i++)
        if (chans[i].kind != K_FREE && chans[i].id == id) return &chans[i];
    return NULL;
}

static struct chan *alloc_chan(int kind, uint32_t id) {
    for (int i = 0; i < MAX_CHANNELS; i++) {
        if (chans[i].kind == K_FREE) {
            struct chan *c = &chans[i];
            memset(c, 0, sizeof *c);
            c->kind = kind;
            c->id = id;
            c->out = c->err = c->in = c->sock = -1;
            return c;
        }
    }
    return NULL;
}

static void free_chan(struct chan *c) {
    if (c->kind == K_EXEC) {
        if (c->out >= 0) close(c->out);
        if (c->err >= 0) close(c->err);
        if (c->in >= 0 && c->in != c->out) close(c->in);
    }
    if (c->sock >= 0) close(c->sock);
    free(c->pending.p);
    memset(c, 0, sizeof *c);
}

/* ---- commands ---------------------------------------------------------------------------- */

/* Capabilities a command never gets: they would let it undo the policy's mounts, reach the host
 * channel, load kernel code or trace the agent. */
static const int dropped_caps[] = {
    CAP_SYS_ADMIN, CAP_SYS_MODULE, CAP_SYS_RAWIO, CAP_SYS_PTRACE, CAP_SYS_BOOT, CAP_MKNOD,
    CAP_SYS_TIME, CAP_MAC_ADMIN, CAP_MAC_OVERRIDE, CAP_BPF, CAP_PERFMON, CAP_SYSLOG,
    CAP_LINUX_IMMUTABLE, CAP_NET_ADMIN, CAP_SYS_RESOURCE,
};

/* Once, at start: the dropped capabilities leave the agent's bounding set and inheritable set,
 * and no_new_privs is set, all inherited by every command. A command runs as root, so at its
 * exec it gets exactly the bounding set; the agent keeps its own effective set for the mounts.
 * Its errno when it failed: then every command fails before it execs. */
static int caps_error = ENOSYS;

static int drop_caps(void) {
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    if (syscall(SYS_capget, &hdr, data) != 0) return -1;
    for (size_t i = 0; i < sizeof dropped_caps / sizeof dropped_caps[0]; i++) {
        int cap = dropped_caps[i];
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL) return -1;
        data[cap / 32].inheritable &= ~(1u << (cap % 32));
    }
    if (syscall(SYS_capset, &hdr, data) != 0) return -1;
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL) return -1;
    for (size_t i = 0; i < sizeof dropped_caps / sizeof dropped_caps[0]; i++) {
        if (prctl(PR_CAPBSET_READ, dropped_caps[i], 0, 0, 0) == 1) { errno = EPERM; return -1; }
    }
    return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
}

static void child_fail(int fd, const char *what, const char *arg) {
    char msg[512];
    int n = snprintf(msg, sizeof msg, "cc-vm-agent: %s %s: %s\n", what, arg, strerror(errno));
    if (n > 0) write_all(fd, msg, (size_t)n);
    _exit(what[0] == 'e' && errno == ENOENT ? 127 : 126);
}

/* ---- the commands' cgroup: frozen while a suspend takes the mounts off ------------------ */

/* The commands' cgroup (v2), reachable only through this descriptor: its cgroupfs mount is
   detached at start, and commands (no CAP_SYS_ADMIN) cannot mount one to leave or thaw it. */
static int cg_cmds = -1;

static void setup_cgroup(void) {
    const char *mnt = "/run/cc-cgroup";
    if (mkdir(mnt, 0700) != 0 && errno != EEXIST) { logmsg("cgroup dir: %s", strerror(errno)); return; }
    if (mount("cgroup2", mnt, "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0) {
        logmsg("cgroup2: %s", strerror(errno));
        rmdir(mnt);
        return;
    }
    if (mkdir("/run/cc-cgroup/cmds", 0755) != 0 && errno != EEXIST)
        logmsg("cgroup cmds: %s", strerror(errno));
    cg_cmds = open("/run/cc-cgroup/cmds", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    umount2(mnt, MNT_DETACH);
    rmdir(mnt);
}

static int cg_write(const char *file, const char *value) {
    int fd = openat(cg_cmds, file, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = write(fd, value, strlen(value));
    int saved = errno;
    close(fd);
    errno = saved;
    return n == (ssize_t)strlen(value) ? 0 : -1;
}

static int set_frozen(int frozen) {
    if (cg_cmds < 0) { errno = ENOSYS; return -1; }
    if (cg_write("cgroup.freeze", frozen ? "1" : "0") != 0) return -1;
    for (int waited = 0; frozen && waited < FREEZE_WAIT_MS; waited++) {
        char events[256];
        int fd = openat(cg_cmds, "cgroup.events", O_RDONLY | O_CLOEXEC);
        if (fd < 0) return -1;
        ssize_t n = read(fd, events, sizeof events - 1);
        close(fd);
        if (n < 0) return -1;
        events[n] = 0;
        if (strstr(events, "frozen 1")) return 0;
        usleep(1000);
    }
    if (!frozen) return 0;
    errno = ETIMEDOUT;
    return -1;
}

static void do_freeze(uint32_t id, int frozen) {
    int rc = set_frozen(frozen);
    send_result(id, rc == 0 ? 0 : errno, rc == 0 ? "ok" : strerror(errno));
}

/* What a command's child needs. The child shares the agent's memory until it execs (see
 * spawn), so it only reads this, writes nothing of the agent's, and keeps to its own stack. */
struct spawn {
    char **argv, **envp;
    const char *cwd;
    const char *slave_name; /* a PTY command's terminal, or NULL */
    int stdin_fd, out_fd, err_fd; /* pipe ends (stdin -1: /dev/null) */
    int join_cgroup;        /* not created in the commands' cgroup: join it first */
};

static int child_main(void *arg) {
    const struct spawn *s = arg;
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    setsid();
    if (s->slave_name) {
        int slave = open(s->slave_name, O_RDWR);
        if (slave < 0) _exit(126);
        ioctl(slave, TIOCSCTTY, 0);
        dup2(slave, 0); dup2(slave, 1); dup2(slave, 2);
        if (slave > 2) close(slave);
    } else {
        int devnull = open("/dev/null", O_RDWR);
        dup2(s->stdin_fd >= 0 ? s->stdin_fd : devnull, 0);
        dup2(s->out_fd, 1);
        dup2(s->err_fd, 2);
    }
    int efd = 2;
    if (caps_error != 0) { errno = caps_error; child_fail(efd, "drop", "capabilities"); }
    /* Into the freezable group before anything of the command runs; a command outside it
       could run while a suspend has the carve-outs off. */
    if (s->join_cgroup) {
        char self[16];
        snprintf(self, sizeof self, "%d", (int)getpid());
        if (cg_cmds < 0) errno = ENOSYS;
        if (cg_cmds < 0 || cg_write("cgroup.procs", self) != 0) child_fail(efd, "join", "cgroup");
    }
    if (s->cwd[0] && chdir(s->cwd) != 0) child_fail(efd, "chdir", s->cwd);
    execvpe(s->argv[0], s->argv, s->envp);
    child_fail(efd, "exec", s->argv[0]);
    return 127;
}

#if defined(__x86_64__)
#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif
struct clone_args_v2 {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls;
    uint64_t set_tid, set_tid_size, cgroup;
};

/* clone3, the child running fn(arg) on its own stack and exiting with its result; the raw
 * syscall's return (pid, or -errno) in the parent. */
static long clone3_run(struct clone_args_v2 *ca, int (*fn)(void *), void *arg) {
    register long rax __asm__("rax") = SYS_clone3;
    register struct clone_args_v2 *rdi __asm__("rdi") = ca;
    register long rsi __asm__("rsi") = sizeof *ca;
    register void *r12 __asm__("r12") = arg;
    register int (*r13)(void *) __asm__("r13") = fn;
    __asm__ volatile(
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "jnz 1f\n\t"
        "xor %%ebp, %%ebp\n\t"
        "mov %%r12, %%rdi\n\t"
        "call *%%r13\n\t"
        "mov %%eax, %%edi\n\t"
        "mov %[exit], %%eax\n\t"
        "syscall\n\t"
        "ud2\n"
        "1:"
        : "+r"(rax)
        : "r"(rdi), "r"(rsi), "r"(r12), "r"(r13), [exit] "i"(SYS_exit)
        : "rcx", "r11", "memory");
    return rax;
}
#endif

/* The command's process. Under TCG, where a guest page fault costs tens of microseconds, a
 * fork (copying the agent's page tables, then faulting every page either side writes) and a
 * move into the cgroup after it cost milliseconds per command: the child is created with the
 * agent's memory shared and the agent stopped until the child execs (CLONE_VM | CLONE_VFORK),
 * straight into the commands' cgroup (CLONE_INTO_CGROUP). A kernel without clone3 gets fork. */
static pid_t spawn(struct spawn *s) {
#if defined(__x86_64__)
    static unsigned char stack[64 * 1024] __attribute__((aligned(16)));
    struct clone_args_v2 ca = {
        .flags = CLONE_VM | CLONE_VFORK | (cg_cmds >= 0 ? CLONE_INTO_CGROUP : 0),
        .exit_signal = SIGCHLD,
        .stack = (uintptr_t)stack,
        .stack_size = sizeof stack,
        .cgroup = cg_cmds >= 0 ? (uint64_t)cg_cmds : 0,
    };
    s->join_cgroup = cg_cmds < 0;
    long ret = clone3_run(&ca, child_main, s);
    if (ret >= 0) return (pid_t)ret;
    if (ret != -ENOSYS && ret != -EINVAL) { errno = (int)-ret; return -1; }
#endif
    s->join_cgroup = 1;
    pid_t pid = fork();
    if (pid == 0) _exit(child_main(s));
    return pid;
}

static void do_exec(uint32_t id, const unsigned char *p, size_t len) {
    if (len < 12 || find(id)) { send_result(id, EINVAL, "bad exec frame"); return; }
    uint32_t flags = get32(p);
    unsigned rows = p[4] | p[5] << 8, cols = p[6] | p[7] << 8;
    unsigned argc = p[8] | p[9] << 8, envc = p[10] | p[11] << 8;
    /* strings: argv..., env..., cwd, each NUL-terminated */
    char *copy = malloc(len - 12 + 1);
    if (!copy) _exit(1);
    memcpy(copy, p + 12, len - 12);
    copy[len - 12] = 0;
    char **argv = calloc(argc + 1, sizeof *argv), **envp = calloc(envc + 1, sizeof *envp);
    char *s = copy, *end = copy + (len - 12), *cwd = NULL;
    for (unsigned i = 0; i < argc + envc + 1; i++) {
        if (s >= end) { free(copy); free(argv); free(envp); send_result(id, EINVAL, "bad exec strings"); return; }
        if (i < argc) argv[i] = s; else if (i < argc + envc) envp[i - argc] = s; else cwd = s;
        s += strlen(s) + 1;
    }
    if (argc == 0) { free(copy); free(argv); free(envp); send_result(id, EINVAL, "empty argv"); return; }

    struct chan *c = alloc_chan(K_EXEC, id);
    if (!c) { free(copy); free(argv); free(envp); send_result(id, EMFILE, "too many channels"); return; }
    int out[2] = {-1, -1}, err[2] = {-1, -1}, in[2] = {-1, -1}, master = -1;
    char *slave_name = NULL;
    if (flags & EXEC_PTY) {
        master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (master < 0 || grantpt(master) || unlockpt(master) || !(slave_name = ptsname(master))) {
            send_result(id, errno, "no pty");
            if (master >= 0) close(master);
            free_chan(c); free(copy); free(argv); free(envp);
            return;
        }
        struct winsize ws = {.ws_row = rows, .ws_col = cols};
        ioctl(master, TIOCSWINSZ, &ws);
    } else {
        if (pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC) ||
            ((flags & EXEC_STDIN) && pipe2(in, O_CLOEXEC))) {
            send_result(id, errno, "no pipes");
            for (int i = 0; i < 2; i++) { if (out[i] >= 0) close(out[i]); if (err[i] >= 0) close(err[i]); }
            free_chan(c); free(copy); free(argv); free(envp);
            return;
        }
    }
    struct spawn sp = {
        .argv = argv, .envp = envp, .cwd = cwd, .slave_name = slave_name,
        .stdin_fd = in[0], .out_fd = out[1], .err_fd = err[1],
    };
    pid_t pid = spawn(&sp);
    int saved = errno;
    free(copy); free(argv); free(envp);
    if (pid < 0) {
        send_result(id, saved, "fork failed");
        if (master >= 0) close(master);
        for (int i = 0; i < 2; i++) { if (out[i] >= 0) close(out[i]); if (err[i] >= 0) close(err[i]); if (in[i] >= 0) close(in[i]); }
        free_chan(c);
        return;
    }
    c->pid = pid;
    if (master >= 0) {
        c->pty = 1;
        c->out = c->in = master;
        fcntl(master, F_SETFL, O_NONBLOCK);
    } else {
        close(out[1]); close(err[1]);
        c->out = out[0]; c->err = err[0];
        if (flags & EXEC_STDIN) { close(in[0]); c->in = in[1]; fcntl(c->in, F_SETFL, O_NONBLOCK); }
    }
    unsigned char pidb[4];
    put32(pidb, (uint32_t)pid);
    send_frame(id, F_STARTED, pidb, 4);
}

static void finish_exec(struct chan *c) {
    unsigned char b[8];
    int code = 0, sig = 0;
    if (WIFEXITED(c->status)) code = WEXITSTATUS(c->status);
    else if (WIFSIGNALED(c->status)) { sig = WTERMSIG(c->status); code = 128 + sig; }
    put32(b, (uint32_t)code);
    put32(b + 4, (uint32_t)sig);
    kill(-c->pid, SIGKILL); /* what the command left in its process group goes with it */
    send_frame(c->id, F_EXIT, b, 8);
    free_chan(c);
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < MAX_CHANNELS; i++) {
            struct chan *c = &chans[i];
            if (c->kind == K_EXEC && c->pid == pid && !c->exited) {
                c->exited = 1;
                c->status = status;
                c->exit_ms = now_ms();
            }
        }
    }
}

/* ---- mounts ------------------------------------------------------------------------------ */

static int mkdirs(const char *path, int file) {
    char tmp[4096];
    if (strlen(path) >= sizeof tmp) { errno = ENAMETOOLONG; return -1; }
    strcpy(tmp, path);
    for (char *p = tmp + 1; *p; p++) {
        if (*p == '/') {
            *p = 0;
            if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return -1;
            *p = '/';
        }
    }
    if (file) {
        int fd = open(tmp, O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
        if (fd < 0) return -1;
        close(fd);
        return 0;
    }
    if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return -1;
    return 0;
}

static void do_mount(uint32_t id, const unsigned char *p, size_t len) {
    if (len < 3 || p[len - 1] != 0) { send_result(id, EINVAL, "bad mount frame"); return; }
    int op = p[0], ro = p[1];
    const char *tag = (const char *)p + 2;
    const char *path = tag + strlen(tag) + 1;
    if ((const unsigned char *)path >= p + len || path[0] != '/') {
        send_result(id, EINVAL, "bad mount path");
        return;
    }
    struct stat st;
    int rc = 0;
    if (op == MOUNT_9P) {
        char opts[128];
        snprintf(opts, sizeof opts, "trans=virtio,version=9p2000.L,msize=262144,cache=none");
        rc = mkdirs(path, 0);
        if (rc == 0) rc = mount(tag, path, "9p", (ro ? MS_RDONLY : 0) | MS_NOSUID | MS_NODEV, opts);
    } else if (op == MOUNT_RO_BIND) {
        rc = mount(path, path, NULL, MS_BIND | MS_REC, NULL);
        if (rc == 0) rc = mount(NULL, path, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY, NULL);
    } else if (op == MOUNT_HIDE) {
        if (lstat(path, &st) != 0) { send_result(id, 0, "absent"); return; }
        if (S_ISDIR(st.st_mode)) {
            rc = mount("cc-hidden", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=000,size=4k");
        } else {
            rc = mount("/run/cc-empty", path, NULL, MS_BIND, NULL);
            if (rc == 0) rc = mount(NULL, path, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY, NULL);
        }
    } else {
        errno = EINVAL;
        rc = -1;
    }
    send_result(id, rc == 0 ? 0 : errno, rc == 0 ? "ok" : strerror(errno));
}

static void do_unmount(uint32_t id, const unsigned char *p, size_t len) {
    if (len < 2 || p[len - 1] != 0) { send_result(id, EINVAL, "bad unmount frame"); return; }
    /* Not MNT_DETACH: a busy mount must stay whole (the caller puts back what it took off). */
    int rc = umount2((const char *)p, 0);
    send_result(id, rc == 0 ? 0 : errno, rc == 0 ? "ok" : strerror(errno));
}

/* ---- time and entropy after a restore ---------------------------------------------------- */

static void do_hello(uint32_t id, const unsigned char *p, size_t len) {
    if (len >= 8 + 4) {
        struct timespec ts;
        uint64_t sec = get32(p) | (uint64_t)get32(p + 4) << 32;
        ts.tv_sec = (time_t)sec;
        ts.tv_nsec = get32(p + 8);
        clock_settime(CLOCK_REALTIME, &ts);
    }
    if (len > 12) {
        size_t n = len - 12;
        struct { int entropy_count; int buf_size; unsigned char buf[256]; } ent;
        if (n > sizeof ent.buf) n = sizeof ent.buf;
        ent.entropy_count = (int)n * 8;
        ent.buf_size = (int)n;
        memcpy(ent.buf, p + 12, n);
        int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            ioctl(fd, RNDADDENTROPY, &ent);
            ioctl(fd, RNDRESEEDCRNG); /* use it now, not at the next timed reseed */
            close(fd);
        }
    }
    send_frame(id, F_HELLO_OK, AGENT_VERSION, strlen(AGENT_VERSION));
}

/* ---- outbound connections ---------------------------------------------------------------- */

static int listen_on(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    int one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 64)) {
        logmsg("cannot listen on 127.0.0.1:%d: %s", port, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

static void accept_one(int lfd, int which) {
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    uint32_t id = 0x80000000u | (next_net_id++ & 0x7fffffffu);
    struct chan *c = alloc_chan(K_NET, id);
    if (!c) { close(fd); return; }
    c->sock = fd;
    unsigned char w = (unsigned char)which;
    send_frame(id, F_NET_OPEN, &w, 1);
}

/* ---- the host's frames ------------------------------------------------------------------- */

static void flush_pending(struct chan *c) {
    int fd = c->kind == K_NET ? c->sock : c->in;
    if (fd < 0) return;
    while (c->pending.len > 0) {
        ssize_t n = write(fd, c->pending.p, c->pending.len);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) return;
            c->pending.len = 0; /* the reader is gone */
            if (c->kind == K_NET) { send_frame(c->id, F_ABORT, NULL, 0); free_chan(c); }
            return;
        }
        buf_drop(&c->pending, (size_t)n);
    }
    if (c->in_eof) {
        if (c->kind == K_NET) {
            shutdown(c->sock, SHUT_WR);
            if (c->sock_eof_sent) free_chan(c);
            else c->in_eof = 2;
        } else if (!c->pty && c->in >= 0) {
            close(c->in);
            c->in = -1;
        } else if (c->pty) {
            unsigned char eot = 4;
            if (write(c->in, &eot, 1) == 1) c->in_eof = 0;
        }
    }
}

static void handle_frame(uint32_t id, int type, const unsigned char *p, size_t len) {
    struct chan *c;
    switch (type) {
    case F_HELLO: do_hello(id, p, len); break;
    case F_PING: send_frame(id, F_PONG, p, len); break;
    case F_EXEC: do_exec(id, p, len); break;
    case F_MOUNT: do_mount(id, p, len); break;
    case F_UNMOUNT: do_unmount(id, p, len); break;
    case F_FREEZE: do_freeze(id, 1); break;
    case F_THAW: do_freeze(id, 0); break;
    case F_DATA:
        if ((c = find(id)) && (c->kind == K_NET || c->in >= 0)) {
            buf_add(&c->pending, p, len);
            flush_pending(c);
        }
        break;
    case F_EOF:
        if ((c = find(id))) { c->in_eof = 1; flush_pending(c); }
        break;
    case F_SIGNAL:
        if ((c = find(id)) && c->kind == K_EXEC && len >= 4 && !c->exited) kill(-c->pid, (int)get32(p));
        break;
    case F_WINSIZE:
        if ((c = find(id)) && c->pty && len >= 4) {
            struct winsize ws = {.ws_row = p[0] | p[1] << 8, .ws_col = p[2] | p[3] << 8};
            ioctl(c->out, TIOCSWINSZ, &ws);
        }
        break;
    case F_ABORT:
        if ((c = find(id)) && c->kind == K_NET) free_chan(c);
        break;
    default: logmsg("unknown frame type %d", type);
    }
}

/* Read what a command or connection wrote and forward it; 0 at EOF. */
static int forward(struct chan *c, int fd, int type) {
    unsigned char data[MAX_PAYLOAD];
    ssize_t n = read(fd, data, sizeof data);
    if (n > 0) { send_frame(c->id, type, data, (size_t)n); return 1; }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return 1;
    return 0; /* EOF, or EIO from a pty whose last slave closed */
}

#if defined(__x86_64__)
/* `cc-vm-agent --tsc-khz`, run on the host (never in the guest): the host's TSC rate, which a
 * guest under TCG reads as its own TSC. The guest cannot measure it (under TCG its PIT
 * calibration fails and it has no HPET), so the server passes it on the kernel command line. */
static int print_tsc_khz(void) {
    struct timespec a, b, pause = {0, 200 * 1000 * 1000};
    clock_gettime(CLOCK_MONOTONIC_RAW, &a);
    uint64_t t0 = __builtin_ia32_rdtsc();
    nanosleep(&pause, NULL);
    clock_gettime(CLOCK_MONOTONIC_RAW, &b);
    uint64_t t1 = __builtin_ia32_rdtsc();
    double ns = (double)(b.tv_sec - a.tv_sec) * 1e9 + (double)(b.tv_nsec - a.tv_nsec);
    if (ns <= 0) return 1;
    printf("%.0f\n", (double)(t1 - t0) * 1e6 / ns);
    return 0;
}
#endif

int main(int argc, char **argv) {
#if defined(__x86_64__)
    if (argc > 1 && strcmp(argv[1], "--tsc-khz") == 0) return print_tsc_khz();
#endif
    const char *port = argc > 1 ? argv[1] : "/dev/hvc0";
    for (int tries = 0; port_fd < 0; tries++) {
        port_fd = open(port, O_RDWR | O_CLOEXEC | O_NOCTTY);
        if (port_fd < 0) {
            if (tries > 500) { logmsg("no %s: %s", port, strerror(errno)); return 1; }
            usleep(10000);
        }
    }
    struct termios t;
    if (tcgetattr(port_fd, &t) == 0) { cfmakeraw(&t); tcsetattr(port_fd, TCSANOW, &t); }
    tcflush(port_fd, TCIOFLUSH); /* whatever arrived before raw mode was cooked: drop it */
    unlink(port); /* nothing else in the guest opens the host channel */
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGPIPE);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    sigdelset(&mask, SIGPIPE);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    setup_cgroup();
    caps_error = drop_caps() == 0 ? 0 : errno;
    if (caps_error) logmsg("cannot drop the commands' capabilities: %s", strerror(caps_error));
    listen_http = listen_on(HTTP_PROXY_PORT);
    listen_socks = listen_on(SOCKS_PROXY_PORT);

    static unsigned char rbuf[2 * (MAX_PAYLOAD + HDR)];
    size_t rlen = 0;
    send_frame(0, F_HELLO_OK, AGENT_VERSION, strlen(AGENT_VERSION));
    for (;;) {
        struct pollfd pf[4 + 3 * MAX_CHANNELS];
        struct { struct chan *c; int which; } who[4 + 3 * MAX_CHANNELS];
        int n = 0;
        pf[n] = (struct pollfd){port_fd, POLLIN, 0}; who[n].c = NULL; who[n++].which = 0;
        pf[n] = (struct pollfd){sfd, POLLIN, 0}; who[n].c = NULL; who[n++].which = 1;
        if (listen_http >= 0) { pf[n] = (struct pollfd){listen_http, POLLIN, 0}; who[n].c = NULL; who[n++].which = 2; }
        if (listen_socks >= 0) { pf[n] = (struct pollfd){listen_socks, POLLIN, 0}; who[n].c = NULL; who[n++].which = 3; }
        int timeout = -1;
        long now = now_ms();
        for (int i = 0; i < MAX_CHANNELS; i++) {
            struct chan *c = &chans[i];
            if (c->kind == K_EXEC) {
                if (c->exited && (c->out < 0 && c->err < 0)) { finish_exec(c); continue; }
                if (c->exited && now - c->exit_ms >= DRAIN_AFTER_EXIT_MS) { finish_exec(c); continue; }
                if (c->exited) {
                    int left = (int)(DRAIN_AFTER_EXIT_MS - (now - c->exit_ms));
                    if (timeout < 0 || left < timeout) timeout = left;
                }
                if (c->out >= 0) { pf[n] = (struct pollfd){c->out, POLLIN, 0}; who[n].c = c; who[n++].which = 'o'; }
                if (c->err >= 0) { pf[n] = (struct pollfd){c->err, POLLIN, 0}; who[n].c = c; who[n++].which = 'e'; }
                if (c->in >= 0 && !c->pty && c->pending.len) { pf[n] = (struct pollfd){c->in, POLLOUT, 0}; who[n].c = c; who[n++].which = 'i'; }
                if (c->pty && c->pending.len) { pf[n] = (struct pollfd){c->in, POLLOUT, 0}; who[n].c = c; who[n++].which = 'i'; }
            } else if (c->kind == K_NET) {
                short ev = c->sock_eof_sent ? 0 : POLLIN;
                if (c->pending.len) ev |= POLLOUT;
                pf[n] = (struct pollfd){c->sock, ev, 0}; who[n].c = c; who[n++].which = 's';
            }
        }
        if (poll(pf, (nfds_t)n, timeout) < 0) { if (errno == EINTR) continue; logmsg("poll: %s", strerror(errno)); return 1; }
        for (int i = 0; i < n; i++) {
            if (!pf[i].revents) continue;
            struct chan *c = who[i].c;
            if (!c) {
                if (who[i].which == 0) {
                    ssize_t r = read(port_fd, rbuf + rlen, sizeof rbuf - rlen);
                    if (r > 0) rlen += (size_t)r;
                    else if (r == 0 || (errno != EAGAIN && errno != EINTR)) usleep(1000); /* host away */
                    size_t off = 0;
                    while (rlen - off >= HDR) {
                        uint32_t plen = get32(rbuf + off);
                        if (plen > MAX_PAYLOAD) { logmsg("oversized frame %u", plen); rlen = off = 0; break; }
                        if (rlen - off < HDR + plen) break;
                        handle_frame(get32(rbuf + off + 4), rbuf[off + 8], rbuf + off + HDR, plen);
                        off += HDR + plen;
                    }
                    memmove(rbuf, rbuf + off, rlen - off);
                    rlen -= off;
                } else if (who[i].which == 1) {
                    struct signalfd_siginfo si;
                    while (read(sfd, &si, sizeof si) == sizeof si) {}
                    reap();
                } else {
                    accept_one(who[i].which == 2 ? listen_http : listen_socks, who[i].which - 2);
                }
                continue;
            }
            if (c->kind == K_FREE) continue;
            switch (who[i].which) {
            case 'o':
                if (!forward(c, c->out, F_STDOUT)) {
                    if (c->in == c->out) c->in = -1;
                    close(c->out); c->out = -1;
                }
                break;
            case 'e':
                if (!forward(c, c->err, F_STDERR)) { close(c->err); c->err = -1; }
                break;
            case 'i':
                flush_pending(c);
                break;
            case 's':
                if (pf[i].revents & POLLOUT) flush_pending(c);
                if (c->kind == K_NET && (pf[i].revents & (POLLIN | POLLHUP | POLLERR)) && !c->sock_eof_sent) {
                    if (!forward(c, c->sock, F_DATA)) {
                        c->sock_eof_sent = 1;
                        send_frame(c->id, F_EOF, NULL, 0);
                        if (c->in_eof == 2) free_chan(c);
                    }
                }
                break;
            }
        }
        reap();
    }
}
