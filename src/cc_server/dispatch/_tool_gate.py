"""The file tools' policy gate: every check a tool makes on a path, and the safe opening of it.

The tools run in the server process, outside any sandbox (see `dispatch.tools`), so this is
where the session's policy is applied to them: the guardrail chain on the path as the agent
spelled it, the path rules on the guest path mapped through the binds, the opening below the
bind's root by a symlink-safe resolver, and the rules once more on the real path of the opened
descriptor. Nothing is read, written or created before all checks pass.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import posixpath
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, TypeVar, cast

from cc_server.dispatch._paths import (
    GuestPath,
    PathOutsideBinds,
    map_guest_path,
    matches_create_glob,
    rule_covering,
)
from cc_server.dispatch._resolve import Resolver, real_path
from cc_server.dispatch.actions import (
    KIND_TOOL,
    READ_KINDS,
    WRITE_KINDS,
    Action,
    ActionKind,
    ActionRefused,
)
from cc_server.dispatch.guardrails import GuardrailChain
from cc_server.dispatch.modes import tools_for_mode
from cc_server.errors import CcServerError
from cc_server.policy import CompiledPolicy, Mount
from cc_server.policy.compiler import innermost_mount
from cc_server.policy.paths import is_within

__all__ = [
    "DIR_FLAGS",
    "MAX_READ_BYTES",
    "MAX_WRITE_BYTES",
    "READ_FLAGS",
    "FileToolError",
    "ToolGate",
    "WriteTarget",
    "exists_at",
    "os_errors_are_tool_errors",
    "replace_content",
]

GUARDRAIL: Final = "file-tools"  # the name refusals made here carry
MAX_READ_BYTES: Final = 16 * 1024 * 1024  # a larger file is refused, not loaded into the server
MAX_WRITE_BYTES: Final = 16 * 1024 * 1024  # same bound for what a tool call may write
GIT_DIR_NAME: Final = ".git"  # the file tools never write one, at any depth

DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK
READ_FLAGS: Final = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY


class FileToolError(CcServerError):
    """The call could not be done for a reason other than policy (missing file, text not found,
    not a regular file, too large); nothing was changed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteTarget:
    """A file to write: its parent directory's descriptor and real path, and its name."""

    parent_fd: int
    parent_real: str
    name: str
    mapped: GuestPath

    @property
    def real(self) -> str:
        return posixpath.join(self.parent_real, self.name)


_F = TypeVar("_F", bound=Callable[..., Any])


