"""The sans-IO SOCKS5 machine: byte-exact happy paths, every refusal, splitting, call order."""

from __future__ import annotations

from ipaddress import IPv6Address

import pytest
from machine_kit import Step, drive_machine

from cc_server.egress.proto import (
    NEED_DATA,
    UPSTREAM_REFUSED,
    UPSTREAM_UNREACHABLE,
    CheckEgress,
    HandshakeMachine,
    OpenUpstream,
    ProtocolError,
    ProtocolRefused,
    SendToClient,
    StartRelay,
    State,
)
from cc_server.egress.socks_machine import (
    SOCKS4_REJECTED,
    Socks5Machine,
    socks5_reply,
)

GREETING = b"\x05\x01\x00"
METHOD_SELECTED = b"\x05\x00"
NO_METHOD = b"\x05\xff"
SUCCESS = b"\x05\x00\x00\x01\x00\x00\x00\x00\x00\x00"
TLS_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32))


def request(atyp: int, address: bytes, port: int = 443, *, cmd: int = 1) -> bytes:
    return bytes((5, cmd, 0, atyp)) + address + port.to_bytes(2, "big")


def domain(name: bytes, port: int = 443) -> bytes:
    return request(3, bytes((len(name),)) + name, port)




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
    """Run a Socks5Machine like the driver does (machine_kit.drive_machine)."""
    return drive_machine(
        Socks5Machine,
        data,
        chunk=chunk,
        allowed=allowed,
        ok=ok,
        error=error,
        eof=eof,
        reason="not allowed",
        how_to_allow="ask",
    )


def happy(host: str, port: int, pipelined: bytes) -> list[Step]:
    return [
        SendToClient(data=METHOD_SELECTED),
        CheckEgress(host=host, port=port, kind="connect"),
        ("decide", b""),
        OpenUpstream(host=host, port=port),
        ("upstream", SUCCESS),
        StartRelay(to_upstream=pipelined, to_client=b""),
    ]


# Happy paths, byte-exact.


def test_ipv4_connect_step_by_step() -> None:
    machine = Socks5Machine()
    assert machine.next_event() is NEED_DATA
    machine.receive_data(GREETING)
    assert machine.next_event() == SendToClient(data=b"\x05\x00")
    assert state(machine) is State.READING
    assert machine.next_event() is NEED_DATA
    machine.receive_data(request(1, bytes((93, 184, 216, 34)), 80) + b"GET / HTTP/1.0\r\n\r\n")
    assert machine.next_event() == CheckEgress(host="93.184.216.34", port=80, kind="connect")
    assert state(machine) is State.CHECKING
    assert machine.decide(True) == b""
    assert machine.next_event() == OpenUpstream(host="93.184.216.34", port=80)
    assert machine.upstream_result(True) == SUCCESS
    assert state(machine) is State.RELAY
    assert machine.next_event() == StartRelay(to_upstream=b"GET / HTTP/1.0\r\n\r\n", to_client=b"")
    assert machine.buffered_bytes == 0


def test_domain_connect_with_pipelined_tls_bytes_in_the_same_packet() -> None:
    data = b"\x05\x02\x02\x00" + domain(b"api.Example.com") + TLS_HELLO
    assert drive(data) == happy("api.Example.com", 443, TLS_HELLO)


@pytest.mark.parametrize(
    ("address", "host"),
    [
        (IPv6Address("::1").packed, "::1"),
        (IPv6Address("2001:db8::1").packed, "2001:db8::1"),
        (IPv6Address("::ffff:169.254.169.254").packed, str(IPv6Address("::ffff:a9fe:a9fe"))),
    ],
)
def test_ipv6_connect(address: bytes, host: str) -> None:
    assert drive(GREETING + request(4, address, 22)) == happy(host, 22, b"")


@pytest.mark.parametrize(
    ("name", "host"),
    [
        (b"example.com", "example.com"),
        (b"127.0.0.1", "127.0.0.1"),
        (b"0x7f.1", "0x7f.1"),
        (b"a" * 255, "a" * 255),
        (b"_srv.example.com", "_srv.example.com"),
        (b"::1", "::1"),
        (b"2001:DB8:0::1", "2001:db8::1"),
    ],
)
def test_domain_names_are_reported_as_given(name: bytes, host: str) -> None:
    assert drive(GREETING + domain(name, 65535)) == happy(host, 65535, b"")


