"""The terminal's fixed profile, its bubblewrap plan, and the manager's terminal launch: over fake
hosts, nothing spawned."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import pytest

from cc_server.backends.bubblewrap import plan_bubblewrap
from cc_server.backends.plan import Command, EgressBridge
from cc_server.backends.probe import ProbeResult
from cc_server.errors import BackendUnavailable, BadSpec, EnforcementFailed
from cc_server.policy import AgentCapabilities, HostFacts, Mode, Platform, SandboxBackend
from cc_server.runtime.port import SandboxManager
from cc_server.terminal import TERMINAL_DENY_READ, terminal_policy

HOME = "/home/dev"
BWRAP = "/usr/bin/bwrap"
FIVE = (".ssh", ".aws", ".gnupg", ".config/gh", "Library/Keychains")


@dataclasses.dataclass(frozen=True)
class Fs:
    links: Mapping[str, str]
    dirs: frozenset[str]

    def realpath(self, path: str) -> str:
        for link in sorted(self.links, key=len, reverse=True):
            if path == link or path.startswith(link + "/"):
                return self.links[link] + path[len(link):]
        return path

    def exists(self, path: str) -> bool:
        return path in self.dirs or path in self.links

    def is_dir(self, path: str) -> bool:
        return self.realpath(path) in self.dirs


def host(dirs: Iterable[str] = (), links: Mapping[str, str] | None = None,
         home: str = HOME, platform: Platform = Platform.LINUX) -> HostFacts:
    fs = Fs(links=dict(links or {}),
            dirs=frozenset({"/usr", "/etc", home, "/work", f"{home}/.ssh", *dirs}))
    return HostFacts(platform=platform, home=home, realpath=fs.realpath, exists=fs.exists,
                     is_dir=fs.is_dir, server_is_root=False)


BWRAP_PROBE = ProbeResult(platform=Platform.LINUX, available=True, mechanism="bubblewrap",
                          note="n", tools={"bwrap": BWRAP, "socat": "/usr/bin/socat"})
NO_PROBE = ProbeResult(platform=Platform.LINUX, available=False, hint="install bubblewrap")


# --- the profile ---------------------------------------------------------------------------------


def test_the_profile_is_exactly_the_reference_pages() -> None:
    policy = terminal_policy("t1", "/work", host())
    assert [(m.host_path, m.writable) for m in policy.mounts] == [(HOME, True), ("/work", True)]
    assert policy.workdir == "/work"
    assert [r.path for r in policy.deny_read] == [f"{HOME}/{rel}" for rel in FIVE]
    assert [rel for rel, _ in TERMINAL_DENY_READ] == list(FIVE)
    assert policy.deny_write == () and policy.deny_create_globs == ()
    assert policy.network_allowed and policy.egress_allowlist == ()
    assert policy.mode is Mode.CHAT and policy.capabilities == AgentCapabilities()


def test_the_five_are_denied_in_both_spellings() -> None:
    policy = terminal_policy("t1", HOME, host(links={f"{HOME}/.ssh": "/keys/ssh"},
                                              dirs={"/keys/ssh"}))
    paths = [r.path for r in policy.deny_read]
    assert f"{HOME}/.ssh" in paths and "/keys/ssh" in paths
    assert len(policy.mounts) == 1  # cwd is $HOME: one writable mount


def test_server_secrets_join_the_deny_set() -> None:
    policy = terminal_policy("t1", "/work", host(), server_private=("/run/cc/token",))
    (extra,) = [r for r in policy.deny_read if r.path == "/run/cc/token"]
    assert "token" in extra.reason


@pytest.mark.parametrize("cwd", ["relative", "/work/../etc", "/missing", ""])
def test_a_bad_cwd_is_refused(cwd: str) -> None:
    with pytest.raises(BadSpec, match="terminal cwd"):
        terminal_policy("t1", cwd, host())


def test_a_root_home_is_refused() -> None:
    with pytest.raises(BadSpec, match="whole host writable"):
        terminal_policy("t1", "/work", host(home="/"))


# --- its bubblewrap plan -------------------------------------------------------------------------


def terminal_plan(**switches: bool) -> list[str]:
    h = host()
    plan = plan_bubblewrap(terminal_policy("t1", "/work", h), Command(argv=("/bin/bash",)),
                           host=h, bwrap=BWRAP, **switches)
    return [str(a) for a in plan.argv]


def test_the_terminal_plan_keeps_the_pty_session_and_the_host_network() -> None:
    argv = terminal_plan(new_session=False, share_net=True)
    assert "--new-session" not in argv and "--unshare-net" not in argv
    for kept in ("--unshare-user", "--unshare-pid", "--unshare-ipc", "--disable-userns",
                 "--die-with-parent", "--seccomp"):
        assert kept in argv, kept
    assert argv[argv.index("--cap-drop") + 1] == "ALL"
    i = argv.index(f"{HOME}/.ssh")
    assert argv[i - 1] == "--tmpfs"  # the secret directory is masked


def test_the_default_plan_is_unchanged_by_the_switches_existing() -> None:
    argv = terminal_plan()
    assert "--new-session" in argv and "--unshare-net" in argv


def test_a_shared_network_never_carries_an_egress_bridge() -> None:
    h = host()
    with pytest.raises(EnforcementFailed, match="host network shared"):
        plan_bubblewrap(
            terminal_policy("t1", "/work", h),
            Command(argv=("/bin/bash",), egress=EgressBridge(socket_dir="/run/s")),
            host=h, bwrap=BWRAP, share_net=True,
        )


# --- SandboxManager.launch_terminal --------------------------------------------------------------


def test_native_terminal_launch_plans_with_the_terminal_switches() -> None:
    h = host()
    manager = SandboxManager(probe_result=BWRAP_PROBE, host=h, sandbox_on=False)
    handle = manager.launch_terminal(terminal_policy("t1", "/work", h),
                                     backend=SandboxBackend.NATIVE)
    assert handle.backend is SandboxBackend.NATIVE and handle.egress is None
    argv = [str(a) for a in handle.plan(Command(argv=("/bin/bash",))).argv]
    assert "--new-session" not in argv and "--unshare-net" not in argv
    assert manager.handles == {}  # the terminal service owns it


def test_native_terminal_without_a_backend_fails_loudly() -> None:
    h = host()
    manager = SandboxManager(probe_result=NO_PROBE, host=h)
    with pytest.raises(BackendUnavailable, match="native"):
        manager.launch_terminal(terminal_policy("t1", "/work", h), backend=SandboxBackend.NATIVE)
    with pytest.raises(BackendUnavailable, match="microvm"):
        manager.launch_terminal(terminal_policy("t1", "/work", h), backend=SandboxBackend.MICROVM)
    none = manager.launch_terminal(terminal_policy("t1", "/work", h), backend=SandboxBackend.NONE)
    assert none.backend is SandboxBackend.NONE


def test_macos_native_terminal_plans_seatbelt_with_open_network() -> None:
    h = host(platform=Platform.MACOS)
    seatbelt = ProbeResult(platform=Platform.MACOS, available=True, mechanism="seatbelt",
                           note="n", tools={"sandbox-exec": "/usr/bin/sandbox-exec"})
    manager = SandboxManager(probe_result=seatbelt, host=h)
    handle = manager.launch_terminal(terminal_policy("t1", "/work", h),
                                     backend=SandboxBackend.NATIVE)
    assert handle.backend is SandboxBackend.NATIVE and handle.egress is None
    plan = handle.plan(Command(argv=("/bin/zsh",)))
    argv = [str(a) for a in plan.argv]
    assert argv[0] == "/usr/bin/sandbox-exec"
    profile = argv[argv.index("-p") + 1]
    assert '(deny network' not in profile, profile  # the terminal profile's network is open


def test_a_mechanism_without_a_terminal_plan_fails_loudly() -> None:
    h = host(platform=Platform.WINDOWS)
    odd = ProbeResult(platform=Platform.WINDOWS, available=True, mechanism="seatbelt",
                      note="n", tools={"sandbox-exec": "/usr/bin/sandbox-exec"})
    manager = SandboxManager(probe_result=odd, host=h)
    with pytest.raises(BackendUnavailable, match="terminal profile"):
        manager.launch_terminal(terminal_policy("t1", "/work", h), backend=SandboxBackend.NATIVE)
