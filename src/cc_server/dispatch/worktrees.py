"""Per-conversation copy-on-write worktrees of registered repositories.

Each conversation works in its own worktree; the registered checkout is never written. Three ways
to make one, tried in this order by `choose_strategy` (each is measured on the host, once):

1. `overlay` (not for a root server, whose sandboxes reach their binds through idmapped mounts,
   which overlayfs does not support; see backends/identity.py; an explicit strategy still can):
   a kernel overlayfs mount whose lower layer is the checkout and whose upper layer is
   the conversation's own directory. The mount is made in the server's mount namespace, so the
   sandbox (a bind of the merged directory) and the in-process file tools (plain host paths) see
   the same merged view. That needs CAP_SYS_ADMIN in the initial user namespace. An overlay
   mounted inside an unprivileged user namespace works on most kernels, but it is visible only
   inside that namespace: bwrap cannot bind it (a bind source must be in the caller's mount
   namespace) and the server's file tools cannot open it through a plain host path, so it is
   not used.
2. `reflink`: a copy of the tree whose file data is shared with the checkout (FICLONE) until
   written, where the filesystem supports it (btrfs, XFS with reflink, bcachefs).
3. `git`: `git worktree add --detach` of the checkout's HEAD. Not copy-on-write: the worktree's
   `.git` is a file naming the checkout's `.git`, which stays protected, so commits from inside
   fail. The strategy is reported on every worktree so a client can tell.

Every worktree lives in `<base>/<id>/` with a `meta.json`; removal unmounts, deletes the
directory and prunes the git worktree entry, leaving nothing behind. A server that was killed
leaves its overlay mounts: `WorktreeManager` re-mounts worktrees it still has metadata for and
unmounts the rest at start.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import enum
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from cc_server.errors import BackendUnavailable, BadSpec, CcServerError, EnforcementFailed
from cc_server.policy.paths import is_within

__all__ = [
    "FICLONE",
    "Repository",
    "Worktree",
    "WorktreeError",
    "WorktreeManager",
    "WorktreeStrategy",
    "choose_strategy",
    "mounted_under",
]

FICLONE: Final = 0x40049409  # _IOW(0x94, 9, int): share a file's extents with another file
MNT_DETACH: Final = 2  # umount2 flag: detach now, free when the last user goes
GIT_TIMEOUT_S: Final = 120.0  # `git worktree add` of a large checkout
MAX_ID_LENGTH: Final = 128  # ids name directories and travel in URLs
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_META = "meta.json"
# overlayfs splits its options at ',' and its lower dirs at ':'; '\\' escapes both. Refusing the
# three keeps a checkout's path from ever becoming another mount option.
_OVERLAY_UNSAFE = frozenset(",:\\\n\x00")


class WorktreeError(CcServerError):
    """A worktree could not be created or removed; nothing was left half-made."""


class WorktreeStrategy(enum.StrEnum):
    """How a worktree is made; the first that works on this host is chosen."""

    OVERLAY = "overlay"  # kernel overlayfs in the server's mount namespace (copy-on-write)
    REFLINK = "reflink"  # FICLONE copies: data shared until written (copy-on-write)
    GIT = "git"  # `git worktree add`: a checkout of HEAD, sharing the original's .git

    @property
    def copy_on_write(self) -> bool:
        """Whether untouched files share storage with the checkout."""
        return self is not WorktreeStrategy.GIT


@dataclass(frozen=True, slots=True, kw_only=True)
class Repository:
    """A registered checkout: agents never write it; they get worktrees of it."""

    repo_id: str
    path: str  # symlink-resolved absolute path of the checkout

    def to_json(self) -> dict[str, Any]:
        """The API form."""
        return {"repoId": self.repo_id, "path": self.path}


@dataclass(frozen=True, slots=True, kw_only=True)
class Worktree:
    """One conversation's worktree."""

    worktree_id: str
    repo_id: str
    conversation_id: str
    original: str  # the registered checkout (protectedPaths of every dispatch into it)
    path: str  # what the agent works in (bound into the sandbox at the same path)
    strategy: WorktreeStrategy
    created: float  # Unix time

    @property
    def root(self) -> str:
        """The worktree's own directory (path, layers, metadata)."""
        return os.path.dirname(self.path)

    def to_json(self) -> dict[str, Any]:
        """The API form."""
        return {
            "worktreeId": self.worktree_id,
            "repoId": self.repo_id,
            "conversationId": self.conversation_id,
            "original": self.original,
            "path": self.path,
            "strategy": str(self.strategy),
            "copyOnWrite": self.strategy.copy_on_write,
            "created": self.created,
        }


