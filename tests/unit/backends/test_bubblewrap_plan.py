"""plan_bubblewrap over fake hosts: the whole argv by exact equality, its order, what must not be
in it, and every refusal. Nothing is spawned; libseccomp is replaced by fixed bytes except where a
test says otherwise."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pytest

from cc_server.backends import bubblewrap as bwrap_mod
from cc_server.backends.bubblewrap import (
    DEFAULT_PATH,
    SANDBOX_HOSTNAME,
    SYSTEM_RO_PATHS,
    CreateRuleTools,
    plan_bubblewrap,
)
from cc_server.backends.egress_bridge import BRIDGE_DIR
from cc_server.backends.identity import session_identity
from cc_server.backends.plan import (
    Command,
    EgressBridge,
    FdArg,
    LaunchPlan,
    PathFd,
    SandboxIdentity,
)
from cc_server.backends.seccomp import filter_bpf
from cc_server.errors import BackendUnavailable, BadSpec, EnforcementFailed
from cc_server.policy import (
    CompiledPolicy,
    HostFacts,
    Mode,
    Mount,
    Platform,
    SandboxBackend,
    compile_policy,
    parse_spec,
)

BWRAP = "/usr/bin/bwrap"
HOME = "/home/dev"
FAKE_BPF = b"\x06\x00\x00\x00\x00\x00\xff\x7f"  # one BPF instruction: return ALLOW
SECCOMP = FdArg(name="seccomp.bpf", data=FAKE_BPF)

# A merged-/usr Debian-like root: /bin, /sbin, /lib, /lib64 are symlinks into /usr.
MERGED_USR: Mapping[str, str] = {
    "/bin": "/usr/bin",
    "/sbin": "/usr/sbin",
    "/lib": "/usr/lib",
    "/lib64": "/usr/lib64",
}
SYSTEM_DIRS = ("/usr", "/usr/bin", "/usr/sbin", "/usr/lib", "/usr/lib64", "/etc")

# bwrap options this backend may emit, with the number of arguments each takes. Anything else in
# an argv (--share-net, --cap-add, --bind-try, ...) makes `ops()` fail.
ARITY: Mapping[str, int] = {
    "--unshare-user": 0,
    "--unshare-pid": 0,
    "--unshare-net": 0,
    "--unshare-ipc": 0,
    "--unshare-uts": 0,
    "--unshare-cgroup-try": 0,
    "--disable-userns": 0,
    "--die-with-parent": 0,
    "--new-session": 0,
    "--hostname": 1,
    "--cap-drop": 1,
    "--ro-bind": 2,
    "--bind": 2,
    "--ro-bind-fd": 2,
    "--bind-fd": 2,
    "--symlink": 2,
    "--proc": 1,
    "--dev": 1,
    "--tmpfs": 1,
    "--remount-ro": 1,
    "--chdir": 1,
    "--seccomp": 1,
}
NAMESPACE_OPTIONS = (
    "--unshare-user",
    "--unshare-pid",
    "--unshare-net",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-cgroup-try",
    "--disable-userns",
    "--hostname",
    "--die-with-parent",
    "--new-session",
    "--cap-drop",
)


# --- fakes and helpers -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FakeFs:
    """Symlinks plus sets of directories and files; answers like realpath / lexists / isdir."""

    links: Mapping[str, str]
    dirs: frozenset[str]
    files: frozenset[str]

    def realpath(self, path: str) -> str:
        # Resolve repeatedly, deepest link prefix first, as a walk of the real tree would.
        for _ in range(40):
            for link in sorted(self.links, key=len, reverse=True):
                if path == link or path.startswith(link + "/"):
                    path = self.links[link] + path[len(link) :]
                    break
            else:
                return path
        raise OSError(f"fake: too many levels of symlinks at {path}")

    def exists(self, path: str) -> bool:  # lexists: a symlink exists even when dangling
        return path in self.dirs or path in self.files or path in self.links

    def is_dir(self, path: str) -> bool:
        return self.realpath(path) in self.dirs


def make_host(
    *,
    dirs: Iterable[str] = (),
    files: Iterable[str] = (),
    links: Mapping[str, str] | None = None,
    home: str = HOME,
    platform: Platform = Platform.LINUX,
) -> HostFacts:
    """A Linux host with merged /usr and /etc, plus the given paths; nothing real is consulted."""
    fs = FakeFs(
        links={**MERGED_USR, **(links or {})},
        dirs=frozenset({*SYSTEM_DIRS, home, *dirs}),
        files=frozenset(files),
    )
    return HostFacts(
        platform=platform, home=home, realpath=fs.realpath, exists=fs.exists, is_dir=fs.is_dir,
        server_is_root=False,
    )


def make_policy(host: HostFacts, **fields: Any) -> CompiledPolicy:
    data: dict[str, Any] = {"sessionId": "space-1", "workspaceId": "ws-1"}
    data.update(fields)
    return compile_policy(parse_spec(data), host)


BY_FD: Mapping[str, str] = {"--bind-fd": "--bind", "--ro-bind-fd": "--ro-bind"}


def ops(argv: Sequence[str | FdArg | PathFd]) -> list[tuple[str | FdArg, ...]]:
    """Group a bwrap argv into (option, *args) tuples; the command after `--` is one tuple. A
    spec bind made by fd (`--bind-fd <PathFd> DEST`: test_representative_argv_exact and
    test_spec_binds_are_made_by_fd_opened_without_symlinks show that form) reads as the bind it
    makes, `--bind SRC DEST`."""
    assert argv[0] == BWRAP, argv
    out: list[tuple[str | FdArg, ...]] = []
    i = 1
    while i < len(argv):
        opt = argv[i]
        if opt == "--":
            out.append(tuple(argv[i:]))
            break
        assert isinstance(opt, str) and opt in ARITY, f"unexpected bwrap option {opt!r}"
        n = ARITY[opt]
        group = tuple(argv[i : i + 1 + n])
        if opt in BY_FD:
            source = group[1]
            assert isinstance(source, PathFd), group
            group = (BY_FD[opt], source.path, *group[2:])
        out.append(group)  # type: ignore[arg-type]
        i += 1 + n
    return out


def index_of(grouped: list[tuple[str | FdArg, ...]], op: tuple[str | FdArg, ...]) -> int:
    assert op in grouped, f"{op} missing"
    return grouped.index(op)


def plan(
    policy: CompiledPolicy, host: HostFacts, argv: tuple[str, ...] = ("true",), **command: Any
) -> LaunchPlan:
    return plan_bubblewrap(policy, Command(argv=argv, **command), host=host, bwrap=BWRAP)


@pytest.fixture(autouse=True)
def fixed_seccomp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans carry FAKE_BPF instead of building the real filter (tested in test_seccomp.py)."""
    monkeypatch.setattr(bwrap_mod, "filter_bpf", lambda: FAKE_BPF)


