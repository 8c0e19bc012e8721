"""A hostile agent against the host identity of a root server's sandboxes (cc-identity).

Each test is one attack, made from inside a sandbox (or from one command of a session against the
next one's launch), and judged on the host afterwards. An attack that works today is kept as a
fixed with the change that refuses it; every attack here is refused now, and each test is its
regression test (a strict xfail would count as a skip under CC_SERVER_NO_SKIP).

Run as root (as CI does): most of what is tested here exists only under a sandbox identity, and
every test that needs it says so.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import stat
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator

import pytest
from escape_kit import (
    Sandboxes,
    attempts,
    host_pids_with,
    outcomes,
    output,
    the_one_pid_with,
    unique,
    wait_until,
)

from cc_server.backends.identity import SANDBOX_GID, SANDBOX_UID, is_sandbox_uid
from cc_server.backends.plan import Command
from cc_server.errors import CcServerError
from cc_server.policy import STANDARD_DENY_CREATE_GLOBS, parse_spec
from cc_server.runtime.handle import CollectedResult, SandboxHandle, run_collect

pytestmark = [pytest.mark.security, pytest.mark.integration]

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="a sandbox identity exists only for a root server")
PYTHON = "/usr/bin/python3"
FOREIGN = (4242, 4343)  # an owner that is neither the suite nor the sandbox identity
RUN_TIMEOUT_S = 60.0


def _pyc(code: str) -> str:
    """`code` (one line, no single quote) as a `python3 -c` shell word, for `attempts()`."""
    assert "'" not in code
    return f"{PYTHON} -c '{code}'"


def _py(code: str) -> str:
    """`code` as a shell command running the sandbox's python3 (quoted for sh -c)."""
    body = textwrap.dedent(code).strip()
    return PYTHON + " - <<'PY'\n" + body + "\nPY\n"


async def _sh(sb: Sandboxes, handle: SandboxHandle, script: str) -> CollectedResult:
    return await sb.sh(handle, script, timeout_s=RUN_TIMEOUT_S)


def _rules(sb: Sandboxes, **fields: object) -> SandboxHandle:
    """A session sandbox with the standard create-time globs: the supervisor answers opens."""
    assert sb.manager.probe_result.create_rules, sb.manager.probe_result.create_rules_hint
    spec = parse_spec(sb.spec(**fields))
    return sb.manager.launch(spec, deny_create_globs=STANDARD_DENY_CREATE_GLOBS)


def _owned(path: pathlib.Path, owner: tuple[int, int], mode: int) -> pathlib.Path:
    os.chown(path, *owner)
    os.chmod(path, mode)
    return path


def _host_sysctls() -> dict[str, bytes]:
    paths = (
        "/proc/sys/kernel/core_pattern",
        "/proc/sys/kernel/modprobe",
        "/proc/sys/net/ipv4/ip_forward",
        "/proc/sys/vm/overcommit_memory",
    )
    return {p: pathlib.Path(p).read_bytes() for p in paths if os.path.exists(p)}


# --- the create-rule supervisor opens on the task's behalf ---------------------------------------


async def test_o_creat_through_the_supervisor_changes_no_host_knob(sb: Sandboxes) -> None:
    # The workers run as the sandbox identity but own the sandbox's user namespace (bwrap made it
    # as that uid), so the kernel grants them every capability there. /proc/sys is bound from the
    # host's procfs read-only: no O_CREAT spelling may open it for writing, nor lower PID 1's OOM
    # score or rewrite an id map.
    before = _host_sysctls()
    knobs = [*before, "/proc/sysrq-trigger", "/proc/self/root/proc/sys/kernel/core_pattern",
             "/proc/1/root/proc/sys/kernel/core_pattern", "/proc/thread-self/root/proc/sys/vm/"
             "overcommit_memory", "/proc/sys/net/ipv4/conf/lo/forwarding",
             "/proc/1/oom_score_adj", "/proc/1/uid_map", "/proc/1/gid_map", "/proc/1/setgroups",
             "/proc/1/loginuid", "/proc/1/timens_offsets", "/proc/mtrr"]  # fmt: skip
    payload = {"/proc/1/oom_score_adj": "-1000", "/proc/1/uid_map": "0 0 4294967295",
               "/proc/1/gid_map": "0 0 4294967295", "/proc/1/setgroups": "allow",
               "/proc/1/loginuid": "0", "/proc/1/timens_offsets": "monotonic 1000 0"}  # fmt: skip
    handle = _rules(sb)
    script = _py(
        f"""
        import os
        for p in {knobs!r}:
            data = {payload!r}.get(p, '1').encode()
            try:
                fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
            except OSError:
                continue
            try:
                print('WROTE', p, os.write(fd, data))
            except OSError:
                pass
        print('done')
        """
    )
    result = await _sh(sb, handle, script)
    out = output(result)
    assert result.stdout.decode().splitlines()[-1:] == ["done"], out
    assert "WROTE" not in out, out
    assert _host_sysctls() == before


