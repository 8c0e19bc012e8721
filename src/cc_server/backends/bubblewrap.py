"""Linux `native`: turn a CompiledPolicy and a command into a bubblewrap LaunchPlan.

Pure: reads the host only through HostFacts (what exists, where symlinks point); runs nothing. The
argv is built in the launch order `docs/launch.md` lists, one numbered step per helper below.
"""

from __future__ import annotations

import dataclasses
import functools
import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cc_server.backends.egress_bridge import BRIDGE_DIR, bridge_env, bridged_argv
from cc_server.backends.identity import identity_argv, session_identity
from cc_server.backends.plan import (
    Command,
    CreateRules,
    EgressBridge,
    FdArg,
    InheritedFd,
    LaunchPlan,
    PathFd,
    SandboxIdentity,
    SessionCommand,
)
from cc_server.backends.probe import BubblewrapTools, CreateRuleTools
from cc_server.backends.seccomp import filter_bpf
from cc_server.backends.supervisor import GUEST_LAUNCHER, notify_filter_bpf
from cc_server.errors import BackendUnavailable, BadSpec, EnforcementFailed
from cc_server.policy import CompiledPolicy, HostFacts, Mount, MountKind, SandboxBackend
from cc_server.policy.compiler import innermost_mount
from cc_server.policy.paths import is_within

__all__ = [
    "SANDBOX_HOSTNAME",
    "SYSTEM_RO_PATHS",
    "BubblewrapPlanner",
    "CreateRuleTools",
    "plan_bubblewrap",
    "planned_egress",
    "session_command",
]


SANDBOX_HOSTNAME = "cc-sandbox"

# What a shell and common toolchains need, read-only. Symlinks (merged /usr) are recreated as
# symlinks so the layout matches the host's.
SYSTEM_RO_PATHS: tuple[str, ...] = (
    "/usr",
    "/etc",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
)

# procfs as a floor for every identity, after the OCI runtime's read-only and masked path lists
# (plus /proc/pressure, whose files take triggers, and /proc/kmsg). The sandbox's own procfs
# shows host-global kernel interfaces; a sandbox running as a uid that owns them (host root)
# could otherwise change them. bubblewrap covers /proc/sys only when its directory is writable.
# A read-only entry is bound from the host's procfs: every sysctl there answers for the
# namespaces of the process that opens it, so the sandbox still sees its own network's values.
PROC_READ_ONLY: tuple[str, ...] = (
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/pressure",
    "/proc/sys",
    "/proc/sysrq-trigger",
)
PROC_MASKED: tuple[str, ...] = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/kmsg",
    "/proc/latency_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/timer_list",
    "/proc/timer_stats",
)

DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


def _ancestors_between(root: str, path: str) -> list[str]:
    """Directories strictly between `root` and `path`, outermost first."""
    rel = posixpath.relpath(path, root)
    parts = rel.split("/")[:-1]
    out, cur = [], root
    for part in parts:
        cur = posixpath.join(cur, part)
        out.append(cur)
    return out


_Word = str | FdArg | InheritedFd | PathFd


def _check_policy(policy: CompiledPolicy, create_rules: CreateRuleTools | None) -> None:
    if policy.requires_create_rules and create_rules is None:
        what = ", ".join((*policy.deny_create_globs, *policy.protected_patterns[:3], "..."))
        raise BackendUnavailable(
            f"this policy forbids creating or writing files by name or path pattern ({what}); "
            "bubblewrap alone can shadow existing paths "
            "but cannot refuse a new name inside a writable bind, and this host has no "
            "create-time filename rules (see `cc-server probe`), so the run is refused rather "
            "than started with a weaker policy",
            fix="build the create-rule supervisor with scripts/bootstrap (gcc) on Linux 5.19 or "
            "newer; without it, only CC_SERVER_WRITE_PROTECTION=launch-time (and no "
            "--deny-create) runs, with the launch-time read-only binds alone (names that do "
            "not exist yet and repositories below a bind root are then not protected)",
        )
    for mount in policy.mounts:
        if mount.guest_path != mount.literal_path:
            raise BadSpec(
                f"bind mount {mount.literal_path!r} asks for guest path {mount.guest_path!r}; "
                "the native sandbox maps host paths 1:1",
                fix="set guestPath equal to hostPath (or omit it)",
            )
        if "\n" in mount.host_path or "\x00" in mount.host_path:
            raise BadSpec(f"bind mount path {mount.host_path!r} contains a control character")
        if mount.literal_path != mount.host_path:
            # Resolved through a symlink. One inside a writable bind may have been left there by
            # a command, to pick what the next launch binds (a root-only host directory).
            for outer in policy.mounts:
                if outer is not mount and outer.writable and (
                    is_within(mount.literal_path, outer.literal_path)
                    or is_within(mount.literal_path, outer.host_path)
                ):
                    raise EnforcementFailed(
                        f"bind mount {mount.literal_path!r} resolves through a symlink inside "
                        f"the writable bind {outer.literal_path!r} (to {mount.host_path!r}); a "
                        "command there may have made it, so the launch is refused",
                        fix="remove the symlink, or name the bind by its real path",
                    )


