"""The supervisor's fast path for an open, attacked where it now skips work: a bare name is judged
in the directory the task starts from (its cwd, its dirfd, the root) without that directory being
opened again, a path of plain names is judged as the start directory's path joined with it
without its parent being opened, and a file made by O_CREAT|O_EXCL is not checked for being a
terminal or an object of a kernel filesystem. Real bubblewrap; each case checks the host afterwards.
"""

from __future__ import annotations

import pathlib
import subprocess

import pytest
from escape_kit import Sandboxes, output, run_attack
from other_user import OtherUser
from write_kit import refusals, tree_state

pytestmark = [pytest.mark.security, pytest.mark.integration]

GIT_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1"}
CONFIG = "repoA/.git/config"
NEW_HOOK = "repoA/.git/hooks/pre-commit"
EXCL = "os.O_CREAT | os.O_EXCL | os.O_WRONLY"


def _plant(wt: pathlib.Path) -> None:
    for args in (["init", "-q", str(wt / "repoA")], ["init", "-q", "--bare", str(wt / "bare.git")]):
        subprocess.run(["git", *args], check=True, capture_output=True, env=GIT_ENV)
    (wt / "plain").mkdir()
    (wt / "plain" / "file").write_text("data\n")
    for d in ("objects", "refs"):
        (wt / "shaped" / d).mkdir(parents=True)  # HEAD beside these would make a bare repo


# name -> (body, action, path below the worktree): a bare name relative to the directory the
# task starts from, where that directory is the protected one.
REFUSED: dict[str, tuple[str, str, str]] = {
    "dirfd-config-append": (
        "d = os.open('repoA/.git', os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.write(os.open('config', os.O_WRONLY | os.O_APPEND, dir_fd=d), b'evil')",
        "file-write-data", CONFIG,
    ),
    "o-path-dirfd-new-hook-excl": (
        "d = os.open('repoA/.git/hooks', os.O_PATH | os.O_DIRECTORY)\n"
        f"os.open('pre-commit', {EXCL}, 0o755, dir_fd=d)",
        "file-write-create", NEW_HOOK,
    ),
    "cwd-new-hook-excl": (
        f"os.chdir('repoA/.git/hooks')\nos.open('pre-commit', {EXCL}, 0o755)",
        "file-write-create", NEW_HOOK,
    ),
    "cwd-new-hook-creat": (
        "os.chdir('repoA/.git/hooks')\nos.open('pre-commit', os.O_CREAT | os.O_WRONLY, 0o755)",
        "file-write-create", NEW_HOOK,
    ),
    "cwd-config-truncate": (
        "os.chdir('repoA/.git')\nos.open('config', os.O_WRONLY | os.O_TRUNC)",
        "file-write-data", CONFIG,
    ),
    "dirfd-bare-config": (  # a git directory by its shape, not by its name
        "d = os.open('bare.git', os.O_PATH | os.O_DIRECTORY)\n"
        "os.write(os.open('config', os.O_WRONLY | os.O_APPEND, dir_fd=d), b'evil')",
        "file-write-data", "bare.git/config",
    ),
    "dirfd-bare-new-hook": (
        "d = os.open('bare.git/hooks', os.O_RDONLY | os.O_DIRECTORY)\n"
        f"os.open('post-update', {EXCL}, 0o755, dir_fd=d)",
        "file-write-create", "bare.git/hooks/post-update",
    ),
    "dirfd-head-beside-objects-and-refs": (
        "d = os.open('shaped', os.O_PATH | os.O_DIRECTORY)\n"
        f"os.open('HEAD', {EXCL}, 0o644, dir_fd=d)",
        "file-write-create", "shaped/HEAD",
    ),
    "dirfd-dot-mcp-json": (
        "d = os.open('plain', os.O_PATH | os.O_DIRECTORY)\n"
        f"os.open('.mcp.json', {EXCL}, 0o644, dir_fd=d)",
        "file-write-create", "plain/.mcp.json",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REFUSED))
async def test_a_bare_name_from_a_protected_start_directory_is_refused(
    sb: Sandboxes, tmp_path: pathlib.Path, name: str
) -> None:
    wt = sb.worktree
    _plant(wt)
    body, action, rel = REFUSED[name]
    before = tree_state(wt)
    handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=refused [Errno 13]" in out, out
    assert tree_state(wt) == before, out
    assert refusals(handle) == [(action, f"{wt}/{rel}")], (refusals(handle), out)


