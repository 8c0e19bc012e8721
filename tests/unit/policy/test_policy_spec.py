"""The spec model: JSON names, defaults, validation messages, the JSON Schema, and the enums."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import pytest

from cc_server.errors import BadSpec
from cc_server.policy import (
    AgentCapabilities,
    Mode,
    SandboxBackend,
    SandboxBindMount,
    SandboxSpec,
    parse_spec,
)
from cc_server.policy.spec import check_absolute, spec_json_schema

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
    dumped = parse_spec(MINIMAL).to_json()
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
    dumped = SandboxBindMount(host_path="/a").to_json()
    assert set(dumped) == {"hostPath", "guestPath", "readOnly", "hostSockets"}


def test_capability_json_names_include_the_reference_pages_github_flag() -> None:
    # The reference page names the flag `canCallGitHubApi` (SandboxViolation.suggestedCapability).
    dumped = AgentCapabilities().to_json()
    assert set(dumped) == {"canUseNetwork", "canCallGitHubApi", "canPush", "canCallTicketing"}
    parsed = parse_spec(spec_with(capabilities={"canCallGitHubApi": True}))
    assert parsed.capabilities.can_call_github_api is True
    # Neither the generated spelling nor the Python name is a second name for it.
    message = bad_spec_message(spec_with(capabilities={"canCallGithubApi": True}))
    assert (
        "invalid SandboxSpec: capabilities.canCallGithubApi: unknown field "
        "(check the spelling; fields are camelCase)"
    ) in message
    message = bad_spec_message(spec_with(capabilities={"can_call_github_api": True}))
    assert "capabilities.can_call_github_api: unknown field" in message


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
    dumped = parse_spec(MINIMAL).to_json()
    assert dumped["agentId"] is None
    assert dumped["guestWorkdir"] is None
    assert dumped["networkEnabled"] is True
    # Sequences stay tuples in the JSON-ready form; a JSON encoder writes them as arrays.
    assert dumped["egressAllowlist"] == ()
    assert dumped["mode"] == "chat"
    assert type(dumped["mode"]) is str
    assert dumped["protectedPaths"] == ()
    assert dumped["runnerStateDirs"] == ()
    assert dumped["execGrantRoots"] == ()
    assert dumped["bindMounts"] == ()
    assert dumped["capabilities"] == {
        "canUseNetwork": True,
        "canCallGitHubApi": False,
        "canPush": False,
        "canCallTicketing": False,
    }
    assert json.loads(json.dumps(dumped))["bindMounts"] == []


def test_to_json_nests_plain_dicts_and_keeps_tuples() -> None:
    spec = SandboxSpec(
        session_id="s",
        workspace_id="w",
        bind_mounts=(SandboxBindMount(host_path="/a", guest_path="/b", read_only=True),),
        protected_paths=("/p",),
        mode=Mode.PLAN,
    )
    dumped = spec.to_json()
    assert dumped["bindMounts"] == (
        {"hostPath": "/a", "guestPath": "/b", "readOnly": True, "hostSockets": False},
    )
    assert type(dumped["bindMounts"]) is tuple
    assert dumped["protectedPaths"] == ("/p",)
    assert dumped["mode"] == "plan"


def test_safe_default_capabilities() -> None:
    safe = AgentCapabilities.safe_default()
    assert safe.can_use_network is True
    assert safe.can_call_github_api is False
    assert safe.can_push is False
    assert safe.can_call_ticketing is False
    assert safe == AgentCapabilities()


def test_bind_mount_defaults() -> None:
    mount = msgspec.convert({"hostPath": "/work/repo"}, SandboxBindMount)
    assert mount.guest_path is None
    assert mount.guest == "/work/repo"
    assert mount.read_only is False


def test_bind_mount_explicit_guest() -> None:
    mount = msgspec.convert(
        {"hostPath": "/a", "guestPath": "/b", "readOnly": True}, SandboxBindMount
    )
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
    assert parse_spec(spec.to_json()) == spec
    assert parse_spec(json.dumps(spec.to_json())) == spec


def test_python_callers_construct_with_snake_case_keywords() -> None:
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


@pytest.mark.parametrize(
    ("data", "where"),
    [
        pytest.param({"session_id": "s", "workspace_id": "w"}, "session_id", id="top-level"),
        pytest.param(spec_with(network_enabled=False), "network_enabled", id="second-field"),
        pytest.param(
            spec_with(bindMounts=[{"host_path": "/a"}]), "bindMounts[0].host_path", id="nested"
        ),
        pytest.param(
            spec_with(capabilities={"can_push": True}), "capabilities.can_push", id="capabilities"
        ),
    ],
)
def test_snake_case_json_keys_are_rejected_as_unknown_fields(
    data: dict[str, Any], where: str
) -> None:
    # JSON is camelCase only; the snake_case names are Python's, not the wire's.
    message = bad_spec_message(data)
    assert f"{where}: unknown field (check the spelling; fields are camelCase)" in message
    assert "invalid SandboxSpec: " in bad_spec_message(json.dumps(data))


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
    before = getattr(model, attribute)
    with pytest.raises(AttributeError, match="immutable"):
        setattr(model, attribute, value)
    assert getattr(model, attribute) == before


def test_safe_default_cannot_be_edited_in_place() -> None:
    with pytest.raises(AttributeError):
        AgentCapabilities.safe_default().can_push = True  # type: ignore[misc]
    assert AgentCapabilities.safe_default().can_push is False
    assert parse_spec(MINIMAL).capabilities is AgentCapabilities.safe_default()


def test_specs_are_hashable_values() -> None:
    assert hash(parse_spec(MINIMAL)) == hash(parse_spec(dict(MINIMAL)))
    assert {SandboxBindMount(host_path="/a/"), SandboxBindMount(host_path="/a")} == {
        SandboxBindMount(host_path="/a")
    }


# --- parse_spec input forms ---------------------------------------------------------------------


def test_parse_spec_from_json_string_bytes_and_dict() -> None:
    text = json.dumps(spec_with(mode="orchestrate"))
    from_str = parse_spec(text)
    from_bytes = parse_spec(text.encode())
    from_dict = parse_spec(spec_with(mode="orchestrate"))
    assert from_str == from_bytes == from_dict
    assert from_str.mode is Mode.ORCHESTRATE


def test_parse_spec_from_bytes_reports_field_problems_like_a_dict() -> None:
    data = spec_with(bindMounts=[{"hostPath": "rel"}])
    expected = "invalid SandboxSpec: bindMounts[0].hostPath: path must be absolute, got 'rel'"
    assert expected in bad_spec_message(json.dumps(data).encode())
    assert expected in bad_spec_message(json.dumps(data))
    assert expected in bad_spec_message(data)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("{not json", id="str"),
        pytest.param(b"{not json", id="bytes"),
        pytest.param(b'{"sessionId": "s", ', id="truncated"),
        pytest.param("", id="empty"),
        pytest.param(b"\xff\xfe", id="not-utf8"),
    ],
)
def test_parse_spec_rejects_malformed_json(text: str | bytes) -> None:
    with pytest.raises(BadSpec) as info:
        parse_spec(text)
    assert info.value.message.startswith("invalid SandboxSpec: ")
    assert info.value.fix == "correct the field named above"
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


def test_malformed_json_says_where_it_broke() -> None:
    message = bad_spec_message("{not json")
    assert message.startswith("invalid SandboxSpec: JSON is malformed: ")
    assert "(byte 1)" in message
    assert "fix: correct the field named above" in message


def test_parse_spec_rejects_a_non_object_at_the_spec_level() -> None:
    assert "invalid SandboxSpec: <spec>: Expected `object`, got `array`" in bad_spec_message([1, 2])
    assert "<spec>: Expected `object`" in bad_spec_message("[1, 2]")


def test_bad_spec_carries_its_fix() -> None:
    with pytest.raises(BadSpec) as info:
        parse_spec({})
    assert info.value.fix == "correct the field named above"
    assert info.value.message == (
        "invalid SandboxSpec: <spec>: Object missing required field `sessionId`"
    )


def test_wrong_type_is_named_by_its_json_path() -> None:
    message = bad_spec_message(spec_with(bindMounts=[{"hostPath": "/a", "readOnly": "yes"}]))
    assert "bindMounts[0].readOnly: Expected `bool`, got `str`" in message


# --- unknown fields -----------------------------------------------------------------------------


def test_unknown_top_level_field_is_rejected_by_name() -> None:
    message = bad_spec_message(spec_with(networkEnabeld=False))
    assert "networkEnabeld: unknown field (check the spelling; fields are camelCase)" in message


def test_unknown_field_inside_bind_mounts_is_rejected_with_its_json_path() -> None:
    message = bad_spec_message(spec_with(bindMounts=[{"hostPath": "/a", "writable": True}]))
    assert "bindMounts[0].writable: unknown field" in message


def test_unknown_field_inside_capabilities_is_rejected_with_its_json_path() -> None:
    message = bad_spec_message(spec_with(capabilities={"canFly": True}))
    assert "capabilities.canFly: unknown field" in message


def test_the_first_problem_is_named() -> None:
    # msgspec stops at the first problem; the message names exactly one.
    message = bad_spec_message(
        {"workspaceId": "ws", "bogus": 1, "bindMounts": [{"hostPath": "rel"}]}
    )
    assert message.startswith("invalid SandboxSpec: bogus: unknown field")
    assert "sessionId" not in message
    assert "bindMounts" not in message


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

# (JSON field, JSON value for a path, where the message locates it, snake_case keyword,
# keyword value for a path). Every message names the field by its JSON path.
PATH_FIELDS = [
    ("bindMounts", lambda p: [{"hostPath": p}], "bindMounts[0].hostPath", "host_path", None),
    (
        "bindMounts",
        lambda p: [{"hostPath": "/h", "guestPath": p}],
        "bindMounts[0].guestPath",
        "guest_path",
        None,
    ),
    ("guestWorkdir", lambda p: p, "guestWorkdir", "guest_workdir", lambda p: p),
    ("protectedPaths", lambda p: [p], "protectedPaths[0]", "protected_paths", lambda p: (p,)),
    ("runnerStateDirs", lambda p: [p], "runnerStateDirs[0]", "runner_state_dirs", lambda p: (p,)),
    ("execGrantRoots", lambda p: [p], "execGrantRoots[0]", "exec_grant_roots", lambda p: (p,)),
]


@pytest.mark.parametrize(("path", "why"), BAD_PATHS)
@pytest.mark.parametrize(
    ("field", "wrap", "where", "keyword", "value"),
    PATH_FIELDS,
    ids=[keyword for *_, keyword, _ in PATH_FIELDS],
)
def test_bad_paths_are_rejected_in_every_path_field(
    field: str, wrap: Any, where: str, keyword: str, value: Any, path: str, why: str
) -> None:
    message = bad_spec_message(spec_with(**{field: wrap(path)}))
    assert message.startswith(f"invalid SandboxSpec: {where}: ")
    assert why in message
    # Direct construction runs the same checks and raises the ValueError itself.
    mount: dict[str, Any] = {"host_path": "/h", keyword: path}
    with pytest.raises(ValueError, match=re.escape(why)):
        if value is None:
            SandboxBindMount(**mount)
        else:
            SandboxSpec(session_id="s", workspace_id="w", **{keyword: value(path)})


def test_a_bad_path_message_quotes_the_path() -> None:
    message = bad_spec_message(spec_with(bindMounts=[{"hostPath": "rel"}]))
    assert message.startswith(
        "invalid SandboxSpec: bindMounts[0].hostPath: path must be absolute, got 'rel'"
    )
    message = bad_spec_message(spec_with(bindMounts=[{"hostPath": "/a"}, {"hostPath": "/b/../c"}]))
    assert (
        "bindMounts[1].hostPath: path must not contain '.' or '..' components, got '/b/../c'"
        in message
    )


@pytest.mark.parametrize(("path", "why"), BAD_PATHS)
def test_check_absolute_rejects_bad_paths(path: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        check_absolute(path)


@pytest.mark.parametrize(
    ("written", "kept"), [("/", "/"), ("/a", "/a"), ("/a/b/", "/a/b"), ("/a/", "/a")]
)
def test_check_absolute_returns_the_normalised_path(written: str, kept: str) -> None:
    assert check_absolute(written) == kept


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
    spec = parse_spec(
        spec_with(
            protectedPaths=[written],
            runnerStateDirs=[written],
            execGrantRoots=[written],
            guestWorkdir=written,
            bindMounts=[{"hostPath": written, "guestPath": written}],
        )
    )
    assert spec.protected_paths == spec.runner_state_dirs == spec.exec_grant_roots == (kept,)
    assert spec.guest_workdir == kept
    assert spec.bind_mounts[0].host_path == spec.bind_mounts[0].guest == kept
    # Direct construction normalises the same way.
    assert SandboxBindMount(host_path=written, guest_path=written).guest_path == kept
    by_name = SandboxSpec(session_id="s", workspace_id="w", protected_paths=(written,))
    assert by_name.protected_paths == (kept,)


def test_root_is_a_valid_path_outside_host_binds() -> None:
    assert parse_spec(spec_with(guestWorkdir="/")).guest_workdir == "/"


def test_binding_the_host_root_is_rejected() -> None:
    message = bad_spec_message(spec_with(bindMounts=[{"hostPath": "/"}]))
    assert "bindMounts[0].hostPath: binding the host root '/' exposes the whole host" in message


def test_binding_the_host_root_is_rejected_by_name_too() -> None:
    with pytest.raises(ValueError, match="host root"):
        SandboxBindMount(host_path="/")
    # A guest path of '/' is not a host root.
    assert SandboxBindMount(host_path="/a", guest_path="/").guest == "/"


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
    assert f"bindMounts[1]: two bind mounts share the guest path {guest!r}" in message
    with pytest.raises(ValueError, match="two bind mounts share"):
        SandboxSpec(
            session_id="s",
            workspace_id="w",
            bind_mounts=tuple(msgspec.convert(m, SandboxBindMount) for m in mounts),
        )


def test_distinct_guest_paths_are_accepted() -> None:
    spec = parse_spec(
        spec_with(bindMounts=[{"hostPath": "/a"}, {"hostPath": "/a", "guestPath": "/b"}])
    )
    assert [m.guest for m in spec.bind_mounts] == ["/a", "/b"]


# --- ids ----------------------------------------------------------------------------------------


BAD_CONTENT_IDS = [
    pytest.param("a/b", "must not contain '/'", id="slash"),
    pytest.param("../x", "must not contain '/'", id="dotdot-slash"),
    pytest.param("tab\there", "printable", id="tab"),
    pytest.param("new\nline", "printable", id="newline"),
]


@pytest.mark.parametrize("field", ["sessionId", "workspaceId"])
@pytest.mark.parametrize(("value", "why"), BAD_CONTENT_IDS)
def test_bad_ids_are_rejected(field: str, value: str, why: str) -> None:
    message = bad_spec_message(spec_with(**{field: value}))
    assert message.startswith(f"invalid SandboxSpec: {field}: ids must be printable")
    assert why in message


@pytest.mark.parametrize("keyword", ["session_id", "workspace_id"])
@pytest.mark.parametrize(("value", "why"), BAD_CONTENT_IDS)
def test_bad_ids_are_rejected_by_name_too(keyword: str, value: str, why: str) -> None:
    ids: dict[str, Any] = {"session_id": "s", "workspace_id": "w", keyword: value}
    with pytest.raises(ValueError, match=re.escape(why)):
        SandboxSpec(**ids)


@pytest.mark.parametrize("field", ["sessionId", "workspaceId"])
@pytest.mark.parametrize(
    ("value", "why"),
    [
        pytest.param("", "Expected `str` of length >= 1", id="empty"),
        pytest.param("x" * 257, "Expected `str` of length <= 256", id="too-long"),
    ],
)
def test_id_lengths_are_checked_at_the_field(field: str, value: str, why: str) -> None:
    assert f"invalid SandboxSpec: {field}: {why}" in bad_spec_message(spec_with(**{field: value}))


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
    assert "mode: Invalid enum value 'yolo'" in bad_spec_message(spec_with(mode="yolo"))


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


# --- JSON Schema --------------------------------------------------------------------------------


def test_spec_json_schema_uses_the_json_names() -> None:
    schema = spec_json_schema()
    assert schema["$ref"] == "#/$defs/SandboxSpec"
    spec = schema["$defs"]["SandboxSpec"]
    assert spec["type"] == "object"
    assert set(spec["properties"]) == set(parse_spec(MINIMAL).to_json())
    assert {"sessionId", "workspaceId", "bindMounts", "capabilities"} <= set(spec["properties"])
    assert spec["required"] == ["sessionId", "workspaceId"]
    assert spec["properties"]["bindMounts"]["items"] == {"$ref": "#/$defs/SandboxBindMount"}


def test_spec_json_schema_forbids_unknown_fields_everywhere() -> None:
    defs = spec_json_schema()["$defs"]
    for name in ("SandboxSpec", "SandboxBindMount", "AgentCapabilities"):
        assert defs[name]["additionalProperties"] is False, name


def test_spec_json_schema_nested_models_and_constraints() -> None:
    defs = spec_json_schema()["$defs"]
    assert set(defs["SandboxBindMount"]["properties"]) == {
        "hostPath", "guestPath", "readOnly", "hostSockets"
    }
    assert defs["SandboxBindMount"]["required"] == ["hostPath"]
    assert set(defs["AgentCapabilities"]["properties"]) == set(AgentCapabilities().to_json())
    assert "canCallGitHubApi" in defs["AgentCapabilities"]["properties"]
    assert set(defs["Mode"]["enum"]) == {m.value for m in Mode}
    session = defs["SandboxSpec"]["properties"]["sessionId"]
    assert (session["minLength"], session["maxLength"]) == (1, 256)
    assert defs["SandboxSpec"]["properties"]["networkEnabled"]["default"] is True


def test_spec_json_schema_is_json() -> None:
    schema = spec_json_schema()
    # Tuple defaults come back as tuples; a JSON encoder writes them as arrays.
    decoded = json.loads(json.dumps(schema))
    assert decoded["$defs"]["SandboxSpec"]["properties"]["bindMounts"]["default"] == []
    assert spec_json_schema() is not schema  # a fresh copy each call, safe to edit


@pytest.mark.parametrize("keyword", ["session_id", "workspace_id"])
@pytest.mark.parametrize("value", ["", "x" * 257], ids=["empty", "too-long"])
def test_id_lengths_are_checked_by_name_too(keyword: str, value: str) -> None:
    ids: dict[str, Any] = {"session_id": "s", "workspace_id": "w", keyword: value}
    with pytest.raises(ValueError, match="must be 1 to 256 characters"):
        SandboxSpec(**ids)