# --- the representative policy -----------------------------------------------------------------

NAMESPACES = [
    "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
    "--unshare-cgroup-try", "--disable-userns", "--hostname", "cc-sandbox",
    "--die-with-parent", "--new-session", "--cap-drop", "ALL",
]  # fmt: skip
SYSTEM = [
    "--ro-bind", "/usr", "/usr",
    "--ro-bind", "/etc", "/etc",
    "--symlink", "usr/bin", "/bin",
    "--symlink", "usr/sbin", "/sbin",
    "--symlink", "usr/lib", "/lib",
    "--symlink", "usr/lib64", "/lib64",
    "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp",
]  # fmt: skip


@pytest.fixture
def rep_host() -> HostFacts:
    """/work/repo (writable bind) with .bashrc, .git/hooks and a protected sub/checkout;
    /opt/data (read-only bind); a home whose .ssh exists; /etc/shadow and /etc/ssl/private."""
    return make_host(
        dirs={
            "/work/repo", "/work/repo/.git", "/work/repo/.git/hooks", "/work/repo/sub",
            "/work/repo/sub/checkout", "/opt/data", f"{HOME}/.ssh", "/etc/ssl/private",
        },
        files={"/work/repo/.bashrc", f"{HOME}/.ssh/id_ed25519", "/etc/shadow"},
    )  # fmt: skip


@pytest.fixture
def rep_policy(rep_host: HostFacts) -> CompiledPolicy:
    return make_policy(
        rep_host,
        bindMounts=[{"hostPath": "/work/repo"}, {"hostPath": "/opt/data", "readOnly": True}],
        protectedPaths=["/work/repo/sub/checkout"],
    )


@pytest.fixture
def rep_plan(rep_policy: CompiledPolicy, rep_host: HostFacts) -> LaunchPlan:
    return plan(rep_policy, rep_host, ("make", "test"), env=(("LANG", "C.UTF-8"),))


def test_representative_argv_exact(rep_plan: LaunchPlan) -> None:
    expected: list[str | FdArg] = [
        BWRAP,
        *NAMESPACES,
        *SYSTEM,
        "--tmpfs", HOME,
        "--bind-fd", PathFd(path="/work/repo"), "/work/repo",
        "--ro-bind-fd", PathFd(path="/opt/data"), "/opt/data",
        "--bind", "/work/repo/sub", "/work/repo/sub",
        "--ro-bind", "/work/repo/sub/checkout", "/work/repo/sub/checkout",
        "--ro-bind", "/work/repo/.bashrc", "/work/repo/.bashrc",
        "--bind", "/work/repo/.git", "/work/repo/.git",
        "--ro-bind", "/work/repo/.git/hooks", "/work/repo/.git/hooks",
        "--ro-bind", "/dev/null", "/etc/shadow",
        "--tmpfs", "/etc/ssl/private", "--remount-ro", "/etc/ssl/private",
        "--remount-ro", "/",
        "--chdir", "/work/repo",
        "--seccomp", SECCOMP,
        "--", "make", "test",
    ]  # fmt: skip
    assert list(rep_plan.argv) == expected, rep_plan.render()
    assert rep_plan.backend is SandboxBackend.NATIVE
    assert rep_plan.cwd is None, rep_plan.render()  # bwrap does the chdir
    assert rep_plan.env == (("HOME", HOME), ("LANG", "C.UTF-8"), ("PATH", DEFAULT_PATH))
    assert rep_plan.notes == ("network: none (no egress bridge for this launch)",)


def test_namespaces_come_first(rep_plan: LaunchPlan) -> None:
    grouped = ops(rep_plan.argv)
    head = [g[0] for g in grouped[: len(NAMESPACE_OPTIONS)]]
    assert head == list(NAMESPACE_OPTIONS), rep_plan.render()
    rest = [g[0] for g in grouped[len(NAMESPACE_OPTIONS) :]]
    assert not set(rest) & set(NAMESPACE_OPTIONS), rep_plan.render()
    assert ("--hostname", SANDBOX_HOSTNAME) in grouped
    assert ("--cap-drop", "ALL") in grouped


