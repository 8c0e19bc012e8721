"""Seam 2: an ACP agent spawned through the SandboxManager, with cc-server as its ACP client.

The agent is any command speaking the Agent Client Protocol (newline-delimited JSON-RPC) on
stdio. It runs in the run's sandbox (native or `none`, always with the sanitised environment);
its stdout and stdin are the execution's pipes, adapted to the ACP SDK's message transport by
`ExecutionTransport`. cc-server answers the agent's requests itself:

- `fs/read_text_file`, `fs/write_text_file`: the in-process file tools, recorded as `acp_read` /
  `acp_write` actions, so the guardrail chain and every path rule apply; a refusal is a JSON-RPC
  error whose message is the violation's "blocked by sandbox policy" notice (the agent hands it
  to its model), with the guardrail in its data;
- `session/request_permission`: the run's policy, on what the tool call would do
  (`judge_tool_call`): the paths an edit, delete, move or read names pass the guardrail chain and
  the path and create-time rules as the file tools would apply them; a command passes the chain
  (the mode's command table, the operator's guardrails); a fetch needs the network; a tool kind
  the mode's surface lacks, and anything unknown or without a target, is rejected. Only a
  once-option is ever chosen: an "always" would outlive this run (the adapter writes it into the
  agent's settings), so when no once-option says the policy's answer the request is cancelled.
  A rejection is a `permission` violation of the run;
- `terminal/*`: the harness bash tool (`acp_terminal` actions), bounded output, killed on release
  and on teardown; what the sandbox refused is added to the output as notice lines;
- `session/update`: kept (bounded) for the client of the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from typing import Any, Final

from acp import PROTOCOL_VERSION, RequestError
from acp.client.connection import ClientSideConnection
from acp.schema import (
    AllowedOutcome,
    ClientCapabilities,
    CreateTerminalResponse,
    DeniedOutcome,
    EnvVariable,
    FileSystemCapabilities,
    Implementation,
    KillTerminalResponse,
    PermissionOption,
    ReadTextFileResponse,
    ReleaseTerminalResponse,
    RequestPermissionResponse,
    TerminalExitStatus,
    TerminalOutputResponse,
    ToolCallUpdate,
    WaitForTerminalExitResponse,
    WriteTextFileResponse,
)

from cc_server import __version__
from cc_server.dispatch.actions import Action, ActionKind, ActionRefused
from cc_server.dispatch.env import sanitized_env
from cc_server.dispatch.harness import shell_argv
from cc_server.dispatch.modes import tools_for_mode
from cc_server.dispatch.service import DispatchRun
from cc_server.dispatch.violations import RunViolation, ViolationSource
from cc_server.errors import BadSpec, CcServerError, EnforcementFailed
from cc_server.policy import Mode
from cc_server.runtime.events import EventType, SandboxViolation
from cc_server.runtime.handle import Execution

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "MAX_MESSAGE_BYTES",
    "MAX_RECORDS",
    "AcpSession",
    "CcAcpClient",
    "ExecutionTransport",
    "judge_tool_call",
    "permission_for",
    "prompt_acp",
    "start_acp",
]

log = logging.getLogger("cc_server.dispatch.acp")
MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024  # one JSON-RPC line from the agent (a big file write)
MAX_STDERR_BYTES: Final = 64 * 1024  # the agent's stderr tail kept for diagnostics
MAX_UPDATES: Final = 1000  # session/update notifications kept per run
MAX_RECORDS: Final = 1000  # file requests and permission decisions kept per run (the newest)
HANDSHAKE_TIMEOUT_S: Final = 60.0  # initialize + session/new (a Node agent's start-up)
REFUSED_CODE: Final = -32001  # JSON-RPC error code of a request the policy refused

# Which tool of the mode's surface an ACP tool kind needs; kinds not listed are refused.
_KIND_TOOL: Final = {
    "read": "read",
    "search": "search",
    "edit": "edit",
    "delete": "write",
    "move": "write",
    "execute": "bash",
    "think": None,  # no effect outside the agent
    "switch_mode": None,
}


def permission_for(mode: Mode, kind: str | None, *, network_allowed: bool) -> tuple[bool, str]:
    """The mode's answer to an ACP permission request for a tool call of `kind`, and why.
    Unknown kinds are refused."""
    if kind not in _KIND_TOOL:
        if kind == "fetch" and network_allowed:
            return True, "network goes through the session's proxies and their allowlist"
        return False, f"tool kind {kind!r} is not one the {mode} mode's policy allows"
    tool = _KIND_TOOL[kind]
    if tool is None or tool in tools_for_mode(mode):
        return True, f"{mode} mode exposes the {tool or kind} tool"
    return False, f"{mode} mode does not expose the {tool!r} tool"


class ExecutionTransport:
    """The ACP SDK's message transport over an execution's stdin and stdout events.

    Lines longer than MAX_MESSAGE_BYTES end the connection (the agent is broken or hostile);
    stderr is kept as a bounded tail; violations are forwarded to the run's handle already.
    """

    def __init__(self, execution: Execution) -> None:
        self.execution = execution
        self._events = execution.__aiter__()
        self._buffer = bytearray()
        self._eof = False
        self.stderr_tail: deque[bytes] = deque()
        self._stderr_bytes = 0
        self.violations: list[SandboxViolation] = []
        self.exit_code: int | None = None

    def _keep_stderr(self, data: bytes) -> None:
        self.stderr_tail.append(data)
        self._stderr_bytes += len(data)
        while self._stderr_bytes > MAX_STDERR_BYTES and len(self.stderr_tail) > 1:
            self._stderr_bytes -= len(self.stderr_tail.popleft())

    def stderr_text(self) -> str:
        return b"".join(self.stderr_tail).decode("utf-8", errors="replace")

    async def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        try:
            await self.execution.write_stdin(data)
        except (BrokenPipeError, ConnectionResetError, BadSpec) as exc:
            raise ConnectionError(f"the ACP agent's stdin is closed: {exc}") from exc

    async def receive(self) -> dict[str, Any] | None:
        while True:
            newline = self._buffer.find(b"\n")
            if newline >= 0:
                line = bytes(self._buffer[:newline]).strip()
                del self._buffer[: newline + 1]
                if not line:
                    continue
                try:
                    message = json.loads(line)
                except ValueError:
                    log.warning("ACP agent wrote a line that is not JSON: %r", line[:200])
                    continue
                if isinstance(message, dict):
                    return message
                continue
            if len(self._buffer) > MAX_MESSAGE_BYTES:
                log.warning("ACP agent wrote a line over %d bytes; closing", MAX_MESSAGE_BYTES)
                await self.execution.kill(reason="protocol")
                self._buffer.clear()
            if self._eof:
                return None
            try:
                event = await self._events.__anext__()
            except StopAsyncIteration:
                self._eof = True
                continue
            if event.type is EventType.STDOUT and event.data:
                self._buffer += event.data
            elif event.type is EventType.STDERR and event.data:
                self._keep_stderr(event.data)
            elif event.type is EventType.VIOLATION and event.violation is not None:
                self.violations.append(event.violation)
            elif event.type is EventType.EXIT:
                self.exit_code = event.exit_code
                self._eof = True

    async def close(self) -> None:
        self.execution.close_stdin()


# Where an ACP tool call names the file it acts on, besides `locations` (Claude Code's tools).
_PATH_KEYS: Final = ("file_path", "path", "notebook_path", "source", "destination")
# The file action a path of each kind is judged as.
_KIND_FILE_ACTION: Final = {
    "read": ActionKind.ACP_READ,
    "search": ActionKind.ACP_READ,
    "edit": ActionKind.ACP_WRITE,
    "delete": ActionKind.ACP_WRITE,
    "move": ActionKind.ACP_WRITE,
}


def _tool_call_paths(tool_call: ToolCallUpdate) -> list[str]:
    paths = [loc.path for loc in tool_call.locations or () if loc.path]
    raw = tool_call.raw_input if isinstance(tool_call.raw_input, dict) else {}
    paths += [raw[k] for k in _PATH_KEYS if isinstance(raw.get(k), str) and raw[k]]
    return list(dict.fromkeys(paths))


def judge_tool_call(run: DispatchRun, tool_call: ToolCallUpdate) -> tuple[bool, str]:
    """The run's policy on an ACP tool call the agent asks permission for, and why.

    The mode's table (`permission_for`) first; then what the call would do: each path of a file
    kind through the file tools' checks (`FileTools.judge`: the chain, the path rules, the
    create-time rules), the command of an `execute` through the chain as a `bash` action. A
    file kind without a path (other than a search) and an `execute` without a command are
    refused: what cannot be judged is not allowed."""
    kind = tool_call.kind
    allowed, why = permission_for(run.mode, kind, network_allowed=run.handle.policy.network_allowed)
    if not allowed:
        return False, why
    raw = tool_call.raw_input if isinstance(tool_call.raw_input, dict) else {}
    try:
        if kind in _KIND_FILE_ACTION:
            paths = _tool_call_paths(tool_call)
            if not paths and kind != "search":
                return False, f"a {kind} tool call that names no path cannot be judged"
            for path in paths:
                run.tools.judge(path, kind=_KIND_FILE_ACTION[kind])
            return True, f"{why}; {', '.join(paths) or 'the search'} allowed by the run's policy"
        if kind == "execute":
            command = raw.get("command")
            if not isinstance(command, str) or not command.strip():
                return False, "an execute tool call that names no command cannot be judged"
            run.chain.check(Action(kind=ActionKind.BASH, tool="bash", session_id=run.run_id,
                                   mode=run.mode, argv=shell_argv(command)))
            return True, f"{why}; the command is allowed by the run's policy"
    except ActionRefused as exc:
        return False, f"{exc.guardrail}: {exc.reason}"
    except CcServerError as exc:
        return False, exc.message
    return True, why


def _refused(exc: CcServerError, violation: RunViolation | None = None) -> RequestError:
    data: dict[str, Any] = {"error": type(exc).__name__, "fix": exc.fix, "detail": exc.message}
    if isinstance(exc, ActionRefused):
        data["guardrail"] = exc.guardrail
    message = violation.notice if violation is not None else exc.message
    return RequestError(REFUSED_CODE, message, data)


class CcAcpClient:
    """cc-server's answers to one agent's requests (the ACP SDK's Client interface)."""

    def __init__(self, run: DispatchRun) -> None:
        self.run = run
        self.updates: deque[dict[str, Any]] = deque(maxlen=MAX_UPDATES)
        # The newest decisions and file requests, for the API and the tests: an agent that asks
        # without end cannot grow the server.
        self.permissions: deque[dict[str, Any]] = deque(maxlen=MAX_RECORDS)
        self.file_requests: deque[dict[str, Any]] = deque(maxlen=MAX_RECORDS)

    def _refused(self, exc: CcServerError) -> RequestError:
        """The JSON-RPC error for a refused request; a guardrail's refusal is a violation of
        the run first."""
        violation = self.run.violations.refused(exc) if isinstance(exc, ActionRefused) else None
        return _refused(exc, violation)

    # -- file system --

    async def read_text_file(
        self,
        session_id: str,
        path: str,
        line: int | None = None,
        limit: int | None = None,
        **_: Any,
    ) -> ReadTextFileResponse:
        offset = max(0, (line or 1) - 1)
        try:
            content = await asyncio.to_thread(  # the tools block: off the event loop
                self.run.tools.read, path, offset=offset, limit=limit, kind=ActionKind.ACP_READ
            )
        except CcServerError as exc:
            self.file_requests.append(
                {"method": "fs/read_text_file", "path": path, "refused": exc.message}
            )
            raise self._refused(exc) from None
        self.file_requests.append({"method": "fs/read_text_file", "path": path, "refused": None})
        return ReadTextFileResponse(content=content)

    async def write_text_file(
        self, session_id: str, path: str, content: str, **_: Any
    ) -> WriteTextFileResponse | None:
        try:
            await asyncio.to_thread(
                self.run.tools.write, path, content, kind=ActionKind.ACP_WRITE
            )
        except CcServerError as exc:
            self.file_requests.append(
                {"method": "fs/write_text_file", "path": path, "refused": exc.message}
            )
            raise self._refused(exc) from None
        self.file_requests.append({"method": "fs/write_text_file", "path": path, "refused": None})
        return WriteTextFileResponse()

    # -- permission --

    async def request_permission(
        self, session_id: str, tool_call: ToolCallUpdate, options: list[PermissionOption], **_: Any
    ) -> RequestPermissionResponse:
        # The file tools' checks resolve paths: off the event loop.
        allowed, why = await asyncio.to_thread(judge_tool_call, self.run, tool_call)
        wanted = "allow_once" if allowed else "reject_once"  # never an "always": see the module
        chosen = next((o for o in options if o.kind == wanted), None)
        self.permissions.append(
            {
                "toolCallId": tool_call.tool_call_id,
                "kind": tool_call.kind,
                "title": tool_call.title,
                "allowed": allowed,
                "reason": why,
                "optionId": None if chosen is None else chosen.option_id,
            }
        )
        if not allowed:
            paths = _tool_call_paths(tool_call)
            raw = tool_call.raw_input if isinstance(tool_call.raw_input, dict) else {}
            command = raw.get("command")
            target = (command if isinstance(command, str) and command else None) or (
                ", ".join(paths) or tool_call.title or str(tool_call.kind))
            self.run.violations.record(RunViolation(
                action=f"permission-{tool_call.kind or 'unknown'}", target=target, reason=why,
                source=ViolationSource.PERMISSION))
        if chosen is None:  # no once-option says what the policy decided: cancel, never allow
            return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        return RequestPermissionResponse(
            outcome=AllowedOutcome(outcome="selected", option_id=chosen.option_id)
        )

    # -- updates --

    async def session_update(self, session_id: str, update: Any, **_: Any) -> None:
        dump = (
            update.model_dump(mode="json", by_alias=True, exclude_none=True)
            if hasattr(update, "model_dump")
            else update
        )
        self.updates.append(dump)

    # -- terminals (the harness bash tool) --

    async def create_terminal(
        self,
        session_id: str,
        command: str,
        args: list[str] | None = None,
        env: list[EnvVariable] | None = None,
        cwd: str | None = None,
        output_byte_limit: int | None = None,
        **_: Any,
    ) -> CreateTerminalResponse:
        argv = (command, *args) if args else shell_argv(command)
        try:
            extra = sanitized_env({v.name: v.value for v in env or ()})
            terminal = await self.run.harness.start(
                argv, env=extra, cwd=cwd, output_limit=output_byte_limit
            )
        except CcServerError as exc:
            raise self._refused(exc) from None
        return CreateTerminalResponse(terminal_id=terminal.terminal_id)

    def _terminal(self, terminal_id: str) -> Any:
        try:
            return self.run.harness.terminal(terminal_id)
        except BadSpec as exc:
            raise RequestError.invalid_params(
                {"terminalId": terminal_id, "message": exc.message}
            ) from None

    @staticmethod
    def _exit(terminal: Any) -> TerminalExitStatus | None:
        if not terminal.done:
            return None
        return TerminalExitStatus(
            exit_code=terminal.exit_code, signal="SIGKILL" if terminal.killed else None
        )

    async def terminal_output(
        self, session_id: str, terminal_id: str, **_: Any
    ) -> TerminalOutputResponse:
        terminal = self._terminal(terminal_id)
        return TerminalOutputResponse(
            output=terminal.output.text(),
            truncated=terminal.output.truncated,
            exit_status=self._exit(terminal),
        )

    async def wait_for_terminal_exit(
        self, session_id: str, terminal_id: str, **_: Any
    ) -> WaitForTerminalExitResponse:
        terminal = self._terminal(terminal_id)
        code = await terminal.wait()
        return WaitForTerminalExitResponse(
            exit_code=code, signal="SIGKILL" if terminal.killed else None
        )

    async def kill_terminal(
        self, session_id: str, terminal_id: str, **_: Any
    ) -> KillTerminalResponse | None:
        await self._terminal(terminal_id).kill()
        return KillTerminalResponse()

    async def release_terminal(
        self, session_id: str, terminal_id: str, **_: Any
    ) -> ReleaseTerminalResponse | None:
        await self.run.harness.release(terminal_id)
        return ReleaseTerminalResponse()


class AcpSession:
    """A live ACP agent of a run: its execution, the connection, and what it said."""

    def __init__(
        self, run: DispatchRun, execution: Execution, stack: contextlib.AsyncExitStack
    ) -> None:
        self._stack = stack  # holds the execution's `open_exec` block
        self.run = run
        self.execution = execution
        self.transport = ExecutionTransport(execution)
        self.client = CcAcpClient(run)
        self.connection = ClientSideConnection(self.client, self.transport)  # type: ignore[arg-type]
        self.agent_info: dict[str, Any] | None = None
        self.protocol_version: int | None = None
        self.session_id: str | None = None
        self._closed = False

    async def handshake(self) -> None:
        """initialize, then session/new in the worktree.

        Raises:
            EnforcementFailed: the agent did not complete the handshake (it exited, timed out,
                or answered with an error); its stderr tail is in the message.
        """
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                init = await self.connection.initialize(
                    protocol_version=PROTOCOL_VERSION,
                    client_capabilities=ClientCapabilities(
                        fs=FileSystemCapabilities(read_text_file=True, write_text_file=True),
                        terminal=True,
                    ),
                    client_info=Implementation(name="cc-server", version=__version__),
                )
                self.protocol_version = init.protocol_version
                info = getattr(init, "agent_info", None)
                self.agent_info = (
                    None
                    if info is None
                    else info.model_dump(mode="json", by_alias=True, exclude_none=True)
                )
                session = await self.connection.new_session(
                    cwd=self.run.worktree.path, mcp_servers=[]
                )
                self.session_id = session.session_id
        except (TimeoutError, RequestError, ConnectionError, OSError) as exc:
            raise EnforcementFailed(
                "the ACP agent did not complete initialize and session/new: "
                f"{type(exc).__name__}: {exc}; "
                f"its stderr: {self.transport.stderr_text()[-2000:]!r}",
                fix="check the agent command (CC_SERVER_ACP_AGENT) and that it speaks ACP on stdio",
            ) from exc

    def to_json(self) -> dict[str, Any]:
        """The API form."""
        return {
            "protocolVersion": self.protocol_version,
            "agentInfo": self.agent_info,
            "sessionId": self.session_id,
            "fileRequests": list(self.client.file_requests),
            "permissions": list(self.client.permissions),
            "updates": len(self.client.updates),
        }

    async def prompt(self, text: str) -> dict[str, Any]:
        """Send one user prompt; the agent's stop reason when it is done.

        Raises:
            EnforcementFailed: no session, or the agent answered with an error.
        """
        from acp import text_block

        if self.session_id is None:
            raise EnforcementFailed("the ACP session was not created")
        try:
            response = await self.connection.prompt(
                session_id=self.session_id, prompt=[text_block(text)]
            )
        except (RequestError, ConnectionError) as exc:
            raise EnforcementFailed(f"the ACP agent failed the prompt: {exc}") from exc
        dumped: dict[str, Any] = response.model_dump(mode="json", by_alias=True, exclude_none=True)
        return dumped

    async def aclose(self) -> None:
        """Close the connection and kill the agent. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            await self.connection.close()
        await self.execution.kill(reason="closed")
        with contextlib.suppress(Exception):
            await self._stack.aclose()


async def start_acp(run: DispatchRun) -> AcpSession:
    """Spawn the run's ACP agent in its sandbox and complete initialize and session/new.

    Raises:
        BadSpec: the run has no agent command.
        EnforcementFailed: the handshake failed (the agent is killed).
        CcServerError: the sandbox could not start the agent.
    """
    if run.agent_argv is None:
        raise BadSpec("this run has no ACP agent command")
    stack = contextlib.AsyncExitStack()
    execution = await stack.enter_async_context(run.handle.open_exec(
        (*run.agent_prefix, *run.agent_argv),
        env=run.env,
        cwd=run.worktree.path,
        interactive_stdin=True,
    ))
    session = AcpSession(run, execution, stack)
    run.acp = session
    try:
        await session.handshake()
    except BaseException:
        await session.aclose()
        run.acp = None
        raise
    return session


async def prompt_acp(run: DispatchRun, text: str) -> dict[str, Any]:
    """One prompt to the run's ACP agent: its answer, the ACP exchanges so far and the
    violations the prompt caused, as JSON data.

    Raises:
        BadSpec: the run has no ACP agent. EnforcementFailed: as `AcpSession.prompt`.
    """
    if run.acp is None:
        raise BadSpec(f"run {run.run_id} has no ACP agent", fix="open it with agent 'acp'")
    mark = run.violations.mark()
    response = await run.acp.prompt(text)
    return {"response": response, "acp": run.acp.to_json(),
            "violations": [v.to_json() for v in run.violations.since(mark)]}
