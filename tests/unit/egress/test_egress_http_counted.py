"""A response passed on as counted bytes (Content-Length alone, or no body) reaches the client
byte for byte as h11 itself would write it for that exchange, whatever its head looks like."""

from __future__ import annotations

import h11
import pytest
from machine_kit import drive_machine

from cc_server.egress.http_machine import HttpProxyMachine
from cc_server.egress.proto import CloseConnection, SendToClient

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
