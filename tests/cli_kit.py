"""Shared by the CLI tests: the CLI daemons a test started, found by the runtime directory their
argv names, so each test ends its own and no other."""

from __future__ import annotations

import os
import pathlib
import signal


def daemon_pids(runtime: pathlib.Path) -> list[int]:
    """The daemons serving sockets under `runtime` (their argv names the socket path), not their
    children on their way to another program."""
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
    # A daemon's child between fork and exec (a sandbox being started) has the daemon's argv.
    return [pid for pid in found if parent_pid(pid) not in found]


def parent_pid(pid: int) -> int | None:
    """The parent of process `pid`; None once it is gone."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def kill_daemons(runtime: pathlib.Path) -> None:
    """SIGKILL every daemon under `runtime`."""
    for pid in daemon_pids(runtime):
        os.kill(pid, signal.SIGKILL)
