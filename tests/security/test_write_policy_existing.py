"""The write policy on what exists already: a protected file at any depth of a writable bind
cannot be written, truncated, removed or have its mode changed, by any of the calls that can do
it (an open without O_CREAT, truncate, unlink, rmdir, chmod, fchmod, fchmodat2 with an empty
path, through a dirfd or a /proc/self/fd link); a protected spelling whose components are
symlinks cannot be re-pointed, removed or renamed. Each refusal is one violation with its verb
and the resolved path, and the host is checked afterwards. Ordinary work on ordinary files, and
the command's own streams reopened by name, keep working.

Cases taken from the peers' suites (their tests read, none of their code): Anthropic
sandbox-runtime `test/sandbox/mandatory-deny-paths.test.ts` (an existing `.git/config` and
`.git/hooks/*` nested in a writable root; removal and rename of a protected file), Codex
`codex-rs/linux-sandbox/tests/suite/sandbox.rs` (a `.git` pointer file cannot be rewritten or
removed).
"""

from __future__ import annotations

import os
import pathlib
import stat
import subprocess

import pytest
from escape_kit import Sandboxes, output, run_attack
from write_kit import git_repo, wheel

pytestmark = [pytest.mark.security, pytest.mark.integration]

GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@b", "GIT_COMMITTER_NAME": "a",
    "GIT_COMMITTER_EMAIL": "a@b",
}  # fmt: skip
CONFIG = "repoA/.git/config"
HOOK = "repoA/.git/hooks/pre-push"  # exists, not executable: chmod +x would arm it

# name -> (Python body run in the worktree, the verb refused, the path refused)
ATTACKS: dict[str, tuple[str, str, str]] = {
    "open-r+": (
        f"open('{CONFIG}', 'r+').write('[core]\\n\\tfsmonitor = evil\\n')",
        "file-write-data", CONFIG,
    ),
    "open-wronly": (
        f"os.write(os.open('{HOOK}', os.O_WRONLY), b'#!/bin/sh\\nevil\\n')",
        "file-write-data", HOOK,
    ),
    "open-append": (
        f"os.write(os.open('{CONFIG}', os.O_WRONLY | os.O_APPEND), b'[core]\\n')",
        "file-write-data", CONFIG,
    ),
    "open-rdonly-trunc": (
        f"os.open('{CONFIG}', os.O_RDONLY | os.O_TRUNC)", "file-write-data", CONFIG,
    ),
    "reopen-proc-fd": (
        f"fd = os.open('{CONFIG}', os.O_RDONLY)\n"
        "os.write(os.open(f'/proc/self/fd/{fd}', os.O_WRONLY), b'evil')",
        "file-write-data", CONFIG,
    ),
    "dirfd-wronly": (
        "d = os.open('repoA/.git', os.O_PATH | os.O_DIRECTORY)\n"
        "os.write(os.open('config', os.O_WRONLY, dir_fd=d), b'evil')",
        "file-write-data", CONFIG,
    ),
    "truncate": (f"os.truncate('{CONFIG}', 0)", "file-write-data", CONFIG),
    "truncate-proc-fd": (
        f"fd = os.open('{CONFIG}', os.O_RDONLY)\nos.truncate(f'/proc/self/fd/{{fd}}', 0)",
        "file-write-data", CONFIG,
    ),
    "unlink-config": (f"os.unlink('{CONFIG}')", "file-write-unlink", CONFIG),
    "unlink-pointer": ("os.unlink('linked/.git')", "file-write-unlink", "linked/.git"),
    "unlinkat-dirfd": (
        "d = os.open('repoA/.git/hooks', os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.unlink('pre-push', dir_fd=d)",
        "file-write-unlink", HOOK,
    ),
    "rmdir-empty-hooks": ("os.rmdir('repoB/.git/hooks')", "file-write-unlink", "repoB/.git/hooks"),
    "chmod": (f"os.chmod('{HOOK}', 0o755)", "file-write-mode", HOOK),
    "chmod-dirfd": (
        "d = os.open('repoA/.git/hooks', os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.chmod('pre-push', 0o755, dir_fd=d)",
        "file-write-mode", HOOK,
    ),
    "fchmod-readonly-fd": (
        f"os.fchmod(os.open('{HOOK}', os.O_RDONLY), 0o755)", "file-write-mode", HOOK,
    ),
    "fchmodat2-empty-path": (
        f"fd = os.open('{HOOK}', os.O_PATH)\n"
        "if libc.syscall(452, fd, b'', 0o755, 0x1000): fail()",
        "file-write-mode", HOOK,
    ),
    "chmod-through-symlink": (
        f"os.symlink('{HOOK}', 'innocent')\nos.chmod('innocent', 0o755)",
        "file-write-mode", HOOK,
    ),
}  # fmt: skip