async def test_a_command_cannot_open_the_launchers_memory_through_o_creat(
    sb: Sandboxes,
) -> None:
    # The supervisor's workers own the sandbox's user namespace, so the kernel grants an open
    # they make every capability there: at 55774c0 an O_CREAT open of /proc/1/mem passed the
    # ptrace check the task fails, and any command could read and write the memory of the
    # non-dumpable session launcher (PID 1). The supervisor must not deputise such opens.
    handle = _rules(sb)
    marker = unique("CC-EARLIER-REQUEST")
    # An earlier command of the session, whose request (its environment) the launcher received.
    first = await run_collect(handle, ["/bin/sh", "-c", "echo first"], env={"API_TOKEN": marker},
                              timeout_s=RUN_TIMEOUT_S)  # fmt: skip
    assert first.stdout == b"first\n", first
    half = len(marker) // 2
    script = _py(
        f"""
        import os
        needle = {marker[:half]!r} + {marker[half:]!r}
        try:
            fd = os.open('/proc/1/mem', os.O_RDONLY)
            print('plain-open=ok')
        except OSError:
            print('plain-open=fail')
        try:
            maps = os.open('/proc/1/maps', os.O_RDONLY | os.O_CREAT)
            mem = os.open('/proc/1/mem', os.O_RDWR | os.O_CREAT)
        except OSError as e:
            raise SystemExit('creat-open=fail ' + str(e))
        print('creat-open=ok')
        text = b''
        while chunk := os.read(maps, 65536):
            text += chunk
        found = False
        for line in text.decode().splitlines():
            span, perms = line.split()[:2]
            if not perms.startswith('rw'):
                continue
            lo, hi = (int(x, 16) for x in span.split('-'))
            try:
                data = os.pread(mem, hi - lo, lo)
            except OSError:
                continue
            if needle.encode() in data:
                found = True
            if perms.startswith('rw') and not found and data:
                wrote = os.pwrite(mem, data[:1], lo)  # the same byte back: a harmless write
                print('write=ok' if wrote == 1 else 'write=fail')
        print('leaked' if found else 'not-found')
        """
    )
    result = await _sh(sb, handle, script)
    out = output(result)
    assert "plain-open=fail" in out, out  # control: the launcher is not dumpable
    assert "creat-open=ok" not in out, out
    assert "leaked" not in out and "write=ok" not in out, out


# --- nested bind roots the agent can rearrange -------------------------------------------------


def _host_only_dir(sb: Sandboxes) -> tuple[pathlib.Path, str]:
    """A root-only directory outside every bind, holding a secret: `secret/state/key`."""
    marker = unique("CC-HOST-ONLY")
    secret = sb.root / "host-only"
    (secret / "state").mkdir(parents=True)
    (secret / "state" / "key").write_text(marker + "\n")
    os.chmod(secret / "state" / "key", 0o600)
    os.chmod(secret, 0o700)
    return secret, marker


