"""The HTTP machine's forwarded exchanges (`State.EXCHANGE`), as transcripts: keep-alive, each
request decided on its own, the upstream reused only for its own target, and exact framing of
both legs (Content-Length, chunked, HEAD/204/304, 1xx, a body ending at EOF)."""

from __future__ import annotations

import pytest
from machine_kit import Step, drive_machine

from cc_server.egress.http_machine import HttpProxyMachine
from cc_server.egress.proto import (
    NEED_UPSTREAM_DATA,
    CheckEgress,
    CloseConnection,
    OpenUpstream,
    ProtocolError,
    ProtocolRefused,
    SendToClient,
    SendUpstream,
    State,
)


def drive(
    data: bytes, response: bytes | list[bytes] | None, *, chunk: int | None = None
) -> list[Step]:
    return drive_machine(HttpProxyMachine, data, response=response, chunk=chunk)


def get(host: str, path: str = "/", extra: bytes = b"") -> bytes:
    return b"GET http://%s%s HTTP/1.1\r\nHost: %s\r\n%s\r\n" % (
        host.encode(),
        path.encode(),
        host.encode(),
        extra,
    )


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def test_two_pipelined_requests_are_decided_one_at_a_time_and_share_the_upstream() -> None:
    steps = drive(get("a.com", "/1") + get("a.com", "/2"), [OK, OK])
    assert steps == [
        CheckEgress(host="a.com", port=80, kind="forward"),
        ("decide", b""),
        OpenUpstream(host="a.com", port=80),
        ("upstream", b""),
        SendUpstream(data=b"GET /1 HTTP/1.1\r\nHost: a.com\r\n\r\n"),
        SendToClient(data=OK),
        CheckEgress(host="a.com", port=80, kind="forward"),
        ("decide", b""),
        OpenUpstream(host="a.com", port=80, reuse=True),
        ("upstream", b""),
        SendUpstream(data=b"GET /2 HTTP/1.1\r\nHost: a.com\r\n\r\n"),
        SendToClient(data=OK),
        CloseConnection(reply=b"", reason="the client closed between requests"),
    ]


def test_pipelined_responses_are_not_reused_past_the_first() -> None:
    # The upstream sent both responses before the second request: bytes past the first
    # response are never read as the next one's.
    steps = drive(get("a.com", "/1") + get("a.com", "/2"), [OK + OK, OK])
    opens = [step for step in steps if isinstance(step, OpenUpstream)]
    assert [open_.reuse for open_ in opens] == [False, False]


