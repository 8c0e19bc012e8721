/*
 * cc-create-launcher: the last step inside a bubblewrap sandbox before the command runs.
 *
 *   cc-create-launcher [--egress FD] [--filter FD --socket FD] -- COMMAND [ARGS...]
 *   cc-create-launcher [--egress FD] [--filter FD --socket FD] --serve FD
 *   cc-create-launcher --selftest
 *
 * --egress FD (the sandbox's network namespace has only `lo`): it listens on 127.0.0.1:3128 and
 * 127.0.0.1:1080 inside that namespace and sends both listening sockets over the Unix socket FD
 * to the server, whose session proxies then accept on them directly (a listening socket stays
 * in the namespace it was made in, whoever accepts). Nothing inside keeps them: the command
 * finds the ports taken and can neither accept the sandbox's own proxy traffic nor re-bind them.
 *
 * It installs the create-rule filter (classic BPF read from FD, built by the server with
 * libseccomp) with SECCOMP_FILTER_FLAG_NEW_LISTENER | SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV,
 * sends the listener over the Unix socket to the server's supervisor, closes the listener, the
 * socket and the filter fd, and only then runs COMMAND. The command never holds a listener, so
 * it can never answer its own notifications.
 *
 * bwrap's own --seccomp cannot return a listener, and libseccomp 2.5 cannot set
 * WAIT_KILLABLE_RECV (without it a signal during a create makes the create run twice), so the
 * filter is loaded here with seccomp(2) directly.
 *
 * When it runs as PID 1 of the sandbox (bwrap --as-pid-1), it stays as the namespace's reaper:
 * it forks COMMAND, reaps every orphan, and exits with COMMAND's status (128+N for signal N).
 * Every process in the sandbox therefore carries the filter; bwrap's own reaper, which did not,
 * is not there to be ptraced into creating names.
 *
 * --serve FD (as the sandbox's PID 1, bwrap --as-pid-1): the session's sandbox outlives one
 * command. The launcher reads exec requests from the SOCK_SEQPACKET socket FD (one request per
 * message, the command's stdin, stdout and stderr attached) and answers each with the command's
 * exit status. Each command gets a keeper process, a child subreaper: it forks the command in a
 * new session, and when the command exits it SIGKILLs whatever the command left behind (every
 * descendant, double-forked or setsid'd, is reparented to the keeper) before it reports. So a
 * command's leftovers die with it, as they did with a PID namespace per command. When the server
 * closes FD the launcher exits and the kernel kills everything left in the namespace.
 *
 * Any failure before the exec exits 125 with a message on stderr: the command never runs
 * without its filter.
 *
 * --selftest checks, in a forked child, that this kernel accepts NEW_LISTENER with
 * WAIT_KILLABLE_RECV (5.19+) and answers with SECCOMP_IOCTL_NOTIF_ADDFD | ADDFD_FLAG_SEND
 * (5.14+); it prints "ok" and exits 0, or prints what is missing and exits 1.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <linux/netlink.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <sys/un.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV
#define SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV (1UL << 5)
#endif
#ifndef SECCOMP_ADDFD_FLAG_SEND
#define SECCOMP_ADDFD_FLAG_SEND (1UL << 1)
#endif

#define EXIT_NOT_RUN 125
#define EGRESS_HTTP_PORT 3128 /* backends/egress_bridge.py HTTP_PROXY_PORT */
#define EGRESS_SOCKS_PORT 1080 /* backends/egress_bridge.py SOCKS_PROXY_PORT */
#define EGRESS_BACKLOG 128
#define USAGE                                                                              \
    "usage: cc-create-launcher [--egress FD] [--filter FD --socket FD] -- COMMAND [ARGS...]\n" \
    "       cc-create-launcher [--egress FD] [--filter FD --socket FD] --serve FD"

#define MAX_FILTER_INSNS 4096 /* BPF_MAXINSNS */
#define SELFTEST_TIMEOUT_MS 5000

static void die(const char *what) {
    fprintf(stderr, "cc-create-launcher: %s: %s; the command was not run\n", what,
            strerror(errno));
    _exit(EXIT_NOT_RUN);
}

static void die_msg(const char *what) {
    fprintf(stderr, "cc-create-launcher: %s; the command was not run\n", what);
    _exit(EXIT_NOT_RUN);
}

static int parse_fd(const char *text) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || *text == '\0' || *end != '\0' || v < 0 || v > 65535)
        die_msg("an fd argument is not a number");
    return (int)v;
}

