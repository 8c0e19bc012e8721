"""The harness bash tool: each command through the run's sandbox, after the guardrail chain.

A command is a shell string (run as `bash -c`) or an argv. It passes the chain first as a `bash`
action (the mode's tool surface, then its command table), then runs through the run's handle,
which the SandboxManager launched: native when the host has a backend, else `none`. Either way
the environment is the run's sanitised one. Every command has a timeout, its output is bounded
(the head is kept, the rest counted and dropped: `runtime.output`, as for the collected exec
result) and its exit code is returned. ACP `terminal/*` requests use the same tool (`start`), as
`acp_terminal` actions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from cc_server.dispatch.actions import Action, ActionKind
from cc_server.dispatch.guardrails import GuardrailChain
from cc_server.dispatch.violations import RunViolation, from_sandbox, notice_text
from cc_server.errors import BadSpec
from cc_server.policy import Mode
from cc_server.runtime.events import SandboxViolation
from cc_server.runtime.handle import Execution, SandboxHandle
from cc_server.runtime.output import BoundedOutput, drain
from cc_server.tasks import start_task

__all__ = [
    "DEFAULT_MAX_OUTPUT_BYTES",
    "DEFAULT_TIMEOUT_S",
    "MAX_TIMEOUT_S",
    "BashResult",
    "HarnessBash",
    "Terminal",
    "run_bounded",
    "shell_argv",
    "with_notices",
]

DEFAULT_TIMEOUT_S: Final = 120.0  # a command that runs longer is killed (SIGKILL to its group)
MAX_TIMEOUT_S: Final = 3600.0  # the longest a caller may ask for
DEFAULT_MAX_OUTPUT_BYTES: Final = 256 * 1024  # per stream; what an agent's context can take
MAX_OUTPUT_BYTES: Final = 8 * 1024 * 1024  # the largest bound a caller may ask for
MAX_TERMINALS: Final = 16  # live ACP terminals per run
SHELL: Final = "/bin/bash"  # shell strings run as `bash -c`; present in every sandbox (/usr)


def shell_argv(command: str | Sequence[str]) -> tuple[str, ...]:
    """The argv of a command: a shell string becomes `bash -c STRING`.

    Raises:
        BadSpec: the command is empty or has a NUL byte.
    """
    argv = (SHELL, "-c", command) if isinstance(command, str) else tuple(command)
    if not argv or not argv[0] or (isinstance(command, str) and not command.strip()):
        raise BadSpec("the command is empty", fix="give a shell string or an argv")
    if any("\x00" in word for word in argv):
        raise BadSpec("the command contains a NUL byte")
    return argv


def _check_limits(timeout_s: float | None, max_output_bytes: int | None) -> tuple[float, int]:
    timeout = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    limit = DEFAULT_MAX_OUTPUT_BYTES if max_output_bytes is None else max_output_bytes
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise BadSpec(f"timeoutS must be in (0, {MAX_TIMEOUT_S:g}], got {timeout_s}")
    if not 0 < limit <= MAX_OUTPUT_BYTES:
        raise BadSpec(f"maxOutputBytes must be in (0, {MAX_OUTPUT_BYTES}], got {limit}")
    return timeout, limit


@dataclass(frozen=True, slots=True, kw_only=True)
class BashResult:
    """What one harness command did."""

    exit_code: int  # 128+N for signal N; a timeout is 137 with killed == "timeout"
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    killed: str | None  # "timeout", "manual", ... when the host killed it
    violations: tuple[SandboxViolation, ...]
    refusals: tuple[RunViolation, ...] = ()  # what the agent runner's hooks refused (claude)

    @property
    def timed_out(self) -> bool:
        return self.killed == "timeout"

    def to_json(self) -> dict[str, Any]:
        """The API form."""
        return {
            "exitCode": self.exit_code,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "stdoutTruncated": self.stdout_truncated,
            "stderrTruncated": self.stderr_truncated,
            "timedOut": self.timed_out,
            "killed": self.killed,
            "violations": [from_sandbox(v).to_json() for v in self.violations]
            + [v.to_json() for v in self.refusals],
        }


def with_notices(result: BashResult) -> BashResult:
    """`result` with a "blocked by sandbox policy" line per violation added to its stderr: the
    tool output an agent hands its model says what was refused, so it does not retry."""
    notes = notice_text(from_sandbox(v) for v in result.violations)
    return dataclasses.replace(result, stderr=result.stderr + notes) if notes else result


async def run_bounded(
    handle: SandboxHandle,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | None,
    stdin: bytes | None = None,
    timeout_s: float | None = None,
    max_output_bytes: int | None = None,
) -> BashResult:
    """Run `argv` in `handle` to completion with a timeout and bounded output. No guardrail:
    callers check the action first.

    Raises:
        BadSpec: limits out of range, or the handle cannot run commands.
        CcServerError: the sandbox could not start the command (it did not run).
    """
    timeout, limit = _check_limits(timeout_s, max_output_bytes)
    out, err = BoundedOutput(limit), BoundedOutput(limit)
    violations: list[SandboxViolation] = []
    async with handle.open_exec(
        tuple(argv), env=dict(env), cwd=cwd, stdin=stdin, timeout_s=timeout
    ) as execution:
        drained = await drain(execution, out, err, violations)
    return BashResult(
        exit_code=drained.exit_code,
        stdout=out.text(),
        stderr=err.text(),
        stdout_truncated=out.truncated,
        stderr_truncated=err.truncated,
        killed=drained.killed,
        violations=tuple(violations),
    )


class Terminal:
    """A command started for an ACP `terminal/create`: output is kept (bounded, stdout and stderr
    interleaved) until the agent releases it."""

    def __init__(
        self, terminal_id: str, execution: Execution, stack: contextlib.AsyncExitStack,
        limit: int,
    ) -> None:
        self.terminal_id = terminal_id
        self._stack = stack  # holds the execution's `open_exec` block
        self.execution = execution
        self.output = BoundedOutput(limit)
        self.violations: list[SandboxViolation] = []
        self.exit_code: int | None = None
        self.killed: str | None = None
        self._done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _pump(self) -> None:
        try:
            drained = await drain(self.execution, self.output, None, self.violations)
            self.exit_code, self.killed = drained.exit_code, drained.killed
            # What the agent reads back says what was refused (see with_notices), even past the
            # output's limit (MAX_NOTICE_LINES bounds it).
            self.output.data += notice_text(from_sandbox(v) for v in self.violations).encode()
        finally:
            with contextlib.suppress(Exception):
                await self._stack.aclose()
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> int | None:
        """Wait for the command to exit; its exit code."""
        await self._done.wait()
        return self.exit_code

    async def kill(self) -> None:
        """Kill the command (its output stays readable)."""
        await self.execution.kill(reason="manual")

    async def release(self) -> None:
        """Kill the command if it still runs and forget its output. Idempotent."""
        await self.execution.kill(reason="released")
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class HarnessBash:
    """The bash tool of one dispatch run."""

    def __init__(
        self,
        handle: SandboxHandle,
        chain: GuardrailChain,
        *,
        mode: Mode,
        env: Mapping[str, str],
        cwd: str | None,
    ) -> None:
        self.handle = handle
        self.chain = chain
        self.mode = mode
        self.env = dict(env)
        self.cwd = cwd
        self.terminals: dict[str, Terminal] = {}

    def _check(self, argv: tuple[str, ...], kind: ActionKind) -> None:
        self.chain.check(
            Action(
                kind=kind, tool="bash", session_id=self.handle.session_id, mode=self.mode, argv=argv
            )
        )

    async def run(
        self,
        command: str | Sequence[str],
        *,
        timeout_s: float | None = None,
        max_output_bytes: int | None = None,
        stdin: bytes | None = None,
    ) -> BashResult:
        """Run one command to completion.

        Raises:
            ActionRefused: a guardrail refused it (nothing ran).
            BadSpec: an empty command or limits out of range.
            CcServerError: the sandbox could not start it (nothing ran).
        """
        argv = shell_argv(command)
        timeout, limit = _check_limits(timeout_s, max_output_bytes)
        self._check(argv, ActionKind.BASH)
        result = await run_bounded(
            self.handle,
            argv,
            env=self.env,
            cwd=self.cwd,
            stdin=stdin,
            timeout_s=timeout,
            max_output_bytes=limit,
        )
        return with_notices(result)

    async def start(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        output_limit: int | None = None,
        timeout_s: float | None = None,
    ) -> Terminal:
        """Start a command for an ACP terminal; it runs until it exits, is killed or released.

        Raises:
            ActionRefused: a guardrail refused it (nothing ran).
            BadSpec: too many live terminals, an empty command or limits out of range.
            CcServerError: the sandbox could not start it.
        """
        words = shell_argv(list(argv))
        timeout, limit = _check_limits(timeout_s or MAX_TIMEOUT_S, output_limit)
        self._check(words, ActionKind.ACP_TERMINAL)
        if len(self.terminals) >= MAX_TERMINALS:
            raise BadSpec(
                f"this run already has {MAX_TERMINALS} terminals",
                fix="release one (terminal/release) first",
            )
        stack = contextlib.AsyncExitStack()
        execution = await stack.enter_async_context(self.handle.open_exec(
            words, env={**self.env, **(env or {})}, cwd=cwd or self.cwd, timeout_s=timeout
        ))
        terminal = Terminal(f"term-{secrets.token_hex(6)}", execution, stack, limit)
        # Owned by this harness: `aclose` (or `release`) kills the command and awaits the task.
        terminal._task = start_task(terminal._pump(), name=f"terminal {terminal.terminal_id}")
        self.terminals[terminal.terminal_id] = terminal
        return terminal

    def terminal(self, terminal_id: str) -> Terminal:
        """A live terminal, or BadSpec."""
        terminal = self.terminals.get(terminal_id)
        if terminal is None:
            raise BadSpec(f"no terminal {terminal_id!r} in this run")
        return terminal

    async def release(self, terminal_id: str) -> None:
        """Kill and forget a terminal; unknown ids are fine."""
        terminal = self.terminals.pop(terminal_id, None)
        if terminal is not None:
            await terminal.release()

    async def aclose(self) -> None:
        """Kill every terminal and wait for it. Idempotent."""
        for terminal_id in list(self.terminals):
            await self.release(terminal_id)
