"""The guest image: a kernel and an initramfs root filesystem, assembled from Debian packages on
first use and cached under a key that hashes every input.

- kernel: Debian's `linux-image-<release>` (the one `linux-image-amd64` depends on), fetched with
  `apt-get download` and unpacked without installing; its bzImage is decompressed to the ELF
  `vmlinux`, which QEMU's microvm machine boots directly (PVH): the guest skips decompressing
  itself, seconds under TCG.
- root filesystem: an uncompressed newc initramfs holding busybox (Debian's `busybox-static`),
  the guest agent (built by scripts/bootstrap), the few kernel modules the guest needs, and /init.
  The guest keeps it in RAM: there is no disk device, so the snapshot holds the whole guest.

Nothing here downloads anything but that one package, through apt. An image directory is written
under a temporary name and renamed into place, so a half-built image is never used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import lzma
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TextIO

from cc_server.errors import BackendUnavailable

__all__ = [
    "AGENT_PATH",
    "GUEST_MODULES",
    "GuestImage",
    "ImageInputs",
    "Progress",
    "default_cache_dir",
    "ensure_image",
    "image_inputs",
    "init_script",
    "progress_bar",
    "prune_cache",
    "touch",
    "write_newc",
]

IMAGE_FORMAT: Final = 3  # bump when the layout or /init changes: part of the cache key
KERNEL_META_PACKAGE: Final = "linux-image-amd64"
BUSYBOX_PATH: Final = "/bin/busybox"  # Debian's busybox-static (statically linked)
AGENT_PATH: Final = str(Path(__file__).parent / "agent" / "cc-vm-agent")
APT_TIMEOUT_S: Final = 600.0  # one package download on a slow mirror
# Loaded in this order by /init (no modules.dep in the unpacked package; dependencies first).
GUEST_MODULES: Final = (
    "drivers/virtio/virtio_ring.ko",
    "drivers/virtio/virtio.ko",
    "drivers/virtio/virtio_mmio.ko",
    "drivers/char/virtio_console.ko",
    "fs/netfs/netfs.ko",
    "fs/fscache/fscache.ko",
    "net/9p/9pnet.ko",
    "net/9p/9pnet_virtio.ko",
    "fs/9p/9p.ko",
)
GUEST_HOSTNAME: Final = "cc-microvm"
XZ_MAGIC: Final = b"\xfd7zXZ\x00"
# An image or snapshot of other inputs that nobody touched for this long is removed.
PRUNE_AFTER_S: Final = 7 * 24 * 3600

Progress = Callable[[str, float], None]  # (step, fraction done 0..1)


def init_script() -> str:
    """The guest's /init: mount the pseudo filesystems, load the modules, bring up loopback
    (the only interface there is) and become the agent."""
    mods = " ".join(f"/lib/modules/{Path(m).name}" for m in GUEST_MODULES)
    return f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /tmp /run /root
mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
ln -sf /dev/pts/ptmx /dev/ptmx
mount -t tmpfs -o mode=1777 tmp /tmp
mount -t tmpfs -o mode=755 run /run
: > /run/cc-empty
chmod 0 /run/cc-empty
for m in {mods}; do insmod $m || echo "cc-init: insmod $m failed"; done
ip link set lo up
hostname {GUEST_HOSTNAME}
exec /sbin/cc-vm-agent /dev/hvc0
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageInputs:
    """Everything an image is made of; its hash names the cache directory."""

    kernel_package: str  # linux-image-6.1.0-57-amd64
    kernel_version: str  # the package version apt would download
    busybox_sha256: str
    agent_sha256: str

    @property
    def key(self) -> str:
        """The cache key: a hash of the inputs, the module list, /init and the format."""
        h = hashlib.sha256()
        for part in (
            str(IMAGE_FORMAT),
            self.kernel_package,
            self.kernel_version,
            self.busybox_sha256,
            self.agent_sha256,
            "\n".join(GUEST_MODULES),
            init_script(),
        ):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:20]


@dataclass(frozen=True, slots=True, kw_only=True)
class GuestImage:
    """A built image: the directory and its two boot files."""

    directory: Path
    kernel: Path  # vmlinux (ELF, PVH entry)
    initrd: Path  # newc cpio, uncompressed
    kernel_release: str  # what `uname -r` says in the guest

    @classmethod
    def at(cls, directory: Path) -> GuestImage:
        """The image in `directory` (which must be complete)."""
        return cls(
            directory=directory,
            kernel=directory / "vmlinux",
            initrd=directory / "initrd.cpio",
            kernel_release=(directory / "kernel-release").read_text().strip(),
        )


def default_cache_dir(environ: dict[str, str] | None = None) -> Path:
    """`$CC_SERVER_MICROVM_CACHE`, else `$XDG_CACHE_HOME/cc-server/microvm`, else
    `~/.cache/cc-server/microvm`."""
    env = os.environ if environ is None else environ
    if env.get("CC_SERVER_MICROVM_CACHE"):
        return Path(env["CC_SERVER_MICROVM_CACHE"])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cc-server" / "microvm"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _run(argv: list[str], cwd: str | None = None) -> str:
    try:
        done = subprocess.run(
            argv, cwd=cwd, capture_output=True, text=True, timeout=APT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendUnavailable(
            f"{argv[0]} failed: {exc}", fix="install apt (Debian/Ubuntu) and retry"
        ) from exc
    if done.returncode != 0:
        raise BackendUnavailable(
            f"{' '.join(argv)} failed: {done.stderr.strip()[-400:]}",
            fix="check the apt sources (apt-get update) and retry",
        )
    return done.stdout


def kernel_package() -> tuple[str, str]:
    """The kernel package `linux-image-amd64` depends on, and the version apt would fetch.

    Raises:
        BackendUnavailable: apt does not know the package (no Debian sources, or not amd64).
    """
    depends = _run(["apt-cache", "depends", KERNEL_META_PACKAGE])
    names = [
        line.split(":", 1)[1].strip()
        for line in depends.splitlines()
        if line.strip().startswith("Depends:") and "linux-image-" in line
    ]
    if not names:
        raise BackendUnavailable(
            f"apt knows no kernel package behind {KERNEL_META_PACKAGE}",
            fix="run on Debian/Ubuntu amd64 with its main archive in the apt sources",
        )
    name = names[0]
    policy = _run(["apt-cache", "policy", name])
    for line in policy.splitlines():
        if line.strip().startswith("Candidate:"):
            version = line.split(":", 1)[1].strip()
            if version and version != "(none)":
                return name, version
    raise BackendUnavailable(
        f"apt has no candidate version of {name}", fix="run apt-get update and retry"
    )


def image_inputs() -> ImageInputs:
    """The inputs of the image this host would build.

    Raises:
        BackendUnavailable: busybox-static, the agent or the kernel package is missing.
    """
    if not os.path.isfile(BUSYBOX_PATH):
        raise BackendUnavailable(
            f"{BUSYBOX_PATH} is missing", fix="sudo apt-get install busybox-static"
        )
    if not os.access(AGENT_PATH, os.X_OK):
        raise BackendUnavailable(
            f"the guest agent {AGENT_PATH} is not built", fix="run scripts/bootstrap"
        )
    name, version = kernel_package()
    return ImageInputs(
        kernel_package=name,
        kernel_version=version,
        busybox_sha256=_sha256(BUSYBOX_PATH),
        agent_sha256=_sha256(AGENT_PATH),
    )


def progress_bar(stream: TextIO) -> Progress:
    """A one-line progress bar on `stream` (the CLI daemon's is its client's stderr)."""

    def show(step: str, fraction: float) -> None:
        width = 30
        done = int(width * max(0.0, min(1.0, fraction)))
        end = "\n" if fraction >= 1.0 else ""
        stream.write(f"\rmicroVM image: [{'#' * done}{'.' * (width - done)}] {step:<28}{end}")
        stream.flush()

    return show


def stderr_progress(step: str, fraction: float) -> None:
    """A one-line progress bar on stderr."""
    progress_bar(sys.stderr)(step, fraction)


def ensure_image(
    cache_dir: Path, inputs: ImageInputs | None = None, progress: Progress = stderr_progress
) -> GuestImage:
    """The image for `inputs` (this host's, by default), built into `cache_dir` if it is not
    there yet. Older images stay until `prune_cache` removes them.

    Raises:
        BackendUnavailable: a package or tool is missing, or the build failed.
    """
    inputs = inputs or image_inputs()
    target = cache_dir / f"image-{inputs.key}"
    if (target / "ready").exists():
        touch(target)
        return GuestImage.at(target)
    cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    work = Path(tempfile.mkdtemp(prefix=f".build-{inputs.key}-", dir=cache_dir))
    try:
        _build(work, inputs, progress)
        try:
            os.rename(work, target)
        except OSError:  # another process built it meanwhile
            if not (target / "ready").exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return GuestImage.at(target)


def touch(path: Path) -> None:
    """Mark a cache entry as used now (prune_cache keeps what was used recently)."""
    with contextlib.suppress(OSError):
        os.utime(path)


def prune_cache(cache_dir: Path, image: GuestImage, *, now: float | None = None) -> list[str]:
    """Remove what other inputs left in `cache_dir` and nobody used for PRUNE_AFTER_S: other
    images, their snapshots and their KVM verdicts. Another checkout or server version may share
    the cache and use its own image right now, so recent entries stay. Returns the names removed.
    """
    key = image.directory.name.removeprefix("image-")
    now = time.time() if now is None else now
    removed: list[str] = []
    for entry in cache_dir.iterdir():
        name = entry.name
        ours = name.startswith(("image-", "template-", "kvm-broken-")) or ".build-" in name
        if not ours or key in name:
            continue
        try:
            if now - entry.lstat().st_mtime < PRUNE_AFTER_S:
                continue
        except FileNotFoundError:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(name)
    return sorted(removed)


def _build(work: Path, inputs: ImageInputs, progress: Progress) -> None:
    progress("fetching kernel package", 0.05)
    deb = _fetch_deb(work, inputs)
    progress("unpacking kernel", 0.35)
    vmlinuz, modules, release = _unpack_kernel(deb)
    deb.unlink()
    progress("decompressing kernel", 0.55)
    (work / "vmlinux").write_bytes(decompress_bzimage(vmlinuz))
    progress("writing initramfs", 0.85)
    with open(work / "initrd.cpio", "wb") as out:
        write_newc(out, _root_entries(modules))
    (work / "kernel-release").write_text(release + "\n")
    (work / "inputs.txt").write_text(
        "\n".join(f"{k}={v}" for k, v in dataclasses.asdict(inputs).items()) + "\n"
    )
    (work / "ready").write_text("")
    progress("done", 1.0)


def _fetch_deb(work: Path, inputs: ImageInputs) -> Path:
    cached = Path("/var/cache/apt/archives") / (
        f"{inputs.kernel_package}_{inputs.kernel_version.replace(':', '%3a')}_amd64.deb"
    )
    if cached.is_file():
        return Path(shutil.copy(cached, work / cached.name))
    _run(["apt-get", "download", "-q", f"{inputs.kernel_package}={inputs.kernel_version}"],
         cwd=str(work))
    debs = sorted(work.glob("*.deb"))
    if not debs:
        raise BackendUnavailable(
            f"apt-get download {inputs.kernel_package} wrote no .deb",
            fix="check the apt sources and retry",
        )
    return debs[0]


def _unpack_kernel(deb: Path) -> tuple[bytes, dict[str, bytes], str]:
    """The bzImage, the guest modules and the kernel release, read from the package's data."""
    with subprocess.Popen(
        ["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None
        vmlinuz: bytes | None = None
        release = ""
        modules: dict[str, bytes] = {}
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for member in tar:
                name = member.name.lstrip("./")
                if not member.isfile():
                    continue
                if name.startswith("boot/vmlinuz-"):
                    release = name.removeprefix("boot/vmlinuz-")
                    vmlinuz = _read_member(tar, member)
                elif name.startswith("lib/modules/"):
                    rel = name.split("/kernel/", 1)[-1]
                    if rel in GUEST_MODULES:
                        modules[rel] = _read_member(tar, member)
    if proc.returncode != 0 or vmlinuz is None:
        raise BackendUnavailable(f"{deb.name} holds no kernel", fix="check the package")
    missing = [m for m in GUEST_MODULES if m not in modules]
    if missing:
        raise BackendUnavailable(
            f"{deb.name} lacks guest modules {missing}", fix="use Debian's linux-image-amd64"
        )
    return vmlinuz, modules, release


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    f = tar.extractfile(member)
    assert f is not None
    return f.read()


def decompress_bzimage(bzimage: bytes) -> bytes:
    """The ELF kernel inside an xz-compressed bzImage.

    Raises:
        BackendUnavailable: the image is not xz-compressed or holds no ELF.
    """
    at = bzimage.find(XZ_MAGIC)
    if at < 0:
        raise BackendUnavailable("the kernel is not xz-compressed", fix="use Debian's kernel")
    elf = lzma.LZMADecompressor().decompress(bzimage[at:])
    if not elf.startswith(b"\x7fELF"):
        raise BackendUnavailable("the decompressed kernel is no ELF", fix="use Debian's kernel")
    return elf


@dataclass(frozen=True, slots=True)
class _Entry:
    path: str  # without a leading slash
    mode: int  # full st_mode
    data: bytes = b""


def _root_entries(modules: dict[str, bytes]) -> list[_Entry]:
    d = stat.S_IFDIR | 0o755
    entries = [_Entry(p, d) for p in (
        "bin", "sbin", "dev", "proc", "sys", "tmp", "run", "root", "etc", "lib", "lib/modules",
        "usr", "usr/bin", "usr/sbin", "mnt",
    )]
    entries.append(_Entry("dev/console", stat.S_IFCHR | 0o600))  # rdev set in write_newc
    entries.append(_Entry("bin/busybox", stat.S_IFREG | 0o755, Path(BUSYBOX_PATH).read_bytes()))
    entries.append(_Entry("sbin/cc-vm-agent", stat.S_IFREG | 0o755, Path(AGENT_PATH).read_bytes()))
    entries.append(_Entry("init", stat.S_IFREG | 0o755, init_script().encode()))
    for rel, data in modules.items():
        entries.append(_Entry(f"lib/modules/{Path(rel).name}", stat.S_IFREG | 0o644, data))
    etc = {
        "etc/hostname": f"{GUEST_HOSTNAME}\n",
        "etc/passwd": "root:x:0:0:root:/root:/bin/sh\n",
        "etc/group": "root:x:0:\n",
        "etc/hosts": f"127.0.0.1 localhost {GUEST_HOSTNAME}\n",
        "etc/resolv.conf": "# no DNS in the guest: names are resolved by the egress proxies\n",
    }
    entries.extend(_Entry(p, stat.S_IFREG | 0o644, t.encode()) for p, t in etc.items())
    return entries


def write_newc(out: io.BufferedWriter | io.BytesIO, entries: Iterable[_Entry]) -> None:
    """Write `entries` as a newc cpio archive (what the kernel unpacks as initramfs)."""

    def pad(n: int) -> bytes:
        return b"\0" * ((4 - n % 4) % 4)

    ino = 1
    for entry in [*entries, _Entry("TRAILER!!!", 0)]:
        name = entry.path.encode() + b"\0"
        rdev_major, rdev_minor = (5, 1) if entry.path == "dev/console" else (0, 0)
        fields = (
            ino, entry.mode, 0, 0, 1, 0, len(entry.data), 0, 0, rdev_major, rdev_minor,
            len(name), 0,
        )
        header = b"070701" + b"".join(f"{v:08x}".encode() for v in fields)
        out.write(header + name + pad(len(header) + len(name)))
        out.write(entry.data + pad(len(entry.data)))
        ino += 1