static int install_filter(struct sock_fprog *prog) {
    return (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER,
                        SECCOMP_FILTER_FLAG_NEW_LISTENER | SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV,
                        prog);
}

/* One message of one byte, `tag`, carrying `n` descriptors. */
static int send_fds(int sock, char tag, const int *fds, size_t n) {
    struct iovec iov = {.iov_base = &tag, .iov_len = 1};
    union {
        struct cmsghdr hdr;
        char buf[CMSG_SPACE(3 * sizeof(int))];
    } control;
    if (n == 0 || n > 3)
        return -1;
    memset(&control, 0, sizeof control);
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = CMSG_SPACE(n * sizeof(int))};
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(n * sizeof(int));
    memcpy(CMSG_DATA(cmsg), fds, n * sizeof(int));
    ssize_t sent;
    do {
        sent = sendmsg(sock, &msg, MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    return sent == 1 ? 0 : -1;
}

static int send_fd(int sock, int fd) { return send_fds(sock, 'L', &fd, 1); }

/* A TCP listener on 127.0.0.1:port in this network namespace. */
static int listen_loopback(unsigned short port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        die("socket(AF_INET)");
    int one = 1;
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0)
        die("setsockopt(SO_REUSEADDR)");
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(port),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) < 0)
        die("cannot listen on the sandbox's loopback for the egress proxies (bind)");
    if (listen(fd, EGRESS_BACKLOG) < 0)
        die("listen");
    return fd;
}

/* The egress handoff: both listeners to the server in one message tagged 'E', then closed. */
static void hand_over_egress(int sock) {
    int fds[2] = {listen_loopback(EGRESS_HTTP_PORT), listen_loopback(EGRESS_SOCKS_PORT)};
    if (send_fds(sock, 'E', fds, 2) < 0)
        die("cannot hand the egress listeners to the server");
    if (close(fds[0]) < 0 || close(fds[1]) < 0 || close(sock) < 0)
        die("close");
}

static int recv_fd(int sock) {
    char byte;
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union {
        struct cmsghdr hdr;
        char buf[CMSG_SPACE(sizeof(int))];
    } control;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    if (recvmsg(sock, &msg, MSG_CMSG_CLOEXEC) != 1)
        return -1;
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    if (!cmsg || cmsg->cmsg_type != SCM_RIGHTS || cmsg->cmsg_len != CMSG_LEN(sizeof(int)))
        return -1;
    int fd;
    memcpy(&fd, CMSG_DATA(cmsg), sizeof fd);
    return fd;
}

/* The filter as the server exported it: whole BPF instructions, at most BPF_MAXINSNS. */
static struct sock_fprog read_filter(int fd) {
    struct stat st;
    if (fstat(fd, &st) < 0)
        die("cannot stat the filter fd");
    if (st.st_size <= 0 || st.st_size % sizeof(struct sock_filter) != 0 ||
        st.st_size > (off_t)(MAX_FILTER_INSNS * sizeof(struct sock_filter)))
        die_msg("the filter fd does not hold a BPF program");
    struct sock_filter *insns = malloc((size_t)st.st_size);
    if (!insns)
        die("out of memory");
    size_t got = 0;
    while (got < (size_t)st.st_size) {
        ssize_t n = pread(fd, (char *)insns + got, (size_t)st.st_size - got, (off_t)got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            die("cannot read the filter");
        got += (size_t)n;
    }
    struct sock_fprog prog = {.len = (unsigned short)(st.st_size / sizeof(struct sock_filter)),
                              .filter = insns};
    return prog;
}

/* PID 1: run COMMAND as a child, reap everything, exit with COMMAND's status. */
static int run_as_init(char **argv) {
    pid_t child = fork();
    if (child < 0)
        die("fork");
    if (child == 0) {
        execvp(argv[0], argv);
        int code = errno == ENOENT ? 127 : 126;
        fprintf(stderr, "cc-create-launcher: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(code);
    }
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, 0);
        if (pid < 0) {
            if (errno == EINTR)
                continue;
            _exit(EXIT_NOT_RUN); /* ECHILD before the command was reaped: cannot happen */
        }
        if (pid != child)
            continue;
        if (WIFEXITED(status))
            _exit(WEXITSTATUS(status));
        if (WIFSIGNALED(status))
            _exit(128 + WTERMSIG(status));
    }
}

/* --- serve: one sandbox per session, commands started on request ------------------------- */

