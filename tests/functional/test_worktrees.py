"""Worktrees on the real host: the strategy chosen here, writes that never reach the checkout,
removal that leaves nothing, recovery after a killed server, and bad input that creates nothing."""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest
from dispatch_kit import git, make_repo, tree_digest

from cc_server.dispatch.worktrees import (
    Worktree,
    WorktreeError,
    WorktreeManager,
    WorktreeStrategy,
    _try_overlay,
    _try_reflink,
    choose_strategy,
    mounted_under,
)
from cc_server.errors import BadSpec

pytestmark = pytest.mark.integration


def _works(strategy: WorktreeStrategy, tmp: pathlib.Path) -> bool:
    scratch = tmp / f"probe-{strategy}"
    scratch.mkdir()
    try:
        if strategy is WorktreeStrategy.OVERLAY:
            return _try_overlay(str(scratch)) is None
        if strategy is WorktreeStrategy.REFLINK:
            return _try_reflink(str(scratch)) is None
        return shutil.which("git") is not None
    finally:
        shutil.rmtree(scratch)


WORKING = list(WorktreeStrategy)


@pytest.fixture
def repo(tmp_path: pathlib.Path) -> pathlib.Path:
    return make_repo(tmp_path / "repo")


def test_the_first_strategy_that_works_here_is_chosen(tmp_path: pathlib.Path) -> None:
    choice = choose_strategy(str(tmp_path), shutil.which("git"))
    # A root server skips overlay (its sandboxes reach binds through idmapped mounts).
    usable = [
        s for s in WorktreeStrategy if not (os.geteuid() == 0 and s is WorktreeStrategy.OVERLAY)
    ]
    expected = next(s for s in usable if _works(s, tmp_path))
    assert choice.strategy is expected, choice.describe()
    assert [s for s, _ in choice.rejected] == list(WorktreeStrategy)[: list(
        WorktreeStrategy).index(expected)]
    assert os.listdir(tmp_path) == [] and mounted_under(str(tmp_path)) == []


def _mutate(tree: pathlib.Path) -> None:
    """Every kind of write an agent could make."""
    (tree / "README.md").write_text("changed by the conversation\n")
    (tree / "src" / "main.py").unlink()
    (tree / "new.txt").write_text("new file\n")
    (tree / "keep" / "data.txt").rename(tree / "keep" / "renamed.txt")
    shutil.rmtree(tree / "keep")
    (tree / "dir").mkdir()
    (tree / "dir" / "x").write_text("x")
    os.chmod(tree / "README.md", 0o600)
    (tree / "link").symlink_to("README.md")
    git("add", "-A", cwd=tree)
    git("commit", "-qm", "conversation commit", cwd=tree)


@pytest.mark.parametrize("strategy", WORKING, ids=str)
def test_a_worktrees_writes_never_reach_the_original_checkout(
    tmp_path: pathlib.Path, repo: pathlib.Path, strategy: WorktreeStrategy
) -> None:
    if not _works(strategy, tmp_path):
        with pytest.raises((WorktreeError, BadSpec)):
            manager = WorktreeManager(base=str(tmp_path / "wt"), strategy=strategy)
            manager.register("r", str(repo))
            manager.create("r", "c1")
        assert mounted_under(str(tmp_path)) == []
        assert os.listdir(tmp_path / "wt") == []
        return
    before = tree_digest(repo)
    manager = WorktreeManager(base=str(tmp_path / "wt"), strategy=strategy)
    manager.register("r", str(repo))
    wt = manager.create("r", "c1")
    tree = pathlib.Path(wt.path)
    assert (tree / "README.md").read_text() == "original readme\n"
    if strategy is WorktreeStrategy.GIT:
        # The git fallback shares the checkout's .git: a commit from the worktree writes there
        # (which is why the checkout is protected in every dispatch); the files never change.
        (tree / "README.md").write_text("changed by the conversation\n")
        (tree / "new.txt").write_text("new\n")
        (tree / "src" / "main.py").unlink()
        after = {k: v for k, v in tree_digest(repo).items() if not k.startswith(".git")}
        assert after == {k: v for k, v in before.items() if not k.startswith(".git")}
    else:
        _mutate(tree)
        assert tree_digest(repo) == before
        assert (tree / "new.txt").read_text() == "new file\n"
    manager.remove(wt.worktree_id)


@pytest.mark.parametrize("strategy", WORKING, ids=str)
def test_removal_leaves_nothing_behind(
    tmp_path: pathlib.Path, repo: pathlib.Path, strategy: WorktreeStrategy
) -> None:
    if not _works(strategy, tmp_path):
        return  # covered by the fail-closed branch above
    base = tmp_path / "wt"
    manager = WorktreeManager(base=str(base), strategy=strategy)
    manager.register("r", str(repo))
    first = manager.create("r", "c1")
    second = manager.create("r", "c2")
    pathlib.Path(first.path, "scratch").write_text("x")
    assert [w.worktree_id for w in manager.list()] == [first.worktree_id, second.worktree_id]
    assert manager.remove(first.worktree_id) is True
    assert manager.remove(first.worktree_id) is False  # idempotent
    manager.remove(second.worktree_id)
    assert os.listdir(base) == []
    assert mounted_under(str(tmp_path)) == []
    listed = git("worktree", "list", "--porcelain", cwd=repo)
    assert listed.count("worktree ") == 1, listed  # only the checkout itself
    assert not (repo / ".git" / "worktrees").exists() or \
        os.listdir(repo / ".git" / "worktrees") == []