@pytest.fixture
def world_dir() -> Iterator[pathlib.Path]:
    """A host directory outside every bind that any uid may enter (/tmp/cc-hia-*, 0755, with a
    0644 file and a 0777 directory), like a user's home or another checkout: not the sandbox's."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="cc-hia-", dir="/tmp"))
    os.chmod(path, 0o755)
    (path / "public").write_text(unique("CC-OUTSIDE-EVERY-BIND") + "\n")
    os.chmod(path / "public", 0o644)
    (path / "drop").mkdir()
    os.chmod(path / "drop", 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _after_swap(
    sb: Sandboxes, handle: SandboxHandle, work: pathlib.Path, swap: str, probe: str
) -> str:
    """Run `swap` in the worktree, then `probe` in the session's next sandbox (`.git/hooks`,
    made by the host since a command may not make a `.git`, makes its plan differ, so it is a
    new one, staged again). The probe's output, or why the launch was refused."""
    done = await _sh(sb, handle, f"cd {work} && {swap} && echo swapped")
    assert done.stdout.decode().endswith("swapped\n"), output(done)
    (work / ".git" / "hooks").mkdir(parents=True, exist_ok=True)
    try:
        result = await run_collect(handle, ["/bin/sh", "-c", probe], timeout_s=RUN_TIMEOUT_S)
    except CcServerError as exc:  # a refused launch is the pass
        return f"refused: {exc}"
    return output(result)


@needs_root
async def test_a_nested_roots_parent_swapped_for_a_symlink_stops_the_next_launch(
    sb: Sandboxes, world_dir: pathlib.Path
) -> None:
    # In a session the policy is compiled once, so the nested root's path is fixed; a symlink
    # in that path above the root makes cc-identity's openat2 (RESOLVE_NO_SYMLINKS) fail.
    work = sb.root / "repos" / "project" / "wt"
    state = work / "a" / "state"
    state.mkdir(parents=True)
    (world_dir / "state").mkdir()
    os.chmod(world_dir / "state", 0o777)
    handle = sb.launch(bindMounts=[{"hostPath": str(work)}], runnerStateDirs=[str(state)])
    out = await _after_swap(
        sb, handle, work, f"mv a a.old && ln -s {world_dir} a",
        f"ls {state}; echo pwned > {state}/planted; echo ran",
    )  # fmt: skip
    assert "refused" in out and "ran" not in out, out
    assert list((world_dir / "state").iterdir()) == []


@needs_root
async def test_a_nested_root_swapped_for_a_symlink_between_commands_does_not_run(
    sb: Sandboxes, world_dir: pathlib.Path
) -> None:
    marker = (world_dir / "public").read_text().strip()
    work = sb.root / "repos" / "project" / "wt"
    state = work / "a" / "b" / "state"
    state.mkdir(parents=True)
    handle = sb.launch(bindMounts=[{"hostPath": str(work)}], runnerStateDirs=[str(state)])
    # The state directory is a mount point inside; its parents are not. The link is relative:
    # from the stage (/dev/shm/1) `../../tmp/X` is the host's /tmp/X; from its place in the
    # worktree (the mount's destination, which bubblewrap also follows) it is <wt>/tmp/X, which
    # the agent makes, so the mount succeeds.
    name = world_dir.name
    out = await _after_swap(
        sb, handle, work,
        f"mv a a.old && mkdir -p a/b tmp/{name} && ln -s ../../tmp/{name} a/b/state",
        f"cat {state}/public; echo pwned > {state}/drop/planted; echo ran",
    )  # fmt: skip
    planted = world_dir / "drop" / "planted"
    assert marker not in out, out
    assert not planted.exists(), f"{planted} owned by uid {os.lstat(planted).st_uid}: {out}"


