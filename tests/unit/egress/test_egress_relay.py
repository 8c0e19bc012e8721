"""The relay on its own, on real loopback sockets: the settings of its loopback legs."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
from collections.abc import Iterator

import pytest

from cc_server.egress.relay import (
    LOOPBACK_CONGESTION_CONTROL,
    LOOPBACK_NOTSENT_LOWAT_BYTES,
    RelayOutcome,
    relay,
    tune_loopback_leg,
)

TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


def congestion_control(sock: socket.socket) -> bytes:
    return sock.getsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, 16).rstrip(b"\0")


def notsent_lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT)


def assert_tuned(sock: socket.socket) -> None:
    assert congestion_control(sock) == LOOPBACK_CONGESTION_CONTROL
    assert notsent_lowat(sock) == LOOPBACK_NOTSENT_LOWAT_BYTES


@contextlib.contextmanager
def tcp_pair(host: str = "127.0.0.1") -> Iterator[tuple[socket.socket, socket.socket]]:
    """Two connected TCP sockets on loopback, non-blocking."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.create_server((host, 0), family=family) as server:
        a = socket.create_connection(server.getsockname()[:2])
        b, _ = server.accept()
    with a, b:
        a.setblocking(False)
        b.setblocking(False)
        yield a, b


def loopback_works(host: str) -> bool:
    try:
        with tcp_pair(host):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_loopback_socket_gets_the_loopback_settings(host: str) -> None:
    if not loopback_works(host):
        pytest.skip(f"no loopback on {host}")
    with tcp_pair(host) as (a, _):
        assert tune_loopback_leg(a)
        assert_tuned(a)


def test_a_unix_socket_is_left_alone() -> None:
    a, b = socket.socketpair()
    with a, b:
        assert not tune_loopback_leg(a)


def test_an_unconnected_socket_is_left_alone() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        before = congestion_control(sock), notsent_lowat(sock)
        assert not tune_loopback_leg(sock)
        assert (congestion_control(sock), notsent_lowat(sock)) == before


async def test_the_relay_tunes_both_loopback_legs_and_moves_every_byte() -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    with tcp_pair() as (client, client_proxy_end), tcp_pair() as (upstream_proxy_end, upstream):
        loop = asyncio.get_running_loop()

        async def far_ends() -> bytes:
            await loop.sock_sendall(upstream, data)
            upstream.shutdown(socket.SHUT_WR)
            client.shutdown(socket.SHUT_WR)
            got = bytearray()
            while chunk := await loop.sock_recv(client, 65536):
                got += chunk
            assert await loop.sock_recv(upstream, 1) == b""
            return bytes(got)

        ends = asyncio.create_task(far_ends(), name="far ends")
        result = await relay(client_proxy_end, upstream_proxy_end, idle_timeout_s=30)
        assert await ends == data
        assert result.outcome is RelayOutcome.CLOSED
        assert result.to_client_bytes == len(data)
        for sock in (client_proxy_end, upstream_proxy_end):
            assert_tuned(sock)


async def test_a_slow_reader_gets_every_byte_in_order() -> None:
    """The loopback leg holds little unsent data (TCP_NOTSENT_LOWAT): a reader slower than the
    upstream makes the relay wait for it, and every byte still arrives, in order."""
    data = os.urandom(4 * 1024 * 1024)
    with tcp_pair() as (client, client_proxy_end), tcp_pair() as (upstream_proxy_end, upstream):
        loop = asyncio.get_running_loop()

        async def upstream_sends() -> None:
            await loop.sock_sendall(upstream, data)
            upstream.shutdown(socket.SHUT_WR)
            assert await loop.sock_recv(upstream, 1) == b""

        async def client_reads_slowly() -> bytes:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # no room to hide
            client.shutdown(socket.SHUT_WR)
            got = bytearray()
            while chunk := await loop.sock_recv(client, 64 * 1024):
                got += chunk
                await asyncio.sleep(0.002)
            return bytes(got)

        sender = asyncio.create_task(upstream_sends(), name="upstream sends")
        reader = asyncio.create_task(client_reads_slowly(), name="client reads slowly")
        result = await relay(client_proxy_end, upstream_proxy_end, idle_timeout_s=30)
        await sender
        got = await reader
        assert result.outcome is RelayOutcome.CLOSED
        assert len(got) == len(data)
        assert hashlib.sha256(got).hexdigest() == hashlib.sha256(data).hexdigest()
        assert result.to_client_bytes == len(data)
