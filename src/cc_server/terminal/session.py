"""One terminal session: a shell on its own PTY, planned by a SandboxHandle, spawned by the runner.

The session owns the PTY master, the shell and everything the shell starts. `aclose()` kills all
of it (the shell's whole session and its descendants; on `native` the sandbox's PID namespace goes
with bwrap), closes the master and destroys the handle. Idempotent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
from typing import Final

from cc_server.backends.plan import Command
from cc_server.backends.runner import PtyProcess, set_window_size, start_pty
from cc_server.errors import BadSpec
from cc_server.policy import SandboxBackend
from cc_server.runtime.handle import SandboxHandle

__all__ = [
    "MAX_WINDOW",
    "HandleSession",
    "TerminalSession",
    "check_window",
    "open_terminal_session",
]

READ_CHUNK_BYTES: Final = 64 * 1024  # one read from the PTY master
# Output held for a client that reads slowly; past this the PTY is not read, so the shell blocks
# on its writes (backpressure) instead of the server buffering without bound.
OUTPUT_BUFFER_BYTES: Final = 256 * 1024
MAX_WINDOW: Final = 10_000  # rows or columns; the kernel stores them as unsigned 16-bit
EXIT_WAIT_S: Final = 5.0  # after SIGKILL, how long the shell may take to be reaped
KILL_ROUNDS: Final = 5  # rescans for processes forked while the previous round was killing


def check_window(rows: int, cols: int) -> None:
    """Raise BadSpec for a window size the kernel cannot hold."""
    if not (1 <= rows <= MAX_WINDOW and 1 <= cols <= MAX_WINDOW):
        raise BadSpec(f"window size {rows}x{cols} is outside 1..{MAX_WINDOW}")


class HandleSession:
    """What every terminal session tells of itself, from the handle it runs under (a host PTY
    here, a guest PTY in cc_server.terminal.vm_session)."""

    handle: SandboxHandle

    @property
    def session_id(self) -> str:
        """The session's id (the handle's)."""
        return self.handle.session_id

    @property
    def backend(self) -> SandboxBackend:
        """The backend actually running the shell: the badge a client may show."""
        return self.handle.backend

    def to_json(self) -> dict[str, object]:
        """What a client is told when the session opens."""
        return {
            "sessionId": self.session_id,
            "backend": str(self.backend),
            "cwd": self.handle.policy.workdir,
        }


class TerminalSession(HandleSession):
    """A shell on a PTY. Read output with `read()`, send input with `write()`, resize, close."""

    def __init__(
        self, *, handle: SandboxHandle, pty: PtyProcess, env_marker: str | None = None
    ) -> None:
        self.handle = handle
        self._pty = pty
        self._env_marker = None if env_marker is None else env_marker.encode()
        self._loop = asyncio.get_running_loop()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._eof = False
        self._reading = False
        self._data_ready = asyncio.Event()
        self._write_lock = asyncio.Lock()
        self._closed = False
        self._resume_reading()

    @property
    def pid(self) -> int:
        """The host pid of the spawned program (the shell, or bwrap on `native`)."""
        return self._pty.process.pid

    # --- output ---------------------------------------------------------------------------------

    def _resume_reading(self) -> None:
        if not self._reading and not self._eof and not self._closed:
            self._loop.add_reader(self._pty.master_fd, self._on_readable)
            self._reading = True

    def _pause_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._pty.master_fd)
            self._reading = False

    def _on_readable(self) -> None:
        try:
            data = os.read(self._pty.master_fd, READ_CHUNK_BYTES)
        except BlockingIOError:
            return
        except OSError:  # EIO: every holder of the slave side has closed it
            data = b""
        if not data:
            self._eof = True
            self._pause_reading()
        else:
            self._chunks.append(data)
            self._buffered += len(data)
            if self._buffered >= OUTPUT_BUFFER_BYTES:
                self._pause_reading()
        self._data_ready.set()

    async def read(self) -> bytes:
        """The output produced since the last call, waiting for some; b"" once the PTY has no
        writer left or the session is closed."""
        while not self._chunks and not self._eof and not self._closed:
            self._data_ready.clear()
            await self._data_ready.wait()
        if not self._chunks:
            return b""
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._resume_reading()
        return data

    # --- input and window -----------------------------------------------------------------------

    async def write(self, data: bytes) -> None:
        """Type `data` into the terminal. Input after the session closed is dropped."""
        async with self._write_lock:
            view = memoryview(data)
            while view and not self._closed:
                try:
                    written = os.write(self._pty.master_fd, view)
                except BlockingIOError:
                    await self._writable()
                    continue
                except OSError:  # EIO: the shell side is gone
                    return
                view = view[written:]

    async def _writable(self) -> None:
        ready: asyncio.Future[None] = self._loop.create_future()

        def on_writable() -> None:
            if not ready.done():
                ready.set_result(None)

        self._loop.add_writer(self._pty.master_fd, on_writable)
        try:
            await ready
        finally:
            self._loop.remove_writer(self._pty.master_fd)

    def resize(self, rows: int, cols: int) -> None:
        """Set the window size; the shell's foreground job gets SIGWINCH.

        Raises:
            BadSpec: rows or cols outside 1..MAX_WINDOW.
        """
        check_window(rows, cols)
        if not self._closed:
            set_window_size(self._pty.master_fd, rows, cols)

    # --- lifetime -------------------------------------------------------------------------------

    async def wait(self) -> int:
        """Wait for the shell (or bwrap) to exit; its exit code, 128+N for signal N."""
        code = await self._pty.process.wait()
        return 128 - code if code < 0 else code

    async def aclose(self) -> None:
        """Kill the shell and everything it started, close the PTY, destroy the handle.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._data_ready.set()
        try:
            for _ in range(KILL_ROUNDS):
                # Once the leader is reaped its pid may be reused: then only its session (whose
                # id stays reserved while a member lives) is ours to kill, not "its" children.
                reaped = self._pty.process.returncode is not None
                if not _kill_session_tree(
                    self.pid, with_descendants=not reaped, env_marker=self._env_marker
                ):
                    break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(EXIT_WAIT_S):
                    await self._pty.process.wait()
        finally:
            self._pause_reading()
            with contextlib.suppress(OSError):
                os.close(self._pty.master_fd)
            self._pty.transport.close()
            await self.handle.destroy()


