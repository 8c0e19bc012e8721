"""The dispatch API: repositories, worktrees, dispatch runs and their tools.

Routes (JSON, camelCase, bearer token like the rest):

- `POST /v1/repos` {repoId, path} registers a checkout; `GET /v1/repos` lists them.
- `POST /v1/worktrees` {repoId, conversationId} makes the conversation's worktree; `GET
  /v1/worktrees`, `GET /v1/worktrees/{id}`, `DELETE /v1/worktrees/{id}` (nothing is left).
- `POST /v1/dispatches` {worktreeId, agent, mode?, capabilities?, workspaceId?} opens a run: its
  sandbox, its guardrail chain, and for `acp` the agent's initialize and session/new. The answer
  carries the run's actual backend (its badge). `GET`, `DELETE /v1/dispatches/{id}` (teardown:
  agent, sandbox, proxies, credential grant, state).
- `POST /v1/dispatches/{id}/claude` {args, stdin?, timeoutS?} runs the Claude Code CLI (seam 1).
- `POST /v1/dispatches/{id}/bash` {command, timeoutS?, maxOutputBytes?} the harness bash tool.
- `POST /v1/dispatches/{id}/tools/{tool}` the in-process file tools (read, write, edit,
  apply_patch, search, find, search_files).
- `POST /v1/dispatches/{id}/acp/prompt` {text} one prompt to the ACP agent.

A refused action answers 403 with the guardrail's message; a dispatch the host cannot enforce
(Linux native without create-time rules) answers 409 BackendUnavailable with the reason; a run
past `dispatch.service.MAX_RUNS` live ones answers 429 LimitReached. Every status comes from the
server's one table (`server/status.py`).

The operator configures dispatch through the server's environment (paths only, never secrets):
`CC_SERVER_CLAUDE_PATH`, `CC_SERVER_ACP_AGENT` (a command line), `CC_SERVER_AGENT_DIRS`
(':'-separated read-only binds the agents need; by default the `node_modules` tree or directory
of each agent program), `CC_SERVER_DISPATCH_DIR` (worktrees and run state; by default
`$XDG_STATE_HOME/cc-server` or `~/.local/state/cc-server`) and `CC_SERVER_GITHUB_TOKEN_FILE`
(the credential broker's GitHub token). The dispatch egress is the operator's too
(`egress.operator`): `cc-server serve --dispatch-allow-domain PATTERN` and
`CC_SERVER_DISPATCH_ALLOW_DOMAINS` extend every run's baseline allowlist, and the agents' model
endpoint `ANTHROPIC_BASE_URL` is passed to every agent and allowed on its port. The agents' model
key is brokered per run (`dispatch.model_credentials`): `CC_SERVER_MODEL_KEY_FILE` (the key,
read once at boot; the agents get a sentinel that the session's proxy swaps for it on the model
host only) and `CC_SERVER_MODEL_CA_FILE` (a CA to trust for that host's certificate).

A problem of the server's own configuration that only shows at dispatch (its environment would
put a secret-like variable's value into the run's, or the agent asked for is not configured)
answers 409 with the fix (and the variables), never 500: the operator fixes it, not the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import msgspec
from aiohttp import web

from cc_server.dispatch.acp import prompt_acp
from cc_server.dispatch.actions import ActionRefused
from cc_server.dispatch.claude import run_claude
from cc_server.dispatch.service import AgentKind, DispatchService
from cc_server.dispatch.setup import open_dispatch_run, open_service
from cc_server.dispatch.tools import TOOL_NAMES, ToolRequest, call_tool
from cc_server.errors import BadSpec
from cc_server.policy import AgentCapabilities, Mode
from cc_server.runtime.port import SandboxManager
from cc_server.server.egress_api import answer_request, change_egress, egress_view
from cc_server.server.logs import log_event
from cc_server.server.models import EgressAnswerRequest, EgressChangeRequest
from cc_server.server.status import Refused, refusal

__all__ = [
    "DISPATCH",
    "REQUEST_MODELS",
    "install_dispatch",
    "openapi_paths",
    "routes",
]

MAX_BODY_BYTES: Final = 32 * 1024 * 1024  # a file write through the tools API

routes = web.RouteTableDef()
DISPATCH: Final = web.AppKey("cc_server_dispatch", DispatchService)


class _Body(msgspec.Struct, rename="camel", forbid_unknown_fields=True, kw_only=True):
    pass


class RegisterRepo(_Body):
    repo_id: str  # the repository's id (letters, digits, '.', '_', '-')
    path: str  # absolute path of the checkout on the server's host


class CreateWorktree(_Body):
    repo_id: str  # a registered repository
    conversation_id: str  # the conversation the worktree belongs to


class OpenDispatch(_Body):
    worktree_id: str  # the conversation's worktree
    agent: AgentKind = AgentKind.HARNESS  # claude, acp, or harness (tools only)
    mode: Mode = Mode.CHAT  # carves the write rules and the tool surface
    capabilities: AgentCapabilities | None = None  # None: safeDefault
    workspace_id: str = "default"  # the owning workspace


class ClaudeRequest(_Body):
    args: list[str]  # arguments after the CLI's path (`["--version"]`, `["-p", "hi"]`)
    env: dict[str, str] | None = None  # added variables (checked: never a secret-named one)
    stdin: str | None = None
    timeout_s: float | None = None
    max_output_bytes: int | None = None


class BashRequest(_Body):
    command: str | list[str]  # a shell string (bash -c) or an argv
    timeout_s: float | None = None
    max_output_bytes: int | None = None


class PromptRequest(_Body):
    text: str


def install_dispatch(app: web.Application, manager: SandboxManager, *,
                     server_private: Sequence[str] = (),
                     environ: Mapping[str, str] = os.environ,
                     allow_domains: Sequence[str] = ()) -> DispatchService:
    """Build the dispatch service from the environment, add its routes, and close it with the
    app.

    Raises:
        what `dispatch.setup.open_service` raises.
    """
    service = open_service(manager, server_private=server_private, environ=environ,
                           allow_domains=allow_domains)
    worktrees, config = service.worktrees, service.config
    creds = config.model_credentials
    if worktrees.choice is not None:
        log_event("dispatch", worktrees.choice.describe(), strategy=str(worktrees.strategy))
    egress = config.operator_egress
    if creds is not None:
        log_event("dispatch", f"dispatch model key brokered per run for {creds.host}:"
                  f"{creds.port} (the agents get a sentinel)", modelKeyFile=creds.key_file)
    if egress.rules:
        log_event("dispatch", "dispatch egress: the baseline plus "
                  + ", ".join(str(rule) for rule in egress.rules),
                  allowDomains=list(egress.patterns), modelUrl=egress.model_url)
    app[DISPATCH] = service
    app.router.add_routes(routes)

    async def _close(_app: web.Application) -> None:
        await service.aclose()

    app.on_cleanup.append(_close)
    return service


# --- helpers -------------------------------------------------------------------------------------


def _not_found(what: str, key: str) -> Refused:
    return Refused(404, "NotFound", f"no {what} {key!r}")


async def _body(request: web.Request, kind: type[Any]) -> Any:
    data = await request.content.read(MAX_BODY_BYTES + 1)
    if len(data) > MAX_BODY_BYTES:
        raise Refused(413, "TooLarge", f"the body is over {MAX_BODY_BYTES} bytes")
    try:
        return msgspec.json.decode(data, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise Refused(400, "BadRequest", f"invalid {kind.__name__}: {exc}",
                      "see /openapi.json for the body's schema") from None


def _service(request: web.Request) -> DispatchService:
    return request.app[DISPATCH]


# --- repositories and worktrees ------------------------------------------------------------------


@routes.post("/v1/repos")
async def register_repo(request: web.Request) -> web.StreamResponse:
    """Register a checkout."""
    body: RegisterRepo = await _body(request, RegisterRepo)
    repo = _service(request).worktrees.register(body.repo_id, body.path)
    return web.json_response(repo.to_json(), status=201)


@routes.get("/v1/repos")
async def list_repos(request: web.Request) -> web.StreamResponse:
    """Every registered checkout."""
    repos = _service(request).worktrees.repos.values()
    return web.json_response({"repos": [r.to_json() for r in repos]})


@routes.post("/v1/worktrees")
async def create_worktree(request: web.Request) -> web.StreamResponse:
    """Make a conversation's worktree."""
    body: CreateWorktree = await _body(request, CreateWorktree)
    wt = _service(request).worktrees.create(body.repo_id, body.conversation_id)
    log_event("worktree.created", f"worktree {wt.worktree_id} ({wt.strategy})",
              worktreeId=wt.worktree_id, strategy=str(wt.strategy))
    return web.json_response(wt.to_json(), status=201,
                             headers={"Location": f"/v1/worktrees/{wt.worktree_id}"})


