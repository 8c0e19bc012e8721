"""macOS `native`: turn a CompiledPolicy and a command into a sandbox-exec LaunchPlan.

Pure: reads the host only through HostFacts (what exists, what is a directory, where symlinks point)
and the checked-in base profile; runs nothing. The profile is the base file `seatbelt_base.sb` with
the rules for one launch inserted at its marker, in this order (Seatbelt applies the last rule that
matches, so the order is the policy):

1. writes: the base resets them to deny; allow the writable roots (the mode's writable binds and
   `runnerStateDirs`) and the per-user temp dir;
2. writes denied even inside a writable root: protected paths, the mandatory denies, the secret
   stores, the session's egress directories; then the create-time name rules as regexes;
3. renames and deletes denied on every denied path and on each of its ancestors, so moving a
   parent away cannot carry a denied path out from under its rule;
4. reads denied for the deny-read set and the session's egress directories;
5. exec denied from every writable directory, re-allowed under `execGrantRoots`;
6. network: only the session's two proxy ports on loopback and the system resolver's socket (or
   nothing, without an egress bridge; or everything, for the terminal's fixed profile).

After the inserted part the base denies the always-dangerous binaries and the requests that make a
service outside the sandbox act (Apple Events, LaunchServices, preference writes).

No user path is ever pasted into the profile text: each is a `(param "NAME")` given on the
command line as `-DNAME=VALUE`, and globs become regexes passed the same way. The only generated
words in the text are parameter names, our own reasons (in comments), port numbers and the
session tag, which is checked to be lowercase letters, digits and '-'.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Final

from cc_server.backends.egress_bridge import bridge_env
from cc_server.backends.plan import Command, LaunchPlan
from cc_server.backends.probe import SANDBOX_EXEC_PATH
from cc_server.errors import BadSpec, EnforcementFailed
from cc_server.policy import CompiledPolicy, HostFacts, PathRule, SandboxBackend, spellings
from cc_server.policy.paths import is_within

__all__ = [
    "BASE_PROFILE",
    "DEFAULT_PATH",
    "DNS_SOCKET",
    "GENERATED_MARKER",
    "TAG_TOKEN",
    "SeatbeltPlanner",
    "SeatbeltProfile",
    "build_profile",
    "darwin_user_temp_dir",
    "glob_regex",
    "message_for",
    "plan_seatbelt",
    "render_seatbelt_plan",
    "session_tag_for",
]

BASE_PROFILE: Final = "seatbelt_base.sb"  # package data beside this module
GENERATED_MARKER: Final = ";;@GENERATED@"
TAG_TOKEN: Final = "@SESSION_TAG@"
# macOS name lookups go to mDNSResponder over this Unix socket; the daemon does the DNS traffic.
DNS_SOCKET: Final = "/private/var/run/mDNSResponder"
DEFAULT_PATH: Final = "/usr/bin:/bin:/usr/sbin:/sbin"
_TAG = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")  # safe inside an SBPL string and a log predicate
TAG_HEX_CHARS: Final = 12  # 48 bits of the session id's hash: distinct for concurrent sessions
_REGEX_SPECIAL = frozenset("\\.^$|?*+()[]{}")
_USER_TEMP = re.compile(r"^(/private)?/var/folders/[^/]+/[^/]+/T/?$")


@dataclass(frozen=True, slots=True, kw_only=True)
class SeatbeltProfile:
    """A generated profile: its text and the parameters sandbox-exec must be given with it."""

    text: str
    params: tuple[tuple[str, str], ...]
    """(NAME, VALUE) in first-use order; passed as -DNAME=VALUE."""
    tag: str
    """The session tag; every deny's message is `message_for(tag)`."""


def session_tag_for(session_id: str) -> str:
    """The tag derived from a session id: stable, and safe in a profile and a log predicate."""
    return hashlib.sha256(session_id.encode("utf-8")).hexdigest()[:TAG_HEX_CHARS]


