"""The data path of a tunnel: relay raw bytes both ways between two connected sockets.

Design (D2 of the relay spike, ``shared/notes/proxy-relay-spike.md``): each direction moves bytes
with `os.splice` from the source socket into a pipe of its own and from the pipe into the
destination socket, so the bytes never enter Python (no kernel-user copies). The event loop
drives it: a direction waits for its source to be readable (`loop.add_reader`) while its pipe is
empty, and for its destination to be writable (`loop.add_writer`) while the pipe holds bytes the
destination would not take; a full pipe stops reading, which is the flow control. The spike
measured 0.72-0.86x a direct loopback transfer for this design at about 0.2 CPU-s/GiB.

Why not one thread per direction with blocking splice (the spike's D1, 0.80-0.91x): a thread
blocked in `splice` can only be woken by shutting its sockets down, so cancellation, the idle
timeout and `aclose()` would each need a shutdown-then-join protocol across threads, and a
session would hold two threads per tunnel. On the event loop a direction is a pair of callbacks
and a future, and `relay` waits for the two futures itself (no task per direction: a task and a
TaskGroup cost more than the callbacks of a short request); cancelling `relay` removes the
callbacks and closes the pipes, and nothing can block.

Small first: a direction copies its first `SPLICE_AFTER_BYTES` with ``recv``/``send`` (a request
head or a small response is two system calls, where a pipe costs five more before the first byte
moves), then opens its pipe and splices; the loopback legs (below) are tuned at that point too.

Each direction also loops a few rounds per wake-up (`ROUNDS_PER_WAKEUP`) before it returns to the
selector, which saves a selector pass per pipe-full on a fast stream while bounding how long one
busy tunnel holds the loop.

Half-close: when a direction's source reaches EOF and its pipe is empty, the destination gets
``shutdown(SHUT_WR)`` (the peer sees EOF after every byte) and the other direction keeps going.
The relay ends when both directions have ended, when ``idle_timeout_s`` passes with no byte moved
either way, or at the first error (a reset, a write to a closed peer): then both sockets are
reset (``SO_LINGER`` 0), so a peer never mistakes a broken tunnel for a clean end of stream.

Loopback legs (`tune_loopback_leg`): a socket whose peer is on loopback (the client's leg always
is: the sandbox reaches the proxy through a loopback listener) gets two settings once the relay
carries bulk data (a direction has read `SPLICE_AFTER_BYTES`).
Measured on the 2-vCPU benchmark VM, 200 MiB through the CONNECT tunnel, interleaved rounds:
- Reno congestion control. Where the host's default is BBR (as on that VM), every sender paces
  its segments with a timer, which on loopback only adds timer wake-ups and idle gaps: there is
  no queue to spare. Reno does not pace, and it is the one algorithm every process may choose.
  1.66-1.76 GB/s paced, 1.93-2.12 GB/s unpaced, and about 0.7 instead of 0.97 CPU-s/GiB for the
  whole transfer.
- ``TCP_NOTSENT_LOWAT`` 16 KiB: the socket takes only a little more than it can send at once,
  and the rest waits in the direction's pipe. Without it a splice queues up to the send buffer
  (autotuned to MiBs) unsent, and the client's ACKs push that queue out from inside the client's
  own system calls, so the reader, the busiest process of a download, also does the relay's
  sending: curl spent 0.42 CPU-s/GiB instead of 0.23, the relay 0.20 instead of 0.26, and the
  tunnel ran at 1.85-1.95 GB/s instead of 2.5-2.8 GB/s (8 KiB: 2.46, 32 KiB: 2.39-2.59,
  64 KiB: 2.10, 128 and 512 KiB: no gain). It bounds the kernel memory a tunnel holds, too.
A leg to another host keeps the host's choices.

Fallback: where `os.splice` is missing or refuses a descriptor (``EINVAL``/``ENOSYS``), the
direction copies with ``recv``/``send`` instead (the spike's C, 0.55-0.59x); one code path
chooses per direction, at its first splice.

The caller owns the sockets (non-blocking, connected) and closes them; the relay owns its pipes.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from typing import Final

__all__ = [
    "LOOPBACK_CONGESTION_CONTROL",
    "LOOPBACK_NOTSENT_LOWAT_BYTES",
    "PIPE_BYTES",
    "RelayOutcome",
    "RelayResult",
    "relay",
    "splice_available",
    "tune_loopback_leg",
]

# One pipe per direction, resized to 1 MiB: one splice moves up to a pipe-full, and 1 MiB is the
# default /proc/sys/fs/pipe-max-size, so an unprivileged process may ask for it. Past the user's
# pipe quota (pipe-user-pages-soft) the resize fails and the pipe keeps its default size (64 KiB),
# which is slower but correct.
PIPE_BYTES: Final = 1024 * 1024
# The fallback's read size: large enough that a fast stream costs few system calls, small enough
# that a tunnel holds little memory while its destination is slow (one chunk per direction).
COPY_CHUNK_BYTES: Final = 256 * 1024
# A direction copies (recv/send, reads of at most this size) until it has read this much, and
# splices from then on: a request head or a small response moves with two system calls and no
# pipe (a pipe costs five: pipe2, two fcntl, two close), and the loopback legs are tuned only
# for a relay that carries more. Under the allocator's mmap threshold (128 KiB), so a read
# costs no mmap/munmap.
SPLICE_AFTER_BYTES: Final = 64 * 1024
# Pipe-fulls a direction moves per wake-up before it lets other callbacks run (at most about
# 4 MiB of one tunnel between two looks at the others).
ROUNDS_PER_WAKEUP: Final = 4

_F_SETPIPE_SZ: Final = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_F_GETPIPE_SZ: Final = getattr(fcntl, "F_GETPIPE_SZ", 1032)
_SPLICE_FLAGS: Final = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
# splice cannot handle this descriptor (or this kernel has no splice): copy instead.
_NO_SPLICE_ERRNOS: Final = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})
# Congestion control for a leg whose peer is on loopback: Reno does not pace (see the module
# docstring), and the kernel lets any process choose it (TCP_CONG_NON_RESTRICTED).
LOOPBACK_CONGESTION_CONTROL: Final = b"reno"
# Unsent bytes a loopback leg's socket holds before it stops taking more (see the module
# docstring): the best of 8, 16, 32 and 64 KiB on the benchmark VM.
LOOPBACK_NOTSENT_LOWAT_BYTES: Final = 16 * 1024
_TCP_CONGESTION: Final = getattr(socket, "TCP_CONGESTION", 13)
_TCP_NOTSENT_LOWAT: Final = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


def splice_available() -> bool:
    """Whether this platform has `os.splice` (Linux, Python 3.10+)."""
    return hasattr(os, "splice")


class RelayOutcome(enum.Enum):
    """How a relay ended."""

    CLOSED = "closed"
    """Both directions reached EOF and every byte was passed on."""
    IDLE = "idle"
    """No byte moved either way for the idle timeout."""
    ERROR = "error"
    """A socket failed (reset, write to a closed peer); both sockets were reset."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayResult:
    """What a relay did, for the log and for tests."""

    outcome: RelayOutcome
    to_upstream_bytes: int
    """Bytes written upstream, including the prefix."""
    to_client_bytes: int
    """Bytes written to the client, including the prefix."""
    error: str = ""
    """The first error, for ERROR."""