def _step_namespaces(*, new_session: bool, share_net: bool, identity: bool) -> list[str | FdArg]:
    # 1. Namespaces and process hygiene: every namespace, no capabilities, no nested user
    #    namespaces, a new session (no TIOCSTI into the caller's terminal), die with the server.
    #    Only the terminal profile keeps the host network and the PTY session (plan_bubblewrap).
    #    Under a sandbox identity (a root server) the command is still uid 0 inside.
    return [
        "--unshare-user",
        *(("--uid", "0", "--gid", "0") if identity else ()),
        "--unshare-pid",
        *(() if share_net else ("--unshare-net",)),
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--disable-userns",
        "--hostname",
        SANDBOX_HOSTNAME,
        "--die-with-parent",
        *(("--new-session",) if new_session else ()),
        "--cap-drop",
        "ALL",
    ]


def _step_system(host: HostFacts) -> list[str | FdArg]:
    # 2. System runtime paths read-only, fresh /proc (its host-global knobs read-only or masked)
    #    and /dev, private /tmp and /var/tmp.
    args: list[str | FdArg] = []
    for path in SYSTEM_RO_PATHS:
        if not host.exists(path):
            continue
        target = host.realpath(path)
        if target != path and posixpath.dirname(target) == "/usr":
            args += ["--symlink", posixpath.relpath(target, "/"), path]
        else:
            args += ["--ro-bind", path, path]
    args += ["--proc", "/proc"]
    for path in PROC_READ_ONLY:
        if host.exists(path):
            args += ["--ro-bind", path, path]
    for path in PROC_MASKED:
        if not host.exists(path):
            continue
        if host.is_dir(path):
            args += ["--tmpfs", path, "--remount-ro", path]
        else:
            args += ["--ro-bind", "/dev/null", path]
    args += ["--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp"]
    return args


def _step_home(host: HostFacts, mounts: Sequence[Mount]) -> list[str | FdArg]:
    # 3. An empty, throw-away $HOME unless a bind makes the real one visible.
    home = host.home
    if home == "/" or any(is_within(home, m.host_path) for m in mounts):
        return []
    return ["--tmpfs", home]


def _step_binds(host: HostFacts, mounts: Sequence[Mount], *, by_fd: bool) -> list[_Word]:
    # 4. The spec's bind mounts, shallowest first so a deeper bind lands on top of its parent.
    #    `by_fd`: each source is opened by the runner with no symlink on the way and bound by fd,
    #    so a source swapped for a symlink after planning (by a second sandbox whose bind holds
    #    it) fails the start instead of binding where it leads. (A root server's identity helper
    #    opens each root the same way itself.)
    args: list[_Word] = []
    for mount in sorted(mounts, key=lambda m: m.host_path.count("/")):
        if by_fd:
            flag = "--bind-fd" if mount.writable else "--ro-bind-fd"
            args += [flag, PathFd(path=mount.host_path), mount.host_path]
        else:
            args += ["--bind" if mount.writable else "--ro-bind", mount.host_path, mount.host_path]
        if mount.literal_path != mount.host_path:
            args += ["--symlink", mount.host_path, mount.literal_path]
    return args


def _pin_ancestors(
    root: Mount, path: str, pinned: set[str], read_only: set[str]
) -> list[str | FdArg]:
    """Self-bind each directory between a writable root and a rule's path.

    A mount point cannot be renamed or removed (EBUSY), so `mv parent elsewhere; mkdir parent`
    cannot move a denied path out from under its rule while the parent stays writable.
    Directories already made read-only need no pin, and a writable self-bind would undo that.
    """
    args: list[str | FdArg] = []
    for ancestor in _ancestors_between(root.host_path, path):
        if ancestor not in pinned and not any(is_within(ancestor, r) for r in read_only):
            pinned.add(ancestor)
            args += ["--bind", ancestor, ancestor]
    return args