def message_for(tag: str) -> str:
    """The message every deny rule of the session carries; the log monitor matches it exactly."""
    return f"cc-{tag}"


def darwin_user_temp_dir(environ: Mapping[str, str]) -> str | None:
    """The per-user temp dir (`/var/folders/xx/yyyy/T`) from TMPDIR, or None when TMPDIR is not
    one; launchd sets it for every macOS login session. Raises nothing."""
    value = environ.get("TMPDIR", "")
    if not _USER_TEMP.match(value):
        return None
    return value.rstrip("/")


def glob_regex(pattern: str) -> str:
    """A Seatbelt regex for a path glob: `*` is any run of characters but '/', `?` one such
    character; every other regex metacharacter is escaped. The match covers the path and
    everything below it, like a subpath."""
    return "^" + _glob_body(pattern) + "(/.*)?$"


def _name_regex(glob: str) -> str:
    """A Seatbelt regex for a create-time name glob (one file name, no '/'): any path whose last
    component matches."""
    return "/" + _glob_body(glob) + "$"


def _glob_body(pattern: str) -> str:
    out: list[str] = []
    for char in pattern:
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char in _REGEX_SPECIAL:
            out.append("\\" + char)
        else:
            out.append(char)
    return "".join(out)


def _is_glob(path: str) -> bool:
    return "*" in path or "?" in path


def _ancestors(path: str) -> list[str]:
    """Every directory above `path`, nearest first, without '/'."""
    out: list[str] = []
    parent = posixpath.dirname(path.rstrip("/"))
    while parent not in ("/", ""):
        out.append(parent)
        parent = posixpath.dirname(parent)
    return out


def _reason(text: str) -> str:
    """One comment line: printable, no line break, whatever the reason string holds."""
    return "".join(c if c.isprintable() else "?" for c in text)


@cache
def _base_profile() -> str:
    text = resources.files("cc_server.backends").joinpath(BASE_PROFILE).read_text("utf-8")
    lines = text.splitlines()
    comments = [line for line in lines if line.lstrip().startswith(";")]
    if (
        lines.count(GENERATED_MARKER) != 1
        or TAG_TOKEN not in text
        or any(TAG_TOKEN in c or (GENERATED_MARKER in c and c != GENERATED_MARKER)
               for c in comments)
    ):
        raise EnforcementFailed(
            f"the checked-in {BASE_PROFILE} needs exactly one {GENERATED_MARKER} line and "
            f"{TAG_TOKEN} in rules only; the installation is damaged",
            fix="reinstall cc-server",
        )
    return text


class _Params:
    """Names for the user paths and regexes a profile refers to, one name per distinct value."""

    def __init__(self) -> None:
        self._by_value: dict[str, str] = {}
        self._counts: dict[str, int] = {}
        self.items: list[tuple[str, str]] = []

    def ref(self, kind: str, value: str) -> str:
        """`(param "KIND_N")` for `value`; the first kind a value is used with names it."""
        if "\x00" in value:
            raise BadSpec(f"a path in the policy contains a NUL byte: {value!r}")
        name = self._by_value.get(value)
        if name is None:
            index = self._counts.get(kind, 0)
            self._counts[kind] = index + 1
            name = f"{kind}_{index}"
            self._by_value[value] = name
            self.items.append((name, value))
        return f'(param "{name}")'


