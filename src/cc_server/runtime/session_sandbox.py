"""Session sandboxes: one bubblewrap sandbox per session, whose PID 1 (the launcher, run with
`--serve`) starts each command on request, instead of one bwrap per command.

The request socket is a SOCK_SEQPACKET socketpair; each message is one request or reply
(`native/launcher.c`, "serve"). Integers are little-endian u32.

- `X` run: tag, 3 pad bytes, id, argc, envc, then NUL-terminated cwd, argv words and
  `KEY=VALUE` words, with three descriptors attached (the command's stdin, stdout, stderr).
- `S` signal: tag, 3 pad bytes, id, signal number: sent to the command's process group.
- `P` started (launcher to server): tag, 3 pad bytes, id, the pid (in the sandbox) of the
  command's keeper, sent before the command starts. With create-time globs, the supervisor's
  refusals name the keeper the refused process runs under: that tells the command.
- `D` done (launcher to server): tag, 3 pad bytes, id, exit code (128+N for signal N), sent
  once the command has exited and its keeper has killed everything it left behind. With
  `KEEPER_KILLED` added, the keeper itself was killed (from inside: the commands share a uid)
  before it could clean up, so what the command left may still run: the sandbox is then not
  reused, and closed once its last command has ended.

The launcher is inside the sandbox, so what it sends is untrusted: a reply that is not a
well-formed `D` for a running id is ignored. If the sandbox ends (the launcher or bwrap died, or
it was closed), every command still running in it ends with 137, as if killed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import signal
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Final

from cc_server.backends.child_watch import wait_exited
from cc_server.backends.fdpass import wait_writable
from cc_server.backends.handoff import Launched, launch
from cc_server.backends.identity import STAGE_DIR
from cc_server.backends.mount_view import bound_as_on_host
from cc_server.backends.peer import SandboxPeers
from cc_server.backends.plan import LaunchPlan, PathFd, SandboxIdentity, SessionCommand
from cc_server.backends.supervisor import (
    CreateRefused,
    CreateRuleSupervisor,
    Report,
    stop_supervisor,
)
from cc_server.errors import EnforcementFailed
from cc_server.runtime.child import KILL_GRACE_S, Emit
from cc_server.runtime.command_pipes import CommandPipes
from cc_server.runtime.egress_port import Adopted, EgressPort
from cc_server.runtime.events import EventType

__all__ = ["MAX_REQUEST_BYTES", "SessionProcess", "SessionSandbox", "encode_request"]

MAX_REQUEST_BYTES: Final = 128 * 1024  # native/launcher.c SERVE_MAX_REQUEST
MAX_WORDS: Final = 16384  # native/launcher.c SERVE_MAX_WORDS: argv and env words together
STDERR_TAIL_BYTES: Final = 4096  # what bwrap and the launcher said, kept for errors and logs
KILLED_CODE: Final = 128 + signal.SIGKILL
KEEPER_KILLED: Final = 0x100  # native/launcher.c KEEPER_KILLED
_HEADER: Final = struct.Struct("<c3xIII")
_REPLY: Final = struct.Struct("<c3xII")
_SIGNAL: Final = struct.Struct("<c3xII")
_OUTPUTS: Final = {1: EventType.STDOUT, 2: EventType.STDERR}
log = logging.getLogger("cc_server.runtime")


def encode_request(request_id: int, command: SessionCommand) -> bytes | None:
    """The `X` message for `command`, or None when it does not fit one request (the caller then
    runs it in a sandbox of its own)."""
    if len(command.argv) + len(command.env) > MAX_WORDS:
        return None
    words = _words((command.cwd, *command.argv))
    env = _env_words(command.env)
    if words is None or env is None:
        return None
    message = _HEADER.pack(b"X", request_id, len(command.argv), len(command.env)) + words + env
    return message if len(message) <= MAX_REQUEST_BYTES else None


def _words(words: Sequence[str]) -> bytes | None:
    """Each word NUL-terminated, or None when one holds a NUL or cannot be encoded (not a word
    exec could take either: the usual path says so)."""
    if any("\0" in w for w in words):
        return None
    try:
        return b"".join(os.fsencode(w) + b"\0" for w in words)
    except UnicodeEncodeError:
        return None


@functools.lru_cache(maxsize=64)
def _env_words(env: tuple[tuple[str, str], ...]) -> bytes | None:
    """`KEY=VALUE` words of `env` (`_words`), kept: a session's commands mostly share theirs."""
    return _words([f"{k}={v}" for k, v in env])


