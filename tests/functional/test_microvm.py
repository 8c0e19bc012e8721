"""The microvm backend on this host, for real: QEMU from Debian's package, the guest kernel from
linux-image-amd64, the agent over virtio-serial. Under TCG here (this host's /dev/kvm is a
nested kind that cannot boot a guest), on KVM where the probe finds it works."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pathlib
import secrets
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
from microvm_kit import (
    alive,
    events_of,
    host_facts,
    launch,
    launch_with_carve_out,
    manager,
    read_until,
    shared_runtime,
    unique,
)
from server_kit import host_pids_with, kill_marked, running_server, wait_until_gone

from cc_server.backends.probe import probe
from cc_server.errors import BackendUnavailable, Closed, EnforcementFailed
from cc_server.microvm.handle import STATE_FILE
from cc_server.microvm.image import default_cache_dir
from cc_server.microvm.pool import VmPool
from cc_server.microvm.runtime import MicroVMRuntime, remove_stale_vm_dirs
from cc_server.policy import SandboxBackend, parse_spec
from cc_server.runtime.events import SandboxState
from cc_server.runtime.handle import run_collect
from cc_server.runtime.port import SandboxManager
from cc_server.terminal.service import TerminalSessionService

pytestmark = [pytest.mark.integration]
STALE_PID = 999_999  # above this host's pid_max: a server that is gone


def test_probe_on_this_host_says_which_accelerator_and_why() -> None:
    verdict = shared_runtime().probe
    assert verdict.available and verdict.accel in ("kvm", "tcg")
    if verdict.accel == "tcg" and os.path.exists("/dev/kvm"):
        # kvm-broken: the device opens but no guest boots under it; the reason says so.
        assert "KVM" in verdict.kvm_detail and verdict.kvm_detail in verdict.reason


async def test_round_trip_and_guest_kernel(tmp_path: pathlib.Path) -> None:
    m = manager(tmp_path)
    try:
        handle = await launch(m)
        assert handle.state is SandboxState.WARM and handle.backend is SandboxBackend.MICROVM
        assert handle.to_json()["backend"] == "microvm"
        result = await run_collect(
            handle, ["/bin/sh", "-c", "echo to-out; echo to-err >&2; uname -r; exit 7"]
        )
        assert result.exit_code == 7
        assert result.stderr == b"to-err\n"
        runtime = shared_runtime()
        assert runtime.pool is not None
        release = runtime.pool.image.kernel_release
        assert result.stdout == f"to-out\n{release}\n".encode()
        assert release != os.uname().release  # the guest's own kernel, not the host's
        killed = await run_collect(handle, ["/bin/sh", "-c", "kill -TERM $$"])
        assert killed.exit_code == 128 + 15
        missing = await run_collect(handle, ["/no/such/program"])
        assert missing.exit_code == 127 and b"/no/such/program" in missing.stderr
        fed = await run_collect(handle, ["cat"], stdin=b"fed through stdin")
        assert fed.stdout == b"fed through stdin" and fed.exit_code == 0
        slow = await run_collect(handle, ["sleep", "100"], timeout_s=0.5)
        assert slow.killed == "timeout" and slow.exit_code == 128 + 9
    finally:
        await m.aclose()


async def test_host_is_not_visible(tmp_path: pathlib.Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "marker").write_text("host home\n")
    m = manager(home)
    try:
        handle = await launch(m)
        hostname = socket.gethostname()
        result = await run_collect(handle, ["/bin/sh", "-c", (
            f"cat /etc/hostname; test -e {home}/marker && echo HOME-IS-''VISIBLE; "
            "cat /proc/[0-9]*/comm"
        )])
        out = result.stdout.decode()
        assert out.splitlines()[0] != hostname and "HOME-IS-VISIBLE" not in out
        comms = out.splitlines()[1:]
        assert "cc-vm-agent" in comms  # the guest's own PID 1
        assert not [c for c in comms if "python" in c or "qemu" in c]  # none of the host's
    finally:
        await m.aclose()


async def test_binds_writable_and_read_only(tmp_path: pathlib.Path) -> None:
    work, ref = tmp_path / "work", tmp_path / "ref"
    work.mkdir()
    ref.mkdir()
    (ref / "data").write_text("reference\n")
    m = manager(tmp_path)
    try:
        handle = await launch(m, bindMounts=[
            {"hostPath": str(work), "guestPath": "/work"},
            {"hostPath": str(ref), "guestPath": "/ref", "readOnly": True},
        ], guestWorkdir="/work")
        result = await run_collect(handle, ["/bin/sh", "-c",
            "pwd; echo from-guest > made.txt; cat /ref/data; echo x > /ref/data; "
            "echo y > /ref/new; ls /ref"])
        assert result.stdout == b"/work\nreference\ndata\n"
        assert result.stderr.count(b"Read-only file system") == 2
        assert (work / "made.txt").read_text() == "from-guest\n"
        assert (ref / "data").read_text() == "reference\n"
        assert not (ref / "new").exists()
    finally:
        await m.aclose()


async def test_explicit_microvm_without_runtime_fails_loudly(tmp_path: pathlib.Path) -> None:
    m = manager(tmp_path)
    m.vm.runtime = None  # this process did not probe a microVM runtime
    spec = parse_spec({"sessionId": unique("vm"), "workspaceId": "ws"})
    with pytest.raises(BackendUnavailable, match="CC_SERVER_MICROVM is off") as info:
        m.launch(spec, backend=SandboxBackend.MICROVM)
    assert info.value.fix and "CC_SERVER_MICROVM=on" in info.value.fix  # the missing switch
    assert spec.session_id not in m.handles


async def test_suspend_resume_keeps_the_shell(tmp_path: pathlib.Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    m = manager(tmp_path)
    try:
        handle = await launch(m, bindMounts=[{"hostPath": str(work), "guestPath": "/work"}])
        async with handle.open_exec(["/bin/sh"], cwd="/tmp", interactive_stdin=True) as shell:
            events = events_of(shell)
            await shell.write_stdin(b"export KEPT=kept-value; sleep 1000 & echo bg=$!\n")
            pid = (await read_until(events, "\n")).split("bg=")[1].strip()
            qemu_pid = handle.qemu_pid
            assert qemu_pid is not None
            await handle.suspend()
            assert handle.state is SandboxState.SUSPENDED
            assert not alive(qemu_pid)  # QEMU ended: its RAM is released
            assert host_pids_with(str(handle.run_dir)) == []
            assert handle.run_dir is not None and (handle.run_dir / STATE_FILE).exists()
            await handle.resume()
            assert handle.state is SandboxState.ACTIVE and handle.qemu_pid != qemu_pid
            await shell.write_stdin(
                f"echo env=$KEPT; kill -0 {pid} && echo bg-alive; ls /work; echo done\n".encode()
            )
            out = await read_until(events, "done")
            assert "env=kept-value" in out and "bg-alive" in out
            assert not (handle.run_dir / STATE_FILE).exists()
            await shell.write_stdin(b"exit 3\n")
            assert await shell.wait() == 3
        (work / "after").write_text("x")  # the mount came back after the resume
        result = await run_collect(handle, ["ls", "/work"])
        assert result.stdout == b"after\n"
    finally:
        await m.aclose()


async def test_destroy_leaves_nothing(tmp_path: pathlib.Path) -> None:
    m = manager(tmp_path)
    cache_before = sorted(os.listdir(default_cache_dir()))
    handle = await launch(m)
    async with handle.open_exec(["sleep", "1000"]):
        qemu_pid = handle.qemu_pid
        run_dir = handle.run_dir
        assert qemu_pid is not None and run_dir is not None
        assert (run_dir / "agent.sock").exists()
        await m.destroy(handle.session_id)
    assert handle.state is SandboxState.DESTROYED
    assert not alive(qemu_pid)
    assert host_pids_with(str(run_dir)) == []  # QEMU too, not only its bubblewrap
    assert not run_dir.exists()  # sockets, logs, state: all of it
    assert sorted(os.listdir(default_cache_dir())) == cache_before  # no image copy


async def test_a_cancelled_stop_still_ends_qemu(tmp_path: pathlib.Path) -> None:
    # A teardown cancelled again (a server shutting down while a session is destroyed) must not
    # leave QEMU running: the VM is ended whatever step the cancellation lands in.
    m = manager(tmp_path)
    handle = await launch(m)
    try:
        vm = handle._vm
        assert vm is not None
        qemu_pid, run_dir = vm.qemu.pid, vm.run_dir
        for attempt in range(3):  # the cancellation lands in the first await of the stop
            stop = asyncio.create_task(vm.stop())
            await asyncio.sleep(0)
            stop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stop
            assert not alive(qemu_pid), attempt  # the first cancelled stop already ended it
        assert wait_until_gone(str(run_dir), 10) == []
    finally:
        await m.aclose()


async def test_suspended_vm_destroyed_leaves_nothing(tmp_path: pathlib.Path) -> None:
    m = manager(tmp_path)
    handle = await launch(m)
    await handle.suspend()
    run_dir = handle.run_dir
    assert run_dir is not None and (run_dir / STATE_FILE).exists()
    await m.aclose()
    assert not run_dir.exists()


async def test_terminal_runs_in_the_guest_pty(tmp_path: pathlib.Path) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "key").write_text("TERMINAL-SECRET\n")
    service = TerminalSessionService(manager(home))
    try:
        session = await service.open(backend=SandboxBackend.MICROVM, rows=30, cols=100)
        assert session.backend is SandboxBackend.MICROVM
        assert session.to_json()["backend"] == "microvm"
        session.resize(40, 120)
        await session.write(
            b"uname -r; tty; stty size; pwd; cat ~/.ssh/key; echo T-$((1+1))-DONE\n"
        )
        out = ""
        async with asyncio.timeout(60):
            while "T-2-DONE\r\n" not in out:
                out += (await session.read()).decode(errors="replace")
        release = shared_runtime().pool.image.kernel_release  # type: ignore[union-attr]
        assert release in out and "/dev/pts/" in out and "40 120" in out
        assert str(home) in out and "TERMINAL-SECRET" not in out
        pid = session.pid
        await session.write(b"exit 4\n")
        async with asyncio.timeout(60):
            assert await session.wait() == 4
        await service.aclose()
        assert not alive(pid)
    finally:
        await service.aclose()


async def test_server_reports_and_runs_microvm(tmp_path: pathlib.Path) -> None:
    shared_runtime()  # the image and snapshot exist: the server's boot probe reuses them
    env = {"CC_SERVER_MICROVM": "default", "CC_SERVER_MICROVM_CACHE": str(default_cache_dir())}
    with running_server(tmp_path, env=env) as server:
        assert [e["message"].split(":")[0] for e in server.log() if e.get("event") == "microvm"] \
            == ["microVM available"]
        async with server.client(timeout=aiohttp.ClientTimeout(total=60)) as client:
            session_id = unique("api-vm")
            # No backend named: this server's default is microvm, and the reply says so.
            async with client.post("/v1/sandboxes", json={"spec": {
                "sessionId": session_id, "workspaceId": "w"}}) as response:
                created = await response.json()
                assert response.status == 201, created
            assert created["backend"] == "microvm"
            async with client.post(f"/v1/sandboxes/{session_id}/exec",
                                   json={"argv": ["uname", "-r"]}) as response:
                result = await response.json()
            release = shared_runtime().pool.image.kernel_release  # type: ignore[union-attr]
            assert result["exitCode"] == 0 and result["stdout"] == f"{release}\n"
            async with client.get(f"/v1/sandboxes/{session_id}") as response:
                assert (await response.json())["state"] == "warm"
            async with client.delete(f"/v1/sandboxes/{session_id}") as response:
                assert response.status in (200, 204)
            async with client.ws_connect(f"{server.ws_url}/v1/terminals",
                                         params={"backend": "microvm"}) as ws:
                first = await ws.receive_json(timeout=60)
                assert first["type"] == "session" and first["backend"] == "microvm"
                await ws.send_bytes(b"uname -r; echo T-$((2+2))\n")
                seen = ""
                async with asyncio.timeout(60):
                    while "T-4\r\n" not in seen:
                        seen += (await ws.receive_bytes()).decode(errors="replace")
                assert release in seen


async def test_restored_guests_get_fresh_entropy_and_the_clock(tmp_path: pathlib.Path) -> None:
    m = manager(tmp_path)
    try:
        script = ["/bin/sh", "-c", "head -c 16 /dev/urandom | od -An -tx1; date +%s"]
        outputs = []
        for _ in range(2):  # two clones of one snapshot
            handle = await launch(m)
            outputs.append((await run_collect(handle, script)).stdout.decode().splitlines())
        assert outputs[0][0] != outputs[1][0]
        for lines in outputs:
            assert abs(int(lines[-1]) - time.time()) < 60
    finally:
        await m.aclose()


def test_boot_cleanup_kills_the_qemu_of_a_killed_server(tmp_path: pathlib.Path) -> None:
    # What a killed server leaves: a VM directory named for its (gone) pid, and a process whose
    # argv names that directory (QEMU's `-name`), no child of ours; here a stand-in, no VM.
    base = tmp_path / "base"
    base.mkdir()
    stale = base / f"vm-{STALE_PID}-{secrets.token_hex(8)}"
    stale.mkdir()
    live = base / f"vm-{os.getpid()}-{secrets.token_hex(8)}"
    live.mkdir()
    marker = f"sleep {secrets.randbelow(10**6) + 10**6}"
    sleeper = f"import time; time.sleep(1000)  # {marker}"
    subprocess.run(["/bin/sh", "-c", '"$0" -c "$1" -name "$2" >/dev/null 2>&1 &',
                    sys.executable, sleeper, str(stale)], check=True)
    bystander = subprocess.Popen([sys.executable, "-c", sleeper])  # not named: left alone
    try:
        deadline = time.monotonic() + 10
        while len(host_pids_with(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert remove_stale_vm_dirs(str(base)) == [stale.name]
        assert wait_until_gone(str(stale), 10) == []
        assert not stale.exists() and live.exists()
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        kill_marked(str(stale))


def test_half_built_snapshots_of_killed_servers_are_removed(tmp_path: pathlib.Path) -> None:
    # A server killed while booting the template leaves `<template>.build-<its pid>` (a RAM file
    # the size of the guest's); the next build removes it, and keeps a live server's.
    pool = shared_runtime().pool
    assert pool is not None
    cache = tmp_path / "cache"
    cache.mkdir()
    fresh = VmPool(qemu=pool.qemu, image=pool.image, config=pool.config, cache_dir=cache)
    dead = cache / f"{fresh.template_dir.name}.build-{STALE_PID}"
    live = cache / f"{fresh.template_dir.name}.build-{os.getppid()}"
    other = cache / f"template-0-other-tcg-256m.build-{STALE_PID}"  # prune_cache's business
    for path in (dead, live, other):
        path.mkdir()
        (path / "ram.img").write_bytes(b"\0")
    fresh._remove_dead_builds()
    assert not dead.exists()
    assert live.exists() and other.exists()


async def test_suspend_refused_while_a_bind_is_in_use(tmp_path: pathlib.Path) -> None:
    work = tmp_path / "work"
    m = manager(tmp_path)
    try:
        handle = await launch_with_carve_out(m, work)
        async with handle.open_exec(["/bin/sh"], cwd="/work", interactive_stdin=True) as shell:
            events = events_of(shell)
            await shell.write_stdin(b"echo in-$((1+1))\n")
            await read_until(events, "in-2")
            qemu_pid = handle.qemu_pid
            with pytest.raises(EnforcementFailed, match="/work is in use") as info:
                await handle.suspend()
            assert info.value.fix
            # Nothing changed: the same VM, the mounts whole, carve-outs included.
            assert handle.state is SandboxState.ACTIVE and handle.qemu_pid == qemu_pid
            assert handle.run_dir is not None and not (handle.run_dir / STATE_FILE).exists()
            await shell.write_stdin(b"echo a > here; echo b > protected/x; echo done-$((1+1))\n")
            await read_until(events, "done-2")
        assert (work / "here").read_text() == "a\n"
        assert not (work / "protected" / "x").exists()
        listing = await run_collect(handle, ["ls", "/work"])
        assert listing.stdout == b"here\nprotected\n"
    finally:
        await m.aclose()


async def test_mounts_that_cannot_be_put_back_end_the_vm(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A refused suspend puts the carve-outs back; when the guest cannot take one (a command
    # removed its directory), the VM must not run on with the bind on and the carve-out off.
    work = tmp_path / "work"
    m = manager(tmp_path)
    try:
        handle = await launch_with_carve_out(m, work)
        qemu_pid = handle.qemu_pid
        assert qemu_pid is not None

        async def refused(steps: object = None) -> None:
            raise EnforcementFailed("the guest could not mount /work/protected")

        async with handle.open_exec(["/bin/sh"], cwd="/work", interactive_stdin=True) as shell:
            events = events_of(shell)
            await shell.write_stdin(b"echo in-$((1+1))\n")
            await read_until(events, "in-2")
            monkeypatch.setattr(handle, "_apply_mounts", refused)
            with pytest.raises(EnforcementFailed, match="could not mount"):
                await handle.suspend()
        assert handle.state is SandboxState.ERROR
        assert not alive(qemu_pid)
        with pytest.raises(Closed, match="launch a new one"):
            async with handle.open_exec(["true"]):
                pass
    finally:
        await m.aclose()


async def test_a_changed_snapshot_is_not_restored(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool = shared_runtime().pool
    assert pool is not None
    cache = tmp_path / "cache"
    run_base = tmp_path / "run"
    run_base.mkdir(mode=0o700)
    # As the runtime's QEMU runs (a root server's: as the sandbox identity, which builds it).
    first = VmPool(qemu=pool.qemu, image=pool.image, config=pool.config, cache_dir=cache,
                   bwrap=pool.bwrap, run_base=str(run_base), identity=pool.identity)
    template = await first.template()
    assert list(run_base.iterdir()) == []  # the boot's VM directory went with it
    with open(template.ram, "r+b") as ram:  # what a compromised QEMU could do to the file
        ram.seek(1 << 20)
        ram.write(b"\x90" * 64)
    again = VmPool(qemu=pool.qemu, image=pool.image, config=pool.config, cache_dir=cache,
                   bwrap=pool.bwrap, identity=pool.identity)
    with caplog.at_level(logging.WARNING, logger="cc_server.microvm"):
        rebuilt = await again.template()
    assert any("changed on disk" in r.getMessage() for r in caplog.records)
    assert again._intact()
    with open(rebuilt.ram, "rb") as ram:
        ram.seek(1 << 20)
        assert ram.read(64) != b"\x90" * 64


async def test_a_suspended_vm_is_not_resumed_over_a_changed_snapshot(
    tmp_path: pathlib.Path,
) -> None:
    # A suspended state is a delta against the template's RAM file: over another file's pages
    # it would be another machine. The resume fails closed instead, and leaves nothing behind.
    shared = shared_runtime()
    assert shared.pool is not None
    pool = VmPool(qemu=shared.pool.qemu, image=shared.pool.image, config=shared.pool.config,
                  cache_dir=tmp_path / "cache", bwrap=shared.pool.bwrap,
                  identity=shared.pool.identity)  # its own snapshot: the shared one stays
    m = SandboxManager(probe_result=probe(), host=host_facts(tmp_path),
                       microvm=MicroVMRuntime(probe=shared.probe, pool=pool,
                                              run_base=shared.run_base))
    try:
        handle = await launch(m)
        await handle.suspend()
        state_dir = handle.run_dir
        assert state_dir is not None and (state_dir / STATE_FILE).exists()
        template = await pool.template()
        with open(template.ram, "r+b") as ram:  # rebuilt, or written by a compromised QEMU
            ram.seek(1 << 20)
            ram.write(b"\x90" * 64)
        with pytest.raises(EnforcementFailed, match="changed after the suspend"):
            await handle.resume()
        assert handle.state is SandboxState.ERROR
        assert not state_dir.exists() and host_pids_with(str(state_dir)) == []
    finally:
        await m.aclose()
        await pool.aclose()


async def test_server_suspends_and_resumes(tmp_path: pathlib.Path) -> None:
    shared_runtime()
    env = {"CC_SERVER_MICROVM": "on", "CC_SERVER_MICROVM_CACHE": str(default_cache_dir())}
    with running_server(tmp_path, env=env) as server:
        async with server.client(timeout=aiohttp.ClientTimeout(total=60)) as client:
            vm_id, native_id = unique("api-vm"), unique("api-native")
            for session_id, backend in ((vm_id, "microvm"), (native_id, "native")):
                async with client.post("/v1/sandboxes", json={"backend": backend, "spec": {
                        "sessionId": session_id, "workspaceId": "w"}}) as response:
                    assert response.status == 201, await response.json()
            async with client.post(f"/v1/sandboxes/{vm_id}/exec",
                                   json={"argv": ["true"]}) as response:
                assert (await response.json())["exitCode"] == 0
            async with client.post(f"/v1/sandboxes/{vm_id}/suspend") as response:
                body = await response.json()
                assert response.status == 200 and body["state"] == "suspended", body
            async with client.post(f"/v1/sandboxes/{vm_id}/resume") as response:
                body = await response.json()
                assert response.status == 200 and body["state"] == "warm", body
            async with client.post(f"/v1/sandboxes/{native_id}/suspend") as response:
                body = await response.json()
                assert response.status == 409 and body["error"] == "BackendUnavailable"
            async with client.get("/openapi.json") as response:
                paths = (await response.json())["paths"]
            assert "/v1/sandboxes/{id}/suspend" in paths and "/v1/sandboxes/{id}/resume" in paths