def os_errors_are_tool_errors(method: _F) -> _F:
    """A tool never raises a bare OSError: one the checks did not turn into a refusal or an
    error (a permission problem met mid-walk, a full disk) becomes a FileToolError."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except OSError as exc:
            raise FileToolError(f"{method.__name__} failed: {exc.strerror or exc}") from None

    return cast(_F, wrapper)


class ToolGate:
    """One session's policy, applied to the paths its file tools name."""

    def __init__(self, policy: CompiledPolicy, chain: GuardrailChain, resolver: Resolver) -> None:
        self.policy = policy
        self.chain = chain
        self.resolver = resolver

    # --- checks --------------------------------------------------------------------------------

    def action(self, kind: ActionKind, path: str | None) -> Action:
        return Action(
            kind=kind,
            tool=KIND_TOOL[kind],
            session_id=self.policy.session_id,
            mode=self.policy.mode,
            path=path,
        )

    def refuse(self, action: Action, reason: str) -> ActionRefused:
        return ActionRefused(action, GUARDRAIL, reason)

    def admit(self, action: Action, *, write: bool) -> GuestPath:
        """Run the chain, then this tool's own checks on the mapped path."""
        if write != (action.kind in WRITE_KINDS) or (not write and action.kind not in READ_KINDS):
            raise self.refuse(action, f"{action.kind} is not a {'write' if write else 'read'}")
        self.chain.check(action)
        if KIND_TOOL[action.kind] not in tools_for_mode(self.policy.mode):
            raise self.refuse(action, f"{self.policy.mode} mode has no {action.tool} tool")
        assert action.path is not None
        try:
            mapped = map_guest_path(self.policy, action.path)
        except PathOutsideBinds as exc:
            raise self.refuse(action, str(exc)) from None
        self.check_real(action, mapped.host, mapped.mount, write=write, guest=mapped.guest)
        return mapped

    def check_real(
        self, action: Action, host: str, mount: Mount, *, write: bool, guest: str
    ) -> None:
        """The path rules on a host path (the lexical one, then the opened object's)."""
        if not is_within(host, mount.host_path):
            raise self.refuse(action, f"{guest!r} resolves outside its bind")
        secret = rule_covering(self.policy.deny_read, host)
        if secret is not None:
            raise self.refuse(
                action, f"{guest!r} is in the secret deny-read set ({secret.reason})"
            )
        if not write:
            return
        if not mount.writable:
            raise self.refuse(action, f"{guest!r} is on a read-only bind ({mount.reason})")
        # A link inside a writable bind may lead into a directory another bind makes read-only
        # (a nested read-only bind of the same tree): the innermost bind holding it decides.
        inner = innermost_mount(self.policy.mounts, host)
        if inner is not None and not inner.writable:
            raise self.refuse(
                action, f"{guest!r} lands on a read-only bind ({inner.guest_path!r})"
            )
        denied = rule_covering(self.policy.deny_write, host)
        if denied is not None:
            raise self.refuse(action, f"{guest!r} is never writable ({denied.reason})")
        below = host[len(mount.host_path) :].split("/")
        if GIT_DIR_NAME in below:
            raise self.refuse(
                action,
                f"{guest!r} is inside or is a {GIT_DIR_NAME} entry (at any depth: its hooks and "
                "config run code on the host); git itself changes it",
            )

    def check_create(self, action: Action, name: str, guest: str) -> None:
        glob = matches_create_glob(self.policy.deny_create_globs, name)
        if glob is not None:
            raise self.refuse(
                action, f"creating {guest!r} is forbidden by the create-time rule {glob!r}"
            )

    # --- opening -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def bind_root(self, action: Action, mount: Mount) -> Iterator[int]:
        """The bind's root directory, opened with no symlink anywhere on its path."""
        try:
            fd = self.open_bind_root(mount, DIR_FLAGS)
        except OSError as exc:
            raise self.refuse(
                action, f"the bind root {mount.guest_path!r} cannot be opened safely ({exc})"
            ) from None
        try:
            yield fd
        finally:
            os.close(fd)

    def open_bind_root(self, mount: Mount, flags: int) -> int:
        """Open the bind's host path from '/' with no symlink anywhere on it (raises OSError)."""
        slash = os.open("/", DIR_FLAGS | os.O_CLOEXEC)
        try:
            return self.resolver.open_beneath(
                slash, mount.host_path.lstrip("/"), flags, follow=False
            )
        finally:
            os.close(slash)

    def open_read(self, action: Action, mapped: GuestPath, flags: int) -> tuple[int, str]:
        """Open the mapped path for reading below its bind; return the fd and its real path.

        The bind's root itself (a bound directory, or a bound single file) is opened from '/'
        with no symlink anywhere on its path."""
        try:
            if not mapped.relative:
                fd = self.open_bind_root(mapped.mount, flags)
            else:
                with self.bind_root(action, mapped.mount) as root:
                    fd = self.resolver.open_beneath(root, mapped.relative, flags)
        except OSError as exc:
            raise self.os_error(action, mapped.guest, exc) from None
        real = real_path(fd, mapped.host)
        try:
            self.check_real(action, real, mapped.mount, write=False, guest=mapped.guest)
        except BaseException:
            os.close(fd)
            raise
        return fd, real

    def os_error(self, action: Action, guest: str, exc: OSError) -> CcServerError:
        if exc.errno in (errno.EXDEV, errno.ELOOP):
            return self.refuse(
                action, f"{guest!r} goes through a link that leads out of its bind or is refused"
            )
        if exc.errno == errno.ENOENT:
            return FileToolError(f"{guest!r} does not exist", fix="check the path")
        if exc.errno == errno.ENOTDIR:
            return FileToolError(f"{guest!r} or one of its parents is not a directory")
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return self.refuse(action, f"{guest!r}: {exc.strerror}")
        return FileToolError(f"{guest!r}: {exc.strerror}")

    def precheck_write(self, action: Action, mapped: GuestPath) -> None:
        """Every check a write of `mapped` makes, without making anything (apply_patch runs it on
        every file first, so a refusal changes nothing)."""
        with self.open_target(action, mapped, create=True, make=False) as target:
            if target.name and not exists_at(target):
                self.check_create(action, target.name, mapped.guest)

    @contextlib.contextmanager
    def open_target(
        self, action: Action, mapped: GuestPath, *, create: bool, make: bool = True
    ) -> Iterator[WriteTarget]:
        """The parent directory of a file to write, resolved safely, missing ones made if
        `create`. Every rule is checked on every name before anything is created. With
        `make=False` nothing is made; when directories are missing the target's name is ''."""
        parts = [p for p in mapped.relative.split("/") if p]
        if not parts:
            raise self.refuse(action, f"{mapped.guest!r} is the bind's root, not a file")
        *dirs, name = parts
        with self.bind_root(action, mapped.mount) as root:
            existing = 0
            parent = os.dup(root)
            try:
                # Descend through the directories that exist, following only links that stay
                # below the bind (then checked on their real path).
                for i in range(len(dirs), -1, -1):
                    try:
                        fd = self.resolver.open_beneath(root, "/".join(dirs[:i]), DIR_FLAGS)
                    except OSError as exc:
                        if exc.errno == errno.ENOENT and i > 0:
                            continue
                        raise self.os_error(action, mapped.guest, exc) from None
                    os.close(parent)
                    parent, existing = fd, i
                    break
                parent_real = real_path(
                    parent, posixpath.join(mapped.mount.host_path, *dirs[:existing])
                )
                missing = dirs[existing:]
                if missing and not create:
                    raise FileToolError(f"the directory of {mapped.guest!r} does not exist")
                # Check every name to be made, and the file itself, before making anything.
                host = parent_real
                for part in missing:
                    host = posixpath.join(host, part)
                    self.check_real(action, host, mapped.mount, write=True, guest=mapped.guest)
                    self.check_create(action, part, mapped.guest)
                self.check_real(
                    action,
                    posixpath.join(host, name),
                    mapped.mount,
                    write=True,
                    guest=mapped.guest,
                )
                if missing:
                    self.check_create(action, name, mapped.guest)
                if not make:
                    yield WriteTarget(
                        parent_fd=parent,
                        parent_real=parent_real,
                        name="" if missing else name,
                        mapped=mapped,
                    )
                    return
                for part in missing:
                    try:
                        with contextlib.suppress(FileExistsError):
                            os.mkdir(part, 0o777, dir_fd=parent)
                        fd = self.resolver.open_beneath(parent, part, DIR_FLAGS, follow=False)
                    except OSError as exc:
                        raise self.os_error(action, mapped.guest, exc) from None
                    os.close(parent)
                    parent = fd
                    parent_real = real_path(parent, posixpath.join(parent_real, part))
                    self.check_real(
                        action, parent_real, mapped.mount, write=True, guest=mapped.guest
                    )
                yield WriteTarget(
                    parent_fd=parent, parent_real=parent_real, name=name, mapped=mapped
                )
            finally:
                os.close(parent)

    def open_existing_for_write(self, action: Action, target: WriteTarget, flags: int) -> int:
        try:
            fd = os.open(
                target.name,
                flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                dir_fd=target.parent_fd,
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self.refuse(
                    action, f"{target.mapped.guest!r} is a symbolic link; writes never follow one"
                ) from None
            if exc.errno == errno.ENOENT:
                raise  # the caller may create it
            raise self.os_error(action, target.mapped.guest, exc) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise FileToolError(f"{target.mapped.guest!r} is not a regular file")
            if info.st_nlink > 1:
                raise self.refuse(
                    action,
                    f"{target.mapped.guest!r} has other hard links; writing it would change "
                    "another path's content",
                )
            self.check_real(
                action,
                real_path(fd, target.real),
                target.mapped.mount,
                write=True,
                guest=target.mapped.guest,
            )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def write_to(self, action: Action, target: WriteTarget, data: bytes) -> None:
        try:
            fd = self.open_existing_for_write(action, target, os.O_WRONLY)
        except FileNotFoundError:
            self.check_create(action, target.name, target.mapped.guest)
            try:
                fd = os.open(
                    target.name,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o666,
                    dir_fd=target.parent_fd,
                )
            except OSError as exc:
                raise self.os_error(action, target.mapped.guest, exc) from None
        try:
            replace_content(fd, data)
        except OSError as exc:
            raise self.os_error(action, target.mapped.guest, exc) from None
        finally:
            os.close(fd)

    def read_fd(self, action: Action, fd: int, guest: str, limit: int) -> bytes:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileToolError(f"{guest!r} is not a regular file")
        if info.st_size > limit:
            raise FileToolError(
                f"{guest!r} is {info.st_size} bytes, more than the {limit} a tool reads",
                fix="read a smaller file, or search it",
            )
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, 1024 * 1024)
            if not chunk:
                break
            total += len(chunk)
            if total > limit:
                raise FileToolError(f"{guest!r} grew past {limit} bytes while being read")
            chunks.append(chunk)
        return b"".join(chunks)

    def read_bytes(self, action: Action, mapped: GuestPath) -> bytes:
        fd, _ = self.open_read(action, mapped, READ_FLAGS)
        try:
            return self.read_fd(action, fd, mapped.guest, MAX_READ_BYTES)
        finally:
            os.close(fd)


def replace_content(fd: int, data: bytes) -> None:
    """Make the open file hold exactly `data`."""
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def exists_at(target: WriteTarget) -> bool:
    try:
        os.stat(target.name, dir_fd=target.parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
