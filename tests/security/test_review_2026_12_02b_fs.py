"""Attacks on a session sandbox's plan given again (backends/session_plan.py, host_reads.py) and on
the supervisor's judgement of a path of plain names as its start directory's path joined with it
(supervisor_rules.c lexically_clear). Between two commands of one session the host changes in a
way a cheap check could miss; the next command must get what a fresh plan gives. Real bubblewrap;
each case checks the host (or the sandbox's mount table, read on the host) afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import secrets
import subprocess
from collections.abc import Iterator

import pytest
from escape_kit import Sandboxes, attempts, outcomes, output, run_attack, unique
from other_user import HOST_PYTHON, OtherUser
from test_session_plan_reuse import MOUNT, UMOUNT, _bind_home, _sandbox_mounts, _twice
from write_kit import refusals

from cc_server.errors import CcServerError
from cc_server.rundir import BASE_DIR_NAME, REGISTRY_NAME

pytestmark = [pytest.mark.security, pytest.mark.integration]


# --- the plan given again -------------------------------------------------------------------


async def test_a_secret_made_below_an_ancestor_that_was_missing_is_masked_next(
    sb: Sandboxes,
) -> None:
    """~/.config is missing when the plan is made (hold asks only about ~/.config for the dozen
    secrets below it); the host then makes ~/.config/gh/hosts.yml in one go."""
    assert not (sb.home / ".config").exists()
    handle = sb.launch(bindMounts=_bind_home(sb))
    await _twice(sb, handle, "true")
    marker = unique("CC-SECRET-GH")
    (sb.home / ".config" / "gh").mkdir(parents=True)
    (sb.home / ".config" / "gh" / "hosts.yml").write_text(f"oauth_token: {marker}\n")
    result = await sb.sh(handle, f"cat {sb.home}/.config/gh/hosts.yml; echo ran")
    assert marker not in output(result) and b"ran" in result.stdout, output(result)
    assert _sandbox_mounts(handle).get(str(sb.home / ".config" / "gh")) == "tmpfs"


async def test_a_missing_ancestor_that_becomes_a_symlink_masks_where_it_leads(
    sb: Sandboxes,
) -> None:
    """~/.config appears as a symlink to a directory that already holds gh/hosts.yml: the
    missing ancestor exists now (as a link), so the plan is made again and masks the target."""
    stash = sb.worktree / "stash"
    (stash / "gh").mkdir(parents=True)
    marker = unique("CC-SECRET-GH-LINK")
    (stash / "gh" / "hosts.yml").write_text(f"oauth_token: {marker}\n")
    handle = sb.launch(bindMounts=_bind_home(sb))
    first = await _twice(sb, handle, f"cat {stash}/gh/hosts.yml")
    assert marker.encode() in first.stdout, output(first)  # control: not a secret yet
    (sb.home / ".config").symlink_to(stash)
    result = await sb.sh(handle, attempts(
        by_target=f"grep -q {marker} {stash}/gh/hosts.yml",
        by_name=f"grep -q {marker} {sb.home}/.config/gh/hosts.yml",
    ))  # fmt: skip
    assert outcomes(result) == {"by_target": "fail", "by_name": "fail"}, output(result)


async def test_a_dangling_secret_link_that_gets_its_target_masks_it_next(sb: Sandboxes) -> None:
    """~/.netrc is a dangling symlink when planned (nothing to mask); its target is then made
    with the same lstat answers for the link itself."""
    target = sb.worktree / "netrc-target"
    (sb.home / ".netrc").symlink_to(target)
    handle = sb.launch(bindMounts=_bind_home(sb))
    await _twice(sb, handle, "true")
    marker = unique("CC-SECRET-NETRC-LATE")
    target.write_text(f"machine example.com password {marker}\n")
    result = await sb.sh(handle, f"cat {target}; cat {sb.home}/.netrc; echo ran")
    assert marker not in output(result) and b"ran" in result.stdout, output(result)


async def test_a_protected_path_that_appears_as_a_symlink_protects_its_target(
    sb: Sandboxes,
) -> None:
    real = sb.worktree / "real-ledger"
    real.mkdir()
    (real / "entry").write_text("original\n")
    ledger = sb.worktree / "ledger"
    handle = sb.launch(protectedPaths=[str(ledger)])
    first = await _twice(sb, handle, f"echo first > {real}/entry")
    assert first.exit_code == 0, output(first)  # control: writable while not protected
    (real / "entry").write_text("original\n")
    ledger.symlink_to(real)
    result = await sb.sh(handle, attempts(
        by_target=f"echo changed > {real}/entry",
        by_name=f"echo changed > {ledger}/entry",
        new=f"echo new > {real}/new",
    ))  # fmt: skip
    assert outcomes(result) == {"by_target": "fail", "by_name": "fail", "new": "fail"}, output(
        result
    )
    assert (real / "entry").read_text() == "original\n" and not (real / "new").exists()


async def test_a_protected_path_swapped_for_another_inode_in_one_tick_stays_protected(
    sb: Sandboxes,
) -> None:
    """The protected directory is renamed away and another put in its place with the same mode
    and owner and the parent's mtime put back: only its inode says it changed."""
    ledger = sb.worktree / "ledger"
    ledger.mkdir()
    (ledger / "entry").write_text("original\n")
    handle = sb.launch(protectedPaths=[str(ledger)])
    await _twice(sb, handle, "true")
    parent = os.stat(sb.worktree)
    fresh = sb.worktree / "fresh"
    fresh.mkdir()
    (fresh / "entry").write_text("original\n")
    os.rename(ledger, sb.worktree / "old-ledger")
    os.rename(fresh, ledger)
    os.utime(sb.worktree, ns=(parent.st_atime_ns, parent.st_mtime_ns))
    result = await sb.sh(
        handle, attempts(write=f"echo changed > {ledger}/entry", new=f"echo new > {ledger}/new")
    )
    assert outcomes(result) == {"write": "fail", "new": "fail"}, output(result)
    assert (ledger / "entry").read_text() == "original\n" and not (ledger / "new").exists()


