"""The supervisor's fast paths against the real kernel, with the workers a sandbox runs.

An open is answered with the task held on the worker's CPU for a run of opens: no call may ever
show or pass on that affinity (a new thread, fork, vfork or the task's own affinity calls), and
it must be given back when the run ends. An open whose path has no symlink and no ".." above its
start is done in one openat2: it must agree with the full walk on every result, errno and
report.
"""

from __future__ import annotations

import os
import pathlib
import textwrap
import time

import pytest
from supervisor_kit import PYTHON, Launch, py, sh

from cc_server.backends.supervisor import WORKERS

pytestmark = pytest.mark.integration

# Every test runs the workers a sandbox runs: WORKERS, the second on standby until calls of two
# tasks overlap.


def _names(root: pathlib.Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


AFFINITY_CHECK = textwrap.dedent(
    """
    import os, sys
    want = set(map(int, sys.argv[1].split(",")))
    os.sched_setaffinity(0, want)
    bad = 0
    for i in range(300):
        os.close(os.open(f"f{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        bad += os.sched_getaffinity(0) != want
        if i % 30 == 0:  # a child forked right after the create: its mask is inherited
            pid = os.fork()
            if pid == 0:
                os._exit(0 if os.sched_getaffinity(0) == want else 1)
            bad += os.waitpid(pid, 0)[1] != 0
    print(bad)
    """
)


# The task's own mask: every CPU, one, and (where it is a proper subset) two.
CPU_SUBSETS = {"all": None, "one": 1, **({"two": 2} if len(os.sched_getaffinity(0)) > 2 else {})}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs to hold a task to one")
@pytest.mark.parametrize("cpus", sorted(CPU_SUBSETS))
def test_a_create_leaves_the_tasks_affinity_as_it_was(tmp_path: pathlib.Path, cpus: str) -> None:
    mine = sorted(os.sched_getaffinity(0))
    want = mine[: CPU_SUBSETS[cpus]]
    (tmp_path / "check.py").write_text(AFFINITY_CHECK)
    launch = Launch(
        [PYTHON, "check.py", ",".join(map(str, want))],
        str(tmp_path),
        workers=WORKERS,
    )
    assert launch.supervisor is not None
    assert launch.proc.wait(timeout=60) == 0
    stats = launch.supervisor.stats()
    result = launch.finish()
    assert result.stdout.split() == ["0"], result
    assert result.faults == [] and result.refused == []
    if cpus == "one":  # a task already held to one CPU is left alone
        assert stats.replies_here == 0, stats
    else:
        assert stats.replies_here > 0, stats  # the path under test was taken


PIN_INHERIT_CHECK = textwrap.dedent(
    """
    import os, subprocess, threading, time

    def allowed():  # read with no trapped call: /proc shows the mask as it is
        with open("/proc/thread-self/status") as f:
            return next(l.split()[1] for l in f if l.startswith("Cpus_allowed_list:"))

    def in_thread():
        seen = []
        t = threading.Thread(target=lambda: seen.append(allowed()))
        t.start()
        t.join()
        return seen[0]

    def in_fork():
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, allowed().encode())
            os._exit(0)
        os.close(w)
        got = os.read(r, 100).decode()
        os.close(r)
        os.waitpid(pid, 0)
        return got

    def in_spawn():  # subprocess uses vfork here
        out = subprocess.run(["grep", "Cpus_allowed_list", "/proc/self/status"],
                             capture_output=True, text=True, check=True).stdout
        return out.split()[1]

    def after_a_pause():  # the hold ends 1 ms after the last call; a loaded machine may be slow
        deadline = time.monotonic() + 2
        while allowed() != want and time.monotonic() < deadline:
            time.sleep(0.01)
        return allowed()

    want = allowed()
    checks = {"thread": in_thread, "fork": in_fork, "spawn": in_spawn, "pause": after_a_pause}
    bad = dict.fromkeys(checks, 0)
    for i in range(60):
        name = list(checks)[i % len(checks)]
        os.close(os.open(f"f{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        bad[name] += checks[name]() != want
    print(" ".join(f"{k}={v}" for k, v in bad.items()))
    """
)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs to hold a task to one")
def test_a_held_task_passes_on_no_pin_and_gets_its_affinity_back(tmp_path: pathlib.Path) -> None:
    # Right after an open the task may still be held to the worker's CPU: a thread, a fork or a
    # vfork'd child it starts next must not inherit that, and a pause must end it.
    (tmp_path / "check.py").write_text(PIN_INHERIT_CHECK)
    launch = Launch([PYTHON, "check.py"], str(tmp_path), workers=WORKERS)
    assert launch.supervisor is not None
    assert launch.proc.wait(timeout=60) == 0
    stats = launch.supervisor.stats()
    result = launch.finish()
    assert result.stdout.split() == ["thread=0", "fork=0", "spawn=0", "pause=0"], result
    assert result.faults == [] and result.refused == []
    assert stats.replies_here > 0, stats  # tasks were held


HELD_UNTIL_STOP = textwrap.dedent(
    """
    import os, time
    n = 0
    while not os.path.exists("stop"):  # opens back to back: the hold lasts
        os.close(os.open(f"f{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        n += 1
    time.sleep(0.5)  # the hold ends
    with open("/proc/self/status") as f:
        print(next(l.split()[1] for l in f if l.startswith("Cpus_allowed_list:")))
    """
)


def _allowed(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list:"))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs to hold a task to one")
def test_an_affinity_set_from_outside_during_a_hold_is_kept(tmp_path: pathlib.Path) -> None:
    # The host moves the task while the supervisor holds it: ending the hold must not undo that.
    (tmp_path / "check.py").write_text(HELD_UNTIL_STOP)
    launch = Launch([PYTHON, "check.py"], str(tmp_path), workers=WORKERS)
    try:
        deadline = time.monotonic() + 10
        # Held (one CPU) only while an answer is given: seen in one read of a few.
        while not (seen := _allowed(launch.proc.pid)).isdigit():
            assert time.monotonic() < deadline, "the task was never held"
        held = int(seen)
        elsewhere = next(c for c in sorted(os.sched_getaffinity(0)) if c != held)
        os.sched_setaffinity(launch.proc.pid, {elsewhere})
    finally:
        (tmp_path / "stop").touch()
    result = launch.finish()
    assert result.returncode == 0 and result.faults == [], result
    assert result.stdout.split() == [str(elsewhere)], result


def test_without_reply_here_every_open_still_gets_its_fd(tmp_path: pathlib.Path) -> None:
    script = "for i in 1 2 3; do echo $i > f$i; done"
    launch = Launch(["/bin/sh", "-c", script], str(tmp_path), workers=WORKERS, reply_here=False)
    assert launch.supervisor is not None
    assert launch.proc.wait(timeout=30) == 0
    stats = launch.supervisor.stats()
    result = launch.finish()
    assert result.returncode == 0 and result.faults == [], result
    assert (tmp_path / "f3").read_text() == "3\n"
    assert stats.replies_here == 0 and stats.handled >= 3, stats


ONE_CALL_CASES = textwrap.dedent(
    """
    import errno, os
    os.umask(0o022)
    os.mkdir("sub"); os.mkdir("sub/deep"); os.mkdir("real")
    os.symlink("real", "link")
    open("file", "w").close()
    os.mkfifo("fifo")
    here = os.getcwd()
    cases = {
        "plain": lambda: os.open("a", os.O_CREAT | os.O_WRONLY),
        "nested": lambda: os.open("sub/deep/b", os.O_CREAT | os.O_EXCL | os.O_WRONLY),
        "dotdot_inside": lambda: os.open("sub/../c", os.O_CREAT | os.O_WRONLY),
        "dotdot_above": lambda: os.open("../up", os.O_CREAT | os.O_WRONLY,
                                        dir_fd=os.open("sub", os.O_RDONLY)),
        "absolute": lambda: os.open(here + "/sub/d", os.O_CREAT | os.O_WRONLY),
        "symlinked_parent": lambda: os.open("link/e", os.O_CREAT | os.O_WRONLY),
        "existing": lambda: os.open("file", os.O_CREAT | os.O_WRONLY | os.O_APPEND),
        "fifo_nonblock_no_reader": lambda: os.open("fifo", os.O_CREAT | os.O_WRONLY
                                                   | os.O_NONBLOCK),
        "missing_parent_pem": lambda: os.open("nope/x.pem", os.O_CREAT | os.O_EXCL
                                              | os.O_WRONLY),
        "through_file_pem": lambda: os.open("file/x.pem", os.O_CREAT | os.O_WRONLY),
        "pem": lambda: os.open("sub/y.pem", os.O_CREAT | os.O_WRONLY),
        "dirfd_file": lambda: os.open("g", os.O_CREAT | os.O_WRONLY,
                                      dir_fd=os.open("file", os.O_RDONLY)),
        "dirfd_bad": lambda: os.open("g", os.O_CREAT | os.O_WRONLY, dir_fd=998),
        "type_bits_in_mode": lambda: os.open("h", os.O_CREAT | os.O_WRONLY, 0o100666),
    }
    for name, call in cases.items():
        try:
            fd = call()
            flags = os.get_blocking(fd)
            print(name, "ok", "blocking" if flags else "nonblocking")
        except OSError as e:
            print(name, errno.errorcode[e.errno], "-")
    """
)


def test_one_call_opens_agree_with_the_walk(tmp_path: pathlib.Path) -> None:
    (tmp_path / "w").mkdir()
    result = py(ONE_CALL_CASES, str(tmp_path / "w"), workers=WORKERS)
    assert result.returncode == 0, result
    got = {line.split()[0]: tuple(line.split()[1:]) for line in result.stdout.splitlines()}
    assert got == {
        "plain": ("ok", "blocking"),
        "nested": ("ok", "blocking"),
        "dotdot_inside": ("ok", "blocking"),
        "dotdot_above": ("ok", "blocking"),
        "absolute": ("ok", "blocking"),
        "symlinked_parent": ("ok", "blocking"),
        "existing": ("ok", "blocking"),
        "fifo_nonblock_no_reader": ("ENXIO", "-"),
        "missing_parent_pem": ("ENOENT", "-"),
        "through_file_pem": ("ENOTDIR", "-"),
        "pem": ("EACCES", "-"),
        "dirfd_file": ("ENOTDIR", "-"),
        "dirfd_bad": ("EBADF", "-"),
        "type_bits_in_mode": ("ok", "blocking"),  # open(2) ignores them; openat2 would not
    }, result
    assert [(r.name, r.target) for r in result.refused] == [("y.pem", "sub/y.pem")], result
    assert result.faults == []
    names = _names(tmp_path)
    assert {"w/up", "w/a", "w/sub/deep/b", "w/c", "w/sub/d", "w/real/e", "w/h"} <= names
    assert not any(n.endswith(".pem") for n in names), names
    assert (tmp_path / "w" / "h").stat().st_mode & 0o7777 == 0o644


DIRFD_REUSE = textwrap.dedent(
    """
    import os
    for d in ("one", "two", "one/in"):
        os.mkdir(d)
    fd = os.open("one", os.O_RDONLY | os.O_DIRECTORY)
    os.close(os.open("a", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(os.open("b", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    two = os.open("two", os.O_RDONLY | os.O_DIRECTORY)
    os.dup2(two, fd)  # the same fd number, another directory
    os.close(os.open("c", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.rename("one", "moved")  # the fd, not the path, is where a lookup starts
    os.dup2(os.open("moved/in", os.O_RDONLY | os.O_DIRECTORY), fd)
    os.close(os.open("d", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(fd)
    try:
        os.open("e", os.O_CREAT | os.O_WRONLY, dir_fd=fd)
    except OSError as e:
        print(e.errno)
    """
)


def test_a_dirfd_is_looked_up_again_when_its_number_is_reused(tmp_path: pathlib.Path) -> None:
    result = py(DIRFD_REUSE, str(tmp_path), workers=WORKERS)
    assert result.returncode == 0, result
    assert result.stdout.split() == ["9"]  # EBADF
    assert _names(tmp_path) == {
        "moved", "moved/a", "moved/b", "moved/in", "moved/in/d", "two", "two/c",
    }  # fmt: skip


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs to hold a task to one")
def test_tasks_creating_at_once_keep_their_affinity_and_every_file(tmp_path: pathlib.Path) -> None:
    # Two tasks' calls overlap: the second worker joins and nobody is held to a CPU.
    want = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    (tmp_path / "check.py").write_text(AFFINITY_CHECK)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    script = f"cd a && {PYTHON} ../check.py {want} & cd b && {PYTHON} ../check.py {want}; wait"
    result = sh(script, str(tmp_path), workers=WORKERS)
    assert result.returncode == 0, result
    assert result.stdout.split() == ["0", "0"], result
    assert result.faults == [] and result.refused == []
    assert len(list((tmp_path / "a").iterdir())) == len(list((tmp_path / "b").iterdir())) == 300


FORK_UNDER_SIGNALS = textwrap.dedent(
    """
    import os, signal
    # A SIGCHLD handler without SA_RESTART (Python's default, dash's too): a trapped call that
    # such a signal interrupts before a worker takes it fails with EINTR, which a fork never may.
    signal.signal(signal.SIGCHLD, lambda *a: None)
    failed = 0
    for i in range(200):
        if i % 20 == 0:
            os.close(os.open(f"f{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # held here
        try:
            pid = os.fork()
        except InterruptedError:
            failed += 1
            continue
        if pid == 0:
            os._exit(0)
        while True:
            try:
                os.waitpid(pid, 0)
                break
            except InterruptedError:
                pass
    print(failed)
    """
)


def test_forks_and_affinity_calls_never_reach_the_supervisor(tmp_path: pathlib.Path) -> None:
    # A held task never runs its own code with the pin, so clone, fork, vfork and the affinity
    # calls are not trapped: each would be a notification a signal could interrupt (EINTR).
    (tmp_path / "check.py").write_text(FORK_UNDER_SIGNALS)
    launch = Launch([PYTHON, "check.py"], str(tmp_path), workers=WORKERS)
    assert launch.supervisor is not None
    assert launch.proc.wait(timeout=60) == 0
    stats = launch.supervisor.stats()
    result = launch.finish()
    assert result.stdout.split() == ["0"], result
    # The ten creates, and no more than the few calls the interpreter's start makes.
    assert 10 <= stats.handled < 40, stats
    assert stats.replies_here > 0, stats
