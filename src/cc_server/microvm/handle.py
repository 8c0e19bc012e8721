"""A microVM sandbox: the handle (states created → warm ⇄ active, suspended, destroyed, error)
and its commands, with the same public surface as the native ones (runtime.handle).

`launch` is synchronous, like every adapter's: the handle comes back `created` and its VM is
restored from the pool's snapshot in the background; the first `exec` (or `ready()`) waits for
`warm`, and a failure moves the handle to `error` with the reason in `handle.error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import signal
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from cc_server.backends.plan import Command, LaunchPlan
from cc_server.errors import (
    BackendUnavailable,
    BadSpec,
    CcServerError,
    Closed,
    EnforcementFailed,
)
from cc_server.microvm.link import (
    AgentGone,
    AgentLink,
    ExecChannel,
    Request,
)
from cc_server.microvm.mounts import GuestMount, MountPlan
from cc_server.microvm.pool import SavedState, Vm, VmPool
from cc_server.microvm.proto import ExecFlags, Frame, FrameType, exec_payload, mount_payload
from cc_server.policy import CompiledPolicy
from cc_server.runtime.child import KILL_GRACE_S, Emit
from cc_server.runtime.events import EventType, SandboxState
from cc_server.runtime.execution import Execution
from cc_server.runtime.handle import SandboxHandle
from cc_server.tasks import start_task

__all__ = ["GUEST_ENV", "MicroVMHandle", "NoHostPlanner", "VmChild"]

log = logging.getLogger("cc_server.microvm")
GUEST_HTTP_PROXY_PORT: Final = 3128  # the agent's loopback listeners (agent.c)
GUEST_SOCKS_PROXY_PORT: Final = 1080
# Every command's base environment in the guest; the caller's env is laid over it.
GUEST_ENV: Final = {
    "PATH": "/bin:/sbin:/usr/bin:/usr/sbin",
    "HOME": "/root",
    "HTTP_PROXY": f"http://127.0.0.1:{GUEST_HTTP_PROXY_PORT}",
    "HTTPS_PROXY": f"http://127.0.0.1:{GUEST_HTTP_PROXY_PORT}",
    "http_proxy": f"http://127.0.0.1:{GUEST_HTTP_PROXY_PORT}",
    "https_proxy": f"http://127.0.0.1:{GUEST_HTTP_PROXY_PORT}",
    "ALL_PROXY": f"socks5h://127.0.0.1:{GUEST_SOCKS_PROXY_PORT}",
    "all_proxy": f"socks5h://127.0.0.1:{GUEST_SOCKS_PROXY_PORT}",
    "NO_PROXY": "localhost,127.0.0.1,::1",
    "no_proxy": "localhost,127.0.0.1,::1",
}
STATE_FILE: Final = "suspended.state"
STDIN_FRAME_BYTES: Final = 32 * 1024  # one DATA frame of a command's stdin carries at most this
KILLED_CODE: Final = 128 + signal.SIGKILL


def _errno_of(reply: Frame) -> int:
    """The errno an agent's RESULT frame carries (0: done)."""
    return int(struct.unpack_from("<i", reply.payload)[0])


def _check_result(reply: Frame, what: str, *, fix: str) -> None:
    """Raise EnforcementFailed when the agent could not do `what`."""
    if (code := _errno_of(reply)) != 0:
        raise EnforcementFailed(f"the guest could not {what}: {os.strerror(code)}", fix=fix)


@dataclass(frozen=True, slots=True)
class NoHostPlanner:
    """A microVM handle's Planner: its commands run in the guest, with no host launch plan."""

    def plan(self, policy: CompiledPolicy, command: Command) -> LaunchPlan:
        """Raises BackendUnavailable, always."""
        raise BackendUnavailable(
            "a microVM runs its commands in the guest; there is no host launch plan",
            fix="use handle.open_exec",
        )


