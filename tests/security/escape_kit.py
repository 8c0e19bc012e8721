"""Helpers for the escape tests: the Sandboxes harness, markers, and host-side process checks."""

from __future__ import annotations

import asyncio
import os
import pathlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cc_server.policy import parse_spec
from cc_server.runtime.handle import CollectedResult, SandboxHandle, run_collect
from cc_server.runtime.port import SandboxManager

RUN_TIMEOUT_S = 20.0  # one sandboxed command; they all finish in well under a second
HOST_POLL_S = 2.0  # how long the host waits for a sandboxed process to disappear


def unique(prefix: str) -> str:
    """A marker no other file or process on this host contains."""
    return f"{prefix}-{secrets.token_hex(8)}"


@dataclass
class Sandboxes:
    """A fake home, a worktree, and a manager that launches sandboxes against them."""

    root: pathlib.Path
    home: pathlib.Path
    worktree: pathlib.Path
    secret_marker: str
    manager: SandboxManager
    _count: int = 0

    @property
    def ssh_key(self) -> pathlib.Path:
        return self.home / ".ssh" / "id_ed25519"

    def spec(self, **fields: Any) -> dict[str, Any]:
        """Spec JSON: the worktree bound writable, chat mode, plus `fields` (camelCase)."""
        self._count += 1
        data: dict[str, Any] = {
            "sessionId": f"sec-{self._count}",
            "workspaceId": "w",
            "bindMounts": [{"hostPath": str(self.worktree)}],
            "mode": "chat",
        }
        data.update(fields)
        return data

    def launch(self, **fields: Any) -> SandboxHandle:
        return self.manager.launch(parse_spec(self.spec(**fields)))

    async def sh(self, handle: SandboxHandle, script: str, **kwargs: Any) -> CollectedResult:
        """Run a /bin/sh script in the sandbox; stderr is folded into the result as usual."""
        kwargs.setdefault("timeout_s", RUN_TIMEOUT_S)
        result = await run_collect(handle, ["/bin/sh", "-c", script], **kwargs)
        assert result.killed is None, f"command was killed ({result.killed}): {result!r}"
        return result

    async def run(self, script: str, **fields: Any) -> CollectedResult:
        """Launch a sandbox for `fields` and run `script` once in it."""
        return await self.sh(self.launch(**fields), script)


def host_pids_with(marker: str) -> list[int]:
    """Host processes whose argv or environment contains `marker` (this process excluded)."""
    found = []
    needle = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        for name in ("cmdline", "environ"):
            try:
                with open(f"/proc/{entry}/{name}", "rb") as f:
                    if needle in f.read():
                        found.append(int(entry))
                        break
            except OSError:
                continue
    return found


async def wait_until(predicate: Callable[[], bool], timeout_s: float = HOST_POLL_S) -> bool:
    """Poll `predicate` until it holds or `timeout_s` passes; the last answer wins."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return predicate()
        await asyncio.sleep(0.05)
    return True


async def the_one_pid_with(marker: str, timeout_s: float = HOST_POLL_S) -> int:
    """The host process whose argv holds `marker`, from one look that finds it alone (a shell's
    child has the shell's argv too, between its fork and its exec)."""
    seen: list[int] = []

    def alone() -> bool:
        seen[:] = host_pids_with(marker)
        return len(seen) == 1

    assert await wait_until(alone, timeout_s), seen
    return seen[0]


def attempts(**commands: str) -> str:
    """A script that runs each command in a subshell and prints `name=ok` or `name=fail`.

    The commands' own output is discarded, so a test can read the outcomes with `outcomes()`.
    """
    lines = [
        f"if ( {command} ) >/dev/null 2>&1; then echo '{name}=ok'; else echo '{name}=fail'; fi"
        for name, command in commands.items()
    ]
    return "\n".join(lines)


def outcomes(result: CollectedResult) -> dict[str, str]:
    """The `name=ok|fail` lines an `attempts()` script printed."""
    found: dict[str, str] = {}
    for line in result.stdout.decode(errors="replace").splitlines():
        name, sep, verdict = line.partition("=")
        if sep and verdict in ("ok", "fail"):
            found[name] = verdict
    return found


def output(result: CollectedResult) -> str:
    """stdout and stderr together, for 'the secret appears nowhere' checks and failure messages."""
    return (result.stdout + result.stderr).decode(errors="replace")


def shell_word(marker: str) -> str:
    """`marker` as a shell word whose source text does not contain it ('abc''def').

    A script that greps /proc/*/cmdline for a marker would otherwise find its own argv.
    """
    half = len(marker) // 2
    return f"'{marker[:half]}''{marker[half:]}'"


def grep_pattern(marker: str) -> str:
    """A grep regex matching `marker` whose own text does not ('ab[c]d', the `ps | grep` trick).

    Otherwise `grep MARKER /proc/*/cmdline` finds the grep process itself.
    """
    half = len(marker) // 2
    return f"{marker[:half]}[{marker[half]}]{marker[half + 1 :]}"


# What an attacker inside a sandbox sends the daemon: stdlib only, run by the system Python.
DAEMON_ATTACK = """
import json, os, socket, struct, sys
path, marker = sys.argv[1], sys.argv[2]
print("visible", os.path.exists(path))
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(path)
except OSError as exc:
    print("connect-failed", exc.errno)
    sys.exit(0)
request = {"argv": ["run", "--backend", "none", "--", "/usr/bin/touch", marker],
           "cwd": "/", "env": {}}
data = json.dumps(request).encode()
fd = os.open("/dev/null", os.O_RDWR)
socket.send_fds(s, [struct.pack("!I", len(data)) + data], [fd, fd, fd])
s.settimeout(30)
try:
    print("reply", s.recv(4096))
except OSError as exc:
    print("recv-failed", exc)
"""


def daemon_attack_script(where: pathlib.Path) -> pathlib.Path:
    """The attack on a CLI daemon's socket (`DAEMON_ATTACK`: python3 SCRIPT SOCKET MARKER asks
    it to `run --backend none -- touch MARKER`), written to `where`."""
    script = where / "attack.py"
    script.write_text(DAEMON_ATTACK)
    script.chmod(0o755)
    return script


# A Python attack body run inside a sandbox: `python3 - WORKTREE BODY_FILE` chdirs to WORKTREE,
# runs BODY_FILE with `os`, `libc` (errno kept) and `fail()` (raise with libc's errno) at hand, and
# prints `RESULT=done` or `RESULT=refused <the OSError>`.
ATTACK_RUNNER = """import os, sys, ctypes
os.chdir(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
def fail():
    raise OSError(ctypes.get_errno(), 'refused')
try:
    exec(open(sys.argv[2]).read())
    print('RESULT=done')
except OSError as exc:
    print('RESULT=refused', exc)
"""


async def run_attack(
    sb: Sandboxes, tmp_path: pathlib.Path, body: str, *, binds: list[dict[str, Any]] | None = None
) -> tuple[SandboxHandle, str]:
    """Run the Python attack `body` (see ATTACK_RUNNER) in the worktree of a sandbox that binds
    it and the attack kit (read-only) and `binds`; the handle (for its violations) and output."""
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "run.py").write_text(ATTACK_RUNNER)
    (kit / "attack.py").write_text(body + "\n")
    wt = sb.worktree
    handle = sb.launch(bindMounts=[
        {"hostPath": str(wt)}, {"hostPath": str(kit), "readOnly": True}, *(binds or []),
    ])  # fmt: skip
    result = await sb.sh(handle, f"/usr/bin/python3 {kit}/run.py {wt} {kit}/attack.py 2>&1")
    return handle, output(result)