@contextlib.contextmanager
def _registry_entry(content: str) -> Iterator[pathlib.Path]:
    """An entry in this user's base directory registry naming `content`, removed afterwards."""
    canonical = pathlib.Path(f"/tmp/{BASE_DIR_NAME}-{os.geteuid()}")
    registry = canonical / REGISTRY_NAME
    for d in (canonical, registry):
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o700)
    entry = registry / f"rfs{secrets.token_hex(6)}"
    entry.write_text(content)
    try:
        yield entry
    finally:
        entry.unlink(missing_ok=True)


async def test_a_registry_entry_rewritten_in_place_with_its_size_and_mtime_hides_the_new_base(
    sb: Sandboxes,
) -> None:
    """A base directory named in the registry is hidden; the entry is then rewritten in place to
    name another base of the same length, its size, inode and mtime kept: the next command must
    not see into the new one."""
    canaries = {}
    for side in ("a", "b"):
        base = sb.worktree / side / f"{BASE_DIR_NAME}-{os.geteuid()}"
        base.mkdir(parents=True, mode=0o700)
        canaries[side] = unique(f"CC-BASE-{side}")
        (base / "token").write_text(canaries[side])
    a, b = (str(sb.worktree / s / f"{BASE_DIR_NAME}-{os.geteuid()}") for s in ("a", "b"))
    assert len(a) == len(b)
    with _registry_entry(a) as entry:
        handle = sb.launch()
        first = await _twice(sb, handle, f"cat {a}/token; cat {b}/token")
        assert canaries["a"] not in output(first), output(first)
        assert canaries["b"] in output(first), output(first)  # control: b is no base yet
        before = os.stat(entry)
        fd = os.open(entry, os.O_WRONLY)
        try:
            os.pwrite(fd, b.encode(), 0)
        finally:
            os.close(fd)
        os.utime(entry, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = os.stat(entry)
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
            before.st_ino,
            before.st_size,
            before.st_mtime_ns,
        )
        second = await sb.sh(handle, f"cat {b}/token; echo ran")
        assert canaries["b"] not in output(second), output(second)
        assert b"ran" in second.stdout, output(second)


