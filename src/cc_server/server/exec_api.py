"""Running commands: `POST .../exec` (the collected result), the exec WebSocket (one command,
its events streamed) and the session stream (one WebSocket per sandbox, many commands, every
frame tagged with the client's command id).

The session stream, `GET /v1/sandboxes/{id}/session/ws`, is for a client that runs many
commands: one upgrade, then per command a `{"id", "exec": ExecRequest}` message and the events
of the exec WebSocket with `"id"` added. A message the server cannot act on gets an error frame
(`{"type": "error", "id", "status", "error", "message", "fix"}`, `id` null when the message
named none or could not be read) and the stream goes on; a refused exec never ran. Closing the
socket kills every command still running on it (reason `disconnected`). A stream is bound to the
handle of the sandbox it was opened on, not to its id: once that sandbox is destroyed, every
further message is refused (Closed, 409), and a new sandbox that took the id is never reached.
Memory per stream is bounded: a command's output waits in its execution's bounded queue, and in
the socket's buffer only until the client takes it (a client that stops reading stops the
command's output, not the server); client messages for one command queue up to
SESSION_INPUT_QUEUE, and the stdin not written yet (an exec's own stdin included) is held up to
SESSION_STDIN_BYTES per command and SESSION_STREAM_STDIN_BYTES per stream: past either, the
message is refused (LimitReached, 429), never buffered.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import codecs
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
from aiohttp import WSMsgType, web

from cc_server.errors import BadSpec, CcServerError
from cc_server.policy.spec import check_absolute
from cc_server.runtime.events import EventType, SandboxEvent, SandboxState
from cc_server.runtime.handle import Execution, SandboxHandle
from cc_server.server.api import (
    WS_CLOSE_TIMEOUT_S,
    WS_HEARTBEAT_S,
    decode_body,
    live_handle,
    live_state,
    ws_answer,
    ws_refuse,
)
from cc_server.server.exec_result import send_exec_result
from cc_server.server.logs import LOGGER_NAME, log_event
from cc_server.server.models import ExecRequest, ExecStreamInput, SessionStreamInput
from cc_server.server.state import STATE, ServerState
from cc_server.server.status import CLOSED_STATUS, LIMIT_STATUS, Refused, error_body, refusal

__all__ = [
    "SESSION_INPUT_QUEUE",
    "SESSION_MAX_COMMANDS",
    "SESSION_STDIN_BYTES",
    "SESSION_STREAM_STDIN_BYTES",
    "routes",
]

FIRST_MESSAGE_TIMEOUT_S: Final = 30.0  # the exec WebSocket's ExecRequest must arrive by then
# Commands running at once on one session stream; one more is refused (LimitReached), so a
# client that does not wait for its commands cannot fork without bound through one socket.
SESSION_MAX_COMMANDS: Final = 64
# Client messages for one command not applied yet (it is still starting, or its stdin pipe is
# full); one more is refused with an error frame, never buffered.
SESSION_INPUT_QUEUE: Final = 64
# Stdin bytes not written yet, held for one command: what the exec WebSocket holds for its one
# command (aiohttp's largest message, read only once the one before it was written) ...
SESSION_STDIN_BYTES: Final = 4 * 2**20
# ... and for all the commands of one stream: two commands' worth, so that with the messages
# being decoded the server's memory grows by well under what a stream's output flood may make
# it hold (40 MiB, tests/functional/test_server_session_stream.py).
SESSION_STREAM_STDIN_BYTES: Final = 8 * 2**20
SESSION_POLL_S: Final = 1.0  # how often an idle session stream checks that its sandbox lives

routes = web.RouteTableDef()
_log = logging.getLogger(LOGGER_NAME)
_encode = msgspec.json.Encoder().encode


def _stdin_bytes(text: str | None, b64: str | None) -> bytes | None:
    if text is not None and b64 is not None:
        raise Refused(400, "BadRequest", "give stdin or stdinBase64, not both")
    if b64 is not None:
        try:
            return base64.b64decode(b64, validate=True)
        except binascii.Error as exc:
            raise Refused(400, "BadRequest", f"stdinBase64 is not base64: {exc}") from None
    return None if text is None else text.encode()


def _check_exec(req: ExecRequest) -> None:
    for i, word in enumerate(req.argv):
        if "\x00" in word:
            raise Refused(400, "BadRequest", f"argv[{i}] contains a NUL byte")
    for name, value in (req.env or {}).items():
        if not name or "=" in name or "\x00" in name or "\x00" in value:
            raise Refused(400, "BadRequest", f"env name {name!r} or its value is not valid",
                          "names are non-empty without '=' or NUL; values have no NUL")
    if req.cwd is not None:
        try:
            check_absolute(req.cwd)
        except ValueError as exc:
            raise Refused(400, "BadRequest", f"cwd: {exc}") from None


@contextlib.asynccontextmanager
async def _running(state: ServerState, sandbox: str | SandboxHandle, req: ExecRequest, *,
                   interactive: bool) -> AsyncIterator[tuple[Execution, bytes | None]]:
    """Start the command of `req` in `sandbox` (the live one of that id, or that handle itself),
    tracked for kill and shutdown, with its stdin bytes (for an interactive one, to be written
    now that it runs); refusals become Refused."""
    _check_exec(req)
    handle = live_handle(state, sandbox) if isinstance(sandbox, str) else sandbox
    stdin = _stdin_bytes(req.stdin, req.stdin_base64)
    started = time.monotonic()
    execution: Execution | None = None
    try:
        async with handle.open_exec(
            req.argv, env=req.env, cwd=req.cwd,
            stdin=None if interactive else stdin,
            interactive_stdin=interactive, timeout_s=req.timeout_s,
        ) as execution:
            state.track(handle.session_id, execution)
            yield execution, stdin
    except CcServerError as exc:
        if execution is not None:  # raised by the caller's block, not a refusal to start
            raise
        log_event("exec.refused", exc.message, level=logging.WARNING,
                  sessionId=handle.session_id, error=type(exc).__name__)
        raise refusal(exc) from exc
    finally:
        if execution is not None:
            state.untrack(handle.session_id, execution)
            log_event("exec.exit", f"{execution.exec_id} exited {execution.exit_code}",
                      sessionId=handle.session_id, execId=execution.exec_id,
                      exitCode=execution.exit_code,
                      ms=round((time.monotonic() - started) * 1000, 1))


@routes.post("/v1/sandboxes/{id}/exec")
async def exec_collected(request: web.Request) -> web.StreamResponse:
    """Run a command; answer with its collected result once it exits. Each stream keeps its
    first `exec_output_limit_bytes`; the rest is read and dropped as it arrives, and counted."""
    state = live_state(request)
    req: ExecRequest = decode_body(await request.read(), ExecRequest)
    async with _running(state, request.match_info["id"], req, interactive=False) as (
        execution, _,
    ):
        result = await execution.collect(limit_bytes=state.exec_output_limit_bytes)
    return await send_exec_result(request, result)


_OUTPUT_EVENTS: Final = frozenset({EventType.STDOUT, EventType.STDERR})
_UTF8: Final = codecs.getincrementaldecoder("utf-8")


class _TextStreams:
    """Events as WebSocket frames: UTF-8 decoding per output stream that never splits a
    character across two frames (each output chunk decoded once, here)."""

    def __init__(self) -> None:
        self._decoders: dict[EventType, codecs.IncrementalDecoder] = {}  # made on first output

    def render(self, event: SandboxEvent) -> list[dict[str, object]]:
        if event.type in _OUTPUT_EVENTS and event.data is not None:
            decoder = self._decoders.get(event.type)
            if decoder is None:
                decoder = self._decoders[event.type] = _UTF8(errors="replace")
            text = decoder.decode(event.data)
            if not text:
                return []
            out: dict[str, object] = {"type": event.type.value, "sessionId": event.session_id}
            if event.exec_id is not None:
                out["execId"] = event.exec_id
            out["data"] = text
            return [out]
        if event.type is EventType.EXIT:  # what is left of a truncated character, then exit
            tails: list[dict[str, object]] = []
            for kind, each in self._decoders.items():
                rest = each.decode(b"", final=True)
                if rest:
                    tails.append({"type": kind.value, "sessionId": event.session_id,
                                  "execId": event.exec_id, "data": rest})
            return [*tails, event.to_json()]
        return [event.to_json()]


async def _send(ws: web.WebSocketResponse, frame: dict[str, object]) -> None:
    """One JSON text frame (encoded once, by msgspec); a client that went away is ignored."""
    with contextlib.suppress(ConnectionError):
        await ws.send_frame(_encode(frame), WSMsgType.TEXT)


async def _bad_request(ws: web.WebSocketResponse, message: str) -> None:
    await _send(ws, {"type": "error", **error_body("BadRequest", message)})


async def _client_messages(ws: web.WebSocketResponse, execution: Execution) -> None:
    """Apply stdin / stdinClose / kill messages until the client closes, then kill."""
    try:
        async for msg in ws:
            if msg.type is not WSMsgType.TEXT:
                continue
            try:
                cmd = msgspec.json.decode(msg.data, type=ExecStreamInput)
                data = _stdin_bytes(cmd.stdin, cmd.stdin_base64)
            except (msgspec.ValidationError, msgspec.DecodeError, Refused) as exc:
                await _bad_request(ws, str(exc))
                continue
            with contextlib.suppress(BadSpec, BrokenPipeError, ConnectionResetError):
                if data:
                    await execution.write_stdin(data)
                if cmd.stdin_close:
                    execution.close_stdin()
            if cmd.egress_answer is not None:
                await ws_answer(ws, execution.handle, cmd.egress_answer)
            if cmd.kill:
                await execution.kill(reason="manual")
    finally:
        await execution.kill(reason="disconnected")  # no-op once the command has exited


async def _write_stdin(execution: Execution, data: bytes) -> None:
    with contextlib.suppress(BadSpec, BrokenPipeError, ConnectionResetError):
        await execution.write_stdin(data)


@routes.get("/v1/sandboxes/{id}/exec/ws")
async def exec_stream(request: web.Request) -> web.StreamResponse:
    """Run a command, streaming its events; closing the socket kills it."""
    ws = web.WebSocketResponse(heartbeat=WS_HEARTBEAT_S, timeout=WS_CLOSE_TIMEOUT_S)
    await ws.prepare(request)
    try:
        state = live_state(request)
        try:
            async with asyncio.timeout(FIRST_MESSAGE_TIMEOUT_S):
                first = await ws.receive()
        except TimeoutError:
            raise Refused(408, "Timeout", "no ExecRequest within "
                          f"{FIRST_MESSAGE_TIMEOUT_S:g} s") from None
        if first.type is not WSMsgType.TEXT:
            return ws  # the client went away (or sent something that is not a request)
        req: ExecRequest = decode_body(first.data, ExecRequest)
        async with _running(state, request.match_info["id"], req, interactive=True) as (
            execution, initial,
        ):
            texts = _TextStreams()
            async with asyncio.TaskGroup() as tg:
                if initial:
                    tg.create_task(_write_stdin(execution, initial), name="initial stdin")
                client = tg.create_task(_client_messages(ws, execution), name="ws client")
                async for event in execution:
                    for frame in texts.render(event):
                        await _send(ws, frame)
                client.cancel()
    except Refused as refused:
        await ws_refuse(ws, refused.status, refused.body)
        return ws
    await ws.close()
    return ws


# --- the session stream --------------------------------------------------------------------------


@dataclass(eq=False)
class _Command:
    """One command of a session stream, from its exec message to its exit."""

    id: str
    inbox: asyncio.Queue[tuple[bytes | None, bool]] = field(
        default_factory=lambda: asyncio.Queue(SESSION_INPUT_QUEUE))  # (stdin data, close)
    execution: Execution | None = None  # set once it runs
    feeder: asyncio.Task[None] | None = None  # writes `inbox` to its stdin, once there is some
    feed: Callable[[], None] | None = None  # starts `feeder`, while the command runs
    kill: str | None = None  # a kill asked for before it ran: the reason
    held: int = 0  # stdin bytes taken for it and not written yet


class _SessionStream:
    """The commands of one session stream and the frames they send."""

    def __init__(self, ws: web.WebSocketResponse, state: ServerState,
                 handle: SandboxHandle) -> None:
        self._ws = ws
        self._state = state
        self._handle = handle
        self._commands: dict[str, _Command] = {}
        self._closing = False
        self._held = 0  # stdin bytes taken for the stream's commands and not written yet

    async def _error(self, command_id: str | None, status: int, body: dict[str, Any]) -> None:
        await _send(self._ws, {"type": "error", "id": command_id, "status": status, **body})

    def _sandbox_gone(self) -> bool:
        handle = self._handle
        return (handle.state in (SandboxState.DESTROYED, SandboxState.ERROR)
                or self._state.manager.handles.get(handle.session_id) is not handle)

    def _refuse_if_gone(self, tg: asyncio.TaskGroup) -> None:
        """A Refused (Closed) once the stream's own sandbox is destroyed or failed, its running
        commands killed: a new sandbox that took its id is another sandbox, never reached."""
        if not self._sandbox_gone():
            return
        self._kill_all(tg, "destroyed")
        raise self._closed()

    def _closed(self) -> Refused:
        return Refused(CLOSED_STATUS, "Closed", f"the sandbox {self._handle.session_id!r} this "
                       "stream was opened on was destroyed or failed",
                       "open a stream on a live sandbox")

    def _kill_all(self, tg: asyncio.TaskGroup, reason: str) -> None:
        for command in list(self._commands.values()):
            if command.execution is not None:
                tg.create_task(command.execution.kill(reason=reason),
                               name=f"session stream kill {command.id}")

    async def serve(self, tg: asyncio.TaskGroup) -> None:
        """Read client messages until the client closes (or the sandbox is gone and no command
        runs), then kill what still runs."""
        try:
            while True:
                try:
                    message = await self._ws.receive(timeout=SESSION_POLL_S)
                except TimeoutError:
                    if self._sandbox_gone() and not self._commands:
                        return
                    continue
                if message.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED,
                                    WSMsgType.ERROR):
                    return
                if message.type is not WSMsgType.TEXT:
                    await self._error(None, 400, error_body(
                        "BadRequest", "the session stream takes JSON text frames only",
                        "send SessionStreamInput as a text frame"))
                    continue
                try:
                    msg = msgspec.json.decode(message.data, type=SessionStreamInput)
                except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                    await self._error(None, 400, error_body(
                        "BadRequest", f"invalid SessionStreamInput: {exc}",
                        "see /openapi.json for the message's schema"))
                    continue
                try:
                    await self._apply(msg, tg)
                except Refused as refused:
                    await self._error(msg.id, refused.status, refused.body)
        finally:
            self._closing = True
            self._kill_all(tg, "disconnected")

    async def _apply(self, msg: SessionStreamInput, tg: asyncio.TaskGroup) -> None:
        self._refuse_if_gone(tg)
        if msg.egress_answer is not None:
            await ws_answer(self._ws, self._handle, msg.egress_answer)
        wants_input = (msg.stdin is not None or msg.stdin_base64 is not None or msg.stdin_close
                       or msg.kill)
        if msg.exec is not None:
            if wants_input:
                raise Refused(400, "BadRequest", "an exec message takes its stdin in "
                               "the ExecRequest, and cannot kill",
                               "send stdin, stdinClose or kill in a later message")
            self._start(msg.id, msg.exec, tg)
        elif wants_input:
            self._input(msg, tg)
        elif msg.egress_answer is None:
            raise Refused(400, "BadRequest", "the message asks for nothing",
                           "send exec, stdin, stdinBase64, stdinClose, kill or egressAnswer")

    def _start(self, command_id: str | None, req: ExecRequest, tg: asyncio.TaskGroup) -> None:
        if command_id is None:
            raise Refused(400, "BadRequest", "an exec message needs an id",
                           "name the command: its events carry that id")
        if command_id in self._commands:
            raise Refused(409, "Conflict", f"command {command_id!r} is running on "
                           "this stream", "wait for its exit event, or use another id")
        if len(self._commands) >= SESSION_MAX_COMMANDS:
            raise Refused(LIMIT_STATUS, "LimitReached",
                           f"{SESSION_MAX_COMMANDS} commands are running on this stream",
                           "wait for one to exit, or open another stream")
        initial = _stdin_bytes(req.stdin, req.stdin_base64)
        command = _Command(command_id)
        self._hold(command, initial)
        self._commands[command_id] = command
        req = msgspec.structs.replace(req, stdin=None, stdin_base64=None)  # fed as it runs
        tg.create_task(self._run(command, req, initial),
                       name=f"session stream command {command_id}")

    def _hold(self, command: _Command, data: bytes | None) -> None:
        """Count `data` as held for `command`; a Refused (LimitReached) past either budget."""
        size = len(data or b"")
        if command.held + size > SESSION_STDIN_BYTES:
            raise Refused(LIMIT_STATUS, "LimitReached", f"{command.held} bytes of stdin for "
                          f"{command.id!r} wait already (at most {SESSION_STDIN_BYTES})",
                          "let the command read its stdin first")
        if self._held + size > SESSION_STREAM_STDIN_BYTES:
            raise Refused(LIMIT_STATUS, "LimitReached", f"{self._held} bytes of stdin wait on "
                          f"this stream already (at most {SESSION_STREAM_STDIN_BYTES})",
                          "let its commands read their stdin first, or open another stream")
        command.held += size
        self._held += size

    def _release(self, command: _Command, size: int) -> None:
        size = min(size, command.held)  # none once the command was forgotten
        command.held -= size
        self._held -= size

    def _input(self, msg: SessionStreamInput, tg: asyncio.TaskGroup) -> None:
        command = None if msg.id is None else self._commands.get(msg.id)
        if command is None:
            raise Refused(404, "NotFound", f"no running command {msg.id!r} on this "
                           "stream", "its exit event may have come already")
        data = _stdin_bytes(msg.stdin, msg.stdin_base64) if (
            msg.stdin is not None or msg.stdin_base64 is not None) else None
        if data is not None or msg.stdin_close:
            if command.inbox.full():
                raise Refused(LIMIT_STATUS, "LimitReached",
                               f"{SESSION_INPUT_QUEUE} messages for {command.id!r} wait already",
                               "let the command read its stdin first")
            self._hold(command, data)
            command.inbox.put_nowait((data, msg.stdin_close))
            if command.feed is not None:
                command.feed()
        if msg.kill:
            if command.execution is None:
                command.kill = "manual"  # applied once it runs
            else:
                tg.create_task(command.execution.kill(reason="manual"),
                               name=f"session stream kill {command.id}")

    async def _run(self, command: _Command, req: ExecRequest, initial: bytes | None) -> None:
        try:
            if self._state.shutting_down:
                raise Refused(503, "ShuttingDown", "the server is shutting down")
            if self._sandbox_gone():
                raise self._closed()
            async with _running(self._state, self._handle, req,
                                interactive=True) as (execution, _):
                command.execution = execution
                if self._closing or command.kill is not None:
                    await execution.kill(reason="disconnected" if self._closing
                                         else command.kill or "manual")
                texts = _TextStreams()
                async with asyncio.TaskGroup() as tg:

                    def feed() -> None:  # stdin is written by a task of its own, when there is
                        if command.feeder is None:
                            command.feeder = tg.create_task(
                                self._feed(command, execution, initial),
                                name=f"session stream stdin {command.id}")

                    command.feed = feed
                    if initial or not command.inbox.empty():
                        feed()
                    async for event in execution:
                        if event.type is EventType.EXIT:  # its id is free from its exit frame on
                            self._forget(command)
                        for frame in texts.render(event):
                            frame["id"] = command.id
                            await _send(self._ws, frame)
                    command.feed = None
                    if command.feeder is not None:
                        command.feeder.cancel()
        except Refused as refused:
            self._forget(command)
            await self._error(command.id, refused.status, refused.body)
        except Exception as exc:  # a fault of the host or a bug: this command's, not the stream's
            self._forget(command)
            _log.exception("session stream %s: command %r failed", self._handle.session_id,
                           command.id)
            await self._error(command.id, 500, error_body(
                "InternalError", f"the command failed ({type(exc).__name__}: {exc}); it was "
                "killed if it had started", "see the server's log"))
        finally:
            self._forget(command)

    def _forget(self, command: _Command) -> None:
        self._release(command, command.held)  # what still waits for it is dropped
        if self._commands.get(command.id) is command:  # not a later command of the same id
            del self._commands[command.id]

    async def _feed(self, command: _Command, execution: Execution,
                    initial: bytes | None) -> None:
        if initial:
            try:
                await _write_stdin(execution, initial)
            finally:
                self._release(command, len(initial))
        while True:
            data, close = await command.inbox.get()
            if data:
                try:
                    await _write_stdin(execution, data)
                finally:
                    self._release(command, len(data))
            if close:
                execution.close_stdin()


@routes.get("/v1/sandboxes/{id}/session/ws")
async def session_stream(request: web.Request) -> web.StreamResponse:
    """Run many commands in one sandbox over one WebSocket, each message and event tagged with
    the client's command id; closing the socket kills every command still running on it."""
    ws = web.WebSocketResponse(heartbeat=WS_HEARTBEAT_S, timeout=WS_CLOSE_TIMEOUT_S)
    await ws.prepare(request)
    try:
        state = live_state(request)
        handle = live_handle(state, request.match_info["id"])
    except Refused as refused:
        await ws_refuse(ws, refused.status, refused.body)
        return ws
    stream = _SessionStream(ws, request.app[STATE], handle)
    try:
        async with asyncio.TaskGroup() as tg:
            await stream.serve(tg)
    except* ConnectionError:
        pass  # the client went away; its commands were killed
    await ws.close()
    return ws
