"""The microVM pool's spare QEMU (started ahead of need with `-incoming defer`): it is handed only
to a session whose QEMU would be given exactly what the spare was (the same shares, each still
the directory the host has at its path), and it never outlives its runtime or its server."""

from __future__ import annotations

import asyncio
import os
import pathlib

import aiohttp
import pytest
from microvm_kit import launch, manager, shared_runtime, unique
from server_kit import host_pids_with, kill_marked, running_server, wait_until_gone

from cc_server.microvm.image import default_cache_dir
from cc_server.microvm.pool import VmPool
from cc_server.runtime.handle import run_collect

pytestmark = [pytest.mark.security, pytest.mark.integration]
SPARE_UP_S = 60.0  # a QEMU start under TCG on a loaded host: tens of ms normally


def pool() -> VmPool:
    runtime = shared_runtime()
    assert runtime.pool is not None
    return runtime.pool


async def spare_up() -> pathlib.Path:
    """The pool's spare directory, once its QEMU runs."""
    spare = pool()._spare
    assert spare is not None
    async with asyncio.timeout(SPARE_UP_S):
        await asyncio.shield(spare.up)
    assert host_pids_with(str(spare.run_dir))
    return spare.run_dir


def bind(path: pathlib.Path, *, read_only: bool = False) -> list[dict[str, object]]:
    return [{"hostPath": str(path), "guestPath": "/work", "readOnly": read_only}]


async def test_spare_only_for_the_same_shares(tmp_path: pathlib.Path) -> None:
    ours, other = tmp_path / "ours", tmp_path / "other"
    for directory in (ours, other):
        directory.mkdir()
        (directory / f"in-{directory.name}").write_text("x")
    m = manager(tmp_path)
    try:
        await launch(m, bindMounts=bind(ours))
        spare_dir = await spare_up()
        # Another bind: a fresh QEMU, and the spare (given `ours`) is ended, never reused.
        handle = await launch(m, bindMounts=bind(other))
        assert not handle.from_spare and handle.run_dir != spare_dir
        assert (await run_collect(handle, ["ls", "/work"])).stdout == b"in-other\n"
        assert wait_until_gone(str(spare_dir), 10) == [] and not spare_dir.exists()
        # The same directory read-only: not what a spare for it writable was given.
        await launch(m, bindMounts=bind(other))
        spare_dir = await spare_up()
        handle = await launch(m, bindMounts=bind(other, read_only=True))
        assert not handle.from_spare and handle.run_dir != spare_dir
        wrote = await run_collect(handle, ["/bin/sh", "-c", "echo x > /work/new"])
        assert wrote.exit_code != 0 and not (other / "new").exists()
        assert wait_until_gone(str(spare_dir), 10) == []
        # The same policy again: the spare is taken (so the checks above can fail).
        spare_dir = await spare_up()
        handle = await launch(m, bindMounts=bind(other, read_only=True))
        assert handle.from_spare and handle.run_dir == spare_dir
    finally:
        await m.aclose()


async def test_spare_not_used_when_a_share_was_replaced(tmp_path: pathlib.Path) -> None:
    # The directory at the bound path is moved away and another made there after the spare
    # bound it: the spare still serves the old one, so a session gets a fresh QEMU.
    work = tmp_path / "work"
    work.mkdir()
    (work / "old-file").write_text("x")
    m = manager(tmp_path)
    try:
        await launch(m, bindMounts=bind(work))
        spare_dir = await spare_up()
        work.rename(tmp_path / "moved")
        work.mkdir()
        (work / "new-file").write_text("x")
        handle = await launch(m, bindMounts=bind(work))
        assert not handle.from_spare and handle.run_dir != spare_dir
        assert (await run_collect(handle, ["ls", "/work"])).stdout == b"new-file\n"
        assert wait_until_gone(str(spare_dir), 10) == []
    finally:
        await m.aclose()


async def test_spare_ends_with_its_runtime(tmp_path: pathlib.Path) -> None:
    m = manager(tmp_path)
    try:
        handle = await launch(m)
        spare_dir = await spare_up()
        await m.destroy(handle.session_id)
        assert host_pids_with(str(spare_dir))  # a destroyed session leaves the spare
    finally:
        await m.aclose()  # the manager closes the runtime's spare with its sandboxes
    assert host_pids_with(str(spare_dir)) == []
    assert not spare_dir.exists() and pool()._spare is None


async def test_a_killed_server_leaves_no_spare(tmp_path: pathlib.Path) -> None:
    shared_runtime()  # the image and snapshot exist: the server's boot probe reuses them
    env = {"CC_SERVER_MICROVM": "default", "CC_SERVER_MICROVM_CACHE": str(default_cache_dir())}
    with running_server(tmp_path, env=env) as server:
        marker = f"/vm-{server.proc.pid}-"  # every VM directory of this server (QEMU's -name)
        try:
            async with server.client(timeout=aiohttp.ClientTimeout(total=60)) as client:
                async with client.post("/v1/sandboxes", json={"spec": {
                        "sessionId": unique("spare"), "workspaceId": "w"}}) as response:
                    assert response.status == 201, await response.json()
                # The session's QEMU and the spare's, both exec'd (bubblewrap has armed its
                # parent-death signal by then; a kill before that is a known limit).
                async with asyncio.timeout(SPARE_UP_S):
                    while len({_qemu_name(pid) for pid in host_pids_with(marker)} - {None}) < 2:
                        await asyncio.sleep(0.05)
            server.proc.kill()
            server.proc.wait()
            assert wait_until_gone(marker, 10) == []
        finally:
            kill_marked(marker)


def _qemu_name(pid: int) -> str | None:
    """The VM directory a QEMU process names after `-name` (None: not QEMU itself)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return None
    if not os.path.basename(words[0]).startswith(b"qemu-system"):
        return None
    for at, word in enumerate(words[:-1]):
        if word == b"-name":
            return os.fsdecode(words[at + 1])
    return None