@dataclass(slots=True)
class _Builder:
    host: HostFacts
    message: str
    params: _Params = field(default_factory=_Params)
    lines: list[str] = field(default_factory=list)

    def section(self, title: str) -> None:
        if self.lines:
            self.lines.append("")
        self.lines.append(f";; --- {title} " + "-" * max(3, 92 - len(title)))

    def rule(self, action: str, operation: str, filters: Sequence[str], reason: str) -> None:
        self.lines.append(f";; {'Allow' if action == 'allow' else 'Deny'}: {_reason(reason)}")
        words = [*filters, f'(with message "{self.message}")'] if action == "deny" else filters
        if len(words) <= 2:
            self.lines.append(f"({action} {operation}{''.join(' ' + w for w in words)})")
            return
        self.lines.append(f"({action} {operation}")
        self.lines.extend(f"  {w}" for w in words[:-1])
        self.lines.append(f"  {words[-1]})")

    def denies(
        self, operation: str, kind: str, rules: Iterable[PathRule], prefix: str = ""
    ) -> None:
        """One deny per reason, naming every path with that reason, in first-use order."""
        by_reason: dict[str, list[str]] = {}
        for rule in rules:
            by_reason.setdefault(rule.reason, []).append(self.deny_filter(kind, rule.path))
        for reason, filters in by_reason.items():
            self.rule("deny", operation, filters, prefix + reason)

    def allow_filter(self, kind: str, path: str) -> str:
        """An allow names exactly one tree: a '*' in its path is a character, never a glob."""
        return f"(subpath {self.params.ref(kind, path)})"

    def path_filter(self, kind: str, path: str, *, subtree: bool) -> str:
        """A filter for `path`: regex for a glob, subpath for a tree, literal for one file."""
        if _is_glob(path):
            return f"(regex {self.params.ref(kind + '_REGEX', glob_regex(path))})"
        if subtree:
            return f"(subpath {self.params.ref(kind, path)})"
        return f"(literal {self.params.ref(kind, path)})"

    def deny_filter(self, kind: str, path: str) -> str:
        """Subpath for a directory or a path that does not exist yet, literal for a file."""
        subtree = _is_glob(path) or not self.host.exists(path) or self.host.is_dir(path)
        return self.path_filter(kind, path, subtree=subtree)


def _writable_roots(
    policy: CompiledPolicy, host: HostFacts, temp_dir: str | None
) -> list[tuple[str, str, tuple[str, ...]]]:
    """(resolved path, reason, every spelling) for each writable root. Allows name the resolved
    spelling only: that is what the kernel matches. A root entirely inside a write-denied path
    gets no allow (the deny would win anyway)."""
    roots: list[tuple[str, str, tuple[str, ...]]] = [
        (m.host_path, m.reason, (m.literal_path, m.host_path)) for m in policy.mounts if m.writable
    ]
    if temp_dir is not None:
        temp = spellings(temp_dir, host.realpath)
        roots.append((temp[-1], "the per-user temp dir, which most tools write to", temp))
    denied = [r.path for r in policy.deny_write if not _is_glob(r.path)]
    out: list[tuple[str, str, tuple[str, ...]]] = []
    seen: set[str] = set()
    for path, reason, names in roots:
        if path in seen or any(is_within(path, d) for d in denied):
            continue
        seen.add(path)
        out.append((path, reason, tuple(dict.fromkeys(names))))
    return out


def _egress_rules(command: Command, host: HostFacts) -> list[PathRule]:
    """The session's egress directories (every session's socket directory, and the server's
    token), both spellings: neither readable nor writable from inside."""
    if command.egress is None:
        return []
    reason = "egress socket directories: other sessions' proxies and the server's token"
    paths = [command.egress.socket_dir]
    if command.egress.base_dir is not None:
        paths.insert(0, command.egress.base_dir)
    out: list[PathRule] = []
    for path in paths:
        if not posixpath.isabs(path):
            continue  # a placeholder (`cc-server plan`): nothing on the host to hide
        out.extend(PathRule(path=p, reason=reason) for p in spellings(path, host.realpath))
    return out


def _unique(rules: Iterable[PathRule]) -> list[PathRule]:
    seen: set[str] = set()
    out: list[PathRule] = []
    for rule in rules:
        if rule.path not in seen:
            seen.add(rule.path)
            out.append(rule)
    return out


