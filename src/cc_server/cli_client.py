"""The `cc-server` command's first step: hand `run` to the user's CLI daemon.

Starting Python and importing the runtime (asyncio, the proxies, the spec models) costs more than
the sandbox itself, on every `cc-server run`. So a plain `run` is handed to a per-user daemon
(`cli_daemon.py`) that has paid for that once: this module, which imports only the standard
library's basics, sends the daemon the arguments, the working directory and the few environment
variables `run` reads, together with its own stdin, stdout and stderr (SCM_RIGHTS); the daemon
runs the command in a sandbox on exactly those descriptors and answers with the exit code. Signals
this process gets (SIGINT, SIGTERM, SIGHUP) are passed on; if this process dies, the daemon kills
the command.

The daemon is started on first use and exits after `IDLE_EXIT_S` without a client. Its socket
lives in the user's private runtime directory (0700, checked), and it serves only its own user
(SO_PEERCRED) in its own user and PID namespaces (SO_PEERPIDFD: a kernel without it gets no
daemon). One daemon serves one build of cc-server with one HOME and PATH: its socket name
carries a key of those (and of every source file's modification time), so a changed installation
gets a fresh daemon. `CC_SERVER_DAEMON=off` runs everything in this process instead, as do
`--events`, `--ask` (it reads the terminal itself), `--help` and every other verb. If the
daemon cannot be started, `run` runs in this process too: the same sandbox, only slower.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: typing costs the thin client 5 ms to import
    from typing import Any, Final

__all__ = ["daemon_socket_path", "main", "stop_daemon"]

DAEMON_ENV: Final = "CC_SERVER_DAEMON"  # "off": never use the daemon
START_TIMEOUT_S: Final = 10.0  # from spawning the daemon to its socket answering
FORWARDED_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# What `run` reads from the caller's environment (cli_spec.PASSTHROUGH_ENV, LC_*); nothing else is
# sent. The variables that place the daemon's files (HOME, XDG_*, TMPDIR, the settings file, the
# microVM cache) and PATH choose the daemon instead (they are part of its key).
SENT_ENV: Final = ("TERM", "COLORTERM", "NO_COLOR", "LANG", "LANGUAGE", "TZ")
KEYED_ENV: Final = ("HOME", "PATH", "XDG_RUNTIME_DIR", "TMPDIR", "XDG_CONFIG_HOME",
                    "XDG_CACHE_HOME", "CC_SERVER_MICROVM_CACHE")
_HEADER: Final = struct.Struct("!I")
MAX_MESSAGE_BYTES: Final = 1 << 20
EXIT_REFUSED: Final = 125
_SO_PEERPIDFD: Final = 77  # Linux 6.5+; the daemon identifies its peers with it (backends/peer.py)


def _eligible(argv: Sequence[str]) -> bool:
    if not argv or argv[0] != "run" or os.environ.get(DAEMON_ENV, "on") == "off":
        return False
    if not sys.platform.startswith("linux"):
        return False
    for arg in argv[1:]:
        if arg == "--":
            break
        if arg in ("-h", "--help") or arg.startswith("--events"):
            return False
        if len(arg) > 3 and "--ask".startswith(arg):  # argparse takes "--as" for "--ask" too
            return False
    return _peers_identifiable()


def _peers_identifiable() -> bool:
    """Whether this kernel hands over a peer's pidfd: without it the daemon serves nobody.

    The first half of `backends.peer.supported`, kept here so that the thin client does not
    import that module (asyncio, logging) on every run; the daemon itself asks `peer`."""
    try:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:
        return False
    with a, b:
        try:
            os.close(a.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD))
        except OSError:
            return False
    return True


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
    the facts, without the 5 ms hashlib's OpenSSL costs the thin client at every start."""
    digest = _Digest()
    package = os.path.dirname(os.path.abspath(__file__))
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".so", ".toml", ".sb")) or "launcher" in name:
                info = os.stat(os.path.join(root, name))
                digest.update(f"{root}/{name}:{info.st_mtime_ns}:{info.st_size}\n".encode())
    digest.update(f"{sys.executable}\n{sys.version}\n{os.geteuid()}\n".encode())
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
    ValueError if it is not one of ours."""
    fds: list[int] = []
    header = b""
    while len(header) < _HEADER.size:
        if max_fds and not fds and not header:
            chunk, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, max_fds)
        else:
            chunk = sock.recv(_HEADER.size - len(header))
        if not chunk:
            for fd in fds:
                os.close(fd)
            raise EOFError
        header += chunk
    (size,) = _HEADER.unpack(header)
    if size > MAX_MESSAGE_BYTES:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a {size}-byte message is too long")
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            for fd in fds:
                os.close(fd)
            raise EOFError
        body += chunk
    message = json.loads(body)
    if not isinstance(message, dict):
        for fd in fds:
            os.close(fd)
        raise ValueError("a message is not a JSON object")
    return message, fds


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def _start_daemon(path: str) -> socket.socket | None:
    import subprocess  # lazy import: only the first run pays for it

    subprocess.Popen(
        [sys.executable, "-m", "cc_server.cli_daemon", path],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        cwd="/",
        # Only what chose it (its key): the daemon never holds this shell's tokens or keys.
        env={k: os.environ[k] for k in KEYED_ENV if k in os.environ},
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        sock = _connect(path)
        if sock is not None:
            return sock
        time.sleep(0.01)
    return None


def _run_via_daemon(argv: Sequence[str]) -> int | None:
    try:
        path = daemon_socket_path()
    except Exception:
        return None  # the in-process path reports what is wrong
    sock = _connect(path) or _start_daemon(path)
    if sock is None:
        return None
    with sock:
        env = {k: v for k, v in os.environ.items() if k in SENT_ENV or k.startswith("LC_")}
        request = {"argv": list(argv), "cwd": os.getcwd(), "env": env}
        received: list[int] = []

        def forward(signum: int, _frame: object) -> None:
            received.append(signum)
            send_message(sock, {"signal": signum})

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
        try:
            send_message(sock, request, fds=(0, 1, 2))
            while True:
                try:
                    reply, _ = receive_message(sock)
                except InterruptedError:
                    continue
                if "exit" in reply:
                    return int(reply["exit"])
        except (EOFError, ValueError, OSError):
            print("cc-server: the CLI daemon went away; the command's fate is unknown "
                  f"(set {DAEMON_ENV}=off to run without it)", file=sys.stderr)
            return EXIT_REFUSED
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def stop_daemon() -> bool:
    """Ask this build's daemon to exit once its commands are done; whether one was running."""
    try:
        sock = _connect(daemon_socket_path())
    except Exception:
        return False
    if sock is None:
        return False
    with sock:
        send_message(sock, {"stop": True})
        with contextlib.suppress(EOFError, ValueError, OSError):
            receive_message(sock)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `cc-server` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if _eligible(args):
        code = _run_via_daemon(args)
        if code is not None:
            return code
    from cc_server.cli import main as in_process

    return in_process(args)


if __name__ == "__main__":
    sys.exit(main())
