"""The microVM probe's verdicts from hand-built facts (a KVM host, a no-QEMU host), the backend
choice around it (explicit microvm fails loudly; only an unspecified default steps down, to
native, with a log line; never to none), the agent protocol's framing and the mount plan."""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import socket
import time

import pytest

import cc_server.microvm.vm as vm_module
from cc_server.backends.probe import ProbeResult
from cc_server.errors import BackendUnavailable, BadSpec
from cc_server.microvm.image import (
    PRUNE_AFTER_S,
    GuestImage,
    ImageInputs,
    ensure_image,
    prune_cache,
)
from cc_server.microvm.mounts import plan_mounts
from cc_server.microvm.probe import QEMU_PACKAGE_HINT, BootOutcome, MicroVMFacts, decide
from cc_server.microvm.proto import (
    ExecFlags,
    Frame,
    FrameDecoder,
    FrameType,
    MountOp,
    ProtocolError,
    encode,
    exec_payload,
)
from cc_server.microvm.runtime import MicroVMRuntime
from cc_server.microvm.vm import MOUNT_SLOTS, Confinement, Share, confined_argv
from cc_server.policy import HostFacts, Platform, SandboxBackend, compile_policy, parse_spec
from cc_server.runtime.port import MicroVMSandboxAdapter
from cc_server.runtime.select import choose_backend

QEMU = "/usr/bin/qemu-system-x86_64"
NATIVE = ProbeResult(platform=Platform.LINUX, available=True, mechanism="bubblewrap",
                     tools={"bwrap": "/usr/bin/bwrap"})
NO_NATIVE = ProbeResult(platform=Platform.LINUX, available=False, hint="install bubblewrap")
KVM_HOST = decide(MicroVMFacts(qemu=QEMU, kvm_usable=True, kvm_boot=BootOutcome(ok=True)))
NO_QEMU = decide(MicroVMFacts(qemu=None, kvm_usable=True))
KVM_BROKEN = decide(MicroVMFacts(
    qemu=QEMU, kvm_usable=True, kvm_boot=BootOutcome(ok=False, detail="no agent answer in 20 s"),
    tcg_boot=BootOutcome(ok=True),
))


def test_probe_kvm_works() -> None:
    assert KVM_HOST.available and KVM_HOST.accel == "kvm" and not KVM_HOST.kvm_detail


def test_probe_kvm_broken_falls_to_tcg_and_says_why() -> None:
    assert KVM_BROKEN.available and KVM_BROKEN.accel == "tcg"
    assert "did not boot under KVM (no agent answer in 20 s)" in KVM_BROKEN.reason


def test_probe_without_qemu() -> None:
    assert not NO_QEMU.available and NO_QEMU.accel is None
    assert "qemu-system-x86_64 is not installed" in NO_QEMU.reason
    assert NO_QEMU.fix == QEMU_PACKAGE_HINT


def test_probe_no_accelerator_boots() -> None:
    verdict = decide(MicroVMFacts(qemu=QEMU, kvm_usable=False,
                                  tcg_boot=BootOutcome(ok=False, detail="panic")))
    assert not verdict.available
    assert "/dev/kvm is missing" in verdict.reason and "TCG: panic" in verdict.reason


@pytest.mark.parametrize("native", [NATIVE, NO_NATIVE])
@pytest.mark.parametrize("microvm", [NO_QEMU, None])
def test_explicit_microvm_without_runtime_fails_loudly(
    native: ProbeResult, microvm: object
) -> None:
    # Not probed: the message names the switch that was off; probed: the host's reason.
    match = "cannot boot a microVM" if microvm is not None else "CC_SERVER_MICROVM is off"
    with pytest.raises(BackendUnavailable, match=match) as info:
        choose_backend(native, SandboxBackend.MICROVM, sandbox_on=True,
                       microvm=NO_QEMU if microvm is not None else None)
    assert info.value.fix
    assert microvm is not None or "CC_SERVER_MICROVM=on" in info.value.fix


def test_explicit_microvm_with_runtime() -> None:
    assert choose_backend(NO_NATIVE, SandboxBackend.MICROVM, sandbox_on=True,
                          microvm=KVM_BROKEN) is SandboxBackend.MICROVM