def _network(b: _Builder, command: Command, *, share_net: bool) -> None:
    b.section("network")
    if share_net:
        b.lines.append(";; Open: the terminal's fixed profile does not restrict the network.")
        return
    egress = command.egress
    if egress is None:
        b.rule("deny", "network*", [], "no egress bridge for this launch: no network at all")
        return
    if egress.http_port is None or egress.socks_port is None:
        raise EnforcementFailed(
            "the session's egress proxies have no TCP ports; a macOS sandbox reaches them only "
            "on the shared loopback",
            fix="start the session's proxies with TCP listeners (ProxyParams.listen_tcp)",
        )
    b.rule("deny", "network*", [], "only the session's proxies and the resolver, allowed below")
    for port, what in ((egress.http_port, "HTTP"), (egress.socks_port, "SOCKS5")):
        if not 0 < port < 65536:
            raise EnforcementFailed(f"egress {what} proxy port {port} is out of range")
        b.rule(
            "allow",
            "network-outbound",
            [f'(remote ip "localhost:{int(port)}")'],
            f"the session's {what} proxy on loopback; it enforces the domain allowlist",
        )
    b.rule(
        "allow",
        "network-outbound",
        [f'(remote unix-socket (path-literal "{DNS_SOCKET}"))'],
        "DNS: the system resolver (mDNSResponder) answers name lookups over this socket",
    )


def build_profile(
    policy: CompiledPolicy,
    command: Command,
    *,
    host: HostFacts,
    session_tag: str,
    temp_dir: str | None = None,
    share_net: bool = False,
) -> SeatbeltProfile:
    """The profile for one launch of `command` under `policy`.

    Raises:
        BadSpec: the session tag is malformed, or a path holds a NUL byte.
        EnforcementFailed: the base profile is damaged, or the egress bridge has no usable ports.
    """
    if not _TAG.match(session_tag):
        raise BadSpec(
            f"session tag {session_tag!r} must be 1-63 lowercase letters, digits or '-'",
            fix="omit it to derive one from the session id",
        )
    b = _Builder(host=host, message=message_for(session_tag))
    roots = _writable_roots(policy, host, temp_dir)
    egress_rules = _egress_rules(command, host)

    # 1. The writable roots (the base has just reset writes to deny).
    b.section("writes: the roots this launch may write (resolved spellings)")
    for path, reason, names in roots:
        b.rule("allow", "file-write*", [b.allow_filter("WRITABLE_ROOT", path)], reason)
        for name in names:  # the other spellings keep the root's name in the rules below
            b.params.ref("WRITABLE_ROOT", name)

    # 2. Write denies that win inside those roots; the secret stores are not writable either.
    b.section("writes denied even inside a writable root (both spellings)")
    write_denied = _unique([*policy.deny_write, *policy.deny_read, *egress_rules])
    b.denies("file-write*", "DENY_WRITE", policy.deny_write)
    write_only = {r.path for r in policy.deny_write}
    b.denies("file-write*", "DENY_READ",
             [r for r in _unique([*policy.deny_read, *egress_rules]) if r.path not in write_only],
             prefix="not writable either: ")
    for index, glob in enumerate(policy.deny_create_globs):
        b.rule(
            "deny",
            "file-write*",
            [f"(regex {b.params.ref('DENY_CREATE_REGEX', _name_regex(glob))})"],
            f"create-time name rule {index}: no such file may be created or changed anywhere",
        )

    # 3. Renames and deletes of a denied path or of any directory above it.
    b.section("renames and deletes: denied paths and every ancestor")
    ancestors: list[str] = []
    for rule in write_denied:
        prefix = rule.path
        if _is_glob(prefix):
            prefix = posixpath.dirname(re.split(r"[*?]", prefix, maxsplit=1)[0] + "x")
            ancestors.append(prefix)
        ancestors.extend(_ancestors(prefix))
    if write_denied:  # never an unfiltered deny: that would refuse every rename
        b.rule(
            "deny",
            "file-write-unlink",
            [b.deny_filter("DENY_WRITE", r.path) for r in write_denied],
            "a denied path may not be renamed or removed",
        )
    unique_ancestors = list(dict.fromkeys(a for a in ancestors if a not in
                                          {r.path for r in write_denied}))
    if unique_ancestors:
        b.rule(
            "deny",
            "file-write-unlink",
            [f"(literal {b.params.ref('ANCESTOR', a)})" for a in unique_ancestors],
            "moving a directory above a denied path would carry it out from under its rule",
        )

    # 4. Reads.
    b.section("reads denied (both spellings)")
    b.denies("file-read*", "DENY_READ", _unique([*policy.deny_read, *egress_rules]))

    # 5. Exec: nothing written in this launch runs, except under the operator's grant roots.
    b.section("exec: blocked from every writable directory, re-opened under execGrantRoots")
    exec_blocked = list(dict.fromkeys(name for _, _, names in roots for name in names))
    if exec_blocked:
        b.rule(
            "deny",
            "process-exec*",
            [b.path_filter("WRITABLE_ROOT", p, subtree=True) for p in exec_blocked],
            "nothing in a writable directory may be executed (it may have been written here)",
        )
    for grant in dict.fromkeys(spellings(g, host.realpath)[-1] for g in policy.exec_grant_roots):
        b.rule("allow", "process-exec*", [b.allow_filter("EXEC_GRANT", grant)],
               "operator-approved tree (execGrantRoots): its programs may run")

    # 6. Network.
    _network(b, command, share_net=share_net)

    text = "\n".join(
        "\n".join(b.lines) if line == GENERATED_MARKER else line.replace(TAG_TOKEN, b.message)
        for line in _base_profile().splitlines()
    ) + "\n"
    return SeatbeltProfile(text=text, params=tuple(b.params.items), tag=session_tag)


