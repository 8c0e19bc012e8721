"""Attacks on the write policy decided when the write happens (the create-rule supervisor's
protected path patterns), each refused: other spellings of a protected path (a dirfd, procfs
magic links, `//`, `./`, `..`, a symlink in the worktree, another case), O_TMPFILE then a link,
renames and exchanges either side, archives and copies that carry a `.git`, git writing its own
config. The host is checked afterwards. Ordinary work that looks like these stays possible.
"""

from __future__ import annotations

import pathlib
import subprocess

import pytest
from escape_kit import ATTACK_RUNNER, Sandboxes, output

pytestmark = [pytest.mark.security, pytest.mark.integration]

GIT_ENV = (
    "GIT_CONFIG_GLOBAL=/dev/null GIT_AUTHOR_NAME=a GIT_AUTHOR_EMAIL=a@b GIT_COMMITTER_NAME=a "
    "GIT_COMMITTER_EMAIL=a@b"
)

# Each attack: a Python body run in the worktree inside the sandbox; it must raise.
SPELLINGS: dict[str, str] = {
    "dirfd-of-git": (
        "d = os.open('repoA/.git', os.O_PATH | os.O_DIRECTORY)\n"
        "os.open('hooks/pre-commit', os.O_CREAT | os.O_WRONLY, 0o755, dir_fd=d)"
    ),
    "dirfd-of-hooks": (
        "d = os.open('repoA/.git/hooks', os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.open('pre-commit', os.O_CREAT | os.O_WRONLY, 0o755, dir_fd=d)"
    ),
    "proc-self-fd": (
        "d = os.open('repoA/.git', os.O_PATH | os.O_DIRECTORY)\n"
        "os.open(f'/proc/self/fd/{d}/hooks/pre-commit', os.O_CREAT | os.O_WRONLY, 0o755)"
    ),
    "proc-self-cwd": (
        "os.open('/proc/self/cwd/repoA/.git/hooks/pre-commit', os.O_CREAT | os.O_WRONLY)"
    ),
    "proc-self-root": (
        "os.open('/proc/self/root' + os.getcwd() + '/repoA/.git/hooks/pre-commit', "
        "os.O_CREAT | os.O_WRONLY)"
    ),
    "double-slash": "os.open('repoA//.git//hooks//pre-commit', os.O_CREAT | os.O_WRONLY)",
    "dot": "os.open('repoA/./.git/./hooks/./pre-commit', os.O_CREAT | os.O_WRONLY)",
    "dotdot": "os.open('repoA/.git/objects/../hooks/pre-commit', os.O_CREAT | os.O_WRONLY)",
    "symlink-to-hooks": (
        "os.symlink('repoA/.git/hooks', 'hk')\nos.open('hk/pre-commit', os.O_CREAT | os.O_WRONLY)"
    ),
    "symlink-to-git-mkdir": "os.symlink('repoA/.git', 'gd')\nos.mkdir('gd/hooks/sub')",
    "upper-case": "os.makedirs('caseR/.GIT/hooks')",
    "mkdir-p-new-git": "os.makedirs('newr/.git/hooks')",
    "git-symlink": "os.makedirs('plain/hooks')\nos.symlink('../plain', 'repoC/.git')",
    "tmpfile-proc-link": (
        "fd = os.open('repoA/.git/hooks', os.O_TMPFILE | os.O_WRONLY, 0o755)\n"
        "os.write(fd, b'#!/bin/sh\\n')\n"
        "os.link(f'/proc/self/fd/{fd}', 'repoA/.git/hooks/pre-commit', follow_symlinks=True)"
    ),
    "tmpfile-linkat-empty-path": (
        "fd = os.open('repoA/.git/hooks', os.O_TMPFILE | os.O_WRONLY, 0o755)\n"
        "d = os.open('repoA/.git/hooks', os.O_PATH)\n"
        "if libc.linkat(fd, b'', d, b'pre-commit', 0x1000): fail()"
    ),
    "exchange-hooks": (
        "os.makedirs('xch')\nopen('xch/pre-commit', 'w').write('evil')\n"
        "if libc.renameat2(-100, b'xch', -100, b'repoA/.git/hooks', 2): fail()"
    ),
    "exchange-git": (
        "os.makedirs('xg/hooks')\nopen('xg/hooks/pre-commit', 'w').write('evil')\n"
        "if libc.renameat2(-100, b'xg', -100, b'repoA/.git', 2): fail()"
    ),
    "rmdir-hooks-then-rename": (
        "[os.unlink('repoB/.git/hooks/' + n) for n in os.listdir('repoB/.git/hooks')]\n"
        "os.rmdir('repoB/.git/hooks')\n"
        "os.makedirs('stage/hooks')\nopen('stage/hooks/pre-commit', 'w').write('evil')\n"
        "os.rename('stage/hooks', 'repoB/.git/hooks')"
    ),
    "sample-renamed": (
        "os.chmod('repoA/.git/hooks/pre-commit.sample', 0o755)\n"
        "os.rename('repoA/.git/hooks/pre-commit.sample', 'repoA/.git/hooks/pre-commit')"
    ),
    "unix-socket": (
        "import socket\nsocket.socket(socket.AF_UNIX).bind('repoA/.git/hooks/pre-commit')"
    ),
    "mknod-fifo": "os.mkfifo('repoA/.git/hooks/pre-commit')",
}