def test_unspecified_default_prefers_microvm() -> None:
    chosen = choose_backend(NATIVE, None, sandbox_on=True, microvm=KVM_HOST,
                            default=SandboxBackend.MICROVM)
    assert chosen is SandboxBackend.MICROVM


def test_unspecified_default_steps_down_to_native_with_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="cc_server.runtime"):
        chosen = choose_backend(NATIVE, None, sandbox_on=True, microvm=NO_QEMU,
                                default=SandboxBackend.MICROVM)
    assert chosen is SandboxBackend.NATIVE
    assert [r.getMessage() for r in caplog.records] == [
        f"microvm unavailable ({NO_QEMU.reason}); stepping down to native"
    ]


def test_stepping_down_never_reaches_none() -> None:
    with pytest.raises(BackendUnavailable, match="no native sandbox to step down to"):
        choose_backend(NO_NATIVE, None, sandbox_on=True, microvm=NO_QEMU,
                       default=SandboxBackend.MICROVM)


def test_frames_round_trip_and_limits() -> None:
    decoder = FrameDecoder()
    data = encode(7, FrameType.STDOUT, b"hello") + encode(0, FrameType.PONG)
    frames = decoder.feed(data[:5]) + decoder.feed(data[5:])
    assert frames == [Frame(7, FrameType.STDOUT, b"hello"), Frame(0, FrameType.PONG, b"")]
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(encode(1, FrameType.DATA)[:8] + b"\x63")
    with pytest.raises(ValueError, match="NUL"):
        exec_payload(("a\0b",), (), None, ExecFlags.NONE)


def _host(tmp: str) -> HostFacts:
    return HostFacts(platform=Platform.LINUX, home=os.path.join(tmp, "home"),
                     realpath=os.path.realpath, exists=os.path.lexists, is_dir=os.path.isdir)


def test_mount_plan(tmp_path: os.PathLike[str]) -> None:
    tmp = str(tmp_path)
    home = os.path.join(tmp, "home")
    os.makedirs(os.path.join(home, ".ssh"))
    os.makedirs(os.path.join(home, "repo"))
    spec = parse_spec({"sessionId": "s", "workspaceId": "w", "protectedPaths": [
        os.path.join(home, "repo")], "bindMounts": [{"hostPath": home, "guestPath": "/h"}]})
    plan = plan_mounts(compile_policy(spec, _host(tmp)), is_dir=os.path.isdir,
                       exists=os.path.lexists)
    assert [s.read_only for s in plan.shares] == [False]
    steps = [(s.op, s.guest_path) for s in plan.steps]
    assert steps == [(MountOp.NINEP, "/h"), (MountOp.RO_BIND, "/h/repo"),
                     (MountOp.HIDE, "/h/.ssh")]


def test_mount_plan_refuses_what_a_vm_cannot_share(tmp_path: os.PathLike[str]) -> None:
    tmp = str(tmp_path)
    dirs = [os.path.join(tmp, f"d{i}") for i in range(MOUNT_SLOTS + 1)]
    for d in dirs:
        os.makedirs(d)
    with open(os.path.join(tmp, "file"), "w") as f:
        f.write("x")
    host = _host(tmp)

    def plan(binds: list[dict[str, object]]) -> None:
        spec = parse_spec({"sessionId": "s", "workspaceId": "w", "bindMounts": binds})
        plan_mounts(compile_policy(spec, host), is_dir=os.path.isdir, exists=os.path.lexists)

    with pytest.raises(BadSpec, match="mount slots"):
        plan([{"hostPath": d, "guestPath": f"/m{i}"} for i, d in enumerate(dirs)])
    with pytest.raises(BadSpec, match="directories only"):
        plan([{"hostPath": os.path.join(tmp, "file"), "guestPath": "/f"}])
    with pytest.raises(BadSpec, match="guest's own system"):
        plan([{"hostPath": dirs[0], "guestPath": "/dev/x"}])


