"""The boot-time probe: which native sandbox this host offers, and if none, what would fix that.

Three tiers, as elsewhere: `ProbeFacts` is everything learned from the host (the only I/O, and
injectable), `probe()` turns facts into a `ProbeResult` and touches nothing, and `boot_probe()`
runs it once for the server. `startup_line()` renders the one line the server logs at boot.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING

from cc_server.backends.identity import IDENTITY_TOOL, IdentityCheck, check_identity
from cc_server.policy.host import Platform, detect_platform

if TYPE_CHECKING:
    from cc_server.backends.supervisor import CreateRulesCheck

__all__ = [
    "BUBBLEWRAP_NOTE",
    "CREATE_LAUNCHER_TOOL",
    "CREATE_SUPERVISOR_TOOL",
    "NOT_OFFERED_HINT",
    "SANDBOX_EXEC_PATH",
    "SEATBELT_NOTE",
    "SELFTEST_TIMEOUT_S",
    "BubblewrapTools",
    "CreateRuleTools",
    "Mechanism",
    "ProbeFacts",
    "ProbeResult",
    "SeatbeltTools",
    "SelftestResult",
    "boot_probe",
    "probe",
    "run_bwrap_selftest",
    "selftest_argv",
    "startup_line",
]

# Checked by absolute path, never through PATH: a `sandbox-exec` earlier on PATH could be anything.
SANDBOX_EXEC_PATH = "/usr/bin/sandbox-exec"

# Generous for one `bwrap ... /bin/true` (milliseconds normally); a hung bwrap must not hang boot.
SELFTEST_TIMEOUT_S = 10.0

CREATE_LAUNCHER_TOOL = "cc-create-launcher"  # probe tools key: the launcher's absolute path
CREATE_SUPERVISOR_TOOL = "cc-create-supervisor"  # probe tools key: the supervisor library's
SEATBELT_NOTE = "sandbox-exec (Seatbelt) — namespace isolation, no kernel boundary"
BUBBLEWRAP_NOTE = "bubblewrap — namespace isolation, no kernel boundary"
NOT_OFFERED_HINT = "Native sandbox is not offered on this platform"

# Tool -> the Debian/Ubuntu package that ships it, in the order hints name them.
_LINUX_PACKAGES: tuple[tuple[str, str], ...] = (("bwrap", "bubblewrap"), ("socat", "socat"))

# Host settings that explain a failed selftest, reported after bwrap's stderr as `name = value`.
_SYSCTLS = (
    "kernel.apparmor_restrict_unprivileged_userns",
    "kernel.unprivileged_userns_clone",
    "user.max_user_namespaces",
)
_EVIDENCE_MARK = "[host: "


class Mechanism(StrEnum):
    """The OS-native sandbox a host offers (the `native` backend's two kinds)."""

    BUBBLEWRAP = "bubblewrap"  # Linux and WSL2: namespaces (backends/bubblewrap.py)
    SEATBELT = "seatbelt"  # macOS: a sandbox-exec profile (backends/seatbelt.py)


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateRuleTools:
    """The create-rule supervisor's two pieces, as the probe resolved them (absolute paths)."""

    launcher: str
    """Runs inside the sandbox before the command: installs the filter, hands over its listener."""
    library: str
    """The supervisor the server loads to answer the listener (see backends/supervisor.py)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BubblewrapTools:
    """What a bubblewrap launch runs, as the probe resolved it (absolute paths)."""

    bwrap: str
    socat: str | None = None  # bridges the session's proxies into the sandbox's network
    create_rules: CreateRuleTools | None = None  # when this kernel runs the supervisor
    identity: str | None = None  # cc-identity, when the server runs as root


@dataclass(frozen=True, slots=True, kw_only=True)
class SeatbeltTools:
    """What a Seatbelt launch runs, as the probe checked it (an absolute path)."""

    sandbox_exec: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SelftestResult:
    """The outcome of running bwrap once."""

    ok: bool
    detail: str
    """Why it failed (bwrap's stderr, then host settings that explain it); "" when ok."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeFacts:
    """Everything the probe learns from the host; tests pass fakes."""

    platform: Platform
    which: Callable[[str], str | None] = field(compare=False)
    """Like `shutil.which`: an absolute path or None. Non-absolute answers are ignored."""
    is_file: Callable[[str], bool] = field(compare=False)
    """Whether an absolute path is a regular file (used for /usr/bin/sandbox-exec)."""
    selftest: Callable[[str], SelftestResult] = field(compare=False)
    """Runs the bwrap at the given absolute path once; see `run_bwrap_selftest`."""
    create_rules: Callable[[], CreateRulesCheck] = field(
        default=lambda: _create_rules_not_checked(), compare=False
    )
    """Whether the create-rule supervisor is built and the kernel can run it (Linux); see
    `supervisor.check_create_rules`. The default reports it absent."""
    identity: Callable[[], IdentityCheck] = field(
        default=lambda: IdentityCheck(needed=False), compare=False
    )
    """Whether the server needs a sandbox identity (it runs as root) and has one that works
    (Linux); see `identity.check_identity`. The default: not needed."""

    @classmethod
    def current(cls) -> ProbeFacts:
        """Facts of the running host; nothing is run until `probe()` asks. Raises nothing."""
        return cls(
            platform=detect_platform(),
            which=_which_absolute,
            is_file=os.path.isfile,
            selftest=run_bwrap_selftest,
            create_rules=_check_create_rules,
            identity=check_identity,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeResult:
    """What the probe found: a backend with its caveat (`note`), or none and a fix (`hint`)."""

    platform: Platform
    available: bool
    mechanism: Mechanism | None = None
    """Set when available (a string naming one is taken as that Mechanism)."""
    note: str | None = None
    """Set when available: what the mechanism does and does not isolate."""
    hint: str | None = None
    """Set when not available: why, and the command or setting that would fix it."""
    requires_install: bool = False
    missing_packages: tuple[str, ...] = ()
    """Debian/Ubuntu package names to install, in the order the hint names them."""
    tools: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Tool name -> absolute path, for every tool the probe found. Read-only."""
    create_rules: bool = False
    """Linux: create-time filename rules can be enforced (the seccomp user-notification
    supervisor is built and this kernel runs it); tools then has `cc-create-launcher` and
    `cc-create-supervisor`. Without it a policy with create-time globs is refused."""
    create_rules_hint: str | None = None
    """Linux with bubblewrap: why create-time rules are not available, and the fix."""

    def __post_init__(self) -> None:
        # A read-only copy, so a caller's dict cannot change a frozen result afterwards.
        object.__setattr__(self, "tools", MappingProxyType(dict(self.tools)))
        if self.mechanism is not None:  # an unknown name fails here, not at the first launch
            object.__setattr__(self, "mechanism", Mechanism(self.mechanism))

    @property
    def bubblewrap(self) -> BubblewrapTools | None:
        """The tools of a bubblewrap launch when that is the mechanism, else None. The
        create-rule supervisor is in only when the probe found it runs on this kernel."""
        if self.mechanism is not Mechanism.BUBBLEWRAP:
            return None
        launcher = self.tools.get(CREATE_LAUNCHER_TOOL)
        library = self.tools.get(CREATE_SUPERVISOR_TOOL)
        return BubblewrapTools(
            bwrap=self.tools["bwrap"],
            socat=self.tools.get("socat"),
            create_rules=CreateRuleTools(launcher=launcher, library=library)
            if self.create_rules and launcher is not None and library is not None
            else None,
            identity=self.tools.get(IDENTITY_TOOL),
        )

    @property
    def seatbelt(self) -> SeatbeltTools | None:
        """The tools of a Seatbelt launch when that is the mechanism, else None."""
        if self.mechanism is not Mechanism.SEATBELT:
            return None
        return SeatbeltTools(sandbox_exec=self.tools["sandbox-exec"])

    def to_json(self) -> dict[str, object]:
        """JSON-ready form with camelCase keys. Raises nothing."""
        return {
            "platform": str(self.platform),
            "available": self.available,
            "mechanism": None if self.mechanism is None else str(self.mechanism),
            "note": self.note,
            "hint": self.hint,
            "requiresInstall": self.requires_install,
            "missingPackages": list(self.missing_packages),
            "tools": dict(self.tools),
            "createRules": self.create_rules,
            "createRulesHint": self.create_rules_hint,
        }


def probe(facts: ProbeFacts | None = None) -> ProbeResult:
    """Decide which native sandbox the host offers, from `facts` (default: this host's).

    Raises nothing: every failure, including a fact source that raises, becomes an unavailable
    result whose hint says why. It never falls back to "unsandboxed but available".
    """
    facts = ProbeFacts.current() if facts is None else facts
    try:
        return _probe(facts)
    except Exception as exc:  # the promise is "raises nothing"; fail closed with the reason
        return ProbeResult(
            platform=facts.platform,
            available=False,
            hint=f"the sandbox probe failed: {exc!r}",
        )


_boot_result: ProbeResult | None = None


def boot_probe() -> ProbeResult:
    """The probe of this host, run on the first call and remembered for the process's lifetime.

    Raises nothing (see `probe`).
    """
    global _boot_result
    if _boot_result is None:
        _boot_result = probe(ProbeFacts.current())
    return _boot_result


def startup_line(result: ProbeResult | None, sandbox_flag_on: bool) -> str:
    """The one line the server logs at boot about the agent sandbox.

    `result` may be None only when the flag is off. Raises ValueError if the flag is on and
    there is no result.
    """
    if not sandbox_flag_on:
        return "agent sandbox DISABLED by --sandbox off"
    if result is None:
        raise ValueError("startup_line needs a probe result when --sandbox is on")
    if result.available:
        return f"agent sandbox ON ({result.note})"
    return f"no OS-native agent sandbox on this host ({result.hint})"


def selftest_argv(bwrap: str, *, with_lib64: bool) -> tuple[str, ...]:
    """The selftest command: every namespace the Linux backend uses, around `/bin/true`.

    `with_lib64` adds the /lib64 symlink; hosts without /lib64 (often arm64) must not get it.
    Raises nothing.
    """
    lib64 = ("--symlink", "usr/lib64", "/lib64") if with_lib64 else ()
    return (
        bwrap,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--die-with-parent",
        "--new-session",
        "--cap-drop", "ALL",
        "--disable-userns",
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/bin", "/bin",
        "--symlink", "usr/lib", "/lib",
        *lib64,
        "--proc", "/proc",
        "--dev", "/dev",
        "--",
        "/bin/true",
    )  # fmt: skip


def run_bwrap_selftest(
    bwrap: str, *, timeout_s: float = SELFTEST_TIMEOUT_S, proc_root: str = "/proc"
) -> SelftestResult:
    """Run `selftest_argv(bwrap)` once with an empty environment.

    On failure the detail is bwrap's stderr (or the exit status, timeout or OSError), followed
    by the host settings under `proc_root` that explain namespace failures. Raises nothing.
    """
    argv = selftest_argv(bwrap, with_lib64=os.path.exists("/lib64"))
    try:
        done = subprocess.run(
            argv,
            env={},
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        reason = f"bwrap selftest timed out after {timeout_s:g} s"
    except OSError as exc:
        reason = f"could not run {bwrap}: {exc}"
    else:
        if done.returncode == 0:
            return SelftestResult(ok=True, detail="")
        stderr = done.stderr.decode(errors="replace").strip()
        reason = stderr or f"bwrap exited with status {done.returncode}"
    evidence = _host_evidence(proc_root)
    return SelftestResult(
        ok=False, detail=f"{reason} {_EVIDENCE_MARK}{evidence}]" if evidence else reason
    )


# --- the pure decision ---------------------------------------------------------------------------


def _probe(facts: ProbeFacts) -> ProbeResult:
    if facts.platform is Platform.MACOS:
        return _probe_macos(facts)
    if facts.platform in (Platform.LINUX, Platform.WSL2):
        return _probe_linux(facts)
    return ProbeResult(platform=facts.platform, available=False, hint=NOT_OFFERED_HINT)


def _probe_macos(facts: ProbeFacts) -> ProbeResult:
    if facts.is_file(SANDBOX_EXEC_PATH):
        return ProbeResult(
            platform=facts.platform,
            available=True,
            mechanism=Mechanism.SEATBELT,
            note=SEATBELT_NOTE,
            tools={"sandbox-exec": SANDBOX_EXEC_PATH},
        )
    return ProbeResult(
        platform=facts.platform,
        available=False,
        hint=(
            f"{SANDBOX_EXEC_PATH} is missing; it ships with every macOS install, "
            "so this system is damaged or locked down"
        ),
    )


def _probe_linux(facts: ProbeFacts) -> ProbeResult:
    # Only absolute paths are kept: the backend later execs exactly these, and a relative
    # answer (from a relative PATH entry) would name a different file from another cwd.
    found: dict[str, str] = {}
    missing: list[str] = []
    ignored: list[str] = []
    for tool, package in _LINUX_PACKAGES:
        path = facts.which(tool)
        if path is not None and os.path.isabs(path):
            found[tool] = path
            continue
        missing.append(package)
        if path is not None:
            ignored.append(f"{tool} at non-absolute {path!r}")
    if missing:
        hint = f"install {' and '.join(missing)}: sudo apt-get install {' '.join(missing)}"
        if ignored:
            hint += f" (ignored {', '.join(ignored)}: a relative PATH entry)"
        return ProbeResult(
            platform=facts.platform,
            available=False,
            hint=hint,
            requires_install=True,
            missing_packages=tuple(missing),
            tools=found,
        )
    bwrap = found["bwrap"]
    selftest = facts.selftest(bwrap)
    if selftest.ok:
        identity = facts.identity()
        if identity.needed and not (identity.available and identity.helper):
            return ProbeResult(
                platform=facts.platform,
                available=False,
                hint=identity.hint or "the server runs as root and has no sandbox identity",
                tools=found,
            )
        if identity.helper:
            found[IDENTITY_TOOL] = identity.helper
        rules = facts.create_rules()
        if rules.available and rules.launcher and rules.library:
            found[CREATE_LAUNCHER_TOOL] = rules.launcher
            found[CREATE_SUPERVISOR_TOOL] = rules.library
        return ProbeResult(
            platform=facts.platform,
            available=True,
            mechanism=Mechanism.BUBBLEWRAP,
            note=BUBBLEWRAP_NOTE,
            tools=found,
            create_rules=rules.available,
            create_rules_hint=rules.hint,
        )
    return ProbeResult(
        platform=facts.platform,
        available=False,
        hint=_selftest_hint(bwrap, selftest.detail),
        tools=found,
    )


# Host settings as `run_bwrap_selftest` reports them. bwrap's own EPERM message quotes
# "kernel.unprivileged_userns_clone=1" (no spaces, value 1), which these do not match.
_APPARMOR_RESTRICTS = re.compile(r"kernel\.apparmor_restrict_unprivileged_userns = [1-9]")
_CLONE_OFF = re.compile(r"kernel\.unprivileged_userns_clone = 0\b")
_MAX_USERNS_ZERO = re.compile(r"user\.max_user_namespaces = 0\b")
_SECCOMP_FILTERED = re.compile(r"\bSeccomp: 2\b")

# bwrap's messages (bubblewrap.c). "create a new" since 0.9, "creating new" before.
_NO_PERMISSION = re.compile(r"No permissions to creat(e|ing)( a)? new namespace")
_MAP_DENIED = re.compile(r"setting up [ug]id map: Permission denied")
_NO_SPACE = re.compile(r"No space left on device|ENOSPC")
_UNSHARE_EPERM = re.compile(
    r"(unshare|clone|Creating new namespace failed)[^\n]*Operation not permitted"
)


def _selftest_hint(bwrap: str, detail: str) -> str:
    """Name the specific remedy for a recognised failure, else quote the failure."""
    if "Unknown option" in detail:
        return (
            f"{bwrap} is too old for the sandbox, which needs --disable-userns; "
            "fix: install bubblewrap 0.8.0 or newer"
        )
    if _NO_SPACE.search(detail) or _MAX_USERNS_ZERO.search(detail):
        return (
            "bwrap cannot create a user namespace because user.max_user_namespaces is 0; "
            "fix: sudo sysctl -w user.max_user_namespaces=15000"
        )
    if _MAP_DENIED.search(detail):
        return _apparmor_hint(bwrap)
    if _NO_PERMISSION.search(detail):
        # One EPERM, three switches that cause it; the host settings tell them apart. A seccomp
        # filter refuses the clone itself, where AppArmor usually lets it through and denies the
        # uid map (above), so a filter is the likelier cause when both are present.
        if _CLONE_OFF.search(detail):
            return _CLONE_HINT
        if _SECCOMP_FILTERED.search(detail):
            return _SECCOMP_HINT
        if _APPARMOR_RESTRICTS.search(detail) or _EVIDENCE_MARK not in detail:
            return _apparmor_hint(bwrap)
    elif _UNSHARE_EPERM.search(detail):
        return _SECCOMP_HINT
    flat = "; ".join(line.strip() for line in detail.splitlines() if line.strip())
    return f"bwrap is installed but its selftest failed: {flat or 'no detail'}"


def _apparmor_hint(bwrap: str) -> str:
    return (
        "AppArmor restricts unprivileged user namespaces on this host (Ubuntu 23.10 and later); "
        f"fix: add an AppArmor profile for {bwrap} that allows userns "
        "(/etc/apparmor.d/bwrap, then sudo apparmor_parser -r /etc/apparmor.d/bwrap), "
        "or lift the restriction host-wide: "
        "sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0"
    )


_CLONE_HINT = (
    "unprivileged user namespaces are switched off (kernel.unprivileged_userns_clone = 0); "
    "fix: sudo sysctl -w kernel.unprivileged_userns_clone=1"
)

_SECCOMP_HINT = (
    "a seccomp filter (typically a container runtime's default profile) blocks creating "
    "namespaces; fix: run the container with a seccomp profile that allows unshare and clone "
    "of namespaces"
)


# --- host facts (the only I/O besides the selftest itself) ---------------------------------------


def _create_rules_not_checked() -> CreateRulesCheck:
    from cc_server.backends.supervisor import CreateRulesCheck

    return CreateRulesCheck(available=False)


def _check_create_rules() -> CreateRulesCheck:
    from cc_server.backends.supervisor import check_create_rules  # lazy: ctypes, subprocess

    return check_create_rules()


def _which_absolute(name: str, path: str | None = None) -> str | None:
    """`shutil.which`, minus answers from relative PATH entries (they depend on the cwd)."""
    found = shutil.which(name, path=path)
    return found if found is not None and os.path.isabs(found) else None


def _host_evidence(proc_root: str) -> str:
    """The namespace-related host settings that exist here, as `name = value, ...`."""
    parts: list[str] = []
    for name in _SYSCTLS:
        value = _read_first_line(os.path.join(proc_root, "sys", *name.split(".")))
        if value is not None:
            parts.append(f"{name} = {value}")
    status = _read_text(os.path.join(proc_root, "self", "status")) or ""
    match = re.search(r"^Seccomp:\s*(\d+)", status, re.MULTILINE)
    if match:
        parts.append(f"Seccomp: {match.group(1)}")
    return ", ".join(parts)


def _read_first_line(path: str) -> str | None:
    text = _read_text(path)
    return None if text is None else text.strip().partition("\n")[0]


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None
