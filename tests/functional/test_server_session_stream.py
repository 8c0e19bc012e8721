"""The session stream (GET /v1/sandboxes/{id}/session/ws) of a real server process, against real
bubblewrap: many commands over one WebSocket, every frame tagged with the client's id; bad
frames and unknown ids answered with error frames; a flood of output held back, not buffered;
closing the socket kills every command it started."""

from __future__ import annotations

import asyncio
import base64
import pathlib
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import pytest
from server_kit import (
    Server,
    host_pids_with,
    kill_marked,
    rss_bytes,
    running_server,
    wait_until_gone,
)

from cc_server.server.exec_api import SESSION_INPUT_QUEUE, SESSION_MAX_COMMANDS

pytestmark = pytest.mark.integration

EXEC_TIMEOUT_S = 30.0  # hang guard for commands that finish in well under a second
PROMPT_S = 10.0  # "promptly" for a kill, far below the commands' own sleeps
FLOOD_BYTES = 96 * 2**20  # output of the flood command: far more than the server may hold
FLOOD_HELD_MAX_BYTES = 40 * 2**20  # the server's RSS may grow by this much while nobody reads
FLOOD_PAUSE_S = 3.0  # how long the client leaves the flood unread


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("session")) as srv:
        yield srv


@pytest.fixture
async def sandbox(server: Server, tmp_path: pathlib.Path) -> AsyncIterator[str]:
    session_id = f"stream-{secrets.token_hex(6)}"
    async with server.client() as client:
        async with client.post("/v1/sandboxes", json={"spec": {
            "sessionId": session_id, "workspaceId": "w",
            "bindMounts": [{"hostPath": str(tmp_path)}]}}) as response:
            assert response.status == 201, await response.text()
        yield session_id
        async with client.delete(f"/v1/sandboxes/{session_id}"):
            pass


@pytest.fixture
def marker() -> Iterator[str]:
    value = str(100000 + secrets.randbelow(800000))  # a unique `sleep` duration, found in /proc
    yield value
    kill_marked(f"sleep\x00{value}")


@pytest.fixture
async def stream(server: Server, sandbox: str) -> AsyncIterator[Frames]:
    async with aiohttp.ClientSession(headers=server.auth) as session, session.ws_connect(
        f"{server.ws_url}/v1/sandboxes/{sandbox}/session/ws"
    ) as ws:
        yield Frames(ws)


