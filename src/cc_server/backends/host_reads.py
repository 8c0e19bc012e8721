"""What a planner read of the host, kept so that the same reading can be checked again cheaply.

A plan is a pure function of its inputs and of what it read of the host (backends/bubblewrap.py
reads the host only through HostFacts; rundir.base_dir_views through a `rundir.Reader`). A
`HostReads` answers those reads (lstat, stat, readlink, listdir, a file's bytes), each the first
time from the host and then from memory, and keeps every answer. `hold()` asks the host every
recorded question again: when each answer is the same, a planning run now would read the same
answers, and so make the same plan (the planner is deterministic); when one differs (a path
appeared, went, was replaced by a symlink or another inode, a mount changed what a path names, a
listing or a file changed), the plan must be made again.

No timestamp is trusted: the questions are asked again, not inferred from a directory's mtime, so
two changes in one clock tick cannot hide one another. An answer is compared by what a planner can
use of it: the errno of a failure, and of a stat its device, inode, mode, owner and group.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

__all__ = ["HostReads"]

_MISSING: Final = object()


@dataclass(frozen=True, slots=True, kw_only=True)
class _Checks:
    """What `HostReads.hold` asks again, sorted by how (`HostReads._sorted`)."""

    present: tuple[str, ...]
    missing: tuple[str, ...]
    lstats: tuple[tuple[str, tuple[int, int, int, int, int]], ...]
    others: tuple[tuple[str, str, int, object], ...]


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

    def _ask(self, op: str, path: str, limit: int = -1) -> object:
        key = (op, path, limit)
        found = self._seen.get(key, _MISSING)
        if found is _MISSING:
            found = self._seen[key] = _read(op, path, limit)
            self._absent = None
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
            self._absent = None
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

    def hold(self) -> bool:
        """Whether every recorded read gets the same answer from the host now.

        A path that did not exist is asked about through its shallowest missing ancestor,
        found at the first `hold` (one question for `~/.config/gh`, `~/.config/op`, ... while
        `~/.config` is missing): a lookup that fails at an ancestor fails for every path below
        it, so the answer stays the recorded one while the ancestor is missing."""
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
        f_ok = os.F_OK
        for path in checks.present:
            if not exists(path, f_ok, follow_symlinks=False):
                return False
        lstat = os.lstat
        for path, key in checks.lstats:
            try:
                now = lstat(path)
            except OSError:
                return False
            if (now.st_ino, now.st_dev, now.st_mode, now.st_uid, now.st_gid) != key:
                return False
        for op, path, limit, was in checks.others:
            if not _same(was, _read(op, path, limit)):
                return False
        return not any(exists(path, f_ok, follow_symlinks=False) for path in self._absent)

    def _sorted(self) -> _Checks:
        """The recorded questions by how `hold` asks them again: a path that existed (`lexists`)
        by `access`, one that was missing through its shallowest missing ancestor, a `lstat` that
        answered by its key, the rest as they were asked. A `lexists` also asked as an `lstat`
        is asked as that, which says more."""
        seen = self._seen
        present: list[str] = []
        missing: list[str] = []
        lstats: list[tuple[str, tuple[int, int, int, int, int]]] = []
        others: list[tuple[str, str, int, object]] = []
        for (op, path, limit), was in seen.items():
            if op == "lexists":
                if ("lstat", path, -1) in seen:
                    continue
                (present if was is True else missing).append(path)
            elif op == "lstat" and isinstance(was, os.stat_result):
                lstats.append((path, (was.st_ino, was.st_dev, was.st_mode, was.st_uid,
                                      was.st_gid)))
            else:
                others.append((op, path, limit, was))
        return _Checks(present=tuple(present), missing=tuple(missing), lstats=tuple(lstats),
                       others=tuple(others))

    @property
    def questions(self) -> int:
        """How many questions `hold` asks again."""
        return len(self._seen)


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
