"""The microVM probe: QEMU present, a guest image available, and a boot test that says which
accelerator really works (`kvm`, `tcg`) or why none does.

A `/dev/kvm` that opens is not trusted: nested or software KVM can accept `KVM_CREATE_VM` and
then hang the guest at its first instruction. KVM counts only when a guest booted under it and
its agent answered within `KVM_BOOT_TIMEOUT_S`; otherwise TCG is tried the same way. Three
tiers, as in the native probe: `MicroVMFacts` (what was learned, injectable), `decide()` (pure),
and `probe_microvm()` (the I/O).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from cc_server.backends.identity import SANDBOX_GID, SANDBOX_UID, IdentityCheck, check_identity
from cc_server.backends.microvm_verdict import microvm_unavailable
from cc_server.backends.plan import SandboxIdentity
from cc_server.errors import BackendUnavailable, CcServerError
from cc_server.microvm.clock import host_tsc_khz
from cc_server.microvm.image import (
    GuestImage,
    Progress,
    ensure_image,
    prune_cache,
    stderr_progress,
)
from cc_server.microvm.pool import VmPool
from cc_server.microvm.vm import MachineConfig

__all__ = [
    "KVM_BOOT_TIMEOUT_S",
    "QEMU_PACKAGE_HINT",
    "AgentChannel",
    "BootOutcome",
    "MicroVMFacts",
    "MicroVMProbe",
    "choose_agent_channel",
    "decide",
    "probe_microvm",
]

QEMU_BINARY: Final = "qemu-system-x86_64"
QEMU_PACKAGE_HINT: Final = "sudo apt-get install qemu-system-x86 busybox-static"
KVM_DEVICE: Final = "/dev/kvm"
VHOST_VSOCK_DEVICE: Final = "/dev/vhost-vsock"
# A working KVM boots this guest to its agent in well under a second; a broken one hangs.
KVM_BOOT_TIMEOUT_S: Final = 20.0
TCG_BOOT_TIMEOUT_S: Final = 120.0  # software emulation on a small, loaded host


@dataclass(frozen=True, slots=True, kw_only=True)
class BootOutcome:
    """One boot test: did the guest's agent answer under this accelerator, and if not, why."""

    ok: bool
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentChannel:
    """What carries the agent protocol between the server and a VM, and why that one."""

    kind: str  # "virtio-serial": a virtconsole port on a QEMU Unix socket chardev
    reason: str


def choose_agent_channel(*, vhost_vsock: bool) -> AgentChannel:
    """The agent's channel on this host; pure. virtio-serial is the one built, and the fallback
    of every host: a vhost-vsock channel would skip QEMU's chardev hop (profiled at a few
    percent of an exec under TCG), but needs a per-VM guest CID, the agent listening on vsock
    and the server checking the peer's CID (any host process may connect to a guest's vsock
    port), which are designed, not built; so `/dev/vhost-vsock` is reported, not used."""
    if not vhost_vsock:
        return AgentChannel(kind="virtio-serial", reason=(
            f"{VHOST_VSOCK_DEVICE} is missing (no vhost_vsock in the host kernel): virtio-serial"))
    return AgentChannel(kind="virtio-serial", reason=(
        f"{VHOST_VSOCK_DEVICE} is present, but the vsock agent channel is not built: "
        "virtio-serial"))


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroVMFacts:
    """What the probe learned; tests build these by hand."""

    qemu: str | None  # absolute path, or None when QEMU is not installed
    kvm_usable: bool  # /dev/kvm exists and this user may open it
    image_error: str | None = None  # why no guest image could be had (None: it is there)
    kvm_boot: BootOutcome | None = None  # None: not tried
    tcg_boot: BootOutcome | None = None
    qemu_confined: bool = False  # QEMU runs under bubblewrap (bwrap found)


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroVMProbe:
    """The verdict: which accelerator a VM gets here, or why there is none."""

    available: bool
    accel: str | None  # "kvm", "tcg" or None
    reason: str  # one line: what works, or what is missing
    fix: str | None = None
    qemu: str | None = None
    kvm_detail: str = ""  # why KVM was not used, when it was not
    qemu_confined: bool = False  # QEMU itself runs under bubblewrap
    qemu_uid: int | None = None  # the host uid QEMU runs as (None: no VM here)
    channel: AgentChannel | None = None  # the agent's channel (None: no VM here)

    def to_json(self) -> dict[str, object]:
        """JSON-ready form (cc-server probe, logs)."""
        return {
            "available": self.available,
            "accelerator": self.accel,
            "reason": self.reason,
            "fix": self.fix,
            "qemu": self.qemu,
            "kvmDetail": self.kvm_detail or None,
            "qemuConfined": self.qemu_confined,
            "qemuUid": self.qemu_uid,
            "agentChannel": self.channel.kind if self.channel else None,
            "agentChannelReason": self.channel.reason if self.channel else None,
        }

    def unavailable_error(self) -> BackendUnavailable:
        """The loud failure of an explicit `microvm` request on this host."""
        return microvm_unavailable(self)


