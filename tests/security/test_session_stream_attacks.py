"""Attacks on the server's session stream (GET /v1/sandboxes/{id}/session/ws) by a client that
holds the token: stdin sent to commands that never read it, to make the server hold it, and a
stream kept open across its sandbox's destruction, to reach a new sandbox that took its id."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from server_kit import (
    Server,
    drop_sandbox,
    frame_until,
    kill_marked,
    new_sandbox,
    rss_bytes,
    running_server,
)

from cc_server.server.exec_api import SESSION_INPUT_QUEUE, SESSION_STREAM_STDIN_BYTES

pytestmark = pytest.mark.integration

TIMEOUT_S = 60.0  # hang guard for frames that come in well under a second
HELD_MAX_BYTES = 40 * 2**20  # what one stream may make the server hold (as for its output)
CHUNK = "a" * (2 * 2**20)  # one stdin message: 2 MiB, half of aiohttp's largest message


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("stream-attacks")) as srv:
        yield srv


@pytest.fixture
async def sandbox(server: Server, tmp_path: pathlib.Path) -> AsyncIterator[str]:
    session_id = await new_sandbox(server, tmp_path)
    try:
        yield session_id
    finally:
        await drop_sandbox(server, session_id)


@pytest.fixture
def sleep_marker() -> Iterator[str]:
    value = str(400000 + secrets.randbelow(500000))  # a unique `sleep` duration, found in /proc
    yield value
    kill_marked(f"sleep\x00{value}")


async def _flood_until_refused(
    ws: aiohttp.ClientWebSocketResponse, command_id: str
) -> dict[str, Any] | None:
    """Send CHUNK after CHUNK to `command_id` (more messages than may wait); the first frame
    that answers, or None when none came."""
    for _ in range(SESSION_INPUT_QUEUE + 8):
        await ws.send_json({"id": command_id, "stdin": CHUNK})
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.05):
                answer: dict[str, Any] = (await ws.receive()).json()
                return answer
    return None


async def test_stdin_nobody_reads_is_held_within_a_bound(
    server: Server, sandbox: str, sleep_marker: str
) -> None:
    """A command that never reads its stdin, sent message after message of it: the server holds
    a bounded number of bytes for it, then refuses (429), and its memory stays bounded."""
    url = f"{server.ws_url}/v1/sandboxes/{sandbox}/session/ws"
    async with aiohttp.ClientSession(headers=server.auth) as session, \
            session.ws_connect(url, max_msg_size=0) as ws:  # fmt: skip
        await ws.send_json({"id": "deaf", "exec": {"argv": ["sleep", sleep_marker]}})
        await frame_until(ws, "ready", "deaf")
        before = rss_bytes(server.proc.pid)
        refused = await _flood_until_refused(ws, "deaf")
        await asyncio.sleep(1.0)
        held = rss_bytes(server.proc.pid) - before
    assert refused is not None, "every message was taken"
    assert (refused["type"], refused["status"], refused["error"], refused["id"]) == (
        "error", 429, "LimitReached", "deaf"), refused  # fmt: skip
    assert held < HELD_MAX_BYTES, f"the server holds {held / 2**20:.0f} MiB of stdin"


async def test_stdin_spread_over_many_commands_is_held_within_a_bound(
    server: Server, sandbox: str, sleep_marker: str
) -> None:
    """Many commands that never read their stdin, one message of it each (each within what one
    command may have waiting): the stream as a whole holds a bounded number of bytes, and the
    messages past that are refused (429)."""
    url = f"{server.ws_url}/v1/sandboxes/{sandbox}/session/ws"
    ids = [f"deaf{n}" for n in range(24)]  # 48 MiB sent
    answers: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(headers=server.auth) as session, \
            session.ws_connect(url, max_msg_size=0) as ws:  # fmt: skip
        for command_id in ids:
            await ws.send_json({"id": command_id, "exec": {"argv": ["sleep", sleep_marker]}})
            await frame_until(ws, "ready", command_id)
        before = rss_bytes(server.proc.pid)
        for command_id in ids:
            await ws.send_json({"id": command_id, "stdin": CHUNK})
        with contextlib.suppress(TimeoutError):
            while True:  # every answer, until none came for a second
                async with asyncio.timeout(1.0):
                    answers.append((await ws.receive()).json())
        held = rss_bytes(server.proc.pid) - before
    assert answers, "every message was taken"
    for refused in answers:
        assert (refused["type"], refused["status"], refused["error"]) == (
            "error", 429, "LimitReached"), refused  # fmt: skip
    assert held < HELD_MAX_BYTES, f"the server holds {held / 2**20:.0f} MiB of stdin"


async def test_the_stdin_of_exec_messages_counts_toward_the_bound(
    server: Server, sandbox: str, sleep_marker: str
) -> None:
    """Commands started with stdin in their exec message, none of them reading it: that stdin
    waits too, so past the stream's bound the next such exec is refused (429) and never runs."""
    url = f"{server.ws_url}/v1/sandboxes/{sandbox}/session/ws"
    stdin = "a" * (3 * 2**20)  # with its JSON, under aiohttp's 4 MiB message
    argv = ["sleep", sleep_marker]
    async with aiohttp.ClientSession(headers=server.auth) as session, \
            session.ws_connect(url, max_msg_size=0) as ws:  # fmt: skip
        for n in range(SESSION_STREAM_STDIN_BYTES // len(stdin)):
            await ws.send_json({"id": f"fed{n}", "exec": {"argv": argv, "stdin": stdin}})
            await frame_until(ws, "ready", f"fed{n}")
        await ws.send_json({"id": "one-more", "exec": {"argv": argv, "stdin": stdin}})
        async with asyncio.timeout(TIMEOUT_S):  # its refusal, or the frames of its start
            while (refused := (await ws.receive()).json()).get("id") != "one-more":
                pass
        assert refused["type"] == "error", f"the exec past the bound ran: {refused}"
        assert (refused["status"], refused["error"]) == (429, "LimitReached"), refused
        await ws.send_json({"id": "small", "exec": {"argv": ["true"], "stdin": "x"}})
        assert (await frame_until(ws, "exit", "small"))["exitCode"] == 0  # the stream goes on


async def test_a_stream_does_not_follow_its_sandbox_id_to_a_new_sandbox(
    server: Server, tmp_path: pathlib.Path
) -> None:
    """The stream of a sandbox that was destroyed, its id then given to a new sandbox with other
    binds: the stream's commands never run in the new one, and its next frame is refused."""
    old_bind, new_bind = tmp_path / "old", tmp_path / "new"
    for d in (old_bind, new_bind):
        d.mkdir()
        (d / "which").write_text(f"{d.name}\n")
    session_id = await new_sandbox(server, old_bind)
    url = f"{server.ws_url}/v1/sandboxes/{session_id}/session/ws"
    answers: list[dict[str, Any]] = []
    try:
        async with (
            aiohttp.ClientSession(headers=server.auth) as session,
            session.ws_connect(url) as ws,
        ):
            await ws.send_json({"id": "a", "exec": {"argv": ["cat", f"{old_bind}/which"]}})
            assert (await frame_until(ws, "stdout", "a"))["data"] == "old\n"
            await frame_until(ws, "exit", "a")
            await drop_sandbox(server, session_id)
            await new_sandbox(server, new_bind, session_id)
            await ws.send_json(
                {
                    "id": "b",
                    "exec": {
                        "argv": ["sh", "-c", f"cat {new_bind}/which; touch {new_bind}/reached"]
                    },
                }
            )
            async with asyncio.timeout(TIMEOUT_S):  # its exit or error frame, or the close
                while (msg := await ws.receive()).type is aiohttp.WSMsgType.TEXT:
                    answers.append(msg.json())
                    if answers[-1].get("id") == "b" and answers[-1]["type"] in ("exit", "error"):
                        break
        assert not (new_bind / "reached").exists(), answers
        assert not any(a.get("data") == "new\n" for a in answers), answers
        assert answers and answers[-1]["type"] == "error", answers
        assert (answers[-1]["status"], answers[-1]["error"]) == (409, "Closed"), answers
    finally:
        await drop_sandbox(server, session_id)


async def test_a_stream_whose_sandbox_was_destroyed_ends_its_commands(
    server: Server, sandbox: str, sleep_marker: str, tmp_path: pathlib.Path
) -> None:
    """A command running on a stream when its sandbox is destroyed ends (its exit frame), and
    stdin sent to it afterwards reaches nothing in a new sandbox of that id."""
    url = f"{server.ws_url}/v1/sandboxes/{sandbox}/session/ws"
    async with aiohttp.ClientSession(headers=server.auth) as session, \
            session.ws_connect(url) as ws:  # fmt: skip
        await ws.send_json({"id": "long", "exec": {"argv": ["sleep", sleep_marker]}})
        await frame_until(ws, "ready", "long")
        await drop_sandbox(server, sandbox)
        await new_sandbox(server, tmp_path, sandbox)
        ended = await frame_until(ws, "exit", "long")
        assert ended["exitCode"] != 0, ended
        for message in (
            {"id": "long", "stdin": "x\n"},
            {"id": "c", "exec": {"argv": ["true"]}},
            {"id": "long", "kill": True},
        ):
            await ws.send_json(message)
            refused = await frame_until(ws, "error")
            assert (refused["id"], refused["status"], refused["error"]) == (
                message["id"], 409, "Closed"), refused  # fmt: skip
