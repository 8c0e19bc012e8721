"""The OpenAPI 3.1 document the server serves at GET /openapi.json, assembled from the msgspec
schemas of the spec model and the API's bodies (`server.models`)."""

from __future__ import annotations

from typing import Any, Final

import msgspec

from cc_server import __version__
from cc_server.server.dispatch_api import REQUEST_MODELS, openapi_paths
from cc_server.server.exec_api import (
    SESSION_INPUT_QUEUE,
    SESSION_MAX_COMMANDS,
    SESSION_STDIN_BYTES,
    SESSION_STREAM_STDIN_BYTES,
)
from cc_server.server.models import (
    CreateSandboxRequest,
    EgressAnswerRequest,
    EgressChangeRequest,
    EgressRequestView,
    EgressStreamInput,
    EgressView,
    ErrorBody,
    ExecRequest,
    ExecResult,
    ExecStreamInput,
    Health,
    KillResult,
    SandboxEventView,
    SandboxHandleView,
    SandboxList,
    SessionStreamInput,
    TerminalControl,
    TerminalSessionView,
)
from cc_server.server.status import BACKEND_UNAVAILABLE_STATUS

__all__ = ["openapi_document"]

_MODELS: Final = (
    CreateSandboxRequest,
    EgressAnswerRequest,
    EgressChangeRequest,
    EgressRequestView,
    EgressStreamInput,
    EgressView,
    ErrorBody,
    ExecRequest,
    ExecResult,
    ExecStreamInput,
    Health,
    KillResult,
    SandboxEventView,
    SandboxHandleView,
    SandboxList,
    SessionStreamInput,
    TerminalControl,
    TerminalSessionView,
)
_REF = "#/components/schemas/{name}"


def _ref(model: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=model.__name__)}


