"""The sandbox API: create, list, inspect, destroy, kill, suspend and resume, and the egress
allowlist of a running sandbox (GET / PATCH .../egress, the egress stream). The exec routes are
in `exec_api.py`, with the helpers here that every route shares (`decode_body`, `live_state`,
`live_handle`, `ws_refuse`, `ws_answer`).

JSON bodies use the reference page's field names. Errors are an ErrorBody with a status a caller
can act on: 400 bad input (nothing was created or run), 401 no token, 404 unknown sandbox, 409 id
taken or backend unavailable on this host, 500 enforcement failed (nothing ran), 503 shutting down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, Final

import msgspec
from aiohttp import WSMsgType, web

from cc_server.errors import BackendUnavailable, BadSpec, CcServerError
from cc_server.microvm.handle import MicroVMHandle
from cc_server.policy import SandboxBackend, SandboxSpec, parse_spec
from cc_server.policy.paths import first_exposure
from cc_server.runtime.events import EgressChanged, EgressRequest, SandboxState, SandboxViolation
from cc_server.runtime.handle import SandboxHandle
from cc_server.server.egress_api import answer_request, change_egress, egress_of, egress_view
from cc_server.server.logs import log_event
from cc_server.server.models import (
    CreateSandboxWire,
    EgressAnswerRequest,
    EgressChangeRequest,
    EgressStreamInput,
)
from cc_server.server.state import STATE, ServerState
from cc_server.server.status import Refused, refusal

__all__ = [
    "WS_CLOSE_BASE",
    "WS_CLOSE_TIMEOUT_S",
    "WS_HEARTBEAT_S",
    "decode_body",
    "live_handle",
    "live_state",
    "routes",
    "ws_answer",
    "ws_refuse",
]

WS_HEARTBEAT_S: Final = 30.0  # ping interval; a client that stops answering is disconnected
WS_CLOSE_TIMEOUT_S: Final = 2.0  # how long a client may take to answer the server's close
WS_CLOSE_BASE: Final = 4000  # a refused WebSocket request closes with 4000 + its HTTP status

routes = web.RouteTableDef()


# --- errors --------------------------------------------------------------------------------------


def decode_body(data: bytes | str, kind: type[Any]) -> Any:
    """`data` decoded strictly as `kind`; a Refused 400 naming the schema when it is not one."""
    try:
        return msgspec.json.decode(data, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise Refused(400, "BadRequest", f"invalid {kind.__name__.removesuffix('Wire')}: {exc}",
                      "see /openapi.json for the body's schema") from None


def live_state(request: web.Request) -> ServerState:
    """The server's state; a Refused 503 once it is shutting down."""
    state = request.app[STATE]
    if state.shutting_down:
        raise Refused(503, "ShuttingDown", "the server is shutting down")
    return state


def live_handle(state: ServerState, session_id: str) -> SandboxHandle:
    """The live sandbox `session_id`; a Refused 404 when there is none."""
    handle = state.manager.handles.get(session_id)
    if handle is None:
        raise Refused(404, "NotFound", f"no live sandbox with sessionId {session_id!r}",
                      "create it with POST /v1/sandboxes")
    return handle


# --- sandboxes -----------------------------------------------------------------------------------

BACKEND_NAMES: Final = tuple(b.value for b in SandboxBackend)


def _backend(name: str | None) -> SandboxBackend | None:
    if name is None:
        return None
    if name not in BACKEND_NAMES:
        raise refusal(BadSpec(f"unknown backend {name!r}",
                              fix=f"use one of {', '.join(BACKEND_NAMES)}, or leave it out"))
    return SandboxBackend(name)


def _check_token_not_exposed(state: ServerState, spec: SandboxSpec) -> None:
    """A sandbox that could read the server's token could drive the server; refuse the binds
    that would show it (the egress socket directory is hidden by the backend itself)."""
    binds = [mount.host_path for mount in spec.bind_mounts]
    exposed = first_exposure(binds, [state.token_real_path], state.manager.host.realpath)
    if exposed is not None:
        i = exposed[0]
        raise refusal(BadSpec(
            f"bindMounts[{i}].hostPath {binds[i]!r} would expose the server's bearer token file",
            fix="bind a directory that does not contain the token file, or start the server "
            "with --token-file elsewhere",
        ))


