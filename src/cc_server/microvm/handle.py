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
    VM_DIR_PREFIX,
    AgentGone,
    AgentLink,
    ExecChannel,
    Request,
    private_dir,
)
from cc_server.microvm.mounts import GuestMount, MountPlan
from cc_server.microvm.pool import Vm, VmPool
from cc_server.microvm.proto import ExecFlags, Frame, FrameType, exec_payload, mount_payload
from cc_server.policy import CompiledPolicy
from cc_server.runtime.events import EventType, SandboxState
from cc_server.runtime.handle import KILL_GRACE_S, Execution, SandboxHandle

__all__ = ["GUEST_ENV", "MicroVMHandle", "VmExecution"]

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


def _errno_of(reply: Frame) -> int:
    """The errno an agent's RESULT frame carries (0: done)."""
    return int(struct.unpack_from("<i", reply.payload)[0])


def _check_result(reply: Frame, what: str, *, fix: str) -> None:
    """Raise EnforcementFailed when the agent could not do `what`."""
    if (code := _errno_of(reply)) != 0:
        raise EnforcementFailed(f"the guest could not {what}: {os.strerror(code)}", fix=fix)


def _no_host_plan(policy: CompiledPolicy, command: Command) -> LaunchPlan:
    raise BackendUnavailable(
        "a microVM runs its commands in the guest; there is no host launch plan",
        fix="use handle.exec",
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
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def run_dir(self) -> Path | None:
        """The VM's private directory (sockets, logs, the suspended state)."""
        return self._run_dir

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
        try:
            bridge = await self.egress.start() if self.egress is not None else None
            proxy_dir = Path(bridge.socket_dir) if bridge is not None else None
            self._link = AgentLink(lambda: proxy_dir)
            self._run_dir = private_dir(self.run_base, VM_DIR_PREFIX)
            self.details["runDir"] = str(self._run_dir)
            self._vm, replies = await self.pool.restore(
                self._run_dir, self.mount_plan.shares, self._link, self._mount_requests()
            )
            self._check_mounts(replies)
            self.details["accelerator"] = self.pool.config.accel
            self.details["qemuPid"] = self._vm.qemu.pid
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
                    await self.pool.suspend(self._vm, self._run_dir / STATE_FILE)
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
            assert self._link is not None and self._run_dir is not None
            assert self.pool is not None and self.mount_plan is not None
            state = self._run_dir / STATE_FILE
            try:
                self._vm, replies = await self.pool.resume(
                    self._run_dir, self.mount_plan.shares, self._link, state,
                    self._mount_requests(),
                )
                self._check_mounts(replies)
                # Thawed only once every mount is known to be back: the agent takes a batch in
                # order, so a thaw sent behind the mounts would let the commands run with a
                # carve-out off until the VM is ended.
                reply = await self._link.request(FrameType.THAW, b"", FrameType.RESULT)
                _check_result(reply, "thaw its commands", fix="see the VM's console log")
            except BaseException as exc:  # cancelled included: never a VM left behind
                await self._fail_closed(exc)
                raise
            state.unlink()
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
                elif isinstance(execution, VmExecution):
                    execution._killed_reason = execution._killed_reason or "destroyed"
        finally:
            async with self._lock:
                await self._teardown()
            self.details.pop("qemuPid", None)
            self.transition(SandboxState.DESTROYED)

    def exec(
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
    ) -> VmExecution:
        """Prepare `argv` to run in the guest (see SandboxHandle.exec); `pty=(rows, cols)` runs
        it on a guest PTY (stdout carries the terminal's output, stdin its input).

        Raises:
            Closed: the handle is destroyed or in error.
            BadSpec: the options conflict.
        """
        if self.state in (SandboxState.DESTROYED, SandboxState.ERROR):
            raise Closed(f"sandbox {self.session_id!r} is {self.state}; launch a new one")
        if inherit_stdio is not False:
            raise BadSpec("a microVM command cannot inherit the server's stdio")
        full_env = {**GUEST_ENV, **(env or {})}
        command = Command(argv=tuple(argv), env=tuple(sorted(full_env.items())),
                          cwd=cwd or self.policy.workdir)
        return VmExecution(
            handle=self,
            exec_id=f"{self.session_id}:{next(self._ids)}",
            command=command,
            stdin=stdin,
            interactive_stdin=interactive_stdin or pty is not None,
            inherit_stdio=False,
            timeout_s=timeout_s,
            pty=pty,
        )


class VmExecution(Execution):
    """One command in the guest; events, collect, wait, kill as for a native command."""

    def __init__(self, *, handle: MicroVMHandle, pty: tuple[int, int] | None,
                 **kwargs: object) -> None:
        super().__init__(handle=handle, **kwargs)  # type: ignore[arg-type]
        self.vm_handle = handle
        self._pty = pty
        self._channel: ExecChannel | None = None
        self.guest_pid: int | None = None

    async def __aenter__(self) -> VmExecution:
        handle = self.vm_handle
        await handle.ready()
        await handle.resume()
        link = handle._link
        if link is None or handle.state not in (SandboxState.WARM, SandboxState.ACTIVE):
            raise Closed(f"sandbox {handle.session_id!r} is {handle.state}; launch a new one")
        await self._queue.put(self._event(EventType.STARTING))
        flags = ExecFlags.NONE
        if self._pty is not None:
            flags |= ExecFlags.PTY
        elif self._stdin_data is not None or self._interactive:
            flags |= ExecFlags.STDIN
        rows, cols = self._pty or (24, 80)
        cmd = self.command
        channel = link.open_exec()
        self._channel = channel
        try:
            link.send(channel.channel, FrameType.EXEC,
                      exec_payload(cmd.argv, cmd.env, cmd.cwd, flags, rows, cols))
            await link.drain()
            first = await channel.frames.get()
        except BaseException:
            link.forget_exec(channel.channel)
            raise
        if first.type is not FrameType.STARTED:
            link.forget_exec(channel.channel)
            detail = first.payload[4:].decode(errors="replace") if first.payload else "no VM"
            raise EnforcementFailed(f"the guest could not start {cmd.argv[0]}: {detail}")
        self.guest_pid = struct.unpack_from("<I", first.payload)[0]
        handle._running.add(self)
        if handle.state is SandboxState.WARM:
            handle.transition(SandboxState.ACTIVE)
        await self._queue.put(self._event(EventType.READY))
        if self._stdin_data is not None:
            with contextlib.suppress(AgentGone):
                await self.write_stdin(self._stdin_data)
                self.close_stdin()
        self._task_group = asyncio.TaskGroup()
        await self._task_group.__aenter__()
        self._task_group.create_task(self._supervise(), name=f"exec {self.exec_id} supervise")
        return self

    async def _supervise(self) -> None:
        channel = self._channel
        assert channel is not None
        code: int = -1
        try:
            try:
                async with asyncio.timeout(self._timeout_s):
                    code = await self._pump_frames(channel)
            except TimeoutError:
                await self._signal(signal.SIGKILL, "timeout")
                async with asyncio.timeout(KILL_GRACE_S):
                    code = await self._pump_frames(channel)
        except (TimeoutError, asyncio.CancelledError):
            code = 128 + signal.SIGKILL
            self._killed_reason = self._killed_reason or "destroyed"
        finally:
            link = self.vm_handle._link
            if link is not None:
                link.forget_exec(channel.channel)
            self.exit_code = code
            if self._killed_reason is not None:
                await self._queue.put(self._event(EventType.KILLED, reason=self._killed_reason))
            await self._queue.put(self._event(EventType.EXIT, exit_code=code))
            handle = self.vm_handle
            handle._running.discard(self)
            if not handle._running and handle.state is SandboxState.ACTIVE:
                handle.transition(SandboxState.WARM)
            self._done.set()

    async def _pump_frames(self, channel: ExecChannel) -> int:
        while True:
            frame: Frame = await channel.frames.get()
            if frame.type is FrameType.STDOUT:
                await self._queue.put(self._event(EventType.STDOUT, data=frame.payload))
            elif frame.type is FrameType.STDERR:
                await self._queue.put(self._event(EventType.STDERR, data=frame.payload))
            elif frame.type is FrameType.EXIT:
                return int(struct.unpack_from("<I", frame.payload)[0])
            elif frame.type is FrameType.ABORT:  # the VM went away under the command
                self._killed_reason = self._killed_reason or "destroyed"
                return 128 + signal.SIGKILL

    async def __aexit__(self, *exc_info: object) -> None:
        if not self._done.is_set():
            await self.kill(reason="manual")
        await self._discard_until_done()
        assert self._task_group is not None
        await self._task_group.__aexit__(None, None, None)

    async def wait_done(self) -> None:
        """Wait until the command has exited (its `exit` event queued), reading nothing."""
        await self._done.wait()

    async def _signal(self, signum: int, reason: str) -> None:
        if self._killed_reason is None:
            self._killed_reason = reason
        link = self.vm_handle._link
        if link is None or self._channel is None:
            return
        with contextlib.suppress(AgentGone):
            link.send(self._channel.channel, FrameType.SIGNAL, struct.pack("<I", signum))
            await link.drain()

    async def kill(self, reason: str = "manual") -> None:
        """SIGKILL the command's process group in the guest and wait for its exit; if the VM
        does not answer, the command is ended here. Idempotent."""
        if self._channel is None or self._done.is_set():
            return
        await self._signal(signal.SIGKILL, reason)
        try:
            async with asyncio.timeout(KILL_GRACE_S):
                await self._done.wait()
        except TimeoutError:
            link = self.vm_handle._link
            if link is not None:
                link.close_all(AgentGone("the command did not answer a kill"))

    async def terminate(self, grace_s: float, reason: str = "shutdown") -> None:
        """SIGTERM, then `kill()` after `grace_s`. Idempotent."""
        if self._channel is None or self._done.is_set():
            return
        await self._signal(signal.SIGTERM, reason)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await self._done.wait()
        await self.kill(reason=reason)

    async def write_stdin(self, data: bytes) -> None:
        """Send bytes to the command's stdin (or its PTY)."""
        link = self.vm_handle._link
        if self._channel is None or link is None:
            raise BadSpec("this execution has no interactive stdin")
        for at in range(0, len(data), 32 * 1024):
            link.send(self._channel.channel, FrameType.DATA, data[at:at + 32 * 1024])
        await link.drain()

    def close_stdin(self) -> None:
        """Send EOF (on a PTY: the terminal's EOF character)."""
        link = self.vm_handle._link
        if self._channel is not None and link is not None:
            with contextlib.suppress(AgentGone):
                link.send(self._channel.channel, FrameType.EOF)

    def set_window(self, rows: int, cols: int) -> None:
        """A PTY command's window size (its foreground job gets SIGWINCH in the guest).

        Raises:
            AgentGone: the VM is not running.
        """
        link = self.vm_handle._link
        if self._channel is not None and link is not None:
            link.send(self._channel.channel, FrameType.WINSIZE, struct.pack("<HH", rows, cols))

