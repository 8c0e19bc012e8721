"""SandboxHandle: a launched sandbox, and the commands it runs (runtime/execution.py).

Every running command has an owner (the TaskGroup its `open_exec` block enters); `destroy()`
kills every command still running, waits for it, and is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from asyncio.subprocess import DEVNULL
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from cc_server.backends.bubblewrap import BubblewrapPlanner
from cc_server.backends.handoff import Streams, launch
from cc_server.backends.peer import SandboxPeers
from cc_server.backends.plan import Command, LaunchPlan, Planner
from cc_server.backends.session_plan import SessionPlanReading, plan_reusing
from cc_server.backends.supervisor import CreateRefused, Report
from cc_server.errors import BadSpec, Closed
from cc_server.policy import CompiledPolicy, SandboxBackend
from cc_server.runtime.child import KILL_GRACE_S, READ_CHUNK_BYTES, Child, HostChild
from cc_server.runtime.egress_port import EgressPort
from cc_server.runtime.events import (
    EgressChanged,
    EgressRequest,
    EventType,
    SandboxState,
    SandboxViolation,
    check_transition,
)
from cc_server.runtime.execution import CollectedResult, Execution
from cc_server.runtime.output import DEFAULT_COLLECT_LIMIT_BYTES
from cc_server.runtime.session_sandbox import SessionSandbox

# EgressPort: runtime.egress_port; Execution, CollectedResult: runtime.execution;
# KILL_GRACE_S, READ_CHUNK_BYTES: runtime.child
__all__ = [
    "KILL_GRACE_S",
    "READ_CHUNK_BYTES",
    "CollectedResult",
    "EgressPort",
    "Execution",
    "SandboxHandle",
    "run_collect",
]

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
    _in_sandbox: dict[Execution, SessionSandbox] = field(default_factory=dict, repr=False)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1), repr=False)
    # The session sandbox new commands go to, and older ones still running commands.
    _sandbox: SessionSandbox | None = field(default=None, repr=False)
    _retired: set[SessionSandbox] = field(default_factory=set, repr=False)
    _sandbox_lock: asyncio.Lock | None = field(default=None, repr=False)
    # The last session sandbox plan and what it was planned from (backends/session_plan.py).
    _reading: SessionPlanReading | None = field(default=None, repr=False)

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
        return self.planner.plan(self.policy, command)

    @contextlib.asynccontextmanager
    async def open_exec(
        self,
        argv: tuple[str, ...] | list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        interactive_stdin: bool = False,
        inherit_stdio: bool | tuple[int, int, int] = False,
        timeout_s: float | None = None,
    ) -> AsyncIterator[Execution]:
        """Run `argv` in the sandbox for the length of the block (see Execution.open).

        `stdin` bytes are written then closed; `interactive_stdin` keeps a pipe open for
        `Execution.write_stdin`; `inherit_stdio` passes the server's own stdio (a TTY) through,
        or the three given descriptors (stdin, stdout, stderr; the caller keeps and closes
        them), and then only `starting`, `ready`, `violation`, `killed` and `exit` are emitted.

        Raises:
            Closed: the handle is destroyed or in error.
            BadSpec: the options conflict.
            CcServerError: the command could not be planned or started (it did not run).
        """
        self.check_open()
        if inherit_stdio is not False and (stdin is not None or interactive_stdin):
            raise BadSpec("inherit_stdio cannot be combined with stdin data")
        command = Command(
            argv=tuple(argv), env=tuple(sorted((env or {}).items())), cwd=cwd
        )
        execution = Execution(
            handle=self, exec_id=self.next_exec_id(), command=command, stdin=stdin,
            timeout_s=timeout_s,
        )
        streams: Streams
        if isinstance(inherit_stdio, tuple):
            streams = inherit_stdio
        elif inherit_stdio:
            streams = (None, None, None)
        else:
            pipe = asyncio.subprocess.PIPE
            streams = (pipe if (stdin is not None or interactive_stdin) else DEVNULL, pipe, pipe)
        async with execution.open(lambda: self._start_child(execution, streams)):
            yield execution

    def check_open(self) -> None:
        """Raise Closed when the handle is destroyed or in error."""
        if self.state in (SandboxState.DESTROYED, SandboxState.ERROR):
            raise Closed(f"sandbox {self.session_id!r} is {self.state}; launch a new one")

    def next_exec_id(self) -> str:
        """A new execution's id: the session's, and a count."""
        return f"{self.session_id}:{next(self._ids)}"

    async def _start_child(self, execution: Execution, streams: Streams) -> Child:
        """Start `execution`'s command: in the session's sandbox when the plan has one and the
        command fits one request, else in a sandbox of its own."""
        command = dataclasses.replace(execution.command, in_session_sandbox=True)
        if self.egress is not None:  # the session's proxies, started on first use
            command = dataclasses.replace(command, egress=await self.egress.start())
        plan = self._plan_session(command)
        if plan.session is not None:
            sandbox = await self.session_sandbox(plan)
            proc = await sandbox.run(
                plan.session, stdin=streams[0], stdout=streams[1], stderr=streams[2],
                on_report=execution.create_report,
            )
            if proc is not None:
                self._in_sandbox[execution] = sandbox
                return proc
            # Too big for one request: a sandbox of its own, planned the same way.
            plan = self.plan(dataclasses.replace(command, in_session_sandbox=False))
        launched = await launch(
            plan, streams, adopt=self.egress.adopt if self.egress is not None else None,
            peers=self.sandbox_peers,
        )
        return HostChild(launched, execution.create_report)

    def _plan_session(self, command: Command) -> LaunchPlan:
        """`plan(command)`; a bubblewrap session sandbox's plan is made again only when something
        it was planned from has changed (backends/session_plan.py)."""
        if not isinstance(self.planner, BubblewrapPlanner):
            return self.plan(command)
        plan, self._reading = plan_reusing(self.planner, self.policy, command, self._reading)
        return plan

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
            sandbox = await SessionSandbox.start(
                plan, self.egress, self.sandbox_peers, self.create_report
            )
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

    def create_report(self, report: Report, execution: Execution | None = None) -> None:
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

    def exec_started(self, execution: Execution) -> None:
        """`execution`'s command is running (its `ready` is next)."""
        self._running.add(execution)
        self.transition(SandboxState.ACTIVE)

    def exec_finished(self, execution: Execution) -> None:
        """`execution`'s command has ended (its `exit` is queued)."""
        self._running.discard(execution)
        if not self._running and self.state is SandboxState.ACTIVE:
            self.transition(SandboxState.WARM)

    async def exec_done(self, execution: Execution) -> None:
        """After `execution`'s end: close the session sandbox it ran in if that was replaced
        and this was its last command."""
        sandbox = self._in_sandbox.pop(execution, None)
        if sandbox is not None:
            await self._close_idle(sandbox)

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


async def run_collect(
    handle: SandboxHandle,
    argv: list[str],
    *,
    limit_bytes: int = DEFAULT_COLLECT_LIMIT_BYTES,
    **kwargs: Any,
) -> CollectedResult:
    """Run `argv` in `handle` and collect its result (each stream's first `limit_bytes`; the
    rest is counted in `stdout_dropped` / `stderr_dropped`). `kwargs` go to `handle.open_exec`.

    Raises:
        CcServerError: the command could not be planned or started (it did not run).
    """
    async with handle.open_exec(argv, **kwargs) as execution:
        return await execution.collect(limit_bytes=limit_bytes)

