"""Execution: one command in a sandbox, composed over the `Child` that runs it.

A handle opens it (`async with handle.open_exec(…) as execution`); the same class serves a
sandbox of its own, the session's sandbox and a microVM's guest, since everything that differs
is the child's (runtime/child.py). Its supervising task runs in a `TaskGroup` entered by that
`async with`; leaving the block kills the command if it still runs and waits for its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from cc_server.backends.plan import Command
from cc_server.backends.supervisor import Report
from cc_server.errors import BadSpec
from cc_server.runtime.child import Child
from cc_server.runtime.events import EventType, SandboxEvent, SandboxViolation
from cc_server.runtime.output import DEFAULT_COLLECT_LIMIT_BYTES, BoundedOutput, drain

if TYPE_CHECKING:
    from cc_server.runtime.handle import SandboxHandle

__all__ = ["EVENT_QUEUE_SIZE", "PIPE_DRAIN_AFTER_EXIT_S", "CollectedResult", "Execution"]

EVENT_QUEUE_SIZE: Final = 256  # events buffered per execution before readers wait for the consumer
# After the command exits, how long its pipes may take to reach EOF. A descendant that left the
# process group (setsid on `none`) can hold them open forever; it must not hold the execution.
PIPE_DRAIN_AFTER_EXIT_S: Final = 2.0


class Execution:
    """One command in a sandbox: an async iterator of its events, with its stdin, kill and
    terminate. Built and opened by its handle's `open_exec`; not subclassed."""

    def __init__(
        self,
        *,
        handle: SandboxHandle,
        exec_id: str,
        command: Command,
        stdin: bytes | None,
        timeout_s: float | None,
    ) -> None:
        self.handle = handle
        self.exec_id = exec_id
        self.command = command
        self.exit_code: int | None = None
        self._stdin_data = stdin
        self._timeout_s = timeout_s
        self._queue: asyncio.Queue[SandboxEvent] = asyncio.Queue(EVENT_QUEUE_SIZE)
        self._child: Child | None = None
        self._killed_reason: str | None = None
        self._discarding = False  # nobody reads: events are dropped, the last `exit` kept
        self._done = asyncio.Event()

    def _event(self, kind: EventType, **fields: Any) -> SandboxEvent:
        return SandboxEvent(
            type=kind, session_id=self.handle.session_id, exec_id=self.exec_id, **fields
        )

    def push_violation(self, violation: SandboxViolation) -> None:
        """Queue a violation event without blocking (dropped only if the consumer is gone)."""
        self.push_event(EventType.VIOLATION, violation=violation)

    def push_event(self, kind: EventType, **fields: Any) -> None:
        """Queue an event without blocking (dropped only if the consumer is gone)."""
        if self._discarding:
            return
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(self._event(kind, **fields))

    async def _emit(self, kind: EventType, data: bytes | None = None, **fields: Any) -> None:
        """Queue an event, waiting while the queue is full (the readers then wait too)."""
        if self._discarding and kind is not EventType.EXIT:
            return
        if data is not None:
            fields["data"] = data
        await self._queue.put(self._event(kind, **fields))

    def mark_killed(self, reason: str) -> None:
        """Note why the command is being ended (its `killed` event says so), unless a reason
        is noted already."""
        if self._killed_reason is None:
            self._killed_reason = reason

    def create_report(self, report: Report) -> None:
        """A report of the create-rule supervisor known to be this command's."""
        self.handle.create_report(report, self)

    @contextlib.asynccontextmanager
    async def open(self, start: Callable[[], Awaitable[Child]]) -> AsyncIterator[Execution]:
        """Queue `starting`, start the child (`start` raises when the command did not run),
        queue `ready` and supervise it until the block ends; then kill it if it still runs and
        wait for its `exit`, discarding the events nobody read."""
        await self._emit(EventType.STARTING)
        child = self._child = await start()
        self.handle.exec_started(self)
        await self._emit(EventType.READY)
        raised: BaseException | None = None  # by the block: raised as it is, not in a group
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._supervise(child), name=f"exec {self.exec_id} supervise")
            try:
                yield self
            except BaseException as exc:
                raised = exc
            finally:
                if not self._done.is_set():
                    await self.kill(reason="manual")
                await self._discard_until_done()
        if raised is not None:
            try:
                raise raised
            finally:
                raised = None

    async def _discard_until_done(self) -> None:
        """Nobody reads the events: drop them so the command is never held on a full queue."""
        self._discarding = True
        while not self._queue.empty():
            self._queue.get_nowait()
        await self._done.wait()

    async def _supervise(self, child: Child) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                output = tg.create_task(child.pump(self._emit), name="output")
                if self._stdin_data is not None:
                    tg.create_task(child.feed(self._stdin_data), name="stdin")
                try:
                    async with asyncio.timeout(self._timeout_s):
                        await child.exited()
                except TimeoutError:
                    await self.kill(reason="timeout")
                # Whatever is left in the command's process group goes with it (on `none`; a
                # sandbox's processes died with its PID 1). Buffered output is still read, for
                # a bounded time.
                child.signal(signal.SIGKILL)
                if not output.done():
                    _, pending = await asyncio.wait([output], timeout=PIPE_DRAIN_AFTER_EXIT_S)
                    for task in pending:
                        task.cancel()
        finally:
            await self._finish(child)

    async def _finish(self, child: Child) -> None:
        """The command has ended (or supervising it was cancelled): make sure, free what it
        held, queue `killed` and `exit`, tell the handle."""
        if child.returncode is None:  # cancelled before the command ended
            await child.kill()
        code = await child.exited()
        await child.close()
        self.exit_code = 128 - code if code < 0 else code
        if self._killed_reason is not None:
            await self._emit(EventType.KILLED, reason=self._killed_reason)
        await self._emit(EventType.EXIT, exit_code=self.exit_code)
        self.handle.exec_finished(self)
        self._done.set()
        await self.handle.exec_done(self)

    async def write_stdin(self, data: bytes) -> None:
        """Send bytes to an interactive execution's stdin.

        Raises:
            BadSpec: it has no interactive stdin.
        """
        if self._child is None:
            raise BadSpec("this execution has no interactive stdin")
        await self._child.write_stdin(data)

    def close_stdin(self) -> None:
        """Send EOF to an interactive execution."""
        if self._child is not None:
            self._child.close_stdin()

    async def kill(self, reason: str = "manual") -> None:
        """SIGKILL the command's process group and wait (boundedly) for its end; idempotent.

        For bubblewrap that takes the sandbox's PID 1, and the kernel then kills every process in
        the sandbox's PID namespace; in the session's sandbox or a VM, a command that does not
        answer is ended with its sandbox, or given up (see Child.kill).
        """
        child = self._child
        if child is None or self._done.is_set():
            return
        if child.returncode is None:
            self.mark_killed(reason)
        await child.kill()

    async def terminate(self, grace_s: float, reason: str = "shutdown") -> None:
        """SIGTERM the command's process group, then `kill()` it if it has not exited within
        `grace_s`; idempotent. On bubblewrap the SIGTERM ends bwrap, and the sandbox's PID
        namespace goes with it at once."""
        child = self._child
        if child is None or self._done.is_set():
            return
        if child.returncode is None:
            self.mark_killed(reason)
        child.signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await child.exited()
        await self.kill(reason=reason)

    def __aiter__(self) -> AsyncIterator[SandboxEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[SandboxEvent]:
        while True:
            event = await self._queue.get()
            yield event
            if event.type is EventType.EXIT:
                return

    async def wait_done(self) -> None:
        """Wait until the command has exited (its `exit` event queued), reading nothing."""
        await self._done.wait()

    async def wait(self) -> int:
        """Wait for the command to exit and return its exit code (128+N for signal N).

        Events nobody has read are discarded meanwhile (use `collect()` to keep them).
        """
        await self._discard_until_done()
        assert self.exit_code is not None
        return self.exit_code

    async def collect(
        self, *, limit_bytes: int = DEFAULT_COLLECT_LIMIT_BYTES
    ) -> CollectedResult:
        """Drain every event; return output, exit code and violations together. Each stream
        keeps its first `limit_bytes`; the rest is read, counted and dropped as it arrives."""
        out, err = BoundedOutput(limit_bytes), BoundedOutput(limit_bytes)
        violations: list[SandboxViolation] = []
        drained = await drain(self, out, err, violations)
        return CollectedResult(
            exit_code=drained.exit_code,
            stdout=out.head(),
            stderr=err.head(),
            stdout_dropped=out.dropped,
            stderr_dropped=err.dropped,
            violations=tuple(violations),
            killed=drained.killed,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectedResult:
    """Everything one execution produced, for simple callers."""

    exit_code: int
    stdout: bytes  # the head of stdout (see `collect`)
    stderr: bytes  # the head of stderr
    stdout_dropped: int  # stdout bytes read past the head and dropped
    stderr_dropped: int  # stderr bytes read past the head and dropped
    violations: tuple[SandboxViolation, ...]
    killed: str | None

    @property
    def stdout_truncated(self) -> bool:
        """Whether stdout was cut at the limit."""
        return self.stdout_dropped > 0

    @property
    def stderr_truncated(self) -> bool:
        """Whether stderr was cut at the limit."""
        return self.stderr_dropped > 0

