"""Leaving the namespaces: nested namespaces, mounts, io_uring, host processes, orphans, network.

Each test tries the escape, asserts it failed, and runs a control that proves the same tool works
where it is allowed (a syscall that is not filtered, a listener inside the sandbox, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from escape_kit import (
    Sandboxes,
    attempts,
    grep_pattern,
    host_pids_with,
    outcomes,
    output,
    shell_word,
    unique,
    wait_until,
)

pytestmark = [pytest.mark.security, pytest.mark.integration]

PY = "/usr/bin/python3"  # the host's pyenv python lives under /root, which the sandbox cannot see


@contextlib.contextmanager
def host_process(argv: list[str], env: dict[str, str] | None = None) -> Iterator[int]:
    """A long-running host process; killed and reaped on exit."""
    proc = subprocess.Popen(argv, env=env or {"PATH": "/usr/bin:/bin"})
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


# --- namespaces and mounts -------------------------------------------------------------------


async def test_nested_user_namespace_and_mounts_are_refused(sb: Sandboxes) -> None:
    result = await sb.run(
        attempts(
            control="unshare --help",
            unshare_user="unshare -Ur true",
            unshare_user_mount="unshare -Urm sh -c 'mount -t tmpfs none /etc'",
            unshare_mount="unshare -m true",
            unshare_net="unshare -n true",
            unshare_pid="unshare -pf true",
            remount_root_rw="mount -o remount,rw /",
            remount_usr_rw="mount -o remount,rw /usr",
            mount_tmpfs="mount -t tmpfs none /etc",
            mount_bind=f"mount --bind {sb.worktree} /usr/bin",
            mount_proc="mount -t proc proc /proc",
            chroot="chroot / true",
            python_unshare=(
                f"{PY} -c 'import os, sys; os.unshare(os.CLONE_NEWUSER | os.CLONE_NEWNS)'"
            ),
        )
        + "\necho probe-ran > /tmp/probe && cat /tmp/probe"
    )
    verdicts = outcomes(result)
    assert verdicts.pop("control") == "ok" and "probe-ran" in output(result), output(result)
    assert verdicts == dict.fromkeys(verdicts, "fail"), verdicts
    assert len(verdicts) == 12


async def test_masks_cannot_be_unmounted(sb: Sandboxes) -> None:
    key = sb.ssh_key
    control = unique("home-readme")
    (sb.home / "README").write_text(control)
    result = await sb.run(
        attempts(
            umount_shadow="umount /etc/shadow",
            umount_lazy_shadow="umount -l /etc/shadow",
            umount_ssh=f"umount {sb.home}/.ssh",
            umount_ssh_lazy=f"umount -l {sb.home}/.ssh",
            umount_key_dir=f"umount -R {sb.home}/.ssh",
            remount_ssh_rw=f"mount -o remount,rw {sb.home}/.ssh",
            umount_python=(
                f"{PY} -c 'import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); "
                f'sys.exit(0 if libc.umount2(b"{sb.home}/.ssh", 2) == 0 else 1)\''
            ),
        )
        + f"""
        echo "shadow-bytes=$(cat /etc/shadow 2>/dev/null | wc -c)"
        cat {key}
        echo "ssh-entries=$(ls -A {sb.home}/.ssh | wc -l)"
        cat {sb.home}/README
        """,
        bindMounts=[{"hostPath": str(sb.home)}],
    )
    text = output(result)
    assert control in text, f"control: the bound home was not readable:\n{text}"
    verdicts = outcomes(result)
    assert verdicts == dict.fromkeys(verdicts, "fail") and len(verdicts) == 7, verdicts
    assert "shadow-bytes=0" in text and "ssh-entries=0" in text, text
    assert sb.secret_marker not in text, text


IO_URING_SETUP = f"""{PY} - <<'EOF'
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
params = ctypes.create_string_buffer(120)  # struct io_uring_params
ret = libc.syscall(425, 8, params)  # io_uring_setup(entries=8, params)
print(f"io_uring_setup={{ret}} errno={{ctypes.get_errno()}}")
print(f"getpid={{libc.syscall(39)}}")  # control: an unfiltered syscall through the same path
EOF"""


async def test_io_uring_setup_is_refused(sb: Sandboxes) -> None:
    result = await sb.run(IO_URING_SETUP)
    text = output(result)
    assert "io_uring_setup=-1 errno=1" in text, text  # EPERM from the seccomp filter
    # PID namespace: a tiny pid (the egress bridge's listeners start first, so not always 2).
    pid = int(text.split("getpid=")[1].split()[0])
    assert 1 < pid < 50, text
    # Control on the host: the probe itself works, so the refusal is the filter's doing.
    host = subprocess.run(
        ["/bin/sh", "-c", IO_URING_SETUP], capture_output=True, text=True, check=True
    ).stdout
    with open("/proc/sys/kernel/io_uring_disabled") as f:
        if f.read().strip() == "0":
            assert "io_uring_setup=-1" not in host, host


async def test_other_filtered_syscalls_are_refused(sb: Sandboxes) -> None:
    script = f"""{PY} - <<'EOF'