@pytest.mark.parametrize("chunk", [1, 7, None])
def test_the_split_changes_nothing(chunk: int | None) -> None:
    # Content-Length bodies: chunked ones are framed again per piece read, so their chunk
    # boundaries follow the split (their bytes do not).
    data = get("a.com", "/1") + b"POST http://a.com/2 HTTP/1.1\r\nHost: a.com\r\n"
    data += b"Content-Length: 3\r\n\r\nabc"
    response = [b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nok\r\n", OK]
    assert drive(data, response, chunk=chunk) == drive(data, response)


def test_a_chunked_body_is_framed_again_with_its_bytes_unchanged() -> None:
    data = b"POST http://a.com/ HTTP/1.1\r\nHost: a.com\r\nTransfer-Encoding: chunked\r\n\r\n"
    data += b"3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nTrailer: dropped\r\n\r\n"
    response = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
    steps = drive(data, response)
    (up,) = [step.data for step in steps if isinstance(step, SendUpstream)]
    assert up.endswith(b"\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    (sent,) = [step.data for step in steps if isinstance(step, SendToClient)]
    assert sent == response


@pytest.mark.parametrize(
    ("first", "second"),
    [("a.com", "b.com"), ("a.com", "a.com:8080"), ("a.com:8080", "a.com")],
)
def test_another_target_never_reuses_the_upstream(first: str, second: str) -> None:
    steps = drive(get(first) + get(second), [OK, OK])
    opens = [step for step in steps if isinstance(step, OpenUpstream)]
    assert [open_.reuse for open_ in opens] == [False, False]


def test_the_host_is_compared_case_insensitively() -> None:
    steps = drive(get("a.com") + get("A.COM"), [OK, OK])
    opens = [step for step in steps if isinstance(step, OpenUpstream)]
    assert [open_.reuse for open_ in opens] == [False, True]


def test_bytes_past_the_response_mean_the_upstream_is_not_reused() -> None:
    steps = drive(get("a.com") + get("a.com"), [OK + b"HTTP/1.1 200 OK\r\n", OK])
    opens = [step for step in steps if isinstance(step, OpenUpstream)]
    assert [open_.reuse for open_ in opens] == [False, False]
    assert next(step for step in steps if isinstance(step, SendToClient)) == SendToClient(data=OK)


def test_a_denied_second_request_ends_the_connection_with_a_403() -> None:
    machine = HttpProxyMachine()
    machine.receive_data(get("a.com") + get("b.com"))
    assert isinstance(machine.next_event(), CheckEgress)
    machine.decide(True)
    assert machine.next_event() == OpenUpstream(host="a.com", port=80)
    machine.upstream_result(True)
    assert isinstance(machine.next_event(), SendUpstream)
    assert machine.next_event() is NEED_UPSTREAM_DATA
    machine.receive_upstream_data(OK)
    assert machine.next_event() == SendToClient(data=OK)
    assert machine.next_event() == CheckEgress(host="b.com", port=80, kind="forward")
    assert machine.decide(False, "no").startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert machine.state is State.CLOSED


def test_reused_without_an_offer_is_a_driver_bug() -> None:
    machine = HttpProxyMachine()
    machine.receive_data(get("a.com"))
    machine.next_event()
    machine.decide(True)
    machine.next_event()
    with pytest.raises(ProtocolError, match="reuse"):
        machine.upstream_result(True, reused=True)


@pytest.mark.parametrize(("method", "status"), [(b"HEAD", 200), (b"GET", 204), (b"GET", 304)])
def test_responses_without_a_body_keep_the_connection(method: bytes, status: int) -> None:
    request = get("a.com").replace(b"GET", method, 1)
    head = b"HTTP/1.1 %d X\r\nContent-Length: 5\r\n\r\n" % status
    steps = drive(request + get("a.com"), [head, OK])
    sent = [step.data for step in steps if isinstance(step, SendToClient)]
    assert sent == [head, OK]  # nothing read as the first one's body


def test_an_interim_response_is_passed_on_before_the_final_one() -> None:
    request = (
        b"POST http://a.com/ HTTP/1.1\r\nHost: a.com\r\nExpect: 100-continue\r\n"
        b"Content-Length: 2\r\n\r\nhi"
    )
    steps = drive(request, b"HTTP/1.1 100 Continue\r\n\r\n" + OK)
    (sent,) = [step.data for step in steps if isinstance(step, SendToClient)]
    assert sent == b"HTTP/1.1 100 Continue\r\n\r\n" + OK


def test_a_body_ending_at_eof_is_framed_for_the_client_and_ends_its_connection() -> None:
    steps = drive(get("a.com") + get("a.com"), b"HTTP/1.1 200 OK\r\nX: 1\r\n\r\nall of it")
    (sent,) = [step.data for step in steps if isinstance(step, SendToClient)]
    assert sent == (
        b"HTTP/1.1 200 OK\r\nX: 1\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"9\r\nall of it\r\n0\r\n\r\n"
    )
    assert steps[-1] == CloseConnection(reply=b"", reason="the response ended the connection")
    assert sum(isinstance(step, CheckEgress) for step in steps) == 1


def test_hop_by_hop_response_headers_are_dropped() -> None:
    response = (
        b"HTTP/1.1 200 OK\r\nConnection: close, X-Hop\r\nKeep-Alive: 5\r\nX-Hop: 1\r\n"
        b"X-End: 2\r\nContent-Length: 2\r\n\r\nok"
    )
    steps = drive(get("a.com"), response)
    (sent,) = [step.data for step in steps if isinstance(step, SendToClient)]
    assert sent == b"HTTP/1.1 200 OK\r\nX-End: 2\r\nContent-Length: 2\r\n\r\nok"


def test_the_client_saying_close_ends_the_connection_after_the_response() -> None:
    steps = drive(get("a.com", extra=b"Connection: close\r\n") + get("b.com"), OK)
    assert steps[4] == SendUpstream(
        data=b"GET / HTTP/1.1\r\nHost: a.com\r\nConnection: close\r\n\r\n"
    )
    assert steps[-1] == CloseConnection(reply=b"", reason="the response ended the connection")
    assert sum(isinstance(step, CheckEgress) for step in steps) == 1


@pytest.mark.parametrize(
    "response",
    [b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nok", b""],
    ids=["malformed", "cut-short", "closed"],
)
def test_a_broken_upstream_response_ends_the_connection(response: bytes) -> None:
    steps = drive(get("a.com") + get("a.com"), response)
    last = steps[-1]
    assert isinstance(last, CloseConnection)
    if response.startswith(b"HTTP"):  # the head was passed on: nothing more to say
        assert last.reply == b""
        assert SendToClient(data=response) in steps
    else:
        assert last.reply.startswith(b"HTTP/1.1 502 Bad Gateway\r\n")


@pytest.mark.parametrize(
    ("second", "reason"),
    [
        (b"GET http://a.com/ HTTP/1.1\r\nHost: a.com\r\nX: 1\r\n y\r\n\r\n", "folding"),
        (b"GET http://a.com/ HTTP/1.1\nHost: a.com\r\n\r\n", "bare LF"),
        (b"\r\nGET http://a.com/ HTTP/1.1\r\nHost: a.com\r\n\r\n", "request line"),
        (
            b"POST http://a.com/ HTTP/1.1\r\nHost: a.com\r\nContent-Length: 1\r\n"
            b"Content-Length: 2\r\n\r\nab",
            "Content-Length",
        ),
    ],
)
def test_a_second_request_with_ambiguous_framing_is_refused(second: bytes, reason: str) -> None:
    steps = drive(get("a.com") + second, OK)
    last = steps[-1]
    assert isinstance(last, ProtocolRefused)
    assert reason in last.reason
    assert last.reply.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert sum(isinstance(step, CheckEgress) for step in steps) == 1
