"""Teardown leaves nothing behind: no sandboxed process, no fd, no hung consumer.

Processes are found on the host by a unique marker in their argv (/proc/*/cmdline).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cc_server.backends.probe import ProbeResult
from cc_server.policy import HostFacts, SandboxBackend, parse_spec
from cc_server.runtime.events import EventType, SandboxState
from cc_server.runtime.handle import run_collect
from cc_server.runtime.port import SandboxManager

pytestmark = pytest.mark.integration

SH = "/bin/sh"
HANG_GUARD_S = 20.0  # anything slower than this counts as a hang
HOST_POLL_S = 3.0  # how long a killed process may take to disappear from the host


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique marker; any host process still carrying it afterwards is killed (test hygiene)."""
    value = f"cc-teardown-{secrets.token_hex(8)}"
    yield value
    for pid in host_pids_with(value):
        kill_quietly(pid)


def kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def spec(session_id: str = "t1", **fields: Any) -> Any:
    return parse_spec({"sessionId": session_id, "workspaceId": "w", **fields})


def host_pids_with(marker: str) -> list[int]:
    """Host processes whose argv contains `marker` (this process excluded; zombies excluded)."""
    needle = marker.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle in f.read():
                    found.append(int(entry))
        except OSError:  # gone meanwhile
            continue
    return found


