"""The asyncio egress driver on real loopback sockets: relaying, refusals, the address guard,
limits, teardown, Unix-socket listeners.

Every server these tests reach is one they start on 127.0.0.1; names resolve through a fake
resolver, never through DNS.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import socket
import stat
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, ip_address
from pathlib import Path

import pytest

from cc_server.egress import driver
from cc_server.egress import relay as relay_module
from cc_server.egress.addresses import IPAddress
from cc_server.egress.driver import (
    EgressRefused,
    ProxyLimits,
    ProxyParams,
    SessionProxies,
    open_session_proxies,
    start_session_proxies,
)
from cc_server.egress.patterns import Allowlist, AllowlistRule, parse_pattern
from cc_server.errors import EnforcementFailed

LOOPBACK = IPv4Address("127.0.0.1")
MIB = 1024 * 1024
SOCKS_GREETING = b"\x05\x01\x00"
SOCKS_SUCCESS = b"\x05\x00\x00\x01\x00\x00\x00\x00\x00\x00"

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def allowlist(*patterns: str, denied: tuple[str, ...] = ()) -> Allowlist:
    return Allowlist(
        patterns=tuple(AllowlistRule(parse_pattern(p), "test") for p in patterns),
        denied=tuple(AllowlistRule(parse_pattern(p), "test deny") for p in denied),
    )


DEFAULT_ALLOWLIST = allowlist("allowed.test", "*.allowed.test", "127.0.0.1")
DEFAULT_LIMITS = ProxyLimits()


@dataclass
class FakeResolver:
    """Maps names to addresses; counts the calls; never touches DNS."""

    table: dict[str, list[IPAddress]] = field(
        default_factory=lambda: {
            "allowed.test": [LOOPBACK],
            "metadata.allowed.test": [ip_address("169.254.169.254")],
            # A public address first (never dialled: the test below forbids dialling).
            "mixed.allowed.test": [ip_address("93.184.215.14"), LOOPBACK],
        }
    )
    calls: list[tuple[str, int]] = field(default_factory=list)

    async def __call__(self, host: str, port: int) -> list[IPAddress]:
        self.calls.append((host, port))
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.table[host])


@dataclass
class Session:
    proxies: SessionProxies
    refusals: list[EgressRefused]
    resolver: FakeResolver


@contextlib.asynccontextmanager
async def session(
    allow: Allowlist = DEFAULT_ALLOWLIST,
    *,
    limits: ProxyLimits = DEFAULT_LIMITS,
    socket_dir: str | None = None,
    suggest: Callable[[str], str | None] = lambda host: None,
    on_refused: Callable[[EgressRefused], None] | None = None,
) -> AsyncIterator[Session]:
    refusals: list[EgressRefused] = []
    resolver = FakeResolver()
    params = ProxyParams(
        session_id="s1",
        allowlist=allow,
        on_refused=on_refused or refusals.append,
        suggest=suggest,
        socket_dir=socket_dir,
        resolver=resolver,
        limits=limits,
    )
    async with open_session_proxies(params) as proxies:
        yield Session(proxies, refusals, resolver)


@contextlib.asynccontextmanager
async def upstream(handler: Handler, host: str = "127.0.0.1") -> AsyncIterator[int]:
    """A loopback server running `handler` per connection; yields its port."""
    tasks: set[asyncio.Task[None]] = set()

    async def wrapped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_server(wrapped, host, 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=2)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(256 * 1024):
        writer.write(data)
        await writer.drain()
    writer.write_eof()


def sender(payload: bytes) -> Handler:
    """Sends `payload`, then closes (an EOF-delimited download)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(payload)
        await writer.drain()

    return handler


def half_closer(tail: bytes) -> Handler:
    """Reads until EOF, then answers with the byte count, the sha256 and `tail`."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()
        writer.write(b"%d %s\n" % (len(data), hashlib.sha256(data).hexdigest().encode()))
        writer.write(tail)
        await writer.drain()

    return handler


def payload(size: int) -> bytes:
    return os.urandom(size)


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def http_connect(
    port: int, target: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """Open a CONNECT tunnel; return the streams and the proxy's response head."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    return reader, writer, head


def connect_request(target: str) -> bytes:
    return f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()


