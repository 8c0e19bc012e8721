"""Pre-booted, snapshotted VMs: one cold boot per image and accelerator, then a restore per
session.

The template VM boots once with its RAM in a file mapped MAP_SHARED, waits for its agent, and is
saved with QEMU's `x-ignore-shared`: a device-state file of a few tens of KB, and the RAM file.
Every session's VM is a new QEMU that maps that RAM file copy-on-write (`share=off`: the file
never changes, the page cache of its pages is shared by every VM) and loads the small state:
tens of milliseconds instead of seconds, with the session's own mounts in the slots.

Suspending a session's VM saves its state to a file in the session's private directory and
ends QEMU: QEMU writes every page, and the file is then cut to the pages that differ from the
template's (microvm.delta), so a resume is a restore too: the template mapped copy-on-write,
and only the session's own pages loaded. Nothing else of a suspended VM stays in memory.

A spare QEMU (one per pool) waits with `-incoming defer` for the next restore or resume: started
after each one with the same RAM and shares, taken only by one whose QEMU would be given exactly
that (the same key, and each share still the host's directory at its path), and ended otherwise
and at `aclose`. A take only loads the state: QEMU's own start (under bubblewrap) is off the
request's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cc_server.backends.mount_view import bound_as_on_host
from cc_server.backends.plan import FdArg, SandboxIdentity
from cc_server.backends.seccomp import filter_bpf
from cc_server.errors import CcServerError, EnforcementFailed
from cc_server.microvm.delta import DeltaRefused, write_delta
from cc_server.microvm.image import PRUNE_AFTER_S, GuestImage, touch
from cc_server.microvm.link import VM_DIR_PREFIX, AgentLink, Request, hello_request, private_dir
from cc_server.microvm.proto import Frame
from cc_server.microvm.vm import (
    Confinement,
    MachineConfig,
    Qemu,
    QmpError,
    Share,
    confined_argv,
    qemu_argv,
)
from cc_server.rundir import egress_base_dir, names_of_dead_owners
from cc_server.tasks import start_task

__all__ = ["BOOT_TIMEOUT_S", "SavedState", "SpareKey", "Template", "Vm", "VmPool"]

log = logging.getLogger("cc_server.microvm")
SPARE_END_TIMEOUT_S: Final = 5.0  # a SIGKILLed process's end; milliseconds normally
BOOT_TIMEOUT_S: Final = 120.0  # a cold boot under TCG on a loaded 2-core host: seconds normally
# Bump when the machine's device set or CPU model changes, or how a state is saved (5: saved
# running, so a restore starts by itself; 6: TCG's CPU without ERMS and FSRM).
TEMPLATE_FORMAT: Final = 6
KVM_DEVICE: Final = "/dev/kvm"


@dataclass(frozen=True, slots=True, kw_only=True)
class Template:
    """A snapshot that new VMs restore: RAM file plus device state."""

    directory: Path
    ram: Path
    state: Path


FileId = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


def _file_id(path: Path) -> FileId:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedState:
    """A suspended VM's state file. `base`: the template RAM file it is a delta of, and that
    file's identity at the suspend (a resume maps it); None: a full state (every page)."""

    path: Path
    base: Path | None = None
    base_id: FileId | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SpareKey:
    """What a restored QEMU is given besides the pool's constants: a spare serves only a
    restore or resume with an equal key."""

    ram: Path | None  # the template's RAM file (a restore), None: anonymous RAM (a resume)
    shares: tuple[Share | None, ...]


