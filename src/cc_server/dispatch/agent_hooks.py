"""Claude Code hooks of a dispatch run: the model hears of refusals, and a write outside the
sandbox's writable binds is refused and reported instead of vanishing.

Both run inside the run's sandbox, as Claude Code's own hooks (seam 1 passes them with
`--settings`; the ACP adapter's Claude Code reads the notice hooks from the run's user
settings):

- **notices** (`PostToolUse`, `PostToolUseFailure`): after each tool call, the run's notice file
  (`violations.NoticeFile`, which the server fills as refusals are reported) is moved away and its
  "blocked by sandbox policy" lines printed as the hook's `additionalContext`, which Claude Code
  hands to the model after the tool's result;
- **write scope** (`PreToolUse` of `Write`, `Edit`, `MultiEdit`, `NotebookEdit`; seam 1): a file
  tool whose path resolves outside every writable bind is denied with the notice as its reason.
  Without it such a write "succeeds" into the sandbox's private tmpfs and is gone when the command
  ends, while the agent believes it. The hook also appends the refusal to the run's refusal file,
  which the server takes after the call (`take_refusals`) as `hook` violations: kept, audited,
  returned. Reported from inside the sandbox, so an agent can suppress its own; it cannot reach
  anything by doing so (the write would vanish). It needs the host's `/usr/bin/python3`; without
  it the hook fails, Claude Code goes on, and the write vanishes as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import stat
from collections.abc import Sequence
from typing import Any, Final

from cc_server.dispatch.violations import NOTICE_FILE, NOTICE_PREFIX, RunViolation, ViolationSource

__all__ = [
    "FILE_TOOLS",
    "NOTICE_EVENTS",
    "REFUSALS_FILE",
    "hook_settings",
    "take_refusals",
]

NOTICE_EVENTS: Final = ("PostToolUse", "PostToolUseFailure")  # after a tool call, failed or not
FILE_TOOLS: Final = ("Write", "Edit", "MultiEdit", "NotebookEdit")  # Claude Code's file writers
REFUSALS_FILE: Final = "cc-server-refusals"  # in the run's state directory
MAX_REFUSALS_BYTES: Final = 256 * 1024  # what the server reads of it after one call
MAX_REFUSALS: Final = 100  # refusals taken from one call
PYTHON: Final = "/usr/bin/python3"  # the host's, under /usr: in every sandbox that has it

# The write-scope hook: argv is the writable roots, then the refusal file. Isolated (-I): it
# imports nothing from the agent's directories.
_WRITE_SCOPE = """
import json, os, sys
*roots, log = sys.argv[1:]
data = json.load(sys.stdin)
args = data.get("tool_input") or {}
path = args.get("file_path") or args.get("notebook_path")
if not isinstance(path, str) or not path:
    sys.exit(0)
full = os.path.normpath(os.path.join(data.get("cwd") or os.getcwd(), path))
real = os.path.realpath(full)
if any(real == r or real.startswith(r.rstrip("/") + "/")
       for r in {os.path.realpath(root) for root in roots}):
    sys.exit(0)
why = "outside the sandbox's writable binds (" + ", ".join(roots) + "): it would vanish"
with open(log, "a") as f:
    f.write(json.dumps({"action": "file-write", "target": full, "reason": why,
                        "tool": data.get("tool_name")}) + "\\n")
print(json.dumps({"hookSpecificOutput": {
    "hookEventName": "PreToolUse", "permissionDecision": "deny",
    "permissionDecisionReason": "%s: file-write " % PREFIX + full + " (" + why + ")"}}))
"""


def _notice_command(state_dir: str, event: str) -> str:
    notices = shlex.quote(os.path.join(state_dir, NOTICE_FILE))
    return (
        f"f={notices}; [ -s \"$f\" ] || exit 0; t=\"$f.$$\"; "
        'mv -f "$f" "$t" 2>/dev/null || exit 0; '
        f"printf '{{\"hookSpecificOutput\":{{\"hookEventName\":\"{event}\","
        "\"additionalContext\":\"'; tr -d '\\n' < \"$t\"; printf '\"}}'; rm -f \"$t\""
    )


def hook_settings(state_dir: str, write_roots: Sequence[str] | None = None) -> dict[str, Any]:
    """Claude Code settings with the notice hooks, and with `write_roots` (the guest paths of
    the writable binds) the write-scope hook too."""
    hooks: dict[str, Any] = {
        event: [{"matcher": "*",
                 "hooks": [{"type": "command", "command": _notice_command(state_dir, event)}]}]
        for event in NOTICE_EVENTS
    }
    if write_roots is not None:
        script = _WRITE_SCOPE.replace("PREFIX", repr(NOTICE_PREFIX))
        words = [PYTHON, "-I", "-c", script, *write_roots,
                 os.path.join(state_dir, REFUSALS_FILE)]
        hooks["PreToolUse"] = [{"matcher": "|".join(FILE_TOOLS), "hooks": [
            {"type": "command", "command": shlex.join(words)}]}]
    return {"hooks": hooks}


def take_refusals(state_dir: str) -> list[RunViolation]:
    """The refusals the write-scope hook wrote since the last call, removing the file. The file
    is the agent's to write: it is opened without following a link, non-blocking, read only as
    a regular file and up to MAX_REFUSALS_BYTES; a line that is not a refusal is skipped."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        dir_fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        try:
            fd = os.open(REFUSALS_FILE, flags, dir_fd=dir_fd)
        except OSError:
            return []
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return []
            data = os.read(fd, MAX_REFUSALS_BYTES)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(REFUSALS_FILE, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    out: list[RunViolation] = []
    for line in data.decode("utf-8", errors="replace").splitlines()[:MAX_REFUSALS]:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        target, reason = entry.get("target"), entry.get("reason")
        if isinstance(target, str) and isinstance(reason, str):
            tool = entry.get("tool")
            out.append(RunViolation(
                action="file-write", target=target, reason=reason, source=ViolationSource.HOOK,
                guardrail=f"claude-code-hook ({tool})" if isinstance(tool, str) else None))
    return out

