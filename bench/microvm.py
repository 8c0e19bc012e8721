#!/usr/bin/env python3
"""The microvm backend, one run, under the accelerator this host's probe chose.

Measures, each against its target from the microVM issue and with a baseline from the same run:
- cold boot to warm: a fresh template VM (new cache directory, the image reused) from QEMU's
  start to its agent's answer, then its snapshot; the baseline every later number is a ratio of;
- new session warm: from `SandboxManager.launch` (spec with one bind mount; egress proxies
  started) to `warm`, restored from the snapshot (target <= 100 ms);
- resume: a suspended VM back to `warm` (target <= 100 ms), and what suspend took;
- exec round-trip of `true` in a warm VM (target <= 5 ms), against spawning /bin/true on the
  host from the same event loop;
- host memory per idle warm VM: RSS and PSS of each QEMU, SAMPLE_VMS VMs up together, idle for
  IDLE_S (target <= 48 MiB), and the host CPU an idle VM's QEMU burns.
Also the host CPU QEMU spent per exec: on a loaded host it moves far less than the wall time.
Prints medians with [min-max]; exits 1 if a target is missed.

Usage: .venv/bin/python bench/microvm.py [--sessions 10] [--execs 50] [--vms 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import secrets
import shutil
import statistics
import sys
import tempfile
import time

from cc_server.backends.probe import probe
from cc_server.microvm.handle import STATE_FILE, MicroVMHandle
from cc_server.microvm.pool import VmPool
from cc_server.microvm.runtime import MicroVMRuntime, probe_runtime
from cc_server.policy import HostFacts, SandboxBackend, parse_spec
from cc_server.runtime.handle import run_collect
from cc_server.runtime.port import SandboxManager

IDLE_S = 3.0
TARGET_WARM_MS = 100.0
TARGET_RESUME_MS = 100.0
TARGET_EXEC_MS = 5.0
TARGET_MEM_MIB = 48.0


def fmt(values: list[float], unit: str = "ms") -> str:
    return (f"{statistics.median(values):8.1f} {unit} [{min(values):.1f}-{max(values):.1f}]"
            f" n={len(values)}")


def _tree(root: int) -> list[int]:
    """`root` and its descendants (bubblewrap, its init, QEMU)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def cpu_ms(pid: int) -> float:
    """Host CPU (user + system) a VM's host process tree has used, in ms."""
    ticks = 0
    for member in _tree(pid):
        for task in os.listdir(f"/proc/{member}/task"):
            with open(f"/proc/{member}/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks * 1000 / os.sysconf("SC_CLK_TCK")


def smaps(pid: int) -> tuple[float, float]:
    """(RSS, PSS) in MiB of a VM's host process tree."""
    rss = pss = 0.0
    for member in _tree(pid):
        with open(f"/proc/{member}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) / 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) / 1024
    return rss, pss


def print_phases(phases: list[dict[str, float]], cpu: list[float], spares: int) -> None:
    """The restores' own timers (ms since each began: QEMU up or a spare taken, the state sent,
    the agent's answers, a resume's thaw) and QEMU's host CPU from its start to warm."""
    for name in ("start", "load", "greet", "thaw"):
        if all(name in p for p in phases):
            print(f"  phase {name:<5} (ms from start): {fmt([p[name] for p in phases])}")
    print(f"  QEMU CPU, its start to warm: {fmt(cpu)}  ({spares} of {len(phases)} from a spare)")


async def main(args: argparse.Namespace) -> int:
    runtime = await probe_runtime()
    if not runtime.available or runtime.pool is None:
        print(f"no microVM runtime: {runtime.probe.reason}", file=sys.stderr)
        return 1
    print(f"accelerator: {runtime.probe.accel} ({runtime.probe.reason})")
    pool = runtime.pool
    failed = False
    config = pool.config
    clock = ("kvm-clock" if config.accel == "kvm"
             else f"TSC at {config.tsc_khz} kHz" if config.tsc_khz else "jiffies")
    print(f"guest clock: {clock}")

    # Cold boot: a template of its own, in a scratch cache directory.
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="cc-bench-microvm-"))
    try:
        cold = VmPool(qemu=pool.qemu, image=pool.image, config=pool.config, cache_dir=scratch,
                      bwrap=pool.bwrap)  # confined like every VM of the server
        started = time.perf_counter()
        await cold.template()
        cold_ms = (time.perf_counter() - started) * 1000
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"cold boot to snapshot ready : {cold_ms:8.1f} ms (boot, agent answer, save)")

    work = pathlib.Path(tempfile.mkdtemp(prefix="cc-bench-microvm-work-"))
    manager = SandboxManager(probe_result=probe(), host=HostFacts.current(), microvm=runtime)
    try:
        def spec() -> object:
            return parse_spec({
                "sessionId": f"bench-{secrets.token_hex(4)}", "workspaceId": "bench",
                "bindMounts": [{"hostPath": str(work), "guestPath": "/work"}],
                "guestWorkdir": "/work",
            })

        # The same restores with QEMU not under bubblewrap, interleaved: what confinement costs.
        bare_pool = VmPool(qemu=pool.qemu, image=pool.image, config=pool.config,
                           cache_dir=pool.cache_dir, bwrap=None)
        await bare_pool.template()
        bare_runtime = MicroVMRuntime(probe=runtime.probe, pool=bare_pool,
                                      run_base=runtime.run_base)
        bare = SandboxManager(probe_result=probe(), host=HostFacts.current(),
                              microvm=bare_runtime)
        warm: list[float] = []
        warm_bare: list[float] = []
        warm_phases: list[dict[str, float]] = []
        warm_cpu: list[float] = []
        warm_spares = 0
        handles: list[MicroVMHandle] = []
        try:
            for _ in range(args.sessions):
                started = time.perf_counter()
                vm = bare.launch(spec(), backend=SandboxBackend.MICROVM)  # type: ignore[arg-type]
                assert isinstance(vm, MicroVMHandle)
                await vm.ready()
                warm_bare.append((time.perf_counter() - started) * 1000)
                await bare.destroy(vm.session_id)
                started = time.perf_counter()
                handle = manager.launch(spec(), backend=SandboxBackend.MICROVM)  # type: ignore[arg-type]
                assert isinstance(handle, MicroVMHandle)
                await handle.ready()
                warm.append((time.perf_counter() - started) * 1000)
                warm_phases.append(handle.phases)
                warm_spares += handle.from_spare
                assert handle.qemu_pid is not None
                warm_cpu.append(cpu_ms(handle.qemu_pid))
                handles.append(handle)
                if len(handles) > args.vms:
                    await manager.destroy(handles.pop(0).session_id)
        finally:
            await bare.aclose()
        confined = "under bubblewrap" if pool.bwrap else "unconfined"
        print(f"new session warm (request) : {fmt(warm)}  target <= {TARGET_WARM_MS:.0f} ms"
              f"  ({statistics.median(warm) / cold_ms:.3f} x cold boot; QEMU {confined})")
        print(f"  QEMU not under bubblewrap: {fmt(warm_bare)}"
              f"  (confined / bare = {statistics.median(warm) / statistics.median(warm_bare):.2f})")
        print_phases(warm_phases, warm_cpu, warm_spares)
        failed |= statistics.median(warm) > TARGET_WARM_MS

        handle = handles[-1]
        host_true: list[float] = []
        vm_true: list[float] = []
        for _ in range(args.execs):
            started = time.perf_counter()
            proc = await asyncio.create_subprocess_exec("/bin/true")
            await proc.wait()
            host_true.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            result = await run_collect(handle, ["true"])
            vm_true.append((time.perf_counter() - started) * 1000)
            assert result.exit_code == 0
        print(f"exec `true` in a warm VM   : {fmt(vm_true)}  target <= {TARGET_EXEC_MS:.0f} ms"
              f"  ({statistics.median(vm_true) / statistics.median(host_true):.2f} x host spawn)")
        print(f"  baseline: host /bin/true : {fmt(host_true)}")
        assert handle.qemu_pid is not None
        used = cpu_ms(handle.qemu_pid)
        for _ in range(args.execs):
            await run_collect(handle, ["true"])
        per_exec = (cpu_ms(handle.qemu_pid) - used) / args.execs
        print(f"  QEMU CPU per exec        : {per_exec:8.2f} ms (host user + system time)")
        failed |= statistics.median(vm_true) > TARGET_EXEC_MS

        idle = [h.qemu_pid for h in handles[-args.vms:] if h.qemu_pid is not None]
        before = [cpu_ms(pid) for pid in idle]
        await asyncio.sleep(IDLE_S)
        idle_cpu = [(cpu_ms(pid) - b) / IDLE_S / 10 for pid, b in zip(idle, before, strict=True)]
        mems = [smaps(h.qemu_pid) for h in handles[-args.vms:] if h.qemu_pid is not None]
        rss = [m[0] for m in mems]
        pss = [m[1] for m in mems]
        print(f"idle warm VM memory, RSS   : {fmt(rss, 'MiB')}  ({len(mems)} VMs up)")
        print(f"idle warm VM memory, PSS   : {fmt(pss, 'MiB')}  target <= {TARGET_MEM_MIB:.0f}"
              " MiB")
        print(f"idle warm VM host CPU      : {fmt(idle_cpu, '%')} of a core")
        failed |= statistics.median(pss) > TARGET_MEM_MIB

        suspend: list[float] = []
        resume: list[float] = []
        resume_phases: list[dict[str, float]] = []
        resume_cpu: list[float] = []
        resume_spares = 0
        state_kib: list[float] = []
        for _ in range(args.resumes):
            started = time.perf_counter()
            await handle.suspend()
            suspend.append((time.perf_counter() - started) * 1000)
            assert handle.run_dir is not None
            state_kib.append((handle.run_dir / STATE_FILE).stat().st_size / 1024)
            started = time.perf_counter()
            await handle.resume()
            resume.append((time.perf_counter() - started) * 1000)
            resume_phases.append(handle.phases)
            resume_spares += handle.from_spare
            assert handle.qemu_pid is not None
            resume_cpu.append(cpu_ms(handle.qemu_pid))
        assert handle.qemu_pid is not None
        resumed_rss, resumed_pss = smaps(handle.qemu_pid)
        print(f"suspend to disk            : {fmt(suspend)}  (state file {fmt(state_kib, 'KiB')})")
        print(f"resume to warm             : {fmt(resume)}  target <= {TARGET_RESUME_MS:.0f} ms"
              f"  ({statistics.median(resume) / cold_ms:.3f} x cold boot)")
        print(f"  resumed VM memory        : RSS {resumed_rss:.1f} MiB, PSS {resumed_pss:.1f} MiB")
        print_phases(resume_phases, resume_cpu, resume_spares)
        failed |= statistics.median(resume) > TARGET_RESUME_MS
    finally:
        await manager.aclose()
        shutil.rmtree(work, ignore_errors=True)
    print("all targets met" if not failed else "TARGET MISSED")
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--execs", type=int, default=50)
    parser.add_argument("--vms", type=int, default=3)
    parser.add_argument("--resumes", type=int, default=5)
    sys.exit(asyncio.run(main(parser.parse_args())) if os.name == "posix" else 1)
