"""The framed protocol between the server and the guest agent (agent/agent.c), sans-IO.

Frame: u32 payload length, u32 channel, u8 type, payload; little endian. The numbers below are
the agent's; both sides must agree, and `tests/unit/microvm` checks the encodings.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Final

__all__ = [
    "HEADER",
    "MAX_PAYLOAD",
    "NET_CHANNEL_BIT",
    "ExecFlags",
    "Frame",
    "FrameDecoder",
    "FrameType",
    "MountOp",
    "ProtocolError",
    "encode",
    "exec_payload",
    "hello_payload",
    "mount_payload",
]

HEADER: Final = struct.Struct("<IIB")
MAX_PAYLOAD: Final = 64 * 1024  # the agent's limit for one frame's payload
NET_CHANNEL_BIT: Final = 0x8000_0000  # channels the agent opens (outbound connections)


class FrameType(enum.IntEnum):
    HELLO = 1  # host: set the clock, add entropy; agent answers HELLO_OK (also sent at start)
    HELLO_OK = 2
    EXEC = 3  # host: run a command on a new channel
    STARTED = 4  # agent: the command's pid
    STDOUT = 5
    STDERR = 6
    EXIT = 7  # agent: u32 exit code (128+N for signal N), u32 signal
    DATA = 8  # both: stdin of a command, bytes of a connection
    EOF = 9  # both: no more DATA in this direction
    SIGNAL = 10  # host: signal the command's process group
    WINSIZE = 11  # host: a PTY command's window size
    MOUNT = 12  # host: mount a 9p slot, or carve a read-only / hidden path
    RESULT = 13  # agent: i32 errno, message
    NET_OPEN = 14  # agent: a guest program connected to a proxy port (u8 0 http, 1 socks)
    ABORT = 15  # both: drop a connection
    PING = 16
    PONG = 17
    UNMOUNT = 18  # host: detach a mount (before a suspend)
    FREEZE = 19  # host: stop every command in the kernel (while a suspend has mounts off)
    THAW = 20  # host: let them run again


class ExecFlags(enum.IntFlag):
    NONE = 0
    PTY = 1
    STDIN = 2


class MountOp(enum.IntEnum):
    NINEP = 0
    RO_BIND = 1
    HIDE = 2


class ProtocolError(Exception):
    """The peer broke the framing; the connection is unusable. `frames`: those it completed
    before the broken one, in order."""

    def __init__(self, message: str, frames: list[Frame] | None = None) -> None:
        super().__init__(message)
        self.frames = frames or []


@dataclass(frozen=True, slots=True)
class Frame:
    channel: int
    type: FrameType
    payload: bytes = b""


def encode(channel: int, kind: FrameType, payload: bytes = b"") -> bytes:
    """One frame's bytes."""
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"frame payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(len(payload), channel, kind) + payload


class FrameDecoder:
    """Feed bytes, take complete frames."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._error: str | None = None

    def feed(self, data: bytes) -> list[Frame]:
        """Frames completed by `data`.

        Raises:
            ProtocolError: an oversized frame or an unknown type (carrying the frames completed
                before it); every later call raises it again.
        """
        if self._error is not None:
            raise ProtocolError(self._error)
        self._buf += data
        frames: list[Frame] = []
        while len(self._buf) >= HEADER.size:
            size, channel, kind = HEADER.unpack_from(self._buf)
            if size > MAX_PAYLOAD:
                self._error = f"frame of {size} bytes from the agent"
                raise ProtocolError(self._error, frames)
            if len(self._buf) < HEADER.size + size:
                break
            try:
                frame_type = FrameType(kind)
            except ValueError as exc:
                self._error = f"unknown frame type {kind} from the agent"
                raise ProtocolError(self._error, frames) from exc
            payload = bytes(self._buf[HEADER.size : HEADER.size + size])
            del self._buf[: HEADER.size + size]
            frames.append(Frame(channel, frame_type, payload))
        return frames


def _cstr(value: str) -> bytes:
    data = value.encode()
    if b"\0" in data:
        raise ValueError(f"NUL byte in {value!r}")
    return data + b"\0"


def exec_payload(
    argv: tuple[str, ...],
    env: tuple[tuple[str, str], ...],
    cwd: str | None,
    flags: ExecFlags,
    rows: int = 24,
    cols: int = 80,
) -> bytes:
    """An EXEC frame's payload."""
    strings = b"".join(_cstr(a) for a in argv)
    strings += b"".join(_cstr(f"{k}={v}") for k, v in env)
    strings += _cstr(cwd or "")
    return struct.pack("<IHHHH", int(flags), rows, cols, len(argv), len(env)) + strings


def hello_payload(realtime_ns: int, entropy: bytes) -> bytes:
    """A HELLO frame's payload: the wall clock and fresh entropy for the guest's RNG."""
    sec, nsec = divmod(realtime_ns, 1_000_000_000)
    return struct.pack("<QI", sec, nsec) + entropy


def mount_payload(op: MountOp, path: str, *, tag: str = "", read_only: bool = False) -> bytes:
    """A MOUNT frame's payload."""
    return bytes([int(op), int(read_only)]) + _cstr(tag) + _cstr(path)
