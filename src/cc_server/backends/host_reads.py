"""What a planner read of the host, kept so that the same reading can be checked again cheaply.

A plan is a pure function of its inputs and of what it read of the host (backends/bubblewrap.py
reads the host only through HostFacts; rundir.base_dir_views through a `rundir.Reader`). A
`HostReads` answers those reads (lstat, stat, readlink, listdir, a file's bytes), each the first
time from the host and then from memory, and keeps every answer. `hold()` asks the host every
recorded question again: when each answer is the same, a planning run now would read the same
answers, and so make the same plan (the planner is deterministic); when one differs (a path
appeared, went, was replaced by a symlink or another inode, a mount changed what a path names, a
listing or a file changed), the plan must be made again.

Whether a name exists in a directory, and a directory's listing, are answered by the directory's
device, inode and ctime where that is exact (`_stamp`): every entry added, removed or renamed in a
directory sets its ctime to the time of the change, and nobody can set a ctime back but by setting
the clock. The stamp is taken before the names are asked again, and trusted only for a directory
of ext2/3/4 or XFS on a block device (its device number names that device) whose ctime is older
than STAMP_AGE_NS then: a change after that stat is stamped later than that, whatever the clock's
tick or the filesystem's granularity. Everything else is asked again. An answer is compared by
what a planner can use of it: the errno of a failure, and of a stat its device, inode, mode,
owner and group.
"""

from __future__ import annotations

import contextlib
import functools
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["HostReads"]

_MISSING: Final = object()
# A directory stamp (`_stamp`) is trusted only while its ctime was at least this old when it was
# taken: more than any filesystem's timestamp granularity (1 s on ext4 with small inodes) and
# clock tick, so a change made after the stamp cannot be stamped with the same time.
STAMP_AGE_NS: Final = 2 * 10**9
# statfs f_type of the filesystems whose directory ctime is known to follow every change of
# their entries: ext2/3/4 and XFS.
STAMPED_FS_TYPES: Final = frozenset({0xEF53, 0x58465342})