# --- mount(2) and umount2(2) ---------------------------------------------------------------------

_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def _mount_overlay(lower: str, upper: str, work: str, target: str) -> None:
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    if _c().mount(b"overlay", os.fsencode(target), b"overlay", 0, os.fsencode(options)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def _umount(target: str) -> None:
    libc = _c()
    if libc.umount2(os.fsencode(target), 0) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EINVAL:  # not a mount point (any more)
        return
    if err == errno.EBUSY and libc.umount2(os.fsencode(target), MNT_DETACH) == 0:
        return
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err), target)


def _unescape_mountinfo(field_text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_text)


def mounted_under(root: str) -> list[str]:
    """Mount points at or below `root` in this process's mount namespace, deepest first."""
    found: list[str] = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            point = _unescape_mountinfo(line.split(" ")[4])
            if is_within(point, root):
                found.append(point)
    return sorted(set(found), key=len, reverse=True)


# --- the strategies ------------------------------------------------------------------------------


def _clone_file(src: str, dst: str, mode: int) -> None:
    fd_src = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd_dst = os.open(
            dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode & 0o7777
        )
        try:
            fcntl.ioctl(fd_dst, FICLONE, fd_src)
        finally:
            os.close(fd_dst)
    finally:
        os.close(fd_src)


def _reflink_tree(src: str, dst: str) -> None:
    """Copy `src` to the new directory `dst`, sharing every regular file's data (FICLONE);
    symlinks are copied as links, never followed. Anything else (a device, a socket) is skipped.

    Raises:
        OSError: the filesystem cannot clone (EOPNOTSUPP, EXDEV) or a copy failed.
    """
    os.mkdir(dst, 0o700)
    for dirpath, dirnames, filenames in os.walk(src, followlinks=False):
        rel = os.path.relpath(dirpath, src)
        target_dir = dst if rel == "." else os.path.join(dst, rel)
        for name in dirnames + filenames:
            source = os.path.join(dirpath, name)
            target = os.path.join(target_dir, name)
            info = os.lstat(source)
            if stat.S_ISLNK(info.st_mode):
                os.symlink(os.readlink(source), target)
            elif stat.S_ISDIR(info.st_mode):
                os.mkdir(target, info.st_mode & 0o7777 | 0o700)
            elif stat.S_ISREG(info.st_mode):
                _clone_file(source, target, info.st_mode)
        # os.walk does not descend into symlinked directories (followlinks=False)


