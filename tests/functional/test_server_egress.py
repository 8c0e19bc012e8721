"""A running sandbox's egress through the API of a real server: GET and PATCH
/v1/sandboxes/{id}/egress, against real bubblewrap and an HTTP server on the host's loopback
(allowed as an IP literal with its port)."""

from __future__ import annotations

import asyncio
import pathlib
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from dispatch_kit import make_repo
from egress_kit import serve_ok_on_loopback
from server_kit import Server, running_server

pytestmark = pytest.mark.integration

# curl honours NO_PROXY (the bridge puts loopback in it) even with -x; '' overrides it.
CURL = "curl -sS -m 10 -o /dev/null -w %{http_code} --noproxy '' -x http://127.0.0.1:3128"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("egress-api")) as srv:
        yield srv


@pytest.fixture
async def client(server: Server) -> AsyncIterator[aiohttp.ClientSession]:
    async with server.client(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture
def upstream_port() -> Iterator[int]:
    with serve_ok_on_loopback() as port:
        yield port


async def curl(client: aiohttp.ClientSession, session_id: str, port: int) -> dict[str, Any]:
    body = {"argv": ["/bin/sh", "-c", f"{CURL} http://127.0.0.1:{port}/"], "timeoutS": 30}
    async with client.post(f"/v1/sandboxes/{session_id}/exec", json=body) as response:
        assert response.status == 200
        return dict(await response.json())


async def test_patch_changes_the_next_connection_and_is_logged(
    server: Server, client: aiohttp.ClientSession, upstream_port: int, tmp_path: pathlib.Path
) -> None:
    sid = f"egress-{secrets.token_hex(6)}"
    entry = f"127.0.0.1:{upstream_port}"
    spec = {"sessionId": sid, "workspaceId": "w", "bindMounts": [{"hostPath": str(tmp_path)}]}
    async with client.post("/v1/sandboxes", json={"spec": spec}) as response:
        assert response.status == 201, await response.text()
    try:
        first = await curl(client, sid, upstream_port)
        assert first["stdout"] == "403" and len(first["violations"]) == 1, first
        refusal = first["violations"][0]
        assert refusal["target"] == entry and "not on this session's egress" in refusal["reason"]
        assert f"--allow-domain {entry}" in refusal["fix"], refusal

        async with client.patch(f"/v1/sandboxes/{sid}/egress", json={"allow": [entry]}) as resp:
            assert resp.status == 200, await resp.text()
            view = await resp.json()
        assert view["change"] == {"added": [entry], "removed": [], "by": "api"}
        assert view["entries"][-1] == entry and "169.254.169.254" in view["denied"]
        allowed = await curl(client, sid, upstream_port)
        assert allowed["stdout"] == "200" and allowed["violations"] == [], allowed

        async with client.patch(f"/v1/sandboxes/{sid}/egress", json={"remove": [entry]}) as resp:
            assert resp.status == 200
            assert (await resp.json())["change"]["removed"] == [entry]
        again = await curl(client, sid, upstream_port)
        assert again["stdout"] == "403", again

        async with client.get(f"/v1/sandboxes/{sid}/egress") as resp:
            assert entry not in (await resp.json())["entries"]
        changes = [e for e in server.log() if e.get("event") == "sandbox.egress"
                   and e.get("sessionId") == sid]  # fmt: skip
        assert [(e.get("added"), e.get("removed")) for e in changes] == [
            ([entry], []), ([], [entry])
        ], changes
    finally:
        async with client.delete(f"/v1/sandboxes/{sid}"):
            pass


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        ({"allow": ["bad.example:0"]}, 400, "InvalidPattern"),
        ({"allow": ["169.254.169.254"]}, 400, "BadSpec"),
        ({"allow": ["a.example"], "remove": ["a.example"]}, 400, "BadSpec"),
        ({"grant": ["a.example"]}, 400, "BadRequest"),
    ],
)
async def test_a_bad_patch_is_refused_and_changes_nothing(
    client: aiohttp.ClientSession, tmp_path: pathlib.Path,
    body: dict[str, Any], status: int, error: str,
) -> None:
    sid = f"egress-{secrets.token_hex(6)}"
    spec = {"sessionId": sid, "workspaceId": "w", "bindMounts": [{"hostPath": str(tmp_path)}]}
    async with client.post("/v1/sandboxes", json={"spec": spec}) as response:
        assert response.status == 201
    try:
        async with client.get(f"/v1/sandboxes/{sid}/egress") as resp:
            before = (await resp.json())["entries"]
        async with client.patch(f"/v1/sandboxes/{sid}/egress", json=body) as resp:
            data = await resp.json()
            assert resp.status == status and data["error"] == error, data
        async with client.get(f"/v1/sandboxes/{sid}/egress") as resp:
            assert (await resp.json())["entries"] == before
    finally:
        async with client.delete(f"/v1/sandboxes/{sid}"):
            pass


