/*
 * bind and connect: a socket bound in the task's view, and a connect made by the launcher's
 * connector inside the sandbox only to a pathname socket bound inside it (do_connect, conn_main).
 */
#include "supervisor.h"

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
void *conn_main(void *arg) {
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
void do_connect(struct req *q, int sockfd, uint64_t addr_ptr, uint64_t addrlen) {
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

void do_bind(struct req *q, int sockfd, uint64_t addr_ptr, uint64_t addrlen) {
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
