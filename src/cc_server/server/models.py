"""The API's request and response bodies as msgspec structs: decoded strictly (unknown fields are
rejected) and published in the OpenAPI document. Response shapes mirror what the runtime's
`to_json()` methods produce; a unit test keeps the two in step.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from cc_server.policy import SandboxBackend, SandboxSpec
from cc_server.runtime.events import EventType, SandboxState

__all__ = [
    "CreateSandboxRequest",
    "EgressAnswerRequest",
    "EgressChangeRequest",
    "EgressChangedView",
    "EgressRequestView",
    "EgressStreamInput",
    "EgressView",
    "ErrorBody",
    "ExecRequest",
    "ExecResult",
    "ExecStreamInput",
    "Health",
    "KillResult",
    "SandboxEventView",
    "SandboxHandleView",
    "SandboxList",
    "SandboxViolationView",
    "SessionStreamInput",
    "TerminalControl",
    "TerminalSessionView",
    "WindowSize",
]


class _Body(msgspec.Struct, rename="camel", forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


_AskTimeout = Annotated[float, msgspec.Meta(gt=0, le=600, description="Seconds a held "
                                            "connection waits for an answer")]


class CreateSandboxRequest(_Body, frozen=True):
    """POST /v1/sandboxes."""

    spec: SandboxSpec  # what to launch; the reference page's SandboxSpec
    backend: SandboxBackend | None = None  # unspecified: native when the host offers it, else none
    egress: Literal["allowlist", "ask"] = "allowlist"  # ask: hold an unlisted target's
    # connection and send an egress-request event (answered once, session or deny)
    egress_ask_timeout_s: _AskTimeout = 30.0  # ask: no answer in this time is a denial


class CreateSandboxWire(_Body, frozen=True):
    """CreateSandboxRequest as decoded: the spec is kept raw so parse_spec names its errors."""

    spec: msgspec.Raw
    backend: str | None = None
    egress: Literal["allowlist", "ask"] = "allowlist"
    egress_ask_timeout_s: _AskTimeout = 30.0


_Argv = Annotated[list[str], msgspec.Meta(min_length=1, description="Program and arguments")]
_Timeout = Annotated[float, msgspec.Meta(gt=0, description="Kill the command after this many s")]


class ExecRequest(_Body, frozen=True):
    """POST /v1/sandboxes/{id}/exec, and the first message on the exec WebSocket."""

    argv: _Argv  # the program (searched in the sandbox's PATH) and its arguments
    env: dict[str, str] | None = None  # the command's exact environment (native adds PATH, HOME)
    cwd: str | None = None  # absolute working directory; default: the sandbox's workdir
    stdin: str | None = None  # text written to stdin, then closed (POST) / left open (WebSocket)
    stdin_base64: str | None = None  # the same, as base64 bytes; not with `stdin`
    timeout_s: _Timeout | None = None  # kill the command after this many seconds


class SandboxViolationView(_Body, frozen=True, omit_defaults=True):
    """A refused operation (SandboxViolation)."""

    action: str  # the denied verb: file-read*, network-outbound, ...
    target: str  # path or host:port
    suggested_capability: str | None  # the capability that would allow it
    raw: str | None  # the raw log line, for debugging
    reason: str | None = None  # why, in one sentence (egress refusals)
    fix: str | None = None  # what would allow it, or why nothing can (egress refusals)


_Entries = Annotated[
    list[str],
    msgspec.Meta(max_length=256, description="Allowlist entries: host, *.domain, a.*.b or an IP "
                 "literal, each with an optional :port ([2001:db8::1]:8080)"),
]


class EgressChangeRequest(_Body, frozen=True, omit_defaults=True):
    """PATCH /v1/sandboxes/{id}/egress: removals first, then additions; for the next connection."""

    allow: _Entries = msgspec.field(default_factory=list)  # entries to add
    remove: _Entries = msgspec.field(default_factory=list)  # entries to remove (exact text)
    ask: bool | None = None  # true: hold unlisted targets and ask (egress-request); false: stop
    ask_timeout_s: _AskTimeout = 30.0  # with ask true: no answer in this time is a denial


class EgressChangedView(_Body, frozen=True):
    """A change to a running session's allowlist (the `egress-changed` event's `egress`)."""

    added: list[str]  # canonical entries added (not those already there)
    removed: list[str]  # canonical entries removed (not those that were not there)
    by: str  # who asked: api, library, dispatch, approval


class EgressRequestView(_Body, frozen=True):
    """A connection held until it is answered (the `egress-request` event's `request`)."""

    id: str  # answer with POST /v1/sandboxes/{id}/egress/requests/{requestId}
    host: str  # the canonical name or address
    port: int
    protocol: str  # http or socks5
    entry: str  # what `session` adds to the allowlist: exactly host:port
    timeout_s: float  # no answer in this time is a denial, reported as a violation
    commands: list[list[str]]  # the argv of each command running when it was asked


class EgressStreamInput(_Body, frozen=True):
    """A client message on the egress WebSocket (GET /v1/sandboxes/{id}/egress/ws)."""

    egress_answer: EgressAnswerRequest  # answer an egress-request (by its id)


class EgressView(_Body, frozen=True, omit_defaults=True):
    """GET and PATCH /v1/sandboxes/{id}/egress: the allowlist now, and what a PATCH changed."""

    entries: list[str]  # the session's allowlist, canonical, in order
    denied: list[str]  # the deny list (wins over every entry; cannot change)
    asking: bool  # unlisted targets are held and asked about (created with egress: ask)
    requests: list[EgressRequestView]  # the requests waiting for an answer
    change: EgressChangedView | None = None  # PATCH: what it did


class EgressAnswerRequest(_Body, frozen=True):
    """POST /v1/sandboxes/{id}/egress/requests/{requestId}, and `egressAnswer` on the exec
    WebSocket (with `id`)."""

    answer: Literal["once", "session", "deny"]  # session adds the request's host:port entry
    id: str | None = None  # the request (WebSocket only; the URL names it otherwise)


class ExecResult(_Body, frozen=True):
    """The collected result of POST /v1/sandboxes/{id}/exec. Each stream keeps its first
    CC_SERVER_EXEC_OUTPUT_LIMIT bytes (16 MiB by default); the rest is read, counted and
    dropped."""

    exit_code: int  # the command's exit code; 128+N when killed by signal N
    stdout: str  # the kept stdout as UTF-8, undecodable bytes replaced
    stderr: str  # the kept stderr as UTF-8, undecodable bytes replaced
    stdout_base64: str  # the kept stdout, exact bytes
    stderr_base64: str  # the kept stderr, exact bytes
    stdout_truncated: bool  # stdout went past the limit: what is kept is its head
    stderr_truncated: bool  # stderr went past the limit: what is kept is its head
    stdout_dropped_bytes: int  # stdout bytes past the limit, read and dropped
    stderr_dropped_bytes: int  # stderr bytes past the limit, read and dropped
    violations: list[SandboxViolationView]  # refusals during this command
    killed: bool  # the host killed the command
    killed_reason: str | None  # timeout, manual, destroyed, disconnected or shutdown


class SandboxHandleView(_Body, frozen=True):
    """A launched sandbox (SandboxHandle)."""

    session_id: str
    backend: SandboxBackend  # the backend actually running, never merely the one asked for
    state: SandboxState
    error: str | None  # set when state is error
    details: dict[str, Any]  # adapter bookkeeping (workdir, ...)
    violations: list[SandboxViolationView]  # every refusal so far


class SandboxList(_Body, frozen=True):
    """GET /v1/sandboxes."""

    sandboxes: list[SandboxHandleView]


class SandboxEventView(_Body, frozen=True, omit_defaults=True):
    """One event on the exec WebSocket (SandboxEvent)."""

    type: EventType
    session_id: str
    exec_id: str | None = None
    data: str | None = None  # stdout / stderr text (UTF-8; a character split across chunks is
    # delivered whole with the next chunk)
    exit_code: int | None = None  # exit
    reason: str | None = None  # killed: timeout, manual, destroyed, disconnected, shutdown
    violation: SandboxViolationView | None = None  # violation
    egress: EgressChangedView | None = None  # egress-changed
    request: EgressRequestView | None = None  # egress-request


class ExecStreamInput(_Body, frozen=True, omit_defaults=True):
    """A later client message on the exec WebSocket (any combination, applied in this order)."""

    stdin: str | None = None  # text to write to the command's stdin
    stdin_base64: str | None = None  # bytes to write, as base64
    stdin_close: bool = False  # send EOF
    kill: bool = False  # kill the command (it reports killed, then exit)
    egress_answer: EgressAnswerRequest | None = None  # answer an egress-request (by its id)


_CommandId = Annotated[str, msgspec.Meta(min_length=1, max_length=128, description="The "
                                          "client's name for a command on a session stream")]


class SessionStreamInput(_Body, frozen=True, omit_defaults=True):
    """A client message on the session stream (GET /v1/sandboxes/{id}/session/ws): `exec` starts
    a command under `id`; stdin, stdinBase64, stdinClose and kill go to the running command
    `id` (in this order); egressAnswer answers an egress-request."""

    id: _CommandId | None = None  # the command: unique among this stream's running commands
    exec: ExecRequest | None = None  # start a command (its stdin, if any, is in here)
    stdin: str | None = None  # text to write to the command's stdin
    stdin_base64: str | None = None  # bytes to write, as base64
    stdin_close: bool = False  # send EOF
    kill: bool = False  # kill the command (it reports killed, then exit)
    egress_answer: EgressAnswerRequest | None = None  # answer an egress-request (by its id)


class KillResult(_Body, frozen=True):
    """POST /v1/sandboxes/{id}/kill."""

    killed: int  # how many running commands were killed


class WindowSize(_Body, frozen=True):
    """A terminal window size."""

    rows: Annotated[int, msgspec.Meta(ge=1, le=10_000)]
    cols: Annotated[int, msgspec.Meta(ge=1, le=10_000)]


class TerminalControl(_Body, frozen=True, omit_defaults=True):
    """A JSON text frame on the terminal WebSocket."""

    resize: WindowSize | None = None  # set the PTY's window size (TIOCSWINSZ)
    input: str | None = None  # text typed into the terminal


class TerminalSessionView(_Body, frozen=True):
    """The first frame of a terminal WebSocket: the session's badge."""

    type: Literal["session"]
    session_id: str
    backend: SandboxBackend  # the backend actually running the shell
    cwd: str | None


class ErrorBody(_Body, frozen=True):
    """Every 4xx/5xx body, and the `error` frame on a WebSocket."""

    error: str  # BadSpec, BackendUnavailable, EnforcementFailed, NotFound, Conflict, ...
    message: str  # what is wrong
    fix: str | None = None  # how to fix it


class Health(_Body, frozen=True):
    """GET /healthz. No sandbox field, by design."""

    status: Literal["ok"]
