"""The guest's clock under TCG: the host's TSC rate, measured once per host boot.

A TCG guest reads the host's TSC as its own (QEMU passes `rdtsc` through, paused while the VM
is stopped, so it is continuous across a snapshot and a restore), but it cannot measure the
rate: its PIT calibration fails under TCG and the microvm machine has no HPET. Told the rate on
its command line (`MachineConfig.cmdline`), it keeps the TSC as its clock; told a wrong one, its
clock watchdog drops the TSC and it counts jiffies (a 4 ms clock, and a tick every 4 ms while
idle: about 5 % of a host core per idle VM).
"""

from __future__ import annotations

import contextlib
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Final

from cc_server.microvm.image import AGENT_PATH

__all__ = ["host_tsc_khz", "tsc_khz_from"]

HOST_CLOCKSOURCE: Final = "/sys/devices/system/clocksource/clocksource0/current_clocksource"
BOOT_ID: Final = "/proc/sys/kernel/random/boot_id"
CACHE_FILE: Final = "host-tsc-khz"  # "<boot id> <kHz>": one measurement per host boot
MEASURE_TIMEOUT_S: Final = 5.0  # the agent's measurement sleeps 200 ms
# Rounded to the MHz: a new measurement after a host reboot then names the same snapshot
# (the rate is part of its key); 0.05 % at most, a drift the clock set at each restore absorbs.
ROUND_KHZ: Final = 1000
PLAUSIBLE_KHZ: Final = range(100_000, 20_000_000)


def tsc_khz_from(output: str) -> int | None:
    """The rate `cc-vm-agent --tsc-khz` printed, rounded; None when it is not a plausible one."""
    try:
        khz = int(output.strip())
    except ValueError:
        return None
    rounded = round(khz / ROUND_KHZ) * ROUND_KHZ
    return rounded if rounded in PLAUSIBLE_KHZ else None


def _read(path: str) -> str:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read().strip()
    return ""


def _measure(agent: str) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run([agent, "--tsc-khz"], capture_output=True, text=True,
                              timeout=MEASURE_TIMEOUT_S, check=False)
        if done.returncode == 0:
            return done.stdout
    return ""


def host_tsc_khz(
    cache_dir: Path,
    *,
    agent: str = AGENT_PATH,
    machine: Callable[[], str] = platform.machine,
    read: Callable[[str], str] = _read,
    measure: Callable[[str], str] = _measure,
) -> int | None:
    """The host's TSC rate in kHz, or None where a guest should not trust its TSC: not an
    x86-64 host (the guest's TSC would be another counter), or a host kernel that does not use
    its own TSC as its clock (then it is not stable here). Kept in `cache_dir` per host boot."""
    if machine() not in ("x86_64", "AMD64") or read(HOST_CLOCKSOURCE) != "tsc":
        return None
    boot_id = read(BOOT_ID)
    cache = cache_dir / CACHE_FILE
    saved = read(str(cache)).split()
    if boot_id and len(saved) == 2 and saved[0] == boot_id:
        return tsc_khz_from(saved[1])
    khz = tsc_khz_from(measure(agent))
    if khz is not None and boot_id:
        with contextlib.suppress(OSError):
            cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = cache.with_name(cache.name + ".tmp")
            tmp.write_text(f"{boot_id} {khz}\n")
            tmp.replace(cache)
    return khz
