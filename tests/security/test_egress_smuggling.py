"""Request smuggling over a kept-alive HTTP proxy connection: a second request hidden in the
first one's body, a chunked body that lies about its size, a request for a refused host behind
an allowed one, an upstream response that sends more than it frames. Each is checked where it
would land: what the upstreams received, byte for byte, and the refusals the session reported.

Real sockets end to end: the session's proxies on loopback, a raw client socket, upstream
servers that record every byte each of their connections received. The proxies are the
boundary here (the sandbox reaches the network only through them), so no sandbox is started.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import h11
import pytest

from cc_server.egress.addresses import IPAddress
from cc_server.egress.driver import (
    AskAnswer,
    Asker,
    EgressAsk,
    EgressRefused,
    ProxyParams,
    SessionProxies,
    open_session_proxies,
)
from cc_server.egress.patterns import Allowlist, parse_rules

pytestmark = [pytest.mark.security, pytest.mark.integration]

OK = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\nok|%s"
TAIL = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil"


def ok(target: bytes) -> bytes:
    """The normal answer: a body naming the request's target."""
    return OK % (3 + len(target), target)


@dataclass
class Upstream:
    """An origin server on loopback: answers each request h11 parses with `ok`, and records
    every byte each connection received and each request's target. `short`: the first
    connection's first response frames 2 bytes and sends a whole second response (`TAIL`)
    after them, in the same write, or (`tail_later`) once `send_tail` is set. `first`: the
    first connection's first answer, as these raw bytes, after which it closes."""

    short: bool = False
    tail_later: bool = False
    first: bytes = b""
    port: int = 0
    received: list[bytearray] = field(default_factory=list)
    targets: list[list[bytes]] = field(default_factory=list)
    send_tail: asyncio.Event = field(default_factory=asyncio.Event)
    tail_sent: asyncio.Event = field(default_factory=asyncio.Event)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = len(self.received)
        raw, targets = bytearray(), list[bytes]()
        self.received.append(raw)
        self.targets.append(targets)
        conn = h11.Connection(h11.SERVER)
        with contextlib.suppress(ConnectionError, h11.ProtocolError):
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    raw += data
                    conn.receive_data(data)
                elif isinstance(event, h11.Request):
                    targets.append(event.target)
                elif isinstance(event, h11.EndOfMessage):
                    await self._answer(writer, number == 0 and len(targets) == 1, targets[-1])
                    # h11 only reads here (the answers are raw bytes): a fresh one per request
                    rest = conn.trailing_data[0]
                    conn = h11.Connection(h11.SERVER)
                    if rest:  # b"" would mean EOF
                        conn.receive_data(rest)
                elif isinstance(event, h11.ConnectionClosed):
                    break
        writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, first: bool, target: bytes) -> None:
        if self.first and first:
            writer.write(self.first)
            await writer.drain()
            writer.close()
            raise ConnectionResetError("closed after the first answer")
        if not (self.short and first):
            writer.write(ok(target))
        elif not self.tail_later:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" + TAIL)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await self.send_tail.wait()
            writer.write(TAIL)
            await writer.drain()
            self.tail_sent.set()
        await writer.drain()


async def loopback_resolver(host: str, port: int) -> list[IPAddress]:
    return [ipaddress.ip_address("127.0.0.1")]


@dataclass
class Lab:
    a: Upstream
    b: Upstream
    c: Upstream
    proxy_port: int
    refusals: list[EgressRefused]
    proxies: SessionProxies

    def only(self, *ups: Upstream) -> Allowlist:
        """An allowlist naming exactly these upstreams (each by its port)."""
        return Allowlist(
            patterns=parse_rules("test", [f"127.0.0.1:{up.port}" for up in ups], "test")
        )