import ctypes, fcntl, os, termios
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(name, nr, *args):
    ret = libc.syscall(nr, *args)
    print(f"{{name}}={{ret}}:{{ctypes.get_errno()}}")
call("setns", 308, -1, 0)
call("bpf", 321, 0, None, 0)
call("perf_event_open", 298, None, 0, -1, -1, 0)
call("keyctl", 250, 0, 0)
call("userfaultfd", 323, 0)
call("unshare_newuser", 272, 0x10000000)
call("unshare_newns", 272, 0x00020000)
call("getppid", 110)
EOF"""
    text = output(await sb.run(script))
    for name in (
        "setns",
        "bpf",
        "perf_event_open",
        "keyctl",
        "userfaultfd",
        "unshare_newuser",
        "unshare_newns",
    ):
        assert f"{name}=-1:1\n" in text, f"{name} not refused with EPERM:\n{text}"
    ppid = re.search(r"getppid=(-?\d+):", text)
    assert ppid is not None and int(ppid.group(1)) > 0, text  # control: allowed syscall ran


async def test_typing_into_a_terminal_is_refused(sb: Sandboxes) -> None:
    # TIOCSTI/TIOCLINUX push input into a terminal; tried on a fresh pty the sandbox owns, and
    # the harmless TIOCGWINSZ on the same fd is the control.
    script = f"""{PY} - <<'EOF'
import fcntl, os, pty, struct, termios
leader, follower = pty.openpty()
try:
    fcntl.ioctl(follower, termios.TIOCGWINSZ, bytes(8))
    print("winsz=ok")
except OSError as exc:
    print(f"winsz={{exc.errno}}")
for name, request in (("tiocsti", termios.TIOCSTI), ("tioclinux", 0x541C)):
    try:
        fcntl.ioctl(follower, request, b"x")
        print(f"{{name}}=ok")
    except OSError as exc:
        print(f"{{name}}={{exc.errno}}")