class Frames:
    """The frames a session stream has sent so far, and waits for the next ones."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.seen: list[dict[str, Any]] = []

    async def send(self, message: dict[str, Any]) -> None:
        await self.ws.send_json(message)

    async def until(self, done: Callable[[dict[str, Any]], bool],
                    since: int = 0) -> list[dict[str, Any]]:
        """The frames from `since` up to the first (seen already, or received now) for which
        `done` is true."""
        for i in range(since, len(self.seen)):
            if done(self.seen[i]):
                return self.seen[since : i + 1]
        async with asyncio.timeout(EXEC_TIMEOUT_S):
            while True:
                msg = await self.ws.receive()
                assert msg.type is aiohttp.WSMsgType.TEXT, msg
                self.seen.append(msg.json())
                if done(self.seen[-1]):
                    return self.seen[since:]

    async def exits(self, ids: set[str], since: int = 0) -> list[dict[str, Any]]:
        """The frames from `since` until every command of `ids` has sent its exit."""
        left = set(ids)

        def done(frame: dict[str, Any]) -> bool:
            if frame["type"] == "exit":
                left.discard(frame["id"])
            return not left

        return await self.until(done, since)

    async def ready(self, command_id: str) -> None:
        await self.until(lambda f: f["type"] == "ready" and f["id"] == command_id)

    async def error_for(self, message: Any, *, binary: bool = False) -> dict[str, Any]:
        """The error frame that answers `message`."""
        since = len(self.seen)
        if binary:
            await self.ws.send_bytes(message)
        elif isinstance(message, str):
            await self.ws.send_str(message)
        else:
            await self.ws.send_json(message)
        return (await self.until(lambda f: f["type"] == "error", since))[-1]


def output(frames: list[dict[str, Any]], command_id: str, kind: str = "stdout") -> str:
    return "".join(f["data"] for f in frames if f["id"] == command_id and f["type"] == kind)


def wait_for_processes(marker: str, count: int) -> bool:
    deadline = time.monotonic() + PROMPT_S
    while time.monotonic() < deadline:
        if len(host_pids_with(marker)) >= count:
            return True
        time.sleep(0.05)
    return False


# --- many commands, one socket -------------------------------------------------------------------


async def test_concurrent_commands_are_tagged_by_their_ids(
    stream: Frames, sandbox: str
) -> None:
    for n in range(3):
        await stream.send({"id": f"c{n}", "exec": {
            "argv": ["sh", "-c", f"echo out{n}; echo err{n} >&2; exit {n + 3}"]}})
    frames = await stream.exits({"c0", "c1", "c2"})
    for n in range(3):
        mine = [f for f in frames if f["id"] == f"c{n}"]
        kinds = [f["type"] for f in mine]
        assert kinds[:2] == ["starting", "ready"] and kinds[-1] == "exit", mine
        assert mine[-1]["exitCode"] == n + 3
        assert output(frames, f"c{n}") == f"out{n}\n"
        assert output(frames, f"c{n}", "stderr") == f"err{n}\n"
        assert len({f["execId"] for f in mine}) == 1
        assert all(f["sessionId"] == sandbox for f in mine)
    # An id is free again once its command has exited.
    since = len(stream.seen)
    await stream.send({"id": "c0", "exec": {"argv": ["echo", "again"]}})
    frames = await stream.exits({"c0"}, since)
    assert output(frames, "c0") == "again\n" and frames[-1]["exitCode"] == 0


async def test_stdin_and_kill_by_id(
    stream: Frames, marker: str
) -> None:
    await stream.send({"id": "cat", "exec": {"argv": ["cat"], "stdin": "one\n"}})
    await stream.send({"id": "sleep", "exec": {"argv": ["sleep", marker]}})
    await stream.send({"id": "cat", "stdin": "two\n"})
    await stream.send({"id": "cat", "stdinBase64": base64.b64encode(
        "trois é\n".encode()).decode(), "stdinClose": True})
    frames = await stream.exits({"cat"})
    assert output(frames, "cat") == "one\ntwo\ntrois é\n"
    assert frames[-1]["exitCode"] == 0
    assert not [f for f in frames if f["id"] == "sleep" and f["type"] in ("killed", "exit")]
    await stream.ready("sleep")
    await stream.send({"id": "sleep", "kill": True})
    frames = await stream.exits({"sleep"})
    assert [f["type"] for f in frames if f["id"] == "sleep"][-2:] == ["killed", "exit"]
    assert [f["reason"] for f in frames if f["type"] == "killed"] == ["manual"]
    assert await asyncio.to_thread(wait_until_gone, f"sleep\x00{marker}", PROMPT_S) == []


# --- bad frames and ids --------------------------------------------------------------------------


async def test_bad_frames_get_error_frames_and_the_stream_goes_on(
    stream: Frames, tmp_path: pathlib.Path
) -> None:
    for bad in ("not json", '{"id": "x", "exec": {"argv": []}}', '{"id": "x", "bogus": 1}',
                '{"id": "", "exec": {"argv": ["true"]}}', "[1, 2]", '{"id": "x"}'):
        error = await stream.error_for(bad)
        assert (error["status"], error["error"]) == (400, "BadRequest"), (bad, error)
        assert error["id"] in (None, "x"), error
    error = await stream.error_for(b"\x00\x01", binary=True)
    assert (error["status"], error["error"], error["id"]) == (400, "BadRequest", None)
    error = await stream.error_for({"exec": {"argv": ["true"]}})
    assert (error["status"], error["id"]) == (400, None) and "needs an id" in error["message"]
    refused_execs = [
        {"argv": ["true"], "stdinBase64": "not base64!"},
        {"argv": ["true"], "stdin": "a", "stdinBase64": "YQ=="},
        {"argv": ["tr\x00ue"]},
        {"argv": ["true"], "cwd": "relative"},
        {"argv": ["true"], "env": {"A=B": "c"}},
    ]
    for n, req in enumerate(refused_execs):
        error = await stream.error_for({"id": f"bad{n}", "exec": req})
        assert (error["status"], error["error"], error["id"]) == (400, "BadRequest", f"bad{n}")
    error = await stream.error_for({"id": "x", "exec": {"argv": ["true"]}, "kill": True})
    assert (error["status"], error["id"]) == (400, "x")
    # None of them ran, and the stream still runs commands.
    (tmp_path / "ran").mkdir()
    since = len(stream.seen)
    await stream.send({"id": "good", "exec": {"argv": ["ls", str(tmp_path / "ran")]}})
    frames = await stream.exits({"good"}, since)
    assert frames[-1]["exitCode"] == 0 and output(frames, "good") == ""
    assert [f["id"] for f in frames if f["type"] == "error"] == []


async def test_unknown_ids_and_running_ids_are_refused(
    stream: Frames, marker: str
) -> None:
    error = await stream.error_for({"id": "ghost", "stdin": "x"})
    assert (error["status"], error["error"], error["id"]) == (404, "NotFound", "ghost")
    error = await stream.error_for({"id": "ghost", "kill": True})
    assert (error["status"], error["id"]) == (404, "ghost")
    await stream.send({"id": "s", "exec": {"argv": ["sleep", marker]}})
    await stream.ready("s")
    error = await stream.error_for({"id": "s", "exec": {"argv": ["true"]}})
    assert (error["status"], error["error"], error["id"]) == (409, "Conflict", "s")
    assert await asyncio.to_thread(wait_for_processes, f"sleep\x00{marker}", 1)
    await stream.send({"id": "s", "kill": True})
    await stream.exits({"s"})
    error = await stream.error_for({"id": "s", "stdinClose": True})  # exited: unknown now
    assert (error["status"], error["id"]) == (404, "s")


async def test_an_unknown_sandbox_closes_with_4404(server: Server) -> None:
    async with aiohttp.ClientSession(headers=server.auth) as session, session.ws_connect(
        f"{server.ws_url}/v1/sandboxes/nope/session/ws"
    ) as ws:
        error = await ws.receive_json()
        assert error["type"] == "error" and error["error"] == "NotFound"
        await ws.receive()
        assert ws.close_code == 4404


async def test_the_limits_on_commands_and_waiting_input(
    stream: Frames, marker: str
) -> None:
    ids = {f"s{n}" for n in range(SESSION_MAX_COMMANDS)}
    for command_id in sorted(ids):
        await stream.send({"id": command_id, "exec": {"argv": ["sleep", marker]}})
    error = await stream.error_for({"id": "one-more", "exec": {"argv": ["true"]}})
    assert (error["status"], error["error"], error["id"]) == (429, "LimitReached", "one-more")
    # A command that never reads its stdin: the pipe fills, then the messages wait, then the
    # next is refused (not buffered).
    chunk = "x" * 2**16
    for _ in range(SESSION_INPUT_QUEUE + 4):
        await stream.send({"id": "s0", "stdin": chunk})
    error = await stream.error_for({"id": "s0", "stdin": chunk})
    assert (error["status"], error["error"], error["id"]) == (429, "LimitReached", "s0")
    for command_id in ids:
        await stream.send({"id": command_id, "kill": True})
    await stream.exits(ids)
    assert await asyncio.to_thread(wait_until_gone, f"sleep\x00{marker}", PROMPT_S) == []


# --- leaving, and a flood ------------------------------------------------------------------------


async def test_closing_the_stream_mid_command_leaves_no_process(
    server: Server, sandbox: str, marker: str
) -> None:
    async with aiohttp.ClientSession(headers=server.auth) as session:
        async with session.ws_connect(f"{server.ws_url}/v1/sandboxes/{sandbox}/session/ws") as ws:
            for command_id in ("a", "b"):  # each with a child of its own
                await ws.send_json({"id": command_id, "exec": {
                    "argv": ["sh", "-c", f"sleep {marker} & sleep {marker}; wait"]}})
            assert await asyncio.to_thread(wait_for_processes, f"sleep\x00{marker}", 4)
        assert await asyncio.to_thread(wait_until_gone, f"sleep\x00{marker}", PROMPT_S) == []
        async with asyncio.timeout(PROMPT_S):  # the handle settles once both are reaped
            while True:
                async with session.get(f"{server.url}/v1/sandboxes/{sandbox}") as response:
                    if (await response.json())["state"] == "warm":
                        break
                await asyncio.sleep(0.05)


async def test_a_flood_left_unread_is_held_back_then_delivered_whole(
    server: Server, sandbox: str, stream: Frames
) -> None:
    before = rss_bytes(server.proc.pid)
    await stream.send({"id": "flood", "exec": {"argv": [
        "sh", "-c", f"head -c {FLOOD_BYTES} /dev/zero | tr '\\0' a"]}})
    await asyncio.sleep(FLOOD_PAUSE_S)  # nobody reads: the command must wait, not the server
    held = rss_bytes(server.proc.pid) - before
    async with (  # other clients are served meanwhile
        server.client() as client,
        asyncio.timeout(PROMPT_S),
        client.get(f"/v1/sandboxes/{sandbox}") as response,
    ):
        assert response.status == 200
    received, frame = 0, {}
    async with asyncio.timeout(EXEC_TIMEOUT_S * 4):
        while frame.get("type") != "exit":
            frame = await stream.ws.receive_json()
            assert frame["id"] == "flood"
            if frame["type"] == "stdout":
                received += len(frame["data"])
    assert received == FLOOD_BYTES
    assert frame["exitCode"] == 0
    assert held < FLOOD_HELD_MAX_BYTES, f"the server grew by {held / 2**20:.0f} MiB"
