"""compile(spec, host) -> CompiledPolicy: pure, no process started, nothing written.

The host is consulted only through `HostFacts` (home directory, symlink resolution, existence), so
every branch is testable on any OS with fake facts.
"""

from __future__ import annotations

import enum
import posixpath
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cc_server.errors import BadSpec
from cc_server.policy.host import HostFacts
from cc_server.policy.paths import (
    HOME_MANDATORY_DENY_WRITE,
    ROOT_MANDATORY_DENY_WRITE,
    SECRET_DENY_READ,
    SYSTEM_DENY_READ,
    is_within,
)
from cc_server.policy.spec import AgentCapabilities, Mode, SandboxSpec

__all__ = [
    "CompiledPolicy",
    "Mount",
    "MountKind",
    "PathRule",
    "compile_policy",
    "innermost_mount",
    "spellings",
]

MAX_GLOB_LENGTH = 255  # one file name; a glob names a file, not a path


@dataclass(frozen=True, slots=True, kw_only=True)
class PathRule:
    """A path a rule applies to, with the reason the rule exists."""

    path: str
    reason: str


class MountKind(enum.StrEnum):
    """Why a mount is there (its `reason` says it in words, for people)."""

    BIND = "bind"  # one of the spec's bindMounts
    RUNNER_STATE = "runner-state"  # one of the spec's runnerStateDirs
    PROFILE = "profile"  # a fixed profile's own (the terminal's $HOME and working directory)
    SYSTEM = "system"  # a system path a backend shows read-only


@dataclass(frozen=True, slots=True, kw_only=True)
class Mount:
    """A host path made visible in the sandbox.

    `host_path` is the symlink-resolved source; `literal_path` is how the spec spelled it.
    """

    host_path: str
    literal_path: str
    guest_path: str
    writable: bool
    reason: str
    kind: MountKind = MountKind.BIND
    host_sockets: bool = False
    """Host listeners below it may be connected to (SandboxBindMount.host_sockets)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CompiledPolicy:
    """Everything a backend needs, in absolute paths, both spellings of every deny path."""

    session_id: str
    mode: Mode
    mounts: tuple[Mount, ...]
    deny_read: tuple[PathRule, ...]
    deny_write: tuple[PathRule, ...]
    deny_create_globs: tuple[str, ...]
    workdir: str | None
    network_allowed: bool
    egress_allowlist: tuple[str, ...]
    capabilities: AgentCapabilities
    exec_grant_roots: tuple[str, ...]
    protected_patterns: tuple[str, ...] = ()
    """Path patterns refused at any depth of a writable bind when the write happens (the
    create-rule supervisor decides them; see policy/paths.py PROTECTED_PATTERNS)."""
    protected_absolute: tuple[str, ...] = ()
    """protectedPaths, as spelled and as resolved, refused with everything below them whether
    they exist or not (by the supervisor, when it runs)."""

    @property
    def exempt_roots(self) -> tuple[str, ...]:
        """Runner state directories: the path patterns do not apply below them."""
        return tuple(m.host_path for m in self.mounts if m.kind is MountKind.RUNNER_STATE)

    @property
    def host_socket_dirs(self) -> tuple[str, ...]:
        """Where host listeners may be connected to, in the sandbox's view."""
        return tuple(m.guest_path for m in self.mounts if m.host_sockets)

    @property
    def writable_roots(self) -> tuple[str, ...]:
        """Resolved host paths that are writable, in mount order."""
        return tuple(m.host_path for m in self.mounts if m.writable)

    def default_cwd(self, host: HostFacts) -> str:
        """Where a command without a cwd starts: the workdir, else the first of the spec's
        bindMounts that is a directory, else $HOME."""
        if self.workdir is not None:
            return self.workdir
        for mount in self.mounts:
            if mount.kind is MountKind.BIND and host.is_dir(mount.host_path):
                return mount.host_path
        return host.home

    @property
    def requires_create_rules(self) -> bool:
        """True when the policy forbids creating names by glob or writing protected path
        patterns, which needs a capable backend (the create-rule supervisor)."""
        return bool(self.deny_create_globs or self.protected_patterns)


def innermost_mount(mounts: Iterable[Mount], host_path: str) -> Mount | None:
    """The mount whose host path is the longest one holding `host_path` (the first of equal
    ones), or None when none holds it: what a path shows inside the sandbox."""
    best: Mount | None = None
    for mount in mounts:
        if is_within(host_path, mount.host_path) and (
            best is None or len(mount.host_path) > len(best.host_path)
        ):
            best = mount
    return best


def _is_glob(path: str) -> bool:
    return "*" in path or "?" in path


def spellings(path: str, realpath: Callable[[str], str]) -> tuple[str, ...]:
    """The literal spelling and the symlink-resolved one (once if equal).

    Globs are left alone; a path that does not resolve is kept as written.
    """
    if _is_glob(path):
        return (path,)
    try:
        resolved = realpath(path)
    except (OSError, ValueError):
        return (path,)
    if resolved == path:
        return (path,)
    return (path, resolved)


