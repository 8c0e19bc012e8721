"""Sandbox states and events: the transition table, pair by pair, and the camelCase JSON."""

from __future__ import annotations

import itertools

import pytest

from cc_server.runtime.events import (
    EgressChanged,
    EventType,
    IllegalTransition,
    SandboxEvent,
    SandboxState,
    SandboxViolation,
    check_transition,
)

S = SandboxState

# Written out by hand from the lifecycle, not imported: a change to events.py must change this.
ALLOWED: dict[SandboxState, set[SandboxState]] = {
    S.CREATED: {S.WARM, S.ERROR, S.DESTROYED},
    S.WARM: {S.ACTIVE, S.SUSPENDED, S.ERROR, S.DESTROYED},
    S.ACTIVE: {S.WARM, S.ERROR, S.DESTROYED},
    S.SUSPENDED: {S.WARM, S.ERROR, S.DESTROYED},
    S.ERROR: {S.DESTROYED},
    S.DESTROYED: set(),
}
PAIRS = list(itertools.product(SandboxState, repeat=2))
LEGAL = [(a, b) for a, b in PAIRS if a is b or b in ALLOWED[a]]
ILLEGAL = [(a, b) for a, b in PAIRS if (a, b) not in LEGAL]


def test_table_covers_every_state() -> None:
    assert set(ALLOWED) == set(SandboxState)
    assert len(LEGAL) + len(ILLEGAL) == len(SandboxState) ** 2 == 36
    assert len(ILLEGAL) == 36 - 6 - 14


@pytest.mark.parametrize(("current", "new"), LEGAL, ids=[f"{a}->{b}" for a, b in LEGAL])
def test_allowed_transition(current: SandboxState, new: SandboxState) -> None:
    check_transition(current, new)


@pytest.mark.parametrize(("current", "new"), ILLEGAL, ids=[f"{a}->{b}" for a, b in ILLEGAL])
def test_illegal_transition(current: SandboxState, new: SandboxState) -> None:
    with pytest.raises(IllegalTransition) as info:
        check_transition(current, new)
    assert str(info.value) == f"illegal sandbox state transition {current} -> {new}"


def test_destroyed_and_error_are_nearly_terminal() -> None:
    assert [b for a, b in LEGAL if a is S.DESTROYED] == [S.DESTROYED]
    assert {b for a, b in LEGAL if a is S.ERROR} == {S.ERROR, S.DESTROYED}
    assert not [a for a, b in LEGAL if b is S.SUSPENDED and a is not S.WARM and a is not b]


def test_state_and_event_names() -> None:
    assert [str(s) for s in SandboxState] == [
        "created", "warm", "active", "suspended", "destroyed", "error",
    ]  # fmt: skip
    assert [str(t) for t in EventType] == [
        "starting", "ready", "stdout", "stderr", "violation", "killed", "exit",
        "egress-changed", "egress-request",  # ours: egress decided while the session runs
    ]  # fmt: skip
    assert issubclass(IllegalTransition, RuntimeError)


# --- JSON --------------------------------------------------------------------------------------

VIOLATION = SandboxViolation(
    action="file-write", target="/work/repo/.git/hooks/pre-commit",
    suggested_capability="canPush", raw="EROFS",
)  # fmt: skip


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (
            SandboxEvent(type=EventType.STARTING, session_id="s1", exec_id="e1"),
            {"type": "starting", "sessionId": "s1", "execId": "e1"},
        ),
        (
            SandboxEvent(type=EventType.READY, session_id="s1"),
            {"type": "ready", "sessionId": "s1"},
        ),
        (
            SandboxEvent(type=EventType.STDOUT, session_id="s1", exec_id="e1", data=b"hi\n"),
            {"type": "stdout", "sessionId": "s1", "execId": "e1", "data": "hi\n"},
        ),
        (
            SandboxEvent(type=EventType.STDERR, session_id="s1", exec_id="e1",
                         data=b"bad \xff byte"),
            {"type": "stderr", "sessionId": "s1", "execId": "e1", "data": "bad \ufffd byte"},
        ),
        (
            SandboxEvent(type=EventType.STDOUT, session_id="s1", data=b""),
            {"type": "stdout", "sessionId": "s1", "data": ""},
        ),
        (
            SandboxEvent(type=EventType.VIOLATION, session_id="s1", exec_id="e1",
                         violation=VIOLATION),
            {
                "type": "violation", "sessionId": "s1", "execId": "e1",
                "violation": {
                    "action": "file-write", "target": "/work/repo/.git/hooks/pre-commit",
                    "suggestedCapability": "canPush", "raw": "EROFS",
                },
            },
        ),
        (
            SandboxEvent(type=EventType.KILLED, session_id="s1", exec_id="e1", reason="timeout"),
            {"type": "killed", "sessionId": "s1", "execId": "e1", "reason": "timeout"},
        ),
        (
            SandboxEvent(type=EventType.EXIT, session_id="s1", exec_id="e1", exit_code=0),
            {"type": "exit", "sessionId": "s1", "execId": "e1", "exitCode": 0},
        ),
        (
            SandboxEvent(type=EventType.EXIT, session_id="s1", exec_id="e1", exit_code=137),
            {"type": "exit", "sessionId": "s1", "execId": "e1", "exitCode": 137},
        ),
    ],
    ids=lambda v: getattr(getattr(v, "type", None), "value", None),
)  # fmt: skip
def test_event_to_json(event: SandboxEvent, expected: dict[str, object]) -> None:
    assert event.to_json() == expected


def test_violation_to_json_with_and_without_optionals() -> None:
    assert VIOLATION.to_json() == {
        "action": "file-write",
        "target": "/work/repo/.git/hooks/pre-commit",
        "suggestedCapability": "canPush",
        "raw": "EROFS",
    }
    bare = SandboxViolation(action="network-connect", target="evil.example:443")
    assert bare.to_json() == {
        "action": "network-connect",
        "target": "evil.example:443",
        "suggestedCapability": None,
        "raw": None,
    }


def test_egress_fields_are_in_json_only_when_set() -> None:
    refused = SandboxViolation(action="network-outbound", target="x.example:443",
                               reason="not listed", fix="--allow-domain x.example:443")
    assert refused.to_json()["reason"] == "not listed"
    assert refused.to_json()["fix"] == "--allow-domain x.example:443"
    assert "reason" not in SandboxViolation(action="a", target="t").to_json()
    change = EgressChanged(added=("x.example:443",), removed=(), by="api")
    event = SandboxEvent(type=EventType.EGRESS_CHANGED, session_id="s", egress=change)
    assert event.to_json() == {
        "type": "egress-changed", "sessionId": "s",
        "egress": {"added": ["x.example:443"], "removed": [], "by": "api"},
    }
