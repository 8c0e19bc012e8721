"""Seatbelt denials read from macOS's unified log and attributed to one session. Sans-IO.

When a Seatbelt rule denies an operation the kernel's Sandbox policy logs one line:

    Sandbox: cat(4242) deny(1) file-read-data /Users/dev/.ssh/id_ed25519

and, when the rule carries `(with message "...")`, that text on the next line of the same log
message. Every deny cc-server generates carries `cc-<session tag>` (backends.seatbelt), so a
denial belongs to the session whose message is the LAST line of the log message: a path in the
first line may hold line breaks and any text an agent chose, but not the kernel's trailer. Repeated
denials are coalesced by the kernel as "N duplicate reports for Sandbox: ...".

`log_stream_argv` is what the runtime runs (by absolute path, like every tool we trust); the
`SeatbeltLogParser` turns its lines into `SeatbeltDenial`s, which the runtime reports as
`SandboxViolation` events with the same four fields (this module is below the runtime and does
not import it). Only two styles are understood:

- `ndjson` (what `log_stream_argv` asks for): one JSON object per log message; the message is one
  string, so a crafted file name cannot forge a second message. Only messages logged by the
  kernel (processID 0) or by /usr/libexec/sandboxd are believed: any process may log text that
  looks like a denial, but not under those senders.
- `compact` (the default of `log show --style compact`, for recorded logs): one header line per
  message, then continuation lines. A file name with a line break can look like a header there,
  so this style is for reading logs a person recorded, not for attributing live denials.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass
from typing import Final

__all__ = [
    "LOG_PATH",
    "MAX_LINE_CHARS",
    "MAX_MESSAGE_LINES",
    "SeatbeltDenial",
    "SeatbeltLogParser",
    "log_stream_argv",
    "watch_denials",
]

# Called by absolute path: a `log` earlier on PATH could feed us anything.
LOG_PATH: Final = "/usr/bin/log"
# A denial line is a verb and one path (PATH_MAX 1024 on macOS) plus the process name; anything
# much longer is not a kernel denial and is dropped rather than buffered.
MAX_LINE_CHARS: Final = 16 * 1024
# A compact-style message spans its header and a few continuation lines (a path with line breaks,
# then the rule's message); a longer run is not one denial.
MAX_MESSAGE_LINES: Final = 64
# Senders whose log messages are believed: the kernel (Sandbox.kext) and the sandbox daemon.
_TRUSTED_IMAGES: Final = frozenset({"/usr/libexec/sandboxd"})
_TAG = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_DENIAL = re.compile(
    r"^(?:\d+ duplicate reports? for )?Sandbox: (?P<process>.+?)\((?P<pid>\d+)\) "
    r"deny(?:\(\d+\))? (?P<action>[a-z][a-z0-9*-]*)(?: (?P<target>.*))?$",
    re.DOTALL,
)
# `log ... --style compact`: "2025-01-15 10:30:45.123 E  kernel[0:2f3] (Sandbox) message".
_COMPACT_HEADER = re.compile(
    r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d+\s+\S+\s+(?P<process>[^\s\[]+)"
    r"\[(?P<pid>\d+):[0-9a-fA-F]+\]\s+(?:\((?P<sender>[^)]*)\)\s+)?(?P<message>.*)$"
)
_HOST_PORT = re.compile(r"^\[?(?P<host>[^\s/\]]+?)\]?:(?P<port>\d+|\*)$")


@dataclass(frozen=True, slots=True, kw_only=True)
class SeatbeltDenial:
    """One denial of the session's profile, with the fields of a SandboxViolation."""

    action: str
    """The denied verb as the kernel names it, e.g. `file-read-data`, `network-outbound`."""
    target: str
    """The path, `host:port` or name the operation was denied on ("" when the log gives none)."""
    suggested_capability: str | None
    """The capability that would allow a denied connection, when one would."""
    raw: str
    """The log line(s) it came from."""
    process: str
    pid: int


def log_stream_argv(session_tag: str) -> tuple[str, ...]:
    """`log stream` for one session's denials: ndjson, kernel or sandboxd messages only, with the
    session's message in them (the parser checks all three again).

    Raises:
        ValueError: the tag is not lowercase letters, digits and '-'.
    """
    if not _TAG.match(session_tag):
        raise ValueError(f"session tag {session_tag!r} must be lowercase letters, digits or '-'")
    predicate = (
        '(processID == 0 OR processImagePath == "/usr/libexec/sandboxd") '
        f'AND eventMessage CONTAINS "cc-{session_tag}"'
    )
    return (LOG_PATH, "stream", "--style", "ndjson", "--predicate", predicate)


