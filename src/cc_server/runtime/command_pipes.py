"""A session sandbox command's pipes, our ends as plain non-blocking descriptors that the event
loop watches directly: no transport, protocol, stream or task of their own (runtime/child.py's
asyncio pipes cost three transports and three tasks per command).

`pump` reads stdout and stderr in the calling task, one chunk at a time, and stops watching a
pipe while its chunk waits to be queued, so a consumer that does not read holds the command
(as a full pipe does), never the server's memory. Stdin is written in call order (a later write
waits for an earlier one that the pipe could not take yet); `close_stdin` sends EOF once what
was asked to be written before it has been written. A descriptor is closed once, here, and never
used after: a number the process reuses is another file's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
from collections.abc import Callable
from typing import Final

from cc_server.errors import BadSpec
from cc_server.runtime.child import READ_CHUNK_BYTES, Emit
from cc_server.runtime.events import EventType

__all__ = ["CommandPipes"]

# Chunks read from one pipe while it has more, before the loop is asked again which is ready
# (what a stream's transport would have buffered meanwhile; the other pipe waits that long).
READS_IN_A_ROW: Final = 4


class CommandPipes:
    """Our ends of one command's pipes. Built empty; `run` adds each pipe it makes."""

    def __init__(self) -> None:
        self._open: set[int] = set()  # our descriptors not closed yet
        self._outputs: list[tuple[int, EventType]] = []
        self._stdin: int | None = None  # until it is closed
        self._stdin_fd = -1  # its number while it is in `_open`
        self._closed_output: Callable[[int], None] | None = None  # set while pump runs
        self._had_stdin = False
        self._writing: asyncio.Lock | None = None  # writes one after another, in call order
        self._writers = 0  # writes asked for and not finished
        self._eof_asked = False  # close_stdin came while writes were under way
        self._waiter: asyncio.Future[None] | None = None  # a write waiting for room

    def add_stdin(self, fd: int) -> None:
        """Take the write end of the command's stdin pipe."""
        os.set_blocking(fd, False)
        self._open.add(fd)
        self._stdin, self._stdin_fd, self._had_stdin = fd, fd, True

    def add_output(self, fd: int, kind: EventType) -> None:
        """Take the read end of its stdout (`kind` STDOUT) or stderr pipe."""
        os.set_blocking(fd, False)
        self._open.add(fd)
        self._outputs.append((fd, kind))

    async def pump(self, emit: Emit) -> None:
        """Pass every chunk read from stdout and stderr to `emit` until both end (EOF, or closed
        here); cancel to stop early."""
        loop = asyncio.get_running_loop()
        kinds = {fd: kind for fd, kind in self._outputs if fd in self._open}
        ready: collections.deque[int] = collections.deque()  # readable, not read yet
        watched: set[int] = set()  # registered with the loop
        woken: list[asyncio.Future[None]] = []

        def readable(fd: int) -> None:
            if fd in ready:  # still waiting its turn (the consumer is slow): stop asking
                loop.remove_reader(fd)
                watched.discard(fd)
                return
            ready.append(fd)
            if woken and not woken[0].done():
                woken[0].set_result(None)

        def closed(fd: int) -> None:
            watched.discard(fd)
            if fd not in ready:
                ready.append(fd)
            if woken and not woken[0].done():
                woken[0].set_result(None)

        self._closed_output = closed
        try:
            for fd in kinds:
                loop.add_reader(fd, readable, fd)
                watched.add(fd)
            while kinds:
                if not ready:
                    woken[:] = [loop.create_future()]
                    await woken[0]
                    continue
                fd = ready[0]
                open_still = fd in kinds and await self._read_some(fd, kinds[fd], emit)
                ready.popleft()
                if not open_still:
                    kinds.pop(fd, None)
                    watched.discard(fd)
                elif fd not in watched:
                    loop.add_reader(fd, readable, fd)
                    watched.add(fd)
        finally:
            self._closed_output = None
            for fd in watched:
                if fd in self._open:
                    loop.remove_reader(fd)

    async def _read_some(self, fd: int, kind: EventType, emit: Emit) -> bool:
        """Emit up to READS_IN_A_ROW chunks of `fd` that are there now; whether it is still
        open (False: it ended, and is closed)."""
        for _ in range(READS_IN_A_ROW):
            try:
                chunk = os.read(fd, READ_CHUNK_BYTES) if fd in self._open else b""
            except BlockingIOError:
                return True
            except OSError:
                chunk = b""
            if not chunk:
                self._close(fd)
                return False
            await emit(kind, chunk)
        return fd in self._open

    async def write(self, data: bytes) -> None:
        """Write `data` to stdin after the writes asked before it, waiting while the pipe is
        full.

        Raises:
            BadSpec: the command has no stdin pipe.
            BrokenPipeError: the command's end is closed, or stdin was closed here.
        """
        if not self._had_stdin:
            raise BadSpec("this execution has no interactive stdin")
        if self._writing is None:
            self._writing = asyncio.Lock()
        self._writers += 1
        try:
            async with self._writing:
                view = memoryview(data)
                while view:
                    fd = self._stdin
                    if fd is None:
                        raise BrokenPipeError("stdin is closed")
                    try:
                        view = view[os.write(fd, view) :]
                    except BlockingIOError:
                        await self._wait_writable(fd)
        finally:
            self._writers -= 1
            if self._eof_asked and self._writers == 0:
                self._close_stdin_now()

    async def _wait_writable(self, fd: int) -> None:
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()

        def writable() -> None:
            if not waiter.done():
                waiter.set_result(None)

        loop.add_writer(fd, writable)
        try:
            await waiter
        finally:
            self._waiter = None
            if fd in self._open:
                loop.remove_writer(fd)

    def close_stdin(self) -> None:
        """Send EOF to stdin once the writes asked before are done (at once when none is)."""
        if self._writers:
            self._eof_asked = True
        else:
            self._close_stdin_now()

    def _close_stdin_now(self) -> None:
        fd, self._stdin = self._stdin, None
        self._eof_asked = False
        if fd is not None:
            self._close(fd)

    def _close(self, fd: int) -> None:
        if fd not in self._open:
            return
        self._open.discard(fd)
        is_stdin = fd == self._stdin_fd
        with contextlib.suppress(RuntimeError):  # no running loop: nothing watches it
            loop = asyncio.get_running_loop()
            if is_stdin:
                loop.remove_writer(fd)  # a write waiting for room
            else:
                loop.remove_reader(fd)  # pump's, if it still watches it
        if is_stdin:
            self._stdin = None
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_exception(BrokenPipeError("stdin is closed"))
        elif self._closed_output is not None:
            self._closed_output(fd)  # pump stops waiting for it
        os.close(fd)

    def close(self) -> None:
        """Close every pipe end still open here (at once); a write waiting fails."""
        for fd in list(self._open):
            self._close(fd)
