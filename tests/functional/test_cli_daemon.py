"""`cc-server run` through the CLI daemon: the same sandbox and the same answers as the in-process
run, on the client's own descriptors, and a daemon nobody else can use or wedge. Both clients: the
Python one (`cli_client.py`) and the C one (`native/client.c`; scripts/bootstrap installs it as
the venv's `cc-server`, these tests build it for the interpreter they run on), which hands
everything but a served `run` to the Python one.

Every test gets its own XDG_RUNTIME_DIR (so its own daemon) and stops that daemon afterwards.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
from cli_kit import daemon_pids, parent_pid

import cc_server
from cc_server.cli_socket import receive_message, send_message

pytestmark = pytest.mark.integration

PACKAGE = pathlib.Path(cc_server.__file__).parent
CLIENT_SOURCE = PACKAGE / "backends" / "native" / "client.c"
PYTHON_CLIENT = (sys.executable, "-m", "cc_server.cli_client")


def build_client(out: pathlib.Path, python: str) -> str:
    """The C client, built as scripts/bootstrap builds it, for this package and `python`."""
    subprocess.run(
        ["gcc", "-O2", "-Wall", "-Wextra", "-Werror", f'-DCC_PACKAGE="{PACKAGE}"',
         f'-DCC_PYTHON="{python}"', "-o", str(out), str(CLIENT_SOURCE)],
        check=True, capture_output=True, timeout=CLI_TIMEOUT_S,
    )  # fmt: skip
    return str(out)


@pytest.fixture(scope="session")
def c_client(tmp_path_factory: pytest.TempPathFactory) -> tuple[str]:
    return (build_client(tmp_path_factory.mktemp("client") / "cc-server", sys.executable),)


@pytest.fixture(params=["py", "c"])
def argv0(request: pytest.FixtureRequest, c_client: tuple[str]) -> tuple[str, ...]:
    return PYTHON_CLIENT if request.param == "py" else c_client

CLI_TIMEOUT_S = 60.0
STALE_PID = 2**22 + 7  # above the largest pid_max Linux allows (2**22): never a live process
PROMPT_S = 10.0


def wait_for(predicate: object, timeout: float = PROMPT_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def runtime() -> Iterator[pathlib.Path]:
    # Short: the session sockets under it must fit a Unix socket path.
    path = pathlib.Path(tempfile.mkdtemp(prefix="ccd-", dir="/tmp"))
    try:
        yield path
        for pid in daemon_pids(path):
            os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not daemon_pids(path))
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def env(tmp_path: pathlib.Path, runtime: pathlib.Path) -> dict[str, str]:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("CC-DAEMON-SECRET\n")
    return {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime)}


def client(
    *args: str, env: dict[str, str], cwd: pathlib.Path | None = None,
    argv0: tuple[str, ...] = PYTHON_CLIENT, stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    if cwd is None:  # never the checkout: `run` binds its cwd when nothing else is bound
        cwd = pathlib.Path(env["HOME"]).parent / "cwd"
        cwd.mkdir(exist_ok=True)
    return subprocess.run(
        [*argv0, *args], env=env, cwd=cwd, capture_output=True, text=True, input=stdin,
        stdin=subprocess.DEVNULL if stdin is None else None, timeout=CLI_TIMEOUT_S, check=False,
    )  # fmt: skip


def sockets(runtime: pathlib.Path) -> list[pathlib.Path]:
    base = runtime / "cc-server"
    return sorted(base.glob("cli-*.sock")) if base.exists() else []


def test_a_run_through_the_daemon_is_the_same_sandbox(
    env: dict[str, str], runtime: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    script = (
        "echo out; echo err >&2; echo made > made.txt; "
        "cat $HOME/.ssh/id_ed25519 || echo secret-hidden; "
        "curl -s -o /dev/null -m 5 http://not-allowed.example/; "
        "echo term=$TERM; exit 7"
    )
    proc = client(
        "run", "--bind", ".", "--env", "X=1", "--", "sh", "-c", script,
        env={**env, "TERM": "xterm-test", "SECRET_TOKEN": "nope"}, cwd=work,
    )  # fmt: skip
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout.splitlines() == ["out", "secret-hidden", "term=xterm-test"]
    assert "err" in proc.stderr.splitlines()
    assert "CC-DAEMON-SECRET" not in proc.stdout + proc.stderr
    assert "violation: network-outbound not-allowed.example:80" in proc.stderr
    assert (work / "made.txt").read_text() == "made\n"  # the relative --bind was the client's
    # It was the daemon: one serves this runtime dir, on a private socket.
    [path] = sockets(runtime)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    [pid] = daemon_pids(runtime)
    # The daemon was started with only what keys it, never the first client's secrets.
    with open(f"/proc/{pid}/environ", "rb") as f:
        daemon_env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if v)
    assert set(daemon_env) <= {b"HOME", b"PATH", b"XDG_RUNTIME_DIR", b"TMPDIR"}, daemon_env
    assert daemon_env[b"HOME"] == env["HOME"].encode()
    # The next run is served by the same daemon.
    again = client("run", "--", "sh", "-c", "echo again", env=env)
    assert again.returncode == 0 and again.stdout == "again\n", again.stderr
    assert daemon_pids(runtime) == [pid]


def test_errors_and_usage_reach_the_clients_stderr(
    env: dict[str, str], runtime: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    bad = client("run", "--bind", "/does/not/exist", "--", "true", env=env)
    assert bad.returncode == 2 and "BadSpec" in bad.stderr, bad.stderr
    usage = client("run", "--mode", "nonsense", "--", "true", env=env)
    assert usage.returncode == 2 and "invalid choice" in usage.stderr, usage.stderr
    # (A refused backend's message and exit code 125: test_cli_microvm, with QEMU missing.)
    marker = tmp_path / "ran"
    # A working directory that is gone by the time the daemon serves it: said on the client's
    # stderr, and the command never runs.
    [path] = sockets(runtime)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX) as sock, open(os.devnull, "rb") as devnull:
            sock.connect(str(path))
            request = {"argv": ["run", "--", "touch", str(marker)],
                       "cwd": str(tmp_path / "missing"), "env": {}}
            send_message(sock, request, fds=(devnull.fileno(), out_w, err_w))
            os.close(out_w)
            os.close(err_w)
            out_w = err_w = -1
            sock.settimeout(PROMPT_S)
            reply, _ = receive_message(sock)
        assert reply == {"exit": 2}
        with os.fdopen(err_r, "rb") as err:
            err_r = -1
            assert b"working directory" in err.read()
    finally:
        for fd in (out_r, out_w, err_r, err_w):
            if fd >= 0:
                os.close(fd)
    assert not marker.exists()


def test_sigterm_to_the_client_ends_the_command(
    env: dict[str, str], tmp_path: pathlib.Path, argv0: tuple[str, ...]
) -> None:
    marker = tmp_path / "work"
    marker.mkdir()
    assert client("run", "--", "true", env=env).returncode == 0  # a daemon serves the C client
    proc = _sleeper(env, marker, argv0)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=PROMPT_S) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert wait_for(lambda: not _sandboxed_sleepers(marker))


def test_a_killed_client_takes_its_command_with_it(
    env: dict[str, str], tmp_path: pathlib.Path, argv0: tuple[str, ...]
) -> None:
    marker = tmp_path / "work"
    marker.mkdir()
    assert client("run", "--", "true", env=env).returncode == 0  # a daemon serves the C client
    proc = _sleeper(env, marker, argv0)
    proc.kill()
    proc.wait()
    assert wait_for(lambda: not _sandboxed_sleepers(marker))


def _sleeper(
    env: dict[str, str], marker: pathlib.Path, argv0: tuple[str, ...] = PYTHON_CLIENT
) -> subprocess.Popen[bytes]:
    """A client running `sleep 60` in a sandbox that binds `marker`, once it runs."""
    proc = subprocess.Popen(
        [*argv0, "run", "--bind", str(marker), "--",
         "sh", "-c", f"echo started > {marker}/started; exec sleep 60"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert wait_for(lambda: (marker / "started").exists())
    assert _sandboxed_sleepers(marker)  # control: the command runs
    return proc


def _sandboxed_sleepers(marker: pathlib.Path) -> list[int]:
    """bwrap processes whose argv binds `marker` (the sandboxes of these tests, a spare too)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if argv and argv[0].endswith(b"bwrap") and str(marker).encode() in argv:
            found.append(int(entry))
    return found