@dataclass(eq=False)
class _Spare:
    """A QEMU being started, or waiting, with `-incoming defer` for `key`. Its task owns it
    until it is taken: ended with the task (a discard, or the event loop's end, which cancels
    it); `inner_pid` is a process in its mount namespace (QEMU under bubblewrap). The
    processes below the one started (bubblewrap's own and QEMU) die with it only by their
    parent-death signal, later: an end kills and waits for each of them too (`_pidfds`)."""

    key: SpareKey
    run_dir: Path
    loop: asyncio.AbstractEventLoop
    up: asyncio.Future[Qemu]
    task: asyncio.Task[None] | None = None
    inner_pid: int | None = None
    taken: bool = False
    _pidfds: tuple[int, ...] = ()

    async def keep(self, argv: tuple[str | FdArg, ...]) -> None:
        """Start QEMU and hold it until taken; end it otherwise (cancelled included)."""
        qemu: Qemu | None = None
        try:
            qemu = await Qemu.launch(argv, self.run_dir)
            await qemu.prepare_incoming(ignore_shared=self.key.ram is not None)
            chain = await asyncio.to_thread(_descendant_chain, qemu.pid)
            self._pidfds = _open_pidfds(chain)
            self.inner_pid = chain[-1] if chain else qemu.pid
            self.up.set_result(qemu)
            await asyncio.get_running_loop().create_future()  # until taken or discarded
        except BaseException as exc:
            if not self.up.done():
                self.up.set_exception(exc if isinstance(exc, Exception) else EnforcementFailed(
                    "the spare QEMU's start was cancelled"))
                self.up.exception()  # seen: a spare that failed is only not used
            raise
        finally:
            if not self.taken:
                try:
                    if qemu is not None:
                        await qemu.kill()
                    await _kill_and_wait(self._pidfds)
                finally:
                    self._close_pidfds()
                    shutil.rmtree(self.run_dir, ignore_errors=True)

    def _close_pidfds(self) -> None:
        pidfds, self._pidfds = self._pidfds, ()
        for pidfd in pidfds:
            os.close(pidfd)

    def take(self) -> Qemu:
        """Its QEMU, now the caller's (needs `up` done without an error)."""
        self.taken = True
        self._close_pidfds()  # the VM's end is Qemu's from here (as for a QEMU started anew)
        assert self.task is not None
        self.task.cancel()
        return self.up.result()

    async def discard(self) -> None:
        """End its QEMU (or its start) and remove its directory. Idempotent."""
        if self.task is not None and self.loop is asyncio.get_running_loop():
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
        # On a loop that has ended, the task ended with it (the loop cancels what runs at its
        # close) and QEMU with the task.
        shutil.rmtree(self.run_dir, ignore_errors=True)


class Vm:
    """One running QEMU and the agent link it serves; `phases`: how long its restore's steps
    took, in ms (start: QEMU up, or a spare taken; load: the state sent for loading; greet: the
    agent's answers, the restore's last step)."""

    def __init__(self, qemu: Qemu, run_dir: Path, link: AgentLink) -> None:
        self.qemu = qemu
        self.run_dir = run_dir
        self.link = link
        self.phases: dict[str, float] = {}
        self.from_spare = False

    async def stop(self) -> None:
        """Detach the agent link and end QEMU (even when cancelled or the link fails).
        Idempotent."""
        try:
            await self.link.detach()
        finally:
            await self.qemu.quit()