def test_the_success_reply_binds_nothing() -> None:
    assert socks5_reply(0) == SUCCESS


# Greeting refusals.


@pytest.mark.parametrize(
    ("data", "reply", "reason"),
    [
        (b"\x05\x01\x02", NO_METHOD, "0x00"),
        (b"\x05\x02\x01\x02", NO_METHOD, "0x00"),
        (b"\x05\x00", NO_METHOD, "no authentication method"),
        (b"\x04\x01\x00\x50\x7f\x00\x00\x01user\x00", SOCKS4_REJECTED, "SOCKS4"),
        (b"\x04", SOCKS4_REJECTED, "SOCKS4"),
        (b"GET / HTTP/1.1\r\n\r\n", b"", "0x47"),
        (b"\x16\x03\x01", b"", "0x16"),
        (b"\x00", b"", "0x00"),
    ],
)
def test_greeting_refusals(data: bytes, reply: bytes, reason: str) -> None:
    (last,) = drive(data)
    assert isinstance(last, ProtocolRefused)
    assert last.reply == reply
    assert reason in last.reason


def test_socks4_rejected_reply_is_the_socks4_failure_code() -> None:
    assert b"\x00\x5b" + bytes(6) == SOCKS4_REJECTED


# Request refusals.


@pytest.mark.parametrize(
    ("req", "rep", "reason"),
    [
        (b"\x04\x01\x00\x01" + bytes(6), 0x01, "version 4"),
        (request(1, bytes(4), cmd=2), 0x07, "BIND"),
        (request(1, bytes(4), cmd=3), 0x07, "UDP ASSOCIATE"),
        (request(1, bytes(4), cmd=9), 0x07, "command 0x09"),
        (b"\x05\x01\x01\x01" + bytes(6), 0x01, "reserved"),
        (b"\x05\x01\x00\x02" + bytes(6), 0x08, "address type 0x02"),
        (b"\x05\x01\x00\x00", 0x08, "address type 0x00"),
        (request(3, b"\x00"), 0x01, "empty domain"),
        (domain(b"exa\x00mple.com"), 0x01, "bad domain"),
        (domain(b"ex ample.com"), 0x01, "bad domain"),
        (domain(b"b\xc3\xbccher.de"), 0x01, "bad domain"),
        (domain(b"a%2e.com"), 0x01, "bad domain"),
        (domain(b"user@a.com"), 0x01, "bad domain"),
        (domain(b"[::1]"), 0x01, "bad domain"),
        (domain(b"fe80::1%eth0"), 0x01, "bad domain"),
        (domain(b"1:2:3"), 0x01, "bad domain"),
        (domain(b"example.com", 0), 0x02, "port 0"),
        (request(1, bytes((1, 2, 3, 4)), 0), 0x02, "port 0"),
    ],
)
def test_request_refusals(req: bytes, rep: int, reason: str) -> None:
    *_, last = drive(GREETING + req)
    assert isinstance(last, ProtocolRefused)
    assert last.reply == socks5_reply(rep)
    assert reason in last.reason


# Denial and upstream failure.


def test_denied_is_reply_0x02() -> None:
    steps = drive(GREETING + domain(b"evil.example"), allowed=False)
    assert steps[-1] == ("decide", b"\x05\x02\x00\x01\x00\x00\x00\x00\x00\x00")


@pytest.mark.parametrize(
    ("error", "rep"),
    [
        (UPSTREAM_REFUSED, 0x05),
        (UPSTREAM_UNREACHABLE, 0x04),
        ("timed out", 0x01),
        ("", 0x01),
    ],
)
def test_upstream_failure_codes(error: str, rep: int) -> None:
    steps = drive(GREETING + domain(b"a.com"), ok=False, error=error)
    assert steps[-1] == ("upstream", socks5_reply(rep))


# EOF and splitting.

FULL = b"\x05\x02\x02\x00" + domain(b"example.com") + TLS_HELLO


@pytest.mark.parametrize("cut", range(len(FULL) - len(TLS_HELLO)))
def test_eof_anywhere_in_the_handshake_is_refused_without_reply(cut: int) -> None:
    *_, last = drive(FULL[:cut])
    assert last == ProtocolRefused(reply=b"", reason="client closed during the SOCKS5 handshake")