class SessionProcess:
    """One command running in a session sandbox: the Child (runtime/child.py) an Execution of
    the session's sandbox is composed over, its pipes plain descriptors (runtime/command_pipes)."""

    def __init__(
        self,
        sandbox: SessionSandbox,
        request_id: int,
        on_report: Callable[[Report], None] | None = None,
    ) -> None:
        self._sandbox = sandbox
        self.request_id = request_id
        self.on_report = on_report  # the create-rule supervisor's refusals of this command
        self.returncode: int | None = None
        self._done = asyncio.get_running_loop().create_future()
        self.pipes = CommandPipes()

    @property
    def sandbox(self) -> SessionSandbox:
        """The session sandbox the command runs in."""
        return self._sandbox

    def _finish(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._done.set_result(None)

    async def exited(self) -> int:
        """Wait until the command (and everything it left) has ended; its exit code."""
        await asyncio.shield(self._done)
        assert self.returncode is not None
        return self.returncode

    def signal(self, signum: int) -> None:
        """Signal the command's process group; after SIGKILL its keeper kills the rest."""
        if self.returncode is None:
            self._sandbox._signal(self.request_id, signum)

    async def kill(self) -> None:
        """SIGKILL the command. Its end is reported from inside: if the launcher does not
        answer within KILL_GRACE_S, the whole sandbox is closed (and not reused), which ends
        the command too (137)."""
        self.signal(signal.SIGKILL)
        try:
            async with asyncio.timeout(KILL_GRACE_S):
                await self.exited()
        except TimeoutError:
            self._sandbox.retire()
            await self._sandbox.aclose()
            await self.exited()

    async def pump(self, emit: Emit) -> None:
        """See Child.pump."""
        await self.pipes.pump(emit)

    async def feed(self, data: bytes) -> None:
        """See Child.feed."""
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if data:
                await self.pipes.write(data)
        self.pipes.close_stdin()

    async def write_stdin(self, data: bytes) -> None:
        """See Child.write_stdin."""
        await self.pipes.write(data)

    def close_stdin(self) -> None:
        """See Child.close_stdin."""
        self.pipes.close_stdin()

    async def close(self) -> None:
        """Close our ends of the command's pipes."""
        self.close_pipes()

    def close_pipes(self) -> None:
        """Close our ends of the command's pipes (at once)."""
        self.pipes.close()


class SessionSandbox:
    """A running session sandbox. Built by `start`; `run` starts one command in it."""

    def __init__(
        self,
        plan: LaunchPlan,
        proc: asyncio.subprocess.Process,
        transport: asyncio.SubprocessTransport,
        requests: socket.socket,
    ) -> None:
        self.plan = plan
        self._proc = proc
        self._transport = transport
        self._requests = requests
        self._adopted: Sequence[Adopted] = ()
        self._running: dict[int, SessionProcess] = {}
        self._next_id = 1
        self._alive = True
        self._reusable = True
        self._stderr_tail: collections.deque[bytes] = collections.deque()
        self._stderr_task: asyncio.Task[None] | None = None
        self._launcher_pid: int | None = None  # its PID 1, as the host sees it
        self._mounts: bytes | None = None  # its mount table when it started
        self._binds = _host_binds(plan)  # host paths bound at their own path
        self._rules: CreateRuleSupervisor | None = None
        self._on_report: Callable[[Report], None] | None = None  # a refusal of no known command
        self._keepers: dict[int, int] = {}  # a keeper's pid in the sandbox -> its request
        self._exits: list[tuple[int, int]] = []  # `D` replies read, not yet handled
        self._eof = False

    @property
    def pid(self) -> int:
        """bwrap's pid on the host."""
        return self._proc.pid

    @property
    def alive(self) -> bool:
        """Whether it can still start commands."""
        return self._alive

    @property
    def reusable(self) -> bool:
        """Whether new commands may go to it: alive, and no keeper was killed before it could
        clean up after its command."""
        return self._alive and self._reusable

    def retire(self) -> None:
        """Take no new commands: the handle replaces it, and closes it after its last one."""
        self._reusable = False

    @property
    def running(self) -> int:
        """How many of its commands have not ended yet."""
        return len(self._running)

    def same_sandbox(self, plan: LaunchPlan) -> bool:
        """Whether `plan` describes this very sandbox (every fact it was planned from is the
        same) and its mounts are all still as they were, so a command planned with it may run
        here.

        The mount table is compared because the host can undo a mount without the sandbox's
        help: unlinking or renaming over a mount point on the host detaches that mount in every
        namespace (a secret's mask, a read-only `.git/hooks`), and a bound directory deleted on
        the host stays bound, marked deleted. A sandbox per command would not see either; this
        one is then replaced.

        The table alone cannot show a bound directory the host moved away and replaced while
        the sandbox started (before its table was first read: the moved mount is in that table
        already), so each host path bound at its own path must also still be, now, the very
        file the sandbox has there (same device and inode); one that cannot be checked is not.
        """
        return (
            plan.argv == self.plan.argv
            and plan.env == self.plan.env
            and self._mounts is not None
            and self._launcher_pid is not None
            and _mount_table(self._launcher_pid) == self._mounts
            and bound_as_on_host(self._launcher_pid, self._binds)
        )

    @classmethod
    async def start(
        cls,
        plan: LaunchPlan,
        egress: EgressPort,
        peers: SandboxPeers,
        on_report: Callable[[Report], None] | None = None,
    ) -> SessionSandbox:
        """Spawn the sandbox of `plan` (registered in `peers`) and take its handoff
        (backends/handoff.py): its loopback listeners to `egress`, with create-time globs its
        launcher's listener to a supervisor. A refusal that no running command can be told to
        have made goes to `on_report`.

        Raises:
            EnforcementFailed: bwrap or the launcher failed before serving (the error carries
                what they said); nothing is left running.
        """
        assert plan.session is not None and plan.egress_handoff is not None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        made: list[SessionSandbox] = []

        def spawned(launched: Launched) -> None:  # bwrap's stderr is kept from the start
            sandbox = cls(plan, launched.proc, launched.transport, ours)
            sandbox._on_report = on_report
            sandbox._stderr_task = asyncio.create_task(
                sandbox._keep_stderr(), name="sandbox stderr"
            )
            made.append(sandbox)

        try:
            try:
                launched = await launch(
                    plan, (asyncio.subprocess.DEVNULL, asyncio.subprocess.DEVNULL,
                           asyncio.subprocess.PIPE),
                    adopt=egress.adopt, peers=peers,
                    fds={plan.session.socket.name: theirs.fileno()}, spawned=spawned,
                )
            finally:
                theirs.close()
            sandbox = made[0]
            sandbox._adopted, sandbox._rules = launched.adopted, launched.supervisor
            if sandbox._rules is not None:
                asyncio.get_running_loop().add_reader(
                    sandbox._rules.report_fd, sandbox._on_reports
                )
            # The launcher has made its listeners, so bwrap has set up every mount by now.
            sandbox._launcher_pid = _only_child(launched.proc.pid)
            if sandbox._launcher_pid is not None:
                sandbox._mounts = _mount_table(sandbox._launcher_pid)
        except BaseException as exc:
            if not made:
                ours.close()
                raise
            await made[0].aclose()
            tail = made[0]._stderr_tail
            if isinstance(exc, EnforcementFailed) and tail:
                said = b"".join(tail).decode("utf-8", "replace").strip()
                raise EnforcementFailed(f"{exc.message}: {said}", fix=exc.fix) from exc
            raise
        ours.setblocking(False)
        asyncio.get_running_loop().add_reader(ours.fileno(), sandbox._on_reply)
        return sandbox

    async def _keep_stderr(self) -> None:
        stream = self._proc.stderr
        assert stream is not None
        size = 0
        while chunk := await stream.read(STDERR_TAIL_BYTES):
            self._stderr_tail.append(chunk)
            size += len(chunk)
            while size - len(self._stderr_tail[0]) >= STDERR_TAIL_BYTES:
                size -= len(self._stderr_tail.popleft())

    async def run(
        self,
        command: SessionCommand,
        *,
        stdin: int | None,
        stdout: int | None,
        stderr: int | None,
        on_report: Callable[[Report], None] | None = None,
    ) -> SessionProcess | None:
        """Start `command`. Each stream is `asyncio.subprocess.PIPE`, `DEVNULL`, a descriptor
        the caller keeps, or None (the server's own). The create-rule supervisor's refusals of this
        command go to `on_report`. Returns None when the command does not fit one request (the
        caller starts a sandbox of its own for it).

        Raises:
            EnforcementFailed: this sandbox has ended, or the request could not be sent; the
                command did not start.
        """
        request_id = self._next_id
        message = encode_request(request_id, command)
        if message is None:
            return None
        if not self._alive:
            raise EnforcementFailed("the session's sandbox has ended; the command was not run")
        self._next_id = self._next_id % 0xFFFF_FFFF + 1  # a u32 in the request, never 0
        proc = SessionProcess(self, request_id, on_report)
        theirs: list[int] = []
        mine: list[int] = []  # descriptors opened here, closed once sent
        try:
            for index, mode in enumerate((stdin, stdout, stderr)):
                if mode == asyncio.subprocess.PIPE:
                    read_end, write_end = os.pipe2(os.O_CLOEXEC)
                    keep, give = (write_end, read_end) if index == 0 else (read_end, write_end)
                    mine.append(give)
                    theirs.append(give)
                    if index == 0:
                        proc.pipes.add_stdin(keep)
                    else:
                        proc.pipes.add_output(keep, _OUTPUTS[index])
                    _give_pipe(give, self.plan.identity, known=True)
                elif mode == asyncio.subprocess.DEVNULL:
                    mine.append(os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))
                    theirs.append(mine[-1])
                else:
                    theirs.append(index if mode is None else mode)
                    if mode is not None:  # a caller's own stream (the CLI's), never the server's
                        _give_pipe(mode, self.plan.identity)
            self._running[request_id] = proc
            try:
                await _send(self._requests, message, theirs)
            except OSError as exc:
                del self._running[request_id]
                raise EnforcementFailed(
                    f"could not hand the command to the session's sandbox: {exc}; "
                    "the command was not run"
                ) from exc
        except BaseException:
            proc.close_pipes()
            raise
        finally:
            for fd in mine:
                os.close(fd)
        return proc

    def _signal(self, request_id: int, signum: int) -> None:
        if not self._alive:
            return
        with contextlib.suppress(OSError):  # full or gone: the sandbox's end handles the rest
            self._requests.send(_SIGNAL.pack(b"S", request_id, signum))

    def _read_replies(self) -> None:
        """Take every message the launcher has sent: keepers are noted at once, exits queued."""
        while not self._eof:
            try:
                data = self._requests.recv(64)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._eof = True
                return
            if len(data) != _REPLY.size or data[:1] not in (b"D", b"P"):
                log.warning("session sandbox %d sent a malformed reply; ignored", self.pid)
                continue
            tag, request_id, value = _REPLY.unpack(data)
            if request_id not in self._running:
                continue
            if tag == b"P":
                self._keepers[value] = request_id
            else:
                self._exits.append((request_id, value))

    def _on_reply(self) -> None:
        self._read_replies()
        if self._exits and self._rules is not None:
            self._route(self._rules.drain())  # a command's refusals come before its exit
        self._finish_exits()
        if self._eof:
            self._ended()

    def _finish_exits(self) -> None:
        exits, self._exits = self._exits, []
        for request_id, code in exits:
            proc = self._running.pop(request_id, None)
            if proc is None:
                continue
            for keeper in [k for k, r in self._keepers.items() if r == request_id]:
                del self._keepers[keeper]
            if code & KEEPER_KILLED:
                self._reusable = False
                code &= ~KEEPER_KILLED
            proc._finish(code if code <= 255 else KILLED_CODE)

    def _on_reports(self) -> None:
        assert self._rules is not None
        self._route(self._rules.drain())
        self._finish_exits()

    def _route(self, reports: list[Report]) -> None:
        """Give each report to the command whose keeper the refused process runs under."""
        for report in reports:
            proc = None
            if isinstance(report, CreateRefused) and report.keeper is not None:
                if report.keeper not in self._keepers:
                    self._read_replies()  # its `P` was sent before the command started
                proc = self._running.get(self._keepers.get(report.keeper, -1))
            if proc is not None and proc.on_report is not None:
                proc.on_report(report)
            elif self._on_report is not None:
                self._on_report(report)

    def _ended(self) -> None:
        if not self._alive:
            return
        self._alive = False
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self._requests.fileno())
        running, self._running = self._running, {}
        for proc in running.values():
            proc._finish(KILLED_CODE)
        if running:
            said = b"".join(self._stderr_tail).decode("utf-8", "replace").strip()
            log.warning("session sandbox %d ended with %d commands running%s", self.pid,
                        len(running), f": {said}" if said else "")

    async def aclose(self) -> None:
        """Kill the sandbox and everything in it, stop accepting on its egress listeners.
        Idempotent."""
        self._ended()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        await wait_exited(self._proc)
        self._transport.close()
        if self._stderr_task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._stderr_task, timeout=1.0)
        adopted, self._adopted = self._adopted, ()
        for listener in adopted:
            await listener.aclose()
        rules, self._rules = self._rules, None
        if rules is not None:  # its last refusals, then its workers stop
            await stop_supervisor(rules, lambda report: self._route([report]))
        self._requests.close()