def test_system_paths_before_binds(rep_plan: LaunchPlan) -> None:
    grouped = ops(rep_plan.argv)
    last_system = max(
        index_of(grouped, ("--ro-bind", "/etc", "/etc")),
        index_of(grouped, ("--symlink", "usr/lib64", "/lib64")),
        index_of(grouped, ("--tmpfs", "/var/tmp")),
    )
    first_bind = index_of(grouped, ("--bind", "/work/repo", "/work/repo"))
    assert last_system < index_of(grouped, ("--tmpfs", HOME)) < first_bind, rep_plan.render()
    for path in ("/usr", "/etc"):
        assert index_of(grouped, ("--ro-bind", path, path)) < first_bind


def test_deny_write_after_binds_with_pins_before_ro_bind(rep_plan: LaunchPlan) -> None:
    grouped = ops(rep_plan.argv)
    last_bind = index_of(grouped, ("--ro-bind", "/opt/data", "/opt/data"))
    for pin, target in [
        ("/work/repo/sub", "/work/repo/sub/checkout"),
        ("/work/repo/.git", "/work/repo/.git/hooks"),
    ]:
        pin_at = index_of(grouped, ("--bind", pin, pin))
        ro_at = index_of(grouped, ("--ro-bind", target, target))
        assert last_bind < pin_at < ro_at, rep_plan.render()
    assert index_of(grouped, ("--ro-bind", "/work/repo/.bashrc", "/work/repo/.bashrc")) > last_bind


def test_deny_read_masks_last_before_remount_root(rep_plan: LaunchPlan) -> None:
    grouped = ops(rep_plan.argv)
    root = index_of(grouped, ("--remount-ro", "/"))
    masks = [
        index_of(grouped, ("--ro-bind", "/dev/null", "/etc/shadow")),
        index_of(grouped, ("--tmpfs", "/etc/ssl/private")),
        index_of(grouped, ("--remount-ro", "/etc/ssl/private")),
    ]
    assert masks == list(range(root - 3, root)), rep_plan.render()
    last_deny_write = index_of(
        grouped, ("--ro-bind", "/work/repo/.git/hooks", "/work/repo/.git/hooks")
    )
    assert last_deny_write == root - 4, rep_plan.render()


def test_seccomp_right_before_the_command(rep_plan: LaunchPlan) -> None:
    argv = list(rep_plan.argv)
    sep = argv.index("--")
    assert argv[sep - 2 : sep] == ["--seccomp", SECCOMP], rep_plan.render()
    assert argv[sep + 1 :] == ["make", "test"]
    assert sum(isinstance(a, FdArg) for a in argv) == 1
    assert argv.count("--") == 1


def test_must_not_be_there(rep_plan: LaunchPlan) -> None:
    text = rep_plan.render()
    argv = list(rep_plan.argv)
    grouped = ops(argv)  # fails on any option outside ARITY, e.g. --share-net or --cap-add
    assert "--share-net" not in argv, text
    assert "--cap-add" not in argv, text
    assert ("--bind", "/", "/") not in grouped, text
    assert ("--ro-bind", "/", "/") not in grouped, text
    # The host's $HOME is never bound when no mount covers it; it is a throw-away tmpfs.
    binds = [g for g in grouped if g[0] in ("--bind", "--ro-bind")]
    assert not [g for g in binds if any(str(p).startswith(HOME) for p in g[1:])], text
    assert ("--tmpfs", HOME) in grouped
    # No mask for a path that does not exist: bwrap would create a stub on the host.
    assert "/etc/shadow-" not in argv and "/etc/gshadow" not in argv, text
    assert f"{HOME}/.aws" not in argv, text
    # ~/.ssh exists but is already hidden by the tmpfs $HOME: no mask needed, none emitted.
    assert f"{HOME}/.ssh" not in argv, text
    # No other host path than the system ones, the binds and what lies under them.
    visible_roots = ("/usr", "/etc", "/work/repo", "/opt/data")
    for group in binds:
        dest = str(group[-1])
        assert any(dest == r or dest.startswith(r + "/") for r in visible_roots), text


def test_plan_env_is_exactly_command_env_plus_defaults(
    rep_policy: CompiledPolicy, rep_host: HostFacts
) -> None:
    command_env = (("TERM", "dumb"), ("A_VAR", "x"))
    p = plan(rep_policy, rep_host, env=command_env)
    assert p.env == (("A_VAR", "x"), ("HOME", HOME), ("PATH", DEFAULT_PATH), ("TERM", "dumb"))
    # Nothing of the server's own environment is carried: only the names above.
    assert {k for k, _ in p.env} == {"A_VAR", "HOME", "PATH", "TERM"}, p.render()


def test_command_env_path_and_home_win_over_defaults(
    rep_policy: CompiledPolicy, rep_host: HostFacts
) -> None:
    p = plan(rep_policy, rep_host, env=(("PATH", "/opt/bin"), ("HOME", "/work/repo")))
    assert p.env == (("HOME", "/work/repo"), ("PATH", "/opt/bin")), p.render()


# --- step 2: system paths ----------------------------------------------------------------------


def test_system_paths_missing_skipped_and_foreign_symlink_ro_bound() -> None:
    # /lib64 points outside /usr (not merged-usr style): it is ro-bound, not recreated.
    host = make_host(links={"/lib64": "/lib/x86_64-linux-gnu"}, dirs={"/lib32"})
    grouped = ops(plan(make_policy(host), host).argv)
    system = [g for g in grouped if g[0] in ("--ro-bind", "--symlink")]
    assert system == [
        ("--ro-bind", "/usr", "/usr"),
        ("--ro-bind", "/etc", "/etc"),
        ("--symlink", "usr/bin", "/bin"),
        ("--symlink", "usr/sbin", "/sbin"),
        ("--symlink", "usr/lib", "/lib"),
        ("--ro-bind", "/lib32", "/lib32"),
        ("--ro-bind", "/lib64", "/lib64"),
    ]
    assert set(SYSTEM_RO_PATHS) - {g[-1] for g in system} == {"/libx32"}  # absent: skipped