async def refused_reply(port: int, request: bytes) -> bytes:
    """Send a request; return everything up to the proxy's close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        await close(writer)


def socks_domain(name: str, port: int) -> bytes:
    raw = name.encode()
    return b"\x05\x01\x00\x03" + bytes((len(raw),)) + raw + port.to_bytes(2, "big")


def socks_ipv4(address: str, port: int) -> bytes:
    return b"\x05\x01\x00\x01" + socket.inet_aton(address) + port.to_bytes(2, "big")


async def socks_connect(
    port: int, request: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(SOCKS_GREETING)
    assert await reader.readexactly(2) == b"\x05\x00"
    writer.write(request)
    return reader, writer, await reader.readexactly(10)


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes
) -> bytes:
    """Send `data` and half-close while reading everything that comes back."""

    async def send() -> None:
        for start in range(0, len(data), MIB):
            writer.write(data[start : start + MIB])
            await writer.drain()
        writer.write_eof()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(send(), name="test send")
        received = tg.create_task(reader.read(), name="test receive")
    return received.result()


def closed_port() -> socket.socket:
    """A bound, non-listening loopback socket: connecting to its port is refused."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


# Relaying.


async def test_connect_to_an_allowed_name_relays_5_mib_both_ways_exactly() -> None:
    data = payload(5 * MIB)
    async with session() as s, upstream(echo) as port:
        reader, writer, head = await http_connect(s.proxies.http_port, f"allowed.test:{port}")
        assert head == b"HTTP/1.1 200 Connection established\r\n\r\n"
        try:
            assert await exchange(reader, writer, data) == data
        finally:
            await close(writer)
        assert s.resolver.calls == [("allowed.test", port)]
        assert s.refusals == []


async def test_eof_delimited_download_arrives_whole() -> None:
    data = payload(5 * MIB + 17)
    async with session() as s, upstream(sender(data)) as port:
        reader, writer, _ = await http_connect(s.proxies.http_port, f"allowed.test:{port}")
        try:
            received = await reader.read()
        finally:
            await close(writer)
        assert hashlib.sha256(received).digest() == hashlib.sha256(data).digest()


async def test_client_half_close_upstream_still_sends_the_rest() -> None:
    sent, tail = payload(3 * MIB), payload(2 * MIB)
    async with session() as s, upstream(half_closer(tail)) as port:
        reader, writer, _ = await http_connect(s.proxies.http_port, f"allowed.test:{port}")
        try:
            answer = await exchange(reader, writer, sent)
        finally:
            await close(writer)
    line, _, rest = answer.partition(b"\n")
    assert line == b"%d %s" % (len(sent), hashlib.sha256(sent).hexdigest().encode())
    assert rest == tail


async def test_bytes_pipelined_behind_connect_go_upstream_first() -> None:
    async with session() as s, upstream(echo) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.proxies.http_port)
        target = f"allowed.test:{port}"
        writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\nhello".encode())
        try:
            await reader.readuntil(b"\r\n\r\n")
            assert await exchange(reader, writer, b" world") == b"hello world"
        finally:
            await close(writer)


async def test_relay_uses_splice_where_available(monkeypatch: pytest.MonkeyPatch) -> None:
    if not relay_module.splice_available():
        pytest.skip("os.splice is Linux-only")
    calls = 0
    real_splice = os.splice

    def counting_splice(*args: int, **kwargs: int) -> int:
        nonlocal calls
        calls += 1
        return real_splice(*args, **kwargs)

    monkeypatch.setattr(os, "splice", counting_splice)
    data = payload(2 * MIB)
    async with session() as s, upstream(echo) as port:
        reader, writer, _ = await http_connect(s.proxies.http_port, f"allowed.test:{port}")
        try:
            assert await exchange(reader, writer, data) == data
        finally:
            await close(writer)
    assert calls > 4


