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
import subprocess
import sys
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


async def start_sleep(session: aiohttp.ClientSession, server: Server, session_id: str,
                      marker: str, work: pathlib.Path,
                      backend: str | None = None) -> aiohttp.ClientWebSocketResponse:
    """Create a sandbox and start `sleep MARKER` in it over the exec WebSocket; returns the open
    socket once the command is ready."""
    body: dict[str, Any] = {"spec": {"sessionId": session_id, "workspaceId": "w",
                                     "bindMounts": [{"hostPath": str(work)}]}}
    if backend:
        body["backend"] = backend
    async with session.post(f"{server.url}/v1/sandboxes", json=body) as response:
        assert response.status == 201, await response.text()
    ws = await session.ws_connect(f"{server.ws_url}/v1/sandboxes/{session_id}/exec/ws")
    await ws.send_json({"argv": ["sleep", marker]})
    async with asyncio.timeout(EVENT_S):
        while (await ws.receive_json())["type"] != "ready":
            pass
    return ws


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
        async with aiohttp.ClientSession(headers=server.auth) as session:
            ws = await start_sleep(session, server, "doomed", marker, work)
            await kill_the_server_while_it_runs(server, runtime_dir, marker)
            await ws.close()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
    left_behind = egress_dirs(runtime_dir)

    with running_server(tmp_path, runtime_dir=runtime_dir) as second:
        assert egress_dirs(runtime_dir) == []
        (cleanup,) = [e for e in second.events if e["event"] == "cleanup"]
        assert cleanup["removed"] == left_behind


async def kill_the_server_while_it_runs(
    server: Server, runtime_dir: pathlib.Path, marker: str
) -> None:
    # The sleep itself: the session's sandbox (bwrap, its launcher) does not carry the command.
    async with asyncio.timeout(PROMPT_S):
        while len(host_pids_with(f"sleep\x00{marker}")) < 1:
            await asyncio.sleep(0.02)
    left_behind = egress_dirs(runtime_dir)
    assert len(left_behind) == 1  # the session's private proxy socket directory

    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=PROMPT_S)
    # bwrap --die-with-parent: the sandbox's PID 1 dies with the server, and every process in
    # its PID namespace with it. No orphan is left on the host.
    assert await asyncio.to_thread(
        wait_until_gone, f"sleep\x00{marker}", PROMPT_S
    ) == [], "sandboxed processes outlived a SIGKILLed server"
    assert egress_dirs(runtime_dir) == left_behind  # nobody cleaned up: it was killed


def test_the_next_boot_kills_sandboxes_that_outlived_a_killed_server(
    tmp_path: pathlib.Path, runtime_dir: pathlib.Path, marker: str
) -> None:
    # bwrap arms --die-with-parent in the sandbox's PID 1 only after creating it; a server killed
    # in that window leaves the sandbox running, its argv naming the dead server's socket dir.
    dead = subprocess.Popen(["true"])
    dead.wait()
    base = runtime_dir / "cc-server"
    base.mkdir(mode=0o700)
    stale = base / f"egress-{dead.pid}-{secrets.token_hex(8)}"
    stale.mkdir(mode=0o700)
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)", marker, "--ro-bind"]
    orphan = subprocess.Popen([*sleeper, str(stale), "/run/cc-egress"], start_new_session=True)
    bystander = subprocess.Popen([*sleeper, str(base / "egress-1-0123456789abcdef")])
    try:
        with running_server(tmp_path, runtime_dir=runtime_dir) as server:
            (cleanup,) = [e for e in server.events if e["event"] == "cleanup"]
            assert cleanup["removed"] == [stale.name]
            assert cleanup["killed"] == [orphan.pid]
            assert orphan.wait(timeout=PROMPT_S) == -signal.SIGKILL
            assert bystander.poll() is None  # pid 1 is alive: not a dead server's directory
    finally:
        for proc in (orphan, bystander):
            proc.kill()
            proc.wait()


async def test_sigterm_ends_commands_terminals_and_sandboxes_gracefully(
    tmp_path: pathlib.Path, runtime_dir: pathlib.Path, marker: str
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    token_file = tmp_path / "token"
    server = start_server(tmp_path, "--token-file", str(token_file), runtime_dir=runtime_dir)
    try:
        async with aiohttp.ClientSession(headers=server.auth) as session:
            await shut_down_while_busy(server, session, runtime_dir, token_file, marker, work)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


async def shut_down_while_busy(server: Server, session: aiohttp.ClientSession,
                               runtime_dir: pathlib.Path, token_file: pathlib.Path,
                               marker: str, work: pathlib.Path) -> None:
    native_ws = await start_sleep(session, server, "n1", marker, work)
    none_ws = await start_sleep(session, server, "h1", marker, work, backend="none")
    terminal_ws = await session.ws_connect(
        f"{server.ws_url}/v1/terminals", params={"backend": "native"})
    assert (await terminal_ws.receive_json())["backend"] == "native"
    await terminal_ws.send_bytes(f"sleep {marker}\n".encode())
    async with asyncio.timeout(PROMPT_S):
        while len(host_pids_with(f"sleep\x00{marker}")) < 3:  # the three sleeps
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
