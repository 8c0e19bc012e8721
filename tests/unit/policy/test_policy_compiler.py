"""compile_policy against fake hosts: the mode table, the deny sets in both spellings, globs."""

from __future__ import annotations

import dataclasses
import posixpath
from collections import Counter
from typing import Any

import pytest
from policy_fakes import FAKE_HOME, MakeHost

from cc_server.errors import BadSpec
from cc_server.policy import (
    STANDARD_DENY_CREATE_GLOBS,
    CompiledPolicy,
    HostFacts,
    Mode,
    Mount,
    MountKind,
    PathRule,
    SandboxSpec,
    compile_policy,
    parse_spec,
    spellings,
)
from cc_server.policy.compiler import MAX_GLOB_LENGTH
from cc_server.policy.paths import (
    HOME_MANDATORY_DENY_WRITE,
    ROOT_MANDATORY_DENY_WRITE,
    SECRET_DENY_READ,
    SYSTEM_DENY_READ,
)

ALL_MODES = list(Mode)
READ_ONLY_MODES = [m for m in Mode if m is not Mode.CHAT]
PROTECTED_REASON = "protected path (registered checkout)"


def make_spec(**fields: Any) -> SandboxSpec:
    """A spec with a writable bind (/tmp/work), a read-only bind (/opt/ro), a runner state dir
    (/tmp/state) and a protected checkout (/tmp/checkout); `fields` (JSON names) override."""
    data: dict[str, Any] = {
        "sessionId": "space-1",
        "workspaceId": "ws-1",
        "bindMounts": [
            {"hostPath": "/tmp/work"},
            {"hostPath": "/opt/ro", "readOnly": True},
        ],
        "runnerStateDirs": ["/tmp/state"],
        "protectedPaths": ["/tmp/checkout"],
    }
    data.update(fields)
    return parse_spec(data)


def paths(rules: tuple[PathRule, ...]) -> list[str]:
    return [r.path for r in rules]


def no_realpath(path: str) -> str:
    raise AssertionError(f"realpath must not be called for {path!r}")


# --- the mode table ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ALL_MODES)
def test_mode_table_mounts(mode: Mode, host: HostFacts) -> None:
    policy = compile_policy(make_spec(mode=mode.value), host)
    tag = "bind mount" if mode is Mode.CHAT else f"bind mount ({mode.value})"
    assert policy.mounts == (
        Mount(
            host_path="/private/tmp/work",
            literal_path="/tmp/work",
            guest_path="/tmp/work",
            writable=mode is Mode.CHAT,
            reason=tag,
        ),
        Mount(
            host_path="/opt/ro",
            literal_path="/opt/ro",
            guest_path="/opt/ro",
            writable=False,
            reason=tag,
        ),
        Mount(
            host_path="/private/tmp/state",
            literal_path="/tmp/state",
            guest_path="/tmp/state",
            writable=True,
            reason="runner state directory",
            kind=MountKind.RUNNER_STATE,
        ),
    )


@pytest.mark.parametrize("mode", ALL_MODES)
def test_writable_roots_per_mode(mode: Mode, host: HostFacts) -> None:
    policy = compile_policy(make_spec(mode=mode.value), host)
    if mode is Mode.CHAT:
        assert policy.writable_roots == ("/private/tmp/work", "/private/tmp/state")
    else:
        assert policy.writable_roots == ("/private/tmp/state",)


def test_bind_mount_keeps_its_guest_path(host: HostFacts) -> None:
    spec = make_spec(bindMounts=[{"hostPath": "/tmp/work", "guestPath": "/workspace"}])
    (mount, _state) = compile_policy(spec, host).mounts
    assert mount.guest_path == "/workspace"
    assert mount.literal_path == "/tmp/work"
    assert mount.host_path == "/private/tmp/work"


def test_writable_roots_keep_mount_order(make_host: MakeHost) -> None:
    host = make_host(existing={"/b", "/a", "/c", "/s"})
    spec = make_spec(
        bindMounts=[{"hostPath": "/b"}, {"hostPath": "/a", "readOnly": True}, {"hostPath": "/c"}],
        runnerStateDirs=["/s"],
    )
    assert compile_policy(spec, host).writable_roots == ("/b", "/c", "/s")