@needs_root
async def test_a_nested_root_swapped_for_a_symlink_cannot_reach_another_session(
    sb: Sandboxes,
) -> None:
    marker = unique("CC-OTHER-SESSIONS-ARGV")
    victim = sb.launch()
    argv = ["/bin/sh", "-c", f"sleep 60; : {marker}"]

    def in_argv() -> list[int]:
        return [p for p in host_pids_with(marker)
                if marker.encode() in pathlib.Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip

    async with victim.open_exec(argv, env={"API_TOKEN": marker}) as execution:
        assert await wait_until(lambda: bool(in_argv()), 10.0)
        pid = in_argv()[0]
        work = sb.root / "repos" / "project" / "wt"
        state = work / "a" / "b" / "state"
        state.mkdir(parents=True)
        attacker = sb.launch(bindMounts=[{"hostPath": str(work)}], runnerStateDirs=[str(state)])
        out = await _after_swap(
            sb, attacker, work, "mv a a.old && mkdir -p a/b proc && ln -s ../../proc a/b/state",
            f"tr '\\0' ' ' < {state}/{pid}/cmdline; echo; tr '\\0' ' ' < {state}/{pid}/environ;"
            f" cat {state}/1/cmdline",
        )  # fmt: skip
        await execution.kill()
    assert marker not in out, out


@needs_root
async def test_a_symlink_left_in_a_bind_does_not_choose_the_next_launchs_nested_root(
    sb: Sandboxes,
) -> None:
    secret, marker = _host_only_dir(sb)
    # A worktree deeper than the host directory, as /work/repos/x is deeper than /root/.claude:
    # the planner binds shallower roots first, so the spec's symlink at the state directory's
    # spelling is made before the worktree is mounted over it, and bubblewrap is content.
    work = sb.root / "repos" / "project" / "wt"
    state = work / "a" / "state"
    state.mkdir(parents=True)
    fields = {"bindMounts": [{"hostPath": str(work)}], "runnerStateDirs": [str(state)]}
    first = sb.launch(**fields)
    # The state directory is a mount point inside, but its parent is not: the agent renames the
    # parent away and leaves a symlink at the state directory's name.
    swap = await _sh(sb, first, f"cd {work} && mv a a.old && mkdir a && "
                                f"ln -s {secret}/state a/state && echo ok")  # fmt: skip
    assert swap.stdout.decode().endswith("ok\n"), output(swap)
    await sb.manager.destroy(first.session_id)
    # The next conversation turn (or a restarted server) launches the same spec.
    staged: list[str] = []
    try:
        second = sb.launch(**fields)
        staged = [w for w in second.plan(Command(argv=("/bin/true",))).argv
                  if isinstance(w, str) and w.startswith(str(secret))]  # fmt: skip
        result = await run_collect(
            second,
            ["/bin/sh", "-c", f"cat {state}/key; echo pwned > {state}/planted; echo ran"],
            timeout_s=RUN_TIMEOUT_S,
        )
        out = output(result)
    except CcServerError as exc:  # a refused launch is the pass, unless its plan staged it
        out = f"refused: {exc}"
    planted = secret / "state" / "planted"
    assert marker not in out, out
    assert not planted.exists(), f"{planted} owned by uid {os.lstat(planted).st_uid}"
    # Judged on the plan too, so the verdict does not hang on bubblewrap's version: no word of
    # the launch may name the host-only directory (cc-identity --map, bwrap --bind).
    assert staged == [], staged


@needs_root
async def test_a_foreign_directory_renamed_onto_a_nested_root_stays_foreign(
    sb: Sandboxes,
) -> None:
    # The worktree is the suite's (root). Through the outer bind the sandbox sees a directory of
    # uid 4242 as nobody's: it can neither write it nor move it (EOVERFLOW: its owner has no
    # mapping). But it can move the suite's directory that holds it, `x`, onto the nested root's
    # parent, so the nested root's path names the foreign directory at the next launch.
    x = sb.worktree / "x"
    x.mkdir()
    foreign = x / "state"
    foreign.mkdir()
    _owned(foreign, FOREIGN, 0o755)
    (foreign / "theirs").write_text("theirs\n")
    _owned(foreign / "theirs", FOREIGN, 0o644)
    state = sb.worktree / "a" / "state"
    state.mkdir(parents=True)
    handle = sb.launch(runnerStateDirs=[str(state)])
    control = await _sh(sb, handle, attempts(
        write_foreign=f"echo x >> {foreign}/theirs",
        create_foreign=f"echo x > {foreign}/new",
        move_foreign=f"mv {foreign} {sb.worktree}/moved",
    ))  # fmt: skip
    assert outcomes(control) == {
        "write_foreign": "fail",
        "create_foreign": "fail",
        "move_foreign": "fail",
    }, output(control)
    # .git/hooks (made by the host: a command may not make a `.git`) makes the next command's
    # plan differ, so it gets a new sandbox (cc-identity stages the roots again).
    swap = await _sh(sb, handle, f"cd {sb.worktree} && mv a a.old && mv x a && echo swapped")
    assert swap.stdout.decode().endswith("swapped\n"), output(swap)
    (sb.worktree / ".git" / "hooks").mkdir(parents=True, exist_ok=True)
    result = await _sh(sb, handle, attempts(
        write_foreign=f"echo x >> {state}/theirs",
        create_foreign=f"echo x > {state}/new",
    ))  # fmt: skip
    new = foreign.parent.parent / "a" / "state" / "new"
    assert not new.exists(), f"{new} created, owned by uid {os.lstat(new).st_uid}"
    assert (state / "theirs").read_text() == "theirs\n", output(result)


# --- set-id bits and file capabilities, by every remaining route ---------------------------------

_LIBC = "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); sc = libc.syscall; "
_LIBC += "sc.restype = ctypes.c_long; "
SET_ID_ROUTES = {
    # x32 ABI numbers (0x40000000 | nr) of chmod: the filter's default for a foreign ABI kills.
    "x32-chmod": "open('a','w').close(); r = sc(0x40000000 | 90, b'a', 0o4755)",
    # The mode register's upper 32 bits set: the kernel keeps the low 16.
    "chmod-high-bits": "open('b','w').close(); r = sc(90, b'b', (1 << 32) | 0o4755)",
    "fchmodat2-empty-path": "open('c','w').close(); fd = os.open('c', os.O_PATH); "
    "r = sc(452, fd, b'', 0o4755, 0x1000)",
    "fchmodat2-dirfd": "open('d','w').close(); r = sc(452, os.open('.', os.O_RDONLY), b'd', "
    "0o2755, 0)",
    "tmpfile-mode-linkat": "fd = os.open('.', os.O_TMPFILE | os.O_WRONLY, 0o4755); "
    "r = libc.linkat(fd, b'', -100, b'e', 0x1000)",
    "tmpfile-fchmod-linkat": "fd = os.open('.', os.O_TMPFILE | os.O_WRONLY, 0o755); "
    "sc(91, fd, 0o4755); r = sc(265, fd, b'', -100, b'f', 0x1000)",
    "proc-self-fd-dirfd": "d = os.open('.', os.O_RDONLY); "
    "r = os.open(f'/proc/self/fd/{d}/g', os.O_CREAT | os.O_WRONLY, 0o4755)",
    "creat": "r = sc(85, b'h', 0o4755)",
    "mknodat-dirfd": "r = sc(259, os.open('.', os.O_RDONLY), b'i', 0o100000 | 0o4755, 0)",
    "mkdirat-setgid": "r = sc(258, -100, b'j', 0o2755)",
    "openat2": "import struct; how = struct.pack('QQQ', os.O_CREAT | os.O_WRONLY, 0o4755, 0); "
    "r = sc(437, -100, b'k', how, len(how))",
    "cap-v3-rootid-0": "open('l','w').close(); "
    "os.setxattr('l', 'security.capability', bytes.fromhex('000000030020000000000000000000000000"
    "000000000000'))",
    "trusted-xattr": "open('m','w').close(); os.setxattr('m', 'trusted.cc', b'x'); r = 0",
    # An ACL naming a uid the sandbox has no mapping for (anyone's but the owner's).
    "acl-other-uid": "open('n','w').close(); import struct; os.setxattr('n', "
    "'system.posix_acl_access', struct.pack('<I', 2) + struct.pack('<HHI', 1, 6, 0xFFFFFFFF) + "
    "struct.pack('<HHI', 2, 7, 1000) + struct.pack('<HHI', 4, 4, 0xFFFFFFFF) + "
    "struct.pack('<HHI', 0x10, 7, 0xFFFFFFFF) + struct.pack('<HHI', 0x20, 4, 0xFFFFFFFF))",
    "cp-a-from-tmp": "import subprocess; open('/tmp/s','w').close(); "
    "r = subprocess.call('chmod 4755 /tmp/s; cp -a /tmp/s o; mv /tmp/s p', shell=True)",
}


def _marks(root: pathlib.Path) -> list[str]:
    found = []
    for path in [root, *root.rglob("*")]:
        st = os.lstat(path)
        if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            found.append(f"{path} {stat.filemode(st.st_mode)}")
        for name in ("security.capability", "trusted.cc", "system.posix_acl_access"):
            try:
                value = os.getxattr(path, name, follow_symlinks=False)
            except OSError:
                continue
            if name != "system.posix_acl_access" or b"\xe8\x03\x00\x00" in value:
                found.append(f"{path} has {name}")
    return found


@pytest.mark.parametrize("rules", [False, True], ids=["plain", "create-rules"])
@pytest.mark.parametrize("route", sorted(SET_ID_ROUTES))
async def test_no_set_id_bit_or_capability_lands_by_any_route(
    sb: Sandboxes, route: str, rules: bool
) -> None:
    # With create rules, the supervisor makes files for the task: the set-id refusal (ERRNO)
    # must still win over its notification (USER_NOTIF) for every creating call.
    handle = _rules(sb) if rules else sb.launch()
    code = _LIBC + SET_ID_ROUTES[route]
    result = await _sh(sb, handle, f'cd {sb.worktree} && {PYTHON} -c "{code}"; echo rc=$?')
    assert _marks(sb.worktree) == [], output(result)


# --- owners: what chown does inside, and files of other owners ---------------------------------


@needs_root
async def test_chown_inside_gives_no_host_owner_and_foreign_files_stay_foreign(
    sb: Sandboxes,
) -> None:
    (sb.worktree / "mine").write_text("mine\n")
    (sb.worktree / "foreign").write_text("theirs\n")
    _owned(sb.worktree / "foreign", FOREIGN, 0o755)
    secret = sb.worktree / "foreign-secret"
    secret.write_text("0600 of another owner\n")
    _owned(secret, FOREIGN, 0o600)
    result = await _sh(sb, sb.launch(), f"cd {sb.worktree} && " + attempts(
        chown_to_root="chown 0:0 mine",  # its own uid inside: a no-op
        chown_away="chown 1:1 mine",
        chown_nobody="chown 65534:65534 mine",
        chown_foreign="chown 0:0 foreign",
        write_foreign="echo x >> foreign",
        read_foreign_secret="cat foreign-secret",
        link_foreign_secret="ln foreign-secret linked",
        delete_foreign="rm -f foreign",
        move_foreign="mv foreign moved",
        chmod_foreign="chmod 0777 foreign",
    ))  # fmt: skip
    assert outcomes(result) == {
        "chown_to_root": "ok", "chown_away": "fail", "chown_nobody": "fail",
        "chown_foreign": "fail", "write_foreign": "fail", "read_foreign_secret": "fail",
        "link_foreign_secret": "fail", "delete_foreign": "fail", "move_foreign": "fail",
        "chmod_foreign": "fail",
    }, output(result)  # fmt: skip
    st = os.lstat(sb.worktree / "mine")
    assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid())
    st = os.lstat(sb.worktree / "foreign")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (*FOREIGN, 0o755)
    assert (sb.worktree / "foreign").read_text() == "theirs\n"
    assert not (sb.worktree / "linked").exists()