def _plant(wt: pathlib.Path) -> None:
    git_repo(wt / "repoA")
    (wt / HOOK).write_text("#!/bin/sh\nexit 0\n")
    (wt / HOOK).chmod(0o644)
    git_repo(wt / "repoB")
    for p in (wt / "repoB" / ".git" / "hooks").iterdir():
        p.unlink()
    (wt / "linked").mkdir()
    (wt / "linked" / ".git").write_text("gitdir: /nonexistent/.git/worktrees/linked\n")


def _state(wt: pathlib.Path) -> dict[str, tuple[int, bytes]]:
    """Every name under a git directory or pointer: its mode and content."""
    out: dict[str, tuple[int, bytes]] = {}
    for p in sorted(wt.rglob("*")):
        rel = p.relative_to(wt)
        if ".git" not in rel.parts:
            continue
        st = p.lstat()
        out[str(rel)] = (st.st_mode, p.read_bytes() if stat.S_ISREG(st.st_mode) else b"")
    return out


@pytest.mark.parametrize("name", sorted(ATTACKS))
async def test_an_existing_protected_file_cannot_be_changed(
    sb: Sandboxes, tmp_path: pathlib.Path, name: str
) -> None:
    wt = sb.worktree
    _plant(wt)
    body, action, rel = ATTACKS[name]
    before = _state(wt)
    handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=refused [Errno 13]" in out, out  # EACCES
    assert _state(wt) == before, out
    refusals = [(v.action, v.target) for v in handle.violations]
    assert refusals == [(action, f"{wt}/{rel}")], (refusals, out)


# A protected spelling through a symlink (`--protect L/settings.json` where L -> real): neither
# the link nor the directory it leads to may be removed, renamed or replaced.
SPELLING_ATTACKS: dict[str, tuple[str, str, str]] = {
    "rm-link": ("rm L", "file-write-unlink", "L"),
    "re-point-link": ("ln -sfn elsewhere L", "file-write-rename", "L"),
    "rename-link": ("mv L L2", "file-write-rename", "L"),
    "rename-target-dir": ("mv real real2", "file-write-rename", "real"),
    "rename-onto-link": ("mkdir other && mv -T other L", "file-write-rename", "L"),
}


@pytest.mark.parametrize("name", sorted(SPELLING_ATTACKS))
async def test_a_protected_spelling_through_a_symlink_cannot_be_re_pointed(
    sb: Sandboxes, name: str
) -> None:
    wt = sb.worktree
    (wt / "real").mkdir()
    (wt / "real" / "settings.json").write_text("{}\n")
    (wt / "L").symlink_to("real")
    (wt / "elsewhere").mkdir()
    script, action, rel = SPELLING_ATTACKS[name]
    handle = sb.launch(protectedPaths=[str(wt / "L" / "settings.json")])
    result = await sb.sh(handle, f"cd {wt} && {{ {script}; }}; echo rc=$?")
    out = output(result)
    assert "rc=0" not in out, out
    assert os.readlink(wt / "L") == "real", out
    assert (wt / "real" / "settings.json").read_text() == "{}\n", out
    assert not (wt / "L2").exists() and not (wt / "real2").exists(), out
    refusals = [(v.action, v.target) for v in handle.violations]
    assert refusals == [(action, f"{wt}/{rel}")], (refusals, out)


