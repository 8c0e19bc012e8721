"""Escapes through the server: driving it without the token, from a web page, or from inside one
of its own sandboxes (reading the token, reaching its port, typing into another terminal).
Each attempt must fail against the real server process and real bubblewrap."""

from __future__ import annotations

import asyncio
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from server_kit import Server, running_server

pytestmark = pytest.mark.security

EXPECT_S = 20.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("access")
    private = root / "srv"
    private.mkdir(mode=0o700)
    with running_server(root, "--token-file", str(private / "token")) as srv:
        yield srv


def api_routes(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(method, concrete path) for every route the OpenAPI document lists, but /healthz."""
    out = []
    for path, item in doc["paths"].items():
        if path == "/healthz":
            continue
        for method in ("get", "post", "delete"):
            if method in item:
                out.append((method.upper(), path.replace("{id}", "some-id")))
    return out


async def openapi(server: Server) -> dict[str, Any]:
    async with server.client() as client, client.get("/openapi.json") as response:
        return dict(await response.json())


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token"},
        {"Authorization": "Bearer "},
        {"Authorization": "Basic dXNlcjpwYXNz"},
    ],
    ids=["none", "wrong", "empty", "basic"],
)
async def test_every_route_refuses_a_missing_or_wrong_token(
    server: Server, headers: dict[str, str]
) -> None:
    routes = api_routes(await openapi(server))
    assert len(routes) >= 9
    async with aiohttp.ClientSession(server.url, headers=headers) as client:
        for method, path in routes:
            async with client.request(method, path, json={}) as response:
                assert response.status == 401, (method, path)
                assert response.headers["WWW-Authenticate"].startswith("Bearer")
                assert (await response.json())["error"] == "Unauthorized"


async def test_near_miss_tokens_are_refused(server: Server) -> None:
    near = [server.token[:-1], server.token + "x", server.token.upper(), f" {server.token}x",
            server.token[1:] + server.token[0]]
    for token in near:
        async with aiohttp.ClientSession(
            server.url, headers={"Authorization": f"Bearer {token}"}
        ) as client, client.get("/v1/sandboxes") as response:
            assert response.status == 401, token


async def test_the_query_token_is_only_for_websockets(server: Server) -> None:
    async with aiohttp.ClientSession(server.url) as client:
        async with client.get("/v1/sandboxes", params={"token": server.token}) as response:
            assert response.status == 401
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect("/v1/terminals")
        assert refused.value.status == 401
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect("/v1/terminals", params={"token": "wrong"})
        assert refused.value.status == 401
        async with client.ws_connect("/v1/terminals", params={"token": server.token}) as ws:
            assert (await ws.receive_json(timeout=EXPECT_S))["type"] == "session"


async def test_a_web_page_gets_no_cors_grant(server: Server) -> None:
    async with aiohttp.ClientSession(server.url) as client, client.options(
        "/v1/sandboxes",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization"},
    ) as response:
        assert response.status in (401, 405)
        assert "Access-Control-Allow-Origin" not in response.headers


async def test_the_token_never_appears_in_the_log(server: Server) -> None:
    async with aiohttp.ClientSession(server.url) as client, client.ws_connect(
        "/v1/terminals", params={"token": server.token}
    ) as ws:
        await ws.receive_json(timeout=EXPECT_S)
    await asyncio.sleep(0.2)
    assert server.token not in server.log_text()


async def test_a_sandbox_cannot_bind_the_token(server: Server) -> None:
    token_dir = pathlib.Path(server.token_path).parent
    async with server.client() as client:
        for exposing in (token_dir, token_dir.parent):
            async with client.post("/v1/sandboxes", json={"spec": {
                "sessionId": "greedy", "workspaceId": "w",
                "bindMounts": [{"hostPath": str(exposing), "readOnly": True}],
            }}) as response:
                body = await response.json()
                assert response.status == 400, body
                assert "bearer token" in body["message"]
        async with client.get("/v1/sandboxes") as response:
            assert (await response.json())["sandboxes"] == []


async def terminal_output(server: Server, typed: str, until: str, **query: str) -> str:
    async with aiohttp.ClientSession(headers=server.auth) as session, session.ws_connect(
        f"{server.ws_url}/v1/terminals", params=query
    ) as ws:
        first = await ws.receive_json(timeout=EXPECT_S)
        assert first["type"] == "session", first
        await ws.send_bytes(typed.encode())
        output = b""
        async with asyncio.timeout(EXPECT_S):
            while not re.search(until.encode(), output):
                msg = await ws.receive()
                assert msg.type is aiohttp.WSMsgType.BINARY, (msg, output)
                output += msg.data
        return output.decode(errors="replace")


async def test_a_native_terminal_cannot_read_the_token(server: Server) -> None:
    token_dir = pathlib.Path(server.token_path).parent
    output = await terminal_output(
        server,
        f"cat {server.token_path} {token_dir}/*; ls -la {token_dir}; echo done-$((2+3))\n",
        r"done-5",
        backend="native", cwd=str(token_dir.parent),
    )
    assert server.token not in output


TIOCSTI_SCRIPT = """\
import fcntl, termios
try:
    fcntl.ioctl(0, termios.TIOCSTI, b"x")
    print("in" + "jected")
except OSError as e:
    print("refused", e.errno)
"""


async def test_a_native_terminal_cannot_push_input_into_its_terminal(
    server: Server, tmp_path: pathlib.Path
) -> None:
    # TIOCSTI would type into whatever reads the PTY; the seccomp filter refuses it (EPERM).
    (tmp_path / "tiocsti.py").write_text(TIOCSTI_SCRIPT)
    output = await terminal_output(server, "python3 tiocsti.py\n", r"refused \d+|injected",
                                   backend="native", cwd=str(tmp_path))
    assert "injected" not in output and "refused 1" in output


async def test_a_sandbox_cannot_reach_the_server(server: Server, tmp_path: pathlib.Path) -> None:
    async with server.client() as client:
        async with client.post("/v1/sandboxes", json={"spec": {
            "sessionId": "reach", "workspaceId": "w",
            "bindMounts": [{"hostPath": str(tmp_path)}]}}) as response:
            assert response.status == 201
        url = f"http://127.0.0.1:{server.port}/healthz"
        for argv in (["curl", "-sS", "--max-time", "5", url],  # through the proxy: loopback
                     ["curl", "-sS", "--max-time", "5", "--noproxy", "*", url]):  # direct
            async with client.post("/v1/sandboxes/reach/exec",
                                   json={"argv": argv, "timeoutS": EXPECT_S}) as response:
                result = await response.json()
            assert result["exitCode"] != 0, result
            assert '"status"' not in result["stdout"]
        await client.delete("/v1/sandboxes/reach")