def _only_child(pid: int) -> int | None:
    """bwrap's one child (the sandbox's PID 1, the launcher), or None."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            children = f.read().split()
    except OSError:
        return None
    return int(children[0]) if len(children) == 1 else None


def _host_binds(plan: LaunchPlan) -> tuple[str, ...]:
    """The sandbox paths where `plan` binds the host path of the same name: bwrap's `--bind` and
    `--ro-bind` options (and their `-fd` forms) up to its `--`, a source staged by another
    identity's helper from one of its `--map` roots named as that root's path."""
    words, roots = list(plan.argv), []
    if plan.identity is not None and "--" in words:
        end = words.index("--")  # the identity helper's own options, then bwrap's argv
        roots = [words[i + 1] for i in range(end - 1) if words[i] == "--map"]
        words = words[end + 1 :]
    found: list[str] = []
    for i, word in enumerate(words):
        if word == "--":
            break
        if word in ("--bind", "--ro-bind", "--bind-fd", "--ro-bind-fd") and i + 2 < len(words):
            source, target = words[i + 1], words[i + 2]
            if isinstance(source, PathFd):  # a spec bind by fd: its source, opened without symlinks
                source = source.path
            if (isinstance(source, str) and isinstance(target, str)
                    and _unstaged(source, roots) == target and target not in found):
                found.append(target)
    return tuple(found)


def _unstaged(source: str, roots: Sequence[object]) -> str:
    """The host path a bind source stands for: a stage of the i-th root is below that root."""
    for i, root in enumerate(roots):
        stage = f"{STAGE_DIR}/{i}"
        if isinstance(root, str) and (source == stage or source.startswith(f"{stage}/")):
            return root + source[len(stage) :]
    return source


def _mount_table(pid: int) -> bytes | None:
    """The mount table of `pid`'s mount namespace, or None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/mountinfo", "rb") as f:
            return f.read()
    except OSError:
        return None


async def _send(sock: socket.socket, message: bytes, fds: list[int]) -> None:
    while True:
        try:
            socket.send_fds(sock, [message], fds)
            return
        except BlockingIOError:
            await wait_writable(sock)


def _give_pipe(fd: int, identity: SandboxIdentity | None, *, known: bool = False) -> None:
    """Give a command's stream, when it is a pipe (`known`: one made here), to a root server's
    sandbox identity.

    A pipe is its maker's, mode 0600: the command could not reopen it by name (`echo >
    /dev/stderr` opens /proc/self/fd/2, which checks the pipe's owner). Terminals and files keep
    their owner; cc-identity does the same for a command it starts itself.
    """
    if identity is None:
        return
    with contextlib.suppress(OSError):  # not a pipe, or gone: the command sees what it is
        if known or os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:["):
            os.fchown(fd, identity.uid, identity.gid)
