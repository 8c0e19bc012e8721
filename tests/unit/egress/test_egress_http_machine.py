"""The sans-IO HTTP proxy machine: byte-exact happy paths, every refusal, limits, call order."""

from __future__ import annotations

from ipaddress import IPv6Address

import pytest
from machine_kit import Step, drive_machine

from cc_server.egress.http_machine import (
    CONNECT_ESTABLISHED,
    DEFAULT_HOW_TO_ALLOW,
    HttpProxyMachine,
)
from cc_server.egress.proto import (
    MAX_HEADER_BYTES,
    MAX_HEADERS,
    NEED_ANY_DATA,
    NEED_DATA,
    NEED_UPSTREAM_DATA,
    CheckEgress,
    HandshakeMachine,
    OpenUpstream,
    ProtocolError,
    ProtocolRefused,
    SendUpstream,
    StartRelay,
    State,
)

TLS_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32))


def state(machine: HandshakeMachine) -> State:
    """The machine's state, read through a call so that mypy does not narrow it between steps."""
    return machine.state


def drive(
    data: bytes,
    *,
    chunk: int | None = None,
    allowed: bool = True,
    ok: bool = True,
    error: str = "",
    eof: bool = True,
) -> list[Step]:
    """Run a HttpProxyMachine like the driver does (machine_kit.drive_machine)."""
    return drive_machine(
        HttpProxyMachine, data, chunk=chunk, allowed=allowed, ok=ok, error=error, eof=eof
    )


def forwarded(steps: list[Step]) -> bytes:
    """What went upstream in a transcript that waits for the upstream's response."""
    assert steps[-1] is NEED_UPSTREAM_DATA, steps[-1]
    (sent,) = [step for step in steps if isinstance(step, SendUpstream)]
    return sent.data


def refused(data: bytes) -> ProtocolRefused:
    *_, last = drive(data)
    assert isinstance(last, ProtocolRefused), last
    return last


