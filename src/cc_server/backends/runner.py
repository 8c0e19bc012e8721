"""The runner: the only code in cc-server that spawns a sandboxed or host command.

It materialises a LaunchPlan's fd payloads in sealed memfds (nothing on disk), starts the argv with
exactly the plan's environment in a new session, and closes every fd it opened, whatever happens.
Two entry points: `start` (asyncio, for the runtime's event streams) and `run_attached` (blocking,
stdio inherited, for the CLI; it does not import asyncio, which the per-run CLI would pay for).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
from collections.abc import Iterator
from types import FrameType
from typing import IO, TYPE_CHECKING, Any

from cc_server.backends.plan import FdArg, LaunchPlan
from cc_server.errors import EnforcementFailed

if TYPE_CHECKING:
    import asyncio

__all__ = ["run_attached", "start"]

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


@contextlib.contextmanager
def _materialised(plan: LaunchPlan) -> Iterator[tuple[list[str], tuple[int, ...]]]:
    fds: list[int] = []
    try:
        argv: list[str] = []
        for word in plan.argv:
            if isinstance(word, FdArg):
                fds.append(_sealed_memfd(word))
                argv.append(str(fds[-1]))
            else:
                argv.append(word)
        yield argv, tuple(fds)
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
) -> tuple[asyncio.subprocess.Process, asyncio.SubprocessTransport]:
    """Spawn the plan. `None` streams are inherited from the server process.

    The child starts in a new session so its whole host-side process group can be signalled.
    Returns the process and its transport: the caller closes the transport when done with it,
    since a descendant holding a pipe would otherwise keep it (and its fds) open.

    Raises:
        EnforcementFailed: the program could not be started (missing binary, bad cwd, fd setup);
            the command has not run.
    """
    import asyncio  # lazy import (see the module docstring)

    loop = asyncio.get_running_loop()
    with _materialised(plan) as (argv, fds):
        # What asyncio.create_subprocess_exec does, keeping the transport.
        transport, protocol = await loop.subprocess_exec(
            lambda: asyncio.subprocess.SubprocessStreamProtocol(limit=2**16, loop=loop),
            *argv,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            env=dict(plan.env),
            cwd=plan.cwd,
            pass_fds=fds,
            start_new_session=True,
        )
        return asyncio.subprocess.Process(transport, protocol, loop), transport
    raise AssertionError("unreachable")  # pragma: no cover (the context manager re-raises)


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
