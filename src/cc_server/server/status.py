"""Errors as HTTP answers, in one place for every route of the server.

`STATUSES` is the one table from the runtime's error types (`cc_server.errors`, and the dispatch
refusals) to HTTP statuses; `Refused` is the one way a route answers with an ErrorBody, raised
anywhere under it; `answer_errors` is the one middleware that turns a `Refused` or a runtime
error into the response. The sandbox API (`api.py`), the dispatch API (`dispatch_api.py`), the
terminal WebSocket (its close code is 4000 + the status) and the OpenAPI document all take their
statuses from here.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from aiohttp import web

from cc_server import errors
from cc_server.dispatch.actions import ActionRefused
from cc_server.dispatch.env import EnvRefused
from cc_server.errors import CcServerError
from cc_server.server.logs import log_event

__all__ = [
    "BACKEND_UNAVAILABLE_STATUS",
    "CLOSED_STATUS",
    "CONFIG_STATUS",
    "LIMIT_STATUS",
    "REFUSED_STATUS",
    "STATUSES",
    "Refused",
    "answer_errors",
    "error_body",
    "refusal",
    "status_for",
]

# A backend the host cannot provide is a conflict with the host's state, not a malformed request:
# the same body succeeds on a host that has the backend. 409, so clients can tell it from a 400.
BACKEND_UNAVAILABLE_STATUS: Final = 409
REFUSED_STATUS: Final = 403  # a guardrail refused the action: the same request stays refused
# The sandbox was destroyed or failed: the request conflicts with its state (launch a new one).
CLOSED_STATUS: Final = 409
LIMIT_STATUS: Final = 429  # too many live runs: the same request succeeds once one is closed
# The server's configuration keeps this request from being served until the operator fixes it:
# never a 500 (nothing broke) and never a 400 (the caller cannot fix it).
CONFIG_STATUS: Final = 409
INTERNAL_STATUS: Final = 500  # enforcement failed, or an error no row below names

# Most specific first: the first row whose type the error is an instance of gives its status.
STATUSES: Final[tuple[tuple[type[CcServerError], int], ...]] = (
    (ActionRefused, REFUSED_STATUS),
    (errors.EgressDenied, REFUSED_STATUS),
    (errors.BadSpec, 400),
    (errors.Closed, CLOSED_STATUS),
    (errors.LimitReached, LIMIT_STATUS),
    (errors.ConfigError, CONFIG_STATUS),
    (errors.BackendUnavailable, BACKEND_UNAVAILABLE_STATUS),
    (errors.EnforcementFailed, INTERNAL_STATUS),
)


def status_for(exc: CcServerError) -> int:
    """The HTTP status for a runtime error (`STATUSES`); an environment refusal the server's
    own configuration produced (`EnvRefused.operator`) is the operator's, like a ConfigError."""
    if isinstance(exc, EnvRefused) and exc.operator:
        return CONFIG_STATUS
    return next((status for kind, status in STATUSES if isinstance(exc, kind)), INTERNAL_STATUS)


def error_body(error: str, message: str, fix: str | None = None) -> dict[str, Any]:
    """The ErrorBody of an answer: the error's name, what happened, and what fixes it."""
    return {"error": error, "message": message, "fix": fix}


class Refused(Exception):
    """A request answered with an ErrorBody (and `fields` beside it); raised anywhere under a
    route, answered by `answer_errors` (a WebSocket route sends `body` and closes with
    4000 + `status` itself)."""

    def __init__(
        self, status: int, error: str, message: str, fix: str | None = None, **fields: Any
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {**error_body(error, message, fix), **fields}

    def response(self) -> web.Response:
        """The answer as an HTTP response."""
        return web.json_response(self.body, status=self.status)


def _fields(exc: CcServerError) -> dict[str, Any]:
    if isinstance(exc, ActionRefused):
        return {"guardrail": exc.guardrail}
    if isinstance(exc, EnvRefused):
        return {"variable": exc.variable, "hostVariable": exc.host_variable}
    return {}


def refusal(exc: CcServerError, **fields: Any) -> Refused:
    """The answer to a runtime error: its status (`status_for`), its type's name, message and
    fix, what its type adds (a guardrail's name, an environment refusal's variables) and
    `fields`."""
    return Refused(
        status_for(exc), type(exc).__name__, exc.message, exc.fix, **_fields(exc), **fields
    )


@web.middleware
async def answer_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Answer a `Refused` with its body, and a runtime error a route let through with its
    `refusal` (logged as `request.refused`, with the path and the error's type)."""
    try:
        response: web.StreamResponse = await handler(request)
    except Refused as refused:
        return refused.response()
    except CcServerError as exc:
        log_event("request.refused", exc.message, level=logging.WARNING,
                  path=request.path, error=type(exc).__name__)
        return refusal(exc).response()
    return response