async def open_terminal_session(
    handle: SandboxHandle,
    *,
    argv: tuple[str, ...],
    env: dict[str, str],
    cwd: str,
    rows: int,
    cols: int,
    env_marker: str | None = None,
) -> TerminalSession:
    """Start `argv` on a new PTY under `handle`'s plan. `env_marker` (`NAME=value`, set in `env`)
    is how the session finds, at close, what left both its session and its process tree.

    Raises:
        BadSpec: the window size is out of range.
        CcServerError: the backend refused the plan or the shell could not start (nothing runs).
    """
    check_window(rows, cols)
    plan = handle.plan(Command(argv=argv, env=tuple(sorted(env.items())), cwd=cwd))
    pty = await start_pty(plan, rows, cols)
    return TerminalSession(handle=handle, pty=pty, env_marker=env_marker)


def _kill_session_tree(
    leader: int, *, with_descendants: bool, env_marker: bytes | None = None
) -> bool:
    """SIGKILL the process group and session led by `leader`, every descendant of it (if asked)
    and every process whose environment carries `env_marker`; return whether any process other
    than the leader was found.

    Jobs of an interactive shell get their own process groups, so the group alone is not enough;
    the session catches those, the parent links catch what called setsid, and the marker catches
    what then also double-forked away (`setsid cmd &`, a tmux server). On `native`, bwrap is the
    leader and its death takes the sandbox's PID namespace with it. On `none`, a process that
    leaves the session, the tree and its environment behind escapes: `none` is no sandbox.
    """
    members: set[int] = set()
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, ppid, sid in _proc_table():
        children[ppid].append(pid)
        if pid != leader and (sid == leader or _has_env(pid, env_marker)):
            members.add(pid)
    stack = [leader] if with_descendants else []
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in members:
                members.add(child)
                stack.append(child)
    # A group or session id stays reserved while any member lives, so these reach only ours.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGKILL)
    for pid in [leader, *members] if with_descendants else members:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return bool(members)


def _has_env(pid: int, marker: bytes | None) -> bool:
    if marker is None:
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:  # gone, or another user's
        return False


def _proc_table() -> list[tuple[int, int, int]]:
    """(pid, ppid, session id) of every live, non-zombie process in /proc; [] where there is
    no /proc."""
    table: list[tuple[int, int, int]] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name is in parentheses and may itself contain ')' or spaces.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) < 4 or fields[0] == b"Z":
            continue
        table.append((int(name), int(fields[1]), int(fields[3])))
    return table
