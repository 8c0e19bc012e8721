"""A second hostile review of the write policy, aimed at the first review's fixes (the prefix rule,
git directories by their shape, the sandbox's own worktrees, the task's own procfs links, the
connector, EEXIST, the refused xattr calls) and what lies near them. Real bubblewrap; each test
names its idea in a comment and checks the host afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pathlib
import socket
import subprocess
import sys
import termios
import textwrap
import time

import pytest
from escape_kit import Sandboxes, output, run_attack
from write_kit import refusals, steps_script, tree_state, wheel

pytestmark = [pytest.mark.security, pytest.mark.integration]

GIT_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1"}


def _git(*args: str, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True, capture_output=True, text=True, env=GIT_ENV, cwd=cwd,
    )  # fmt: skip


CONFIG = "repoA/.git/config"
NEW_HOOK = "repoA/.git/hooks/pre-commit"
HOST_WT = "repoA/.git/worktrees/w"  # a host linked worktree's directory (its pointer: wt2/.git)


def _plant(wt: pathlib.Path) -> None:
    """A repository with a host linked worktree, a bare repository, a home-like .config/git, and
    scratch material; scratch names start `s_`."""
    _git("init", "-q", str(wt / "repoA"))
    w = wt / HOST_WT
    w.mkdir(parents=True)
    (w / "commondir").write_text("../..\n")
    (w / "HEAD").write_text("ref: refs/heads/main\n")
    (w / "gitdir").write_text(f"{wt}/wt2/.git\n")
    (wt / "wt2").mkdir()
    (wt / "wt2" / ".git").write_text(f"gitdir: {w}\n")
    _git("init", "-q", "--bare", str(wt / "bare.git"))
    (wt / "home" / ".config" / "git").mkdir(parents=True)
    (wt / "home" / ".config" / "git" / "ignore").write_text("*.o\n")
    (wt / "plain").mkdir()
    (wt / "plain" / "b").mkdir()
    (wt / "plain" / "b" / ".config").mkdir()  # an empty .config a rename could replace
    (wt / "s_evil" / "git").mkdir(parents=True)  # what an attacker wants as a .config
    (wt / "s_evil" / "git" / "config").write_text("[core]\n\tpager = evil\n")
    (wt / "s_file").write_text("[core]\n\tpager = evil\n")


REFUSED: dict[str, tuple[str, str, str]] = {
    # The prefix rule in another case: a directory holding git/config renamed to .CONFIG.
    "prefix-case": ("os.rename('s_evil', 'plain/.CONFIG')", "file-write-rename", "plain/.CONFIG"),
    # ... spelled with `//` and a trailing slash.
    "prefix-double-slash-trailing": (
        "os.rename('s_evil/', 'plain//.config/')", "file-write-rename", "plain/.config",
    ),
    # ... with RENAME_NOREPLACE.
    "prefix-noreplace": (
        "if libc.renameat2(-100, b's_evil', -100, b'plain/.config', 1): fail()",
        "file-write-rename", "plain/.config",
    ),
    # ... through a symlinked parent (judged on the resolved path).
    "prefix-through-a-symlinked-parent": (
        "os.symlink('plain', 's_l')\nos.rename('s_evil', 's_l/.config')",
        "file-write-rename", "plain/.config",
    ),
    # `mv a b/.config` where b/.config is an existing empty directory: the rename replaces it.
    "prefix-replaces-an-empty-dot-config": (
        "os.rename('s_evil', 'plain/b/.config')", "file-write-rename", "plain/b/.config",
    ),
    # RENAME_EXCHANGE of an existing .config with the attacker's directory.
    "prefix-exchange": (
        "if libc.renameat2(-100, b'plain/b/.config', -100, b's_evil', 2): fail()",
        "file-write-rename", "plain/b/.config",
    ),
    # A symlink named .config to the attacker's directory.
    "prefix-symlink": (
        "os.symlink(os.getcwd() + '/s_evil', 'plain/.config')",
        "file-write-create", "plain/.config",
    ),
    # A directory renamed to .git/worktrees/<name> (a prefix of the worktree patterns).
    "prefix-worktree-dir": (
        "os.rename('s_evil', 'repoA/.git/worktrees/new')",
        "file-write-rename", "repoA/.git/worktrees/new",
    ),
    # Renaming the parent of a .config whose child becomes git: the inner rename is judged.
    "deeper-rename-inside-dot-config": (
        "os.rename('s_evil/git', 's_evil/gitx')\nos.rename('s_evil', 's_c')\n"
        "os.makedirs('s_d/.config')\nos.rename('s_c/gitx', 's_d/.config/git')",
        "file-write-rename", "s_d/.config/git",
    ),
    # A hard link of an ordinary file into an existing .config/git.
    "hard-link-into-dot-config-git": (
        "os.link('s_file', 'home/.config/git/config')",
        "file-write-create", "home/.config/git/config",
    ),
    # A hard link of the bare repository's HEAD to an ordinary directory (a second bare repo).
    "hard-link-a-head-out": (
        "os.makedirs('s_b/objects'); os.makedirs('s_b/refs')\nos.link('bare.git/HEAD', 's_b/HEAD')",
        "file-write-create", "bare.git/HEAD",  # the source: HEAD outside a .git directory
    ),
    # A symlinked HEAD (git accepts `HEAD -> refs/heads/x`) beside objects/ and refs/.
    "symlinked-head": (
        "os.makedirs('s_b/objects'); os.makedirs('s_b/refs')\n"
        "os.symlink('refs/heads/main', 's_b/HEAD')",
        "file-write-create", "s_b/HEAD",
    ),
    # mknod of a regular file named HEAD (not an open).
    "mknod-head": (
        "os.makedirs('s_b/objects'); os.makedirs('s_b/refs')\nos.mknod('s_b/HEAD', 0o100644)",
        "file-write-create", "s_b/HEAD",
    ),
    # Shape first, config after: the config write sees the shape (HEAD is the way in).
    "config-before-head": (
        "os.makedirs('s_b/objects'); os.makedirs('s_b/refs')\n"
        "open('s_b/config', 'w').write('[core]\\n\\tpager = evil\\n')\n"
        "open('s_b/HEAD', 'w').write('ref: refs/heads/main\\n')",
        "file-write-create", "s_b/HEAD",
    ),
    # Remove a bare repository's HEAD (then write its config, then restore HEAD).
    "remove-bare-head": ("os.unlink('bare.git/HEAD')", "file-write-unlink", "bare.git/HEAD"),
    # ... or move it aside.
    "rename-bare-head": (
        "os.rename('bare.git/HEAD', 'bare.git/HEAD.x')", "file-write-rename", "bare.git/HEAD",
    ),
    # A git-shaped directory made inside .git, then moved out of it.
    "shaped-inside-git-moved-out": (
        "for d in ('objects', 'refs'): os.makedirs('repoA/.git/s_x/' + d)\n"
        "open('repoA/.git/s_x/config', 'w').write('[core]\\n\\tpager = evil\\n')\n"
        "open('repoA/.git/s_x/HEAD', 'w').write('ref: refs/heads/main\\n')\n"
        "os.rename('repoA/.git/s_x', 's_out')",
        "file-write-rename", "repoA/.git/s_x",
    ),
    # .git itself renamed (its config would be an ordinary name elsewhere).
    "rename-dot-git": ("os.rename('repoA/.git', 'repoA/s_git')", "file-write-rename", "repoA/.git"),
    # .git/worktrees renamed away (then made again, as the sandbox's own).
    "rename-worktrees": (
        "os.rename('repoA/.git/worktrees', 'repoA/.git/s_wts')",
        "file-write-rename", "repoA/.git/worktrees",
    ),
    # A host worktree's directory removed (commondir first: refused there already).
    "rm-host-worktree-commondir": (
        f"os.unlink('{HOST_WT}/commondir')", "file-write-unlink", f"{HOST_WT}/commondir",
    ),
    # The sandbox's own worktree dir exchanged with the host's (the host pointer would then
    # name the sandbox's directory).
    "exchange-own-and-host-worktree": (
        "os.mkdir('repoA/.git/worktrees/mine')\n"
        "open('repoA/.git/worktrees/mine/commondir', 'w').write('/evil\\n')\n"
        "if libc.renameat2(-100, b'repoA/.git/worktrees/mine', -100, b'repoA/.git/worktrees/w', 2):"
        " fail()",
        "file-write-rename", HOST_WT,
    ),
    # ... and the host's exchanged with the sandbox's (the other side first).
    "exchange-host-and-own-worktree": (
        "os.mkdir('repoA/.git/worktrees/mine')\n"
        "open('repoA/.git/worktrees/mine/commondir', 'w').write('/evil\\n')\n"
        "if libc.renameat2(-100, b'repoA/.git/worktrees/w', -100, b'repoA/.git/worktrees/mine', 2):"
        " fail()",
        "file-write-rename", HOST_WT,  # the host's directory may not be moved
    ),
    # The sandbox's own worktree renamed onto the host's name (replacing it).
    "rename-own-onto-host-worktree": (
        "os.mkdir('repoA/.git/worktrees/mine')\n"
        "os.rename('repoA/.git/worktrees/mine', 'repoA/.git/worktrees/w')",
        "file-write-rename", HOST_WT,
    ),
    # /proc/thread-self/fd/N of a read-only fd, reopened for writing.
    "proc-thread-self-fd": (
        f"fd = os.open('{CONFIG}', os.O_RDONLY)\n"
        "os.write(os.open(f'/proc/thread-self/fd/{fd}', os.O_WRONLY), b'evil')",
        "file-write-data", CONFIG,
    ),
    # /proc/<own pid>/task/<own tid>/fd/N.
    "proc-own-task-fd": (
        f"fd = os.open('{CONFIG}', os.O_RDONLY)\n"
        "p = f'/proc/{os.getpid()}/task/{__import__(\"threading\").get_native_id()}/fd/{fd}'\n"
        "os.write(os.open(p, os.O_WRONLY), b'evil')",
        "file-write-data", CONFIG,
    ),
    # /proc/self/fd of a directory fd, then a relative name (a new hook).
    "proc-self-fd-of-a-dir-then-a-name": (
        "d = os.open('repoA/.git/hooks', os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.open(f'/proc/self/fd/{d}/pre-commit', os.O_CREAT | os.O_WRONLY, 0o755)",
        "file-write-create", NEW_HOOK,
    ),
    # /proc/self/cwd with the cwd inside .git.
    "proc-self-cwd-inside-git": (
        "os.chdir('repoA/.git')\nos.write(os.open('/proc/self/cwd/config', os.O_WRONLY), b'evil')",
        "file-write-data", CONFIG,
    ),
    # /proc/self/cwd/.. from inside .git/hooks to config (.. through a magic link).
    "proc-self-cwd-dotdot": (
        "os.chdir('repoA/.git/hooks')\n"
        "os.write(os.open('/proc/self/cwd/../config', os.O_WRONLY | os.O_APPEND), b'evil')",
        "file-write-data", CONFIG,
    ),
    # A bare repository's config through /proc/self/fd (the object path).
    "object-path-bare-config": (
        "fd = os.open('bare.git/config', os.O_RDONLY)\n"
        "os.write(os.open(f'/proc/self/fd/{fd}', os.O_WRONLY), b'evil')",
        "file-write-data", "bare.git/config",
    ),
    # packed-refs and info/attributes are not protected, but a bare repo's hooks are, also
    # by the object path (an O_PATH fd of the hooks directory, then a name).
    "object-path-bare-hooks-dir": (
        "d = os.open('bare.git/hooks', os.O_PATH | os.O_DIRECTORY)\n"
        "os.open(f'/proc/self/fd/{d}/post-receive', os.O_CREAT | os.O_WRONLY, 0o755)",
        "file-write-create", "bare.git/hooks/post-receive",
    ),
    # A bare repository's config and a new hook, written straight (its shape is intact).
    "bare-config-append": (
        "open('bare.git/config', 'a').write('[core]\\n\\tpager = evil\\n')",
        "file-write-data", "bare.git/config",
    ),
    "bare-new-hook": (
        "os.open('bare.git/hooks/post-receive', os.O_CREAT | os.O_WRONLY, 0o755)",
        "file-write-create", "bare.git/hooks/post-receive",
    ),
    # A hook renamed into a bare repository's hooks, and its hooks exchanged with another dir.
    "rename-into-bare-hooks": (
        "os.rename('s_file', 'bare.git/hooks/post-update')",
        "file-write-rename", "bare.git/hooks/post-update",
    ),
    "exchange-bare-hooks": (
        "if libc.renameat2(-100, b's_evil', -100, b'bare.git/hooks', 2): fail()",
        "file-write-rename", "bare.git/hooks",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REFUSED))
async def test_review2_the_supervisor_refuses_and_reports_once(
    sb: Sandboxes, tmp_path: pathlib.Path, name: str
) -> None:
    wt = sb.worktree
    _plant(wt)
    body, action, rel = REFUSED[name]
    before = tree_state(wt)
    handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=refused [Errno 13]" in out, out
    # What the attack made before the refused step (inside .git, not at the top) is left.
    made = ("repoA/.git/s_x", "repoA/.git/worktrees/mine")
    assert {k: v for k, v in tree_state(wt).items() if not k.startswith(made)} == before, out
    assert (wt / HOST_WT / "commondir").read_text() == "../..\n", out
    assert not (wt / NEW_HOOK).exists(), out
    assert refusals(handle) == [(action, f"{wt}/{rel}")], (refusals(handle), out)


# name -> Python body; each must fail, change nothing, and make no file-* violation (the filter
# answers EOPNOTSUPP for every xattr write, the kernel the rest).
NOT_SUPERVISED: dict[str, str] = {
    # setxattrat (Linux 6.13, nr 463) with AT_SYMLINK_NOFOLLOW: a POSIX ACL on a hook.
    "setxattrat-acl-on-a-hook": (
        "import struct\n"
        "acl = struct.pack('<I', 2) + struct.pack('<HHI', 1, 7, 0xffffffff) + "
        "struct.pack('<HHI', 4, 7, 0xffffffff) + struct.pack('<HHI', 32, 7, 0xffffffff)\n"
        "args = struct.pack('<QII', ctypes.cast(ctypes.c_char_p(acl), ctypes.c_void_p).value,"
        " len(acl), 0)\n"
        "if libc.syscall(463, -100, b'repoA/.git/hooks/pre-push.sample', 0x100,"
        " b'system.posix_acl_access', args, len(args)) < 0: fail()"
    ),
    # fsetxattr on an O_PATH fd of the config (the kernel says EBADF; never a write).
    "fsetxattr-on-o-path": (
        f"fd = os.open('{CONFIG}', os.O_PATH)\n"
        "if libc.fsetxattr(fd, b'user.x', b'1', 1, 0): fail()"
    ),
    # lremovexattr and removexattrat (466) of the config's security label.
    "removexattrat": (
        f"if libc.syscall(466, -100, b'{CONFIG}', 0, b'user.x') < 0: fail()"
    ),
    # `git config --file` on a bare repository's config: git's lock file then rename onto it.
    "git-config-file-on-a-bare-repo": (
        "import subprocess\n"
        "r = subprocess.run(['git', 'config', '--file', 'bare.git/config', 'core.pager', 'evil'])\n"
        "if r.returncode: raise PermissionError(13, 'git config failed')"
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(NOT_SUPERVISED))
async def test_review2_refused_without_a_write(
    sb: Sandboxes, tmp_path: pathlib.Path, name: str
) -> None:
    wt = sb.worktree
    _plant(wt)
    before = tree_state(wt)
    handle, out = await run_attack(sb, tmp_path, NOT_SUPERVISED[name])
    assert "RESULT=refused" in out, out
    assert tree_state(wt) == before, out
    if name.startswith("git-config"):  # refused at git's rename onto the config: one violation
        assert refusals(handle) == [("file-write-rename", f"{wt}/bare.git/config")], out
    else:
        assert not [v for v in handle.violations if v.action.startswith("file-")], out


async def test_review2_existing_protected_names_are_eexist_not_violations(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # name_for_create's EEXIST: mkdir of an existing .git, .git/hooks, a host worktree dir, a
    # symlink and a socket onto an existing protected name: the kernel's EEXIST (what mkdir -p
    # expects), no violation; O_CREAT|O_EXCL of the config is a refusal (it names a protected
    # file) or EEXIST, never a write.
    wt = sb.worktree
    _plant(wt)
    before = tree_state(wt)
    body = (
        "import errno, socket\ngot = []\n"
        f"for p in ('repoA/.git', 'repoA/.git/hooks', '{HOST_WT}', 'bare.git/hooks'):\n"
        "    try:\n        os.mkdir(p); got.append('MADE')\n"
        "    except OSError as e:\n        got.append(e.errno)\n"
        f"for f in (lambda: os.symlink('/evil', '{CONFIG}'),\n"
        f"          lambda: socket.socket(socket.AF_UNIX).bind('{CONFIG}'),\n"
        f"          lambda: os.mknod('{HOST_WT}/commondir')):\n"
        "    try:\n        f(); got.append('MADE')\n"
        "    except OSError as e:\n        got.append(e.errno)\n"
        "print('got', got)\n"
        "import subprocess\n"
        "print('mkdir-p', subprocess.run(['mkdir', '-p', 'repoA/.git/hooks', 'repoA/.git/info'])"
        ".returncode)\n"
    )
    handle, out = await run_attack(sb, tmp_path, body)
    # (bind: the kernel says EADDRINUSE, the supervisor EEXIST; see the review's report)
    assert any(f"got [17, 17, 17, 17, 17, {e}, 17]" in out for e in (17, 98)), out
    assert "mkdir-p 0" in out, out
    assert tree_state(wt) == before, out
    assert handle.violations == [], refusals(handle)


class _HostListener:
    """A host process's listening Unix socket; `contacts()` says whether anyone reached it."""

    def __init__(self, path: pathlib.Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        path.chmod(0o777)
        self.sock.listen(256)
        self.sock.setblocking(False)

    def contacts(self) -> int:
        n = 0
        while True:
            try:
                self.sock.accept()[0].close()
                n += 1
            except BlockingIOError:
                return n

    def close(self) -> None:
        self.sock.close()


FIND_CONNECTOR = (
    "import signal, socket, subprocess, time, threading\n"
    "conn = [int(n) for n in os.listdir('/proc') if n.isdigit()\n"
    "        and 'Seccomp_filters:\\t1' in open(f'/proc/{n}/status').read()]\n"
    "assert len(conn) == 1, conn\n"
    "def attempt(f):\n"
    "    try:\n        f(); return 'ok'\n"
    "    except OSError as e:\n        return e.errno\n"
)


async def test_review2_a_killed_connector_fails_closed(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # The connector killed from inside (same uid): every bind and connect it would have made is
    # refused from then on (none is made by the supervisor instead, with its reach), a pathname
    # bind (the supervisor's own) still works, and the host's socket stays out.
    wt = sb.worktree
    listener = _HostListener(wt / "host.sock")
    body = FIND_CONNECTOR + (
        "os.kill(conn[0], signal.SIGKILL); time.sleep(0.3)\n"
        "r = {}\n"
        "r['inet-bind'] = attempt(lambda: socket.socket().bind(('127.0.0.1', 0)))\n"
        "r['abstract-bind'] = attempt(lambda: socket.socket(socket.AF_UNIX).bind('\\0s-x'))\n"
        "r['netlink-groups'] = attempt(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW,"
        " 0).bind((0, 1)))\n"
        "own = socket.socket(socket.AF_UNIX)\n"
        "r['path-bind'] = attempt(lambda: own.bind('s_own.sock'))\n"
        "own.listen()\n"
        "r['own-connect'] = attempt(lambda: socket.socket(socket.AF_UNIX).connect('s_own.sock'))\n"
        "r['host-connect'] = attempt(lambda: socket.socket(socket.AF_UNIX).connect('host.sock'))\n"
        "print('r', sorted(r.items()))\n"
    )
    try:
        handle, out = await run_attack(sb, tmp_path, body)
        assert listener.contacts() == 0, out
    finally:
        listener.close()
    assert (
        "r [('abstract-bind', 111), ('host-connect', 13), ('inet-bind', 111), "
        "('netlink-groups', 111), ('own-connect', 111), ('path-bind', 'ok')]"
    ) in out, out
    assert refusals(handle) == [("network-outbound", f"{wt}/host.sock")], out


async def test_review2_binds_through_the_connector_keep_the_task_s_reach(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # Binds the connector makes: netlink with multicast groups (EPERM: no CAP_NET_ADMIN; only
    # NETLINK_KOBJECT_UEVENT, 15, lets anyone receive, as the kernel does for the task), a port
    # below 1024 (EACCES), while an abstract socket, port 0 and a datagram socket work; a
    # socket fd dup2'd between AF_UNIX and AF_INET during the binds binds one or the other,
    # never a port below 1024.
    body = FIND_CONNECTOR + (
        "r = {}\n"
        "for proto in (0, 6, 12, 15):\n"
        "    r[f'netlink-{proto}'] = attempt(lambda: socket.socket(socket.AF_NETLINK,"
        " socket.SOCK_RAW, proto).bind((0, 0xffffffff)))\n"
        "r['port-80'] = attempt(lambda: socket.socket().bind(('127.0.0.1', 80)))\n"
        "r['port-80-v6'] = attempt(lambda: socket.socket(socket.AF_INET6).bind(('::1', 80)))\n"
        "r['port-0'] = attempt(lambda: socket.socket().bind(('127.0.0.1', 0)))\n"
        "r['udp'] = attempt(lambda: socket.socket(type=socket.SOCK_DGRAM).bind(('0.0.0.0', 0)))\n"
        "a = socket.socket(socket.AF_UNIX)\n"
        "r['abstract'] = attempt(lambda: (a.bind('\\0s-review2'), a.listen()))\n"
        "r['abstract-connect'] = attempt(lambda: socket.socket(socket.AF_UNIX)"
        ".connect('\\0s-review2'))\n"
        "import ctypes\n"
        "sa = (ctypes.c_char * 16)(*b'\\x02\\x00\\x00\\x50\\x7f\\x00\\x00\\x01' + b'\\0' * 8)\n"
        "tcp = socket.socket(); unix = socket.socket(socket.AF_UNIX)\n"
        "n = os.dup(tcp.fileno()); stop = []\n"
        "def flip():\n"
        "    while not stop:\n"
        "        os.dup2(unix.fileno(), n); os.dup2(tcp.fileno(), n)\n"
        "t = threading.Thread(target=flip); t.start()\n"
        "low = 0\n"
        "for i in range(200):\n"
        "    if libc.bind(n, sa, 16) == 0: low += 1\n"
        "stop.append(1); t.join()\n"
        "r['low-port-race'] = low\n"
        "print('r', sorted(r.items()))\n"
    )
    _handle, out = await run_attack(sb, tmp_path, body)
    assert (
        "r [('abstract', 'ok'), ('abstract-connect', 'ok'), ('low-port-race', 0), "
        "('netlink-0', 1), ('netlink-12', 1), ('netlink-15', 'ok'), ('netlink-6', 1), "
        "('port-0', 'ok'), ('port-80', 13), ('port-80-v6', 13), ('udp', 'ok')]"
    ) in out, out


async def test_review2_a_flooded_connector_lets_nothing_out_and_recovers(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # 100 blocking connects at once to the sandbox's own listener, which never accepts (its
    # backlog full, each waits in a connector thread; past 64 the connector says EAGAIN): the
    # host's socket is still refused meanwhile, and once the listener closes every waiting
    # connect ends and a new connect works.
    wt = sb.worktree
    listener = _HostListener(wt / "host.sock")
    body = FIND_CONNECTOR + (
        "own = socket.socket(socket.AF_UNIX); own.bind('s_full.sock'); own.listen(0)\n"
        "results = []\n"
        "def one():\n"
        "    c = socket.socket(socket.AF_UNIX)\n"
        "    results.append(attempt(lambda: c.connect('s_full.sock')))\n"
        "threads = [threading.Thread(target=one) for _ in range(100)]\n"
        "for t in threads: t.start()\n"
        "time.sleep(1.0)\n"
        "print('host', attempt(lambda: socket.socket(socket.AF_UNIX).connect('host.sock')))\n"
        "own.close(); os.unlink('s_full.sock')\n"
        "for t in threads: t.join(10)\n"
        "print('alive', sum(t.is_alive() for t in threads))\n"
        "print('eagain', results.count(11) > 0)\n"
        "again = socket.socket(socket.AF_UNIX); again.bind('s_again.sock'); again.listen()\n"
        "print('after', attempt(lambda: socket.socket(socket.AF_UNIX).connect('s_again.sock')))\n"
    )
    try:
        handle, out = await run_attack(sb, tmp_path, body)
        assert listener.contacts() == 0, out
    finally:
        listener.close()
    assert "host 13" in out and "alive 0" in out and "after ok" in out, out
    assert "RESULT=done" in out, out
    assert refusals(handle) == [("network-outbound", f"{wt}/host.sock")], out


async def test_review2_a_stopped_connector_holds_binds_until_resumed(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # SIGSTOP to the connector, then an IP bind: it waits (killable) rather than being made by
    # the supervisor; after SIGCONT binds work again.
    body = FIND_CONNECTOR + (
        "os.kill(conn[0], signal.SIGSTOP)\n"
        'probe = \'import socket; socket.socket().bind(("127.0.0.1", 0)); print("BOUND")\'\n'
        "def run():\n"
        "    p = subprocess.run(['timeout', '-s', 'KILL', '2', 'python3', '-c', probe],\n"
        "                       capture_output=True, text=True)\n"
        "    return p.returncode, p.stdout.strip()\n"
        "print('stopped', run())\n"
        "os.kill(conn[0], signal.SIGCONT); time.sleep(0.2)\n"
        "print('resumed', run())\n"
    )
    _handle, out = await run_attack(sb, tmp_path, body)
    assert "stopped (-9, '')" in out and "resumed (0, 'BOUND')" in out, out


async def test_review2_creates_deep_below_hooks_names_are_not_pathologically_slow(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # A create whose path has /hooks/ in it walks up (at most 16 levels) looking for a git
    # directory: 300 creates at the bottom of a 200-deep chain of `hooks` directories, against
    # the same below plain names. The walk is bounded; no create is refused.
    body = (
        "import time\n"
        "def bench(name):\n"
        "    os.makedirs('s_' + name + '/' + '/'.join([name] * 200))\n"
        "    d = os.open('s_' + name + '/' + '/'.join([name] * 200), os.O_PATH | os.O_DIRECTORY)\n"
        "    t = time.perf_counter()\n"
        "    for i in range(300):\n"
        "        os.close(os.open(f'f{i}', os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=d))\n"
        "    return time.perf_counter() - t\n"
        "plain = min(bench('plain' + str(k)) for k in range(2))\n"
        "hooks = min(bench('hooks') if k == 0 else bench('modules') for k in range(2))\n"
        "print(f'per-create plain {plain / 300 * 1e6:.0f} us, hooks {hooks / 300 * 1e6:.0f} us')\n"
        "print('ratio', hooks / plain)\n"
    )
    handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=done" in out, out
    ratio = float(out.split("ratio ")[1].split()[0])
    # Measured on a 2-vCPU VM: ~650 us per create below the hooks chain, ~160 below the plain
    # one (4x; a shallow create is ~25-40 us): bounded, not quadratic.
    assert ratio < 10, out
    assert handle.violations == [], refusals(handle)


async def test_review2_ordinary_work_near_the_fixes_still_works(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # The control: git init and commit in /tmp (outside every bind); in a host repository of the
    # bind git commit, git gc, git worktree add /tmp/x (a commit there, then worktree remove);
    # a source tree with src/hooks/ and a config file written; cp -a and tar --xattrs of files
    # (the xattr calls answer EOPNOTSUPP, which both take); pip install of a wheel into a venv
    # in the worktree; npm install of a local package.
    wt = sb.worktree
    _git("init", "-q", "-b", "main", str(wt / "repoA"))
    (wt / "repoA" / "a.txt").write_text("a\n")
    _git("-C", str(wt / "repoA"), "add", "a.txt")
    _git("-C", str(wt / "repoA"), "commit", "-q", "-m", "one")
    config_before = (wt / "repoA" / ".git" / "config").read_bytes()
    wheel_file = wheel(
        tmp_path, "revtwo", "1.0", {"revtwo/__init__.py": "X = 1\n", "revtwo/hooks/__init__.py": ""}
    )
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "package.json").write_text('{"name": "revtwo", "version": "1.0.0"}\n')
    (tmp_path / "pkg" / "index.js").write_text("module.exports = 1;\n")
    src = tmp_path / "x"
    src.mkdir()
    (src / "f").write_text("f\n")
    os.setxattr(src / "f", "user.k", b"v")
    subprocess.run(["tar", "--xattrs", "-cf", str(tmp_path / "x.tar"), "-C", str(tmp_path), "x"],
                   check=True)  # fmt: skip
    g = "git -c user.name=t -c user.email=t@t"
    steps = {
        "tmp-repo": f"cd /tmp && {g} init -q r && cd r && echo x > x && {g} add x && "
        f"{g} commit -qm x",
        "commit": f"cd {wt}/repoA && echo b > b.txt && {g} add b.txt && {g} commit -qm two",
        "gc": f"cd {wt}/repoA && {g} gc -q",
        "worktree-add": f"cd {wt}/repoA && {g} worktree add -q /tmp/x -b feat && cd /tmp/x && "
        f"echo c > c.txt && {g} add c.txt && {g} commit -qm three",
        "worktree-remove": f"cd {wt}/repoA && {g} worktree remove /tmp/x",
        "hooks-src": f"mkdir -p {wt}/app/src/hooks && echo 'x' > {wt}/app/src/hooks/useX.ts && "
        f"echo 'k: v' > {wt}/app/config",
        "cp-a": f"cp -a {src} {wt}/s_cp",
        "tar-xattrs": f"mkdir {wt}/s_tar && tar --xattrs -xf {tmp_path}/x.tar -C {wt}/s_tar",
        "pip": f"python3 -m venv --system-site-packages --without-pip {wt}/venv && "
        f"{wt}/venv/bin/python -m pip install -q --no-index --no-deps {wheel_file} && "
        f"{wt}/venv/bin/python -c 'import revtwo.hooks'",
        "npm": f"mkdir {wt}/s_npm && cd {wt}/s_npm && echo '{{}}' > package.json && "
        f"HOME={wt}/s_npm npm install --offline --no-audit --no-fund --no-update-notifier -s "
        f"{tmp_path}/pkg",
    }
    script = steps_script(steps)
    handle = sb.launch(bindMounts=[
        {"hostPath": str(wt)}, {"hostPath": str(tmp_path / "pkg"), "readOnly": True},
        {"hostPath": str(tmp_path / "x.tar"), "readOnly": True},
        {"hostPath": str(wheel_file), "readOnly": True}, {"hostPath": str(src), "readOnly": True},
    ])  # fmt: skip
    result = await sb.sh(handle, script, timeout_s=120)
    out = output(result)
    for k in steps:
        assert f"{k}=ok" in out, out
    log = _git("-C", str(wt / "repoA"), "log", "--all", "--format=%s").stdout.split()
    assert sorted(log) == ["one", "three", "two"], log
    assert (wt / "repoA" / ".git" / "config").read_bytes() == config_before
    assert not (wt / "repoA" / ".git" / "worktrees" / "x").exists()
    assert (wt / "s_cp" / "f").read_text() == "f\n" and (wt / "s_tar" / "x" / "f").exists()
    assert (wt / "s_npm" / "node_modules" / "revtwo").exists(), out
    # (npm may still look for the registry: the egress proxy refuses that, not the write policy)
    assert [v for v in handle.violations if v.action.startswith("file-")] == [], refusals(handle)


async def test_review2_past_64_own_worktrees_a_commondir_stays_protected(sb: Sandboxes) -> None:
    # The sandbox's own worktree directories are tracked up to 64 (each held open); the 65th is
    # not its own, so its commondir is refused (fail closed), never let through untracked.
    wt = sb.worktree
    _git("init", "-q", str(wt / "repoA"))
    handle = sb.launch()
    result = await sb.sh(handle, (
        f"cd {wt}/repoA/.git && mkdir worktrees && for i in $(seq 1 65); do "
        "mkdir worktrees/o$i || echo MKDIR-FAILED; done; "
        "echo ../.. > worktrees/o1/commondir; echo first=$?; "
        "echo ../.. > worktrees/o65/commondir; echo last=$?"
    ))  # fmt: skip
    out = output(result)
    assert "first=0" in out and "last=0" not in out and "MKDIR-FAILED" not in out, out
    assert not (wt / "repoA" / ".git" / "worktrees" / "o65" / "commondir").exists(), out
    assert refusals(handle) == [
        ("file-write-create", f"{wt}/repoA/.git/worktrees/o65/commondir")
    ], out


# Ready to paste into tests/security/test_write_policy_review2.py, after its helpers (_git,
# _refusals, GIT_ENV; Sandboxes, output, run_attack from escape_kit). Add to its imports:
#     import asyncio, contextlib, fcntl, sys, termios, textwrap, time
# Each asserts the SAFE outcome; every one FAILS on main at f94658f / 0c606a1 (2026-12-02).


async def test_review2_escape_shape_broken_by_moving_refs_then_restored(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # Idea: gitdir_shaped looks for HEAD, objects/ and refs/ at the moment of the write. Move
    # refs/ (or objects/) away, the directory is no git directory: write its config and a hook,
    # move refs/ back. A --separate-git-dir store (the host's next `git status` in proj runs
    # core.fsmonitor) and a bare repository (objects/ moved; host `git push` runs its hooks).
    wt = sb.worktree
    pwned = tmp_path / "PWNED"
    (wt / "store").mkdir()
    _git("init", "-q", "--separate-git-dir", str(wt / "store" / "r.git"), str(wt / "proj"))
    _git("init", "-q", "--bare", str(wt / "bare.git"))
    cfg, bare_cfg = wt / "store" / "r.git" / "config", wt / "bare.git" / "config"
    before, bare_before = cfg.read_bytes(), bare_cfg.read_bytes()
    handle = sb.launch()
    result = await sb.sh(handle, (
        f"cd {wt}; mv store/r.git/refs store/r.git/s_refs; "
        f"printf '[core]\\n\\tfsmonitor = touch {pwned}\\n' >> store/r.git/config; echo cfg=$?; "
        "echo evil > store/r.git/hooks/pre-commit; echo hook=$?; "
        "mv store/r.git/s_refs store/r.git/refs; "
        "mv bare.git/objects bare.git/s_o; echo '[core] pager = evil' >> bare.git/config; "
        "echo bare_cfg=$?; echo evil > bare.git/hooks/post-receive; echo bare_hook=$?; "
        "mv bare.git/s_o bare.git/objects"
    ))  # fmt: skip
    out = output(result)
    subprocess.run(["git", "-C", str(wt / "proj"), "status"], env=GIT_ENV, capture_output=True)
    assert not pwned.exists(), f"host git status ran the sandbox's fsmonitor: {out}"
    assert [line for line in out.splitlines() if line.endswith("=0")] == [], out
    assert cfg.read_bytes() == before and bare_cfg.read_bytes() == bare_before, out
    assert not (wt / "store" / "r.git" / "hooks" / "pre-commit").exists(), out
    assert not (wt / "bare.git" / "hooks" / "post-receive").exists(), out
    assert len(refusals(handle)) >= 2, out


async def test_review2_escape_a_bind_root_git_dir_with_refs_moved_away(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # Idea: the same shape break at a bind whose root is a repository's .git (the main repository
    # of a linked worktree): no pattern applies there (the names are `config`, `hooks/x` below
    # the root) and the shape is gone while refs/ is away.
    other = tmp_path / "other"
    _git("init", "-q", str(other))
    gitdir = other / ".git"
    before = (gitdir / "config").read_bytes()
    handle = sb.launch(bindMounts=[{"hostPath": str(sb.worktree)}, {"hostPath": str(gitdir)}])
    result = await sb.sh(handle, (
        f"cd {gitdir} && mv refs s_r; echo '[core] fsmonitor = evil' >> config; echo cfg=$?; "
        "echo evil > hooks/pre-commit; echo hook=$?; mv s_r refs"
    ))  # fmt: skip
    out = output(result)
    assert "cfg=0" not in out and "hook=0" not in out, out
    assert (gitdir / "config").read_bytes() == before, out
    assert not (gitdir / "hooks" / "pre-commit").exists(), out
    assert (gitdir / "refs").is_dir(), out


async def test_review2_escape_a_gitdir_whose_objects_is_a_symlink(sb: Sandboxes) -> None:
    # Idea: git takes objects/ (and refs/) through a symlink (access(X_OK) follows; the `repo`
    # tool and shared object stores lay repositories out so); gitdir_shaped asks for a real
    # directory (AT_SYMLINK_NOFOLLOW), so such a repository's config is an ordinary file.
    wt = sb.worktree
    _git("init", "-q", "--bare", str(wt / "sym.git"))
    os.rename(wt / "sym.git" / "objects", wt / "objstore")
    (wt / "sym.git" / "objects").symlink_to("../objstore")
    _git("--git-dir", str(wt / "sym.git"), "rev-parse", "--git-dir")  # host git: a repository
    before = (wt / "sym.git" / "config").read_bytes()
    handle = sb.launch()
    result = await sb.sh(handle, (
        f"cd {wt}; echo '[core] pager = evil' >> sym.git/config; echo cfg=$?; "
        "echo evil > sym.git/hooks/post-receive; echo hook=$?"
    ))  # fmt: skip
    out = output(result)
    assert "cfg=0" not in out and "hook=0" not in out, out
    assert (wt / "sym.git" / "config").read_bytes() == before, out


async def test_review2_regression_chmod_and_tar_x_below_hooks_and_config_dirs(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # Ordinary work: an object-path check (existing_object -> path_refused(obj, "") ->
    # gitdir_refused with an empty name) refuses outright any path with /hooks/ in it or whose
    # last name is config, shaped or not: `chmod` of src/hooks/x.sh and of a config/ directory
    # (a Rails app) are refused, and `tar x` of such a project exits 2 (its directories' modes).
    wt = sb.worktree
    src = tmp_path / "src"
    (src / "proj" / "src" / "hooks").mkdir(parents=True)
    (src / "proj" / "src" / "hooks" / "useX.sh").write_text("x\n")
    (src / "proj" / "config").mkdir()
    (src / "proj" / "config" / "app.yml").write_text("x\n")
    subprocess.run(["tar", "cf", str(wt / "proj.tar"), "-C", str(src), "proj"], check=True)
    (wt / "app").mkdir()
    (wt / "app" / "config").mkdir()
    (wt / "app" / "src" / "hooks").mkdir(parents=True)
    (wt / "app" / "src" / "hooks" / "run.sh").write_text("x\n")
    handle = sb.launch()
    result = await sb.sh(handle, (
        f"cd {wt}; chmod 755 app/src/hooks/run.sh; echo chmod_hook=$?; "
        "chmod 700 app/config; echo chmod_config=$?; mkdir out; tar xf proj.tar -C out; echo tar=$?"
    ))  # fmt: skip
    out = output(result)
    assert "chmod_hook=0" in out and "chmod_config=0" in out and "tar=0" in out, out
    assert (wt / "app" / "src" / "hooks" / "run.sh").stat().st_mode & 0o777 == 0o755, out
    assert handle.violations == [], refusals(handle)


async def test_review2_regression_bind_onto_an_existing_name_is_eaddrinuse(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # Ordinary work: name_for_create answers EEXIST for every existing name, bind included; the
    # kernel says EADDRINUSE, which servers test for to remove a stale socket and bind again.
    body = (
        "import socket\ns = socket.socket(socket.AF_UNIX); s.bind('s_stale.sock'); s.close()\n"
        "try:\n    socket.socket(socket.AF_UNIX).bind('s_stale.sock')\n"
        "except OSError as e:\n    print('errno', e.errno)\n"
    )
    _handle, out = await run_attack(sb, tmp_path, body)
    assert "errno 98" in out, out


_TTY_CHILD = textwrap.dedent("""
    import asyncio, os, sys
    from cc_server.backends.probe import probe
    from cc_server.policy import HostFacts, detect_platform, parse_spec
    from cc_server.runtime.handle import run_collect
    from cc_server.runtime.port import SandboxManager

    async def main():
        wt = sys.argv[1]
        host = HostFacts(platform=detect_platform(), home=wt + "/home", realpath=os.path.realpath,
                         exists=os.path.lexists, is_dir=os.path.isdir)
        manager = SandboxManager(probe_result=probe(), host=host)
        try:
            handle = manager.launch(parse_spec({"sessionId": "tty", "workspaceId": "w",
                                                "bindMounts": [{"hostPath": wt}], "mode": "chat"}))
            result = await run_collect(handle, ["/bin/sh", "-c", sys.argv[2]], timeout_s=20)
            print("SANDBOX-DONE", result.stdout, result.stderr, flush=True)
        finally:
            await manager.aclose()

    asyncio.run(main())
""")


async def test_review2_escape_dev_tty_opened_by_the_supervisor_is_the_server_s_terminal(
    tmp_path: pathlib.Path,
) -> None:
    # Idea: /dev/tty means "the opener's controlling terminal". The task has none (bwrap
    # --new-session: ENXIO), but an open of /dev/tty for writing (or O_RDWR, `exec 3<>/dev/tty`)
    # is trapped and made by the supervisor, a thread of the server: it gets the SERVER's
    # terminal (a `cc-server serve` in a shell, any library user with a tty), and hands it to
    # the task, which can then write to it and read what the user types there (a password).
    # The CLI daemon has no terminal, so `cc-server run` shows ENXIO; the library does not.
    wt = tmp_path / "wt"
    (wt / "home").mkdir(parents=True)
    master, slave = os.openpty()
    script = (
        "echo SANDBOX-WROTE-TO-HOST-TTY > /dev/tty; "
        f'exec 3<>/dev/tty && read line <&3 && echo "got=$line" > {wt}/stolen'
    )
    child = subprocess.Popen(
        [sys.executable, "-c", _TTY_CHILD, str(wt), script],
        stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
    )  # fmt: skip
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 30
    os.set_blocking(master, False)
    while time.monotonic() < deadline and child.poll() is None:
        with contextlib.suppress(BlockingIOError):
            seen += os.read(master, 4096)
        if b"SANDBOX-WROTE" in seen and not (wt / "s_typed").exists():
            os.write(master, b"hunter2\n")  # the user types on the server's terminal
            (wt / "s_typed").touch()
        await asyncio.sleep(0.05)
    if child.poll() is None:
        os.write(master, b"\n")  # let a blocked read end
    out = child.communicate(timeout=20)[0].decode(errors="replace")
    os.close(master)
    stolen = (wt / "stolen").read_text() if (wt / "stolen").exists() else None
    # Reproduced: the marker is on the server's terminal and stolen == "got=hunter2\n".
    assert b"SANDBOX-WROTE-TO-HOST-TTY" not in seen and stolen is None, (seen, stolen, out)


async def test_review2_escape_a_host_worktree_pruned_on_purpose_then_made_again(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # Idea: the own-worktree exemption trusts that no host pointer names a directory the
    # sandbox makes (a stale pointer of a pruned worktree is a documented limit). The sandbox
    # can make one: a host worktree's `gitdir` file (and its index's mtime, utimensat is not
    # trapped) are not protected, so pointing gitdir nowhere makes the host's next
    # `git worktree prune` (or `git gc`, with the index dated 1970) remove the directory while
    # the worktree's .git pointer stays. Then the name is free: made again by the sandbox it
    # is "its own", its commondir leads to a git-shaped-but-HEAD-less directory with a config
    # (no HEAD: not protected), and the host's `git status` in the worktree runs its fsmonitor.
    wt = sb.worktree
    pwned = tmp_path / "PWNED"
    _git("init", "-q", "-b", "main", str(wt / "repoA"))
    (wt / "repoA" / "a").write_text("a\n")
    _git("-C", str(wt / "repoA"), "add", "a")
    _git("-C", str(wt / "repoA"), "commit", "-qm", "a")
    _git("-C", str(wt / "repoA"), "worktree", "add", "-q", str(wt / "wt2"), "-b", "feat")
    w = wt / "repoA" / ".git" / "worktrees" / "wt2"
    handle = sb.launch()
    await sb.sh(handle, (
        f"printf '/gone/.git\\n' > {w}/gitdir; touch -d @0 {w}/index {w}/gitdir; echo step1=$?"
    ))  # fmt: skip
    _git("-C", str(wt / "repoA"), "gc", "-q")  # the host's routine maintenance
    pruned = not w.exists()
    handle2 = sb.launch()
    result = await sb.sh(handle2, (
        f"cd {wt} && mkdir -p s_evil/objects s_evil/refs && "
        f"printf '[core]\\n\\trepositoryformatversion = 0\\n\\tfsmonitor = touch {pwned}\\n' "
        f"> s_evil/config; mkdir -p {w} && echo {wt}/s_evil > {w}/commondir && "
        f"echo 'ref: refs/heads/feat' > {w}/HEAD && echo {wt}/wt2/.git > {w}/gitdir; "
        "echo made=$?"
    ))  # fmt: skip
    out = output(result)
    subprocess.run(["git", "-C", str(wt / "wt2"), "status"], env=GIT_ENV, capture_output=True)
    # Reproduced: pruned=True and PWNED exists (the fsmonitor ran on the host).
    assert not pwned.exists(), f"pruned={pruned}: host git status ran the fsmonitor: {out}"
    assert not pruned, "the sandbox made the host's git gc prune a live worktree"


async def test_review2_regression_commit_in_a_separate_git_dir_repository(sb: Sandboxes) -> None:
    # Ordinary work: bare_head refuses every name HEAD outside a directory named .git, so in a
    # `git init --separate-git-dir` repository (yadm, vcsh, `git clone --separate-git-dir`)
    # `git commit` fails (append to <gitdir>/logs/HEAD refused) and so does `git checkout -b`
    # (the HEAD symref): EACCES, "fatal: cannot update the ref 'HEAD'".
    wt = sb.worktree
    (wt / "store").mkdir()
    _git("init", "-q", "-b", "main", "--separate-git-dir", str(wt / "store" / "r.git"),
         str(wt / "proj"))  # fmt: skip
    (wt / "proj" / "a").write_text("a\n")
    _git("-C", str(wt / "proj"), "add", "a")
    _git("-C", str(wt / "proj"), "commit", "-qm", "a")
    handle = sb.launch()
    g = "git -c user.name=t -c user.email=t@t"
    result = await sb.sh(handle, (
        f"cd {wt}/proj && {g} commit -q --allow-empty -m b; echo ci=$?; "
        f"{g} checkout -q -b feat; echo co=$?"
    ))  # fmt: skip
    out = output(result)
    assert "ci=0" in out and "co=0" in out, out
    assert handle.violations == [], refusals(handle)


async def test_review2_escape_a_task_s_own_landlock_domain_is_ignored_by_the_supervisor(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # Idea: a program in the sandbox confines itself with Landlock (Codex's linux-sandbox does,
    # with seccomp; any agent runner may): no file written or made anywhere. Its trapped opens
    # (O_CREAT, O_WRONLY) are made by the supervisor, which is not in that Landlock domain, so
    # the file is created and an existing one written, where the kernel would answer EACCES.
    # Either the supervisor refuses a task with a Landlock domain (trap landlock_restrict_self
    # and remember it, children included) or the filter answers landlock_create_ruleset with
    # ENOSYS / EOPNOTSUPP so the program knows Landlock is not there and fails closed itself.
    wt = sb.worktree
    body = (
        "import struct\n"
        "attr = struct.pack('<Q', (1 << 1) | (1 << 8))\n"  # WRITE_FILE | MAKE_REG
        "rs = libc.syscall(444, attr, len(attr), 0)\n"
        "if rs >= 0:\n"
        "    libc.prctl(38, 1, 0, 0, 0)\n"  # PR_SET_NO_NEW_PRIVS
        "    if libc.syscall(446, rs, 0): fail()\n"
        "    print('landlocked')\n"
        "    r = {}\n"
        "    for name, f in (('create', lambda: os.open('s_made', os.O_CREAT | os.O_WRONLY)),\n"
        "                    ('write', lambda: os.open('README', os.O_WRONLY | os.O_APPEND))):\n"
        "        try:\n            f(); r[name] = 'DONE'\n"
        "        except OSError as e:\n            r[name] = e.errno\n"
        "    print('r', sorted(r.items()))\n"
        "else:\n"
        "    print('no landlock in the sandbox')\n"
    )
    _handle, out = await run_attack(sb, tmp_path, body)
    assert "no landlock in the sandbox" in out or "r [('create', 13), ('write', 13)]" in out, out
    assert not (wt / "s_made").exists(), out


async def test_review2_escape_a_task_s_own_landlock_network_rules_are_ignored_by_the_connector(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # Idea: the same for Landlock's network rules (ABI 4: BIND_TCP, CONNECT_TCP, no port
    # allowed): the connector binds and connects for the task, outside its domain, and the
    # supervisor starts a non-blocking connect itself (EINPROGRESS, not EACCES).
    body = (
        "import socket, struct\n"
        "srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen()\n"
        "port = srv.getsockname()[1]\n"
        "attr = struct.pack('<QQQ', 0, (1 << 1) | (1 << 0), 0)\n"
        "rs = libc.syscall(444, attr, len(attr), 0)\n"
        "if rs >= 0:\n"
        "    libc.prctl(38, 1, 0, 0, 0)\n"
        "    if libc.syscall(446, rs, 0): fail()\n"
        "    nb = socket.socket(); nb.setblocking(False)\n"
        "    r = {}\n"
        "    for name, f in (('connect', lambda: socket.socket().connect(('127.0.0.1', port))),\n"
        "                    ('bind', lambda: socket.socket().bind(('127.0.0.1', 0))),\n"
        "                    ('nonblocking', lambda: nb.connect(('127.0.0.1', port)))):\n"
        "        try:\n            f(); r[name] = 'DONE'\n"
        "        except OSError as e:\n            r[name] = e.errno\n"
        "    print('r', sorted(r.items()))\n"
        "else:\n"
        "    print('no landlock in the sandbox')\n"
    )
    _handle, out = await run_attack(sb, tmp_path, body)
    assert (
        "no landlock in the sandbox" in out
        or "r [('bind', 13), ('connect', 13), ('nonblocking', 13)]" in out
    ), out