@routes.post("/v1/sandboxes")
async def create_sandbox(request: web.Request) -> web.StreamResponse:
    """Create a sandbox from {spec, backend?}."""
    state = live_state(request)
    wire: CreateSandboxWire = decode_body(await request.read(), CreateSandboxWire)
    requested = _backend(wire.backend)
    try:
        spec = parse_spec(bytes(wire.spec))
    except BadSpec as exc:
        raise refusal(exc) from exc
    if spec.session_id in state.manager.handles:
        raise Refused(409, "Conflict", f"a sandbox with sessionId {spec.session_id!r} is live",
                      "destroy it first (DELETE /v1/sandboxes/{id}) or use another sessionId")
    _check_token_not_exposed(state, spec)
    try:
        handle = state.manager.launch(spec, backend=requested)
    except CcServerError as exc:
        log_event("sandbox.refused", exc.message, level=logging.WARNING,
                  sessionId=spec.session_id, error=type(exc).__name__)
        raise refusal(exc) from exc
    if wire.egress == "ask":
        if handle.egress is None:
            await state.manager.destroy(spec.session_id)
            raise Refused(409, "Conflict", f"egress ask needs the session's proxies; backend "
                          f"{handle.backend} has none", "use the native or microvm backend")
        handle.egress.ask(wire.egress_ask_timeout_s)
    log_event("sandbox.created", f"sandbox {spec.session_id} created",
              sessionId=spec.session_id, backend=str(handle.backend))
    return web.json_response(
        handle.to_json(), status=201,
        headers={"Location": f"/v1/sandboxes/{spec.session_id}"},
    )


@routes.get("/v1/sandboxes")
async def list_sandboxes(request: web.Request) -> web.StreamResponse:
    """Every live sandbox."""
    state = request.app[STATE]
    return web.json_response(
        {"sandboxes": [h.to_json() for h in state.manager.handles.values()]}
    )


@routes.get("/v1/sandboxes/{id}")
async def get_sandbox(request: web.Request) -> web.StreamResponse:
    """One sandbox: state, backend, violations so far."""
    return web.json_response(live_handle(request.app[STATE], request.match_info["id"]).to_json())


@routes.delete("/v1/sandboxes/{id}")
async def destroy_sandbox(request: web.Request) -> web.StreamResponse:
    """Destroy (idempotent): running commands are killed first."""
    session_id = request.match_info["id"]
    state = request.app[STATE]
    if session_id in state.manager.handles:
        await state.manager.destroy(session_id)
        log_event("sandbox.destroyed", f"sandbox {session_id} destroyed", sessionId=session_id)
    return web.Response(status=204)


@routes.post("/v1/sandboxes/{id}/kill")
async def kill_commands(request: web.Request) -> web.StreamResponse:
    """Kill the sandbox's running commands; the sandbox stays."""
    state = request.app[STATE]
    session_id = request.match_info["id"]
    live_handle(state, session_id)
    executions = list(state.running.get(session_id, ()))
    for execution in executions:
        await execution.kill(reason="manual")
    return web.json_response({"killed": len(executions)})


@routes.get("/v1/sandboxes/{id}/egress")
async def get_egress(request: web.Request) -> web.StreamResponse:
    """The sandbox's allowlist and deny list now, and the requests waiting for an answer."""
    handle = live_handle(live_state(request), request.match_info["id"])
    try:
        return web.json_response(egress_view(handle))
    except CcServerError as exc:
        raise refusal(exc) from exc


@routes.patch("/v1/sandboxes/{id}/egress")
async def patch_egress(request: web.Request) -> web.StreamResponse:
    """Remove, then add, allowlist entries; effective for the sandbox's next connection."""
    handle = live_handle(live_state(request), request.match_info["id"])
    req: EgressChangeRequest = decode_body(await request.read(), EgressChangeRequest)
    try:
        return web.json_response(change_egress(handle, req, by="api"))
    except CcServerError as exc:
        raise refusal(exc) from exc


@routes.post("/v1/sandboxes/{id}/egress/requests/{request}")
async def answer_egress_request(request: web.Request) -> web.StreamResponse:
    """Answer a held connection: once, session (adds its host:port) or deny."""
    handle = live_handle(live_state(request), request.match_info["id"])
    req: EgressAnswerRequest = decode_body(await request.read(), EgressAnswerRequest)
    try:
        return web.json_response(answer_request(handle, request.match_info["request"],
                                                req.answer))
    except BadSpec as exc:  # no such request waits: the id names nothing (any more)
        raise Refused(404, "NotFound", exc.message, exc.fix) from None
    except CcServerError as exc:
        raise refusal(exc) from exc


# Frames a slow egress-stream client has not taken yet; past it new ones are dropped (the
# allowlist and the waiting requests stay readable with GET .../egress).
EGRESS_STREAM_QUEUE: Final = 256
EGRESS_STREAM_POLL_S: Final = 1.0  # how often the stream checks that its sandbox still lives


