"""The sandbox API of a real server process, over HTTP and WebSocket, against real bubblewrap:
create → exec (collected and streamed) → inspect → kill → destroy, and every 4xx."""

from __future__ import annotations

import asyncio
import base64
import pathlib
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from server_kit import Server, kill_marked, running_server, wait_until_gone

pytestmark = pytest.mark.integration

EXEC_TIMEOUT_S = 30.0  # hang guard for commands that finish in well under a second
PROMPT_S = 10.0  # "promptly" for a kill, far below the commands' own sleeps


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("api")) as srv:
        yield srv


@pytest.fixture
async def client(server: Server) -> AsyncIterator[aiohttp.ClientSession]:
    async with server.client(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture
def work(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "work"
    path.mkdir()
    (path / "hello.txt").write_text("hello from the worktree\n")
    return path


@pytest.fixture
def marker() -> Iterator[str]:
    value = str(100000 + secrets.randbelow(800000))  # a unique `sleep` duration, found in /proc
    yield value
    kill_marked(f"sleep\x00{value}")


def sid() -> str:
    return f"api-{secrets.token_hex(6)}"


def spec(session_id: str, work: pathlib.Path, **fields: Any) -> dict[str, Any]:
    return {"sessionId": session_id, "workspaceId": "w",
            "bindMounts": [{"hostPath": str(work)}], **fields}


async def create(client: aiohttp.ClientSession, body: dict[str, Any]) -> dict[str, Any]:
    async with client.post("/v1/sandboxes", json=body) as response:
        data = await response.json()
        assert response.status == 201, data
        return dict(data)


async def exec_collected(client: aiohttp.ClientSession, session_id: str,
                         body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with client.post(f"/v1/sandboxes/{session_id}/exec", json=body) as response:
        return response.status, await response.json()


async def ws_events(server: Server, session_id: str, first: dict[str, Any],
                    then: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    """Run one command over the exec WebSocket; every event until the server closes."""
    events: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(headers=server.auth) as session, session.ws_connect(
        f"{server.ws_url}/v1/sandboxes/{session_id}/exec/ws"
    ) as ws:
        await ws.send_json(first)
        for message in then:
            await ws.send_json(message)
        async with asyncio.timeout(EXEC_TIMEOUT_S):
            async for msg in ws:
                assert msg.type is aiohttp.WSMsgType.TEXT
                events.append(msg.json())
    return events


# --- the whole lifecycle -------------------------------------------------------------------------


async def test_create_exec_inspect_destroy_with_bubblewrap(
    client: aiohttp.ClientSession, work: pathlib.Path
) -> None:
    session_id = sid()
    handle = await create(client, {"spec": spec(session_id, work)})
    assert handle["sessionId"] == session_id
    assert handle["backend"] == "native" and handle["state"] == "warm"

    status, result = await exec_collected(client, session_id, {
        "argv": ["sh", "-c", "hostname; cat hello.txt; echo oops >&2; exit 3"],
        "cwd": str(work), "timeoutS": EXEC_TIMEOUT_S,
    })
    assert status == 200, result
    assert result["exitCode"] == 3
    assert result["stdout"] == "cc-sandbox\nhello from the worktree\n"
    assert result["stderr"] == "oops\n"
    assert base64.b64decode(result["stdoutBase64"]) == result["stdout"].encode()
    assert result["killed"] is False and result["killedReason"] is None

    async with client.get(f"/v1/sandboxes/{session_id}") as response:
        assert response.status == 200
        assert (await response.json())["state"] == "warm"
    async with client.get("/v1/sandboxes") as response:
        listed = (await response.json())["sandboxes"]
        assert session_id in [h["sessionId"] for h in listed]

    for _ in range(2):  # idempotent
        async with client.delete(f"/v1/sandboxes/{session_id}") as response:
            assert response.status == 204
    async with client.get(f"/v1/sandboxes/{session_id}") as response:
        assert response.status == 404


async def test_backend_none_when_asked_runs_on_the_host(
    client: aiohttp.ClientSession, work: pathlib.Path
) -> None:
    session_id = sid()
    handle = await create(client, {"spec": spec(session_id, work), "backend": "none"})
    assert handle["backend"] == "none"
    status, result = await exec_collected(client, session_id, {"argv": ["hostname"]})
    assert status == 200 and result["stdout"].strip() != "cc-sandbox"
    await client.delete(f"/v1/sandboxes/{session_id}")


async def test_stdin_as_text_and_as_base64(
    client: aiohttp.ClientSession, work: pathlib.Path
) -> None:
    session_id = sid()
    await create(client, {"spec": spec(session_id, work)})
    _, result = await exec_collected(client, session_id, {"argv": ["cat"], "stdin": "typed\n"})
    assert result["stdout"] == "typed\n"
    raw = bytes(range(256))
    _, result = await exec_collected(client, session_id, {
        "argv": ["cat"], "stdinBase64": base64.b64encode(raw).decode()})
    assert base64.b64decode(result["stdoutBase64"]) == raw
    await client.delete(f"/v1/sandboxes/{session_id}")


async def test_a_timeout_kills_the_command(
    client: aiohttp.ClientSession, work: pathlib.Path, marker: str
) -> None:
    session_id = sid()
    await create(client, {"spec": spec(session_id, work)})
    status, result = await exec_collected(
        client, session_id, {"argv": ["sleep", marker], "timeoutS": 0.5})
    assert status == 200
    assert result["killed"] is True and result["killedReason"] == "timeout"
    assert result["exitCode"] == 137
    await client.delete(f"/v1/sandboxes/{session_id}")


async def test_violations_are_reported_on_the_result_and_the_handle(
    client: aiohttp.ClientSession, work: pathlib.Path
) -> None:
    session_id = sid()
    await create(client, {"spec": spec(session_id, work)})
    _, result = await exec_collected(client, session_id, {
        "argv": ["curl", "-sS", "--max-time", "10", "https://not-on-the-list.invalid/"],
        "timeoutS": EXEC_TIMEOUT_S,
    })
    assert result["exitCode"] != 0
    (violation,) = result["violations"]
    assert violation["action"] == "network-outbound"
    assert violation["target"] == "not-on-the-list.invalid:443"
    async with client.get(f"/v1/sandboxes/{session_id}") as response:
        assert (await response.json())["violations"] == [violation]
    await client.delete(f"/v1/sandboxes/{session_id}")


# --- the exec WebSocket --------------------------------------------------------------------------


async def test_ws_streams_every_event_in_order(
    server: Server, client: aiohttp.ClientSession, work: pathlib.Path
) -> None:
    session_id = sid()
    await create(client, {"spec": spec(session_id, work)})
    events = await ws_events(server, session_id, {
        "argv": ["sh", "-c", "echo out; echo err >&2; exit 5"]})
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["starting", "ready"] and kinds[-1] == "exit"
    assert events[-1]["exitCode"] == 5
    assert "".join(e["data"] for e in events if e["type"] == "stdout") == "out\n"
    assert "".join(e["data"] for e in events if e["type"] == "stderr") == "err\n"
    assert all(e["sessionId"] == session_id for e in events)
    await client.delete(f"/v1/sandboxes/{session_id}")


async def test_ws_stdin_messages_and_eof(
    server: Server, client: aiohttp.ClientSession, work: pathlib.Path
) -> None:
    session_id = sid()
    await create(client, {"spec": spec(session_id, work)})
    events = await ws_events(server, session_id, {"argv": ["cat"], "stdin": "one\n"}, [
        {"stdin": "two\n"},
        {"stdinBase64": base64.b64encode("trois é\n".encode()).decode()},
        {"stdinClose": True},
    ])
    assert "".join(e["data"] for e in events if e["type"] == "stdout") == "one\ntwo\ntrois é\n"
    assert events[-1] == {"type": "exit", "sessionId": session_id,
                          "execId": events[0]["execId"], "exitCode": 0}
    await client.delete(f"/v1/sandboxes/{session_id}")


async def test_ws_never_splits_a_character(
    server: Server, client: aiohttp.ClientSession, work: pathlib.Path
) -> None:
    session_id = sid()
    await create(client, {"spec": spec(session_id, work)})
    # "é" is two bytes; the first is written, then the second a little later.
    events = await ws_events(server, session_id, {"argv": [
        "sh", "-c", r"printf '\303'; sleep 0.3; printf '\251\n'"]})
    assert "".join(e["data"] for e in events if e["type"] == "stdout") == "é\n"
    await client.delete(f"/v1/sandboxes/{session_id}")


async def test_ws_kill_message(
    server: Server, client: aiohttp.ClientSession, work: pathlib.Path, marker: str
) -> None:
    session_id = sid()
    await create(client, {"spec": spec(session_id, work)})
    events = await ws_events(server, session_id, {"argv": ["sleep", marker]}, [{"kill": True}])
    assert [e["type"] for e in events][-2:] == ["killed", "exit"]
    assert events[-2]["reason"] == "manual"
    assert wait_until_gone(f"sleep\x00{marker}", PROMPT_S) == []
    await client.delete(f"/v1/sandboxes/{session_id}")


async def test_closing_the_ws_kills_the_command(
    server: Server, client: aiohttp.ClientSession, work: pathlib.Path, marker: str
) -> None:
    session_id = sid()
    await create(client, {"spec": spec(session_id, work)})
    async with aiohttp.ClientSession(headers=server.auth) as session, session.ws_connect(
        f"{server.ws_url}/v1/sandboxes/{session_id}/exec/ws"
    ) as ws:
        await ws.send_json({"argv": ["sleep", marker]})
        async with asyncio.timeout(EXEC_TIMEOUT_S):
            while (await ws.receive_json())["type"] != "ready":
                pass
        assert await asyncio.to_thread(wait_until_present, f"sleep\x00{marker}")
    assert await asyncio.to_thread(wait_until_gone, f"sleep\x00{marker}", PROMPT_S) == []
    async with asyncio.timeout(PROMPT_S):  # the handle settles once the execution is reaped
        while True:
            async with client.get(f"/v1/sandboxes/{session_id}") as response:
                if (await response.json())["state"] == "warm":
                    break
            await asyncio.sleep(0.05)
    await client.delete(f"/v1/sandboxes/{session_id}")


async def test_a_client_that_leaves_a_collected_exec_kills_its_command(
    server: Server, client: aiohttp.ClientSession, work: pathlib.Path, marker: str
) -> None:
    session_id = sid()
    await create(client, {"spec": spec(session_id, work)})
    async with aiohttp.ClientSession(server.url, headers=server.auth) as impatient:
        request = asyncio.create_task(impatient.post(
            f"/v1/sandboxes/{session_id}/exec", json={"argv": ["sleep", marker]}))
        assert await asyncio.to_thread(wait_until_present, f"sleep\x00{marker}")
        request.cancel()  # the connection closes; the server's handler is cancelled
        with pytest.raises(asyncio.CancelledError):
            await request
    assert await asyncio.to_thread(wait_until_gone, f"sleep\x00{marker}", PROMPT_S) == []
    await client.delete(f"/v1/sandboxes/{session_id}")


def wait_until_present(marker: str) -> bool:
    import time

    from server_kit import host_pids_with

    deadline = time.monotonic() + PROMPT_S
    while time.monotonic() < deadline:
        if host_pids_with(marker):
            return True
        time.sleep(0.05)
    return False


async def test_kill_route_and_destroy_end_running_commands(
    server: Server, client: aiohttp.ClientSession, work: pathlib.Path, marker: str
) -> None:
    session_id = sid()
    await create(client, {"spec": spec(session_id, work)})
    stream = asyncio.create_task(ws_events(server, session_id, {"argv": ["sleep", marker]}))
    assert await asyncio.to_thread(wait_until_present, f"sleep\x00{marker}")
    async with client.post(f"/v1/sandboxes/{session_id}/kill") as response:
        assert response.status == 200 and await response.json() == {"killed": 1}
    events = await stream
    assert [e["type"] for e in events][-2:] == ["killed", "exit"]

    stream = asyncio.create_task(ws_events(server, session_id, {"argv": ["sleep", marker]}))
    assert await asyncio.to_thread(wait_until_present, f"sleep\x00{marker}")
    async with client.delete(f"/v1/sandboxes/{session_id}") as response:
        assert response.status == 204
    events = await stream
    assert events[-2] == {**events[-2], "type": "killed", "reason": "destroyed"}
    assert await asyncio.to_thread(wait_until_gone, f"sleep\x00{marker}", PROMPT_S) == []


# --- refusals: 4xx with a message, nothing created -----------------------------------------------


async def refused(client: aiohttp.ClientSession, method: str, path: str,
                  **kwargs: Any) -> tuple[int, dict[str, Any]]:
    async with client.request(method, path, **kwargs) as response:
        return response.status, await response.json()


async def live_ids(client: aiohttp.ClientSession) -> set[str]:
    async with client.get("/v1/sandboxes") as response:
        return {h["sessionId"] for h in (await response.json())["sandboxes"]}


@pytest.mark.parametrize(
    ("body", "status", "error", "says"),
    [
        ("{not json", 400, "BadRequest", "invalid CreateSandbox"),
        ({"spec": {"sessionId": "x", "workspaceId": "w", "bindMount": []}}, 400, "BadSpec",
         "bindMount: unknown field"),
        ({"spec": {"sessionId": "x", "workspaceId": "w",
                   "bindMounts": [{"hostPath": "relative/dir"}]}}, 400, "BadSpec",
         "bindMounts[0].hostPath: path must be absolute"),
        ({"spec": {"sessionId": "x", "workspaceId": "w"}, "backend": "docker"}, 400, "BadSpec",
         "unknown backend 'docker'"),
        ({"spec": {"sessionId": "x", "workspaceId": "w"}, "extra": 1}, 400, "BadRequest",
         "unknown field `extra`"),
        ({"spec": {"sessionId": "x"}}, 400, "BadSpec", "workspaceId"),
        ({"spec": {"sessionId": "x", "workspaceId": "w",
                   "bindMounts": [{"hostPath": "/does/not/exist"}]}}, 400, "BadSpec",
         "does not exist"),
        ({"spec": {"sessionId": "x", "workspaceId": "w"}, "backend": "microvm"}, 409,
         "BackendUnavailable", "microvm"),
    ],
)
async def test_bad_create_requests_are_refused_and_create_nothing(
    client: aiohttp.ClientSession, body: Any, status: int, error: str, says: str
) -> None:
    before = await live_ids(client)
    kwargs = {"data": body} if isinstance(body, str) else {"json": body}
    got, data = await refused(client, "POST", "/v1/sandboxes", **kwargs)
    assert (got, data["error"]) == (status, error), data
    assert says in data["message"], data
    assert await live_ids(client) == before


async def test_a_live_session_id_is_a_conflict(
    client: aiohttp.ClientSession, work: pathlib.Path
) -> None:
    session_id = sid()
    await create(client, {"spec": spec(session_id, work)})
    status, data = await refused(client, "POST", "/v1/sandboxes",
                                 json={"spec": spec(session_id, work)})
    assert (status, data["error"]) == (409, "Conflict")
    await client.delete(f"/v1/sandboxes/{session_id}")


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"argv": []}, "length >= 1 - at `$.argv`"),
        ({"argv": ["true"], "cwd": "relative"}, "cwd: path must be absolute"),
        ({"argv": ["true"], "stdin": "a", "stdinBase64": "YQ=="}, "not both"),
        ({"argv": ["true"], "stdinBase64": "%%%"}, "not base64"),
        ({"argv": ["true"], "timeoutS": 0}, "timeoutS"),
        ({"argv": ["true"], "env": {"A=B": "c"}}, "env name"),
        ({"argv": ["true"], "surprise": True}, "unknown field"),
    ],
)
async def test_bad_exec_requests_are_400(
    client: aiohttp.ClientSession, work: pathlib.Path, body: dict[str, Any], says: str
) -> None:
    session_id = sid()
    await create(client, {"spec": spec(session_id, work)})
    status, data = await refused(client, "POST", f"/v1/sandboxes/{session_id}/exec", json=body)
    assert status == 400 and says in data["message"], data
    await client.delete(f"/v1/sandboxes/{session_id}")


