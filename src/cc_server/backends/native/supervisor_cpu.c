/*
 * CPU holds: a task whose opens are answered is kept on the worker's CPU for a run of them
 * (hold_here) and gets its own affinity back when the run ends (pin_release), and the crowd
 * check (crowded) that turns holding off while tasks trap on several CPUs.
 */
#include "supervisor.h"

long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Whether calls of several tasks have overlapped in the last CROWD_MS (see worker()). */
bool crowded(struct ccs *s) { return now_ns() < atomic_load(&s->crowded_until); }

/* Give this worker its own affinity back (see hold_here). */
void worker_release_cpu(void) {
    if (worker_held_on >= 0) {
        sched_setaffinity(0, sizeof worker_cpus, &worker_cpus);
        worker_held_on = -1;
    }
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
void pin_release(struct ccs *s) {
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
 * ~20 us. So for a run of opens this worker is allowed this CPU alone (it stays so for the run:
 * see PIN_IDLE_MS), and for the answer the task too, unless it already is: respond_fd installs
 * the fd (the task wakes here, installs it and waits again, in the kernel), gives the task its
 * affinity back (pin_release) and only then answers, with a sync wake-up that keeps it here.
 * The task never runs its own code with the pin, so nothing it starts or asks inherits or shows
 * it, and no call of its (clone, fork, exec, its own affinity calls) needs trapping for it: a
 * trapped call that a signal interrupts before a worker takes it fails with EINTR when the
 * handler lacks SA_RESTART, which a fork must never do. Returns whether the task is held here.
 */
bool hold_here(struct ccs *s, pid_t tid, int pidfd) {
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
