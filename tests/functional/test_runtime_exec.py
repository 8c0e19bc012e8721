"""Commands through the library API against real bubblewrap: events, exit codes, stdin, states.

Everything goes through `SandboxManager.launch`, `SandboxHandle.exec` and `run_collect`, as a
caller of the library would. $HOME is a directory under tmp_path, never the real one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from typing import Any

import pytest

from cc_server.backends.egress_bridge import bridge_env
from cc_server.backends.probe import ProbeResult
from cc_server.errors import BackendUnavailable, BadSpec, Closed
from cc_server.policy import HostFacts, SandboxBackend, parse_spec
from cc_server.runtime.events import EventType, SandboxEvent, SandboxState
from cc_server.runtime.handle import READ_CHUNK_BYTES, SandboxHandle, run_collect
from cc_server.runtime.port import SandboxManager

pytestmark = pytest.mark.integration

SH = "/bin/sh"
RUN_TIMEOUT_S = 20.0  # a bound for commands that finish in well under a second
PROMPT_S = 10.0  # "promptly": generous for a loaded CI host, far below the commands' own sleeps


def spec(session_id: str = "s1", **fields: Any) -> Any:
    return parse_spec({"sessionId": session_id, "workspaceId": "w", **fields})


async def events_of(handle: SandboxHandle, argv: list[str], **kwargs: Any) -> list[SandboxEvent]:
    kwargs.setdefault("timeout_s", RUN_TIMEOUT_S)
    async with handle.open_exec(argv, **kwargs) as ex:
        return [ev async for ev in ex]


def types(events: list[SandboxEvent]) -> list[EventType]:
    return [ev.type for ev in events]


def joined(events: list[SandboxEvent], kind: EventType) -> bytes:
    return b"".join(ev.data or b"" for ev in events if ev.type is kind)


# --- events and exit codes -----------------------------------------------------------------------


async def test_simple_command_emits_starting_ready_output_exit_in_order(
    manager: SandboxManager,
) -> None:
    handle = manager.launch(spec())
    events = await events_of(handle, [SH, "-c", "echo one; echo two"])

    kinds = types(events)
    assert kinds[:2] == [EventType.STARTING, EventType.READY]
    assert kinds[-1] is EventType.EXIT
    assert set(kinds[2:-1]) == {EventType.STDOUT}, kinds
    assert joined(events, EventType.STDOUT) == b"one\ntwo\n"
    assert events[-1].exit_code == 0
    assert {ev.session_id for ev in events} == {"s1"}
    assert len({ev.exec_id for ev in events}) == 1 and events[0].exec_id is not None
    assert events[-1].to_json()["exitCode"] == 0


async def test_each_execution_gets_its_own_exec_id(manager: SandboxManager) -> None:
    handle = manager.launch(spec())
    first = await events_of(handle, ["/bin/true"])
    second = await events_of(handle, ["/bin/true"])
    assert first[0].exec_id != second[0].exec_id


async def test_stderr_is_a_separate_stream(manager: SandboxManager) -> None:
    handle = manager.launch(spec())
    events = await events_of(handle, [SH, "-c", "echo out; echo err >&2; echo out2"])
    assert joined(events, EventType.STDOUT) == b"out\nout2\n"
    assert joined(events, EventType.STDERR) == b"err\n"

    result = await run_collect(handle, [SH, "-c", "echo o; echo e >&2"], timeout_s=RUN_TIMEOUT_S)
    assert (result.stdout, result.stderr, result.exit_code) == (b"o\n", b"e\n", 0)


@pytest.mark.parametrize(
    ("script", "code"),
    [("exit 0", 0), ("exit 3", 3), ("exit 255", 255), ("kill -9 $$", 128 + 9)],
)
async def test_exit_codes_propagate(manager: SandboxManager, script: str, code: int) -> None:
    handle = manager.launch(spec())
    events = await events_of(handle, [SH, "-c", script])
    assert events[-1].type is EventType.EXIT
    assert events[-1].exit_code == code
    assert EventType.KILLED not in types(events)  # the command died on its own; we killed nothing

    result = await run_collect(handle, [SH, "-c", script], timeout_s=RUN_TIMEOUT_S)
    assert (result.exit_code, result.killed) == (code, None)


async def test_stdin_bytes_are_delivered_then_closed(manager: SandboxManager) -> None:
    handle = manager.launch(spec())
    data = bytes(range(256)) * 1000 + b"\nlast line without newline"
    result = await run_collect(handle, ["/bin/cat"], stdin=data, timeout_s=RUN_TIMEOUT_S)
    assert result.exit_code == 0
    assert result.stdout == data

    empty = await run_collect(handle, ["/bin/cat"], stdin=b"", timeout_s=RUN_TIMEOUT_S)
    assert (empty.exit_code, empty.stdout) == (0, b"")


async def test_without_stdin_the_command_reads_eof(manager: SandboxManager) -> None:
    handle = manager.launch(spec())
    result = await run_collect(handle, ["/bin/cat"], timeout_s=RUN_TIMEOUT_S)
    assert (result.exit_code, result.stdout, result.killed) == (0, b"", None)


async def test_interactive_stdin_round_trips_before_eof(manager: SandboxManager) -> None:
    handle = manager.launch(spec())
    async with asyncio.timeout(RUN_TIMEOUT_S):
        async with handle.open_exec(["/bin/cat"], interactive_stdin=True) as ex:
            events = aiter(ex)
            assert (await anext(events)).type is EventType.STARTING
            assert (await anext(events)).type is EventType.READY

            async def echo_of(line: bytes) -> bytes:
                await ex.write_stdin(line)
                got = b""
                while len(got) < len(line):
                    ev = await anext(events)
                    assert ev.type is EventType.STDOUT, ev
                    got += ev.data or b""
                return got

            # cat answers each line while stdin is still open: the pipe is really interactive.
            assert await echo_of(b"first\n") == b"first\n"
            assert await echo_of(b"second\n") == b"second\n"
            ex.close_stdin()
            rest = [ev async for ev in events]
    assert types(rest) == [EventType.EXIT]
    assert rest[0].exit_code == 0


async def test_write_stdin_without_interactive_stdin_is_refused(manager: SandboxManager) -> None:
    handle = manager.launch(spec())
    async with asyncio.timeout(RUN_TIMEOUT_S), handle.open_exec(["/bin/true"]) as ex:
        with pytest.raises(BadSpec):
            await ex.write_stdin(b"x")
        assert await ex.wait() == 0


async def test_a_large_output_arrives_complete_and_in_order(manager: SandboxManager) -> None:
    handle = manager.launch(spec())
    size = 5 * 1024 * 1024
    script = (
        "import sys\n"
        "block = bytes(range(256)) * 4096\n"
        f"for _ in range({size} // len(block)):\n"
        "    sys.stdout.buffer.write(block)\n"
    )
    events = await events_of(handle, ["/usr/bin/python3", "-c", script])
    out = joined(events, EventType.STDOUT)
    assert len(out) == size
    assert out == bytes(range(256)) * (size // 256)
    assert all(len(ev.data or b"") <= READ_CHUNK_BYTES for ev in events)
    assert events[-1].exit_code == 0


async def test_timeout_kills_with_reason_timeout_then_exit(manager: SandboxManager) -> None:
    handle = manager.launch(spec())
    started = time.monotonic()
    events = await events_of(handle, [SH, "-c", "echo before; exec sleep 30"], timeout_s=1)
    elapsed = time.monotonic() - started

    assert elapsed < PROMPT_S
    assert types(events)[-2:] == [EventType.KILLED, EventType.EXIT]
    assert events[-2].reason == "timeout"
    assert events[-1].exit_code == 128 + 9
    assert joined(events, EventType.STDOUT) == b"before\n"

    result = await run_collect(handle, ["/usr/bin/sleep", "30"], timeout_s=0.5)
    assert (result.killed, result.exit_code) == ("timeout", 137)


async def test_a_command_faster_than_its_timeout_is_not_killed(manager: SandboxManager) -> None:
    handle = manager.launch(spec())
    result = await run_collect(handle, [SH, "-c", "exit 4"], timeout_s=30)
    assert (result.killed, result.exit_code) == (None, 4)


async def test_manual_kill_emits_killed_manual_then_exit(manager: SandboxManager) -> None:
    handle = manager.launch(spec())
    seen: list[SandboxEvent] = []
    async with asyncio.timeout(RUN_TIMEOUT_S):
        async with handle.open_exec([SH, "-c", "echo up; exec sleep 30"]) as ex:
            async for ev in ex:
                seen.append(ev)
                if ev.type is EventType.STDOUT:
                    await ex.kill()
                    await ex.kill()  # idempotent; the first reason stays
            assert await ex.wait() == 137
    assert types(seen)[-2:] == [EventType.KILLED, EventType.EXIT]
    assert seen[-2].reason == "manual"
    assert seen[-1].exit_code == 137
    assert types(seen).count(EventType.KILLED) == 1


async def test_the_command_gets_exactly_the_env_it_was_given(manager: SandboxManager) -> None:
    handle = manager.launch(spec())
    result = await run_collect(
        handle, ["/usr/bin/env"], env={"CC_TEST_VAR": "v1"}, timeout_s=RUN_TIMEOUT_S
    )
    lines = result.stdout.decode().splitlines()
    keys = {line.split("=", 1)[0] for line in lines}
    # PATH and HOME are the planner's defaults, PWD is bwrap's --chdir, the proxy variables are
    # the egress bridge's; nothing else leaks from the test process.
    proxy = set(bridge_env())
    assert keys == {"CC_TEST_VAR", "PATH", "HOME", "PWD", *proxy}, lines
    assert "CC_TEST_VAR=v1" in lines
    assert f"HOME={manager.host.home}" in lines


# --- states --------------------------------------------------------------------------------------


async def test_state_transitions_over_a_handles_life(manager: SandboxManager) -> None:
    assert SandboxHandle.__dataclass_fields__["state"].default is SandboxState.CREATED
    handle = manager.launch(spec())
    assert handle.state is SandboxState.WARM
    assert handle.to_json()["state"] == "warm"
    assert manager.handles == {"s1": handle}

    async with asyncio.timeout(RUN_TIMEOUT_S):
        script = [SH, "-c", "read line; echo $line"]
        async with handle.open_exec(script, interactive_stdin=True) as ex:
            assert handle.state is SandboxState.ACTIVE
            await ex.write_stdin(b"go\n")
            ex.close_stdin()
            assert await ex.wait() == 0
            assert handle.state is SandboxState.WARM
    assert handle.state is SandboxState.WARM

    await handle.destroy()
    assert handle.state is SandboxState.DESTROYED
    with pytest.raises(Closed, match="destroyed"):
        async with handle.open_exec(["/bin/true"]):
            pass
    with pytest.raises(Closed):
        await run_collect(handle, ["/bin/true"])
    await handle.destroy()  # idempotent
    assert handle.state is SandboxState.DESTROYED


async def test_state_stays_active_until_the_last_of_two_commands_ends(
    manager: SandboxManager,
) -> None:
    handle = manager.launch(spec())
    async with (
        asyncio.timeout(RUN_TIMEOUT_S),
        handle.open_exec(["/bin/cat"], interactive_stdin=True) as first,
        handle.open_exec(["/bin/cat"], interactive_stdin=True) as second,
    ):
        assert handle.state is SandboxState.ACTIVE
        first.close_stdin()
        assert await first.wait() == 0
        assert handle.state is SandboxState.ACTIVE
        second.close_stdin()
        assert await second.wait() == 0
        assert handle.state is SandboxState.WARM


async def test_manager_destroy_and_aclose_are_idempotent(
    probe_result: ProbeResult, host: HostFacts
) -> None:
    manager = SandboxManager(probe_result=probe_result, host=host)
    first = manager.launch(spec("a"))
    second = manager.launch(spec("b"))
    await manager.destroy("a")
    await manager.destroy("a")
    await manager.destroy("never-launched")
    assert first.state is SandboxState.DESTROYED
    assert list(manager.handles) == ["b"]
    await manager.aclose()
    await manager.aclose()
    assert second.state is SandboxState.DESTROYED
    assert manager.handles == {}


async def test_launching_a_live_session_id_twice_is_refused(manager: SandboxManager) -> None:
    handle = manager.launch(spec("dup"))
    with pytest.raises(BadSpec, match="already live"):
        manager.launch(spec("dup"))
    assert manager.handles == {"dup": handle}
    assert handle.state is SandboxState.WARM  # the refused launch did not disturb the live one

    await manager.destroy("dup")
    again = manager.launch(spec("dup"))  # a destroyed id can be used again
    assert again is not handle and again.state is SandboxState.WARM


async def test_explicit_microvm_is_unavailable_and_nothing_is_kept(
    manager: SandboxManager,
) -> None:
    with pytest.raises(BackendUnavailable, match="microvm"):
        manager.launch(spec(), backend=SandboxBackend.MICROVM)
    assert manager.handles == {}
    manager.launch(spec())  # the session id was not taken by the failed launch


def without_create_rules(result: ProbeResult) -> ProbeResult:
    """The same host as if the create-rule supervisor were not built."""
    tools = {k: v for k, v in result.tools.items() if not k.startswith("cc-create-")}
    return dataclasses.replace(
        result, tools=tools, create_rules=False, create_rules_hint="not built (test)"
    )


@pytest.mark.parametrize("backend", [None, SandboxBackend.NATIVE])
async def test_deny_create_globs_without_the_supervisor_are_unavailable(
    probe_result: ProbeResult, host: HostFacts, backend: SandboxBackend | None
) -> None:
    manager = SandboxManager(probe_result=without_create_rules(probe_result), host=host)
    try:
        with pytest.raises(BackendUnavailable, match="create-time filename rules"):
            manager.launch(spec(), backend=backend, deny_create_globs=["*.pem"])
        assert manager.handles == {}
    finally:
        await manager.aclose()


@pytest.mark.parametrize("backend", [None, SandboxBackend.NATIVE])
async def test_deny_create_globs_with_the_supervisor_run_and_refuse_the_name(
    manager: SandboxManager, backend: SandboxBackend | None
) -> None:
    assert manager.probe_result.create_rules, manager.probe_result.create_rules_hint
    handle = manager.launch(spec(), backend=backend, deny_create_globs=["*.pem"])
    assert handle.backend is SandboxBackend.NATIVE
    result = await run_collect(
        handle, ["/bin/sh", "-c", "cd /tmp && touch ok.txt && touch no.pem"],
        timeout_s=RUN_TIMEOUT_S,
    )
    assert result.exit_code == 1, result
    assert b"Permission denied" in result.stderr
    refused = [(v.action, v.target) for v in result.violations]
    assert refused == [("file-write-create", "/tmp/no.pem")]


async def test_none_backend_runs_on_the_host(manager: SandboxManager) -> None:
    handle = manager.launch(spec(), backend=SandboxBackend.NONE)
    assert handle.backend is SandboxBackend.NONE
    assert handle.to_json()["backend"] == "none"
    result = await run_collect(
        handle, ["/bin/cat", "/proc/sys/kernel/hostname"], timeout_s=RUN_TIMEOUT_S
    )
    hostname = result.stdout.decode().strip()
    assert result.exit_code == 0
    assert hostname != "cc-sandbox"
    assert hostname == socket.gethostname()


@pytest.mark.parametrize("backend", [None, SandboxBackend.NATIVE])
async def test_native_runs_in_the_sandbox_and_reports_it(
    manager: SandboxManager, backend: SandboxBackend | None
) -> None:
    handle = manager.launch(spec(), backend=backend)
    assert handle.backend is SandboxBackend.NATIVE  # unspecified resolves to what actually runs
    assert handle.to_json()["backend"] == "native"
    result = await run_collect(
        handle, ["/bin/cat", "/proc/sys/kernel/hostname"], timeout_s=RUN_TIMEOUT_S
    )
    assert result.exit_code == 0
    assert result.stdout == b"cc-sandbox\n"


async def test_a_disabled_sandbox_runs_none_when_unspecified(
    probe_result: ProbeResult, host: HostFacts
) -> None:
    manager = SandboxManager(probe_result=probe_result, host=host, sandbox_on=False)
    try:
        assert manager.launch(spec()).backend is SandboxBackend.NONE
    finally:
        await manager.aclose()


async def test_wait_returns_without_reading_many_output_chunks(manager: SandboxManager) -> None:
    # More output chunks than the event queue holds, and nobody reads the events.
    handle = manager.launch(spec())
    script = "i=0; while [ $i -lt 400 ]; do echo $i; sleep 0.001; i=$((i+1)); done"
    async with asyncio.timeout(RUN_TIMEOUT_S), handle.open_exec([SH, "-c", script]) as execution:
        assert await execution.wait() == 0


async def test_none_background_child_holding_stdout_does_not_hold_the_run(
    manager: SandboxManager,
) -> None:
    handle = manager.launch(spec("none-bg"), backend=SandboxBackend.NONE)
    async with asyncio.timeout(RUN_TIMEOUT_S):
        result = await run_collect(
            handle, [SH, "-c", "/bin/sleep 300 & echo done"], timeout_s=RUN_TIMEOUT_S
        )
    assert result.stdout == b"done\n"
    assert result.exit_code == 0


async def test_none_setsid_child_holding_stdout_does_not_hold_the_run(
    manager: SandboxManager,
) -> None:
    # A descendant that left the process group cannot be signalled with it, and keeps the pipe
    # open: the execution still ends, a bounded time after the command.
    handle = manager.launch(spec("none-setsid"), backend=SandboxBackend.NONE)
    async with asyncio.timeout(RUN_TIMEOUT_S):
        result = await run_collect(
            # The pause lets the child leave the group before the shell exits.
            handle,
            [SH, "-c", "setsid /bin/sleep 8 & sleep 0.3; echo done"],
            timeout_s=RUN_TIMEOUT_S,
        )
    assert result.stdout == b"done\n"
