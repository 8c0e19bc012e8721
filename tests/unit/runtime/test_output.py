"""The bounded collector every collected result uses (`runtime.output`): the head is kept exactly,
the rest only counted, and the events are drained in one place."""

from __future__ import annotations

from collections.abc import AsyncIterator

from hypothesis import given
from hypothesis import strategies as st

from cc_server.runtime.events import EventType, SandboxEvent, SandboxViolation
from cc_server.runtime.output import BoundedOutput, drain


def test_the_head_is_kept_and_the_rest_counted() -> None:
    out = BoundedOutput(5)
    for chunk in (b"ab", b"cdef", b"gh"):
        out.add(chunk)
    assert (out.head(), out.dropped, out.truncated) == (b"abcde", 3, True)
    assert BoundedOutput(5).truncated is False


def test_exactly_the_limit_is_not_truncated() -> None:
    out = BoundedOutput(4)
    out.add(b"abcd")
    assert (out.head(), out.dropped, out.truncated) == (b"abcd", 0, False)
    out.add(b"")
    assert out.truncated is False
    out.add(b"e")
    assert (out.head(), out.dropped, out.truncated) == (b"abcd", 1, True)


def test_a_zero_limit_keeps_nothing_and_counts_everything() -> None:
    out = BoundedOutput(0)
    out.add(b"abc")
    out.add(b"de")
    assert (out.head(), out.dropped, out.text()) == (b"", 5, "")


@given(st.lists(st.binary(max_size=64), max_size=20), st.integers(min_value=0, max_value=400))
def test_any_chunks_keep_the_exact_head_and_count_the_exact_rest(
    chunks: list[bytes], limit: int
) -> None:
    out = BoundedOutput(limit)
    for chunk in chunks:
        out.add(chunk)
    whole = b"".join(chunks)
    assert out.head() == whole[:limit]
    assert out.dropped == max(0, len(whole) - limit)
    assert len(out.data) <= limit


def test_text_replaces_what_is_not_utf8() -> None:
    out = BoundedOutput(16)
    out.add("é".encode() + b"\xff")
    assert out.text() == "é\ufffd"


VIOLATION = SandboxViolation(action="network-outbound", target="evil.example:443")


def event(kind: EventType, **fields: object) -> SandboxEvent:
    return SandboxEvent(type=kind, session_id="s", exec_id="s:1", **fields)  # type: ignore[arg-type]


async def events(*items: SandboxEvent) -> AsyncIterator[SandboxEvent]:
    for item in items:
        yield item


async def test_drain_splits_the_streams_and_keeps_violations_and_the_end() -> None:
    out, err, violations = BoundedOutput(3), BoundedOutput(3), []
    drained = await drain(events(
        event(EventType.STARTING),
        event(EventType.STDOUT, data=b"12"),
        event(EventType.STDERR, data=b"e"),
        event(EventType.VIOLATION, violation=VIOLATION),
        event(EventType.STDOUT, data=b"345"),
        event(EventType.KILLED, reason="timeout"),
        event(EventType.EXIT, exit_code=137),
    ), out, err, violations)
    assert (drained.exit_code, drained.killed) == (137, "timeout")
    assert (out.head(), out.dropped, err.head(), err.dropped) == (b"123", 2, b"e", 0)
    assert violations == [VIOLATION]


async def test_drain_without_an_err_interleaves_both_streams() -> None:
    out, violations = BoundedOutput(10), []
    drained = await drain(events(
        event(EventType.STDOUT, data=b"o1 "),
        event(EventType.STDERR, data=b"e1 "),
        event(EventType.STDOUT, data=b"o2"),
        event(EventType.EXIT, exit_code=0),
    ), out, None, violations)
    assert (out.head(), drained.exit_code, drained.killed) == (b"o1 e1 o2", 0, None)


async def test_no_exit_event_is_minus_one() -> None:
    drained = await drain(events(), BoundedOutput(1), None, [])
    assert (drained.exit_code, drained.killed) == (-1, None)