def _step_deny_write(
    host: HostFacts, policy: CompiledPolicy, pinned: set[str], read_only: set[str]
) -> list[str | FdArg]:
    # 5. Protected paths and mandatory denies read-only, even inside a writable bind.
    args: list[str | FdArg] = []
    done: set[str] = set()
    for rule in policy.deny_write:
        if not host.exists(rule.path):
            continue
        target = host.realpath(rule.path)
        if target in done or not host.exists(target):
            # A dangling symlink: its target does not exist, so there is nothing to mount over
            # (mounting would create a stub on the host). Same limit as a missing name.
            continue
        done.add(target)
        mount = innermost_mount(policy.mounts, target)
        if mount is not None and mount.writable:
            args += _pin_ancestors(mount, target, pinned, read_only)
            args += ["--ro-bind", target, target]  # also covers every bind below it
            read_only.add(target)
            continue
        # Not writable from above, but a writable bind below it (protectedPaths: [/repo] with
        # /repo/src bound) would be: re-bind each such bind read-only.
        for inner in policy.mounts:
            if inner.writable and is_within(inner.host_path, target):
                args += ["--ro-bind", inner.host_path, inner.host_path]
                read_only.add(inner.host_path)
    return args


def _step_deny_read(
    host: HostFacts, policy: CompiledPolicy, pinned: set[str], read_only: set[str]
) -> list[str | FdArg]:
    # 6. Secrets masked wherever a bind or a system path would expose them. Directories get an
    #    empty read-only tmpfs, files an empty read-only file. Masks come last so they win.
    args: list[str | FdArg] = []
    done: set[str] = set()
    system = [Mount(host_path=p, literal_path=p, guest_path=p, writable=False, reason="system",
                    kind=MountKind.SYSTEM)
              for p in SYSTEM_RO_PATHS]
    for rule in policy.deny_read:
        if not host.exists(rule.path):
            continue
        target = host.realpath(rule.path)
        if target in done or not host.exists(target):
            # A dangling symlink: its target does not exist, so there is nothing to mount over
            # (mounting would create a stub on the host). Same limit as a missing name.
            continue
        mount = innermost_mount([*policy.mounts, *system], target)
        # A bind at or below the secret (bindMounts: ~/.ssh/keys) exposes it even when nothing
        # above it is visible; the mask on the secret itself hides those binds too.
        if mount is None and not any(is_within(m.host_path, target) for m in policy.mounts):
            continue
        done.add(target)
        if mount is not None and mount.writable:
            args += _pin_ancestors(mount, target, pinned, read_only)
        if host.is_dir(target):
            args += ["--tmpfs", target, "--remount-ro", target]
        else:
            args += ["--ro-bind", "/dev/null", target]
    return args


def _hide_base_dirs(policy: CompiledPolicy, egress: EgressBridge) -> list[_Word]:
    """An empty read-only tmpfs on each base directory view a bind (or a system path) would
    show, so no sandbox reaches the token, the CLI daemon or another session's sockets. The
    views come from the caller, found by device and inode (rundir.base_dir_views); a bind the
    spec asks for inside a view (a run's credential directory) is bound again on top."""
    views = {*egress.hidden_dirs, *((egress.base_dir,) if egress.base_dir else ())}
    return list(_hiding_args(tuple(sorted(views)), policy.mounts))


def planned_egress(policy: CompiledPolicy, egress: EgressBridge | None) -> object:
    """What a plan under `policy` takes of `egress`: two bridges with equal answers give equal
    plans, all else equal. Its hidden directories count only as the words that hide those a
    bind or a system path would show (`_hide_base_dirs`), the rest of it as it is."""
    if egress is None:
        return None
    return dataclasses.replace(egress, hidden_dirs=()), tuple(_hide_base_dirs(policy, egress))


@functools.lru_cache(maxsize=64)
def _hiding_args(views: tuple[str, ...], mounts: tuple[Mount, ...]) -> tuple[str, ...]:
    """The words `_hide_base_dirs` plans for these views and mounts. Reads nothing, so it is
    cached: a session's plan is made again for every command, mostly from the same two."""
    roots = [m.host_path for m in mounts] + list(SYSTEM_RO_PATHS)
    args: list[str] = []
    for view in views:
        if not any(is_within(view, root) or is_within(root, view) for root in roots):
            continue
        args += ["--tmpfs", view]
        for mount in sorted(mounts, key=lambda m: m.host_path.count("/")):
            if mount.host_path != view and is_within(mount.host_path, view):
                flag = "--bind" if mount.writable else "--ro-bind"
                args += [flag, mount.host_path, mount.host_path]
        args += ["--remount-ro", view]
    return tuple(args)


