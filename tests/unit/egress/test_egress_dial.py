"""The driver's dial when a connect is still in progress as connect() returns (to another host;
never on loopback here, so the tests make the first look report it as in progress): the loop
waits for it, and its failure is the upstream's, as when it fails at once. The cases are
test_egress_driver's own, run again with every dial going that way."""

from __future__ import annotations

import contextlib
import socket

import pytest
from test_egress_driver import (
    test_a_refused_upstream_gives_502_and_socks_5 as refused_upstream_case,
)
from test_egress_driver import (
    test_connect_to_an_allowed_name_relays_5_mib_both_ways_exactly as relay_case,
)

from cc_server.egress import sockets


@pytest.fixture
def connects_in_progress(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every dial starts its connect and is told it is still in progress."""
    started: list[tuple[str, int]] = []

    def in_progress(sock: socket.socket, address: tuple[str, int]) -> bool:
        started.append(address)
        with contextlib.suppress(BlockingIOError):
            sock.connect(address)
        return False

    monkeypatch.setattr(sockets, "connected_at_once", in_progress)
    return started


async def test_a_connect_in_progress_is_awaited_and_relays(
    connects_in_progress: list[tuple[str, int]],
) -> None:
    await relay_case()
    assert len(connects_in_progress) == 1


async def test_a_connect_refused_while_in_progress_is_a_502_and_socks_5(
    connects_in_progress: list[tuple[str, int]],
) -> None:
    await refused_upstream_case()
    assert len(connects_in_progress) == 2  # the HTTP proxy's dial and the SOCKS5 proxy's