#define SERVE_MAX_REQUEST (128 * 1024) /* runtime/pod.py MAX_REQUEST_BYTES */
#define SERVE_MAX_WORDS 16384
#define SERVE_MAX_RUNNING 1024
#define SERVE_HEADER 16 /* tag, 3 bytes of padding, id, argc, envc (little-endian u32) */
#define KEEPER_KILLED 0x100 /* in a 'D' code: the keeper itself was killed (runtime/session_sandbox.py) */

extern char **environ;

struct keeper {
    pid_t pid;
    uint32_t id;
};
static struct keeper keepers[SERVE_MAX_RUNNING];
static size_t n_keepers;

/* In a keeper: the command's pid while it can still be signalled, else 0. */
static volatile sig_atomic_t keeper_command;

static void on_sigchld(int sig) { (void)sig; }

/* A keeper forwards the signal the launcher queued (SIGUSR1 from PID 1, the signal number as
 * its value) to the command's process group. Anyone else's SIGUSR1 is ignored. */
static void keeper_on_usr1(int sig, siginfo_t *info, void *ctx) {
    (void)sig;
    (void)ctx;
    pid_t command = keeper_command;
    if (command <= 0 || info->si_code != SI_QUEUE || info->si_pid != 1)
        return;
    int signo = info->si_value.sival_int;
    if (signo <= 0 || signo >= NSIG)
        return;
    if (kill(-command, signo) < 0)
        kill(command, signo);
}

static void put_u32(char *at, uint32_t v) { memcpy(at, &v, sizeof v); }
static uint32_t get_u32(const char *at) {
    uint32_t v;
    memcpy(&v, at, sizeof v);
    return v;
}

