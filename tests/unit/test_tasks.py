"""cc_server.tasks.start_task: named, referenced until it ends, its failure logged (and a
cancellation not)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from cc_server.tasks import running_tasks, start_task


async def test_a_task_is_named_and_referenced_until_it_ends() -> None:
    release = asyncio.Event()

    async def work() -> int:
        await release.wait()
        return 7

    task = start_task(work(), name="the work")
    assert task.get_name() == "the work"
    assert task in running_tasks()
    release.set()
    assert await task == 7
    assert task not in running_tasks()


async def test_a_failure_is_logged_with_the_task_name(caplog: pytest.LogCaptureFixture) -> None:
    async def fail() -> None:
        raise ValueError("broken on purpose")

    with caplog.at_level(logging.ERROR, logger="cc_server.tasks"):
        task = start_task(fail(), name="failing work")
        await asyncio.wait([task])
        await asyncio.sleep(0)  # the done callback runs on the next turn
    [record] = [r for r in caplog.records if r.name == "cc_server.tasks"]
    assert "'failing work'" in record.getMessage() and "ValueError" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[1] is task.exception()
    assert task not in running_tasks()


async def test_a_cancellation_is_not_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="cc_server.tasks"):
        task = start_task(asyncio.sleep(3600), name="cancelled work")
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait([task])
        await asyncio.sleep(0)
    assert task.cancelled() and task not in running_tasks()
    assert not [r for r in caplog.records if r.name == "cc_server.tasks"]
