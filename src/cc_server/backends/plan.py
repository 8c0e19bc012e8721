"""LaunchPlan: what to run, computed by a backend's pure `plan()`, executed only by the runner."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Protocol

from cc_server.policy import CompiledPolicy, SandboxBackend

__all__ = [
    "Command",
    "CreateRules",
    "EgressBridge",
    "FdArg",
    "InheritedFd",
    "LaunchPlan",
    "PathFd",
    "Planner",
    "SandboxIdentity",
    "SessionCommand",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class EgressBridge:
    """Where a session's egress proxies answer on the host: a private directory holding the
    Unix sockets `http.sock` and `socks.sock`, which a backend bridges into the sandbox."""

    socket_dir: str
    # The directory holding every session's socket directory (and the server's token): hidden
    # wherever a bind would expose it, so no sandbox reaches another session's proxies.
    base_dir: str | None = None
    # Every host path at which a cc-server base directory of this user is visible (each base,
    # whatever XDG_RUNTIME_DIR or TMPDIR chose it, and each alias of one, such as a bind mount),
    # found by device and inode (rundir.base_dir_views): each is hidden like `base_dir`.
    hidden_dirs: tuple[str, ...] = ()
    # The proxies' TCP ports on 127.0.0.1, when they listen there too: a macOS sandbox shares the
    # host loopback and reaches them directly (Linux goes through the sockets above).
    http_port: int | None = None
    socks_port: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    """What to run: argv, the exact environment it gets, its working directory, and the
    session's egress bridge when its network goes through the proxies."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    egress: EgressBridge | None = None
    # Run it in the session's long-lived sandbox when the backend has one (LaunchPlan.session):
    # the plan then describes that sandbox, and the command goes to it as a request.
    in_session_sandbox: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class FdArg:
    """An argv slot the runner fills with the number of an fd holding `data`.

    The runner materialises `data` in a sealed memfd just before spawning; nothing touches disk.
    """

    name: str
    data: bytes = field(repr=False)

    def __str__(self) -> str:
        return f"<fd:{self.name}>"


@dataclass(frozen=True, slots=True, kw_only=True)
class PathFd:
    """An argv slot the runner fills with the number of an `O_PATH` fd of `path`, opened just
    before spawning with no symlink on the way (a bind's source for `--bind-fd`: swapped for a
    symlink after planning, by a second sandbox whose bind holds it, it must not lead
    elsewhere). A path with a symlink in it, or gone, fails the start."""

    path: str

    def __str__(self) -> str:
        return f"<fd:{self.path}>"


@dataclass(frozen=True, slots=True, kw_only=True)
class InheritedFd:
    """An argv slot the runner fills with the number of an fd its caller passes at spawn (a
    socket, say), looked up by `name`. A plan with such a slot needs a caller that provides it."""

    name: str

    def __str__(self) -> str:
        return f"<fd:{self.name}>"


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateRules:
    """Create-time filename rules a supervisor in the server enforces for this launch.

    The caller of the runner passes one end of a socketpair as `socket`; the launcher inside
    the sandbox sends its seccomp listener over it, and the supervisor (`library`, resolved by
    the probe) answers every trapped call (see backends/supervisor.py).
    """

    globs: tuple[str, ...]
    socket: InheritedFd
    library: str
    # The write policy's path rules (backends/supervisor.py PathRules), as plain tuples.
    patterns: tuple[str, ...] = ()
    roots: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()
    absolute: tuple[str, ...] = ()
    host_sockets: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxIdentity:
    """The unprivileged host identity a root server's sandboxes run as (backends/identity.py).

    `helper` (cc-identity, resolved by the probe) starts bubblewrap as `uid` and `gid` with the
    binds idmapped to their owners; the create-rule supervisor's workers take on the same ids.
    """

    helper: str
    uid: int
    gid: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionCommand:
    """A command for a session sandbox (runtime/session_sandbox.py): the launcher inside, the
    sandbox's PID 1, starts `argv` with exactly `env` in `cwd` when asked over `socket`.

    The plan it belongs to describes the sandbox itself; two execs whose plans are equal can
    share one, since every fact the plan was built from is the same.
    """

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    cwd: str
    socket: InheritedFd


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchPlan:
    """A complete, auditable description of one launch.

    `env` is the exact environment the launched program starts with: the runner passes nothing
    else from the server's environment.
    """

    backend: SandboxBackend
    argv: tuple[str | FdArg | InheritedFd | PathFd, ...]
    env: tuple[tuple[str, str], ...]
    cwd: str | None = None
    notes: tuple[str, ...] = ()
    create_rules: CreateRules | None = None
    # The launcher inside sends the sandbox's two loopback proxy listeners over this socket; the
    # caller must give them to the session's proxies (runtime/handle.py does).
    egress_handoff: InheritedFd | None = None
    # Set when `argv` starts a session sandbox rather than the command: the command itself.
    session: SessionCommand | None = None
    # Set when the sandbox runs as another host identity than the server (a root server's).
    identity: SandboxIdentity | None = None

    def render(self) -> str:
        """Human-readable form: the backend, cwd and env, then one argv word per line (each quoted
        for a shell), the notes, and the session command when there is one."""
        lines = [f"backend: {self.backend}"]
        if self.cwd is not None:
            lines.append(f"cwd: {self.cwd}")
        lines.append("env:")
        lines.extend(f"  {k}={shlex.quote(v)}" for k, v in self.env)
        lines.append("argv:")
        lines.extend(f"  {shlex.quote(str(a))}" for a in self.argv)
        lines.extend(f"note: {n}" for n in self.notes)
        if self.create_rules is not None:
            lines.append(f"create rules: {', '.join(self.create_rules.globs)} (supervised)")
        if self.egress_handoff is not None:
            lines.append("egress: the launcher hands its loopback listeners to the proxies")
        if self.session is not None:
            lines.append("session sandbox: the launcher serves exec requests; this command:")
            lines.append(f"  cwd: {self.session.cwd}")
            lines.extend(f"  env: {k}={shlex.quote(v)}" for k, v in self.session.env)
            lines.extend(f"  argv: {shlex.quote(a)}" for a in self.session.argv)
        return "\n".join(lines)

    def to_json(self) -> dict[str, object]:
        """JSON-ready form for `cc-server plan --json` and the API."""
        out: dict[str, object] = {
            "backend": str(self.backend),
            "argv": [str(a) for a in self.argv],
            "env": dict(self.env),
            "cwd": self.cwd,
            "notes": list(self.notes),
        }
        if self.create_rules is not None:
            out["createRules"] = {"globs": list(self.create_rules.globs), "supervised": True}
        if self.egress_handoff is not None:
            out["egressHandoff"] = True
        if self.session is not None:
            out["session"] = {
                "argv": list(self.session.argv),
                "env": dict(self.session.env),
                "cwd": self.session.cwd,
            }
        return out


class Planner(Protocol):
    """A backend's pure planning step with its host facts and tool paths bound: a small frozen
    object per backend (`NonePlanner`, `BubblewrapPlanner`, `SeatbeltPlanner`), built by
    `runtime.select.planner_for`."""

    def plan(self, policy: CompiledPolicy, command: Command) -> LaunchPlan:
        """What to run for `command` under `policy`; runs nothing.

        Raises:
            CcServerError: the backend refuses the command (see the backend's plan function).
        """
        ...
