"""The host identity of a root server's sandboxes: never host uid 0.

A sandbox started by bubblewrap maps its one uid to the server's. For a root server that is host
uid 0, which owns `/proc/sys` and whatever else the kernel checks by uid alone (no capability is
needed to write a root-owned `0644` file). So a root server starts every sandbox through
`cc-identity` (native/identity.c, built by scripts/bootstrap), which runs bubblewrap as
`SANDBOX_UID`:`SANDBOX_GID` with no supplementary groups, after idmapping each bind so its owner's
files appear as that identity's: the sandbox reads and writes a bind as its owner, and what it
creates there belongs on the host to that owner. Inside, the command still runs as uid 0 (bwrap
`--uid 0 --gid 0`), with no capability, as a root server's commands always did.

The binds reach bubblewrap through `STAGE_DIR/<n>`: a tmpfs the helper mounts in a mount namespace
of its own (a slave of the host's), so no directory above a bind needs to be searchable by the
sandbox identity and nothing changes in the host's mount table.

A non-root server keeps bubblewrap's own mapping: the sandbox is the server's uid.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypeVar

from cc_server.errors import BadSpec
from cc_server.policy.paths import is_within

if TYPE_CHECKING:
    from cc_server.backends.plan import SandboxIdentity

__all__ = [
    "IDENTITY_TOOL",
    "SANDBOX_GID",
    "SANDBOX_UID",
    "STAGE_DIR",
    "IdentityCheck",
    "check_identity",
    "identity_argv",
    "is_sandbox_uid",
    "sandbox_uids",
    "session_identity",
]

# The uids and gids of a root server's sandboxes, owned by nothing on the host: above the ranges
# useradd (1000-60000) and systemd's dynamic users (61184-65519) take, and above the subordinate
# ranges useradd hands out (100000 + 65536 n, for the first 28,000 users). Each session gets its
# own from the range (`session_identity`), so per-user kernel counts (inotify instances and
# watches, RLIMIT_NPROC) are not shared between sessions; SANDBOX_UID itself is the selftest's.
SANDBOX_UID: Final = 0x7000_0000
SANDBOX_GID: Final = 0x7000_0000
SANDBOX_ID_RANGE: Final = 0x1_0000  # ids per server: SANDBOX_UID .. SANDBOX_UID + range - 1
# Where the helper stages the idmapped binds, in its own mount namespace. /dev/shm exists on every
# Linux host; bubblewrap's `--dev /dev` makes the sandbox a /dev of its own, so the host's
# /dev/shm is never a source of the plan.
STAGE_DIR: Final = "/dev/shm"
IDENTITY_TOOL: Final = "cc-identity"  # probe tools key: the helper's absolute path
SELFTEST_TIMEOUT_S: Final = 10.0
_NATIVE_DIR: Final = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")
_BUILD_HINT: Final = (
    "build it with scripts/bootstrap (needs gcc), or run the server as a non-root user"
)


_W = TypeVar("_W")
_BIND_OPTIONS: Final = frozenset({"--bind", "--ro-bind"})


def _staged(
    source: str, staged: Sequence[str], by_depth: Sequence[int], realpath: Callable[[str], str]
) -> str:
    if not any(is_within(source, r) for r in staged):
        source = realpath(source)
    for i in by_depth:
        if is_within(source, staged[i]):
            return f"{STAGE_DIR}/{i}{source[len(staged[i]):]}"
    return source


def identity_argv(
    bwrap_argv: Sequence[_W],
    identity: SandboxIdentity,
    roots: Sequence[str],
    realpath: Callable[[str], str] = lambda path: path,
) -> list[_W | str]:
    """`cc-identity --uid U --gid G --stage STAGE_DIR --map ROOT... -- BWRAP_ARGV`, each
    `--bind`/`--ro-bind` source below a root taking its path from that root's stage (the
    innermost one). Only bubblewrap's own options are read: what follows its `--` (the command,
    or QEMU's argv) is passed on as it is. A source below no root is named by its real path (a
    tool spelled through a symlink); system paths, /dev/null and /proc stay as any uid reads
    them. Pure.

    Raises:
        BadSpec: a root is at or above STAGE_DIR, or below it.
    """
    staged: list[str] = []
    for root in roots:
        if is_within(root, STAGE_DIR) or is_within(STAGE_DIR, root):
            raise BadSpec(
                f"bind mount {root!r} overlaps {STAGE_DIR}, where a root server stages its binds",
                fix=f"bind a directory outside {STAGE_DIR}",
            )
        if root not in staged:
            staged.append(root)
    # Longest first, so a source below a nested root comes from that root's own stage.
    by_depth = sorted(range(len(staged)), key=lambda i: -len(staged[i]))
    out: list[_W | str] = [
        identity.helper, "--uid", str(identity.uid), "--gid", str(identity.gid),
        "--stage", STAGE_DIR,
    ]  # fmt: skip
    for root in staged:
        out += ["--map", root]
    out.append("--")
    words = iter(bwrap_argv)
    for word in words:
        out.append(word)
        if word == "--":
            out.extend(words)
            break
        if isinstance(word, str) and word in _BIND_OPTIONS:
            source = next(words)
            out.append(_staged(source, staged, by_depth, realpath) if isinstance(source, str)
                       else source)  # fmt: skip
            continue
    return out


def session_identity(identity: SandboxIdentity, session_id: str) -> SandboxIdentity:
    """The identity of one session's sandboxes: the range's base plus a stable offset from the
    session id (two sessions share ids only by a 1-in-65,536 chance, and then only their
    per-user kernel counts). Pure."""
    offset = zlib.crc32(session_id.encode()) % SANDBOX_ID_RANGE
    return dataclasses.replace(identity, uid=identity.uid + offset, gid=identity.gid + offset)


def is_sandbox_uid(uid: int) -> bool:
    """Whether `uid` is one of a root server's sandbox identities."""
    return SANDBOX_UID <= uid < SANDBOX_UID + SANDBOX_ID_RANGE


