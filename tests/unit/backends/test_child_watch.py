"""The pidfd child watcher (Python 3.11): exits reach asyncio without a thread per child, on
whichever loop spawned the child."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from cc_server.backends.child_watch import use_pidfd_child_watcher

pytestmark = pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12 watches pidfds itself")


async def _run(code: int) -> int:
    use_pidfd_child_watcher()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", f"raise SystemExit({code})")
    return await proc.wait()


def test_exits_reach_every_loop_without_a_thread_per_child() -> None:
    threads = threading.active_count()
    # Two loops one after the other, as the server's and the tests' loops come and go.
    assert asyncio.run(_run(3)) == 3
    assert asyncio.run(_run(0)) == 0
    assert threading.active_count() == threads
    assert type(asyncio.get_child_watcher()).__name__ == "_PidfdWatcher"
