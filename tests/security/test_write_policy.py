"""Write protection decided when the write happens: host-run files at any depth of a writable
bind, existing or new, each refusal one violation, the host checked afterwards.

Cases taken from the peers' own suites (their tests read, none of their code): Anthropic
sandbox-runtime `test/sandbox/mandatory-deny-paths.test.ts` (shell rc files, `.gitconfig`,
`.git/hooks`, `.git/config`, `.vscode`, `.idea`, `.claude/commands`, `.claude/agents`, `.mcp.json`,
`.ripgreprc`, at the root and nested; names that do not exist yet), Codex
`codex-rs/linux-sandbox/tests/suite/sandbox.rs` (no new repository inside a writable root; a
`.git` pointer cannot be rewritten).
"""

from __future__ import annotations

import pathlib
import subprocess
import tarfile

import pytest
from escape_kit import Sandboxes, output

pytestmark = [pytest.mark.security, pytest.mark.integration]

GIT_ENV = (
    "GIT_CONFIG_GLOBAL=/dev/null GIT_AUTHOR_NAME=a GIT_AUTHOR_EMAIL=a@b GIT_COMMITTER_NAME=a "
    "GIT_COMMITTER_EMAIL=a@b"
)


def _repo(path: pathlib.Path) -> None:
    subprocess.run(["git", "init", "-q", str(path)], check=True, env={"PATH": "/usr/bin:/bin"})


# name -> (script run in the worktree, the host path that must not appear or change)
ESCAPES: dict[str, tuple[str, str]] = {
    "nested-hook": ("echo evil > repoA/.git/hooks/pre-commit", "repoA/.git/hooks/pre-commit"),
    "nested-config": ("printf '[core]\\n\\tfsmonitor = evil\\n' >> repoA/.git/config",
                      "repoA/.git/config"),
    "deep-hook": ("echo evil > a/b/repoB/.git/hooks/post-checkout",
                  "a/b/repoB/.git/hooks/post-checkout"),
    "new-bashrc": ("echo evil > .bashrc", ".bashrc"),
    "nested-zshrc": ("echo evil > a/.zshrc", "a/.zshrc"),
    "new-mcp": ("echo '{}' > .mcp.json", ".mcp.json"),
    "new-gitmodules": ("echo evil > .gitmodules", ".gitmodules"),
    "new-gitconfig": ("echo evil > a/.gitconfig", "a/.gitconfig"),
    "claude-dir": ("mkdir .claude", ".claude"),
    "vscode-dir": ("mkdir -p a/.vscode", "a/.vscode"),
    "idea-dir": ("mkdir .idea", ".idea"),
    "ripgreprc": ("echo evil > .ripgreprc", ".ripgreprc"),
    "commondir": ("echo /evil > repoA/.git/commondir", "repoA/.git/commondir"),
    "git-init": ("git init -q sub", "sub/.git"),
    "git-init-in-nested": ("cd a && git init -q", "a/.git"),
    "rename-onto": ("echo evil > plain.txt && mv plain.txt .profile", ".profile"),
    "link-onto": ("echo evil > plain2.txt && ln plain2.txt a/.bash_profile", "a/.bash_profile"),
    "symlink-onto": ("ln -s /tmp/x .mcp.json", ".mcp.json"),
    "hooks-moved-away": ("mv repoA/.git/hooks repoA/.git/hooks.old", "repoA/.git/hooks.old"),
    "ssh-authorized": ("mkdir -p home/.ssh", "home/.ssh"),
    "pointer-rewrite": ("printf 'gitdir: .evil\\n' > linked/.git", "linked/.git"),
    "worktree-commondir": ("echo /evil > repoA/.git/worktrees/w/commondir",
                           "repoA/.git/worktrees/w/commondir"),
    "hard-link-alias": ("ln repoA/.git/config alias && echo evil >> alias", "repoA/.git/config"),
    "xdg-git-config": ("mkdir -p home/.config/git && echo evil > home/.config/git/config",
                       "home/.config/git"),
    "bash-aliases": ("echo evil > home/.bash_aliases", "home/.bash_aliases"),
    # A bare repository's shape in any other directory (host git's default
    # safe.bareRepository=all honours its config): its HEAD is what is refused.
    "bare-repository": ("mkdir -p a/objects a/refs && printf '[core]\\n\\tfsmonitor = evil\\n'"
                        " > a/config && echo 'ref: refs/heads/main' > a/HEAD", "a/HEAD"),
}


