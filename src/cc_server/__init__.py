"""cc-server: a sandbox runtime and server for AI-agent work."""

from cc_server.errors import (
    BackendUnavailable,
    BadSpec,
    CcServerError,
    EgressDenied,
    EnforcementFailed,
)

__all__ = [
    "BackendUnavailable",
    "BadSpec",
    "CcServerError",
    "EgressDenied",
    "EnforcementFailed",
]
__version__ = "0.1.0"
