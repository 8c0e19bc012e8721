"""choose_backend and planner_for, every row of the reference page's table. Nothing is probed:
ProbeResults are built by hand."""

from __future__ import annotations

import dataclasses
import os

import pytest

from cc_server.backends.bubblewrap import BubblewrapPlanner, CreateRuleTools
from cc_server.backends.identity import IDENTITY_TOOL, SANDBOX_GID, SANDBOX_UID
from cc_server.backends.none import NonePlanner, plan_none
from cc_server.backends.plan import Command, SandboxIdentity
from cc_server.backends.probe import (
    CREATE_LAUNCHER_TOOL,
    CREATE_SUPERVISOR_TOOL,
    BubblewrapTools,
    Mechanism,
    ProbeResult,
)
from cc_server.backends.seatbelt import SeatbeltPlanner, darwin_user_temp_dir
from cc_server.errors import BackendUnavailable, ConfigError
from cc_server.policy import (
    PROTECTED_PATTERN_NAMES,
    HostFacts,
    Platform,
    SandboxBackend,
    compile_policy,
    parse_spec,
)
from cc_server.runtime.select import (
    WRITE_PROTECTION_ENV,
    EgressRoute,
    choose_backend,
    egress_route,
    planner_for,
    protected_patterns_for,
)

BWRAP = "/usr/bin/bwrap"
HINT = "install bubblewrap and socat (apt-get install bubblewrap socat)"

LINUX_OK = ProbeResult(
    platform=Platform.LINUX,
    available=True,
    mechanism="bubblewrap",
    tools={"bwrap": BWRAP, "socat": "/usr/bin/socat"},
)
WSL2_OK = ProbeResult(
    platform=Platform.WSL2, available=True, mechanism="bubblewrap", tools={"bwrap": BWRAP}
)
MACOS_OK = ProbeResult(
    platform=Platform.MACOS,
    available=True,
    mechanism="seatbelt",
    tools={"sandbox-exec": "/usr/bin/sandbox-exec"},
)
LINUX_MISSING = ProbeResult(platform=Platform.LINUX, available=False, hint=HINT)
NO_HINT = ProbeResult(platform=Platform.OTHER, available=False)
ALL_PROBES = [LINUX_OK, WSL2_OK, MACOS_OK, LINUX_MISSING, NO_HINT]


def _host(platform: Platform) -> HostFacts:
    def realpath(path: str) -> str:
        raise AssertionError("planner_for must not consult the filesystem")

    return HostFacts(
        platform=platform, home="/home/dev", realpath=realpath, exists=realpath, is_dir=realpath
    )


def _real_host() -> HostFacts:
    return HostFacts.current()


# --- choose_backend ----------------------------------------------------------------------------


@pytest.mark.parametrize("probe", [LINUX_OK, WSL2_OK, MACOS_OK])
def test_unspecified_available_sandbox_on_is_native(probe: ProbeResult) -> None:
    assert choose_backend(probe, None, sandbox_on=True) is SandboxBackend.NATIVE


@pytest.mark.parametrize("probe", ALL_PROBES)
def test_unspecified_sandbox_off_is_none(probe: ProbeResult) -> None:
    assert choose_backend(probe, None, sandbox_on=False) is SandboxBackend.NONE


@pytest.mark.parametrize("probe", [LINUX_MISSING, NO_HINT])
def test_unspecified_unavailable_is_none(probe: ProbeResult) -> None:
    assert choose_backend(probe, None, sandbox_on=True) is SandboxBackend.NONE


@pytest.mark.parametrize("sandbox_on", [True, False])
def test_explicit_native_available_is_native(sandbox_on: bool) -> None:
    assert choose_backend(LINUX_OK, SandboxBackend.NATIVE, sandbox_on=sandbox_on) is (
        SandboxBackend.NATIVE
    )


@pytest.mark.parametrize("sandbox_on", [True, False])
def test_explicit_native_unavailable_fails_never_none(sandbox_on: bool) -> None:
    with pytest.raises(BackendUnavailable, match="'native' was requested") as info:
        choose_backend(LINUX_MISSING, SandboxBackend.NATIVE, sandbox_on=sandbox_on)
    assert info.value.fix == HINT


def test_explicit_native_unavailable_without_hint_has_a_fix() -> None:
    with pytest.raises(BackendUnavailable) as info:
        choose_backend(NO_HINT, SandboxBackend.NATIVE, sandbox_on=True)
    assert info.value.fix == "install the native sandbox tools"


@pytest.mark.parametrize("probe", ALL_PROBES)
@pytest.mark.parametrize("sandbox_on", [True, False])
def test_explicit_microvm_fails(probe: ProbeResult, sandbox_on: bool) -> None:
    with pytest.raises(BackendUnavailable, match="'microvm' was requested"):
        choose_backend(probe, SandboxBackend.MICROVM, sandbox_on=sandbox_on)