class SeatbeltLogParser:
    """Feed it `log` output line by line; it returns the session's denials as they complete."""

    def __init__(
        self, *, session_tag: str, suggest: Callable[[str], str | None] | None = None
    ) -> None:
        """`suggest(host)` names the capability that would allow a connection to `host`
        (cc_server.egress.resolver.suggested_capability bound to the session's spec).

        Raises:
            ValueError: the tag is not lowercase letters, digits and '-'.
        """
        if not _TAG.match(session_tag):
            raise ValueError(f"session tag {session_tag!r} is malformed")
        self._message = f"cc-{session_tag}"
        self._suggest = suggest
        self._pending: list[str] = []  # a compact-style message: its header, then continuations
        self._pending_trusted = False

    def feed(self, line: str | bytes) -> list[SeatbeltDenial]:
        """One line of output, with or without its line break. Never raises on bad input."""
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        line = line.rstrip("\r\n")
        if len(line) > MAX_LINE_CHARS:
            return []
        if line.startswith("{"):
            return [*self.flush(), *self._from_ndjson(line)]
        header = _COMPACT_HEADER.match(line)
        if header is not None:
            done = self.flush()
            self._pending = [line]
            self._pending_trusted = _trusted(header["process"], int(header["pid"]))
            return done
        if self._pending and line:
            if len(self._pending) >= MAX_MESSAGE_LINES:
                self._pending = []
                return []
            self._pending.append(line)
        elif not line:
            return self.flush()
        return []

    def flush(self) -> list[SeatbeltDenial]:
        """Complete the compact-style message in progress (at the end of the output)."""
        pending, self._pending = self._pending, []
        if not pending or not self._pending_trusted:
            return []
        header = _COMPACT_HEADER.match(pending[0])
        assert header is not None  # only a header starts a pending message
        message = "\n".join([header["message"], *pending[1:]])
        denial = self._denial(message, raw="\n".join(pending))
        return [denial] if denial is not None else []

    def _from_ndjson(self, line: str) -> list[SeatbeltDenial]:
        try:
            record = json.loads(line)
        except ValueError:
            return []
        if not isinstance(record, dict):
            return []
        message, pid, image = (record.get(k) for k in
                               ("eventMessage", "processID", "processImagePath"))
        if not isinstance(message, str):
            return []
        if not (pid == 0 or (isinstance(image, str) and image in _TRUSTED_IMAGES)):
            return []
        denial = self._denial(message, raw=line)
        return [denial] if denial is not None else []

    def _denial(self, message: str, *, raw: str) -> SeatbeltDenial | None:
        body, sep, trailer = message.rstrip("\n").rpartition("\n")
        if not sep or trailer.strip() != self._message:
            return None  # another session's, another sandbox's, or no message at all
        match = _DENIAL.match(body)
        if match is None:
            return None
        action, target = match["action"], match["target"] or ""
        return SeatbeltDenial(
            action=action,
            target=target,
            suggested_capability=self._capability(action, target),
            raw=raw,
            process=match["process"],
            pid=int(match["pid"]),
        )

    def _capability(self, action: str, target: str) -> str | None:
        if self._suggest is None or not action.startswith("network"):
            return None
        match = _HOST_PORT.match(target)
        if match is None or match["host"] == "*":
            return None
        try:
            return self._suggest(match["host"])
        except Exception:  # a suggestion is a hint; it never costs the denial itself
            return None


def _trusted(process: str, pid: int) -> bool:
    return (process == "kernel" and pid == 0) or process == "sandboxd"


async def watch_denials(
    lines: AsyncIterable[str | bytes],
    parser: SeatbeltLogParser,
    on_denial: Callable[[SeatbeltDenial], None],
) -> None:
    """Feed every line of `lines` (a `log stream` process's stdout) to `parser` and report each
    denial, until the stream ends. Raises whatever `lines` or `on_denial` raise."""
    async for line in lines:
        for denial in parser.feed(line):
            on_denial(denial)
    for denial in parser.flush():
        on_denial(denial)
