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

import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cc_server.cli_socket import (
    KEYED_ENV,
    connect,
    daemon_socket_path,
    receive_message,
    send_message,
)

if TYPE_CHECKING:  # annotations only: typing costs the thin client 5 ms to import
    from typing import Final

__all__ = ["main"]

DAEMON_ENV: Final = "CC_SERVER_DAEMON"  # "off": never use the daemon
START_TIMEOUT_S: Final = 10.0  # from spawning the daemon to its socket answering
FORWARDED_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# What `run` reads from the caller's environment (cli_spec.PASSTHROUGH_ENV, LC_*); nothing else is
# sent. The variables that choose the daemon instead are cli_socket.KEYED_ENV (part of its key).
SENT_ENV: Final = ("TERM", "COLORTERM", "NO_COLOR", "LANG", "LANGUAGE", "TZ")
EXIT_REFUSED: Final = 125
_NOT_SERVED: Final = ("--help", "--events", "--ask")  # --ask reads the terminal itself
_SO_PEERPIDFD: Final = 77  # Linux 6.5+; the daemon identifies its peers with it (backends/peer.py)


def _eligible(argv: Sequence[str]) -> bool:
    if not argv or argv[0] != "run" or os.environ.get(DAEMON_ENV, "on") == "off":
        return False
    if not sys.platform.startswith("linux"):
        return False
    for arg in argv[1:]:
        if arg == "--":
            break
        # argparse takes a long option's unique prefix too ("--ev" for "--events", "--as",
        # "--he"); the shortest unique one of these three is four characters long.
        name = arg.partition("=")[0]
        if arg == "-h" or (len(name) > 3 and any(o.startswith(name) for o in _NOT_SERVED)):
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
        sock = connect(path)
        if sock is not None:
            return sock
        time.sleep(0.01)
    return None


def _run_via_daemon(argv: Sequence[str]) -> int | None:
    try:
        path = daemon_socket_path()
    except Exception:
        return None  # the in-process path reports what is wrong
    sock = connect(path) or _start_daemon(path)
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