@routes.get("/v1/worktrees")
async def list_worktrees(request: web.Request) -> web.StreamResponse:
    """Every worktree."""
    return web.json_response({"worktrees": [w.to_json() for w in
                                            _service(request).worktrees.list()]})


@routes.get("/v1/worktrees/{id}")
async def get_worktree(request: web.Request) -> web.StreamResponse:
    """One worktree."""
    key = request.match_info["id"]
    wt = _service(request).worktrees.worktrees.get(key)
    if wt is None:
        raise _not_found("worktree", key)
    return web.json_response(wt.to_json())


@routes.delete("/v1/worktrees/{id}")
async def remove_worktree(request: web.Request) -> web.StreamResponse:
    """Remove a worktree (idempotent); refused while a live run uses it."""
    service = _service(request)
    key = request.match_info["id"]
    users = service.runs_using(key)
    if users:
        raise Refused(409, "Conflict", f"worktree {key!r} is used by {users}",
                      "close those dispatch runs first")
    if service.worktrees.remove(key):
        log_event("worktree.removed", f"worktree {key} removed", worktreeId=key)
    return web.Response(status=204)


# --- dispatch runs -------------------------------------------------------------------------------


@routes.post("/v1/dispatches")
async def open_dispatch(request: web.Request) -> web.StreamResponse:
    """Open a run (and, for `acp`, complete the agent's handshake)."""
    service = _service(request)
    body: OpenDispatch = await _body(request, OpenDispatch)
    if body.worktree_id not in service.worktrees.worktrees:
        raise _not_found("worktree", body.worktree_id)
    run = await open_dispatch_run(service, worktree_id=body.worktree_id, agent=body.agent,
                                  mode=body.mode, capabilities=body.capabilities,
                                  workspace_id=body.workspace_id)
    log_event("dispatch.opened", f"run {run.run_id} ({run.agent}, {run.backend})",
              runId=run.run_id, agent=str(run.agent), backend=str(run.backend))
    return web.json_response(_run_json(run), status=201,
                             headers={"Location": f"/v1/dispatches/{run.run_id}"})


