"""The user's private runtime directory for cc-server: session sockets, the server's token, the
CLI daemon's socket. Stdlib only, so the `cc-server` command's first step can use it cheaply.

A user can have several base directories at once (one server with `XDG_RUNTIME_DIR` set, a CLI
daemon without it, another `TMPDIR`), and each can be visible under more than one path (a bind
mount of `/tmp` elsewhere). Every base other than the canonical `/tmp/cc-server-<uid>` records
itself in that one's `bases/` directory, so `base_dir_views` can find them all, and then every
path where one is visible, by device and inode, for the sandboxes to hide.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import re
import stat
from collections.abc import Mapping
from typing import Final, Protocol

from cc_server.errors import EnforcementFailed
from cc_server.policy.paths import is_within

__all__ = [
    "BASE_DIR_NAME",
    "Reader",
    "base_dir_views",
    "egress_base_dir",
    "forget_server_token",
    "known_base_dirs",
    "live_server_token_files",
    "names_of_dead_owners",
    "pid_alive",
    "record_server_token",
]

BASE_DIR_NAME: Final = "cc-server"
REGISTRY_NAME: Final = "bases"  # in the canonical base: one file per other base, naming it
MAX_REGISTERED: Final = 256  # entries read from the registry; a user has a handful of bases
MAX_SCANNED: Final = 4096  # entries looked at (those of bases that are gone are removed)
# Bytes of a registry entry read to take its first 4096 characters the way a text file does
# (io.TextIOWrapper reads 8 KiB chunks; 4096 UTF-8 characters need at most three).
ENTRY_READ_BYTES: Final = 32 * 1024


class Reader(Protocol):
    """How `known_base_dirs` and `base_dir_views` read the host: directly (the default), or
    through a recorder whose reads can be checked again (backends/host_reads.HostReads)."""

    def lstat(self, path: str) -> os.stat_result:
        """`os.lstat`."""
        ...

    def isdir(self, path: str) -> bool:
        """`os.path.isdir`."""
        ...

    def realpath(self, path: str) -> str:
        """`os.path.realpath`."""
        ...

    def listdir(self, path: str) -> list[str]:
        """`os.listdir`, sorted."""
        ...

    def read(self, path: str, limit: int = -1) -> bytes:
        """The first `limit` bytes of a file (-1: all of it)."""
        ...


class _Host:
    """A Reader that reads the host directly, every time."""

    lstat = staticmethod(os.lstat)
    isdir = staticmethod(os.path.isdir)

    @staticmethod
    def realpath(path: str) -> str:
        return os.path.realpath(path)

    @staticmethod
    def listdir(path: str) -> list[str]:
        return sorted(os.listdir(path))

    @staticmethod
    def read(path: str, limit: int = -1) -> bytes:
        with open(path, "rb") as f:
            return f.read(limit)


_HOST: Final[Reader] = _Host()


def _text(data: bytes, limit: int = -1) -> str:
    """What a text-mode UTF-8 `read(limit)` of a file holding `data` returns (newlines too)."""
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8").read(limit)


def egress_base_dir(
    environ: Mapping[str, str] = os.environ, tmp_dir: str | None = None
) -> str:
    """The private base directory for session sockets: `$XDG_RUNTIME_DIR/cc-server` when that is
    set, else `<tmp>/cc-server-<uid>`. Created 0700; refused unless it is ours and private.

    Raises:
        EnforcementFailed: the directory exists but belongs to someone else or is open to others.
    """
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        base = os.path.join(runtime, BASE_DIR_NAME)
    else:
        if tmp_dir is None:
            import tempfile  # lazy import: only without XDG_RUNTIME_DIR

            tmp_dir = tempfile.gettempdir()
        tmp = tmp_dir
        base = os.path.join(tmp, f"{BASE_DIR_NAME}-{os.geteuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(base, 0o700)
    info = os.lstat(base)
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.geteuid()
        or stat.S_IMODE(info.st_mode) & 0o077
    ):
        raise EnforcementFailed(
            f"{base} is not a private directory owned by this user",
            fix=f"remove {base} (someone else may have created it) and start again",
        )
    _register(base)
    return base


def _canonical_base() -> str:
    """The one base every process of this user can name without its environment."""
    return f"/tmp/{BASE_DIR_NAME}-{os.geteuid()}"


def _private_dir(path: str, reader: Reader | None = None) -> os.stat_result | None:
    try:
        info = (_HOST if reader is None else reader).lstat(path)
    except OSError:
        return None
    if (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.geteuid()
        and not stat.S_IMODE(info.st_mode) & 0o077
    ):
        return info
    return None


def _register(base: str) -> None:
    """Record `base` in the canonical base's registry (best effort: a base that cannot be
    recorded is still found when it is one of the usual spellings)."""
    canonical = _canonical_base()
    if os.path.realpath(base) == canonical:
        return
    registry = os.path.join(canonical, REGISTRY_NAME)
    entry = os.path.join(registry, hashlib.sha256(os.fsencode(base)).hexdigest()[:16])
    if os.path.lexists(entry):
        return
    with contextlib.suppress(OSError):
        with contextlib.suppress(FileExistsError):
            os.mkdir(canonical, 0o700)
        with contextlib.suppress(FileExistsError):
            os.mkdir(registry, 0o700)
        if _private_dir(canonical) is None or _private_dir(registry) is None:
            return
        temporary = f"{entry}.{os.getpid()}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(base)
        os.replace(temporary, entry)


def known_base_dirs(
    own: str | None = None, environ: Mapping[str, str] = os.environ, reader: Reader | None = None
) -> list[str]:
    """Every cc-server base directory of this user that exists now: `own`, the usual spellings
    (`/tmp`, `/var/tmp`, `$TMPDIR`, `/run/user/<uid>`, `$XDG_RUNTIME_DIR`) and what the registry
    names. Only private directories of this user with a base's name count, real paths. The
    host is read through `reader` (directly by default); an entry of a base that is gone is
    removed."""
    import tempfile  # lazy import: only the server and the daemon plan sandboxes

    uid = os.geteuid()
    names = (BASE_DIR_NAME, f"{BASE_DIR_NAME}-{uid}")
    candidates = [own] if own else []
    for tmp in ("/tmp", "/var/tmp", tempfile.gettempdir(), environ.get("TMPDIR", "")):
        if tmp:
            candidates.append(os.path.join(tmp, f"{BASE_DIR_NAME}-{uid}"))
    for runtime in (f"/run/user/{uid}", environ.get("XDG_RUNTIME_DIR", "")):
        if runtime:
            candidates.append(os.path.join(runtime, BASE_DIR_NAME))
    reader = _HOST if reader is None else reader
    registry = os.path.join(_canonical_base(), REGISTRY_NAME)
    if (_private_dir(_canonical_base(), reader) is not None
            and _private_dir(registry, reader) is not None):
        with contextlib.suppress(OSError):
            live = 0
            for name in reader.listdir(registry)[:MAX_SCANNED]:
                if live == MAX_REGISTERED:
                    break
                entry = os.path.join(registry, name)
                with contextlib.suppress(OSError, UnicodeDecodeError):
                    base = _text(reader.read(entry, ENTRY_READ_BYTES), 4096)
                    if not reader.isdir(base):  # gone: forget it, so live ones stay in reach
                        os.unlink(entry)
                        continue
                    candidates.append(base)
                    live += 1
    found: list[str] = []
    for candidate in candidates:
        if not os.path.isabs(candidate):
            continue
        real = reader.realpath(candidate)
        if real not in found and os.path.basename(real) in names and _private_dir(real, reader):
            found.append(real)
    return found


_ESCAPE = re.compile(r"\\([0-7]{3})")


def _mounts(mountinfo: str, reader: Reader) -> list[tuple[str, str, str]]:
    """(device, root within the filesystem, mount point) of each line of a mountinfo file."""
    out = []
    with contextlib.suppress(OSError):
        data = reader.read(mountinfo)
        text = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape")
        for line in text:
            fields = line.split(" ")
            if len(fields) > 4:
                root, point = (_ESCAPE.sub(lambda m: chr(int(m[1], 8)), v) for v in fields[3:5])
                out.append((fields[2], root, point))
    return out


@functools.lru_cache(maxsize=16)
def _aliases(
    bases: tuple[str, ...], mounts: tuple[tuple[str, str, str], ...]
) -> tuple[str, ...]:
    """The paths, other than the bases themselves, at which a base may be visible through
    `mounts` (a bind mount of the base, or of a directory above it, elsewhere): candidates, for
    `base_dir_views` to confirm by device and inode. Reads nothing, so it is cached: a server's
    mount table and bases seldom change between two commands."""
    seen = set(bases)
    candidates = []
    for base in bases:
        for device, root, point in mounts:
            if not is_within(base, point):
                continue
            in_fs = os.path.normpath(os.path.join(root, os.path.relpath(base, point)))
            for other_device, other_root, other_point in mounts:
                if other_device != device or not is_within(in_fs, other_root):
                    continue
                view = os.path.normpath(
                    os.path.join(other_point, os.path.relpath(in_fs, other_root))
                )
                if view not in seen:
                    seen.add(view)
                    candidates.append(view)
    return tuple(candidates)


def base_dir_views(
    own: str | None = None,
    environ: Mapping[str, str] = os.environ,
    mountinfo: str = "/proc/self/mountinfo",
    reader: Reader | None = None,
) -> tuple[str, ...]:
    """Every host path at which one of `known_base_dirs` is visible: each base itself and every
    alias through a mount (a bind mount of the base, or of a directory above it, elsewhere),
    found from the mount table and confirmed by device and inode. Sorted, for stable plans.
    The bases, the mount table and each alias's device and inode are read on every call,
    through `reader` (directly by default)."""
    reader = _HOST if reader is None else reader
    bases = []
    identities = set()
    for base in known_base_dirs(own, environ, reader):
        try:
            info = reader.lstat(base)
        except FileNotFoundError:  # removed since it was found (its server stopped): not shown
            continue
        bases.append(base)
        identities.add((info.st_dev, info.st_ino))
    views = set(bases)
    for view in _aliases(tuple(bases), tuple(_mounts(mountinfo, reader))):
        with contextlib.suppress(OSError):
            info = reader.lstat(view)
            if (info.st_dev, info.st_ino) in identities:
                views.add(view)
    return tuple(sorted(views))


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one this user may not signal counts as existing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def names_of_dead_owners(directory: str, pattern: re.Pattern[str]) -> list[str]:
    """The names in `directory` that `pattern` matches and whose `pid` group names a process that
    is gone: what a killed server, daemon or build left behind. None when there is no directory."""
    dead: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            match = pattern.match(name)
            if match is not None and not pid_alive(int(match["pid"])):
                dead.append(name)
    return dead


_TOKEN_RECORD = re.compile(r"^server-(?P<pid>\d+)\.token\Z")


def record_server_token(base: str, token_path: str) -> str:
    """Record, in base directory `base`, where this live server keeps its token file (wherever
    `--token-file` put it), so that `cc-server run` can refuse a bind that would expose it.
    Returns the record's path, for `forget_server_token`."""
    record = os.path.join(base, f"server-{os.getpid()}.token")
    temporary = f"{record}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(os.path.realpath(token_path))
    os.replace(temporary, record)
    return record


def forget_server_token(record: str) -> None:
    """Remove a record `record_server_token` made. Idempotent."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record)


def live_server_token_files(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The token files of this user's live servers, as their records in every known base
    directory name them (real paths). A record of a server that is gone is removed."""
    tokens: list[str] = []
    for base in known_base_dirs(None, environ):
        for name in names_of_dead_owners(base, _TOKEN_RECORD):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(base, name))
        with contextlib.suppress(OSError):
            for name in os.listdir(base):
                if _TOKEN_RECORD.match(name):
                    with (
                        contextlib.suppress(OSError, UnicodeDecodeError),
                        open(os.path.join(base, name), encoding="utf-8") as f,
                    ):
                        path = f.read(4096)
                        if os.path.isabs(path) and path not in tokens:
                            tokens.append(path)
    return tokens
