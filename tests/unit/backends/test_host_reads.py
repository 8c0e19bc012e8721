"""HostReads answers as the host does, and `hold` sees every change to what it was asked; a
session sandbox's plan given again (plan_reusing) is the plan planning would make. Real files
in tmp_path; no sandbox is started."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import pytest
from plan_kit import FAKE_BPF, TOOLS
from stamp_kit import past_the_tick, stampable

from cc_server.backends import bubblewrap as bwrap_mod
from cc_server.backends import host_reads
from cc_server.backends.bubblewrap import BubblewrapPlanner
from cc_server.backends.host_reads import HostReads
from cc_server.backends.plan import Command, EgressBridge
from cc_server.backends.probe import BubblewrapTools
from cc_server.backends.session_plan import plan_reusing
from cc_server.policy import CompiledPolicy, HostFacts, Platform, compile_policy, parse_spec


@pytest.fixture
def tree(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "f").write_text("x")
    (tmp_path / "up").symlink_to("d/e/..")
    (tmp_path / "abs").symlink_to(tmp_path / "d")
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    (tmp_path / "dangling").symlink_to("nowhere/x")
    (tmp_path / "d" / "self").symlink_to(".")
    return tmp_path


PATHS = ("d", "d/e", "d/f", "up", "up/e", "abs/e/../f", "loop1", "loop1/x", "dangling",
         "dangling/y", "missing/../d", "d/self/self/e", "d/f/x", "./d//e/", "../x", "d/..")


def test_its_answers_are_the_hosts(tree: pathlib.Path) -> None:
    reads = HostReads()
    for rel in PATHS:
        path = f"{tree}/{rel}"
        assert reads.realpath(path) == os.path.realpath(path), rel
        assert reads.lexists(path) == os.path.lexists(path), rel
        assert reads.isdir(path) == os.path.isdir(path), rel
    assert not reads.lexists(f"{tree}/d\0") and not reads.isdir(f"{tree}/d\0")
    assert reads.listdir(str(tree)) == sorted(os.listdir(tree))
    assert reads.read(f"{tree}/d/f") == b"x"
    with pytest.raises(FileNotFoundError):
        reads.lstat(f"{tree}/missing")
    with pytest.raises(FileNotFoundError):  # a failure is kept and raised again
        reads.lstat(f"{tree}/missing")
    assert reads.hold()


CHANGES = {
    "appears": lambda t: (t / "missing").mkdir(),
    "appears below a missing one": lambda t: (t / "missing" / "deep").mkdir(parents=True),
    "goes": lambda t: (t / "d" / "f").unlink(),
    "symlink": lambda t: ((t / "d" / "e").rmdir(), (t / "d" / "e").symlink_to("/etc")),
    "renamed over": lambda t: ((t / "other").mkdir(), os.rename(t / "other", t / "d" / "e")),
    "chmod": lambda t: (t / "d").chmod(0o700),
    "listing": lambda t: (t / "new").write_text(""),
    "content": lambda t: (t / "d" / "f").write_text("y"),
    "link target": lambda t: ((t / "up").unlink(), (t / "up").symlink_to("d")),
    "link replaced": lambda t: ((t / "up2").symlink_to("d/e/.."), os.rename(t / "up2", t / "up")),
}


@pytest.mark.parametrize("how", ["by access", "real ids not effective", "by stamp"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_hold_sees_a_change_to_anything_it_was_asked(
    tree: pathlib.Path, change: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if how == "real ids not effective":  # each question asked again (access checks real ids)
        monkeypatch.setattr(host_reads, "_exists_now", lambda: None)
    if how == "by stamp":  # every directory's stamp trusted at once, however new its ctime
        monkeypatch.setattr(host_reads, "STAMP_AGE_NS", 0)
    reads = HostReads()
    for rel in PATHS:
        reads.realpath(f"{tree}/{rel}")
        reads.lexists(f"{tree}/{rel}")
        reads.isdir(f"{tree}/{rel}")
    reads.lexists(f"{tree}/missing")
    reads.lexists(f"{tree}/missing/deep")
    reads.lexists(f"{tree}/d/missing/deeper")
    reads.listdir(str(tree))
    reads.read(f"{tree}/d/f")
    past_the_tick(tree, tree / "d", tree / "d" / "e")
    assert reads.hold() and reads.hold()
    if how == "by stamp":  # the names of tree and tree/d, and tree's listing, by their stamps
        assert reads.stamped >= 3 or not stampable(tree), reads.stamped
    CHANGES[change](tree)
    assert not reads.hold()


NAME_CHANGES = {
    "appears": lambda d: (d / "missing").mkdir(),
    "appears as a symlink": lambda d: (d / "missing").symlink_to("nowhere"),
    "appears below a missing one": lambda d: (d / "gone" / "deeper").mkdir(parents=True),
    "goes": lambda d: (d / "here").unlink(),
    "renamed away": lambda d: os.rename(d / "here", d / "there"),
    "directory replaced": lambda d: (pathlib.Path(f"{d}.new", "missing").mkdir(parents=True),
                                     os.rename(d, f"{d}.old"), os.rename(f"{d}.new", d)),
}


@pytest.mark.parametrize("change", sorted(NAME_CHANGES))
def test_names_taken_from_a_directory_stamp_see_every_entry_change(
    tmp_path: pathlib.Path, change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only names in one directory are asked (nothing else would see a change): `hold` takes
    them from the directory's stamp, and each change of its entries is a change."""
    monkeypatch.setattr(host_reads, "STAMP_AGE_NS", 0)  # trusted at once (see past_the_tick)
    directory = tmp_path / "dir"
    directory.mkdir()
    (directory / "here").write_text("")
    reads = HostReads()
    assert reads.lexists(f"{directory}/here")
    assert not reads.lexists(f"{directory}/missing")
    assert not reads.lexists(f"{directory}/gone/deeper/deepest")
    past_the_tick(directory)
    assert reads.hold() and reads.hold()
    assert reads.stamped == 1 or not stampable(directory)
    NAME_CHANGES[change](directory)
    assert not reads.hold()