def _step_egress(
    policy: CompiledPolicy, command: Command, socat: str | None, launcher: bool
) -> tuple[list[_Word], tuple[str, ...]]:
    # 7. The session's proxies, the only way out of the sandbox's empty network namespace.
    #    With the launcher (7b) it listens on the sandbox's loopback before the command runs and
    #    hands both listeners to the proxies: nothing else is bound in. Without it, the proxies'
    #    sockets are bound read-only and two socat listeners bridge to them, up before the
    #    command runs. No egress: no network at all.
    #    Every view of every cc-server base directory (EgressBridge.hidden_dirs) is hidden
    #    wherever a bind or a system path would expose it (_hide_base_dirs).
    if command.egress is None:
        return [], command.argv
    bind: list[_Word] = _hide_base_dirs(policy, command.egress)
    if launcher:
        return bind, command.argv
    if socat is None or not posixpath.isabs(socat):
        raise EnforcementFailed(
            "the egress bridge needs socat, resolved by the probe",
            fix="install socat (apt-get install socat)",
        )
    bind += ["--ro-bind", command.egress.socket_dir, BRIDGE_DIR]
    return bind, bridged_argv(socat, command.argv)


def _step_launcher(
    policy: CompiledPolicy,
    tools: CreateRuleTools | None,
    argv: tuple[str, ...],
    egress: bool,
    serve: InheritedFd | None = None,
) -> tuple[list[_Word], tuple[_Word, ...], CreateRules | None, InheritedFd | None]:
    # 7b. The launcher, bound read-only, runs before the command. With egress it hands the
    #     sandbox's loopback listeners to the proxies. With create-time filename rules it runs as
    #     the sandbox's PID 1 (so no process inside lacks the filter), installs the create-rule
    #     filter, sends its listener to the server's supervisor and only then runs the command.
    #     For a session sandbox (`serve`) it is PID 1 and starts each command on request, after
    #     the handoff and the filter.
    rules_needed = policy.requires_create_rules
    if tools is None or not (rules_needed or egress):
        return [], argv, None, None
    for path in (tools.launcher, tools.library):
        if not posixpath.isabs(path):
            raise EnforcementFailed(f"{path!r} is not absolute; it must come from the probe")
    bind: list[_Word] = ["--ro-bind", tools.launcher, GUEST_LAUNCHER]
    wrapped: list[_Word] = [GUEST_LAUNCHER]
    handoff = None
    if egress:
        handoff = InheritedFd(name="egress.sock")
        wrapped += ["--egress", handoff]
    rules = None
    if rules_needed:
        try:
            bpf = notify_filter_bpf(
                writes=bool(policy.protected_patterns or policy.protected_absolute)
            )
        except OSError as exc:
            raise EnforcementFailed(
                f"could not build the create-rule filter: {exc}",
                fix="install libseccomp2 (apt-get install libseccomp2)",
            ) from exc
        sock = InheritedFd(name="create-rules.sock")
        bind = ["--as-pid-1", *bind]
        wrapped += ["--filter", FdArg(name="create-rules.bpf", data=bpf), "--socket", sock]
        roots = {m.host_path: None for m in policy.mounts if m.writable}
        rules = CreateRules(
            globs=policy.deny_create_globs, socket=sock, library=tools.library,
            patterns=policy.protected_patterns, roots=tuple(roots),
            exempt=policy.exempt_roots, absolute=policy.protected_absolute,
            host_sockets=policy.host_socket_dirs,
        )  # fmt: skip
    if serve is not None:
        pid_1 = [] if rules is not None else ["--as-pid-1"]  # with rules it is there already
        return [*pid_1, *bind], (*wrapped, "--serve", serve), rules, handoff
    return bind, (*wrapped, "--", *argv), rules, handoff