@pytest.mark.parametrize("mode", ALL_MODES)
def test_protected_paths_are_denied_writes_in_every_mode(mode: Mode, host: HostFacts) -> None:
    policy = compile_policy(make_spec(mode=mode.value), host)
    assert PathRule(path="/tmp/checkout", reason=PROTECTED_REASON) in policy.deny_write
    assert PathRule(path="/private/tmp/checkout", reason=PROTECTED_REASON) in policy.deny_write


def test_protected_paths_come_first_in_deny_write(host: HostFacts) -> None:
    policy = compile_policy(make_spec(protectedPaths=["/Users/dev/repo", "/tmp/x"]), host)
    assert paths(policy.deny_write)[:3] == ["/Users/dev/repo", "/tmp/x", "/private/tmp/x"]


# --- mandatory deny-write --------------------------------------------------------------------


def under(root: str, entries: tuple[tuple[str, str], ...]) -> set[str]:
    return {posixpath.join(root, rel) for rel, _ in entries}


@pytest.mark.parametrize("mode", ALL_MODES)
def test_mandatory_names_under_home_and_every_writable_root(mode: Mode, host: HostFacts) -> None:
    denied = set(paths(compile_policy(make_spec(mode=mode.value), host).deny_write))
    writable = ["/tmp/state", "/private/tmp/state"]
    if mode is Mode.CHAT:
        writable += ["/tmp/work", "/private/tmp/work"]
    for root in [FAKE_HOME, *writable]:
        missing = under(root, ROOT_MANDATORY_DENY_WRITE) - denied
        assert not missing, f"{root}: {sorted(missing)}"


@pytest.mark.parametrize("mode", ALL_MODES)
def test_mandatory_names_not_under_read_only_mounts(mode: Mode, host: HostFacts) -> None:
    denied = paths(compile_policy(make_spec(mode=mode.value), host).deny_write)
    read_only = ["/opt/ro/"]
    if mode is not Mode.CHAT:
        read_only += ["/tmp/work/", "/private/tmp/work/"]
    offending = [p for p in denied if p.startswith(tuple(read_only))]
    assert offending == []


def test_mandatory_rules_carry_their_reasons(host: HostFacts) -> None:
    policy = compile_policy(make_spec(), host)
    by_path = {r.path: r.reason for r in policy.deny_write}
    for rel, why in ROOT_MANDATORY_DENY_WRITE:
        assert by_path[posixpath.join("/private/tmp/work", rel)] == why
    for rel, why in HOME_MANDATORY_DENY_WRITE:
        assert by_path[posixpath.join(FAKE_HOME, rel)] == why


def test_home_mandatory_entries_only_under_home(host: HostFacts) -> None:
    denied = set(paths(compile_policy(make_spec(), host).deny_write))
    assert under(FAKE_HOME, HOME_MANDATORY_DENY_WRITE) <= denied
    for root in ["/tmp/work", "/private/tmp/work", "/tmp/state", "/private/tmp/state"]:
        assert not under(root, HOME_MANDATORY_DENY_WRITE) & denied, root


def test_symlinked_home_gets_both_spellings(make_host: MakeHost) -> None:
    host = make_host(home="/tmp/home")
    policy = compile_policy(make_spec(bindMounts=[], runnerStateDirs=[]), host)
    denied = set(paths(policy.deny_write))
    assert under("/tmp/home", ROOT_MANDATORY_DENY_WRITE) <= denied
    assert under("/private/tmp/home", ROOT_MANDATORY_DENY_WRITE) <= denied
    assert under("/private/tmp/home", HOME_MANDATORY_DENY_WRITE) <= denied
    read = set(paths(policy.deny_read))
    assert {"/tmp/home/.ssh", "/private/tmp/home/.ssh"} <= read


@pytest.mark.parametrize(("home", "expected"), [("/Users/dev/", "/Users/dev"), ("/", "")])
def test_home_with_trailing_slash(make_host: MakeHost, home: str, expected: str) -> None:
    policy = compile_policy(make_spec(bindMounts=[], runnerStateDirs=[]), make_host(home=home))
    assert f"{expected}/.ssh" in paths(policy.deny_read)
    assert f"{expected}/.bashrc" in paths(policy.deny_write)
    assert not any("//" in p for p in paths(policy.deny_read) + paths(policy.deny_write))


# --- deny-read -------------------------------------------------------------------------------


