"""SandboxHandle and Execution: a launched sandbox, and one command running in it.

Every running command has an owner (its Execution's TaskGroup); `destroy()` kills every command
still running, waits for it, and is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from cc_server.backends.child_watch import wait_exited
from cc_server.backends.fdpass import receive_fds
from cc_server.backends.peer import SandboxPeers
from cc_server.backends.plan import Command, LaunchPlan, Planner
from cc_server.backends.runner import start
from cc_server.backends.supervisor import (
    CreateRefused,
    CreateRuleSupervisor,
    Report,
    path_rules,
    receive_listener,
    stop_supervisor,
    watch_reports,
)
from cc_server.errors import BadSpec, Closed
from cc_server.policy import CompiledPolicy, SandboxBackend
from cc_server.runtime.egress_port import Adopted, EgressPort
from cc_server.runtime.events import (
    EgressChanged,
    EgressRequest,
    EventType,
    SandboxEvent,
    SandboxState,
    SandboxViolation,
    check_transition,
)
from cc_server.runtime.output import DEFAULT_COLLECT_LIMIT_BYTES, BoundedOutput, drain
from cc_server.runtime.session_sandbox import SessionProcess, SessionSandbox

__all__ = ["EgressPort", "Execution", "SandboxHandle"]  # EgressPort: runtime.egress_port

EVENT_QUEUE_SIZE: Final = 256  # events buffered per execution before readers wait for the consumer
READ_CHUNK_BYTES: Final = 64 * 1024  # one stdout/stderr event carries at most this much
KILL_GRACE_S: Final = 2.0  # after SIGKILL, how long to wait for the process to be reaped
# After the command exits, how long its pipes may take to reach EOF. A descendant that left the
# process group (setsid on `none`) can hold them open forever; it must not hold the execution.
PIPE_DRAIN_AFTER_EXIT_S: Final = 2.0
HANDOFF_TIMEOUT_S: Final = 10.0  # from spawning bwrap to the launcher's egress listeners arriving
log = logging.getLogger("cc_server.runtime")


@dataclass(eq=False)
class SandboxHandle:
    """A launched sandbox. Returned by SandboxPort.launch.

    `backend` is the backend actually running, never the one that was merely asked for.
    """

    session_id: str
    backend: SandboxBackend
    policy: CompiledPolicy
    planner: Planner = field(repr=False)
    state: SandboxState = SandboxState.CREATED
    error: BaseException | None = None
    details: dict[str, object] = field(default_factory=dict)
    violations: list[SandboxViolation] = field(default_factory=list)
    # Called with each violation as it is recorded (a dispatch run's audit log); one that raises
    # is logged and the rest still run.
    violation_listeners: list[Callable[[SandboxViolation], None]] = field(
        default_factory=list, repr=False
    )
    egress: EgressPort | None = field(default=None, repr=False)
    # Every process this handle launched: the session's proxies and a run's credential broker
    # serve a peer only from inside one of their sandboxes (backends/peer.py).
    sandbox_peers: SandboxPeers = field(default_factory=SandboxPeers, repr=False)
    _running: set[Execution] = field(default_factory=set, repr=False)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1), repr=False)
    # The session sandbox new commands go to, and older ones still running commands.
    _sandbox: SessionSandbox | None = field(default=None, repr=False)
    _retired: set[SessionSandbox] = field(default_factory=set, repr=False)
    _sandbox_lock: asyncio.Lock | None = field(default=None, repr=False)

    def transition(self, new: SandboxState) -> None:
        """Move to `new`, or raise IllegalTransition (a bug)."""
        check_transition(self.state, new)
        self.state = new

    def fail(self, error: BaseException) -> None:
        """Record a launch failure."""
        self.error = error
        self.transition(SandboxState.ERROR)

    def plan(self, command: Command) -> LaunchPlan:
        """The launch plan for `command` under this sandbox's policy; runs nothing.

        Raises:
            CcServerError: the backend refuses the command (see the backend's planner).
        """
        return self.planner(self.policy, command)

    def exec(
        self,
        argv: tuple[str, ...] | list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        interactive_stdin: bool = False,
        inherit_stdio: bool | tuple[int, int, int] = False,
        timeout_s: float | None = None,
    ) -> Execution:
        """Prepare `argv` to run in the sandbox; use `async with` (or `run()`) to start it.

        `stdin` bytes are written then closed; `interactive_stdin` keeps a pipe open for
        `Execution.write_stdin`; `inherit_stdio` passes the server's own stdio (a TTY) through,
        or the three given descriptors (stdin, stdout, stderr; the caller keeps and closes
        them), and then only `starting`, `ready`, `violation`, `killed` and `exit` are emitted.

        Raises:
            Closed: the handle is destroyed or in error.
            BadSpec: the options conflict.
        """
        if self.state in (SandboxState.DESTROYED, SandboxState.ERROR):
            raise Closed(f"sandbox {self.session_id!r} is {self.state}; launch a new one")
        if inherit_stdio is not False and (stdin is not None or interactive_stdin):
            raise BadSpec("inherit_stdio cannot be combined with stdin data")
        command = Command(
            argv=tuple(argv), env=tuple(sorted((env or {}).items())), cwd=cwd
        )
        return Execution(
            handle=self,
            exec_id=f"{self.session_id}:{next(self._ids)}",
            command=command,
            stdin=stdin,
            interactive_stdin=interactive_stdin,
            inherit_stdio=inherit_stdio,
            timeout_s=timeout_s,
        )

    async def session_sandbox(self, plan: LaunchPlan) -> SessionSandbox:
        """The session sandbox `plan` describes: the running one when the plan is the same (every
        host fact it was built from is unchanged), else a new one. A replaced sandbox keeps
        running its commands and is closed after the last.

        Raises:
            EnforcementFailed: the sandbox could not be started; no command ran.
        """
        if self._sandbox_lock is None:
            self._sandbox_lock = asyncio.Lock()
        async with self._sandbox_lock:
            current = self._sandbox
            if current is not None and current.reusable and current.same_sandbox(plan):
                return current
            self._sandbox = None
            if current is not None:
                self._retired.add(current)
                await self._close_idle(current)
            assert self.egress is not None  # a session sandbox is planned only with egress
            with self.sandbox_peers.launching():
                sandbox = await SessionSandbox.start(plan, self.egress, self._create_report)
                self.sandbox_peers.add(sandbox.pid)
            if self.state in (SandboxState.DESTROYED, SandboxState.ERROR):  # destroyed meanwhile
                await sandbox.aclose()
                raise Closed(f"sandbox {self.session_id!r} is {self.state}; launch a new one")
            self._sandbox = sandbox
            self.details["sandboxPid"] = sandbox.pid
            return sandbox

    async def _close_idle(self, sandbox: SessionSandbox) -> None:
        """Close `sandbox` if it was replaced, or may not be reused, and runs no command any
        more."""
        if sandbox is self._sandbox and not sandbox.reusable:
            self._sandbox = None
            self._retired.add(sandbox)
        if sandbox in self._retired and sandbox.running == 0:
            self._retired.discard(sandbox)
            await sandbox.aclose()

    def _create_report(self, report: Report, execution: Execution | None = None) -> None:
        """A report of the create-rule supervisor: a refusal becomes a violation, of `execution`
        when it is known to have made the call, else of every running one."""
        if isinstance(report, CreateRefused):
            self.record_violation(
                SandboxViolation(
                    action=report.action, target=report.judged_target, raw=report.raw,
                    reason=report.reason,
                ),
                execution,
            )
        else:
            log.warning("create-rule supervisor refused %s: %s", report.syscall, report.detail)

    def _started(self, execution: Execution) -> None:
        self._running.add(execution)
        self.transition(SandboxState.ACTIVE)

    def _finished(self, execution: Execution) -> None:
        self._running.discard(execution)
        if not self._running and self.state is SandboxState.ACTIVE:
            self.transition(SandboxState.WARM)

    def record_egress_change(self, change: EgressChanged) -> None:
        """Tell every running execution that the session's allowlist changed (an event)."""
        for running in list(self._running):
            running.push_event(EventType.EGRESS_CHANGED, egress=change)

    def record_egress_request(self, request: EgressRequest) -> None:
        """Tell every running execution that a connection waits for an answer (an event that
        names every running command: the proxies cannot tell which one connected)."""
        running = list(self._running)
        request = dataclasses.replace(
            request, commands=tuple(tuple(r.command.argv) for r in running)
        )
        for execution in running:
            execution.push_event(EventType.EGRESS_REQUEST, request=request)

    def record_violation(
        self, violation: SandboxViolation, execution: Execution | None = None
    ) -> None:
        """Keep a violation on the handle and forward it to `execution` when the refusal is known
        to be its own (a create refused in its sandbox), else to every running execution (the
        session's proxies cannot tell which command connected)."""
        self.violations.append(violation)
        for listener in list(self.violation_listeners):
            try:
                listener(violation)
            except Exception:
                log.exception("a violation listener failed")
        for running in [execution] if execution is not None else list(self._running):
            running.push_violation(violation)

    async def destroy(self) -> None:
        """Kill every running command, wait for it, and invalidate the handle. Idempotent."""
        if self.state is SandboxState.DESTROYED:
            return
        try:
            for execution in list(self._running):
                await execution.kill(reason="destroyed")
        finally:
            try:
                sandboxes = [*self._retired, *([self._sandbox] if self._sandbox else [])]
                self._sandbox = None
                self._retired.clear()
                for sandbox in sandboxes:
                    await sandbox.aclose()
            finally:
                self.sandbox_peers.close()
                if self.egress is not None:
                    await self.egress.aclose()
                self.transition(SandboxState.DESTROYED)

    def to_json(self) -> dict[str, object]:
        """The spec's SandboxHandle fields, camelCase."""
        return {
            "sessionId": self.session_id,
            "backend": str(self.backend),
            "state": str(self.state),
            "error": None if self.error is None else str(self.error),
            "details": dict(self.details),
            "violations": [v.to_json() for v in self.violations],
        }


class Execution:
    """One command in a sandbox: an async context manager and an async iterator of events."""

    def __init__(
        self,
        *,
        handle: SandboxHandle,
        exec_id: str,
        command: Command,
        stdin: bytes | None,
        interactive_stdin: bool,
        inherit_stdio: bool | tuple[int, int, int],
        timeout_s: float | None,
    ) -> None:
        self.handle = handle
        self.exec_id = exec_id
        self.command = command
        self._stdin_data = stdin
        self._interactive = interactive_stdin
        self._inherit = inherit_stdio is not False
        self._stdio: tuple[int | None, ...] = (
            inherit_stdio if isinstance(inherit_stdio, tuple) else (None, None, None)
        )
        self._timeout_s = timeout_s
        self._queue: asyncio.Queue[SandboxEvent] = asyncio.Queue(EVENT_QUEUE_SIZE)
        self._proc: asyncio.subprocess.Process | SessionProcess | None = None
        self._sandbox: SessionSandbox | None = None  # when it runs in the session's sandbox
        self._transport: asyncio.SubprocessTransport | None = None
        self._killed_reason: str | None = None
        self._task_group: asyncio.TaskGroup | None = None
        self._done = asyncio.Event()
        self._create_rules: CreateRuleSupervisor | None = None
        self._adopted: Sequence[Adopted] = ()
        self.exit_code: int | None = None

    def _event(self, kind: EventType, **fields: Any) -> SandboxEvent:
        return SandboxEvent(
            type=kind, session_id=self.handle.session_id, exec_id=self.exec_id, **fields
        )

    def push_violation(self, violation: SandboxViolation) -> None:
        """Queue a violation event without blocking (dropped only if the consumer is gone)."""
        self.push_event(EventType.VIOLATION, violation=violation)

    def push_event(self, kind: EventType, **fields: Any) -> None:
        """Queue an event without blocking (dropped only if the consumer is gone)."""
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(self._event(kind, **fields))

    async def __aenter__(self) -> Execution:
        command = dataclasses.replace(self.command, in_session_sandbox=True)
        if self.handle.egress is not None:  # the session's proxies, started on first use
            command = dataclasses.replace(command, egress=await self.handle.egress.start())
        plan = self.handle.plan(command)
        await self._queue.put(self._event(EventType.STARTING))
        pipe = asyncio.subprocess.PIPE
        stdin_mode = (
            self._stdio[0] if self._inherit
            else pipe if (self._stdin_data is not None or self._interactive)
            else asyncio.subprocess.DEVNULL
        )
        if plan.session is not None:
            sandbox = await self.handle.session_sandbox(plan)
            self._proc = await sandbox.run(
                plan.session,
                stdin=stdin_mode,
                stdout=self._stdio[1] if self._inherit else pipe,
                stderr=self._stdio[2] if self._inherit else pipe,
                on_report=self._create_report,
            )
            if self._proc is not None:
                self._sandbox = sandbox
                return await self._ready()
            # Too big for one request: a sandbox of its own, planned the same way.
            plan = self.handle.plan(dataclasses.replace(command, in_session_sandbox=False))
        # The launcher inside sends over these: its seccomp listener, its loopback listeners.
        pairs: dict[str, tuple[socket.socket, socket.socket]] = {}
        for slot in (plan.create_rules.socket if plan.create_rules else None, plan.egress_handoff):
            if slot is not None:
                pairs[slot.name] = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                with self.handle.sandbox_peers.launching():
                    self._proc, self._transport = await start(
                        plan,
                        stdin=stdin_mode,
                        stdout=self._stdio[1] if self._inherit else pipe,
                        stderr=self._stdio[2] if self._inherit else pipe,
                        fds={name: theirs.fileno() for name, (_, theirs) in pairs.items()},
                    )
                    if self._proc.returncode is None:  # not reaped: the pid is still its own
                        self.handle.sandbox_peers.add(self._proc.pid)
            finally:
                for _, theirs in pairs.values():
                    theirs.close()
            await self._take_handoffs(plan, {name: ours for name, (ours, _) in pairs.items()})
        finally:
            for ours, _ in pairs.values():
                ours.close()
        return await self._ready()

    async def _ready(self) -> Execution:
        self.handle._started(self)
        await self._queue.put(self._event(EventType.READY))
        self._task_group = asyncio.TaskGroup()
        await self._task_group.__aenter__()
        self._task_group.create_task(self._supervise(), name=f"exec {self.exec_id} supervise")
        return self

    async def _take_handoffs(self, plan: LaunchPlan, socks: dict[str, socket.socket]) -> None:
        """Take what the launcher hands over: its loopback listeners go to the session's proxies,
        its seccomp listener to a new supervisor. The launcher runs the command only after both;
        on any failure the sandbox is killed (the command never ran) and the error raised."""
        try:
            if plan.egress_handoff is not None:
                await self._adopt_egress(socks[plan.egress_handoff.name])
            if plan.create_rules is not None:
                listener = await receive_listener(socks[plan.create_rules.socket.name])
                self._create_rules = CreateRuleSupervisor.start(
                    listener, plan.create_rules.globs, library=plan.create_rules.library,
                    identity=plan.identity,
                    paths=path_rules(plan.create_rules),
                )
        except BaseException:
            self._signal_group()
            await self._exited()
            if self._transport is not None:
                self._transport.close()
            for adopted in self._adopted:
                await adopted.aclose()
            self._adopted = ()
            raise
        if self._create_rules is not None:
            watch_reports(asyncio.get_running_loop(), self._create_rules, self._create_report)

    async def _adopt_egress(self, sock: socket.socket) -> None:
        assert self.handle.egress is not None  # a plan with a handoff had an egress bridge
        fds = await receive_fds(
            sock, tag=b"E", count=2, timeout_s=HANDOFF_TIMEOUT_S, what="egress listeners"
        )
        http, socks = (socket.socket(fileno=fd) for fd in fds)
        self._adopted = await self.handle.egress.adopt(http, socks)

    def _create_report(self, report: Report) -> None:
        self.handle._create_report(report, self)

    async def __aexit__(self, *exc_info: object) -> None:
        if not self._done.is_set():
            await self.kill(reason="manual")
        await self._discard_until_done()
        assert self._task_group is not None
        await self._task_group.__aexit__(None, None, None)

    async def _discard_until_done(self) -> None:
        """Nobody reads the events: discard them so no reader blocks on a full queue."""
        while not self._done.is_set():
            while not self._queue.empty():
                self._queue.get_nowait()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._done.wait(), timeout=0.05)

    async def _pump(self, stream: asyncio.StreamReader | None, kind: EventType) -> None:
        if stream is None:
            return
        while chunk := await stream.read(READ_CHUNK_BYTES):
            await self._queue.put(self._event(kind, data=chunk))

    async def _feed_stdin(self) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if self._stdin_data:
                self._proc.stdin.write(self._stdin_data)
                await self._proc.stdin.drain()
            self._proc.stdin.close()

    async def _supervise(self) -> None:
        proc = self._proc
        assert proc is not None
        try:
            async with asyncio.TaskGroup() as tg:
                readers = [
                    tg.create_task(self._pump(proc.stdout, EventType.STDOUT), name="stdout"),
                    tg.create_task(self._pump(proc.stderr, EventType.STDERR), name="stderr"),
                ]
                if self._stdin_data is not None:
                    tg.create_task(self._feed_stdin(), name="stdin")
                try:
                    async with asyncio.timeout(self._timeout_s):
                        await self._exited()
                except TimeoutError:
                    await self.kill(reason="timeout")
                # Whatever is left in the command's host-side process group goes with it (on
                # `none`; a sandbox's processes died with its PID 1). Buffered output is still
                # read, for a bounded time.
                self._signal_group()
                _, pending = await asyncio.wait(readers, timeout=PIPE_DRAIN_AFTER_EXIT_S)
                for reader in pending:
                    reader.cancel()
        finally:
            if proc.returncode is None:  # cancelled before the command ended
                await self._sigkill_and_wait(bounded=False)
            code = proc.returncode
            assert code is not None
            if self._transport is not None:
                self._transport.close()  # our pipe ends, even if a descendant still holds theirs
            if isinstance(proc, SessionProcess):
                proc.close()
            for adopted in self._adopted:  # the sandbox is gone: nothing more to accept
                await adopted.aclose()
            self._adopted = ()
            if self._create_rules is not None:  # its last refusals come before `exit`
                rules, self._create_rules = self._create_rules, None
                await stop_supervisor(rules, self._create_report)
            self.exit_code = 128 - code if code < 0 else code
            if self._killed_reason is not None:
                await self._queue.put(self._event(EventType.KILLED, reason=self._killed_reason))
            await self._queue.put(self._event(EventType.EXIT, exit_code=self.exit_code))
            self.handle._finished(self)
            self._done.set()
            if self._sandbox is not None:
                await self.handle._close_idle(self._sandbox)

    async def write_stdin(self, data: bytes) -> None:
        """Send bytes to an interactive execution's stdin."""
        if self._proc is None or self._proc.stdin is None:
            raise BadSpec("this execution has no interactive stdin")
        self._proc.stdin.write(data)
        await self._proc.stdin.drain()

    def close_stdin(self) -> None:
        """Send EOF to an interactive execution."""
        if self._proc is not None and self._proc.stdin is not None:
            self._proc.stdin.close()

    async def kill(self, reason: str = "manual") -> None:
        """SIGKILL the command's whole host-side process group; idempotent.

        For bubblewrap that takes the sandbox's PID 1, and the kernel then kills every process in
        the sandbox's PID namespace.
        """
        proc = self._proc
        if proc is None or self._done.is_set():
            return
        if proc.returncode is None and self._killed_reason is None:
            self._killed_reason = reason
        await self._sigkill_and_wait(bounded=True)

    async def _sigkill_and_wait(self, *, bounded: bool) -> None:
        """SIGKILL the command and wait for its end. A sandbox of its own ends by the kernel's
        hand, so unless `bounded` the wait has no limit (else at most KILL_GRACE_S). In the
        session's sandbox the end is reported from inside: if its launcher does not answer
        within KILL_GRACE_S, the whole sandbox is closed, which ends the command too."""
        self._signal_group()
        if self._sandbox is None and not bounded:
            await self._exited()
            return
        try:
            async with asyncio.timeout(KILL_GRACE_S):
                await self._exited()
        except TimeoutError:
            if self._sandbox is not None:
                self.handle._retired.add(self._sandbox)
                await self._sandbox.aclose()
                await self._exited()  # the closed sandbox ended it (137)

    async def terminate(self, grace_s: float, reason: str = "shutdown") -> None:
        """SIGTERM the command's host-side process group, then `kill()` it if it has not exited
        within `grace_s`; idempotent. On bubblewrap the SIGTERM ends bwrap, and the sandbox's PID
        namespace goes with it at once."""
        proc = self._proc
        if proc is None or self._done.is_set():
            return
        if proc.returncode is None and self._killed_reason is None:
            self._killed_reason = reason
        if isinstance(proc, SessionProcess):
            proc.send_signal(signal.SIGTERM)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await self._exited()
        await self.kill(reason=reason)

    async def _exited(self) -> None:
        """Wait for the command itself to exit (see child_watch.wait_exited); in a session
        sandbox, for its keeper's report that it and everything it left have ended."""
        proc = self._proc
        assert proc is not None
        if isinstance(proc, SessionProcess):
            await proc.exited()
        else:
            await wait_exited(proc)

    def _signal_group(self) -> None:
        # The group id stays reserved while any member lives, so this never hits a stranger.
        assert self._proc is not None
        if isinstance(self._proc, SessionProcess):
            self._proc.send_signal(signal.SIGKILL)  # no-op once it has ended
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)

    def __aiter__(self) -> AsyncIterator[SandboxEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[SandboxEvent]:
        while True:
            event = await self._queue.get()
            yield event
            if event.type is EventType.EXIT:
                return

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


async def run_collect(
    handle: SandboxHandle,
    argv: list[str],
    *,
    limit_bytes: int = DEFAULT_COLLECT_LIMIT_BYTES,
    **kwargs: Any,
) -> CollectedResult:
    """Run `argv` in `handle` and collect its result (each stream's first `limit_bytes`; the
    rest is counted in `stdout_dropped` / `stderr_dropped`). `kwargs` go to `handle.exec`.

    Raises:
        CcServerError: the command could not be planned or started (it did not run).
    """
    async with handle.exec(argv, **kwargs) as execution:
        return await execution.collect(limit_bytes=limit_bytes)