async def test_a_destination_that_refuses_splice_midway_gets_the_bytes_copied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """splice into the pipe works, out of it fails with EINVAL: the bytes already in the pipe are
    taken back out and sent, then the direction copies."""
    if not relay_module.splice_available():
        pytest.skip("os.splice is Linux-only")
    real_splice = os.splice

    def no_splice_into_sockets(src: int, dst: int, count: int, **kwargs: int) -> int:
        if not stat.S_ISFIFO(os.fstat(dst).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_splice(src, dst, count, **kwargs)

    monkeypatch.setattr(os, "splice", no_splice_into_sockets)
    data, tail = payload(3 * MIB), payload(MIB)
    async with session() as s, upstream(half_closer(tail)) as port:
        reader, writer, _ = await http_connect(s.proxies.http_port, f"allowed.test:{port}")
        try:
            answer = await exchange(reader, writer, data)
        finally:
            await close(writer)
    line, _, rest = answer.partition(b"\n")
    assert line == b"%d %s" % (len(data), hashlib.sha256(data).hexdigest().encode())
    assert rest == tail


async def test_relay_without_splice_copies_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_module, "splice_available", lambda: False)
    data, tail = payload(3 * MIB), payload(MIB)
    async with session() as s, upstream(echo) as echo_port:
        reader, writer, _ = await http_connect(s.proxies.http_port, f"allowed.test:{echo_port}")
        try:
            assert await exchange(reader, writer, data) == data
        finally:
            await close(writer)
        async with upstream(half_closer(tail)) as port:
            reader, writer, _ = await http_connect(s.proxies.http_port, f"allowed.test:{port}")
            try:
                answer = await exchange(reader, writer, data)
            finally:
                await close(writer)
    assert answer.endswith(b"\n" + tail)
    assert answer.startswith(b"%d " % len(data))