def test_image_key_follows_every_input(tmp_path: os.PathLike[str]) -> None:
    base = ImageInputs(kernel_package="linux-image-6.1.0-57-amd64", kernel_version="6.1.1-1",
                       busybox_sha256="b" * 64, agent_sha256="a" * 64)
    keys = {base.key} | {
        dataclasses.replace(base, **{name: "changed"}).key
        for name in ("kernel_package", "kernel_version", "busybox_sha256", "agent_sha256")
    }
    assert len(keys) == 5
    built = pathlib.Path(tmp_path) / f"image-{base.key}"
    built.mkdir()
    for name, text in (("vmlinux", ""), ("initrd.cpio", ""), ("kernel-release", "6.1.0\n"),
                       ("ready", "")):
        (built / name).write_text(text)

    def no_build(step: str, fraction: float) -> None:
        raise AssertionError(f"rebuilt a cached image ({step})")

    image = ensure_image(pathlib.Path(tmp_path), base, no_build)
    assert image.directory == built and image.kernel_release == "6.1.0"


def test_create_time_globs_are_refused_for_microvm(tmp_path: os.PathLike[str]) -> None:
    runtime = MicroVMRuntime(probe=KVM_HOST, pool=object())  # type: ignore[arg-type]
    adapter = MicroVMSandboxAdapter(runtime=runtime, host=_host(str(tmp_path)))
    spec = parse_spec({"sessionId": "s", "workspaceId": "w"})
    with pytest.raises(BackendUnavailable, match="create-time globs") as info:
        adapter.launch(spec, deny_create_globs=(".env", "*.pem"))
    assert "native" in (info.value.fix or "")


def test_prune_cache_keeps_only_the_current_image(tmp_path: os.PathLike[str]) -> None:
    cache = pathlib.Path(tmp_path)
    names = ["image-new", "image-old", "template-2-new-tcg-256m", "template-2-old-tcg-256m",
             "kvm-broken-image-old-6.1", ".build-old-x", ".build-new-y", "empty"]
    for name in names:
        (cache / name).mkdir()
    (cache / "image-new" / "kernel-release").write_text("6.1\n")
    image = GuestImage.at(cache / "image-new")
    # Recently used by someone (another checkout may share the cache): kept.
    assert prune_cache(cache, image) == []
    later = time.time() + PRUNE_AFTER_S + 60
    removed = prune_cache(cache, image, now=later)
    assert removed == sorted([".build-old-x", "image-old", "kvm-broken-image-old-6.1",
                              "template-2-old-tcg-256m"])
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [".build-new-y", "empty", "image-new", "template-2-new-tcg-256m"])


def test_confined_argv_shows_qemu_only_its_files() -> None:
    argv = confined_argv(
        Confinement(bwrap="/usr/bin/bwrap", read_only=("/c/image",), writable=("/r/vm",),
                    seccomp=b"bpf"),
        ("/usr/bin/qemu-system-x86_64", "-name", "/r/vm"),
        [Share(host_path="/w/rw", read_only=False), None, Share(host_path="/w/ro",
                                                                 read_only=True)],
        is_symlink=lambda p: p in ("/bin", "/lib"),
        readlink=lambda p: "usr" + p,
        exists=lambda p: p in ("/usr", "/etc/ld.so.cache"),
    )
    text = " ".join(map(str, argv))
    assert argv[:5] == ("/usr/bin/bwrap", "--die-with-parent", "--unshare-all",
                        "--new-session", "--clearenv")
    assert "--symlink usr/bin /bin" in text and "--ro-bind /usr /usr" in text
    assert "--ro-bind /c/image /c/image" in text and "--bind /r/vm /r/vm" in text
    assert "--bind /w/rw /w/rw" in text and "--ro-bind /w/ro /w/ro" in text
    assert "/dev/kvm" not in text and "--share-net" not in text and "/home" not in text
    assert argv[argv.index("--"):] == ("--", "/usr/bin/qemu-system-x86_64", "-name", "/r/vm")


async def test_a_qmp_command_without_an_answer_is_a_qmp_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A QEMU that stops answering is an EnforcementFailed the caller handles (the suspend puts
    # the mounts back), not a bare TimeoutError.
    monkeypatch.setattr(vm_module, "QMP_COMMAND_TIMEOUT_S", 0.05)
    ours, qemu = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)
    client = vm_module.QmpClient(ours)
    try:
        with pytest.raises(vm_module.QmpError, match="no answer"):
            await client.execute("query-status")
    finally:
        client.close()
        qemu.close()