@pytest.mark.parametrize("cut", range(len(FULL) - len(TLS_HELLO)))
def test_partial_handshake_without_eof_asks_for_more(cut: int) -> None:
    assert drive(FULL[:cut], eof=False)[-1] is NEED_DATA


SPLIT_CASES = [
    FULL,
    GREETING + request(1, bytes((10, 0, 0, 1)), 8080) + b"x",
    GREETING + request(4, IPv6Address("::1").packed, 443),
    GREETING + domain(b"bad name"),
    GREETING + request(1, bytes(4), cmd=2),
    b"\x05\x01\x02",
    b"\x04\x01",
    b"junk",
]


@pytest.mark.parametrize("data", SPLIT_CASES, ids=range(len(SPLIT_CASES)))
@pytest.mark.parametrize("allowed", [True, False])
def test_one_byte_at_a_time_gives_the_same_result_as_all_at_once(
    data: bytes, allowed: bool
) -> None:
    whole = drive(data, allowed=allowed)
    assert drive(data, chunk=1, allowed=allowed) == whole
    assert drive(data, chunk=3, allowed=allowed) == whole


def test_greeting_and_request_split_by_the_driver_reading_twice() -> None:
    machine = Socks5Machine()
    machine.receive_data(GREETING)
    assert machine.next_event() == SendToClient(data=METHOD_SELECTED)
    assert machine.next_event() is NEED_DATA
    assert machine.next_event() is NEED_DATA  # asking again changes nothing
    machine.receive_data(domain(b"a.com")[:3])
    assert machine.next_event() is NEED_DATA
    assert machine.buffered_bytes == 3


# Call order and ERROR.


def checking_machine() -> Socks5Machine:
    machine = Socks5Machine()
    machine.receive_data(GREETING + domain(b"a.com"))
    assert isinstance(machine.next_event(), SendToClient)
    assert isinstance(machine.next_event(), CheckEgress)
    return machine


def assert_in_error(machine: Socks5Machine) -> None:
    assert state(machine) is State.ERROR
    with pytest.raises(ProtocolError, match="ERROR"):
        machine.next_event()
    with pytest.raises(ProtocolError, match="ERROR"):
        machine.decide(False)


def test_feeding_after_send_to_client_without_need_data_is_a_driver_bug() -> None:
    machine = Socks5Machine()
    machine.receive_data(GREETING)
    machine.next_event()
    with pytest.raises(ProtocolError, match="NEED_DATA"):
        machine.receive_data(domain(b"a.com"))
    assert_in_error(machine)


def test_decide_twice_is_a_driver_bug() -> None:
    machine = checking_machine()
    machine.decide(True)
    with pytest.raises(ProtocolError, match="pending CheckEgress"):
        machine.decide(True)
    assert_in_error(machine)


def test_upstream_result_twice_is_a_driver_bug() -> None:
    machine = checking_machine()
    machine.decide(True)
    machine.next_event()
    machine.upstream_result(True)
    with pytest.raises(ProtocolError, match="pending OpenUpstream"):
        machine.upstream_result(True)
    assert_in_error(machine)


def test_next_event_after_refusal_is_a_driver_bug() -> None:
    machine = Socks5Machine()
    machine.receive_data(b"junk")
    assert isinstance(machine.next_event(), ProtocolRefused)
    assert state(machine) is State.CLOSED
    with pytest.raises(ProtocolError, match="over"):
        machine.next_event()
    assert_in_error(machine)


def test_an_exception_inside_the_machine_moves_it_to_error() -> None:
    machine = Socks5Machine()
    with pytest.raises(TypeError):
        machine.receive_data(12)  # type: ignore[arg-type]
    assert_in_error(machine)


def test_an_unreachable_target_gets_host_unreachable_and_ends_the_conversation() -> None:
    machine = Socks5Machine()
    machine.receive_data(GREETING)
    assert machine.next_event() == SendToClient(data=METHOD_SELECTED)
    assert machine.next_event() is NEED_DATA
    machine.receive_data(domain(b"a.com"))
    assert isinstance(machine.next_event(), CheckEgress)
    assert machine.unreachable(UPSTREAM_UNREACHABLE) == socks5_reply(0x04)
    assert state(machine) is State.CLOSED
    with pytest.raises(ProtocolError, match="over"):
        machine.next_event()