@contextlib.asynccontextmanager
async def open_lab(a: Upstream | None = None, ask: Asker | None = None) -> AsyncIterator[Lab]:
    """Upstreams A and C are allowed (each by its own port), B is not. `ask`: an unlisted
    name is asked about (every name resolves to 127.0.0.1, whose address the list names)."""
    a = a or Upstream()
    b, c = Upstream(), Upstream()
    async with contextlib.AsyncExitStack() as stack:
        for up in (a, b, c):
            server = await asyncio.start_server(up.serve, "127.0.0.1", 0)
            await stack.enter_async_context(server)
            up.port = server.sockets[0].getsockname()[1]
        entries = [f"127.0.0.1:{a.port}", f"127.0.0.1:{c.port}"] + (["127.0.0.1"] if ask else [])
        allowlist = Allowlist(patterns=parse_rules("test", entries, "test"))
        refusals: list[EgressRefused] = []
        params = ProxyParams(
            session_id="smuggle",
            allowlist=allowlist,
            on_refused=refusals.append,
            ask=ask,
            resolver=loopback_resolver,
        )
        proxies = await stack.enter_async_context(open_session_proxies(params))
        assert proxies.http_port is not None
        yield Lab(a, b, c, proxies.http_port, refusals, proxies)


class Client:
    """A raw client of the HTTP proxy that reads responses with h11, one at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h11.Connection(h11.CLIENT)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, method: bytes = b"GET") -> tuple[int, bytes]:
        """The next response's status and body (method: of the request it answers)."""
        self.conn.send(h11.Request(method=method, target="/", headers=[("Host", "x")]))
        self.conn.send(h11.EndOfMessage())
        status, body = 0, b""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.reader.read(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
                    self.conn.start_next_cycle()
                return status, body
            else:
                raise AssertionError(f"no response: {event}")

    async def rest(self) -> bytes:
        """Everything until the proxy closes the connection."""
        return await asyncio.wait_for(self.reader.read(), 30)


@contextlib.asynccontextmanager
async def client(lab: Lab) -> AsyncIterator[Client]:
    reader, writer = await asyncio.open_connection("127.0.0.1", lab.proxy_port)
    try:
        yield Client(reader, writer)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def get(up: Upstream, path: str, extra: str = "") -> bytes:
    host = f"127.0.0.1:{up.port}"
    return f"GET http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()


async def settle(lab: Lab) -> None:
    """Let the upstreams read what the proxy sent before the lab is inspected."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_request_hidden_by_content_length_and_chunked_together_is_refused() -> None:
    async with open_lab() as lab, client(lab) as c:
        hidden = get(lab.b, "/hidden")
        body = b"0\r\n\r\n" + hidden
        host = f"127.0.0.1:{lab.a.port}"
        await c.send(
            f"POST http://{host}/upload HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Length: {len(body)}\r\nTransfer-Encoding: chunked\r\n\r\n".encode() + body
        )
        reply = await c.rest()
        await settle(lab)
    assert reply.startswith(b"HTTP/1.1 400 Bad Request\r\n"), reply[:80]
    assert b"Content-Length and Transfer-Encoding together" in reply
    assert lab.a.received == [] and lab.b.received == []  # no upstream saw a byte
    assert lab.refusals == []  # the hidden request was never read as one


@pytest.mark.parametrize(
    "chunk",
    [b"5x\r\nhello\r\n", b"-5\r\nhello\r\n", b"3\r\nhello\r\n", b"5\nhello\r\n"],
    ids=["junk-size", "negative-size", "size-too-short", "bare-lf"],
)
async def test_a_chunked_body_with_a_bad_size_or_extension_ends_the_connection(
    chunk: bytes,
) -> None:
    async with open_lab() as lab, client(lab) as c:
        host = f"127.0.0.1:{lab.a.port}"
        head = f"POST http://{host}/upload HTTP/1.1\r\nHost: {host}\r\n"
        await c.send(
            (head + "Transfer-Encoding: chunked\r\n\r\n").encode()
            + chunk
            + b"0\r\n\r\n"
            + get(lab.b, "/hidden")
            + get(lab.a, "/after")
        )
        reply = await c.rest()
        await settle(lab)
    assert reply.startswith(b"HTTP/1.1 400 Bad Request\r\n"), reply[:80]
    assert b"bad request body" in reply
    # A never received a complete request (at most its head), and nothing after it.
    for raw in lab.a.received:
        assert b"/hidden" not in raw and b"/after" not in raw
        assert not raw.endswith(b"0\r\n\r\n"), raw
    assert all(targets == [] for targets in lab.a.targets[1:])
    assert lab.b.received == []
    assert lab.refusals == []


@pytest.mark.parametrize("extension", [b";name=value", b';q="a\r\n0"', b";\x00"])
async def test_a_chunk_extension_never_reaches_the_upstream_and_what_follows_is_decided_alone(
    extension: bytes,
) -> None:
    async with open_lab() as lab, client(lab) as c:
        host = f"127.0.0.1:{lab.a.port}"
        await c.send(
            f"POST http://{host}/upload HTTP/1.1\r\nHost: {host}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
            + b"5"
            + extension
            + b"\r\nhello\r\n0\r\n\r\n"
            + get(lab.b, "/hidden")
        )
        first = await c.response()
        second = await c.response() if first[0] == 200 else (0, await c.rest())
        await settle(lab)
    # Either the extension is refused (400, the body never complete upstream), or it is
    # dropped and the body framed again; what follows the body is a request of its own, for
    # B, decided alone: refused and reported, never sent on A's connection.
    for raw in lab.a.received:
        assert extension not in raw and b"/hidden" not in raw
    assert lab.b.received == []
    if first[0] == 200:
        assert first == (200, b"ok|/upload")
        (raw,) = lab.a.received
        assert raw.endswith(b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n"), raw
        assert second[0] == 403
        (refusal,) = lab.refusals
        assert refusal.port == lab.b.port
    else:
        assert first[0] == 400 and lab.refusals == []


async def test_a_refused_host_behind_an_allowed_one() -> None:
    """Refused, reported, and never sent on the first request's upstream."""
    async with open_lab() as lab, client(lab) as c:
        await c.send(get(lab.a, "/one") + get(lab.b, "/two") + get(lab.a, "/three"))
        assert await c.response() == (200, b"ok|/one")
        status, body = await c.response()
        rest = await c.rest()  # the refusal ends the connection: /three is never read
        await settle(lab)
    assert status == 403, body
    assert rest == b""
    assert lab.a.targets == [[b"/one"]]  # one connection, one request
    assert b"/two" not in lab.a.received[0] and b"/three" not in lab.a.received[0]
    assert lab.b.received == []
    (refusal,) = lab.refusals
    assert (refusal.host, refusal.port, refusal.protocol) == ("127.0.0.1", lab.b.port, "http")


async def test_an_upstream_is_reused_only_for_the_host_and_port_it_was_dialled_for() -> None:
    async with open_lab() as lab, client(lab) as c:
        await c.send(get(lab.a, "/one") + get(lab.a, "/two") + get(lab.c, "/three"))
        assert await c.response() == (200, b"ok|/one")
        assert await c.response() == (200, b"ok|/two")
        assert await c.response() == (200, b"ok|/three")
        await settle(lab)
    assert lab.a.targets == [[b"/one", b"/two"]]  # kept alive for A
    assert lab.c.targets == [[b"/three"]]  # C's request went to C, on a connection of its own
    assert lab.refusals == []


@pytest.mark.parametrize("tail_later", [False, True], ids=["same-write", "tail-later"])
async def test_a_response_longer_than_its_framing_never_answers_the_next_request(
    tail_later: bool,
) -> None:
    async with open_lab(Upstream(short=True, tail_later=tail_later)) as lab, client(lab) as c:
        await c.send(get(lab.a, "/first"))
        assert await c.response() == (200, b"ok")
        if tail_later:  # the tail arrives after the proxy passed the response on
            lab.a.send_tail.set()
            await lab.a.tail_sent.wait()
        await c.send(get(lab.a, "/second"))
        assert await c.response() == (200, ok(b"/second").partition(b"\r\n\r\n")[2])
        await settle(lab)
    # The second request went to A on a new connection, never behind the tail on the first.
    assert lab.a.targets == [[b"/first"], [b"/second"]]
    assert lab.refusals == []


async def test_a_response_shorter_than_its_content_length_is_never_completed_by_the_next() -> None:
    # The body is cut short by the upstream's close: the client connection ends there, so the
    # bytes of the next response (here the pipelined request's, to C) never complete it.
    short = b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\nok"
    async with open_lab(Upstream(first=short)) as lab, client(lab) as c:
        await c.send(get(lab.a, "/first") + get(lab.c, "/second"))
        reply = await c.rest()
        await settle(lab)
    assert reply == short
    assert lab.a.targets == [[b"/first"]]
    assert lab.c.received == []  # the request after the cut one was never read
    assert lab.refusals == []


async def test_a_response_chunked_despite_its_content_length_is_passed_on_as_chunked() -> None:
    # Transfer-Encoding wins over Content-Length (RFC 9112 section 6.3): the body is read as
    # chunks, and the client gets it framed once, as chunked, never by the stale length.
    both = b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\nTransfer-Encoding: chunked\r\n\r\n"
    both += b"2\r\nok\r\n0\r\n\r\n"
    async with open_lab(Upstream(first=both)) as lab, client(lab) as c:
        await c.send(get(lab.a, "/first"))
        head = b""
        while b"0\r\n\r\n" not in head:
            chunk = await asyncio.wait_for(c.reader.read(65536), 30)
            assert chunk, head
            head += chunk
        await c.send(get(lab.a, "/second"))
        second = await c.response()
        await settle(lab)
    fields, _, body = head.partition(b"\r\n\r\n")
    assert b"content-length" not in fields.lower(), head
    assert b"transfer-encoding: chunked" in fields.lower(), head
    assert body == b"2\r\nok\r\n0\r\n\r\n", head
    assert second == (200, b"ok|/second")
    assert lab.a.targets == [[b"/first"], [b"/second"]]
    assert lab.refusals == []


async def test_a_removal_refuses_the_next_request_after_several_on_a_kept_upstream() -> None:
    # The guard's answer is kept for the kept upstream's target only under the allowlist that
    # gave it: the allowlist changed, so the next request is decided again, and refused.
    async with open_lab() as lab, client(lab) as c:
        for path in ("/one", "/two", "/three"):
            await c.send(get(lab.a, path))
            assert await c.response() == (200, b"ok|" + path.encode())
        lab.proxies.set_allowlist(lab.only(lab.c))
        await c.send(get(lab.a, "/four"))
        status, body = await c.response()
        await settle(lab)
    assert status == 403, body
    assert lab.a.targets == [[b"/one", b"/two", b"/three"]]
    assert b"/four" not in lab.a.received[0]
    (refusal,) = lab.refusals
    assert refusal.port == lab.a.port


async def test_each_request_on_a_kept_upstream_to_an_unlisted_target_is_asked_about() -> None:
    # Approved once, twice, then refused: an answer given by asking is never kept for the
    # next request, even on the upstream it was dialled for.
    asked: list[EgressAsk] = []

    async def asker(ask: EgressAsk) -> AskAnswer:
        asked.append(ask)
        return AskAnswer(allowed=len(asked) <= 2, reason="refused the third time")

    def ask_b(path: str) -> bytes:
        host = f"ask.test:{lab.b.port}"
        return f"GET http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()

    async with open_lab(ask=asker) as lab, client(lab) as c:
        for path in ("/one", "/two"):
            await c.send(ask_b(path))
            assert await c.response() == (200, b"ok|" + path.encode())
        await c.send(ask_b("/three"))
        status, body = await c.response()
        await settle(lab)
    assert status == 403, body
    assert [(ask.host, ask.port) for ask in asked] == [("ask.test", lab.b.port)] * 3
    assert lab.b.targets == [[b"/one", b"/two"]]
    assert b"/three" not in lab.b.received[0]
    (refusal,) = lab.refusals
    assert refusal.port == lab.b.port