async def test_an_unknown_sandbox_is_404(client: aiohttp.ClientSession) -> None:
    async with client.patch("/v1/sandboxes/nope/egress", json={"allow": []}) as resp:
        assert resp.status == 404


async def test_ask_over_the_exec_websocket(
    server: Server, client: aiohttp.ClientSession, upstream_port: int, tmp_path: pathlib.Path
) -> None:
    # `localhost` is not listed; the addresses it resolves to are, so it is asked about.
    sid = f"egress-{secrets.token_hex(6)}"
    spec = {"sessionId": sid, "workspaceId": "w", "bindMounts": [{"hostPath": str(tmp_path)}],
            "egressAllowlist": ["127.0.0.1", "::1"]}
    body = {"spec": spec, "egress": "ask", "egressAskTimeoutS": 20}
    async with client.post("/v1/sandboxes", json=body) as response:
        assert response.status == 201, await response.text()
    script = (f"{CURL} http://localhost:{upstream_port}/; echo; "
              f"{CURL} http://localhost:{upstream_port}/")
    frames: list[dict[str, Any]] = []
    answers = iter(["once", "deny"])
    try:
        async with aiohttp.ClientSession(headers=server.auth) as session, session.ws_connect(
            f"{server.ws_url}/v1/sandboxes/{sid}/exec/ws"
        ) as ws:
            await ws.send_json({"argv": ["/bin/sh", "-c", script], "timeoutS": 60})
            async for message in ws:
                frame = message.json()
                frames.append(frame)
                if frame["type"] == "egress-request":
                    assert frame["request"]["entry"] == f"localhost:{upstream_port}"
                    async with client.get(f"/v1/sandboxes/{sid}/egress") as resp:
                        view = await resp.json()
                    assert view["asking"] and [r["id"] for r in view["requests"]] == [
                        frame["request"]["id"]]
                    await ws.send_json({"egressAnswer": {"id": frame["request"]["id"],
                                                         "answer": next(answers)}})
        output = "".join(f.get("data", "") for f in frames if f["type"] == "stdout")
        assert output.split() == ["200", "403"], frames
        kinds = [f["type"] for f in frames]
        assert kinds.count("egress-request") == 2 and kinds.count("violation") == 1, kinds
        violation = next(f["violation"] for f in frames if f["type"] == "violation")
        assert "refused when asked" in violation["reason"]
    finally:
        async with client.delete(f"/v1/sandboxes/{sid}"):
            pass


async def test_an_answer_to_no_request_is_404(
    client: aiohttp.ClientSession, tmp_path: pathlib.Path
) -> None:
    sid = f"egress-{secrets.token_hex(6)}"
    spec = {"sessionId": sid, "workspaceId": "w", "bindMounts": [{"hostPath": str(tmp_path)}]}
    async with client.post("/v1/sandboxes", json={"spec": spec, "egress": "ask"}) as response:
        assert response.status == 201
    try:
        async with client.post(f"/v1/sandboxes/{sid}/egress/requests/nope",
                               json={"answer": "once"}) as resp:
            assert resp.status == 404, await resp.text()
        async with client.post(f"/v1/sandboxes/{sid}/egress/requests/nope",
                               json={"answer": "always"}) as resp:
            assert resp.status == 400
    finally:
        async with client.delete(f"/v1/sandboxes/{sid}"):
            pass


