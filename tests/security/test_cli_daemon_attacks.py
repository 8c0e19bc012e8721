"""Frames the CLI daemon cannot take, sent by a process of its own uid on its socket: each gets an
error answer or a closed connection, never a dead daemon, a stalled loop, a leaked descriptor or
a command that outlives its client; and a spare whose binds the host changed while it started is
not the sandbox the next run is served in.

The fixtures and the hostile client are those of the review's tests (test_review_2026_12_02).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import time

import pytest
import test_review_2026_12_02 as review
from cli_kit import daemon_pids
from server_kit import host_pids_with
from test_review_2026_12_02 import (
    CLI_TIMEOUT_S,
    PROMPT_S,
    bwrap_binding,
    client,
    frame,
    hostile,
    request,
    served_daemon,
    unique_duration,
    wait_for,
)

from cc_server.backends.identity import STAGE_DIR
from cc_server.backends.plan import LaunchPlan, PathFd, SandboxIdentity
from cc_server.policy import SandboxBackend
from cc_server.runtime.session_sandbox import _host_binds

pytestmark = pytest.mark.integration

# The review's fixtures, each test's own daemon.
runtime, env, work = review.runtime, review.env, review.work


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_frame_nested_deeper_than_the_parser_goes_does_not_end_the_daemon(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path
) -> None:
    pid, path = served_daemon(env, runtime, work)
    depth = 200_000  # 400 kB: under the 1 MiB frame limit, far over the recursion limit
    with hostile(path, b"[" * depth + b"]" * depth) as sock:
        sock.settimeout(PROMPT_S)
        assert sock.recv(100) == b""  # dropped, no answer
    assert daemon_pids(runtime) == [pid]  # the same daemon lives and serves
    ok = client("run", "--", "sh", "-c", "echo still", env=env, cwd=work)
    assert ok.returncode == 0 and ok.stdout == "still\n", ok.stderr
    assert daemon_pids(runtime) == [pid]


@pytest.mark.parametrize("number", [99999, -1, 0])
def test_a_bad_signal_number_does_not_keep_a_command_past_its_client(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path, number: int
) -> None:
    _, path = served_daemon(env, runtime, work)
    marker = unique_duration()
    try:
        with hostile(path, request(["run", "--", "sleep", marker], work)) as sock:
            assert wait_for(lambda: host_pids_with(f"sleep\x00{marker}"))  # control: it runs
            sock.sendall(frame(json.dumps({"signal": number}).encode()))  # no such signal
            time.sleep(0.5)
        # The client is gone: its command goes with it.
        assert wait_for(lambda: not host_pids_with(f"sleep\x00{marker}")), host_pids_with(
            f"sleep\x00{marker}"
        )
    finally:
        for each in host_pids_with(f"sleep\x00{marker}"):
            os.kill(each, signal.SIGKILL)


def test_stalled_connections_do_not_hold_up_another_run(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path
) -> None:
    _, path = served_daemon(env, runtime, work)
    stalled = []
    try:
        for _ in range(6):  # each sent half a header and nothing more
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            sock.sendall(b"\x00\x00")
            stalled.append(sock)
        time.sleep(0.2)
        ok = client("run", "--", "sh", "-c", "echo served", env=env, cwd=work, timeout=PROMPT_S)
        assert ok.returncode == 0 and ok.stdout == "served\n", ok.stderr
        for sock in stalled:  # each dropped once its message is late
            sock.settimeout(PROMPT_S)
            assert sock.recv(100) == b""
    finally:
        for sock in stalled:
            sock.close()


def test_connections_that_send_nothing_are_dropped(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path
) -> None:
    """Connected and silent: each is closed by the daemon, its descriptor with it, and the
    daemon still serves and exits when idle (no client holds it)."""
    pid, path = served_daemon(env, runtime, work)
    time.sleep(1.0)  # the spare has started
    before = open_fds(pid)
    silent = []
    try:
        for _ in range(20):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            silent.append(sock)
        for sock in silent:
            sock.settimeout(PROMPT_S)
            assert sock.recv(100) == b""  # closed by the daemon, unanswered
        assert wait_for(lambda: open_fds(pid) <= before), (before, open_fds(pid))
        ok = client("run", "--", "sh", "-c", "echo served", env=env, cwd=work, timeout=PROMPT_S)
        assert ok.returncode == 0 and ok.stdout == "served\n", ok.stderr
    finally:
        for sock in silent:
            sock.close()


def test_a_stalled_running_client_does_not_hold_up_another_run(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path
) -> None:
    """Half a header sent by a client whose command runs: the loop is not held while the rest
    is awaited."""
    _, path = served_daemon(env, runtime, work)
    marker = unique_duration()
    try:
        with hostile(path, request(["run", "--", "sleep", marker], work)) as sock:
            assert wait_for(lambda: host_pids_with(f"sleep\x00{marker}"))
            sock.sendall(b"\x00\x00")
            time.sleep(0.2)
            ok = client("run", "--", "sh", "-c", "echo served", env=env, cwd=work, timeout=4.0)
            assert ok.returncode == 0 and ok.stdout == "served\n", ok.stderr
        assert wait_for(lambda: not host_pids_with(f"sleep\x00{marker}"))
    finally:
        for each in host_pids_with(f"sleep\x00{marker}"):
            os.kill(each, signal.SIGKILL)


def test_descriptors_sent_with_bad_frames_are_not_kept(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path
) -> None:
    first = client("run", "--bind", str(work), "--", "true", env=env, cwd=work)
    assert first.returncode == 0, first.stderr
    [pid] = daemon_pids(runtime)
    [path] = [str(p) for p in (runtime / "cc-server").glob("cli-*.sock")]
    assert wait_for(lambda: len(bwrap_binding(work)) == 1)  # the spare
    time.sleep(1.0)  # the spare's proxies have started
    before = open_fds(pid)
    bodies = [b"{", b"[1]", b"\xff\xfe", json.dumps({"argv": 5, "cwd": "/"}).encode(),
              json.dumps({"argv": ["run"], "cwd": "relative"}).encode()]  # fmt: skip
    for _ in range(5):
        for body in bodies:
            with hostile(path, body) as sock:
                sock.settimeout(PROMPT_S)
                with pytest.raises(OSError):  # the socket closed unanswered, or reset
                    if sock.recv(100) == b"":
                        raise ConnectionResetError
        # Ten descriptors on one message: the daemon takes three at most.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            null = os.open(os.devnull, os.O_RDWR)
            try:
                socket.send_fds(sock, [frame(b"{")], [null] * 10)
            finally:
                os.close(null)
            sock.settimeout(PROMPT_S)
            assert sock.recv(100) == b""
    assert wait_for(lambda: open_fds(pid) <= before), (before, open_fds(pid))


@pytest.mark.parametrize("argv", [["probe"], ["serve"], ["daemon", "stop"], ["plan", "--", "true"]])
def test_a_request_for_another_verb_neither_ends_the_daemon_nor_runs(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path, argv: list[str]
) -> None:
    pid, path = served_daemon(env, runtime, work)
    if argv[0] == "plan":
        argv = ["plan", "--bind", str(work), "--", "touch", str(work / "ran")]
    err_r, err_w = os.pipe()
    null = os.open(os.devnull, os.O_RDWR)
    answer = b""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            socket.send_fds(sock, [frame(request(argv, work))], [null, null, err_w])
            os.close(err_w)
            err_w = -1
            sock.settimeout(CLI_TIMEOUT_S)
            with contextlib.suppress(OSError):
                while chunk := sock.recv(100):
                    answer += chunk
        with os.fdopen(err_r, "rb") as err:
            err_r = -1
            said = err.read().decode()
    finally:
        os.close(null)
        for fd in (err_r, err_w):
            if fd >= 0:
                os.close(fd)
    assert b'"exit": 2' in answer, (answer, said)  # a usage error
    assert "run" in said, said
    time.sleep(0.5)
    assert not (work / "ran").exists()  # a plan is never a run
    assert daemon_pids(runtime) == [pid]
    ok = client("run", "--", "sh", "-c", "echo still", env=env, cwd=work)
    assert ok.returncode == 0 and ok.stdout == "still\n", ok.stderr
    assert daemon_pids(runtime) == [pid]


def test_a_bound_directory_replaced_while_the_spare_starts_is_the_new_one(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """The user moves a bound directory away and makes a new one right after a run, while the
    daemon starts the spare: the next run must see the new directory."""
    args = ("run", "--bind", str(work), "--", "sh", "-c", f"cat {work}/which")
    for attempt in range(10):
        (work / "which").write_text(f"old-{attempt}\n")
        first = client(*args, env=env, cwd=tmp_path)
        assert first.returncode == 0 and first.stdout == f"old-{attempt}\n", first.stderr
        assert wait_for(lambda: len(bwrap_binding(work)) == 1)  # its bwrap runs: binds made
        work.rename(tmp_path / f"moved-away-{attempt}")
        work.mkdir()
        (work / "which").write_text(f"new-{attempt}\n")
        second = client(*args, env=env, cwd=tmp_path)
        assert second.returncode == 0 and second.stdout == f"new-{attempt}\n", (attempt, second)
        assert wait_for(lambda: len(bwrap_binding(work)) <= 1)


def test_the_host_paths_a_sandbox_binds_are_read_from_its_plan_with_and_without_an_identity() -> (
    None
):
    """What `same_sandbox` compares with the host: each host path bound at its own path, for a
    sandbox of the server's uid and for one of another identity (whose sources are stages)."""
    bwrap = ("/usr/bin/bwrap", "--ro-bind", "/usr", "/usr", "--ro-bind", "/dev/null", "/etc/x",
             "--bind", "/w", "/w", "--ro-bind", "/w/.git/hooks", "/w/.git/hooks",
             "--ro-bind", "/opt/launcher", "/run/launcher", "--", "/run/launcher", "--bind",
             "/a", "/a")  # fmt: skip
    plain = LaunchPlan(backend=SandboxBackend.NATIVE, argv=bwrap, env=())
    assert _host_binds(plain) == ("/usr", "/w", "/w/.git/hooks")
    staged = ("cc-identity", "--uid", "5", "--gid", "5", "--stage", STAGE_DIR, "--map", "/w",
              "--map", "/opt/launcher", "--", *bwrap[:7], "--bind", f"{STAGE_DIR}/0", "/w",
              "--ro-bind", f"{STAGE_DIR}/0/.git/hooks", "/w/.git/hooks", "--ro-bind",
              f"{STAGE_DIR}/1", "/run/launcher", *bwrap[16:])  # fmt: skip
    other = LaunchPlan(backend=SandboxBackend.NATIVE, argv=staged, env=(),
                       identity=SandboxIdentity(helper="cc-identity", uid=5, gid=5))
    assert _host_binds(other) == ("/usr", "/w", "/w/.git/hooks")
    # A spec bind made by fd (a server that is not root): its source is the fd's path.
    by_fd = (*bwrap[:7], "--bind-fd", PathFd(path="/w"), "/w", *bwrap[10:])
    plain_fd = LaunchPlan(backend=SandboxBackend.NATIVE, argv=by_fd, env=())
    assert _host_binds(plain_fd) == ("/usr", "/w", "/w/.git/hooks")