async def test_ordinary_changes_to_ordinary_files_still_work(sb: Sandboxes) -> None:
    # The control for every refusal above: the same calls on files no rule protects, the
    # command's own streams reopened by name (a root server's pipes are the sandbox's), and
    # work in a repository that does not touch its host-run files.
    wt = sb.worktree
    _plant(wt)
    (wt / "src.py").write_text("print(1)\n")
    (wt / "tree" / "a").mkdir(parents=True)
    (wt / "tree" / "a" / "f").write_text("x")
    handle = sb.launch()
    result = await sb.sh(handle, (
        f"cd {wt} && set -e; "
        "echo to-stderr > /dev/stderr; echo to-stdout | tee /dev/stderr > /dev/stdout; "
        "python3 -c \"import os; f=open('src.py','r+'); f.write('print(2)'); f.close(); "
        "os.truncate('src.py', 8); os.chmod('src.py', 0o755); "
        "os.fchmod(os.open('src.py', os.O_RDONLY), 0o700)\"; "
        "rm -rf tree; echo keep > k && rm k; "
        "git -C repoA status --short >/dev/null; cat repoA/.git/config >/dev/null; "
        "echo done"
    ))  # fmt: skip
    out = output(result)
    assert result.exit_code == 0 and result.stdout.decode().splitlines()[-1] == "done", out
    assert "to-stderr" in out and out.count("to-stdout") == 2, out
    assert (wt / "src.py").read_text() == "print(2)" and (
        wt / "src.py"
    ).stat().st_mode & 0o777 == 0o700
    assert not (wt / "tree").exists()
    assert not [v for v in handle.violations if v.action.startswith("file-")], handle.violations


async def test_a_kernel_object_opened_for_writing_is_refused_and_reported(sb: Sandboxes) -> None:
    # Opens without O_CREAT now reach the supervisor too; it must not open procfs or sysfs for a
    # task (its credentials own the sandbox's user namespace): refused, the host unchanged.
    sysctl = pathlib.Path("/proc/sys/net/ipv4/ip_forward")
    before = sysctl.read_text()
    handle = sb.launch()
    flip = "0" if before.strip() == "1" else "1"
    result = await sb.sh(handle, (
        "python3 -c \"import os\n"
        "calls = (('/proc/sys/net/ipv4/ip_forward', os.O_WRONLY), ('/proc/1/mem', os.O_RDWR))\n"
        "for p, f in calls:\n"
        "    try:\n"
        "        fd = os.open(p, f); print('opened', p)\n"
        f"        os.write(fd, b'{flip}') if 'sys' in p else None\n"
        "    except OSError as e:\n"
        "        print('refused', p, e.errno)\""
    ))  # fmt: skip
    out = output(result)
    assert "opened" not in out and out.count("refused") == 2, out
    assert sysctl.read_text() == before
    # /proc/1/mem the supervisor refuses (a violation); the sysctl, where the kernel itself
    # already refuses the open (EACCES, EROFS), may be the kernel's answer and no violation.
    refusals = {(v.action, v.target) for v in handle.violations}
    assert ("file-write-data", "/proc/1/mem") in refusals, (refusals, out)
    assert refusals <= {("file-write-data", str(sysctl)), ("file-write-data", "/proc/1/mem")}


async def test_git_worktree_add_to_the_sandboxs_tmp_works_and_a_hosts_worktree_stays_protected(
    sb: Sandboxes,
) -> None:
    # `git worktree add` writes .git/worktrees/<name>/{commondir,gitdir,HEAD,...} in the host's
    # repository: allowed in a directory the sandbox made itself (no pointer on the host names
    # it); the commondir of a worktree the host made stays protected.
    wt = sb.worktree
    git_repo(wt)
    (wt / "f").write_text("v1\n")
    git_env = {"PATH": "/usr/bin:/bin", "GIT_CONFIG_GLOBAL": "/dev/null", **GIT_IDENTITY}
    subprocess.run(f"cd {wt} && git add f && git commit -qm init && git worktree add -q "
                   f"{sb.root}/hostwt -b host", shell=True, check=True, env=git_env)  # fmt: skip
    host_commondir = wt / ".git" / "worktrees" / "hostwt" / "commondir"
    before = host_commondir.read_bytes()
    exports = " ".join(f"{k}={v}" for k, v in git_env.items() if k != "PATH")
    handle = sb.launch()
    result = await sb.sh(handle, (
        f"export {exports}; cd {wt} && git worktree add -q /tmp/side -b side && "
        "cd /tmp/side && echo x > g && git add g && git commit -qm side && "
        "git log --oneline | wc -l; "
        f"echo /evil > {host_commondir}; echo host=$?"
    ))  # fmt: skip
    out = output(result)
    assert result.stdout.decode().splitlines()[0] == "2", out
    assert "host=0" not in out, out
    assert host_commondir.read_bytes() == before
    refusals = [(v.action, v.target) for v in handle.violations]
    assert refusals == [("file-write-data", str(host_commondir))], (refusals, out)