async def test_unknown_sandboxes_are_404(client: aiohttp.ClientSession) -> None:
    for method, path in [("GET", "/v1/sandboxes/nope"), ("POST", "/v1/sandboxes/nope/kill")]:
        status, data = await refused(client, method, path)
        assert (status, data["error"]) == (404, "NotFound")
    status, data = await refused(client, "POST", "/v1/sandboxes/nope/exec", json={"argv": ["x"]})
    assert status == 404


async def test_ws_refusals_close_with_4000_plus_the_status(
    server: Server, client: aiohttp.ClientSession, work: pathlib.Path
) -> None:
    async with aiohttp.ClientSession(headers=server.auth) as session:
        async with session.ws_connect(f"{server.ws_url}/v1/sandboxes/nope/exec/ws") as ws:
            await ws.send_json({"argv": ["true"]})
            error = await ws.receive_json()
            assert error["type"] == "error" and error["error"] == "NotFound"
            await ws.receive()
            assert ws.close_code == 4404
        session_id = sid()
        await create(client, {"spec": spec(session_id, work)})
        async with session.ws_connect(
            f"{server.ws_url}/v1/sandboxes/{session_id}/exec/ws"
        ) as ws:
            await ws.send_json({"argv": "not a list"})
            error = await ws.receive_json()
            assert error["error"] == "BadRequest"
            await ws.receive()
            assert ws.close_code == 4400
        await client.delete(f"/v1/sandboxes/{session_id}")
