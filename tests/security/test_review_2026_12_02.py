"""An attacker's review of the CLI daemon's C client and spare sandbox, the server's session
stream, the supervisor's open fast path and the egress guard: each test tries an escape and
checks the host afterwards.

The daemon tests give every test its own XDG_RUNTIME_DIR (so its own daemon) and kill that
daemon afterwards; the hostile client speaks the daemon's framing on its socket directly.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from ipaddress import ip_address

import aiohttp
import pytest
from cli_kit import daemon_pids
from escape_kit import Sandboxes, run_attack
from server_kit import (
    Server,
    drop_sandbox,
    frame_until,
    host_pids_with,
    kill_marked,
    new_sandbox,
    running_server,
    wait_until_gone,
)
from write_kit import tree_state

import cc_server
from cc_server.egress.guard import (
    Allowed,
    Refused,
    Resolve,
    Unresolvable,
    check_answers,
    check_target,
    unresolvable,
)
from cc_server.egress.patterns import Allowlist, parse_rules

pytestmark = pytest.mark.integration

CLI_TIMEOUT_S = 60.0  # hang guard for a run that takes well under a second
PROMPT_S = 10.0
PYTHON_CLIENT = (sys.executable, "-m", "cc_server.cli_client")
PACKAGE = pathlib.Path(cc_server.__file__).parent


def wait_for(predicate: object, timeout: float = PROMPT_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


# --- the CLI daemon ------------------------------------------------------------------------------


@pytest.fixture
def runtime() -> Iterator[pathlib.Path]:
    path = pathlib.Path(tempfile.mkdtemp(prefix="ccr-", dir="/tmp"))  # short: socket paths
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
    home.mkdir()
    return {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime)}


@pytest.fixture
def work(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


def client(
    *args: str, env: dict[str, str], cwd: pathlib.Path, timeout: float = CLI_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PYTHON_CLIENT, *args], env=env, cwd=cwd, capture_output=True, text=True,
        stdin=subprocess.DEVNULL, timeout=timeout, check=False,
    )  # fmt: skip


def served_daemon(env: dict[str, str], runtime: pathlib.Path, cwd: pathlib.Path) -> tuple[int, str]:
    """Start the daemon with one run; its pid and socket path."""
    first = client("run", "--", "true", env=env, cwd=cwd)
    assert first.returncode == 0, first.stderr
    [pid] = daemon_pids(runtime)
    [path] = (runtime / "cc-server").glob("cli-*.sock")
    return pid, str(path)


def frame(body: bytes) -> bytes:
    return struct.pack("!I", len(body)) + body


def hostile(path: str, body: bytes, *, fds: bool = True) -> socket.socket:
    """A connection that sent `body` as one framed message, with /dev/null as its stdio."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    if fds:
        null = os.open(os.devnull, os.O_RDWR)
        try:
            socket.send_fds(sock, [frame(body)], [null, null, null])
        finally:
            os.close(null)
    else:
        sock.sendall(frame(body))
    return sock


def request(argv: list[str], cwd: pathlib.Path, **extra: object) -> bytes:
    return json.dumps({"argv": argv, "cwd": str(cwd), "env": {}, **extra}).encode()


def bwrap_binding(directory: pathlib.Path) -> list[int]:
    """bwrap processes whose argv names `directory` (a run's sandbox, or a spare)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"bwrap") and str(directory).encode() in argv:
            found.append(int(entry))
    return found


def unique_duration() -> str:
    return str(400000 + int.from_bytes(os.urandom(3), "big") % 500000)


def test_another_user_is_refused_even_where_the_socket_lets_it_connect(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Past the 0700 directory and the 0600 socket (opened up here as a careless user might):
    the daemon's own SO_PEERCRED check refuses a peer of another uid."""
    _, path = served_daemon(env, runtime, work)
    os.chmod(runtime, 0o711)
    os.chmod(runtime / "cc-server", 0o777)
    os.chmod(path, 0o777)
    marker = tmp_path / "other-user-ran"
    tmp_path.chmod(0o777)
    body = request(["run", "--bind", str(tmp_path), "--", "touch", str(marker)], tmp_path)
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            code = 1  # connected: now the daemon itself must refuse
            with sock:
                socket.send_fds(sock, [frame(body)], [0, 1, 2])
                sock.settimeout(PROMPT_S)
                code = 0 if sock.recv(100) == b"" else 2  # closed unread, or answered
        except (BrokenPipeError, ConnectionResetError):
            code = 0 if code == 1 else 5  # closed at once: refused
        except OSError:
            code = 4
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    time.sleep(0.5)
    assert not marker.exists()


