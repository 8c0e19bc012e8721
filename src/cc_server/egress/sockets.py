"""The egress proxies' sockets: binding their listeners (a loopback port, Unix socket files in a
private directory, removed only if still ours) and dialling an upstream without waiting a loop
iteration for a connect that is complete already. No decisions here: `driver` says what to
bind and which checked address to dial.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import stat
from typing import Final

from cc_server.errors import EnforcementFailed

__all__ = [
    "LISTEN_BACKLOG",
    "MAX_UNIX_PATH_BYTES",
    "bind_tcp",
    "bind_unix",
    "check_socket_dir",
    "connect_done",
    "connected_at_once",
    "remove_socket_file",
]

# Pending connections per listener; a sandbox opens a few at a time, max_connections bounds the
# rest.
LISTEN_BACKLOG: Final = 128
# sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_UNIX_PATH_BYTES: Final = 107


def connected_at_once(sock: socket.socket, address: tuple[str, int]) -> bool:
    """Start a non-blocking connect; whether it is complete already. To loopback (a sandbox's
    local service, a test's upstream) the handshake is usually done when connect() returns, and
    one poll saves waiting a loop iteration for it. False: still in progress (`connect_done`
    waits for it; connect() is not called again, which would fail with EISCONN if the
    handshake completed in between).

    Raises:
        OSError: the connect failed (refused, unreachable, ...).
    """
    try:
        sock.connect(address)
        return True
    except (BlockingIOError, InterruptedError):
        pass
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    if not poller.poll(0):
        return False
    _raise_socket_error(sock)
    return True


async def connect_done(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Wait until a connect in progress has ended (the socket is writable), as the loop's
    sock_connect does after its own connect().

    Raises:
        OSError: the connect failed (refused, unreachable, ...).
    """
    writable: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not writable.done():
            writable.set_result(None)

    fd = sock.fileno()
    loop.add_writer(fd, ready)
    try:
        await writable
    finally:
        loop.remove_writer(fd)
    _raise_socket_error(sock)


def _raise_socket_error(sock: socket.socket) -> None:
    """Raise the error a finished non-blocking connect left on the socket, if any."""
    error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if error:
        raise OSError(error, os.strerror(error))


def bind_tcp() -> socket.socket:
    """A listener on 127.0.0.1, an ephemeral port, non-blocking.

    Raises:
        EnforcementFailed: it could not be bound.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise EnforcementFailed(f"cannot listen on 127.0.0.1 for the egress proxy: {exc}") from exc
    return sock


def check_socket_dir(directory: str) -> None:
    """The bridge directory must be a real directory, ours, and closed to everyone else."""
    try:
        info = os.lstat(directory)
    except OSError as exc:
        raise EnforcementFailed(
            f"egress socket directory {directory} is not usable: {exc}",
            fix="create it with mode 0700 before starting the proxies",
        ) from exc
    if not stat.S_ISDIR(info.st_mode):
        raise EnforcementFailed(
            f"egress socket directory {directory} is not a directory (or is a symlink)"
        )
    if info.st_uid != os.geteuid():
        raise EnforcementFailed(
            f"egress socket directory {directory} belongs to uid {info.st_uid}, "
            f"not to this process (uid {os.geteuid()})"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode != 0o700:
        raise EnforcementFailed(
            f"egress socket directory {directory} has mode {mode:04o}, not 0700",
            fix=f"chmod 0700 {directory}",
        )


def bind_unix(path: str) -> tuple[socket.socket, tuple[int, int]]:
    """Listen on a new Unix socket at `path`, mode 0600; return it and its file's identity."""
    if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
        raise EnforcementFailed(
            f"egress socket path {path} is longer than {MAX_UNIX_PATH_BYTES} bytes",
            fix="use a shorter socket directory",
        )
    if os.path.lexists(path):
        raise EnforcementFailed(
            f"egress socket {path} exists already",
            fix="remove what a previous server left there, or use a new directory",
        )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # The umask is the process's, so this is the one place it changes: bind() creates the
        # file 0600 from the start (the directory is 0700 as well, so nobody else could reach
        # the file in between anyway).
        old_umask = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old_umask)
        info = os.lstat(path)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise EnforcementFailed(f"cannot listen on {path} for the egress proxy: {exc}") from exc
    return sock, (info.st_dev, info.st_ino)


def remove_socket_file(path: str, identity: tuple[int, int]) -> None:
    """Remove the socket file we created, and nothing that has replaced it since."""
    with contextlib.suppress(OSError):
        info = os.lstat(path)
        if (info.st_dev, info.st_ino) == identity:
            os.unlink(path)