@routes.get("/v1/sandboxes/{id}/egress/ws")
async def egress_stream(request: web.Request) -> web.StreamResponse:
    """The sandbox's egress as it happens: a snapshot (`egress`), then `egress-changed`,
    `egress-request` and `violation` frames; `{"egressAnswer": {id, answer}}` answers a request.
    Closes when the sandbox is destroyed."""
    ws = web.WebSocketResponse(heartbeat=WS_HEARTBEAT_S, timeout=WS_CLOSE_TIMEOUT_S)
    await ws.prepare(request)
    try:
        handle = live_handle(live_state(request), request.match_info["id"])
        try:
            egress, snapshot = egress_of(handle), egress_view(handle)
        except CcServerError as exc:
            raise refusal(exc) from exc
    except Refused as refused:
        await ws_refuse(ws, refused.status, refused.body)
        return ws
    frames: asyncio.Queue[dict[str, object]] = asyncio.Queue(EGRESS_STREAM_QUEUE)

    def push(frame: dict[str, object]) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            frames.put_nowait(frame)

    def watch(item: EgressChanged | EgressRequest) -> None:
        if isinstance(item, EgressChanged):
            push({"type": "egress-changed", "sessionId": handle.session_id,
                  "egress": item.to_json()})
        else:
            push({"type": "egress-request", "sessionId": handle.session_id,
                  "request": item.to_json()})

    def violated(violation: SandboxViolation) -> None:
        push({"type": "violation", "sessionId": handle.session_id,
              "violation": violation.to_json()})

    async def send() -> None:
        await ws.send_str(json.dumps({"type": "egress", "sessionId": handle.session_id,
                                      **snapshot}))
        while handle.state is not SandboxState.DESTROYED:
            try:
                async with asyncio.timeout(EGRESS_STREAM_POLL_S):
                    frame = await frames.get()
            except TimeoutError:
                continue
            await ws.send_str(json.dumps(frame))

    async def receive() -> None:
        async for msg in ws:
            if msg.type is not WSMsgType.TEXT:
                continue
            try:
                cmd = msgspec.json.decode(msg.data, type=EgressStreamInput)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                await ws.send_str(json.dumps({"type": "error", "error": "BadRequest",
                                              "message": str(exc), "fix": None}))
                continue
            await ws_answer(ws, handle, cmd.egress_answer)

    egress.watchers.append(watch)
    handle.violation_listeners.append(violated)
    try:
        async with asyncio.TaskGroup() as tg:
            sender = tg.create_task(send(), name=f"egress stream {handle.session_id} send")
            receiver = tg.create_task(receive(), name=f"egress stream {handle.session_id} recv")
            await asyncio.wait([sender, receiver], return_when=asyncio.FIRST_COMPLETED)
            sender.cancel()
            receiver.cancel()
    except* ConnectionError:
        pass  # the client went away
    finally:
        egress.watchers.remove(watch)
        handle.violation_listeners.remove(violated)
    await ws.close()
    return ws


def _vm(request: web.Request) -> MicroVMHandle:
    handle = live_handle(live_state(request), request.match_info["id"])
    if not isinstance(handle, MicroVMHandle):
        raise refusal(BackendUnavailable(
            f"sandbox {handle.session_id!r} runs on {handle.backend}, which cannot suspend",
            fix="only microvm sandboxes are checkpointed to disk"))
    return handle


@routes.post("/v1/sandboxes/{id}/suspend")
async def suspend_sandbox(request: web.Request) -> web.StreamResponse:
    """Checkpoint a microVM sandbox to disk and end its VM (its RAM is released); its running
    commands stay, frozen, until resume (or the next exec)."""
    handle = _vm(request)
    try:
        await handle.suspend()
    except CcServerError as exc:
        raise refusal(exc) from exc
    log_event("sandbox.suspended", f"sandbox {handle.session_id} suspended",
              sessionId=handle.session_id)
    return web.json_response(handle.to_json())


@routes.post("/v1/sandboxes/{id}/resume")
async def resume_sandbox(request: web.Request) -> web.StreamResponse:
    """Restore a suspended microVM sandbox (a warm one is left alone)."""
    handle = _vm(request)
    try:
        await handle.resume()
    except CcServerError as exc:
        raise refusal(exc) from exc
    return web.json_response(handle.to_json())


async def ws_refuse(ws: web.WebSocketResponse, status: int, body: dict[str, Any]) -> None:
    """Send `body` as an error frame, then close with WS_CLOSE_BASE + `status`."""
    with contextlib.suppress(ConnectionError):
        await ws.send_str(json.dumps({"type": "error", **body}))
    await ws.close(code=WS_CLOSE_BASE + status, message=body["error"].encode()[:120])


async def ws_answer(ws: web.WebSocketResponse, handle: SandboxHandle,
                     msg: EgressAnswerRequest) -> None:
    """Answer an egress request from the exec WebSocket; a bad answer is an error frame."""
    try:
        if handle.egress is None or msg.id is None:
            raise BadSpec("egressAnswer needs an id, and a sandbox with egress proxies")
        handle.egress.answer(msg.id, msg.answer)
    except BadSpec as exc:
        with contextlib.suppress(ConnectionError):
            await ws.send_str(json.dumps({"type": "error", "error": "BadRequest",
                                          "message": exc.message, "fix": exc.fix}))
