"""WS /v1/terminals: a server-hosted terminal session over a WebSocket.

Query: `backend` (none | native | microvm; default the service's, which is none), `cwd`
(absolute; default $HOME), `rows`, `cols`. Frames:
- server → client: first a text frame `{"type": "session", "sessionId", "backend", "cwd"}` (the
  badge: the backend actually running the shell), then the PTY's output as binary frames, and when
  the shell exits `{"type": "exit", "exitCode": N}` before the close;
- client → server: binary frames are typed input; text frames are JSON control messages
  (`{"resize": {"rows": R, "cols": C}}`, `{"input": "text"}`) or, when they are not a JSON object,
  typed input as they are.
A session that cannot start gets `{"type": "error", ...}` and close code 4000 + the HTTP status
(4409 when `native` or `microvm` is asked on a host that cannot provide it); no shell runs.
Closing the socket ends the shell and everything it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Final

import msgspec
from aiohttp import WSMsgType, web

from cc_server.errors import BadSpec, CcServerError
from cc_server.policy import SandboxBackend
from cc_server.server.api import WS_CLOSE_BASE, WS_CLOSE_TIMEOUT_S, WS_HEARTBEAT_S
from cc_server.server.logs import log_event
from cc_server.server.models import TerminalControl
from cc_server.server.state import STATE
from cc_server.server.status import status_for
from cc_server.terminal import DEFAULT_WINDOW, TerminalSession

__all__ = ["routes"]

# After the shell exits, how long output still in the PTY may take to arrive before the session
# is torn down (a background job holding the terminal open must not hold the socket).
OUTPUT_DRAIN_S: Final = 1.0
TERMINAL_BACKENDS: Final = tuple(b.value for b in SandboxBackend)

routes = web.RouteTableDef()


def _query(request: web.Request) -> tuple[SandboxBackend | None, str | None, int, int]:
    name = request.query.get("backend")
    if name is not None and name not in TERMINAL_BACKENDS:
        raise BadSpec(f"unknown terminal backend {name!r}",
                      fix=f"use one of {', '.join(TERMINAL_BACKENDS)}, or leave it out")
    try:
        rows = int(request.query.get("rows", DEFAULT_WINDOW[0]))
        cols = int(request.query.get("cols", DEFAULT_WINDOW[1]))
    except ValueError:
        raise BadSpec("rows and cols must be integers") from None
    backend = None if name is None else SandboxBackend(name)
    return backend, request.query.get("cwd"), rows, cols


async def _pump_output(ws: web.WebSocketResponse, session: TerminalSession) -> None:
    with contextlib.suppress(ConnectionError):  # the client left: the input pump ends the session
        while data := await session.read():
            await ws.send_bytes(data)


async def _pump_input(ws: web.WebSocketResponse, session: TerminalSession) -> None:
    async for msg in ws:
        if msg.type is WSMsgType.BINARY:
            await session.write(msg.data)
        elif msg.type is WSMsgType.TEXT:
            await _text_frame(ws, session, msg.data)


async def _text_frame(ws: web.WebSocketResponse, session: TerminalSession, text: str) -> None:
    if not text.lstrip().startswith("{"):
        await session.write(text.encode())
        return
    try:
        control = msgspec.json.decode(text, type=TerminalControl)
    except msgspec.DecodeError:  # not JSON: typed text that happens to start with "{"
        await session.write(text.encode())
        return
    except msgspec.ValidationError as exc:
        with contextlib.suppress(ConnectionError):
            await ws.send_str(json.dumps({"type": "error", "error": "BadRequest",
                                          "message": f"invalid control message: {exc}",
                                          "fix": None}))
        return
    if control.resize is not None:
        session.resize(control.resize.rows, control.resize.cols)
    if control.input is not None:
        await session.write(control.input.encode())


@routes.get("/v1/terminals")
async def terminal(request: web.Request) -> web.StreamResponse:
    """Open a terminal session on this socket."""
    state = request.app[STATE]
    ws = web.WebSocketResponse(heartbeat=WS_HEARTBEAT_S, timeout=WS_CLOSE_TIMEOUT_S)
    await ws.prepare(request)
    try:
        if state.shutting_down:
            raise CcServerError("the server is shutting down")
        backend, cwd, rows, cols = _query(request)
        session = await state.terminals.open(backend=backend, cwd=cwd, rows=rows, cols=cols)
    except CcServerError as exc:
        status = 503 if state.shutting_down else status_for(exc)
        log_event("terminal.refused", exc.message, level=logging.WARNING,
                  error=type(exc).__name__, backend=request.query.get("backend", "default"))
        with contextlib.suppress(ConnectionError):
            await ws.send_str(json.dumps({"type": "error", "error": type(exc).__name__,
                                          "message": exc.message, "fix": exc.fix}))
        await ws.close(code=WS_CLOSE_BASE + status, message=type(exc).__name__.encode())
        return ws
    log_event("terminal.opened", f"terminal {session.session_id} opened",
              sessionId=session.session_id, backend=str(session.backend), pid=session.pid)
    exit_code: int | None = None
    try:
        with contextlib.suppress(ConnectionError):
            await ws.send_str(json.dumps({"type": "session", **session.to_json()}))
        async with asyncio.TaskGroup() as tg:
            output = tg.create_task(_pump_output(ws, session), name="terminal output")
            client = tg.create_task(_pump_input(ws, session), name="terminal input")
            shell = tg.create_task(session.wait(), name="terminal shell")
            await asyncio.wait({client, shell}, return_when=asyncio.FIRST_COMPLETED)
            if shell.done():
                exit_code = shell.result()
                await asyncio.wait({output}, timeout=OUTPUT_DRAIN_S)
            await state.terminals.close(session.session_id)  # ends the output pump too
            client.cancel()
            shell.cancel()
        if exit_code is not None:
            with contextlib.suppress(ConnectionError):
                await ws.send_str(json.dumps({"type": "exit", "exitCode": exit_code}))
    finally:
        await state.terminals.close(session.session_id)
        log_event("terminal.closed", f"terminal {session.session_id} closed",
                  sessionId=session.session_id, exitCode=exit_code)
    await ws.close()
    return ws
