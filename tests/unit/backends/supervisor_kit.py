"""Run a command under the create-rule filter and a real supervisor, without bubblewrap.

The launcher execs the command directly on the host (it is not PID 1 here), in a throw-away
directory, so each rule is checked against the kernel itself in milliseconds. The sandbox-level
checks (bwrap, PID 1, the plan) live in tests/security/test_create_rules.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from cc_server.backends.supervisor import (
    CreateRefused,
    CreateRuleSupervisor,
    Report,
    SupervisorFault,
    check_create_rules,
    notify_filter_bpf,
)
from cc_server.policy import STANDARD_DENY_CREATE_GLOBS

RUN_TIMEOUT_S = 30.0
CHECK = check_create_rules()
assert CHECK.available, f"the create-rule supervisor must be built: {CHECK.hint}"
LAUNCHER: str = CHECK.launcher or ""
LIBRARY: str = CHECK.library or ""
PYTHON = "/usr/bin/python3"  # the system interpreter: what a sandbox would run


@dataclass
class Supervised:
    returncode: int
    stdout: str
    stderr: str
    reports: list[Report]

    @property
    def refused(self) -> list[CreateRefused]:
        return [r for r in self.reports if isinstance(r, CreateRefused)]

    @property
    def faults(self) -> list[SupervisorFault]:
        return [r for r in self.reports if isinstance(r, SupervisorFault)]


def filter_memfd() -> int:
    fd = os.memfd_create("test-filter", 0)
    os.write(fd, notify_filter_bpf())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class Launch:
    """A command started under the launcher, with its supervisor running."""

    def __init__(
        self,
        argv: Sequence[str],
        cwd: str,
        globs: Sequence[str] = STANDARD_DENY_CREATE_GLOBS,
        *,
        supervise: bool = True,
        workers: int = 3,
        reply_here: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        ours, theirs = socket.socketpair()
        mfd = filter_memfd()
        try:
            self.proc = subprocess.Popen(
                [LAUNCHER, "--filter", str(mfd), "--socket", str(theirs.fileno()), "--", *argv],
                cwd=cwd,
                pass_fds=(mfd, theirs.fileno()),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env if env is not None else {"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
            )
        finally:
            os.close(mfd)
            theirs.close()
        ours.settimeout(RUN_TIMEOUT_S)
        data, fds, _flags, _addr = socket.recv_fds(ours, 1, 1)
        ours.close()
        assert data == b"L" and len(fds) == 1, (data, fds)
        self.listener = fds[0]
        self.supervisor: CreateRuleSupervisor | None = None
        if supervise:
            self.supervisor = CreateRuleSupervisor.start(
                fds[0], globs, library=LIBRARY, workers=workers, reply_here=reply_here
            )

    def finish(self) -> Supervised:
        try:
            out, err = self.proc.communicate(timeout=RUN_TIMEOUT_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        reports = self.supervisor.close() if self.supervisor is not None else []
        if self.supervisor is None:
            os.close(self.listener)
        return Supervised(
            returncode=self.proc.returncode,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            reports=reports,
        )


def run(argv: Sequence[str], cwd: str, **kwargs: object) -> Supervised:
    return Launch(argv, cwd, **kwargs).finish()  # type: ignore[arg-type]


def sh(script: str, cwd: str, **kwargs: object) -> Supervised:
    return run(["/bin/sh", "-c", script], cwd, **kwargs)


def py(code: str, cwd: str, **kwargs: object) -> Supervised:
    return run([PYTHON, "-c", code], cwd, **kwargs)
