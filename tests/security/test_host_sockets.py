"""Host listeners stay out: a Unix socket a host process listens on inside a writable bind
cannot be connected to from the sandbox, by any spelling of its path (a symlink, a hard link,
/proc/self/cwd, /proc/self/root), from a stream, seqpacket or datagram socket, as root and as
an unprivileged user; the host's listener is checked afterwards and sees nothing. A socket
bound inside the sandbox, a socketpair, an abstract socket and TCP keep working, and so does a
bind whose host listeners were allowed (the credential broker's).

Cases taken from the peers' suites (their tests read, none of their code): Anthropic
sandbox-runtime `test/sandbox/unix-socket-allowlist.test.ts` (a socket outside the allowed
paths is refused; a symlink is resolved before matching; a relative path is the caller's; an
allowed path lets exactly its listener through; TCP is left alone) and
`test/sandbox/seccomp-filter.test.ts` (socketpair keeps working), Codex
`codex-rs/linux-sandbox/tests/suite/sandbox.rs` (no connection to a host Unix socket).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import shlex
import socket

import pytest
from escape_kit import Sandboxes, output, run_attack
from other_user import OtherUser
from write_kit import host_listener

pytestmark = [pytest.mark.security, pytest.mark.integration]


SPELLINGS: dict[str, str] = {
    "absolute": "c = socket.socket(socket.AF_UNIX); c.connect(os.getcwd() + '/host.sock')",
    "relative": "c = socket.socket(socket.AF_UNIX); c.connect('host.sock')",
    "symlink": (
        "os.symlink('host.sock', 'innocent')\n"
        "c = socket.socket(socket.AF_UNIX); c.connect('innocent')"
    ),
    "hard-link": (
        "os.link('host.sock', 'alias.sock')\n"
        "c = socket.socket(socket.AF_UNIX); c.connect('alias.sock')"
    ),
    "proc-self-cwd": (
        "c = socket.socket(socket.AF_UNIX); c.connect('/proc/self/cwd/host.sock')"
    ),
    "proc-self-root": (
        "c = socket.socket(socket.AF_UNIX)\n"
        "c.connect('/proc/self/root' + os.getcwd() + '/host.sock')"
    ),
    "seqpacket": (
        "c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); c.connect('host.sock')"
    ),
    "via-a-thread": (
        "import threading\nerr = []\n"
        "def go():\n"
        "    try:\n"
        "        socket.socket(socket.AF_UNIX).connect('host.sock')\n"
        "    except OSError as e:\n"
        "        err.append(e)\n"
        "t = threading.Thread(target=go); t.start(); t.join()\n"
        "if err: raise err[0]"
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SPELLINGS))
async def test_a_host_listener_in_a_bind_cannot_be_reached(
    sb: Sandboxes, tmp_path: pathlib.Path, name: str
) -> None:
    wt = sb.worktree
    kind = socket.SOCK_SEQPACKET if name == "seqpacket" else socket.SOCK_STREAM
    with host_listener(wt / "host.sock", kind) as host:
        handle, out = await run_attack(sb, tmp_path, "import socket\n" + SPELLINGS[name])
    assert "RESULT=refused [Errno 13]" in out, out
    assert host.contacts == 0, out
    refusals = [(v.action, v.target) for v in handle.violations]
    judged = "alias.sock" if name == "hard-link" else "host.sock"  # the name it was reached by
    assert refusals == [("network-outbound", f"{wt}/{judged}")], (refusals, out)


async def test_a_host_datagram_socket_cannot_be_connected_to(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    body = (
        "import socket\nc = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
        "c.connect('host.sock'); c.send(b'x')"
    )
    with host_listener(sb.worktree / "host.sock", socket.SOCK_DGRAM) as host:
        _handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=refused [Errno 13]" in out, out
    assert host.contacts == 0, out


async def test_sockets_of_the_sandbox_itself_keep_working(sb: Sandboxes) -> None:
    # A listener bound inside (in the worktree too), a socketpair, an abstract socket, TCP on
    # loopback, a blocking and a non-blocking connect.
    wt = sb.worktree
    handle = sb.launch()
    script = (
        "import socket, os\n"
        f"os.chdir({str(wt)!r})\n"
        "for path in ('/tmp/in.sock', 'in.sock'):\n"
        "    s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen()\n"
        "    c = socket.socket(socket.AF_UNIX); c.connect(path); a, _ = s.accept()\n"
        "    c.sendall(b'ping'); assert a.recv(4) == b'ping'\n"
        "x, y = socket.socketpair(); x.sendall(b'p'); assert y.recv(1) == b'p'\n"
        "s = socket.socket(socket.AF_UNIX); s.bind('\\0cc-abstract'); s.listen()\n"
        "socket.socket(socket.AF_UNIX).connect('\\0cc-abstract')\n"
        "t = socket.socket(); t.bind(('127.0.0.1', 0)); t.listen()\n"
        "socket.create_connection(t.getsockname()).close()\n"
        "n = socket.socket(); n.setblocking(False)\n"
        "try:\n"
        "    n.connect(t.getsockname())\n"
        "except BlockingIOError:\n"
        "    pass\n"
        "print('all ok')\n"
    )
    result = await sb.sh(handle, f"/usr/bin/python3 -c {shlex.quote(script)}")
    out = output(result)
    assert result.exit_code == 0 and "all ok" in out, out
    assert handle.violations == [], handle.violations


async def test_a_bind_that_allows_host_listeners_lets_them_be_reached(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    body = f"import socket\nsocket.socket(socket.AF_UNIX).connect({str(allowed)!r} + '/b.sock')"
    with host_listener(allowed / "b.sock") as host:
        handle, out = await run_attack(
            sb,
            tmp_path,
            body,
            binds=[{"hostPath": str(allowed), "readOnly": True, "hostSockets": True}],
        )
        for _ in range(50):
            if host.contacts:
                break
            await asyncio.sleep(0.02)
    assert "RESULT=done" in out, out
    assert host.contacts == 1, out
    assert handle.violations == [], handle.violations


async def test_a_killed_connector_refuses_connects_and_never_hangs(sb: Sandboxes) -> None:
    # Everything inside is killed (the connector too): a connect then fails, it does not wait.
    handle = sb.launch()
    script = (
        "kill -9 -1 2>/dev/null; sleep 0.2; "
        '/usr/bin/python3 -c "import socket\n'
        "s = socket.socket(socket.AF_UNIX); s.bind('/tmp/x.sock'); s.listen()\n"
        "try:\n"
        "    socket.socket(socket.AF_UNIX).connect('/tmp/x.sock'); print('connected')\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\""
    )
    result = await sb.sh(handle, script, timeout_s=30)
    out = output(result)
    # An answer within the timeout, and the one a dead connector gives: ECONNREFUSED, never a
    # connection made some other way.
    assert "refused 111" in out and "connected" not in out, out


def test_as_an_unprivileged_user_a_host_listener_stays_out(
    other_user: OtherUser, user_dir: pathlib.Path
) -> None:
    with host_listener(user_dir / "host.sock") as host:
        os.chown(user_dir / "host.sock", other_user.uid, other_user.gid)
        done = other_user.run(
            ["/usr/bin/python3", "-m", "cc_server.cli", "run", "--bind", str(user_dir),
             "--workdir", str(user_dir), "--", "/usr/bin/python3", "-c",
             "import socket\ntry:\n    socket.socket(socket.AF_UNIX).connect('host.sock')\n"
             "    print('CONNECTED')\nexcept OSError as e:\n    print('refused', e.errno)"],
            cwd=user_dir, env={"CC_SERVER_DAEMON": "off"},
        )  # fmt: skip
    assert "refused 13" in done.stdout, (done.stdout, done.stderr)
    assert host.contacts == 0
    assert "network-outbound" in done.stderr, done.stderr
