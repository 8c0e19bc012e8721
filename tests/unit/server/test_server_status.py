"""One status table for every route: each error type's HTTP status, the one middleware that
answers with it, and the sandbox API's answer for a destroyed sandbox."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from cc_server import errors
from cc_server.backends.probe import ProbeResult
from cc_server.dispatch.actions import Action, ActionKind, ActionRefused
from cc_server.dispatch.env import EnvRefused
from cc_server.dispatch.modes import InvalidCommandPolicy
from cc_server.errors import CcServerError
from cc_server.policy import HostFacts, Mode, Platform
from cc_server.runtime.port import SandboxManager
from cc_server.server.app import build_app
from cc_server.server.config import ServerConfigError
from cc_server.server.state import ServerState
from cc_server.server.status import STATUSES, Refused, answer_errors, refusal, status_for
from cc_server.terminal import TerminalSessionService

ACTION = Action(kind=ActionKind.BASH, tool="bash", session_id="s", mode=Mode.PLAN, argv=("rm",))


@pytest.mark.parametrize(("exc", "status"), [
    (errors.BadSpec("b"), 400),
    (EnvRefused("a caller's secret", variable="TOKEN"), 400),
    (EnvRefused("the server's secret", variable="HOME", operator=True), 409),
    (ActionRefused(ACTION, "command-policy", "not in plan mode"), 403),
    (errors.EgressDenied("e"), 403),
    (errors.Closed("sandbox 's' is destroyed; launch a new one"), 409),
    (errors.LimitReached("64 runs are live"), 429),
    (errors.ConfigError("CC_SERVER_CLAUDE_PATH must be absolute"), 409),
    (ServerConfigError("--port must be 0..65535"), 409),
    (errors.BackendUnavailable("no bwrap"), 409),
    (errors.EnforcementFailed("e"), 500),
    (InvalidCommandPolicy("command_policy.toml: bad"), 500),
    (CcServerError("anything else"), 500),
], ids=lambda value: type(value).__name__ if isinstance(value, Exception) else str(value))
def test_each_error_type_has_its_status(exc: CcServerError, status: int) -> None:
    assert status_for(exc) == status
    answer = refusal(exc)
    assert (answer.status, answer.body["error"], answer.body["message"]) == (
        status, type(exc).__name__, exc.message)


def test_every_error_type_of_the_errors_module_has_a_row() -> None:
    declared = {
        value for value in vars(errors).values()
        if inspect.isclass(value) and issubclass(value, CcServerError)
        and value is not CcServerError
    }
    assert declared <= {kind for kind, _ in STATUSES}, declared


def test_a_refusal_carries_what_its_type_adds_and_the_callers_fields() -> None:
    refused = refusal(ActionRefused(ACTION, "command-policy", "not in plan mode", fix="chat"),
                      notice="n")
    assert refused.body == {
        "error": "ActionRefused", "message": refused.body["message"], "fix": "chat",
        "guardrail": "command-policy", "notice": "n",
    }
    env = refusal(EnvRefused("m", variable="HOME", host_variable="DEPLOY_TOKEN_DIR"))
    assert (env.body["variable"], env.body["hostVariable"]) == ("HOME", "DEPLOY_TOKEN_DIR")


async def _raises(request: web.Request) -> web.StreamResponse:
    raise {
        "closed": errors.Closed("sandbox 's' is destroyed; launch a new one",
                                fix="launch a new one"),
        "limit": errors.LimitReached("64 runs are live", fix="close one"),
        "config": errors.ConfigError("no claude agent is configured on this server"),
        "refused": Refused(413, "TooLarge", "the body is over 1 bytes", size=2),
    }[request.match_info["what"]]


@pytest.fixture
async def raising() -> AsyncIterator[TestClient[Any, Any]]:
    app = web.Application(middlewares=[answer_errors])
    app.router.add_get("/{what}", _raises)
    async with TestClient(TestServer(app)) as client:
        yield client


@pytest.mark.parametrize(("what", "status", "body"), [
    ("closed", 409, {"error": "Closed", "message": "sandbox 's' is destroyed; launch a new one",
                     "fix": "launch a new one"}),
    ("limit", 429, {"error": "LimitReached", "message": "64 runs are live", "fix": "close one"}),
    ("config", 409, {"error": "ConfigError",
                     "message": "no claude agent is configured on this server", "fix": None}),
    ("refused", 413, {"error": "TooLarge", "message": "the body is over 1 bytes", "fix": None,
                      "size": 2}),
])
async def test_the_middleware_answers_every_route_from_the_table(
    raising: TestClient[Any, Any], what: str, status: int, body: dict[str, Any]
) -> None:
    async with raising.get(f"/{what}") as response:
        assert response.status == status
        assert await response.json() == body


@pytest.fixture
async def server_app() -> AsyncIterator[tuple[TestClient[Any, Any], SandboxManager]]:
    result = ProbeResult(platform=Platform.LINUX, available=False, hint="h")
    manager = SandboxManager(probe_result=result, host=HostFacts.current())
    state = ServerState(manager=manager, terminals=TerminalSessionService(manager),
                        token_path="/nonexistent/token")
    try:
        async with TestClient(TestServer(build_app(state, "tok"))) as client:
            yield client, manager
    finally:
        await manager.aclose()


async def test_a_destroyed_sandbox_answers_409_closed_not_400(
    server_app: tuple[TestClient[Any, Any], SandboxManager],
) -> None:
    client, manager = server_app
    headers = {"Authorization": "Bearer tok"}
    async with client.post("/v1/sandboxes", headers=headers, json={
        "spec": {"sessionId": "gone", "workspaceId": "w"}, "backend": "none",
    }) as response:
        assert response.status == 201, await response.text()
    await manager.handles["gone"].destroy()  # destroyed under the API, still listed
    async with client.post("/v1/sandboxes/gone/exec", headers=headers,
                           json={"argv": ["true"]}) as response:
        assert response.status == 409
        body = await response.json()
    assert body["error"] == "Closed" and "launch a new one" in body["message"]