# --- step 3 and 4: home and binds --------------------------------------------------------------


def test_binds_sorted_shallowest_first_stable_on_ties() -> None:
    host = make_host(dirs={"/w", "/w/a", "/w/a/b", "/x", "/y"})
    policy = make_policy(
        host,
        bindMounts=[
            {"hostPath": "/w/a/b", "readOnly": True},
            {"hostPath": "/y"},
            {"hostPath": "/w/a"},
            {"hostPath": "/x", "readOnly": True},
        ],
        guestWorkdir="/w/a",
    )
    p = plan(policy, host)
    binds = [g for g in ops(p.argv) if g[0] in ("--bind", "--ro-bind") and g[1] == g[2]]
    assert binds[2:6] == [
        ("--bind", "/y", "/y"),
        ("--ro-bind", "/x", "/x"),
        ("--bind", "/w/a", "/w/a"),
        ("--ro-bind", "/w/a/b", "/w/a/b"),
    ], p.render()
    assert ("--chdir", "/w/a") in ops(p.argv)


def test_symlinked_bind_source_mounted_at_resolved_path_plus_symlink() -> None:
    host = make_host(links={"/w/link": "/data/real"}, dirs={"/w", "/data/real"})
    policy = make_policy(host, bindMounts=[{"hostPath": "/w/link"}])
    p = plan(policy, host)
    argv = list(p.argv)
    at = argv.index("--bind-fd")
    assert argv[at : at + 6] == [
        "--bind-fd", PathFd(path="/data/real"), "/data/real", "--symlink", "/data/real", "/w/link",
    ], p.render()  # fmt: skip
    assert ("--bind", "/w/link", "/w/link") not in ops(argv), p.render()
    assert ("--chdir", "/data/real") in ops(argv)


def test_home_bound_writable_masks_secrets() -> None:
    host = make_host(
        dirs={f"{HOME}/.ssh", f"{HOME}/.config", f"{HOME}/.config/gh", f"{HOME}/.config/gcloud"},
        files={f"{HOME}/.netrc", f"{HOME}/.ssh/id_ed25519"},
    )
    policy = make_policy(host, bindMounts=[{"hostPath": HOME}])
    p = plan(policy, host)
    tail = [
        "--bind-fd", PathFd(path=HOME), HOME,
        "--tmpfs", f"{HOME}/.ssh", "--remount-ro", f"{HOME}/.ssh",
        "--bind", f"{HOME}/.config", f"{HOME}/.config",
        "--tmpfs", f"{HOME}/.config/gh", "--remount-ro", f"{HOME}/.config/gh",
        "--tmpfs", f"{HOME}/.config/gcloud", "--remount-ro", f"{HOME}/.config/gcloud",
        "--ro-bind", "/dev/null", f"{HOME}/.netrc",
        "--remount-ro", "/",
        "--chdir", HOME,
    ]  # fmt: skip
    argv = list(p.argv)
    start = len(NAMESPACES) + len(SYSTEM) + 1
    assert argv[start : start + len(tail)] == tail, p.render()
    assert ("--tmpfs", HOME) not in ops(argv), p.render()  # the real home is bound, not replaced


def test_home_bound_read_only_masks_without_pins() -> None:
    host = make_host(dirs={f"{HOME}/.config", f"{HOME}/.config/gh"})
    policy = make_policy(host, bindMounts=[{"hostPath": HOME, "readOnly": True}])
    grouped = ops(plan(policy, host).argv)
    assert ("--tmpfs", f"{HOME}/.config/gh") in grouped
    assert ("--bind", f"{HOME}/.config", f"{HOME}/.config") not in grouped


def test_bind_below_a_secret_masks_the_secret() -> None:
    keys = f"{HOME}/.ssh/keys"
    host = make_host(dirs={f"{HOME}/.ssh", keys})
    policy = make_policy(host, bindMounts=[{"hostPath": keys}])
    p = plan(policy, host)
    grouped = ops(p.argv)
    at = index_of(grouped, ("--tmpfs", f"{HOME}/.ssh"))
    assert grouped[at : at + 3] == [
        ("--tmpfs", f"{HOME}/.ssh"),
        ("--remount-ro", f"{HOME}/.ssh"),
        ("--remount-ro", "/"),
    ], p.render()
    assert index_of(grouped, ("--bind", keys, keys)) < at
    assert ("--tmpfs", HOME) in grouped  # the home itself is still a throw-away tmpfs


def test_bind_of_a_secret_file_masks_it_with_dev_null() -> None:
    key = f"{HOME}/.netrc"
    host = make_host(files={key})
    p = plan(
        make_policy(host, bindMounts=[{"hostPath": key, "readOnly": True}], guestWorkdir="/tmp"),
        host,
    )
    grouped = ops(p.argv)
    assert index_of(grouped, ("--ro-bind", key, key)) < index_of(
        grouped, ("--ro-bind", "/dev/null", key)
    ), p.render()


def test_secret_reached_through_two_spellings_masked_once() -> None:
    # ~/.ssh is a symlink to ~/dotfiles/ssh: both spellings are rules, one mask on the target.
    host = make_host(
        links={f"{HOME}/.ssh": f"{HOME}/dotfiles/ssh"},
        dirs={f"{HOME}/dotfiles", f"{HOME}/dotfiles/ssh"},
    )
    p = plan(make_policy(host, bindMounts=[{"hostPath": HOME}]), host)
    argv = list(p.argv)
    assert argv.count("--tmpfs") == 3, p.render()  # /tmp, /var/tmp, the one mask
    grouped = ops(argv)
    assert ("--bind", f"{HOME}/dotfiles", f"{HOME}/dotfiles") in grouped  # ancestor pin
    assert ("--tmpfs", f"{HOME}/dotfiles/ssh") in grouped
    assert f"{HOME}/.ssh" not in argv, p.render()