def _plant(wt: pathlib.Path) -> dict[str, bytes | None]:
    """The worktree's host-side state the escapes aim at: two nested repositories, a linked
    worktree's `.git` pointer, a plain directory."""
    _repo(wt / "repoA")
    (wt / "a" / "b").mkdir(parents=True)
    _repo(wt / "a" / "b" / "repoB")
    (wt / "linked").mkdir()
    (wt / "linked" / ".git").write_text("gitdir: /nonexistent/.git/worktrees/linked\n")
    (wt / "home").mkdir()
    (wt / "home" / ".config").mkdir()
    (wt / "repoA" / ".git" / "worktrees" / "w").mkdir(parents=True)
    (wt / "repoA" / ".git" / "worktrees" / "w" / "commondir").write_text("../..\n")
    return {rel: _read(wt / rel) for _, rel in ESCAPES.values()}


def _read(path: pathlib.Path) -> bytes | None:
    try:
        return path.read_bytes() if path.is_file() else b"<dir>" if path.is_dir() else b""
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("name", sorted(ESCAPES))
async def test_a_host_run_file_at_any_depth_cannot_be_planted(sb: Sandboxes, name: str) -> None:
    wt = sb.worktree
    before = _plant(wt)
    script, rel = ESCAPES[name]
    handle = sb.launch()
    result = await sb.sh(handle, f"cd {wt} && export {GIT_ENV} && {{ {script}; }}; echo rc=$?")
    out = output(result)
    assert "rc=0" not in out, out
    assert _read(wt / rel) == before[rel], f"{rel} changed on the host:\n{out}"
    refusals = [v for v in handle.violations if v.action.startswith("file-write-")]
    assert len(refusals) == 1, (refusals, out)


async def test_a_protected_path_missing_at_launch_cannot_be_made(sb: Sandboxes) -> None:
    wt = sb.worktree
    later = wt / "later" / "settings.json"
    (wt / "real").mkdir()
    (wt / "L").symlink_to("real")  # a protected spelling through a symlink
    handle = sb.launch(protectedPaths=[str(later), str(wt / "L" / "settings.json")])
    result = await sb.sh(handle, (
        f"cd {wt} && mkdir -p later && echo evil > later/settings.json; echo a=$?; "
        "echo evil > L/settings.json; echo b=$?; "
        "rm L && mkdir L && echo evil > L/settings.json; echo c=$?"
    ))  # fmt: skip
    out = output(result)
    assert "a=0" not in out and "b=0" not in out and "c=0" not in out, out
    assert not later.exists() and not (wt / "real" / "settings.json").exists()
    assert not (wt / "L" / "settings.json").exists()


async def test_ordinary_work_still_works(sb: Sandboxes, tmp_path: pathlib.Path) -> None:
    # The control for every refusal above: editing, new source files, an archive, a venv, and
    # git in the worktree's own repository (made by the host): commit, branch, checkout. (`git
    # worktree add` works to the sandbox's /tmp: test_write_policy_existing.py.)
    wt = sb.worktree
    _repo(wt)
    (wt / "main.py").write_text("print('v1')\n")
    archive = tmp_path / "src.tar"
    members = tmp_path / "members"
    (members / "pkg").mkdir(parents=True)
    for i in range(200):
        (members / "pkg" / f"m{i}.py").write_text(f"x = {i}\n")
    with tarfile.open(archive, "w") as tar:
        tar.add(str(members / "pkg"), arcname="pkg")
    handle = sb.launch(bindMounts=[{"hostPath": str(wt)},
                                   {"hostPath": str(tmp_path / "src.tar"), "readOnly": True}])
    result = await sb.sh(handle, (
        f"cd {wt} && export {GIT_ENV} && set -e; "
        "echo \"print('v2')\" > main.py; mkdir -p src/lib && echo 'y = 1' > src/lib/y.py; "
        f"tar -xf {archive}; ls pkg | wc -l; "
        "python3 -m venv --without-pip venv; test -x venv/bin/python3; "
        "git add -A && git commit -qm work && git log --oneline | wc -l; "
        "git checkout -qb topic && git checkout -q - && git log -g --oneline | grep -q .; "
        "echo done"
    ), timeout_s=60)  # fmt: skip
    out = output(result)
    assert out.splitlines()[-3:] == ["200", "1", "done"], out
    assert (wt / "main.py").read_text() == "print('v2')\n"
    assert not [v for v in handle.violations if v.action.startswith("file-write-")], out


async def test_a_git_directory_bound_on_its_own_is_judged_by_its_place(sb: Sandboxes) -> None:
    # A writable bind nested in another is matched from the outer bind's root: `.git` bound
    # by itself is still a `.git`, so `hooks/pre-commit` inside it is `.git/hooks/pre-commit`.
    wt = sb.worktree
    _repo(wt / "repoA")
    git_dir = wt / "repoA" / ".git"
    handle = sb.launch(bindMounts=[{"hostPath": str(wt)}, {"hostPath": str(git_dir)}])
    result = await sb.sh(handle, f"echo evil > {git_dir}/hooks/pre-commit; echo rc=$?")
    assert "rc=0" not in output(result), output(result)
    assert not (git_dir / "hooks" / "pre-commit").exists()
