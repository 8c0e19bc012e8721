"""Terminal sessions through the library: the runner's PTY spawn (the PTY is the controlling
terminal, the window size is set), and a session's close ending everything its shell started, on
the host (`none`) and in real bubblewrap (`native`)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import secrets
from collections.abc import AsyncIterator, Iterator

import pytest
from server_kit import host_pids_with, kill_marked, wait_until_gone

from cc_server.backends.none import plan_none
from cc_server.backends.plan import Command
from cc_server.backends.runner import start_pty
from cc_server.policy import HostFacts, SandboxBackend
from cc_server.runtime.port import SandboxManager
from cc_server.terminal import TerminalSession, TerminalSessionService
from cc_server.terminal.profile import terminal_policy

pytestmark = pytest.mark.integration

EXPECT_S = 20.0
PROMPT_S = 10.0

CTTY_CHECK = (
    "import os; print('ctty', os.getsid(0) == os.getpid(), os.tcgetpgrp(0) == os.getpgrp(),"
    " os.get_terminal_size(0))"
)


async def read_all(session: TerminalSession) -> bytes:
    out = b""
    async with asyncio.timeout(EXPECT_S):
        while chunk := await session.read():
            out += chunk
    return out


async def test_start_pty_gives_the_child_its_controlling_terminal(
    host: HostFacts, tmp_path: pathlib.Path
) -> None:
    policy = terminal_policy("t-pty", str(tmp_path), host)
    plan = plan_none(policy, Command(argv=("python3", "-c", CTTY_CHECK),
                                     env=(("PATH", "/usr/bin:/bin"),), cwd=str(tmp_path)))
    pty = await start_pty(plan, 31, 97)
    try:
        loop = asyncio.get_running_loop()
        output = b""
        reading: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            nonlocal output
            try:
                data = os.read(pty.master_fd, 4096)
            except OSError:
                data = b""
            if data:
                output += data
            elif not reading.done():
                reading.set_result(None)

        loop.add_reader(pty.master_fd, readable)
        try:
            async with asyncio.timeout(EXPECT_S):
                await pty.process.wait()
                await reading
        finally:
            loop.remove_reader(pty.master_fd)
        assert b"ctty True True os.terminal_size(columns=97, lines=31)" in output, output
    finally:
        os.close(pty.master_fd)
        pty.transport.close()


@pytest.fixture
def marker() -> Iterator[str]:
    value = str(100000 + secrets.randbelow(800000))
    yield value
    kill_marked(f"sleep\x00{value}")


@pytest.fixture
async def service(manager: SandboxManager) -> AsyncIterator[TerminalSessionService]:
    svc = TerminalSessionService(manager)
    try:
        yield svc
    finally:
        await svc.aclose()


@pytest.mark.parametrize("backend", [SandboxBackend.NONE, SandboxBackend.NATIVE])
async def test_close_ends_jobs_setsid_children_and_double_forks(
    service: TerminalSessionService, backend: SandboxBackend, marker: str
) -> None:
    session = await service.open(backend=backend)
    assert session.backend is backend
    # A job (own group), a setsid child (own session), and a double fork that left the tree.
    await session.write(
        f"sleep {marker} & setsid sleep {marker} & (setsid sleep {marker} &) ; echo ok\n".encode()
    )
    async with asyncio.timeout(PROMPT_S):
        while len(host_pids_with(f"sleep\x00{marker}")) < 3:
            await asyncio.sleep(0.05)
    await service.close(session.session_id)
    assert await asyncio.to_thread(wait_until_gone, f"sleep\x00{marker}", PROMPT_S) == []
    assert service.sessions == {}
    await read_all(session)  # closed: reads end (after what was buffered), writes are dropped
    await session.write(b"ignored\n")


async def test_exit_code_and_output_of_a_session(service: TerminalSessionService) -> None:
    session = await service.open()
    assert session.backend is SandboxBackend.NONE  # the default
    await session.write(b"echo out-$((3*3)); exit 4\n")
    assert await asyncio.wait_for(session.wait(), EXPECT_S) == 4
    await service.close(session.session_id)


async def test_slow_readers_get_backpressure_not_unbounded_buffers(
    service: TerminalSessionService,
) -> None:
    session = await service.open()
    await session.write(b"head -c 3000000 /dev/zero | tr '\\0' x; echo; echo END-$((1+1))\n")
    await asyncio.sleep(1.0)  # nobody reads meanwhile: the PTY fills and the writer blocks
    assert session._buffered < 2 * 256 * 1024
    out = b""
    async with asyncio.timeout(EXPECT_S):
        while b"END-2" not in out:
            out += await session.read()
    assert out.count(b"x") >= 3_000_000
    await service.close(session.session_id)