def test_home_root_gets_no_tmpfs() -> None:
    host = make_host(home="/")
    p = plan(make_policy(host), host)
    grouped = ops(p.argv)
    assert ("--tmpfs", "/") not in grouped, p.render()
    assert ("--chdir", "/") in grouped
    assert ("HOME", "/") in p.env


# --- step 5: deny-write ------------------------------------------------------------------------


def test_deny_write_symlink_leaving_the_mount_skipped_and_duplicate_target_once() -> None:
    host = make_host(
        dirs={"/work/repo", "/work/repo/.git", "/work/repo/.git/hooks"},
        files={f"{HOME}/.bashrc"},
        links={
            "/work/repo/.bashrc": f"{HOME}/.bashrc",  # resolves out of the bind: not ours
            "/work/repo/hooks-link": "/work/repo/.git/hooks",  # same target as a mandatory rule
        },
    )
    policy = make_policy(
        host, bindMounts=[{"hostPath": "/work/repo"}], protectedPaths=["/work/repo/hooks-link"]
    )
    p = plan(policy, host)
    argv = list(p.argv)
    assert argv.count("/work/repo/.git/hooks") == 2, p.render()  # one --ro-bind, once
    assert f"{HOME}/.bashrc" not in argv, p.render()
    assert "/work/repo/.bashrc" not in argv, p.render()
    assert "/work/repo/hooks-link" not in argv, p.render()


def test_deny_write_under_read_only_nested_bind_skipped() -> None:
    host = make_host(dirs={"/work/repo", "/work/repo/vendor", "/work/repo/vendor/pkg"})
    policy = make_policy(
        host,
        bindMounts=[
            {"hostPath": "/work/repo/vendor", "readOnly": True},
            {"hostPath": "/work/repo"},
        ],
        protectedPaths=["/work/repo/vendor/pkg"],
    )
    p = plan(policy, host)
    assert "/work/repo/vendor/pkg" not in p.argv, p.render()
    assert ("--chdir", "/work/repo/vendor") in ops(p.argv)


def test_deny_write_missing_path_not_bound() -> None:
    host = make_host(dirs={"/work/repo"})
    policy = make_policy(
        host, bindMounts=[{"hostPath": "/work/repo"}], protectedPaths=["/work/repo/absent"]
    )
    p = plan(policy, host)
    assert [g for g in ops(p.argv) if g[0] == "--bind"] == [
        ("--bind", "/work/repo", "/work/repo")
    ], p.render()
    assert not [a for a in p.argv if str(a).startswith("/work/repo/")], p.render()


def deny_segment(p: LaunchPlan, first: tuple[str, ...]) -> list[tuple[str | FdArg, ...]]:
    """The groups from `first` up to (not including) `--remount-ro /`."""
    grouped = ops(p.argv)
    return grouped[index_of(grouped, first) : index_of(grouped, ("--remount-ro", "/"))]


def test_protected_dir_not_reopened_by_a_pin_for_a_mandatory_path_inside() -> None:
    # protectedPaths [.git] with .git/hooks inside: the pin `--bind .git .git` would make the
    # protected .git writable again after its --ro-bind, so no pin is emitted under it.
    host = make_host(dirs={"/work/repo", "/work/repo/.git", "/work/repo/.git/hooks"})
    policy = make_policy(
        host, bindMounts=[{"hostPath": "/work/repo"}], protectedPaths=["/work/repo/.git"]
    )
    p = plan(policy, host)
    assert deny_segment(p, ("--ro-bind", "/work/repo/.git", "/work/repo/.git")) == [
        ("--ro-bind", "/work/repo/.git", "/work/repo/.git"),
        ("--ro-bind", "/work/repo/.git/hooks", "/work/repo/.git/hooks"),
    ], p.render()
    assert ("--bind", "/work/repo/.git", "/work/repo/.git") not in ops(p.argv), p.render()


def test_protected_dir_not_reopened_by_a_pin_for_a_secret_inside() -> None:
    host = make_host(dirs={f"{HOME}/.config", f"{HOME}/.config/gh"})
    policy = make_policy(host, bindMounts=[{"hostPath": HOME}], protectedPaths=[f"{HOME}/.config"])
    p = plan(policy, host)
    assert deny_segment(p, ("--ro-bind", f"{HOME}/.config", f"{HOME}/.config")) == [
        ("--ro-bind", f"{HOME}/.config", f"{HOME}/.config"),
        ("--tmpfs", f"{HOME}/.config/gh"),
        ("--remount-ro", f"{HOME}/.config/gh"),
    ], p.render()


def test_writable_bind_below_a_read_only_protected_path_rebound_read_only() -> None:
    # /work/repo is protected and bound read-only, but /work/repo/src is bound writable below it:
    # the inner bind is re-bound read-only, and nothing under it is pinned writable.
    host = make_host(
        dirs={
            "/work/repo",
            "/work/repo/src",
            "/work/repo/src/.git",
            "/work/repo/src/.git/hooks",
            "/other",
        }
    )
    policy = make_policy(
        host,
        bindMounts=[
            {"hostPath": "/work/repo", "readOnly": True},
            {"hostPath": "/work/repo/src"},
            {"hostPath": "/other"},
        ],
        protectedPaths=["/work/repo"],
    )
    p = plan(policy, host)
    assert deny_segment(p, ("--ro-bind", "/work/repo/src", "/work/repo/src")) == [
        ("--ro-bind", "/work/repo/src", "/work/repo/src"),
        ("--ro-bind", "/work/repo/src/.git/hooks", "/work/repo/src/.git/hooks"),
    ], p.render()
    grouped = ops(p.argv)
    assert [g for g in grouped if g[0] == "--bind"] == [
        ("--bind", "/other", "/other"),
        ("--bind", "/work/repo/src", "/work/repo/src"),
    ], p.render()  # step 4 only: no pins
    assert grouped.index(("--bind", "/work/repo/src", "/work/repo/src")) < grouped.index(
        ("--ro-bind", "/work/repo/src", "/work/repo/src")
    )


