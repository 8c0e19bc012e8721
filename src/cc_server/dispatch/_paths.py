"""Guest paths to host paths through a compiled policy's binds, and the rule lookups on them.

Pure string work: nothing here touches the filesystem. The in-process file tools resolve the
result again on the host, through file descriptors, before they use it.
"""

from __future__ import annotations

import fnmatch
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

from cc_server.policy import CompiledPolicy, Mount, PathRule
from cc_server.policy.paths import ancestors, is_within, lexical, relative_within

__all__ = [
    "GuestPath",
    "PathOutsideBinds",
    "map_guest_path",
    "matches_create_glob",
    "rule_covering",
    "rule_under",
]

MAX_PATH_BYTES = 4096  # PATH_MAX: the kernel refuses longer paths anyway


class PathOutsideBinds(ValueError):
    """The path is not inside any bind of the policy (or is malformed); the reason says which."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GuestPath:
    """A guest path mapped onto the bind that holds it."""

    guest: str  # normalised absolute guest path
    mount: Mount  # the bind with the longest guest prefix holding it
    relative: str  # path below the mount's root ('' for the root itself), no '..' in it

    @property
    def host(self) -> str:
        """The host path, as the binds spell it (mount roots are symlink-resolved)."""
        if not self.relative:
            return self.mount.host_path
        return posixpath.join(self.mount.host_path, self.relative)


def map_guest_path(policy: CompiledPolicy, path: str) -> GuestPath:
    """Map a path as the agent sees it (absolute, or relative to the policy's workdir).

    `..` is resolved lexically; the result must stay inside a bind.

    Raises:
        PathOutsideBinds: empty, NUL, too long, relative without a workdir, or outside the binds.
    """
    if not path:
        raise PathOutsideBinds("the path is empty")
    if "\x00" in path:
        raise PathOutsideBinds("the path contains a NUL byte")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise PathOutsideBinds(f"the path is longer than {MAX_PATH_BYTES} bytes")
    if not path.startswith("/"):
        if policy.workdir is None:
            raise PathOutsideBinds(f"{path!r} is relative and the session has no workdir")
        path = posixpath.join(policy.workdir, path)
    guest = posixpath.normpath(path)
    if guest.startswith("//"):
        guest = "/" + guest.lstrip("/")
    best: tuple[Mount, str] | None = None
    for mount in policy.mounts:
        rest = relative_within(guest, mount.guest_path)
        if rest is not None and (best is None or len(mount.guest_path) > len(best[0].guest_path)):
            best = (mount, rest)
    if best is None:
        raise PathOutsideBinds(f"{guest!r} is outside the sandbox's binds")
    return GuestPath(guest=guest, mount=best[0], relative=best[1])


def rule_covering(rules: Iterable[PathRule], host_path: str) -> PathRule | None:
    """The first rule whose path is `host_path` or one of its ancestors."""
    up = ancestors(host_path)  # one set lookup a rule: this runs for every path a tool checks
    for rule in rules:
        if lexical(rule.path) in up:
            return rule
    return None


def rule_under(rules: Iterable[PathRule], host_dir: str) -> list[PathRule]:
    """Rules whose path lies strictly below `host_dir` (what a walk of it must skip)."""
    return [r for r in rules if r.path != host_dir and is_within(r.path, host_dir)]


def matches_create_glob(globs: Iterable[str], name: str) -> str | None:
    """The first create-time glob the file name matches.

    Case-folded, and `*` matches a leading dot, as the create-rule supervisor matches (a `.PEM`
    is refused as `*.pem` is, for case-folding filesystems).
    """
    folded = name.casefold()
    for glob in globs:
        if fnmatch.fnmatchcase(folded, glob.casefold()):
            return glob
    return None
