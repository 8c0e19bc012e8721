"""What an agent asks to do, and the refusal of it: the vocabulary every guardrail speaks.

`Action` and `ActionRefused` live here, below both `guardrails` (the chain) and `modes` (the
command table), so that each can import them without importing the other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cc_server.errors import CcServerError
from cc_server.policy import Mode

__all__ = [
    "COMMAND_KINDS",
    "FILE_KINDS",
    "KIND_TOOL",
    "READ_KINDS",
    "WRITE_KINDS",
    "Action",
    "ActionKind",
    "ActionRefused",
]


class ActionKind(enum.StrEnum):
    """What an action does, whichever seam it came through."""

    BASH = "bash"  # a shell command (harness bash tool, Claude Code's run)
    FILE_READ = "file_read"  # in-process read tool
    FILE_WRITE = "file_write"  # in-process write tool
    FILE_EDIT = "file_edit"  # in-process edit tool
    APPLY_PATCH = "apply_patch"  # in-process apply-patch tool, one action per file it touches
    SEARCH = "search"  # in-process content search
    FIND = "find"  # in-process name glob
    SEARCH_FILES = "search_files"  # in-process files-containing search
    ACP_READ = "acp_read"  # ACP fs/read_text_file, served by the in-process tools
    ACP_WRITE = "acp_write"  # ACP fs/write_text_file, served by the in-process tools
    ACP_TERMINAL = "acp_terminal"  # ACP terminal/create, run like bash


# The tool of the mode's surface each kind needs. ACP requests need the same tool the harness
# would use, so review and plan refuse an ACP write exactly as they refuse the write tool.
KIND_TOOL: dict[ActionKind, str] = {
    ActionKind.BASH: "bash",
    ActionKind.FILE_READ: "read",
    ActionKind.FILE_WRITE: "write",
    ActionKind.FILE_EDIT: "edit",
    ActionKind.APPLY_PATCH: "apply_patch",
    ActionKind.SEARCH: "search",
    ActionKind.FIND: "find",
    ActionKind.SEARCH_FILES: "search_files",
    ActionKind.ACP_READ: "read",
    ActionKind.ACP_WRITE: "write",
    ActionKind.ACP_TERMINAL: "bash",
}

READ_KINDS = frozenset(
    {
        ActionKind.FILE_READ,
        ActionKind.SEARCH,
        ActionKind.FIND,
        ActionKind.SEARCH_FILES,
        ActionKind.ACP_READ,
    }
)
WRITE_KINDS = frozenset(
    {ActionKind.FILE_WRITE, ActionKind.FILE_EDIT, ActionKind.APPLY_PATCH, ActionKind.ACP_WRITE}
)
FILE_KINDS = READ_KINDS | WRITE_KINDS
COMMAND_KINDS = frozenset({ActionKind.BASH, ActionKind.ACP_TERMINAL})


@dataclass(frozen=True, slots=True)
class Action:
    """One thing an agent asks to do.

    `path` is the guest path as the agent gave it (file actions); `argv` the command (bash).
    """

    kind: ActionKind
    tool: str
    session_id: str
    mode: Mode
    path: str | None = None
    argv: tuple[str, ...] | None = None

    def describe(self) -> str:
        """A short, log-safe description: the tool and its target."""
        if self.argv is not None:
            shown = " ".join(self.argv)
            if len(shown) > 200:
                shown = shown[:200] + "..."
            return f"{self.tool} {shown!r}"
        if self.path is not None:
            return f"{self.tool} {self.path!r}"
        return self.tool


class ActionRefused(CcServerError):
    """A guardrail refused an action: nothing was done. Says which guardrail, what and why."""

    def __init__(
        self, action: Action, guardrail: str, reason: str, *, fix: str | None = None
    ) -> None:
        self.action = action
        self.guardrail = guardrail
        self.reason = reason
        super().__init__(
            f"{guardrail} refused {action.describe()} in {action.mode} mode: {reason}", fix=fix
        )