def test_a_peer_in_another_user_namespace_is_refused(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path
) -> None:
    """The daemon's own uid, in a user namespace of its own (as a sandbox is): never served."""
    _, path = served_daemon(env, runtime, work)
    marker = work / "userns-ran"
    body = request(["run", "--bind", str(work), "--", "touch", str(marker)], work)
    script = (
        "import socket, struct, os, sys\n"
        f"body = {body!r}\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"s.connect({path!r})\n"
        "try:\n"
        "    socket.send_fds(s, [struct.pack('!I', len(body)) + body], [0, 1, 2])\n"
        "    s.settimeout(10)\n"
        "    sys.exit(0 if s.recv(100) == b'' else 1)\n"
        "except (BrokenPipeError, ConnectionResetError):\n"
        "    sys.exit(0)\n"
    )
    for flags in (["-U", "-r"], ["-p", "-f", "--mount-proc"]):
        done = subprocess.run(
            ["unshare", *flags, sys.executable, "-c", script], capture_output=True,
            stdin=subprocess.DEVNULL, timeout=CLI_TIMEOUT_S, check=False,
        )  # fmt: skip
        assert done.returncode == 0, (flags, done.stderr)
    time.sleep(0.5)
    assert not marker.exists()


def _spare_ready(work: pathlib.Path) -> bool:
    return len(bwrap_binding(work)) == 1


def test_a_secret_made_after_the_spare_is_masked_in_it(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path
) -> None:
    home = pathlib.Path(env["HOME"])
    netrc = home / ".netrc"
    args = (
        "run",
        "--bind",
        str(home),
        "--bind",
        str(work),
        "--",
        "sh",
        "-c",
        f"cat {netrc} 2>/dev/null || echo masked",
    )
    first = client(*args, env=env, cwd=work)
    assert first.returncode == 0 and first.stdout == "masked\n", first.stderr
    assert wait_for(lambda: _spare_ready(work))  # the spare, made while ~/.netrc was absent
    netrc.write_text("machine example.com password CC-REVIEW-SECRET\n")
    second = client(*args, env=env, cwd=work)
    assert "CC-REVIEW-SECRET" not in second.stdout + second.stderr
    assert second.stdout.strip() in ("masked", ""), second.stdout


def test_a_file_made_after_the_spare_that_deny_create_names_is_as_in_a_fresh_sandbox(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path
) -> None:
    script = "cat .env 2>/dev/null || echo absent; echo x > .env && echo wrote; pwd"
    args = ("run", "--bind", str(work), "--deny-create", ".env", "--", "sh", "-c", script)
    first = client(*args, env=env, cwd=work)
    assert first.returncode == 0, first.stderr
    assert "absent" in first.stdout and "wrote" not in first.stdout  # .env: deny-create
    assert not (work / ".env").exists()
    assert wait_for(lambda: _spare_ready(work))
    (work / ".env").write_text("TOKEN=made-on-the-host\n")
    spared = client(*args, env=env, cwd=work)
    (work / ".env").write_text("TOKEN=made-on-the-host\n")
    fresh = client(*args, env={**env, "CC_SERVER_DAEMON": "off"}, cwd=work)
    assert (spared.returncode, spared.stdout) == (fresh.returncode, fresh.stdout), (
        spared.stderr,
        fresh.stderr,
    )


