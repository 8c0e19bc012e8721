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

__all__ = ["use_pidfd_child_watcher", "wait_exited"]


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


RETURNCODE_SPIN_TURNS = 16  # loop turns to wait for the exit status before 1 ms naps


async def wait_exited(proc: asyncio.subprocess.Process) -> None:
    """Wait for `proc` itself to exit and its `returncode` to be set.

    Not `Process.wait()`: asyncio's also waits for every pipe to close, which a descendant
    holding stdout can postpone forever. A pidfd becomes readable when the process exits; the
    loop's child watcher then sets `returncode` within a loop iteration or two.
    """
    if proc.returncode is None:
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(proc.pid)
        except ProcessLookupError:  # already reaped: returncode is on its way
            pidfd = -1
        if pidfd >= 0:
            exited: asyncio.Future[None] = loop.create_future()

            def on_exit() -> None:
                if not exited.done():
                    exited.set_result(None)

            loop.add_reader(pidfd, on_exit)
            try:
                await exited
            finally:
                loop.remove_reader(pidfd)
                os.close(pidfd)
    # The child watcher sets it from a callback it schedules: a few loop turns, at most.
    turns = 0
    while proc.returncode is None:
        turns += 1
        await asyncio.sleep(0 if turns <= RETURNCODE_SPIN_TURNS else 0.001)
