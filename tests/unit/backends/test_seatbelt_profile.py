"""plan_seatbelt over a fake macOS host: whole profiles by exact equality with checked-in goldens,
every profile read back and checked as SBPL (seatbelt_sbpl), what the rules decide for the paths
that matter, what must NOT be in a profile, and hostile path names that must not add a rule.

Nothing here runs sandbox-exec: these tests pass on any OS. What only a Mac can show is listed in
docs/macos.md.

Goldens: tests/unit/backends/seatbelt_golden/*.txt hold `render_seatbelt_plan` of each case.
After an intended change, regenerate them with CC_SERVER_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest
from seatbelt_sbpl import ProfileError, Rule, allow_reasons_missing, check, decide, parse

from cc_server.backends.plan import Command, EgressBridge, LaunchPlan
from cc_server.backends.seatbelt import (
    DNS_SOCKET,
    build_profile,
    darwin_user_temp_dir,
    glob_regex,
    message_for,
    plan_seatbelt,
    render_seatbelt_plan,
    session_tag_for,
)
from cc_server.errors import BadSpec, EnforcementFailed
from cc_server.policy import (
    STANDARD_DENY_CREATE_GLOBS,
    AgentCapabilities,
    CompiledPolicy,
    HostFacts,
    Mode,
    Mount,
    MountKind,
    PathRule,
    Platform,
    SandboxBackend,
    compile_policy,
    parse_spec,
    spellings,
)

GOLDEN_DIR = Path(__file__).parent / "seatbelt_golden"
SANDBOX_EXEC = "/usr/bin/sandbox-exec"
HOME = "/Users/dev"
TEMP = "/var/folders/zz/abc123/T"
TEMP_RESOLVED = "/private" + TEMP
EGRESS_BASE = TEMP + "/cc-server-501"
EGRESS_DIR = EGRESS_BASE + "/egress-4242-0123456789abcdef"
HTTP_PORT, SOCKS_PORT = 50001, 50002
TAG = "s0"
MESSAGE = message_for(TAG)

# macOS's own symlinks: the kernel matches rules against the right-hand side.
MACOS_LINKS: Mapping[str, str] = {"/tmp": "/private/tmp", "/var": "/private/var",
                                  "/etc": "/private/etc"}
DIRS = {
    HOME,
    f"{HOME}/.ssh",
    f"{HOME}/proj",  # a registered checkout: protected
    f"{HOME}/ref",  # bound read-only
    f"{HOME}/.cc-state",  # a runner state dir
    f"{HOME}/.local/bin",  # an exec grant root
    "/private/tmp/work",  # bound as /tmp/work: the symlinked spelling
    TEMP_RESOLVED,
    "/private/etc/ssh",
}
FILES = {f"{HOME}/.netrc", "/private/etc/ssh/ssh_host_ed25519_key"}


def _resolve(path: str) -> str:
    for link, target in MACOS_LINKS.items():
        if path == link or path.startswith(link + "/"):
            return target + path[len(link):]
    return path


def make_host(extra_dirs: Iterable[str] = ()) -> HostFacts:
    dirs = {*DIRS, *(_resolve(d) for d in extra_dirs)}
    known = dirs | FILES | set(MACOS_LINKS) | {posixpath.dirname(p) for p in dirs | FILES}

    def exists(path: str) -> bool:
        return _resolve(path) in known or path in MACOS_LINKS

    def is_dir(path: str) -> bool:
        return _resolve(path) in dirs

    return HostFacts(platform=Platform.MACOS, home=HOME, realpath=_resolve, exists=exists,
                     is_dir=is_dir)


HOST = make_host()


def spec_data(mode: str = "chat", **overrides: object) -> dict[str, object]:
    data: dict[str, object] = {
        "sessionId": "space-7",
        "workspaceId": "ws-1",
        "mode": mode,
        "bindMounts": [{"hostPath": "/tmp/work"}, {"hostPath": f"{HOME}/ref", "readOnly": True}],
        "protectedPaths": [f"{HOME}/proj"],
        "runnerStateDirs": [f"{HOME}/.cc-state"],
        "execGrantRoots": [f"{HOME}/.local/bin"],
    }
    data.update(overrides)
    return data


def policy_for(mode: str = "chat", host: HostFacts = HOST, **overrides: object) -> CompiledPolicy:
    spec = parse_spec(spec_data(mode, **overrides))
    return compile_policy(spec, host, deny_create_globs=STANDARD_DENY_CREATE_GLOBS)


BRIDGE = EgressBridge(socket_dir=EGRESS_DIR, base_dir=EGRESS_BASE, http_port=HTTP_PORT,
                      socks_port=SOCKS_PORT)
COMMAND = Command(argv=("git", "status"), env=(("LANG", "en_US.UTF-8"),), egress=BRIDGE)


def plan(
    policy: CompiledPolicy,
    command: Command = COMMAND,
    *,
    host: HostFacts = HOST,
    share_net: bool = False,
    temp_dir: str | None = TEMP,
) -> LaunchPlan:
    return plan_seatbelt(policy, command, host=host, sandbox_exec=SANDBOX_EXEC, session_tag=TAG,
                         temp_dir=temp_dir, share_net=share_net)


def profile_of(launch: LaunchPlan) -> tuple[str, list[tuple[str, str]]]:
    words = [str(w) for w in launch.argv]
    end = words.index("--")
    params = []
    for word in words[3:end]:
        assert word.startswith("-D"), word
        name, _, value = word[2:].partition("=")
        params.append((name, value))
    return words[2], params


def rules_of(launch: LaunchPlan) -> list[Rule]:
    text, params = profile_of(launch)
    try:
        return check(text, params, message=MESSAGE)
    except ProfileError as exc:
        raise AssertionError(f"{exc}\n--- profile ---\n{text}") from None


def terminal_policy(workdir: str = "/tmp/work") -> CompiledPolicy:
    """The terminal's fixed profile (spec, "Server-hosted terminal"), built as the terminal
    package does: $HOME and the working dir writable, the five secret paths read-denied."""
    mounts = [Mount(host_path=_resolve(p), literal_path=p, guest_path=p, writable=True, reason=r,
                    kind=MountKind.PROFILE)
              for p, r in ((HOME, "terminal profile: $HOME"), (workdir, "terminal profile: cwd"))]
    deny_read = [PathRule(path=s, reason=reason)
                 for rel, reason in ((".ssh", "SSH keys"), (".aws", "AWS credentials"),
                                     (".gnupg", "GnuPG keys"), (".config/gh", "GitHub CLI token"),
                                     ("Library/Keychains", "macOS keychains"))
                 for s in spellings(f"{HOME}/{rel}", _resolve)]
    return CompiledPolicy(
        session_id="term-1", mode=Mode.CHAT, mounts=tuple(mounts), deny_read=tuple(deny_read),
        deny_write=(), deny_create_globs=(), workdir=workdir, network_allowed=True,
        egress_allowlist=(), capabilities=AgentCapabilities(), exec_grant_roots=(),
    )


# --- goldens --------------------------------------------------------------------------------------

NO_EGRESS = dataclasses.replace(COMMAND, egress=None)
CASES: dict[str, tuple[CompiledPolicy, Command, bool]] = {
    "chat": (policy_for("chat"), COMMAND, False),
    "review": (policy_for("review"), COMMAND, False),
    "plan": (policy_for("plan"), COMMAND, False),
    "orchestrate": (policy_for("orchestrate"), COMMAND, False),
    "chat_network_off": (policy_for("chat", networkEnabled=False), COMMAND, False),
    "chat_no_egress_bridge": (policy_for("chat"), NO_EGRESS, False),
    "terminal": (terminal_policy(), NO_EGRESS, True),
}


def _case_plan(name: str) -> LaunchPlan:
    policy, command, share_net = CASES[name]
    return plan(policy, command, share_net=share_net)


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_plan_matches_its_golden(name: str) -> None:
    rendered = render_seatbelt_plan(_case_plan(name)) + "\n"
    golden = GOLDEN_DIR / f"{name}.txt"
    if os.environ.get("CC_SERVER_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(rendered, encoding="utf-8")
    expected = golden.read_text(encoding="utf-8")
    assert rendered == expected, f"{name} differs from {golden}; rendered:\n{rendered}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_profile_is_valid_sbpl_with_reasons(name: str) -> None:
    launch = _case_plan(name)
    rules_of(launch)  # parses, and every operation, filter, parameter and message checks out
    text, _ = profile_of(launch)
    assert allow_reasons_missing(text) == [], text


@pytest.mark.parametrize("mode", ["review", "plan", "orchestrate"])
def test_network_off_changes_only_the_note_in_read_only_modes(mode: str) -> None:
    on = plan(policy_for(mode))
    off = plan(policy_for(mode, networkEnabled=False))
    assert on.argv == off.argv  # the proxies decide; the profile reaches them either way
    assert on.env == off.env
    assert "refuse every connection" in " ".join(off.notes)


# --- the checker itself ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("(version 1)\n(allow file-wrtie* (subpath \"/x\"))", "unknown operation"),
        ("(version 1)\n(allow file-write* (subpth \"/x\"))", "unknown filter"),
        ("(version 1)\n(allow network-outbound (remote ip \"10.0.0.1:80\"))", "localhost"),
        ("(version 1)\n(allow network-outbound (remote tcpp \"*:80\"))", "KIND"),
        ("(version 1)\n(allow file-write* (subpath \"x\"))", "absolute"),
        ("(version 1)\n(allow file-write* (subpath (param \"NOPE\")))", "not given"),
        ("(version 1)\n(deny file-read* (subpath \"/x\"))", "message"),
        ("(version 1)\n(deny file-read* (subpath \"/x\") (with mesage \"cc-s0\"))", "modifier"),
        ("(version 1)\n(allow file-read* (subpath \"/x\")", "unbalanced"),
        ("(allow default)", "version"),
        ("(version 1)\n(define x 1)", "only (allow"),
    ],
)
def test_the_checker_rejects_what_seatbelt_would(text: str, problem: str) -> None:
    with pytest.raises(ProfileError, match=re.escape(problem)):
        check(text, [], message=MESSAGE)


def test_the_checker_rejects_unused_parameters() -> None:
    with pytest.raises(ProfileError, match="never used"):
        check("(version 1)\n(allow default)", [("EXTRA", "/x")], message=MESSAGE)


def test_the_checker_reads_strings_regexes_and_comments() -> None:
    forms = parse('(a "x\\"y" #"^/dev/ttys[0-9]+$") ; (not a form)\n')
    assert len(forms) == 1


# --- what the rules decide ------------------------------------------------------------------------

MODES = ["chat", "review", "plan", "orchestrate"]


def _write_ops() -> list[str]:
    return ["file-write-create", "file-write-data", "file-write-unlink", "file-write-mode"]


@pytest.mark.parametrize("mode", MODES)
def test_writes_outside_the_roots_are_denied(mode: str) -> None:
    rules = rules_of(plan(policy_for(mode)))
    for path in (f"{HOME}/notes.txt", f"{HOME}/Library/LaunchAgents/x.plist", "/private/tmp/x",
                 "/usr/local/bin/x", "/private/var/folders/zz/other/T/x", f"{HOME}/ref/x"):
        for op in _write_ops():
            assert decide(rules, op, path) == "deny", (mode, op, path)


def test_chat_writes_inside_the_writable_bind_in_its_resolved_spelling() -> None:
    rules = rules_of(plan(policy_for("chat")))
    assert decide(rules, "file-write-create", "/private/tmp/work/src/main.c") == "allow"
    assert decide(rules, "file-write-data", "/private/tmp/work/build/out.o") == "allow"


@pytest.mark.parametrize("mode", ["review", "plan", "orchestrate"])
def test_read_only_modes_do_not_write_the_binds(mode: str) -> None:
    rules = rules_of(plan(policy_for(mode)))
    assert decide(rules, "file-write-create", "/private/tmp/work/src/main.c") == "deny"


@pytest.mark.parametrize("mode", MODES)
def test_runner_state_and_temp_dir_are_writable_in_every_mode(mode: str) -> None:
    rules = rules_of(plan(policy_for(mode)))
    assert decide(rules, "file-write-create", f"{HOME}/.cc-state/session.json") == "allow"
    assert decide(rules, "file-write-create", f"{TEMP_RESOLVED}/tmp.123") == "allow"


def test_devices_a_shell_needs_are_writable() -> None:
    rules = rules_of(plan(policy_for("review")))
    for path in ("/dev/null", "/dev/tty", "/dev/fd/3", "/dev/ttys004", "/dev/ptmx"):
        assert decide(rules, "file-write-data", path) == "allow", path
    assert decide(rules, "file-write-data", "/dev/disk0") == "deny"


MANDATORY_INSIDE_ROOT = [
    ".bashrc", ".zshrc", ".profile", ".gitconfig", ".git/hooks/pre-commit", ".git/config",
    ".git/commondir", ".claude/settings.json", ".mcp.json", ".vscode/tasks.json",
]


@pytest.mark.parametrize("root", ["/private/tmp/work", f"{HOME}/.cc-state", HOME])
def test_mandatory_denies_hold_inside_writable_roots(root: str) -> None:
    rules = rules_of(plan(policy_for("chat")))
    for rel in MANDATORY_INSIDE_ROOT:
        for op in _write_ops():
            assert decide(rules, op, f"{root}/{rel}") == "deny", (op, root, rel)


def test_mandatory_denies_are_emitted_in_both_spellings() -> None:
    _, params = profile_of(plan(policy_for("chat")))
    values = {v for _, v in params}
    assert {"/tmp/work/.git/hooks", "/private/tmp/work/.git/hooks"} <= values
    assert {"/tmp/work/.bashrc", "/private/tmp/work/.bashrc"} <= values


@pytest.mark.parametrize("mode", MODES)
def test_no_allow_for_a_protected_path_in_any_mode(mode: str) -> None:
    protected = f"{HOME}/proj"
    # Even bound writable and inside it, and with the protected checkout itself bound.
    policy = policy_for(mode, host=make_host([f"{protected}/src"]),
                        bindMounts=[{"hostPath": protected}, {"hostPath": f"{protected}/src"},
                                    {"hostPath": "/tmp/work"}])
    launch = plan(policy, host=make_host([f"{protected}/src"]))
    rules = rules_of(launch)
    for rule in rules:
        if rule.action == "allow":
            for flt in rule.filters:
                assert not (flt.value == protected or flt.value.startswith(protected + "/")), rule
    for path in (protected, f"{protected}/src/a.c", f"{protected}/.git/HEAD"):
        for op in _write_ops():
            assert decide(rules, op, path) == "deny", (mode, op, path)


def test_protected_paths_hold_in_the_terminal_profile_too() -> None:
    # The terminal's fixed profile has none; a protected path given to a chat policy that also
    # makes $HOME writable (a bind of $HOME) is still denied.
    policy = policy_for("chat", bindMounts=[{"hostPath": HOME}])
    rules = rules_of(plan(policy))
    assert decide(rules, "file-write-data", f"{HOME}/proj/README") == "deny"
    assert decide(rules, "file-write-data", f"{HOME}/scratch.txt") == "allow"


@pytest.mark.parametrize("mode", MODES)
def test_every_denied_path_and_its_ancestors_cannot_be_renamed(mode: str) -> None:
    policy = policy_for(mode)
    rules = rules_of(plan(policy))
    denied = [r.path for r in (*policy.deny_write, *policy.deny_read)]
    assert denied
    for path in denied:
        assert decide(rules, "file-write-unlink", path) == "deny", path
        parent = posixpath.dirname(path)
        while parent != "/":
            assert decide(rules, "file-write-unlink", parent) == "deny", (path, parent)
            parent = posixpath.dirname(parent)


def test_renames_elsewhere_in_a_writable_root_stay_allowed() -> None:
    rules = rules_of(plan(policy_for("chat")))
    assert decide(rules, "file-write-unlink", "/private/tmp/work/src/old.c") == "allow"
    assert decide(rules, "file-write-unlink", "/private/tmp/work/build") == "allow"


def test_create_time_globs_are_regexes_enforced_on_new_files() -> None:
    rules = rules_of(plan(policy_for("chat")))
    for path in ("/private/tmp/work/.env", "/private/tmp/work/deep/er/.env",
                 "/private/tmp/work/server.key", "/private/tmp/work/certs/ca.pem",
                 f"{TEMP_RESOLVED}/x.pem"):
        assert decide(rules, "file-write-create", path) == "deny", path
    for path in ("/private/tmp/work/.envrc", "/private/tmp/work/a.pemx", "/private/tmp/work/key",
                 "/private/tmp/work/.env/inside-a-dir-named-env"):
        assert decide(rules, "file-write-create", path) == "allow", path


@pytest.mark.parametrize("mode", MODES)
def test_secrets_are_unreadable_and_unwritable_in_both_spellings(mode: str) -> None:
    rules = rules_of(plan(policy_for(mode)))
    for path in (f"{HOME}/.ssh/id_ed25519", f"{HOME}/.aws/credentials", f"{HOME}/.netrc",
                 f"{HOME}/.config/gh/hosts.yml", f"{HOME}/Library/Keychains/login.keychain-db",
                 "/etc/ssh/ssh_host_ed25519_key", "/private/etc/ssh/ssh_host_ed25519_key"):
        assert decide(rules, "file-read-data", path) == "deny", path
        assert decide(rules, "file-write-data", path) == "deny", path
    assert decide(rules, "file-read-data", f"{HOME}/proj/README") == "allow"
    assert decide(rules, "file-read-data", "/usr/lib/libSystem.B.dylib") == "allow"


def test_a_file_is_denied_by_literal_a_directory_by_subpath() -> None:
    rules = rules_of(plan(policy_for("chat")))
    kinds = {f.value: f.kind for r in rules if r.operations == ("file-read*",) for f in r.filters}
    assert kinds[f"{HOME}/.netrc"] == "literal"
    assert kinds[f"{HOME}/.ssh"] == "subpath"
    assert kinds[f"{HOME}/.aws"] == "subpath"  # missing now: a directory may appear later


def test_the_egress_directories_are_hidden_in_both_spellings() -> None:
    rules = rules_of(plan(policy_for("chat")))
    for base in (EGRESS_BASE, "/private" + EGRESS_BASE):
        for op in ("file-read-data", "file-write-create", "file-write-unlink"):
            assert decide(rules, op, f"{base}/token") == "deny", (op, base)
            assert decide(rules, op, f"{base}/egress-9-ffff/http.sock") == "deny", (op, base)


@pytest.mark.parametrize("mode", MODES)
def test_nothing_written_here_runs_except_under_grant_roots(mode: str) -> None:
    rules = rules_of(plan(policy_for(mode)))
    for path in (f"{HOME}/.cc-state/hook.sh", f"{TEMP_RESOLVED}/payload", f"{TEMP}/payload"):
        assert decide(rules, "process-exec", path) == "deny", path
    if mode == "chat":
        assert decide(rules, "process-exec", "/private/tmp/work/a.out") == "deny"
        assert decide(rules, "process-exec", "/tmp/work/a.out") == "deny"
    assert decide(rules, "process-exec", f"{HOME}/.local/bin/rg") == "allow"
    assert decide(rules, "process-exec", "/usr/bin/git") == "allow"


DANGEROUS = ["/usr/bin/osascript", "/usr/bin/open", "/usr/bin/security", "/bin/launchctl",
             "/usr/bin/sudo", "/usr/bin/shortcuts", "/usr/bin/crontab", "/usr/bin/pbpaste"]


def test_dangerous_binaries_stay_denied_even_under_a_grant_root() -> None:
    policy = policy_for("chat", execGrantRoots=["/usr/bin", "/bin"])
    rules = rules_of(plan(policy))
    for binary in DANGEROUS:
        assert decide(rules, "process-exec", binary) == "deny", binary
    assert decide(rules, "process-exec", "/usr/bin/git") == "allow"


def test_requests_to_services_outside_are_denied() -> None:
    rules = rules_of(plan(policy_for("chat")))
    for op in ("appleevent-send", "lsopen", "user-preference-write", "file-link", "file-clone"):
        assert decide(rules, op, "/private/tmp/work/x") == "deny", op


# --- network --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in CASES if n != "terminal"])
def test_no_blanket_network_allow_when_restricted(name: str) -> None:
    launch = _case_plan(name)
    text, _ = profile_of(launch)
    assert "(allow network*" not in text
    assert "(allow network-outbound)" not in text
    rules = rules_of(launch)
    for rule in rules:
        if rule.action == "allow" and any(op.startswith("network") for op in rule.operations):
            assert rule.filters, rule  # never unfiltered
            for flt in rule.filters:
                assert flt.value in (f"localhost:{HTTP_PORT}", f"localhost:{SOCKS_PORT}",
                                     DNS_SOCKET), rule
                assert not flt.value.startswith("*"), rule


def test_only_the_proxies_and_the_resolver_are_reachable() -> None:
    rules = rules_of(plan(policy_for("chat")))
    assert decide(rules, "network-outbound", f"localhost:{HTTP_PORT}") == "allow"
    assert decide(rules, "network-outbound", f"localhost:{SOCKS_PORT}") == "allow"
    assert decide(rules, "network-outbound", DNS_SOCKET) == "allow"
    for target in ("localhost:22", "localhost:5432", "*:443", "*:53",
                   "/private/var/run/docker.sock", f"{HOME}/.ssh/agent.sock"):
        assert decide(rules, "network-outbound", target) == "deny", target
    assert decide(rules, "network-bind", f"localhost:{HTTP_PORT}") == "deny"
    assert decide(rules, "network-inbound", "localhost:8080") == "deny"


def test_without_an_egress_bridge_there_is_no_network_at_all() -> None:
    rules = rules_of(_case_plan("chat_no_egress_bridge"))
    for target in (f"localhost:{HTTP_PORT}", DNS_SOCKET, "*:443"):
        assert decide(rules, "network-outbound", target) == "deny", target


def test_the_proxy_environment_names_the_session_ports() -> None:
    env = dict(plan(policy_for("chat")).env)
    assert env["HTTPS_PROXY"] == f"http://127.0.0.1:{HTTP_PORT}"
    assert env["ALL_PROXY"] == f"socks5h://127.0.0.1:{SOCKS_PORT}"
    assert f"127.0.0.1:{SOCKS_PORT}" in env["GIT_SSH_COMMAND"]
    assert env["LANG"] == "en_US.UTF-8"  # the command's own variables are kept
    assert env["TMPDIR"] == TEMP and env["HOME"] == HOME
    assert "HTTPS_PROXY" not in dict(_case_plan("chat_no_egress_bridge").env)


def test_an_egress_bridge_without_ports_is_refused() -> None:
    command = dataclasses.replace(COMMAND, egress=EgressBridge(socket_dir=EGRESS_DIR))
    with pytest.raises(EnforcementFailed, match="no TCP ports"):
        plan(policy_for("chat"), command)


@pytest.mark.parametrize("port", [0, 65536, -1])
def test_an_out_of_range_port_is_refused(port: int) -> None:
    bridge = dataclasses.replace(BRIDGE, http_port=port)
    with pytest.raises(EnforcementFailed, match="out of range"):
        plan(policy_for("chat"), dataclasses.replace(COMMAND, egress=bridge))


# --- the terminal's fixed profile -----------------------------------------------------------------


def test_terminal_profile_home_and_workdir_writable_network_open_five_secrets() -> None:
    launch = _case_plan("terminal")
    rules = rules_of(launch)
    assert decide(rules, "file-write-create", f"{HOME}/notes.txt") == "allow"
    assert decide(rules, "file-write-create", "/private/tmp/work/x") == "allow"
    assert decide(rules, "file-write-create", "/private/tmp/elsewhere") == "deny"
    for rel in (".ssh/id_rsa", ".aws/config", ".gnupg/pubring.kbx", ".config/gh/hosts.yml",
                "Library/Keychains/login.keychain-db"):
        assert decide(rules, "file-read-data", f"{HOME}/{rel}") == "deny", rel
    assert decide(rules, "file-read-data", f"{HOME}/.netrc") == "allow"  # not in the fixed five
    for target in ("*:443", "localhost:22", DNS_SOCKET):
        assert decide(rules, "network-outbound", target) == "allow", target
    assert not any(r.action == "deny" and any(o.startswith("network") for o in r.operations)
                   for r in rules)
    assert "network: open" in " ".join(launch.notes)


def test_terminal_profile_refuses_an_egress_bridge() -> None:
    with pytest.raises(EnforcementFailed, match="network shared"):
        plan(terminal_policy(), COMMAND, share_net=True)


# --- hostile path names ---------------------------------------------------------------------------

HOSTILE = [
    'quote"name',
    "back\\slash",
    "paren(s)",
    'x")) (allow default) ((',
    "new\nline",
    "new\n(allow file-write* (subpath \"/\"))",
    "bracket[abc",
    "star*name",
    "question?mark",
    "ünïcødé-名前",
    "semi;colon",
    "hash#\"regex\"",
    "dollar$^anchor",
    "tab\tand space",
]


def _hostile_case(name: str) -> tuple[CompiledPolicy, HostFacts]:
    bound = f"/private/tmp/{name}"
    host = make_host([bound, f"{HOME}/{name}"])
    policy = policy_for(
        "chat",
        host=host,
        bindMounts=[{"hostPath": bound}],
        protectedPaths=[f"{HOME}/{name}"],
        runnerStateDirs=[],
        execGrantRoots=[f"/opt/{name}"],
    )
    return policy, host


def _shape(rules: list[Rule]) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    return [(r.action, r.operations, tuple(f.kind for f in r.filters)) for r in rules]


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_path_is_a_parameter_and_cannot_add_a_rule(name: str) -> None:
    policy, host = _hostile_case(name)
    launch = plan(policy, host=host)
    text, params = profile_of(launch)
    # Never in the profile text; always exactly as written in a -D value.
    assert name not in text
    assert f"-DWRITABLE_ROOT_0=/private/tmp/{name}" in [str(w) for w in launch.argv]
    assert (dict(params)["WRITABLE_ROOT_0"]) == f"/private/tmp/{name}"
    # The same rules, filter kinds and allows as for a plain name (a glob character only turns
    # a deny's subpath into a regex, which denies no less).
    plain_policy, plain_host = _hostile_case("plain")
    plain = rules_of(plan(plain_policy, host=plain_host))
    hostile = rules_of(launch)
    if "*" in name or "?" in name:
        assert len(hostile) == len(plain)
        assert [r.action for r in hostile] == [r.action for r in plain]
    else:
        assert _shape(hostile) == _shape(plain)
    allows = [(r.operations, tuple(f.value for f in r.filters)) for r in hostile
              if r.action == "allow"]
    plain_allows = [(r.operations, tuple(f.value.replace("plain", name) for f in r.filters))
                    for r in plain if r.action == "allow"]
    assert allows == plain_allows
    # And the rules still mean what they say for that exact path.
    assert decide(hostile, "file-write-create", f"/private/tmp/{name}/f") == "allow"
    assert decide(hostile, "file-write-create", "/private/tmp/other/f") == "deny"
    assert decide(hostile, "file-write-data", f"{HOME}/{name}/f") == "deny"
    assert decide(hostile, "process-exec", f"/opt/{name}/tool") == "allow"


def test_a_glob_character_in_a_protected_path_denies_at_least_that_path() -> None:
    policy, host = _hostile_case("we*ird(1).[x]")
    rules = rules_of(plan(policy, host=host))
    assert decide(rules, "file-write-data", f"{HOME}/we*ird(1).[x]/f") == "deny"
    assert decide(rules, "file-write-data", f"{HOME}/weXYZird(1).[x]/f") == "deny"
    assert decide(rules, "file-write-data", f"{HOME}/we/ird(1).[x]/f") == "deny"  # outside roots
    regex = glob_regex(f"{HOME}/we*ird(1).[x]")
    assert re.search(regex, f"{HOME}/we*ird(1).[x]")
    assert not re.search(regex, f"{HOME}/weird(1)X[x]")


@pytest.mark.parametrize("glob", ['x")(allow default)(', "a\\b", "*.p[em", "é*"])
def test_a_hostile_create_glob_is_an_escaped_regex_parameter(glob: str) -> None:
    spec = parse_spec(spec_data("chat"))
    policy = compile_policy(spec, HOST, deny_create_globs=[glob])
    launch = plan(policy)
    text, params = profile_of(launch)
    assert glob not in text
    regex = dict(params)["DENY_CREATE_REGEX_0"]
    rules = rules_of(launch)
    literal_name = glob.replace("*", "anything")
    assert decide(rules, "file-write-create", f"/private/tmp/work/{literal_name}") == "deny"
    assert decide(rules, "file-write-create", "/private/tmp/work/unrelated") == "allow"
    assert re.search(regex, "/x/" + literal_name)


@pytest.mark.parametrize("tag", ["", "UPPER", "has space", 'q"uote', "a" * 64, "-lead", "é"])
def test_a_malformed_session_tag_is_refused(tag: str) -> None:
    with pytest.raises(BadSpec, match="session tag"):
        plan_seatbelt(policy_for("chat"), COMMAND, host=HOST, session_tag=tag)


# --- plan shape -----------------------------------------------------------------------------------


def test_argv_is_sandbox_exec_by_absolute_path_profile_params_then_the_command() -> None:
    launch = plan(policy_for("chat"))
    words = [str(w) for w in launch.argv]
    assert launch.backend is SandboxBackend.NATIVE
    assert words[:2] == [SANDBOX_EXEC, "-p"]
    assert words[2].startswith("(version 1)\n")
    end = words.index("--")
    assert all(w.startswith("-D") for w in words[3:end])
    assert words[end:] == ["--", "git", "status"]
    assert launch.cwd == "/private/tmp/work"  # the first bound directory


def test_the_default_tag_is_derived_from_the_session_id() -> None:
    policy = policy_for("chat")
    launch = plan_seatbelt(policy, COMMAND, host=HOST)
    tag = session_tag_for(policy.session_id)
    assert re.fullmatch(r"[0-9a-f]{12}", tag)
    assert f'(with message "{message_for(tag)}")' in str(launch.argv[2])
    assert session_tag_for("space-7") == tag and session_tag_for("space-8") != tag
    assert str(launch.argv[0]) == SANDBOX_EXEC  # the probe's path is the default


def test_the_command_cwd_and_workdir_win_over_the_default() -> None:
    assert plan(policy_for("chat"), dataclasses.replace(COMMAND, cwd="/x")).cwd == "/x"
    assert plan(policy_for("chat", guestWorkdir="/tmp/work/src")).cwd == "/tmp/work/src"
    no_binds = policy_for("chat", bindMounts=[])
    assert plan(no_binds).cwd == HOME


def test_no_temp_dir_means_no_temp_allow() -> None:
    rules = rules_of(plan(policy_for("chat"), temp_dir=None))
    assert decide(rules, "file-write-create", f"{TEMP_RESOLVED}/x") == "deny"
    assert "TMPDIR" not in dict(plan(policy_for("chat"), temp_dir=None).env)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sandbox_exec": "sandbox-exec"}, EnforcementFailed, "not absolute"),
        ({"temp_dir": "relative/T"}, EnforcementFailed, "not absolute"),
    ],
)
def test_relative_tool_and_temp_paths_are_refused(
    kwargs: dict[str, str], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        plan_seatbelt(policy_for("chat"), COMMAND, host=HOST, **kwargs)  # type: ignore[arg-type]


def test_an_empty_command_is_refused() -> None:
    with pytest.raises(BadSpec, match="empty"):
        plan(policy_for("chat"), Command(argv=()))


def test_a_guest_path_other_than_the_host_path_is_refused() -> None:
    policy = policy_for("chat", bindMounts=[{"hostPath": "/tmp/work", "guestPath": "/work"}])
    with pytest.raises(BadSpec, match="1:1"):
        plan(policy)


def test_a_nul_in_a_path_is_refused() -> None:
    policy = dataclasses.replace(
        policy_for("chat"), deny_read=(PathRule(path="/x\x00y", reason="r"),)
    )
    with pytest.raises(BadSpec, match="NUL"):
        plan(policy)


def test_a_policy_without_denied_paths_has_no_unfiltered_path_deny() -> None:
    bare = dataclasses.replace(terminal_policy(), deny_read=())
    rules = rules_of(plan(bare, NO_EGRESS, share_net=True))
    for rule in rules:
        if rule.action == "deny" and not rule.filters:
            assert set(rule.operations) <= {"file-write*", "file-link", "file-clone",
                                            "appleevent-send", "lsopen",
                                            "user-preference-write"}, rule
    assert decide(rules, "file-write-unlink", "/private/tmp/work/old.txt") == "allow"


def test_build_profile_uses_each_parameter_once_per_value() -> None:
    profile = build_profile(policy_for("chat"), COMMAND, host=HOST, session_tag=TAG,
                            temp_dir=TEMP)
    values = [v for _, v in profile.params]
    assert len(values) == len(set(values))
    assert len({n for n, _ in profile.params}) == len(profile.params)


@pytest.mark.parametrize(
    ("tmpdir", "expected"),
    [
        ("/var/folders/zz/abc123/T/", "/var/folders/zz/abc123/T"),
        ("/private/var/folders/zz/abc123/T", "/private/var/folders/zz/abc123/T"),
        ("/tmp", None),
        ("/var/folders/zz/abc123/C/", None),
        ("", None),
    ],
)
def test_darwin_user_temp_dir(tmpdir: str, expected: str | None) -> None:
    assert darwin_user_temp_dir({"TMPDIR": tmpdir}) == expected
    assert darwin_user_temp_dir({}) is None


def test_render_refuses_a_plan_that_is_not_sandbox_exec() -> None:
    with pytest.raises(ValueError, match="not a sandbox-exec plan"):
        render_seatbelt_plan(LaunchPlan(backend=SandboxBackend.NONE, argv=("true",), env=()))
