/*
 * CPU holds: a worker answering a run of opens keeps to its CPU, and the task of each for the
 * installation of its fd (hold_here, hold_release), and the crowd check
 * (crowded) that turns holding off while tasks trap on several CPUs.
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

/*
 * Keep the task of an open on this CPU while its fd is installed. The kernel wakes the task for
 * SECCOMP_IOCTL_NOTIF_ADDFD with an ordinary wake-up, never on the waker's CPU (the sync wake-up
 * flag covers only the notification and SECCOMP_IOCTL_NOTIF_SEND), so the scheduler puts it on
 * another CPU whenever one is idle; and an idle vCPU here halts, so that wake-up costs ~20 us.
 * So for a run of opens this worker is allowed this CPU alone (it stays so for the run: see
 * PIN_IDLE_MS), and for the installation the task too: respond_fd installs the fd (the task
 * wakes here, installs it and waits again, in the kernel), gives the task its affinity back
 * (hold_release) and only then answers, with a sync wake-up that keeps it here. The task never
 * runs its own code with the pin, so nothing it starts or asks inherits or shows it, and no call
 * of its (clone, fork, exec, its own affinity calls) needs trapping for it: a trapped call that a
 * signal interrupts before a worker takes it fails with EINTR when the handler lacks SA_RESTART,
 * which a fork must never do. Each hold is the call's own (`saved`, on the worker's stack): two
 * workers hold two tasks without sharing anything. Returns whether the task is held here.
 */
bool hold_here(struct ccs *s, pid_t tid, int *cpu_out, cpu_set_t *saved) {
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
    /* A task already held to one CPU, or kept off this one, is left alone. */
    *cpu_out = cpu;
    return sched_getaffinity(tid, sizeof *saved, saved) == 0 && CPU_ISSET(cpu, saved) &&
           CPU_COUNT(saved) >= 2 && sched_setaffinity(tid, sizeof here, &here) == 0;
}

/* Give a task hold_here held to `cpu` its affinity back (before it is answered), unless
 * something else changed it meanwhile (the host, or its cpuset): that change is kept. Gone
 * meanwhile: nothing to give. */
void hold_release(struct ccs *s, pid_t tid, int cpu, const cpu_set_t *saved) {
    cpu_set_t now;
    if (sched_getaffinity(tid, sizeof now, &now) != 0 || CPU_COUNT(&now) != 1 ||
        !CPU_ISSET(cpu, &now))
        return;
    if (sched_setaffinity(tid, sizeof *saved, saved) == 0 || errno == ESRCH)
        return;
    cpu_set_t all; /* its cpuset changed meanwhile: every CPU it may use */
    memset(&all, 0xff, sizeof all);
    if (sched_setaffinity(tid, sizeof all, &all) < 0 && errno != ESRCH) {
        atomic_fetch_add(&s->errors, 1);
        report(s, KIND_ERROR, "openat", "", "", "cannot give the task its CPU affinity back");
    }
}
