"""The driver's live controls on real loopback sockets: the allowlist replaced between
connections, and the asker (ask mode): who is asked, what its answer does, and the handshake
deadline around the wait. Names resolve through the fake resolver of test_egress_driver."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from test_egress_driver import (
    DEFAULT_LIMITS,
    FakeResolver,
    allowlist,
    close,
    connect_request,
    echo,
    http_connect,
    refused_reply,
    upstream,
)

from cc_server.egress.driver import (
    AskAnswer,
    Asker,
    EgressAsk,
    EgressRefused,
    ProxyLimits,
    ProxyParams,
    SessionProxies,
    open_session_proxies,
)
from cc_server.egress.patterns import Allowlist


@contextlib.asynccontextmanager
async def proxies_with(
    allow: Allowlist, asker: Asker | None, limits: ProxyLimits = DEFAULT_LIMITS
) -> AsyncIterator[tuple[SessionProxies, list[EgressRefused]]]:
    refusals: list[EgressRefused] = []
    params = ProxyParams(session_id="live", allowlist=allow, on_refused=refusals.append,
                         resolver=FakeResolver(), limits=limits, ask=asker)
    async with open_session_proxies(params) as proxies:
        yield proxies, refusals


class Recorder:
    """An asker that records what it is asked and answers `answer` after `delay_s`."""

    def __init__(self, answer: AskAnswer, delay_s: float = 0.0) -> None:
        self.answer = answer
        self.delay_s = delay_s
        self.asked: list[EgressAsk] = []

    async def __call__(self, ask: EgressAsk) -> AskAnswer:
        self.asked.append(ask)
        await asyncio.sleep(self.delay_s)
        return self.answer


async def tunnel_echoes(proxy_port: int, target: str) -> bool:
    reader, writer, head = await http_connect(proxy_port, target)
    try:
        if not head.startswith(b"HTTP/1.1 200"):
            return False
        writer.write(b"ping")
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
    finally:
        await close(writer)


async def test_an_unlisted_name_is_asked_and_an_approval_opens_the_tunnel() -> None:
    # allowed.test resolves to 127.0.0.1, which is listed: only the name itself is asked about.
    asker = Recorder(AskAnswer(allowed=True))
    async with upstream(echo) as port, proxies_with(allowlist("127.0.0.1"), asker) as (p, refused):
        assert p.http_port is not None
        assert await tunnel_echoes(p.http_port, f"allowed.test:{port}")
    assert asker.asked == [EgressAsk(host="allowed.test", port=port, protocol="http",
                                     kind="connect")]
    assert asker.asked[0].entry == f"allowed.test:{port}"
    assert refused == []


async def test_a_refusal_when_asked_is_a_403_and_one_report() -> None:
    asker = Recorder(AskAnswer(allowed=False, reason="allowed.test:9 was refused when asked"))
    async with proxies_with(allowlist("127.0.0.1"), asker) as (p, refused):
        assert p.http_port is not None
        reply = await refused_reply(p.http_port, connect_request("allowed.test:9"))
    assert reply.startswith(b"HTTP/1.1 403 ")
    assert b"refused when asked" in reply
    assert [(r.host, r.port, r.reason) for r in refused] == [
        ("allowed.test", 9, "allowed.test:9 was refused when asked")
    ]
    assert "--allow-domain allowed.test:9" in refused[0].how_to_allow


@pytest.mark.parametrize(
    "target",
    [
        "denied.test:80",  # on the deny list
        "169.254.169.254:80",  # metadata, as a literal
        "127.0.0.2:80",  # loopback, not listed as a literal
        "metadata.allowed.test:80",  # a name that resolves to metadata
        "unresolvable.test:80",  # an upstream failure: nothing to offer
    ],
)
async def test_what_no_entry_could_allow_is_never_asked(target: str) -> None:
    asker = Recorder(AskAnswer(allowed=True))
    allow = allowlist("127.0.0.1", denied=("denied.test",))
    async with proxies_with(allow, asker) as (p, _):
        assert p.http_port is not None
        reply = await refused_reply(p.http_port, connect_request(target))
    assert reply.startswith((b"HTTP/1.1 403 ", b"HTTP/1.1 502 ")), reply
    assert asker.asked == []


async def test_with_the_network_off_nothing_is_asked() -> None:
    asker = Recorder(AskAnswer(allowed=True))
    async with proxies_with(Allowlist(), asker) as (p, refused):
        assert p.http_port is not None
        reply = await refused_reply(p.http_port, connect_request("allowed.test:80"))
    assert reply.startswith(b"HTTP/1.1 403 ") and asker.asked == []
    assert refused[0].how_to_allow.startswith("nothing while the session's network is off")


async def test_the_wait_does_not_count_against_the_handshake_deadline() -> None:
    asker = Recorder(AskAnswer(allowed=True), delay_s=0.6)
    limits = ProxyLimits(handshake_timeout_s=0.3)
    async with upstream(echo) as port, proxies_with(allowlist("127.0.0.1"), asker, limits) as (
        p, _
    ):
        assert p.http_port is not None
        assert await tunnel_echoes(p.http_port, f"allowed.test:{port}")


async def test_an_asker_that_fails_refuses() -> None:
    async def broken(ask: EgressAsk) -> AskAnswer:
        raise RuntimeError("the prompt went away")

    async with proxies_with(allowlist("127.0.0.1"), broken) as (p, refused):
        assert p.http_port is not None
        reply = await refused_reply(p.http_port, connect_request("allowed.test:80"))
    assert reply.startswith(b"HTTP/1.1 403 ")
    assert "asking failed" in refused[0].reason


async def test_the_allowlist_and_the_asker_change_between_connections() -> None:
    async with upstream(echo) as port, proxies_with(allowlist("127.0.0.1"), None) as (p, _):
        assert p.http_port is not None
        assert not await tunnel_echoes(p.http_port, f"allowed.test:{port}")  # not listed
        p.set_allowlist(allowlist("127.0.0.1", "allowed.test"))
        assert await tunnel_echoes(p.http_port, f"allowed.test:{port}")
        p.set_allowlist(allowlist("127.0.0.1"))
        assert not await tunnel_echoes(p.http_port, f"allowed.test:{port}")
        p.set_asker(Recorder(AskAnswer(allowed=True)))
        assert await tunnel_echoes(p.http_port, f"allowed.test:{port}")
        p.set_asker(None)
        assert not await tunnel_echoes(p.http_port, f"allowed.test:{port}")
        with pytest.raises(ValueError, match="deny list cannot change"):
            p.set_allowlist(allowlist("127.0.0.1", denied=("x.test",)))
