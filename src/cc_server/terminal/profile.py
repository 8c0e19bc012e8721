"""The server-hosted terminal's fixed profile, built explicitly rather than compiled from a spec.

The reference page fixes it: `$HOME` and the session's working directory writable, network open,
`~/.ssh`, `~/.aws`, `~/.gnupg`, `~/.config/gh` and `~/Library/Keychains` read-denied, and no
capability gating (that is a dispatch concern). Only those five paths are denied, in both their
literal and symlink-resolved spellings; the dispatch policy's wider credential set and mandatory
write denies do not apply to a terminal the user drives by hand.
"""

from __future__ import annotations

import posixpath
from typing import Final

from cc_server.errors import BadSpec
from cc_server.policy import (
    AgentCapabilities,
    CompiledPolicy,
    HostFacts,
    Mode,
    Mount,
    MountKind,
    PathRule,
    spellings,
)
from cc_server.policy.spec import check_absolute

__all__ = ["TERMINAL_DENY_READ", "terminal_policy"]

# The five paths the reference page names for the terminal profile, relative to $HOME.
TERMINAL_DENY_READ: Final[tuple[tuple[str, str], ...]] = (
    (".ssh", "SSH private keys, agent sockets and known hosts"),
    (".aws", "AWS CLI credentials and SSO token cache"),
    (".gnupg", "GnuPG private keys and agent socket"),
    (".config/gh", "GitHub CLI OAuth token (hosts.yml)"),
    ("Library/Keychains", "macOS keychains"),
)


def terminal_policy(
    session_id: str,
    cwd: str,
    host: HostFacts,
    *,
    server_private: tuple[str, ...] = (),
) -> CompiledPolicy:
    """The terminal profile for a session working in `cwd`.

    `server_private` are the server's own secrets (its bearer token file and private directory):
    also read-denied, since a shell that read the token could drive the server and ask it for an
    unsandboxed one. They are not the user's secrets, so the five stay exactly five.

    Raises:
        BadSpec: `cwd` is not an absolute, normalised path to an existing directory, or `$HOME`
            is the root directory (the profile would make the whole host writable).
    """
    try:
        cwd = check_absolute(cwd)
    except ValueError as exc:
        raise BadSpec(f"terminal cwd: {exc}") from None
    if not host.is_dir(cwd):
        raise BadSpec(f"terminal cwd {cwd!r} is not a directory", fix="pass an existing directory")
    home = host.home.rstrip("/")
    if not home:
        raise BadSpec("$HOME is '/', so the terminal profile would make the whole host writable")
    mounts: list[Mount] = []
    for path, reason in ((home, "terminal profile: $HOME"), (cwd, "terminal profile: cwd")):
        resolved = host.realpath(path)
        if any(m.host_path == resolved for m in mounts):
            continue
        mounts.append(
            Mount(host_path=resolved, literal_path=path, guest_path=path, writable=True,
                  reason=reason, kind=MountKind.PROFILE)
        )
    deny_read: list[PathRule] = []
    entries = [(posixpath.join(home, rel), reason) for rel, reason in TERMINAL_DENY_READ]
    entries += [(path, "the server's own token and sockets") for path in server_private]
    for path, reason in entries:
        for spelling in spellings(path, host.realpath):
            if all(rule.path != spelling for rule in deny_read):
                deny_read.append(PathRule(path=spelling, reason=reason))
    return CompiledPolicy(
        session_id=session_id,
        mode=Mode.CHAT,
        mounts=tuple(mounts),
        deny_read=tuple(deny_read),
        deny_write=(),
        deny_create_globs=(),
        workdir=cwd,
        network_allowed=True,
        egress_allowlist=(),
        capabilities=AgentCapabilities(),
        exec_grant_roots=(),
    )
