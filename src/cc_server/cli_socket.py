"""The CLI daemon's socket: where it lives, the messages on it, and asking the daemon to stop.

Below both the thin client (`cli_client.py`, which hands `run` to the daemon) and `cli.py`
(whose `daemon` verb stops it), and imported by the daemon (`cli_daemon.py`) to speak the same
framing. Like the thin client it imports only the standard library's basics: it is on the path of
every `cc-server run`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import sys
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: typing costs the thin client 5 ms to import
    from typing import Any, Final

__all__ = [
    "CMSG_CLOEXEC",
    "HEADER_BYTES",
    "KEYED_ENV",
    "MAX_MESSAGE_BYTES",
    "connect",
    "daemon_socket_path",
    "decode_message",
    "message_size",
    "receive_message",
    "send_message",
    "stop_daemon",
]

# The variables that place the daemon's files (HOME, XDG_*, TMPDIR, the settings file, the
# microVM cache) and PATH choose the daemon (they are part of its key).
KEYED_ENV: Final = ("HOME", "PATH", "XDG_RUNTIME_DIR", "TMPDIR", "XDG_CONFIG_HOME",
                    "XDG_CACHE_HOME", "CC_SERVER_MICROVM_CACHE")
_HEADER: Final = struct.Struct("!I")
MAX_MESSAGE_BYTES: Final = 1 << 20
HEADER_BYTES: Final = _HEADER.size
# Received descriptors are close-on-exec from the start (Linux; elsewhere set by nobody).
CMSG_CLOEXEC: Final = getattr(socket, "MSG_CMSG_CLOEXEC", 0)


class _Digest:
    """64 bits of zlib's CRC-32 and Adler-32 over everything `update`d."""

    def __init__(self) -> None:
        self.crc, self.adler = 0, 1

    def update(self, data: bytes) -> None:
        self.crc = zlib.crc32(data, self.crc)
        self.adler = zlib.adler32(data, self.adler)

    def hexdigest(self) -> str:
        return f"{self.crc:08x}{self.adler:08x}"


def _key() -> str:
    """The build and host facts the daemon was started with: a different one gets its own.

    A cache key, not a secret (the socket lives in the user's private directory): two CRCs of
    the facts, without the 5 ms hashlib's OpenSSL costs the thin client at every start. The C
    client (backends/native/client.c) computes the same over the same facts: keep them alike."""
    digest = _Digest()
    package = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".so", ".toml", ".sb")) or "launcher" in name:
                info = os.stat(os.path.join(root, name))
                digest.update(f"{root}/{name}:{info.st_mtime_ns}:{info.st_size}\n".encode())
    # The interpreter as its file: another build (a new version) is another file.
    interpreter = os.path.realpath(sys.executable)
    info = os.stat(interpreter)
    digest.update(f"{interpreter}\n{info.st_mtime_ns}:{info.st_size}\n{os.geteuid()}\n".encode())
    for name in KEYED_ENV:
        digest.update(f"{name}={os.environ.get(name, '')}\n".encode())
    return digest.hexdigest()


def daemon_socket_path() -> str:
    """Where this build's daemon listens (in the private runtime directory, created if needed).

    Raises:
        EnforcementFailed: the runtime directory is not private (see rundir.egress_base_dir).
    """
    from cc_server.rundir import egress_base_dir

    return os.path.join(egress_base_dir(), f"cli-{_key()}.sock")


def send_message(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """One length-prefixed JSON message, with `fds` attached to its first byte."""
    data = json.dumps(message).encode()
    payload = _HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [payload], list(fds)) if fds else sock.send(payload)
    if sent < len(payload):
        sock.sendall(payload[sent:])


def receive_message(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    """One message (and the descriptors sent with it); raises EOFError if the peer closed first,
    ValueError if it is not one of ours. The descriptors are closed whenever it raises."""
    fds: list[int] = []
    try:
        header = b""
        while len(header) < _HEADER.size:
            if max_fds and not fds and not header:
                chunk, fds, _flags, _addr = socket.recv_fds(
                    sock, _HEADER.size, max_fds, CMSG_CLOEXEC
                )
            else:
                chunk = sock.recv(_HEADER.size - len(header))
            if not chunk:
                raise EOFError
            header += chunk
        size = message_size(header)
        body = b""
        while len(body) < size:
            chunk = sock.recv(size - len(body))
            if not chunk:
                raise EOFError
            body += chunk
        return decode_message(body), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def message_size(header: bytes) -> int:
    """The length a message's header gives; raises ValueError if it is too long."""
    (size,) = _HEADER.unpack(header)
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"a {size}-byte message is too long")
    return int(size)


def decode_message(body: bytes) -> dict[str, Any]:
    """A message's body as its JSON object; raises ValueError if it is not one."""
    try:
        message = json.loads(body)
    except RecursionError:  # nested deeper than the parser goes
        raise ValueError("a message is nested too deeply") from None
    if not isinstance(message, dict):
        raise ValueError("a message is not a JSON object")
    return message


def connect(path: str) -> socket.socket | None:
    """A connection to the daemon listening on `path`; None when none listens."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def stop_daemon() -> bool:
    """Ask this build's daemon to exit once its commands are done; whether one was running."""
    try:
        sock = connect(daemon_socket_path())
    except Exception:
        return False
    if sock is None:
        return False
    with sock:
        send_message(sock, {"stop": True})
        with contextlib.suppress(EOFError, ValueError, OSError):
            receive_message(sock)
    return True