/* Reply to the server: tag 'D', the request's id, the exit code (128+N for signal N). */
static void send_done(int ctl, uint32_t id, int code) {
    char msg[12] = {'D'};
    put_u32(msg + 4, id);
    put_u32(msg + 8, (uint32_t)code);
    ssize_t n;
    do {
        n = send(ctl, msg, sizeof msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
}

/* SIGKILL every descendant of `pid`, deepest last (a killed parent cannot fork again). */
static void kill_descendants(pid_t pid, int depth) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *tasks = opendir(path);
    if (!tasks)
        return;
    struct dirent *task;
    while ((task = readdir(tasks)) != NULL) {
        if (task->d_name[0] == '.')
            continue;
        char children_path[96];
        snprintf(children_path, sizeof children_path, "/proc/%d/task/%.16s/children", (int)pid,
                 task->d_name);
        FILE *f = fopen(children_path, "re");
        if (!f)
            continue;
        long child;
        while (fscanf(f, "%ld", &child) == 1) {
            kill((pid_t)child, SIGKILL);
            if (depth < 4096)
                kill_descendants((pid_t)child, depth + 1);
        }
        fclose(f);
    }
    closedir(tasks);
}

static int status_code(int status) {
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    if (WIFSIGNALED(status))
        return 128 + WTERMSIG(status);
    return EXIT_NOT_RUN;
}

/* The keeper of one command: a subreaper that runs it and, when it exits, kills every process
 * it left, then exits with the command's code. Before the command starts it tells the server
 * its pid ('P'), which the create-rule supervisor's refusals name. Never returns. */
static void keeper(int ctl, uint32_t id, const char *cwd, char **argv, char **envp,
                   const int fds[3], const sigset_t *unblocked) {
    char started[12] = {'P'};
    put_u32(started + 4, id);
    put_u32(started + 8, (uint32_t)getpid());
    ssize_t sent;
    do {
        sent = send(ctl, started, sizeof started, MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    close(ctl);
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0) {
        dprintf(fds[2], "cc-server: prctl(PR_SET_CHILD_SUBREAPER): %s; the command was not run\n",
                strerror(errno));
        _exit(EXIT_NOT_RUN);
    }
    struct sigaction usr1 = {.sa_sigaction = keeper_on_usr1, .sa_flags = SA_SIGINFO | SA_RESTART};
    sigemptyset(&usr1.sa_mask);
    sigaction(SIGUSR1, &usr1, NULL);
    sigset_t block_usr1; /* blocked since the launcher forked us */
    sigemptyset(&block_usr1);
    sigaddset(&block_usr1, SIGUSR1);
    pid_t command = fork();
    if (command < 0) {
        dprintf(fds[2], "cc-server: fork: %s; the command was not run\n", strerror(errno));
        _exit(EXIT_NOT_RUN);
    }
    if (command == 0) {
        struct sigaction dfl = {.sa_handler = SIG_DFL};
        sigaction(SIGUSR1, &dfl, NULL);
        sigaction(SIGCHLD, &dfl, NULL);
        sigprocmask(SIG_SETMASK, unblocked, NULL);
        setsid();
        /* fds[] are close-on-exec; dup2 clears that on 0, 1 and 2 (a dup of itself would not). */
        int high[3];
        for (int i = 0; i < 3; i++)
            if ((high[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 3)) < 0)
                _exit(EXIT_NOT_RUN);
        for (int i = 0; i < 3; i++)
            if (dup2(high[i], i) < 0)
                _exit(EXIT_NOT_RUN);
        if (chdir(cwd) < 0) {
            dprintf(2, "cc-server: cannot chdir to %s: %s; the command was not run\n", cwd,
                    strerror(errno));
            _exit(EXIT_NOT_RUN);
        }
        environ = envp; /* execvp searches the command's own PATH */
        execvp(argv[0], argv);
        int code = errno == ENOENT ? 127 : 126;
        dprintf(2, "cc-server: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(code);
    }
    for (int i = 0; i < 3; i++)
        close(fds[i]);
    keeper_command = command;
    sigprocmask(SIG_UNBLOCK, &block_usr1, NULL);
    int code = EXIT_NOT_RUN;
    for (;;) {
        siginfo_t info;
        memset(&info, 0, sizeof info);
        /* WNOWAIT: the command stays a zombie, so its pid cannot be reused by the time the
         * forwarding handler is switched off. */
        if (waitid(P_ALL, 0, &info, WEXITED | WNOWAIT) < 0) {
            if (errno == EINTR)
                continue;
            break; /* ECHILD: cannot happen before the command is reaped */
        }
        if (info.si_pid != command) {
            waitpid(info.si_pid, NULL, 0);
            continue;
        }
        sigprocmask(SIG_BLOCK, &block_usr1, NULL);
        keeper_command = 0;
        int status;
        while (waitpid(command, &status, 0) < 0 && errno == EINTR) {
        }
        code = status_code(status);
        break;
    }
    /* What the command left: every descendant is ours (we are their subreaper). Kill the whole
     * tree, reap, and repeat until none is left; a process forked during a walk is seen in the
     * next one. */
    for (;;) {
        kill_descendants(getpid(), 0);
        /* Reap every one already dead before walking again (one walk per reaped process would
         * be quadratic in what a fork loop leaves); wait only when none is dead yet. */
        pid_t reaped;
        int any = 0;
        while ((reaped = waitpid(-1, NULL, WNOHANG)) > 0)
            any = 1;
        if (reaped < 0 && errno == ECHILD)
            break;
        if (!any && waitpid(-1, NULL, 0) < 0 && errno == ECHILD)
            break;
    }
    _exit(code);
}

static void close_fds(const int *fds, size_t n) {
    for (size_t i = 0; i < n; i++)
        close(fds[i]);
}

/* One message from the server: 'X' (run a command) or 'S' (signal one). */
static void serve_request(int ctl, char *buf, const sigset_t *unblocked) {
    union {
        struct cmsghdr hdr;
        char buf[CMSG_SPACE(3 * sizeof(int))];
    } control;
    struct iovec iov = {.iov_base = buf, .iov_len = SERVE_MAX_REQUEST};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    ssize_t n = recvmsg(ctl, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0 && (errno == EINTR || errno == EAGAIN))
        return;
    if (n <= 0) /* the server is gone: so is this sandbox */
        _exit(0);
    int fds[3];
    size_t nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t j = 0; j < k; j++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + j * sizeof(int), sizeof fd);
            if (nfds < 3)
                fds[nfds++] = fd;
            else
                close(fd);
        }
    }
    if (n == 12 && buf[0] == 'S' && nfds == 0) {
        uint32_t id = get_u32(buf + 4);
        union sigval value = {.sival_int = (int)get_u32(buf + 8)};
        for (size_t i = 0; i < n_keepers; i++)
            if (keepers[i].id == id)
                sigqueue(keepers[i].pid, SIGUSR1, value);
        return;
    }
    if (n < SERVE_HEADER || buf[0] != 'X' || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ||
        nfds != 3) {
        if (n >= 8)
            send_done(ctl, get_u32(buf + 4), EXIT_NOT_RUN);
        close_fds(fds, nfds);
        return;
    }
    uint32_t id = get_u32(buf + 4), argc = get_u32(buf + 8), envc = get_u32(buf + 12);
    char *words[SERVE_MAX_WORDS + 3];
    size_t n_words = 0;
    char *at = buf + SERVE_HEADER, *end = buf + n;
    int ok = argc >= 1 && argc <= SERVE_MAX_WORDS && envc <= SERVE_MAX_WORDS - argc;
    for (uint32_t k = 0; ok && k < 1 + argc + envc; k++) {
        char *nul = memchr(at, '\0', (size_t)(end - at));
        if (!nul) {
            ok = 0;
            break;
        }
        words[n_words++] = at;
        at = nul + 1;
    }
    if (!ok || at != end || n_keepers >= SERVE_MAX_RUNNING) {
        dprintf(fds[2], "cc-server: %s; the command was not run\n",
                ok && at == end ? "too many commands are running in this sandbox"
                                : "malformed exec request");
        send_done(ctl, id, EXIT_NOT_RUN);
        close_fds(fds, nfds);
        return;
    }
    /* words: cwd, argv..., NULL, env..., NULL (the NULLs go after each list) */
    char *argv[SERVE_MAX_WORDS + 1], *envp[SERVE_MAX_WORDS + 1];
    memcpy(argv, words + 1, argc * sizeof(char *));
    argv[argc] = NULL;
    memcpy(envp, words + 1 + argc, envc * sizeof(char *));
    envp[envc] = NULL;
    pid_t pid = fork();
    if (pid == 0)
        keeper(ctl, id, words[0], argv, envp, fds, unblocked);
    close_fds(fds, nfds);
    if (pid < 0) {
        send_done(ctl, id, EXIT_NOT_RUN);
        return;
    }
    keepers[n_keepers++] = (struct keeper){.pid = pid, .id = id};
}

