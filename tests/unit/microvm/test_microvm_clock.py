"""The guest's clock: the host's TSC rate on a TCG guest's command line when the host's own clock
is its TSC, measured once per host boot; the nominal rate (and jiffies in the guest) otherwise.
Pure: the measurement and the host's files are injected."""

from __future__ import annotations

import pathlib

from cc_server.microvm.clock import BOOT_ID, HOST_CLOCKSOURCE, host_tsc_khz, tsc_khz_from
from cc_server.microvm.image import GuestImage
from cc_server.microvm.pool import VmPool
from cc_server.microvm.probe import MicroVMProbe, choose_agent_channel
from cc_server.microvm.vm import NOMINAL_TSC_KHZ, MachineConfig, qemu_argv


def _host(clocksource: str = "tsc", boot_id: str = "boot-1") -> dict[str, str]:
    return {HOST_CLOCKSOURCE: clocksource, BOOT_ID: boot_id}


def _measure_counting(calls: list[str], output: str = "2445431\n"):  # type: ignore[no-untyped-def]
    def measure(agent: str) -> str:
        calls.append(agent)
        return output

    return measure


def _probe(cache: pathlib.Path, files: dict[str, str], calls: list[str], *,
           machine: str = "x86_64", output: str = "2445431\n") -> int | None:
    def read(path: str) -> str:
        if path in files:
            return files[path]
        try:
            return pathlib.Path(path).read_text().strip()
        except OSError:
            return ""

    return host_tsc_khz(cache, agent="/a/cc-vm-agent", machine=lambda: machine, read=read,
                        measure=_measure_counting(calls, output))


def test_the_rate_is_measured_once_per_host_boot_and_rounded_to_the_mhz(
    tmp_path: pathlib.Path,
) -> None:
    calls: list[str] = []
    assert _probe(tmp_path, _host(), calls) == 2_445_000
    assert _probe(tmp_path, _host(), calls, output="2445999\n") == 2_445_000  # the saved one
    assert calls == ["/a/cc-vm-agent"]
    assert _probe(tmp_path, _host(boot_id="boot-2"), calls, output="2446020\n") == 2_446_000
    assert len(calls) == 2


def test_no_rate_where_the_guest_should_not_trust_its_tsc(tmp_path: pathlib.Path) -> None:
    calls: list[str] = []
    assert _probe(tmp_path, _host(clocksource="hpet"), calls) is None
    assert _probe(tmp_path, _host(), calls, machine="aarch64") is None
    assert calls == []  # nothing is run on such a host
    assert _probe(tmp_path, _host(), calls, output="") is None  # the measurement failed
    assert not (tmp_path / "host-tsc-khz").exists()


def test_implausible_measurements_are_refused() -> None:
    assert tsc_khz_from("2445431") == 2_445_000
    for bad in ("", "garbage", "-5", "0", "99999999999"):
        assert tsc_khz_from(bad) is None, bad


def test_a_tcg_guest_with_the_rate_keeps_its_tsc_clock() -> None:
    cmdline = MachineConfig(accel="tcg", tsc_khz=2_445_000).cmdline.split()
    assert "tsc_early_khz=2445000" in cmdline and "tsc=reliable" in cmdline
    for config in (MachineConfig(accel="tcg"), MachineConfig(accel="kvm", tsc_khz=2_445_000)):
        words = config.cmdline.split()
        assert f"tsc_early_khz={NOMINAL_TSC_KHZ}" in words and "tsc=reliable" not in words
    for config in (MachineConfig(accel="tcg"), MachineConfig(accel="tcg", tsc_khz=2_445_000)):
        assert "init_on_free=1" in config.cmdline.split()


def test_the_rate_names_the_snapshot() -> None:
    image = GuestImage(directory=pathlib.Path("/c/image-abc"), kernel=pathlib.Path("/c/k"),
                       initrd=pathlib.Path("/c/i"), kernel_release="6.1")
    dirs = {
        VmPool(qemu="/q", image=image, config=config, cache_dir=pathlib.Path("/c")).template_dir
        for config in (MachineConfig(accel="tcg"), MachineConfig(accel="tcg", tsc_khz=2_445_000),
                       MachineConfig(accel="tcg", tsc_khz=2_446_000))
    }
    assert len(dirs) == 3, dirs


def test_only_a_cold_boot_gets_the_kernel_and_its_command_line(tmp_path: pathlib.Path) -> None:
    # A restore's kernel is in the snapshot's RAM: QEMU need not read nor hold it.
    image = GuestImage(directory=tmp_path, kernel=tmp_path / "vmlinux",
                       initrd=tmp_path / "initrd.cpio", kernel_release="6.1")
    config = MachineConfig(accel="tcg", tsc_khz=2_445_000)
    for incoming in (False, True):
        argv = qemu_argv("/q", image, config, run_dir=tmp_path / "vm", ram_path=None,
                         ram_shared=False, shares=(), empty_dir=tmp_path / "empty",
                         incoming=incoming)
        boots = {"-kernel", "-initrd", "-append"} & set(argv)
        assert boots == (set() if incoming else {"-kernel", "-initrd", "-append"}), argv
        assert ("-incoming" in argv) is incoming
        if not incoming:
            assert argv[argv.index("-append") + 1] == config.cmdline


def test_the_agent_channel_falls_back_to_virtio_serial_without_vhost_vsock() -> None:
    missing = choose_agent_channel(vhost_vsock=False)
    assert missing.kind == "virtio-serial" and "/dev/vhost-vsock is missing" in missing.reason
    present = choose_agent_channel(vhost_vsock=True)  # reported, not used: not built
    assert present.kind == "virtio-serial" and "not built" in present.reason
    verdict = MicroVMProbe(available=True, accel="tcg", reason="r", channel=missing)
    assert verdict.to_json()["agentChannel"] == "virtio-serial"
    assert MicroVMProbe(available=False, accel=None, reason="r").to_json()["agentChannel"] is None


def test_a_tcg_guest_copies_memory_without_byte_wise_string_instructions() -> None:
    assert MachineConfig(accel="tcg").cpu == "max,-erms,-fsrm"
    assert MachineConfig(accel="kvm").cpu == "host"
