"""The in-process file tools against real files and real symlinks: every escape refused.

The tools run in the server process, outside any sandbox, so nothing but their own checks stands
between an agent's path and the host. Each test plants a real secret (a fake ~/.ssh key under a
fake $HOME, told to the policy through HostFacts), tries to reach it or to write where the policy
forbids, and checks the refusal, that nothing secret came back and that nothing was written.
Every test runs with both resolvers: openat2 (RESOLVE_BENEATH) and the O_NOFOLLOW walk.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from cc_server.dispatch._resolve import Openat2Resolver, Resolver, WalkResolver
from cc_server.dispatch.actions import Action, ActionKind, ActionRefused
from cc_server.dispatch.guardrails import standard_chain
from cc_server.dispatch.tools import FileToolError, FileTools
from cc_server.policy import (
    STANDARD_DENY_CREATE_GLOBS,
    HostFacts,
    Mode,
    Platform,
    SandboxBindMount,
    SandboxSpec,
    compile_policy,
)

pytestmark = pytest.mark.security

SWAP_ITERATIONS = 3000  # tool calls made while a thread flips a link under them
MIN_FLIPS = 20  # link replacements the flipping thread must have made during those calls


@dataclass
class Tree:
    """A fake home with secrets, a worktree, a protected checkout, and the tools on them."""

    root: pathlib.Path
    home: pathlib.Path
    wt: pathlib.Path
    repo: pathlib.Path
    marker: str
    resolver: Resolver

    @property
    def key(self) -> pathlib.Path:
        return self.home / ".ssh" / "id_ed25519"

    def host(self) -> HostFacts:
        """The real filesystem, with the fake home as $HOME."""
        return HostFacts(
            platform=Platform.LINUX,
            home=str(self.home),
            realpath=os.path.realpath,
            exists=os.path.lexists,
        )

    def tools_with_read_only(self, extra: pathlib.Path) -> FileTools:
        """Tools for the worktree (writable) plus `extra` bound read-only."""
        spec = SandboxSpec(
            session_id="s1",
            workspace_id="w1",
            bind_mounts=(
                SandboxBindMount(host_path=str(self.wt)),
                SandboxBindMount(host_path=str(extra), read_only=True),
            ),
            guest_workdir=str(self.wt),
        )
        policy = compile_policy(spec, self.host())
        return FileTools(policy, standard_chain(policy), resolver=self.resolver)

    def tools(self, mode: Mode = Mode.CHAT, **kw: object) -> FileTools:
        spec = SandboxSpec(
            session_id="s1",
            workspace_id="w1",
            bind_mounts=(
                SandboxBindMount(host_path=str(self.wt)),
                SandboxBindMount(host_path=str(self.repo)),  # writable bind, but protected
                SandboxBindMount(host_path=str(self.home), read_only=True),
            ),
            guest_workdir=str(self.wt),
            mode=mode,
            protected_paths=(str(self.repo),),
        )
        policy = compile_policy(spec, self.host(), deny_create_globs=STANDARD_DENY_CREATE_GLOBS)
        extra = kw.pop("extra", ())
        return FileTools(policy, standard_chain(policy, extra=extra), resolver=self.resolver)  # type: ignore[arg-type]

    def snapshot(self) -> dict[str, bytes | str]:
        """Every path under root with its content or link target ('nothing written' is ==)."""
        out: dict[str, bytes | str] = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                if os.path.islink(p):
                    out[p] = "link:" + os.readlink(p)
                elif os.path.isfile(p):
                    out[p] = pathlib.Path(p).read_bytes()
                else:
                    out[p] = "dir"
        return out


def _resolvers() -> list[Resolver]:
    return [Openat2Resolver(), WalkResolver()]


@pytest.fixture(params=["openat2", "walk"])
def tree(tmp_path: pathlib.Path, request: pytest.FixtureRequest) -> Iterator[Tree]:
    resolver: Resolver = Openat2Resolver() if request.param == "openat2" else WalkResolver()
    marker = f"CC-SECRET-{secrets.token_hex(8)}"
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text(f"-----BEGIN KEY-----\n{marker}\n")
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text(f"secret = {marker}\n")
    wt = tmp_path / "wt"
    (wt / ".git" / "hooks").mkdir(parents=True)
    (wt / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\nexit 0\n")
    (wt / "src").mkdir()
    (wt / "src" / "main.py").write_text("print('hello')\n")
    (wt / "harmless.txt").write_text("harmless\n")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README").write_text("original checkout\n")
    yield Tree(root=tmp_path, home=home, wt=wt, repo=repo, marker=marker, resolver=resolver)


def _all_calls(ft: FileTools, path: str) -> dict[str, Callable[[], object]]:
    """Every tool aimed at `path` (reads and writes)."""
    patch_update = f"*** Begin Patch\n*** Update File: {path}\n@@\n-x\n+y\n*** End Patch\n"
    patch_add = f"*** Begin Patch\n*** Add File: {path}\n+planted\n*** End Patch\n"
    patch_delete = f"*** Begin Patch\n*** Delete File: {path}\n*** End Patch\n"
    return {
        "read": lambda: ft.read(path),
        "acp_read": lambda: ft.read(path, kind=ActionKind.ACP_READ),
        "write": lambda: ft.write(path, "planted\n"),
        "acp_write": lambda: ft.write(path, "planted\n", kind=ActionKind.ACP_WRITE),
        "edit": lambda: ft.edit(path, "-----BEGIN", "planted"),
        "apply_patch_update": lambda: ft.apply_patch(patch_update),
        "apply_patch_add": lambda: ft.apply_patch(patch_add),
        "apply_patch_delete": lambda: ft.apply_patch(patch_delete),
        "search": lambda: ft.search(".", path),
        "search_files": lambda: ft.search_files(".", path),
        "find": lambda: ft.find("*", path),
    }


def _assert_refused_everywhere(tree: Tree, ft: FileTools, path: str) -> None:
    before = tree.snapshot()
    for name, call in _all_calls(ft, path).items():
        with pytest.raises(ActionRefused) as info:
            result = call()
            pytest.fail(f"{name}({path!r}) was allowed and returned {result!r}")
        assert tree.marker not in str(info.value), name
        assert tree.snapshot() == before, f"{name}({path!r}) changed the tree"


SECRET_SPELLINGS = [
    "{home}/.ssh/id_ed25519",  # absolute, inside the read-only home bind
    "{home}/.ssh",  # the directory
    "{home}/.aws/credentials",
    "../home/.ssh/id_ed25519",  # ../ out of the workdir
    "src/../../home/.ssh/id_ed25519",
    "{wt}/../home/.ssh/id_ed25519",
    "{home}//.ssh/./id_ed25519",
]


@pytest.mark.parametrize("spelling", SECRET_SPELLINGS)
def test_every_tool_refuses_the_secret_deny_read_set(tree: Tree, spelling: str) -> None:
    path = spelling.format(home=tree.home, wt=tree.wt)
    _assert_refused_everywhere(tree, tree.tools(), path)


@pytest.mark.parametrize(
    "path",
    ["/etc/passwd", "/etc/shadow", "{root}", "/", "{root}/outside.txt", "../../../../etc/passwd"],
)
def test_every_tool_refuses_paths_outside_the_binds(tree: Tree, path: str) -> None:
    (tree.root / "outside.txt").write_text(f"outside {tree.marker}\n")
    _assert_refused_everywhere(tree, tree.tools(), path.format(root=tree.root))


def test_write_tools_refuse_the_protected_checkout(tree: Tree) -> None:
    ft = tree.tools()
    before = tree.snapshot()
    for path in (f"{tree.repo}/README", f"{tree.repo}/new.txt", f"{tree.wt}/../repo/README"):
        for name, call in _all_calls(ft, path).items():
            if name in ("read", "acp_read", "search", "search_files", "find"):
                continue  # reading the original checkout is allowed
            with pytest.raises(ActionRefused, match=r"protected path|never writable"):
                call()
    assert tree.snapshot() == before
    assert ft.read(f"{tree.repo}/README") == "original checkout\n"


@pytest.mark.parametrize(
    "path",
    [
        ".git/hooks/pre-commit",
        ".git/hooks/post-checkout",
        ".git/config",
        ".bashrc",
        ".claude/settings.json",
        "sub/.git/hooks/pre-push",
    ],
)
def test_write_tools_refuse_mandatory_denies(tree: Tree, path: str) -> None:
    ft = tree.tools()
    before = tree.snapshot()
    for name, call in _all_calls(ft, path).items():
        if name in ("read", "acp_read", "search", "search_files", "find"):
            continue
        with pytest.raises(ActionRefused):
            call()
            pytest.fail(f"{name}({path!r}) was allowed")
    assert tree.snapshot() == before


@pytest.mark.parametrize(
    "path", ["x.pem", ".env", "a.key", "A.PEM", "new/dir/cert.pem", "src/.env", ".env/inner.txt"]
)
def test_creating_a_create_glob_name_is_refused_and_leaves_nothing(tree: Tree, path: str) -> None:
    ft = tree.tools()
    before = tree.snapshot()
    for name in ("write", "acp_write", "apply_patch_add"):
        with pytest.raises(ActionRefused, match="create-time rule"):
            _all_calls(ft, path)[name]()
    # A move onto a forbidden name, and a patch whose second file is forbidden, change nothing.
    move = (
        f"*** Begin Patch\n*** Update File: harmless.txt\n*** Move to: {path}\n"
        "@@\n-harmless\n+moved\n*** End Patch\n"
    )
    two = f"*** Begin Patch\n*** Add File: fine.txt\n+ok\n*** Add File: {path}\n+k\n*** End Patch\n"
    for patch in (move, two):
        with pytest.raises(ActionRefused, match="create-time rule"):
            ft.apply_patch(patch)
    assert tree.snapshot() == before


def test_an_existing_glob_named_file_may_still_be_edited(tree: Tree) -> None:
    """The rule is about creating names, as the create-rule supervisor's is."""
    (tree.wt / "server.pem").write_text("old\n")
    ft = tree.tools()
    ft.edit("server.pem", "old", "new")
    assert (tree.wt / "server.pem").read_text() == "new\n"