async def test_a_registry_entry_added_in_the_same_tick_hides_its_base(sb: Sandboxes) -> None:
    """A new registry entry, the registry directory's mtime put back: its listing differs."""
    base = sb.worktree / "late" / f"{BASE_DIR_NAME}-{os.geteuid()}"
    base.mkdir(parents=True, mode=0o700)
    canary = unique("CC-BASE-LATE")
    (base / "token").write_text(canary)
    with _registry_entry("/nonexistent/placeholder") as placeholder:
        registry = placeholder.parent
        handle = sb.launch()
        first = await _twice(sb, handle, f"cat {base}/token")
        assert canary in output(first), output(first)  # control
        was = os.stat(registry)
        with _registry_entry(str(base)):
            os.utime(registry, ns=(was.st_atime_ns, was.st_mtime_ns))
            second = await sb.sh(handle, f"cat {base}/token; echo ran")
        assert canary not in output(second) and b"ran" in second.stdout, output(second)


async def test_a_bind_source_replaced_by_a_symlink_from_a_second_sandbox_exposes_nothing(
    sb: Sandboxes,
) -> None:
    """Session A binds p/side; session B binds p and, between two of A's commands, moves side
    away and puts a symlink to $HOME in its place. A's next command must not see $HOME's
    secrets through its bind (refused, or the old directory: anything but the host's $HOME)."""
    p = sb.root / "p"
    side = p / "side"
    side.mkdir(parents=True)
    (side / "mine").write_text("side file\n")
    a = sb.launch(bindMounts=[{"hostPath": str(side)}], guestWorkdir=str(side))
    b = sb.launch(bindMounts=[{"hostPath": str(p)}], guestWorkdir=str(p))
    first = await _twice(sb, a, f"cat {side}/mine")
    assert first.stdout == b"side file\n", output(first)
    swap = await sb.sh(b, f"mv {side} {p}/side.old && ln -s {sb.home} {side} && echo swapped")
    assert swap.stdout == b"swapped\n", output(swap)
    assert side.is_symlink()
    try:
        second = await sb.sh(a, f"cat {side}/.ssh/id_ed25519 {side}/.aws/credentials; ls -a {side}")
    except CcServerError:
        return  # refused before it ran: nothing exposed
    assert sb.secret_marker not in output(second), output(second)


# --- a path of plain names judged as the start's path joined with it ------------------------


async def test_a_cwd_moved_out_of_the_bind_by_a_second_sandbox_makes_no_protected_file(
    sb: Sandboxes,
) -> None:
    """Session A binds p/w and works in p/w/x; session B binds p and moves x out to p/x while
    A's command waits there. A's cwd is then outside every root of A's policy (its path, read
    from the fd, is the host's), yet still writable through A's mount: a plain-name create of a
    protected name there must not land on the host."""
    p = sb.root / "p"
    w = p / "w"
    (w / "x" / "sub").mkdir(parents=True)
    a = sb.launch(bindMounts=[{"hostPath": str(w)}], guestWorkdir=str(w))
    b = sb.launch(bindMounts=[{"hostPath": str(p)}], guestWorkdir=str(p))
    go = w / "go"
    script = (
        f"cd {w}/x && i=0; while [ ! -e {go} ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done; "
        + attempts(
            bare="echo evil > .mcp.json",
            plain="echo evil > sub/.mcp.json",
            rc="echo evil > sub/.bashrc",
            claude="mkdir -p sub/.claude 2>/dev/null; echo evil > sub/.claude/settings.json",
        )
    )
    waiting = asyncio.ensure_future(sb.sh(a, script))
    await asyncio.sleep(0.5)
    moved = await sb.sh(b, f"mv {w}/x {p}/x && touch {go} && echo moved")
    assert moved.stdout == b"moved\n", output(moved)
    result = await waiting
    made = [str(path.relative_to(p)) for path in (
        p / "x" / ".mcp.json", p / "x" / "sub" / ".mcp.json", p / "x" / "sub" / ".bashrc",
        p / "x" / "sub" / ".claude" / "settings.json",
    ) if path.exists()]  # fmt: skip
    assert made == [], (made, output(result), refusals(a))