class VmPool:
    """Boots the template once (per image and accelerator) and restores VMs from it."""

    def __init__(
        self,
        *,
        qemu: str,
        image: GuestImage,
        config: MachineConfig,
        cache_dir: Path,
        bwrap: str | None = None,
        run_base: str | None = None,
        identity: SandboxIdentity | None = None,
    ) -> None:
        self.qemu = qemu
        self.bwrap = bwrap  # QEMU runs under bubblewrap when set (see vm.confined_argv)
        # A root server's QEMU runs as this identity (with bwrap only; see qemu_identity).
        self.identity = identity if bwrap is not None else None
        # Where the template boot's VM directory goes (None: the server's private base).
        self.run_base = run_base
        self.image = image
        self.config = config
        self.cache_dir = cache_dir
        self._lock = asyncio.Lock()
        self._template: Template | None = None
        self._family = f"{image.directory.name.removeprefix('image-')}-{config.accel}"
        # The snapshot's guest kernel was booted with the TSC rate: another rate, another one.
        clock = f"-tsc{config.tsc_khz}" if config.tsc_khz else ""
        self.template_dir = cache_dir / (
            f"template-{TEMPLATE_FORMAT}-{self._family}{clock}-{config.memory_mib}m"
        )
        self.empty_dir = cache_dir / "empty"
        self._spare: _Spare | None = None

    def _argv(
        self,
        run_dir: Path,
        *,
        ram: Path | None,
        ram_shared: bool,
        shares: Sequence[Share | None],
        incoming: bool,
    ) -> tuple[str | FdArg, ...]:
        """QEMU's command line, under bubblewrap when the probe found it.

        Raises:
            EnforcementFailed: QEMU's seccomp filter could not be built (QEMU does not run).
            BadSpec: a share overlaps the identity's stage directory.
        """
        argv = qemu_argv(
            self.qemu,
            self.image,
            self.config,
            run_dir=run_dir,
            ram_path=ram,
            ram_shared=ram_shared,
            shares=shares,
            empty_dir=self.empty_dir,
            incoming=incoming,
        )
        if self.bwrap is None:
            return argv
        writable = [str(run_dir)]
        if ram is not None and ram.parent != run_dir:
            # QEMU 7.2 opens a RAM file read-write even to map it copy-on-write (its `readonly`
            # makes guest RAM read-only), so the template's RAM file is the one file of the cache
            # it can reach writably; `template()` checks its hash (see the threat model).
            writable.append(str(ram))
        try:
            bpf = filter_bpf()
        except OSError as exc:
            raise EnforcementFailed(
                f"could not build QEMU's seccomp filter: {exc}",
                fix="install libseccomp2 (apt-get install libseccomp2)",
            ) from exc
        return confined_argv(
            Confinement(bwrap=self.bwrap,
                        read_only=(str(self.image.directory), str(self.empty_dir)),
                        writable=tuple(writable), kvm=self.config.accel == "kvm",
                        seccomp=bpf, identity=self.qemu_identity),
            argv,
            shares,
        )

    @property
    def qemu_identity(self) -> SandboxIdentity | None:
        """The host identity QEMU runs as, when not the server's: the sandbox identity of a root
        server, except under KVM when that identity may not open /dev/kvm (then QEMU stays the
        server's uid, with the procfs floor and the seccomp filter still on)."""
        if self.identity is None:
            return None
        if self.config.accel == "kvm" and not self._kvm_open_to_others():
            return None
        return self.identity

    def _kvm_open_to_others(self) -> bool:
        try:
            return os.stat(KVM_DEVICE).st_mode & 0o006 == 0o006
        except OSError:
            return False

    async def template(self) -> Template:
        """The snapshot, cold-booted on first use (cached on disk across restarts).

        Raises:
            EnforcementFailed: the VM did not boot or could not be saved.
        """
        async with self._lock:
            if self._template is None:
                ready = self.template_dir / "ready"
                if ready.exists() and not await asyncio.to_thread(self._intact):
                    # Every VM maps this RAM; a changed file would change every guest.
                    log.warning("microVM snapshot %s changed on disk; booting a new one",
                                self.template_dir)
                    shutil.rmtree(self.template_dir, ignore_errors=True)
                if not ready.exists():
                    await self._build_template()
                    self._prune_older_formats()
                touch(self.template_dir)
                self._template = Template(
                    directory=self.template_dir,
                    ram=self.template_dir / "ram.img",
                    state=self.template_dir / "state.bin",
                )
            return self._template

    def _prune_older_formats(self) -> None:
        """Remove this image's snapshots of another machine format or TSC rate (same
        accelerator) that nobody used for PRUNE_AFTER_S (another checkout sharing the cache may
        use one now)."""
        pattern = f"template-*-{self._family}*-{self.config.memory_mib}m"
        for entry in self.cache_dir.glob(pattern):
            with contextlib.suppress(OSError):
                stale = time.time() - entry.stat().st_mtime >= PRUNE_AFTER_S
                if entry != self.template_dir and entry.is_dir() and stale:
                    shutil.rmtree(entry, ignore_errors=True)

    def _intact(self) -> bool:
        """Whether the template's RAM file still has the hash it was saved with."""
        try:
            saved = (self.template_dir / "ram.sha256").read_text().strip()
        except OSError:
            return False
        return _sha256(self.template_dir / "ram.img") == saved

    def _remove_dead_builds(self) -> None:
        """Remove the half-built snapshots of servers that were killed while building one (a
        256 MiB RAM file each; `prune_cache` keeps every entry of the current image)."""
        build = re.compile(re.escape(self.template_dir.name) + r"\.build-(?P<pid>\d+)\Z")
        for name in names_of_dead_owners(str(self.cache_dir), build):
            shutil.rmtree(self.cache_dir / name, ignore_errors=True)

    async def _build_template(self) -> None:
        self.empty_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
        self._remove_dead_builds()
        work = self.template_dir.with_name(self.template_dir.name + f".build-{os.getpid()}")
        # The boot's sockets and logs live in a VM directory like a session's: a Unix socket
        # path must fit in 108 bytes (the cache directory may be deep), and the next boot kills
        # the QEMU of a server killed mid-build and removes the directory (remove_stale_vm_dirs).
        run = private_dir(self.run_base or egress_base_dir(), VM_DIR_PREFIX)
        try:
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True, mode=0o700)
            ram = work / "ram.img"
            with open(ram, "wb") as f:
                f.truncate(self.config.memory_mib << 20)
            link = AgentLink(lambda: None)
            qemu = await Qemu.launch(
                self._argv(run, ram=ram, ram_shared=True, shares=(), incoming=False), run
            )
            vm = Vm(qemu, run, link)
            try:
                try:
                    async with asyncio.timeout(BOOT_TIMEOUT_S):
                        await link.wait_startup(
                            run / "agent.sock", alive=lambda: qemu.returncode is None
                        )
                        await link.hello()
                except TimeoutError as exc:
                    raise EnforcementFailed(
                        f"the template VM did not boot in {BOOT_TIMEOUT_S} s: "
                        + _console_tail(run),
                        fix="check the accelerator (cc-server probe) and the image",
                    ) from exc
                await link.detach()
                fd = os.open(work / "state.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    await qemu.migrate_to(fd, ignore_shared=True)
                finally:
                    os.close(fd)
            finally:
                await vm.stop()
            (work / "ram.sha256").write_text(_sha256(work / "ram.img") + "\n")
            (work / "ready").write_text("")
            if not self.template_dir.exists():
                os.replace(work, self.template_dir)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(run, ignore_errors=True)

    async def restore(
        self,
        shares: Sequence[Share | None],
        link: AgentLink,
        then: Sequence[Request] = (),
    ) -> tuple[Vm, list[Frame]]:
        """A new VM from the template, running, its agent greeted (clock and entropy set), and
        the agent's answers to `then`, sent right behind the greeting. The VM's directory is new
        (`vm.run_dir`) and is removed here on failure.

        Raises:
            EnforcementFailed: QEMU did not start or the snapshot did not load.
        """
        template = await self.template()
        key = SpareKey(ram=template.ram, shares=tuple(shares))
        return await self._incoming(key, link, template.state, True, then)

    async def resume(
        self,
        shares: Sequence[Share | None],
        link: AgentLink,
        saved: SavedState,
        then: Sequence[Request] = (),
    ) -> tuple[Vm, list[Frame]]:
        """A suspended VM back from its state file, in a new directory (see `restore`).

        Raises:
            EnforcementFailed: QEMU did not start, the state did not load, or the template it
                is a delta of is not the file it was at the suspend.
        """
        if saved.base is None:
            # Anonymous RAM: the state file carries every page the guest used.
            return await self._incoming(SpareKey(ram=None, shares=tuple(shares)), link,
                                        saved.path, False, then)
        template = await self.template()
        try:
            same = saved.base == template.ram and _file_id(template.ram) == saved.base_id
        except OSError:
            same = False
        if not same:
            raise EnforcementFailed(
                "the microVM snapshot this suspended VM's state is a delta of changed after "
                "the suspend; the VM cannot be resumed",
                fix="destroy the sandbox and launch a new one",
            )
        # The template mapped as for a restore (the spare serves both), the delta loaded over it.
        return await self._incoming(SpareKey(ram=template.ram, shares=tuple(shares)), link,
                                    saved.path, False, then)

    async def _incoming(
        self,
        key: SpareKey,
        link: AgentLink,
        state: Path,
        ignore_shared: bool,
        then: Sequence[Request],
    ) -> tuple[Vm, list[Frame]]:
        started = time.perf_counter()
        with contextlib.suppress(OSError):  # read the state ahead while QEMU starts
            fd = os.open(state, os.O_RDONLY | os.O_CLOEXEC)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            os.close(fd)
        taken = await self._take_spare(key)
        qemu, run_dir = taken or await self._launch_incoming(key)
        vm = Vm(qemu, run_dir, link)
        vm.from_spare = taken is not None
        vm.phases["start"] = (time.perf_counter() - started) * 1000
        try:
            # Connect first: the console port drops what the guest writes while nobody listens.
            await link.attach(run_dir / "agent.sock", alive=lambda: qemu.returncode is None)
            fd = os.open(state, os.O_RDONLY | os.O_CLOEXEC)
            try:
                await qemu.start_incoming(fd, ignore_shared=ignore_shared)
            finally:
                os.close(fd)
            vm.phases["load"] = (time.perf_counter() - started) * 1000
            # The guest runs once its state is in; the greeting waits in the socket until then.
            replies = await link.request_many([hello_request(), *then])
            vm.phases["greet"] = (time.perf_counter() - started) * 1000
        except BaseException:
            try:
                await vm.stop()
            finally:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        self._start_spare(key)  # after this VM is up: its start does not compete with ours
        return vm, replies[1:]

    async def _launch_incoming(self, key: SpareKey) -> tuple[Qemu, Path]:
        """A QEMU for `key` in a new VM directory, waiting for its state (`-incoming defer`).

        Raises:
            EnforcementFailed: QEMU did not start (its directory is removed).
        """
        run_dir = private_dir(self.run_base or egress_base_dir(), VM_DIR_PREFIX)
        try:
            argv = self._argv(run_dir, ram=key.ram, ram_shared=False, shares=key.shares,
                              incoming=True)
            return await Qemu.launch(argv, run_dir), run_dir
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise

    def _start_spare(self, key: SpareKey) -> None:
        """Start the spare for `key`, ending the one there was (never two per pool)."""
        old, self._spare = self._spare, None
        if old is not None:  # a taken spare is no longer here: this one is of another key
            start_task(old.discard(), name="microvm spare discard")
        loop = asyncio.get_running_loop()
        run_dir = private_dir(self.run_base or egress_base_dir(), VM_DIR_PREFIX)
        try:
            argv = self._argv(run_dir, ram=key.ram, ram_shared=False, shares=key.shares,
                              incoming=True)
        except CcServerError:
            shutil.rmtree(run_dir, ignore_errors=True)
            return  # the next restore with this key fails the same way, with its own error
        spare = _Spare(key=key, run_dir=run_dir, loop=loop, up=loop.create_future())
        spare.task = start_task(spare.keep(argv), name="microvm spare")
        self._spare = spare

    async def _take_spare(self, key: SpareKey) -> tuple[Qemu, Path] | None:
        """The spare's QEMU and directory when it was started for `key` and each share is
        still, in QEMU's mount namespace, the directory the host has at its path; otherwise
        the spare is ended and None returned."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        if spare.key == key and spare.loop is asyncio.get_running_loop():
            try:
                qemu = await asyncio.shield(spare.up)  # it may be starting still
            except Exception:
                qemu = None
            except BaseException:
                await spare.discard()
                raise
            paths = [share.host_path for share in key.shares if share is not None]
            if (qemu is not None and qemu.returncode is None and spare.inner_pid is not None
                    and bound_as_on_host(spare.inner_pid, paths)):
                return spare.take(), spare.run_dir
        await spare.discard()
        return None

    @property
    def spare_run_dir(self) -> Path | None:
        """The spare QEMU's directory (its `-name`), while there is one."""
        return self._spare.run_dir if self._spare is not None else None

    async def aclose(self) -> None:
        """End the spare QEMU. Idempotent; the pool still serves (without a spare until the
        next restore)."""
        spare, self._spare = self._spare, None
        if spare is not None:
            await spare.discard()

    async def suspend(self, vm: Vm, state: Path) -> SavedState:
        """Save `vm` to `state`, end its QEMU, and cut the file to a delta against the template
        (kept whole when the stream is not one microvm.delta rewrites).

        Raises:
            EnforcementFailed: QEMU refused to save it (the VM keeps running).
        """
        await vm.link.detach()
        fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            await vm.qemu.migrate_to(fd, ignore_shared=False)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                state.unlink()
            with contextlib.suppress(QmpError):  # a failed migration runs the VM again itself
                await vm.qemu.execute("cont")
            await vm.link.attach(vm.run_dir / "agent.sock", alive=lambda: True)
            raise
        os.close(fd)
        await vm.qemu.quit()
        template = await self.template()
        try:
            base_id = _file_id(template.ram)
            await _in_thread(write_delta, state, state, template.ram)
        except (DeltaRefused, OSError) as exc:
            log.warning("microVM state %s kept whole (not cut to a delta): %s", state, exc)
            return SavedState(path=state)
        return SavedState(path=state, base=template.ram, base_id=base_id)


async def _in_thread(func: Callable[..., int], *args: object) -> int:
    """`func(*args)` in a thread, waited for even when cancelled (it writes a file in the VM's
    directory: a teardown that removed it meanwhile could leave its last write behind)."""
    job = start_task(asyncio.to_thread(func, *args), name="microvm state delta")
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await job
        raise


def _descendant_chain(root: int) -> list[int]:
    """The chain of processes below `root` (each one's first child), nearest first."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(name))
    chain: list[int] = []
    pid = root
    while children.get(pid):
        pid = min(children[pid])
        chain.append(pid)
    return chain


def _open_pidfds(pids: Sequence[int]) -> tuple[int, ...]:
    """A pidfd for each of `pids` still alive."""
    pidfds = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            pidfds.append(os.pidfd_open(pid))
    return tuple(pidfds)


async def _kill_and_wait(pidfds: Sequence[int]) -> None:
    """SIGKILL each process and wait until each has ended (at most SPARE_END_TIMEOUT_S)."""
    loop = asyncio.get_running_loop()
    for pidfd in pidfds:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        ended: asyncio.Future[None] = loop.create_future()

        def readable(future: asyncio.Future[None] = ended) -> None:
            if not future.done():
                future.set_result(None)

        loop.add_reader(pidfd, readable)
        try:
            async with asyncio.timeout(SPARE_END_TIMEOUT_S):
                await ended
        except TimeoutError:
            log.warning("a spare QEMU's process (pidfd %d) did not end", pidfd)
        finally:
            loop.remove_reader(pidfd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _console_tail(run_dir: Path) -> str:
    with contextlib.suppress(OSError):
        text = (run_dir / "console.log").read_text(errors="replace").strip()
        return text[-400:] or "(no console output)"
    return "(no console log)"
