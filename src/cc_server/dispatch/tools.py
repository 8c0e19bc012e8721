"""The in-process file tools: read, write, edit, apply_patch, search, find, search_files.

They run in the server process, outside any sandbox, on every host: only bash is wrapped. So
they enforce the session's policy themselves, on what they actually open:

1. the guardrail chain (tool surface, path policy, extra guardrails) on the path as the agent
   spelled it;
2. the same path rules again here, on the guest path mapped through the binds;
3. the object is opened below its bind's root by a symlink-safe resolver (openat2 with
   RESOLVE_BENEATH, or an O_NOFOLLOW walk): a link swapped between check and use can never lead
   out of the bind; writes never follow a link in their last component;
4. the rules are checked once more on the real path of the opened descriptor, before a byte is
   read or written.

Every refusal is an `ActionRefused`; nothing is read, written or created before all checks pass.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import functools
import os
import posixpath
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, TypeVar, cast

import regex

from cc_server.dispatch._paths import (
    GuestPath,
    PathOutsideBinds,
    map_guest_path,
    matches_create_glob,
    rule_covering,
    rule_under,
)
from cc_server.dispatch._resolve import Resolver, default_resolver, real_path
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
from cc_server.policy.paths import is_within

__all__ = [
    "MAX_READ_BYTES",
    "MAX_SEARCH_RESULTS",
    "FileToolError",
    "FileTools",
    "SearchMatch",
]

GUARDRAIL: Final = "file-tools"  # the name refusals made here carry
MAX_READ_BYTES: Final = 16 * 1024 * 1024  # a larger file is refused, not loaded into the server
MAX_WRITE_BYTES: Final = 16 * 1024 * 1024  # same bound for what a tool call may write
MAX_SEARCH_FILE_BYTES: Final = 4 * 1024 * 1024  # larger files are skipped by the searches
MAX_SEARCH_RESULTS: Final = 2000  # matches (or paths) returned by one search
MAX_SEARCH_LINE_CHARS: Final = 4096  # longer lines are searched up to this length only
MAX_PATTERN_CHARS: Final = 1000  # a longer regex is refused (bounds compile and match cost)
SEARCH_TIMEOUT_S: Final = 10.0  # one search's matching, all files together (the server's CPU)
MAX_WALK_ENTRIES: Final = 200_000  # directory entries one search visits at most
BINARY_SNIFF_BYTES: Final = 8192  # a NUL in the first bytes marks a file as binary
GIT_DIR_NAME: Final = ".git"  # the file tools never write one, at any depth
SKIPPED_DIRS: Final = frozenset({GIT_DIR_NAME})  # repository internals: noise for every search

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK
_READ_FLAGS: Final = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY


class FileToolError(CcServerError):
    """The call could not be done for a reason other than policy (missing file, text not found,
    not a regular file, too large); nothing was changed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchMatch:
    """One matching line."""

    path: str  # guest path
    line: int  # 1-based line number
    text: str  # the line, without its newline (cut at MAX_SEARCH_LINE_CHARS)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Target:
    """A file to write: its parent directory's descriptor and real path, and its name."""

    parent_fd: int
    parent_real: str
    name: str
    mapped: GuestPath

    @property
    def real(self) -> str:
        return posixpath.join(self.parent_real, self.name)


@dataclass(frozen=True, slots=True, kw_only=True)
class _PatchOp:
    kind: str  # "add", "delete", "update"
    path: str
    move_to: str | None = None
    lines: tuple[str, ...] = ()  # add: the content lines; update: the hunk lines


_F = TypeVar("_F", bound=Callable[..., Any])


