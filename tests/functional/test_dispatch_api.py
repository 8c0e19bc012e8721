"""The dispatch API: in process over a real DispatchService (for guardrails and probes the tests
choose), and once through the real `cc-server serve` process configured by its environment."""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import os
import pathlib
import shutil
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from dispatch_kit import (
    ACP_AGENT_BIN,
    ACP_AGENT_NAME,
    CLAUDE_BIN,
    CLAUDE_VERSION,
    Dispatch,
    dispatch_app,
    make_repo,
    need_npm_agents,
    open_dispatch,
)
from server_kit import running_server

from cc_server.backends.probe import ProbeResult
from cc_server.dispatch import service as service_module
from cc_server.dispatch.actions import Action
from cc_server.dispatch.worktrees import mounted_under

pytestmark = pytest.mark.integration


class _Broken:
    """An operator guardrail with a bug: it raises on every action."""

    name = "operator-broken"

    def check(self, action: Action) -> None:
        raise RuntimeError("lookup table missing")


@pytest.fixture
async def api(tmp_path: pathlib.Path,
              probe_result: ProbeResult) -> AsyncIterator[tuple[TestClient[Any, Any], Dispatch]]:
    async with open_dispatch(tmp_path, probe_result) as d, \
            TestClient(TestServer(dispatch_app(d.service))) as client:
        yield client, d


async def _worktree(client: TestClient[Any, Any], conversation: str = "c1") -> dict[str, Any]:
    resp = await client.post("/v1/worktrees", json={"repoId": "r", "conversationId": conversation})
    assert resp.status == 201, await resp.text()
    body: dict[str, Any] = await resp.json()
    return body


async def test_worktrees_are_created_listed_and_removed_through_the_api(
    api: tuple[TestClient[Any, Any], Dispatch]
) -> None:
    client, d = api
    other = make_repo(d.tmp / "other")
    resp = await client.post("/v1/repos", json={"repoId": "other", "path": str(other)})
    assert resp.status == 201
    assert {r["repoId"] for r in (await (await client.get("/v1/repos")).json())["repos"]} == {
        "r", "other"}
    wt = await _worktree(client)
    assert wt["original"] == str(d.repo) and wt["strategy"] == str(d.worktrees.strategy)
    listed = (await (await client.get("/v1/worktrees")).json())["worktrees"]
    assert [w["worktreeId"] for w in listed] == [wt["worktreeId"]]
    assert (await client.get(f"/v1/worktrees/{wt['worktreeId']}")).status == 200
    assert (await client.delete(f"/v1/worktrees/{wt['worktreeId']}")).status == 204
    assert (await client.delete(f"/v1/worktrees/{wt['worktreeId']}")).status == 204
    assert (await client.get(f"/v1/worktrees/{wt['worktreeId']}")).status == 404
    assert os.listdir(d.worktrees.base) == [] and mounted_under(str(d.tmp)) == []


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/repos", {"repoId": "x", "path": "relative"}, 400),
        ("/v1/repos", {"repoId": "x", "path": "/", "extra": 1}, 400),
        ("/v1/worktrees", {"repoId": "nope", "conversationId": "c"}, 400),
        ("/v1/worktrees", {"repoId": "r", "conversationId": "../c"}, 400),
        ("/v1/dispatches", {"worktreeId": "missing"}, 404),
        ("/v1/dispatches", {"worktreeId": "w", "mode": "yolo"}, 400),
    ],
)
async def test_bad_requests_are_refused_and_create_nothing(
    api: tuple[TestClient[Any, Any], Dispatch], path: str, body: dict[str, Any], status: int
) -> None:
    client, d = api
    resp = await client.post(path, json=body)
    assert resp.status == status, await resp.text()
    assert (await resp.json())["message"]
    assert d.worktrees.worktrees == {} and d.service.runs == {}
    assert os.listdir(d.worktrees.base) == []