@pytest.mark.parametrize("probe", ALL_PROBES)
@pytest.mark.parametrize("sandbox_on", [True, False])
def test_explicit_none_is_none(probe: ProbeResult, sandbox_on: bool) -> None:
    assert choose_backend(probe, SandboxBackend.NONE, sandbox_on=sandbox_on) is (
        SandboxBackend.NONE
    )


# --- planner_for -------------------------------------------------------------------------------


@pytest.mark.parametrize("probe", ALL_PROBES)
def test_planner_for_none_is_plan_none(probe: ProbeResult) -> None:
    planner = planner_for(SandboxBackend.NONE, probe, _host(probe.platform))
    assert planner == NonePlanner()
    policy = compile_policy(parse_spec({"sessionId": "s", "workspaceId": "w"}), _real_host())
    command = Command(argv=("/bin/true",), cwd="/tmp")
    assert planner.plan(policy, command) == plan_none(policy, command)


@pytest.mark.parametrize("probe", [LINUX_OK, WSL2_OK])
def test_planner_for_native_bubblewrap_is_a_bound_plan_bubblewrap(probe: ProbeResult) -> None:
    host = _host(probe.platform)
    planner = planner_for(SandboxBackend.NATIVE, probe, host)
    assert planner == BubblewrapPlanner(
        host=host,
        tools=BubblewrapTools(
            bwrap=BWRAP,
            socat=probe.tools.get("socat"),
            create_rules=None,  # the probe found no create-rule supervisor
        ),
        identity=None,  # nor a sandbox identity (only a root server needs one)
        new_session=True,
        share_net=False,
    )
    assert isinstance(planner, BubblewrapPlanner) and planner.host is host


def test_planner_for_the_terminal_profile_keeps_the_host_network_and_no_bridge_or_rules() -> None:
    tools = {
        **LINUX_OK.tools,
        CREATE_LAUNCHER_TOOL: "/opt/cc/cc-create-launcher",
        CREATE_SUPERVISOR_TOOL: "/opt/cc/libcc-create-supervisor.so",
        IDENTITY_TOOL: "/opt/cc/cc-identity",
    }
    probe = dataclasses.replace(LINUX_OK, tools=tools, create_rules=True)
    host = _host(probe.platform)
    assert planner_for(SandboxBackend.NATIVE, probe, host, terminal=True) == BubblewrapPlanner(
        host=host,
        tools=BubblewrapTools(bwrap=BWRAP),
        identity=SandboxIdentity(helper="/opt/cc/cc-identity", uid=SANDBOX_UID, gid=SANDBOX_GID),
        new_session=False,
        share_net=True,
    )
    mac = _host(Platform.MACOS)
    assert planner_for(SandboxBackend.NATIVE, MACOS_OK, mac, terminal=True) == SeatbeltPlanner(
        host=mac,
        sandbox_exec="/usr/bin/sandbox-exec",
        temp_dir=darwin_user_temp_dir(os.environ),
        share_net=True,
    )
    with pytest.raises(BackendUnavailable, match="terminal profile is not built for bubblewrap"):
        planner_for(SandboxBackend.NATIVE, probe, mac, terminal=True)


def test_planner_for_native_bubblewrap_passes_the_sandbox_identity_the_probe_found() -> None:
    probe = dataclasses.replace(
        LINUX_OK, tools={**LINUX_OK.tools, IDENTITY_TOOL: "/opt/cc/cc-identity"}
    )
    planner = planner_for(SandboxBackend.NATIVE, probe, _host(probe.platform))
    assert isinstance(planner, BubblewrapPlanner)
    assert planner.identity == SandboxIdentity(
        helper="/opt/cc/cc-identity", uid=SANDBOX_UID, gid=SANDBOX_GID
    )


def test_planner_for_native_bubblewrap_passes_the_create_rule_tools_the_probe_found() -> None:
    tools = {
        **LINUX_OK.tools,
        CREATE_LAUNCHER_TOOL: "/opt/cc/cc-create-launcher",
        CREATE_SUPERVISOR_TOOL: "/opt/cc/libcc-create-supervisor.so",
    }
    probe = dataclasses.replace(LINUX_OK, tools=tools, create_rules=True)
    planner = planner_for(SandboxBackend.NATIVE, probe, _host(probe.platform))
    assert isinstance(planner, BubblewrapPlanner)
    assert planner.tools.create_rules == CreateRuleTools(
        launcher="/opt/cc/cc-create-launcher", library="/opt/cc/libcc-create-supervisor.so"
    )
    # Tools without the probe's verdict (the kernel check failed) are not used.
    unchecked = dataclasses.replace(probe, create_rules=False)
    planner = planner_for(SandboxBackend.NATIVE, unchecked, _host(probe.platform))
    assert isinstance(planner, BubblewrapPlanner)
    assert planner.tools.create_rules is None


