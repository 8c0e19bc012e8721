"""Execution over a scripted Child: the events, the timeout, kill and the `open` block, with no
process (tests/functional/test_runtime_exec.py runs the real children)."""

from __future__ import annotations

import asyncio
import signal

import pytest

from cc_server.backends.plan import Command
from cc_server.runtime.child import Emit
from cc_server.runtime.events import EventType, SandboxEvent
from cc_server.runtime.execution import Execution


class _Child:
    """Prints `output`, then runs until `end()` or a signal that ends it (SIGKILL, SIGTERM)."""

    def __init__(self, output: tuple[bytes, ...] = (), *, ignore_term: bool = False) -> None:
        self.output = output
        self.ignore_term = ignore_term
        self.returncode: int | None = None
        self.signals: list[int] = []
        self.stdin: list[bytes] = []
        self.closed = 0
        self._ended = asyncio.Event()

    def end(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._ended.set()

    async def pump(self, emit: Emit) -> None:
        for chunk in self.output:
            await emit(EventType.STDOUT, chunk)

    async def feed(self, data: bytes) -> None:
        self.stdin.append(data)

    async def write_stdin(self, data: bytes) -> None:
        self.stdin.append(data)

    def close_stdin(self) -> None:
        self.stdin.append(b"<eof>")

    async def exited(self) -> int:
        await self._ended.wait()
        assert self.returncode is not None
        return self.returncode

    def signal(self, signum: int) -> None:
        self.signals.append(signum)
        if signum == signal.SIGKILL or (signum == signal.SIGTERM and not self.ignore_term):
            self.end(-signum)

    async def kill(self) -> None:
        self.signal(signal.SIGKILL)

    async def close(self) -> None:
        self.closed += 1


class _Handle:
    session_id = "s"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def exec_started(self, execution: Execution) -> None:
        self.calls.append("started")

    def exec_finished(self, execution: Execution) -> None:
        self.calls.append(f"finished {execution.exit_code}")

    async def exec_done(self, execution: Execution) -> None:
        self.calls.append("done")


def _execution(
    handle: _Handle, *, stdin: bytes | None = None, timeout_s: float | None = None
) -> Execution:
    return Execution(
        handle=handle,  # type: ignore[arg-type]  # the recorded stand-in
        exec_id="s:1", command=Command(argv=("x",)), stdin=stdin, timeout_s=timeout_s,
    )


def _kinds(events: list[SandboxEvent]) -> list[str]:
    return [str(e.type) for e in events]


async def _started(child: _Child) -> _Child:
    return child


async def test_events_run_from_starting_to_exit_and_the_handle_hears_in_order() -> None:
    handle, child = _Handle(), _Child((b"a", b"b"))
    execution = _execution(handle, stdin=b"in")
    async with asyncio.timeout(5), execution.open(lambda: _started(child)) as ex:
        child.end(3)
        events = [e async for e in ex]
    assert _kinds(events) == ["starting", "ready", "stdout", "stdout", "exit"]
    assert [e.data for e in events[2:4]] == [b"a", b"b"] and events[-1].exit_code == 3
    assert execution.exit_code == 3 and child.stdin == [b"in"] and child.closed == 1
    assert handle.calls == ["started", "finished 3", "done"]


async def test_a_timeout_kills_with_reason_timeout_and_a_signal_code_is_128_plus() -> None:
    handle, child = _Handle(), _Child()
    async with asyncio.timeout(5), _execution(handle, timeout_s=0.01).open(
        lambda: _started(child)
    ) as ex:
        events = [e async for e in ex]
    assert _kinds(events) == ["starting", "ready", "killed", "exit"]
    assert events[2].reason == "timeout" and events[-1].exit_code == 128 + signal.SIGKILL


async def test_terminate_waits_its_grace_then_kills() -> None:
    handle, child = _Handle(), _Child(ignore_term=True)
    async with asyncio.timeout(5), _execution(handle).open(lambda: _started(child)) as ex:
        await ex.terminate(0.01, reason="shutdown")
        assert await ex.wait() == 128 + signal.SIGKILL
    assert child.signals[:2] == [signal.SIGTERM, signal.SIGKILL]


async def test_leaving_the_block_kills_and_the_blocks_error_comes_out_as_it_is() -> None:
    handle, child = _Handle(), _Child()
    execution = _execution(handle)
    with pytest.raises(LookupError, match="the consumer failed"):
        async with asyncio.timeout(5), execution.open(lambda: _started(child)):
            raise LookupError("the consumer failed")
    assert execution.exit_code == 128 + signal.SIGKILL
    assert handle.calls == ["started", f"finished {128 + signal.SIGKILL}", "done"]


async def test_nobody_reading_never_holds_the_command_and_exit_is_kept() -> None:
    handle, child = _Handle(), _Child(tuple(b"x" for _ in range(1000)))  # more than fits
    execution = _execution(handle)
    async with asyncio.timeout(5), execution.open(lambda: _started(child)) as ex:
        child.end(0)
        assert await ex.wait() == 0
        assert _kinds([e async for e in ex])[-1] == "exit"


async def test_a_child_that_does_not_start_leaves_nothing_started() -> None:
    handle = _Handle()

    async def refused() -> _Child:
        raise OSError("no such program")

    with pytest.raises(OSError, match="no such program"):
        async with _execution(handle).open(refused):
            raise AssertionError("the block must not run")
    assert handle.calls == []
