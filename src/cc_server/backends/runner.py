"""The runner: the only code in cc-server that spawns a sandboxed or host command.

It materialises a LaunchPlan's fd payloads in sealed memfds (nothing on disk), starts the argv with
exactly the plan's environment, and closes every fd it opened, whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from typing import IO, Any

from cc_server.backends.plan import FdArg, LaunchPlan
from cc_server.errors import EnforcementFailed

__all__ = ["start"]

_Stream = int | IO[Any] | None


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


async def start(
    plan: LaunchPlan,
    *,
    stdin: _Stream = None,
    stdout: _Stream = None,
    stderr: _Stream = None,
) -> asyncio.subprocess.Process:
    """Spawn the plan. `None` streams are inherited from the server process (TTY pass-through).

    The child starts in a new session so the whole host-side process group can be signalled.

    Raises:
        EnforcementFailed: the program could not be started (missing binary, bad cwd, fd setup);
            the command has not run.
    """
    fds: list[int] = []
    try:
        argv: list[str] = []
        for word in plan.argv:
            if isinstance(word, FdArg):
                fd = _sealed_memfd(word)
                fds.append(fd)
                argv.append(str(fd))
            else:
                argv.append(word)
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            env=dict(plan.env),
            cwd=plan.cwd,
            pass_fds=tuple(fds),
            start_new_session=True,
        )
    except OSError as exc:
        raise EnforcementFailed(
            f"could not start {plan.argv[0]!s}: {exc.strerror or exc}",
            fix="check that the program exists and the working directory is valid",
        ) from exc
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