/* Reap exited keepers and report their commands' codes. Anything else that ends up here (an
 * orphan whose keeper was killed from inside) is reaped too. */
static void reap(int ctl) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (size_t i = 0; i < n_keepers; i++) {
            if (keepers[i].pid != pid)
                continue;
            /* A keeper that died of a signal (killed from inside) could not clean up after its
             * command: the server is told, and replaces this sandbox once it is idle. */
            send_done(ctl, keepers[i].id,
                      status_code(status) | (WIFSIGNALED(status) ? KEEPER_KILLED : 0));
            keepers[i] = keepers[--n_keepers];
            break;
        }
    }
}

static _Noreturn void serve(int ctl) {
    if (getpid() != 1)
        die_msg("--serve runs only as the sandbox's PID 1 (bwrap --as-pid-1)");
    /* Not ptraceable by the commands (same uid): they cannot read other commands' requests. */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0)
        die("prctl(PR_SET_DUMPABLE)");
    if (fcntl(ctl, F_SETFD, FD_CLOEXEC) < 0)
        die("fcntl(F_SETFD)");
    /* PID 1 gets SIGCHLD only with a handler installed; it stays blocked except inside ppoll.
     * SIGUSR1 stays blocked here, so a keeper starts with it blocked: one queued before the
     * keeper has its handler and its command stays pending instead of killing the keeper. */
    sigset_t chld, orig, waiting;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigaddset(&chld, SIGUSR1);
    if (sigprocmask(SIG_BLOCK, &chld, &orig) < 0)
        die("sigprocmask");
    struct sigaction on_chld = {.sa_handler = on_sigchld, .sa_flags = SA_NOCLDSTOP};
    sigemptyset(&on_chld.sa_mask);
    if (sigaction(SIGCHLD, &on_chld, NULL) < 0)
        die("sigaction(SIGCHLD)");
    waiting = orig;
    sigdelset(&waiting, SIGCHLD);
    sigaddset(&waiting, SIGUSR1);
    char *buf = malloc(SERVE_MAX_REQUEST);
    if (!buf)
        die("out of memory");
    for (;;) {
        reap(ctl);
        struct pollfd p = {.fd = ctl, .events = POLLIN};
        int r = ppoll(&p, 1, NULL, &waiting);
        if (r < 0 && errno != EINTR)
            die("ppoll");
        if (r > 0)
            serve_request(ctl, buf, &orig);
    }
}

/* --- selftest ------------------------------------------------------------------------------ */

#if defined(__x86_64__)
#define SELFTEST_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define SELFTEST_ARCH AUDIT_ARCH_AARCH64
#else
#error "cc-create-launcher: unsupported architecture"
#endif