def test_a_run_from_another_directory_or_with_another_environment_is_its_own(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    args = (
        "run",
        "--bind",
        str(work),
        "--bind",
        str(other),
        "--",
        "sh",
        "-c",
        "pwd; echo term=$TERM lang=$LANG; ls",
    )
    (other / "only-in-other").touch()
    first = client(*args, env={**env, "TERM": "one"}, cwd=work)
    assert first.returncode == 0 and first.stdout.startswith(f"{work}\nterm=one"), first
    assert wait_for(lambda: _spare_ready(work))
    spared = client(*args, env={**env, "TERM": "two", "LANG": "C.UTF-8"}, cwd=other)
    fresh = client(
        *args, env={**env, "TERM": "two", "LANG": "C.UTF-8", "CC_SERVER_DAEMON": "off"}, cwd=other
    )
    assert spared.returncode == 0 and spared.stdout == fresh.stdout, (spared, fresh)
    assert spared.stdout.startswith(f"{other}\nterm=two lang=C.UTF-8\nonly-in-other")


def test_state_of_a_run_does_not_reach_the_next_through_the_spare(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path
) -> None:
    marker = unique_duration()
    script = (
        f"echo left > /tmp/left; echo left > $HOME/left; mkdir -p /dev/shm && "
        f"echo left > /dev/shm/left; (setsid sleep {marker} >/dev/null 2>&1 &); echo ok"
    )
    first = client("run", "--bind", str(work), "--", "sh", "-c", script, env=env, cwd=work)
    assert first.returncode == 0 and first.stdout == "ok\n", first.stderr
    try:
        assert wait_for(
            lambda: not host_pids_with(f"sleep\x00{marker}")
        )  # its sandbox took it along
        assert wait_for(lambda: _spare_ready(work))
        second = client(
            "run",
            "--bind",
            str(work),
            "--",
            "sh",
            "-c",
            "cat /tmp/left $HOME/left /dev/shm/left 2>/dev/null; pgrep -x sleep || echo clean",
            env=env,
            cwd=work,
        )
        assert second.returncode == 0 and second.stdout == "clean\n", second
    finally:
        for each in host_pids_with(f"sleep\x00{marker}"):
            os.kill(each, signal.SIGKILL)


def _session_dirs(runtime: pathlib.Path, pid: int) -> list[str]:
    base = runtime / "cc-server"
    return sorted(p.name for p in base.iterdir() if p.name.startswith(f"egress-{pid}-"))


def test_write_protection_chosen_when_the_daemon_started_is_not_the_next_clients(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path
) -> None:
    """The daemon started by a client that turned write-time protection off: a later client that
    did not is protected as in its own process."""
    weak = {**env, "CC_SERVER_WRITE_PROTECTION": "launch-time"}
    first = client("run", "--", "true", env=weak, cwd=work)
    assert first.returncode == 0, first.stderr
    assert daemon_pids(runtime)
    script = "echo '{}' > .mcp.json && echo wrote || echo refused"
    for run_env in (env, {**env, "CC_SERVER_DAEMON": "off"}):
        done = client("run", "--bind", str(work), "--", "sh", "-c", script, env=run_env, cwd=work)
        assert done.stdout == "refused\n", (done.stdout, done.stderr)
        assert not (work / ".mcp.json").exists()


@pytest.fixture(scope="module")
def c_client(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The C client, built as scripts/bootstrap builds it, for this package."""
    out = tmp_path_factory.mktemp("c-client") / "cc-server"
    source = PACKAGE / "backends" / "native" / "client.c"
    subprocess.run(
        ["gcc", "-O2", f'-DCC_PACKAGE="{PACKAGE}"', f'-DCC_PYTHON="{sys.executable}"',
         "-o", str(out), str(source)],
        check=True, capture_output=True, timeout=CLI_TIMEOUT_S,
    )  # fmt: skip
    return str(out)


def test_a_daemon_killed_mid_run_leaves_the_c_client_failed_and_the_command_run_once(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path, c_client: str
) -> None:
    served_daemon(env, runtime, work)
    [pid] = daemon_pids(runtime)
    marker = unique_duration()
    proc = subprocess.Popen(
        [c_client, "run", "--bind", str(work), "--", "sh", "-c",
         f"echo ran >> {work}/count; exec sleep {marker}"],
        env=env, cwd=work, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert wait_for(lambda: host_pids_with(f"sleep\x00{marker}"))
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 125 and "went away" in err, (proc.returncode, err)
    assert wait_for(lambda: not host_pids_with(f"sleep\x00{marker}"))
    assert (work / "count").read_text() == "ran\n"  # not run again in another process


def test_the_c_client_does_not_use_a_runtime_directory_that_is_not_private(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path, c_client: str
) -> None:
    served_daemon(env, runtime, work)
    (runtime / "cc-server").chmod(0o755)
    try:
        done = subprocess.run(
            [c_client, "run", "--bind", str(work), "--", "touch", str(work / "ran")],
            env=env, cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=CLI_TIMEOUT_S, check=False,
        )  # fmt: skip
    finally:
        (runtime / "cc-server").chmod(0o700)
    assert done.returncode != 0 and "EnforcementFailed" in done.stderr, done
    assert not (work / "ran").exists()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_a_spare_goes_with_its_daemon(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path, how: signal.Signals
) -> None:
    first = client("run", "--bind", str(work), "--", "true", env=env, cwd=work)
    assert first.returncode == 0, first.stderr
    [pid] = daemon_pids(runtime)
    assert wait_for(lambda: _spare_ready(work))
    assert _session_dirs(runtime, pid)  # control: the spare's session directory
    os.kill(pid, how)
    assert wait_for(lambda: not daemon_pids(runtime))
    assert wait_for(lambda: not bwrap_binding(work)), bwrap_binding(work)
    with open("/proc/self/mountinfo") as f:
        assert str(work) not in f.read()  # no mount of the spare's left on the host
    if how is signal.SIGINT:  # ended by itself: the spare is torn down, its directory too
        assert _session_dirs(runtime, pid) == []
    # The next daemon serves (its session directory is swept by the next daemon whose owner
    # is reaped by then: not checked here, the reaper of a killed daemon is the host's init).
    again = client("run", "--", "true", env=env, cwd=work)
    assert again.returncode == 0, again.stderr


def test_a_daemon_started_with_sigint_ignored_still_ends_on_sigint(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path
) -> None:
    # The first client started as a background job of a shell is (SIGINT ignored): the daemon
    # it spawns must not inherit that and outlive a SIGINT with its spare.
    first = subprocess.run(
        [*PYTHON_CLIENT, "run", "--bind", str(work), "--", "true"], env=env, cwd=work,
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=CLI_TIMEOUT_S,
        check=False, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    [pid] = daemon_pids(runtime)
    assert wait_for(lambda: _spare_ready(work))
    os.kill(pid, signal.SIGINT)
    assert wait_for(lambda: not daemon_pids(runtime))
    assert wait_for(lambda: not bwrap_binding(work)), bwrap_binding(work)
    assert _session_dirs(runtime, pid) == []


def test_daemon_stop_destroys_the_spare_at_once(
    env: dict[str, str], runtime: pathlib.Path, work: pathlib.Path
) -> None:
    first = client("run", "--bind", str(work), "--", "true", env=env, cwd=work)
    assert first.returncode == 0, first.stderr
    [pid] = daemon_pids(runtime)
    assert wait_for(lambda: _spare_ready(work))
    stopped = client("daemon", "stop", env=env, cwd=work)
    assert stopped.returncode == 0, stopped.stderr
    assert wait_for(lambda: not daemon_pids(runtime))
    assert not bwrap_binding(work)
    assert _session_dirs(runtime, pid) == []


# --- the server's session stream -----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("review-server")) as srv:
        yield srv


@pytest.fixture
async def sandboxes(server: Server, tmp_path: pathlib.Path) -> AsyncIterator[tuple[str, str]]:
    one, two = (await new_sandbox(server, tmp_path), await new_sandbox(server, tmp_path))
    try:
        yield one, two
    finally:
        await drop_sandbox(server, one)
        await drop_sandbox(server, two)


@pytest.fixture
def sleep_marker() -> Iterator[str]:
    value = unique_duration()
    yield value
    kill_marked(f"sleep\x00{value}")


@pytest.mark.parametrize("auth", ["none", "wrong-header", "wrong-query", "query-prefix"])
async def test_the_session_stream_upgrade_needs_the_token(
    server: Server, sandboxes: tuple[str, str], tmp_path: pathlib.Path, auth: str
) -> None:
    marker = tmp_path / f"ran-{auth}"
    headers = {"Authorization": "Bearer nope"} if auth == "wrong-header" else {}
    query = {
        "none": "",
        "wrong-header": "",
        "wrong-query": "?token=nope",
        "query-prefix": f"?token={server.token[:-1]}",
    }[auth]
    url = f"{server.ws_url}/v1/sandboxes/{sandboxes[0]}/session/ws{query}"
    async with aiohttp.ClientSession(headers=headers) as session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with session.ws_connect(url) as ws:
                await ws.send_json({"id": "x", "exec": {"argv": ["touch", str(marker)]}})
                await asyncio.sleep(1)
        assert refused.value.status == 401
    assert not marker.exists()


async def test_one_stream_cannot_reach_the_commands_of_another(
    server: Server, sandboxes: tuple[str, str], tmp_path: pathlib.Path, sleep_marker: str
) -> None:
    one, two = sandboxes
    base = f"{server.ws_url}/v1/sandboxes"
    async with (
        aiohttp.ClientSession(headers=server.auth) as session,
        session.ws_connect(f"{base}/{one}/session/ws") as victim,
        session.ws_connect(f"{base}/{one}/session/ws") as same_sandbox,
        session.ws_connect(f"{base}/{two}/session/ws") as other_sandbox,
    ):
        await victim.send_json(
            {
                "id": "job",
                "exec": {"argv": ["sh", "-c", f"cat > {tmp_path}/fed; exec sleep {sleep_marker}"]},
            }
        )
        await frame_until(victim, "ready", "job")
        for attacker in (same_sandbox, other_sandbox):
            for message in (
                {"id": "job", "kill": True},
                {"id": "job", "stdin": "evil\n"},
                {"id": "job", "stdinClose": True},
            ):
                await attacker.send_json(message)
                error = await frame_until(attacker, "error")
                assert error["id"] == "job" and error["status"] == 404, error
        await asyncio.sleep(0.5)
        assert host_pids_with(f"sleep\x00{sleep_marker}") == []  # still in `cat`: not fed
        await victim.send_json({"id": "job", "stdin": "mine\n", "stdinClose": True})
        assert await asyncio.to_thread(
            lambda: wait_for(lambda: host_pids_with(f"sleep\x00{sleep_marker}"))
        )
        assert (tmp_path / "fed").read_text() == "mine\n"
        await victim.send_json({"id": "job", "kill": True})
        exit_frame = await frame_until(victim, "exit", "job")
        assert exit_frame["id"] == "job"


async def test_a_reused_id_reaches_only_the_new_command(
    server: Server, sandboxes: tuple[str, str], tmp_path: pathlib.Path, sleep_marker: str
) -> None:
    url = f"{server.ws_url}/v1/sandboxes/{sandboxes[0]}/session/ws"
    async with aiohttp.ClientSession(headers=server.auth) as session, session.ws_connect(url) as ws:
        await ws.send_json({"id": "a", "exec": {"argv": ["true"]}})
        await frame_until(ws, "exit", "a")
        await ws.send_json({"id": "a", "exec": {"argv": ["sleep", sleep_marker]}})
        await frame_until(ws, "ready", "a")
        await ws.send_json({"id": "a", "kill": True})
        killed = await frame_until(ws, "exit", "a")
        assert killed["exitCode"] != 0
        assert await asyncio.to_thread(wait_until_gone, f"sleep\x00{sleep_marker}", PROMPT_S) == []


async def test_closing_before_the_commands_started_leaves_no_process(
    server: Server, sandboxes: tuple[str, str], sleep_marker: str
) -> None:
    url = f"{server.ws_url}/v1/sandboxes/{sandboxes[0]}/session/ws"
    for _ in range(3):
        async with (
            aiohttp.ClientSession(headers=server.auth) as session,
            session.ws_connect(url) as ws,
        ):
            for i in range(8):
                await ws.send_json(
                    {
                        "id": f"c{i}",
                        "exec": {
                            "argv": [
                                "sh",
                                "-c",
                                f"sleep {sleep_marker} & exec sleep {sleep_marker}",
                            ]
                        },
                    }
                )
        # closed at once: nothing has answered yet
    await asyncio.sleep(1.0)
    assert await asyncio.to_thread(wait_until_gone, f"sleep\x00{sleep_marker}", PROMPT_S) == []


# --- the supervisor's open fast path -------------------------------------------------------------

GIT_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1"}
EXCL = "os.O_CREAT | os.O_EXCL | os.O_WRONLY"
DEEP = 24  # directories of 200-byte names: 4800 bytes of path, past PATH_MAX


def _repo(wt: pathlib.Path) -> None:
    subprocess.run(
        ["git", "init", "-q", str(wt / "repoA")], check=True, capture_output=True, env=GIT_ENV
    )
    (wt / "plain").mkdir()


# Each attack prints WRITES=[...]: the ways it got a protected file open for writing.
FAST_PATH_ATTACKS: dict[str, str] = {
    # A bare name from /proc/self/fd: the magic link of a read-only descriptor of the config,
    # reopened for writing as a name in its start directory.
    "proc-self-fd-dirfd": (
        "ro = os.open('repoA/.git/config', os.O_RDONLY)\n"
        "writes = []\n"
        "for start in ('/proc/self/fd', f'/proc/{os.getpid()}/fd', '/proc/thread-self/fd'):\n"
        "    for flags in (os.O_WRONLY | os.O_APPEND, os.O_RDWR, os.O_WRONLY | os.O_TRUNC):\n"
        "        for how in (os.O_RDONLY | os.O_DIRECTORY, os.O_PATH | os.O_DIRECTORY):\n"
        "            try:\n"
        "                d = os.open(start, how)\n"
        "                fd = os.open(str(ro), flags, dir_fd=d)\n"
        "                os.write(fd, b'evil'); writes.append((start, flags))\n"
        "            except OSError:\n                pass\n"
        "try:\n"
        "    os.chdir('/proc/self/fd')\n"
        "    os.write(os.open(str(ro), os.O_WRONLY | os.O_APPEND), b'evil')\n"
        "    writes.append('cwd')\n"
        "except OSError:\n    pass\n"
        "print('WRITES=' + repr(writes))"
    ),
    # O_TMPFILE in the protected directory, then given the protected name by linkat.
    "o-tmpfile-then-link": (
        "writes = []\n"
        "for start, name in (('repoA/.git/hooks', 'pre-commit'),\n"
        "                     ('repoA/.git', 'hooks/pre-commit'), ('plain', '.mcp.json')):\n"
        "    try:\n"
        "        d = os.open(start, os.O_PATH | os.O_DIRECTORY)\n"
        "        fd = os.open('.', os.O_TMPFILE | os.O_WRONLY, 0o755, dir_fd=d)\n"
        "        os.write(fd, b'#!/bin/sh\\necho evil\\n')\n"
        "        os.link(f'/proc/self/fd/{fd}', name, dst_dir_fd=d)\n"
        "        writes.append(start)\n"
        "    except OSError:\n        pass\n"
        "print('WRITES=' + repr(writes))"
    ),
    # A directory deleted after it was opened as the start directory; then the start
    # directory's own name re-made as a protected one.
    "deleted-start-directory": (
        "writes = []\n"
        "os.mkdir('plain/gone')\n"
        "d = os.open('plain/gone', os.O_PATH | os.O_DIRECTORY)\n"
        "os.rmdir('plain/gone')\n"
        f"for flags in ({EXCL}, os.O_CREAT | os.O_WRONLY):\n"
        "    try:\n"
        "        os.open('pre-commit', flags, 0o755, dir_fd=d); writes.append(flags)\n"
        "    except OSError:\n        pass\n"
        "print('WRITES=' + repr(writes))"
    ),
    # The start directory renamed, by a second thread, between a plain directory and the
    # (absent) hooks directory of a repository, while the first makes a hook in it again and
    # again by a bare name.
    "start-directory-renamed-meanwhile": (
        "import shutil, threading\n"
        "os.mkdir('plain/hooks')\n"
        "stop = threading.Event()\n"
        "moves = []\n"
        "def swap():\n"
        "    while not stop.is_set():\n"
        "        for a, b in (('plain/hooks', 'repoA/.git/hooks'),\n"
        "                     ('repoA/.git/hooks', 'plain/hooks')):\n"
        "            try:\n"
        "                os.rename(a, b); moves.append(b)\n"
        "            except OSError:\n                pass\n"
        "t = threading.Thread(target=swap)\n"
        "t.start()\n"
        "d = os.open('plain/hooks', os.O_PATH | os.O_DIRECTORY)\n"
        "made, writes = 0, []\n"
        "for i in range(300):\n"
        "    try:\n"
        f"        os.close(os.open('pre-commit', {EXCL}, 0o755, dir_fd=d)); made += 1\n"
        "        if os.path.exists('repoA/.git/hooks/pre-commit'):\n"
        "            writes.append(i)\n"
        "        os.unlink('pre-commit', dir_fd=d)\n"
        "    except OSError:\n        pass\n"
        "stop.set(); t.join()\n"
        "print('MOVES', len(moves), 'MADE', made)\n"
        "print('WRITES=' + repr(writes))"
    ),
    # A start directory whose path is longer than PATH_MAX: its path cannot be read whole.
    # A start directory whose path is longer than PATH_MAX (made by the host): its path cannot
    # be read whole.
    "start-directory-past-path-max": (
        "writes, depth = [], 0\n"
        "os.chdir('plain')\n"
        "while os.path.isdir('d' * 200):\n"
        "    os.chdir('d' * 200)\n"
        "    depth += 1\n"
        "print('DEPTH', depth)\n"
        "for flags in (os.O_CREAT | os.O_EXCL | os.O_WRONLY, os.O_CREAT | os.O_WRONLY):\n"
        "    for dirfd in (None, os.open('.', os.O_PATH | os.O_DIRECTORY)):\n"
        "        try:\n"
        "            os.close(os.open('.mcp.json', flags, 0o644, dir_fd=dirfd))\n"
        "            writes.append((flags, dirfd))\n"
        "        except OSError:\n            pass\n"
        "print('WRITES=' + repr(writes))"
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(FAST_PATH_ATTACKS))
async def test_the_open_fast_path_gives_no_protected_file(
    sb: Sandboxes, tmp_path: pathlib.Path, name: str
) -> None:
    wt = sb.worktree
    _repo(wt)
    if name == "start-directory-renamed-meanwhile":
        shutil.rmtree(wt / "repoA" / ".git" / "hooks")
    before = tree_state(wt)
    if name == "start-directory-past-path-max":
        fd = os.open(wt / "plain", os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(DEEP):  # by descriptor: the path is past PATH_MAX
            os.mkdir("d" * 200, dir_fd=fd)
            deeper = os.open("d" * 200, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
        os.close(fd)
    config = (wt / "repoA" / ".git" / "config").read_bytes()
    _, out = await run_attack(sb, tmp_path, FAST_PATH_ATTACKS[name])
    assert "WRITES=[]" in out, out
    assert name != "start-directory-past-path-max" or f"DEPTH {DEEP}" in out, out
    assert (wt / "repoA" / ".git" / "config").read_bytes() == config
    assert not (wt / "repoA" / ".git" / "hooks" / "pre-commit").exists()
    # find walks by descriptor: paths past PATH_MAX too.
    found = subprocess.run(["find", str(wt), "-name", ".mcp.json"], capture_output=True,
                           text=True, check=True, timeout=CLI_TIMEOUT_S)  # fmt: skip
    assert found.stdout == "", found.stdout
    if name != "start-directory-past-path-max":  # tree_state reads by path
        made = sorted(set(tree_state(wt)) - set(before))
        assert not [p for p in made if ".git" in p], made


# --- the egress guard ----------------------------------------------------------------------------


GUARDED = Allowlist(
    patterns=parse_rules(
        "allow", ("example.com:443", "*.corp.example", "[2001:db8::1]:443", "8.8.4.4"), "review"
    ),
    denied=parse_rules("deny", ("8.8.8.8", "secret.corp.example"), "review deny"),
)

# Loopback, private, link-local, metadata and unspecified addresses, as a client can spell them.
FORBIDDEN_SPELLINGS = (
    "127.0.0.1", "127.1", "0x7f.1", "0177.0.0.1", "2130706433", "127.0.0.1.",
    "\uff11\uff12\uff17.0.0.1",
    "::1", "[::1]", "0:0:0:0:0:0:0:1", "::ffff:127.0.0.1", "[::ffff:7f00:1]", "::127.0.0.1",
    "64:ff9b::7f00:1", "64:ff9b:1::a00:1", "2002:7f00:1::", "2002:a9fe:a9fe::1",
    "2001:0:4136:e378:8000:63bf:80ff:fffe", "::ffff:0:a00:1", "fe80::1%eth0", "fe80::1%1",
    "[fe80::1%25eth0]", "169.254.169.254", "[fd00:ec2::254]", "0.0.0.0", "::", "[::]", "0",
    "10.0.0.1", "::ffff:10.0.0.1", "100.100.100.200", "192.168.1.1", "172.16.0.1",
    "2001:db8::2", "ff02::1", "224.0.0.1", "255.255.255.255",
)  # fmt: skip


@pytest.mark.parametrize("ask", [False, True])
@pytest.mark.parametrize("host", FORBIDDEN_SPELLINGS)
def test_no_spelling_of_a_forbidden_address_is_dialled_or_offered(host: str, ask: bool) -> None:
    for port in (443, 80, 22):
        verdict = check_target(GUARDED, host, port, ask=ask)
        assert isinstance(verdict, Refused), (host, port, verdict)


@pytest.mark.parametrize("host", [
    "example.com", "EXAMPLE.COM", "example.com.", "Example.Com.", "\uff45xample.com",
])  # fmt: skip
def test_spellings_of_a_listed_name_are_that_name_on_its_port_only(host: str) -> None:
    verdict = check_target(GUARDED, host, 443)
    assert isinstance(verdict, Resolve) and verdict.name == "example.com", verdict
    assert verdict.port == 443 and not verdict.ask
    for port in (80, 444, 0, 65535, 4430):
        assert isinstance(check_target(GUARDED, host, port), Refused), port


@pytest.mark.parametrize("host", [
    "ex\u0430mple.com",  # Cyrillic a
    "example.com..", ".example.com", "example..com", "example.com:443", "example.com\x00",
    "example.com\x00.evil.test", "evil.test#.example.com", "evil.test/.example.com",
    "evil.test\\.example.com", "example.com@evil.test", "evil.test?.example.com",
    "example.com evil.test", "example.com\t", "example.com\n", "example.co", "wwwexample.com",
    "example.com.evil.test", "xn--example.com", "example\u3002com\u3002evil.test",
    "corp.example", "a.corp.example.", "\u00e9vil.corp.example",
    "secret.corp.example", "SECRET.corp.example.", "s\u0435cret.corp.example",
])  # fmt: skip
@pytest.mark.parametrize("ask", [False, True])
def test_a_name_the_allowlist_does_not_hold_is_never_resolved_as_listed(
    host: str, ask: bool
) -> None:
    for port in (443, 80):
        verdict = check_target(GUARDED, host, port, ask=ask)
        if isinstance(verdict, Resolve):
            listed = GUARDED.decide(verdict.name, port)
            # Resolved without asking only when the canonical name is listed for that port;
            # anything else is either refused or held for the one asked.
            assert listed.allowed or verdict.ask, (host, port, verdict)
            assert not GUARDED.decide(verdict.name, port).rule or listed.allowed
            assert ask or listed.allowed
            assert verdict.name != "secret.corp.example"
        else:
            assert isinstance(verdict, Refused), (host, port, verdict)


def test_the_deny_list_wins_in_every_spelling_and_in_ask_mode() -> None:
    for ask in (False, True):
        for host in (
            "secret.corp.example",
            "SECRET.CORP.EXAMPLE.",
            "8.8.8.8",
            "::ffff:8.8.8.8",
            "[::ffff:808:808]",
            "64:ff9b::808:808",
            "2002:808:808::1",
            "0x8.8.8.8",
            "134744072",
            "8.8.8.8.",
            "\uff10x8.8.8.8",
        ):
            verdict = check_target(GUARDED, host, 443, ask=ask)
            assert isinstance(verdict, Refused) and verdict.entry is None, (host, verdict)
    resolve = Resolve(name="a.corp.example", port=443)
    for answers in (["8.8.8.8"], ["1.1.1.1", "::ffff:8.8.8.8"], ["2002:808:808::"]):
        verdict = check_answers(GUARDED, resolve, [ip_address(a) for a in answers])
        assert isinstance(verdict, Refused) and verdict.entry is None, (answers, verdict)


def test_a_listed_literal_is_that_address_on_its_port_only() -> None:
    for spelled in ("2001:db8::1", "[2001:db8::1]", "2001:0db8:0000::0001", "[2001:DB8::1]"):
        verdict = check_target(GUARDED, spelled, 443)
        assert isinstance(verdict, Allowed), (spelled, verdict)
        assert verdict.addresses == (ip_address("2001:db8::1"),)
        assert isinstance(check_target(GUARDED, spelled, 80), Refused)
    # The literal allowed on every port is itself, not the addresses carrying it.
    assert isinstance(check_target(GUARDED, "8.8.4.4", 22), Allowed)
    for carried in ("::ffff:8.8.4.4", "64:ff9b::808:404"):
        verdict = check_target(GUARDED, carried, 22)
        assert not (isinstance(verdict, Allowed) and verdict.addresses != (ip_address(carried),))


@pytest.mark.parametrize("answers", [
    ["93.184.216.34", "127.0.0.1"], ["::1"], ["::ffff:10.0.0.1"], ["64:ff9b::a9fe:a9fe"],
    ["2606:4700::1", "fe80::1"], ["0.0.0.0"], ["2001:db8::2"], ["169.254.169.254"],
])  # fmt: skip
def test_a_listed_name_that_resolves_anywhere_forbidden_is_refused_whole(
    answers: list[str],
) -> None:
    for ask in (False, True):
        resolve = Resolve(name="example.com", port=443, ask=ask)
        verdict = check_answers(GUARDED, resolve, [ip_address(a) for a in answers])
        assert isinstance(verdict, Refused), (answers, verdict)


def test_an_unresolvable_name_dials_nothing_and_is_no_allowance() -> None:
    resolve = Resolve(name="example.com", port=443)
    for verdict in (
        check_answers(GUARDED, resolve, []),
        unresolvable("example.com", OSError("no such name")),
        unresolvable("example.com", TimeoutError()),
    ):
        assert isinstance(verdict, Unresolvable) and verdict.error, verdict
    # What is allowed carries exactly the answers, once each, in order.
    answers = [ip_address(a) for a in ("93.184.216.34", "2606:2800::1", "93.184.216.34")]
    verdict = check_answers(GUARDED, resolve, answers)
    assert isinstance(verdict, Allowed) and verdict.addresses == tuple(answers[:2])


async def test_no_head_of_any_kind_makes_a_repository_of_a_directory_with_a_config(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    """objects/, refs/, hooks/ and a config with core.fsmonitor made first (not a repository
    yet), then HEAD as a file, a symlink git would follow, or a hard link of a repository's
    HEAD: host git must not find a repository there."""
    wt = sb.worktree
    _repo(wt)
    pwned = tmp_path / "pwned"
    body = (
        "got = {}\n"
        "os.makedirs('p/objects'); os.makedirs('p/refs/heads'); os.makedirs('p/hooks')\n"
        "open('p/config', 'w').write("
        f"'[core]\\n\\trepositoryformatversion = 0\\n\\tfsmonitor = touch {pwned}\\n')\n"
        "for what, make in (\n"
        "        ('symlink', lambda: os.symlink('refs/heads/main', 'p/HEAD')),\n"
        "        ('file', lambda: open('p/HEAD', 'w').write('ref: refs/heads/main\\n')),\n"
        "        ('link', lambda: os.link('repoA/.git/HEAD', 'p/HEAD')),\n"
        "        ('rename', lambda: (open('p/HEAD.new', 'w').write('ref: refs/heads/main\\n'),\n"
        "                            os.rename('p/HEAD.new', 'p/HEAD')))):\n"
        "    try:\n        make(); got[what] = 'MADE'\n"
        "    except OSError as e:\n        got[what] = e.errno\n"
        "print('GOT', sorted(got.items()))"
    )
    _, out = await run_attack(sb, tmp_path, body)
    assert "GOT [" in out and "MADE" not in out, out
    assert not (wt / "p" / "HEAD").exists() and not (wt / "p" / "HEAD").is_symlink()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GIT_CEILING_DIRECTORIES": str(wt)}
    git = subprocess.run(["git", "-C", str(wt / "p"), "status"], capture_output=True,
                         text=True, env=env, check=False, timeout=CLI_TIMEOUT_S)  # fmt: skip
    assert git.returncode != 0 and "not a git repository" in git.stderr, git
    assert not pwned.exists()
