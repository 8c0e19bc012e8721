"""The server's end of the agent protocol: one connection to a VM's console port at a time, and
the channels (commands, outbound connections) that outlive it across a suspend and resume.

A command's channel is a queue of frames its Execution reads. An outbound connection the guest
opens on its proxy port becomes a connection to the session's egress proxy socket on the host:
the proxies' allowlist, address guard and violation events apply to it unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, NamedTuple

from cc_server.errors import EnforcementFailed
from cc_server.microvm.proto import (
    MAX_PAYLOAD,
    NET_CHANNEL_BIT,
    Frame,
    FrameDecoder,
    FrameType,
    ProtocolError,
    encode,
    hello_payload,
)
from cc_server.tasks import start_task

__all__ = ["AgentGone", "AgentLink", "ExecChannel"]

log = logging.getLogger("cc_server.microvm")
EXEC_QUEUE_FRAMES: Final = 1024  # frames buffered per command before the link waits for its reader
AGENT_CONNECT_TIMEOUT_S: Final = 10.0
AGENT_REPLY_TIMEOUT_S: Final = 30.0
ENTROPY_BYTES: Final = 64  # fresh randomness for each restored guest
PROXY_SOCKETS: Final = ("http.sock", "socks.sock")  # NET_OPEN's u8: 0 http, 1 socks
VM_DIR_PREFIX: Final = "vm"  # <base>/vm-<server pid>-<random>: one VM's sockets, logs, state


class AgentGone(EnforcementFailed):
    """The VM's agent connection broke."""


class Request(NamedTuple):
    """One frame to send and the answer to wait for (channel None: a fresh one)."""

    kind: FrameType
    payload: bytes
    answer: FrameType
    channel: int | None = None


def hello_request() -> Request:
    """The clock and fresh entropy for the guest: every restore of one snapshot starts with the
    same random state and the snapshot's time."""
    payload = hello_payload(time.time_ns(), secrets.token_bytes(ENTROPY_BYTES))
    return Request(FrameType.HELLO, payload, FrameType.HELLO_OK, 0)


class ExecChannel:
    """One command's frames, in order."""

    def __init__(self, channel: int) -> None:
        self.channel = channel
        self.frames: asyncio.Queue[Frame] = asyncio.Queue(EXEC_QUEUE_FRAMES)


class _Conn:
    """One outbound connection: the guest's channel and the proxy socket on the host."""

    def __init__(self) -> None:
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None


