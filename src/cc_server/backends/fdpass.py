"""Receiving file descriptors a sandbox's launcher sends over a socketpair (SCM_RIGHTS)."""

from __future__ import annotations

import asyncio
import os
import socket

from cc_server.errors import EnforcementFailed

__all__ = ["receive_fds"]


async def receive_fds(
    sock: socket.socket, *, tag: bytes, count: int, timeout_s: float, what: str
) -> list[int]:
    """Wait for the launcher's message of `tag` carrying exactly `count` descriptors (`what`,
    for the error) on `sock`; return them, close-on-exec.

    Raises:
        EnforcementFailed: nothing came within `timeout_s`, or the launcher closed its end or
            sent anything else (whatever arrived is closed); the launcher runs the command only
            after sending, so it has not run.
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
    except TimeoutError:
        raise EnforcementFailed(
            f"the sandbox's launcher sent no {what} within {timeout_s:g} s; "
            "the command was not run"
        ) from None
    finally:
        loop.remove_reader(sock.fileno())
    if data != tag or len(fds) != count:
        for fd in fds:
            os.close(fd)
        raise EnforcementFailed(
            f"the sandbox's launcher exited without handing over its {what}; the command was "
            "not run (its stderr says why)"
        )
    for fd in fds:
        os.set_inheritable(fd, False)
    return fds