@dataclass(frozen=True, slots=True, kw_only=True)
class _Checks:
    """What `HostReads.hold` asks again, sorted by how (`HostReads._sorted`)."""

    present: tuple[str, ...]
    missing: tuple[str, ...]
    stats: tuple[tuple[Callable[[str], os.stat_result], str, tuple[int, int, int, int, int]], ...]
    others: tuple[tuple[str, str, int, object], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Names:
    """Names `hold` asks about in one directory (None: paths not in plain absolute form): those
    that existed, and the shallowest missing ancestors of those that did not."""

    directory: str | None
    present: tuple[str, ...]
    absent: tuple[str, ...]


class HostReads:
    """The host reads of one planning run, answered once each and checked again by `hold`.

    Failures are kept and raised again as they came (an OSError with the same errno), so a
    caller's `except OSError` sees what it would have seen reading the host itself.
    """

    def __init__(self) -> None:
        # (operation, path, limit) -> the first answer: a value, or the OSError raised.
        self._seen: dict[tuple[str, str, int], object] = {}
        self._realpath: dict[str, str] = {}
        self._absent: frozenset[str] | None = None  # hold's missing ancestors, once found
        self._checks: _Checks | None = None  # hold's questions, sorted with `_absent`
        self._names: tuple[_Names, ...] = ()  # `_checks`' names by directory
        # Directory -> its stamp when every name asked in it (or its listing) was last found
        # the same, and the stamp could be trusted; forgotten with `_absent`.
        self._stamps: dict[str, tuple[int, int, int]] = {}
        self.stamped = 0  # directories whose names `hold` took from a stamp (for tests)

    def _ask(self, op: str, path: str, limit: int = -1) -> object:
        key = (op, path, limit)
        found = self._seen.get(key, _MISSING)
        if found is _MISSING:
            found = self._seen[key] = _read(op, path, limit)
            self._forget_sorted()
        if isinstance(found, OSError):
            raise OSError(found.errno, found.strerror, path)
        return found

    def lstat(self, path: str) -> os.stat_result:
        """`os.lstat(path)`, recorded. Raises OSError as the host did."""
        found = self._ask("lstat", path)
        assert isinstance(found, os.stat_result)
        return found

    def stat(self, path: str) -> os.stat_result:
        """`os.stat(path)` (symlinks followed), recorded. Raises OSError as the host did."""
        found = self._ask("stat", path)
        assert isinstance(found, os.stat_result)
        return found

    def readlink(self, path: str) -> str:
        """`os.readlink(path)`, recorded. Raises OSError as the host did."""
        found = self._ask("readlink", path)
        assert isinstance(found, str)
        return found

    def listdir(self, path: str) -> list[str]:
        """`os.listdir(path)`, sorted, recorded. Raises OSError as the host did."""
        found = self._ask("listdir", path)
        assert isinstance(found, tuple)
        return list(found)

    def read(self, path: str, limit: int = -1) -> bytes:
        """The first `limit` bytes of file `path` (all of it: -1), recorded. Raises OSError as
        the host did."""
        found = self._ask("read", path, limit)
        assert isinstance(found, bytes)
        return found

    def lexists(self, path: str) -> bool:
        """`os.path.lexists(path)`, recorded as a yes or no (one lstat)."""
        if "\0" in path:  # os.path.lexists says no without asking the host
            return False
        found = self._seen.get(("lstat", path, -1), _MISSING)
        if found is _MISSING:
            found = self._seen.setdefault(("lexists", path, -1), _read("lexists", path, -1))
            self._forget_sorted()
        return not isinstance(found, OSError)

    def isdir(self, path: str) -> bool:
        """`os.path.isdir(path)`, from `stat`."""
        try:
            return stat.S_ISDIR(self.stat(path).st_mode)
        except (OSError, ValueError):
            return False

    def realpath(self, path: str) -> str:
        """`os.path.realpath(path)` (non-strict, Python 3.11's algorithm), from `lstat` and
        `readlink`."""
        found = self._realpath.get(path)
        if found is None:
            resolved, _ = self._join_real("", path, {})
            found = self._realpath[path] = os.path.abspath(resolved)
        return found

    def _join_real(self, path: str, rest: str, seen: dict[str, str | None]) -> tuple[str, bool]:
        """posixpath._joinrealpath of Python 3.11, reading through this object."""
        if rest.startswith("/"):
            rest, path = rest[1:], "/"
        while rest:
            name, _, rest = rest.partition("/")
            if not name or name == ".":
                continue
            if name == "..":
                if path:
                    path, name = os.path.split(path)
                    if name == "..":
                        path = os.path.join(path, "..", "..")
                else:
                    path = ".."
                continue
            newpath = os.path.join(path, name)
            try:
                is_link = stat.S_ISLNK(self.lstat(newpath).st_mode)
            except OSError:
                is_link = False
            if not is_link:
                path = newpath
                continue
            if newpath in seen:
                known = seen[newpath]
                if known is not None:
                    path = known
                    continue
                return os.path.join(newpath, rest), False  # a symlink loop
            seen[newpath] = None
            path, ok = self._join_real(path, self.readlink(newpath), seen)
            if not ok:
                return os.path.join(path, rest), False
            seen[newpath] = path
        return path, True

    def _forget_sorted(self) -> None:
        self._absent = None
        self._stamps.clear()

    def hold(self) -> bool:
        """Whether every recorded read gets the same answer from the host now.

        A path that did not exist is asked about through its shallowest missing ancestor,
        found at the first `hold` (one question for `~/.config/gh`, `~/.config/op`, ... while
        `~/.config` is missing): a lookup that fails at an ancestor fails for every path below
        it, so the answer stays the recorded one while the ancestor is missing. The names asked
        in one directory, and a listing, are not asked again while the directory's trusted
        stamp is the same (see the module's docstring)."""
        exists = _exists_now()
        if exists is None:
            return all(_same(was, _read(op, path, limit))
                       for (op, path, limit), was in self._seen.items())
        checks = self._checks
        if self._absent is None or checks is None:
            checks = self._sorted()
            absent = _absent_ancestors(checks.missing)
            if absent is None:
                return False
            self._absent, self._checks = absent, checks
            self._names = _by_directory(checks.present, absent)
        if not self._same_names(exists):
            return False
        for asked, path, key in checks.stats:
            try:
                now = asked(path)
            except OSError:
                return False
            if (now.st_ino, now.st_dev, now.st_mode, now.st_uid, now.st_gid) != key:
                return False
        for op, path, limit, was in checks.others:
            if op == "listdir" and not isinstance(was, OSError):
                if not self._same_listing(path, was):
                    return False
            elif not _same(was, _read(op, path, limit)):
                return False
        return True

    def _same_names(self, exists: Callable[..., bool]) -> bool:
        """Whether every name asked exists now as it did: a directory's names by its stamp
        while that is trusted and the same, else each again (then the stamp taken before
        them is kept when it can be trusted)."""
        f_ok, stamps, time_ns, stat_now = os.F_OK, self._stamps, time.time_ns, os.stat
        for names in self._names:
            directory = names.directory
            info: os.stat_result | None = None
            if directory is not None:
                asked_ns = time_ns()  # before the stamp: a change after it is stamped later
                with contextlib.suppress(OSError):
                    info = stat_now(directory)
                if info is not None and stamps.get(directory) == (
                        info.st_dev, info.st_ino, info.st_ctime_ns):
                    self.stamped += 1
                    continue
            for path in names.present:
                if not exists(path, f_ok, follow_symlinks=False):
                    return False
            for path in names.absent:
                if exists(path, f_ok, follow_symlinks=False):
                    return False
            if directory is not None:
                if info is not None and _stamp_trusted(directory, info, asked_ns):
                    stamps[directory] = (info.st_dev, info.st_ino, info.st_ctime_ns)
                else:
                    stamps.pop(directory, None)
        return True

    def _same_listing(self, path: str, was: object) -> bool:
        """Whether directory `path` still lists `was`: by its trusted stamp, else read again."""
        now = time.time_ns()
        try:
            info = os.stat(path)
        except OSError:
            return False
        key = (info.st_dev, info.st_ino, info.st_ctime_ns)
        stamp_of = f"listdir\0{path}"  # not a path: never a names directory's key
        if self._stamps.get(stamp_of) == key:
            self.stamped += 1
            return True
        if not _same(was, _read("listdir", path, -1)):
            return False
        if _stamp_trusted(path, info, now):
            self._stamps[stamp_of] = key
        return True

    def _sorted(self) -> _Checks:
        """The recorded questions by how `hold` asks them again: a path that existed (`lexists`)
        by `access`, one that was missing through its shallowest missing ancestor, a `lstat` that
        answered (and a `stat`) by its key, the rest as they were asked. A `lexists` also asked
        as an `lstat` is asked as that, which says more."""
        seen = self._seen
        present: list[str] = []
        missing: list[str] = []
        stats: list[tuple[Callable[[str], os.stat_result], str,
                          tuple[int, int, int, int, int]]] = []
        others: list[tuple[str, str, int, object]] = []
        for (op, path, limit), was in seen.items():
            if op == "lexists":
                if ("lstat", path, -1) in seen:
                    continue
                (present if was is True else missing).append(path)
            elif op in ("lstat", "stat") and isinstance(was, os.stat_result):
                stats.append((os.lstat if op == "lstat" else os.stat, path,
                              (was.st_ino, was.st_dev, was.st_mode, was.st_uid, was.st_gid)))
            else:
                others.append((op, path, limit, was))
        return _Checks(present=tuple(present), missing=tuple(missing), stats=tuple(stats),
                       others=tuple(others))

    @property
    def questions(self) -> int:
        """How many questions `hold` asks again."""
        return len(self._seen)


def _by_directory(present: Iterable[str], absent: Iterable[str]) -> tuple[_Names, ...]:
    """The names by the directory they are looked up in; paths not in plain absolute form (and
    `/`) on their own, asked every time."""
    found: dict[str | None, tuple[list[str], list[str]]] = {}
    for index, paths in enumerate((present, absent)):
        for path in paths:
            directory: str | None = os.path.dirname(path)
            if (not path.startswith("/") or path.startswith("//") or directory == path
                    or os.path.normpath(path) != path):
                directory = None
            found.setdefault(directory, ([], []))[index].append(path)
    return tuple(_Names(directory=directory, present=tuple(p), absent=tuple(a))
                 for directory, (p, a) in found.items())


def _stamp_trusted(path: str, info: os.stat_result, now_ns: int) -> bool:
    """Whether `info`, a stat of directory `path` made after `now_ns`, may stand for its entries
    from now on: a directory on a block device of a STAMPED_FS_TYPES filesystem, its ctime
    older than STAMP_AGE_NS at `now_ns`."""
    return (
        stat.S_ISDIR(info.st_mode)
        and os.major(info.st_dev) != 0
        and info.st_ctime_ns < now_ns - STAMP_AGE_NS
        and _fs_type(path) in STAMPED_FS_TYPES
    )


def _fs_type(path: str) -> int | None:
    """statfs(2)'s f_type for `path` (the first word of struct statfs), or None."""
    import ctypes  # lazy: only when a stamp is about to be trusted

    buffer = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    try:
        if _libc().statfs(os.fsencode(path), buffer) != 0:
            return None
    except (ValueError, AttributeError, OSError):  # a NUL in the path, no statfs in this libc
        return None
    return ctypes.c_ulong.from_buffer(buffer).value


@functools.cache
def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _absent_ancestors(paths: Iterable[str]) -> frozenset[str] | None:
    """For each path, the shallowest of it and its ancestors that is missing now (a path not in
    plain absolute form stands for itself); None when one of them exists now."""
    access, f_ok = os.access, os.F_OK
    found: set[str] = set()
    for path in paths:
        if not path.startswith("/") or path.startswith("//") or os.path.normpath(path) != path:
            if access(path, f_ok, follow_symlinks=False):
                return None
            found.add(path)
            continue
        prefix = ""
        for part in path[1:].split("/"):
            prefix = f"{prefix}/{part}"
            if not access(prefix, f_ok, follow_symlinks=False):
                found.add(prefix)
                break
        else:
            return None
    return frozenset(found)


def _exists_now() -> Callable[..., bool] | None:
    """`os.access`, which asks what lstat would answer to `lexists` without raising (faster),
    when this process's real ids are its effective ones (access checks the real ones)."""
    if os.getuid() == os.geteuid() and os.getgid() == os.getegid():
        return os.access
    return None


def _read(op: str, path: str, limit: int) -> object:
    """One read of the host: its answer (`lexists`: True or False), or the OSError it raised."""
    try:
        if op == "lexists":
            os.lstat(path)
            return True
        if op == "lstat":
            return os.lstat(path)
        if op == "stat":
            return os.stat(path)
        if op == "readlink":
            return os.readlink(path)
        if op == "listdir":
            return tuple(sorted(os.listdir(path)))
        return _read_file(path, limit)
    except OSError as exc:
        return exc


def _same(was: object, now: object) -> bool:
    """Whether two answers to one question say the same to a planner: a failure by its errno, a
    stat by its device, inode, mode, owner and group, anything else by equality."""
    if isinstance(was, OSError) or isinstance(now, OSError):
        return isinstance(was, OSError) and isinstance(now, OSError) and was.errno == now.errno
    if isinstance(was, os.stat_result) and isinstance(now, os.stat_result):
        return _stat_key(was) == _stat_key(now)
    return was == now


def _stat_key(result: os.stat_result) -> tuple[int, ...]:
    return (result.st_dev, result.st_ino, result.st_mode, result.st_uid, result.st_gid)


def _read_file(path: str, limit: int) -> bytes:
    """The first `limit` bytes of `path` (-1: all of them)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        chunks, size = [], 0
        while limit < 0 or size < limit:
            chunk = os.read(fd, 1 << 16 if limit < 0 else min(1 << 16, limit - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
