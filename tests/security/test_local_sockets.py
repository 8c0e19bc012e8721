"""Local sockets authenticate by namespace, and no sandbox sees a cc-server base directory.

The exploit: the CLI daemon runs whatever `run` request it gets, `--backend none` included, and a
sandboxed process has the daemon's uid whenever the daemon is not root. A sandbox that can reach
the daemon's socket (another base directory than its own, through a bind; or an alias of one, a
bind mount elsewhere) could run a command on the host, unsandboxed. Each test sends exactly that
request and then checks the host: the marker file the host command would have created is absent.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
from escape_kit import daemon_attack_script
from server_kit import running_server

from cc_server.cli_socket import receive_message, send_message
from cc_server.rundir import egress_base_dir

pytestmark = pytest.mark.security

REPO = pathlib.Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "cc_server.cli_client"]
DAEMON_START_S = 30.0  # the daemon probes once before it listens
RUN_TIMEOUT_S = 60



def _env(**extra: str) -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), **extra}
    return {k: v for k, v in env.items() if v}


@contextlib.contextmanager
def _daemon(path: str) -> Iterator[subprocess.Popen[bytes]]:
    """A CLI daemon on `path` (its stderr in `path`.log), stopped (killed if it must be)."""
    with open(f"{path}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cc_server.cli_daemon", path],
            cwd="/", env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
        )
    try:
        deadline = time.monotonic() + DAEMON_START_S
        while not os.path.exists(path):
            assert proc.poll() is None, pathlib.Path(f"{path}.log").read_text()
            assert time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.05)
        yield proc
    finally:
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(path)
            send_message(s, {"stop": True})
            receive_message(s)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def _marker() -> pathlib.Path:
    """A host path no sandbox below can write: /var/tmp is a private tmpfs inside."""
    return pathlib.Path("/var/tmp") / f"cc-pwned-{secrets.token_hex(8)}"


def _daemon_refuses(stderr: bytes) -> bool:
    return b"refused" in stderr and b"namespace" in stderr


@pytest.mark.parametrize(
    "unshare",
    [
        ["--user", "--map-root-user"],
        ["--pid", "--fork"],
        ["--user", "--map-root-user", "--pid", "--fork"],
    ],
    ids=["user-ns", "pid-ns", "both"],
)
def test_the_cli_daemon_refuses_a_peer_in_another_namespace(
    tmp_path: pathlib.Path, unshare: list[str]
) -> None:
    if "--user" not in unshare and os.geteuid() != 0:
        unshare = ["--user", "--map-root-user", *unshare]  # a PID namespace needs privilege
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    sock = str(run_dir / f"cli-{secrets.token_hex(4)}.sock")
    script = daemon_attack_script(tmp_path)
    control, refused = _marker(), _marker()
    try:
        with _daemon(sock):
            # Control: the same request from this process's namespaces is served.
            same = subprocess.run(["/usr/bin/python3", str(script), sock, str(control)],
                                  capture_output=True, timeout=RUN_TIMEOUT_S, check=False)
            assert control.exists() and b"exit" in same.stdout, same
            foreign = subprocess.run(
                ["/usr/bin/unshare", *unshare, "/usr/bin/python3", str(script), sock,
                 str(refused)],
                capture_output=True, timeout=RUN_TIMEOUT_S, check=False,
            )
            assert b"visible True" in foreign.stdout, foreign
            assert b"exit" not in foreign.stdout, foreign  # closed unanswered (or reset)
            time.sleep(0.5)  # a command it had been given would have run by now
            assert not refused.exists(), foreign
        log = pathlib.Path(f"{sock}.log").read_bytes()  # the logged reason
        assert _daemon_refuses(log), log
    finally:
        control.unlink(missing_ok=True)
        refused.unlink(missing_ok=True)


def _cc_server_run(
    bind: str, argv: list[str], xdg: pathlib.Path
) -> subprocess.CompletedProcess[bytes]:
    """`cc-server run --bind BIND -- ARGV` in its own process, its runtime directory elsewhere."""
    return subprocess.run(
        [*CLI, "run", "--bind", bind, "--", *argv],
        cwd=str(REPO), env=_env(XDG_RUNTIME_DIR=str(xdg), CC_SERVER_DAEMON="off"),
        capture_output=True, timeout=RUN_TIMEOUT_S, check=False,
    )


@pytest.fixture
def xdg() -> Iterator[pathlib.Path]:
    """The attacker's own XDG_RUNTIME_DIR: its base directory is not the daemon's."""
    runtime = tempfile.mkdtemp(prefix="ccx-", dir="/tmp")
    yield pathlib.Path(runtime)
    shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture
def second_base() -> Iterator[pathlib.Path]:
    """A second base directory of this user: the one a daemon started with another TMPDIR uses
    (short: a socket path has 107 bytes)."""
    other_tmp = tempfile.mkdtemp(prefix="cct-", dir="/tmp")
    yield pathlib.Path(egress_base_dir({"TMPDIR": other_tmp}, tmp_dir=other_tmp))
    shutil.rmtree(other_tmp, ignore_errors=True)


def test_a_sandbox_binding_a_second_base_directory_runs_nothing_on_the_host(
    xdg: pathlib.Path, second_base: pathlib.Path
) -> None:
    sock = str(second_base / f"cli-{secrets.token_hex(4)}.sock")
    above = second_base.parent  # the other TMPDIR, bound writable by the attacker
    script = daemon_attack_script(above)
    marker = _marker()
    try:
        with _daemon(sock) as daemon:
            result = _cc_server_run(
                str(above), ["/usr/bin/python3", str(script), sock, str(marker)], xdg
            )
            listing = _cc_server_run(str(above), ["/bin/ls", "-A", str(second_base)], xdg)
            time.sleep(0.5)
            assert daemon.poll() is None
        assert result.returncode == 0, result
        assert b"visible False" in result.stdout, result  # hidden by device and inode
        assert not marker.exists(), result
        assert listing.returncode == 0 and listing.stdout == b"", listing
    finally:
        marker.unlink(missing_ok=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="a host bind mount needs root")
def test_a_sandbox_binding_an_alias_of_a_base_directory_runs_nothing_on_the_host(
    xdg: pathlib.Path, second_base: pathlib.Path
) -> None:
    sock_name = f"cli-{secrets.token_hex(4)}.sock"
    marker = _marker()
    outside = pathlib.Path("/var/tmp") / f"cc-alias-{secrets.token_hex(4)}"
    alias = outside / "alias"
    alias.mkdir(parents=True)
    script = daemon_attack_script(outside)
    subprocess.run(["/usr/bin/mount", "--bind", str(second_base), str(alias)], check=True)
    try:
        with _daemon(str(second_base / sock_name)):
            assert (alias / sock_name).exists()
            result = _cc_server_run(
                str(outside),
                ["/usr/bin/python3", str(script), str(alias / sock_name), str(marker)], xdg,
            )
            time.sleep(0.5)
        assert result.returncode == 0, output_of(result)
        assert b"visible False" in result.stdout, output_of(result)
        assert not marker.exists(), output_of(result)
    finally:
        subprocess.run(["/usr/bin/umount", "-l", str(alias)], check=False)
        shutil.rmtree(outside, ignore_errors=True)
        marker.unlink(missing_ok=True)


def output_of(result: subprocess.CompletedProcess[bytes]) -> str:
    return (result.stdout + result.stderr).decode(errors="replace")



def test_cc_server_run_refuses_a_bind_that_exposes_a_live_servers_token_file(
    tmp_path: pathlib.Path, xdg: pathlib.Path
) -> None:
    """`--token-file` outside every base directory (the README's ~/.cc-server-token): the server
    records where it is, and `cc-server run` refuses to bind it, with a fix (exit 2)."""
    secrets_dir = tmp_path / "operator"
    secrets_dir.mkdir()
    elsewhere = tmp_path / "project"
    elsewhere.mkdir()
    token_file = secrets_dir / "cc-server-token"
    with running_server(tmp_path, "--token-file", str(token_file)) as server:
        assert server.token_path == str(token_file)
        refused = _cc_server_run(str(secrets_dir), ["/bin/true"], xdg)
        also = _cc_server_run(str(token_file), ["/bin/true"], xdg)
        control = _cc_server_run(str(elsewhere), ["/bin/true"], xdg)
    assert refused.returncode == 2, output_of(refused)
    assert b"BadSpec" in refused.stderr and b"token" in refused.stderr, output_of(refused)
    assert b"fix:" in refused.stderr or b"fix" in refused.stderr, output_of(refused)
    assert also.returncode == 2, output_of(also)
    assert control.returncode == 0, output_of(control)
    after = _cc_server_run(str(secrets_dir), ["/bin/true"], xdg)  # the server is gone
    assert after.returncode == 0, output_of(after)