# --- the stage and the host's mount table --------------------------------------------------------


def _mount_table() -> list[str]:
    return [" ".join(line.split()[3:5]) for line in pathlib.Path("/proc/self/mountinfo")
            .read_text().splitlines()]  # fmt: skip


@needs_root
async def test_the_stage_is_neither_reachable_inside_nor_left_on_the_host(sb: Sandboxes) -> None:
    before_mounts = _mount_table()
    before_shm = sorted(os.listdir("/dev/shm"))
    result = await _sh(sb, _rules(sb), attempts(
        stage_listed="ls -A /dev/shm | grep -q .",
        stage_mounted="grep -q ' /dev/shm/' /proc/self/mountinfo",
        through_pid1="ls -A /proc/1/root/dev/shm | grep -q .",
        through_creat=_pyc('import os; os.open("/proc/1/root/dev/shm/0/README", '
                           'os.O_RDONLY | os.O_CREAT)'),
        host_root_visible="test -e /oldroot || test -e /newroot",
    ) + "\nls /proc/*/root/dev/shm/0/README 2>/dev/null | head -1; echo end")  # fmt: skip
    assert set(outcomes(result).values()) == {"fail"}, output(result)
    assert "README" not in result.stdout.decode(), output(result)
    assert result.stdout.decode().splitlines()[-1:] == ["end"], output(result)
    await sb.manager.aclose()
    assert sorted(os.listdir("/dev/shm")) == before_shm
    assert _mount_table() == before_mounts


