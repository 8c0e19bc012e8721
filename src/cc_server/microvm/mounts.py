"""The session's bind mounts in the guest, planned from the compiled policy; pure.

Each bind is one 9p slot, read-only at the host (`-fsdev ...,readonly=on`) where the policy says
(mode rules, `readOnly`), so even a guest kernel that misbehaved could not write through it. The
policy's deny-write paths inside a writable bind become read-only bind mounts in the guest, and
its deny-read paths inside any bind are hidden (an empty read-only tmpfs or file over them);
commands in the guest run without CAP_SYS_ADMIN, so they cannot unmount either. Nothing else of
the host is in the guest: no slot is exported but these, unused slots point at an empty
read-only directory.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from cc_server.errors import BadSpec
from cc_server.microvm.proto import MountOp
from cc_server.microvm.vm import MOUNT_SLOTS, Share, slot_tag
from cc_server.policy import CompiledPolicy
from cc_server.policy.paths import is_within, relative_within

__all__ = ["GuestMount", "MountPlan", "plan_mounts"]

# Guest paths a bind may not cover: the guest's own system, which the agent needs.
RESERVED_GUEST_PATHS: Final = ("/", "/bin", "/sbin", "/dev", "/proc", "/sys", "/run", "/lib",
                               "/etc", "/init", "/usr", "/usr/bin", "/usr/sbin")


@dataclass(frozen=True, slots=True, kw_only=True)
class GuestMount:
    """One step the agent takes in the guest, in order."""

    op: MountOp
    guest_path: str
    tag: str = ""
    read_only: bool = False
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class MountPlan:
    """The slots' host directories and the agent's mount steps."""

    shares: tuple[Share, ...]
    steps: tuple[GuestMount, ...]


def _relative_to_any(path: str, roots: set[str]) -> str | None:
    """`path` relative to the first of `roots` holding it ("" for a root itself), else None."""
    return next((r for r in (relative_within(path, root) for root in roots) if r is not None), None)


def plan_mounts(
    policy: CompiledPolicy,
    *,
    is_dir: Callable[[str], bool],
    exists: Callable[[str], bool],
) -> MountPlan:
    """The mount plan for `policy`.

    Raises:
        BadSpec: more binds than slots, a bind that is not a directory (9p exports directories),
            or a guest path that would cover the guest's own system.
    """
    if len(policy.mounts) > MOUNT_SLOTS:
        raise BadSpec(
            f"{len(policy.mounts)} bind mounts (runnerStateDirs included); a microVM has "
            f"{MOUNT_SLOTS} mount slots",
            fix="bind a common parent directory instead, or use backend 'native'",
        )
    shares: list[Share] = []
    steps: list[GuestMount] = []
    carves: list[GuestMount] = []
    for index, mount in enumerate(policy.mounts):
        guest = posixpath.normpath(mount.guest_path)
        if guest in RESERVED_GUEST_PATHS or not guest.startswith("/") or any(
            is_within(guest, r) for r in ("/proc", "/sys", "/dev", "/run")
        ):
            raise BadSpec(
                f"guestPath {mount.guest_path!r} would cover the guest's own system",
                fix="bind it somewhere else, e.g. under /work or /home",
            )
        if not is_dir(mount.host_path):
            raise BadSpec(
                f"bind mount {mount.literal_path!r} is not a directory; a microVM shares "
                "directories only",
                fix="bind its parent directory",
            )
        writable = mount.writable
        roots = {mount.host_path, mount.literal_path}
        for rule in policy.deny_write:
            rel = _relative_to_any(rule.path, roots)
            if rel is None or not writable:
                continue
            if rel == "":
                writable = False  # the whole bind is protected: read-only at the host
            elif exists(rule.path):
                carves.append(GuestMount(op=MountOp.RO_BIND, guest_path=posixpath.join(guest, rel),
                                         reason=rule.reason))
        for rule in policy.deny_read:
            if "*" in rule.path or "?" in rule.path:
                continue
            rel = _relative_to_any(rule.path, roots)
            if rel == "":
                raise BadSpec(
                    f"bind mount {mount.literal_path!r} is a path the policy denies reading "
                    f"({rule.reason})",
                    fix="do not bind secret directories into a sandbox",
                )
            if rel is not None and exists(rule.path):
                carves.append(GuestMount(op=MountOp.HIDE, guest_path=posixpath.join(guest, rel),
                                         reason=rule.reason))
        shares.append(Share(host_path=mount.host_path, read_only=not writable))
        steps.append(GuestMount(op=MountOp.NINEP, guest_path=guest, tag=slot_tag(index),
                                read_only=not writable, reason=mount.reason))
    # Parents before children, then the carve-outs (each once), read-only before hidden.
    steps.sort(key=lambda s: s.guest_path.count("/"))
    seen: set[tuple[MountOp, str]] = set()
    for carve in sorted(carves, key=lambda c: (c.op, c.guest_path.count("/"))):
        if (carve.op, carve.guest_path) not in seen:
            seen.add((carve.op, carve.guest_path))
            steps.append(carve)
    return MountPlan(shares=tuple(shares), steps=tuple(steps))
