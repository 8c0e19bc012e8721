"""A real server process under commands that write without end: the collected exec result keeps a
bounded head per stream and says how much it dropped, and neither the collected exec, nor the
exec or terminal WebSocket of a client that never reads, lets the server's memory follow the
command's output.

Memory is the server's peak RSS (`VmHWM` in /proc/<pid>/status), absolute, of a server started
for the one test: that is the number the promise names (256 MiB), it includes the interpreter and
the boot (about 65 MiB here), so no growth of the baseline can hide behind a delta, and no other
test's load is in it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import pathlib
import secrets
import time
from collections.abc import Iterator

import aiohttp
import pytest
from server_kit import (
    Server,
    host_pids_with,
    kill_marked,
    run_serve_to_exit,
    running_server,
    wait_until_gone,
)

pytestmark = pytest.mark.integration

GIB = 1024 * 1024 * 1024
MIB = 1024 * 1024
DEFAULT_LIMIT_BYTES = 16 * MIB  # runtime.output.DEFAULT_COLLECT_LIMIT_BYTES, as documented
PEAK_RSS_BYTES = 256 * MIB  # the promise: 1 GiB of output keeps the server under this
HANG_GUARD_S = 600.0  # 1 GiB through a sandbox on a loaded 2-CPU host; normally ~10 s
PROMPT_S = 10.0
STALL_SAMPLES = 5  # equal readings of the writer's progress, 0.2 s apart, count as held
MARK = b"HEAD-MARK:"  # the first bytes of the stream, so the kept head is checked byte for byte


@pytest.fixture
def work(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


@pytest.fixture
def count() -> Iterator[int]:
    """A byte count just over 1 GiB, unique to the test: `head -c COUNT` is found in /proc."""
    value = GIB + secrets.randbelow(1_000_000)
    yield value
    kill_marked(f"head\x00-c\x00{value}\x00")


def peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def written_bytes(pid: int) -> int:
    """What the process has written so far (`wchar` in /proc/<pid>/io)."""
    with open(f"/proc/{pid}/io", encoding="ascii") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise AssertionError(f"no wchar for {pid}")


async def create(client: aiohttp.ClientSession, work: pathlib.Path) -> str:
    session_id = f"out-{secrets.token_hex(6)}"
    async with client.post("/v1/sandboxes", json={"spec": {
        "sessionId": session_id, "workspaceId": "w", "bindMounts": [{"hostPath": str(work)}],
    }}) as response:
        assert response.status == 201, await response.text()
    return session_id


async def exec_body(client: aiohttp.ClientSession, session_id: str,
                    argv: list[str]) -> dict[str, object]:
    async with asyncio.timeout(HANG_GUARD_S), client.post(
        f"/v1/sandboxes/{session_id}/exec", json={"argv": argv}
    ) as response:
        body = await response.read()
        assert response.status == 200, body[:2000]
    result = json.loads(body)
    assert isinstance(result, dict)
    return result


async def test_a_gib_of_stdout_keeps_the_server_under_256_mib_and_the_exact_head(
    tmp_path: pathlib.Path, work: pathlib.Path
) -> None:
    script = f"printf '{MARK.decode()}'; head -c {GIB} /dev/zero; printf tail; echo err >&2"
    with running_server(tmp_path) as server:
        async with server.client() as client:
            session_id = await create(client, work)
            result = await exec_body(client, session_id, ["sh", "-c", script])
            async with client.get("/healthz") as response:  # still serving
                assert response.status == 200
            peak = peak_rss_bytes(server.proc.pid)
    assert result["exitCode"] == 0 and result["killed"] is False
    head = MARK + bytes(DEFAULT_LIMIT_BYTES - len(MARK))
    assert base64.b64decode(str(result["stdoutBase64"])) == head
    assert result["stdout"] == head.decode()
    assert result["stdoutTruncated"] is True
    assert result["stdoutDroppedBytes"] == len(MARK) + GIB + len(b"tail") - DEFAULT_LIMIT_BYTES
    assert (result["stderr"], result["stderrTruncated"], result["stderrDroppedBytes"]) == (
        "err\n", False, 0)
    assert peak < PEAK_RSS_BYTES, f"server peak RSS {peak / MIB:.0f} MiB"


async def test_the_limit_is_the_servers_option_and_exact_at_the_boundary(
    tmp_path: pathlib.Path, work: pathlib.Path
) -> None:
    with running_server(tmp_path, env={"CC_SERVER_EXEC_OUTPUT_LIMIT": "1000"}) as server:
        async with server.client() as client:
            session_id = await create(client, work)
            over = await exec_body(client, session_id, [
                "sh", "-c", "head -c 1500 /dev/zero | tr '\\0' o; head -c 2500 /dev/zero >&2"])
            exact = await exec_body(client, session_id, [
                "sh", "-c", "head -c 1000 /dev/zero | tr '\\0' o"])
    assert (over["stdout"], over["stdoutTruncated"], over["stdoutDroppedBytes"]) == (
        "o" * 1000, True, 500)
    assert (over["stderrBase64"], over["stderrTruncated"], over["stderrDroppedBytes"]) == (
        base64.b64encode(bytes(1000)).decode(), True, 1500)
    assert (exact["stdout"], exact["stdoutTruncated"], exact["stdoutDroppedBytes"]) == (
        "o" * 1000, False, 0)


def test_a_bad_limit_stops_the_start(tmp_path: pathlib.Path) -> None:
    done = run_serve_to_exit(tmp_path, env={"CC_SERVER_EXEC_OUTPUT_LIMIT": "16MiB"})
    assert done.returncode == 2
    assert "CC_SERVER_EXEC_OUTPUT_LIMIT must be a number of bytes" in done.stdout + done.stderr


def client_text_frame(payload: bytes) -> bytes:
    """One masked WebSocket text frame, as a client sends it (RFC 6455 5.2)."""
    mask = os.urandom(4)
    size = len(payload)
    if size < 126:
        header = bytes([0x81, 0x80 | size])
    elif size < 1 << 16:
        header = bytes([0x81, 0x80 | 126]) + size.to_bytes(2, "big")
    else:
        header = bytes([0x81, 0x80 | 127]) + size.to_bytes(8, "big")
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def open_silent_ws(server: Server, path: str, first: dict[str, object]
                         ) -> asyncio.StreamWriter:
    """A WebSocket client that sends its request and then never reads a byte (a raw socket: a
    client library would read into its own buffers)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
        f"Authorization: Bearer {server.token}\r\n\r\n").encode())
    async with asyncio.timeout(PROMPT_S):
        answer = await reader.readuntil(b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 101"), answer
    writer.write(client_text_frame(json.dumps(first).encode()))
    await writer.drain()
    return writer


def writer_pid(marker: str) -> int | None:
    """The process whose argv starts with `marker` (not bwrap or the launcher, whose argv only
    holds it)."""
    for pid in host_pids_with(marker):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read().startswith(marker.encode()):
                return pid
    return None


def wait_until_held(marker: str) -> int:
    """The bytes the marked writer has written once its progress stops: STALL_SAMPLES equal
    readings in a row."""
    deadline = time.monotonic() + HANG_GUARD_S
    samples: list[int] = []
    while time.monotonic() < deadline:
        pid = writer_pid(marker)
        if pid is not None:
            with contextlib.suppress(OSError):
                samples.append(written_bytes(pid))
            if len(samples) >= STALL_SAMPLES and len(set(samples[-STALL_SAMPLES:])) == 1:
                return samples[-1]
        time.sleep(0.2)
    raise AssertionError(f"the writer was never held back: {samples[-STALL_SAMPLES:]}")


@pytest.mark.parametrize("route", ["exec/ws", "session/ws"])
async def test_an_exec_ws_client_that_never_reads_holds_the_command_not_the_servers_memory(
    tmp_path: pathlib.Path, work: pathlib.Path, count: int, route: str
) -> None:
    marker = f"head\x00-c\x00{count}\x00"
    request: dict[str, object] = {"argv": ["head", "-c", str(count), "/dev/zero"]}
    with running_server(tmp_path) as server:
        async with server.client() as client:
            session_id = await create(client, work)
            writer = await open_silent_ws(  # the session stream: the same request, with an id
                server, f"/v1/sandboxes/{session_id}/{route}",
                request if route == "exec/ws" else {"id": "flood", "exec": request})
            try:
                written = await asyncio.to_thread(wait_until_held, marker)
                peak = peak_rss_bytes(server.proc.pid)
                async with client.get("/healthz") as response:  # the loop is not stuck
                    assert response.status == 200
            finally:
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()
            # Closing the socket kills the command.
            assert await asyncio.to_thread(wait_until_gone, marker, PROMPT_S) == []
    assert 0 < written < count, f"the command wrote {written} bytes: it was not held back"
    assert peak < PEAK_RSS_BYTES, f"server peak RSS {peak / MIB:.0f} MiB"


async def test_a_terminal_ws_client_that_never_reads_holds_the_shell_not_the_servers_memory(
    tmp_path: pathlib.Path, count: int
) -> None:
    marker = f"head\x00-c\x00{count}\x00"
    with running_server(tmp_path) as server:
        writer = await open_silent_ws(server, "/v1/terminals?backend=none",
                                      {"input": f"exec head -c {count} /dev/zero\n"})
        try:
            written = await asyncio.to_thread(wait_until_held, marker)
            peak = peak_rss_bytes(server.proc.pid)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        # Closing the socket ends the shell and what it runs.
        assert await asyncio.to_thread(wait_until_gone, marker, PROMPT_S) == []
    assert 0 < written < count, f"the shell wrote {written} bytes: it was not held back"
    assert peak < PEAK_RSS_BYTES, f"server peak RSS {peak / MIB:.0f} MiB"

