"""Symlink-safe opens below a directory file descriptor.

Two resolvers with one contract, `open_beneath(dirfd, relative, flags, mode) -> fd`: the opened
object is at or below `dirfd`, and no link is followed out of it, whatever is swapped in the
tree while the call runs.

- `Openat2Resolver` (Linux 5.6+): one `openat2(2)` with RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS.
  The kernel resolves the path atomically against the tree: a relative symlink that stays below
  `dirfd` is followed, an absolute one or one climbing out fails with EXDEV, /proc magic links
  fail with ELOOP.
- `WalkResolver` (everywhere): component by component with O_NOFOLLOW | O_DIRECTORY, each
  opened relative to the previous directory's descriptor; any symlink at all is refused (ELOOP).

`real_path(fd)` names what a descriptor actually is (Linux: /proc/self/fd), so a rule is checked
on the object opened, not on the path asked for.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import platform
import stat
from typing import Final, Protocol

__all__ = [
    "Openat2Resolver",
    "Resolver",
    "WalkResolver",
    "default_resolver",
    "real_path",
]

RESOLVE_NO_MAGICLINKS: Final = 0x02
RESOLVE_NO_SYMLINKS: Final = 0x04
RESOLVE_BENEATH: Final = 0x08
# openat2 has one number on every architecture (the syscall table was unified at 403+).
SYS_OPENAT2: Final = 437
_OPEN_HOW_SIZE: Final = 24  # struct open_how: u64 flags, u64 mode, u64 resolve


class _OpenHow(ctypes.Structure):
    _fields_ = (
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    )


class Resolver(Protocol):
    """Opens `relative` below `dirfd` without following a link out of it."""

    name: str

    def open_beneath(
        self, dirfd: int, relative: str, flags: int, mode: int = 0o666, *, follow: bool = True
    ) -> int:
        """Return a new descriptor (O_CLOEXEC), or raise OSError (EXDEV/ELOOP for an escape).

        `follow=False` refuses every symlink on the way, including the last component.
        """
        ...


def _split(relative: str) -> list[str]:
    parts = [p for p in relative.split("/") if p and p != "."]
    if ".." in parts:
        raise OSError(errno.EXDEV, "'..' is never resolved below a tree", relative)
    return parts


def _open_nofollow(name: str, flags: int, mode: int, dirfd: int) -> int:
    """openat with O_NOFOLLOW; a link met as a directory (ENOTDIR) is reported as ELOOP."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=dirfd)
    except NotADirectoryError:
        try:
            is_link = stat.S_ISLNK(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
        except OSError:
            is_link = False
        if is_link:
            raise OSError(errno.ELOOP, "a symbolic link is never followed", name) from None
        raise


class WalkResolver:
    """Component by component with O_NOFOLLOW; every symlink is refused."""

    name = "walk"

    def open_beneath(
        self, dirfd: int, relative: str, flags: int, mode: int = 0o666, *, follow: bool = True
    ) -> int:
        del follow  # this resolver never follows a link
        parts = _split(relative)
        if not parts:
            return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=dirfd)
        current = dirfd
        try:
            for part in parts[:-1]:
                nxt = _open_nofollow(part, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, current)
                if current != dirfd:
                    os.close(current)
                current = nxt
            return _open_nofollow(parts[-1], flags | os.O_CLOEXEC, mode, current)
        finally:
            if current != dirfd:
                os.close(current)


class Openat2Resolver:
    """One openat2(2) call with RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS."""

    name = "openat2"

    def __init__(self) -> None:
        libc_name = ctypes.util.find_library("c") or "libc.so.6"
        self._libc = ctypes.CDLL(libc_name, use_errno=True)
        self._syscall = self._libc.syscall
        self._syscall.restype = ctypes.c_long

    def open_beneath(
        self, dirfd: int, relative: str, flags: int, mode: int = 0o666, *, follow: bool = True
    ) -> int:
        _split(relative)  # '..' is refused even where the kernel would keep it beneath
        how = _OpenHow()
        how.flags = flags | os.O_CLOEXEC
        how.mode = mode if flags & os.O_CREAT else 0
        how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS
        if not follow:
            how.resolve |= RESOLVE_NO_SYMLINKS
        path = os.fsencode(relative or ".")
        fd = self._syscall(
            ctypes.c_long(SYS_OPENAT2),
            ctypes.c_int(dirfd),
            ctypes.c_char_p(path),
            ctypes.byref(how),
            ctypes.c_size_t(_OPEN_HOW_SIZE),
        )
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), relative)
        return int(fd)


def _probe_openat2() -> Resolver | None:
    if platform.system() != "Linux":
        return None
    try:
        resolver = Openat2Resolver()
    except OSError:
        return None
    root = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = resolver.open_beneath(root, ".", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    finally:
        os.close(root)
    os.close(fd)
    return resolver


_DEFAULT: list[Resolver] = []


def default_resolver() -> Resolver:
    """openat2 where the kernel has it, else the O_NOFOLLOW walk (decided once)."""
    if not _DEFAULT:
        _DEFAULT.append(_probe_openat2() or WalkResolver())
    return _DEFAULT[0]


def real_path(fd: int, fallback: str) -> str:
    """The path of what `fd` is open on (Linux: /proc/self/fd); `fallback` where unknown.

    The walk resolver never follows a link, so its path as built is already the real one.
    """
    with contextlib.suppress(OSError):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if target.startswith("/"):
            return target
    return fallback