def test_links_out_of_the_bind_are_never_followed(tree: Tree) -> None:
    os.symlink(tree.key, tree.wt / "abs-link")
    os.symlink("../home/.ssh/id_ed25519", tree.wt / "rel-link")
    os.symlink(tree.home / ".ssh", tree.wt / "dir-link")
    os.symlink("/etc", tree.wt / "etc-link")
    os.symlink(f"/proc/{os.getpid()}/root{tree.key}", tree.wt / "proc-link")
    ft = tree.tools()
    for path in ("abs-link", "rel-link", "dir-link/id_ed25519", "etc-link/passwd", "proc-link"):
        _assert_refused_everywhere_or_missing(tree, ft, path)
    # Searches skip links: nothing secret in any result.
    assert tree.marker not in repr(ft.search("CC-SECRET"))
    assert tree.marker not in repr(ft.search_files("CC-SECRET"))
    assert all("id_ed25519" not in p for p in ft.find("*"))


def _assert_refused_everywhere_or_missing(tree: Tree, ft: FileTools, path: str) -> None:
    before = tree.snapshot()
    for name, call in _all_calls(ft, path).items():
        try:
            result = call()
        except (ActionRefused, FileToolError) as exc:
            assert tree.marker not in str(exc)
            continue
        # A search of a link-named directory finds nothing: it is not followed.
        assert name in ("search", "search_files", "find") and not result, (name, path, result)
        assert tree.marker not in repr(result)
    assert tree.snapshot() == before


