"""Receiving file descriptors a sandbox's launcher sends over a socketpair (SCM_RIGHTS), and
waiting for a socket the event loop does not own to become readable or writable."""

from __future__ import annotations

import asyncio
import os
import socket

from cc_server.errors import EnforcementFailed

__all__ = ["receive_fds", "wait_readable", "wait_writable"]


async def wait_readable(sock: socket.socket) -> None:
    """Wait until `sock` is readable (data, a message with descriptors, or EOF)."""
    await _wait(sock, writable=False)


async def wait_writable(sock: socket.socket) -> None:
    """Wait until `sock` has room for a message."""
    await _wait(sock, writable=True)


async def _wait(sock: socket.socket, *, writable: bool) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    add, remove = (
        (loop.add_writer, loop.remove_writer) if writable else (loop.add_reader, loop.remove_reader)
    )
    add(sock.fileno(), wake)
    try:
        await ready
    finally:
        remove(sock.fileno())


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
    sock.setblocking(False)
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                await wait_readable(sock)
                try:
                    data, fds, _flags, _addr = socket.recv_fds(sock, len(tag), count)
                except BlockingIOError:
                    continue
                break
    except TimeoutError:
        raise EnforcementFailed(
            f"the sandbox's launcher sent no {what} within {timeout_s:g} s; "
            "the command was not run"
        ) from None
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