def _planner(home: pathlib.Path) -> BubblewrapPlanner:
    host = dataclasses.replace(HostFacts.current(Platform.LINUX), home=str(home),
                               server_is_root=False)
    tools = BubblewrapTools(bwrap="/usr/bin/bwrap", socat=None, create_rules=TOOLS)
    return BubblewrapPlanner(host=host, tools=tools)


def _binding_d(
    tree: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[BubblewrapPlanner, CompiledPolicy]:
    """A planner with a fake seccomp filter, and a policy binding `tree/d`."""
    monkeypatch.setattr(bwrap_mod, "filter_bpf", lambda: FAKE_BPF)
    monkeypatch.setattr(bwrap_mod, "notify_filter_bpf", lambda **_: FAKE_BPF)
    home = tree / "home"
    home.mkdir()
    planner = _planner(home)
    spec = parse_spec({"sessionId": "s", "workspaceId": "w",
                       "bindMounts": [{"hostPath": str(tree / "d")}]})
    policy = compile_policy(spec, planner.host)
    return planner, policy


def test_a_plan_given_again_is_the_plan_planning_makes(
    tree: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planner, policy = _binding_d(tree, monkeypatch)
    bridge = EgressBridge(socket_dir=str(tree / "sock"))
    commands = [
        Command(argv=("true",), egress=bridge, in_session_sandbox=True),
        Command(argv=("make", "x"), env=(("A", "1"),), cwd=str(tree / "d" / "e"),
                egress=bridge, in_session_sandbox=True),
        Command(argv=("env",), env=(("HOME", "/x"), ("PATH", "/p")), egress=bridge,
                in_session_sandbox=True),
    ]
    plan, last = plan_reusing(planner, policy, commands[0], None)
    assert last is not None and plan == planner.plan(policy, commands[0])
    for command in commands:
        again, kept = plan_reusing(planner, policy, command, last)
        assert kept is last  # given again, not planned
        assert again == planner.plan(policy, command)
    (tree / "d" / ".git" / "hooks").mkdir(parents=True)  # a fact the plan rests on
    changed, kept = plan_reusing(planner, policy, commands[0], last)
    assert kept is not last and changed == planner.plan(policy, commands[0])
    assert changed.argv != plan.argv


def test_a_plan_is_given_again_while_only_views_no_bind_shows_change(
    tree: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planner, policy = _binding_d(tree, monkeypatch)
    bridge = EgressBridge(socket_dir=str(tree / "sock"), hidden_dirs=(str(tree / "b1"),))

    def command(*hidden: pathlib.Path) -> Command:
        egress = dataclasses.replace(bridge, hidden_dirs=tuple(str(h) for h in hidden))
        return Command(argv=("true",), egress=egress, in_session_sandbox=True)

    _, last = plan_reusing(planner, policy, command(tree / "b1"), None)
    outside = command(tree / "b1", tree / "b2")  # a new base no bind shows
    again, kept = plan_reusing(planner, policy, outside, last)
    assert kept is last and again == planner.plan(policy, outside)
    inside = command(tree / "b1", tree / "d" / "e")  # one the bind of d shows
    changed, kept = plan_reusing(planner, policy, inside, last)
    assert kept is not last and changed == planner.plan(policy, inside)
    assert "--tmpfs" in changed.argv and str(tree / "d" / "e") in changed.argv
