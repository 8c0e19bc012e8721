"""The runner: the only code in cc-server that spawns a sandboxed or host command.

It materialises a LaunchPlan's fd payloads in sealed memfds (nothing on disk), starts the argv with
exactly the plan's environment in a new session, and closes every fd it opened, whatever happens.
Three entry points: `start` (asyncio, for the runtime's event streams), `start_pty` (asyncio, a
shell on a fresh pseudo-terminal for the server-hosted terminal) and `run_attached` (blocking, stdio
inherited, for the CLI; it does not import asyncio, which the per-run CLI would pay for).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import stat
import struct
import subprocess
import termios
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import IO, TYPE_CHECKING, Any

from cc_server.backends.plan import FdArg, InheritedFd, LaunchPlan, PathFd
from cc_server.errors import EnforcementFailed

if TYPE_CHECKING:
    import asyncio

__all__ = ["PtyProcess", "run_attached", "set_window_size", "start", "start_pty"]

_Stream = int | IO[Any] | None
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _sealed_memfd(arg: FdArg) -> int:
    fd = os.memfd_create(f"cc-{arg.name}", os.MFD_ALLOW_SEALING)  # inheritable: not CLOEXEC
    try:
        os.write(fd, arg.data)
        os.lseek(fd, 0, os.SEEK_SET)
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _opened_without_symlinks(arg: PathFd) -> int:
    """An `O_PATH` fd of `arg.path` (absolute), each component opened `O_NOFOLLOW` from the one
    before, so no symlink is followed on the way or at its end.

    Raises:
        EnforcementFailed: a component is a symlink now, or is gone.
    """
    parts = [p for p in arg.path.split("/") if p]
    if not arg.path.startswith("/") or any(p in (".", "..") for p in parts):
        raise EnforcementFailed(
            f"the bind source {arg.path!r} is not a plain absolute path; the command was not run",
            fix="this is a planner bug: report it",
        )
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            try:
                step = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                raise EnforcementFailed(
                    f"the bind source {arg.path} cannot be opened ({part}: "
                    f"{exc.strerror or exc}) since the policy was made; the command was not run",
                    fix="put the directory back, or bind another one",
                ) from exc
            os.close(fd)
            fd = step
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                raise EnforcementFailed(
                    f"the bind source {arg.path} has a symlink on its path ({part}) since the "
                    "policy was made; a bind is never made through one, so the command was not run",
                    fix="bind the directory it leads to, or put the directory back",
                )
        return fd
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def _materialised(
    plan: LaunchPlan, inherited: Mapping[str, int] | None = None
) -> Iterator[tuple[list[str], tuple[int, ...]]]:
    fds: list[int] = []
    passed: list[int] = []  # the caller's fds: passed on, closed by the caller
    try:
        argv: list[str] = []
        for word in plan.argv:
            if isinstance(word, FdArg):
                fds.append(_sealed_memfd(word))
                argv.append(str(fds[-1]))
            elif isinstance(word, PathFd):
                fds.append(_opened_without_symlinks(word))
                argv.append(str(fds[-1]))
            elif isinstance(word, InheritedFd):
                if inherited is None or word.name not in inherited:
                    raise EnforcementFailed(
                        f"the plan needs the fd {word.name!r}, which this way of starting it "
                        "cannot provide; the command was not run",
                        fix="run it through the library's handle.exec (cc-server run --events "
                        "json or --timeout), which supervises it",
                    )
                passed.append(inherited[word.name])
                argv.append(str(passed[-1]))
            else:
                argv.append(word)
        yield argv, (*fds, *passed)
    except OSError as exc:
        raise EnforcementFailed(
            f"could not start {plan.argv[0]!s}: {exc.strerror or exc}",
            fix="check that the program exists and the working directory is valid",
        ) from exc
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


async def start(
    plan: LaunchPlan,
    *,
    stdin: _Stream = None,
    stdout: _Stream = None,
    stderr: _Stream = None,
    fds: Mapping[str, int] | None = None,
) -> tuple[asyncio.subprocess.Process, asyncio.SubprocessTransport]:
    """Spawn the plan. `None` streams are inherited from the server process.

    `fds` fills the plan's InheritedFd slots by name (the create-rule socket); the caller keeps
    and closes them.

    The child starts in a new session so its whole host-side process group can be signalled.
    Returns the process and its transport: the caller closes the transport when done with it,
    since a descendant holding a pipe would otherwise keep it (and its fds) open.

    Raises:
        EnforcementFailed: the program could not be started (missing binary, bad cwd, fd setup);
            the command has not run.
    """
    with _materialised(plan, fds) as (argv, pass_fds):
        return await _spawn(plan, argv, pass_fds, stdin=stdin, stdout=stdout, stderr=stderr)
    raise AssertionError("unreachable")  # pragma: no cover (the context manager re-raises)


async def _spawn(
    plan: LaunchPlan,
    argv: list[str],
    pass_fds: Sequence[int],
    *,
    stdin: _Stream,
    stdout: _Stream,
    stderr: _Stream,
    preexec_fn: Callable[[], None] | None = None,
) -> tuple[asyncio.subprocess.Process, asyncio.SubprocessTransport]:
    """What asyncio.create_subprocess_exec does, keeping the transport: the plan's exact
    environment and cwd, in a new session, child exits watched with a pidfd."""
    import asyncio  # lazy imports (see the module docstring)

    from cc_server.backends.child_watch import use_pidfd_child_watcher

    loop = asyncio.get_running_loop()
    use_pidfd_child_watcher()
    transport, protocol = await loop.subprocess_exec(
        lambda: asyncio.subprocess.SubprocessStreamProtocol(limit=2**16, loop=loop),
        *argv,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        env=dict(plan.env),
        cwd=plan.cwd,
        pass_fds=pass_fds,
        start_new_session=True,
        preexec_fn=preexec_fn,
    )
    return asyncio.subprocess.Process(transport, protocol, loop), transport


@dataclass(frozen=True, slots=True, kw_only=True)
class PtyProcess:
    """A command on its own pseudo-terminal: the process and the master side, which the caller
    owns (reads output from it, writes input to it, closes it)."""

    process: asyncio.subprocess.Process
    transport: asyncio.SubprocessTransport
    master_fd: int


def set_window_size(fd: int, rows: int, cols: int) -> None:
    """Set a terminal's window size (TIOCSWINSZ); on a PTY master the kernel then sends SIGWINCH
    to the terminal's foreground process group.

    Raises:
        OSError: `fd` is not a terminal.
    """
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _take_controlling_terminal() -> None:  # pragma: no cover (runs in the child, before exec)
    # Runs between fork and exec, after setsid (start_new_session): stdin is the PTY slave, and a
    # session leader acquires it as its controlling terminal. One ioctl, nothing that could wait
    # on a lock another thread of the server held at fork time.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


async def start_pty(plan: LaunchPlan, rows: int, cols: int) -> PtyProcess:
    """Spawn the plan on a new pseudo-terminal of `rows` x `cols`.

    The child's stdin, stdout and stderr are the PTY slave, and it starts in a new session whose
    controlling terminal is that slave (setsid, then TIOCSCTTY), so job control, ^C and SIGWINCH
    work. The slave is closed in this process before returning; the caller owns `master_fd`
    (non-blocking) and must close it, and the transport, when done.

    Raises:
        EnforcementFailed: the PTY could not be opened or the program could not be started; the
            command has not run.
    """
    try:
        master, slave = os.openpty()  # both close-on-exec; Popen dups the slave onto 0, 1, 2
    except OSError as exc:
        raise EnforcementFailed(f"could not open a pseudo-terminal: {exc}") from exc
    try:
        set_window_size(master, rows, cols)
        os.set_blocking(master, False)
        with _materialised(plan) as (argv, fds):
            try:
                process, transport = await _spawn(
                    plan, argv, fds, stdin=slave, stdout=slave, stderr=slave,
                    preexec_fn=_take_controlling_terminal,
                )
            except subprocess.SubprocessError as exc:  # the preexec step failed in the child
                raise EnforcementFailed(
                    f"could not give {argv[0]} its terminal: {exc}",
                    fix="check that this host supports pseudo-terminals (/dev/pts)",
                ) from exc
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return PtyProcess(process=process, transport=transport, master_fd=master)


def run_attached(plan: LaunchPlan) -> int:
    """Run the plan with the caller's stdio (a TTY passes through) and return its exit code.

    SIGINT, SIGTERM and SIGHUP received meanwhile are forwarded to the command's process group;
    for bubblewrap that ends the sandbox's PID 1 and with it every process in the sandbox.
    A command killed by signal N returns 128+N.

    Raises:
        EnforcementFailed: the program could not be started; the command has not run.
    """
    with _materialised(plan) as (argv, fds):
        proc = subprocess.Popen(  # argv comes from a backend plan, never a shell
            argv, env=dict(plan.env), cwd=plan.cwd, pass_fds=fds, start_new_session=True
        )

    def forward(signum: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return 128 - code if code < 0 else code
