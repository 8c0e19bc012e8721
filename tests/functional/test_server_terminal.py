"""The server-hosted terminal of a real server process: a PTY over a WebSocket, on the host shell
(`none`, the default) and wrapped in bubblewrap (`native`); input, output, resize, and the end of
everything the shell started when the socket closes."""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from server_kit import (
    Server,
    host_pids_with,
    kill_marked,
    path_without,
    running_server,
    wait_until_gone,
)

pytestmark = pytest.mark.integration

EXPECT_S = 20.0  # hang guard for output that arrives in milliseconds
PROMPT_S = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("terminal")
    home = root / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("CC-TERMINAL-SECRET-KEY\n")
    (home / "notes.txt").write_text("a note in home\n")
    with running_server(root, home=home) as srv:
        yield srv


@pytest.fixture
def marker() -> Iterator[str]:
    value = str(100000 + secrets.randbelow(800000))
    yield value
    kill_marked(f"sleep\x00{value}")


class Terminal:
    """One terminal WebSocket: typed input, accumulated output."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.output = bytearray()
        self.frames: list[dict[str, Any]] = []

    async def type(self, text: str) -> None:
        await self.ws.send_bytes(text.encode())

    async def control(self, message: dict[str, Any]) -> None:
        await self.ws.send_str(json.dumps(message))

    async def expect(self, pattern: str) -> re.Match[bytes]:
        """Read until `pattern` (a regex) appears in the output."""
        regex = re.compile(pattern.encode())
        try:
            async with asyncio.timeout(EXPECT_S):
                while not (match := regex.search(self.output)):
                    msg = await self.ws.receive()
                    if msg.type is aiohttp.WSMsgType.BINARY:
                        self.output += msg.data
                    elif msg.type is aiohttp.WSMsgType.TEXT:
                        self.frames.append(json.loads(msg.data))
                    else:
                        raise AssertionError(f"socket closed; output so far: {self.output!r}")
        except TimeoutError:
            raise AssertionError(f"no {pattern!r} in {self.output!r}") from None
        return match

    async def until_closed(self) -> list[dict[str, Any]]:
        async with asyncio.timeout(EXPECT_S):
            async for msg in self.ws:
                if msg.type is aiohttp.WSMsgType.BINARY:
                    self.output += msg.data
                elif msg.type is aiohttp.WSMsgType.TEXT:
                    self.frames.append(json.loads(msg.data))
        return self.frames


@pytest.fixture
async def connect(server: Server) -> AsyncIterator[Any]:
    async with aiohttp.ClientSession(headers=server.auth) as session:

        async def open_terminal(**query: str) -> tuple[Terminal, dict[str, Any]]:
            ws = await session.ws_connect(f"{server.ws_url}/v1/terminals", params=query)
            first = await ws.receive_json(timeout=EXPECT_S)
            return Terminal(ws), first

        yield open_terminal


async def test_the_default_is_the_host_shell(connect: Any, server: Server) -> None:
    term, first = await connect()
    assert first["type"] == "session" and first["backend"] == "none"
    assert first["cwd"] == str(server.home)
    await term.type("echo sum=$((6*7)); cat notes.txt\n")
    await term.expect(r"sum=42\r?\n")
    await term.expect(r"a note in home")
    await term.type("exit 7\n")
    frames = await term.until_closed()
    assert frames[-1] == {"type": "exit", "exitCode": 7}


async def test_native_wraps_the_shell_in_the_terminal_profile(
    connect: Any, server: Server, tmp_path: pathlib.Path
) -> None:
    term, first = await connect(backend="native", cwd=str(tmp_path))
    assert first["backend"] == "native" and first["cwd"] == str(tmp_path)
    await term.type("echo host=$(hostname) pwd=$(pwd)\n")
    await term.expect(rf"host=cc-sandbox pwd={re.escape(str(tmp_path))}\r?\n")
    # $HOME and the working directory are writable; the five secrets are not readable.
    await term.type("echo written > ~/from-terminal && echo w > ./here && echo wrote-$((1+1))\n")
    await term.expect(r"wrote-2\r?\n")
    await term.type("cat ~/.ssh/id_ed25519 || echo ssh-$((0+1))-denied\n")
    await term.expect(r"ssh-1-denied")
    assert b"CC-TERMINAL-SECRET-KEY" not in term.output
    await term.type("exit\n")
    await term.until_closed()
    assert (server.home / "from-terminal").read_text() == "written\n"
    assert (tmp_path / "here").read_text() == "w\n"


@pytest.mark.parametrize("backend", ["none", "native"])
async def test_resize_reaches_the_pty(connect: Any, backend: str) -> None:
    term, first = await connect(backend=backend, rows="33", cols="101")
    assert first["backend"] == backend
    await term.type("stty size\n")
    await term.expect(r"\b33 101\r\n")
    await term.control({"resize": {"rows": 48, "cols": 160}})
    await term.type("stty size\n")
    await term.expect(r"\b48 160\r\n")
    await term.control({"input": "echo via-$((1+1))-control\n"})
    await term.expect(r"via-2-control\r\n")
    await term.ws.close()


@pytest.mark.parametrize("backend", ["none", "native"])
async def test_closing_the_socket_ends_the_shell_and_its_jobs(
    connect: Any, backend: str, marker: str
) -> None:
    term, _ = await connect(backend=backend)
    # A background job (its own process group under bash), and one that left the session.
    await term.type(f"sleep {marker} & setsid sleep {marker} & echo started-$((1+1))\n")
    await term.expect(r"started-2")
    async with asyncio.timeout(PROMPT_S):
        while len(host_pids_with(f"sleep\x00{marker}")) < 2:
            await asyncio.sleep(0.05)
    await term.ws.close()
    assert await asyncio.to_thread(wait_until_gone, f"sleep\x00{marker}", PROMPT_S) == []


async def test_bad_terminal_requests_fail_with_an_error_frame(connect: Any) -> None:
    for query, status, error in [
        ({"backend": "docker"}, 4400, "BadSpec"),
        ({"backend": "microvm"}, 4409, "BackendUnavailable"),  # this server probed no VM
        ({"cwd": "relative"}, 4400, "BadSpec"),
        ({"cwd": "/does/not/exist"}, 4400, "BadSpec"),
        ({"rows": "0"}, 4400, "BadSpec"),
    ]:
        term, first = await connect(**query)
        assert first["type"] == "error" and first["error"] == error, (query, first)
        await term.until_closed()
        assert term.ws.close_code == status, query


async def test_native_on_a_host_without_a_backend_fails_instead_of_badging(
    tmp_path: pathlib.Path,
) -> None:
    with running_server(tmp_path, env={"PATH": path_without(tmp_path, ["bwrap"])}) as server:
        async with aiohttp.ClientSession(headers=server.auth) as session:
            async with session.ws_connect(
                f"{server.ws_url}/v1/terminals", params={"backend": "native"}
            ) as ws:
                first = await ws.receive_json(timeout=EXPECT_S)
                assert first["type"] == "error" and first["error"] == "BackendUnavailable"
                assert "native" in first["message"] and first["fix"]
                rest = [msg async for msg in ws]
                assert rest == []  # no session frame, no shell output
                assert ws.close_code == 4409
            async with session.ws_connect(f"{server.ws_url}/v1/terminals") as ws:
                first = await ws.receive_json(timeout=EXPECT_S)
                assert first["backend"] == "none"  # the default still works, honestly badged
            async with session.post(f"{server.url}/v1/sandboxes", json={
                "spec": {"sessionId": "n", "workspaceId": "w"}, "backend": "native",
            }) as response:
                assert response.status == 409
                assert (await response.json())["error"] == "BackendUnavailable"
            async with session.post(f"{server.url}/v1/sandboxes", json={
                "spec": {"sessionId": "d", "workspaceId": "w"},
            }) as response:
                assert response.status == 201
                assert (await response.json())["backend"] == "none"  # on, but no backend here
        assert "terminal.opened" not in [
            e["event"] for e in server.log() if e.get("backend") == "native"
        ]