def _repo(path: pathlib.Path) -> None:
    subprocess.run(["git", "init", "-q", str(path)], check=True, env={"PATH": "/usr/bin:/bin"})


def _snapshot(wt: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(wt)): p.read_bytes()
        for p in sorted(wt.rglob("*"))
        if ".git" in p.parts and p.is_file() and not p.is_symlink()
    }


@pytest.mark.parametrize("name", sorted(SPELLINGS))
async def test_another_spelling_of_a_protected_path_is_refused(
    sb: Sandboxes, tmp_path: pathlib.Path, name: str
) -> None:
    wt = sb.worktree
    _repo(wt / "repoA")
    _repo(wt / "repoB")
    (wt / "repoC").mkdir()
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "run.py").write_text(ATTACK_RUNNER)
    (kit / "attack.py").write_text(SPELLINGS[name] + "\n")
    before = _snapshot(wt)
    handle = sb.launch(bindMounts=[{"hostPath": str(wt)}, {"hostPath": str(kit), "readOnly": True}])
    result = await sb.sh(handle, f"/usr/bin/python3 {kit}/run.py {wt} {kit}/attack.py 2>&1")
    out = output(result)
    assert "RESULT=refused" in out, out
    after = _snapshot(wt)
    # Nothing new or changed in any git directory (removing samples is not a host-run write).
    assert {k: v for k, v in after.items() if before.get(k) != v} == {}, out
    for git_dir in ("repoA/.git/hooks", "repoB/.git/hooks"):
        names = {p.name for p in (wt / git_dir).iterdir()} if (wt / git_dir).is_dir() else set()
        assert not {n for n in names if not n.endswith(".sample")}, (git_dir, names, out)
    for new_git in ("caseR/.GIT", "newr/.git", "repoC/.git"):
        assert not (wt / new_git).exists() and not (wt / new_git).is_symlink(), out
    assert [v for v in handle.violations if v.action.startswith("file-write-")], out


async def test_archives_copies_and_git_itself_cannot_plant_a_repository(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    wt = sb.worktree
    _repo(wt / "repoA")
    arc = tmp_path / "arc"
    (arc / "x" / ".git" / "hooks").mkdir(parents=True)
    (arc / "x" / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\necho evil\n")
    (arc / "y").mkdir()
    (arc / "y" / ".bashrc").write_text("evil\n")
    subprocess.run(
        "tar cf a.tar x && tar cf b.tar y && zip -qr c.zip x", shell=True, cwd=arc, check=True
    )
    config_before = (wt / "repoA" / ".git" / "config").read_bytes()
    handle = sb.launch(bindMounts=[{"hostPath": str(wt)}, {"hostPath": str(arc), "readOnly": True}])
    result = await sb.sh(handle, (
        f"cd {wt} && export {GIT_ENV}; "
        f"tar xf {arc}/a.tar; echo tar=$?; tar xf {arc}/b.tar; echo tarb=$?; "
        f"unzip -q {arc}/c.zip -d z; echo unzip=$?; cp -r repoA repoCopy; echo cp=$?; "
        "git -C repoA config core.hooksPath /evil; echo config=$?; "
        "git clone -q repoA cloned; echo clone=$?"
    ), timeout_s=60)  # fmt: skip
    out = output(result)
    for step in ("tar", "tarb", "unzip", "cp", "config", "clone"):
        assert f"{step}=0" not in out, out
    for planted in ("x/.git", "y/.bashrc", "z/x/.git", "repoCopy/.git", "cloned/.git"):
        assert not (wt / planted).exists(), (planted, out)
    assert (wt / "repoA" / ".git" / "config").read_bytes() == config_before, out


async def test_work_that_looks_like_an_attack_still_works(sb: Sandboxes) -> None:
    # npm's bin links, a venv, a commit in the host's repository, `git -c` (environment only), a
    # directory called hooks outside any .git, a .git-like name that is not .git, a deep tree.
    wt = sb.worktree
    _repo(wt)
    (wt / "f").write_text("v1\n")
    subprocess.run(
        f"cd {wt} && git add f && {GIT_ENV} git commit -qm init", shell=True, check=True,
        env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    handle = sb.launch()
    result = await sb.sh(handle, (
        f"cd {wt} && export {GIT_ENV} && set -e; "
        "mkdir -p node_modules/.bin node_modules/foo && echo x > node_modules/foo/cli.js; "
        "ln -s ../foo/cli.js node_modules/.bin/foo; "
        "python3 -m venv --without-pip venv; test -x venv/bin/python3; "
        "mkdir -p tools/hooks && echo x > tools/hooks/pre-commit; "
        "mkdir -p notgit/.gitx/hooks && echo x > notgit/.gitx/hooks/pre-commit; "
        "echo '# x' > .gitignore; "
        "d=deep; for i in 1 2 3 4 5 6 7 8 9 10; do d=$d/$(printf 'd%.0s' $(seq 1 200)); done; "
        "mkdir -p $d && echo x > $d/leaf.txt; "
        "echo v2 > f && git -c core.hooksPath=/nonexistent commit -qam work; "
        "git log --oneline | wc -l; echo done"
    ), timeout_s=60)  # fmt: skip
    out = output(result)
    assert out.splitlines()[-2:] == ["2", "done"], out
    assert (wt / "node_modules" / ".bin" / "foo").is_symlink()
    assert (wt / "tools" / "hooks" / "pre-commit").is_file()
    assert not [v for v in handle.violations if v.action.startswith("file-write-")], out
