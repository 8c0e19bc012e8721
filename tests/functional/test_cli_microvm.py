"""`cc-server run --backend microvm` from the command line, under TCG as every microVM test here:
through the CLI daemon (which probes the runtime on first use and keeps it) and in the process
(`CC_SERVER_DAEMON=off`), and the refusal that names what is missing.

Each test gets its own $HOME, runtime directory and microVM cache; the cache starts with the
suite's guest image (built once, microvm_kit) but no snapshot, so the first run boots one.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
from cli_kit import daemon_pids, kill_daemons
from microvm_kit import shared_runtime

from cc_server.microvm.image import default_cache_dir
from cc_server.microvm.probe import QEMU_PACKAGE_HINT

pytestmark = pytest.mark.integration

CLI_TIMEOUT_S = 300.0  # a TCG cold boot on a loaded two-core host: ten seconds normally


@pytest.fixture
def cache(tmp_path: pathlib.Path) -> pathlib.Path:
    """A microVM cache holding the suite's image and KVM verdict, and no snapshot yet."""
    shared_runtime()  # the image exists
    source = default_cache_dir()
    path = tmp_path / "cache"
    path.mkdir()
    for entry in source.iterdir():
        if entry.name.startswith("image-"):
            shutil.copytree(entry, path / entry.name)
        elif entry.name.startswith("kvm-broken-"):  # this host's KVM hangs: not again per test
            shutil.copy2(entry, path / entry.name)
    return path


@pytest.fixture
def env(tmp_path: pathlib.Path, cache: pathlib.Path) -> Iterator[dict[str, str]]:
    home = tmp_path / "home"
    home.mkdir()
    runtime = pathlib.Path(tempfile.mkdtemp(prefix="ccm-", dir="/tmp"))  # short socket paths
    try:
        yield {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime),
               "CC_SERVER_MICROVM_CACHE": str(cache)}
    finally:
        kill_daemons(runtime)
        shutil.rmtree(runtime, ignore_errors=True)


def run(*args: str, env: dict[str, str], cwd: pathlib.Path, verb: str = "run",
        stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`cc-server VERB ARGS` (run through the thin client, as the console script does)."""
    entry = "cc_server.cli_client" if verb == "run" else "cc_server.cli"
    return subprocess.run(
        [sys.executable, "-m", entry, verb, *args], env=env, cwd=cwd, input=stdin,
        stdin=subprocess.DEVNULL if stdin is None else None, capture_output=True, text=True,
        timeout=CLI_TIMEOUT_S, check=False,
    )  # fmt: skip


def snapshot(cache: pathlib.Path) -> tuple[int, int]:
    """The one TCG snapshot's `ready` marker: (inode, mtime); it changes only on a cold boot."""
    [ready] = cache.glob("template-*-tcg-*/ready")
    info = ready.stat()
    return info.st_ino, info.st_mtime_ns


def test_run_backend_microvm_prints_the_guest_kernel_twice_the_second_from_the_snapshot(
    env: dict[str, str], cache: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    script = "uname -r; pwd; echo to-stderr >&2; echo made > made.txt"
    first = run("--backend", "microvm", "--", "sh", "-c", script, env=env, cwd=project)
    assert first.returncode == 0, first.stderr
    kernel, workdir = first.stdout.splitlines()
    assert kernel != os.uname().release  # the guest's own kernel, not the host's
    assert workdir == str(project)  # the cwd default holds in a VM too
    assert "to-stderr" in first.stderr
    assert (project / "made.txt").read_text() == "made\n"
    booted = snapshot(cache)  # the first run booted the snapshot
    assert daemon_pids(pathlib.Path(env["XDG_RUNTIME_DIR"]))  # served by a daemon
    second = run("--backend", "microvm", "--", "uname", "-r", env=env, cwd=project)
    assert second.returncode == 0, second.stderr
    assert second.stdout == f"{kernel}\n"
    assert snapshot(cache) == booted  # restored, not booted again
    # In the process too: its own probe restores the snapshot on disk.
    inline = run("--backend", "microvm", "--", "sh", "-c", "uname -r; exit 4",
                 env={**env, "CC_SERVER_DAEMON": "off"}, cwd=project)
    assert inline.returncode == 4, inline.stderr
    assert inline.stdout == f"{kernel}\n"
    assert snapshot(cache) == booted


@pytest.mark.parametrize("daemon", ["on", "off"])
def test_run_backend_microvm_without_qemu_names_the_package(
    env: dict[str, str], tmp_path: pathlib.Path, daemon: str
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    marker = tmp_path / "ran"
    proc = run("--backend", "microvm", "--", "touch", str(marker),
               env={**env, "PATH": str(empty), "CC_SERVER_DAEMON": daemon}, cwd=empty)
    assert proc.returncode == 125, proc.stderr
    assert "BackendUnavailable" in proc.stderr and "is not installed" in proc.stderr
    assert QEMU_PACKAGE_HINT in proc.stderr
    assert not marker.exists()


def test_plan_backend_microvm_shows_the_guest_mounts_and_boots_nothing(
    env: dict[str, str], cache: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    project = tmp_path / "project"
    (project / "ref").mkdir(parents=True)
    marker = project / "ran"
    proc = run("--json", "--backend", "microvm", "--bind", str(project), "--protect",
               str(project / "ref"), "--", "touch", str(marker), env=env, cwd=project,
               verb="plan")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["backend"] == "microvm" and plan["argv"] == ["touch", str(marker)]
    assert plan["cwd"] == str(project)
    assert plan["shares"] == [{"hostPath": str(project), "readOnly": False}]
    assert [m["guestPath"] for m in plan["guestMounts"]] == [str(project), str(project / "ref")]
    assert plan["guestMounts"][1]["op"] == "ro_bind"  # the protected path, carved read-only
    assert not marker.exists()
    assert not list(cache.glob("template-*"))  # nothing was booted


@pytest.mark.parametrize("daemon", ["on", "off"])
def test_run_backend_microvm_passes_stdin_to_the_guest(
    env: dict[str, str], tmp_path: pathlib.Path, daemon: str
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    proc = run("--backend", "microvm", "--", "sh", "-c", "tr a-z A-Z; echo end",
               env={**env, "CC_SERVER_DAEMON": daemon}, cwd=project, stdin="piped in\n" * 2000)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "PIPED IN\n" * 2000 + "end\n"  # every byte, then EOF


def test_plan_backend_microvm_maps_the_cwd_through_a_guest_path(
    env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    proc = run("--json", "--backend", "microvm", "--bind", f"{project}:/work", "--", "pwd",
               env=env, cwd=project / "src", verb="plan")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["cwd"] == "/work/src"  # where the guest sees the cwd
