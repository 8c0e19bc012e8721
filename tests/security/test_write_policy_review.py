"""A hostile agent's review of the write policy and the host-listener rule (the create-rule
supervisor's path rules, its connect judge and the launcher's connector): every attempt below
runs in a real bubblewrap sandbox, names its idea in a comment, and checks the host afterwards.

Refused by the supervisor (one violation each, with its verb and the resolved target): an O_PATH
fd linked back by AT_EMPTY_PATH, chmod and truncate through /proc/self/fd of an O_PATH fd, a
`.git` pointer rewritten by an open without O_CREAT, a `.git` made under a name with a newline,
in another case or beyond PATH_MAX, protected paths reached through /proc/1/root and another
process's /proc/<pid>/cwd, renameat2 with RENAME_NOREPLACE, RENAME_WHITEOUT or RENAME_EXCHANGE on
either side, rmdir of an empty protected directory, the connector's /proc/<pid>/mem, a host
socket hard-linked before the launch, and protectedPaths spellings that do not exist yet.
Refused by the kernel or the filter (nothing reaches the supervisor): writes through a read-only
fd (fallocate, ftruncate, a shared writable mmap, copy_file_range), open_by_handle_at, io_uring,
openat2, an x32 open, ptrace and process_vm_writev of the connector and of PID 1. Races: a
symlink swapped under a create, the sockaddr rewritten and the socket fd swapped during a
connect. A stopped connector: connects wait (killable), none reaches a host listener. The same
through the server's exec route and as an unprivileged user. Ordinary work that looks like these
attacks keeps working.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import socket
import stat
import subprocess

import pytest
from escape_kit import Sandboxes, output, run_attack
from other_user import OtherUser
from write_kit import git_repo, host_listener, refusals, tree_state

pytestmark = [pytest.mark.security, pytest.mark.integration]

CONFIG = "repoA/.git/config"
HOOK = "repoA/.git/hooks/pre-push"  # exists, not executable: making it executable arms it
NEW_HOOK = "repoA/.git/hooks/pre-commit"


def _plant(wt: pathlib.Path) -> None:
    """Protected files and directories at depth in the worktree; scratch names start `s_`."""
    git_repo(wt / "repoA")
    (wt / HOOK).write_text("#!/bin/sh\nexit 0\n")
    (wt / HOOK).chmod(0o644)
    git_repo(wt / "repoB")
    for p in (wt / "repoB" / ".git" / "hooks").iterdir():
        p.unlink()
    (wt / "linked").mkdir()
    (wt / "linked" / ".git").write_text("gitdir: /nonexistent/.git/worktrees/linked\n")
    (wt / "plain").mkdir()
    (wt / "sub" / ".vscode").mkdir(parents=True)
    (wt / "sub" / ".claude").mkdir()
    (wt / "sub" / ".claude" / "settings.json").write_text("{}\n")
    (wt / "sub" / ".mcp.json").write_text("{}\n")


# --- refused by the supervisor: exactly one violation, its verb and the resolved target ---------

# name -> (Python body run in the worktree, the verb refused, the target, relative to it)
SUPERVISED: dict[str, tuple[str, str, str]] = {
    # linkat AT_EMPTY_PATH of an O_PATH fd of a protected file: a second name for it.
    "linkat-empty-path-of-opath": (
        f"fd = os.open('{CONFIG}', os.O_PATH)\n"
        "if libc.linkat(fd, b'', -100, b's_alias', 0x1000): fail()",
        "file-write-create", CONFIG,
    ),
    # linkat(AT_SYMLINK_FOLLOW) through /proc/self/fd of an O_PATH fd.
    "linkat-follow-proc-fd-of-opath": (
        f"fd = os.open('{CONFIG}', os.O_PATH)\n"
        "if libc.linkat(-100, f'/proc/self/fd/{fd}'.encode(), -100, b's_alias', 0x400): fail()",
        "file-write-create", CONFIG,
    ),
    # chmod via /proc/self/fd/N of an O_PATH fd.
    "chmod-proc-fd-of-opath": (
        f"fd = os.open('{HOOK}', os.O_PATH)\nos.chmod(f'/proc/self/fd/{{fd}}', 0o755)",
        "file-write-mode", HOOK,
    ),
    # truncate via /proc/self/fd/N of an O_PATH fd.
    "truncate-proc-fd-of-opath": (
        f"fd = os.open('{CONFIG}', os.O_PATH)\nos.truncate(f'/proc/self/fd/{{fd}}', 0)",
        "file-write-data", CONFIG,
    ),
    # A `.git` FILE pointer (gitdir:) rewritten by an open without O_CREAT.
    "git-pointer-rewrite": (
        "os.write(os.open('linked/.git', os.O_WRONLY | os.O_TRUNC), b'gitdir: /evil\\n')",
        "file-write-data", "linked/.git",
    ),
    # A new `.git` pointer file in a plain directory.
    "git-pointer-create": (
        "open('plain/.git', 'w').write('gitdir: /evil\\n')", "file-write-create", "plain/.git",
    ),
    # A name with a newline on the way to a new `.git`.
    "newline-in-a-component": (
        "os.makedirs('s_n\\nl/.git/hooks')", "file-write-create", "s_n\nl/.git",
    ),
    # Another case of a protected name.
    "case-variant": ("os.makedirs('plain/.Git/hooks')", "file-write-create", "plain/.Git"),
    # /proc/1/root: the launcher's root, spliced by the kernel.
    "proc-1-root": (
        f"os.open('/proc/1/root' + os.getcwd() + '/{NEW_HOOK}', os.O_CREAT | os.O_WRONLY)",
        "file-write-create", NEW_HOOK,
    ),
    # /proc/<pid>/cwd of another process of the sandbox that sits in .git/hooks.
    "proc-pid-cwd-of-another": (
        "import subprocess, time\n"
        "p = subprocess.Popen(['sleep', '10'], cwd='repoA/.git/hooks')\n"
        "time.sleep(0.3)\n"
        "try:\n"
        "    os.open(f'/proc/{p.pid}/cwd/pre-commit', os.O_CREAT | os.O_WRONLY)\n"
        "finally:\n"
        "    p.kill()",
        "file-write-create", NEW_HOOK,
    ),
    # renameat2 RENAME_NOREPLACE onto a protected name that does not exist yet.
    "renameat2-noreplace": (
        "open('s_hook', 'w').write('#!/bin/sh\\nevil\\n')\n"
        f"if libc.renameat2(-100, b's_hook', -100, b'{NEW_HOOK}', 1): fail()",
        "file-write-rename", NEW_HOOK,
    ),
    # renameat2 RENAME_WHITEOUT of a protected file (the whiteout would hide it on an overlay).
    "renameat2-whiteout-old-side": (
        f"if libc.renameat2(-100, b'{CONFIG}', -100, b's_cfg', 4): fail()",
        "file-write-rename", CONFIG,
    ),
    # RENAME_EXCHANGE with the protected file as the OLD side (the new side is ordinary).
    "renameat2-exchange-old-side": (
        "open('s_cfg', 'w').write('[core]\\n\\tfsmonitor = evil\\n')\n"
        f"if libc.renameat2(-100, b'{CONFIG}', -100, b's_cfg', 2): fail()",
        "file-write-rename", CONFIG,
    ),
    # rmdir of an empty protected directory.
    "rmdir-empty-vscode": ("os.rmdir('sub/.vscode')", "file-write-unlink", "sub/.vscode"),
    # unlink of a Claude settings file at depth.
    "unlink-claude-settings": (
        "os.unlink('sub/.claude/settings.json')",
        "file-write-unlink", "sub/.claude/settings.json",
    ),
    # An existing .mcp.json opened for writing through a dirfd, without O_CREAT.
    "mcp-json-dirfd-rdwr": (
        "d = os.open('sub', os.O_PATH | os.O_DIRECTORY)\n"
        "os.write(os.open('.mcp.json', os.O_RDWR, dir_fd=d), b'{\"mcpServers\": {}}')",
        "file-write-data", "sub/.mcp.json",
    ),
    # /dev/fd is a symlink to /proc/self/fd: a reopen for writing through it.
    "dev-fd-reopen": (
        f"fd = os.open('{CONFIG}', os.O_RDONLY)\n"
        "os.write(os.open(f'/dev/fd/{fd}', os.O_WRONLY), b'evil')",
        "file-write-data", CONFIG,
    ),
    # fchmodat2 through a dirfd with AT_SYMLINK_NOFOLLOW (the hook is no symlink: applies).
    "fchmodat2-nofollow": (
        "d = os.open('repoA/.git/hooks', os.O_PATH | os.O_DIRECTORY)\n"
        "if libc.syscall(452, d, b'pre-push', 0o755, 0x100): fail()",
        "file-write-mode", HOOK,
    ),
    # A trailing slash on a new `.git` directory.
    "mkdir-trailing-slash": ("os.mkdir('plain/.git/')", "file-write-create", "plain/.git"),
    # truncate, unlink and rename through a symlink component that leads into .git.
    "truncate-through-a-symlink": (
        f"os.symlink('{CONFIG}', 's_cfg')\nos.truncate('s_cfg', 0)", "file-write-data", CONFIG,
    ),
    "unlink-through-a-symlinked-dir": (
        "os.symlink('repoA/.git', 's_g')\nos.unlink('s_g/config')", "file-write-unlink", CONFIG,
    ),
    "rename-through-a-symlinked-dir": (
        "os.symlink('repoA/.git', 's_g')\nos.rename('s_g/config', 's_x')",
        "file-write-rename", CONFIG,
    ),
    # The cwd inside .git, a relative name.
    "cwd-inside-git": (
        "os.chdir('repoA/.git')\nos.write(os.open('config', os.O_WRONLY), b'evil')",
        "file-write-data", CONFIG,
    ),
    # The dirfd is /proc/self/fd itself, the name a fd number (a magic link there).
    "dirfd-of-proc-self-fd": (
        f"fd = os.open('{CONFIG}', os.O_RDONLY)\n"
        "d = os.open('/proc/self/fd', os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.write(os.open(str(fd), os.O_WRONLY, dir_fd=d), b'evil')",
        "file-write-data", CONFIG,
    ),
    # A dangling symlink whose target is a new `.git`: an O_CREAT open follows it.
    "dangling-symlink-to-a-new-git": (
        "os.symlink('plain/.git', 's_l')\nopen('s_l', 'w').write('gitdir: /evil\\n')",
        "file-write-create", "plain/.git",
    ),
    # memfd + execveat: a program with no name on disk still carries the filter.
    "memfd-execveat": (
        "fd = os.memfd_create('t', 0)\nos.write(fd, open('/usr/bin/touch', 'rb').read())\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n"
        f"        os.execve(fd, ['touch', '{NEW_HOOK}'], {{}})\n"
        "    finally:\n"
        "        os._exit(99)\n"
        "if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:\n"
        "    raise PermissionError(13, 'touch failed')",
        "file-write-create", NEW_HOOK,
    ),
    # fchmodat2 with an empty path and AT_FDCWD: the cwd itself, .git/hooks.
    "fchmodat2-empty-path-of-the-cwd": (
        "os.chdir('repoA/.git/hooks')\nif libc.syscall(452, -100, b'', 0o777, 0x1000): fail()",
        "file-write-mode", "repoA/.git/hooks",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SUPERVISED))
async def test_the_supervisor_refuses_and_reports_once(
    sb: Sandboxes, tmp_path: pathlib.Path, name: str
) -> None:
    wt = sb.worktree
    _plant(wt)
    body, action, rel = SUPERVISED[name]
    before = tree_state(wt)
    handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=refused [Errno 13]" in out, out
    assert tree_state(wt) == before, out
    assert not (wt / NEW_HOOK).exists() and not (wt / "s_alias").exists(), out
    got = refusals(handle)
    if name.startswith("proc-"):
        # Through another process's procfs link: refused at the link itself (the supervisor
        # follows only the task's own), one violation naming the link.
        assert len(got) == 1 and got[0][1].startswith("/proc/"), (got, out)
    else:
        assert got == [(action, f"{wt}/{rel}")], (got, out)


# --- refused before the supervisor: the kernel or the filter -------------------------------------

# name -> Python body; each must fail, change nothing, and leave no violation behind.
UNSUPERVISED: dict[str, str] = {
    # link(2) of /proc/self/fd/N (CPython's os.link): link does not follow, so this is a
    # hard link of the procfs magic link itself: EXDEV, for the task as for the supervisor.
    "link-of-a-proc-fd-link": (
        f"fd = os.open('{CONFIG}', os.O_PATH)\nos.link(f'/proc/self/fd/{{fd}}', 's_alias')"
    ),
    # O_NOFOLLOW on a /proc/self/fd magic link: ELOOP, for the supervisor as for the kernel.
    "nofollow-proc-fd-magic-link": (
        f"fd = os.open('{CONFIG}', os.O_RDONLY)\n"
        "os.open(f'/proc/self/fd/{fd}', os.O_WRONLY | os.O_NOFOLLOW)"
    ),
    # fallocate through a read-only fd of a protected file.
    "fallocate-read-only-fd": (
        f"fd = os.open('{CONFIG}', os.O_RDONLY)\nos.posix_fallocate(fd, 0, 1 << 16)"
    ),
    # ftruncate through a read-only fd.
    "ftruncate-read-only-fd": f"os.ftruncate(os.open('{CONFIG}', os.O_RDONLY), 0)",
    # A shared writable mmap of a read-only fd.
    "mmap-shared-writable": (
        f"import mmap\nfd = os.open('{CONFIG}', os.O_RDONLY)\n"
        "mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)[0:1] = b'x'"
    ),
    # copy_file_range / sendfile into a read-only fd.
    "copy-file-range-into-read-only-fd": (
        f"fd = os.open('{CONFIG}', os.O_RDONLY)\n"
        "os.copy_file_range(os.open('README', os.O_RDONLY), fd, 10)"
    ),
    "sendfile-into-read-only-fd": (
        f"fd = os.open('{CONFIG}', os.O_RDONLY)\n"
        "os.sendfile(fd, os.open('README', os.O_RDONLY), 0, 10)"
    ),
    # name_to_handle_at (harmless) then open_by_handle_at for writing (not a trapped call).
    "open-by-handle-at": (
        "import ctypes\nbuf = ctypes.create_string_buffer(8 + 128)\n"
        "ctypes.memmove(buf, (128).to_bytes(4, 'little'), 4)\nmnt = ctypes.c_int()\n"
        f"if libc.name_to_handle_at(-100, b'{CONFIG}', buf, ctypes.byref(mnt), 0): fail()\n"
        "if libc.open_by_handle_at(os.open('/', os.O_RDONLY), buf, os.O_WRONLY) < 0: fail()"
    ),
    # io_uring would open and write without a trapped syscall.
    "io-uring-setup": (
        "import ctypes\nparams = ctypes.create_string_buffer(120)\n"
        "if libc.syscall(425, 4, params) < 0: fail()"
    ),
    # openat2 with O_CREAT (its flags live in memory, beyond the filter's reach).
    "openat2-create": (
        "import struct\nhow = struct.pack('QQQ', os.O_WRONLY | os.O_CREAT, 0o755, 0)\n"
        f"if libc.syscall(437, -100, b'{NEW_HOOK}', how, 24) < 0: fail()"
    ),
    # /proc/self/map_files/<range> of a read-only mapping: a magic link only a process with
    # CAP_CHECKPOINT_RESTORE (in the initial namespace) may follow: EPERM for the supervisor too.
    "map-files-reopen": (
        f"import mmap\nm = mmap.mmap(os.open('{CONFIG}', os.O_RDONLY), 0, prot=mmap.PROT_READ)\n"
        "line = next(l for l in open('/proc/self/maps') if l.rstrip().endswith('.git/config'))\n"
        "os.write(os.open('/proc/self/map_files/' + line.split()[0], os.O_RDWR), b'evil')"
    ),
    # New mounts (open_tree, fsopen) would give a protected directory another path.
    "open-tree-clone": (
        "if libc.syscall(428, -100, b'repoA/.git', 1 | 0x80000) < 0: fail()"
    ),
    "fsopen-tmpfs": "if libc.syscall(430, b'tmpfs', 0) < 0: fail()",
    # A user namespace of its own would allow mounts (a protected directory at another path).
    "unshare-user-namespace": "if libc.unshare(0x10000000 | 0x20000): fail()",
    # A core file is a name made without a syscall: its limit cannot be raised again.
    "raise-core-limit": (
        "import ctypes\nlim = (ctypes.c_ulong * 2)(1 << 20, 1 << 20)\n"
        "if libc.setrlimit(4, lim): fail()"
    ),
    # The connector (no filter of ours: started before it) and PID 1: ptrace and
    # process_vm_writev (both not dumpable).
    "ptrace-and-poke-the-connector-and-pid-1": (
        "import ctypes\n"
        "conn = [int(n) for n in os.listdir('/proc') if n.isdigit()\n"
        "        and 'Seccomp_filters:\\t1' in open(f'/proc/{n}/status').read()]\n"
        "assert len(conn) == 1, conn\n"
        "class Iov(ctypes.Structure):\n"
        "    _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]\n"
        "buf = ctypes.create_string_buffer(8)\n"
        "local, remote = Iov(ctypes.cast(buf, ctypes.c_void_p), 8), Iov(0x400000, 8)\n"
        "got = []\n"
        "for pid in (conn[0], 1):\n"
        "    got.append(libc.ptrace(16, pid, 0, 0))\n"
        "    got.append(libc.process_vm_writev(pid, ctypes.byref(local), 1,\n"
        "                                      ctypes.byref(remote), 1, 0))\n"
        "print('calls', got)\n"
        "if all(g == -1 for g in got): fail()"
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(UNSUPERVISED))
async def test_the_kernel_or_the_filter_refuses(
    sb: Sandboxes, tmp_path: pathlib.Path, name: str
) -> None:
    wt = sb.worktree
    _plant(wt)
    before = tree_state(wt)
    handle, out = await run_attack(sb, tmp_path, UNSUPERVISED[name])
    assert "RESULT=refused" in out, out
    assert tree_state(wt) == before, out
    assert not (wt / NEW_HOOK).exists(), out
    assert not [v for v in handle.violations if v.action.startswith("file-")], out


async def test_an_x32_open_is_killed_not_let_through(sb: Sandboxes, tmp_path: pathlib.Path) -> None:
    # The x32 ABI (nr | 0x40000000): another syscall table the filter must not let pass.
    wt = sb.worktree
    _plant(wt)
    body = (
        "import ctypes\n"
        f"r = libc.syscall(0x40000000 + 2, b'{NEW_HOOK}', os.O_CREAT | os.O_WRONLY, 0o755)\n"
        "print('x32 open', r, ctypes.get_errno())"
    )
    _handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=done" not in out and "x32 open" not in out, out  # the thread was killed
    assert not (wt / NEW_HOOK).exists(), out


async def test_the_connector_s_memory_is_not_opened_for_a_task(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # /proc/<connector>/mem opened O_RDWR|O_CREAT: the supervisor would open it as the
    # namespace's owner; the task itself is refused by the kernel (not dumpable).
    body = (
        "conn = [int(n) for n in os.listdir('/proc') if n.isdigit()\n"
        "        and 'Seccomp_filters:\\t1' in open(f'/proc/{n}/status').read()]\n"
        "assert len(conn) == 1, conn\n"
        "print('conn', conn[0])\n"
        "os.open(f'/proc/{conn[0]}/mem', os.O_RDWR | os.O_CREAT)"
    )
    handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=refused [Errno 13]" in out, out
    conn = next(line.split()[1] for line in out.splitlines() if line.startswith("conn "))
    assert refusals(handle) == [("file-write-data", f"/proc/{conn}/mem")], out


# --- beyond PATH_MAX ----------------------------------------------------------------------------


async def test_a_git_beyond_path_max_is_refused(sb: Sandboxes, tmp_path: pathlib.Path) -> None:
    # A directory chain deeper than PATH_MAX, made with relative mkdir/chdir; then a `.git`
    # (mkdir, and a rename of an ordinary directory) at the bottom. Its path cannot be read
    # (ENAMETOOLONG): refused, never let through.
    wt = sb.worktree
    body = (
        "os.mkdir('s_deep'); os.chdir('s_deep')\n"
        "length = len(os.getcwd())\n"
        "while True:\n"
        "    try:\n"
        "        os.mkdir('d' * 250)\n"
        "    except OSError as e:\n"
        "        print('mkdir stopped at', length, e.errno)\n"
        "        break\n"
        "    os.chdir('d' * 250); length += 251\n"
        "    if length > 4400:\n"
        "        break\n"
        "print('depth', length)\n"
        "for attempt in ('mkdir', 'rename'):\n"
        "    try:\n"
        "        if attempt == 'mkdir':\n"
        "            os.mkdir('.git')\n"
        "        else:\n"
        "            os.chdir('..'); os.rename('d' * 250, '.git')\n"
        "        print(attempt, 'MADE')\n"
        "    except OSError as e:\n"
        "        print(attempt, 'refused', e.errno)\n"
    )
    handle, out = await run_attack(sb, tmp_path, body)
    assert "MADE" not in out, out
    # The ordinary mkdir past PATH_MAX is refused too (fail closed), each refusal reported once.
    assert "mkdir refused 13" in out and "rename refused 13" in out, out
    got = refusals(handle)
    assert [a for a, _ in got] == ["file-write-create"] * 2 + ["file-write-rename"], out
    found = subprocess.run(
        ["find", str(wt / "s_deep"), "-name", ".git"], capture_output=True, text=True
    )
    assert found.stdout == "", (found.stdout, out)


# --- races: the supervisor works on what it pinned and copied ------------------------------------


async def test_a_symlink_swapped_under_a_create_never_lands_in_hooks(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # A thread re-points s_sw between an ordinary directory and .git/hooks while the main
    # thread creates s_sw/pre-commit: every create lands in the ordinary directory or is refused,
    # and each refusal is exactly one violation.
    wt = sb.worktree
    _plant(wt)
    body = (
        "import threading\nos.mkdir('s_plain')\nstop = []\n"
        "def flip():\n"
        "    while not stop:\n"
        "        for target in ('s_plain', 'repoA/.git/hooks'):\n"
        "            with __import__('contextlib').suppress(FileNotFoundError):\n"
        "                os.unlink('s_tmp')\n"
        "            os.symlink(target, 's_tmp'); os.rename('s_tmp', 's_sw')\n"
        "os.symlink('s_plain', 's_sw')\n"
        "t = threading.Thread(target=flip); t.start()\n"
        "made = refused = 0\n"
        "for i in range(400):\n"
        "    try:\n"
        "        os.close(os.open('s_sw/pre-commit', os.O_CREAT | os.O_WRONLY, 0o755)); made += 1\n"
        "    except PermissionError:\n"
        "        refused += 1\n"
        "stop.append(1); t.join()\n"
        "print('made', made, 'refused', refused)\n"
    )
    handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=done" in out, out
    assert not (wt / NEW_HOOK).exists(), out
    refused = int(out.split("refused ")[1].split()[0])
    assert refused > 0 and (wt / "s_plain" / "pre-commit").exists(), out  # both sides were hit
    assert refusals(handle) == [("file-write-create", f"{wt}/{NEW_HOOK}")] * refused, out


async def test_refusals_from_many_processes_at_once_are_each_reported_once(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # Four processes at once (the supervisor's crowd mode: every worker polls), each trying a
    # protected create and an ordinary one in turn: no protected name lands, every ordinary one
    # does, and the violations are exactly the refusals, one each.
    wt = sb.worktree
    _plant(wt)
    body = (
        "os.mkdir('s_out')\npids = []\n"
        "for k in range(4):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        refused = 0\n"
        "        for i in range(60):\n"
        "            try:\n"
        f"                os.open('{NEW_HOOK}', os.O_CREAT | os.O_WRONLY)\n"
        "            except PermissionError:\n"
        "                refused += 1\n"
        "            os.close(os.open(f's_out/{k}-{i}', os.O_CREAT | os.O_WRONLY))\n"
        "        os._exit(0 if refused == 60 else 1)\n"
        "    pids.append(pid)\n"
        "codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]\n"
        "print('codes', codes)\n"
    )
    handle, out = await run_attack(sb, tmp_path, body)
    assert "codes [0, 0, 0, 0]" in out and "RESULT=done" in out, out
    assert not (wt / NEW_HOOK).exists(), out
    assert len(list((wt / "s_out").iterdir())) == 240, out
    assert refusals(handle) == [("file-write-create", f"{wt}/{NEW_HOOK}")] * 240, out


OWN_LISTENER = (
    "import socket, threading, ctypes\n"
    "own = socket.socket(socket.AF_UNIX); own.bind('s_in.sock'); own.listen(512)\n"
    "def serve():\n"
    "    while True:\n"
    "        a, _ = own.accept(); a.close()\n"
    "threading.Thread(target=serve, daemon=True).start()\n"
    "def sun(path):\n"
    "    b = ctypes.create_string_buffer(110); b[0:2] = b'\\x01\\x00'\n"
    "    b[2:2 + len(path)] = path; return b\n"
)


async def test_a_sockaddr_rewritten_during_connect_never_reaches_a_host_listener(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # A thread flips the sockaddr's path between the sandbox's own socket and the host's
    # while the main thread connects with it: the supervisor judges the bytes it copied, and the
    # connector connects to the inode judged, never to what the memory says later.
    wt = sb.worktree
    body = OWN_LISTENER + (
        "addr = sun(b's_in.sock')\nstop = []\n"
        "def flip():\n"
        "    while not stop:\n"
        "        ctypes.memmove(ctypes.addressof(addr) + 2, b'host.sock\\0', 10)\n"
        "        ctypes.memmove(ctypes.addressof(addr) + 2, b's_in.sock\\0', 10)\n"
        "t = threading.Thread(target=flip); t.start()\n"
        "ok = refused = other = 0\n"
        "for i in range(300):\n"
        "    c = socket.socket(socket.AF_UNIX)\n"
        "    if libc.connect(c.fileno(), addr, 110) == 0:\n"
        "        ok += 1\n"
        "    elif ctypes.get_errno() == 13:\n"
        "        refused += 1\n"
        "    else:\n"
        "        other += 1\n"
        "    c.close()\n"
        "stop.append(1); t.join()\n"
        "print('ok', ok, 'refused', refused, 'other', other)\n"
    )
    with host_listener(wt / "host.sock") as host:
        handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=done" in out, out
    assert host.contacts == 0, out
    refused = int(out.split("refused ")[1].split()[0])
    assert refusals(handle) == [("network-outbound", f"{wt}/host.sock")] * refused, out


async def test_a_socket_fd_swapped_during_connect_never_reaches_a_host_listener(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # A thread dup2s a Unix socket and a TCP socket in turn onto one fd number while the
    # main thread connects that number to the host's socket: the supervisor judges the socket
    # it fetched, with the address it copied.
    wt = sb.worktree
    body = OWN_LISTENER + (
        "host = sun(b'host.sock')\n"
        "tcp = socket.socket(); unix = socket.socket(socket.AF_UNIX)\n"
        "n = os.dup(tcp.fileno())\nstop = []\n"
        "def flip():\n"
        "    while not stop:\n"
        "        os.dup2(unix.fileno(), n); os.dup2(tcp.fileno(), n)\n"
        "t = threading.Thread(target=flip); t.start()\n"
        "results = {}\n"
        "for i in range(300):\n"
        "    r = libc.connect(n, host, 110)\n"
        "    e = 0 if r == 0 else ctypes.get_errno()\n"
        "    results[e] = results.get(e, 0) + 1\n"
        "stop.append(1); t.join()\n"
        "print('results', results)\n"
        "if 0 in results: print('CONNECTED')\n"
    )
    with host_listener(wt / "host.sock") as host:
        handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=done" in out and "CONNECTED" not in out, out
    assert host.contacts == 0, out
    assert {v.action for v in handle.violations} <= {"network-outbound"}, out
    assert {v.target for v in handle.violations} <= {f"{wt}/host.sock"}, out


async def test_a_host_socket_hard_linked_before_the_launch_stays_out(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # The host made a second name for its socket before the sandbox started (no link made
    # inside): the judge goes by the inode, not the name.
    wt = sb.worktree
    with host_listener(wt / "host.sock") as host:
        os.link(wt / "host.sock", wt / "s_alias.sock")
        body = "import socket\nsocket.socket(socket.AF_UNIX).connect('s_alias.sock')"
        handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=refused [Errno 13]" in out, out
    assert host.contacts == 0, out
    assert refusals(handle) == [("network-outbound", f"{wt}/s_alias.sock")], out


# Other spellings of a host socket's path (the existing suite has the plain ones).
CONNECT_SPELLINGS: dict[str, str] = {
    # /proc/self/fd/N of an O_PATH fd of the host's socket.
    "proc-self-fd-of-opath": (
        "fd = os.open('host.sock', os.O_PATH)\n"
        "socket.socket(socket.AF_UNIX).connect(f'/proc/self/fd/{fd}')"
    ),
    # /dev/fd/N: a symlink to /proc/self/fd.
    "dev-fd-of-opath": (
        "fd = os.open('host.sock', os.O_PATH)\n"
        "socket.socket(socket.AF_UNIX).connect(f'/dev/fd/{fd}')"
    ),
    # /proc/1/root: PID 1's root, a magic link.
    "proc-1-root": (
        "socket.socket(socket.AF_UNIX).connect('/proc/1/root' + os.getcwd() + '/host.sock')"
    ),
    # /proc/<pid>/cwd of another process of the sandbox.
    "proc-pid-cwd-of-another": (
        "import subprocess, time\np = subprocess.Popen(['sleep', '10'])\ntime.sleep(0.3)\n"
        "try:\n"
        "    socket.socket(socket.AF_UNIX).connect(f'/proc/{p.pid}/cwd/host.sock')\n"
        "finally:\n"
        "    p.kill()"
    ),
    # A chain of symlinks, the last absolute.
    "symlink-chain": (
        "os.symlink(os.getcwd() + '/host.sock', 's_l1'); os.symlink('s_l1', 's_l2')\n"
        "socket.socket(socket.AF_UNIX).connect('s_l2')"
    ),
    # A datagram socket connected by fd to the host's name through a dirfd'd symlink.
    "datagram-via-symlinked-dir": (
        "os.symlink('.', 's_here')\n"
        "socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).connect('s_here/host.sock')"
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONNECT_SPELLINGS))
async def test_another_spelling_of_a_host_socket_stays_out(
    sb: Sandboxes, tmp_path: pathlib.Path, name: str
) -> None:
    wt = sb.worktree
    kind = socket.SOCK_DGRAM if name.startswith("datagram") else socket.SOCK_STREAM
    with host_listener(wt / "host.sock", kind) as host:
        handle, out = await run_attack(sb, tmp_path, "import socket\n" + CONNECT_SPELLINGS[name])
    assert "RESULT=refused [Errno 13]" in out, out
    assert host.contacts == 0, out
    got = refusals(handle)
    by_link = len(got) == 1 and got[0][1].startswith("/proc/")  # another's procfs link
    assert by_link or got == [("network-outbound", f"{wt}/host.sock")], (got, out)


async def test_host_listeners_by_other_names_stay_out(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # A host abstract socket and a host TCP listener on loopback (the sandbox has a network
    # namespace of its own), a host socket in a read-only bind without hostSockets, and a host
    # symlink inside a hostSockets bind that leads to a socket outside it.
    wt = sb.worktree
    ro = tmp_path / "ro"
    ro.mkdir()
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    name = f"cc-review-{os.getpid()}"
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0" + name)
    abstract.listen()
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    port = tcp.getsockname()[1]
    body = (
        "import socket\nresults = []\n"
        "def attempt(family, addr):\n"
        "    try:\n"
        "        socket.socket(family).connect(addr); results.append('CONNECTED')\n"
        "    except OSError as e:\n"
        "        results.append(e.errno)\n"
        f"attempt(socket.AF_UNIX, '\\0{name}')\n"
        f"attempt(socket.AF_INET, ('127.0.0.1', {port}))\n"
        f"attempt(socket.AF_UNIX, '{ro}/host.sock')\n"
        f"attempt(socket.AF_UNIX, '{allowed}/link.sock')\n"
        "print('results', results)\n"
    )
    try:
        with host_listener(ro / "host.sock") as in_ro, host_listener(wt / "host.sock") as in_wt:
            (allowed / "link.sock").symlink_to(wt / "host.sock")
            handle, out = await run_attack(sb, tmp_path, body, binds=[
                {"hostPath": str(ro), "readOnly": True},
                {"hostPath": str(allowed), "readOnly": True, "hostSockets": True},
            ])  # fmt: skip
        assert "RESULT=done" in out and "CONNECTED" not in out, out
        assert in_ro.contacts == 0 and in_wt.contacts == 0, out
        abstract.setblocking(False)
        tcp.setblocking(False)
        for sock in (abstract, tcp):
            with pytest.raises(BlockingIOError):
                sock.accept()
    finally:
        abstract.close()
        tcp.close()
    assert refusals(handle) == [("network-outbound", f"{ro}/host.sock"),
                                 ("network-outbound", f"{wt}/host.sock")], out  # fmt: skip


async def test_a_stopped_connector_holds_connects_and_lets_none_out(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # SIGSTOP to the connector: a connect to the sandbox's own socket waits (and stays
    # killable), a connect to the host's is still refused at once by the supervisor; after
    # SIGCONT connects work again. The sandbox does not fail open.
    wt = sb.worktree
    body = (
        "import signal, socket, subprocess, time\n"
        "own = socket.socket(socket.AF_UNIX); own.bind('s_in.sock'); own.listen(8)\n"
        "conn = [int(n) for n in os.listdir('/proc') if n.isdigit()\n"
        "        and 'Seccomp_filters:\\t1' in open(f'/proc/{n}/status').read()]\n"
        "assert len(conn) == 1, conn\n"
        "os.kill(conn[0], signal.SIGSTOP)\n"
        "probe = ('import socket, sys\\ntry:\\n'\n"
        "         '    socket.socket(socket.AF_UNIX).connect(sys.argv[1])\\n'\n"
        "         '    print(\"CONNECTED\")\\n'\n"
        "         'except OSError as e:\\n    print(\"errno\", e.errno)')\n"
        "def run(path):\n"
        "    p = subprocess.run(['timeout', '-s', 'KILL', '3', 'python3', '-c', probe, path],\n"
        "                       capture_output=True, text=True)\n"
        "    return p.returncode, p.stdout.strip()\n"
        "print('stopped-own', run('s_in.sock'))\n"
        "print('stopped-host', run('host.sock'))\n"
        "os.kill(conn[0], signal.SIGCONT)\n"
        "time.sleep(0.2)\n"
        "print('resumed-own', run('s_in.sock'))\n"
    )
    with host_listener(wt / "host.sock") as host:
        handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=done" in out, out
    assert "stopped-own (-9, '')" in out, out  # waited until killed: no answer, no connection
    assert "stopped-host (0, 'errno 13')" in out, out
    assert "resumed-own (0, 'CONNECTED')" in out, out
    assert host.contacts == 0, out
    assert refusals(handle) == [("network-outbound", f"{wt}/host.sock")], out


# --- protectedPaths spelled through a link that does not exist yet -------------------------------


PROTECTED_SPELLINGS: dict[str, tuple[str, str, str]] = {
    # The protected spelling M/settings.json, M not there yet: M may not become a symlink.
    "link-made-where-none-was": ("ln -s elsewhere M", "file-write-create", "M"),
    # ... nor a socket, a FIFO or a file (each would leave the spelling unresolvable or elsewhere).
    "fifo-made-where-none-was": ("mkfifo M", "file-write-create", "M"),
    # The grandparent of an existing link spelling renamed away.
    "grandparent-renamed": ("mv g g2", "file-write-rename", "g"),
    # The resolved spelling written directly (the link's target).
    "resolved-spelling-written": ("echo evil > real/settings.json", "file-write-data",
                                  "real/settings.json"),
    # A directory made elsewhere and renamed to M, with settings.json inside.
    "dir-renamed-into-place": (
        "mkdir s_x && echo evil > s_x/settings.json && mv s_x M", "file-write-rename", "M",
    ),
    # M made as a directory (allowed), then the protected name in it.
    "mkdir-then-write": ("mkdir M && echo evil > M/settings.json", "file-write-create",
                         "M/settings.json"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PROTECTED_SPELLINGS))
async def test_a_protected_spelling_cannot_be_made_to_lead_elsewhere(
    sb: Sandboxes, name: str
) -> None:
    wt = sb.worktree
    (wt / "real").mkdir()
    (wt / "real" / "settings.json").write_text("{}\n")
    (wt / "g" / "h").mkdir(parents=True)
    (wt / "g" / "h" / "L").symlink_to("../../real")
    (wt / "elsewhere").mkdir()
    script, action, rel = PROTECTED_SPELLINGS[name]
    before = tree_state(wt)
    handle = sb.launch(protectedPaths=[str(wt / "M" / "settings.json"),
                                       str(wt / "g" / "h" / "L" / "settings.json")])  # fmt: skip
    result = await sb.sh(handle, f"cd {wt} && {{ {script}; }}; echo rc=$?")
    out = output(result)
    assert "rc=0" not in out, out
    after = tree_state(wt)
    if name == "mkdir-then-write":
        assert after.pop("M")[1] == b"", out  # the directory itself is allowed
    assert after == before, out
    assert refusals(handle) == [(action, f"{wt}/{rel}")], (refusals(handle), out)


# --- the control: ordinary work that looks like the attacks --------------------------------------


async def test_ordinary_work_that_looks_like_these_attacks_still_works(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # Links of ordinary files by fd, chmod and truncate through /proc/self/fd, renameat2 with
    # each flag, a name with a newline, an ordinary deep tree, rmdir of an ordinary empty
    # directory, a .git directory's ordinary files written by git, sockets of the sandbox's own.
    wt = sb.worktree
    _plant(wt)
    body = (
        "import socket\n"
        "open('s_f', 'w').write('x')\n"
        "fd = os.open('s_f', os.O_PATH)\n"
        "if libc.linkat(fd, b'', -100, b's_f2', 0x1000): fail()\n"
        "os.chmod(f'/proc/self/fd/{fd}', 0o700); os.truncate(f'/proc/self/fd/{fd}', 0)\n"
        "open('s_g', 'w').write('g')\n"
        "if libc.renameat2(-100, b's_g', -100, b's_h', 1): fail()\n"
        "if libc.renameat2(-100, b's_h', -100, b's_f2', 2): fail()\n"
        "if libc.renameat2(-100, b's_h', -100, b's_w', 4): fail()\n"
        "os.makedirs('s_n\\nl/x'); os.rmdir('s_n\\nl/x')\n"
        "os.makedirs('s_deep/' + '/'.join(['d' * 200] * 10))\n"
        "open('repoA/.git/description', 'w').write('ok\\n')\n"
        "s = socket.socket(socket.AF_UNIX); s.bind('s_own.sock'); s.listen()\n"
        "os.link('s_own.sock', 's_own2.sock')\n"
        "socket.socket(socket.AF_UNIX).connect('s_own2.sock')\n"
        "print('all ok')"
    )
    handle, out = await run_attack(sb, tmp_path, body)
    assert "all ok" in out and "RESULT=done" in out, out
    assert (wt / "s_f").stat().st_mode & 0o777 == 0o700 and (wt / "s_f").stat().st_size == 0
    assert (wt / "s_f2").read_text() == "g" and (wt / "s_w").read_text() == ""
    assert stat.S_ISCHR((wt / "s_h").lstat().st_mode)  # the whiteout left by RENAME_WHITEOUT
    assert handle.violations == [], handle.violations


# --- through the server's exec route -----------------------------------------------------------


async def test_through_the_server_the_review_s_attacks_are_refused(tmp_path: pathlib.Path) -> None:
    from server_kit import running_server

    work = tmp_path / "wt"
    work.mkdir()
    _plant(work)
    before = tree_state(work)
    script = (
        f"cd {work}; "
        "python3 -c \"import os; fd = os.open('repoA/.git/hooks/pre-push', os.O_PATH); "
        "os.chmod(f'/proc/self/fd/{fd}', 0o755)\" 2>/dev/null; echo chmod=$?; "
        "python3 -c \"import os; os.write(os.open('linked/.git', os.O_WRONLY), b'gitdir: /e')\" "
        "2>/dev/null; echo pointer=$?; "
        "python3 -c \"import os; os.open('/proc/1/root' + os.getcwd() + "
        "'/repoA/.git/hooks/pre-commit', os.O_CREAT | os.O_WRONLY)\" 2>/dev/null; echo root=$?; "
        "rmdir sub/.vscode 2>/dev/null; echo rmdir=$?; echo ok > s_fine; echo fine=$?"
    )
    with running_server(tmp_path) as server:
        async with server.client() as http:
            spec = {"sessionId": "srv-review", "workspaceId": "w",
                    "bindMounts": [{"hostPath": str(work)}]}  # fmt: skip
            assert (await http.post("/v1/sandboxes", json={"spec": spec})).status == 201
            reply = await http.post("/v1/sandboxes/srv-review/exec",
                                    json={"argv": ["/bin/sh", "-c", script]})  # fmt: skip
            result = await reply.json()
    assert result["stdout"].splitlines() == ["chmod=1", "pointer=1", "root=1", "rmdir=1",
                                             "fine=0"], result  # fmt: skip
    refusals = sorted((v["action"], v["target"]) for v in result["violations"])
    assert refusals == sorted([
        ("file-write-mode", f"{work}/{HOOK}"),
        ("file-write-data", f"{work}/linked/.git"),
        ("file-write-data", "/proc/1/root"),  # another process's link: refused there
        ("file-write-unlink", f"{work}/sub/.vscode"),
    ]), result  # fmt: skip
    assert tree_state(work) == before
    assert (work / "s_fine").read_text() == "ok\n"


# --- as an unprivileged user (the CLI, no daemon) ----------------------------------------------


def test_as_an_unprivileged_user_the_review_s_attacks_are_refused(
    other_user: OtherUser, user_dir: pathlib.Path
) -> None:
    _plant(user_dir)
    subprocess.run(["chown", "-R", f"{other_user.uid}:{other_user.gid}", str(user_dir)], check=True)
    before = tree_state(user_dir)
    script = (
        "python3 -c \"import os; fd = os.open('repoA/.git/hooks/pre-push', os.O_PATH); "
        "os.chmod(f'/proc/self/fd/{fd}', 0o755)\" 2>/dev/null; echo chmod=$?; "
        "python3 -c \"import os, ctypes; fd = os.open('repoA/.git/config', os.O_PATH); "
        "l = ctypes.CDLL(None, use_errno=True); "
        "exit(1 if l.linkat(fd, b'', -100, b's_alias', 0x1000) else 0)\"; echo link=$?; "
        'python3 -c "import os; os.truncate(f\'/proc/self/fd/{os.open(\\"repoA/.git/config\\", '
        "os.O_PATH)}', 0)\" 2>/dev/null; echo truncate=$?; "
        "rmdir sub/.vscode 2>/dev/null; echo rmdir=$?; "
        # The first review's escapes that reproduced as this user: an ACL, a directory renamed
        # to .config, a bare repository moved out of .git.
        "python3 -c \"import os, struct; os.setxattr('repoA/.git/hooks/pre-push', "
        "'system.posix_acl_access', struct.pack('<I', 2) + b''.join(struct.pack('<HHI', t, 7, "
        "0xffffffff) for t in (1, 4, 0x20)))\" 2>/dev/null; echo acl=$?; "
        "mkdir -p s_c/git && echo evil > s_c/git/config && mv s_c sub/.config 2>/dev/null; "
        "echo prefix=$?; mkdir -p repoA/.git/s_x/objects repoA/.git/s_x/refs && "
        "mv repoA/.git/s_x s_bare 2>/dev/null; echo bare=$?; "
        "echo ok > s_fine; echo fine=$?"
    )
    done = other_user.run(
        ["/usr/bin/python3", "-m", "cc_server.cli", "run", "--bind", str(user_dir),
         "--workdir", str(user_dir), "--", "/bin/sh", "-c", script],
        cwd=user_dir, env={"CC_SERVER_DAEMON": "off"},
    )  # fmt: skip
    assert done.stdout.splitlines() == [
        "chmod=1", "link=1", "truncate=1", "rmdir=1", "acl=1", "prefix=1", "bare=1", "fine=0"
    ], (done.stdout, done.stderr)  # fmt: skip
    staged = user_dir / "repoA" / ".git" / "s_x"  # made inside .git (allowed), kept there
    assert (staged / "objects").is_dir(), done.stderr
    shutil.rmtree(staged)
    assert tree_state(user_dir) == before, done.stderr
    assert not (user_dir / "s_alias").exists() and not (user_dir / "s_bare").exists()
    for verb in ("file-write-mode", "file-write-create", "file-write-data", "file-write-unlink"):
        assert verb in done.stderr, done.stderr


# --- the escapes this review found, each now refused (they escaped when it was written) ----------

FIXED_ESCAPES: dict[str, tuple[str, str, str]] = {
    # A POSIX ACL written with setxattr is a chmod by another name: the owner bits follow
    # ACL_USER_OBJ, so the hook becomes executable (0777). setxattr is not trapped.
    "acl-setxattr-makes-a-hook-executable": (
        "import struct\n"
        "acl = struct.pack('<I', 2) + b''.join(struct.pack('<HHI', tag, 7, 0xffffffff)"
        " for tag in (1, 4, 0x20))\n"
        f"os.setxattr('{HOOK}', 'system.posix_acl_access', acl)",
        "file-write-mode", HOOK,
    ),
    # A directory holding git/config renamed to .config: .config/git/config exists, never
    # created under its protected name (only multi-component patterns with an unprotected
    # first component are open to this).
    "dir-renamed-to-dot-config": (
        "os.makedirs('s_stage/git')\n"
        "open('s_stage/git/config', 'w').write('[core]\\n\\tfsmonitor = evil\\n')\n"
        "os.rename('s_stage', 'sub/.config')",
        "file-write-rename", "sub/.config",
    ),
    "dir-renamed-to-dot-config-fish": (
        "os.makedirs('sub/.config')\nos.makedirs('s_stage')\n"
        "open('s_stage/config.fish', 'w').write('evil\\n')\n"
        "os.rename('s_stage', 'sub/.config/fish')",
        "file-write-rename", "sub/.config/fish",
    ),
    "dir-exchanged-with-dot-config": (
        "os.makedirs('sub/.config')\nos.makedirs('s_stage/systemd/user')\n"
        "open('s_stage/systemd/user/evil.service', 'w').write('[Service]\\nExecStart=/evil\\n')\n"
        "if libc.renameat2(-100, b's_stage', -100, b'sub/.config', 2): fail()",
        "file-write-rename", "sub/.config",
    ),
    # A directory holding commondir renamed into .git/worktrees/<name>.
    "dir-renamed-into-git-worktrees": (
        "os.makedirs('repoA/.git/worktrees')\nos.makedirs('s_stage')\n"
        "open('s_stage/commondir', 'w').write('/evil\\n')\n"
        "os.rename('s_stage', 'repoA/.git/worktrees/w')",
        "file-write-rename", "repoA/.git/worktrees/w",
    ),
    # HEAD is refused outside a .git directory, but a directory made inside .git (where HEAD
    # is git's) and renamed out carries HEAD, objects/ and refs/ with it: a bare repository whose
    # config host git honours.
    "bare-repository-renamed-out-of-git": (
        "os.makedirs('repoA/.git/x/objects'); os.makedirs('repoA/.git/x/refs')\n"
        "os.makedirs('repoA/.git/x/hooks')\n"
        "open('repoA/.git/x/hooks/pre-commit', 'w').write('#!/bin/sh\\necho evil\\n')\n"
        "open('repoA/.git/x/config', 'w').write('[core]\\n\\tbare = true\\n')\n"
        "open('repoA/.git/x/HEAD', 'w').write('ref: refs/heads/main\\n')\n"
        "os.rename('repoA/.git/x', 's_bare')",
        "file-write-rename", "repoA/.git/x",
    ),
    # The same with a symlink in place of the rename: the unprotected component made a link
    # to a directory that holds the protected names.
    "symlink-named-dot-config": (
        "os.makedirs('s_stage/git')\n"
        "open('s_stage/git/config', 'w').write('[core]\\n\\tfsmonitor = evil\\n')\n"
        "os.symlink('../s_stage', 'sub/.config')",
        "file-write-create", "sub/.config",
    ),
    "symlink-named-git-worktrees": (
        "os.makedirs('s_wt/w')\nopen('s_wt/w/commondir', 'w').write('/evil\\n')\n"
        "os.symlink('../../s_wt', 'repoA/.git/worktrees')",
        "file-write-create", "repoA/.git/worktrees",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(FIXED_ESCAPES))
async def test_review_escape(sb: Sandboxes, tmp_path: pathlib.Path, name: str) -> None:
    wt = sb.worktree
    _plant(wt)
    body, _action, _rel = FIXED_ESCAPES[name]  # the verb and target a fix would naturally report
    before = tree_state(wt)
    handle, out = await run_attack(sb, tmp_path, body)
    # EACCES (a refusal, one violation), or EOPNOTSUPP for the ACL (xattr writes are refused
    # outright under the write policy, as by a filesystem without them).
    acl = name.startswith("acl-")
    assert f"RESULT=refused [Errno {95 if acl else 13}]" in out, out
    after = tree_state(wt)
    # What existed is unchanged; what the attack made on its way (the directories it staged
    # before the refused step) carries no protected path: no config, hooks or commondir.
    assert {k: v for k, v in after.items() if k in before} == before, out
    host_run = {"config", "commondir", "config.fish", "evil.service", "pre-commit"}
    planted = {k for k in after.keys() - before.keys() if pathlib.Path(k).name in host_run}
    assert not {k for k in planted if not k.startswith("repoA/.git/x/")}, (planted, out)
    assert not (wt / "s_bare" / "HEAD").exists(), out
    got = refusals(handle)
    if acl:
        assert got == [], (got, out)
    else:
        assert len(got) == 1 and got[0][0].startswith("file-write-"), (got, out)


async def test_review_escape_protected_dir_renamed_away(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # An existing .config/git/config moved away by renaming the unprotected directory above it;
    # a new one can then be moved in (see above).
    wt = sb.worktree
    _plant(wt)
    (wt / "sub" / ".config" / "git").mkdir(parents=True)
    (wt / "sub" / ".config" / "git" / "config").write_text("[user]\n")
    before = tree_state(wt)
    body = "os.rename('sub/.config', 's_old')"
    _handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=refused [Errno 13]" in out, out
    assert tree_state(wt) == before, out


async def test_review_escape_supervisor_opens_a_non_dumpable_process_s_fds(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # PID 1 (the launcher) and the connector are not dumpable: the task's own open of
    # /proc/1/fd/N is refused (EACCES), but the same open with O_WRONLY (trapped) is made by the
    # supervisor, which owns the sandbox's user namespace, and the object (PID 1's stderr pipe,
    # the connector's stdin) is handed to the task.
    body = (
        "conn = [int(n) for n in os.listdir('/proc') if n.isdigit()\n"
        "        and 'Seccomp_filters:\\t1' in open(f'/proc/{n}/status').read()]\n"
        "opened = []\n"
        "for pid in (1, conn[0]):\n"
        "    for n in os.listdir(f'/proc/{pid}/fd'):\n"
        "        for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR):\n"
        "            try:\n"
        "                fd = os.open(f'/proc/{pid}/fd/{n}', flags)\n"
        "                opened.append((pid, n, flags, os.readlink(f'/proc/self/fd/{fd}')))\n"
        "            except OSError:\n"
        "                pass\n"
        "print('opened', opened)\n"
        "if opened: fd = os.open('/proc/1/fd/2', os.O_RDWR); os.write(fd, b'SPOOFED\\n')\n"
    )
    _handle, out = await run_attack(sb, tmp_path, body)
    assert "opened []" in out, out
async def test_review_gap_a_file_where_a_protected_spelling_needs_a_directory(
    sb: Sandboxes,
) -> None:
    # Minor: mkfifo/symlink/bind at M are refused (ancestor_refused: "may not be made as
    # anything but a directory"), but an open(O_CREAT) of M is not checked against it.
    wt = sb.worktree
    handle = sb.launch(protectedPaths=[str(wt / "M" / "settings.json")])
    result = await sb.sh(handle, f"cd {wt} && {{ echo x > M; }}; echo rc=$?")
    out = output(result)
    assert "rc=0" not in out and not (wt / "M").exists(), out
    assert refusals(handle) == [("file-write-create", f"{wt}/M")], out


async def test_review_gap_a_bind_whose_root_is_a_git_directory(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # A writable bind whose root is a repository's git directory (say, the main repository of a
    # linked worktree): the patterns are matched below the bind root, so `config` and
    # `hooks/pre-commit` there are ordinary names.
    other = tmp_path / "other"
    git_repo(other)
    gitdir = other / ".git"
    before = (gitdir / "config").read_bytes()
    handle = sb.launch(bindMounts=[{"hostPath": str(sb.worktree)}, {"hostPath": str(gitdir)}])
    result = await sb.sh(handle, (
        f"cd {gitdir} && echo '[core] fsmonitor = evil' >> config; echo cfg=$?; "
        "echo evil > hooks/pre-commit; echo hook=$?"
    ))  # fmt: skip
    out = output(result)
    assert "cfg=0" not in out and "hook=0" not in out, out
    assert (gitdir / "config").read_bytes() == before
    assert not (gitdir / "hooks" / "pre-commit").exists()


async def test_review_gap_mkdir_p_through_an_existing_git_is_reported(sb: Sandboxes) -> None:
    # Ordinary work: `mkdir -p repoA/.git/info` calls mkdir("repoA/.git"), which the kernel
    # answers EEXIST (nothing would be made); the supervisor refuses it with EACCES and reports a
    # violation (mkdir -p then carries on): a refusal of nothing, reported to the run and model.
    wt = sb.worktree
    _plant(wt)
    handle = sb.launch()
    result = await sb.sh(handle, f"cd {wt} && mkdir -p repoA/.git/info/x && echo rc=$?")
    out = output(result)
    assert "rc=0" in out, out
    assert handle.violations == [], refusals(handle)


async def test_review_escape_netlink_groups_through_the_supervisor(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # The supervisor binds (every bind is trapped) and, for a non-blocking socket of another
    # family, connects the task's socket itself, as the owner of the sandbox's user namespace:
    # CAP_NET_ADMIN in the sandbox's network namespace. A netlink socket then joins (bind) or
    # sends to (connect) multicast groups the task itself may not: its own
    # setsockopt(NETLINK_ADD_MEMBERSHIP) and a blocking connect (the connector) get EPERM.
    body = (
        "import socket\nresults = []\n"
        "for proto in (6, 12):  # NETLINK_XFRM, NETLINK_NETFILTER: no unprivileged groups\n"
        "    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, proto)\n"
        "    try:\n"
        "        s.setsockopt(270, 1, 1); results.append('own-membership')\n"
        "    except OSError as e:\n"
        "        results.append(e.errno)\n"
        "    try:\n"
        "        s.bind((0, 0xffffffff)); results.append('BOUND-TO-GROUPS')\n"
        "    except OSError as e:\n"
        "        results.append(e.errno)\n"
        "    c = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, proto); c.setblocking(False)\n"
        "    try:\n"
        "        c.connect((0, 1)); results.append('CONNECTED-TO-GROUP')\n"
        "    except OSError as e:\n"
        "        results.append(e.errno)\n"
        "print('results', results)\n"
    )
    _handle, out = await run_attack(sb, tmp_path, body)
    assert "results [1, 1, 1, 1, 1, 1]" in out, out


def _linked_worktree(wt: pathlib.Path) -> pathlib.Path:
    """A host linked worktree wt/wt2 of repoA (its pointer names .git/worktrees/w)."""
    git_repo(wt / "repoA")
    w = wt / "repoA" / ".git" / "worktrees" / "w"
    w.mkdir(parents=True)
    (w / "commondir").write_text("../..\n")
    (w / "gitdir").write_text(f"{wt}/wt2/.git\n")
    (wt / "wt2").mkdir()
    (wt / "wt2" / ".git").write_text(f"gitdir: {w}\n")
    return w


async def test_review_escape_git_worktrees_renamed_away_then_made_again(sb: Sandboxes) -> None:
    # .git/worktrees itself is no protected name: moved away with every host worktree's
    # directory in it, then made again; w, made by the sandbox now, counts as its own, so its
    # commondir (which the host's pointer wt2/.git follows) is written.
    wt = sb.worktree
    w = _linked_worktree(wt)
    handle = sb.launch()
    result = await sb.sh(handle, (
        f"cd {wt}; mv repoA/.git/worktrees s_away; echo mv=$?; "
        "mkdir repoA/.git/worktrees repoA/.git/worktrees/w; "
        "echo /evil > repoA/.git/worktrees/w/commondir; echo commondir=$?"
    ))  # fmt: skip
    out = output(result)
    assert "mv=0" not in out and "commondir=0" not in out, out
    assert (w / "commondir").read_text() == "../..\n", out
    assert not (wt / "s_away").exists(), out


async def test_review_escape_own_worktree_inode_reused_by_the_host(sb: Sandboxes) -> None:
    # The sandbox's own worktree directories are known by dev:ino, and stay known after the
    # sandbox removes them: a directory the host makes later (git worktree add on the host, a
    # dispatch of another conversation) that reuses one of those inode numbers counts as the
    # sandbox's own, and its commondir is written.
    wt = sb.worktree
    git_repo(wt / "repoA")
    wts = wt / "repoA" / ".git" / "worktrees"
    wts.mkdir()
    handle = sb.launch()
    script = (
        f"cd {wt} && for i in $(seq 1 16); do mkdir repoA/.git/worktrees/s$i; done; "
        "stat -c %i repoA/.git/worktrees/s* > s_inodes; "
        "for i in $(seq 1 16); do rmdir repoA/.git/worktrees/s$i; done; touch s_ready; "
        "while [ ! -e s_go ]; do sleep 0.05; done; "
        "for d in repoA/.git/worktrees/*; do echo /evil > $d/commondir && echo WROTE $d; done; "
        "echo done"
    )
    task = asyncio.create_task(sb.sh(handle, script))
    for _ in range(200):
        if (wt / "s_ready").exists():
            break
        await asyncio.sleep(0.05)
    freed = {int(line) for line in (wt / "s_inodes").read_text().split()}
    reused = []
    for i in range(400):  # the host's own linked worktrees, made while the sandbox runs
        d = wts / f"host{i}"
        d.mkdir()
        if d.stat().st_ino in freed:
            (d / "commondir").write_text("../..\n")
            reused.append(d)
        else:
            d.rmdir()
        if len(reused) == 2:
            break
    (wt / "s_go").touch()
    out = output(await task)
    # The supervisor holds each of its own directories open, so none of those inodes is freed
    # while the sandbox lives (without that, a reuse happened on every run and WROTE followed).
    assert reused == [], reused
    assert "WROTE" not in out, out
    assert all((d / "commondir").read_text() == "../..\n" for d in reused), out


async def test_review_escape_a_gitdir_not_named_dot_git(sb: Sandboxes) -> None:
    # The gitdir a `.git` file points at (git init --separate-git-dir, issue 14: "and the gitdir
    # that a .git file points at") and an existing bare repository in the bind (host `git push`
    # to it runs its hooks) are matched by no pattern: their config and hooks are ordinary names.
    wt = sb.worktree
    (wt / "store").mkdir()
    subprocess.run(
        ["git", "init", "-q", "--separate-git-dir", str(wt / "store" / "r.git"), str(wt / "proj")],
        check=True,
    )
    subprocess.run(["git", "init", "-q", "--bare", str(wt / "bare.git")], check=True)
    before = tree_state(wt)
    handle = sb.launch()
    result = await sb.sh(handle, (
        f"cd {wt}; echo '[core] fsmonitor = evil' >> store/r.git/config; echo cfg=$?; "
        "echo evil > store/r.git/hooks/pre-commit; echo hook=$?; "
        "echo '[core] fsmonitor = evil' >> bare.git/config; echo bare_cfg=$?; "
        "echo evil > bare.git/hooks/post-update; echo bare_hook=$?"
    ))  # fmt: skip
    out = output(result)
    assert [line for line in out.splitlines() if line.endswith("=0")] == [], out
    assert tree_state(wt) == before, out