def _overlay_worktree(
    tmp_path: pathlib.Path, repo: pathlib.Path
) -> tuple[pathlib.Path, WorktreeManager, Worktree]:
    """An overlay manager under tmp_path/wt with `repo` registered and one worktree (skips where
    overlay mounts do not work)."""
    if not _works(WorktreeStrategy.OVERLAY, tmp_path):
        pytest.skip("overlay mounts need CAP_SYS_ADMIN; this host uses another strategy")
    base = tmp_path / "wt"
    manager = WorktreeManager(base=str(base), strategy=WorktreeStrategy.OVERLAY)
    manager.register("r", str(repo))
    return base, manager, manager.create("r", "c1")


def test_overlay_mounts_survive_a_killed_server_and_are_recovered(
    tmp_path: pathlib.Path, repo: pathlib.Path
) -> None:
    base, killed, wt = _overlay_worktree(tmp_path, repo)
    pathlib.Path(wt.path, "work.txt").write_text("in progress\n")
    # A stray directory with a mount but no metadata (a create cut short by the kill).
    stray = base / "stray"
    for name in ("lower", "upper", "work", "tree"):
        (stray / name).mkdir(parents=True)
    from cc_server.dispatch.worktrees import _mount_overlay

    _mount_overlay(str(stray / "lower"), str(stray / "upper"), str(stray / "work"),
                   str(stray / "tree"))
    del killed  # SIGKILL: nobody unmounts; the mounts stay in the host's namespace
    restarted = WorktreeManager(base=str(base))
    assert [w.worktree_id for w in restarted.list()] == [wt.worktree_id]
    assert pathlib.Path(wt.path, "work.txt").read_text() == "in progress\n"
    assert not stray.exists()
    assert mounted_under(str(base)) == [wt.path]
    restarted.remove(wt.worktree_id)
    assert mounted_under(str(tmp_path)) == [] and os.listdir(base) == []


def test_a_closed_manager_unmounts_and_the_next_one_remounts(
    tmp_path: pathlib.Path, repo: pathlib.Path
) -> None:
    base, first, wt = _overlay_worktree(tmp_path, repo)
    pathlib.Path(wt.path, "kept.txt").write_text("kept\n")
    first.close()
    assert mounted_under(str(base)) == []
    second = WorktreeManager(base=str(base))
    assert pathlib.Path(wt.path, "kept.txt").read_text() == "kept\n"
    assert second.repos["r"].path == str(repo)
    second.remove_all()
    assert os.listdir(base) == []


def test_a_removal_whose_unmount_fails_can_be_retried(
    tmp_path: pathlib.Path, repo: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cc_server.dispatch import worktrees as module

    base, manager, wt = _overlay_worktree(tmp_path, repo)

    def busy(target: str) -> None:
        raise OSError(16, "Device or resource busy", target)

    with monkeypatch.context() as patch:
        patch.setattr(module, "_umount", busy)
        with pytest.raises(WorktreeError, match="cannot unmount"):
            manager.remove(wt.worktree_id)
    assert [w.worktree_id for w in manager.list()] == [wt.worktree_id]
    assert mounted_under(str(base)) == [wt.path]
    assert manager.remove(wt.worktree_id) is True  # the retry the error's fix asks for
    assert mounted_under(str(tmp_path)) == [] and os.listdir(base) == []


@pytest.mark.parametrize(
    ("repo_id", "conversation", "message"),
    [
        ("../x", "c1", "no registered repository"),
        ("r", "../../etc", "not a valid id"),
        ("r", "", "not a valid id"),
        ("r", "c/1", "not a valid id"),
        ("r", "c1\n", "not a valid id"),
        ("unknown", "c1", "no registered repository"),
    ],
)
def test_bad_worktree_requests_create_nothing(
    tmp_path: pathlib.Path, repo: pathlib.Path, repo_id: str, conversation: str, message: str
) -> None:
    base = tmp_path / "wt"
    manager = WorktreeManager(base=str(base))
    manager.register("r", str(repo))
    with pytest.raises(BadSpec, match=message):
        manager.create(repo_id, conversation)
    assert os.listdir(base) == [] and mounted_under(str(tmp_path)) == []


def test_bad_registrations_are_refused(tmp_path: pathlib.Path, repo: pathlib.Path) -> None:
    manager = WorktreeManager(base=str(tmp_path / "wt"))
    with pytest.raises(BadSpec, match="not absolute"):
        manager.register("r", "repo")
    with pytest.raises(BadSpec, match="not a directory"):
        manager.register("r", str(tmp_path / "missing"))
    with pytest.raises(BadSpec, match="overlaps the worktree directory"):
        manager.register("r", str(tmp_path))
    manager.register("r", str(repo))
    manager.register("r", str(repo))  # the same again is fine
    other = make_repo(tmp_path / "other")
    with pytest.raises(BadSpec, match="is registered for"):
        manager.register("r", str(other))
    if manager.strategy is WorktreeStrategy.OVERLAY:
        odd = make_repo(tmp_path / "a,lowerdir=x")
        with pytest.raises(BadSpec, match="overlay mount options"):
            manager.register("odd", str(odd))


def test_one_worktree_per_conversation_and_repository(
    tmp_path: pathlib.Path, repo: pathlib.Path
) -> None:
    manager = WorktreeManager(base=str(tmp_path / "wt"))
    manager.register("r", str(repo))
    wt = manager.create("r", "c1")
    with pytest.raises(BadSpec, match="already has worktree"):
        manager.create("r", "c1")
    manager.remove(wt.worktree_id)


def test_a_worktree_directory_that_is_not_private_is_refused(tmp_path: pathlib.Path) -> None:
    from cc_server.errors import EnforcementFailed

    base = tmp_path / "wt"
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    with pytest.raises(EnforcementFailed, match="not private"):
        WorktreeManager(base=str(base))