def test_planner_for_native_seatbelt_on_macos_is_a_bound_plan_seatbelt() -> None:
    host = _host(Platform.MACOS)
    planner = planner_for(SandboxBackend.NATIVE, MACOS_OK, host)
    assert planner == SeatbeltPlanner(
        host=host,
        sandbox_exec="/usr/bin/sandbox-exec",
        temp_dir=darwin_user_temp_dir(os.environ),
        share_net=False,
    )
    stand_in = planner_for(SandboxBackend.NATIVE, MACOS_OK, host, temp_dir="/private/var/t")
    assert stand_in == dataclasses.replace(planner, temp_dir="/private/var/t")


def test_a_mechanism_is_typed_and_an_unknown_one_is_refused() -> None:
    assert LINUX_OK.mechanism is Mechanism.BUBBLEWRAP and MACOS_OK.mechanism is Mechanism.SEATBELT
    assert LINUX_OK.to_json()["mechanism"] == "bubblewrap"
    with pytest.raises(ValueError, match="firejail"):
        ProbeResult(platform=Platform.LINUX, available=True, mechanism="firejail")  # type: ignore[arg-type]


def test_egress_route_is_the_one_place_a_bridge_is_decided() -> None:
    assert egress_route(SandboxBackend.NATIVE, LINUX_OK) is EgressRoute.SOCKETS
    assert egress_route(SandboxBackend.NATIVE, WSL2_OK) is EgressRoute.SOCKETS
    assert egress_route(SandboxBackend.NATIVE, MACOS_OK) is EgressRoute.LOOPBACK
    for probe in ALL_PROBES:
        assert egress_route(SandboxBackend.NONE, probe) is None
        assert egress_route(SandboxBackend.MICROVM, probe) is None
    assert egress_route(SandboxBackend.NATIVE, LINUX_MISSING) is None


@pytest.mark.parametrize("platform", [Platform.LINUX, Platform.WSL2, Platform.WINDOWS])
def test_planner_for_seatbelt_on_a_non_macos_host_unavailable(platform: Platform) -> None:
    with pytest.raises(BackendUnavailable, match="seatbelt adapter is not available"):
        planner_for(SandboxBackend.NATIVE, MACOS_OK, _host(platform))


@pytest.mark.parametrize("platform", [Platform.MACOS, Platform.WINDOWS, Platform.OTHER])
def test_planner_for_bubblewrap_on_a_non_linux_host_unavailable(platform: Platform) -> None:
    with pytest.raises(BackendUnavailable, match="bubblewrap adapter is not available"):
        planner_for(SandboxBackend.NATIVE, LINUX_OK, _host(platform))


def test_planner_for_native_with_unavailable_probe_fails() -> None:
    with pytest.raises(BackendUnavailable, match="backend native cannot run") as info:
        planner_for(SandboxBackend.NATIVE, LINUX_MISSING, _host(Platform.LINUX))
    assert info.value.fix == HINT


@pytest.mark.parametrize("probe", ALL_PROBES)
def test_planner_for_microvm_fails(probe: ProbeResult) -> None:
    with pytest.raises(BackendUnavailable, match="backend microvm cannot run") as info:
        planner_for(SandboxBackend.MICROVM, probe, _host(probe.platform))
    assert info.value.fix == (probe.hint or "request 'native' or leave the backend unspecified")


# --- protected_patterns_for --------------------------------------------------------------------


def test_bubblewrap_gets_the_protected_patterns_with_or_without_the_supervisor() -> None:
    # Without the supervisor the patterns are still asked for, so the planner refuses the launch
    # (BackendUnavailable) instead of running it with the launch-time binds alone.
    for probe in (LINUX_OK, dataclasses.replace(LINUX_OK, create_rules=True)):
        assert protected_patterns_for(probe, env={}) == PROTECTED_PATTERN_NAMES


def test_launch_time_protection_only_when_said_on_purpose() -> None:
    env = {WRITE_PROTECTION_ENV: "launch-time"}
    assert protected_patterns_for(LINUX_OK, env=env) == ()
    assert protected_patterns_for(LINUX_OK, env={WRITE_PROTECTION_ENV: "write-time"}) == (
        PROTECTED_PATTERN_NAMES
    )
    with pytest.raises(ConfigError, match="not a choice") as err:
        protected_patterns_for(LINUX_OK, env={WRITE_PROTECTION_ENV: "off"})
    assert "launch-time" in (err.value.fix or "")


def test_other_mechanisms_have_launch_time_rules_only() -> None:
    assert protected_patterns_for(MACOS_OK, env={}) == ()