def _run_json(run: Any) -> dict[str, Any]:
    out: dict[str, Any] = run.to_json()
    if run.acp is not None:
        out["acp"] = run.acp.to_json()
    return out


@contextlib.contextmanager
def _refusals_of(run: Any) -> Iterator[None]:
    """A guardrail's refusal of one of `run`'s actions is a violation of the run (kept, audited)
    and the 403 carries it with its notice."""
    try:
        yield
    except ActionRefused as exc:
        violation = run.violations.refused(exc)
        raise refusal(exc, violations=[violation.to_json()], notice=violation.notice) from None


def _run(request: web.Request) -> Any:
    key = request.match_info["id"]
    run = _service(request).runs.get(key)
    if run is None:
        raise _not_found("dispatch run", key)
    return run


@routes.get("/v1/dispatches")
async def list_dispatches(request: web.Request) -> web.StreamResponse:
    """Every live run."""
    return web.json_response({"dispatches": [_run_json(r) for r in
                                             _service(request).runs.values()]})


@routes.get("/v1/dispatches/{id}")
async def get_dispatch(request: web.Request) -> web.StreamResponse:
    """One run: backend, state, violations, ACP exchanges."""
    return web.json_response(_run_json(_run(request)))


@routes.delete("/v1/dispatches/{id}")
async def close_dispatch(request: web.Request) -> web.StreamResponse:
    """Tear a run down (idempotent)."""
    key = request.match_info["id"]
    if await _service(request).close_run(key):
        log_event("dispatch.closed", f"run {key} closed", runId=key)
    return web.Response(status=204)


@routes.get("/v1/dispatches/{id}/egress")
async def get_dispatch_egress(request: web.Request) -> web.StreamResponse:
    """The run's egress allowlist now (server/egress_api.py)."""
    return web.json_response(egress_view(_run(request).handle))


