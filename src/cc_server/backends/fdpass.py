"""Receiving file descriptors a sandbox's launcher sends over a socketpair (SCM_RIGHTS)."""

from __future__ import annotations

import asyncio
import os
import socket

__all__ = ["receive_fds"]


async def receive_fds(
    sock: socket.socket, *, tag: bytes, count: int, timeout_s: float
) -> list[int]:
    """Wait for one message of `tag` carrying exactly `count` descriptors on `sock`.

    Returns them (close-on-exec). Returns [] if the peer closed its end or sent anything else
    (whatever arrived is closed).

    Raises:
        TimeoutError: nothing arrived within `timeout_s`.
    """
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    arrived: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not arrived.done():
            arrived.set_result(None)

    loop.add_reader(sock.fileno(), readable)
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                await arrived
                try:
                    data, fds, _flags, _addr = socket.recv_fds(sock, len(tag), count)
                except BlockingIOError:
                    arrived = loop.create_future()
                    continue
                break
    finally:
        loop.remove_reader(sock.fileno())
    if data != tag or len(fds) != count:
        for fd in fds:
            os.close(fd)
        return []
    for fd in fds:
        os.set_inheritable(fd, False)
    return fds
