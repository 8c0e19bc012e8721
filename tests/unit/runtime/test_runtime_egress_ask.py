"""A session's approval queue and live changes without proxies: `SessionEgress.change`, `ask`,
`answer`, and the asker the proxies call (`_asked`), driven directly."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from cc_server.egress.baseline import BASELINE_DENIED
from cc_server.egress.driver import AskAnswer, EgressAsk
from cc_server.egress.patterns import Allowlist
from cc_server.errors import BadSpec, EnforcementFailed
from cc_server.runtime.egress import MAX_PENDING_REQUESTS, SessionEgress
from cc_server.runtime.events import EgressChanged, EgressRequest


def egress(tmp_path: pathlib.Path) -> tuple[SessionEgress, list[object]]:
    seen: list[object] = []
    session = SessionEgress(
        session_id="s", allowlist=Allowlist(denied=BASELINE_DENIED), suggest=lambda host: None,
        on_violation=seen.append, base_dir=str(tmp_path), on_change=seen.append,
        on_request=seen.append,
    )  # fmt: skip
    return session, seen


def ask(host: str = "pypi.org", port: int = 443) -> EgressAsk:
    return EgressAsk(host=host, port=port, protocol="http", kind="connect")


async def requested(seen: list[object], count: int = 1) -> list[EgressRequest]:
    for _ in range(100):
        found = [x for x in seen if isinstance(x, EgressRequest)]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {count} requests in {seen}")


async def test_once_session_and_deny(tmp_path: pathlib.Path) -> None:
    session, seen = egress(tmp_path)
    session.ask(timeout_s=5)
    assert session.asking
    for answer, allowed in (("once", True), ("deny", False), ("session", True)):
        waiting = asyncio.ensure_future(session._asked(ask()))
        request = (await requested(seen, 1))[-1]
        assert session.pending_requests == (request,)
        assert request.entry == "pypi.org:443" and request.timeout_s == 5
        session.answer(request.id, answer)
        result = await waiting
        assert result.allowed is allowed
        seen.remove(request)
    assert "pypi.org:443" in session.entries
    assert [x for x in seen if isinstance(x, EgressChanged)] == [
        EgressChanged(added=("pypi.org:443",), removed=(), by="approval")
    ]


async def test_no_answer_is_a_denial_for_every_connection_waiting(tmp_path: pathlib.Path) -> None:
    session, seen = egress(tmp_path)
    session.ask(timeout_s=0.2)
    first = asyncio.ensure_future(session._asked(ask()))
    await requested(seen)
    second = asyncio.ensure_future(session._asked(ask()))  # the same target: one request
    results = await asyncio.gather(first, second)
    assert [r.allowed for r in results] == [False, False]
    assert all("none came in 0.2 s" in r.reason for r in results)
    assert len([x for x in seen if isinstance(x, EgressRequest)]) == 1
    assert session.pending_requests == ()


async def test_too_many_waiting_are_refused_at_once(tmp_path: pathlib.Path) -> None:
    session, seen = egress(tmp_path)
    session.ask(timeout_s=5)
    held = [asyncio.ensure_future(session._asked(ask(port=1000 + i)))
            for i in range(MAX_PENDING_REQUESTS)]  # fmt: skip
    await requested(seen, MAX_PENDING_REQUESTS)
    over = await session._asked(ask(port=9))
    assert not over.allowed and "waiting for an answer already" in over.reason
    for request in session.pending_requests:
        session.answer(request.id, "deny")
    assert [r.allowed for r in await asyncio.gather(*held)] == [False] * MAX_PENDING_REQUESTS


async def test_bad_answers(tmp_path: pathlib.Path) -> None:
    session, seen = egress(tmp_path)
    session.ask(timeout_s=5)
    with pytest.raises(BadSpec, match="no egress request"):
        session.answer("nope", "once")
    waiting = asyncio.ensure_future(session._asked(ask()))
    request = (await requested(seen))[0]
    with pytest.raises(BadSpec, match="not an answer"):
        session.answer(request.id, "always")
    session.answer(request.id, "once")
    assert await waiting == AskAnswer(allowed=True)
    with pytest.raises(BadSpec, match="answered already"):
        session.answer(request.id, "once")
    with pytest.raises(BadSpec, match="positive"):
        session.ask(timeout_s=0)


async def test_changes_before_the_proxies_start_and_after_close(tmp_path: pathlib.Path) -> None:
    session, seen = egress(tmp_path)
    change = session.allow("a.example:443", "b.example")
    assert change == EgressChanged(added=("a.example:443", "b.example"), removed=(), by="library")
    assert session.remove("b.example", "c.example").removed == ("b.example",)
    assert session.allow("a.example:443") == EgressChanged(added=(), removed=(), by="library")
    assert [x for x in seen if isinstance(x, EgressChanged)] == [  # no event for no change
        change, EgressChanged(added=(), removed=("b.example",), by="library")
    ]
    assert session.allowlist.allows("a.example", 443).allowed
    await session.aclose()
    with pytest.raises(EnforcementFailed):
        session.allow("d.example")