@needs_root
async def test_the_staged_launcher_cannot_be_changed_from_inside(sb: Sandboxes) -> None:
    # The create-rule launcher is one of the staged roots (idmapped to root: uid 0 inside, its
    # owner). Every sandbox runs it, so a change would reach every later session.
    launcher = sb.manager.probe_result.tools.get("cc-create-launcher")
    assert launcher, sb.manager.probe_result.tools
    before = pathlib.Path(launcher).read_bytes(), os.stat(launcher).st_mode
    result = await _sh(sb, _rules(sb), attempts(
        write="printf x >> /run/cc-create/launcher",
        chmod="chmod 0777 /run/cc-create/launcher",
        truncate=_pyc('import os; os.truncate("/run/cc-create/launcher", 0)'),
        creat=_pyc('import os; os.open("/run/cc-create/launcher", os.O_CREAT | os.O_WRONLY)'),
    ))  # fmt: skip
    assert set(outcomes(result).values()) == {"fail"}, output(result)
    assert (pathlib.Path(launcher).read_bytes(), os.stat(launcher).st_mode) == before


async def test_procfs_has_no_writable_host_global_file(sb: Sandboxes) -> None:
    # Outside the per-process directories, only the /dev/null masks open for writing.
    script = _py(
        """
        import os
        hits = []
        for top in sorted(os.listdir('/proc')):
            if top.isdigit() or top in ('self', 'thread-self'):
                continue
            for dp, dn, fn in os.walk('/proc/' + top):
                for f in fn + ([] if dn or fn else []):
                    q = os.path.join(dp, f)
                    try:
                        os.close(os.open(q, os.O_WRONLY | os.O_NONBLOCK))
                    except OSError:
                        continue
                    hits.append(q)
            if not os.path.isdir('/proc/' + top):
                try:
                    os.close(os.open('/proc/' + top, os.O_WRONLY | os.O_NONBLOCK))
                    hits.append('/proc/' + top)
                except OSError:
                    pass
        st = os.stat('/dev/null')
        print('\\n'.join(h for h in hits if os.stat(h).st_rdev != st.st_rdev) or 'none')
        """
    )
    result = await _sh(sb, sb.launch(), script)
    assert result.stdout == b"none\n", output(result)