# Run as the unprivileged user: sessions A (binds ROOT/p/side) and B (binds ROOT/p) of one
# manager; B swaps A's bind source for a symlink to the fake $HOME between two of A's commands.
SWAP_AS_USER = """
import asyncio, os, sys
from cc_server.backends.probe import probe
from cc_server.policy import HostFacts, detect_platform, parse_spec
from cc_server.runtime.handle import run_collect
from cc_server.runtime.port import SandboxManager

root = sys.argv[1]
home, p = os.path.join(root, "home"), os.path.join(root, "p")
side = os.path.join(p, "side")
host = HostFacts(platform=detect_platform(), home=home, realpath=os.path.realpath,
                 exists=os.path.lexists, is_dir=os.path.isdir)

def spec(sid, bind):
    return parse_spec({"sessionId": sid, "workspaceId": "w", "mode": "chat",
                       "bindMounts": [{"hostPath": bind}], "guestWorkdir": bind})

async def main():
    manager = SandboxManager(probe_result=probe(), host=host)
    try:
        a, b = manager.launch(spec("rfs-a", side)), manager.launch(spec("rfs-b", p))
        for _ in range(2):
            print("first", (await run_collect(a, ["cat", side + "/mine"])).stdout)
        swap = await run_collect(
            b, ["/bin/sh", "-c", f"mv {side} {p}/side.old && ln -s {home} {side}"])
        print("swap", swap.exit_code, os.path.islink(side))
        try:
            got = await run_collect(a, ["/bin/sh", "-c", f"cat {side}/.ssh/id_ed25519"])
            print("second", got.stdout + got.stderr)
        except Exception as exc:
            print("refused", type(exc).__name__, exc)
    finally:
        await manager.aclose()

asyncio.run(main())
"""


def test_as_an_unprivileged_user_a_bind_source_swapped_for_a_symlink_exposes_nothing(
    other_user: OtherUser, user_dir: pathlib.Path
) -> None:
    marker = unique("CC-SECRET-USER-SSH")
    (user_dir / "home" / ".ssh").mkdir(parents=True)
    (user_dir / "home" / ".ssh" / "id_ed25519").write_text(f"{marker}\n")
    (user_dir / "p" / "side").mkdir(parents=True)
    (user_dir / "p" / "side" / "mine").write_text("side file\n")
    (user_dir / "driver.py").write_text(SWAP_AS_USER)
    subprocess.run(["chown", "-R", f"{other_user.uid}:{other_user.gid}", str(user_dir)], check=True)
    done = other_user.run(
        [HOST_PYTHON, str(user_dir / "driver.py"), str(user_dir)], cwd=user_dir, timeout_s=120
    )
    assert "first b'side file\\n'" in done.stdout, (done.stdout, done.stderr)
    assert "swap 0 True" in done.stdout, (done.stdout, done.stderr)  # the swap was made
    assert marker not in done.stdout + done.stderr, (done.stdout, done.stderr)


# A thread moves the start directory's ancestors back and forth (allowed: no protected name on
# either side) and tries to move it into a .claude directory the host made, while the main
# thread creates protected names below the cwd by plain paths: every create is refused, and
# nothing protected lands anywhere.
RACE_BODY = """
import threading
os.makedirs('r1/mid/cwd/sub')
os.chdir('r1/mid/cwd')
stop = False
moves = 0
def mover():
    global moves
    names = ['r1', 'r2']
    i = 0
    while not stop:
        try:
            os.rename(f'{WT}/{names[i % 2]}', f'{WT}/{names[(i + 1) % 2]}')
            i += 1
            moves = i
        except OSError:
            pass
        try:
            os.rename(f'{WT}/{names[i % 2]}/mid', f'{WT}/host/.claude/mid')
        except OSError:
            pass
t = threading.Thread(target=mover)
t.start()
made = 0
for n in range(300):
    for rel in ('.mcp.json', 'sub/.mcp.json', 'sub/.bash_aliases', 'sub/.claude.json'):
        try:
            os.close(os.open(rel, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            made += 1
        except OSError:
            pass
stop = True
t.join()
print('MADE', made, 'MOVED', moves > 0)
"""