def _os_errors_are_tool_errors(method: _F) -> _F:
    """A tool never raises a bare OSError: one the checks did not turn into a refusal or an
    error (a permission problem met mid-walk, a full disk) becomes a FileToolError."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except OSError as exc:
            raise FileToolError(f"{method.__name__} failed: {exc.strerror or exc}") from None

    return cast(_F, wrapper)


class FileTools:
    """The seven file tools of one session, enforcing its compiled policy."""

    def __init__(
        self,
        policy: CompiledPolicy,
        chain: GuardrailChain,
        *,
        resolver: Resolver | None = None,
        search_timeout_s: float = SEARCH_TIMEOUT_S,
    ) -> None:
        self.policy = policy
        self.chain = chain
        self.resolver = resolver or default_resolver()
        self.search_timeout_s = search_timeout_s

    # --- checks --------------------------------------------------------------------------------

    def _action(self, kind: ActionKind, path: str | None) -> Action:
        return Action(
            kind=kind,
            tool=KIND_TOOL[kind],
            session_id=self.policy.session_id,
            mode=self.policy.mode,
            path=path,
        )

    def _refuse(self, action: Action, reason: str) -> ActionRefused:
        return ActionRefused(action, GUARDRAIL, reason)

    def _admit(self, action: Action, *, write: bool) -> GuestPath:
        """Run the chain, then this tool's own checks on the mapped path."""
        if write != (action.kind in WRITE_KINDS) or (not write and action.kind not in READ_KINDS):
            raise self._refuse(action, f"{action.kind} is not a {'write' if write else 'read'}")
        self.chain.check(action)
        if KIND_TOOL[action.kind] not in tools_for_mode(self.policy.mode):
            raise self._refuse(action, f"{self.policy.mode} mode has no {action.tool} tool")
        assert action.path is not None
        try:
            mapped = map_guest_path(self.policy, action.path)
        except PathOutsideBinds as exc:
            raise self._refuse(action, str(exc)) from None
        self._check_real(action, mapped.host, mapped.mount, write=write, guest=mapped.guest)
        return mapped

    def _check_real(
        self, action: Action, host: str, mount: Mount, *, write: bool, guest: str
    ) -> None:
        """The path rules on a host path (the lexical one, then the opened object's)."""
        if not is_within(host, mount.host_path):
            raise self._refuse(action, f"{guest!r} resolves outside its bind")
        secret = rule_covering(self.policy.deny_read, host)
        if secret is not None:
            raise self._refuse(
                action, f"{guest!r} is in the secret deny-read set ({secret.reason})"
            )
        if not write:
            return
        if not mount.writable:
            raise self._refuse(action, f"{guest!r} is on a read-only bind ({mount.reason})")
        # A link inside a writable bind may lead into a directory another bind makes read-only
        # (a nested read-only bind of the same tree): the innermost bind holding it decides.
        inner = _innermost_mount(self.policy.mounts, host)
        if inner is not None and not inner.writable:
            raise self._refuse(
                action, f"{guest!r} lands on a read-only bind ({inner.guest_path!r})"
            )
        denied = rule_covering(self.policy.deny_write, host)
        if denied is not None:
            raise self._refuse(action, f"{guest!r} is never writable ({denied.reason})")
        below = host[len(mount.host_path) :].split("/")
        if GIT_DIR_NAME in below:
            raise self._refuse(
                action,
                f"{guest!r} is inside or is a {GIT_DIR_NAME} entry (at any depth: its hooks and "
                "config run code on the host); git itself changes it",
            )

    def _check_create(self, action: Action, name: str, guest: str) -> None:
        glob = matches_create_glob(self.policy.deny_create_globs, name)
        if glob is not None:
            raise self._refuse(
                action, f"creating {guest!r} is forbidden by the create-time rule {glob!r}"
            )

    # --- opening -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _root(self, action: Action, mount: Mount) -> Iterator[int]:
        """The bind's root directory, opened with no symlink anywhere on its path."""
        try:
            fd = self._open_bind_root(mount, _DIR_FLAGS)
        except OSError as exc:
            raise self._refuse(
                action, f"the bind root {mount.guest_path!r} cannot be opened safely ({exc})"
            ) from None
        try:
            yield fd
        finally:
            os.close(fd)

    def _open_bind_root(self, mount: Mount, flags: int) -> int:
        """Open the bind's host path from '/' with no symlink anywhere on it (raises OSError)."""
        slash = os.open("/", _DIR_FLAGS | os.O_CLOEXEC)
        try:
            return self.resolver.open_beneath(
                slash, mount.host_path.lstrip("/"), flags, follow=False
            )
        finally:
            os.close(slash)

    def _open_read(self, action: Action, mapped: GuestPath, flags: int) -> tuple[int, str]:
        """Open the mapped path for reading below its bind; return the fd and its real path.

        The bind's root itself (a bound directory, or a bound single file) is opened from '/'
        with no symlink anywhere on its path."""
        try:
            if not mapped.relative:
                fd = self._open_bind_root(mapped.mount, flags)
            else:
                with self._root(action, mapped.mount) as root:
                    fd = self.resolver.open_beneath(root, mapped.relative, flags)
        except OSError as exc:
            raise self._os_error(action, mapped.guest, exc) from None
        real = real_path(fd, mapped.host)
        try:
            self._check_real(action, real, mapped.mount, write=False, guest=mapped.guest)
        except BaseException:
            os.close(fd)
            raise
        return fd, real

    def _os_error(self, action: Action, guest: str, exc: OSError) -> CcServerError:
        if exc.errno in (errno.EXDEV, errno.ELOOP):
            return self._refuse(
                action, f"{guest!r} goes through a link that leads out of its bind or is refused"
            )
        if exc.errno == errno.ENOENT:
            return FileToolError(f"{guest!r} does not exist", fix="check the path")
        if exc.errno == errno.ENOTDIR:
            return FileToolError(f"{guest!r} or one of its parents is not a directory")
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return self._refuse(action, f"{guest!r}: {exc.strerror}")
        return FileToolError(f"{guest!r}: {exc.strerror}")

    def _precheck_write(self, action: Action, mapped: GuestPath) -> None:
        """Every check a write of `mapped` makes, without making anything (apply_patch runs it on
        every file first, so a refusal changes nothing)."""
        with self._target(action, mapped, create=True, make=False) as target:
            if target.name and not _exists_at(target):
                self._check_create(action, target.name, mapped.guest)

    @contextlib.contextmanager
    def _target(
        self, action: Action, mapped: GuestPath, *, create: bool, make: bool = True
    ) -> Iterator[_Target]:
        """The parent directory of a file to write, resolved safely, missing ones made if
        `create`. Every rule is checked on every name before anything is created. With
        `make=False` nothing is made; when directories are missing the target's name is ''."""
        parts = [p for p in mapped.relative.split("/") if p]
        if not parts:
            raise self._refuse(action, f"{mapped.guest!r} is the bind's root, not a file")
        *dirs, name = parts
        with self._root(action, mapped.mount) as root:
            existing = 0
            parent = os.dup(root)
            try:
                # Descend through the directories that exist, following only links that stay
                # below the bind (then checked on their real path).
                for i in range(len(dirs), -1, -1):
                    try:
                        fd = self.resolver.open_beneath(root, "/".join(dirs[:i]), _DIR_FLAGS)
                    except OSError as exc:
                        if exc.errno == errno.ENOENT and i > 0:
                            continue
                        raise self._os_error(action, mapped.guest, exc) from None
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
                    self._check_real(action, host, mapped.mount, write=True, guest=mapped.guest)
                    self._check_create(action, part, mapped.guest)
                self._check_real(
                    action,
                    posixpath.join(host, name),
                    mapped.mount,
                    write=True,
                    guest=mapped.guest,
                )
                if missing:
                    self._check_create(action, name, mapped.guest)
                if not make:
                    yield _Target(
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
                        fd = self.resolver.open_beneath(parent, part, _DIR_FLAGS, follow=False)
                    except OSError as exc:
                        raise self._os_error(action, mapped.guest, exc) from None
                    os.close(parent)
                    parent = fd
                    parent_real = real_path(parent, posixpath.join(parent_real, part))
                    self._check_real(
                        action, parent_real, mapped.mount, write=True, guest=mapped.guest
                    )
                yield _Target(parent_fd=parent, parent_real=parent_real, name=name, mapped=mapped)
            finally:
                os.close(parent)

    def _open_existing_for_write(self, action: Action, target: _Target, flags: int) -> int:
        try:
            fd = os.open(
                target.name,
                flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                dir_fd=target.parent_fd,
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._refuse(
                    action, f"{target.mapped.guest!r} is a symbolic link; writes never follow one"
                ) from None
            if exc.errno == errno.ENOENT:
                raise  # the caller may create it
            raise self._os_error(action, target.mapped.guest, exc) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise FileToolError(f"{target.mapped.guest!r} is not a regular file")
            if info.st_nlink > 1:
                raise self._refuse(
                    action,
                    f"{target.mapped.guest!r} has other hard links; writing it would change "
                    "another path's content",
                )
            self._check_real(
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

    def _write_target(self, action: Action, target: _Target, data: bytes) -> None:
        try:
            fd = self._open_existing_for_write(action, target, os.O_WRONLY)
        except FileNotFoundError:
            self._check_create(action, target.name, target.mapped.guest)
            try:
                fd = os.open(
                    target.name,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o666,
                    dir_fd=target.parent_fd,
                )
            except OSError as exc:
                raise self._os_error(action, target.mapped.guest, exc) from None
        try:
            _replace_content(fd, data)
        except OSError as exc:
            raise self._os_error(action, target.mapped.guest, exc) from None
        finally:
            os.close(fd)

    def _read_fd(self, action: Action, fd: int, guest: str, limit: int) -> bytes:
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

    def _read_bytes(self, action: Action, mapped: GuestPath) -> bytes:
        fd, _ = self._open_read(action, mapped, _READ_FLAGS)
        try:
            return self._read_fd(action, fd, mapped.guest, MAX_READ_BYTES)
        finally:
            os.close(fd)

    # --- the tools -----------------------------------------------------------------------------

    def judge(self, path: str, *, kind: ActionKind) -> None:
        """Whether `kind` on `path` would be allowed, without doing it (an ACP permission
        request for an action the agent does itself): the chain, the path rules on the path as
        mapped, and for a write of a name that does not exist yet the create-time rules.

        Raises:
            ActionRefused: a guardrail or the policy refuses it.
        """
        action = self._action(kind, path)
        write = kind in WRITE_KINDS
        mapped = self._admit(action, write=write)
        if write and not os.path.lexists(mapped.host):
            self._check_create(action, posixpath.basename(mapped.host), mapped.guest)

    @_os_errors_are_tool_errors
    def read(
        self,
        path: str,
        *,
        offset: int = 0,
        limit: int | None = None,
        kind: ActionKind = ActionKind.FILE_READ,
    ) -> str:
        """The file's text from line `offset` (0-based), at most `limit` lines.

        Raises:
            ActionRefused: a guardrail or the policy refuses the path.
            FileToolError: missing, not a regular file, or larger than MAX_READ_BYTES.
        """
        action = self._action(kind, path)
        mapped = self._admit(action, write=False)
        text = self._read_bytes(action, mapped).decode("utf-8", errors="replace")
        if offset == 0 and limit is None:
            return text
        if offset < 0 or (limit is not None and limit < 0):
            raise FileToolError("offset and limit must not be negative")
        lines = text.splitlines(keepends=True)
        end = None if limit is None else offset + limit
        return "".join(lines[offset:end])

    @_os_errors_are_tool_errors
    def write(self, path: str, content: str, *, kind: ActionKind = ActionKind.FILE_WRITE) -> None:
        """Write `content` to the file, creating it (and missing directories) if allowed.

        Raises:
            ActionRefused: a guardrail or the policy refuses (read-only bind, protected path,
                mandatory deny, secret path, create-time glob, a link on the way out).
            FileToolError: the path is a directory or another non-regular file.
        """
        action = self._action(kind, path)
        data = content.encode("utf-8", errors="surrogateescape")
        if len(data) > MAX_WRITE_BYTES:
            raise FileToolError(f"content is more than {MAX_WRITE_BYTES} bytes")
        mapped = self._admit(action, write=True)
        with self._target(action, mapped, create=True) as target:
            self._write_target(action, target, data)

    @_os_errors_are_tool_errors
    def edit(
        self,
        path: str,
        old: str,
        new: str,
        *,
        count: int = 1,
        kind: ActionKind = ActionKind.FILE_EDIT,
    ) -> None:
        """Replace `old` by `new`; `old` must occur exactly `count` times.

        Raises:
            ActionRefused: as `write`.
            FileToolError: the file is missing, or `old` does not occur exactly `count` times.
        """
        action = self._action(kind, path)
        if not old or count < 1:
            raise FileToolError("edit needs a non-empty old text and a count of at least 1")
        mapped = self._admit(action, write=True)
        with self._target(action, mapped, create=False) as target:
            try:
                fd = self._open_existing_for_write(action, target, os.O_RDWR)
            except FileNotFoundError:
                raise FileToolError(f"{mapped.guest!r} does not exist") from None
            try:
                text = self._read_fd(action, fd, mapped.guest, MAX_READ_BYTES).decode(
                    "utf-8", errors="surrogateescape"
                )
                found = text.count(old)
                if found != count:
                    raise FileToolError(
                        f"the old text occurs {found} times in {mapped.guest!r}, not {count}",
                        fix="give more context so it is unique, or the right count",
                    )
                data = text.replace(old, new).encode("utf-8", errors="surrogateescape")
                try:
                    _replace_content(fd, data)
                except OSError as exc:
                    raise self._os_error(action, mapped.guest, exc) from None
            finally:
                os.close(fd)

    @_os_errors_are_tool_errors
    def apply_patch(self, patch: str, *, kind: ActionKind = ActionKind.APPLY_PATCH) -> list[str]:
        """Apply a patch in the apply_patch format (`*** Begin Patch` ... `*** End Patch`, with
        Add File, Delete File and Update File sections, the last optionally with `*** Move to`).

        Every file is checked (chain and policy) and every new content computed before anything
        is written; the guest paths changed are returned.

        Raises:
            ActionRefused: any file of the patch is refused; nothing is changed.
            FileToolError: the patch does not parse or a hunk does not apply; nothing is changed.
        """
        ops = _parse_patch(patch)
        planned: list[tuple[Action, GuestPath, bytes | None]] = []
        for op in ops:
            action = self._action(kind, op.path)
            mapped = self._admit(action, write=True)
            if op.kind == "add":
                planned.append((action, mapped, "".join(op.lines).encode()))
                continue
            with self._target(action, mapped, create=False) as target:
                try:
                    fd = self._open_existing_for_write(action, target, os.O_RDONLY)
                except FileNotFoundError:
                    raise FileToolError(f"{mapped.guest!r} does not exist") from None
                try:
                    old = self._read_fd(action, fd, mapped.guest, MAX_READ_BYTES)
                finally:
                    os.close(fd)
            if op.kind == "delete":
                planned.append((action, mapped, None))
                continue
            new = _apply_hunks(old.decode("utf-8", "surrogateescape"), op.lines, mapped.guest)
            data = new.encode("utf-8", "surrogateescape")
            if op.move_to is not None:
                move_action = self._action(kind, op.move_to)
                moved = self._admit(move_action, write=True)
                planned.append((action, mapped, None))
                planned.append((move_action, moved, data))
            else:
                planned.append((action, mapped, data))
        # Every write must be possible: check it now, so a refusal changes nothing.
        for action, mapped, content in planned:
            if content is not None:
                self._precheck_write(action, mapped)
        changed: list[str] = []
        for action, mapped, content in planned:
            if content is None:
                with self._target(action, mapped, create=False) as target:
                    fd = self._open_existing_for_write(action, target, os.O_RDONLY)
                    os.close(fd)
                    os.unlink(target.name, dir_fd=target.parent_fd)
            else:
                with self._target(action, mapped, create=True) as target:
                    self._write_target(action, target, content)
            changed.append(mapped.guest)
        return list(dict.fromkeys(changed))

    @_os_errors_are_tool_errors
    def search(
        self, pattern: str, path: str | None = None, *, kind: ActionKind = ActionKind.SEARCH
    ) -> list[SearchMatch]:
        """Lines matching the regular expression `pattern` in the files below `path` (default:
        the workdir). Secret paths, links, `.git`, binary and very large files are skipped.

        Raises:
            ActionRefused: the search root is refused. FileToolError: the pattern is invalid.
        """
        return self._matches(kind, pattern, path, first_only=False)

    @_os_errors_are_tool_errors
    def search_files(
        self, query: str, path: str | None = None, *, kind: ActionKind = ActionKind.SEARCH_FILES
    ) -> list[str]:
        """Guest paths of the files below `path` whose content matches the regex `query`.

        Raises:
            ActionRefused: the search root is refused. FileToolError: the query is invalid.
        """
        return [m.path for m in self._matches(kind, query, path, first_only=True)]

    def _matches(
        self, kind: ActionKind, pattern: str, path: str | None, *, first_only: bool
    ) -> list[SearchMatch]:
        """Matching lines below `path` (only each file's first with `first_only`), bounded."""
        compiled = _compile(pattern)
        # One pass over the whole file first (^ and $ at line ends) skips files without a match;
        # patterns whose meaning depends on being given one line at a time are not prefiltered.
        prefilter = None if _LINE_ONLY.search(pattern) else _compile(pattern, regex.MULTILINE)
        deadline = time.monotonic() + self.search_timeout_s

        def search(compiled: regex.Pattern[str], text: str) -> bool:
            try:
                timeout = max(deadline - time.monotonic(), 0.0)
                return compiled.search(text, timeout=timeout) is not None
            except TimeoutError:
                raise FileToolError(
                    f"the search took longer than {self.search_timeout_s:g} s (a pattern that "
                    "backtracks badly, or too much to search)",
                    fix="use a simpler pattern or search a smaller directory",
                ) from None

        matches: list[SearchMatch] = []
        for guest, data in self._walk_files(kind, path, with_content=True):
            assert data is not None
            # Lines end at '\n' (and '\r\n'), as the prefilter's ^ and $ see them.
            content = data.decode("utf-8", "replace").replace("\r\n", "\n")
            if prefilter is not None and not search(prefilter, content):
                continue
            lines = content.split("\n")
            if lines and not lines[-1]:
                lines.pop()
            for number, line in enumerate(lines, 1):
                text = line[:MAX_SEARCH_LINE_CHARS]
                if search(compiled, text):
                    matches.append(SearchMatch(path=guest, line=number, text=text))
                    if len(matches) >= MAX_SEARCH_RESULTS:
                        return matches
                    if first_only:
                        break
        return matches

    @_os_errors_are_tool_errors
    def find(
        self, glob: str, path: str | None = None, *, kind: ActionKind = ActionKind.FIND
    ) -> list[str]:
        """Guest paths below `path` matching `glob`: against the name when the glob has no '/',
        else against the path relative to `path` (`*` crosses '/', so `src/*.py` is recursive).

        Raises:
            ActionRefused: the search root is refused.
        """
        if not glob or len(glob) > MAX_PATTERN_CHARS:
            raise FileToolError(f"the glob must be 1 to {MAX_PATTERN_CHARS} characters")
        found: list[str] = []
        for guest, relative, _ in self._walk(kind, path, with_content=False):
            subject = relative if "/" in glob else posixpath.basename(relative)
            if fnmatch.fnmatchcase(subject, glob.lstrip("/")):
                found.append(guest)
                if len(found) >= MAX_SEARCH_RESULTS:
                    break
        return sorted(found)

    # --- walking -------------------------------------------------------------------------------

    def _walk_files(
        self, kind: ActionKind, path: str | None, *, with_content: bool
    ) -> Iterator[tuple[str, bytes | None]]:
        for guest, _, data in self._walk(kind, path, with_content=with_content):
            yield guest, data

    def _walk(
        self, kind: ActionKind, path: str | None, *, with_content: bool
    ) -> Iterator[tuple[str, str, bytes | None]]:
        """(guest path, path relative to the root, content) of every regular file below the
        root that the policy lets the session read. Links are never followed."""
        start = path if path is not None else (self.policy.workdir or "")
        action = self._action(kind, start)
        mapped = self._admit(action, write=False)
        root_fd, root_real = self._open_read(action, mapped, _DIR_FLAGS)
        # Only the secrets below the root can be met (one covering the root was refused above).
        secrets_below = rule_under(self.policy.deny_read, root_real)
        mount_root = mapped.mount.host_path
        seen = 0
        try:
            for dirpath, dirnames, filenames, dirfd in os.fwalk(
                ".", dir_fd=root_fd, follow_symlinks=False
            ):
                rel_dir = posixpath.normpath(dirpath)
                rel_dir = "" if rel_dir == "." else rel_dir
                expected = posixpath.join(root_real, rel_dir) if rel_dir else root_real
                # What the directory descriptor really is, once per directory: files are then
                # opened in it with O_NOFOLLOW, so their real path is this plus their name.
                dir_real = real_path(dirfd, expected)
                if dir_real != expected or not is_within(dir_real, mount_root):
                    dirnames[:] = []
                    continue  # swapped while walking: skip it rather than guess
                dirnames[:] = [
                    name
                    for name in sorted(dirnames)
                    if name not in SKIPPED_DIRS
                    and not rule_covering(secrets_below, posixpath.join(dir_real, name))
                ]
                for name in sorted(filenames):
                    seen += 1
                    if seen > MAX_WALK_ENTRIES:
                        return
                    if secrets_below and rule_covering(
                        secrets_below, posixpath.join(dir_real, name)
                    ):
                        continue
                    relative = posixpath.join(rel_dir, name) if rel_dir else name
                    data = _walk_read(dirfd, name, with_content)
                    if data is not None:
                        content = data if with_content else None
                        yield posixpath.join(mapped.guest, relative), relative, content
        finally:
            os.close(root_fd)


def _walk_read(dirfd: int, name: str, with_content: bool) -> bytes | None:
    """A walked file's bytes (b"" without content); None to skip it (a link, not regular, gone,
    too large or binary)."""
    if not with_content:
        try:
            info = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except OSError:
            return None
        return b"" if stat.S_ISREG(info.st_mode) else None
    try:
        fd = os.open(name, _READ_FLAGS | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return None  # a link, gone, or unreadable: searches skip it
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_SEARCH_FILE_BYTES:
            return None
        data = os.read(fd, MAX_SEARCH_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SEARCH_FILE_BYTES or b"\x00" in data[:BINARY_SNIFF_BYTES]:
        return None
    return data


def _innermost_mount(mounts: tuple[Mount, ...], host: str) -> Mount | None:
    """The bind whose host path is the longest one holding `host`."""
    best: Mount | None = None
    for mount in mounts:
        root = mount.host_path
        if is_within(host, root) and (
            best is None or len(root) > len(best.host_path)
        ):
            best = mount
    return best


def _replace_content(fd: int, data: bytes) -> None:
    """Make the open file hold exactly `data`."""
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _exists_at(target: _Target) -> bool:
    try:
        os.stat(target.name, dir_fd=target.parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


# Anchors, lookarounds and flags that see a line's ends differently inside a whole file.
_LINE_ONLY: Final = regex.compile(r"\\[AZzG`']|\(\?<?[=!]|\(\?[a-zA-Z]*[msw]")


def _compile(pattern: str, flags: int = 0) -> regex.Pattern[str]:
    if not pattern or len(pattern) > MAX_PATTERN_CHARS:
        raise FileToolError(f"the pattern must be 1 to {MAX_PATTERN_CHARS} characters")
    try:
        return regex.compile(pattern, flags)
    except regex.error as exc:
        raise FileToolError(f"invalid regular expression: {exc}") from None


# --- the apply_patch format ----------------------------------------------------------------------

_BEGIN, _END = "*** Begin Patch", "*** End Patch"
_ADD, _DELETE, _UPDATE, _MOVE = (
    "*** Add File: ",
    "*** Delete File: ",
    "*** Update File: ",
    "*** Move to: ",
)
_EOF_MARK = "*** End of File"
MAX_PATCH_OPS: Final = 1000  # files one patch may touch


def _parse_patch(patch: str) -> list[_PatchOp]:
    lines = patch.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines or lines[0].strip() != _BEGIN or lines[-1].strip() != _END:
        raise FileToolError(
            "a patch starts with '*** Begin Patch' and ends with '*** End Patch'",
            fix="send the patch in the apply_patch format",
        )
    ops: list[_PatchOp] = []
    i = 1
    body = lines[1:-1]
    i = 0
    while i < len(body):
        line = body[i]
        if line.startswith(_ADD):
            path = line[len(_ADD) :].strip()
            i += 1
            content: list[str] = []
            while i < len(body) and not body[i].startswith("*** "):
                if not body[i].startswith("+"):
                    raise FileToolError(f"line {i + 2}: an added file's lines start with '+'")
                content.append(body[i][1:] + "\n")
                i += 1
            ops.append(_PatchOp(kind="add", path=path, lines=tuple(content)))
        elif line.startswith(_DELETE):
            ops.append(_PatchOp(kind="delete", path=line[len(_DELETE) :].strip()))
            i += 1
        elif line.startswith(_UPDATE):
            path = line[len(_UPDATE) :].strip()
            i += 1
            move_to = None
            if i < len(body) and body[i].startswith(_MOVE):
                move_to = body[i][len(_MOVE) :].strip()
                i += 1
            hunk: list[str] = []
            while i < len(body) and (
                not body[i].startswith("*** ") or body[i].strip() == _EOF_MARK
            ):
                if body[i].strip() != _EOF_MARK:
                    hunk.append(body[i])
                i += 1
            ops.append(_PatchOp(kind="update", path=path, move_to=move_to, lines=tuple(hunk)))
        elif not line.strip():
            i += 1
        else:
            raise FileToolError(f"line {i + 2}: unexpected {line[:80]!r}")
        if len(ops) > MAX_PATCH_OPS:
            raise FileToolError(f"a patch touches at most {MAX_PATCH_OPS} files")
    if not ops:
        raise FileToolError("the patch changes nothing")
    if any(not op.path for op in ops):
        raise FileToolError("a patch section names no file")
    return ops


def _apply_hunks(text: str, hunk_lines: tuple[str, ...], guest: str) -> str:
    """Apply `@@`-separated hunks of ' ', '-' and '+' lines, in order, to `text`."""
    lines = text.splitlines()
    trailing_newline = text.endswith("\n") or not text
    hunks: list[tuple[str, list[str]]] = []
    for line in hunk_lines:
        if line.startswith("@@"):
            hunks.append((line[2:].strip(), []))
        else:
            if not hunks:
                hunks.append(("", []))
            hunks[-1][1].append(line)
    position = 0
    for anchor, body in hunks:
        old: list[str] = []
        new: list[str] = []
        for line in body:
            marker, rest = (line[:1], line[1:]) if line else (" ", "")
            if marker == " ":
                old.append(rest)
                new.append(rest)
            elif marker == "-":
                old.append(rest)
            elif marker == "+":
                new.append(rest)
            else:
                raise FileToolError(f"{guest!r}: a hunk line starts with ' ', '-' or '+'")
        if anchor:
            found = next(
                (k for k in range(position, len(lines)) if lines[k].strip() == anchor.strip()),
                None,
            )
            if found is None:
                raise FileToolError(f"{guest!r}: the hunk anchor {anchor!r} is not found")
            position = found + 1 if old and old[0].strip() != anchor.strip() else found
        at = _find_block(lines, old, position)
        if at is None:
            raise FileToolError(
                f"{guest!r}: a hunk's lines are not found in the file",
                fix="read the file again and patch what it holds now",
            )
        lines[at : at + len(old)] = new
        position = at + len(new)
    result = "\n".join(lines)
    return result + "\n" if trailing_newline and lines else result


def _find_block(lines: list[str], block: list[str], start: int) -> int | None:
    if not block:
        return start
    for k in range(start, len(lines) - len(block) + 1):
        if lines[k : k + len(block)] == block:
            return k
    for k in range(start, len(lines) - len(block) + 1):  # then ignoring trailing whitespace
        if [x.rstrip() for x in lines[k : k + len(block)]] == [x.rstrip() for x in block]:
            return k
    return None