EOF"""
    text = output(await sb.run(script))
    assert "winsz=ok" in text, text
    assert "tiocsti=1\n" in text and "tioclinux=1\n" in text, text


# --- host processes --------------------------------------------------------------------------


async def test_host_processes_are_invisible_and_cannot_be_signalled(sb: Sandboxes) -> None:
    marker = unique("cc-host-proc")
    pattern = grep_pattern(marker)
    with host_process(["/bin/sh", "-c", f"sleep 600; : {marker}"]) as pid:
        is_host_proc = f"grep -q '{pattern}' /proc/{pid}/cmdline"
        assert await wait_until(lambda: host_pids_with(marker) == [pid])
        result = await sb.run(
            attempts(
                proc_entry=f"test -e /proc/{pid}/cmdline && {is_host_proc}",
                kill_0=f"kill -0 {pid} && {is_host_proc}",
                kill_term=f"kill -TERM {pid} && {is_host_proc}",
                scan=f"grep -qs '{pattern}' /proc/[0-9]*/cmdline",
                self_visible="test -e /proc/self/cmdline && kill -0 $$",
            )
            + '\necho "pids=$(ls -d /proc/[0-9]* | wc -l)"'
        )
        verdicts = outcomes(result)
        assert verdicts.pop("self_visible") == "ok", verdicts
        assert verdicts == dict.fromkeys(verdicts, "fail"), verdicts
        count = int(output(result).split("pids=")[1].split()[0])
        assert count < 10, f"the sandbox sees {count} processes; a fresh PID namespace sees a few"
        # The host process is untouched.
        os.kill(pid, 0)
        assert host_pids_with(marker) == [pid]


async def test_host_process_environment_is_unreadable(sb: Sandboxes) -> None:
    marker = unique("cc-host-env")
    inner = unique("cc-inner-env")
    with host_process(["/bin/sleep", "600"], env={"CC_SECRET_TOKEN": marker}) as pid:
        assert await wait_until(lambda: host_pids_with(marker) == [pid])
        result = await sb.sh(
            sb.launch(),
            f"""
            cat /proc/{pid}/environ
            for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < "$f"; done
            env
            """,
            env={"CC_INNER_MARK": inner},
        )
    text = output(result)
    assert inner in text, f"control: the sandbox's own environment was not readable:\n{text}"
    assert marker not in text, text
    assert "CC_SECRET_TOKEN" not in text, text


async def test_the_server_environment_does_not_leak_in(sb: Sandboxes) -> None:
    # The runner passes exactly the plan's environment; the test process's own variables (PATH
    # under /root/.pyenv, PYTEST_CURRENT_TEST, ...) must not appear.
    assert "PYTEST_CURRENT_TEST" in os.environ
    result = await sb.run("env; echo env-done")
    text = output(result)
    assert "env-done" in text and f"HOME={sb.home}" in text, text
    assert "PYTEST_CURRENT_TEST" not in text and "pyenv" not in text, text


# --- orphans ---------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["setsid", "nohup", "double-fork"])
async def test_orphaned_background_process_dies_with_the_command(
    sb: Sandboxes, launcher: str
) -> None:
    marker = unique(f"cc-orphan-{launcher}")
    pattern = grep_pattern(marker)
    body = "'sleep 300; : '\"$m\""  # the marker reaches the child's argv, not the script's
    start = {
        "setsid": f"setsid /bin/sh -c {body} </dev/null >/dev/null 2>&1 &",
        "nohup": f"nohup /bin/sh -c {body} </dev/null >/dev/null 2>&1 &",
        "double-fork": f"( ( /bin/sh -c {body} </dev/null >/dev/null 2>&1 & ) & )",
    }[launcher]
    result = await sb.run(
        f"""
        m={shell_word(marker)}
        {start}
        for i in 1 2 3 4 5 6 7 8 9 10; do
            grep -qs '{pattern}' /proc/[0-9]*/cmdline && break; sleep 0.1
        done
        grep -qs '{pattern}' /proc/[0-9]*/cmdline && echo orphan-running
        """
    )
    assert "orphan-running" in output(result), output(result)  # control: it really started
    assert result.exit_code == 0
    assert await wait_until(lambda: not host_pids_with(marker)), host_pids_with(marker)


async def test_destroy_kills_a_running_command_and_its_children(sb: Sandboxes) -> None:
    marker = unique("cc-destroy")
    handle = sb.launch()
    script = f"m={shell_word(marker)}; setsid /bin/sh -c 'sleep 300; : '\"$m\" & sleep 300"
    async with handle.open_exec(["/bin/sh", "-c", script]) as execution:
        # Control: the host (the parent PID namespace) sees the sandboxed child.
        assert await wait_until(lambda: len(host_pids_with(marker)) == 1, timeout_s=5.0), (
            host_pids_with(marker)
        )
        await sb.manager.destroy(handle.session_id)
        code = await asyncio.wait_for(execution.wait(), timeout=5.0)
    assert code != 0
    assert await wait_until(lambda: not host_pids_with(marker)), host_pids_with(marker)


SERVER = """
import asyncio, os, sys
from cc_server.backends.probe import probe
from cc_server.policy import HostFacts, parse_spec
from cc_server.runtime.port import SandboxManager
from cc_server.runtime.handle import run_collect

async def main():
    home, wt, script = sys.argv[1:4]
    host = HostFacts.current()
    host = HostFacts(platform=host.platform, home=home, realpath=os.path.realpath,
                     exists=os.path.lexists, is_dir=os.path.isdir)
    mgr = SandboxManager(probe_result=probe(), host=host)
    spec = {"sessionId": "crash", "workspaceId": "w", "bindMounts": [{"hostPath": wt}]}
    handle = mgr.launch(parse_spec(spec))
    print("launching", flush=True)
    await run_collect(handle, ["/bin/sh", "-c", script], timeout_s=600)