def _git(git: str, *args: str, cwd: str) -> subprocess.CompletedProcess[str]:
    # Hooks of the checkout never run here: the server is not the agent's shell.
    return subprocess.run(
        [git, "-c", "core.hooksPath=/dev/null", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=GIT_TIMEOUT_S,
        check=False,
        env={"PATH": os.defpath, "GIT_TERMINAL_PROMPT": "0", "HOME": "/nonexistent"},
    )


OVERLAY_NOT_FOR_ROOT = (
    "a root server's sandboxes run as an unprivileged identity through idmapped binds, and an "
    "overlayfs mount cannot be idmapped"
)


def _try_overlay(scratch: str) -> str | None:
    """None when an overlay mount works under `scratch`, else why not."""
    layers = {name: os.path.join(scratch, name) for name in ("lower", "upper", "work", "merged")}
    for path in layers.values():
        os.mkdir(path)
    with open(os.path.join(layers["lower"], "probe"), "w") as f:
        f.write("lower\n")
    try:
        _mount_overlay(layers["lower"], layers["upper"], layers["work"], layers["merged"])
    except OSError as exc:
        return f"overlay mount failed: {exc.strerror}"
    try:
        with open(os.path.join(layers["merged"], "probe"), "w") as f:
            f.write("upper\n")
        with open(os.path.join(layers["lower"], "probe")) as f:
            if f.read() != "lower\n":
                return "overlay write reached the lower layer"
    finally:
        _umount(layers["merged"])
    return None


def _try_reflink(scratch: str) -> str | None:
    src = os.path.join(scratch, "src")
    with open(src, "w") as f:
        f.write("x" * 4096)
    try:
        _clone_file(src, os.path.join(scratch, "dst"), 0o600)
    except OSError as exc:
        return f"FICLONE failed: {exc.strerror}"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class StrategyChoice:
    """What `choose_strategy` found: the chosen strategy and why each earlier one was passed."""

    strategy: WorktreeStrategy
    rejected: tuple[tuple[WorktreeStrategy, str], ...]

    def describe(self) -> str:
        """One line for the server log."""
        why = "; ".join(f"{s}: {reason}" for s, reason in self.rejected)
        return f"worktrees: {self.strategy}" + (f" ({why})" if why else "")


def choose_strategy(base: str, git: str | None) -> StrategyChoice:
    """Try overlay, then reflink, under `base` (on the filesystem worktrees will use); fall back
    to git. Leaves nothing behind.

    Raises:
        BackendUnavailable: none works (no overlay, no reflink and no git).
    """
    rejected: list[tuple[WorktreeStrategy, str]] = []
    tries: list[tuple[WorktreeStrategy, Callable[[str], str | None]]] = [
        (WorktreeStrategy.OVERLAY, _try_overlay),
        (WorktreeStrategy.REFLINK, _try_reflink),
    ]
    if os.geteuid() == 0:
        # Only root can mount one, and a root server's sandboxes reach their binds through
        # idmapped mounts (backends/identity.py), which overlayfs does not support.
        tries.pop(0)
        rejected.append((WorktreeStrategy.OVERLAY, OVERLAY_NOT_FOR_ROOT))
    for strategy, attempt in tries:
        scratch = os.path.join(base, f".probe-{secrets.token_hex(6)}")
        os.mkdir(scratch, 0o700)
        try:
            reason = attempt(scratch)
        finally:
            for point in mounted_under(scratch):
                with contextlib.suppress(OSError):
                    _umount(point)
            shutil.rmtree(scratch, ignore_errors=True)
        if reason is None:
            return StrategyChoice(strategy=strategy, rejected=tuple(rejected))
        rejected.append((strategy, reason))
    if git is None:
        raise BackendUnavailable(
            "no way to make a worktree here: "
            + "; ".join(f"{s}: {r}" for s, r in rejected)
            + "; and git is not installed",
            fix="install git (apt-get install git), or run the server with CAP_SYS_ADMIN for "
            "overlay worktrees",
        )
    return StrategyChoice(strategy=WorktreeStrategy.GIT, rejected=tuple(rejected))


# --- the manager ---------------------------------------------------------------------------------


def _check_id(kind: str, value: str) -> str:
    if not 1 <= len(value) <= MAX_ID_LENGTH or not _ID.match(value):
        raise BadSpec(
            f"{kind} {value!r} is not a valid id",
            fix=f"use 1 to {MAX_ID_LENGTH} letters, digits, '.', '_' or '-', starting with a "
            "letter or digit",
        )
    return value


@dataclass(eq=False)
class WorktreeManager:
    """Registered repositories and their worktrees under one private base directory."""

    base: str
    strategy: WorktreeStrategy | None = None  # None: choose_strategy at start
    git: str | None = field(default_factory=lambda: shutil.which("git"))
    repos: dict[str, Repository] = field(default_factory=dict)
    worktrees: dict[str, Worktree] = field(default_factory=dict)
    choice: StrategyChoice | None = None

    def __post_init__(self) -> None:
        self.base = os.path.realpath(self.base)
        os.makedirs(self.base, mode=0o700, exist_ok=True)
        info = os.lstat(self.base)
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise EnforcementFailed(
                f"the worktree directory {self.base!r} is not private to this user",
                fix="chmod 700 it, or choose another directory",
            )
        if self.strategy is None:
            self.choice = choose_strategy(self.base, self.git)
            self.strategy = self.choice.strategy
        self._recover()

    # -- repositories --

    def register(self, repo_id: str, path: str) -> Repository:
        """Register a checkout (an existing directory). Registering the same id and path again is
        fine.

        Raises:
            BadSpec: a bad id, a path that is not an absolute existing directory, a path inside
                the worktree directory, or the id is taken by another path.
        """
        _check_id("repoId", repo_id)
        if not os.path.isabs(path):
            raise BadSpec(f"repository path {path!r} is not absolute", fix="give an absolute path")
        resolved = os.path.realpath(path)
        if not os.path.isdir(resolved):
            raise BadSpec(
                f"repository path {path!r} is not a directory", fix="register an existing checkout"
            )
        if is_within(resolved, self.base) or is_within(self.base, resolved):
            raise BadSpec(
                f"repository path {path!r} overlaps the worktree directory",
                fix="register a checkout outside it",
            )
        if self.strategy is WorktreeStrategy.OVERLAY and _OVERLAY_UNSAFE & set(resolved):
            raise BadSpec(
                f"repository path {path!r} contains ',', ':' or '\\', which overlay "
                "mount options cannot carry",
                fix="move or symlink the checkout",
            )
        existing = self.repos.get(repo_id)
        if existing is not None and existing.path != resolved:
            raise BadSpec(
                f"repoId {repo_id!r} is registered for {existing.path!r}", fix="use another repoId"
            )
        repo = Repository(repo_id=repo_id, path=resolved)
        self.repos[repo_id] = repo
        return repo

    # -- worktrees --

    def create(self, repo_id: str, conversation_id: str) -> Worktree:
        """Make the conversation's worktree of a registered repository.

        Raises:
            BadSpec: unknown repository, a bad conversation id, or the conversation already has a
                worktree of it.
            WorktreeError: the worktree could not be made (nothing is left behind).
        """
        repo = self.repos.get(repo_id)
        if repo is None:
            raise BadSpec(
                f"no registered repository {repo_id!r}", fix="register it first (POST /v1/repos)"
            )
        _check_id("conversationId", conversation_id)
        for wt in self.worktrees.values():
            if wt.repo_id == repo_id and wt.conversation_id == conversation_id:
                raise BadSpec(
                    f"conversation {conversation_id!r} already has worktree "
                    f"{wt.worktree_id!r} of {repo_id!r}",
                    fix="use or remove it",
                )
        assert self.strategy is not None
        worktree_id = f"{repo_id}-{conversation_id}-{secrets.token_hex(4)}"[:MAX_ID_LENGTH]
        root = os.path.join(self.base, worktree_id)
        os.mkdir(root, 0o700)
        wt = Worktree(
            worktree_id=worktree_id,
            repo_id=repo_id,
            conversation_id=conversation_id,
            original=repo.path,
            path=os.path.join(root, "tree"),
            strategy=self.strategy,
            created=time.time(),
        )
        try:
            self._materialise(wt, repo)
            with open(os.path.join(root, _META), "w", encoding="utf-8") as f:
                json.dump(wt.to_json(), f)
        except BaseException as exc:
            self._teardown(wt)
            if isinstance(exc, CcServerError):
                raise
            if isinstance(exc, OSError | subprocess.SubprocessError):
                raise WorktreeError(
                    f"could not make a {self.strategy} worktree of {repo.path!r}: {exc}",
                    fix="check the checkout and the worktree directory",
                ) from exc
            raise
        self.worktrees[worktree_id] = wt
        return wt

    def _materialise(self, wt: Worktree, repo: Repository) -> None:
        root = wt.root
        if wt.strategy is WorktreeStrategy.OVERLAY:
            for name in ("upper", "work", "tree"):
                os.makedirs(os.path.join(root, name), mode=0o700, exist_ok=True)
            _mount_overlay(
                repo.path, os.path.join(root, "upper"), os.path.join(root, "work"), wt.path
            )
            os.chmod(wt.path, 0o755)
        elif wt.strategy is WorktreeStrategy.REFLINK:
            _reflink_tree(repo.path, wt.path)
        else:
            assert self.git is not None
            done = _git(self.git, "worktree", "add", "--detach", wt.path, "HEAD", cwd=repo.path)
            if done.returncode != 0:
                raise WorktreeError(
                    f"git worktree add failed for {repo.path!r}: {done.stderr.strip()[:500]}",
                    fix="register a git checkout with at least one commit",
                )

    def get(self, worktree_id: str) -> Worktree:
        """The worktree, or BadSpec when unknown."""
        wt = self.worktrees.get(worktree_id)
        if wt is None:
            raise BadSpec(f"no worktree {worktree_id!r}", fix="create it (POST /v1/worktrees)")
        return wt

    def list(self) -> list[Worktree]:
        """Every worktree, oldest first."""
        return sorted(self.worktrees.values(), key=lambda w: w.created)

    def remove(self, worktree_id: str) -> bool:
        """Unmount, delete and prune; False when unknown (idempotent).

        Raises:
            WorktreeError: the mount could not be removed (the worktree stays listed, so removing
                it again retries).
        """
        wt = self.worktrees.get(worktree_id)
        if wt is None:
            return False
        self._teardown(wt)
        del self.worktrees[worktree_id]
        return True

    def _teardown(self, wt: Worktree) -> None:
        for point in mounted_under(wt.root):
            try:
                _umount(point)
            except OSError as exc:
                raise WorktreeError(
                    f"cannot unmount {point!r}: {exc.strerror}",
                    fix="stop what still uses it, then remove again",
                ) from exc
        if (
            wt.strategy is WorktreeStrategy.GIT
            and self.git is not None
            and os.path.isdir(wt.original)
        ):
            _git(self.git, "worktree", "remove", "--force", wt.path, cwd=wt.original)
        shutil.rmtree(wt.root, ignore_errors=True)
        if (
            wt.strategy is WorktreeStrategy.GIT
            and self.git is not None
            and os.path.isdir(wt.original)
        ):
            _git(self.git, "worktree", "prune", cwd=wt.original)

    def _recover(self) -> None:
        """After a killed server: re-mount the overlays of worktrees with metadata, unmount and
        delete what has none."""
        for name in sorted(os.listdir(self.base)):
            root = os.path.join(self.base, name)
            try:
                with open(os.path.join(root, _META), encoding="utf-8") as f:
                    data = json.load(f)
                wt = Worktree(
                    worktree_id=data["worktreeId"],
                    repo_id=data["repoId"],
                    conversation_id=data["conversationId"],
                    original=data["original"],
                    path=data["path"],
                    strategy=WorktreeStrategy(data["strategy"]),
                    created=float(data["created"]),
                )
                if wt.worktree_id != name or wt.root != root:
                    raise ValueError("metadata names another directory")
            except (OSError, ValueError, KeyError, TypeError):
                for point in mounted_under(root):
                    with contextlib.suppress(OSError):
                        _umount(point)
                shutil.rmtree(root, ignore_errors=True)
                continue
            if wt.strategy is WorktreeStrategy.OVERLAY and wt.path not in mounted_under(root):
                try:
                    _mount_overlay(
                        wt.original,
                        os.path.join(root, "upper"),
                        os.path.join(root, "work"),
                        wt.path,
                    )
                except OSError:
                    continue  # the original is gone: keep the upper layer, do not list it
            self.worktrees[wt.worktree_id] = wt
            self.repos.setdefault(wt.repo_id, Repository(repo_id=wt.repo_id, path=wt.original))

    def close(self) -> None:
        """Unmount every overlay (the upper layers stay for the next start). Idempotent."""
        for wt in self.worktrees.values():
            for point in mounted_under(wt.root):
                with contextlib.suppress(OSError):
                    _umount(point)

    def remove_all(self) -> None:
        """Remove every worktree (tests and `--ephemeral` servers)."""
        for worktree_id in list(self.worktrees):
            self.remove(worktree_id)