def test_links_inside_the_bind_are_followed_only_by_openat2(tree: Tree) -> None:
    os.symlink("src/main.py", tree.wt / "inner-link")
    ft = tree.tools()
    if isinstance(tree.resolver, Openat2Resolver):
        assert ft.read("inner-link") == "print('hello')\n"
    else:
        with pytest.raises(ActionRefused, match="link"):
            ft.read("inner-link")
    with pytest.raises(ActionRefused, match="symbolic link"):
        ft.write("inner-link", "x")
    assert (tree.wt / "src" / "main.py").read_text() == "print('hello')\n"


def test_a_link_to_a_secret_inside_a_bind_is_refused_on_its_real_path(tree: Tree) -> None:
    """A link that stays inside a bind but lands on a secret: checked on what was opened."""
    ft_home = tree.tools()
    # Inside the home bind, a link from an ordinary name to the key.
    os.symlink(".ssh/id_ed25519", tree.home / "innocent.txt")
    with pytest.raises(ActionRefused) as info:
        ft_home.read(f"{tree.home}/innocent.txt")
    assert tree.marker not in str(info.value)


def test_hard_linked_files_are_not_written(tree: Tree) -> None:
    os.link(tree.repo / "README", tree.wt / "readme-link")
    ft = tree.tools()
    with pytest.raises(ActionRefused, match="hard links"):
        ft.write("readme-link", "changed\n")
    with pytest.raises(ActionRefused, match="hard links"):
        ft.edit("readme-link", "original", "changed")
    assert (tree.repo / "README").read_text() == "original checkout\n"