def test_garbage_on_the_socket_does_not_wedge_the_daemon(
    env: dict[str, str], runtime: pathlib.Path
) -> None:
    assert client("run", "--", "true", env=env).returncode == 0
    [path] = sockets(runtime)
    for junk in (b"\xff\xff\xff\xff", struct.pack("!I", 5) + b"[1,2]", b"\x00\x00", b""):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(path))
            sock.sendall(junk)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(PROMPT_S)
            assert sock.recv(100) == b""  # dropped, no answer
    # A request without descriptors is dropped too.
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))
        body = json.dumps({"argv": ["run", "--", "true"], "cwd": "/", "env": {}}).encode()
        sock.sendall(struct.pack("!I", len(body)) + body)
        sock.settimeout(PROMPT_S)
        assert sock.recv(100) == b""
    ok = client("run", "--", "sh", "-c", "echo still", env=env)
    assert ok.returncode == 0 and ok.stdout == "still\n", ok.stderr


def test_another_user_cannot_reach_the_daemon(env: dict[str, str], runtime: pathlib.Path) -> None:
    assert client("run", "--", "true", env=env).returncode == 0
    [path] = sockets(runtime)
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(str(path))
            code = 1  # connected: the escape worked
        except PermissionError:
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_new_daemon_removes_what_a_killed_one_left(
    env: dict[str, str], runtime: pathlib.Path
) -> None:
    base = runtime / "cc-server"
    base.mkdir(mode=0o700)
    dead = base / f"cli-0123abcd.sock.{STALE_PID}.tmp"  # bound, then killed before the rename
    live = base / f"cli-0123abcd.sock.{os.getpid()}.tmp"  # a daemon starting right now
    other = base / "cli-notes.tmp"  # not a name the daemon makes
    for path in (dead, live, other):
        path.touch()
    with pytest.raises(ProcessLookupError):
        os.kill(STALE_PID, 0)
    assert client("run", "--", "true", env=env).returncode == 0
    assert not dead.exists() and live.exists() and other.exists()
    # A killed daemon's socket is replaced by the next one.
    [pid] = daemon_pids(runtime)
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: not daemon_pids(runtime))
    [stale] = sockets(runtime)
    again = client("run", "--", "sh", "-c", "echo again", env=env)
    assert again.returncode == 0 and again.stdout == "again\n", again.stderr
    assert sockets(runtime) == [stale] and len(daemon_pids(runtime)) == 1