def _rules(entries: Iterable[tuple[str, str]], realpath: Callable[[str], str]) -> list[PathRule]:
    rules: list[PathRule] = []
    seen: set[str] = set()
    for path, reason in entries:
        for spelling in spellings(path, realpath):
            if spelling not in seen:
                seen.add(spelling)
                rules.append(PathRule(path=spelling, reason=reason))
    return rules


def _check_glob(glob: str) -> str:
    if not glob or "/" in glob or "\x00" in glob or len(glob) > MAX_GLOB_LENGTH:
        raise BadSpec(
            f"create-time glob {glob!r} must be one non-empty file name pattern without '/'",
            fix="write it as a name pattern such as '*.pem' or '.env'",
        )
    return glob


def _check_pattern(pattern: str) -> str:
    parts = pattern.split("/")
    if (
        not pattern
        or pattern.startswith("/")
        or "\x00" in pattern
        or len(pattern) > MAX_GLOB_LENGTH
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise BadSpec(
            f"protected path pattern {pattern!r} must be relative components without '.' or "
            "'..', optionally ending in '/**'",
            fix="write it as '.git/config' or '.vscode/**'",
        )
    return pattern


def compile_policy(
    spec: SandboxSpec,
    host: HostFacts,
    *,
    deny_create_globs: Iterable[str] = (),
    protected_patterns: Iterable[str] = (),
) -> CompiledPolicy:
    """Compile a spec against the host's facts.

    `deny_create_globs` are create-time filename rules (the standard dispatch policy passes
    `.env`, `*.key`, `*.pem`); the policy carries them for backends that can enforce them.
    `protected_patterns` are the write policy's path patterns (the runtime passes
    `PROTECTED_PATTERN_NAMES` for every native launch); with them, `protectedPaths` are enforced
    by the supervisor too, whether they exist or not.

    Raises:
        BadSpec: a bind mount's host path does not exist, or a glob is malformed.
    """
    realpath = host.realpath
    home = host.home.rstrip("/") or "/"

    mounts: list[Mount] = []
    for bind in spec.bind_mounts:
        if not host.exists(bind.host_path):
            raise BadSpec(
                f"bind mount hostPath {bind.host_path!r} does not exist",
                fix="create it first or remove it from bindMounts",
            )
        if bind.host_sockets and not bind.read_only:
            raise BadSpec(
                f"bind mount {bind.host_path!r}: hostSockets needs readOnly: in a writable "
                "bind a hard link would bring any other socket of the same filesystem in",
                fix="set readOnly: true on it, or drop hostSockets",
            )
        resolved = realpath(bind.host_path)
        mounts.append(
            Mount(
                host_path=resolved,
                literal_path=bind.host_path,
                guest_path=bind.guest,
                writable=spec.mode.binds_writable and not bind.read_only,
                reason="bind mount" if spec.mode.binds_writable else f"bind mount ({spec.mode})",
                host_sockets=bind.host_sockets,
            )
        )
    for state_dir in spec.runner_state_dirs:
        if not host.exists(state_dir):
            raise BadSpec(
                f"runnerStateDirs entry {state_dir!r} does not exist",
                fix="create the runner state directory before launch",
            )
        mounts.append(
            Mount(
                host_path=realpath(state_dir),
                literal_path=state_dir,
                guest_path=state_dir,
                writable=True,
                reason="runner state directory",
                kind=MountKind.RUNNER_STATE,
            )
        )

    deny_read = _rules(
        [(posixpath.join(home, rel), why) for rel, why in SECRET_DENY_READ]
        + list(SYSTEM_DENY_READ),
        realpath,
    )

    roots = {m.literal_path: None for m in mounts if m.writable}
    roots.update({m.host_path: None for m in mounts if m.writable})
    mandatory: list[tuple[str, str]] = []
    for root in [home, *roots]:
        for rel, why in ROOT_MANDATORY_DENY_WRITE:
            mandatory.append((posixpath.join(root, rel), why))
    for rel, why in HOME_MANDATORY_DENY_WRITE:
        mandatory.append((posixpath.join(home, rel), why))
    protected = [(p, "protected path (registered checkout)") for p in spec.protected_paths]
    deny_write = _rules(protected + mandatory, realpath)

    globs = tuple(dict.fromkeys(_check_glob(g) for g in deny_create_globs))
    patterns = tuple(dict.fromkeys(_check_pattern(p) for p in protected_patterns))
    absolute = tuple(
        dict.fromkeys(s for p in spec.protected_paths for s in spellings(p, realpath))
    )

    return CompiledPolicy(
        session_id=spec.session_id,
        mode=spec.mode,
        mounts=tuple(mounts),
        deny_read=tuple(deny_read),
        deny_write=tuple(deny_write),
        deny_create_globs=globs,
        workdir=spec.guest_workdir,
        network_allowed=spec.network_allowed,
        egress_allowlist=spec.egress_allowlist if spec.network_allowed else (),
        capabilities=spec.capabilities,
        exec_grant_roots=spec.exec_grant_roots,
        protected_patterns=patterns,
        protected_absolute=absolute if patterns else (),
    )
