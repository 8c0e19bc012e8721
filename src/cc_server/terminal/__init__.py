"""The server-hosted terminal: PTY sessions and the fixed terminal profile."""

from cc_server.terminal.profile import TERMINAL_DENY_READ, terminal_policy
from cc_server.terminal.service import DEFAULT_WINDOW, TerminalSessionService
from cc_server.terminal.session import MAX_WINDOW, TerminalSession

__all__ = [
    "DEFAULT_WINDOW",
    "MAX_WINDOW",
    "TERMINAL_DENY_READ",
    "TerminalSession",
    "TerminalSessionService",
    "terminal_policy",
]
