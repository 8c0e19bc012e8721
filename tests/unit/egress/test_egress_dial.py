"""The driver's dial when a connect is still in progress as connect() returns (to another host;
never on loopback here, so the tests make the first look report it as in progress): the loop
waits for it, and its failure is the upstream's, as when it fails at once."""

from __future__ import annotations

import contextlib
import socket

import pytest
from test_egress_driver import (
    close,
    closed_port,
    connect_request,
    echo,
    exchange,
    http_connect,
    payload,
    refused_reply,
    session,
    upstream,
)

from cc_server.egress import driver


@pytest.fixture
def connects_in_progress(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every dial starts its connect and is told it is still in progress."""
    started: list[tuple[str, int]] = []

    def in_progress(sock: socket.socket, address: tuple[str, int]) -> bool:
        started.append(address)
        with contextlib.suppress(BlockingIOError):
            sock.connect(address)
        return False

    monkeypatch.setattr(driver, "_connected_at_once", in_progress)
    return started


async def test_a_connect_in_progress_is_awaited_and_relays(
    connects_in_progress: list[tuple[str, int]],
) -> None:
    data = payload(256 * 1024)
    async with session() as s, upstream(echo) as port:
        reader, writer, _ = await http_connect(s.proxies.http_port, f"allowed.test:{port}")
        try:
            assert await exchange(reader, writer, data) == data
        finally:
            await close(writer)
    assert connects_in_progress == [("127.0.0.1", port)]
    assert s.refusals == []


async def test_a_connect_refused_while_in_progress_is_a_502(
    connects_in_progress: list[tuple[str, int]],
) -> None:
    with closed_port() as closed:
        port = closed.getsockname()[1]
        async with session() as s:
            response = await refused_reply(
                s.proxies.http_port, connect_request(f"allowed.test:{port}")
            )
    assert response.startswith(b"HTTP/1.1 502 ")
    assert b"refused" in response
    assert connects_in_progress == [("127.0.0.1", port)]
    assert s.refusals == []
