"""The app in process: /healthz never touches the probe, and logs are one line per event."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from cc_server.backends import probe as probe_module
from cc_server.backends.probe import ProbeResult
from cc_server.policy import HostFacts, Platform
from cc_server.runtime.port import SandboxManager
from cc_server.server.app import build_app
from cc_server.server.logs import configure_logging, log_event
from cc_server.server.state import ServerState
from cc_server.terminal import TerminalSessionService


@pytest.fixture
async def client(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    def no_probe(*_args: object, **_kwargs: object) -> ProbeResult:
        raise AssertionError("the probe ran after boot")

    monkeypatch.setattr(probe_module, "probe", no_probe)
    monkeypatch.setattr(probe_module, "boot_probe", no_probe)
    result = ProbeResult(platform=Platform.LINUX, available=False, hint="h")
    manager = SandboxManager(probe_result=result, host=HostFacts.current())
    state = ServerState(manager=manager, terminals=TerminalSessionService(manager),
                        token_path="/nonexistent/token")
    async with TestClient(TestServer(build_app(state, "tok"))) as test_client:
        yield test_client


async def test_healthz_is_ok_only(client: TestClient[web.Request, web.Application]) -> None:
    async with client.get("/healthz") as response:
        assert response.status == 200
        assert await response.json() == {"status": "ok"}


async def test_routes_answer_json_errors(
    client: TestClient[web.Request, web.Application],
) -> None:
    headers = {"Authorization": "Bearer tok"}
    async with client.get("/v1/sandboxes/x", headers=headers) as response:
        assert response.status == 404
        assert (await response.json())["error"] == "NotFound"
    async with client.post("/v1/sandboxes", headers=headers, json={
        "spec": {"sessionId": "s", "workspaceId": "w"}, "backend": "native",
    }) as response:
        assert response.status == 409  # the fake probe found no backend
        assert (await response.json())["error"] == "BackendUnavailable"


def test_text_and_json_log_lines() -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    stream = io.StringIO()
    try:
        configure_logging(as_json=False, stream=stream)
        log_event("sandbox", "agent sandbox ON (x)", available=True, path="/a b")
        configure_logging(as_json=True, stream=stream)
        log_event("listening", "up\nand running", port=1)
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
    text, as_json = stream.getvalue().splitlines()
    assert text.endswith(' info sandbox: agent sandbox ON (x) available=True path="/a b"')
    record = json.loads(as_json)
    assert record["event"] == "listening" and record["port"] == 1
    assert record["message"] == "up\nand running" and record["level"] == "info"
