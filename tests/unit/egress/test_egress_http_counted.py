"""A response passed on as counted bytes (Content-Length alone, or no body) reaches the client
byte for byte as h11 itself would write it for that exchange, whatever its head looks like."""

from __future__ import annotations

import h11
import pytest
from machine_kit import drive_machine

from cc_server.egress.http_machine import HttpProxyMachine
from cc_server.egress.proto import (
    NEED_DATA,
    NEED_UPSTREAM_DATA,
    CheckEgress,
    CloseConnection,
    OpenUpstream,
    SendToClient,
    SendUpstream,
)

REQUESTS = {
    "kept": b"GET http://a.com/ HTTP/1.1\r\nHost: a.com\r\n\r\n",
    "close": b"GET http://a.com/ HTTP/1.1\r\nHost: a.com\r\nConnection: close\r\n\r\n",
    "http10": b"GET http://a.com/ HTTP/1.0\r\n\r\n",
    "head": b"HEAD http://a.com/ HTTP/1.1\r\nHost: a.com\r\n\r\n",
    "post": b"POST http://a.com/ HTTP/1.1\r\nHost: a.com\r\nContent-Length: 3\r\n\r\nabc",
}
RESPONSES = {
    "plain": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "odd-spelling": b"HTTP/1.1 200 OK\r\ncontent-length:  2 \r\nX-Y: z\r\n\r\nok",
    "length-twice": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2, 2\r\n\r\nok",
    "host-field": b"HTTP/1.1 200 OK\r\nA: b\r\nContent-Length: 2\r\nHost: h\r\n\r\nok",
    "hop-by-hop": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: X-B, close\r\n"
    b"X-B: 1\r\nKeep-Alive: t\r\n\r\nok",
    "http10": b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "empty-reason": b"HTTP/1.1 404 \r\nContent-Length: 0\r\n\r\n",
    "204": b"HTTP/1.1 204 No Content\r\nContent-Length: 7\r\n\r\n",
    "304": b"HTTP/1.1 304 Not Modified\r\n\r\n",
}
_HOP_BY_HOP = {b"connection", b"keep-alive", b"x-b"}


def h11_would_write(request: bytes, response: bytes) -> bytes:
    """What h11 writes for the client: the response read by h11, its hop-by-hop fields
    dropped, written again by an h11 server that read `request`."""
    server = h11.Connection(h11.SERVER)
    server.receive_data(request)
    method = server.next_event().method  # type: ignore[union-attr]
    while server.next_event() is not h11.NEED_DATA and server.their_state is h11.SEND_BODY:
        pass
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method=method, target="/", headers=[("Host", "a.com")]))
    client.send(h11.EndOfMessage())
    client.receive_data(response)
    head = client.next_event()
    assert isinstance(head, h11.Response)
    fields = [(n, v) for n, v in head.headers.raw_items() if n.lower() not in _HOP_BY_HOP]
    out = server.send(
        h11.Response(status_code=head.status_code, headers=fields, reason=head.reason)
    )
    while (event := client.next_event()) is not h11.NEED_DATA:
        out += server.send(event) or b""  # type: ignore[arg-type]
        if isinstance(event, h11.EndOfMessage):
            break
    return out


@pytest.mark.parametrize("chunk", [None, 1])
@pytest.mark.parametrize("response", RESPONSES.values(), ids=RESPONSES.keys())
@pytest.mark.parametrize("request_", REQUESTS.values(), ids=REQUESTS.keys())
def test_the_client_gets_what_h11_would_write(
    request_: bytes, response: bytes, chunk: int | None
) -> None:
    steps = drive_machine(HttpProxyMachine, request_, response=response, chunk=chunk)
    sent = b"".join(step.data for step in steps if isinstance(step, SendToClient))
    assert sent == h11_would_write(request_, response)
    assert isinstance(steps[-1], CloseConnection) and steps[-1].reply == b""


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nBad Field: 1\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n",  # the head cut short by the close
        b"HTTP/1.1 200 OK\r\nX: " + b"y" * (20 * 1024),  # never ends, over h11's 16 KiB
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
        b"SMTP ready\r\n\r\n",
    ],
    ids=["bad-length", "two-lengths", "gzip", "bad-field", "cut-head", "huge-head", "101", "junk"],
)
@pytest.mark.parametrize("chunk", [None, 1000])
def test_a_response_head_h11_refuses_is_refused_with_a_502(
    response: bytes, chunk: int | None
) -> None:
    # Read without an h11 connection while only a head is awaited, a head h11 would refuse
    # is handed to one: refused as h11 refuses it, nothing of it reaching the client.
    steps = drive_machine(HttpProxyMachine, REQUESTS["kept"], response=response, chunk=chunk)
    assert not any(isinstance(step, SendToClient) for step in steps), steps
    last = steps[-1]
    assert isinstance(last, CloseConnection), steps
    assert last.reply.startswith(b"HTTP/1.1 502 "), last.reply[:60]


def test_an_unended_response_head_is_refused_once_over_h11s_bound_without_waiting_for_more() -> (
    None
):
    # The head read without an h11 connection is bounded as h11 bounds it: past 16 KiB and
    # still incomplete, it is refused at once, not buffered until the upstream closes.
    machine = HttpProxyMachine()
    assert machine.next_event() is NEED_DATA
    machine.receive_data(REQUESTS["kept"])
    assert isinstance(machine.next_event(), CheckEgress)
    machine.decide(True)
    assert isinstance(machine.next_event(), OpenUpstream)
    machine.upstream_result(True)
    assert isinstance(machine.next_event(), SendUpstream)
    head = b"HTTP/1.1 200 OK\r\nX: " + b"y" * (20 * 1024)
    for fed in range(0, len(head), 1000):
        event = machine.next_event()
        if isinstance(event, CloseConnection):
            break
        assert event is NEED_UPSTREAM_DATA, event
        machine.receive_upstream_data(head[fed : fed + 1000])
    else:
        event = machine.next_event()
    assert isinstance(event, CloseConnection), event
    assert event.reply.startswith(b"HTTP/1.1 502 ")
    assert fed <= 17 * 1000