async def wait_until_gone(marker: str) -> list[int]:
    """Poll up to HOST_POLL_S for every process carrying `marker` to disappear; the survivors."""
    deadline = time.monotonic() + HOST_POLL_S
    while (left := host_pids_with(marker)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return left


def sleeper(tag: str) -> str:
    """A 300 s sleeper with `tag` in its argv; it first leaves /tmp/ready-TAG (the sandbox's own
    /tmp) so a script can wait until it really runs."""
    return (
        "/usr/bin/python3 -c 'import sys, time\n"
        'open("/tmp/ready-" + sys.argv[1], "w").close()\n'
        f"time.sleep(300)' {tag}"
    )


def spawner(marker: str) -> str:
    """A native-sandbox script that leaves background processes behind, each with `marker` in
    its argv: a plain background child, one in its own session (setsid), one forked off by
    `setsid -f`, and a double-forked daemon. It prints `spawned` once all four run."""
    daemon = (
        "/usr/bin/python3 -c 'import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        '        open("/tmp/ready-" + sys.argv[1], "w").close()\n'
        "        time.sleep(300)\n"
        f"' {marker}-daemon"
    )
    return (
        f"{sleeper(marker + '-plain')} >/dev/null 2>&1 &\n"
        f"/usr/bin/setsid {sleeper(marker + '-setsid')} >/dev/null 2>&1 &\n"
        f"/usr/bin/setsid -f {sleeper(marker + '-setsid-f')} >/dev/null 2>&1\n"
        f"{daemon} >/dev/null 2>&1\n"
        "while [ $(ls /tmp | grep -c '^ready-') -lt 4 ]; do sleep 0.05; done\n"
        "echo spawned\n"
    )


async def test_background_children_of_a_finished_command_are_gone_after_destroy(
    manager: SandboxManager, marker: str
) -> None:
    handle = manager.launch(spec())
    async with asyncio.timeout(HANG_GUARD_S):
        result = await run_collect(handle, [SH, "-c", spawner(marker)], timeout_s=HANG_GUARD_S)
        assert (result.exit_code, result.stdout, result.killed) == (0, b"spawned\n", None)
        await handle.destroy()
    assert handle.state is SandboxState.DESTROYED
    assert await wait_until_gone(marker) == []


async def test_destroy_kills_a_running_command_and_its_children(
    manager: SandboxManager, marker: str
) -> None:
    handle = manager.launch(spec())
    script = spawner(marker) + f"exec {sleeper(marker + '-main')}\n"
    async with asyncio.timeout(HANG_GUARD_S):
        async with handle.open_exec([SH, "-c", script]) as ex:
            async for ev in ex:
                if ev.type is EventType.STDOUT:
                    break
            assert host_pids_with(marker), "the test's processes should be running now"
            await handle.destroy()
            assert handle.state is SandboxState.DESTROYED
            rest = [ev async for ev in ex]
    assert [ev.type for ev in rest][-2:] == [EventType.KILLED, EventType.EXIT]
    assert rest[-2].reason == "destroyed"
    assert rest[-1].exit_code == 137
    assert await wait_until_gone(marker) == []


async def test_manager_aclose_kills_commands_in_every_sandbox(
    probe_result: ProbeResult, host: HostFacts, marker: str
) -> None:
    manager = SandboxManager(probe_result=probe_result, host=host)
    executions = []
    async with asyncio.timeout(HANG_GUARD_S), contextlib.AsyncExitStack() as stack:
        for name in ("a", "b"):
            argv = [SH, "-c", f"exec {sleeper(f'{marker}-{name}')}"]
            executions.append(
                await stack.enter_async_context(manager.launch(spec(name)).open_exec(argv))
            )
        assert host_pids_with(marker), "the sleepers should be running now"
        await manager.aclose()
        for ex in executions:
            assert await ex.wait() == 137
    assert manager.handles == {}
    assert await wait_until_gone(marker) == []


def open_fds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # the fd listdir itself used
            continue
    return sorted(out)


async def test_no_fd_or_memfd_leaks_over_many_executions(manager: SandboxManager) -> None:
    handle = manager.launch(spec())
    async with asyncio.timeout(HANG_GUARD_S * 3):
        await run_collect(handle, ["/bin/true"])  # warm-up: the loop's own lazily made fds
        before = open_fds()
        for i in range(20):
            kind = i % 5
            if kind == 0:
                result = await run_collect(handle, [SH, "-c", "echo x; echo y >&2; exit 2"])
                assert result.exit_code == 2
            elif kind == 1:
                result = await run_collect(handle, ["/bin/cat"], stdin=b"data" * 1000)
                assert result.stdout == b"data" * 1000
            elif kind == 2:
                async with handle.open_exec(["/bin/cat"], interactive_stdin=True) as ex:
                    await ex.write_stdin(b"hi\n")
                    ex.close_stdin()
                    assert await ex.wait() == 0
            elif kind == 3:
                result = await run_collect(handle, ["/usr/bin/sleep", "30"], timeout_s=0.2)
                assert result.killed == "timeout"
            else:
                async with handle.open_exec([SH, "-c", "yes | head -c 1000000"]):
                    pass  # left early
        after = open_fds()
    assert after == before
    assert not [fd for fd in after if "memfd:" in fd]


async def test_a_process_killed_right_after_a_chdir_leaves_no_fd_behind(
    manager: SandboxManager,
) -> None:
    # The supervisor notes a chdir until its thread's next call; a thread that dies first (here
    # a shell that changes directory and kills itself) must not leave anything of it open.
    handle = manager.launch(spec(), deny_create_globs=(".env",))
    async with asyncio.timeout(HANG_GUARD_S * 3):
        await run_collect(handle, ["/bin/true"])
        before = open_fds()
        for _ in range(5):
            result = await run_collect(handle, [SH, "-c", "cd /tmp && kill -9 $$"])
            assert result.exit_code == -9 or result.exit_code == 137, result
        after = open_fds()
    assert after == before


@pytest.mark.parametrize("backend", [SandboxBackend.NATIVE, SandboxBackend.NONE])
async def test_leaving_exec_early_kills_a_noisy_command_promptly(
    manager: SandboxManager, backend: SandboxBackend, marker: str
) -> None:
    handle = manager.launch(spec(), backend=backend)
    script = f"/usr/bin/yes {marker} | /usr/bin/head -c 50000000"
    started = time.monotonic()
    async with asyncio.timeout(HANG_GUARD_S):
        async with handle.open_exec([SH, "-c", script]) as ex:
            pass  # not a single event read; the queue fills and the readers block
    assert time.monotonic() - started < HANG_GUARD_S / 2
    assert ex.exit_code == 137
    assert handle.state is SandboxState.WARM
    assert await wait_until_gone(marker) == []


async def test_leaving_exec_after_a_few_events_or_by_exception_kills_the_command(
    manager: SandboxManager, marker: str
) -> None:
    handle = manager.launch(spec())
    script = f"/usr/bin/yes {marker} | /usr/bin/head -c 50000000"
    async with asyncio.timeout(HANG_GUARD_S):
        async with handle.open_exec([SH, "-c", script]) as ex:
            seen = 0
            async for ev in ex:
                seen += ev.type is EventType.STDOUT
                if seen == 3:
                    break
        assert ex.exit_code == 137

        with pytest.raises(LookupError):
            async with handle.open_exec([SH, "-c", script]) as ex2:
                raise LookupError("the consumer failed")
        assert ex2.exit_code == 137
    assert handle.state is SandboxState.WARM
    assert await wait_until_gone(marker) == []


async def test_destroy_with_an_unread_full_queue_returns_promptly(
    manager: SandboxManager, marker: str
) -> None:
    handle = manager.launch(spec())
    async with asyncio.timeout(HANG_GUARD_S):
        async with handle.open_exec([SH, "-c", f"/usr/bin/yes {marker}"]) as ex:
            await asyncio.sleep(0.3)  # let the readers fill the event queue
            await handle.destroy()
            assert handle.state is SandboxState.DESTROYED
    # destroy() returned with the queue full and unread; the command is gone.
    assert ex.exit_code == 137
    assert await wait_until_gone(marker) == []
