"""A running sandbox's egress through the API: the view, a change and an answer, shared by the
sandbox routes (`/v1/sandboxes/{id}/egress`) and the dispatch routes
(`/v1/dispatches/{id}/egress`). Each raises a `CcServerError` the routes map to a status."""

from __future__ import annotations

from typing import Any

from cc_server.egress.changes import EgressChange
from cc_server.errors import BackendUnavailable
from cc_server.runtime.egress_port import EgressPort
from cc_server.runtime.handle import SandboxHandle
from cc_server.server.logs import log_event
from cc_server.server.models import EgressChangeRequest

__all__ = ["answer_request", "change_egress", "egress_of", "egress_view"]


def egress_of(handle: SandboxHandle) -> EgressPort:
    """The handle's egress proxies.

    Raises:
        BackendUnavailable: the handle has none (backend `none`: its network is the host's).
    """
    if handle.egress is None:
        raise BackendUnavailable(
            f"sandbox {handle.session_id!r} has no egress proxies (backend {handle.backend}): "
            "its network is not decided per connection",
            fix="create the sandbox with the native or microvm backend",
        )
    return handle.egress


def egress_view(handle: SandboxHandle) -> dict[str, Any]:
    """The allowlist now, the deny list, ask mode and the requests waiting (`EgressView`).

    Raises:
        BackendUnavailable: no egress proxies.
    """
    egress = egress_of(handle)
    return {"entries": list(egress.entries),
            "denied": [rule.entry for rule in egress.allowlist.denied],
            "asking": egress.asking,
            "requests": [request.to_json() for request in egress.pending_requests]}


def change_egress(
    handle: SandboxHandle, request: EgressChangeRequest, *, by: str, **log_fields: Any
) -> dict[str, Any]:
    """Remove, then add, entries, then turn ask mode on or off if asked; the view after it,
    with what it did (`change`). A change that changes something is a `sandbox.egress` line in
    the server's log.

    Raises:
        BackendUnavailable: no egress proxies.
        InvalidPattern, BadSpec: as `SessionEgress.change`; nothing changes.
    """
    egress = egress_of(handle)
    change = egress.change(EgressChange(allow=tuple(request.allow), remove=tuple(request.remove)),
                           by=by)
    if request.ask is not None and request.ask != egress.asking:
        if request.ask:
            egress.ask(request.ask_timeout_s)
        else:
            egress.stop_asking()
        log_event("sandbox.egress-ask", f"sandbox {handle.session_id} egress ask "
                  f"{'on' if request.ask else 'off'}", sessionId=handle.session_id,
                  ask=request.ask, by=by, **log_fields)
    if change.added or change.removed:
        log_event("sandbox.egress", f"sandbox {handle.session_id} egress changed",
                  sessionId=handle.session_id, added=list(change.added),
                  removed=list(change.removed), by=by, **log_fields)
    return {**egress_view(handle), "change": change.to_json()}


def answer_request(handle: SandboxHandle, request_id: str, answer: str) -> dict[str, Any]:
    """Answer a held connection; the request answered (`EgressRequestView`), and a log line.

    Raises:
        BackendUnavailable: no egress proxies.
        BadSpec: no such request waits, or the answer is not once, session or deny.
    """
    answered = egress_of(handle).answer(request_id, answer)
    log_event("sandbox.egress-answer", f"sandbox {handle.session_id} egress request answered",
              sessionId=handle.session_id, entry=answered.entry, answer=answer)
    return answered.to_json()