def last_answer(steps: list[Step]) -> bytes:
    *_, last = steps
    assert isinstance(last, tuple), last
    return last[1]


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def head_and_body(reply: bytes) -> tuple[list[bytes], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return head.split(b"\r\n"), body


# Happy paths, byte-exact.


def test_connect_with_pipelined_tls_bytes_in_the_same_packet() -> None:
    machine = HttpProxyMachine()
    assert state(machine) is State.READING
    assert machine.next_event() is NEED_DATA
    machine.receive_data(
        b"CONNECT api.example.com:443 HTTP/1.1\r\n"
        b"Host: api.example.com:443\r\n"
        b"Proxy-Authorization: Basic Zm9vOmJhcg==\r\n"
        b"User-Agent: curl/8.5.0\r\n\r\n" + TLS_HELLO
    )
    assert machine.next_event() == CheckEgress(host="api.example.com", port=443, kind="connect")
    assert state(machine) is State.CHECKING
    assert machine.decide(True) == b""
    assert state(machine) is State.OPENING
    assert machine.next_event() == OpenUpstream(host="api.example.com", port=443)
    assert machine.upstream_result(True) == CONNECT_ESTABLISHED
    assert CONNECT_ESTABLISHED == b"HTTP/1.1 200 Connection established\r\n\r\n"
    assert state(machine) is State.RELAY
    assert machine.next_event() == StartRelay(to_upstream=TLS_HELLO, to_client=b"")
    assert machine.buffered_bytes == 0


def test_connect_without_pipelined_bytes_relays_nothing_first() -> None:
    steps = drive(b"CONNECT example.com:22 HTTP/1.1\r\nHost: example.com:22\r\n\r\n")
    assert steps == [
        CheckEgress(host="example.com", port=22, kind="connect"),
        ("decide", b""),
        OpenUpstream(host="example.com", port=22),
        ("upstream", CONNECT_ESTABLISHED),
        StartRelay(to_upstream=b"", to_client=b""),
    ]


@pytest.mark.parametrize(
    ("target", "host", "port"),
    [
        (b"[::1]:443", "::1", 443),
        (b"[2001:DB8:0:0::1]:8443", "2001:db8::1", 8443),
        # Python's compressed spelling of a mapped address changed in 3.13; either is parsed.
        (b"[::ffff:169.254.169.254]:80", str(IPv6Address("::ffff:a9fe:a9fe")), 80),
        (b"127.0.0.1:1", "127.0.0.1", 1),
        (b"0x7f.1:65535", "0x7f.1", 65535),
        (b"Mixed-Case.Example.COM:0443", "Mixed-Case.Example.COM", 443),
        (b"under_score.example:443", "under_score.example", 443),
    ],
)
def test_connect_targets_are_reported_as_given(target: bytes, host: str, port: int) -> None:
    steps = drive(b"CONNECT " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert steps[0] == CheckEgress(host=host, port=port, kind="connect")


def test_connect_with_content_length_zero_and_http_1_0_is_a_tunnel() -> None:
    steps = drive(b"CONNECT example.com:443 HTTP/1.0\r\nContent-Length: 0\r\n\r\nabc")
    assert steps[0] == CheckEgress(host="example.com", port=443, kind="connect")
    assert steps[-1] == StartRelay(to_upstream=b"abc", to_client=b"")


def test_absolute_form_post_with_body_is_rewritten_to_origin_form() -> None:
    machine = HttpProxyMachine()
    machine.receive_data(
        b"POST http://Example.COM/upload?x=1 HTTP/1.1\r\n"
        b"Host: example.com\r\n"
        b"User-Agent: test\r\n"
        b"Proxy-Authorization: Basic Zm9vOmJhcg==\r\n"
        b"Proxy-Connection: keep-alive\r\n"
        b"Connection: keep-alive, X-Trace, Host, Content-Length\r\n"
        b"Keep-Alive: timeout=5\r\n"
        b"TE: trailers\r\n"
        b"Upgrade: h2c\r\n"
        b"X-Trace: 1\r\n"
        b"Content-Length: 11\r\n"
        b"\r\n"
        b"hello"
    )
    assert machine.next_event() == CheckEgress(host="Example.COM", port=80, kind="forward")
    assert machine.decide(True) == b""
    assert machine.next_event() == OpenUpstream(host="Example.COM", port=80)
    assert machine.upstream_result(True) == b""  # the origin's own response answers the client
    assert state(machine) is State.EXCHANGE
    assert machine.next_event() == SendUpstream(
        data=(
            b"POST /upload?x=1 HTTP/1.1\r\n"
            b"Host: example.com\r\n"
            b"User-Agent: test\r\n"
            b"Content-Length: 11\r\n"
            b"\r\n"
            b"hello"
        )
    )
    # The rest of the body, or an early response: whichever comes first.
    assert machine.next_event() is NEED_ANY_DATA
    machine.receive_data(b" world")
    assert machine.next_event() == SendUpstream(data=b" world")
    assert machine.next_event() is NEED_UPSTREAM_DATA


def test_chunked_body_goes_upstream_chunked() -> None:
    body = b"5\r\nhello\r\n0\r\n\r\n"
    steps = drive(
        b"PUT http://example.com:8080/x HTTP/1.1\r\nHost: EXAMPLE.com:8080\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + body
    )
    assert steps[0] == CheckEgress(host="example.com", port=8080, kind="forward")
    assert forwarded(steps) == (
        b"PUT /x HTTP/1.1\r\nHost: EXAMPLE.com:8080\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    )


@pytest.mark.parametrize(
    ("target", "origin_form"),
    [
        (b"http://example.com", b"/"),
        (b"http://example.com?q=1", b"/?q=1"),
        (b"http://example.com/a/b?c=d/e", b"/a/b?c=d/e"),
        (b"HTTP://example.com/", b"/"),
    ],
)
def test_origin_form_of_absolute_targets(target: bytes, origin_form: bytes) -> None:
    steps = drive(b"GET " + target + b" HTTP/1.1\r\nHost: example.com\r\n\r\n")
    assert forwarded(steps).startswith(b"GET " + origin_form + b" HTTP/1.1\r\n")


@pytest.mark.parametrize(
    ("target", "host_line"),
    [
        (b"http://example.com/", b"Host: example.com"),
        (b"http://example.com:8080/", b"Host: example.com:8080"),
        (b"http://[::1]/", b"Host: [::1]"),
        (b"http://[::1]:8080/", b"Host: [::1]:8080"),
    ],
)
def test_http_1_0_without_host_gets_one_from_the_target(target: bytes, host_line: bytes) -> None:
    steps = drive(b"GET " + target + b" HTTP/1.0\r\nAccept: */*\r\n\r\n")
    # Sent as HTTP/1.1 (h11's), saying this connection ends after it, as an HTTP/1.0 one does.
    assert forwarded(steps) == (
        b"GET / HTTP/1.1\r\n" + host_line + b"\r\nAccept: */*\r\nConnection: close\r\n\r\n"
    )


@pytest.mark.parametrize(
    ("target", "host_header"),
    [
        (b"http://example.com/", b"example.com:80"),
        (b"http://example.com:80/", b"example.com"),
        (b"http://example.com:8080/", b"EXAMPLE.COM:8080"),
        (b"http://[::1]/", b"[0::1]"),
        (b"http://[::1]:8080/", b"[::1]:8080"),
    ],
)
def test_host_header_agrees_case_insensitively_with_default_port_elided(
    target: bytes, host_header: bytes
) -> None:
    steps = drive(b"GET " + target + b" HTTP/1.1\r\nHost: " + host_header + b"\r\n\r\n")
    assert forwarded(steps).startswith(b"GET / HTTP/1.1\r\nHost: " + host_header + b"\r\n")


# Refusals.


@pytest.mark.parametrize(
    ("request_head", "status", "reason"),
    [
        (b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n", 400, "this is a proxy"),
        (b"GET https://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n", 400, "use CONNECT"),
        (b"GET ftp://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n", 400, "absolute http"),
        (b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n", 400, "absolute http"),
        (b"GET example.com:80 HTTP/1.1\r\nHost: a\r\n\r\n", 400, "absolute http"),
        (b"GET http://a.com/#x HTTP/1.1\r\nHost: a.com\r\n\r\n", 400, "fragment"),
        (b"GET http://a.com#@b.com/ HTTP/1.1\r\nHost: a.com\r\n\r\n", 400, "fragment"),
        (b"GET http://u:p@a.com/ HTTP/1.1\r\nHost: a.com\r\n\r\n", 400, "user info"),
        (b"GET http://a%2e.com/ HTTP/1.1\r\nHost: a.com\r\n\r\n", 400, "bad host name"),
        (b"GET http://a\\b.com/ HTTP/1.1\r\nHost: a.com\r\n\r\n", 400, "bad host name"),
        (b"GET http:///x HTTP/1.1\r\nHost: a.com\r\n\r\n", 400, "bad host name"),
        (b"GET http://a.com:0/ HTTP/1.1\r\nHost: a.com\r\n\r\n", 400, "out of range"),
        (b"GET http://a.com:/ HTTP/1.1\r\nHost: a.com\r\n\r\n", 400, "bad port"),
        (b"GET http://a.com:65536/ HTTP/1.1\r\nHost: a.com\r\n\r\n", 400, "out of range"),
        (b"GET http://a.com:000080/ HTTP/1.1\r\nHost: a.com\r\n\r\n", 400, "bad port"),
        (b"GET http://a.com/ HTTP/1.1\r\nHost: b.com\r\n\r\n", 400, "does not match"),
        (b"GET http://a.com/ HTTP/1.1\r\nHost: a.com:8080\r\n\r\n", 400, "does not match"),
        (b"GET http://a.com:8080/ HTTP/1.1\r\nHost: a.com\r\n\r\n", 400, "does not match"),
        (b"GET http://a.com/ HTTP/1.1\r\nHost: a.com:x\r\n\r\n", 400, "bad Host header"),
        (b"GET http://a.com/ HTTP/1.1\r\nHost: \xffa.com\r\n\r\n", 400, "not ASCII"),
        (b"GET http://a.com/ HTTP/1.1\r\nHost: \r\n\r\n", 400, "bad Host header"),
        (b"GET http://a.com/ HTTP/1.1\r\nAccept: */*\r\n\r\n", 400, "Host"),
        (b"GET http://a.com/ HTTP/1.1\r\nHost: a.com\r\nHost: a.com\r\n\r\n", 400, "multiple"),
        (
            b"POST http://a.com/ HTTP/1.1\r\nHost: a.com\r\nContent-Length: 3\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n",
            400,
            "together",
        ),
        (
            b"POST http://a.com/ HTTP/1.1\r\nHost: a.com\r\nTransfer-Encoding: gzip\r\n\r\n",
            501,
            "chunked",
        ),
        (b"GET http://a.com/ HTTP/2.0\r\nHost: a.com\r\n\r\n", 505, "HTTP/1.0 and HTTP/1.1"),
        (b"GET http://a.com/ HTTP/0.9\r\nHost: a.com\r\n\r\n", 505, "HTTP/1.0 and HTTP/1.1"),
        (b"CONNECT example.com HTTP/1.1\r\nHost: a\r\n\r\n", 400, "missing port"),
        (b"CONNECT example.com:0 HTTP/1.1\r\nHost: a\r\n\r\n", 400, "out of range"),
        (b"CONNECT example.com:99999 HTTP/1.1\r\nHost: a\r\n\r\n", 400, "out of range"),
        (b"CONNECT example.com:44x HTTP/1.1\r\nHost: a\r\n\r\n", 400, "bad port"),
        (b"CONNECT :443 HTTP/1.1\r\nHost: a\r\n\r\n", 400, "bad host name"),
        (b"CONNECT ::1:443 HTTP/1.1\r\nHost: a\r\n\r\n", 400, "brackets"),
        (b"CONNECT [::1 HTTP/1.1\r\nHost: a\r\n\r\n", 400, "unterminated"),
        (b"CONNECT [::1]443 HTTP/1.1\r\nHost: a\r\n\r\n", 400, "junk after"),
        (b"CONNECT [::1] HTTP/1.1\r\nHost: a\r\n\r\n", 400, "missing port"),
        (b"CONNECT [fe80::1%25eth0]:443 HTTP/1.1\r\nHost: a\r\n\r\n", 400, "bad IPv6"),
        (b"CONNECT [1.2.3.4]:443 HTTP/1.1\r\nHost: a\r\n\r\n", 400, "bad IPv6"),
        (b"CONNECT http://a.com:443 HTTP/1.1\r\nHost: a\r\n\r\n", 400, "host:port"),
        (b"CONNECT a.com:443 HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nab", 400, "body"),
        (
            b"CONNECT a.com:443 HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
            400,
            "body",
        ),
        (b"\x16\x03\x01\x00\x05hello\r\n\r\n", 400, "request line"),
        (b"\x16\x03\x01\x00\x05", 400, "illegal request line"),
        (b"\r\nGET http://a.com/ HTTP/1.1\r\nHost: a.com\r\n\r\n", 400, "request line"),
        (b"\r\n\r\n", 400, "illegal request line"),
        (b"GET http://a.com/ HTTP/1.1\r\nBad Header: x\r\n\r\n", 400, "header"),
    ],
)
def test_refusals_answer_in_protocol(request_head: bytes, status: int, reason: str) -> None:
    refusal = refused(request_head)
    assert reason.lower() in refusal.reason.lower()
    lines, body = head_and_body(refusal.reply)
    assert status_of(refusal.reply) == status
    assert b"Connection: close" in lines
    assert b"X-Cc-Server-Egress: bad-request" in lines
    assert f"Content-Length: {len(body)}".encode() in lines
    assert body == f"cc-server egress proxy: {refusal.reason}\n".encode()


def test_origin_form_refusal_byte_exact() -> None:
    body = b"cc-server egress proxy: this is a proxy: use an absolute URI or CONNECT\n"
    assert refused(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n").reply == (
        b"HTTP/1.1 400 Bad Request\r\n"
        b"Content-Type: text/plain; charset=utf-8\r\n"
        b"X-Cc-Server-Egress: bad-request\r\n"
        b"Connection: close\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )


def test_client_closing_before_any_byte_gets_no_reply() -> None:
    assert drive(b"") == [
        ProtocolRefused(reply=b"", reason="client closed before sending a request")
    ]


@pytest.mark.parametrize("prefix", [b"G", b"GET http://a.com/ HTTP/1.1\r\n", b"CONNECT a:1"])
def test_client_closing_mid_head_is_refused(prefix: bytes) -> None:
    refusal = refused(prefix)
    assert status_of(refusal.reply) == 400
    assert "closed" in refusal.reason


# Denial and upstream failure.


def test_denied_reply_byte_exact() -> None:
    machine = HttpProxyMachine()
    machine.receive_data(b"CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n\r\n")
    assert isinstance(machine.next_event(), CheckEgress)
    reply = machine.decide(
        False,
        "evil.example is not on the session's allowlist",
        "ask for it with --allow-domain evil.example",
    )
    body = (
        b"cc-server egress proxy refused the connection to evil.example:443.\n"
        b"evil.example is not on the session's allowlist\n"
        b"To allow it: ask for it with --allow-domain evil.example\n"
    )
    assert reply == (
        b"HTTP/1.1 403 Forbidden\r\n"
        b"Content-Type: text/plain; charset=utf-8\r\n"
        b"X-Cc-Server-Egress: denied\r\n"
        b"X-Cc-Server-Egress-Reason: evil.example is not on the session's allowlist\r\n"
        b"Connection: close\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    assert state(machine) is State.CLOSED


def test_denied_reply_defaults_say_not_on_the_allowlist_and_how_to_ask() -> None:
    reply = last_answer(
        drive(b"GET http://[::1]:81/ HTTP/1.1\r\nHost: [::1]:81\r\n\r\n", allowed=False)
    )
    lines, body = head_and_body(reply)
    assert status_of(reply) == 403
    assert b"X-Cc-Server-Egress-Reason: not on the session's egress allowlist" in lines
    assert body.decode() == (
        "cc-server egress proxy refused the connection to [::1]:81.\n"
        "The host is not on this session's egress allowlist.\n"
        f"To allow it: {DEFAULT_HOW_TO_ALLOW}\n"
    )


def test_denial_reason_header_cannot_split_the_response() -> None:
    machine = HttpProxyMachine()
    machine.receive_data(b"CONNECT a.com:443 HTTP/1.1\r\nHost: a\r\n\r\n")
    machine.next_event()
    reason = "bad\r\nSet-Cookie: x=1\x00\tü" + "y" * 500
    reply = machine.decide(False, reason)
    lines, _ = head_and_body(reply)
    (header,) = [line for line in lines if line.startswith(b"X-Cc-Server-Egress-Reason:")]
    assert header == b"X-Cc-Server-Egress-Reason: " + (b"bad Set-Cookie: x=1 ?" + b"y" * 500)[:200]
    assert not any(line.startswith(b"Set-Cookie") for line in lines)


def test_upstream_failure_is_a_502_byte_exact() -> None:
    steps = drive(
        b"CONNECT a.com:443 HTTP/1.1\r\nHost: a\r\n\r\n", ok=False, error="connection refused"
    )
    body = b"cc-server egress proxy could not connect to a.com:443: connection refused\n"
    assert steps[-1] == (
        "upstream",
        b"HTTP/1.1 502 Bad Gateway\r\n"
        b"Content-Type: text/plain; charset=utf-8\r\n"
        b"X-Cc-Server-Egress: upstream-failed\r\n"
        b"Connection: close\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body,
    )


def test_upstream_failure_without_an_error_text() -> None:
    reply = last_answer(drive(b"GET http://a.com/ HTTP/1.1\r\nHost: a.com\r\n\r\n", ok=False))
    assert reply.endswith(b"\r\n\r\ncc-server egress proxy could not connect to a.com:80: failed\n")


# Limits.


def head_of_size(size: int) -> bytes:
    start = b"GET http://a.com/ HTTP/1.1\r\nHost: a.com\r\nX-Pad: "
    end = b"\r\n\r\n"
    return start + b"p" * (size - len(start) - len(end)) + end


@pytest.mark.parametrize("chunk", [None, 1, 1000, MAX_HEADER_BYTES])
def test_head_of_exactly_the_limit_is_accepted(chunk: int | None) -> None:
    head = head_of_size(MAX_HEADER_BYTES)
    assert len(head) == MAX_HEADER_BYTES
    steps = drive(head + b"GET", chunk=chunk)  # the next request's start waits its turn
    assert forwarded(steps).startswith(b"GET / HTTP/1.1\r\nHost: a.com\r\nX-Pad: ppp")


@pytest.mark.parametrize("chunk", [None, 1, 1000, MAX_HEADER_BYTES])
def test_head_one_byte_over_the_limit_is_a_431(chunk: int | None) -> None:
    *_, last = drive(head_of_size(MAX_HEADER_BYTES + 1), chunk=chunk)
    assert isinstance(last, ProtocolRefused)
    assert status_of(last.reply) == 431
    assert last.reason == f"request head over {MAX_HEADER_BYTES} bytes"


def test_an_endless_head_is_cut_off_at_the_limit() -> None:
    machine = HttpProxyMachine()
    fed = 0
    while (event := machine.next_event()) is NEED_DATA:
        machine.receive_data(b"x" * 1000)
        fed += 1000
        assert machine.buffered_bytes <= MAX_HEADER_BYTES + 1000
    assert isinstance(event, ProtocolRefused)
    assert status_of(event.reply) == 431
    assert fed <= MAX_HEADER_BYTES + 1000


def header_block(count: int) -> bytes:
    return b"".join(b"X-%d: v\r\n" % i for i in range(count - 1))


def test_header_count_limit() -> None:
    ok = b"GET http://a.com/ HTTP/1.1\r\nHost: a.com\r\n" + header_block(MAX_HEADERS) + b"\r\n"
    assert drive(ok)[-1] is NEED_UPSTREAM_DATA
    over = b"GET http://a.com/ HTTP/1.1\r\nHost: a.com\r\n" + header_block(MAX_HEADERS + 1)
    refusal = refused(over + b"\r\n")
    assert status_of(refusal.reply) == 431
    assert refusal.reason == f"more than {MAX_HEADERS} header fields"


# Splitting.

SPLIT_CASES = [
    b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com:443\r\n\r\n" + TLS_HELLO,
    b"POST http://a.com/x HTTP/1.1\r\nHost: a.com\r\nContent-Length: 3\r\n\r\nabc",
    b"GET http://a.com/ HTTP/1.0\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET http://a.com/ HTTP/1.1\r\nHost: b.com\r\n\r\n",
    b"\n\nGET http://a.com/ HTTP/1.1\nHost: a.com\n\n",
    b"GET http://a.com/ HTTP/1.1\r\nHost: a.com\r\n",
    b"garbage",
    head_of_size(MAX_HEADER_BYTES + 1),
]


@pytest.mark.parametrize("data", SPLIT_CASES, ids=range(len(SPLIT_CASES)))
@pytest.mark.parametrize("allowed", [True, False])
def test_one_byte_at_a_time_gives_the_same_result_as_all_at_once(
    data: bytes, allowed: bool
) -> None:
    whole = drive(data, allowed=allowed)
    assert drive(data, chunk=1, allowed=allowed) == whole
    assert drive(data, chunk=7, allowed=allowed) == whole


def test_incomplete_head_without_eof_keeps_asking_for_data() -> None:
    machine = HttpProxyMachine()
    machine.receive_data(b"GET http://a.com/ HTTP/1.1\r\n")
    assert machine.next_event() is NEED_DATA
    assert machine.next_event() is NEED_DATA  # asking again changes nothing
    assert machine.buffered_bytes == len(b"GET http://a.com/ HTTP/1.1\r\n")
    assert repr(NEED_DATA) == "NEED_DATA"


# Call order and ERROR.


def checking_machine() -> HttpProxyMachine:
    machine = HttpProxyMachine()
    machine.receive_data(b"CONNECT a.com:443 HTTP/1.1\r\nHost: a\r\n\r\n")
    assert isinstance(machine.next_event(), CheckEgress)
    return machine


def assert_in_error(machine: HttpProxyMachine) -> None:
    assert state(machine) is State.ERROR
    for call in (
        machine.next_event,
        lambda: machine.receive_data(b"x"),
        lambda: machine.decide(True),
        lambda: machine.upstream_result(True),
    ):
        with pytest.raises(ProtocolError, match="ERROR"):
            call()


def test_an_unreachable_target_gets_the_502_and_ends_the_conversation() -> None:
    machine = checking_machine()
    reply = machine.unreachable()
    assert reply.startswith(b"HTTP/1.1 502 Bad Gateway\r\n")
    assert reply.endswith(b"cc-server egress proxy could not connect to a.com:443: unreachable\n")
    assert state(machine) is State.CLOSED
    with pytest.raises(ProtocolError, match="over"):
        machine.next_event()


def test_unreachable_without_a_pending_check_is_a_driver_bug() -> None:
    machine = HttpProxyMachine()
    with pytest.raises(ProtocolError, match="unreachable"):
        machine.unreachable()
    assert_in_error(machine)


def test_next_event_before_decide_is_a_driver_bug() -> None:
    machine = checking_machine()
    with pytest.raises(ProtocolError, match="decide"):
        machine.next_event()
    assert_in_error(machine)


def test_feeding_without_need_data_is_a_driver_bug() -> None:
    machine = HttpProxyMachine()
    machine.receive_data(b"CONNECT a.com:443 HTTP/1.1\r\n")
    with pytest.raises(ProtocolError, match="NEED_DATA"):
        machine.receive_data(b"Host: a\r\n\r\n")
    assert_in_error(machine)


def test_feeding_while_checking_is_a_driver_bug() -> None:
    machine = checking_machine()
    with pytest.raises(ProtocolError, match="CHECKING"):
        machine.receive_data(b"more")
    assert_in_error(machine)


def test_feeding_after_eof_is_a_driver_bug() -> None:
    machine = HttpProxyMachine()
    machine.receive_data(b"")
    machine._wants_data = True  # a driver that ignored the ProtocolRefused and fed again
    with pytest.raises(ProtocolError, match="after EOF"):
        machine.receive_data(b"x")
    assert_in_error(machine)


def test_decide_without_check_is_a_driver_bug() -> None:
    machine = HttpProxyMachine()
    with pytest.raises(ProtocolError, match="pending CheckEgress"):
        machine.decide(True)
    assert_in_error(machine)


def test_upstream_result_before_open_upstream_was_returned_is_a_driver_bug() -> None:
    machine = checking_machine()
    machine.decide(True)
    with pytest.raises(ProtocolError, match="pending OpenUpstream"):
        machine.upstream_result(True)
    assert_in_error(machine)


def test_next_event_while_opening_is_a_driver_bug() -> None:
    machine = checking_machine()
    machine.decide(True)
    machine.next_event()
    with pytest.raises(ProtocolError, match="upstream_result"):
        machine.next_event()
    assert_in_error(machine)


def test_next_event_after_start_relay_is_a_driver_bug() -> None:
    machine = checking_machine()
    machine.decide(True)
    machine.next_event()
    machine.upstream_result(True)
    assert isinstance(machine.next_event(), StartRelay)
    with pytest.raises(ProtocolError, match="relay"):
        machine.next_event()
    assert_in_error(machine)


@pytest.mark.parametrize("allowed", [True, False])
def test_next_event_after_the_conversation_ended_is_a_driver_bug(allowed: bool) -> None:
    machine = checking_machine()
    if allowed:
        machine.decide(True)
        machine.next_event()
        machine.upstream_result(False, "unreachable")
    else:
        machine.decide(False)
    assert state(machine) is State.CLOSED
    with pytest.raises(ProtocolError, match="over"):
        machine.next_event()
    assert_in_error(machine)


def test_an_exception_inside_the_machine_moves_it_to_error() -> None:
    machine = HttpProxyMachine()
    with pytest.raises(TypeError):
        machine.receive_data("not bytes")  # type: ignore[arg-type]
    assert_in_error(machine)