def _check_policy(policy: CompiledPolicy) -> None:
    for mount in policy.mounts:
        if mount.guest_path != mount.literal_path:
            raise BadSpec(
                f"bind mount {mount.literal_path!r} asks for guest path {mount.guest_path!r}; "
                "the native sandbox maps host paths 1:1",
                fix="set guestPath equal to hostPath (or omit it)",
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class SeatbeltPlanner:
    """The `native` backend's Planner on macOS: `plan_seatbelt` with this host's facts, the
    sandbox-exec the probe checked and the user's temp dir (`share_net` as there)."""

    host: HostFacts
    sandbox_exec: str
    temp_dir: str | None = None
    share_net: bool = False

    def plan(self, policy: CompiledPolicy, command: Command) -> LaunchPlan:
        """See plan_seatbelt."""
        return plan_seatbelt(
            policy, command, host=self.host, sandbox_exec=self.sandbox_exec,
            temp_dir=self.temp_dir, share_net=self.share_net,
        )


def plan_seatbelt(
    policy: CompiledPolicy,
    command: Command,
    *,
    host: HostFacts,
    sandbox_exec: str = SANDBOX_EXEC_PATH,
    session_tag: str | None = None,
    temp_dir: str | None = None,
    share_net: bool = False,
) -> LaunchPlan:
    """Plan a sandbox-exec launch of `command` under `policy`.

    `sandbox_exec` is the absolute path the probe checked. `session_tag` marks every deny rule so
    the log monitor can attribute denials (default: derived from the session id). `temp_dir` is
    the per-user temp dir (see `darwin_user_temp_dir`), writable when given. `share_net=True`
    leaves the network unrestricted, for the server-hosted terminal's fixed profile only (as in
    plan_bubblewrap); otherwise the command reaches only its egress proxies' TCP ports on the
    shared loopback plus the system resolver, or nothing without an egress bridge.

    Raises:
        BadSpec: the command is empty, a mount asks for another guest path, the tag is malformed.
        EnforcementFailed: sandbox-exec's path is not absolute, the base profile is damaged, or
            the egress bridge carries no usable ports or comes with the network shared.
    """
    if share_net and command.egress is not None:
        raise EnforcementFailed("an egress bridge cannot be planned with the network shared")
    if not command.argv:
        raise BadSpec("the command is empty", fix="pass the program to run after '--'")
    if not posixpath.isabs(sandbox_exec):
        # Called by absolute path only: a sandbox-exec found through PATH could be anything.
        raise EnforcementFailed(
            f"sandbox-exec path {sandbox_exec!r} is not absolute; it must come from the probe"
        )
    if temp_dir is not None and not posixpath.isabs(temp_dir):
        raise EnforcementFailed(f"the per-user temp dir {temp_dir!r} is not absolute")
    _check_policy(policy)
    tag = session_tag if session_tag is not None else session_tag_for(policy.session_id)
    profile = build_profile(policy, command, host=host, session_tag=tag,
                            temp_dir=temp_dir, share_net=share_net)

    argv: list[str] = [sandbox_exec, "-p", profile.text]
    argv += [f"-D{name}={value}" for name, value in profile.params]
    argv += ["--", *command.argv]

    env = dict(command.env)
    env.setdefault("PATH", DEFAULT_PATH)
    env.setdefault("HOME", host.home)
    if temp_dir is not None:
        env.setdefault("TMPDIR", temp_dir)
    egress = command.egress
    if egress is not None and egress.http_port and egress.socks_port:
        env.update(bridge_env(egress.http_port, egress.socks_port))
    return LaunchPlan(
        backend=SandboxBackend.NATIVE,
        argv=tuple(argv),
        env=tuple(sorted(env.items())),
        cwd=command.cwd or policy.default_cwd(host),
        notes=_notes(policy, command, profile, share_net=share_net),
    )


def _notes(
    policy: CompiledPolicy, command: Command, profile: SeatbeltProfile, *, share_net: bool
) -> tuple[str, ...]:
    if share_net:
        network = "network: open (the terminal's fixed profile)"
    elif command.egress is None:
        network = "network: none (no egress bridge for this launch)"
    elif not policy.network_allowed:
        network = "network: proxies only, and they refuse every connection (network disabled)"
    else:
        network = "network: only through the session's HTTP and SOCKS5 proxies (allowlist enforced)"
    return (
        "seatbelt: the kernel's Sandbox policy, applied by sandbox-exec; no kernel boundary",
        network,
        f"violations: denials carry the message {message_for(profile.tag)!r} in the unified log",
    )


def render_seatbelt_plan(plan: LaunchPlan) -> str:
    """Human-readable form of a sandbox-exec plan: the profile as text, its parameters one per
    line, then the command line with the profile shown as $PROFILE.

    Raises:
        ValueError: `plan` is not a sandbox-exec plan (no `-p PROFILE` after the program).
    """
    words = [str(a) for a in plan.argv]
    if len(words) < 4 or words[1] != "-p":
        raise ValueError("not a sandbox-exec plan")
    profile = words[2]
    lines = [f"backend: {plan.backend} (seatbelt)"]
    if plan.cwd is not None:
        lines.append(f"cwd: {plan.cwd}")
    lines.append("env:")
    lines.extend(f"  {k}={shlex.quote(v)}" for k, v in plan.env)
    lines.append("profile:")
    lines.extend(f"  {line}" if line else "" for line in profile.splitlines())
    lines.append("parameters:")
    rest = words[3:]
    end = rest.index("--") if "--" in rest else len(rest)
    lines.extend(f"  {shlex.quote(p[2:])}" for p in rest[:end])
    lines.append("command line (PROFILE is the profile above):")
    lines.append("  " + shlex.join([words[0], "-p"]) + ' "$PROFILE" ' + shlex.join(rest))
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)
