"""Shared by the CLI tests: the CLI daemons a test started, found by the runtime directory their
argv names, so each test ends its own and no other."""

from __future__ import annotations

import os
import pathlib
import signal


def daemon_pids(runtime: pathlib.Path) -> list[int]:
    """The daemons serving sockets under `runtime` (their argv names the socket path)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"cc_server.cli_daemon" in argv and any(str(runtime).encode() in a for a in argv):
            found.append(int(entry))
    return found


def kill_daemons(runtime: pathlib.Path) -> None:
    """SIGKILL every daemon under `runtime`."""
    for pid in daemon_pids(runtime):
        os.kill(pid, signal.SIGKILL)
