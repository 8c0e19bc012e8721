"""The one way to start a task outside a `TaskGroup`: named, referenced until it ends, and its
failure logged.

A bare `asyncio.create_task` keeps no reference (the loop holds tasks weakly, so one can vanish
mid-flight), leaves the task unnamed in a dump, and an exception it ends with is reported, if
ever, when the task is collected. ruff's banned-api rule (pyproject.toml) refuses
`asyncio.create_task` and `asyncio.ensure_future` in the package; a task a `TaskGroup` owns is
started with `tg.create_task(…, name=…)`, any other with `start_task`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["running_tasks", "start_task"]

log = logging.getLogger("cc_server.tasks")

_T = TypeVar("_T")
_RUNNING: set[asyncio.Task[Any]] = set()  # strong references until each task is done


def start_task(coro: Coroutine[Any, Any, _T], *, name: str) -> asyncio.Task[_T]:
    """Start `coro` on the running loop as a task named `name`; kept referenced until it ends,
    and logged (with its traceback) if it ends with an exception. Its owner still awaits or
    cancels it: this only makes sure it is never lost.

    Raises:
        RuntimeError: no loop is running.
    """
    task = asyncio.get_running_loop().create_task(coro, name=name)
    _RUNNING.add(task)
    task.add_done_callback(_finished)
    return task


def running_tasks() -> frozenset[asyncio.Task[Any]]:
    """The tasks `start_task` started that have not ended yet."""
    return frozenset(_RUNNING)


def _finished(task: asyncio.Task[Any]) -> None:
    _RUNNING.discard(task)
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("task %r ended with %s", task.get_name(), type(exc).__name__, exc_info=exc)