def _flip(
    link: pathlib.Path, targets: tuple[str, str], stop: threading.Event, flips: list[int]
) -> None:
    """Atomically replace `link` by a link to each target in turn until told to stop; count the
    replacements in `flips[0]`."""
    tmp = link.with_name(link.name + ".flip")
    i = 0
    while not stop.is_set():
        try:
            os.symlink(targets[i % 2], tmp)
            os.replace(tmp, link)
            flips[0] += 1
        except FileExistsError:
            os.unlink(tmp)
        i += 1


@pytest.mark.parametrize(
    "targets, call",
    [
        # The last component flips between a harmless file and the key.
        (("harmless.txt", "{key}"), "read link"),
        (("harmless.txt", "../home/.ssh/id_ed25519"), "read link"),
        (("harmless.txt", "{key}"), "write link"),
        (("harmless.txt", "{key}"), "edit link"),
        # A directory on the way flips between a harmless directory and ~/.ssh.
        (("src", "{ssh}"), "read link/id_ed25519"),
        (("src", "{ssh}"), "write link/new.txt"),
        (("src", "{ssh}"), "write link/id_ed25519"),
        (("src", "{ssh}"), "search link"),
        (("src", "{ssh}"), "find link"),
        (("src", "{ssh}"), "acp_read link/id_ed25519"),
    ],
)
def test_a_link_swapped_during_the_call_is_never_followed_out(
    tree: Tree, targets: tuple[str, str], call: str
) -> None:
    (tree.wt / "src" / "id_ed25519").write_text("harmless copy\n")
    fmt = {"key": str(tree.key), "ssh": str(tree.home / ".ssh")}
    resolved = (targets[0], targets[1].format(**fmt))
    link = tree.wt / "link"
    os.symlink(resolved[0], link)
    ft = tree.tools()
    tool, path = call.split()
    key_before = tree.key.read_bytes()
    ssh_before = sorted(os.listdir(tree.home / ".ssh"))
    stop = threading.Event()
    flips = [0]
    flipper = threading.Thread(target=_flip, args=(link, resolved, stop, flips), daemon=True)
    flipper.start()
    outcomes: dict[str, int] = {}
    flips_during_calls = 0
    try:
        for _ in range(SWAP_ITERATIONS):
            try:
                if tool == "read":
                    result: object = ft.read(path)
                elif tool == "acp_read":
                    result = ft.read(path, kind=ActionKind.ACP_READ)
                elif tool == "write":
                    result = ft.write(path, "planted\n")
                elif tool == "edit":
                    result = ft.edit(path, "harmless", "planted")
                    ft.edit(path, "planted", "harmless")
                elif tool == "search":
                    result = ft.search("CC-SECRET|harmless", path)
                else:
                    result = ft.find("*", path)
                outcomes["allowed"] = outcomes.get("allowed", 0) + 1
            except ActionRefused as exc:
                result = str(exc)
                outcomes["refused"] = outcomes.get("refused", 0) + 1
            except FileToolError as exc:
                result = str(exc)
                outcomes["error"] = outcomes.get("error", 0) + 1
            assert tree.marker not in repr(result)
        flips_during_calls = flips[0]
    finally:
        stop.set()
        flipper.join()
    # The race was really run: the link pointed at each target while the calls were made.
    assert flips_during_calls >= MIN_FLIPS, flips_during_calls
    assert tree.key.read_bytes() == key_before
    assert sorted(os.listdir(tree.home / ".ssh")) == ssh_before
    assert sum(outcomes.values()) == SWAP_ITERATIONS


class Recorder:
    """A guardrail that allows everything and records what reached it."""

    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[Action] = []

    def check(self, action: Action) -> None:
        self.seen.append(action)


def test_review_and_plan_have_no_write_tools_refused_at_the_surface(tree: Tree) -> None:
    """The tool surface refuses first: the path policy and later guardrails never run."""
    for mode in (Mode.REVIEW, Mode.PLAN, Mode.ORCHESTRATE):
        recorder = Recorder()
        seen = recorder.seen
        ft = tree.tools(mode, extra=[recorder])
        before = tree.snapshot()
        # An ordinary path, and one the path policy would refuse too (a mandatory deny).
        for path in ("harmless.txt", "new.txt", ".git/hooks/pre-commit"):
            for name, call in _all_calls(ft, path).items():
                if name in ("read", "acp_read", "search", "search_files", "find"):
                    continue
                with pytest.raises(ActionRefused) as info:
                    call()
                assert info.value.guardrail == "tool-surface", (mode, name, info.value)
        assert seen == []
        assert tree.snapshot() == before
        # Reading still works, through the whole chain.
        assert ft.read("harmless.txt") == "harmless\n"
        assert [a.kind for a in seen] == [ActionKind.FILE_READ]