class AgentLink:
    """Frames to and from one VM's agent; reconnects to a new socket after a resume."""

    def __init__(self, proxy_dir: Callable[[], Path | None]) -> None:
        self._proxy_dir = proxy_dir  # the session's egress socket dir, once the proxies run
        self._ids = itertools.count(1)
        self._execs: dict[int, ExecChannel] = {}
        self._conns: dict[int, _Conn] = {}
        self._replies: dict[tuple[int, FrameType], asyncio.Future[Frame]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._decoder = FrameDecoder()
        self._gone: BaseException | None = None

    async def wait_startup(self, sock_path: Path, *, alive: Callable[[], bool]) -> None:
        """Attach to a cold-booting VM and wait for the agent's first HELLO_OK, which it sends
        once its console port is in raw mode: bytes sent earlier would be echoed back by the
        guest's tty layer.

        Raises:
            AgentGone: the agent never greeted.
        """
        future: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self._replies[(0, FrameType.HELLO_OK)] = future
        try:
            await self.attach(sock_path, alive=alive)
            await future
        finally:
            self._replies.pop((0, FrameType.HELLO_OK), None)

    async def attach(self, sock_path: Path, *, alive: Callable[[], bool]) -> None:
        """Connect to the agent's socket (QEMU creates it at start; connect before the guest
        runs, since the console port drops output while nobody listens).

        Raises:
            AgentGone: the socket did not accept in time, or QEMU exited.
        """
        try:
            async with asyncio.timeout(AGENT_CONNECT_TIMEOUT_S):
                while True:
                    if not alive():
                        raise AgentGone("QEMU exited before its agent socket answered")
                    try:
                        reader, writer = await asyncio.open_unix_connection(str(sock_path))
                        break
                    except (FileNotFoundError, ConnectionRefusedError):
                        await asyncio.sleep(0.002)
        except TimeoutError as exc:
            raise AgentGone(f"no agent socket at {sock_path}") from exc
        self._decoder = FrameDecoder()
        self._gone = None
        self._writer = writer
        self._reader_task = start_task(self._read(reader), name="microvm agent reader")

    async def detach(self) -> None:
        """Drop the connection (the VM is being suspended or destroyed); every outbound
        connection is closed. Command channels stay: a resumed VM continues them."""
        for channel in list(self._conns):
            self._close_conn(channel)
        writer, self._writer = self._writer, None
        task, self._reader_task = self._reader_task, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for future in self._replies.values():
            if not future.done():
                future.set_exception(AgentGone("the VM's agent connection was closed"))
        self._replies.clear()

    def close_all(self, reason: BaseException) -> None:
        """The VM is gone for good: every command channel ends."""
        self._gone = reason
        for channel in list(self._execs):
            self._end_exec(channel)

    # --- sending ------------------------------------------------------------------------

    def send(self, channel: int, kind: FrameType, payload: bytes = b"") -> None:
        """Queue one frame to the agent.

        Raises:
            AgentGone: no connection (suspended, destroyed or broken).
        """
        if self._writer is None or self._writer.is_closing():
            raise AgentGone("the VM is not running", fix="resume it or launch a new one")
        self._writer.write(encode(channel, kind, payload))

    async def drain(self) -> None:
        """Wait until the frames sent so far are with QEMU."""
        if self._writer is not None:
            await self._writer.drain()

    async def request(
        self, kind: FrameType, payload: bytes, answer: FrameType, channel: int | None = None
    ) -> Frame:
        """Send a frame and wait for the agent's answer on the same channel.

        Raises:
            AgentGone: the connection broke or the agent did not answer in time.
        """
        return (await self.request_many([Request(kind, payload, answer, channel)]))[0]

    async def request_many(self, requests: Sequence[Request]) -> list[Frame]:
        """Send every frame at once, then wait for every answer: the agent handles them in
        order, and one round trip to a guest under TCG costs milliseconds.

        Raises:
            AgentGone: the connection broke or the agent did not answer in time.
        """
        loop = asyncio.get_running_loop()
        keys: list[tuple[int, FrameType]] = []
        futures: list[asyncio.Future[Frame]] = []
        try:
            for request in requests:
                channel = next(self._ids) if request.channel is None else request.channel
                key = (channel, request.answer)
                futures.append(loop.create_future())
                self._replies[key] = futures[-1]
                keys.append(key)
                self.send(channel, request.kind, request.payload)
            await self.drain()
            async with asyncio.timeout(AGENT_REPLY_TIMEOUT_S):
                return [await future for future in futures]
        except TimeoutError as exc:
            raise AgentGone("the agent did not answer in time") from exc
        finally:
            for key in keys:
                self._replies.pop(key, None)
            for future in futures:  # the answers after a failed one: seen, not left to warn
                if future.done() and not future.cancelled():
                    future.exception()

    async def hello(self) -> None:
        """Give the guest the host's clock and fresh entropy (see `hello_request`)."""
        await self.request_many([hello_request()])

    def open_exec(self) -> ExecChannel:
        """A new command channel (the caller sends EXEC on it)."""
        channel = ExecChannel(next(self._ids))
        self._execs[channel.channel] = channel
        if self._gone is not None:
            self._end_exec(channel.channel)
        return channel

    def forget_exec(self, channel: int) -> None:
        """The command's Execution is done with its channel."""
        self._execs.pop(channel, None)

    # --- receiving ----------------------------------------------------------------------

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while chunk := await reader.read(MAX_PAYLOAD + 64):
                for frame in self._decoder.feed(chunk):
                    await self._dispatch(frame)
        except ProtocolError as exc:
            # The guest broke the framing: nothing it sends can be read any more. What it
            # completed before counts; then every waiter fails now (not at its timeout), every
            # command ends, and nothing more is sent.
            log.warning("microvm agent broke the protocol: %s", exc)
            for frame in exc.frames:
                await self._dispatch(frame)
            self._broken(AgentGone(f"the VM's agent broke the protocol: {exc}",
                                   fix="destroy the sandbox; see the VM's console log"))
        except ConnectionError as exc:
            log.warning("microvm agent connection broke: %s", exc)
        # EOF: QEMU closed the socket (it quit, or a restore's state did not load); nothing
        # can answer a waiting request now. The commands' channels are the owner's to end.
        gone = AgentGone("the VM's agent connection closed: QEMU exited",
                         fix="see QEMU's log in the VM's directory")
        for future in self._replies.values():
            if not future.done():
                future.set_exception(gone)

    def _broken(self, reason: AgentGone) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        for channel in list(self._conns):
            self._close_conn(channel)
        for future in self._replies.values():
            if not future.done():
                future.set_exception(reason)
        self.close_all(reason)

    async def _dispatch(self, frame: Frame) -> None:
        waiting = self._replies.get((frame.channel, frame.type))
        if waiting is None and frame.type is FrameType.RESULT:
            waiting = next(
                (f for (ch, _), f in self._replies.items() if ch == frame.channel), None
            )
        if waiting is not None:
            if not waiting.done():
                waiting.set_result(frame)
            return
        if frame.type is FrameType.NET_OPEN:
            self._open_conn(frame)
            return
        if frame.channel & NET_CHANNEL_BIT:
            self._conn_frame(frame)
            return
        channel = self._execs.get(frame.channel)
        if channel is not None:
            await channel.frames.put(frame)
        elif frame.type not in (FrameType.HELLO_OK, FrameType.PONG):
            log.debug("microvm frame for unknown channel %d: %s", frame.channel, frame.type)

    def _end_exec(self, channel: int) -> None:
        exec_channel = self._execs.get(channel)
        if exec_channel is not None:
            with contextlib.suppress(asyncio.QueueFull):
                exec_channel.frames.put_nowait(Frame(channel, FrameType.ABORT))

    # --- outbound connections ---------------------------------------------------------------

    def _open_conn(self, frame: Frame) -> None:
        which = frame.payload[0] if frame.payload else 0
        directory = self._proxy_dir()
        if directory is None or which >= len(PROXY_SOCKETS):
            self._abort(frame.channel)
            return
        task = start_task(
            self._conn_main(frame.channel, directory / PROXY_SOCKETS[which]),
            name=f"microvm conn {frame.channel:#x}",
        )
        self._conns[frame.channel] = _Conn()
        self._conns[frame.channel].task = task

    async def _conn_main(self, channel: int, path: Path) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(str(path))
        except OSError:
            self._conns.pop(channel, None)
            self._abort(channel)
            return
        conn = self._conns.get(channel)
        if conn is None:
            writer.close()
            return
        conn.writer = writer
        try:
            while data := await reader.read(MAX_PAYLOAD):
                self.send(channel, FrameType.DATA, data)
                await self.drain()
            self.send(channel, FrameType.EOF)
        except (OSError, AgentGone):
            self._abort(channel)
            self._close_conn(channel, cancel=False)

    def _conn_frame(self, frame: Frame) -> None:
        conn = self._conns.get(frame.channel)
        if conn is None or conn.writer is None:
            if conn is None:
                self._abort(frame.channel)
                return
            # Not connected yet: the proxy socket is a local Unix socket, so this is rare;
            # hold the frame until the connection exists.
            asyncio.get_running_loop().call_later(0.005, self._conn_frame, frame)
            return
        writer = conn.writer
        if frame.type is FrameType.DATA:
            writer.write(frame.payload)
        elif frame.type is FrameType.EOF:
            with contextlib.suppress(OSError):
                if writer.can_write_eof():
                    writer.write_eof()
        elif frame.type is FrameType.ABORT:
            self._close_conn(frame.channel)

    def _abort(self, channel: int) -> None:
        with contextlib.suppress(AgentGone):
            self.send(channel, FrameType.ABORT)

    def _close_conn(self, channel: int, *, cancel: bool = True) -> None:
        conn = self._conns.pop(channel, None)
        if conn is None:
            return
        if conn.writer is not None:
            conn.writer.close()
        if cancel and conn.task is not None:
            conn.task.cancel()

    @property
    def connected(self) -> bool:
        """Whether a VM is attached."""
        return self._writer is not None and not self._writer.is_closing()


def private_dir(base: str, prefix: str) -> Path:
    """A new 0700 directory `<base>/<prefix>-<server pid>-<random>`."""
    path = Path(base) / f"{prefix}-{os.getpid()}-{secrets.token_hex(8)}"
    path.mkdir(mode=0o700)
    return path
