"""The microVM runtime a SandboxManager holds: the probe's verdict, the pool of its accelerator,
and where VM directories live. `launch` turns a compiled policy into a MicroVMHandle."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cc_server.egress.driver import Resolver
from cc_server.egress.patterns import Allowlist
from cc_server.microvm.handle import MicroVMHandle, NoHostPlanner
from cc_server.microvm.image import Progress, default_cache_dir, stderr_progress
from cc_server.microvm.link import VM_DIR_PREFIX
from cc_server.microvm.mounts import plan_mounts
from cc_server.microvm.pool import VmPool
from cc_server.microvm.probe import MicroVMProbe, ProbeParams, probe_microvm
from cc_server.policy import CompiledPolicy, SandboxBackend
from cc_server.rundir import names_of_dead_owners
from cc_server.runtime.egress import SessionEgress, egress_base_dir, kill_stale_sandboxes

__all__ = ["MicroVMRuntime", "probe_runtime", "remove_stale_vm_dirs"]

_VM_DIR = re.compile(rf"^{VM_DIR_PREFIX}-(?P<pid>\d+)-[0-9a-f]{{16}}$")


@dataclass(kw_only=True)
class MicroVMRuntime:
    """What the boot probe found, and the pool that serves launches when it found a VM."""

    probe: MicroVMProbe
    pool: VmPool | None = None
    run_base: str = ""

    @property
    def available(self) -> bool:
        """Whether a VM can be booted here."""
        return self.probe.available and self.pool is not None

    def launch(
        self,
        policy: CompiledPolicy,
        *,
        allowlist: Allowlist,
        suggest: Callable[[str], str | None],
        resolver: Resolver | None = None,
    ) -> MicroVMHandle:
        """A `created` handle whose VM starts restoring now (needs a running event loop).

        Raises:
            BackendUnavailable: no VM runtime on this host, or no event loop.
            BadSpec: the mounts do not fit a VM (too many, not directories, reserved paths).
        """
        if not self.available or self.pool is None:
            raise self.probe.unavailable_error()
        plan = plan_mounts(policy, is_dir=os.path.isdir, exists=os.path.lexists)
        handle = MicroVMHandle(
            session_id=policy.session_id,
            backend=SandboxBackend.MICROVM,
            policy=policy,
            planner=NoHostPlanner(),
            pool=self.pool,
            mount_plan=plan,
            run_base=self.run_base,
        )
        handle.egress = SessionEgress(
            session_id=policy.session_id,
            allowlist=allowlist,
            suggest=suggest,
            on_violation=handle.record_violation,
            on_change=handle.record_egress_change,
            on_request=handle.record_egress_request,
            base_dir=self.run_base,
            resolver=resolver,
        )
        handle.details["workdir"] = policy.workdir
        handle.details["accelerator"] = self.pool.config.accel
        handle.start()
        return handle

    async def aclose(self) -> None:
        """End the pool's spare QEMU (pool.VmPool.aclose); launches still work. Idempotent."""
        if self.pool is not None:
            await self.pool.aclose()


def remove_stale_vm_dirs(base: str) -> list[str]:
    """Kill the QEMUs of killed servers (their argv names their VM directory) and remove those
    directories; return the names removed."""
    stale = names_of_dead_owners(base, _VM_DIR)
    kill_stale_sandboxes(base, stale)
    for name in stale:
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return stale


async def probe_runtime(cache_dir: Path | None = None, *,
                        accels: tuple[str, ...] = ("kvm", "tcg"),
                        progress: Progress = stderr_progress) -> MicroVMRuntime:
    """Probe this host for the microVM backend (see microvm.probe) and set up its runtime;
    `progress` shows the image build of the first use."""
    base = egress_base_dir()
    remove_stale_vm_dirs(base)
    verdict, pool = await probe_microvm(
        ProbeParams(cache_dir=cache_dir or default_cache_dir(), accels=accels, run_base=base,
                    progress=progress)
    )
    return MicroVMRuntime(probe=verdict, pool=pool, run_base=base)