async def test_a_bare_name_from_a_file_is_enotdir_and_makes_nothing(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # The start "directory" is a regular file: the kernel's ENOTDIR, as without a supervisor.
    wt = sb.worktree
    _plant(wt)
    before = tree_state(wt)
    body = (
        "f = os.open('plain/file', os.O_RDONLY)\n"
        "got = []\n"
        f"for flags in ({EXCL}, os.O_CREAT | os.O_WRONLY, os.O_WRONLY):\n"
        "    try:\n        os.open('x', flags, 0o644, dir_fd=f); got.append('OPENED')\n"
        "    except OSError as e:\n        got.append(e.errno)\n"
        "print('GOT', got)"
    )
    handle, out = await run_attack(sb, tmp_path, body)
    assert "GOT [20, 20, 20]" in out, out  # ENOTDIR
    assert tree_state(wt) == before, out
    assert refusals(handle) == [], out


def _ip_forward() -> str:
    return pathlib.Path("/proc/sys/net/ipv4/ip_forward").read_text()


async def test_an_exclusive_create_never_opens_a_kernel_object_or_the_terminal(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # O_CREAT|O_EXCL skips the terminal and kernel-filesystem checks because it can only make a
    # new regular file: an existing name (the terminal, a sysctl, the launcher's memory) is
    # EEXIST, and a kernel filesystem makes no file by open. Never an fd, never a write.
    wt = sb.worktree
    _plant(wt)
    forward = _ip_forward()
    body = (
        "got = {}\n"
        "for p in ('/dev/tty', '/proc/sys/net/ipv4/ip_forward', '/proc/1/mem', '/proc/self/mem',\n"
        "          '/proc/s_new', '/proc/self/s_new', '/proc/sys/s_new', '/sys/s_new',\n"
        "          '/sys/fs/cgroup/s_new', '/dev/shm/../../proc/s_new'):\n"
        "    try:\n"
        "        fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)\n"
        "        os.write(fd, b'1'); got[p] = 'WROTE'\n"
        "    except OSError as e:\n        got[p] = e.errno\n"
        "d = os.open('/proc/sys/net/ipv4', os.O_PATH | os.O_DIRECTORY)\n"
        "for n in ('ip_forward', 's_new'):\n"
        "    try:\n"
        "        os.write(os.open(n, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644, dir_fd=d), b'1')\n"
        "        got['dirfd:' + n] = 'WROTE'\n"
        "    except OSError as e:\n        got['dirfd:' + n] = e.errno\n"
        "print('GOT', sorted(got.items()))\n"
        "print('WROTE' in got.values())"
    )
    handle, out = await run_attack(sb, tmp_path, body)
    assert "GOT [" in out and "\nFalse" in out, out
    assert "'/dev/tty', 17" in out and "'/proc/sys/net/ipv4/ip_forward', 17" in out, out
    assert "'/proc/1/mem', 17" in out and "'dirfd:ip_forward', 17" in out, out
    assert _ip_forward() == forward
    assert not [v for v in handle.violations if v.action.startswith("file-")], out


# The supervisor keeps a thread's cwd and root between its calls, and drops them at every chdir,
# fchdir (and the calls the sandbox's own filter refuses first). name -> body whose last create
# is relative to a cwd that changed after the cwd was kept; it must be judged in the new one.
CWD_CHANGED: dict[str, str] = {
    "chdir": (
        f"os.close(os.open('s_warm', {EXCL}))\n"  # the worktree kept as the cwd
        "os.chdir('repoA/.git/hooks')\n"
        f"os.open('pre-commit', {EXCL}, 0o755)"
    ),
    "fchdir": (
        f"os.close(os.open('s_warm', {EXCL}))\n"
        "os.fchdir(os.open('repoA/.git/hooks', os.O_RDONLY | os.O_DIRECTORY))\n"
        f"os.open('pre-commit', {EXCL}, 0o755)"
    ),
    "chdir-by-another-thread": (  # threads share their cwd
        "import threading\n"
        f"os.close(os.open('s_warm', {EXCL}))\n"
        "t = threading.Thread(target=os.chdir, args=('repoA/.git/hooks',))\n"
        "t.start(); t.join()\n"
        "os.open('pre-commit', os.O_CREAT | os.O_WRONLY, 0o755)"
    ),
    "chdir-by-a-thread-that-then-waits": (  # no further call of that thread retires it
        "import threading\n"
        "done, go = threading.Event(), threading.Event()\n"
        "def hop():\n    os.chdir('repoA/.git/hooks'); done.set(); go.wait()\n"
        f"os.close(os.open('s_warm', {EXCL}))\n"
        "t = threading.Thread(target=hop); t.start(); done.wait()\n"
        f"try:\n    os.open('pre-commit', {EXCL}, 0o755)\nfinally:\n    go.set(); t.join()"
    ),
    "chdir-by-a-process-sharing-the-cwd": (  # clone(CLONE_FS): another process, one cwd
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"os.close(os.open('s_warm', {EXCL}))\n"
        "r, w = os.pipe()\n"
        "nr = {'x86_64': 56, 'aarch64': 220}[os.uname().machine]\n"
        "pid = libc.syscall(nr, 0x200 | 17, 0, 0, 0, 0)\n"  # clone(CLONE_FS | SIGCHLD)
        "if pid == 0:\n    os.chdir('repoA/.git/hooks'); os.write(w, b'x'); os._exit(0)\n"
        "assert pid > 0, ctypes.get_errno()\n"
        "os.read(r, 1); os.waitpid(pid, 0)\n"
        f"os.open('pre-commit', {EXCL}, 0o755)"
    ),
    "chdir-by-a-process-sharing-the-cwd-that-lives-on": (
        "import ctypes, signal\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"os.close(os.open('s_warm', {EXCL}))\n"
        "r, w = os.pipe()\n"
        "nr = {'x86_64': 56, 'aarch64': 220}[os.uname().machine]\n"
        "pid = libc.syscall(nr, 0x200 | 17, 0, 0, 0, 0)\n"
        "if pid == 0:\n    os.chdir('repoA/.git/hooks'); os.write(w, b'x'); signal.pause()\n"
        "assert pid > 0, ctypes.get_errno()\n"
        "os.read(r, 1)\n"
        f"try:\n    os.open('pre-commit', {EXCL}, 0o755)\n"
        "finally:\n    os.kill(pid, 9); os.waitpid(pid, 0)"
    ),
    "many-chdirs": (
        "for i in range(40):\n"
        "    os.chdir('/' if i % 2 else os.environ['WT'])\n"
        f"    os.close(os.open(os.environ['WT'] + f'/s_{{i}}', {EXCL}))\n"
        "os.chdir(os.environ['WT'] + '/repoA/.git/hooks')\n"
        f"os.open('pre-commit', {EXCL}, 0o755)"
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CWD_CHANGED))
async def test_a_create_after_the_cwd_changed_is_judged_in_the_new_cwd(
    sb: Sandboxes, tmp_path: pathlib.Path, name: str
) -> None:
    wt = sb.worktree
    _plant(wt)
    before = tree_state(wt)
    body = f"os.environ['WT'] = {str(wt)!r}\n" + CWD_CHANGED[name]
    handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=refused [Errno 13]" in out, out
    made = {k for k in tree_state(wt) if k not in before}
    assert {k for k in made if not k.startswith("s_")} == set(), out  # no pre-commit anywhere
    assert refusals(handle) == [("file-write-create", f"{wt}/{NEW_HOOK}")], out


async def test_creates_follow_each_cwd_of_a_process_and_its_child(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # Ordinary work: relative creates land in the cwd each was made in, with chdirs between
    # them in the process, a thread and a forked child (whose chdir is its own).
    wt = sb.worktree
    _plant(wt)
    body = (
        "import threading\n"
        "os.makedirs('s_d/a'); os.makedirs('s_d/b')\n"
        "for i in range(30):\n"
        "    os.chdir('s_d/a' if i % 2 else 's_d/b')\n"
        f"    os.close(os.open(f'f{{i}}', {EXCL}))\n"
        "    os.chdir('../..')\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        f"    os.chdir('s_d/a'); os.close(os.open('child', {EXCL})); os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        f"os.close(os.open('parent', {EXCL}))\n"
        "t = threading.Thread(target=os.chdir, args=('s_d/b',)); t.start(); t.join()\n"
        f"os.close(os.open('after-thread', {EXCL}))\n"
        "os.chdir('/')\n"
        f"os.close(os.open(os.environ['WT'] + '/s_d/absolute', {EXCL}))"
    )
    handle, out = await run_attack(sb, tmp_path, f"os.environ['WT'] = {str(wt)!r}\n" + body)
    assert "RESULT=done" in out, out
    a = {p.name for p in (wt / "s_d" / "a").iterdir()}
    b = {p.name for p in (wt / "s_d" / "b").iterdir()}
    assert a == {f"f{i}" for i in range(1, 30, 2)} | {"child"}, out
    assert b == {f"f{i}" for i in range(0, 30, 2)} | {"after-thread"}, out
    assert (wt / "parent").is_file() and (wt / "s_d" / "absolute").is_file(), out
    assert refusals(handle) == [], out


# name -> (path as the command spells it, from the worktree, path refused below the worktree):
# an exclusive create of a protected name several directories down. The supervisor judges the
# start directory's path joined with its names ("." and empty components dropped) without opening
# the parent; a spelling with ".." or a symlink goes to the walk. Either way it is refused, once.
SPELLED: dict[str, tuple[str, str]] = {
    "plain-names": ("a/b/c/.mcp.json", "a/b/c/.mcp.json"),
    "dot": ("a/./b/.mcp.json", "a/b/.mcp.json"),
    "double-slash": ("a//b/.mcp.json", "a/b/.mcp.json"),
    "leading-dot": ("./a/b/.mcp.json", "a/b/.mcp.json"),
    "dots-and-slashes": (".//a/.//b/./c/.bashrc", "a/b/c/.bashrc"),
    "dot-into-hooks": ("repoA/.git/./hooks/pre-commit", "repoA/.git/hooks/pre-commit"),
    "slashes-into-hooks": ("repoA//.git//hooks//pre-push", "repoA/.git/hooks/pre-push"),
    "dot-gitmodules": ("./repoA/./.gitmodules", "repoA/.gitmodules"),
    "dot-dot": ("a/b/c/../.mcp.json", "a/b/.mcp.json"),
    "symlinked-dir": ("lnk/c/.mcp.json", "a/b/c/.mcp.json"),
    "other-case": ("a/b/.MCP.json", "a/b/.MCP.json"),
    "tree-pattern": ("a/.ssh/authorized_keys", "a/.ssh/authorized_keys"),
    "under-dot-claude": ("a/b/.claude/settings.json", "a/b/.claude/settings.json"),
    "absolute": ("{wt}/a/b/.bash_aliases", "a/b/.bash_aliases"),
    "hook-by-path": ("repoA/.git/hooks/pre-commit", "repoA/.git/hooks/pre-commit"),
    "hook-of-a-bare-repo": ("bare.git/hooks/post-update", "bare.git/hooks/post-update"),
    "commondir-by-path": ("bare.git/commondir", "bare.git/commondir"),
}


@pytest.mark.parametrize("name", sorted(SPELLED))
async def test_a_protected_name_deep_down_is_refused_however_spelled(
    sb: Sandboxes, tmp_path: pathlib.Path, name: str
) -> None:
    wt = sb.worktree
    _plant(wt)
    for d in ("a/b/c", "a/.ssh", "a/b/.claude"):
        (wt / d).mkdir(parents=True)
    (wt / "lnk").symlink_to("a/b")
    spelled, rel = SPELLED[name]
    spelled = spelled.format(wt=wt)
    before = tree_state(wt)
    body = f"os.close(os.open({spelled!r}, {EXCL}, 0o755))"
    handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=refused [Errno 13]" in out, out
    assert tree_state(wt) == before, out
    assert refusals(handle) == [("file-write-create", f"{wt}/{rel}")], (refusals(handle), out)


# A protectedPaths entry is matched on the whole judged string, not on a name: spelled with ".",
# empty components or ".." from a start directory above it, it must be refused all the same,
# existing or not ("a/../keep/x" reaches keep/x while staying beneath the start).
PROTECTED_SPELLED = {
    "dot-dot-new": (f"os.close(os.open('a/../keep/settings.json', {EXCL}))", "keep/settings.json"),
    "dot-new": (f"os.close(os.open('./keep/./settings.json', {EXCL}))", "keep/settings.json"),
    "slashes-new": (f"os.close(os.open('keep//settings.json', {EXCL}))", "keep/settings.json"),
    "dot-dot-truncate": (
        "os.close(os.open('a/b/../../held.txt', os.O_WRONLY | os.O_TRUNC))",
        "held.txt",
    ),
    "dot-truncate": ("os.close(os.open('./held.txt', os.O_WRONLY | os.O_TRUNC))", "held.txt"),
}


@pytest.mark.parametrize("name", sorted(PROTECTED_SPELLED))
async def test_a_protected_path_is_refused_however_spelled(sb: Sandboxes, name: str) -> None:
    wt = sb.worktree
    (wt / "a" / "b").mkdir(parents=True)
    (wt / "keep").mkdir()
    (wt / "held.txt").write_text("kept\n")
    body, rel = PROTECTED_SPELLED[name]
    handle = sb.launch(
        bindMounts=[{"hostPath": str(wt)}],
        protectedPaths=[str(wt / "keep" / "settings.json"), str(wt / "held.txt")],
    )
    before = tree_state(wt)
    script = f"import os\nos.chdir({str(wt)!r})\ntry:\n    {body}\n    print('MADE')\n"
    script += "except OSError as e:\n    print('REFUSED', e.errno)\n"
    out = output(await sb.sh(handle, f"/usr/bin/python3 - <<'EOF'\n{script}EOF\n"))
    assert "REFUSED 13" in out, out
    assert tree_state(wt) == before, out
    assert (wt / "held.txt").read_text() == "kept\n"
    assert [t for _a, t in refusals(handle)] == [f"{wt}/{rel}"], (refusals(handle), out)


# The same fast paths as an unprivileged user through the CLI: a protected name several
# directories down (judged on the joined path), another spelling of it (the walk), a create after
# a process that shares the cwd (clone(CLONE_FS)) moved it, and ordinary creates beside them.
AS_USER_SCRIPT = (
    "python3 -c \"import os; os.open('a/b/c/.mcp.json', os.O_CREAT | os.O_EXCL | os.O_WRONLY)\" "
    "2>/dev/null; echo deep=$?; "
    "python3 -c \"import os; os.open('a//b/./c/.bash_aliases', os.O_CREAT | os.O_WRONLY)\" "
    "2>/dev/null; echo spelled=$?; "
    'python3 -c "import ctypes, os; l = ctypes.CDLL(None); '
    "os.close(os.open('s_warm', os.O_CREAT | os.O_EXCL | os.O_WRONLY)); r, w = os.pipe(); "
    "nr = {'x86_64': 56, 'aarch64': 220}[os.uname().machine]; "
    "pid = l.syscall(nr, 0x200 | 17, 0, 0, 0, 0); "
    "pid or (os.chdir('repoA/.git/hooks'), os.write(w, b'x'), os._exit(0)); "
    "os.read(r, 1); os.waitpid(pid, 0); "
    "os.open('pre-commit', os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o755)\" 2>/dev/null; "
    "echo shared-cwd=$?; "
    "echo ok > a/b/c/s_fine && (cd a/b && echo ok > s_near); echo fine=$?"
)


def test_as_an_unprivileged_user_the_fast_paths_refuse_the_same(
    other_user: OtherUser, user_dir: pathlib.Path
) -> None:
    _plant(user_dir)
    (user_dir / "a" / "b" / "c").mkdir(parents=True)
    subprocess.run(["chown", "-R", f"{other_user.uid}:{other_user.gid}", str(user_dir)], check=True)
    before = tree_state(user_dir)
    done = other_user.run(
        ["/usr/bin/python3", "-m", "cc_server.cli", "run", "--bind", str(user_dir),
         "--workdir", str(user_dir), "--", "/bin/sh", "-c", AS_USER_SCRIPT],
        cwd=user_dir, env={"CC_SERVER_DAEMON": "off"},
    )  # fmt: skip
    assert done.stdout.splitlines() == ["deep=1", "spelled=1", "shared-cwd=1", "fine=0"], (
        done.stdout, done.stderr)  # fmt: skip
    made = {k for k in tree_state(user_dir) if k not in before}
    assert made == {"a/b/c/s_fine", "a/b/s_near"}, (made, done.stderr)
    assert (user_dir / "s_warm").exists(), done.stderr
    for rel in ("a/b/c/.mcp.json", "a/b/c/.bash_aliases", NEW_HOOK):
        assert f"file-write-create {user_dir}/{rel}" in done.stderr, done.stderr