def test_secret_deny_read_has_the_five_spec_paths_and_the_system_set(host: HostFacts) -> None:
    read = paths(compile_policy(make_spec(), host).deny_read)
    for rel in [".ssh", ".aws", ".gnupg", ".config/gh", "Library/Keychains"]:
        assert f"{FAKE_HOME}/{rel}" in read
    assert under(FAKE_HOME, SECRET_DENY_READ) <= set(read)
    assert {p for p, _ in SYSTEM_DENY_READ} <= set(read)


def test_deny_read_reasons(host: HostFacts) -> None:
    by_path = {r.path: r.reason for r in compile_policy(make_spec(), host).deny_read}
    assert by_path[f"{FAKE_HOME}/.ssh"] == "SSH private keys, agent sockets and known hosts"
    assert by_path["/etc/shadow"] == "password hashes"


@pytest.mark.parametrize("mode", ALL_MODES)
def test_deny_read_does_not_depend_on_mode(mode: Mode, host: HostFacts) -> None:
    chat = compile_policy(make_spec(), host).deny_read
    assert compile_policy(make_spec(mode=mode.value), host).deny_read == chat


def test_system_paths_get_their_resolved_spelling(make_host: MakeHost) -> None:
    # macOS: /etc -> /private/etc.
    host = make_host(links={"/etc": "/private/etc"})
    read = paths(compile_policy(make_spec(bindMounts=[], runnerStateDirs=[]), host).deny_read)
    for path, _ in SYSTEM_DENY_READ:
        assert path in read
        assert "/private" + path in read
        assert read.index("/private" + path) == read.index(path) + 1


# --- both spellings --------------------------------------------------------------------------


def test_every_deny_path_appears_literal_and_resolved(make_host: MakeHost) -> None:
    host = make_host(
        home="/tmp/home",
        links={"/tmp": "/private/tmp", "/etc": "/private/etc", "/tmp/home/.aws": "/vault/aws"},
        existing={"/tmp/work", "/tmp/state", "/opt/ro"},
    )
    fs_realpath = host.realpath
    policy = compile_policy(make_spec(), host)
    for rule_set in (policy.deny_read, policy.deny_write):
        listed = set(paths(rule_set))
        for path in listed:
            assert fs_realpath(path) in listed, path
    assert "/vault/aws" in paths(policy.deny_read)


def test_spellings_literal_then_resolved() -> None:
    assert spellings("/tmp/x", lambda p: "/private" + p) == ("/tmp/x", "/private/tmp/x")


def test_spellings_once_when_already_resolved() -> None:
    assert spellings("/usr/x", lambda p: p) == ("/usr/x",)


@pytest.mark.parametrize("glob", ["/tmp/*.pem", "/tmp/key?", "/Users/*/.ssh", "*"])
def test_spellings_leave_globs_alone(glob: str) -> None:
    assert spellings(glob, no_realpath) == (glob,)


@pytest.mark.parametrize("error", [OSError("loop"), FileNotFoundError("gone"), ValueError("nul")])
def test_spellings_keep_an_unresolvable_path_as_written(error: Exception) -> None:
    def failing(path: str) -> str:
        raise error

    assert spellings("/tmp/x", failing) == ("/tmp/x",)


def test_unresolvable_protected_path_is_kept_as_written(make_host: MakeHost) -> None:
    host = make_host(existing={"/tmp/work", "/tmp/state", "/opt/ro"}, unresolvable={"/tmp/gone"})
    policy = compile_policy(make_spec(protectedPaths=["/tmp/gone"]), host)
    assert PathRule(path="/tmp/gone", reason=PROTECTED_REASON) in policy.deny_write
    assert "/private/tmp/gone" not in paths(policy.deny_write)


def test_no_duplicate_deny_paths(make_host: MakeHost) -> None:
    # Home is also a writable bind and a runner state dir, and a protected path repeats a
    # mandatory one: every path is still listed once, with the first reason that named it.
    host = make_host(existing={FAKE_HOME, "/tmp/work", "/tmp/state"})
    spec = make_spec(
        bindMounts=[{"hostPath": FAKE_HOME}, {"hostPath": "/tmp/work"}],
        runnerStateDirs=["/tmp/state", "/tmp/work"],
        protectedPaths=["/tmp/checkout", "/tmp/checkout", f"{FAKE_HOME}/.bashrc"],
    )
    policy = compile_policy(spec, host)
    for rule_set in (policy.deny_read, policy.deny_write):
        counts = Counter(paths(rule_set))
        assert [p for p, n in counts.items() if n > 1] == []
    by_path = {r.path: r.reason for r in policy.deny_write}
    assert by_path[f"{FAKE_HOME}/.bashrc"] == PROTECTED_REASON