async def test_too_many_live_runs_answer_429_and_launch_nothing(
    api: tuple[TestClient[Any, Any], Dispatch], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, d = api
    wt = await _worktree(client)
    monkeypatch.setattr(service_module, "MAX_RUNS", 0)  # the limit, reached before any run
    resp = await client.post("/v1/dispatches", json={"worktreeId": wt["worktreeId"]})
    assert resp.status == 429, await resp.text()
    body = await resp.json()
    assert body["error"] == "LimitReached" and "DELETE /v1/dispatches" in body["fix"]
    assert d.service.runs == {} and d.manager.handles == {}


async def test_an_agent_the_operator_did_not_configure_answers_409(
    api: tuple[TestClient[Any, Any], Dispatch]
) -> None:
    """The caller cannot fix it (not a 400) and nothing broke (not a 500): the operator's."""
    client, d = api
    wt = await _worktree(client)
    d.service.config = dataclasses.replace(d.service.config, claude_path=None)
    resp = await client.post("/v1/dispatches",
                             json={"worktreeId": wt["worktreeId"], "agent": "claude"})
    assert resp.status == 409, await resp.text()
    body = await resp.json()
    assert body["error"] == "ConfigError" and "CC_SERVER_CLAUDE_PATH" in body["fix"]
    assert d.service.runs == {} and d.manager.handles == {}


async def test_a_dispatch_whose_guardrail_raises_is_refused(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    async with open_dispatch(tmp_path, probe_result, guardrails=[_Broken()]) as d, \
            TestClient(TestServer(dispatch_app(d.service))) as client:
        wt = await _worktree(client)
        resp = await client.post("/v1/dispatches",
                                 json={"worktreeId": wt["worktreeId"], "agent": "claude"})
        assert resp.status == 403
        body = await resp.json()
        assert body["error"] == "ActionRefused" and body["guardrail"] == "operator-broken"
        assert "RuntimeError: lookup table missing" in body["message"]
        assert d.service.runs == {} and d.manager.handles == {}
        assert list((tmp_path / "runs").iterdir()) == []


async def test_native_dispatch_without_create_rules_fails_closed_with_the_reason(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    weaker = dataclasses.replace(probe_result, create_rules=False)
    async with open_dispatch(tmp_path, weaker) as d, \
            TestClient(TestServer(dispatch_app(d.service))) as client:
        wt = await _worktree(client)
        resp = await client.post("/v1/dispatches", json={"worktreeId": wt["worktreeId"]})
        assert resp.status == 409
        body = await resp.json()
        assert body["error"] == "BackendUnavailable"
        assert "cannot refuse a new name inside a writable bind" in body["message"]
        assert "scripts/bootstrap" in body["fix"] and "launch-time" in body["fix"]
        assert d.service.runs == {} and d.manager.handles == {}


async def test_a_harness_run_through_the_api(
    api: tuple[TestClient[Any, Any], Dispatch]
) -> None:
    client, d = api
    wt = await _worktree(client)
    resp = await client.post("/v1/dispatches", json={"worktreeId": wt["worktreeId"]})
    assert resp.status == 201, await resp.text()
    run = await resp.json()
    assert run["backend"] == "native" and run["sandboxed"] is True
    assert run["protectedPaths"] == [str(d.repo)]
    assert run["guardrails"] == ["tool-surface", "command-policy", "path-policy"]
    url = f"/v1/dispatches/{run['runId']}"
    bash = await (await client.post(f"{url}/bash", json={"command": "echo hi > out.txt; "
                                                                    "cat out.txt; exit 4"})).json()
    assert (bash["exitCode"], bash["stdout"]) == (4, "hi\n")
    read = await client.post(f"{url}/tools/read", json={"path": "out.txt"})
    assert (await read.json())["content"] == "hi\n"
    pem = await client.post(f"{url}/tools/write", json={"path": "id.pem", "content": "k"})
    assert pem.status == 403 and (await pem.json())["error"] == "ActionRefused"
    assert (await client.post(f"{url}/tools/chmod", json={"path": "x"})).status == 404
    busy = await client.delete(f"/v1/worktrees/{wt['worktreeId']}")
    assert busy.status == 409
    assert (await client.delete(url)).status == 204
    assert (await client.get(url)).status == 404
    assert not (d.repo / "out.txt").exists()
    assert d.manager.handles == {}


async def test_claude_and_an_acp_agent_through_the_api(
    api: tuple[TestClient[Any, Any], Dispatch]
) -> None:
    need_npm_agents()
    client, _ = api
    wt = await _worktree(client)
    resp = await client.post("/v1/dispatches", json={"worktreeId": wt["worktreeId"],
                                                     "agent": "claude", "mode": "review"})
    run = await resp.json()
    version = await (await client.post(f"/v1/dispatches/{run['runId']}/claude",
                                       json={"args": ["--version"]})).json()
    assert version["stdout"].strip() == f"{CLAUDE_VERSION} (Claude Code)"
    assert version["backend"] == "native"
    await client.delete(f"/v1/dispatches/{run['runId']}")
    resp = await client.post("/v1/dispatches", json={"worktreeId": wt["worktreeId"],
                                                     "agent": "acp"})
    assert resp.status == 201, await resp.text()
    run = await resp.json()
    assert run["acp"]["agentInfo"]["name"] == ACP_AGENT_NAME and run["acp"]["sessionId"]
    assert (await client.delete(f"/v1/dispatches/{run['runId']}")).status == 204


async def test_the_served_api_dispatches_with_the_operators_settings(
    tmp_path: pathlib.Path,
) -> None:
    need_npm_agents()
    repo = make_repo(tmp_path / "repo")
    env = {"CC_SERVER_CLAUDE_PATH": str(CLAUDE_BIN), "CC_SERVER_ACP_AGENT": str(ACP_AGENT_BIN),
           "CC_SERVER_DISPATCH_DIR": str(tmp_path / "dispatch")}
    with running_server(tmp_path, env=env) as server:
        assert any(e.get("event") == "dispatch" for e in server.log())
        async with server.client() as http:
            doc = await (await http.get("/openapi.json")).json()
            assert "/v1/dispatches/{id}/claude" in doc["paths"]
            await http.post("/v1/repos", json={"repoId": "r", "path": str(repo)})
            wt = await (await http.post("/v1/worktrees", json={
                "repoId": "r", "conversationId": "c1"})).json()
            run = await (await http.post("/v1/dispatches", json={
                "worktreeId": wt["worktreeId"], "agent": "claude"})).json()
            assert run["backend"] == "native", run
            assert run["worktree"]["path"].startswith(str(tmp_path / "dispatch"))
            out = await (await http.post(f"/v1/dispatches/{run['runId']}/claude",
                                         json={"args": ["--version"]})).json()
            assert out["stdout"].strip() == f"{CLAUDE_VERSION} (Claude Code)"
        async with aiohttp.ClientSession(server.url) as anonymous:
            assert (await anonymous.get("/v1/worktrees")).status == 401
        # Stopping the server with a run and a worktree live leaves no mount behind.
        assert server.stop() == 0
    assert mounted_under(str(tmp_path)) == []


@pytest.mark.parametrize("agent", [("/bin/sh", "-c", "echo not-acp; exit 3"),
                                   ("/bin/sh", "-c", "head -c 100 >/dev/null; exit 0")],
                         ids=["garbage-then-exit", "reads-then-exits"])
async def test_an_agent_that_does_not_speak_acp_is_refused_and_leaves_nothing(
    tmp_path: pathlib.Path, probe_result: ProbeResult, agent: tuple[str, ...]
) -> None:
    async with open_dispatch(tmp_path, probe_result, acp_agent=agent) as d, \
            TestClient(TestServer(dispatch_app(d.service))) as client:
        wt = await _worktree(client)
        resp = await client.post("/v1/dispatches", json={"worktreeId": wt["worktreeId"],
                                                         "agent": "acp"})
        assert resp.status == 500, await resp.text()
        body = await resp.json()
        assert body["error"] == "EnforcementFailed"
        assert "did not complete initialize and session/new" in body["message"]
        assert d.service.runs == {} and d.manager.handles == {}
        assert list((tmp_path / "runs").iterdir()) == []


async def test_a_killed_servers_worktrees_and_runs_are_recovered_at_the_next_boot(
    tmp_path: pathlib.Path,
) -> None:
    import signal

    from server_kit import start_server

    repo = make_repo(tmp_path / "repo")
    dispatch_dir = tmp_path / "dispatch"
    env = {"CC_SERVER_DISPATCH_DIR": str(dispatch_dir)}
    first = start_server(tmp_path, env=env)
    try:
        async with first.client() as http:
            await http.post("/v1/repos", json={"repoId": "r", "path": str(repo)})
            wt = await (await http.post("/v1/worktrees", json={
                "repoId": "r", "conversationId": "c1"})).json()
            run = await (await http.post("/v1/dispatches", json={
                "worktreeId": wt["worktreeId"]})).json()
            done = await (await http.post(f"/v1/dispatches/{run['runId']}/bash", json={
                "command": "echo kept > work.txt"})).json()
            assert done["exitCode"] == 0, done
    finally:
        first.stop(signal.SIGKILL)
        shutil.rmtree(first.runtime_dir, ignore_errors=True)
    assert (dispatch_dir / "runs" / run["runId"]).exists()  # nobody cleaned up
    with running_server(tmp_path, env=env) as second:
        async with second.client() as http:
            listed = (await (await http.get("/v1/worktrees")).json())["worktrees"]
            assert [w["worktreeId"] for w in listed] == [wt["worktreeId"]]
            assert pathlib.Path(wt["path"], "work.txt").read_text() == "kept\n"
            assert (await http.get(f"/v1/dispatches/{run['runId']}")).status == 404
            assert list((dispatch_dir / "runs").iterdir()) == []
            # Mounted only when the worktree is an overlay (a root server chooses none).
            overlay = wt["strategy"] == "overlay"
            assert mounted_under(str(dispatch_dir)) == ([wt["path"]] if overlay else [])
            assert (await http.delete(f"/v1/worktrees/{wt['worktreeId']}")).status == 204
    assert mounted_under(str(tmp_path)) == []
    assert (repo / "README.md").read_text() == "original readme\n"


async def test_a_dispatch_that_fails_to_install_leaves_no_worktree_mounted(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    from cc_server.dispatch.worktrees import WorktreeManager, WorktreeStrategy
    from cc_server.policy import HostFacts
    from cc_server.runtime.port import SandboxManager
    from cc_server.server.dispatch_api import install_dispatch

    dispatch_dir = tmp_path / "dispatch"
    dispatch_dir.mkdir(mode=0o700)
    if os.geteuid() != 0:
        pytest.skip("only overlay worktrees are mounted, and only root can mount one")
    # Named: a root server no longer chooses overlay itself (dispatch/worktrees.py), but a
    # server that ran with one before must still recover its mounts.
    killed = WorktreeManager(
        base=str(dispatch_dir / "worktrees"), strategy=WorktreeStrategy.OVERLAY
    )
    killed.register("r", str(make_repo(tmp_path / "repo")))
    wt = killed.create("r", "c1")
    killed.close()  # as after a kill: the next start re-mounts it
    (dispatch_dir / "runs").write_text("not a directory\n")  # the run state cannot be made
    manager = SandboxManager(probe_result=probe_result, host=dataclasses.replace(
        HostFacts.current(), home=str(tmp_path)))
    with pytest.raises(OSError):
        install_dispatch(web.Application(), manager,
                         environ={"CC_SERVER_DISPATCH_DIR": str(dispatch_dir)})
    assert mounted_under(str(tmp_path)) == []
    assert pathlib.Path(wt.root).is_dir()  # the worktree itself is kept for the next start
    await manager.aclose()


async def test_a_server_started_from_its_home_with_the_default_dispatch_dir_dispatches(
    tmp_path: pathlib.Path,
) -> None:
    """`cd ~ && cc-server serve`: the shell's PWD (and OLDPWD) is the home directory, a prefix of
    every run's HOME under the default dispatch dir; neither is a secret."""
    repo = make_repo(tmp_path / "repo")
    home = tmp_path / "operator-home"
    home.mkdir()
    env = {"PWD": str(home), "OLDPWD": str(home)}
    with running_server(home, env=env, home=home) as server:
        async with server.client() as http:
            await http.post("/v1/repos", json={"repoId": "r", "path": str(repo)})
            wt = await (await http.post("/v1/worktrees", json={
                "repoId": "r", "conversationId": "c1"})).json()
            resp = await http.post("/v1/dispatches", json={"worktreeId": wt["worktreeId"]})
            assert resp.status == 201, (await resp.text(), server.log_text()[-3000:])
            run = await resp.json()
            assert run["worktree"]["path"].startswith(str(home / ".local" / "state"))
            done = await (await http.post(f"/v1/dispatches/{run['runId']}/bash", json={
                "command": "echo $HOME"})).json()
            assert done["exitCode"] == 0 and done["stdout"].startswith(str(home)), done
            assert (await http.delete(f"/v1/dispatches/{run['runId']}")).status == 204
            assert (await http.delete(f"/v1/worktrees/{wt['worktreeId']}")).status == 204
    assert mounted_under(str(tmp_path)) == []


@contextlib.contextmanager
def _loopback_upstream(body: bytes = b"upstream-ok") -> Iterator[tuple[int, list[str]]]:
    """An HTTP server on 127.0.0.1 that answers every request with `body` and records its
    request lines: the host service a dispatch run may reach only through its proxies."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.requestline)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="loopback-upstream", daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_a_dispatch_run_reaches_what_the_operator_allowed_and_nothing_else(
    tmp_path: pathlib.Path,
) -> None:
    """`--dispatch-allow-domain` and CC_SERVER_DISPATCH_ALLOW_DOMAINS extend the baseline of every
    dispatch run (no per-run egressAllowlist); a refusal names those settings."""
    repo = make_repo(tmp_path / "repo")
    env = {"CC_SERVER_DISPATCH_DIR": str(tmp_path / "dispatch"),
           "CC_SERVER_DISPATCH_ALLOW_DOMAINS": " 127.0.0.1, ::1 "}
    # curl honours the bridge's NO_PROXY (loopback) even with -x; '' sends it to the proxy.
    curl = "curl --noproxy '' -sS --max-time 20 -o - -w ' %{http_code}'"
    with _loopback_upstream() as (port, seen), \
            running_server(tmp_path, "--dispatch-allow-domain", "localhost", env=env) as server:
        async with server.client() as http_client:
            await http_client.post("/v1/repos", json={"repoId": "r", "path": str(repo)})
            wt = await (await http_client.post("/v1/worktrees", json={
                "repoId": "r", "conversationId": "c1"})).json()
            resp = await http_client.post("/v1/dispatches", json={"worktreeId": wt["worktreeId"]})
            assert resp.status == 201, await resp.text()
            run = await resp.json()
            assert run["backend"] == "native"
            bash = f"/v1/dispatches/{run['runId']}/bash"
            for target in (f"http://127.0.0.1:{port}/ip", f"http://localhost:{port}/name"):
                done = await (await http_client.post(bash, json={
                    "command": f"{curl} {target}"})).json()
                assert done["stdout"] == "upstream-ok 200", done
                assert done["violations"] == [], done
            assert [line.split()[1] for line in seen] == ["/ip", "/name"]
            done = await (await http_client.post(bash, json={
                "command": f"{curl} http://not-allowed.example/"})).json()
            assert done["stdout"].endswith(" 403"), done
            assert "--dispatch-allow-domain not-allowed.example" in done["stdout"]
            refused = [v for v in done["violations"] if v["action"] == "network-outbound"]
            assert [v["target"] for v in refused] == ["not-allowed.example:80"], done
            assert "--dispatch-allow-domain not-allowed.example" in refused[0]["raw"]
            assert "CC_SERVER_DISPATCH_ALLOW_DOMAINS" in refused[0]["raw"]
            assert "cc-server run --allow-domain" not in refused[0]["raw"]
            kept = await (await http_client.get(f"/v1/dispatches/{run['runId']}")).json()
            assert "not-allowed.example:80" in [v["target"] for v in kept["violations"]]
            assert (await http_client.delete(f"/v1/dispatches/{run['runId']}")).status == 204
    assert len(seen) == 2
    assert mounted_under(str(tmp_path)) == []


async def test_a_server_secret_in_the_runs_environment_answers_409_naming_it(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    """A secret-named server variable whose value is a prefix of the dispatch directory: the
    operator's problem, answered 409 with both variables and a fix, and nothing is left."""
    async with open_dispatch(tmp_path, probe_result,
                             environ={"DEPLOY_TOKEN_DIR": str(tmp_path)}) as d, \
            TestClient(TestServer(dispatch_app(d.service))) as client:
        wt = await _worktree(client)
        resp = await client.post("/v1/dispatches", json={"worktreeId": wt["worktreeId"]})
        assert resp.status == 409, await resp.text()
        body = await resp.json()
        assert body["error"] == "EnvRefused"
        assert (body["variable"], body["hostVariable"]) == ("HOME", "DEPLOY_TOKEN_DIR")
        assert "'DEPLOY_TOKEN_DIR'" in body["message"] and "DEPLOY_TOKEN_DIR" in body["fix"]
        assert d.service.runs == {} and d.manager.handles == {}
        assert list((tmp_path / "runs").iterdir()) == []
