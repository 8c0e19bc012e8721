"""The seccomp filter bubblewrap installs on the sandboxed command, as classic BPF bytes.

Built with libseccomp (through pyseccomp) so architecture checks, x32 aliases and jump tables are
the library's business, not ours. Default action: allow. The filter refuses what the namespaces do
not already stop, or what would let a process leave them:

- io_uring: its operations (openat, connect, ...) bypass seccomp argument checks entirely;
- new user namespaces (clone/unshare with CLONE_NEWUSER) and every namespace flag, setns;
  clone3 passes its flags in memory BPF cannot read, so it gets ENOSYS and libc falls back to clone;
- the mount family: even without capabilities, refuse at the syscall so a future capability leak
  cannot remount a mask;
- kernel keyrings (not namespaced), bpf, perf_event_open, userfaultfd (exploit aids), TIOCSTI
  and TIOCLINUX (typing into the host terminal);
- a setuid or setgid bit on anything the command creates or changes the mode of (`chmod`
  and its `f`/`at`/`at2` forms, and the mode of `open`, `openat`, `creat`, `mkdir(at)`,
  `mknod(at)`): such a file in a writable bind would be a setuid program on the host, whoever
  runs it there. `openat2` carries its mode in memory BPF cannot read, so it gets ENOSYS and
  libc falls back to `openat`.

Any syscall from a foreign ABI (i386 `int 0x80`, x32) kills the process: libseccomp's default for
architectures not added to the filter.
"""

from __future__ import annotations

import errno
import functools
import os
from typing import Any, Final

__all__ = [
    "DENIED_SYSCALLS",
    "MODE_ARGUMENT",
    "NAMESPACE_FLAGS",
    "SET_ID_BITS",
    "export_bpf",
    "filter_bpf",
]

CLONE_NEWNS: Final = 0x00020000
CLONE_NEWCGROUP: Final = 0x02000000
CLONE_NEWUTS: Final = 0x04000000
CLONE_NEWIPC: Final = 0x08000000
CLONE_NEWUSER: Final = 0x10000000
CLONE_NEWPID: Final = 0x20000000
CLONE_NEWNET: Final = 0x40000000
CLONE_NEWTIME: Final = 0x00000080
NAMESPACE_FLAGS: Final = (
    CLONE_NEWNS,
    CLONE_NEWCGROUP,
    CLONE_NEWUTS,
    CLONE_NEWIPC,
    CLONE_NEWUSER,
    CLONE_NEWPID,
    CLONE_NEWNET,
    CLONE_NEWTIME,
)
S_ISUID: Final = 0o4000
S_ISGID: Final = 0o2000
SET_ID_BITS: Final = (S_ISUID, S_ISGID)
# Which argument of each call is the mode a new or changed inode gets (fchmodat2 is 452 on every
# architecture; older libseccomp releases do not know its name).
MODE_ARGUMENT: Final[tuple[tuple[str | int, int], ...]] = (
    ("chmod", 1),
    ("fchmod", 1),
    ("fchmodat", 2),
    (452, 2),  # fchmodat2
    ("open", 2),
    ("openat", 3),
    ("creat", 1),
    ("mkdir", 1),
    ("mkdirat", 2),
    ("mknod", 1),
    ("mknodat", 2),
)
TIOCSTI: Final = 0x5412
TIOCLINUX: Final = 0x541C

# Refused outright with EPERM, each with its reason.
DENIED_SYSCALLS: Final[tuple[tuple[str, str], ...]] = (
    ("io_uring_setup", "io_uring ops bypass seccomp checks"),
    ("io_uring_enter", "io_uring ops bypass seccomp checks"),
    ("io_uring_register", "io_uring ops bypass seccomp checks"),
    ("setns", "joining another namespace"),
    ("mount", "mount family: could remount a mask"),
    ("umount2", "mount family: could unmount a mask"),
    ("pivot_root", "mount family"),
    ("move_mount", "new mount API"),
    ("open_tree", "new mount API"),
    ("fsopen", "new mount API"),
    ("fsconfig", "new mount API"),
    ("fsmount", "new mount API"),
    ("fspick", "new mount API"),
    ("mount_setattr", "new mount API"),
    ("chroot", "changing root"),
    ("keyctl", "kernel keyrings are not namespaced"),
    ("add_key", "kernel keyrings are not namespaced"),
    ("request_key", "kernel keyrings are not namespaced"),
    ("bpf", "kernel attack surface"),
    ("perf_event_open", "side channels and kernel attack surface"),
    ("userfaultfd", "race-widening exploit aid"),
    ("kexec_load", "kernel replacement"),
    ("kexec_file_load", "kernel replacement"),
    ("init_module", "kernel modules"),
    ("finit_module", "kernel modules"),
    ("delete_module", "kernel modules"),
)


@functools.cache
def filter_bpf() -> bytes:
    """The filter as BPF bytes, ready for `bwrap --seccomp FD`. Built once per process.

    Raises:
        OSError: libseccomp is missing or refused the rules (callers turn this into
            EnforcementFailed: the command does not run without its filter).
    """
    import pyseccomp as sc  # lazy import (loads libseccomp via ctypes; only when planning)

    flt = sc.SyscallFilter(sc.ALLOW)
    eperm = sc.ERRNO(errno.EPERM)
    for name, _reason in DENIED_SYSCALLS:
        flt.add_rule(eperm, name)
    for flag in NAMESPACE_FLAGS:
        flt.add_rule(eperm, "unshare", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for call, index in MODE_ARGUMENT:
        for bit in SET_ID_BITS:
            flt.add_rule(eperm, call, sc.Arg(index, sc.MASKED_EQ, bit, bit))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "openat2")
    for request in (TIOCSTI, TIOCLINUX):
        flt.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))

    return export_bpf(flt, "cc-seccomp")


def export_bpf(flt: Any, name: str) -> bytes:
    """A libseccomp filter's BPF program as bytes, exported through a memfd called `name`.

    Raises:
        OSError: the memfd could not be made or libseccomp refused to export.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        with os.fdopen(os.dup(fd), "wb", buffering=0) as handle:
            flt.export_bpf(handle)
        size = os.lseek(fd, 0, os.SEEK_END)
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)
