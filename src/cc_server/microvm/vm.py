"""One QEMU process: its command line (pure), its start through the runner, and its control
through QMP over a Unix socket (asyncio, no library: a dozen commands, one JSON object a line).

The machine is QEMU's `microvm`: no PCI, no firmware, no disk; the guest RAM is a file-backed
memory backend (so a snapshot can leave it out and a restore can map it copy-on-write), a
virtio-serial console port carries the agent protocol, and a fixed number of virtio-9p devices
("slots") carry the session's bind mounts. Every slot exists in every VM, pointed at an empty
read-only directory when unused, so one snapshot fits every session whatever its mounts.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import os
import signal
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from cc_server.backends.bubblewrap import PROC_MASKED, PROC_READ_ONLY
from cc_server.backends.identity import identity_argv
from cc_server.backends.plan import FdArg, LaunchPlan, SandboxIdentity
from cc_server.backends.runner import start
from cc_server.errors import EnforcementFailed
from cc_server.microvm.image import GuestImage
from cc_server.policy import SandboxBackend

__all__ = [
    "MOUNT_SLOTS",
    "Confinement",
    "MachineConfig",
    "Qemu",
    "QmpClient",
    "QmpError",
    "Share",
    "confined_argv",
    "qemu_argv",
    "slot_tag",
]

# microvm has 8 virtio-mmio transports: one for the agent's console port, six for mounts, one
# spare. Raising it changes every snapshot (the device set travels in the migration stream).
MOUNT_SLOTS: Final = 6
GUEST_RAM_MIB: Final = 256
KERNEL_CMDLINE: Final = (
    "console=ttyS0 rdinit=/init panic=-1 reboot=t quiet loglevel=1 init_on_free=1"
)
# The TSC rate a guest is told when the host's is not known. Under TCG the guest cannot calibrate
# its TSC (its PIT timing fails, it has no HPET), so with a wrong rate its clock watchdog drops
# the TSC and it counts jiffies: a 4 ms clock, and a timer tick every 4 ms even when idle.
NOMINAL_TSC_KHZ: Final = 2_000_000
QMP_CONNECT_TIMEOUT_S: Final = 10.0  # QEMU creates its QMP socket within ~50 ms normally
QMP_COMMAND_TIMEOUT_S: Final = 30.0
QMP_LINE_LIMIT: Final = 1 << 20  # one QMP reply line
QUIT_GRACE_S: Final = 5.0
# Bytes/s: a save to a file is not throttled (QEMU's default, 128 MiB/s, made a suspend ~0.45 s).
SAVE_BANDWIDTH: Final = 1 << 40
# QEMU's own seccomp filter: no spawning helpers, no privilege changes, no obsolete syscalls.
QEMU_SANDBOX: Final = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"


def slot_tag(index: int) -> str:
    """The 9p mount tag of slot `index` (what the agent mounts)."""
    return f"ccm{index}"


@dataclass(frozen=True, slots=True, kw_only=True)
class MachineConfig:
    """What must be identical between a snapshot and every restore of it."""

    accel: str  # "kvm" or "tcg"
    memory_mib: int = GUEST_RAM_MIB
    cpus: int = 1
    # Under TCG the guest's TSC is the host's: its rate (probe.host_tsc_khz), or None if unknown.
    tsc_khz: int | None = None

    @property
    def cmdline(self) -> str:
        """The guest kernel's command line. With the host's TSC rate a TCG guest keeps the TSC
        as its clock (`tsc=reliable`: its only other clock, jiffies, lags under a loaded host
        and would fail the TSC): a nanosecond clock, and no timer tick while idle."""
        if self.accel == "tcg" and self.tsc_khz:
            return f"{KERNEL_CMDLINE} tsc_early_khz={self.tsc_khz} tsc=reliable"
        return f"{KERNEL_CMDLINE} tsc_early_khz={NOMINAL_TSC_KHZ}"

    @property
    def cpu(self) -> str:
        """`host` under KVM; otherwise the widest model TCG emulates, less ERMS and FSRM: with
        them the guest kernel copies and clears memory with `rep movsb` / `rep stosb`, which TCG
        runs a byte per iteration (`rep movsq` moves eight; QEMU CPU per exec of `true` 14.5 ->
        12.5 ms, interleaved in one run)."""
        return "host" if self.accel == "kvm" else "max,-erms,-fsrm"


@dataclass(frozen=True, slots=True, kw_only=True)
class Share:
    """A host directory behind one slot."""

    host_path: str
    read_only: bool


def _opt(value: str) -> str:
    """A value inside a QEMU `-opt a=b,c=d` list: commas are doubled."""
    return value.replace(",", ",,")


def qemu_argv(
    qemu: str,
    image: GuestImage,
    config: MachineConfig,
    *,
    run_dir: Path,
    ram_path: Path | None,
    ram_shared: bool,
    shares: Sequence[Share | None],
    empty_dir: Path,
    incoming: bool,
) -> tuple[str, ...]:
    """The QEMU command line for one VM; runs nothing.

    `ram_shared`: map the RAM file MAP_SHARED (the VM that boots and snapshots it) or
    copy-on-write (every restore: the file never changes); `ram_path=None`: anonymous RAM (a
    resume, whose state file carries every page). `shares` fills the slots in order;
    `None` and missing slots get `empty_dir`, read-only. Every share is `security_model=none`
    (files keep the QEMU user's ownership) and read-only at the host when `read_only`: the
    guest kernel cannot write through it whatever runs inside.
    """
    if len(shares) > MOUNT_SLOTS:
        raise ValueError(f"{len(shares)} shares for {MOUNT_SLOTS} slots")
    mem = config.memory_mib
    argv = [
        qemu,
        "-name", str(run_dir),  # how a restarted server finds the QEMU of a killed one
        "-accel", config.accel,
        "-cpu", config.cpu,
        "-M", "microvm,pit=on,pic=on,rtc=on,memory-backend=mem0",
        "-m", f"{mem}M",
        "-smp", str(config.cpus),
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-object",
        f"memory-backend-file,id=mem0,size={mem}M,mem-path={_opt(str(ram_path))},"
        f"share={'on' if ram_shared else 'off'}"
        if ram_path is not None
        else f"memory-backend-ram,id=mem0,size={mem}M",
    ]
    if not incoming:
        # A restore's guest kernel is in the snapshot's RAM already: without these QEMU neither
        # reads the ~66 MB kernel nor keeps it for firmware that never runs again (no reboot).
        argv += ["-kernel", str(image.kernel), "-initrd", str(image.initrd),
                 "-append", config.cmdline]
    argv += [
        "-serial", f"file:{run_dir / 'console.log'}",
        "-device", "virtio-serial-device",
        "-chardev", f"socket,id=agent,path={_opt(str(run_dir / 'agent.sock'))},server=on,wait=off",
        "-device", "virtconsole,chardev=agent",
    ]
    for index in range(MOUNT_SLOTS):
        share = shares[index] if index < len(shares) else None
        path, read_only = (
            (share.host_path, share.read_only) if share else (str(empty_dir), True)
        )
        argv += [
            "-fsdev",
            f"local,id=fs{index},path={_opt(path)},security_model=none"
            + (",readonly=on" if read_only else ""),
            "-device", f"virtio-9p-device,fsdev=fs{index},mount_tag={slot_tag(index)}",
        ]
    argv += ["-qmp", f"unix:{_opt(str(run_dir / 'qmp.sock'))},server=on,wait=off"]
    argv += ["-sandbox", QEMU_SANDBOX]
    if incoming:
        argv += ["-incoming", "defer"]
    return tuple(argv)


# The host directories QEMU needs besides the VM's own files: its binary, libraries and firmware.
_SYSTEM_DIRS: Final = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr")


@dataclass(frozen=True, slots=True, kw_only=True)
class Confinement:
    """What QEMU may see when it runs under bubblewrap: everything else of the host is gone."""

    bwrap: str  # absolute, resolved by the probe
    read_only: tuple[str, ...]  # the image, the template, the empty slot directory
    writable: tuple[str, ...]  # the VM's run directory (the template's, while it is built)
    # The filter bwrap loads on QEMU (backends/seccomp.filter_bpf): among the rest, no set-id bit
    # in any mode QEMU sets, so a guest's `chmod 4755` in a share gets EPERM from the host.
    seccomp: bytes = field(repr=False)
    kvm: bool = False
    # A root server's QEMU runs as the sandbox identity through cc-identity (None: as the server).
    identity: SandboxIdentity | None = None


def confined_argv(
    confinement: Confinement,
    argv: tuple[str, ...],
    shares: Sequence[Share | None],
    *,
    is_symlink: Callable[[str], bool] = os.path.islink,
    readlink: Callable[[str], str] = os.readlink,
    exists: Callable[[str], bool] = os.path.exists,
    is_dir: Callable[[str], bool] = os.path.isdir,
) -> tuple[str | FdArg, ...]:
    """`argv` (a QEMU command line) wrapped in bubblewrap: new user-invisible namespaces for
    everything (QEMU needs no network: the guest has no network device), the system directories
    read-only, procfs with its host-global knobs read-only or masked (the native sandbox's
    floor), the VM's files, and each share at its own path, read-only where the share is
    (a second lock besides `-fsdev readonly=on`), then the seccomp filter. QEMU dies with the
    server (`--die-with-parent`), so a killed server leaves no VM running.

    With an identity, `cc-identity` starts bubblewrap as that uid and gid, with the VM's files
    and the shares idmapped to their owners and bound from its stage: QEMU is not host uid 0,
    and what the guest creates in a share belongs on the host to the share's owner.

    Pure: runs nothing.

    Raises:
        BadSpec: a share overlaps the identity's stage directory.
    """
    out: list[str | FdArg] = [
        confinement.bwrap, "--die-with-parent", "--unshare-all", "--new-session", "--clearenv",
        "--proc", "/proc",
    ]  # fmt: skip
    for path in PROC_READ_ONLY:
        if exists(path):
            out += ["--ro-bind", path, path]
    for path in PROC_MASKED:
        if not exists(path):
            continue
        if is_dir(path):
            out += ["--tmpfs", path, "--remount-ro", path]
        else:
            out += ["--ro-bind", "/dev/null", path]
    out += ["--dev", "/dev"]
    for path in _SYSTEM_DIRS:
        if is_symlink(path):
            out += ["--symlink", readlink(path), path]
        elif exists(path):
            out += ["--ro-bind", path, path]
    if exists("/etc/ld.so.cache"):
        out += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    if confinement.kvm:
        out += ["--dev-bind", "/dev/kvm", "/dev/kvm"]
    roots: list[str] = []
    for path in confinement.read_only:
        out += ["--ro-bind", path, path]
        roots.append(path)
    for path in confinement.writable:
        out += ["--bind", path, path]
        roots.append(path)
    for share in shares:
        if share is not None:
            out += ["--ro-bind" if share.read_only else "--bind", share.host_path, share.host_path]
            roots.append(share.host_path)
    out += ["--seccomp", FdArg(name="qemu-seccomp.bpf", data=confinement.seccomp)]
    out += ["--", *argv]
    if confinement.identity is None:
        return tuple(out)
    return tuple(identity_argv(out, confinement.identity, roots))




QmpCommand = tuple[str, dict[str, Any] | None, int | None]  # command, arguments, fd to pass


class QmpError(EnforcementFailed):
    """QEMU refused a QMP command or went away."""


class QmpClient:
    """QMP over a Unix socket: one command at a time, events skipped."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, path: Path, alive: Qemu) -> QmpClient:
        """Connect once QEMU has created its socket; negotiate capabilities.

        Raises:
            QmpError: QEMU exited, or did not answer in time.
        """
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(QMP_CONNECT_TIMEOUT_S):
            while True:
                if alive.returncode is not None:
                    raise QmpError(f"QEMU exited at start: {alive.stderr_tail()}")
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, str(path))
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    sock.close()
                    await asyncio.sleep(0.002)
        client = cls(sock)
        try:
            await client._read_json()  # the greeting
            await client.execute("qmp_capabilities")
        except BaseException:
            client.close()
            raise
        return client

    async def _read_json(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        while b"\n" not in self._buf:
            if len(self._buf) > QMP_LINE_LIMIT:
                raise QmpError("oversized QMP reply")
            try:
                chunk = await loop.sock_recv(self._sock, 65536)
            except OSError as exc:
                raise QmpError(f"QEMU's QMP socket failed: {exc}") from exc
            if not chunk:
                raise QmpError("QEMU closed its QMP socket")
            self._buf += chunk
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        value = json.loads(line)
        if not isinstance(value, dict):
            raise QmpError(f"unexpected QMP line {line[:200]!r}")
        return value

    async def execute(
        self, command: str, arguments: dict[str, Any] | None = None, *, fd: int | None = None
    ) -> Any:
        """Run one command and return its `return` value; `fd` rides along (SCM_RIGHTS), for
        `getfd`.

        Raises:
            QmpError: QEMU answered with an error, went away, or did not answer in time.
        """
        try:
            return await self._execute(command, arguments, fd)
        except TimeoutError as exc:
            raise QmpError(f"QMP {command}: no answer in {QMP_COMMAND_TIMEOUT_S} s") from exc

    async def _execute(self, command: str, arguments: dict[str, Any] | None,
                       fd: int | None) -> Any:
        return (await self._execute_many([(command, arguments, fd)]))[0]

    async def execute_many(self, commands: Sequence[QmpCommand]) -> list[Any]:
        """Send every command at once, then read their answers in order: QEMU runs them in
        order, and a QMP round trip costs milliseconds on a loaded host.

        Raises:
            QmpError: a command failed (the first failure; QEMU still ran the ones after it,
                so the caller ends this QEMU), QEMU went away, or it did not answer in time.
        """
        try:
            return await self._execute_many(commands)
        except TimeoutError as exc:
            first = commands[0][0]
            raise QmpError(f"QMP {first}…: no answer in {QMP_COMMAND_TIMEOUT_S} s") from exc

    async def _execute_many(self, commands: Sequence[QmpCommand]) -> list[Any]:
        loop = asyncio.get_running_loop()
        async with self._lock, asyncio.timeout(QMP_COMMAND_TIMEOUT_S):
            for command, arguments, fd in commands:
                message: dict[str, Any] = {"execute": command}
                if arguments:
                    message["arguments"] = arguments
                data = json.dumps(message).encode() + b"\n"
                try:
                    if fd is not None:
                        fds = array.array("i", [fd])
                        self._sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                    else:
                        await loop.sock_sendall(self._sock, data)
                except OSError as exc:
                    raise QmpError(f"QMP {command}: {exc}") from exc
            results: list[Any] = []
            failure: QmpError | None = None
            for command, _, _ in commands:
                while True:
                    reply = await self._read_json()
                    if "return" in reply:
                        results.append(reply["return"])
                        break
                    if "error" in reply:
                        failure = failure or QmpError(
                            f"QMP {command}: {reply['error'].get('desc', reply)}")
                        results.append(None)
                        break
            if failure is not None:
                raise failure
            return results

    def close(self) -> None:
        """Close the socket. Idempotent."""
        self._sock.close()


def _ignore_shared(on: bool) -> dict[str, Any]:
    return {"capabilities": [{"capability": "x-ignore-shared", "state": on}]}


class Qemu:
    """A running QEMU process, started through the runner, and its QMP connection."""

    def __init__(self, proc: asyncio.subprocess.Process, run_dir: Path) -> None:
        self.proc = proc
        self.run_dir = run_dir
        self.qmp: QmpClient | None = None
        self._transport: asyncio.SubprocessTransport | None = None
        self._incoming_capabilities: bool | None = None  # x-ignore-shared, once set ahead

    @property
    def pid(self) -> int:
        """QEMU's pid."""
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """Its exit status once it has exited."""
        return self.proc.returncode

    def stderr_tail(self) -> str:
        """The end of QEMU's stderr log, for error messages."""
        with contextlib.suppress(OSError):
            return (self.run_dir / "qemu.log").read_text(errors="replace")[-600:].strip()
        return ""

    @classmethod
    async def launch(cls, argv: tuple[str | FdArg, ...], run_dir: Path) -> Qemu:
        """Start QEMU with an empty environment and wait for its QMP socket.

        Raises:
            EnforcementFailed: QEMU did not start or did not answer.
        """
        plan = LaunchPlan(backend=SandboxBackend.MICROVM, argv=argv, env=(), cwd=str(run_dir))
        log = os.open(run_dir / "qemu.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            proc, transport = await start(
                plan, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log
            )
        finally:
            os.close(log)
        qemu = cls(proc, run_dir)
        qemu._transport = transport  # closed once QEMU has exited (closing it kills QEMU)
        try:
            qemu.qmp = await QmpClient.connect(run_dir / "qmp.sock", qemu)
        except QmpError as exc:
            await qemu.kill()
            raise QmpError(f"{exc.message}; QEMU said: {qemu.stderr_tail() or '(nothing)'}",
                           fix="check the accelerator and the QEMU install") from exc
        except BaseException:
            await qemu.kill()
            raise
        return qemu

    async def execute(
        self, command: str, arguments: dict[str, Any] | None = None, *, fd: int | None = None
    ) -> Any:
        """A QMP command (see QmpClient.execute)."""
        return await self._qmp().execute(command, arguments, fd=fd)

    def _qmp(self) -> QmpClient:
        if self.qmp is None:
            raise QmpError("QEMU's QMP connection is closed")
        return self.qmp

    async def migrate_to(self, fd: int, *, ignore_shared: bool) -> None:
        """Write the VM's state to `fd` (a file) and wait until done. The VM runs while its RAM is
        copied and is stopped for the last pass (QEMU's live migration): the state records it
        running, so a restore of it starts by itself (`start_incoming`).

        Raises:
            QmpError: the migration failed (a 9p share still mounted blocks it).
        """
        await self._qmp().execute_many([
            ("migrate-set-capabilities", _ignore_shared(ignore_shared), None),
            ("migrate-set-parameters", {"max-bandwidth": SAVE_BANDWIDTH}, None),
            ("getfd", {"fdname": "migration-out"}, fd),
            ("migrate", {"uri": "fd:migration-out"}, None),
        ])
        try:
            async with asyncio.timeout(QMP_COMMAND_TIMEOUT_S):
                while True:
                    info = await self.execute("query-migrate")
                    status = info.get("status")
                    if status == "completed":
                        return
                    if status in ("failed", "cancelled"):
                        raise QmpError(f"saving the VM failed: {info.get('error-desc', status)}")
                    await asyncio.sleep(0.002)
        except TimeoutError as exc:
            raise QmpError(f"saving the VM took over {QMP_COMMAND_TIMEOUT_S} s") from exc

    async def start_incoming(self, fd: int, *, ignore_shared: bool) -> None:
        """Start loading a state file into a QEMU started with `-incoming defer`. A state saved
        from a running VM (`migrate_to` never stops it first) runs as soon as it is loaded:
        nothing here waits for the load, and no `cont` is needed; a load that fails ends QEMU,
        which closes the agent's socket.

        Raises:
            QmpError: QEMU refused to start the load.
        """
        commands: list[QmpCommand] = []
        if self._incoming_capabilities != ignore_shared:
            commands.append(("migrate-set-capabilities", _ignore_shared(ignore_shared), None))
        await self._qmp().execute_many([
            *commands,
            ("getfd", {"fdname": "migration-in"}, fd),
            ("migrate-incoming", {"uri": "fd:migration-in"}, None),
        ])

    async def prepare_incoming(self, *, ignore_shared: bool) -> None:
        """Set the load's capabilities ahead of `start_incoming` (a spare, before it is needed).

        Raises:
            QmpError: QEMU refused them.
        """
        await self.execute("migrate-set-capabilities", _ignore_shared(ignore_shared))
        self._incoming_capabilities = ignore_shared

    async def quit(self) -> None:
        """Ask QEMU to quit, then kill it if it lingers; killed too when cancelled. Idempotent."""
        try:
            if self.returncode is None and self.qmp is not None:
                with contextlib.suppress(QmpError, OSError, TimeoutError):
                    async with asyncio.timeout(QUIT_GRACE_S):
                        await self.execute("quit")
                        await self.proc.wait()
        finally:
            await self.kill()

    async def kill(self) -> None:
        """SIGKILL QEMU and reap it. Idempotent."""
        if self.qmp is not None:
            self.qmp.close()
            self.qmp = None
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()
        if self._transport is not None:
            self._transport.close()
            self._transport = None
