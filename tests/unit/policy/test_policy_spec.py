"""The spec model: JSON names, defaults, validation messages, and the small enums."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from cc_server.errors import BadSpec
from cc_server.policy import (
    AgentCapabilities,
    Mode,
    SandboxBackend,
    SandboxBindMount,
    SandboxSpec,
    parse_spec,
)

MINIMAL: dict[str, Any] = {"sessionId": "space-1", "workspaceId": "ws-1"}


def spec_with(**fields: Any) -> dict[str, Any]:
    """The minimal JSON spec plus `fields` (JSON names)."""
    return {**MINIMAL, **fields}


def bad_spec_message(data: Any) -> str:
    with pytest.raises(BadSpec) as info:
        parse_spec(data)
    return str(info.value)


# --- JSON names and defaults ------------------------------------------------------------------


def test_spec_json_names_are_the_reference_pages_camel_case() -> None:
    dumped = parse_spec(MINIMAL).model_dump(by_alias=True, mode="json")
    assert set(dumped) == {
        "sessionId",
        "workspaceId",
        "agentId",
        "bindMounts",
        "networkEnabled",
        "egressAllowlist",
        "guestWorkdir",
        "mode",
        "capabilities",
        "protectedPaths",
        "runnerStateDirs",
        "execGrantRoots",
    }


def test_bind_mount_json_names() -> None:
    dumped = SandboxBindMount(host_path="/a").model_dump(by_alias=True)
    assert set(dumped) == {"hostPath", "guestPath", "readOnly"}


def test_capability_json_names_include_the_reference_pages_github_flag() -> None:
    # The reference page names the flag `canCallGitHubApi` (SandboxViolation.suggestedCapability).
    dumped = AgentCapabilities().model_dump(by_alias=True)
    assert set(dumped) == {"canUseNetwork", "canCallGitHubApi", "canPush", "canCallTicketing"}
    parsed = parse_spec(spec_with(capabilities={"canCallGitHubApi": True}))
    assert parsed.capabilities.can_call_github_api is True
    by_name = parse_spec(spec_with(capabilities={"can_call_github_api": True}))
    assert by_name.capabilities == parsed.capabilities
    # The generated spelling is not a second name for it.
    message = bad_spec_message(spec_with(capabilities={"canCallGithubApi": True}))
    assert "capabilities.canCallGithubApi: unknown field" in message


def test_every_default_matches_the_reference_page() -> None:
    spec = parse_spec(MINIMAL)
    assert spec.agent_id is None
    assert spec.bind_mounts == ()
    assert spec.network_enabled is True
    assert spec.egress_allowlist == ()
    assert spec.guest_workdir is None
    assert spec.mode is Mode.CHAT
    assert spec.capabilities == AgentCapabilities.safe_default()
    assert spec.protected_paths == ()
    assert spec.runner_state_dirs == ()
    assert spec.exec_grant_roots == ()


def test_defaults_in_json_form() -> None:
    dumped = parse_spec(MINIMAL).model_dump(by_alias=True, mode="json")
    assert dumped["networkEnabled"] is True
    assert dumped["egressAllowlist"] == []
    assert dumped["mode"] == "chat"
    assert dumped["protectedPaths"] == []
    assert dumped["runnerStateDirs"] == []
    assert dumped["execGrantRoots"] == []
    assert dumped["bindMounts"] == []


def test_safe_default_capabilities() -> None:
    safe = AgentCapabilities.safe_default()
    assert safe.can_use_network is True
    assert safe.can_call_github_api is False
    assert safe.can_push is False
    assert safe.can_call_ticketing is False
    assert safe == AgentCapabilities()


def test_bind_mount_defaults() -> None:
    mount = SandboxBindMount.model_validate({"hostPath": "/work/repo"})
    assert mount.guest_path is None
    assert mount.guest == "/work/repo"
    assert mount.read_only is False


def test_bind_mount_explicit_guest() -> None:
    mount = SandboxBindMount.model_validate({"hostPath": "/a", "guestPath": "/b", "readOnly": True})
    assert mount.guest == "/b"
    assert mount.read_only is True


def test_full_camel_case_spec_round_trips() -> None:
    data = {
        "sessionId": "space-1",
        "workspaceId": "ws-1",
        "agentId": "agent-7",
        "bindMounts": [{"hostPath": "/work/repo", "guestPath": "/repo", "readOnly": True}],
        "networkEnabled": False,
        "egressAllowlist": ["*.example.com"],
        "guestWorkdir": "/repo",
        "mode": "review",
        "capabilities": {"canUseNetwork": False, "canPush": True},
        "protectedPaths": ["/src/checkout"],
        "runnerStateDirs": ["/state/claude"],
        "execGrantRoots": ["/opt/tools"],
    }
    spec = parse_spec(data)
    assert spec.agent_id == "agent-7"
    assert spec.bind_mounts == (
        SandboxBindMount(host_path="/work/repo", guest_path="/repo", read_only=True),
    )
    assert spec.mode is Mode.REVIEW
    assert spec.capabilities.can_push is True
    assert spec.protected_paths == ("/src/checkout",)
    assert spec.runner_state_dirs == ("/state/claude",)
    assert spec.exec_grant_roots == ("/opt/tools",)
    assert parse_spec(spec.model_dump(by_alias=True, mode="json")) == spec


def test_snake_case_population_also_works() -> None:
    by_name = SandboxSpec(
        session_id="space-1",
        workspace_id="ws-1",
        bind_mounts=(SandboxBindMount(host_path="/work/repo", read_only=True),),
        network_enabled=False,
        egress_allowlist=("a.example.com",),
        mode=Mode.PLAN,
        capabilities=AgentCapabilities(can_call_github_api=True),
        protected_paths=("/src/checkout",),
        runner_state_dirs=("/state",),
        exec_grant_roots=("/opt",),
    )
    by_alias = parse_spec(
        {
            "sessionId": "space-1",
            "workspaceId": "ws-1",
            "bindMounts": [{"hostPath": "/work/repo", "readOnly": True}],
            "networkEnabled": False,
            "egressAllowlist": ["a.example.com"],
            "mode": "plan",
            "capabilities": {"canCallGitHubApi": True},
            "protectedPaths": ["/src/checkout"],
            "runnerStateDirs": ["/state"],
            "execGrantRoots": ["/opt"],
        }
    )
    assert by_name == by_alias
    # parse_spec accepts snake_case keys too.
    snake = parse_spec({"session_id": "space-1", "workspace_id": "ws-1", "network_enabled": False})
    assert snake.network_enabled is False


@pytest.mark.parametrize(
    ("model", "attribute", "value"),
    [
        (parse_spec(MINIMAL), "mode", Mode.REVIEW),
        (parse_spec(MINIMAL), "network_enabled", False),
        (SandboxBindMount(host_path="/a"), "read_only", True),
        (AgentCapabilities(), "can_push", True),
    ],
)
def test_models_are_frozen(model: Any, attribute: str, value: Any) -> None:
    with pytest.raises(ValidationError, match="frozen"):
        setattr(model, attribute, value)


def test_safe_default_cannot_be_edited_in_place() -> None:
    with pytest.raises(ValidationError):
        AgentCapabilities.safe_default().can_push = True  # type: ignore[misc]
    assert AgentCapabilities.safe_default().can_push is False


# --- parse_spec input forms ---------------------------------------------------------------------


def test_parse_spec_from_json_string_bytes_and_dict() -> None:
    text = json.dumps(spec_with(mode="orchestrate"))
    from_str = parse_spec(text)
    from_bytes = parse_spec(text.encode())
    from_dict = parse_spec(spec_with(mode="orchestrate"))
    assert from_str == from_bytes == from_dict
    assert from_str.mode is Mode.ORCHESTRATE


def test_parse_spec_rejects_malformed_json_with_a_spec_level_location() -> None:
    message = bad_spec_message("{not json")
    assert message.startswith("invalid SandboxSpec: <spec>: ")
    assert "fix: correct the fields named above" in message


def test_parse_spec_rejects_a_non_object() -> None:
    assert "<spec>:" in bad_spec_message([1, 2])


def test_bad_spec_carries_its_fix() -> None:
    with pytest.raises(BadSpec) as info:
        parse_spec({})
    assert info.value.fix == "correct the fields named above"
    assert "sessionId: Field required" in info.value.message
    assert "workspaceId: Field required" in info.value.message


# --- unknown fields -----------------------------------------------------------------------------


def test_unknown_top_level_field_is_rejected_by_name() -> None:
    message = bad_spec_message(spec_with(networkEnabeld=False))
    assert "networkEnabeld: unknown field (check the spelling; fields are camelCase)" in message


def test_unknown_field_inside_bind_mounts_is_rejected_with_its_json_path() -> None:
    message = bad_spec_message(spec_with(bindMounts=[{"hostPath": "/a", "writable": True}]))
    assert "bindMounts.0.writable: unknown field" in message


def test_unknown_field_inside_capabilities_is_rejected_with_its_json_path() -> None:
    message = bad_spec_message(spec_with(capabilities={"canFly": True}))
    assert "capabilities.canFly: unknown field" in message


def test_every_problem_is_named_in_one_message() -> None:
    message = bad_spec_message(
        {"workspaceId": "ws", "bogus": 1, "bindMounts": [{"hostPath": "rel"}]}
    )
    assert "sessionId: Field required" in message
    assert "bogus: unknown field" in message
    assert "bindMounts.0.hostPath: Value error, path must be absolute" in message


# --- paths ------------------------------------------------------------------------------------

BAD_PATHS = [
    pytest.param("relative/path", "must be absolute", id="relative"),
    pytest.param("", "must be absolute", id="empty"),
    pytest.param("~/x", "must be absolute", id="tilde"),
    pytest.param("/a/../b", "'.' or '..'", id="dotdot-middle"),
    pytest.param("/a/..", "'.' or '..'", id="dotdot-end"),
    pytest.param("/..", "'.' or '..'", id="dotdot-root"),
    pytest.param("/a/./b", "'.' or '..'", id="dot-middle"),
    pytest.param("/a/.", "'.' or '..'", id="dot-end"),
    pytest.param("//a", "repeated '/'", id="double-slash-lead"),
    pytest.param("///a", "repeated '/'", id="triple-slash-lead"),
    pytest.param("/a//b", "repeated '/'", id="double-slash-middle"),
    pytest.param("//", "repeated '/'", id="double-slash-only"),
    pytest.param("/a\x00b", "NUL", id="nul"),
]

PATH_FIELDS = [
    ("bindMounts", lambda p: [{"hostPath": p}], "bindMounts.0.hostPath"),
    ("bindMounts", lambda p: [{"hostPath": "/h", "guestPath": p}], "bindMounts.0.guestPath"),
    ("guestWorkdir", lambda p: p, "guestWorkdir"),
    ("protectedPaths", lambda p: [p], "protectedPaths.0"),
    ("runnerStateDirs", lambda p: [p], "runnerStateDirs.0"),
    ("execGrantRoots", lambda p: [p], "execGrantRoots.0"),
]


@pytest.mark.parametrize(("path", "why"), BAD_PATHS)
@pytest.mark.parametrize(
    ("field", "wrap", "where"), PATH_FIELDS, ids=[loc for _, _, loc in PATH_FIELDS]
)
def test_bad_paths_are_rejected_in_every_path_field(
    field: str, wrap: Any, where: str, path: str, why: str
) -> None:
    message = bad_spec_message(spec_with(**{field: wrap(path)}))
    assert f"{where}: " in message
    assert why in message


@pytest.mark.parametrize(
    ("written", "kept"),
    [
        ("/a", "/a"),
        ("/a/b/", "/a/b"),
        ("/a/.hidden/..x/b", "/a/.hidden/..x/b"),
        ("/with space/ünï", "/with space/ünï"),
    ],
)
def test_good_paths_are_kept_normalised(written: str, kept: str) -> None:
    spec = parse_spec(spec_with(protectedPaths=[written], bindMounts=[{"hostPath": written}]))
    assert spec.protected_paths == (kept,)
    assert spec.bind_mounts[0].host_path == kept


def test_root_is_a_valid_path_outside_host_binds() -> None:
    assert parse_spec(spec_with(guestWorkdir="/")).guest_workdir == "/"


def test_binding_the_host_root_is_rejected() -> None:
    message = bad_spec_message(spec_with(bindMounts=[{"hostPath": "/"}]))
    assert "bindMounts.0.hostPath" in message
    assert "host root '/'" in message


def test_binding_the_host_root_is_rejected_by_name_too() -> None:
    with pytest.raises(ValidationError, match="host root"):
        SandboxBindMount(host_path="/")


@pytest.mark.parametrize(
    ("mounts", "guest"),
    [
        pytest.param(
            [{"hostPath": "/a"}, {"hostPath": "/a", "readOnly": True}], "/a", id="same-host"
        ),
        pytest.param(
            [{"hostPath": "/a", "guestPath": "/g"}, {"hostPath": "/b", "guestPath": "/g"}],
            "/g",
            id="same-guest",
        ),
        pytest.param(
            [{"hostPath": "/g"}, {"hostPath": "/b", "guestPath": "/g"}], "/g", id="implicit"
        ),
        pytest.param([{"hostPath": "/g/"}, {"hostPath": "/g"}], "/g", id="trailing-slash"),
    ],
)
def test_duplicate_guest_paths_are_rejected(mounts: list[dict[str, Any]], guest: str) -> None:
    message = bad_spec_message(spec_with(bindMounts=mounts))
    assert f"two bind mounts share the guest path {guest!r}" in message


def test_distinct_guest_paths_are_accepted() -> None:
    spec = parse_spec(
        spec_with(bindMounts=[{"hostPath": "/a"}, {"hostPath": "/a", "guestPath": "/b"}])
    )
    assert [m.guest for m in spec.bind_mounts] == ["/a", "/b"]


# --- ids ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["sessionId", "workspaceId"])
@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("a/b", "must not contain '/'"),
        ("../x", "must not contain '/'"),
        ("tab\there", "printable"),
        ("new\nline", "printable"),
        ("", "at least 1 character"),
        ("x" * 257, "at most 256 characters"),
    ],
)
def test_bad_ids_are_rejected(field: str, value: str, why: str) -> None:
    message = bad_spec_message(spec_with(**{field: value}))
    assert f"{field}: " in message
    assert why in message


def test_longest_id_is_accepted() -> None:
    assert parse_spec(spec_with(sessionId="x" * 256)).session_id == "x" * 256


# --- enums and derived properties -------------------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "backend"),
    [
        (None, SandboxBackend.NONE),
        ("docker", SandboxBackend.NATIVE),
        ("garbage", SandboxBackend.NONE),
        ("", SandboxBackend.NONE),
        ("Native", SandboxBackend.NONE),
        ("microvm", SandboxBackend.MICROVM),
        ("native", SandboxBackend.NATIVE),
        ("none", SandboxBackend.NONE),
    ],
)
def test_backend_from_name(stored: str | None, backend: SandboxBackend) -> None:
    assert SandboxBackend.from_name(stored) is backend


def test_backend_values() -> None:
    assert [b.value for b in SandboxBackend] == ["microvm", "native", "none"]


@pytest.mark.parametrize(
    ("mode", "writable"),
    [(Mode.CHAT, True), (Mode.REVIEW, False), (Mode.PLAN, False), (Mode.ORCHESTRATE, False)],
)
def test_mode_binds_writable(mode: Mode, writable: bool) -> None:
    assert mode.binds_writable is writable


def test_mode_values() -> None:
    assert [m.value for m in Mode] == ["chat", "review", "plan", "orchestrate"]


def test_unknown_mode_is_rejected() -> None:
    assert "mode: " in bad_spec_message(spec_with(mode="yolo"))


@pytest.mark.parametrize(
    ("api", "push", "earns"),
    [(False, False, False), (True, False, True), (False, True, True), (True, True, True)],
)
def test_earns_github(api: bool, push: bool, earns: bool) -> None:
    caps = AgentCapabilities(can_call_github_api=api, can_push=push)
    assert caps.earns_github is earns


def test_ticketing_does_not_earn_github() -> None:
    assert AgentCapabilities(can_call_ticketing=True).earns_github is False


@pytest.mark.parametrize(
    ("enabled", "capable", "allowed"),
    [(True, True, True), (False, True, False), (True, False, False), (False, False, False)],
)
def test_network_allowed_needs_both_switches(enabled: bool, capable: bool, allowed: bool) -> None:
    spec = parse_spec(spec_with(networkEnabled=enabled, capabilities={"canUseNetwork": capable}))
    assert spec.network_allowed is allowed