class _SandboxUids:
    """The host uids this server's sandboxed processes run as (`in` only)."""

    def __init__(self, own: int) -> None:
        self.own = own

    def __contains__(self, uid: object) -> bool:
        return uid == self.own or (self.own == 0 and isinstance(uid, int) and is_sandbox_uid(uid))


def sandbox_uids() -> _SandboxUids:
    """The host uids this server's sandboxed processes run as: its own, and the sandbox
    identities' when it is root. What a uid check on a local socket or in /proc must accept."""
    return _SandboxUids(os.geteuid())


@dataclass(frozen=True, slots=True, kw_only=True)
class IdentityCheck:
    """Whether this server needs a sandbox identity, and whether it has one that works."""

    needed: bool
    available: bool = False
    helper: str | None = None
    hint: str | None = None


_SELFTEST_DIR = re.compile(r"^cc-identity-selftest-(?P<pid>\d+)-\w{6}\Z")


def _remove_dead_selftests(tmp: str = "/tmp") -> None:
    """What a selftest killed mid-way left (its mounts died with it; its directories did not)."""
    from cc_server.rundir import names_of_dead_owners  # lazy: only the probe as root

    for name in names_of_dead_owners(tmp, _SELFTEST_DIR):
        shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)


def check_identity(native_dir: str = _NATIVE_DIR) -> IdentityCheck:
    """The probe's check: needed only as root; then the helper must be built and its selftest
    (an idmapped bind written as the sandbox identity, owned by the bind's owner) must pass.
    Raises nothing."""
    if os.geteuid() != 0:
        return IdentityCheck(needed=False)
    _remove_dead_selftests()
    helper = os.path.join(native_dir, IDENTITY_TOOL)
    if not os.access(helper, os.X_OK):
        return IdentityCheck(
            needed=True,
            hint=f"the server runs as root and its sandboxes must not: {helper} is missing; "
            + _BUILD_HINT,
        )
    try:
        done = subprocess.run(
            [helper, "--selftest", str(SANDBOX_UID), str(SANDBOX_GID)],
            capture_output=True, timeout=SELFTEST_TIMEOUT_S, check=False, env={},
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return IdentityCheck(needed=True, hint=f"{helper} --selftest failed: {exc}")
    if done.returncode != 0:
        detail = done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"
        return IdentityCheck(
            needed=True,
            hint=f"the server runs as root, and the sandbox identity does not work here "
            f"({detail}); idmapped mounts need Linux 5.12 or newer; or run the server as a "
            "non-root user",
        )
    return IdentityCheck(needed=True, available=True, helper=helper)