def _step_identity(
    argv: list[_Word],
    identity: SandboxIdentity | None,
    roots: Sequence[str],
    realpath: Callable[[str], str],
) -> list[_Word]:
    # 0. A root server's sandbox runs as its sandbox identity (backends/identity.py): the helper
    #    stages each root below idmapped at STAGE_DIR/<n>, drops to the identity and runs bwrap,
    #    whose binds then take their sources from there. Everything else bwrap reads (system
    #    paths, /dev/null, /proc) is readable by any uid.
    if identity is None:
        return argv
    if not posixpath.isabs(identity.helper):
        raise EnforcementFailed(f"{identity.helper!r} is not absolute; it must come from the probe")
    return identity_argv(argv, identity, roots, realpath)


@dataclass(frozen=True, slots=True, kw_only=True)
class BubblewrapPlanner:
    """The `native` backend's Planner on Linux and WSL2: `plan_bubblewrap` with this host's
    facts and the tools the probe resolved (`new_session` and `share_net` as there)."""

    host: HostFacts
    tools: BubblewrapTools
    identity: SandboxIdentity | None = None  # a root server's sandbox identity
    new_session: bool = True
    share_net: bool = False

    def plan(self, policy: CompiledPolicy, command: Command) -> LaunchPlan:
        """See plan_bubblewrap."""
        return plan_bubblewrap(
            policy, command, host=self.host, bwrap=self.tools.bwrap, socat=self.tools.socat,
            new_session=self.new_session, share_net=self.share_net,
            create_rules=self.tools.create_rules, identity=self.identity,
        )


