"""Errors as HTTP answers, in one place for every route of the server.

`status_for` is the one table from the runtime's error types (`cc_server.errors`) to HTTP
statuses, and `error_response` the one ErrorBody shape; the sandbox API (`api.py`), the dispatch
API (`dispatch_api.py`), the terminal WebSocket and the OpenAPI document all take them from here.
"""

from __future__ import annotations

from typing import Any, Final

from aiohttp import web

from cc_server.errors import BackendUnavailable, BadSpec, CcServerError, EnforcementFailed

__all__ = ["BACKEND_UNAVAILABLE_STATUS", "error_body", "error_response", "status_for"]

# A backend the host cannot provide is a conflict with the host's state, not a malformed request:
# the same body succeeds on a host that has the backend. 409, so clients can tell it from a 400.
BACKEND_UNAVAILABLE_STATUS: Final = 409


def status_for(exc: CcServerError) -> int:
    """The HTTP status for a runtime error."""
    if isinstance(exc, BadSpec):
        return 400
    if isinstance(exc, BackendUnavailable):
        return BACKEND_UNAVAILABLE_STATUS
    if isinstance(exc, EnforcementFailed):
        return 500
    return 500


def error_body(error: str, message: str, fix: str | None = None) -> dict[str, Any]:
    """The ErrorBody of an answer: the error's name, what happened, and what fixes it."""
    return {"error": error, "message": message, "fix": fix}


def error_response(status: int, error: str, message: str, fix: str | None = None) -> web.Response:
    """An ErrorBody response."""
    return web.json_response(error_body(error, message, fix), status=status)