static int selftest(void) {
    struct seccomp_notif_sizes sizes;
    if (syscall(SYS_seccomp, SECCOMP_GET_NOTIF_SIZES, 0, &sizes) < 0) {
        printf("seccomp user notification is not supported by this kernel (%s); "
               "it needs Linux 5.19 or newer\n", strerror(errno));
        return 1;
    }
    if (sizes.seccomp_notif != sizeof(struct seccomp_notif) ||
        sizes.seccomp_notif_resp != sizeof(struct seccomp_notif_resp)) {
        printf("the kernel's seccomp notification sizes (%u/%u) differ from this build's\n",
               sizes.seccomp_notif, sizes.seccomp_notif_resp);
        return 1;
    }
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
        printf("socketpair: %s\n", strerror(errno));
        return 1;
    }
    pid_t child = fork();
    if (child < 0) {
        printf("fork: %s\n", strerror(errno));
        return 1;
    }
    if (child == 0) {
        /* Trap getppid only; its notification is answered with an injected fd. */
        struct sock_filter insns[] = {
            BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
            BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SELFTEST_ARCH, 0, 3),
            BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
            BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_getppid, 0, 1),
            BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_USER_NOTIF),
            BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        };
        struct sock_fprog prog = {.len = sizeof insns / sizeof insns[0], .filter = insns};
        close(sv[0]);
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
            _exit(2);
        int listener = install_filter(&prog);
        if (listener < 0)
            _exit(errno == EINVAL ? 3 : 2);
        if (send_fd(sv[1], listener) < 0)
            _exit(2);
        close(listener);
        long fd = syscall(SYS_getppid);
        struct stat st;
        if (fd < 0 || fstat((int)fd, &st) < 0 || !S_ISCHR(st.st_mode))
            _exit(4);
        _exit(0);
    }
    close(sv[1]);
    int result = 1;
    int listener = -1;
    int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
    struct pollfd pfd = {.fd = sv[0], .events = POLLIN};
    if (devnull < 0) {
        printf("open /dev/null: %s\n", strerror(errno));
        goto out;
    }
    if (poll(&pfd, 1, SELFTEST_TIMEOUT_MS) != 1 || (listener = recv_fd(sv[0])) < 0)
        goto reap; /* the child failed to install the filter: its exit code says why */
    pfd.fd = listener;
    if (poll(&pfd, 1, SELFTEST_TIMEOUT_MS) != 1) {
        printf("no seccomp notification arrived within %d ms\n", SELFTEST_TIMEOUT_MS);
        goto out;
    }
    struct seccomp_notif notif;
    memset(&notif, 0, sizeof notif);
    if (ioctl(listener, SECCOMP_IOCTL_NOTIF_RECV, &notif) < 0) {
        printf("SECCOMP_IOCTL_NOTIF_RECV: %s\n", strerror(errno));
        goto out;
    }
    struct seccomp_notif_addfd addfd = {
        .id = notif.id, .flags = SECCOMP_ADDFD_FLAG_SEND, .srcfd = (unsigned)devnull};
    if (ioctl(listener, SECCOMP_IOCTL_NOTIF_ADDFD, &addfd) < 0) {
        printf("SECCOMP_IOCTL_NOTIF_ADDFD with ADDFD_FLAG_SEND failed (%s); it needs Linux "
               "5.14 or newer\n", strerror(errno));
        goto out;
    }
reap:;
    int status;
    while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
    }
    child = -1;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        result = 0;
        printf("ok\n");
    } else if (WIFEXITED(status) && WEXITSTATUS(status) == 3) {
        printf("the kernel refused SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV; it needs Linux "
               "5.19 or newer\n");
    } else if (WIFEXITED(status) && WEXITSTATUS(status) == 4) {
        printf("the injected fd did not arrive in the notifying process\n");
    } else {
        printf("installing a seccomp filter with a listener failed (status %d)\n", status);
    }
out:
    if (child > 0) {
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
    }
    return result;
}

/* --- the connector: connect(2) done for the supervisor, inside the sandbox ------------------ */

#define CONNECT_MAX_ADDR 128 /* sizeof(struct sockaddr_storage) */
#define CONNECT_MAX_RUNNING 64
#define CONNECT_TARGET 1u /* supervisor.c: the same values */
#define CONNECT_BIND 2u

/* One request (supervisor.c do_connect): connect the attached socket to `addr`, or, with a
 * second descriptor attached (an O_PATH of a Unix socket's file the supervisor has judged), to
 * that very inode through /proc/self/fd. The reply carries `id` and the errno (0: connected). */