def test_protected_path_outside_every_bind_emits_nothing() -> None:
    host = make_host(dirs={"/work/repo", "/elsewhere"})
    policy = make_policy(
        host, bindMounts=[{"hostPath": "/work/repo"}], protectedPaths=["/elsewhere"]
    )
    p = plan(policy, host)
    assert "/elsewhere" not in p.argv, p.render()


def test_no_mask_on_the_missing_target_of_a_dangling_secret_symlink() -> None:
    host = make_host(
        dirs={f"{HOME}/secrets"}, links={f"{HOME}/.netrc": f"{HOME}/secrets/netrc"}
    )  # target absent
    p = plan(make_policy(host, bindMounts=[{"hostPath": HOME}]), host)
    assert f"{HOME}/secrets/netrc" not in p.argv, p.render()


def test_no_ro_bind_of_the_missing_target_of_a_dangling_symlink() -> None:
    host = make_host(dirs={"/work/repo"}, links={"/work/repo/.bashrc": "/work/repo/gone"})
    p = plan(make_policy(host, bindMounts=[{"hostPath": "/work/repo"}]), host)
    assert "/work/repo/gone" not in p.argv, p.render()


# --- modes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [m for m in Mode if m is not Mode.CHAT])
def test_read_only_modes_bind_read_only_and_emit_no_deny_write(mode: Mode) -> None:
    host = make_host(
        dirs={"/work/repo", "/work/repo/.git", "/work/repo/.git/hooks", "/work/repo/sub"},
        files={"/work/repo/.bashrc"},
    )
    policy = make_policy(
        host,
        mode=mode.value,
        bindMounts=[{"hostPath": "/work/repo"}],
        protectedPaths=["/work/repo/sub"],
    )
    p = plan(policy, host)
    grouped = ops(p.argv)
    assert [g for g in grouped if g[0] == "--bind"] == [], p.render()
    assert ("--ro-bind", "/work/repo", "/work/repo") in grouped
    assert not [a for a in p.argv if str(a).startswith("/work/repo/")], p.render()
    assert ("--chdir", "/work/repo") in grouped  # reason "bind mount (<mode>)" still counts


def test_review_mode_still_protects_writable_runner_state_dirs() -> None:
    host = make_host(dirs={"/work/repo", "/state", "/state/.vscode"}, files={"/state/.bashrc"})
    policy = make_policy(
        host, mode="review", bindMounts=[{"hostPath": "/work/repo"}], runnerStateDirs=["/state"]
    )
    p = plan(policy, host)
    binds = [g for g in ops(p.argv) if g[0] in ("--bind", "--ro-bind") and g[1] != "/dev/null"]
    assert binds[2:] == [
        ("--bind", "/state", "/state"),
        ("--ro-bind", "/work/repo", "/work/repo"),
        ("--ro-bind", "/state/.bashrc", "/state/.bashrc"),
        ("--ro-bind", "/state/.vscode", "/state/.vscode"),
    ], p.render()


# --- cwd and notes -----------------------------------------------------------------------------


def test_cwd_command_then_workdir_then_first_bind_then_home() -> None:
    host = make_host(dirs={"/work/repo", "/state"})
    with_bind = make_policy(
        host, bindMounts=[{"hostPath": "/work/repo"}], runnerStateDirs=["/state"]
    )
    assert ("--chdir", "/x") in ops(plan(with_bind, host, cwd="/x").argv)
    assert ("--chdir", "/work/repo") in ops(plan(with_bind, host).argv)
    workdir = dataclasses.replace(with_bind, workdir="/work/repo/src")
    assert ("--chdir", "/work/repo/src") in ops(plan(workdir, host).argv)
    state_only = make_policy(host, runnerStateDirs=["/state"])
    assert ("--chdir", HOME) in ops(plan(state_only, host).argv)


def test_note_when_network_disabled() -> None:
    host = make_host()
    p = plan(make_policy(host, networkEnabled=False), host)
    assert p.notes == ("network: none (no egress bridge for this launch)",)
    assert "--share-net" not in p.argv


# --- refusals ----------------------------------------------------------------------------------


def test_create_globs_refused() -> None:
    host = make_host()
    policy = compile_policy(
        parse_spec({"sessionId": "s", "workspaceId": "w"}),
        host,
        deny_create_globs=[".env", "*.pem"],
    )
    with pytest.raises(BackendUnavailable) as info:
        plan(policy, host)
    assert "create-time filename rules" in str(info.value)
    assert ".env, *.pem" in info.value.message


def test_guest_path_differs_refused() -> None:
    host = make_host(dirs={"/work/repo"})
    policy = make_policy(host, bindMounts=[{"hostPath": "/work/repo", "guestPath": "/repo"}])
    with pytest.raises(BadSpec, match="guest path '/repo'"):
        plan(policy, host)


