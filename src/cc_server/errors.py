"""One root error type, and under it the failures a caller can act on.

Every error says whose fault it is and how to fix it. An error raised anywhere between the spec
and the launch means the command does not run (fail closed).
"""

from __future__ import annotations


class CcServerError(Exception):
    """Root of every error cc-server raises on purpose."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.message = message
        self.fix = fix
        super().__init__(message if fix is None else f"{message} (fix: {fix})")


class BadSpec(CcServerError):
    """The caller's spec or options are wrong: fix the input and retry."""


class Closed(CcServerError):
    """The sandbox was destroyed or failed: it takes no more commands. Launch a new one."""


class LimitReached(CcServerError):
    """Too many live things (dispatch runs, …) at once: close one, then retry."""


class ConfigError(CcServerError):
    """The operator's configuration (the server's flags, environment or files) is wrong: the
    operator fixes it and restarts; the same request from the caller fails until then."""


class BackendUnavailable(CcServerError):
    """The host cannot provide the requested isolation: install or enable what the fix names."""


class EnforcementFailed(CcServerError):
    """The isolation could not be applied or verified; the command was not run."""


class EgressDenied(CcServerError):
    """An outbound connection was refused by the session's allowlist."""
