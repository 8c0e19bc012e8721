/*
 * Records on the report pipe (report_keeper, report_error, refuse) and the answers to the kernel
 * (respond, respond_continue, respond_fd, id_valid).
 */
#include "supervisor.h"

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

void report(struct ccs *s, char kind, const char *sysname, const char *target,
            const char *name, const char *detail) {
    report_keeper(s, kind, sysname, target, name, detail, 0, NULL, NULL);
}

void report_error(struct req *q, const char *target, const char *fmt, ...) {
    char detail[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    atomic_fetch_add(&q->s->errors, 1);
    report(q->s, KIND_ERROR, q->sysname, target, "", detail);
}

/* Let the call run as it is: only for calls that create no name (state_change, pin points). */
void respond_continue(struct ccs *s, uint64_t id) {
    struct seccomp_notif_resp resp;
    memset(&resp, 0, sizeof resp);
    resp.id = id;
    resp.flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
    ioctl(s->listener, SECCOMP_IOCTL_NOTIF_SEND, &resp);
}

void respond(struct ccs *s, uint64_t id, int64_t val, int err) {
    struct seccomp_notif_resp resp;
    memset(&resp, 0, sizeof resp);
    resp.id = id;
    resp.val = err ? 0 : val;
    resp.error = err ? -err : 0;
    /* ENOENT: the task died or was killed meanwhile; nothing waits for the answer. */
    ioctl(s->listener, SECCOMP_IOCTL_NOTIF_SEND, &resp);
}

/* Hand `fd` to the task as the syscall's result (its thread `tid`, or 0 for no hold: see
 * hold_here); our copy is closed. */
void respond_fd(struct ccs *s, uint64_t id, pid_t tid, int fd, bool cloexec) {
    cpu_set_t saved;
    int cpu = -1;
    bool held = tid > 0 && hold_here(s, tid, &cpu, &saved);
    struct seccomp_notif_addfd addfd;
    memset(&addfd, 0, sizeof addfd);
    addfd.id = id;
    /* Held: the fd is installed first (the task wakes here, installs it and waits again, in
     * the kernel), then the task gets its affinity back, then the answer (a sync wake-up, on
     * this CPU). It never runs its own code with the pin. */
    addfd.flags = held ? 0 : SECCOMP_ADDFD_FLAG_SEND;
    addfd.srcfd = (uint32_t)fd;
    addfd.newfd_flags = cloexec ? O_CLOEXEC : 0;
    int r = ioctl(s->listener, SECCOMP_IOCTL_NOTIF_ADDFD, &addfd);
    int err = errno;
    if (held)
        hold_release(s, tid, cpu, &saved);
    close(fd);
    if (r >= 0 && held) {
        atomic_fetch_add(&s->replies_here, 1);
        respond(s, id, r, 0);
    } else if (r < 0 && err != ENOENT && err != ESRCH) { /* ENOENT, ESRCH: gone, nobody waits */
        respond(s, id, 0, err);                          /* e.g. EMFILE: the task's fd limit */
    }
}

bool id_valid(struct ccs *s, uint64_t id) {
    return ioctl(s->listener, SECCOMP_IOCTL_NOTIF_ID_VALID, &id) == 0;
}

/* One refusal record, the call answered by the caller. */
void report_refusal(struct req *q, const char *target, const char *name,
                    const char *rule, const char *action) {
    atomic_fetch_add(&q->s->refused, 1);
    report_keeper(q->s, KIND_REFUSED, q->sysname, target, name, rule,
                  keeper_of(q->s, (pid_t)q->n->pid), action, judged);
}

/* `q->action` names the verb (file-write-create unless the call set another); the resolved
 * target is the path the last check judged. */
void refuse(struct req *q, const char *target, const char *name, const char *glob) {
    atomic_fetch_add(&q->s->refused, 1);
    report_keeper(q->s, KIND_REFUSED, q->sysname, target, name, glob,
                  keeper_of(q->s, (pid_t)q->n->pid),
                  q->action ? q->action : "file-write-create", judged);
    respond(q->s, q->n->id, 0, EACCES);
}

/* refuse(), after judging the path of `name` in `dir_fd` (a name glob's refusal has not). */
void refuse_at(struct req *q, const char *target, int dir_fd, const char *name,
               const char *glob) {
    judge_path(dir_fd, name);
    refuse(q, target, name, glob);
}
