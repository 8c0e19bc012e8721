"""How asyncio learns that a child exited, on Python 3.11: a pidfd, not a thread per child.

Python 3.11's default child watcher starts a thread for every child and waits for the thread to
start, about 2 ms of every launch here; its own PidfdChildWatcher is tied to one event loop, and
the server and the tests run several. Python 3.12 and later watch every child with a pidfd on the
loop that spawned it by themselves; this module does the same on 3.11 (Linux 5.3+), and nothing
on other versions.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["use_pidfd_child_watcher"]


class _PidfdWatcher(asyncio.AbstractChildWatcher):
    """A pidfd per child, read on the loop that spawned it."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, int]] = {}

    def add_child_handler(  # type: ignore[override]  # typeshed's TypeVarTuple form
        self, pid: int, callback: Callable[..., object], *args: Any
    ) -> None:
        loop = asyncio.get_running_loop()
        pidfd = os.pidfd_open(pid)
        self._pending[pid] = (loop, pidfd)
        loop.add_reader(pidfd, self._reap, pid, callback, args)

    def _reap(self, pid: int, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        loop, pidfd = self._pending.pop(pid)
        loop.remove_reader(pidfd)
        os.close(pidfd)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:  # reaped elsewhere: asyncio's own convention
            code = 255
        else:
            code = os.waitstatus_to_exitcode(status)
        callback(pid, code, *args)

    def remove_child_handler(self, pid: int) -> bool:
        entry = self._pending.pop(pid, None)
        if entry is None:
            return False
        loop, pidfd = entry
        loop.remove_reader(pidfd)
        os.close(pidfd)
        return True

    def attach_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        pass

    def close(self) -> None:
        pass

    def is_active(self) -> bool:
        return True

    def __enter__(self) -> _PidfdWatcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


def use_pidfd_child_watcher() -> None:
    """Install the pidfd watcher as the process's child watcher (once; Python 3.11 on Linux).

    Safe at any time: a child the previous watcher was already watching keeps its watcher."""
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    if not isinstance(asyncio.get_child_watcher(), _PidfdWatcher):
        asyncio.set_child_watcher(_PidfdWatcher())