struct connect_request {
    uint64_t id;
    uint32_t addrlen;
    uint32_t flags; /* CONNECT_TARGET: a target fd is attached; CONNECT_BIND: bind it */
    unsigned char addr[CONNECT_MAX_ADDR];
};
struct connect_reply {
    uint64_t id;
    int32_t err;
    uint32_t pad;
};
struct connect_job {
    int ctl;
    int sock;
    int target;
    struct connect_request req;
};

static atomic_int connects_running;

static void *connect_one(void *arg) {
    struct connect_job *job = arg;
    int rc;
    if (job->target >= 0) {
        struct sockaddr_un un = {.sun_family = AF_UNIX};
        snprintf(un.sun_path, sizeof un.sun_path, "/proc/self/fd/%d", job->target);
        rc = connect(job->sock, (struct sockaddr *)&un, sizeof un);
    } else if (job->req.flags & CONNECT_BIND) {
        rc = bind(job->sock, (struct sockaddr *)job->req.addr, job->req.addrlen);
    } else {
        rc = connect(job->sock, (struct sockaddr *)job->req.addr, job->req.addrlen);
    }
    struct connect_reply reply = {.id = job->req.id, .err = rc < 0 ? errno : 0};
    send(job->ctl, &reply, sizeof reply, MSG_NOSIGNAL);
    close(job->sock);
    if (job->target >= 0)
        close(job->target);
    free(job);
    atomic_fetch_sub(&connects_running, 1);
    return NULL;
}

/* The connector's loop: each request in a thread of its own (a blocking connect waits there,
 * never in the supervisor). It exits when the supervisor closes its end. */
static _Noreturn void connector(int ctl) {
    for (;;) {
        struct connect_job *job = calloc(1, sizeof *job);
        if (!job)
            _exit(1);
        union {
            struct cmsghdr hdr;
            char buf[CMSG_SPACE(2 * sizeof(int))];
        } control;
        struct iovec iov = {.iov_base = &job->req, .iov_len = sizeof job->req};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                             .msg_controllen = sizeof control.buf};
        ssize_t n = recvmsg(ctl, &msg, MSG_CMSG_CLOEXEC);
        if (n == 0)
            _exit(0);
        if (n < 0) {
            free(job);
            if (errno == EINTR)
                continue;
            _exit(1);
        }
        int fds[2] = {-1, -1}, nfds = 0;
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        if (c && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            nfds = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            memcpy(fds, CMSG_DATA(c), (size_t)(nfds > 2 ? 2 : nfds) * sizeof(int));
        }
        bool ok = n == (ssize_t)sizeof job->req && nfds == ((job->req.flags & CONNECT_TARGET) ? 2 : 1) &&
                  job->req.addrlen <= CONNECT_MAX_ADDR && job->req.flags != (CONNECT_TARGET | CONNECT_BIND);
        struct connect_reply reply = {.id = job->req.id, .err = EINVAL};
        if (ok && atomic_fetch_add(&connects_running, 1) >= CONNECT_MAX_RUNNING) {
            atomic_fetch_sub(&connects_running, 1);
            reply.err = EAGAIN;
            ok = false;
        }
        pthread_t t;
        if (ok) {
            job->ctl = ctl;
            job->sock = fds[0];
            job->target = (job->req.flags & CONNECT_TARGET) ? fds[1] : -1;
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            pthread_attr_setstacksize(&attr, 64 * 1024);
            int rc = pthread_create(&t, &attr, connect_one, job);
            pthread_attr_destroy(&attr);
            if (rc == 0)
                continue;
            atomic_fetch_sub(&connects_running, 1);
            reply.err = EAGAIN;
        }
        send(ctl, &reply, sizeof reply, MSG_NOSIGNAL);
        for (int i = 0; i < nfds && i < 2; i++)
            close(fds[i]);
        free(job);
    }
}

/* Start the connector, before the filter (its own connects are never trapped) and after every
 * capability is gone. It is not dumpable, so no command can ptrace it or read its memory, and it
 * holds nothing but its end of the socketpair. Its connects are made in the sandbox's
 * namespaces with the sandbox's credentials, so a listener sees a process of the sandbox.
 * Returns the supervisor's end; *diag gets a NETLINK_SOCK_DIAG socket of the sandbox's network
 * namespace (the supervisor lists the Unix sockets bound inside with it). */