@pytest.mark.parametrize(
    "script",
    [
        "mv .git/worktrees/hostwt .git/worktrees/moved",
        "rm -rf .git/worktrees/hostwt",
        "mkdir .git/worktrees/mine && /usr/bin/python3 -c \"import ctypes; "
        "r = ctypes.CDLL(None, use_errno=True).renameat2(-100, b'.git/worktrees/mine', -100, "
        "b'.git/worktrees/hostwt', 2); raise SystemExit(ctypes.get_errno() if r else 0)\"",
    ],
    ids=["rename-away", "remove", "exchange"],
)
async def test_a_hosts_worktree_directory_cannot_be_moved_away_and_made_again(
    sb: Sandboxes, script: str
) -> None:
    # Moved away (or emptied and removed), its name could be made again as the sandbox's own,
    # with a commondir of its choosing, which the host's pointer to that name would follow.
    wt = sb.worktree
    git_repo(wt)
    (wt / "f").write_text("v1\n")
    git_env = {"PATH": "/usr/bin:/bin", "GIT_CONFIG_GLOBAL": "/dev/null", **GIT_IDENTITY}
    subprocess.run(f"cd {wt} && git add f && git commit -qm init && git worktree add -q "
                   f"{sb.root}/hostwt -b host", shell=True, check=True, env=git_env)  # fmt: skip
    commondir = wt / ".git" / "worktrees" / "hostwt" / "commondir"
    before = commondir.read_bytes()
    handle = sb.launch()
    result = await sb.sh(handle, (
        f"cd {wt} && {{ {script}; }}; "
        "mkdir -p .git/worktrees/hostwt && echo /evil > .git/worktrees/hostwt/commondir; "
        "echo rc=$?"
    ))  # fmt: skip
    out = output(result)
    assert "rc=0" not in out, out
    assert commondir.read_bytes() == before, out
    assert not (wt / ".git" / "worktrees" / "moved").exists()
    assert [v for v in handle.violations if v.action.startswith("file-write-")], out


async def test_package_installs_work_in_a_repository(sb: Sandboxes, tmp_path: pathlib.Path) -> None:
    # Ordinary work the protection must not break: a venv with pip installing into it, npm
    # installing into node_modules, both inside a repository in the worktree (offline: a local
    # wheel and a packed local package).
    wt = sb.worktree
    git_repo(wt)
    kit = tmp_path / "kit"
    (kit / "pkg").mkdir(parents=True)
    whl = wheel(kit, "ccsdemo", "0.1", {"ccsdemo.py": "VALUE = 42\n"})
    (kit / "pkg" / "package.json").write_text('{"name": "ccs-demo", "version": "1.0.0"}\n')
    (kit / "pkg" / "index.js").write_text("module.exports = 42;\n")
    subprocess.run(["npm", "pack", "--silent", "--pack-destination", str(kit)], cwd=kit / "pkg",
                   check=True, capture_output=True)  # fmt: skip
    tgz = kit / "ccs-demo-1.0.0.tgz"
    handle = sb.launch(bindMounts=[{"hostPath": str(wt)}, {"hostPath": str(kit), "readOnly": True}])
    result = await sb.sh(handle, (
        f"cd {wt} && set -e; /usr/bin/python3 -m venv venv; "
        f"venv/bin/python -m pip install -q --no-index {whl}; "
        "venv/bin/python -c 'import ccsdemo; print(\"py\", ccsdemo.VALUE)'; "
        f"npm install --offline --no-audit --no-fund --loglevel=error {tgz}; "
        "node -e 'console.log(\"js\", require(\"ccs-demo\"))'"
    ), timeout_s=120)  # fmt: skip
    out = output(result)
    assert result.exit_code == 0 and "py 42" in out and "js 42" in out, out
    assert (wt / "node_modules" / "ccs-demo" / "index.js").is_file()
    assert not [v for v in handle.violations if v.action.startswith("file-")], handle.violations
