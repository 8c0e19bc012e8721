"""cc-server: a sandbox runtime and server for AI-agent work."""

from cc_server.errors import (
    BackendUnavailable,
    BadSpec,
    CcServerError,
    Closed,
    ConfigError,
    EgressDenied,
    EnforcementFailed,
    LimitReached,
)

__all__ = [
    "BackendUnavailable",
    "BadSpec",
    "CcServerError",
    "Closed",
    "ConfigError",
    "EgressDenied",
    "EnforcementFailed",
    "LimitReached",
]
__version__ = "0.1.0"
