"""A dispatch run's violations: kept on the run, logged once, told to the agent's model.

Three things refuse an agent's action, and each refusal becomes one `RunViolation`:

- the sandbox (`sandbox`): the create-rule supervisor (a refused create or rename) and the
  session's proxies (a refused connection) report a `SandboxViolation` on the run's handle; the
  run's `ViolationLog` listens to the handle, so each is taken once, as it happens;
- a guardrail (`guardrail`): an `ActionRefused` of the chain or of the in-process file tools
  (`/tools/*`, an ACP file or terminal request, a `/bash` or `/claude` command);
- an ACP permission request the run's policy rejected (`permission`).

Each is kept on the run (the newest `MAX_KEPT`, with the total count), written to the server's
log as one audit line (`dispatch.violation`: run, session, action, target, reason), and has a
short plain `notice` ("blocked by sandbox policy: <action> <target> (<why>)") that the seams add
to the tool output the agent hands its model, so that it stops retrying what stays refused.

The read-only binds refuse silently (the kernel answers EROFS or EACCES and reports nothing):
those refusals are not here, which `docs/dispatch.md` says.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import re
import stat
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

from cc_server.dispatch.actions import (
    COMMAND_KINDS,
    READ_KINDS,
    WRITE_KINDS,
    ActionKind,
    ActionRefused,
)
from cc_server.runtime.events import SandboxViolation

__all__ = [
    "MAX_KEPT",
    "MAX_NOTICE_LINES",
    "NOTICE_FILE",
    "NOTICE_PREFIX",
    "NoticeFile",
    "RunViolation",
    "ViolationLog",
    "ViolationSource",
    "from_refusal",
    "from_sandbox",
    "notice_text",
]

audit = logging.getLogger("cc_server.dispatch.audit")
NOTICE_PREFIX: Final = "blocked by sandbox policy"
MAX_KEPT: Final = 1000  # violations kept per run (the newest); the count goes on
MAX_NOTICE_LINES: Final = 8  # notice lines added to one tool output; the rest are counted
MAX_TARGET_CHARS: Final = 200  # a target in a notice or a log line (a long command is cut)
MAX_REASON_CHARS: Final = 300  # a reason in a notice or a log line
NOTICE_FILE: Final = "cc-server-notices"  # in a run's state directory (see NoticeFile)
MAX_NOTICE_FILE_BYTES: Final = 64 * 1024  # notices waiting for the hook; past it they are dropped

_MATCHES = re.compile(r"matches ('.*?')\)\s*$")
_EGRESS_REASON = re.compile(r" reason=(.*?) to_allow=(.*)$")


class ViolationSource(enum.StrEnum):
    """What refused."""

    SANDBOX = "sandbox"  # the create-rule supervisor or the session's proxies
    HOOK = "hook"  # the agent runner's hook inside the sandbox (`dispatch.agent_hooks`)
    GUARDRAIL = "guardrail"  # the guardrail chain or the in-process file tools
    PERMISSION = "permission"  # an ACP permission request the policy rejected


def _cut(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True, kw_only=True)
class RunViolation:
    """One refused action of a run."""

    action: str  # the denied verb: file-write-create, network-outbound, file-write, command ...
    target: str  # the path, host:port or command
    reason: str  # why, in a few words
    source: ViolationSource
    guardrail: str | None = None  # the guardrail that refused (source guardrail)
    suggested_capability: str | None = None
    raw: str | None = None  # the enforcer's own line

    @property
    def notice(self) -> str:
        """The line for the agent's model."""
        target = _cut(self.target, MAX_TARGET_CHARS)
        return f"{NOTICE_PREFIX}: {self.action} {target} ({_cut(self.reason, MAX_REASON_CHARS)})"

    def to_json(self) -> dict[str, Any]:
        """The API form: the spec's SandboxViolation fields, plus reason, source, guardrail."""
        return {
            "action": self.action,
            "target": self.target,
            "reason": self.reason,
            "source": str(self.source),
            "guardrail": self.guardrail,
            "suggestedCapability": self.suggested_capability,
            "raw": self.raw,
        }


def from_sandbox(violation: SandboxViolation) -> RunViolation:
    """A sandbox's report as a run violation; the reason is read from its raw line."""
    raw = violation.raw or ""
    reason = "refused by the sandbox"
    egress = _EGRESS_REASON.search(raw)
    matches = _MATCHES.search(raw)
    if egress is not None:
        reason = f"{egress.group(1)}; to allow: {egress.group(2)}"
    elif matches is not None:
        reason = f"matches {matches.group(1)}"
    elif raw:
        reason = raw
    return RunViolation(
        action=violation.action,
        target=violation.target,
        reason=reason,
        source=ViolationSource.SANDBOX,
        suggested_capability=violation.suggested_capability,
        raw=violation.raw,
    )


def _refused_verb(kind: ActionKind) -> str:
    if kind in WRITE_KINDS:
        return "file-write"
    if kind in READ_KINDS:
        return "file-read"
    if kind in COMMAND_KINDS:
        return "command"
    return str(kind)  # pragma: no cover - every kind is one of the three


