"""The server's end of the agent protocol against a fake agent on a Unix socket: a guest that
breaks the framing (an unknown frame type, an oversized length) fails every waiter at once,
ends every command's channel and leaves nothing to send to; what it sent intact still counts."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
from collections.abc import AsyncIterator

import pytest

from cc_server.microvm.link import AgentGone, AgentLink
from cc_server.microvm.proto import HEADER, MAX_PAYLOAD, FrameType, encode

GARBAGE = {
    "unknown type": HEADER.pack(3, 0, 99) + b"abc",
    "oversized": HEADER.pack(MAX_PAYLOAD + 1, 0, int(FrameType.PONG)),
}


class FakeAgent:
    """A Unix socket the link attaches to; `peer()` is the agent's end of the connection."""

    def __init__(self) -> None:
        self._peers: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue(1)
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self, path: pathlib.Path) -> None:
        async def accept(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._writers.append(writer)
            await self._peers.put(writer)

        self._server = await asyncio.start_unix_server(accept, str(path))

    async def peer(self) -> asyncio.StreamWriter:
        return await self._peers.get()

    async def aclose(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()


@contextlib.asynccontextmanager
async def attached(tmp_path: pathlib.Path) -> AsyncIterator[tuple[AgentLink, asyncio.StreamWriter]]:
    """A link attached to a fake agent, and the agent's end."""
    fake = FakeAgent()
    await fake.start(tmp_path / "agent.sock")
    link = AgentLink(lambda: None)
    try:
        await link.attach(tmp_path / "agent.sock", alive=lambda: True)
        yield link, await fake.peer()
    finally:
        await link.detach()
        await fake.aclose()


@pytest.mark.parametrize("garbage", GARBAGE.values(), ids=GARBAGE.keys())
async def test_a_garbage_frame_fails_every_waiter_at_once(
    tmp_path: pathlib.Path, garbage: bytes
) -> None:
    async with attached(tmp_path) as (link, agent):
        channel = link.open_exec()
        waiting = asyncio.create_task(link.request(FrameType.PING, b"x", FrameType.PONG, 0))
        await asyncio.sleep(0)
        agent.write(encode(channel.channel, FrameType.STARTED, b"\x07\0\0\0") + garbage)
        async with asyncio.timeout(5):  # not the link's 30 s reply timeout
            with pytest.raises(AgentGone, match="broke the protocol"):
                await waiting
            first = await channel.frames.get()
            assert first.type is FrameType.STARTED  # decoded before the garbage
            assert (await channel.frames.get()).type is FrameType.ABORT
        assert not link.connected
        with pytest.raises(AgentGone):
            link.send(channel.channel, FrameType.SIGNAL, b"\x09\0\0\0")
        late = link.open_exec()
        assert (await late.frames.get()).type is FrameType.ABORT


async def test_frames_split_anywhere_still_decode(tmp_path: pathlib.Path) -> None:
    async with attached(tmp_path) as (link, agent):
        channel = link.open_exec()
        data = encode(channel.channel, FrameType.STDOUT, b"hello") + encode(
            channel.channel, FrameType.EXIT, b"\0\0\0\0\0\0\0\0")
        for at in range(len(data)):
            agent.write(data[at:at + 1])
            await agent.drain()
        async with asyncio.timeout(5):
            assert (await channel.frames.get()).payload == b"hello"
            assert (await channel.frames.get()).type is FrameType.EXIT
        assert link.connected


async def test_a_closed_socket_fails_the_waiting_requests_at_once(tmp_path: pathlib.Path) -> None:
    # QEMU closes the agent's socket when it exits (a restore's state that does not load):
    # the greeting waiting behind the load fails now, not at the link's 30 s reply timeout.
    async with attached(tmp_path) as (link, agent):
        channel = link.open_exec()
        waiting = asyncio.create_task(link.request(FrameType.HELLO, b"", FrameType.HELLO_OK, 0))
        await asyncio.sleep(0)
        agent.close()
        async with asyncio.timeout(5):
            with pytest.raises(AgentGone, match="QEMU exited"):
                await waiting
        assert channel.frames.empty()  # a command's channel is its owner's to end (resume)