def decide(facts: MicroVMFacts) -> MicroVMProbe:
    """The verdict from the facts; touches nothing."""
    if facts.qemu is None:
        return MicroVMProbe(
            available=False, accel=None, reason=f"{QEMU_BINARY} is not installed",
            fix=QEMU_PACKAGE_HINT,
        )
    if facts.image_error is not None:
        return MicroVMProbe(
            available=False, accel=None, qemu=facts.qemu,
            reason=f"no guest image: {facts.image_error}",
            fix="run scripts/bootstrap (builds the agent) on Debian/Ubuntu amd64 with apt",
        )
    if not facts.kvm_usable:
        kvm_detail = f"{KVM_DEVICE} is missing or not accessible"
    elif facts.kvm_boot is None:
        kvm_detail = "KVM was not boot-tested"
    elif facts.kvm_boot.ok:
        return MicroVMProbe(
            available=True, accel="kvm", qemu=facts.qemu, qemu_confined=facts.qemu_confined,
            reason="QEMU microvm under KVM: a guest booted and its agent answered"
            + _confinement(facts),
        )
    else:
        kvm_detail = f"a guest did not boot under KVM ({facts.kvm_boot.detail})"
    if facts.tcg_boot is not None and facts.tcg_boot.ok:
        return MicroVMProbe(
            available=True, accel="tcg", qemu=facts.qemu, kvm_detail=kvm_detail,
            qemu_confined=facts.qemu_confined,
            reason=f"QEMU microvm under TCG (software emulation): {kvm_detail}"
            + _confinement(facts),
        )
    tcg = facts.tcg_boot.detail if facts.tcg_boot is not None else "not tried"
    return MicroVMProbe(
        available=False, accel=None, qemu=facts.qemu, kvm_detail=kvm_detail,
        reason=f"no accelerator boots a guest: {kvm_detail}; TCG: {tcg}",
        fix="check QEMU's log in the microVM cache directory; on a KVM host, check /dev/kvm",
    )


def _confinement(facts: MicroVMFacts) -> str:
    if facts.qemu_confined:
        return "; QEMU runs under bubblewrap"
    return "; QEMU runs unconfined by bubblewrap (bwrap not found: apt-get install bubblewrap)"


BootTest = Callable[[str], Awaitable[BootOutcome]]


@dataclass(slots=True, kw_only=True)
class ProbeParams:
    """Where the probe keeps the image and snapshots, and how it reports progress."""

    cache_dir: Path
    which: Callable[[str], str | None] = field(default=shutil.which)
    kvm_device: str = KVM_DEVICE
    accels: tuple[str, ...] = ("kvm", "tcg")  # tried in this order
    run_base: str | None = None  # where VM directories go (None: the server's private base)
    # Whether a root server has a working sandbox identity for QEMU (backends/identity.py).
    identity_check: Callable[[], IdentityCheck] = field(default=check_identity)
    progress: Progress = stderr_progress  # the image build's (first use); the CLI daemon's client's


