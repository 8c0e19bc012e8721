"""CommandPipes: a session command's pipes as plain descriptors on the loop (real pipes, no
sandbox): stdin written in call order and closed after what was asked before, output pumped
with the consumer's pace, every descriptor closed once."""

from __future__ import annotations

import asyncio
import os

import pytest

from cc_server.errors import BadSpec
from cc_server.runtime.command_pipes import CommandPipes
from cc_server.runtime.events import EventType

BIG = 1 << 20  # more than a pipe holds: the write has to wait for the reader


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


async def test_writes_go_in_call_order_and_eof_comes_after_them() -> None:
    pipes = CommandPipes()
    theirs, ours = os.pipe2(os.O_CLOEXEC)
    pipes.add_stdin(ours)
    reader = asyncio.create_task(asyncio.to_thread(_read_all, theirs))
    first, second = b"a" * BIG, b"b" * 1000
    writes = [asyncio.create_task(pipes.write(first)), asyncio.create_task(pipes.write(second))]
    await asyncio.sleep(0)
    pipes.close_stdin()  # asked while both writes wait: EOF once they are done
    await asyncio.gather(*writes)
    assert await reader == first + second
    with pytest.raises(BrokenPipeError):
        await pipes.write(b"late")
    pipes.close()


async def test_a_write_waiting_fails_when_the_pipes_are_closed() -> None:
    pipes = CommandPipes()
    theirs, ours = os.pipe2(os.O_CLOEXEC)
    pipes.add_stdin(ours)
    write = asyncio.create_task(pipes.write(b"x" * BIG))
    await asyncio.sleep(0.01)
    assert not write.done()  # nobody reads: it waits
    pipes.close()
    with pytest.raises(BrokenPipeError):
        await write
    os.close(theirs)


async def test_no_stdin_pipe_is_a_bad_spec() -> None:
    with pytest.raises(BadSpec):
        await CommandPipes().write(b"x")


async def test_output_is_pumped_at_the_consumers_pace_until_both_ends_close() -> None:
    pipes = CommandPipes()
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    pipes.add_output(out_r, EventType.STDOUT)
    pipes.add_output(err_r, EventType.STDERR)
    got: dict[EventType, bytearray] = {EventType.STDOUT: bytearray(), EventType.STDERR: bytearray()}
    gate = asyncio.Event()

    async def emit(kind: EventType, chunk: bytes) -> None:
        await gate.wait()  # a consumer that does not read yet
        got[kind] += chunk

    pump = asyncio.create_task(pipes.pump(emit))
    os.write(err_w, b"err")
    payload = b"o" * BIG
    writer = asyncio.create_task(asyncio.to_thread(os.write, out_w, payload))
    await asyncio.sleep(0.05)
    assert not writer.done()  # held by the full pipe while the consumer waits
    gate.set()
    written = await writer
    os.write(out_w, payload[written:])
    os.close(out_w)
    os.close(err_w)
    async with asyncio.timeout(10):
        await pump
    assert bytes(got[EventType.STDOUT]) == payload and bytes(got[EventType.STDERR]) == b"err"
    assert not pipes._open  # each closed at its EOF, so close() closes nothing twice
    pipes.close()


async def test_pump_ends_when_its_pipes_are_closed_here() -> None:
    pipes = CommandPipes()
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    pipes.add_output(out_r, EventType.STDOUT)

    async def emit(kind: EventType, chunk: bytes) -> None:
        raise AssertionError("nothing was written")

    pump = asyncio.create_task(pipes.pump(emit))
    await asyncio.sleep(0)
    pipes.close()  # the command's end is still open: no EOF comes
    async with asyncio.timeout(10):
        await pump
    os.close(out_w)