def _json(model: type, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


def _errors(*codes: int) -> dict[str, Any]:
    reasons = {
        400: "malformed body, unknown field, relative path or unknown backend name",
        401: "missing or wrong bearer token",
        404: "no live sandbox with this id",
        409: "the sandbox id is taken, the requested backend cannot run on this host, or the "
             "sandbox was destroyed or failed (Closed)",
        500: "the isolation could not be applied (EnforcementFailed); nothing ran",
        503: "the server is shutting down",
    }
    return {str(code): _json(ErrorBody, reasons[code]) for code in codes}


_ID_PARAM: Final = {
    "name": "id", "in": "path", "required": True, "schema": {"type": "string"},
    "description": "The sandbox's sessionId",
}


def _paths() -> dict[str, Any]:
    return {
        "/healthz": {"get": {
            "summary": "Liveness; needs no token and never touches the probe",
            "security": [],
            "responses": {"200": _json(Health, "the server is up")},
        }},
        "/v1/sandboxes": {
            "post": {
                "summary": "Create a sandbox from a SandboxSpec",
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": _ref(CreateSandboxRequest)}}},
                "responses": {
                    "201": _json(SandboxHandleView, "created; backend is the one running"),
                    **_errors(400, 401, 409, 500, 503),
                },
            },
            "get": {
                "summary": "List live sandboxes",
                "responses": {"200": _json(SandboxList, "every live sandbox"), **_errors(401)},
            },
        },
        "/v1/sandboxes/{id}": {
            "parameters": [_ID_PARAM],
            "get": {
                "summary": "Inspect a sandbox: state, backend, violations so far",
                "responses": {"200": _json(SandboxHandleView, "the sandbox"),
                              **_errors(401, 404)},
            },
            "delete": {
                "summary": "Destroy a sandbox, killing its commands (idempotent)",
                "responses": {"204": {"description": "destroyed, or was not live"},
                              **_errors(401)},
            },
        },
        "/v1/sandboxes/{id}/exec": {
            "parameters": [_ID_PARAM],
            "post": {
                "summary": "Run a command and return its collected result",
                "description": (
                    "Each stream keeps its first CC_SERVER_EXEC_OUTPUT_LIMIT bytes (16 MiB by "
                    "default); the rest is read and dropped as it arrives, and counted in "
                    "stdoutDroppedBytes / stderrDroppedBytes (stdoutTruncated / stderrTruncated "
                    "say whether any was). A large body is sent chunked. For all of a command's "
                    "output, use the exec WebSocket."
                ),
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": _ref(ExecRequest)}}},
                "responses": {"200": _json(ExecResult, "the command ran (any exit code)"),
                              **_errors(400, 401, 404, 409, 500, 503)},
            },
        },
        "/v1/sandboxes/{id}/exec/ws": {
            "parameters": [_ID_PARAM],
            "get": {
                "summary": "Run a command, streaming its events over a WebSocket",
                "description": (
                    "Upgrade to a WebSocket (token in the Authorization header or the `token` "
                    "query parameter). Send one ExecRequest as the first text message; the "
                    "server then sends every SandboxEventView (starting, ready, stdout, stderr, "
                    "violation, killed, exit) and closes after exit. Later client messages are "
                    "ExecStreamInput. Closing the socket kills the command. A refused request "
                    "gets one ErrorBody message and close code 4000 + its HTTP status."
                ),
                "responses": {"101": {"description": "switching to WebSocket"},
                              **_errors(401, 404)},
            },
        },
        "/v1/sandboxes/{id}/session/ws": {
            "parameters": [_ID_PARAM],
            "get": {
                "summary": "Run many commands over one WebSocket (the session stream), every "
                           "frame tagged with the client's command id",
                "description": (
                    "For a client that runs many commands in one sandbox: one upgrade instead "
                    "of one per command. Client messages are SessionStreamInput: "
                    '`{"id": "c1", "exec": ExecRequest}` starts a command (ids are the '
                    "client's, unique among the stream's running commands, free again after "
                    "the command's exit); `{\"id\": \"c1\", \"stdin\": ...}`, stdinBase64, "
                    "stdinClose and kill go to that running command; egressAnswer answers an "
                    "egress-request. The server sends the exec WebSocket's SandboxEventView "
                    'frames with `"id"` added. A message it cannot act on (unreadable, binary, '
                    "an unknown or running id, a refused exec: that command never ran) gets "
                    '`{"type": "error", "id", "status", "error", "message", "fix"}` (id null '
                    "when none could be read) and the stream goes on. At most "
                    f"{SESSION_MAX_COMMANDS} commands run at once on one stream, "
                    f"{SESSION_INPUT_QUEUE} messages wait per command, and stdin not written "
                    f"yet (an exec's own included) is held up to {SESSION_STDIN_BYTES} bytes "
                    f"per command and {SESSION_STREAM_STDIN_BYTES} per stream (LimitReached, "
                    "429, past any of them: that message is not taken). Closing the socket "
                    "kills every command still running on it (reason disconnected). A stream "
                    "is bound to the sandbox it was opened on: once that sandbox is destroyed "
                    "its commands end, every further message gets a Closed (409) error frame "
                    "(a new sandbox that took the id is never reached), and the server closes "
                    "the stream once no command runs. An "
                    "unknown sandbox gets one ErrorBody message and close code 4404. The exec "
                    "WebSocket stays for one command at a time."
                ),
                "responses": {"101": {"description": "switching to WebSocket"},
                              **_errors(401, 404)},
            },
        },
        "/v1/sandboxes/{id}/egress/ws": {
            "parameters": [_ID_PARAM],
            "get": {
                "summary": "The sandbox's egress as it happens, over a WebSocket",
                "description": (
                    "First an `egress` frame (an EgressView), then `egress-changed`, "
                    "`egress-request` and `violation` frames (SandboxEventView fields) for the "
                    "whole session, whichever command caused them. Client messages are "
                    "EgressStreamInput (answer a request). Closes when the sandbox is destroyed."
                ),
                "responses": {"101": {"description": "switching to WebSocket"},
                              **_errors(401, 404, 409)},
            },
        },
        "/v1/sandboxes/{id}/kill": {
            "parameters": [_ID_PARAM],
            "post": {
                "summary": "Kill the sandbox's running commands (the sandbox stays)",
                "responses": {"200": _json(KillResult, "killed"), **_errors(401, 404)},
            },
        },
        "/v1/sandboxes/{id}/egress": {
            "parameters": [_ID_PARAM],
            "get": {
                "summary": "The sandbox's egress allowlist and deny list now",
                "responses": {"200": _json(EgressView, "the allowlist"), **_errors(401, 404)},
            },
            "patch": {
                "summary": "Remove, then add, allowlist entries (host[:port]); the sandbox's "
                           "next connection is checked against the result, an open tunnel goes "
                           "on; each change is an `egress-changed` event and a log line",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref(EgressChangeRequest)}}},
                "responses": {"200": _json(EgressView, "the allowlist after the change"),
                              **_errors(400, 401, 404, 409)},
            },
        },
        "/v1/sandboxes/{id}/egress/requests/{request}": {
            "parameters": [_ID_PARAM, {"name": "request", "in": "path", "required": True,
                                       "schema": {"type": "string"},
                                       "description": "The egress-request event's id"}],
            "post": {
                "summary": "Answer a connection held for an answer (sandbox created with "
                           "egress: ask): once, session (adds its host:port) or deny",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref(EgressAnswerRequest)}}},
                "responses": {"200": _json(EgressRequestView, "the request answered"),
                              **_errors(400, 401, 404, 409)},
            },
        },
        "/v1/sandboxes/{id}/suspend": {
            "parameters": [_ID_PARAM],
            "post": {
                "summary": "Checkpoint a microvm sandbox to disk and end its VM (state "
                           "`suspended`); its running commands stay, frozen",
                "responses": {"200": _json(SandboxHandleView, "the sandbox, suspended"),
                              **_errors(401, 404, 409, 500)},
            },
        },
        "/v1/sandboxes/{id}/resume": {
            "parameters": [_ID_PARAM],
            "post": {
                "summary": "Restore a suspended microvm sandbox (a warm one is left alone)",
                "responses": {"200": _json(SandboxHandleView, "the sandbox, warm"),
                              **_errors(401, 404, 409, 500)},
            },
        },
        "/v1/terminals": {
            "get": {
                "summary": "A terminal session: a shell on a PTY over a WebSocket",
                "description": (
                    "Query: backend=none|native (default none: the host shell), cwd=ABSOLUTE "
                    "(default $HOME), rows, cols. The first server frame is a TerminalSessionView "
                    "text frame (the badge); then output arrives as binary frames. Client binary "
                    "frames are input; client text frames are TerminalControl JSON ({resize}, "
                    "{input}) or, if not JSON, input. When the shell exits the server sends "
                    '{"type": "exit", "exitCode": N} and closes. A session that cannot start '
                    "(native on a host without a native backend) gets one ErrorBody frame and "
                    "close code 4000 + its HTTP status; no shell runs. Closing the socket ends "
                    "the shell and everything it started."
                ),
                "parameters": [
                    {"name": "backend", "in": "query", "schema": {
                        "type": "string", "enum": ["none", "native"]}},
                    {"name": "cwd", "in": "query", "schema": {"type": "string"}},
                    {"name": "rows", "in": "query", "schema": {"type": "integer"}},
                    {"name": "cols", "in": "query", "schema": {"type": "integer"}},
                ],
                "responses": {"101": {"description": "switching to WebSocket"}, **_errors(401)},
            },
        },
        "/openapi.json": {"get": {
            "summary": "This document",
            "responses": {"200": {"description": "OpenAPI 3.1"}, **_errors(401)},
        }},
    }


def openapi_document() -> dict[str, Any]:
    """The whole document. Raises nothing."""
    _, components = msgspec.json.schema_components(_MODELS + REQUEST_MODELS, ref_template=_REF)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "cc-server",
            "version": __version__,
            "description": (
                "Sandboxes for AI-agent commands, and a server-hosted terminal. Every route but "
                "/healthz needs `Authorization: Bearer <token>`; the token is in the file the "
                "server names at start. BackendUnavailable answers "
                f"{BACKEND_UNAVAILABLE_STATUS}."
            ),
        },
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": {**_paths(), **openapi_paths(_ref)},
    }