@routes.patch("/v1/dispatches/{id}/egress")
async def patch_dispatch_egress(request: web.Request) -> web.StreamResponse:
    """Remove, then add, entries of the run's allowlist, for its next connection."""
    run = _run(request)
    body: EgressChangeRequest = await _body(request, EgressChangeRequest)
    return web.json_response(change_egress(run.handle, body, by="dispatch",
                                           runId=request.match_info["id"]))


@routes.post("/v1/dispatches/{id}/egress/requests/{request}")
async def answer_dispatch_egress_request(request: web.Request) -> web.StreamResponse:
    """Answer a connection of the run held for an answer (once, session or deny)."""
    run = _run(request)
    body: EgressAnswerRequest = await _body(request, EgressAnswerRequest)
    try:
        answered = answer_request(run.handle, request.match_info["request"], body.answer)
    except BadSpec as exc:  # no such request waits
        raise Refused(404, "NotFound", exc.message, exc.fix) from None
    return web.json_response(answered)


@routes.post("/v1/dispatches/{id}/claude")
async def claude(request: web.Request) -> web.StreamResponse:
    """Run the Claude Code CLI in the run's sandbox."""
    run = _run(request)
    body: ClaudeRequest = await _body(request, ClaudeRequest)
    with _refusals_of(run):
        result = await run_claude(
            run, body.args, env=body.env,
            stdin=None if body.stdin is None else body.stdin.encode(),
            timeout_s=body.timeout_s, max_output_bytes=body.max_output_bytes)
    return web.json_response({**result.to_json(), "backend": str(run.backend)})


@routes.post("/v1/dispatches/{id}/bash")
async def bash(request: web.Request) -> web.StreamResponse:
    """The harness bash tool."""
    run = _run(request)
    body: BashRequest = await _body(request, BashRequest)
    with _refusals_of(run):
        result = await run.harness.run(body.command, timeout_s=body.timeout_s,
                                       max_output_bytes=body.max_output_bytes)
    return web.json_response({**result.to_json(), "backend": str(run.backend)})


@routes.post("/v1/dispatches/{id}/tools/{tool}")
async def file_tool(request: web.Request) -> web.StreamResponse:
    """One in-process file tool call."""
    run = _run(request)
    tool = request.match_info["tool"]
    b: ToolRequest = await _body(request, ToolRequest)
    if tool not in TOOL_NAMES:
        raise _not_found("tool", tool)
    # The tools block (a search may run up to its deadline): off the event loop.
    with _refusals_of(run):
        return web.json_response(await asyncio.to_thread(call_tool, run.tools, tool, b))


@routes.post("/v1/dispatches/{id}/acp/prompt")
async def acp_prompt(request: web.Request) -> web.StreamResponse:
    """One prompt to the run's ACP agent."""
    run = _run(request)
    body: PromptRequest = await _body(request, PromptRequest)
    return web.json_response(await prompt_acp(run, body.text))


# --- OpenAPI -------------------------------------------------------------------------------------

REQUEST_MODELS: Final = (
    RegisterRepo, CreateWorktree, OpenDispatch, ClaudeRequest, BashRequest, ToolRequest,
    PromptRequest,
)
_OBJECT: Final = {"type": "object"}