@pytest.mark.parametrize("bad", ["/work/a\nb", "/work/a\x00b"])
def test_control_character_in_mount_refused(bad: str) -> None:
    host = make_host()
    mount = Mount(
        host_path=bad, literal_path=bad, guest_path=bad, writable=True, reason="bind mount"
    )
    policy = dataclasses.replace(make_policy(host), mounts=(mount,))
    with pytest.raises(BadSpec, match="control character"):
        plan(policy, host)


def test_empty_argv_refused() -> None:
    host = make_host()
    with pytest.raises(BadSpec, match="empty"):
        plan(make_policy(host), host, ())


@pytest.mark.parametrize("bwrap", ["bwrap", "usr/bin/bwrap", ""])
def test_relative_bwrap_refused(bwrap: str) -> None:
    host = make_host()
    with pytest.raises(EnforcementFailed, match="not absolute"):
        plan_bubblewrap(make_policy(host), Command(argv=("true",)), host=host, bwrap=bwrap)


def test_seccomp_build_failure_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> bytes:
        raise OSError("libseccomp.so.2: cannot open shared object file")

    monkeypatch.setattr(bwrap_mod, "filter_bpf", broken)
    host = make_host()
    with pytest.raises(EnforcementFailed, match="seccomp filter") as info:
        plan(make_policy(host), host)
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.fix is not None and "libseccomp2" in info.value.fix


