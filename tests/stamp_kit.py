"""Directory stamps (backends/host_reads.py) in tests: where they are trusted, and a wait that
makes a test's change carry a later ctime than the stamp it must break on any kernel."""

from __future__ import annotations

import os
import pathlib
import time

from cc_server.backends import host_reads

CLOCK_REALTIME_COARSE = 5  # linux/time.h: the clock a change's ctime is taken from


def stampable(path: pathlib.Path) -> bool:
    """Whether directory stamps can be trusted where `path` is (host_reads._stamp_trusted)."""
    return (os.major(os.stat(path).st_dev) != 0
            and host_reads._fs_type(str(path)) in host_reads.STAMPED_FS_TYPES)


def past_the_tick(*paths: pathlib.Path) -> None:
    """Wait until the kernel's coarse clock is past each path's ctime, so that a change made
    now cannot carry the same ctime (what STAMP_AGE_NS ensures where a test does not set it to
    0). Returns at once where a ctime just read makes the next change later (multigrain)."""
    newest = max(os.stat(path).st_ctime_ns for path in paths)
    while time.clock_gettime_ns(CLOCK_REALTIME_COARSE) <= newest:
        time.sleep(0.001)