async def test_absolute_form_get_is_forwarded_in_origin_form_and_the_close_passed_on() -> None:
    seen: list[bytes] = []

    async def origin(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()

    async with session() as s, upstream(origin) as port:
        request = (
            f"GET http://allowed.test:{port}/x?y=1 HTTP/1.1\r\n"
            f"Host: allowed.test:{port}\r\nProxy-Connection: keep-alive\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        response = await refused_reply(s.proxies.http_port, request)
    assert response.startswith(b"HTTP/1.1 200 OK\r\n")
    assert response.endswith(b"\r\n\r\nok")
    head = seen[0].decode()
    assert head.startswith("GET /x?y=1 HTTP/1.1\r\n")
    assert "Connection: close\r\n" in head
    assert "Proxy-Connection" not in head


async def test_socks5_connect_by_domain_and_by_ipv4() -> None:
    async with session() as s, upstream(echo) as port:
        for request in (socks_domain("allowed.test", port), socks_ipv4("127.0.0.1", port)):
            reader, writer, reply = await socks_connect(s.proxies.socks_port, request)
            try:
                assert reply == SOCKS_SUCCESS
                assert await exchange(reader, writer, b"ping" * 1000) == b"ping" * 1000
            finally:
                await close(writer)
        assert s.resolver.calls == [("allowed.test", port)]  # the literal needs no resolving
        assert s.refusals == []


def ipv6_loopback_available() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback_available(), reason="no IPv6 loopback here")
async def test_ipv6_targets_work_when_the_address_is_listed() -> None:
    async with session(allowlist("::1")) as s, upstream(echo, "::1") as port:
        request = b"\x05\x01\x00\x04" + socket.inet_pton(socket.AF_INET6, "::1")
        reader, writer, reply = await socks_connect(
            s.proxies.socks_port, request + port.to_bytes(2, "big")
        )
        try:
            assert reply == SOCKS_SUCCESS
            assert await exchange(reader, writer, b"six") == b"six"
        finally:
            await close(writer)
        reader, writer, head = await http_connect(s.proxies.http_port, f"[::1]:{port}")
        try:
            assert head.startswith(b"HTTP/1.1 200 ")
            assert await exchange(reader, writer, b"six") == b"six"
        finally:
            await close(writer)
        assert s.refusals == []


async def test_an_allowlisted_literal_in_a_short_spelling_is_dialled() -> None:
    async with session() as s, upstream(echo) as port:
        reader, writer, head = await http_connect(s.proxies.http_port, f"127.1:{port}")
        try:
            assert head.startswith(b"HTTP/1.1 200 ")
            assert await exchange(reader, writer, b"x") == b"x"
        finally:
            await close(writer)


def abort_with_reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def test_an_upstream_reset_reaches_the_client_as_a_reset_not_an_eof() -> None:
    async def resetter(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(payload(MIB))
        await writer.drain()
        await reader.readexactly(1)  # the client has read the megabyte
        abort_with_reset(writer)

    async with session() as s, upstream(resetter) as port:
        reader, writer, _ = await http_connect(s.proxies.http_port, f"allowed.test:{port}")
        try:
            await reader.readexactly(MIB)
            writer.write(b"k")
            with pytest.raises(ConnectionResetError):
                async with asyncio.timeout(3):
                    await reader.read()
        finally:
            await close(writer)
        await wait_for(lambda: s.proxies.active_connections == 0)


async def test_a_client_that_vanishes_mid_download_frees_its_tunnel() -> None:
    upstream_done = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        chunk = payload(MIB)
        try:
            while True:
                writer.write(chunk)
                await writer.drain()
        finally:
            upstream_done.set()

    async with session() as s, upstream(endless) as port:
        reader, writer, _ = await http_connect(s.proxies.http_port, f"allowed.test:{port}")
        await reader.readexactly(2 * MIB)
        abort_with_reset(writer)
        async with asyncio.timeout(3):
            await upstream_done.wait()
        await wait_for(lambda: s.proxies.active_connections == 0)
        reader, writer, head = await http_connect(s.proxies.http_port, f"allowed.test:{port}")
        abort_with_reset(writer)
        assert head.startswith(b"HTTP/1.1 200 ")


# Refusals.


async def test_a_name_not_on_the_allowlist_gets_403_and_one_report() -> None:
    async with session(suggest=lambda host: "canCallGitHubApi") as s:
        response = await refused_reply(s.proxies.http_port, connect_request("GitHub.com:443"))
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403 ")
    assert b"\r\nX-Cc-Server-Egress: denied\r\n" in head + b"\r\n"
    assert b"--allow-domain github.com" in body
    assert b"canCallGitHubApi" in body
    assert s.resolver.calls == []
    [refusal] = s.refusals
    assert (refusal.host, refusal.port, refusal.protocol) == ("github.com", 443, "http")
    assert refusal.suggested_capability == "canCallGitHubApi"
    assert "not on this session's egress allowlist" in refusal.reason
    assert "\n" not in refusal.raw and "GitHub.com:443" in refusal.raw


async def test_socks5_denied_gets_reply_2_and_one_report() -> None:
    async with session() as s:
        _, writer, reply = await socks_connect(
            s.proxies.socks_port, socks_domain("example.com", 443)
        )
        await close(writer)
    assert reply == b"\x05\x02\x00\x01\x00\x00\x00\x00\x00\x00"
    [refusal] = s.refusals
    assert (refusal.host, refusal.port, refusal.protocol) == ("example.com", 443, "socks5")


async def test_deny_list_wins_and_says_no_allowlist_entry_helps() -> None:
    allow = allowlist("allowed.test", "*.allowed.test", denied=("metadata.allowed.test",))
    async with session(allow) as s:
        response = await refused_reply(
            s.proxies.http_port, connect_request("metadata.allowed.test:80")
        )
    assert response.startswith(b"HTTP/1.1 403 ")
    assert b"deny list" in response
    assert b"--allow-domain" not in response
    assert len(s.refusals) == 1


@pytest.mark.parametrize(
    ("name", "expected"),
    [("metadata.allowed.test", "cloud metadata"), ("allowed.test", "loopback")],
)
async def test_a_name_resolving_to_a_forbidden_address_is_refused(name: str, expected: str) -> None:
    allow = allowlist("allowed.test", "*.allowed.test")  # 127.0.0.1 itself is not listed
    async with session(allow) as s:
        response = await refused_reply(s.proxies.http_port, connect_request(f"{name}:80"))
        _, _, socks_reply = await _socks_refused(s.proxies.socks_port, socks_domain(name, 80))
    assert response.startswith(b"HTTP/1.1 403 ")
    assert socks_reply[:2] == b"\x05\x02"
    assert [r.host for r in s.refusals] == [name, name]
    assert all(expected in r.reason and "resolves to" in r.reason for r in s.refusals)
    assert s.resolver.calls == [(name, 80), (name, 80)]


async def test_any_forbidden_answer_refuses_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # mixed.allowed.test resolves to a public address and to 127.0.0.1 (not listed here).
    async def no_dial(*args: object) -> None:
        raise AssertionError("the proxy dialled a name it should have refused")

    monkeypatch.setattr(driver._Connection, "_dial", no_dial)
    allow = allowlist("*.allowed.test")
    async with session(allow) as s:
        response = await refused_reply(
            s.proxies.http_port, connect_request("mixed.allowed.test:80")
        )
    assert response.startswith(b"HTTP/1.1 403 ")
    [refusal] = s.refusals
    assert "127.0.0.1" in refusal.reason and "loopback" in refusal.reason


@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [
        ("2130706433", "127.0.0.1"),
        ("0x7f.1", "127.0.0.1"),
        ("127.1", "127.0.0.1"),
        ("0177.0.0.1", "127.0.0.1"),
        ("[::ffff:127.0.0.1]", "::ffff:127.0.0.1"),
        ("169.254.169.254", "169.254.169.254"),
    ],
)
async def test_ip_literal_spellings_are_refused_when_not_listed(
    spelling: str, canonical: str
) -> None:
    async with session(allowlist("allowed.test")) as s:
        response = await refused_reply(s.proxies.http_port, connect_request(f"{spelling}:80"))
    assert response.startswith(b"HTTP/1.1 403 ")
    [refusal] = s.refusals
    assert (ip_address(refusal.host), refusal.port) == (ip_address(canonical), 80)
    assert s.resolver.calls == []


async def test_socks_domain_that_is_a_decimal_literal_is_refused() -> None:
    async with session(allowlist("allowed.test")) as s:
        _, _, reply = await _socks_refused(s.proxies.socks_port, socks_domain("2130706433", 80))
    assert reply[:2] == b"\x05\x02"
    assert [r.host for r in s.refusals] == ["127.0.0.1"]
    assert s.resolver.calls == []


async def test_an_empty_allowlist_refuses_everything() -> None:
    async with session(Allowlist()) as s, upstream(echo) as port:
        for target in (f"allowed.test:{port}", f"127.0.0.1:{port}"):
            response = await refused_reply(s.proxies.http_port, connect_request(target))
            assert response.startswith(b"HTTP/1.1 403 ")
        _, _, reply = await _socks_refused(s.proxies.socks_port, socks_ipv4("127.0.0.1", port))
    assert reply[:2] == b"\x05\x02"
    assert len(s.refusals) == 3
    assert all("allowlist is empty" in r.reason for r in s.refusals)
    assert s.resolver.calls == []


async def _socks_refused(
    port: int, request: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer, reply = await socks_connect(port, request)
    try:
        assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        await close(writer)
    return reader, writer, reply


# Upstream failures: answered in-protocol, never reported as violations.


async def test_an_unresolvable_name_is_an_upstream_failure_not_a_violation() -> None:
    async with session() as s:
        response = await refused_reply(
            s.proxies.http_port, connect_request("nowhere.allowed.test:80")
        )
        _, _, reply = await _socks_refused(
            s.proxies.socks_port, socks_domain("nowhere.allowed.test", 80)
        )
    assert response.startswith(b"HTTP/1.1 502 ")
    assert reply[:2] == b"\x05\x04"
    assert s.refusals == []


async def test_a_refused_upstream_gives_502_and_socks_5() -> None:
    with closed_port() as closed:
        port = closed.getsockname()[1]
        async with session() as s:
            response = await refused_reply(
                s.proxies.http_port, connect_request(f"allowed.test:{port}")
            )
            _, _, reply = await _socks_refused(
                s.proxies.socks_port, socks_domain("allowed.test", port)
            )
    assert response.startswith(b"HTTP/1.1 502 ")
    assert b"refused" in response
    assert reply[:2] == b"\x05\x05"
    assert s.refusals == []
    assert s.resolver.calls == [("allowed.test", port)] * 2


# Robustness and limits.


async def test_garbage_is_refused_and_the_listeners_keep_working() -> None:
    async with session() as s, upstream(echo) as port:
        http_reply = await refused_reply(s.proxies.http_port, b"\x16\x03\x01garbage\r\n\r\n")
        socks_reply = await refused_reply(s.proxies.socks_port, b"GET / HTTP/1.1\r\n\r\n")
        assert http_reply.startswith(b"HTTP/1.1 400 ")
        assert socks_reply == b""
        reader, writer, _ = await http_connect(s.proxies.http_port, f"allowed.test:{port}")
        try:
            assert await exchange(reader, writer, b"still here") == b"still here"
        finally:
            await close(writer)
        reader, writer, reply = await socks_connect(
            s.proxies.socks_port, socks_domain("allowed.test", port)
        )
        try:
            assert reply == SOCKS_SUCCESS
        finally:
            await close(writer)
    assert s.refusals == []


async def test_a_failing_on_refused_callback_does_not_break_the_proxy() -> None:
    def explode(refusal: EgressRefused) -> None:
        raise RuntimeError("callback bug")

    async with session(on_refused=explode) as s:
        for _ in range(2):
            response = await refused_reply(s.proxies.http_port, connect_request("example.com:443"))
            assert response.startswith(b"HTTP/1.1 403 ")


async def test_handshake_timeout_closes_a_silent_client() -> None:
    async with session(limits=ProxyLimits(handshake_timeout_s=0.2)) as s:
        unfinished = {
            s.proxies.http_port: b"CONNECT allowed.test:80 HTTP/1.1\r\n",
            s.proxies.socks_port: b"\x05\x02\x00",  # two methods announced, one sent
        }
        loop = asyncio.get_running_loop()
        for port, start in unfinished.items():
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(start)
                began = loop.time()
                async with asyncio.timeout(3):
                    assert await reader.read() == b""
                assert loop.time() - began >= 0.15
            finally:
                await close(writer)
        await wait_for(lambda: s.proxies.active_connections == 0)


async def test_idle_timeout_closes_an_idle_relay() -> None:
    async with session(limits=ProxyLimits(idle_timeout_s=0.3)) as s, upstream(echo) as port:
        reader, writer, _ = await http_connect(s.proxies.http_port, f"allowed.test:{port}")
        try:
            writer.write(b"a")
            assert await reader.readexactly(1) == b"a"
            loop = asyncio.get_running_loop()
            started = loop.time()
            async with asyncio.timeout(3):
                assert await reader.read() == b""
            assert loop.time() - started >= 0.25
        finally:
            await close(writer)
        await wait_for(lambda: s.proxies.active_connections == 0)


async def test_idle_timeout_closes_an_idle_kept_alive_connection_and_its_upstream() -> None:
    closed: list[bool] = []

    async def origin(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        closed.append(await reader.read() == b"")  # the proxy let go of the kept upstream

    async with session(limits=ProxyLimits(idle_timeout_s=0.3)) as s, upstream(origin) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.proxies.http_port)
        try:
            target = f"allowed.test:{port}"
            writer.write(f"GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200 OK\r\n")
            async with asyncio.timeout(3):
                assert await reader.read() == b""  # kept alive, then idle: closed
        finally:
            await close(writer)
        await wait_for(lambda: s.proxies.active_connections == 0)
        await wait_for(lambda: closed == [True])


async def test_max_connections_closes_new_clients_at_once() -> None:
    async with session(limits=ProxyLimits(max_connections=2)) as s:
        held = [await asyncio.open_connection("127.0.0.1", s.proxies.http_port) for _ in range(2)]
        try:
            await wait_for(lambda: s.proxies.active_connections == 2)
            reader, writer = await asyncio.open_connection("127.0.0.1", s.proxies.socks_port)
            try:
                async with asyncio.timeout(3):
                    assert await reader.read() == b""
            finally:
                await close(writer)
            assert s.proxies.active_connections == 2
        finally:
            for _, w in held:
                await close(w)
        await wait_for(lambda: s.proxies.active_connections == 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", s.proxies.socks_port)
        try:
            writer.write(SOCKS_GREETING)
            assert await reader.readexactly(2) == b"\x05\x00"
        finally:
            await close(writer)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def test_aclose_closes_live_relays_is_idempotent_and_leaks_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "bridge"
    directory.mkdir(mode=0o700)
    async with upstream(echo) as port:
        before = _open_fds()
        params = ProxyParams(
            session_id="s1",
            allowlist=DEFAULT_ALLOWLIST,
            on_refused=lambda refusal: None,
            socket_dir=str(directory),
            resolver=FakeResolver(),
        )
        proxies = await start_session_proxies(params)
        assert sorted(os.listdir(directory)) == ["http.sock", "socks.sock"]
        reader, writer, _ = await http_connect(proxies.http_port, f"allowed.test:{port}")
        try:
            writer.write(b"a")
            assert await reader.readexactly(1) == b"a"
            await proxies.aclose()
            await proxies.aclose()
            assert proxies.active_connections == 0
            async with asyncio.timeout(3):
                assert await reader.read() == b""
        finally:
            await close(writer)
        assert os.listdir(directory) == []
        assert _open_fds() <= before
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", proxies.http_port)


async def test_aclose_right_after_start_frees_everything() -> None:
    before = _open_fds()
    params = ProxyParams(session_id="s1", allowlist=Allowlist(), on_refused=lambda r: None)
    proxies = await start_session_proxies(params)
    await proxies.aclose()
    assert _open_fds() <= before


def loopback_listener() -> socket.socket:
    """A listening loopback socket, like the one a sandbox's launcher hands over."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


async def test_an_adopted_listener_is_served_until_closed_even_if_the_close_is_cancelled() -> None:
    async with session() as s, upstream(echo) as port:
        sock = loopback_listener()
        where = sock.getsockname()[1]
        adopted = await s.proxies.adopt(sock, "http", "sandbox loopback")
        reader, writer, head = await http_connect(where, f"allowed.test:{port}")
        try:
            assert head == b"HTTP/1.1 200 Connection established\r\n\r\n"
            closing = asyncio.get_running_loop().create_task(adopted.aclose(), name="close")
            await asyncio.sleep(0)  # aclose waits for the accept task to end
            closing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await closing
            await wait_for(lambda: sock.fileno() == -1)  # closed all the same
            writer.write(b"a")  # the connection already accepted goes on
            assert await reader.readexactly(1) == b"a"
        finally:
            await close(writer)
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", where)
        await adopted.aclose()  # twice is fine


async def test_adopting_after_the_session_closed_refuses_and_closes_the_socket() -> None:
    async with session() as s:
        adopted = await s.proxies.adopt(loopback_listener(), "socks5", "sandbox loopback")
    await adopted.aclose()  # after the session: nothing left to do, and no error
    late = loopback_listener()
    with pytest.raises(EnforcementFailed, match="closed"):
        await s.proxies.adopt(late, "http", "sandbox loopback")
    assert late.fileno() == -1


async def test_closing_the_session_closes_what_it_adopted() -> None:
    async with session() as s:
        sock = loopback_listener()
        await s.proxies.adopt(sock, "http", "sandbox loopback")
    assert sock.fileno() == -1


async def test_unix_socket_listeners_serve_both_proxies(tmp_path: Path) -> None:
    directory = tmp_path / "bridge"
    directory.mkdir(mode=0o700)
    data = payload(2 * MIB)
    async with session(socket_dir=str(directory)) as s, upstream(echo) as port:
        assert s.proxies.http_socket == str(directory / "http.sock")
        assert s.proxies.socks_socket == str(directory / "socks.sock")
        for path in (s.proxies.http_socket, s.proxies.socks_socket):
            info = os.lstat(path)
            assert stat.S_ISSOCK(info.st_mode)
            assert stat.S_IMODE(info.st_mode) == 0o600
        reader, writer = await asyncio.open_unix_connection(s.proxies.http_socket)
        try:
            target = f"allowed.test:{port}"
            writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
            assert await exchange(reader, writer, data) == data
        finally:
            await close(writer)
        reader, writer = await asyncio.open_unix_connection(s.proxies.socks_socket)
        try:
            writer.write(SOCKS_GREETING + socks_domain("allowed.test", port))
            assert await reader.readexactly(12) == b"\x05\x00" + SOCKS_SUCCESS
            assert await exchange(reader, writer, data) == data
        finally:
            await close(writer)
    assert os.listdir(directory) == []


@pytest.mark.parametrize("problem", ["mode", "exists", "not-a-dir", "symlink", "missing"])
async def test_socket_dir_must_be_ours_private_and_free(tmp_path: Path, problem: str) -> None:
    directory = tmp_path / "bridge"
    directory.mkdir(mode=0o700)
    target = directory
    if problem == "mode":
        directory.chmod(0o755)
    elif problem == "exists":
        (directory / "socks.sock").write_text("")
    elif problem == "not-a-dir":
        target = tmp_path / "file"
        target.write_text("")
    elif problem == "symlink":
        target = tmp_path / "link"
        target.symlink_to(directory)
    else:
        target = tmp_path / "missing"
    before = _open_fds()
    params = ProxyParams(
        session_id="s1", allowlist=Allowlist(), on_refused=lambda r: None, socket_dir=str(target)
    )
    with pytest.raises(EnforcementFailed):
        await start_session_proxies(params)
    assert _open_fds() <= before
    if problem == "exists":
        assert os.listdir(directory) == ["socks.sock"]  # what was there stays; ours is gone


async def test_two_sessions_get_different_ports() -> None:
    async with session() as first, session() as second:
        ports = {
            first.proxies.http_port,
            first.proxies.socks_port,
            second.proxies.http_port,
            second.proxies.socks_port,
        }
    assert len(ports) == 4
