"""VmChild, the Child of a command in the guest, over a recorded stand-in for the agent link: its
frames become events and an exit code, an ABORT is a kill, and a kill nobody answers gives up
this command's channel alone (the functional tests run it against a real VM)."""

from __future__ import annotations

import asyncio
import signal
import struct

import pytest

from cc_server.microvm import handle as vm_handle
from cc_server.microvm.handle import VmChild
from cc_server.microvm.link import AgentGone, ExecChannel
from cc_server.microvm.proto import Frame, FrameType
from cc_server.runtime.events import EventType


class _Link:
    """What VmChild asks of AgentLink: send, drain, forget_exec; `gone` makes send raise."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, FrameType, bytes]] = []
        self.forgotten: list[int] = []
        self.gone = False

    def send(self, channel: int, kind: FrameType, payload: bytes = b"") -> None:
        if self.gone:
            raise AgentGone("the VM is not running")
        self.sent.append((channel, kind, payload))

    async def drain(self) -> None:
        return None

    def forget_exec(self, channel: int) -> None:
        self.forgotten.append(channel)

    def close_all(self, reason: BaseException) -> None:
        raise AssertionError("one command's kill must not end the VM's other channels")


def _child(link: _Link, aborted: list[bool] | None = None) -> tuple[VmChild, ExecChannel]:
    channel = ExecChannel(7)
    noted = aborted if aborted is not None else []
    child = VmChild(
        link,  # type: ignore[arg-type]  # the recorded stand-in
        channel, guest_pid=42, on_abort=lambda: noted.append(True),
    )
    return child, channel


async def _pumped(child: VmChild) -> list[tuple[EventType, bytes]]:
    events: list[tuple[EventType, bytes]] = []

    async def emit(kind: EventType, data: bytes) -> None:
        events.append((kind, data))

    async with asyncio.timeout(5):
        await child.pump(emit)
    return events


async def test_output_frames_become_events_in_order_then_the_exit_code() -> None:
    link = _Link()
    child, channel = _child(link)
    for frame in (
        Frame(7, FrameType.STDOUT, b"out"),
        Frame(7, FrameType.STDERR, b"err"),
        Frame(7, FrameType.STDOUT, b"more"),
        Frame(7, FrameType.EXIT, struct.pack("<I", 3)),
    ):
        channel.frames.put_nowait(frame)
    assert await _pumped(child) == [
        (EventType.STDOUT, b"out"), (EventType.STDERR, b"err"), (EventType.STDOUT, b"more"),
    ]
    assert child.returncode == 3 and await child.exited() == 3
    child.signal(signal.SIGKILL)  # ended: nothing more goes to the guest
    assert link.sent == []
    await child.close()
    assert link.forgotten == [7]


async def test_an_abort_is_the_vm_going_away_under_the_command() -> None:
    aborted: list[bool] = []
    child, channel = _child(_Link(), aborted)
    channel.frames.put_nowait(Frame(7, FrameType.STDOUT, b"x"))
    channel.frames.put_nowait(Frame(7, FrameType.ABORT))
    assert await _pumped(child) == [(EventType.STDOUT, b"x")]
    assert child.returncode == 128 + signal.SIGKILL and aborted == [True]


async def test_a_kill_sends_sigkill_and_the_guests_exit_ends_it() -> None:
    link = _Link()
    child, channel = _child(link)
    pump = asyncio.get_running_loop().create_task(_pumped(child), name="pump")
    killing = asyncio.get_running_loop().create_task(child.kill(), name="kill")
    await asyncio.sleep(0)
    assert link.sent == [(7, FrameType.SIGNAL, struct.pack("<I", signal.SIGKILL))]
    channel.frames.put_nowait(Frame(7, FrameType.EXIT, struct.pack("<I", 137)))
    async with asyncio.timeout(5):
        await killing
        await pump
    assert child.returncode == 137


async def test_a_kill_nobody_answers_gives_up_this_channel_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vm_handle, "KILL_GRACE_S", 0.05)
    link = _Link()
    child, _ = _child(link)
    pump = asyncio.get_running_loop().create_task(_pumped(child), name="pump")
    async with asyncio.timeout(5):
        await child.kill()  # the stand-in's close_all would fail the test
        assert await child.exited() == 128 + signal.SIGKILL
        assert await pump == []  # woken, and ended
    await child.close()
    assert link.forgotten == [7]


async def test_stdin_to_a_vm_that_is_gone_is_dropped_by_feed_and_raised_by_write() -> None:
    link = _Link()
    child, _ = _child(link)
    await child.feed(b"a" * (70 * 1024))
    assert [len(payload) for _, kind, payload in link.sent if kind is FrameType.DATA] == [
        32 * 1024, 32 * 1024, 6 * 1024,
    ]
    assert link.sent[-1][1] is FrameType.EOF
    link.gone = True
    await child.feed(b"late")  # no error: the reader is gone
    with pytest.raises(AgentGone):
        await child.write_stdin(b"late")