async def probe_microvm(params: ProbeParams) -> tuple[MicroVMProbe, VmPool | None]:
    """Probe this host: find QEMU, build the image (first use), boot-test KVM then TCG. The
    boot under the winning accelerator is the template snapshot every session restores, so it
    is never wasted; a verdict for KVM is kept on disk beside the snapshots.

    Returns the verdict and, when available, the pool of that accelerator.
    """
    qemu = params.which(QEMU_BINARY)
    qemu = os.path.realpath(qemu) if qemu else None
    bwrap = params.which("bwrap")  # confines QEMU itself when present (vm.confined_argv)
    bwrap = os.path.realpath(bwrap) if bwrap else None
    kvm_usable = os.path.exists(params.kvm_device) and os.access(
        params.kvm_device, os.R_OK | os.W_OK
    )
    identity, identity_note = _qemu_identity(params.identity_check())
    if qemu is None:
        return decide(MicroVMFacts(qemu=None, kvm_usable=kvm_usable)), None
    try:
        image = await asyncio.to_thread(ensure_image, params.cache_dir, None, params.progress)
    except CcServerError as exc:
        return decide(MicroVMFacts(qemu=qemu, kvm_usable=kvm_usable, image_error=exc.message)), None
    prune_cache(params.cache_dir, image)
    outcomes: dict[str, BootOutcome] = {}
    pools: dict[str, VmPool] = {}
    tcg = "tcg" in params.accels
    tsc_khz = await asyncio.to_thread(host_tsc_khz, params.cache_dir) if tcg else None
    for accel in params.accels:
        if accel == "kvm" and not kvm_usable:
            continue
        config = MachineConfig(accel=accel, tsc_khz=tsc_khz if accel == "tcg" else None)
        pool = VmPool(qemu=qemu, image=image, config=config,
                      cache_dir=params.cache_dir, bwrap=bwrap, run_base=params.run_base,
                      identity=identity)
        outcomes[accel] = await _boot_test(pool, params.cache_dir, image)
        pools[accel] = pool
        if outcomes[accel].ok:
            break
    verdict = decide(
        MicroVMFacts(
            qemu=qemu,
            kvm_usable=kvm_usable,
            kvm_boot=outcomes.get("kvm"),
            tcg_boot=outcomes.get("tcg"),
            qemu_confined=bwrap is not None,
        )
    )
    chosen = pools.get(verdict.accel) if verdict.accel else None
    if chosen is None:
        return verdict, None
    as_identity = chosen.qemu_identity
    qemu_uid = as_identity.uid if as_identity is not None else os.geteuid()
    note = f"; QEMU runs as host uid {qemu_uid}"
    if as_identity is None and os.geteuid() == 0:
        if bwrap is None:
            note += " (no bubblewrap to start it as the sandbox identity)"
        else:
            if identity is not None:
                identity_note = f"{KVM_DEVICE} opens for root only, so QEMU under KVM stays root"
            note += f" ({identity_note}; the procfs floor and the seccomp filter still hold)"
    channel = choose_agent_channel(vhost_vsock=os.access(VHOST_VSOCK_DEVICE, os.R_OK | os.W_OK))
    note += f"; agent channel: {channel.kind}"
    return dataclasses.replace(verdict, qemu_uid=qemu_uid, channel=channel,
                               reason=verdict.reason + note), chosen


def _qemu_identity(check: IdentityCheck) -> tuple[SandboxIdentity | None, str]:
    """The sandbox identity QEMU takes on as a root server's, and why not when it does not."""
    if check.available and check.helper is not None:
        return SandboxIdentity(helper=check.helper, uid=SANDBOX_UID, gid=SANDBOX_GID), ""
    return None, check.hint or "no sandbox identity"


async def _boot_test(pool: VmPool, cache_dir: Path, image: GuestImage) -> BootOutcome:
    accel = pool.config.accel
    verdict_file = cache_dir / f"kvm-broken-{image.directory.name}-{os.uname().release}"
    if accel == "kvm" and verdict_file.exists():
        return BootOutcome(ok=False, detail=verdict_file.read_text().strip())
    timeout = KVM_BOOT_TIMEOUT_S if accel == "kvm" else TCG_BOOT_TIMEOUT_S
    try:
        async with asyncio.timeout(timeout):
            await pool.template()
    except TimeoutError:
        outcome = BootOutcome(ok=False, detail=f"no agent answer within {timeout:.0f} s")
    except CcServerError as exc:
        outcome = BootOutcome(ok=False, detail=" | ".join(exc.message.split("\n"))[:400])
    else:
        return BootOutcome(ok=True)
    if accel == "kvm":  # remembered for this image and host kernel: a hang costs 20 s a boot
        verdict_file.write_text(outcome.detail + "\n")
    return outcome
