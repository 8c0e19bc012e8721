"""`cc-server run --ask`: each connection to a host the allowlist does not name is held and
asked about on the terminal, firewall-style:

    cc-server: egress request: pypi.org:443 (http, from: pip install x)
    cc-server: allow [o]nce, for the [s]ession, or [d]eny? (30 s)

`o` lets that connection through, `s` adds `pypi.org:443` to the run's allowlist, `d` (or any
other answer, or none within the request's time) refuses it, and the refusal is a violation
line like any other. One question at a time; a request whose time ran out while an earlier one
was asked is not asked any more. The terminal is the command's too: a command reading its
stdin while a question is up may take the answer (or the answer its input).

Deny-list hosts, refused addresses (loopback, metadata, private ranges, unless allowed as an IP
literal) and a run with the network off are never asked about (`runtime.egress`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Final, TextIO

from cc_server.errors import BadSpec

if TYPE_CHECKING:
    from cc_server.runtime.events import EgressRequest
    from cc_server.runtime.handle import SandboxHandle

__all__ = ["ANSWER_KEYS", "Prompter", "open_asking", "open_prompter"]

ANSWER_KEYS: Final = {"o": "once", "s": "session", "d": "deny"}
DEFAULT_TIMEOUT_S: Final = 30.0  # runtime.egress.ASK_TIMEOUT_S, without importing the runtime
MAX_ANSWER_BYTES: Final = 256  # one short line; anything longer is not an answer
QUEUE_SIZE: Final = 16  # as many as the session holds at once (MAX_PENDING_REQUESTS)


class Prompter:
    """Asks about each `offer`ed request on a terminal, one at a time (see the module)."""

    def __init__(self, handle: SandboxHandle, tty_fd: int, out: TextIO) -> None:
        self._handle = handle
        self._fd = tty_fd
        self._out = out
        self._queue: asyncio.Queue[EgressRequest] = asyncio.Queue(QUEUE_SIZE)

    def offer(self, request: EgressRequest) -> None:
        """Queue a request to be asked about (dropped, so denied at its timeout, when full)."""
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(request)

    async def run(self) -> None:
        """Ask about the queued requests until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            request = await self._queue.get()
            pending = {r.id for r in (self._handle.egress.pending_requests
                                      if self._handle.egress else ())}  # fmt: skip
            if request.id not in pending:
                continue  # answered elsewhere, or its time ran out
            started = loop.time()
            commands = "; ".join(" ".join(argv) for argv in request.commands) or "?"
            self._say(f"cc-server: egress request: {request.entry} ({request.protocol}, "
                      f"from: {commands})")
            self._say(f"cc-server: allow [o]nce, for the [s]ession, or [d]eny? "
                      f"({request.timeout_s:g} s) ", end="")
            line = await self._read_line(request.timeout_s - (loop.time() - started))
            if line is None:
                self._say("\ncc-server: no answer: refused")
                continue
            answer = ANSWER_KEYS.get(line.strip().lower()[:1], "deny")
            try:
                assert self._handle.egress is not None
                self._handle.egress.answer(request.id, answer)
            except BadSpec:
                self._say("cc-server: too late: its time ran out, refused")
                continue
            self._say(f"cc-server: {request.entry}: {answer}")

    def _say(self, text: str, end: str = "\n") -> None:
        print(text, end=end, file=self._out, flush=True)

    async def _read_line(self, timeout_s: float) -> str | None:
        """One line from the terminal, or None at EOF, on an error, or after `timeout_s`."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[str | None] = loop.create_future()
        buffer = bytearray()

        def readable() -> None:
            try:
                chunk = os.read(self._fd, MAX_ANSWER_BYTES)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if done.done():
                return
            if not chunk:
                done.set_result(None)
                return
            buffer.extend(chunk)
            if b"\n" in buffer or b"\r" in buffer or len(buffer) >= MAX_ANSWER_BYTES:
                done.set_result(buffer.decode(errors="replace"))

        loop.add_reader(self._fd, readable)
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                return await done
        except TimeoutError:
            return None
        finally:
            loop.remove_reader(self._fd)


@contextlib.asynccontextmanager
async def open_prompter(
    handle: SandboxHandle, tty_fd: int, out: TextIO, timeout_s: float
) -> AsyncIterator[Prompter]:
    """Put `handle`'s egress in ask mode (`timeout_s` per request) and ask on `tty_fd` and
    `out` for the duration of the block; give the prompter every `egress-request` event.

    Raises:
        BadSpec: the handle has no egress proxies (a backend without them cannot ask), or the
            timeout is not positive.
    """
    if handle.egress is None:
        raise BadSpec(
            f"--ask needs the session's egress proxies; backend {handle.backend} has none",
            fix="run with the native or microvm backend, or without --ask",
        )
    handle.egress.ask(timeout_s)
    prompter = Prompter(handle, tty_fd, out)
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(prompter.run(), name=f"egress prompter {handle.session_id}")
        try:
            yield prompter
        finally:
            task.cancel()


@contextlib.asynccontextmanager
async def open_asking(
    ask: bool, handle: SandboxHandle, out: TextIO, timeout_s: float = DEFAULT_TIMEOUT_S
) -> AsyncIterator[Prompter | None]:
    """`cc-server run --ask`: a prompter on this process's terminal (stdin) when `ask`, else
    nothing.

    Raises:
        BadSpec: `ask`, and stdin is not a terminal, or the handle has no egress proxies.
    """
    if not ask:
        yield None
        return
    if not os.isatty(0):
        raise BadSpec("--ask asks on the terminal, and stdin is not one",
                      fix="run it from a terminal, or answer through the API (egress: ask)")
    async with open_prompter(handle, 0, out, timeout_s) as prompter:
        yield prompter
