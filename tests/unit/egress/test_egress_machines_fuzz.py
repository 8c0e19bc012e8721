"""Hypothesis: whatever bytes a client sends, split however the network splits them, each
handshake machine ends in a clean refusal or a valid request, never raises, never buffers more
than its limit plus one chunk, never asks for data after EOF, and never loops."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address

import h11
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cc_server.egress.http_machine import CONNECT_ESTABLISHED, HttpProxyMachine
from cc_server.egress.proto import (
    MAX_HEADER_BYTES,
    MAX_HEADERS,
    NEED_ANY_DATA,
    NEED_DATA,
    NEED_UPSTREAM_DATA,
    CheckEgress,
    Event,
    HandshakeMachine,
    OpenUpstream,
    ProtocolRefused,
    SendToClient,
    SendUpstream,
    StartRelay,
    State,
)
from cc_server.egress.socks_machine import SOCKS4_REJECTED, Socks5Machine

FUZZ = settings(max_examples=400, database=None, deadline=None)

# Events a machine can produce besides NEED_DATA: SendToClient, CheckEgress, OpenUpstream,
# StartRelay or a refusal, and a forward's SendUpstream (one per chunk at most). With one
# NEED_DATA per chunk and one for EOF, a run that needs more next_event() calls than this (plus
# a SendUpstream per chunk) is looping.
EVENTS_PER_CONVERSATION = 5

Step = Event | tuple[str, bytes]


@dataclass(frozen=True, kw_only=True)
class Answers:
    allowed: bool
    ok: bool
    error: str


ANSWERS = st.builds(
    Answers,
    # Mostly yes, so that most accepted requests reach StartRelay and its checks.
    allowed=st.sampled_from([True, True, True, False]),
    ok=st.sampled_from([True, True, True, False]),
    error=st.sampled_from(["", "refused", "unreachable", "timed out", "\r\nX: y"]),
)


def mutate(raw: bytes, index: int, byte: int) -> bytes:
    """``raw`` with one byte replaced (or unchanged when ``index`` is past its end)."""
    return raw[:index] + bytes((byte,)) + raw[index + 1 :] if index < len(raw) else raw


def state(machine: HandshakeMachine) -> State:
    return machine.state


def run(machine: HandshakeMachine, chunks: list[bytes], answers: Answers) -> list[Step]:
    """Drive ``machine`` as the asyncio driver does, checking the invariants at every step.

    Returns the transcript: events other than NEED_DATA, and what decide()/upstream_result()
    returned; StartRelay.to_upstream includes the chunks not fed yet, as the relay sends them.
    A forward's SendUpstream events are one ("sent upstream", bytes) step, however many there
    were; the upstream never answers, so a forward that went upstream ends in
    NEED_UPSTREAM_DATA (its request complete) or a refusal (its body broken or cut short).
    """
    pieces = iter(chunks)
    eof_fed = False
    transcript: list[Step] = []
    for _ in range(2 * len(chunks) + 1 + EVENTS_PER_CONVERSATION):
        event = machine.next_event()
        assert state(machine) is not State.ERROR
        if isinstance(event, SendUpstream):
            if transcript and transcript[-1][0] == "sent upstream":  # type: ignore[index]
                event = SendUpstream(data=transcript.pop()[1] + event.data)  # type: ignore[index]
            transcript.append(("sent upstream", event.data))
            continue
        if event is NEED_UPSTREAM_DATA or (event is NEED_ANY_DATA and eof_fed):
            transcript.append(NEED_UPSTREAM_DATA)
            return transcript
        if event is NEED_DATA or event is NEED_ANY_DATA:
            assert not eof_fed, "asked for data after EOF: the connection would hang"
            piece = next(pieces, b"")
            eof_fed = not piece
            machine.receive_data(piece)
            assert machine.buffered_bytes <= MAX_HEADER_BYTES + len(piece)
            continue
        if isinstance(event, StartRelay):
            event = StartRelay(
                to_upstream=event.to_upstream + b"".join(pieces), to_client=event.to_client
            )
        transcript.append(event)
        if isinstance(event, CheckEgress):
            transcript.append(("decide", machine.decide(answers.allowed, "no", "ask")))
            if not answers.allowed:
                assert state(machine) is State.CLOSED
                return transcript
        elif isinstance(event, OpenUpstream):
            transcript.append(("upstream", machine.upstream_result(answers.ok, answers.error)))
            if not answers.ok:
                assert state(machine) is State.CLOSED
                return transcript
        elif isinstance(event, StartRelay):
            assert state(machine) is State.RELAY
            return transcript
        elif isinstance(event, ProtocolRefused):
            assert state(machine) is State.CLOSED
            return transcript
    raise AssertionError("the machine never finished: too many next_event() calls")


CUTS = st.lists(st.integers(0, 2**20), max_size=12)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut into non-empty chunks (b"" would mean EOF) at the offsets ``cuts`` name,
    modulo its length."""
    bounds = [0, *sorted({cut % len(data) for cut in cuts if data}), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


# The HTTP machine.

HOSTS = st.sampled_from(
    [
        b"a.com",
        b"A.Com",
        b"[::1]",
        b"[::ffff:1.2.3.4]",
        b"[fe80::1%25x]",
        b"[",
        b"[::1",
        b"::1",
        b"",
        b"a%2ecom",
        b"u@a.com",
        b"a.com#x",
        b"0x7f.1",
        b"x" * 300,
    ]
)
PORTS = st.sampled_from([b"", b":", b":80", b":443", b":0", b":65535", b":65536", b":8x", b":080"])
PATHS = st.sampled_from([b"", b"", b"/", b"/x?y", b"?q", b"#f", b"/a b"])
TARGETS = st.one_of(
    st.builds(
        lambda scheme, host, port, path: scheme + host + port + path,
        st.sampled_from([b"http://", b"http://", b"HTTP://", b"https://", b"ftp://", b"", b""]),
        HOSTS,
        PORTS,
        PATHS,
    ),
    st.sampled_from([b"/", b"*", b"/x"]),
    st.binary(max_size=20),
)
HEADER_LINES = st.sampled_from(
    [
        b"Host: a.com",
        b"Host: A.COM:80",
        b"Host: a.com:443",
        b"Host: [::1]",
        b"Host: b.com",
        b"Host: \xff",
        b"Host:",
        b"Content-Length: 3",
        b"Content-Length: 0",
        b"Content-Length: x",
        b"Transfer-Encoding: chunked",
        b"Transfer-Encoding: gzip",
        b"Connection: close, host, content-length, x-a",
        b"Proxy-Authorization: Basic eA==",
        b"Proxy-Connection: keep-alive",
        b"Upgrade: websocket",
        b"X-A: 1",
        b"Bad Header: x",
        b" folded",
        b"\x00",
    ]
)
HTTP_REQUESTS = st.builds(
    lambda method, target, version, headers, eol, body: (
        method
        + b" "
        + target
        + b" "
        + version
        + eol
        + b"".join(h + eol for h in headers)
        + eol
        + body
    ),
    st.sampled_from([b"GET", b"POST", b"CONNECT", b"CONNECT", b"connect", b"OPTIONS", b"G\x00T"]),
    TARGETS,
    st.sampled_from([b"HTTP/1.1"] * 4 + [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1", b"http/1.1"]),
    st.lists(HEADER_LINES, max_size=6),
    st.sampled_from([b"\r\n", b"\n"]),
    st.binary(max_size=40),
)
EXTRA_HEADER_LINES = st.sampled_from(
    [
        b"Content-Length: 3",
        b"Transfer-Encoding: chunked",
        b"Connection: close, host, content-length, x-a",
        b"Connection: keep-alive",
        b"Proxy-Authorization: Basic eA==",
        b"Proxy-Connection: keep-alive",
        b"Keep-Alive: 5",
        b"TE: trailers",
        b"Upgrade: websocket",
        b"X-A: 1",
    ]
)


@st.composite
def forward_requests(draw: st.DrawFn) -> bytes:
    """Plain-HTTP proxy requests that h11 accepts, with agreeing and disagreeing Host headers."""
    host = draw(st.sampled_from([b"a.com", b"A.Com", b"[::1]", b"0x7f.1"]))
    port = draw(st.sampled_from([b"", b":80", b":8080"]))
    target = b"http://" + host + port + draw(PATHS.filter(lambda path: b" " not in path))
    host_header = draw(
        st.sampled_from(
            [host, host.upper(), host + b":80", host + port, host + b":81", b"b.com", b"[::2]"]
        )
    )
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"]))
    headers = draw(st.lists(EXTRA_HEADER_LINES, max_size=4))
    if version == b"HTTP/1.1" or draw(st.booleans()):
        headers.insert(draw(st.integers(0, len(headers))), b"Host: " + host_header)
    method = draw(st.sampled_from([b"GET", b"POST", b"DELETE"]))
    head = b"%s %s %s\r\n" % (method, target, version)
    return (
        head + b"".join(line + b"\r\n" for line in headers) + b"\r\n" + draw(st.binary(max_size=8))
    )


@st.composite
def near_the_limits(draw: st.DrawFn) -> bytes:
    """Requests with 2 or 99..101 header fields and a head just under or over MAX_HEADER_BYTES."""
    count = draw(st.sampled_from([0, MAX_HEADERS - 3, MAX_HEADERS - 2, MAX_HEADERS - 1]))
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(count))
    start = b"GET http://a.com/ HTTP/1.1\r\nHost: a.com\r\n" + fields + b"X-Pad: "
    size = draw(st.integers(MAX_HEADER_BYTES - 8, MAX_HEADER_BYTES + 8) | st.just(len(start) + 4))
    head = start + b"p" * (size - len(start) - 4) + b"\r\n\r\n"
    return head + draw(st.binary(max_size=8))


HTTP_INPUT = st.one_of(
    st.binary(max_size=300),
    HTTP_REQUESTS,
    forward_requests(),
    near_the_limits(),
    st.builds(
        lambda raw, index, byte: mutate(raw, index, byte),
        st.sampled_from(
            [
                b"CONNECT a.com:443 HTTP/1.1\r\nHost: a.com:443\r\n\r\n\x16\x03\x01",
                b"GET http://a.com:8080/x HTTP/1.1\r\nHost: a.com:8080\r\n\r\n",
                b"POST http://[::1]/ HTTP/1.1\r\nHost: [::1]\r\nContent-Length: 2\r\n\r\nab",
            ]
        ),
        st.integers(0, 80),
        st.integers(0, 255),
    ),
)

_REFUSAL_HEAD = re.compile(rb"HTTP/1\.1 (4\d\d|5\d\d) [A-Za-z ]+\r\n")


def check_http_outcome(raw: bytes, transcript: list[Step]) -> None:
    last = transcript[-1]
    if isinstance(last, ProtocolRefused):
        assert last.reply == b"" or _REFUSAL_HEAD.match(last.reply), last.reply[:80]
        return
    check = transcript[0]
    assert isinstance(check, CheckEgress)
    original = assert_head_within_limits(raw)
    assert_host(check.host)
    assert 1 <= check.port <= 65535
    if isinstance(last, tuple):  # denied or upstream failed: a 403 or a 502
        assert last[1].startswith((b"HTTP/1.1 403 Forbidden\r\n", b"HTTP/1.1 502 Bad Gateway\r\n"))
        return
    if check.kind == "connect":
        assert isinstance(last, StartRelay)
        assert transcript[3] == ("upstream", CONNECT_ESTABLISHED)
        return
    assert last is NEED_UPSTREAM_DATA
    sent = transcript[4]
    assert isinstance(sent, tuple) and sent[0] == "sent upstream"
    assert_valid_forwarded_request(sent[1], check, original)


def assert_head_within_limits(raw: bytes) -> h11.Request:
    """An accepted request head is at most MAX_HEADER_BYTES long with at most MAX_HEADERS fields,
    measured by an h11 parser without limits."""
    unlimited = h11.Connection(h11.SERVER, max_incomplete_event_size=len(raw) + 1)
    unlimited.receive_data(raw)
    request = unlimited.next_event()
    assert isinstance(request, h11.Request)
    assert len(raw) - len(unlimited.trailing_data[0]) <= MAX_HEADER_BYTES
    assert len(request.headers) <= MAX_HEADERS
    return request


def assert_host(host: str) -> None:
    """A name from the safe alphabet, or a literal in its canonical spelling."""
    if ":" in host:
        assert str(IPv6Address(host)) == host
    else:
        assert re.fullmatch(r"[A-Za-z0-9._-]{1,255}", host), host


def assert_valid_forwarded_request(
    to_upstream: bytes, check: CheckEgress, original: h11.Request
) -> None:
    """What goes upstream is one origin-form request that h11 accepts, for the checked host,
    with the client's method and body framing."""
    origin = h11.Connection(h11.SERVER)
    origin.receive_data(to_upstream)
    request = origin.next_event()
    assert isinstance(request, h11.Request)
    assert request.target.startswith(b"/")
    assert request.method == original.method
    framing = {b"content-length", b"transfer-encoding"}
    assert [field for field in request.headers if field[0] in framing] == [
        field for field in original.headers if field[0] in framing
    ]
    names = [name for name, _ in request.headers]
    assert b"proxy-authorization" not in names
    assert b"proxy-connection" not in names
    # Connection: close only when this client connection ends after it (the client said so).
    closing = original.http_version == b"1.0" or any(
        token.strip().lower() == b"close"
        for name, value in original.headers
        if name == b"connection"
        for token in value.split(b",")
    )
    connection = [value for name, value in request.headers if name == b"connection"]
    assert connection == ([b"close"] if closing else [])
    (host_header,) = [value.decode() for name, value in request.headers if name == b"host"]
    if host_header.startswith("["):
        literal, _, port = host_header[1:].partition("]")
        host, port = str(IPv6Address(literal)), port.removeprefix(":")
    else:
        host, _, port = host_header.partition(":")
    assert host.lower() == check.host.lower()
    assert int(port or 80) == check.port


@FUZZ
@given(HTTP_INPUT, CUTS, ANSWERS)
@example(
    raw=b"CONNECT a.com:443 HTTP/1.1\r\nHost: a\r\n\r\n\x16\x03",
    cuts=[1],
    answers=Answers(allowed=True, ok=True, error=""),
)
def test_http_machine_ends_cleanly_whatever_the_bytes_and_split(
    raw: bytes, cuts: list[int], answers: Answers
) -> None:
    transcript = run(HttpProxyMachine(), split(raw, cuts), answers)
    check_http_outcome(raw, transcript)
    assert run(HttpProxyMachine(), split(raw, []), answers) == transcript


@FUZZ
@given(near_the_limits(), CUTS, ANSWERS)
def test_http_machine_limits_hold_however_the_head_is_split(
    raw: bytes, cuts: list[int], answers: Answers
) -> None:
    transcript = run(HttpProxyMachine(), split(raw, cuts), answers)
    check_http_outcome(raw, transcript)
    assert run(HttpProxyMachine(), split(raw, []), answers) == transcript


# The SOCKS5 machine.

SOCKS_ADDRESSES = st.one_of(
    st.builds(lambda a: (1, a), st.binary(min_size=4, max_size=4)),
    st.builds(lambda a: (4, a), st.binary(min_size=16, max_size=16)),
    st.builds(
        lambda name: (3, bytes((len(name),)) + name),
        st.sampled_from([b"a.com", b"A.com", b"::1", b"[::1]", b"a b", b"\x00", b"", b"x" * 255])
        | st.binary(max_size=20),
    ),
    st.tuples(st.integers(0, 255), st.binary(max_size=20)),
)
SOCKS_INPUT = st.one_of(
    st.binary(max_size=80),
    st.builds(
        lambda version, methods, req_version, cmd, rsv, address, port, tail: (
            bytes((version, len(methods)))
            + methods
            + bytes((req_version, cmd, rsv, address[0]))
            + address[1]
            + port.to_bytes(2, "big")
            + tail
        ),
        st.sampled_from([5] * 8 + [4, 0]),
        st.sampled_from([b"\x00"] * 4 + [b"\x02\x00", b"\x02", b""]) | st.binary(max_size=5),
        st.sampled_from([5] * 8 + [4, 0]),
        st.sampled_from([1] * 6 + [2, 3, 0]),
        st.sampled_from([0] * 8 + [1]),
        SOCKS_ADDRESSES,
        st.sampled_from([443] * 3 + [0, 1, 65535]),
        st.binary(max_size=16),
    ),
)
SOCKS_INPUT = SOCKS_INPUT | st.builds(
    lambda raw, index, byte: mutate(raw, index, byte),
    st.sampled_from(
        [
            b"\x05\x01\x00\x05\x01\x00\x01\x7f\x00\x00\x01\x00\x50",
            b"\x05\x02\x02\x00\x05\x01\x00\x03\x05a.com\x01\xbbtail",
            b"\x05\x01\x00\x05\x01\x00\x04" + bytes(15) + b"\x01\x00\x16",
        ]
    ),
    st.integers(0, 40),
    st.integers(0, 255),
)


def check_socks_outcome(transcript: list[Step]) -> None:
    last = transcript[-1]
    if isinstance(last, ProtocolRefused):
        reply = last.reply
        assert reply in (b"", b"\x05\xff", SOCKS4_REJECTED) or (
            reply[:1] == b"\x05"
            and reply[1] in (1, 2, 7, 8)
            and reply[2:] == b"\x00\x01" + bytes(6)
        ), reply
        return
    assert transcript[0] == SendToClient(data=b"\x05\x00")
    check = transcript[1]
    assert isinstance(check, CheckEgress)
    assert_host(check.host)
    assert 1 <= check.port <= 65535
    if isinstance(last, tuple):
        assert len(last[1]) == 10 and last[1][1] in (0x01, 0x02, 0x04, 0x05)
        return
    assert isinstance(last, StartRelay)
    assert transcript[4] == ("upstream", b"\x05\x00\x00\x01" + bytes(6))


@FUZZ
@given(SOCKS_INPUT, CUTS, ANSWERS)
@example(
    raw=b"\x05\x01\x00\x05\x01\x00\x01\x7f\x00\x00\x01\x00\x50",
    cuts=[1],
    answers=Answers(allowed=True, ok=True, error=""),
)
def test_socks_machine_ends_cleanly_whatever_the_bytes_and_split(
    raw: bytes, cuts: list[int], answers: Answers
) -> None:
    transcript = run(Socks5Machine(), split(raw, cuts), answers)
    check_socks_outcome(transcript)
    assert run(Socks5Machine(), split(raw, []), answers) == transcript


@FUZZ
@given(st.binary(min_size=4, max_size=4))
def test_socks_ipv4_addresses_become_dotted_quads(address: bytes) -> None:
    raw = b"\x05\x01\x00\x05\x01\x00\x01" + address + b"\x01\xbb"
    transcript = run(Socks5Machine(), [raw], Answers(allowed=False, ok=False, error=""))
    assert transcript[1] == CheckEgress(host=str(IPv4Address(address)), port=443, kind="connect")