# --- one sandbox against another: each session its own uid from 0x70000000 on -----------------


@needs_root
async def test_a_sandbox_cannot_signal_trace_or_read_another_sessions_sandbox(
    sb: Sandboxes,
) -> None:
    marker = unique("CC-OTHER-SESSION")
    victim = sb.launch()
    await _sh(sb, victim, f"echo {marker} > /tmp/note; echo {marker} > /dev/shm/note")
    async with victim.open_exec(["/bin/sh", "-c", f"sleep 60; : {marker}"]) as execution:
        pid = await the_one_pid_with(marker, 10.0)
        uid = pathlib.Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0]
        assert is_sandbox_uid(int(uid))  # control: a sandbox identity, as the attacker's
        attacker = sb.launch()
        result = await _sh(sb, attacker, attempts(
            kill_host_pid=f"kill -0 {pid}",
            proc_host_pid=f"cat /proc/{pid}/cmdline | grep -q {marker[:10]}",
            ptrace_host_pid=_pyc(f"import ctypes, sys; libc = ctypes.CDLL(None); "
                                 f"sys.exit(libc.ptrace(16, {pid}, 0, 0) != 0)"),
            pidfd_host_pid=_pyc(f"import os; os.pidfd_open({pid})"),
            read_tmp="grep -rqs CC-OTHER /tmp /dev/shm /var/tmp",
        ) + "\nkill -KILL -1 2>/dev/null; echo signalled")  # fmt: skip
        assert set(outcomes(result).values()) == {"fail"}, output(result)
        await asyncio.sleep(0.2)
        assert os.path.exists(f"/proc/{pid}"), "the other session's command was killed"
        await execution.kill()