class _Activity:
    """When a byte last moved, either way (the idle clock)."""

    __slots__ = ("last", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.last = loop.time()

    def touch(self) -> None:
        self.last = self.loop.time()


class _Legs:
    """The relay's two sockets, tuned once the relay carries bulk data (`tune_loopback_leg`)."""

    __slots__ = ("socks", "tuned")

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.socks = (client, upstream)
        self.tuned = False

    def tune(self) -> None:
        if not self.tuned:
            self.tuned = True
            for sock in self.socks:
                tune_loopback_leg(sock)


class _Direction:
    """Bytes from ``src`` to ``dst``: a chunk at a time by copying until `SPLICE_AFTER_BYTES`
    were read, then a pipe-full at a time (or still by copying where splice is refused)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        src: socket.socket,
        dst: socket.socket,
        *,
        prefix: bytes,
        use_splice: bool,
        activity: _Activity,
        legs: _Legs,
    ) -> None:
        self._loop = loop
        self._src = src
        self._dst = dst
        self._src_fd = src.fileno()
        self._dst_fd = dst.fileno()
        self._activity = activity
        self._legs = legs
        self._buffer = memoryview(prefix)  # bytes in user space still to write (prefix, copy)
        self._may_splice = use_splice  # splice once this direction carries bulk data
        self._use_splice = False  # splicing now
        self._bulk = False  # SPLICE_AFTER_BYTES were read
        self._read = 0  # bytes read by copying
        self._pipe_r = -1
        self._pipe_w = -1
        self._pipe_size = PIPE_BYTES
        self._in_pipe = 0  # bytes spliced into the pipe and not yet out of it
        self._eof = False
        self._reading = False
        self._writing = False
        self.done: asyncio.Future[None] = loop.create_future()
        """Set once EOF has been passed on; its exception is the first OSError."""
        self.moved = 0  # bytes written to dst

    def start(self) -> None:
        """Move what can be moved now, then go on from loop callbacks until `done`."""
        self._pump()

    def stop(self) -> None:
        """Remove the callbacks and close the pipe (idempotent); `done` is left as it is."""
        self._stop_watching()
        for fd in (self._pipe_r, self._pipe_w):
            if fd >= 0:
                os.close(fd)
        self._pipe_r = self._pipe_w = -1
        self._use_splice = self._may_splice = False

    def failure(self) -> BaseException | None:
        """The error this direction ended with, if it has ended with one."""
        if not self.done.done() or self.done.cancelled():
            return None
        return self.done.exception()

    def _go_bulk(self) -> None:
        """SPLICE_AFTER_BYTES were read: tune the legs, and splice from now on if allowed."""
        self._bulk = True
        self._legs.tune()
        if self._may_splice:
            self._may_splice = False
            self._open_pipe()

    def _open_pipe(self) -> None:
        try:
            self._pipe_r, self._pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return  # out of descriptors for pipes: copying still works
        self._use_splice = True
        with contextlib.suppress(OSError):
            fcntl.fcntl(self._pipe_w, _F_SETPIPE_SZ, PIPE_BYTES)
        try:
            self._pipe_size = fcntl.fcntl(self._pipe_w, _F_GETPIPE_SZ)
        except OSError:
            self._pipe_size = 64 * 1024

    def _pump(self) -> None:
        """Move what can be moved now, then wait for the right readiness (a loop callback)."""
        if self.done.done():
            return
        self._activity.touch()
        try:
            if not self._flush():
                return self._watch(write=True)
            for _ in range(ROUNDS_PER_WAKEUP):
                if self._eof:
                    return self._finish()
                if not self._fill():
                    return self._watch(write=False)
                if not self._flush():
                    return self._watch(write=True)
            self._watch(write=False)
        except OSError as exc:
            self._stop_watching()
            self.done.set_exception(exc)

    def _fill(self) -> bool:
        """Read once from src into the pipe (or the buffer); False when src has nothing now."""
        if not self._bulk and self._read >= SPLICE_AFTER_BYTES:
            self._go_bulk()
        if self._use_splice:
            try:
                n = os.splice(self._src_fd, self._pipe_w, self._pipe_size, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                return False
            except OSError as exc:
                if exc.errno not in _NO_SPLICE_ERRNOS:
                    raise
                self._use_splice = False  # nothing was moved: read the same bytes by copying
            else:
                if n == 0:
                    self._eof = True
                self._in_pipe += n
                return True
        try:
            data = self._src.recv(COPY_CHUNK_BYTES if self._bulk else SPLICE_AFTER_BYTES)
        except BlockingIOError:
            return False
        if not data:
            self._eof = True
        self._read += len(data)
        self._buffer = memoryview(data)
        return True

    def _flush(self) -> bool:
        """Write everything pending to dst; False when dst would block first."""
        while self._buffer:
            try:
                n = self._dst.send(self._buffer)
            except BlockingIOError:
                return False
            self._buffer = self._buffer[n:]
            self.moved += n
        while self._in_pipe:
            try:
                n = os.splice(self._pipe_r, self._dst_fd, self._in_pipe, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                return False
            except OSError as exc:
                if exc.errno not in _NO_SPLICE_ERRNOS:
                    raise
                return self._pipe_to_buffer()
            if n == 0:
                raise OSError(errno.EIO, "splice from the relay pipe moved nothing")
            self._in_pipe -= n
            self.moved += n
        return True

    def _pipe_to_buffer(self) -> bool:
        """dst takes no splice: take the bytes back out of the pipe and copy from now on."""
        chunks = []
        while self._in_pipe:
            chunk = os.read(self._pipe_r, self._in_pipe)
            if not chunk:
                raise OSError(errno.EIO, "relay pipe ended early")
            chunks.append(chunk)
            self._in_pipe -= len(chunk)
        self._use_splice = False
        self._buffer = memoryview(b"".join(chunks))
        return self._flush()

    def _finish(self) -> None:
        """EOF and nothing pending: pass the EOF on, and this direction is done."""
        self._stop_watching()
        with contextlib.suppress(OSError):  # the peer may be gone already; nothing is lost
            self._dst.shutdown(socket.SHUT_WR)
        self.done.set_result(None)

    def _watch(self, *, write: bool) -> None:
        if write:
            if self._reading:
                self._loop.remove_reader(self._src_fd)
                self._reading = False
            if not self._writing:
                self._loop.add_writer(self._dst_fd, self._pump)
                self._writing = True
        else:
            if self._writing:
                self._loop.remove_writer(self._dst_fd)
                self._writing = False
            if not self._reading:
                self._loop.add_reader(self._src_fd, self._pump)
                self._reading = True

    def _stop_watching(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._src_fd)
            self._reading = False
        if self._writing:
            self._loop.remove_writer(self._dst_fd)
            self._writing = False


class _Waiter:
    """What `relay` waits for, on one future: both directions done, the first error, or the idle
    timeout (one timer, moved on while bytes move). Lighter than `asyncio.wait` on the two
    futures, which a short request would pay for twice."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        done: tuple[asyncio.Future[None], ...],
        activity: _Activity,
        idle_timeout_s: float,
    ) -> None:
        self._loop = loop
        self._done = done
        self._activity = activity
        self._idle_timeout_s = idle_timeout_s
        self.finished: asyncio.Future[None] = loop.create_future()
        self.outcome = RelayOutcome.CLOSED
        for future in done:
            future.add_done_callback(self._one_done)
        self._timer: asyncio.TimerHandle | None = loop.call_at(
            activity.last + idle_timeout_s, self._check_idle
        )

    def _one_done(self, future: asyncio.Future[None]) -> None:
        failed = not future.cancelled() and future.exception() is not None
        if not self.finished.done() and (failed or all(f.done() for f in self._done)):
            self.finished.set_result(None)

    def _check_idle(self) -> None:
        due = self._activity.last + self._idle_timeout_s
        if due > self._loop.time():
            self._timer = self._loop.call_at(due, self._check_idle)
        elif not self.finished.done():
            self._timer = None
            self.outcome = RelayOutcome.IDLE
            self.finished.set_result(None)

    def close(self) -> None:
        """Stop the timer and the callbacks (idempotent)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for future in self._done:
            future.remove_done_callback(self._one_done)


async def relay(
    client: socket.socket,
    upstream: socket.socket,
    *,
    to_upstream: bytes = b"",
    to_client: bytes = b"",
    idle_timeout_s: float,
    name: str = "relay",
    use_splice: bool | None = None,
) -> RelayResult:
    """Relay bytes both ways until both directions end, the relay is idle for ``idle_timeout_s``,
    or a socket fails. ``to_upstream`` and ``to_client`` are written first, in order with the
    relayed bytes. ``use_splice`` None means: splice where the platform has it.

    The sockets stay open (the caller closes them); after an error or the idle timeout both have
    been shut down, after an error with ``SO_LINGER`` 0 so that closing them sends a reset.

    Never raises for socket errors (they become `RelayOutcome.ERROR`); raises CancelledError when
    cancelled, after removing its callbacks and closing its pipes. ``name`` is the caller's label
    for the relay (the relay itself starts no task to name).
    """
    loop = asyncio.get_running_loop()
    splice = splice_available() if use_splice is None else use_splice
    activity = _Activity(loop)
    legs = _Legs(client, upstream)
    up = _Direction(
        loop,
        client,
        upstream,
        prefix=to_upstream,
        use_splice=splice,
        activity=activity,
        legs=legs,
    )
    down = _Direction(
        loop,
        upstream,
        client,
        prefix=to_client,
        use_splice=splice,
        activity=activity,
        legs=legs,
    )
    waiter = _Waiter(loop, (up.done, down.done), activity, idle_timeout_s)
    try:
        up.start()
        down.start()
        await waiter.finished
    finally:
        waiter.close()
        up.stop()
        down.stop()
        errors = [exc for exc in (up.failure(), down.failure()) if exc is not None]
    outcome = RelayOutcome.ERROR if errors else waiter.outcome
    error = "; ".join(str(exc) for exc in errors)
    if errors:
        for sock in (client, upstream):
            _reset(sock)
    if outcome is RelayOutcome.IDLE:
        for sock in (client, upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
    return RelayResult(
        outcome=outcome, to_upstream_bytes=up.moved, to_client_bytes=down.moved, error=error
    )


def tune_loopback_leg(sock: socket.socket) -> bool:
    """Give a TCP socket whose peer is a loopback address `LOOPBACK_CONGESTION_CONTROL` and
    `LOOPBACK_NOTSENT_LOWAT_BYTES`; whether it was a loopback leg. Other sockets (another host,
    Unix sockets) are left alone. A setting the kernel refuses is skipped: each one costs speed
    when missing, never correctness.

    Never raises."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return False
    try:
        peer = ipaddress.ip_address(sock.getpeername()[0])
    except (OSError, ValueError):
        return False
    mapped = peer.ipv4_mapped if isinstance(peer, ipaddress.IPv6Address) else None
    if not (mapped or peer).is_loopback:
        return False
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, LOOPBACK_CONGESTION_CONTROL)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, LOOPBACK_NOTSENT_LOWAT_BYTES)
    return True


def _reset(sock: socket.socket) -> None:
    """Make the coming close() send a reset, not a FIN that could pass for a complete stream."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