@dataclass(eq=False)
class MicroVMHandle(SandboxHandle):
    """A sandbox whose commands run in a QEMU microVM of its own."""

    pool: VmPool | None = field(default=None, repr=False)
    mount_plan: MountPlan | None = field(default=None, repr=False)
    run_base: str = ""
    _vm: Vm | None = field(default=None, repr=False)
    _link: AgentLink | None = field(default=None, repr=False)
    _run_dir: Path | None = field(default=None, repr=False)
    _start_task: asyncio.Task[None] | None = field(default=None, repr=False)
    _saved: SavedState | None = field(default=None, repr=False)  # while suspended
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    _children: dict[Execution, VmChild] = field(default_factory=dict, repr=False)

    @property
    def run_dir(self) -> Path | None:
        """The VM's private directory (sockets, logs, the suspended state)."""
        return self._run_dir

    @property
    def phases(self) -> dict[str, float]:
        """How long the running VM's restore (or last resume) took to each step, in ms since
        it began (see pool.Vm); empty while there is no VM."""
        return dict(self._vm.phases) if self._vm is not None else {}

    @property
    def from_spare(self) -> bool:
        """Whether the running VM's QEMU was the pool's spare (started ahead of need)."""
        return self._vm is not None and self._vm.from_spare

    @property
    def qemu_pid(self) -> int | None:
        """The host pid of the running VM's process (bubblewrap around QEMU when QEMU is
        confined; QEMU dies with it); None while created, suspended or destroyed."""
        return self._vm.qemu.pid if self._vm is not None else None

    def start(self) -> None:
        """Restore the VM in the background (needs a running event loop).

        Raises:
            BackendUnavailable: no event loop runs (the microVM backend is async only).
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError as exc:
            raise BackendUnavailable(
                "the microvm backend needs the server's event loop",
                fix="use it through cc-server serve or the async library API",
            ) from exc
        self._start_task = loop.create_task(self._start(), name=f"microvm start {self.session_id}")

    async def ready(self) -> None:
        """Wait until the VM is warm.

        Raises:
            CcServerError: the VM could not be started (the handle is in `error`).
            Closed: the handle is destroyed.
        """
        if self._start_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._start_task)
        if self.state is SandboxState.ERROR:
            assert self.error is not None
            raise self.error
        if self.state is SandboxState.DESTROYED:
            raise Closed(f"sandbox {self.session_id!r} is destroyed; launch a new one")

    async def _start(self) -> None:
        assert self.pool is not None and self.mount_plan is not None
        proxy_dir: list[Path] = []  # the session's egress sockets, once its proxies run
        pool, shares = self.pool, self.mount_plan.shares

        async def start_egress() -> None:
            if self.egress is not None:
                proxy_dir.append(Path((await self.egress.start()).socket_dir))

        async def restore(link: AgentLink) -> tuple[Vm, list[Frame]]:
            self._vm, replies = await pool.restore(shares, link, self._mount_requests())
            self._run_dir = self._vm.run_dir
            return self._vm, replies

        try:
            self._link = AgentLink(lambda: proxy_dir[0] if proxy_dir else None)
            # The proxies start while QEMU does: no command runs (and so no guest connection
            # opens) before the VM is warm, and either failing ends both.
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(start_egress(), name=f"microvm egress {self.session_id}")
                    restoring = group.create_task(restore(self._link),
                                                  name=f"microvm restore {self.session_id}")
            except BaseExceptionGroup as failed:
                raise failed.exceptions[0] from None
            vm, replies = restoring.result()
            self.details["runDir"] = str(vm.run_dir)
            self._check_mounts(replies)
            self.details["accelerator"] = self.pool.config.accel
            self.details["qemuPid"] = vm.qemu.pid
            self.transition(SandboxState.WARM)
        except BaseException as exc:
            await self._teardown()
            if self.state is not SandboxState.DESTROYED:
                self.fail(exc if isinstance(exc, CcServerError) else EnforcementFailed(
                    f"the microVM did not start: {exc!r}"))
            if not isinstance(exc, Exception):
                raise

    def _mount_requests(self, steps: tuple[GuestMount, ...] | None = None) -> list[Request]:
        assert self.mount_plan is not None
        return [
            Request(FrameType.MOUNT, mount_payload(step.op, step.guest_path, tag=step.tag,
                                                   read_only=step.read_only), FrameType.RESULT)
            for step in (self.mount_plan.steps if steps is None else steps)
        ]

    def _check_mounts(self, replies: list[Frame],
                      steps: tuple[GuestMount, ...] | None = None) -> None:
        """Raise for the first mount step the guest could not take."""
        assert self.mount_plan is not None
        for step, reply in zip(self.mount_plan.steps if steps is None else steps, replies,
                               strict=True):
            _check_result(reply, f"mount {step.guest_path} ({step.reason})",
                          fix="check the bind mount's guestPath")

    async def _apply_mounts(self, steps: tuple[GuestMount, ...] | None = None) -> None:
        assert self._link is not None
        self._check_mounts(await self._link.request_many(self._mount_requests(steps)), steps)

    async def _fail_closed(self, exc: BaseException) -> None:
        """End the VM and move to `error`: its mounts are not known to be whole (a read-only or
        hidden carve-out may be off while the bind under it is on)."""
        await self._teardown()
        self.fail(exc if isinstance(exc, CcServerError) else EnforcementFailed(
            f"the microVM's mounts could not be put back: {exc!r}"))

    async def _put_back_mounts(self, steps: tuple[GuestMount, ...] | None = None) -> None:
        """Mount again what a suspend took off. A step the guest cannot take (a command
        removed a carve-out's directory while it was off) fails the handle closed."""
        try:
            await self._apply_mounts(steps)
        except BaseException as exc:
            await self._fail_closed(exc)
            raise

    async def _set_frozen(self, frozen: bool) -> None:
        """Freeze (or thaw) every command in the guest: frozen, none runs while a suspend has
        a carve-out off and the bind under it on.

        Raises:
            EnforcementFailed: the guest could not (the handle fails closed on a thaw).
        """
        assert self._link is not None
        kind = FrameType.FREEZE if frozen else FrameType.THAW
        try:
            reply = await self._link.request(kind, b"", FrameType.RESULT)
            _check_result(reply, f"{'freeze' if frozen else 'thaw'} its commands",
                          fix="retry the suspend; see the VM's console log")
        except BaseException as exc:
            if frozen:  # nothing is off yet: whatever froze runs again
                with contextlib.suppress(CcServerError):
                    await self._link.request(FrameType.THAW, b"", FrameType.RESULT)
            else:
                await self._fail_closed(exc)
            raise

    async def _detach_mounts(self) -> None:
        """Unmount every step, last first (QEMU cannot save a VM with a 9p share mounted). A
        busy mount stays, and so does everything under it: the steps taken off are put back
        and EnforcementFailed is raised, with the VM running as before. When the steps cannot
        all be accounted for or put back, the handle fails closed (see `_fail_closed`)."""
        assert self._link is not None and self.mount_plan is not None
        steps = tuple(reversed(self.mount_plan.steps))
        try:
            replies = await self._link.request_many([
                Request(FrameType.UNMOUNT, step.guest_path.encode() + b"\0", FrameType.RESULT)
                for step in steps
            ])
        except BaseException as exc:
            await self._fail_closed(exc)
            raise
        codes = [_errno_of(reply) for reply in replies]
        # EINVAL: not a mount point (a hidden path that did not exist); nothing to take off.
        taken = tuple(s for s, c in zip(steps, codes, strict=True) if c == 0)
        busy = [s for s, c in zip(steps, codes, strict=True) if c not in (0, errno.EINVAL)]
        if busy:
            await self._put_back_mounts(tuple(reversed(taken)))
            raise EnforcementFailed(
                f"the microVM cannot be suspended while {busy[0].guest_path} is in use "
                f"({os.strerror(codes[steps.index(busy[0])])}): QEMU cannot save a VM with a "
                "shared folder mounted",
                fix="end the commands that hold files on a bind mount (a shell whose working "
                "directory is in one), then suspend again",
            )

    async def suspend(self) -> None:
        """Write the VM's whole state to disk and end its QEMU (its RAM is released). Running
        commands stay, frozen; `resume()` (or the next `exec`) continues them.

        Raises:
            BadSpec: the handle is not warm or active.
            EnforcementFailed: the VM could not be saved and keeps running, its mounts whole:
                QEMU cannot save a VM with a 9p share mounted, so a process in it that holds a
                file on a bind mount (its working directory included) prevents a suspend. When
                the mounts cannot be put back whole, the VM is ended and the handle is in
                `error` instead.
        """
        await self.ready()
        async with self._lock:
            if self.state not in (SandboxState.WARM, SandboxState.ACTIVE):
                raise BadSpec(f"sandbox {self.session_id!r} is {self.state}; cannot suspend")
            assert self._vm is not None and self._run_dir is not None and self.pool is not None
            await self._set_frozen(True)  # thawed by resume, after the mounts are back
            try:
                await self._detach_mounts()
                try:
                    self._saved = await self.pool.suspend(self._vm, self._run_dir / STATE_FILE)
                except BaseException as exc:
                    await self._put_back_mounts()
                    if not isinstance(exc, CcServerError):
                        raise
                    raise EnforcementFailed(
                        f"the microVM could not be suspended: {exc.message}",
                        fix="see QEMU's log in the VM's directory",
                    ) from exc
            except BaseException:
                if self._vm is not None:  # not failed closed: the mounts are whole again
                    await self._set_frozen(False)
                raise
            self._vm = None
            self.details.pop("qemuPid", None)
            if self.state is SandboxState.ACTIVE:
                self.transition(SandboxState.WARM)
            self.transition(SandboxState.SUSPENDED)

    async def resume(self) -> None:
        """Restore a suspended VM from its state file; a warm one is left alone.

        Raises:
            EnforcementFailed: the state could not be restored (the handle is in `error`).
        """
        async with self._lock:
            if self.state is not SandboxState.SUSPENDED:
                return
            assert self._link is not None and self._saved is not None
            assert self.pool is not None and self.mount_plan is not None
            try:
                self._vm, replies = await self.pool.resume(
                    self.mount_plan.shares, self._link, self._saved, self._mount_requests(),
                )
                self._check_mounts(replies)
                # Thawed only once every mount is known to be back: the agent takes a batch in
                # order, so a thaw sent behind the mounts would let the commands run with a
                # carve-out off until the VM is ended.
                thaw_from = time.perf_counter()
                reply = await self._link.request(FrameType.THAW, b"", FrameType.RESULT)
                _check_result(reply, "thaw its commands", fix="see the VM's console log")
                self._vm.phases["thaw"] = self._vm.phases["greet"] + (
                    time.perf_counter() - thaw_from) * 1000
            except BaseException as exc:  # cancelled included: never a VM left behind
                await self._fail_closed(exc)
                raise
            # The VM runs in a directory of its own now: the one with the state goes, in a
            # thread (freeing a large file takes milliseconds; a killed server's is removed
            # at the next boot, remove_stale_vm_dirs).
            suspended_dir, self._run_dir = self._saved.path.parent, self._vm.run_dir
            self._saved = None
            start_task(asyncio.to_thread(shutil.rmtree, suspended_dir, ignore_errors=True),
                       name=f"microvm remove suspended state {self.session_id}")
            self.details["runDir"] = str(self._run_dir)
            self.details["qemuPid"] = self._vm.qemu.pid
            self.transition(SandboxState.WARM)
            if self._running:
                self.transition(SandboxState.ACTIVE)

    async def _teardown(self) -> None:
        vm, self._vm = self._vm, None
        try:
            if vm is not None:
                await vm.stop()
        finally:
            if self._link is not None:
                self._link.close_all(AgentGone("the microVM was stopped"))
            run_dir, self._run_dir = self._run_dir, None
            if run_dir is not None:
                shutil.rmtree(run_dir, ignore_errors=True)
            if self.egress is not None:
                await self.egress.aclose()

    async def destroy(self) -> None:
        """Kill every command, end QEMU, stop the proxies, remove the VM's directory (its
        suspended state included). Idempotent."""
        if self.state is SandboxState.DESTROYED:
            return
        task = self._start_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        try:
            for execution in list(self._running):
                if self._vm is not None:
                    await execution.kill(reason="destroyed")
                else:
                    execution.mark_killed("destroyed")
        finally:
            async with self._lock:
                await self._teardown()
            self.details.pop("qemuPid", None)
            self.transition(SandboxState.DESTROYED)

    @contextlib.asynccontextmanager
    async def open_exec(
        self,
        argv: tuple[str, ...] | list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        interactive_stdin: bool = False,
        inherit_stdio: bool | tuple[int, int, int] = False,
        timeout_s: float | None = None,
        pty: tuple[int, int] | None = None,
    ) -> AsyncIterator[Execution]:
        """Run `argv` in the guest for the length of the block (see SandboxHandle.open_exec);
        `pty=(rows, cols)` runs it on a guest PTY (stdout carries the terminal's output, stdin
        its input).

        Raises:
            Closed: the handle is destroyed or in error.
            BadSpec: the options conflict.
            CcServerError: the VM did not start, or the guest could not start the command.
        """
        self.check_open()
        if inherit_stdio is not False:
            raise BadSpec("a microVM command cannot inherit the server's stdio")
        full_env = {**GUEST_ENV, **(env or {})}
        command = Command(argv=tuple(argv), env=tuple(sorted(full_env.items())),
                          cwd=cwd or self.policy.workdir)
        execution = Execution(handle=self, exec_id=self.next_exec_id(), command=command,
                              stdin=stdin, timeout_s=timeout_s)
        flags = ExecFlags.NONE
        if pty is not None:
            flags |= ExecFlags.PTY
        elif stdin is not None or interactive_stdin:
            flags |= ExecFlags.STDIN
        async with execution.open(lambda: self._start_guest(execution, flags, pty or (24, 80))):
            yield execution

    async def _start_guest(self, execution: Execution, flags: ExecFlags,
                           window: tuple[int, int]) -> VmChild:
        """Start `execution`'s command in the guest, on a channel of its own."""
        await self.ready()
        await self.resume()
        link = self._link
        if link is None or self.state not in (SandboxState.WARM, SandboxState.ACTIVE):
            raise Closed(f"sandbox {self.session_id!r} is {self.state}; launch a new one")
        cmd = execution.command
        channel = link.open_exec()
        try:
            link.send(channel.channel, FrameType.EXEC,
                      exec_payload(cmd.argv, cmd.env, cmd.cwd, flags, *window))
            await link.drain()
            first = await channel.frames.get()
        except BaseException:
            link.forget_exec(channel.channel)
            raise
        if first.type is not FrameType.STARTED:
            link.forget_exec(channel.channel)
            detail = first.payload[4:].decode(errors="replace") if first.payload else "no VM"
            raise EnforcementFailed(f"the guest could not start {cmd.argv[0]}: {detail}")
        child = VmChild(link, channel, guest_pid=struct.unpack_from("<I", first.payload)[0],
                        on_abort=lambda: execution.mark_killed("destroyed"))
        self._children[execution] = child
        return child

    def exec_started(self, execution: Execution) -> None:
        """See SandboxHandle.exec_started (a VM being suspended stays as it is)."""
        self._running.add(execution)
        if self.state is SandboxState.WARM:
            self.transition(SandboxState.ACTIVE)

    async def exec_done(self, execution: Execution) -> None:
        """See SandboxHandle.exec_done."""
        self._children.pop(execution, None)
        await super().exec_done(execution)

    def set_window(self, execution: Execution, rows: int, cols: int) -> None:
        """The window size of `execution`'s guest PTY (its foreground job gets SIGWINCH).

        Raises:
            AgentGone: the VM is not running.
        """
        child = self._children.get(execution)
        if child is not None:
            child.set_window(rows, cols)


class VmChild:
    """One command in the guest, on a channel of the agent link: the Child (runtime/child.py)
    a microVM's Execution is composed over. Its frames carry the output and then the exit;
    an ABORT means the VM went away under the command (137, killed: `on_abort`)."""

    def __init__(self, link: AgentLink, channel: ExecChannel, *, guest_pid: int,
                 on_abort: Callable[[], None]) -> None:
        self._link = link
        self._channel = channel
        self._on_abort = on_abort
        self.guest_pid = guest_pid
        self._code: int | None = None
        self._ended = asyncio.Event()

    @property
    def returncode(self) -> int | None:
        """See Child.returncode."""
        return self._code

    def _end(self, code: int) -> None:
        if self._code is None:
            self._code = code
            self._ended.set()

    async def pump(self, emit: Emit) -> None:
        """See Child.pump: the channel's frames, up to its EXIT (or ABORT)."""
        while self._code is None:
            frame: Frame = await self._channel.frames.get()
            if frame.type is FrameType.STDOUT:
                await emit(EventType.STDOUT, frame.payload)
            elif frame.type is FrameType.STDERR:
                await emit(EventType.STDERR, frame.payload)
            elif frame.type is FrameType.EXIT:
                self._end(int(struct.unpack_from("<I", frame.payload)[0]))
            elif frame.type is FrameType.ABORT:
                if self._code is None:
                    self._on_abort()
                self._end(KILLED_CODE)

    async def feed(self, data: bytes) -> None:
        """See Child.feed."""
        with contextlib.suppress(AgentGone):
            await self.write_stdin(data)
            self.close_stdin()

    async def write_stdin(self, data: bytes) -> None:
        """Send bytes to the command's stdin (or its PTY).

        Raises:
            AgentGone: the VM is not running.
        """
        for at in range(0, len(data), STDIN_FRAME_BYTES):
            self._link.send(self._channel.channel, FrameType.DATA,
                            data[at:at + STDIN_FRAME_BYTES])
        await self._link.drain()

    def close_stdin(self) -> None:
        """Send EOF (on a PTY: the terminal's EOF character)."""
        with contextlib.suppress(AgentGone):
            self._link.send(self._channel.channel, FrameType.EOF)

    async def exited(self) -> int:
        """See Child.exited."""
        await self._ended.wait()
        assert self._code is not None
        return self._code

    def signal(self, signum: int) -> None:
        """See Child.signal: to the command's process group in the guest."""
        if self._code is None:
            with contextlib.suppress(AgentGone):
                self._link.send(self._channel.channel, FrameType.SIGNAL,
                                struct.pack("<I", signum))

    async def kill(self) -> None:
        """See Child.kill: a command whose VM does not answer within KILL_GRACE_S is given up
        here (137); its channel is forgotten."""
        self.signal(signal.SIGKILL)
        try:
            async with asyncio.timeout(KILL_GRACE_S):
                await self._ended.wait()
        except TimeoutError:
            self._end(KILLED_CODE)
            with contextlib.suppress(asyncio.QueueFull):  # wakes `pump`
                self._channel.frames.put_nowait(Frame(self._channel.channel, FrameType.ABORT))

    async def close(self) -> None:
        """See Child.close."""
        self._link.forget_exec(self._channel.channel)

    def set_window(self, rows: int, cols: int) -> None:
        """A PTY command's window size.

        Raises:
            AgentGone: the VM is not running.
        """
        self._link.send(self._channel.channel, FrameType.WINSIZE,
                        struct.pack("<HH", rows, cols))