def test_real_filter_is_what_the_plan_carries(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real libseccomp build (loads the library, spawns nothing).
    monkeypatch.setattr(bwrap_mod, "filter_bpf", filter_bpf)
    host = make_host()
    argv = plan(make_policy(host), host).argv
    assert argv[-3] == FdArg(name="seccomp.bpf", data=filter_bpf())


def test_default_workdir_skips_a_file_bind() -> None:
    host = make_host(dirs={"/work/repo"}, files={"/work/notes.txt"})
    policy = make_policy(
        host, bindMounts=[{"hostPath": "/work/notes.txt"}, {"hostPath": "/work/repo"}]
    )
    argv = plan(policy, host).argv
    assert argv[argv.index("--chdir") + 1] == "/work/repo"


# --- egress bridge -----------------------------------------------------------------------------


def _bridged(network: bool = True, socat: str | None = "/usr/bin/socat") -> LaunchPlan:
    host = make_host(dirs={"/work/repo"})
    policy = make_policy(host, bindMounts=[{"hostPath": "/work/repo"}], networkEnabled=network)
    bridge = EgressBridge(socket_dir="/run/x")
    command = Command(argv=("curl", "https://example.org"), egress=bridge)
    return plan_bubblewrap(policy, command, host=host, bwrap="/usr/bin/bwrap", socat=socat)


def test_egress_bridge_binds_the_socket_dir_read_only_and_wraps_the_command() -> None:
    p = _bridged()
    argv = [str(a) for a in p.argv]
    i = argv.index("/run/x")
    assert argv[i - 1 : i + 2] == ["--ro-bind", "/run/x", BRIDGE_DIR], p.render()
    assert i < argv.index("--remount-ro"), p.render()
    tail = argv[argv.index("--") + 1 :]
    assert tail[:2] == ["/bin/sh", "-c"]
    assert tail[3:] == ["cc-egress-bridge", "/usr/bin/socat", "curl", "https://example.org"]
    assert "UNIX-CONNECT:/run/cc-egress/http.sock" in tail[2]
    assert "--share-net" not in argv
    env = dict(p.env)
    assert env["HTTPS_PROXY"] == "http://127.0.0.1:3128"
    assert env["ALL_PROXY"] == "socks5h://127.0.0.1:1080"
    assert "nc -X 5 -x 127.0.0.1:1080" in env["GIT_SSH_COMMAND"]
    assert p.notes == (
        "network: only through the session's HTTP and SOCKS5 proxies (allowlist enforced)",
    )


def test_egress_bridge_with_the_network_off_says_the_proxies_refuse_everything() -> None:
    assert _bridged(network=False).notes == (
        "network: proxies only, and they refuse every connection (network disabled)",
    )


@pytest.mark.parametrize("socat", [None, "socat"])
def test_egress_bridge_without_an_absolute_socat_is_refused(socat: str | None) -> None:
    with pytest.raises(EnforcementFailed, match="socat"):
        _bridged(socat=socat)


def test_procfs_knobs_are_read_only_and_the_kernel_s_secrets_masked() -> None:
    # The OCI runtime's read-only and masked lists as a floor: what the host's procfs has is
    # covered right after --proc, what it lacks is not planned (bwrap cannot create a name there).
    host = make_host(
        dirs={"/work", "/proc/sys", "/proc/irq", "/proc/acpi", "/proc/pressure"},
        files={"/proc/sysrq-trigger", "/proc/kcore", "/proc/keys"},
    )
    argv = [str(a) for a in plan(make_policy(host, bindMounts=[{"hostPath": "/work"}]), host).argv]
    at = argv.index("--proc")
    assert argv[at : at + 2 + 6 * 3 + 4 + 1] == [
        "--proc", "/proc",
        "--ro-bind", "/proc/irq", "/proc/irq",
        "--ro-bind", "/proc/pressure", "/proc/pressure",
        "--ro-bind", "/proc/sys", "/proc/sys",
        "--ro-bind", "/proc/sysrq-trigger", "/proc/sysrq-trigger",
        "--tmpfs", "/proc/acpi", "--remount-ro", "/proc/acpi",
        "--ro-bind", "/dev/null", "/proc/kcore",
        "--ro-bind", "/dev/null", "/proc/keys",
        "--dev",
    ]  # fmt: skip


IDENTITY = SandboxIdentity(helper="/opt/cc/cc-identity", uid=0x7000_0000, gid=0x7000_0000)


def test_each_session_gets_its_own_identity_from_the_range() -> None:
    ids = {session_identity(IDENTITY, f"s{i}").uid for i in range(200)}
    assert len(ids) >= 195  # a 1-in-65,536 chance of sharing, per pair
    assert all(IDENTITY.uid <= u < IDENTITY.uid + 0x1_0000 for u in ids)
    assert session_identity(IDENTITY, "s1") == session_identity(IDENTITY, "s1")


def _root_host(**kwargs: Any) -> HostFacts:
    return dataclasses.replace(make_host(**kwargs), server_is_root=True)


def test_a_root_server_without_a_sandbox_identity_runs_nothing() -> None:
    host = _root_host(dirs={"/work"})
    with pytest.raises(BackendUnavailable, match="host uid 0"):
        plan(make_policy(host, bindMounts=[{"hostPath": "/work"}]), host)


def test_a_root_server_starts_bwrap_as_its_identity_with_every_bind_staged() -> None:
    # The helper stages each bind root (nested ones too) at /dev/shm/<n>; every bwrap source
    # under a root comes from its innermost root's stage; system paths stay as they are.
    host = _root_host(dirs={"/work", "/work/.git", "/work/.git/hooks", "/work/state", "/data"})
    policy = make_policy(
        host,
        bindMounts=[{"hostPath": "/work"}, {"hostPath": "/data", "readOnly": True}],
        runnerStateDirs=["/work/state"],
    )
    got = plan_bubblewrap(
        policy, Command(argv=("true",)), host=host, bwrap=BWRAP, identity=IDENTITY
    )
    argv = [str(a) for a in got.argv]
    mine = session_identity(IDENTITY, policy.session_id)  # the session's own from the range
    assert got.identity == mine and mine.uid != IDENTITY.uid
    roots = argv[argv.index("--stage") + 2 : argv.index("--")]
    assert roots == ["--map", "/work", "--map", "/data", "--map", "/work/state"]
    assert argv[: argv.index("--stage")] == [
        "/opt/cc/cc-identity", "--uid", str(mine.uid), "--gid", str(mine.gid),
    ]  # fmt: skip
    bwrap_argv = argv[argv.index("--") + 1 :]
    assert bwrap_argv[:4] == [BWRAP, "--unshare-user", "--uid", "0"]
    pairs = {(bwrap_argv[i + 1], bwrap_argv[i + 2]) for i, w in enumerate(bwrap_argv)
             if w in ("--bind", "--ro-bind")}  # fmt: skip
    assert ("/dev/shm/0", "/work") in pairs
    assert ("/dev/shm/1", "/data") in pairs
    assert ("/dev/shm/2", "/work/state") in pairs
    assert ("/dev/shm/0/.git/hooks", "/work/.git/hooks") in pairs
    assert ("/usr", "/usr") in pairs
    assert not [s for s, d in pairs if s.startswith(("/work", "/data"))]
    assert any("host identity: uid" in n for n in got.notes)


def test_a_root_server_refuses_a_bind_over_the_stage() -> None:
    host = _root_host(dirs={"/dev/shm/x"})
    with pytest.raises(BadSpec, match="/dev/shm"):
        plan_bubblewrap(
            make_policy(host, bindMounts=[{"hostPath": "/dev/shm/x"}]),
            Command(argv=("true",)), host=host, bwrap=BWRAP, identity=IDENTITY,
        )  # fmt: skip


def test_a_non_root_server_ignores_the_identity() -> None:
    host = make_host(dirs={"/work"})
    got = plan_bubblewrap(
        make_policy(host, bindMounts=[{"hostPath": "/work"}]), Command(argv=("true",)),
        host=host, bwrap=BWRAP, identity=IDENTITY,
    )  # fmt: skip
    assert got.argv[0] == BWRAP and got.identity is None


def test_a_root_server_stages_a_tool_spelled_through_a_symlink_by_its_real_path() -> None:
    # cc-identity refuses a root with a symlink in it: the planner names the real path.
    host = _root_host(dirs={"/work", "/srv/cc"}, files={"/srv/cc/cc-create-launcher"},
                      links={"/opt/cc": "/srv/cc"})
    got = plan_bubblewrap(
        make_policy(host, bindMounts=[{"hostPath": "/work"}]),
        Command(argv=("true",), egress=EgressBridge(socket_dir="/run/cc-test")),
        host=host, bwrap=BWRAP, identity=IDENTITY,
        create_rules=CreateRuleTools(launcher="/opt/cc/cc-create-launcher", library="/opt/cc/l.so"),
    )  # fmt: skip
    argv = [str(a) for a in got.argv]
    maps = [argv[i + 1] for i, w in enumerate(argv[: argv.index("--")]) if w == "--map"]
    assert maps == ["/work", "/srv/cc/cc-create-launcher"]
    at = argv.index("/run/cc-create/launcher")
    assert argv[at - 2 : at] == ["--ro-bind", "/dev/shm/1"]


def test_a_root_servers_command_words_are_never_rewritten_as_bind_sources() -> None:
    # Only bwrap's own options are staged: a command that says `--bind /work/x` keeps its words.
    host = _root_host(dirs={"/work"})
    got = plan_bubblewrap(
        make_policy(host, bindMounts=[{"hostPath": "/work"}]),
        Command(argv=("tool", "--bind", "/work/x", "--ro-bind", "/work")),
        host=host, bwrap=BWRAP, identity=IDENTITY,
    )  # fmt: skip
    assert [str(a) for a in got.argv[-5:]] == ["tool", "--bind", "/work/x", "--ro-bind", "/work"]