async def test_a_dispatch_runs_egress_changes_through_the_dispatch_api(
    tmp_path: pathlib.Path, upstream_port: int
) -> None:
    repo = make_repo(tmp_path / "repo")
    env = {"CC_SERVER_DISPATCH_DIR": str(tmp_path / "dispatch")}
    entry = f"127.0.0.1:{upstream_port}"
    command = {"command": f"curl -sS -m 10 -o /dev/null -w %{{http_code}} --noproxy '' "
                          f"http://{entry}/"}
    with running_server(tmp_path / "srv", env=env) as server:
        async with server.client(timeout=aiohttp.ClientTimeout(total=60)) as http_client:
            await http_client.post("/v1/repos", json={"repoId": "r", "path": str(repo)})
            wt = await (await http_client.post("/v1/worktrees", json={
                "repoId": "r", "conversationId": "c1"})).json()
            resp = await http_client.post("/v1/dispatches", json={"worktreeId": wt["worktreeId"]})
            assert resp.status == 201, await resp.text()
            run_id = (await resp.json())["runId"]
            egress, bash = f"/v1/dispatches/{run_id}/egress", f"/v1/dispatches/{run_id}/bash"
            try:
                refused = await (await http_client.post(bash, json=command)).json()
                assert refused["stdout"] == "403", refused
                async with http_client.patch(egress, json={"allow": [entry]}) as answer:
                    view = await answer.json()
                    assert answer.status == 200, view
                assert view["change"] == {"added": [entry], "removed": [], "by": "dispatch"}
                allowed = await (await http_client.post(bash, json=command)).json()
                assert allowed["stdout"] == "200", allowed
                async with http_client.patch(egress, json={"remove": [entry]}) as answer:
                    assert answer.status == 200
                again = await (await http_client.post(bash, json=command)).json()
                assert again["stdout"] == "403", again
                async with http_client.patch(egress, json={"allow": ["x:0"]}) as answer:
                    assert answer.status == 400
                async with http_client.get("/v1/dispatches/nope/egress") as answer:
                    assert answer.status == 404
                # Ask mode, switched on for the running run; answered through the dispatch API.
                # `localhost` is asked about: the addresses it resolves to are listed.
                async with http_client.patch(egress, json={
                    "allow": ["127.0.0.1", "::1"], "ask": True, "askTimeoutS": 20}) as a:
                    assert (await a.json())["asking"] is True
                named = {"command": command["command"].replace("127.0.0.1", "localhost")}
                pending = asyncio.ensure_future(http_client.post(bash, json=named))
                requests: list[dict[str, Any]] = []
                for _ in range(200):
                    requests = (await (await http_client.get(egress)).json())["requests"]
                    if requests:
                        break
                    await asyncio.sleep(0.05)
                assert [r["entry"] for r in requests] == [f"localhost:{upstream_port}"], requests
                async with http_client.post(f"{egress}/requests/{requests[0]['id']}",
                                            json={"answer": "once"}) as answer:
                    assert answer.status == 200, await answer.text()
                asked = await (await pending).json()
                assert asked["stdout"] == "200", asked
                async with http_client.post(f"{egress}/requests/{requests[0]['id']}",
                                            json={"answer": "once"}) as answer:
                    assert answer.status == 404  # answered already
            finally:
                await http_client.delete(f"/v1/dispatches/{run_id}")
        logged = [e for e in server.log() if e.get("event") == "sandbox.egress"]
        assert [(e.get("by"), e.get("runId")) for e in logged] == [("dispatch", run_id)] * 3


async def test_the_egress_stream_shows_and_answers_a_sessions_requests(
    server: Server, client: aiohttp.ClientSession, upstream_port: int, tmp_path: pathlib.Path
) -> None:
    # A command run with the collected exec (no WebSocket of its own) is held; the session's
    # egress stream sees the request and answers it.
    sid = f"egress-{secrets.token_hex(6)}"
    spec = {"sessionId": sid, "workspaceId": "w", "bindMounts": [{"hostPath": str(tmp_path)}],
            "egressAllowlist": ["127.0.0.1", "::1"]}
    async with client.post("/v1/sandboxes", json={"spec": spec, "egress": "ask"}) as response:
        assert response.status == 201
    frames: list[dict[str, Any]] = []
    try:
        async with aiohttp.ClientSession(headers=server.auth) as session, session.ws_connect(
            f"{server.ws_url}/v1/sandboxes/{sid}/egress/ws"
        ) as ws:
            first = await ws.receive_json(timeout=10)
            assert first["type"] == "egress" and first["asking"] and first["requests"] == []
            exec_body = {"argv": ["/bin/sh", "-c", f"{CURL} http://localhost:{upstream_port}/"],
                         "timeoutS": 30}
            done = asyncio.ensure_future(client.post(f"/v1/sandboxes/{sid}/exec", json=exec_body))
            request = await ws.receive_json(timeout=20)
            assert request["type"] == "egress-request", request
            await ws.send_json({"egressAnswer": {"id": request["request"]["id"],
                                                 "answer": "session"}})
            changed = await ws.receive_json(timeout=10)
            assert changed["type"] == "egress-changed", changed
            assert changed["egress"] == {"added": [f"localhost:{upstream_port}"], "removed": [],
                                         "by": "approval"}
            result = await (await done).json()
            assert result["stdout"] == "200", result
            async with client.patch(f"/v1/sandboxes/{sid}/egress",
                                    json={"remove": [f"localhost:{upstream_port}"],
                                          "ask": False}) as resp:
                assert resp.status == 200
            frames.append(await ws.receive_json(timeout=10))
            refused = await (await client.post(f"/v1/sandboxes/{sid}/exec", json=exec_body)).json()
            assert refused["stdout"] == "403", refused
            frames.append(await ws.receive_json(timeout=10))
            await ws.send_json({"egressAnswer": {"id": "nope", "answer": "once"}})
            frames.append(await ws.receive_json(timeout=10))
            async with client.delete(f"/v1/sandboxes/{sid}"):
                pass
            closed = await ws.receive(timeout=10)
            assert closed.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        assert [f["type"] for f in frames] == ["egress-changed", "violation", "error"], frames
        assert frames[1]["violation"]["target"] == f"localhost:{upstream_port}"
    finally:
        async with client.delete(f"/v1/sandboxes/{sid}"):
            pass
