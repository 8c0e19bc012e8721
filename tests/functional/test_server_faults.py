"""Shutdown and faults of a real server process: SIGTERM ends everything gracefully; SIGKILL
takes the sandboxed commands with it, and the next boot removes what was left on disk."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import secrets
import shutil
import signal
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from server_kit import (
    Server,
    host_pids_with,
    kill_marked,
    running_server,
    short_runtime_dir,
    start_server,
    wait_until_gone,
)

pytestmark = pytest.mark.integration

PROMPT_S = 10.0  # far below the commands' own sleeps
EVENT_S = 20.0


@pytest.fixture
def marker() -> Iterator[str]:
    value = str(100000 + secrets.randbelow(800000))
    yield value
    kill_marked(f"sleep\x00{value}")


@pytest.fixture
def runtime_dir() -> Iterator[pathlib.Path]:
    path = short_runtime_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def egress_dirs(runtime_dir: pathlib.Path) -> list[str]:
    base = runtime_dir / "cc-server"
    return sorted(n for n in os.listdir(base) if n.startswith("egress-")) if base.exists() else []


async def start_sleep(server: Server, session_id: str, marker: str,
                      work: pathlib.Path, backend: str | None = None) -> Any:
    """Create a sandbox and start `sleep MARKER` in it over the exec WebSocket; returns the open
    socket (with its client session) once the command is ready."""
    body: dict[str, Any] = {"spec": {"sessionId": session_id, "workspaceId": "w",
                                     "bindMounts": [{"hostPath": str(work)}]}}
    if backend:
        body["backend"] = backend
    session = aiohttp.ClientSession(headers=server.auth)
    async with session.post(f"{server.url}/v1/sandboxes", json=body) as response:
        assert response.status == 201, await response.text()
    ws = await session.ws_connect(f"{server.ws_url}/v1/sandboxes/{session_id}/exec/ws")
    await ws.send_json({"argv": ["sleep", marker]})
    async with asyncio.timeout(EVENT_S):
        while (await ws.receive_json())["type"] != "ready":
            pass
    return session, ws


async def rest_of(ws: aiohttp.ClientWebSocketResponse) -> list[dict[str, Any]]:
    async with asyncio.timeout(EVENT_S):
        return [json.loads(m.data) async for m in ws if m.type is aiohttp.WSMsgType.TEXT]


async def test_sigkill_takes_the_sandbox_with_it_and_the_next_boot_cleans_up(
    tmp_path: pathlib.Path, runtime_dir: pathlib.Path, marker: str
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    server = start_server(tmp_path, runtime_dir=runtime_dir)
    try:
        session, ws = await start_sleep(server, "doomed", marker, work)
        sandboxed = host_pids_with(f"sleep\x00{marker}")
        assert sandboxed, "the sandboxed sleep (and its bwrap) should be running"
        left_behind = egress_dirs(runtime_dir)
        assert len(left_behind) == 1  # the session's private proxy socket directory

        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=PROMPT_S)
        # bwrap --die-with-parent: the sandbox's PID 1 dies with the server, and every process
        # in its PID namespace with it. No orphan is left on the host.
        assert await asyncio.to_thread(
            wait_until_gone, f"sleep\x00{marker}", PROMPT_S
        ) == [], "sandboxed processes outlived a SIGKILLed server"
        assert egress_dirs(runtime_dir) == left_behind  # nobody cleaned up: it was killed
        await ws.close()
        await session.close()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()

    with running_server(tmp_path, runtime_dir=runtime_dir) as second:
        assert egress_dirs(runtime_dir) == []
        (cleanup,) = [e for e in second.events if e["event"] == "cleanup"]
        assert cleanup["removed"] == left_behind


async def test_sigterm_ends_commands_terminals_and_sandboxes_gracefully(
    tmp_path: pathlib.Path, runtime_dir: pathlib.Path, marker: str
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    token_file = tmp_path / "token"
    server = start_server(tmp_path, "--token-file", str(token_file), runtime_dir=runtime_dir)
    clients: list[aiohttp.ClientSession] = []
    try:
        native_session, native_ws = await start_sleep(server, "n1", marker, work)
        none_session, none_ws = await start_sleep(server, "h1", marker, work, backend="none")
        clients += [native_session, none_session]
        terminal_ws = await native_session.ws_connect(
            f"{server.ws_url}/v1/terminals", params={"backend": "native"})
        assert (await terminal_ws.receive_json())["backend"] == "native"
        await terminal_ws.send_bytes(f"sleep {marker}\n".encode())
        async with asyncio.timeout(PROMPT_S):
            while len(host_pids_with(f"sleep\x00{marker}")) < 4:  # 2 bwrap + 2 sleeps at least
                await asyncio.sleep(0.05)

        server.proc.send_signal(signal.SIGTERM)
        native_events, none_events = await asyncio.gather(rest_of(native_ws), rest_of(none_ws))
        for events in (native_events, none_events):
            assert [e["type"] for e in events][-2:] == ["killed", "exit"]
            assert events[-2]["reason"] == "shutdown"
        assert await asyncio.to_thread(server.proc.wait, EVENT_S) == 0
        assert await asyncio.to_thread(wait_until_gone, f"sleep\x00{marker}", PROMPT_S) == []
        assert egress_dirs(runtime_dir) == []  # proxies closed, their directories removed
        assert not token_file.exists()
        events = [e["event"] for e in server.log()]
        assert events.index("shutdown") < events.index("stopped")
    finally:
        for client in clients:
            await client.close()
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