def test_home_as_writable_root_adds_nothing_new(make_host: MakeHost) -> None:
    host = make_host(existing={FAKE_HOME})
    bare = compile_policy(make_spec(bindMounts=[], runnerStateDirs=[], protectedPaths=[]), host)
    with_home = compile_policy(
        make_spec(bindMounts=[{"hostPath": FAKE_HOME}], runnerStateDirs=[], protectedPaths=[]),
        host,
    )
    assert with_home.deny_write == bare.deny_write
    assert with_home.writable_roots == (FAKE_HOME,)


# --- existence checks ------------------------------------------------------------------------


def test_missing_bind_source_is_a_bad_spec(make_host: MakeHost) -> None:
    host = make_host(existing={"/tmp/state", "/opt/ro"})
    with pytest.raises(BadSpec, match=r"bind mount hostPath '/tmp/work' does not exist") as info:
        compile_policy(make_spec(), host)
    assert info.value.fix == "create it first or remove it from bindMounts"


def test_missing_read_only_bind_source_is_a_bad_spec_too(make_host: MakeHost) -> None:
    host = make_host(existing={"/tmp/work", "/tmp/state"})
    with pytest.raises(BadSpec, match="'/opt/ro' does not exist"):
        compile_policy(make_spec(mode="review"), host)


def test_missing_runner_state_dir_is_a_bad_spec(make_host: MakeHost) -> None:
    host = make_host(existing={"/tmp/work", "/opt/ro"})
    with pytest.raises(BadSpec, match=r"runnerStateDirs entry '/tmp/state' does not exist") as e:
        compile_policy(make_spec(), host)
    assert e.value.fix == "create the runner state directory before launch"


def test_protected_paths_need_not_exist(make_host: MakeHost) -> None:
    host = make_host(existing={"/tmp/work", "/tmp/state", "/opt/ro"})
    compile_policy(make_spec(protectedPaths=["/nowhere/at/all"]), host)


# --- create-time globs -----------------------------------------------------------------------


def test_no_globs_by_default(host: HostFacts) -> None:
    policy = compile_policy(make_spec(), host)
    assert policy.deny_create_globs == ()
    assert policy.requires_create_rules is False


def test_standard_globs_are_carried(host: HostFacts) -> None:
    policy = compile_policy(make_spec(), host, deny_create_globs=STANDARD_DENY_CREATE_GLOBS)
    assert policy.deny_create_globs == (".env", "*.key", "*.pem")
    assert policy.requires_create_rules is True


def test_globs_are_deduplicated_in_order(host: HostFacts) -> None:
    globs = (g for g in ["*.pem", ".env", "*.pem", "*.key", ".env"])
    policy = compile_policy(make_spec(), host, deny_create_globs=globs)
    assert policy.deny_create_globs == ("*.pem", ".env", "*.key")


def test_longest_glob_is_accepted(host: HostFacts) -> None:
    glob = "a" * MAX_GLOB_LENGTH
    assert compile_policy(make_spec(), host, deny_create_globs=[glob]).deny_create_globs == (glob,)


@pytest.mark.parametrize(
    "glob",
    [
        pytest.param("", id="empty"),
        pytest.param("a/b", id="slash"),
        pytest.param("/abs.pem", id="absolute"),
        pytest.param("a\x00b", id="nul"),
        pytest.param("a" * (MAX_GLOB_LENGTH + 1), id="too-long"),
    ],
)
def test_malformed_globs_are_bad_specs(host: HostFacts, glob: str) -> None:
    with pytest.raises(BadSpec, match="must be one non-empty file name pattern") as info:
        compile_policy(make_spec(), host, deny_create_globs=[".env", glob])
    assert info.value.fix == "write it as a name pattern such as '*.pem' or '.env'"


# --- network and carried fields -------------------------------------------------------------


