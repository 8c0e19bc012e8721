"""Bounded output: the head of a stream is kept, the rest is counted and dropped as it arrives.

One mechanism for every caller that collects a command's output instead of streaming it: the
collected `POST .../exec` result (`Execution.collect`), the harness bash tool and ACP terminals
(`dispatch.harness`). Bytes past the limit are never buffered: each event's chunk is cut at the
limit and the rest only counted, so memory is the head plus the execution's bounded event queue,
whatever the command writes.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from dataclasses import dataclass, field
from typing import Final

from cc_server.runtime.events import EventType, SandboxEvent, SandboxViolation

__all__ = ["DEFAULT_COLLECT_LIMIT_BYTES", "BoundedOutput", "Drained", "drain"]

# Per stream, for a collected result: large enough for any build or test log an agent reads
# whole, small enough that a command writing without end keeps the server small (1 GiB of
# stdout through POST .../exec: 94 MiB peak RSS, bench/RESULTS.md).
DEFAULT_COLLECT_LIMIT_BYTES: Final = 16 * 1024 * 1024


@dataclass(slots=True)
class BoundedOutput:
    """The first `limit` bytes of a stream, and how many more were dropped."""

    limit: int
    data: bytearray = field(default_factory=bytearray)
    dropped: int = 0

    def add(self, chunk: bytes) -> None:
        """Keep what fits under the limit; count the rest."""
        room = self.limit - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    @property
    def truncated(self) -> bool:
        """Whether any byte was dropped."""
        return self.dropped > 0

    def head(self) -> bytes:
        """The kept bytes."""
        return bytes(self.data)

    def text(self) -> str:
        """The kept bytes as UTF-8, undecodable bytes replaced."""
        return self.data.decode("utf-8", errors="replace")


@dataclass(frozen=True, slots=True, kw_only=True)
class Drained:
    """How an execution ended, once its events are drained."""

    exit_code: int  # 128+N for signal N; -1 if no exit event came
    killed: str | None  # why the host killed it, if it did


async def drain(
    events: AsyncIterable[SandboxEvent],
    out: BoundedOutput,
    err: BoundedOutput | None,
    violations: list[SandboxViolation],
) -> Drained:
    """Read every event until `exit`: stdout into `out`, stderr into `err` (into `out` too when
    `err` is None: one interleaved stream), violations appended as they come. Raises nothing of
    its own."""
    code, killed = -1, None
    async for event in events:
        if event.type is EventType.STDOUT and event.data:
            out.add(event.data)
        elif event.type is EventType.STDERR and event.data:
            (out if err is None else err).add(event.data)
        elif event.type is EventType.VIOLATION and event.violation is not None:
            violations.append(event.violation)
        elif event.type is EventType.KILLED:
            killed = event.reason
        elif event.type is EventType.EXIT and event.exit_code is not None:
            code = event.exit_code
    return Drained(exit_code=code, killed=killed)