async def test_renames_of_the_cwds_ancestors_by_another_thread_make_no_protected_file(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    wt = sb.worktree
    (wt / "host" / ".claude").mkdir(parents=True)
    _, out = await run_attack(sb, tmp_path, f"WT = {str(wt)!r}\n" + RACE_BODY)
    assert "RESULT=done" in out and "MADE 0 MOVED True" in out, out
    protected = {".mcp.json", ".bash_aliases", ".claude.json"}
    found = [os.path.join(d, f) for d, _, files in os.walk(wt) for f in files if f in protected]
    assert found == [] and sorted(os.listdir(wt / "host" / ".claude")) == [], (found, out)


# Start directories whose names are odd in a /proc/self/fd link (a newline, a " (deleted)"
# suffix, bytes that are not UTF-8, a space) or whose path is longer than PATH_MAX: a protected
# name made from them by a plain path is refused, as from any other directory.
ODD_BODY = """
made = []
for d in ODD:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    for rel in (b'.mcp.json', b'sub/.mcp.json'):
        try:
            os.close(os.open(rel, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644, dir_fd=fd))
            made.append(d + b'/' + rel)
        except OSError:
            pass
os.chdir('deep')
for _ in range(DEPTH):
    os.chdir('d' * 200)
for rel in ('.mcp.json', 'sub/.mcp.json', 'sub/.claude.json'):
    try:
        os.close(os.open(rel, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        made.append(rel.encode())
    except OSError:
        pass
print('MADE', made)
"""
ODD: tuple[bytes, ...] = (b"new\nline", b"x (deleted)", b"\xff\xfe", b"sp ace")
DEPTH = 22  # 22 names of 200 bytes: the start's path is longer than PATH_MAX


async def test_odd_and_overlong_start_paths_make_no_protected_file(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    wt = sb.worktree
    for d in ODD:
        os.makedirs(os.path.join(os.fsencode(wt), d, b"sub"))
    fd = os.open(wt, os.O_RDONLY | os.O_DIRECTORY)
    for name in ("deep", *["d" * 200] * DEPTH):
        os.mkdir(name, dir_fd=fd)
        fd, old = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
        os.close(old)
    os.mkdir("sub", dir_fd=fd)
    os.close(fd)
    body = f"ODD = {ODD!r}\nDEPTH = {DEPTH}\n" + ODD_BODY
    _, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=done" in out and "MADE []" in out, out
    found = [
        os.path.join(d, f)
        for d, _, files in os.walk(os.fsencode(wt))
        for f in files
        if f in {b".mcp.json", b".claude.json"}
    ]
    fd = os.open(wt, os.O_RDONLY | os.O_DIRECTORY)
    for name in ("deep", *["d" * 200] * DEPTH):  # below PATH_MAX, where os.walk cannot go
        fd, old = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
        os.close(old)
    deep = {
        *os.listdir(fd),
        *(f"sub/{n}" for n in os.listdir(os.open("sub", os.O_RDONLY, dir_fd=fd))),
    }
    os.close(fd)
    assert found == [] and deep == {"sub"}, (found, deep, out)


async def test_a_mount_the_host_makes_over_a_masked_secret_is_not_seen_next(
    sb: Sandboxes,
) -> None:
    """The host bind-mounts a directory holding credentials over the masked ~/.aws between two
    commands (the new mount propagates into the running sandbox's view of the bound $HOME); the
    next command must not read them."""
    assert os.geteuid() == 0, "this test mounts on the host: run the security suite as root"
    stash = sb.root / "stash"
    stash.mkdir()
    marker = unique("CC-SECRET-AWS-MOUNT")
    (stash / "credentials").write_text(f"aws_secret_access_key = {marker}\n")
    handle = sb.launch(bindMounts=_bind_home(sb))
    first = await _twice(sb, handle, f"cat {sb.home}/.aws/credentials; echo ran")
    assert sb.secret_marker not in output(first) and b"ran" in first.stdout, output(first)
    aws = sb.home / ".aws"
    subprocess.run([MOUNT, "--bind", str(stash), str(aws)], check=True)
    try:
        second = await sb.sh(handle, f"cat {aws}/credentials; ls -a {aws}; echo ran")
        assert marker not in output(second) and b"ran" in second.stdout, output(second)
    finally:
        subprocess.run([UMOUNT, "-l", str(aws)], check=True)


# Run as the unprivileged user: session A binds ROOT/p/w, session B binds ROOT/p. A binds a
# datagram socket in the shared directory; B sends it a descriptor of its own bind root P with
# sendmsg to that address (datagrams sent with an address are not judged). A makes protected
# names below that descriptor: they would land in B's writable root, where B's policy refuses
# each of them.
FD_PASS_AS_USER = """
import asyncio, os, sys
from cc_server.backends.probe import probe
from cc_server.policy import HostFacts, detect_platform, parse_spec
from cc_server.runtime.handle import run_collect
from cc_server.runtime.port import SandboxManager

RECV = '''
import array, os, socket, sys
w = sys.argv[1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(w + "/s.sock")
open(w + "/ready", "w").close()
s.settimeout(20)
_, anc, _, _ = s.recvmsg(16, socket.CMSG_SPACE(4))
fds = array.array("i")
fds.frombytes(anc[0][2][:4])
os.fchdir(fds[0])
for rel in (".mcp.json", ".claude.json", "sub/.mcp.json"):
    try:
        os.close(os.open(rel, os.O_CREAT | os.O_WRONLY, 0o644))
    except OSError as exc:
        print("refused", rel, exc)
try:
    os.makedirs("nested/.git/hooks")
    with open("nested/.git/hooks/pre-commit", "w") as f:
        f.write("#!/bin/sh\\\\n")
except OSError as exc:
    print("refused hook", exc)
'''
SEND = '''
import os, socket, sys, time
p, w = sys.argv[1], sys.argv[2]
for _ in range(400):
    if os.path.exists(w + "/ready"):
        break
    time.sleep(0.05)
fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd.to_bytes(4, sys.byteorder))]
s.sendmsg([b"x"], rights, 0, w + "/s.sock")
print("sent")
'''

root = sys.argv[1]
home, p = os.path.join(root, "home"), os.path.join(root, "p")
w = os.path.join(p, "w")
with open(os.path.join(w, "recv.py"), "w") as f:
    f.write(RECV)
with open(os.path.join(w, "send.py"), "w") as f:
    f.write(SEND)
host = HostFacts(platform=detect_platform(), home=home, realpath=os.path.realpath,
                 exists=os.path.lexists, is_dir=os.path.isdir)

def spec(sid, bind):
    return parse_spec({"sessionId": sid, "workspaceId": "w", "mode": "chat",
                       "bindMounts": [{"hostPath": bind}]})

async def main():
    manager = SandboxManager(probe_result=probe(), host=host)
    try:
        a, b = manager.launch(spec("rfs-fa", w)), manager.launch(spec("rfs-fb", p))
        got, sent = await asyncio.gather(
            run_collect(a, ["python3", w + "/recv.py", w], timeout_s=30),
            run_collect(b, ["python3", w + "/send.py", p, w], timeout_s=30))
        print("A", got.stdout + got.stderr)
        print("B", sent.stdout + sent.stderr)
        print("violations", [(v.action, v.target) for v in a.violations])
    finally:
        await manager.aclose()

asyncio.run(main())
"""


def test_as_an_unprivileged_user_a_directory_passed_from_another_sandbox_gets_no_protected_file(
    other_user: OtherUser, user_dir: pathlib.Path
) -> None:
    p = user_dir / "p"
    (p / "w").mkdir(parents=True)
    (p / "sub").mkdir()
    (user_dir / "home").mkdir()
    (user_dir / "driver.py").write_text(FD_PASS_AS_USER)
    subprocess.run(["chown", "-R", f"{other_user.uid}:{other_user.gid}", str(user_dir)], check=True)
    done = other_user.run(
        [HOST_PYTHON, str(user_dir / "driver.py"), str(user_dir)], cwd=user_dir, timeout_s=120
    )
    assert "B b'sent\\n'" in done.stdout, (done.stdout, done.stderr)  # the descriptor went
    made = [
        rel
        for rel in (".mcp.json", ".claude.json", "sub/.mcp.json", "nested/.git/hooks/pre-commit")
        if (p / rel).exists()
    ]
    assert made == [], (made, done.stdout, done.stderr)


async def test_a_deep_protected_file_cannot_be_reached_by_a_plain_name_linked_to_it(
    sb: Sandboxes,
) -> None:
    """An existing .mcp.json deep in the worktree: a hard link to it under an innocent name
    (which the plain-name judgement would clear) is refused in every form, and nothing
    writes it."""
    deep = sb.worktree / "a" / "b"
    deep.mkdir(parents=True)
    (deep / ".mcp.json").write_text("original\n")
    handle = sb.launch()
    result = await sb.sh(handle, f"cd {sb.worktree}; " + attempts(
        ln="ln a/b/.mcp.json innocent",
        cp="cp --link a/b/.mcp.json innocent2",
        py="python3 -c \"import os; os.link('a/b/.mcp.json', 'a/innocent3')\"",
        write="echo evil >> a/b/.mcp.json",
    ))  # fmt: skip
    assert outcomes(result) == {"ln": "fail", "cp": "fail", "py": "fail", "write": "fail"}, output(
        result
    )
    assert (deep / ".mcp.json").read_text() == "original\n"
    assert os.stat(deep / ".mcp.json").st_nlink == 1