static int start_connector(int *diag) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
        die("socketpair (connector)");
    *diag = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    if (*diag < 0)
        die("socket(NETLINK_SOCK_DIAG)");
    pid_t pid = fork();
    if (pid < 0)
        die("fork (connector)");
    if (pid == 0) {
        if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0 || prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
            _exit(1);
        int null = open("/dev/null", O_RDWR | O_CLOEXEC);
        if (dup2(sv[1], 3) < 0 || (null >= 0 && (dup2(null, 0) < 0 || dup2(null, 1) < 0 ||
                                                 dup2(null, 2) < 0)))
            _exit(1);
        if (syscall(SYS_close_range, 4, ~0U, 0) < 0)
            _exit(1);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        connector(3);
    }
    close(sv[1]);
    return sv[0];
}

/* The create-time rules: the filter installed with a listener, the listener sent to the server's
 * supervisor and closed. Any failure exits 125: the command never runs without its filter. */
static void install_create_rules(int filter_fd, int sock_fd) {
    struct sock_fprog prog = read_filter(filter_fd);
    /* A core file is a name the kernel creates without a syscall: none, ever. */
    struct rlimit no_core = {0, 0};
    if (setrlimit(RLIMIT_CORE, &no_core) < 0)
        die("setrlimit(RLIMIT_CORE)");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        die("prctl(PR_SET_NO_NEW_PRIVS)");
    /* No capabilities, now or after exec (no_new_privs keeps a root exec from regaining them):
     * bwrap --cap-drop ALL already did this; here it is checked, and the supervisor, which
     * has none either, can never be asked to act for a task more privileged than itself. */
    struct __user_cap_header_struct cap_hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct no_caps[2];
    memset(no_caps, 0, sizeof no_caps);
    if (syscall(SYS_capset, &cap_hdr, no_caps) < 0)
        die("capset");
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        die("prctl(PR_CAP_AMBIENT_CLEAR_ALL)");
    int diag;
    int conn = start_connector(&diag);
    int listener = install_filter(&prog);
    if (listener < 0)
        die("seccomp(SECCOMP_SET_MODE_FILTER, NEW_LISTENER|WAIT_KILLABLE_RECV)");
    free(prog.filter);
    int ends[3] = {listener, conn, diag};
    if (send_fds(sock_fd, 'L', ends, 3) < 0)
        die("cannot hand the listener to the supervisor");
    /* From here on nothing in the sandbox holds the listener. */
    if (close(listener) < 0 || close(conn) < 0 || close(diag) < 0 || close(sock_fd) < 0 ||
        close(filter_fd) < 0)
        die("close");
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--selftest") == 0)
        return selftest();
    int filter_fd = -1, sock_fd = -1, egress_fd = -1, serve_fd = -1, i = 1;
    for (; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0) {
            i++;
            break;
        }
        if (i + 1 >= argc)
            die_msg(USAGE);
        if (strcmp(argv[i], "--filter") == 0)
            filter_fd = parse_fd(argv[++i]);
        else if (strcmp(argv[i], "--socket") == 0)
            sock_fd = parse_fd(argv[++i]);
        else if (strcmp(argv[i], "--egress") == 0)
            egress_fd = parse_fd(argv[++i]);
        else if (strcmp(argv[i], "--serve") == 0)
            serve_fd = parse_fd(argv[++i]);
        else
            die_msg("unknown option");
    }
    if (serve_fd >= 0) {
        if ((filter_fd < 0) != (sock_fd < 0) || i < argc)
            die_msg(USAGE);
        if (egress_fd >= 0)
            hand_over_egress(egress_fd);
        if (filter_fd >= 0) /* the launcher, and so every command, carries the filter */
            install_create_rules(filter_fd, sock_fd);
        serve(serve_fd);
    }
    if ((filter_fd < 0) != (sock_fd < 0) || (filter_fd < 0 && egress_fd < 0) || i >= argc)
        die_msg(USAGE);
    /* Before the filter: the listeners are the launcher's own, made before any command runs,
     * so the command's first connection finds them listening. */
    if (egress_fd >= 0)
        hand_over_egress(egress_fd);
    if (filter_fd >= 0)
        install_create_rules(filter_fd, sock_fd);
    if (getpid() == 1)
        return run_as_init(&argv[i]);
    execvp(argv[i], &argv[i]);
    int code = errno == ENOENT ? 127 : 126;
    fprintf(stderr, "cc-create-launcher: cannot run %s: %s\n", argv[i], strerror(errno));
    return code;
}