def test_daemon_stop_and_off(env: dict[str, str], runtime: pathlib.Path) -> None:
    assert client("run", "--", "true", env=env).returncode == 0
    assert len(daemon_pids(runtime)) == 1
    stopped = client("daemon", "stop", env=env)
    assert stopped.returncode == 0 and "stopping" in stopped.stdout, stopped.stderr
    assert wait_for(lambda: not daemon_pids(runtime) and not sockets(runtime))
    # Off: the run happens in the client's process, and no daemon is started.
    off = client("run", "--", "sh", "-c", "echo inproc", env={**env, "CC_SERVER_DAEMON": "off"})
    assert off.returncode == 0 and off.stdout == "inproc\n", off.stderr
    assert not daemon_pids(runtime) and not sockets(runtime)
    nothing = client("daemon", "stop", env=env)
    assert nothing.returncode == 0 and "no CLI daemon" in nothing.stdout


def _descendants(pid: int) -> set[str]:
    """The command names of `pid`'s descendants."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat_line = f.read()
        except (OSError, ValueError):
            continue
        name, rest = stat_line[stat_line.index("(") + 1 :].rsplit(")", 1)
        names[int(entry)] = name
        children.setdefault(int(rest.split()[1]), []).append(int(entry))
    found, todo = set(), list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.add(names[child])
        todo.extend(children.get(child, []))
    return found


def test_the_next_run_takes_a_spare_sandbox_that_is_new(
    env: dict[str, str], tmp_path: pathlib.Path, c_client: tuple[str]
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    first = client(
        "run", "--bind", str(work), "--", "sh", "-c",
        "echo left > /tmp/left; sleep 60 > /dev/null 2>&1 & echo first", env=env, cwd=work,
    )  # fmt: skip
    assert first.returncode == 0 and first.stdout == "first\n", first.stderr
    # The first run's sandbox is gone before its client returns: what binds `work` now is the
    # spare, made for the next run like it (bwrap, and the child it forks for the namespace).
    assert wait_for(lambda: _sandboxed_sleepers(work))
    found = _sandboxed_sleepers(work)
    [spare] = [pid for pid in found if parent_pid(pid) not in found]
    second = subprocess.Popen(
        [*c_client, "run", "--bind", str(work), "--", "sh", "-c",
         f"cat /tmp/left 2>/dev/null || echo new-tmp; echo > {work}/started; exec sleep 1"],
        env=env, cwd=work, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert wait_for(lambda: (work / "started").exists())
        # It runs in the spare: a sandbox no command ran in, without the first one's files or
        # the process it left.
        assert "sleep" in _descendants(spare)
        out, err = second.communicate(timeout=CLI_TIMEOUT_S)
    finally:
        second.kill()
        second.wait()
    assert second.returncode == 0 and out == "new-tmp\n", err
    assert spare not in _sandboxed_sleepers(work)  # destroyed after its one command


def test_a_spare_made_before_the_host_changed_is_not_used(
    env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    old, new, link = tmp_path / "old", tmp_path / "new", tmp_path / "link"
    for directory in (old, new):
        directory.mkdir()
        (directory / "which").write_text(f"{directory.name}\n")
    link.symlink_to(old)
    first = client("run", "--bind", str(link), "--", "cat", f"{link}/which", env=env)
    assert first.returncode == 0 and first.stdout == "old\n", first.stderr
    assert wait_for(lambda: _sandboxed_sleepers(old))  # the spare: `old` bound at `link`
    link.unlink()
    link.symlink_to(new)  # the same spec means another directory now
    second = client("run", "--bind", str(link), "--", "cat", f"{link}/which", env=env)
    assert second.returncode == 0 and second.stdout == "new\n", second.stderr


def test_the_c_client_is_served_by_the_same_daemon(
    env: dict[str, str], runtime: pathlib.Path, tmp_path: pathlib.Path, c_client: tuple[str]
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    script = "cat; echo term=$TERM lc=$LC_ALL token=${SECRET_TOKEN-unset}; echo err >&2; exit 5"
    # No daemon yet: the C client leaves it to the Python one, which starts it.
    started = client("run", "--", "sh", "-c", script, env={**env, "TERM": "t1"}, cwd=work,
                     argv0=c_client, stdin="in-1\n")
    assert started.returncode == 5, started.stderr
    assert started.stdout == "in-1\nterm=t1 lc= token=unset\n"
    [pid] = daemon_pids(runtime)
    [path] = sockets(runtime)
    served = client(
        "run", "--", "sh", "-c", script, cwd=work, argv0=c_client, stdin="in-2\n",
        env={**env, "TERM": "t2", "LC_ALL": "C.UTF-8", "SECRET_TOKEN": "nope"},
    )  # fmt: skip
    assert served.returncode == 5, served.stderr
    assert served.stdout == "in-2\nterm=t2 lc=C.UTF-8 token=unset\n"
    assert served.stderr.splitlines() == ["err"]
    # The same daemon and socket as the Python client's: the two compute the same key.
    again = client("run", "--", "sh", "-c", "echo py", env=env, cwd=work)
    assert again.returncode == 0 and again.stdout == "py\n", again.stderr
    assert daemon_pids(runtime) == [pid] and sockets(runtime) == [path]
    stopped = client("daemon", "stop", env=env, argv0=c_client)
    assert stopped.returncode == 0 and "stopping" in stopped.stdout, stopped.stderr
    assert wait_for(lambda: not daemon_pids(runtime) and not sockets(runtime))


def test_the_c_client_hands_the_rest_to_python(
    env: dict[str, str], runtime: pathlib.Path, tmp_path: pathlib.Path, c_client: tuple[str]
) -> None:
    c = c_client
    probe = client("probe", "--json", env=env, argv0=c)
    assert probe.returncode == 0 and json.loads(probe.stdout)["platform"] == "linux"
    usage = client("run", "--help", env=env, argv0=c)
    assert usage.returncode == 0 and "--bind" in usage.stdout
    off = client("run", "--", "sh", "-c", "echo inproc", env={**env, "CC_SERVER_DAEMON": "off"},
                 argv0=c)
    assert off.returncode == 0 and off.stdout == "inproc\n", off.stderr
    assert not daemon_pids(runtime)
    bad = client("run", "--bind", "/does/not/exist", "--", "true", env=env, argv0=c)
    assert bad.returncode == 2 and "BadSpec" in bad.stderr, bad.stderr
    # An argument that is not UTF-8 reaches the command as it was (through Python).
    work = tmp_path / "work"
    work.mkdir()
    raw = subprocess.run(
        [c[0].encode(), b"run", b"--", b"printf", b"%s", b"a\xffb"], env=env, cwd=work,
        stdin=subprocess.DEVNULL, capture_output=True, timeout=CLI_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert raw.returncode == 0 and raw.stdout == b"a\xffb", raw.stderr


def test_a_c_client_without_its_interpreter_runs_nothing(
    env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    broken = build_client(tmp_path / "cc-server", f"{tmp_path}/gone/python")
    marker = tmp_path / "ran"
    for args in (["probe"], ["run", "--bind", str(tmp_path), "--", "touch", str(marker)]):
        proc = client(*args, env=env, argv0=(broken,))
        assert proc.returncode == 125, proc
        assert f"cannot start {tmp_path}/gone/python" in proc.stderr
    assert not marker.exists()


def test_what_the_daemon_does_not_serve_runs_in_process_even_abbreviated(
    env: dict[str, str], runtime: pathlib.Path, argv0: tuple[str, ...]
) -> None:
    # argparse takes "--ev" for "--events" and "--he" for "--help": the events stream on the
    # client's stdout, the help on its stdout, never a daemon's run without them.
    events = client("run", "--ev", "json", "--", "echo", "hi", env=env, argv0=argv0)
    assert events.returncode == 0, events.stderr
    kinds = [json.loads(line)["type"] for line in events.stdout.splitlines()]
    assert kinds == ["starting", "ready", "stdout", "exit"], events.stdout
    usage = client("run", "--he", env=env, argv0=argv0)
    assert usage.returncode == 0 and "--bind" in usage.stdout, usage.stderr
    assert not daemon_pids(runtime)
