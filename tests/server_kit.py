"""Start the real `cc-server serve` process and talk to it, for the server tests and the bench.

The server always runs as `python -m cc_server.cli serve --port 0 --log-json`, with an explicit
environment (never the test process's own): PATH, a throw-away $HOME and a short private
XDG_RUNTIME_DIR (egress socket paths must stay under the 108-byte Unix socket limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

BOOT_TIMEOUT_S = 30.0  # the probe's bwrap selftest plus interpreter start; normally < 1 s
STOP_TIMEOUT_S = 30.0  # SIGTERM to exit, including the server's own 5 s grace period


@dataclass
class Server:
    """A running server process and what its startup lines said."""

    proc: subprocess.Popen[bytes]
    log_path: pathlib.Path
    runtime_dir: pathlib.Path
    home: pathlib.Path
    port: int = 0
    token: str = ""
    token_path: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def client(self, **kwargs: Any) -> aiohttp.ClientSession:
        """A client session that sends the token."""
        return aiohttp.ClientSession(self.url, headers=self.auth, **kwargs)

    def log(self) -> list[dict[str, Any]]:
        """Every JSON log line so far."""
        return read_events(self.log_path)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the server and wait for it; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not stop on {sig!r}:\n{self.log_text()}") from None


def read_events(path: pathlib.Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict):
                out.append(event)
    return out


def short_runtime_dir() -> pathlib.Path:
    """A private directory with a short path, for XDG_RUNTIME_DIR."""
    return pathlib.Path(tempfile.mkdtemp(prefix="ccs-", dir="/tmp"))


def server_env(home: pathlib.Path, runtime_dir: pathlib.Path,
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "XDG_RUNTIME_DIR": str(runtime_dir), "LANG": "C.UTF-8"}
    env.update(extra or {})
    return env


def serve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "cc_server.cli", "serve", "--port", "0", "--log-json", *args]


def start_server(
    workdir: pathlib.Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    runtime_dir: pathlib.Path | None = None,
    home: pathlib.Path | None = None,
) -> Server:
    """Start a server and wait for its `listening` line. `env` entries are added to (or, when
    PATH, replace) the defaults."""
    home = home or workdir / "home"
    home.mkdir(parents=True, exist_ok=True)
    runtime_dir = runtime_dir or short_runtime_dir()
    log_path = workdir / f"server-{secrets.token_hex(4)}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            serve_argv(*args), env=server_env(home, runtime_dir, env), cwd=str(workdir),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
    server = Server(proc=proc, log_path=log_path, runtime_dir=runtime_dir, home=home)
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while time.monotonic() < deadline:
        events = server.log()
        listening = [e for e in events if e.get("event") == "listening"]
        if listening:
            server.events = events
            server.port = int(listening[0]["port"])
            token_event = next(e for e in events if e.get("event") == "token")
            server.token_path = token_event["path"]
            server.token = pathlib.Path(server.token_path).read_text().strip()
            return server
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}:\n{server.log_text()}")
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise AssertionError(f"server did not start in {BOOT_TIMEOUT_S} s:\n{server.log_text()}")


@contextlib.contextmanager
def running_server(workdir: pathlib.Path, *args: str, **kwargs: Any) -> Iterator[Server]:
    """A server for the duration of the block; stopped with SIGTERM, then its runtime dir
    removed."""
    server = start_server(workdir, *args, **kwargs)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()
        if "runtime_dir" not in kwargs:
            shutil.rmtree(server.runtime_dir, ignore_errors=True)


def run_serve_to_exit(workdir: pathlib.Path, *args: str, env: Mapping[str, str] | None = None,
                      timeout_s: float = BOOT_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run `serve` expecting it to refuse to start; its exit code and output."""
    home = workdir / "home"
    home.mkdir(parents=True, exist_ok=True)
    runtime_dir = short_runtime_dir()
    try:
        return subprocess.run(
            serve_argv(*args), env=server_env(home, runtime_dir, env), cwd=str(workdir),
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s,
            check=False,
        )
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


def path_without(tmp: pathlib.Path, hidden: Sequence[str]) -> str:
    """A PATH of one directory holding symlinks to the current PATH's socat, sh, ... except the
    `hidden` tools: the probe then finds no bwrap, as on a host without it."""
    bindir = tmp / "bin-restricted"
    bindir.mkdir(exist_ok=True)
    for tool in ("socat", "sh", "bash", "env", "cat", "sleep", "stty", "curl", "hostname", "git"):
        found = shutil.which(tool)
        if found and tool not in hidden and not (bindir / tool).exists():
            (bindir / tool).symlink_to(found)
    return str(bindir)


def host_pids_with(marker: str) -> list[int]:
    """Live (non-zombie) host processes whose argv contains `marker`, this process excluded."""
    needle = marker.encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        state = stat[stat.rfind(b")") + 2 :].split()[:1]
        if needle in cmdline and state != [b"Z"]:
            found.append(int(name))
    return found


def wait_until_gone(marker: str, timeout_s: float) -> list[int]:
    """Poll until no host process carries `marker`; what is left at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = host_pids_with(marker)
        if not left:
            return []
        time.sleep(0.05)
    return host_pids_with(marker)


def kill_marked(marker: str) -> None:
    """Test hygiene: kill whatever still carries `marker`."""
    for pid in host_pids_with(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def frame_until(
    ws: aiohttp.ClientWebSocketResponse, kind: str, command_id: str | None = None,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """The next text frame of type `kind` (and of `command_id`, given one) from a session or exec
    WebSocket; the frames before it are dropped."""
    async with asyncio.timeout(timeout_s):
        while True:
            msg = await ws.receive()
            assert msg.type is aiohttp.WSMsgType.TEXT, msg
            frame: dict[str, Any] = msg.json()
            if frame["type"] == kind and (command_id is None or frame.get("id") == command_id):
                return frame


async def new_sandbox(server: Server, bind: pathlib.Path, session_id: str | None = None) -> str:
    """Create a sandbox binding `bind` (its id `session_id`, or a fresh one); its id."""
    session_id = session_id or f"sb-{secrets.token_hex(6)}"
    spec = {"sessionId": session_id, "workspaceId": "w", "bindMounts": [{"hostPath": str(bind)}]}
    async with server.client() as http, http.post("/v1/sandboxes", json={"spec": spec}) as answer:
        assert answer.status == 201, await answer.text()
    return session_id


async def drop_sandbox(server: Server, session_id: str) -> None:
    """Destroy the sandbox `session_id` (idempotent)."""
    async with server.client() as http, http.delete(f"/v1/sandboxes/{session_id}"):
        pass


def rss_bytes(pid: int) -> int:
    """The resident memory of process `pid` now (VmRSS), in bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")