@needs_root
async def test_one_session_cannot_exhaust_another_sessions_inotify_instances(
    sb: Sandboxes,
) -> None:
    limit = int(pathlib.Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    marker = unique("CC-INOTIFY-HOG")
    hog = sb.launch()
    script = _py(
        f"""
        import ctypes, time
        libc = ctypes.CDLL(None)
        held = [libc.inotify_init() for _ in range({limit + 8})]
        print(sum(fd >= 0 for fd in held), flush=True)
        time.sleep(30)  # {marker}
        """
    )
    async with hog.open_exec(["/bin/sh", "-c", script]) as execution:
        assert await wait_until(lambda: bool(host_pids_with(marker)), 10.0)
        await asyncio.sleep(1.0)
        other = await _sh(sb, sb.launch(), _py(
            "import ctypes; print('inotify', ctypes.CDLL(None).inotify_init() >= 0)"
        ))  # fmt: skip
        await execution.kill()
    assert other.stdout == b"inotify True\n", output(other)


# --- cc-identity itself -----------------------------------------------------------------------


@needs_root
def test_the_selftest_leaves_nothing_in_tmp() -> None:
    from cc_server.backends.identity import _NATIVE_DIR, IDENTITY_TOOL

    helper = os.path.join(_NATIVE_DIR, IDENTITY_TOOL)
    before = {p for p in os.listdir("/tmp") if p.startswith("cc-identity-selftest-")}
    mounts = _mount_table()
    for argv in (["--selftest", str(SANDBOX_UID), str(SANDBOX_GID)],
                 ["--selftest", "0", "0"], ["--selftest", str(SANDBOX_UID), "x"]):  # fmt: skip
        subprocess.run([helper, *argv], capture_output=True, timeout=20, check=False, env={})
    after = {p for p in os.listdir("/tmp") if p.startswith("cc-identity-selftest-")}
    assert after == before
    assert _mount_table() == mounts


@pytest.fixture
def overlay(sb: Sandboxes) -> Iterator[pathlib.Path]:
    """An overlayfs mount (which cannot be idmapped) under the test's directory."""
    base = sb.root / "ovl"
    layers = {n: base / n for n in ("lower", "upper", "work", "merged")}
    for path in layers.values():
        path.mkdir(parents=True)
    (layers["lower"] / "file").write_text("lower\n")
    opts = f"lowerdir={layers['lower']},upperdir={layers['upper']},workdir={layers['work']}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(layers["merged"])],
                   check=True, capture_output=True)  # fmt: skip
    yield layers["merged"]
    subprocess.run(["umount", "-l", str(layers["merged"])], check=False, capture_output=True)


@needs_root
@pytest.mark.parametrize("where", ["the-bind", "below-the-bind"])
async def test_a_bind_that_cannot_be_idmapped_fails_closed(
    sb: Sandboxes, overlay: pathlib.Path, where: str
) -> None:
    bind = overlay if where == "the-bind" else overlay.parent
    ran = sb.root / "ran"
    try:
        result = await run_collect(
            sb.launch(bindMounts=[{"hostPath": str(bind)}, {"hostPath": str(sb.root)}]),
            ["/bin/sh", "-c", f"echo x > {ran}; echo x > {overlay}/new; echo ran"],
            timeout_s=RUN_TIMEOUT_S,
        )
        out = output(result)
    except CcServerError as exc:
        out = f"refused: {exc}"
    assert "refused" in out and "idmap" in out, out
    assert not ran.exists() and not (overlay / "new").exists()