@pytest.mark.parametrize(("enabled", "capable"), [(False, True), (True, False), (False, False)])
def test_egress_allowlist_is_emptied_when_network_is_off(
    host: HostFacts, enabled: bool, capable: bool
) -> None:
    spec = make_spec(
        networkEnabled=enabled,
        capabilities={"canUseNetwork": capable},
        egressAllowlist=["*.example.com"],
    )
    policy = compile_policy(spec, host)
    assert policy.network_allowed is False
    assert policy.egress_allowlist == ()


def test_egress_allowlist_is_kept_when_network_is_allowed(host: HostFacts) -> None:
    spec = make_spec(egressAllowlist=["*.example.com", "bedrock.*.amazonaws.com"])
    policy = compile_policy(spec, host)
    assert policy.network_allowed is True
    assert policy.egress_allowlist == ("*.example.com", "bedrock.*.amazonaws.com")


def test_carried_fields(host: HostFacts) -> None:
    spec = make_spec(
        mode="plan",
        guestWorkdir="/tmp/work",
        capabilities={"canPush": True},
        execGrantRoots=["/opt/tools", "/tmp/bin"],
    )
    policy = compile_policy(spec, host)
    assert policy.session_id == "space-1"
    assert policy.mode is Mode.PLAN
    assert policy.workdir == "/tmp/work"
    assert policy.capabilities == spec.capabilities
    assert policy.capabilities.earns_github is True
    assert policy.exec_grant_roots == ("/opt/tools", "/tmp/bin")


def test_compile_is_pure(host: HostFacts) -> None:
    spec = make_spec()
    assert compile_policy(spec, host) == compile_policy(spec, host)


@pytest.mark.parametrize(
    ("value", "attribute"),
    [
        (PathRule(path="/a", reason="r"), "path"),
        (
            Mount(host_path="/a", literal_path="/a", guest_path="/a", writable=False, reason="r"),
            "writable",
        ),
    ],
)
def test_rule_and_mount_are_frozen(value: Any, attribute: str) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, attribute, True)


def test_compiled_policy_is_frozen(host: HostFacts) -> None:
    policy: CompiledPolicy = compile_policy(make_spec(), host)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.network_allowed = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.mounts = ()  # type: ignore[misc]
    assert isinstance(policy.deny_read, tuple)
    assert isinstance(policy.deny_write, tuple)


def test_host_sockets_need_a_read_only_bind(host: HostFacts) -> None:
    # A writable bind that lets host listeners through is one hard link away from every other
    # socket on its filesystem (Anthropic sandbox-runtime's unix-socket-allowlist test drops
    # such an entry; here it is refused, with the fix).
    spec = make_spec(bindMounts=[{"hostPath": "/tmp/work", "hostSockets": True}])
    with pytest.raises(BadSpec, match="hostSockets needs readOnly") as err:
        compile_policy(spec, host)
    assert "readOnly: true" in (err.value.fix or "")
    ok = make_spec(bindMounts=[{"hostPath": "/tmp/work", "hostSockets": True, "readOnly": True}])
    assert compile_policy(ok, host).host_socket_dirs == ("/tmp/work",)


def test_default_cwd_is_the_workdir_else_the_first_bind_directory_else_home(
    make_host: MakeHost,
) -> None:
    """Told apart by the mount's kind, not its reason's text: a runner state directory or a
    profile's mount is never the default, even when it comes first."""
    existing = {"/tmp/work", "/tmp/state", "/opt/ro", "/private/tmp/work", "/private/tmp/state"}
    host = make_host(existing=existing)
    spec = make_spec(guestWorkdir="/tmp/work")
    assert compile_policy(spec, host).default_cwd(host) == "/tmp/work"
    policy = compile_policy(make_spec(), host)
    assert policy.default_cwd(host) == "/private/tmp/work"  # the first bind, resolved
    state_first = dataclasses.replace(policy, mounts=policy.mounts[::-1])
    assert state_first.mounts[0].kind is MountKind.RUNNER_STATE
    assert state_first.default_cwd(host) == "/opt/ro"  # the first bind: /tmp/state is skipped
    profile = dataclasses.replace(
        policy, mounts=tuple(dataclasses.replace(m, kind=MountKind.PROFILE) for m in policy.mounts)
    )
    assert profile.default_cwd(host) == FAKE_HOME
    # No bind is a directory (only the runner state directory is): $HOME.
    assert policy.default_cwd(make_host(existing={"/private/tmp/state"})) == FAKE_HOME
