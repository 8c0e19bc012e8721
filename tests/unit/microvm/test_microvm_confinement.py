"""QEMU's bubblewrap plan: the seccomp filter that refuses set-id modes, the procfs floor, and a
root server's QEMU started as the sandbox identity with its files idmapped from cc-identity's
stage. Pure: nothing is run."""

from __future__ import annotations

import os
import pathlib

import pytest

import cc_server.microvm.pool as pool_module
from cc_server.backends.bubblewrap import PROC_MASKED, PROC_READ_ONLY
from cc_server.backends.identity import STAGE_DIR
from cc_server.backends.plan import FdArg, SandboxIdentity
from cc_server.backends.seccomp import filter_bpf
from cc_server.errors import BadSpec
from cc_server.microvm.image import GuestImage
from cc_server.microvm.pool import VmPool
from cc_server.microvm.vm import Confinement, MachineConfig, Share, confined_argv

QEMU = ("/usr/bin/qemu-system-x86_64", "-name", "/r/vm", "-kernel", "/c/image/vmlinux")
IDENTITY = SandboxIdentity(helper="/opt/cc/cc-identity", uid=0x7000_0000, gid=0x7000_0000)
SHARES = [Share(host_path="/w/rw", read_only=False), None,
          Share(host_path="/w/ro", read_only=True)]
HOST_PROC = {"/proc/sys", "/proc/fs", "/proc/sysrq-trigger", "/proc/acpi", "/proc/kcore"}


def _plan(identity: SandboxIdentity | None = None,
          shares: list[Share | None] = SHARES) -> tuple[str | FdArg, ...]:
    return confined_argv(
        Confinement(bwrap="/usr/bin/bwrap", read_only=("/c/image", "/c/empty"),
                    writable=("/r/vm", "/c/t/ram.img"), seccomp=b"qemu-bpf",
                    identity=identity),
        QEMU,
        shares,
        is_symlink=lambda p: p in ("/bin", "/lib"),
        readlink=lambda p: "usr" + p,
        exists=lambda p: p in ("/usr", "/etc/ld.so.cache") or p in HOST_PROC,
        is_dir=lambda p: p in ("/proc/sys", "/proc/fs", "/proc/acpi"),
    )


def _text(argv: tuple[str | FdArg, ...]) -> str:
    return " ".join(map(str, argv))


def test_qemu_loads_the_seccomp_filter_last_before_its_argv() -> None:
    argv = _plan()
    end = argv.index("--")
    assert argv[end - 2] == "--seccomp", _text(argv)
    bpf = argv[end - 1]
    assert isinstance(bpf, FdArg) and bpf.data == b"qemu-bpf"
    assert argv[end:] == ("--", *QEMU)


def test_the_filter_qemu_gets_is_the_sandbox_filter_with_its_set_id_rules() -> None:
    # The pool hands QEMU the native sandbox's filter: it refuses set-id bits in chmod and
    # creation modes (tests/unit/backends/test_seccomp.py checks the rules themselves).
    image = GuestImage(directory=pathlib.Path("/c/image"), kernel=pathlib.Path("/c/image/k"),
                       initrd=pathlib.Path("/c/image/i"), kernel_release="6")
    pool = VmPool(qemu="/usr/bin/qemu-system-x86_64", image=image,
                  config=MachineConfig(accel="tcg"), cache_dir=pathlib.Path("/c"),
                  bwrap="/usr/bin/bwrap")
    argv = pool._argv(pathlib.Path("/r/vm"), ram=None, ram_shared=False, shares=(),
                      incoming=False)
    bpf = argv[argv.index("--seccomp") + 1]
    assert isinstance(bpf, FdArg) and bpf.data == filter_bpf()


def test_qemu_procfs_has_the_native_floor_for_what_the_host_has() -> None:
    text = _text(_plan())
    assert "--proc /proc --ro-bind /proc/fs /proc/fs" in text
    assert "--ro-bind /proc/sys /proc/sys" in text
    assert "--ro-bind /proc/sysrq-trigger /proc/sysrq-trigger" in text
    assert "--tmpfs /proc/acpi --remount-ro /proc/acpi" in text
    assert "--ro-bind /dev/null /proc/kcore" in text
    for path in (*PROC_READ_ONLY, *PROC_MASKED):
        if path not in HOST_PROC:  # what this host lacks is not asked for
            assert path not in text, path


def test_without_an_identity_qemu_starts_as_bubblewrap_with_its_own_paths() -> None:
    argv = _plan()
    assert argv[0] == "/usr/bin/bwrap"
    text = _text(argv)
    assert "cc-identity" not in text and STAGE_DIR not in text
    assert "--bind /r/vm /r/vm" in text and "--ro-bind /w/ro /w/ro" in text


def test_a_root_servers_qemu_starts_as_the_sandbox_identity_from_the_stage() -> None:
    argv = _plan(IDENTITY)
    text = _text(argv)
    roots = ["/c/image", "/c/empty", "/r/vm", "/c/t/ram.img", "/w/rw", "/w/ro"]
    head = ["/opt/cc/cc-identity", "--uid", "1879048192", "--gid", "1879048192",
            "--stage", STAGE_DIR]
    for root in roots:
        head += ["--map", root]
    assert list(argv[: len(head) + 2]) == [*head, "--", "/usr/bin/bwrap"], text
    # Each of QEMU's files comes from its root's stage, at its own path inside.
    for index, root in enumerate(roots):
        assert f"{STAGE_DIR}/{index} {root}" in text, root
    assert f"--bind {STAGE_DIR}/2 /r/vm" in text and f"--ro-bind {STAGE_DIR}/5 /w/ro" in text
    # What any uid reads stays as it is: system paths, the procfs floor, /dev/null.
    assert "--ro-bind /usr /usr" in text and "--ro-bind /proc/sys /proc/sys" in text
    assert "--ro-bind /dev/null /proc/kcore" in text
    # QEMU's own argv names its files by their real paths, which bubblewrap binds there.
    assert argv[-len(QEMU):] == QEMU
    assert isinstance(argv[argv.index("--seccomp") + 1], FdArg)


def test_a_share_below_the_stage_is_refused_for_a_root_servers_qemu() -> None:
    with pytest.raises(BadSpec, match=STAGE_DIR):
        _plan(IDENTITY, [Share(host_path=f"{STAGE_DIR}/x", read_only=False)])


@pytest.mark.parametrize(("accel", "mode", "as_identity"), [
    ("tcg", 0o600, True),  # TCG needs no device
    ("kvm", 0o666, True),  # /dev/kvm opens for anyone
    ("kvm", 0o660, False),  # root (or the kvm group) only: QEMU under KVM stays the server's
])
def test_qemu_takes_on_the_identity_unless_kvm_would_not_open(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, accel: str, mode: int,
    as_identity: bool,
) -> None:
    device = tmp_path / "kvm"
    device.write_text("")
    os.chmod(device, mode)
    monkeypatch.setattr(pool_module, "KVM_DEVICE", str(device))
    image = GuestImage(directory=tmp_path, kernel=tmp_path / "k", initrd=tmp_path / "i",
                       kernel_release="6")
    pool = VmPool(qemu="/q", image=image, config=MachineConfig(accel=accel),
                  cache_dir=tmp_path, bwrap="/usr/bin/bwrap", identity=IDENTITY)
    assert (pool.qemu_identity is IDENTITY) is as_identity
    unconfined = VmPool(qemu="/q", image=image, config=MachineConfig(accel=accel),
                        cache_dir=tmp_path, identity=IDENTITY)
    assert unconfined.qemu_identity is None  # no bubblewrap: cc-identity has nothing to start