def plan_bubblewrap(
    policy: CompiledPolicy,
    command: Command,
    *,
    host: HostFacts,
    bwrap: str,
    socat: str | None = None,
    new_session: bool = True,
    share_net: bool = False,
    create_rules: CreateRuleTools | None = None,
    identity: SandboxIdentity | None = None,
) -> LaunchPlan:
    """Plan a bubblewrap launch of `command` under `policy`.

    `bwrap` and `socat` are the absolute paths the probe resolved. `create_rules` (the probe's
    launcher and supervisor) is needed when the policy has create-time globs; the plan then says
    so in `LaunchPlan.create_rules`, and its caller must run the supervisor. With it, a command
    with egress gets its loopback listeners from the launcher (`LaunchPlan.egress_handoff`; the
    caller gives them to the session's proxies); without it, socat bridges to the proxies'
    sockets and is needed then. runtime/handle.py does both.

    A command with `in_session_sandbox` gets, when it can (the launcher is there, the command has
    egress, the default profile), the plan of a session sandbox instead: the same steps, with
    the launcher as PID 1 serving exec requests in place of the command (`--serve`, chdir `/`,
    only `PATH` in its environment; with create-time globs it installs their filter first, so
    every command carries it), and the command itself, its full environment and its working
    directory in `LaunchPlan.session` (runtime/session_sandbox.py).

    Two switches exist for the server-hosted terminal's fixed profile only (terminal.profile):
    `new_session=False` omits `--new-session`, so the shell keeps the PTY it was started on as its
    controlling terminal (safe there: the PTY is private to the session, so TIOCSTI could only
    reach that PTY, and the seccomp filter refuses TIOCSTI anyway); `share_net=True` keeps the
    host's network namespace instead of the egress bridge (the profile's network is open).

    A root server (`host.server_is_root`) needs `identity` (the probe's cc-identity): the plan
    then starts bubblewrap through it, as an unprivileged host uid, with every bind idmapped to
    its owner (step 0, backends/identity.py), and says so in `LaunchPlan.identity`.

    Raises:
        BackendUnavailable: the policy needs create-time filename rules and `create_rules` is
            None (this host has no supervisor for them), or the server is root and `identity`
            is None.
        BadSpec: a mount asks for a guest path other than its host path, or a command is empty.
        EnforcementFailed: a seccomp filter could not be built, socat is missing for the
            egress bridge, or an egress bridge was asked for with the host network shared.
    """
    if share_net and command.egress is not None:
        raise EnforcementFailed("an egress bridge cannot be planned with the host network shared")
    if not command.argv:
        raise BadSpec("the command is empty", fix="pass the program to run after '--'")
    if not posixpath.isabs(bwrap):
        raise EnforcementFailed(
            f"bwrap path {bwrap!r} is not absolute; it must come from the probe"
        )
    _check_policy(policy, create_rules)
    if not host.server_is_root:
        identity = None
    elif identity is None:
        raise BackendUnavailable(
            "the server runs as root, and a sandbox it started would be host uid 0, which owns "
            "host-global kernel settings; this host has no sandbox identity (see "
            "`cc-server probe`), so the run is refused",
            fix="build cc-identity with scripts/bootstrap, or run the server as a non-root user",
        )
    else:
        identity = session_identity(identity, policy.session_id)
    try:
        bpf = filter_bpf()
    except OSError as exc:
        raise EnforcementFailed(
            f"could not build the seccomp filter: {exc}",
            fix="install libseccomp2 (apt-get install libseccomp2)",
        ) from exc

    pinned: set[str] = {m.host_path for m in policy.mounts}
    read_only: set[str] = set()  # made read-only by step 5; pins must not re-open them
    cwd = command.cwd or policy.default_cwd(host)
    serve = (
        InheritedFd(name="session.sock")
        if command.in_session_sandbox
        and create_rules is not None
        and command.egress is not None
        and new_session
        and not share_net
        else None
    )
    argv: list[_Word] = [bwrap]
    argv += _step_namespaces(
        new_session=new_session, share_net=share_net, identity=identity is not None
    )
    argv += _step_system(host)
    argv += _step_home(host, policy.mounts)
    argv += _step_binds(host, policy.mounts, by_fd=identity is None)
    argv += _step_deny_write(host, policy, pinned, read_only)
    argv += _step_deny_read(host, policy, pinned, read_only)
    bridge_args, bridged = _step_egress(policy, command, socat, create_rules is not None)
    argv += bridge_args
    launcher_args, inner_argv, rules, handoff = _step_launcher(
        policy, create_rules, bridged, command.egress is not None, serve
    )
    argv += launcher_args
    # 8. Everything not explicitly writable above is read-only, including the sandbox's root.
    argv += ["--remount-ro", "/"]
    # 9. Working directory, then the seccomp filter (bwrap loads it last, right before exec).
    argv += ["--chdir", "/" if serve else cwd, "--seccomp", FdArg(name="seccomp.bpf", data=bpf)]
    argv += ["--", *inner_argv]
    roots = [m.host_path for m in sorted(policy.mounts, key=lambda m: m.host_path.count("/"))]
    if create_rules is not None and launcher_args:
        roots.append(host.realpath(create_rules.launcher))  # the helper refuses a symlink
    if command.egress is not None and BRIDGE_DIR in argv:
        roots.append(host.realpath(command.egress.socket_dir))
    argv = _step_identity(argv, identity, roots, host.realpath)

    env = _command_env(command, host.home)
    session = None
    if serve is not None:
        session = session_command(command, cwd, host.home, serve)
        env = {"PATH": DEFAULT_PATH}
    return LaunchPlan(
        backend=SandboxBackend.NATIVE,
        argv=tuple(argv),
        env=tuple(sorted(env.items())),
        cwd=None,
        notes=(
            ("network: open (the host's network namespace; terminal profile)",)
            if share_net
            else _notes(policy, command)
        )
        + (
            (f"create-time names refused: {', '.join(rules.globs)} (seccomp supervisor)",)
            if rules is not None and rules.globs
            else ()
        )
        + (
            (f"protected at any depth of a writable bind: {', '.join(rules.patterns)} "
             "(seccomp supervisor)",)
            if rules is not None and rules.patterns
            else ()
        )
        + (
            (f"host identity: uid {identity.uid} gid {identity.gid}, not the server's root; "
             "binds idmapped to their owners",)
            if identity is not None
            else ()
        ),
        create_rules=rules,
        egress_handoff=handoff,
        session=session,
        identity=identity,
    )


def _command_env(command: Command, home: str) -> dict[str, str]:
    """The environment `command` runs with: its own, PATH and HOME when it sets none, and the
    proxy variables when it has egress."""
    env = dict(command.env)
    env.setdefault("PATH", DEFAULT_PATH)
    env.setdefault("HOME", home)
    if command.egress is not None:
        env.update(bridge_env())
    return env


def session_command(command: Command, cwd: str, home: str, serve: InheritedFd) -> SessionCommand:
    """`command` as a session sandbox's launcher is asked to run it."""
    env = _command_env(command, home)
    env["PWD"] = cwd  # what bwrap's --chdir sets for a command it starts itself
    return SessionCommand(argv=command.argv, env=tuple(sorted(env.items())), cwd=cwd, socket=serve)


def _notes(policy: CompiledPolicy, command: Command) -> tuple[str, ...]:
    if command.egress is None:
        return ("network: none (no egress bridge for this launch)",)
    if not policy.network_allowed:
        return ("network: proxies only, and they refuse every connection (network disabled)",)
    return ("network: only through the session's HTTP and SOCKS5 proxies (allowlist enforced)",)