def test_a_raising_guardrail_refuses_and_nothing_happens(tree: Tree) -> None:
    class Broken:
        name = "broken"

        def check(self, action: Action) -> None:
            raise RuntimeError("lost its database connection")

    ft = tree.tools(extra=[Broken()])
    before = tree.snapshot()
    for name, call in _all_calls(ft, "harmless.txt").items():
        with pytest.raises(ActionRefused) as info:
            call()
        assert info.value.guardrail == "broken", name
        assert "RuntimeError" in str(info.value)
    assert tree.snapshot() == before


def test_ordinary_work_in_the_worktree_still_works(tree: Tree) -> None:
    ft = tree.tools()
    ft.write("pkg/mod.py", "a = 1\n")
    ft.edit("pkg/mod.py", "a = 1", "a = 2")
    assert ft.read("pkg/mod.py") == "a = 2\n"
    changed = ft.apply_patch(
        "*** Begin Patch\n*** Add File: pkg/new.py\n+b = 3\n"
        "*** Update File: pkg/mod.py\n@@\n-a = 2\n+a = 4\n*** End Patch\n"
    )
    assert changed == [f"{tree.wt}/pkg/new.py", f"{tree.wt}/pkg/mod.py"]
    assert (tree.wt / "pkg" / "mod.py").read_text() == "a = 4\n"
    assert [m.path for m in ft.search(r"b = \d")] == [f"{tree.wt}/pkg/new.py"]
    assert ft.find("*.py") == sorted(
        [f"{tree.wt}/pkg/mod.py", f"{tree.wt}/pkg/new.py", f"{tree.wt}/src/main.py"]
    )
    assert ft.search_files("hello") == [f"{tree.wt}/src/main.py"]
    # Not-a-file targets are errors, not crashes, and change nothing.
    os.mkfifo(tree.wt / "fifo")
    for call in (
        lambda: ft.write("src", "x"),
        lambda: ft.read("src"),
        lambda: ft.edit("src", "a", "b"),
        lambda: ft.write("fifo", "x"),
        lambda: ft.read("fifo"),
        lambda: ft.write("harmless.txt/below", "x"),
    ):
        with pytest.raises(FileToolError):
            call()
    # .git is never searched; the home bind is searchable but its secrets are skipped.
    assert ft.find("pre-commit") == []
    found = ft.search(".", str(tree.home))
    assert tree.marker not in repr(found)


def test_a_backtracking_pattern_cannot_hold_the_server(tree: Tree) -> None:
    """Searches run in the server process: a catastrophic pattern ends with an error."""
    (tree.wt / "bait.txt").write_text(("a" * 3000 + "b\n") * 3)
    spec_tools = tree.tools()
    ft = FileTools(
        spec_tools.policy, spec_tools.chain, resolver=tree.resolver, search_timeout_s=0.5
    )
    for call in (lambda: ft.search(r"(a+)+$"), lambda: ft.search_files(r"(a|aa)+c")):
        with pytest.raises(FileToolError, match="longer than"):
            call()


def test_a_bound_single_file_is_readable_and_a_link_in_its_place_is_not(tree: Tree) -> None:
    notes = tree.root / "notes.txt"
    notes.write_text("bound file\n")
    ft = tree.tools_with_read_only(notes)
    assert ft.read(str(notes)) == "bound file\n"
    with pytest.raises(ActionRefused, match="read-only bind"):
        ft.write(str(notes), "x")
    # Swap the bound file for a link to the key: the bind's root is never reached through a link.
    notes.unlink()
    notes.symlink_to(tree.key)
    with pytest.raises(ActionRefused) as info:
        ft.read(str(notes))
    assert tree.marker not in str(info.value)


def test_a_link_into_a_nested_read_only_bind_is_not_written(tree: Tree) -> None:
    """The worktree is writable but its docs/ is bound again read-only; a link leads there."""
    docs = tree.wt / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("read-only doc\n")
    os.symlink("docs", tree.wt / "docs-link")
    ft = tree.tools_with_read_only(docs)
    before = tree.snapshot()
    for call in (
        lambda: ft.write("docs/a.md", "x"),
        lambda: ft.write("docs-link/a.md", "x"),
        lambda: ft.write("docs-link/new.md", "x"),
        lambda: ft.edit("docs-link/a.md", "read-only", "changed"),
    ):
        with pytest.raises((ActionRefused, FileToolError)):
            call()
    assert tree.snapshot() == before
