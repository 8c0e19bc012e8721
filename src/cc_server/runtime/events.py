"""Sandbox states, events and violations, with the reference page's names."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

__all__ = [
    "EgressChanged",
    "EgressRequest",
    "EventType",
    "IllegalTransition",
    "SandboxEvent",
    "SandboxState",
    "SandboxViolation",
    "check_transition",
]


class SandboxState(enum.StrEnum):
    """Lifecycle state of a sandbox handle."""

    CREATED = "created"  # spec accepted, nothing started yet
    WARM = "warm"  # ready to exec commands
    ACTIVE = "active"  # executing at least one command
    SUSPENDED = "suspended"  # paused / checkpointed to disk
    DESTROYED = "destroyed"  # torn down; the handle is no longer valid
    ERROR = "error"  # launch failed; see SandboxHandle.error


_ALLOWED: Final[dict[SandboxState, frozenset[SandboxState]]] = {
    SandboxState.CREATED: frozenset(
        {SandboxState.WARM, SandboxState.ERROR, SandboxState.DESTROYED}
    ),
    SandboxState.WARM: frozenset(
        {SandboxState.ACTIVE, SandboxState.SUSPENDED, SandboxState.ERROR, SandboxState.DESTROYED}
    ),
    SandboxState.ACTIVE: frozenset(
        {SandboxState.WARM, SandboxState.ERROR, SandboxState.DESTROYED}
    ),
    SandboxState.SUSPENDED: frozenset(
        {SandboxState.WARM, SandboxState.ERROR, SandboxState.DESTROYED}
    ),
    SandboxState.ERROR: frozenset({SandboxState.DESTROYED}),
    SandboxState.DESTROYED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A state change the lifecycle does not allow: a bug in cc-server, never a user error."""


def check_transition(current: SandboxState, new: SandboxState) -> None:
    """Raise IllegalTransition unless `current -> new` is allowed (staying put is allowed)."""
    if new is not current and new not in _ALLOWED[current]:
        raise IllegalTransition(f"illegal sandbox state transition {current} -> {new}")


class EventType(enum.StrEnum):
    """Event types a sandbox emits."""

    STARTING = "starting"
    READY = "ready"
    STDOUT = "stdout"
    STDERR = "stderr"
    VIOLATION = "violation"
    KILLED = "killed"
    EXIT = "exit"
    EGRESS_CHANGED = "egress-changed"  # the session's allowlist changed while it runs
    EGRESS_REQUEST = "egress-request"  # a connection is held until someone answers (ask mode)


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxViolation:
    """A refused operation: the denied verb, its target, and what would allow it."""

    action: str
    target: str
    suggested_capability: str | None = None
    raw: str | None = None
    reason: str | None = None  # why, in one sentence (egress refusals)
    fix: str | None = None  # what would allow it, or why nothing can (egress refusals)

    def to_json(self) -> dict[str, object]:
        """The spec's camelCase form, plus `reason` and `fix` when they are known."""
        out: dict[str, object] = {
            "action": self.action,
            "target": self.target,
            "suggestedCapability": self.suggested_capability,
            "raw": self.raw,
        }
        if self.reason is not None:
            out["reason"] = self.reason
        if self.fix is not None:
            out["fix"] = self.fix
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class EgressChanged:
    """A change to a running session's egress allowlist, effective for its next connection."""

    added: tuple[str, ...]  # canonical entries (`host:443`)
    removed: tuple[str, ...]
    by: str  # who asked: "library", "api", "dispatch", "approval"

    def to_json(self) -> dict[str, object]:
        """camelCase JSON."""
        return {"added": list(self.added), "removed": list(self.removed), "by": self.by}


@dataclass(frozen=True, slots=True, kw_only=True)
class EgressRequest:
    """A connection to a target the allowlist does not name, held until it is answered
    (`once`, `session` or `deny`) or its time is up (a denial, reported as a violation)."""

    id: str  # answer with this
    host: str  # the canonical name or address
    port: int
    protocol: str  # http or socks5: which proxy holds it
    entry: str  # the allowlist entry `session` adds: exactly host:port
    timeout_s: float  # no answer in this time is a denial
    commands: tuple[tuple[str, ...], ...] = ()  # the argv of each command running then (the
    # proxies cannot tell which one connected)

    def to_json(self) -> dict[str, object]:
        """camelCase JSON."""
        return {"id": self.id, "host": self.host, "port": self.port, "protocol": self.protocol,
                "entry": self.entry, "timeoutS": self.timeout_s,
                "commands": [list(argv) for argv in self.commands]}


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxEvent:
    """One event on a sandbox handle. Which optional fields are set depends on `type`."""

    type: EventType
    session_id: str
    exec_id: str | None = None
    data: bytes | None = None  # stdout / stderr
    exit_code: int | None = None  # exit
    reason: str | None = None  # killed: "timeout", "manual", "destroyed"
    violation: SandboxViolation | None = None  # violation
    egress: EgressChanged | None = None  # egress-changed
    request: EgressRequest | None = None  # egress-request

    def to_json(self) -> dict[str, object]:
        """camelCase JSON; output bytes are decoded as UTF-8 with replacement characters."""
        out: dict[str, object] = {"type": str(self.type), "sessionId": self.session_id}
        if self.exec_id is not None:
            out["execId"] = self.exec_id
        if self.data is not None:
            out["data"] = self.data.decode("utf-8", errors="replace")
        if self.exit_code is not None:
            out["exitCode"] = self.exit_code
        if self.reason is not None:
            out["reason"] = self.reason
        if self.violation is not None:
            out["violation"] = self.violation.to_json()
        if self.egress is not None:
            out["egress"] = self.egress.to_json()
        if self.request is not None:
            out["request"] = self.request.to_json()
        return out