def from_refusal(exc: ActionRefused) -> RunViolation:
    """A guardrail's refusal as a run violation."""
    action = exc.action
    if action.argv is not None:
        target = " ".join(action.argv)
    else:
        target = action.path if action.path is not None else action.tool
    return RunViolation(
        action=_refused_verb(action.kind),
        target=target,
        reason=f"{exc.guardrail}: {exc.reason}",
        source=ViolationSource.GUARDRAIL,
        guardrail=exc.guardrail,
        raw=exc.message,
    )


def notice_text(violations: Iterable[RunViolation]) -> str:
    """The notice lines for a tool output (one per distinct violation, at most
    MAX_NOTICE_LINES and a count of the rest), newline-terminated; empty for none."""
    lines = list(dict.fromkeys(v.notice for v in violations))
    if not lines:
        return ""
    shown = lines[:MAX_NOTICE_LINES]
    if len(lines) > len(shown):
        shown.append(f"{NOTICE_PREFIX}: {len(lines) - len(shown)} more refusals")
    return "".join(line + "\n" for line in shown)


class ViolationLog:
    """The violations of one run: kept (bounded), counted, and audited once each.

    `listeners` are called with each violation after it is logged (the Claude Code hook's
    notice file); one that raises is logged and the rest still run.
    """

    def __init__(self, run_id: str, session_id: str, *, conversation_id: str | None = None) -> None:
        self.run_id = run_id
        self.session_id = session_id
        self.conversation_id = conversation_id
        self.kept: deque[RunViolation] = deque(maxlen=MAX_KEPT)
        self.total = 0
        self.listeners: list[Callable[[RunViolation], None]] = []

    def record(self, violation: RunViolation, *, notify: bool = True) -> RunViolation:
        """Keep, count and audit one violation; returns it. `notify`: tell the listeners (not
        when the agent's model was told already)."""
        self.kept.append(violation)
        self.total += 1
        fields: dict[str, Any] = {
            "runId": self.run_id,
            "sessionId": self.session_id,
            "conversationId": self.conversation_id,
            "action": violation.action,
            "target": _cut(violation.target, MAX_TARGET_CHARS),
            "reason": _cut(violation.reason, MAX_REASON_CHARS),
            "source": str(violation.source),
        }
        audit.warning(
            "run %s: %s", self.run_id, violation.notice,
            extra={"event": "dispatch.violation", "fields": fields},
        )
        for listener in list(self.listeners) if notify else []:
            try:
                listener(violation)
            except Exception:
                audit.exception("a violation listener failed")
        return violation

    def sandbox(self, violation: SandboxViolation) -> None:
        """The run's handle's listener."""
        self.record(from_sandbox(violation))

    def refused(self, exc: ActionRefused) -> RunViolation:
        """Record a guardrail's refusal."""
        return self.record(from_refusal(exc))

    def mark(self) -> int:
        """A cursor: `since(mark)` is what was recorded after it (of what is still kept)."""
        return self.total

    def since(self, mark: int) -> list[RunViolation]:
        """The violations recorded after `mark`, oldest first."""
        newer = self.total - mark
        if newer <= 0:
            return []
        return list(self.kept)[-min(newer, len(self.kept)):]

    def to_json(self) -> list[dict[str, Any]]:
        """The kept violations, oldest first."""
        return [v.to_json() for v in self.kept]


class NoticeFile:
    """The notices of a Claude Code run waiting for its hook (`dispatch.claude`): the server
    appends each violation's notice line to NOTICE_FILE in the run's state directory; the hook,
    inside the sandbox, after each tool call, moves the file away and hands its lines to the
    model.

    The state directory is writable from inside the sandbox, so the server never follows what
    the agent may have put there: the file is opened relative to the directory's descriptor
    taken at launch, without following a link, non-blocking (a FIFO), and written only when it
    is a regular file with one link and under MAX_NOTICE_FILE_BYTES. Anything else is left
    alone and the notice is not written (the agent only loses its own notices).
    """

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, NOTICE_FILE)
        self._dir_fd: int | None = os.open(
            state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
        )

    def append(self, violation: RunViolation) -> None:
        """Add one notice line (a ViolationLog listener)."""
        if self._dir_fd is None:
            return
        flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                 | os.O_NOCTTY | os.O_CLOEXEC)
        try:
            fd = os.open(NOTICE_FILE, flags, 0o600, dir_fd=self._dir_fd)
        except OSError:
            return  # a symlink or something else the agent put there: not written
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                return
            if st.st_size > MAX_NOTICE_FILE_BYTES:
                return
            # JSON-escaped, so the hook can print the file inside a JSON string as it is.
            os.write(fd, (json.dumps(violation.notice)[1:-1] + "\\n\n").encode())
        except OSError:
            return
        finally:
            os.close(fd)

    def clear(self) -> None:
        """Drop the notices no hook has taken (what was refused before this call of the agent:
        its model hears of what happens while it runs)."""
        if self._dir_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(NOTICE_FILE, dir_fd=self._dir_fd)

    def close(self) -> None:
        """Stop writing. Idempotent."""
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