asyncio.run(main())
"""


async def test_sandbox_dies_with_a_crashed_server(sb: Sandboxes) -> None:
    # --die-with-parent: a server killed with SIGKILL (no aclose, no destroy) must not leave the
    # sandboxed command, or a process it detached, running on the host.
    marker = unique("cc-crash")
    script = (
        f"m={shell_word(marker)}; setsid /bin/sh -c 'sleep 300; : '\"$m\" </dev/null "
        ">/dev/null 2>&1 & sleep 300"
    )
    server = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SERVER,
        str(sb.home),
        str(sb.worktree),
        script,
        stdout=asyncio.subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin"},
    )
    try:
        assert server.stdout is not None
        assert await asyncio.wait_for(server.stdout.readline(), 10) == b"launching\n"
        # Control: the detached child is really running, seen from the host.
        assert await wait_until(lambda: len(host_pids_with(marker)) == 1, timeout_s=5.0)
    finally:
        server.kill()
        await server.wait()
    assert await wait_until(lambda: not host_pids_with(marker)), host_pids_with(marker)


async def test_timeout_kills_the_whole_sandbox(sb: Sandboxes) -> None:
    from cc_server.runtime.handle import run_collect

    marker = unique("cc-timeout")
    handle = sb.launch()
    result = await run_collect(
        handle,
        [
            "/bin/sh",
            "-c",
            f"m={shell_word(marker)}; (setsid /bin/sh -c 'sleep 300; : '\"$m\" &); sleep 300",
        ],
        timeout_s=1.0,
    )
    assert result.killed == "timeout"
    assert await wait_until(lambda: not host_pids_with(marker)), host_pids_with(marker)


# --- network ---------------------------------------------------------------------------------


CONNECT = f"""{PY} - "$@" <<'EOF'
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
family = socket.AF_INET6 if ":" in host else socket.AF_INET
try:
    socket.create_connection((host, port), timeout=2).close()
    print("connected")
except OSError as exc:
    print(f"refused: {{exc!r}}")
EOF"""


@contextlib.contextmanager
def host_listener(host: str = "127.0.0.1") -> Iterator[tuple[socket.socket, int]]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.bind((host, 0))
        server.listen(8)
        server.setblocking(False)
        yield server, server.getsockname()[1]


def _accepted(server: socket.socket) -> bool:
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


async def test_no_route_out_of_the_network_namespace(sb: Sandboxes) -> None:
    result = await sb.run(f"set -- 1.1.1.1 80\n{CONNECT}\ncat /proc/net/dev")
    text = output(result)
    assert "refused:" in text and "connected" not in text, text
    assert "Network is unreachable" in text or "Errno 101" in text, text
    # /proc/net/dev inside: the namespace's own loopback and nothing else.
    interfaces = re.findall(r"(?m)^\s*(\S+):\s+\d", text)
    assert interfaces == ["lo"], text


@pytest.mark.parametrize("address", ["127.0.0.1", "::1"])
async def test_host_loopback_listener_is_unreachable(sb: Sandboxes, address: str) -> None:
    if address == "::1" and not socket.has_ipv6:
        pytest.fail("this host has no IPv6 loopback; run the suite on a host with one")
    with host_listener(address) as (server, port):
        # Control on the host: the listener accepts a connection from the host itself.
        with socket.create_connection((address, port), timeout=2):
            pass
        assert await wait_until(lambda: _accepted(server), timeout_s=2.0)
        result = await sb.run(
            f"""
            set -- {address} {port}
            {CONNECT}
            {PY} - <<'EOF'
import socket
family = socket.AF_INET6 if ":" in "{address}" else socket.AF_INET
with socket.socket(family) as s:
    s.bind(("{address}", 0)); s.listen(1)
    socket.create_connection(s.getsockname()[:2], timeout=2).close()
    print("own-loopback-ok")
EOF
            """
        )
        text = output(result)
        assert "own-loopback-ok" in text, text  # control: sockets work inside the sandbox
        assert "refused:" in text and "connected" not in text.replace("own-", ""), text
        assert not _accepted(server), "the host listener accepted a connection from the sandbox"


async def test_host_abstract_unix_socket_is_unreachable(sb: Sandboxes) -> None:
    name = unique("cc-abstract")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind("\0" + name)
        server.listen(1)
        server.setblocking(False)
        result = await sb.run(
            f"""{PY} - <<'EOF'
import socket
for target in ("\\0{name}", "\\0{name}-own"):
    if target.endswith("-own"):
        own = socket.socket(socket.AF_UNIX); own.bind(target); own.listen(1)
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(target)
        print("connected", target.endswith("-own"))
    except OSError as exc:
        print("refused", repr(exc))
EOF"""
        )
        text = output(result)
        assert "connected True" in text, text  # control: abstract sockets work inside
        assert "refused" in text and "connected False" not in text, text
        assert not _accepted(server)