def openapi_paths(ref: Any) -> dict[str, Any]:
    """The dispatch routes for the OpenAPI document; `ref(model)` names a component schema."""

    def body(model: type) -> dict[str, Any]:
        return {"required": True, "content": {"application/json": {"schema": ref(model)}}}

    def answer(description: str, *codes: int) -> dict[str, Any]:
        out: dict[str, Any] = {str(codes[0]): {"description": description, "content": {
            "application/json": {"schema": _OBJECT}}}}
        reasons = {400: "bad input; nothing was created or run", 401: "no or wrong token",
                   403: "a guardrail refused the action (ActionRefused names it)",
                   404: "unknown repository, worktree, run or tool",
                   409: "conflict, the backend cannot enforce the dispatch policy here, or the "
                        "server's configuration keeps it from being served (ConfigError)",
                   429: "too many runs are live (LimitReached): close one",
                   500: "the isolation or the agent failed; nothing is left running"}
        for code in codes[1:]:
            out[str(code)] = {"description": reasons[code]}
        return out

    run_id = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "/v1/repos": {
            "post": {"summary": "Register a checkout (never written by agents)",
                     "requestBody": body(RegisterRepo),
                     "responses": answer("registered", 201, 400, 401)},
            "get": {"summary": "List registered checkouts",
                    "responses": answer("the repositories", 200, 401)},
        },
        "/v1/worktrees": {
            "post": {"summary": "Make a conversation's copy-on-write worktree",
                     "requestBody": body(CreateWorktree),
                     "responses": answer("created (strategy: overlay, reflink or git)",
                                         201, 400, 401, 500)},
            "get": {"summary": "List worktrees", "responses": answer("the worktrees", 200, 401)},
        },
        "/v1/worktrees/{id}": {
            "parameters": [run_id],
            "get": {"summary": "One worktree", "responses": answer("the worktree", 200, 401, 404)},
            "delete": {"summary": "Remove a worktree: no mount, directory or git entry is left",
                       "responses": {"204": {"description": "removed, or was not there"},
                                     "409": {"description": "a live run uses it"}}},
        },
        "/v1/dispatches": {
            "post": {"summary": "Open a dispatch run (sandbox, guardrails, agent handshake)",
                     "requestBody": body(OpenDispatch),
                     "responses": answer("the run, with its actual backend",
                                         201, 400, 401, 403, 404, 409, 429, 500)},
            "get": {"summary": "List live runs", "responses": answer("the runs", 200, 401)},
        },
        "/v1/dispatches/{id}": {
            "parameters": [run_id],
            "get": {"summary": "One run", "responses": answer("the run", 200, 401, 404)},
            "delete": {"summary": "Tear a run down: agent, sandbox, proxies, credentials, state",
                       "responses": {"204": {"description": "closed, or was not live"}}},
        },
        "/v1/dispatches/{id}/egress": {
            "parameters": [run_id],
            "get": {"summary": "The run's egress allowlist and deny list now",
                    "responses": answer("the allowlist (EgressView)", 200, 401, 404, 409)},
            "patch": {"summary": "Remove, then add, allowlist entries (host[:port]) for the "
                                 "run's next connection (an egress-changed event, a log line); "
                                 "ask: hold unlisted targets and ask (egress-request)",
                      "requestBody": body(EgressChangeRequest),
                      "responses": answer("the allowlist after it (EgressView)",
                                          200, 400, 401, 404, 409)},
        },
        "/v1/dispatches/{id}/egress/requests/{request}": {
            "parameters": [run_id, {"name": "request", "in": "path", "required": True,
                                    "schema": {"type": "string"}}],
            "post": {"summary": "Answer a held connection of the run: once, session or deny",
                     "requestBody": body(EgressAnswerRequest),
                     "responses": answer("the request answered", 200, 400, 401, 404, 409)},
        },
        "/v1/dispatches/{id}/claude": {
            "parameters": [run_id],
            "post": {"summary": "Run the Claude Code CLI in the run's sandbox (seam 1)",
                     "requestBody": body(ClaudeRequest),
                     "responses": answer("exit code, bounded output, violations",
                                         200, 400, 401, 403, 404, 500)},
        },
        "/v1/dispatches/{id}/bash": {
            "parameters": [run_id],
            "post": {"summary": "The harness bash tool",
                     "requestBody": body(BashRequest),
                     "responses": answer("exit code, bounded output, violations",
                                         200, 400, 401, 403, 404, 500)},
        },
        "/v1/dispatches/{id}/tools/{tool}": {
            "parameters": [run_id, {"name": "tool", "in": "path", "required": True,
                                    "schema": {"type": "string",
                                               "enum": list(TOOL_NAMES)}}],
            "post": {"summary": "One in-process file tool call (outside any sandbox; the tool "
                                "enforces the run's policy itself)",
                     "requestBody": body(ToolRequest),
                     "responses": answer("the tool's result", 200, 400, 401, 403, 404)},
        },
        "/v1/dispatches/{id}/acp/prompt": {
            "parameters": [run_id],
            "post": {"summary": "Send one prompt to the run's ACP agent",
                     "requestBody": body(PromptRequest),
                     "responses": answer("the stop reason and the ACP exchanges so far",
                                         200, 400, 401, 404, 500)},
        },
    }
