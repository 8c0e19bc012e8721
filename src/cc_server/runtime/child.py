"""Children: one running command, whatever runs it, behind one small protocol.

An `Execution` (runtime/execution.py) is composed over a `Child` and never asks which kind it
has. Three kinds exist: `HostChild` here (a sandbox of its own, or no sandbox: a host process
and its process group), `SessionProcess` (runtime/session_sandbox.py: a request to the session's
long-lived sandbox) and `VmChild` (microvm/handle.py: a channel to the guest's agent). The first
reads and writes asyncio pipes (`PipedChild`); the second plain descriptors the loop watches
(runtime/command_pipes.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Final, Protocol

from cc_server.backends.child_watch import wait_exited
from cc_server.backends.handoff import Launched
from cc_server.backends.supervisor import Report, stop_supervisor, watch_reports
from cc_server.errors import BadSpec
from cc_server.runtime.events import EventType

__all__ = ["KILL_GRACE_S", "READ_CHUNK_BYTES", "Child", "Emit", "HostChild", "PipedChild"]

READ_CHUNK_BYTES: Final = 64 * 1024  # one stdout/stderr event carries at most this much
KILL_GRACE_S: Final = 2.0  # after SIGKILL, how long to wait for the command's end

Emit = Callable[[EventType, bytes], Awaitable[None]]
"""Queue one output event (STDOUT or STDERR) of the command, waiting while the queue is full."""


class Child(Protocol):
    """One running command: its stdio, its end, its signals, what the server holds for it."""

    @property
    def returncode(self) -> int | None:
        """The exit code (negative: killed by that signal) once the command has ended."""
        ...

    async def pump(self, emit: Emit) -> None:
        """Pass the command's output to `emit` until its streams end (cancel to stop early)."""
        ...

    async def feed(self, data: bytes) -> None:
        """Write `data` to the command's stdin, then EOF; a reader that is gone is no error."""
        ...

    async def write_stdin(self, data: bytes) -> None:
        """Send bytes to the command's stdin.

        Raises:
            BadSpec: it has no stdin pipe.
        """
        ...

    def close_stdin(self) -> None:
        """Send EOF to the command's stdin, if it has one."""
        ...

    async def exited(self) -> int:
        """Wait until the command has ended (in a session sandbox or a VM: and what it left
        behind); return `returncode`."""
        ...

    def signal(self, signum: int) -> None:
        """Send `signum` to the command's process group; nothing once it has ended."""
        ...

    async def kill(self) -> None:
        """SIGKILL the command and wait up to KILL_GRACE_S for its end. A child that can be
        ended another way then is (its session sandbox closed, its VM channel given up); a
        host process is left to the kernel, and `exited()` waits for it."""
        ...

    async def close(self) -> None:
        """After the end: free what the server holds for the command (its pipes, its egress
        listeners, its create-rule supervisor, whose last refusals are reported now).
        Idempotent."""
        ...


class PipedChild:
    """The stdio of a command over asyncio pipes (a host process's)."""

    stdin: asyncio.StreamWriter | None = None
    stdout: asyncio.StreamReader | None = None
    stderr: asyncio.StreamReader | None = None

    async def pump(self, emit: Emit) -> None:
        """See Child.pump: stdout and stderr, read side by side."""
        async with asyncio.TaskGroup() as tg:
            for stream, kind in ((self.stdout, EventType.STDOUT), (self.stderr, EventType.STDERR)):
                if stream is not None:
                    tg.create_task(_pump(stream, kind, emit), name=str(kind))

    async def feed(self, data: bytes) -> None:
        """See Child.feed."""
        assert self.stdin is not None  # fed only when started with stdin data
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if data:
                self.stdin.write(data)
                await self.stdin.drain()
            self.stdin.close()

    async def write_stdin(self, data: bytes) -> None:
        """See Child.write_stdin."""
        if self.stdin is None:
            raise BadSpec("this execution has no interactive stdin")
        self.stdin.write(data)
        await self.stdin.drain()

    def close_stdin(self) -> None:
        """See Child.close_stdin."""
        if self.stdin is not None:
            self.stdin.close()


async def _pump(stream: asyncio.StreamReader, kind: EventType, emit: Emit) -> None:
    while chunk := await stream.read(READ_CHUNK_BYTES):
        await emit(kind, chunk)


class HostChild(PipedChild):
    """A command in a sandbox of its own (or on `none`): a host process that leads its own
    process group. For bubblewrap that process is the sandbox's PID 1's parent, and the kernel
    kills everything in the sandbox's PID namespace when it dies."""

    def __init__(self, launched: Launched, on_report: Callable[[Report], None]) -> None:
        self._launched = launched
        self._on_report = on_report
        proc = launched.proc
        self.stdin, self.stdout, self.stderr = proc.stdin, proc.stdout, proc.stderr
        if launched.supervisor is not None:
            watch_reports(asyncio.get_running_loop(), launched.supervisor, on_report)

    @property
    def pid(self) -> int:
        """The host pid of the process (and the id of its process group)."""
        return self._launched.proc.pid

    @property
    def returncode(self) -> int | None:
        """See Child.returncode."""
        return self._launched.proc.returncode

    async def exited(self) -> int:
        """See Child.exited: the process itself (backends.child_watch.wait_exited)."""
        proc = self._launched.proc
        await wait_exited(proc)
        assert proc.returncode is not None
        return proc.returncode

    def signal(self, signum: int) -> None:
        """See Child.signal. The group id stays reserved while any member lives, so this never
        reaches a stranger; on `none` it takes what the command left in its group."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._launched.proc.pid, signum)

    async def kill(self) -> None:
        """See Child.kill."""
        self.signal(signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(KILL_GRACE_S):
                await self.exited()

    async def close(self) -> None:
        """See Child.close."""
        launched = self._launched
        launched.transport.close()  # our pipe ends, even if a descendant still holds theirs
        adopted, launched.adopted = launched.adopted, ()
        for listener in adopted:  # the sandbox is gone: nothing more to accept
            await listener.aclose()
        rules, launched.supervisor = launched.supervisor, None
        if rules is not None:  # its last refusals come before `exit`
            await stop_supervisor(rules, self._on_report)
