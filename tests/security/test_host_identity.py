"""A sandbox has no power over the host through who it is: never host uid 0, no host-global kernel
knob, no setuid file left behind. Judged on the host, for both identities: the suite's own (root in
CI) and an unprivileged user made for it (`other_user`), through the CLI and through the server.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shlex
import stat
import subprocess
import tarfile
import time

import pytest
from escape_kit import (
    Sandboxes,
    daemon_attack_script,
    host_pids_with,
    the_one_pid_with,
    unique,
)
from other_user import OtherUser, remove

from cc_server.backends.identity import is_sandbox_uid

pytestmark = [pytest.mark.security, pytest.mark.integration]

ROOT = os.geteuid() == 0
HOST_KNOBS = ("/proc/sys/kernel/core_pattern", "/proc/sys/vm/drop_caches", "/proc/sysrq-trigger")
MASKED = ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/kmsg")

# Every way found to put a setuid or setgid bit on a file (runc's and the peers' lists, plus the
# creation modes): each must fail, and nothing with such a bit may be left in the bind.
SETUID_ATTEMPTS = {
    "chmod-octal": "cp /bin/true a && chmod 4755 a",
    "chmod-symbolic": "cp /bin/true b && chmod u+s b",
    "chmod-setgid": "cp /bin/true c && chmod g+s c",
    "chmod-dir-setgid": "mkdir d && chmod 2755 d",
    "mkdir-mode": "mkdir -m 4755 e",
    "install": "install -m 4755 /bin/true f",
    "cp-preserve": "cp -p /usr/bin/passwd g 2>&1; ls -l g",
    "py-chmod": "python3 -c \"import os,shutil; shutil.copy('/bin/true','h'); "
    "os.chmod('h',0o4755)\"",
    "py-fchmod": "python3 -c \"import os; fd=os.open('i',os.O_CREAT|os.O_WRONLY,0o755); "
    "os.fchmod(fd,0o6755)\"",
    "py-fchmodat-dirfd": "python3 -c \"import os; open('j','w').close(); "
    "d=os.open('.',os.O_RDONLY); os.chmod('j',0o4755,dir_fd=d)\"",
    "open-create-mode": "python3 -c \"import os; os.open('k',os.O_CREAT|os.O_WRONLY,0o4755)\"",
    "mknod-mode": "python3 -c \"import os,stat; os.mknod('l',stat.S_IFREG|0o4755)\"",
    "tar-preserve": "tar -xpf suid.tar",
    "file-capability": "cp /bin/true m && python3 -c \"import os; os.setxattr('m',"
    "'security.capability',bytes.fromhex('01000002c000000000000000000000000000000000'))\"",
}


def set_id_files(root: pathlib.Path) -> list[str]:
    found = []
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            mode = os.lstat(path).st_mode
            if mode & (stat.S_ISUID | stat.S_ISGID):
                found.append(f"{path} {stat.filemode(mode)}")
            try:
                if os.getxattr(path, "security.capability", follow_symlinks=False):
                    found.append(f"{path} has file capabilities")
            except OSError:
                pass
    return found


def suid_tar(path: pathlib.Path) -> None:
    member = path.parent / "payload"
    member.write_bytes(b"#!/bin/sh\n")
    with tarfile.open(path, "w") as tar:
        info = tar.gettarinfo(str(member), arcname="suid-member")
        info.mode = 0o4755
        with open(member, "rb") as f:
            tar.addfile(info, f)
    member.unlink()


# --- the suite's own identity (root in CI), through the library -------------------------------


async def test_a_sandboxed_process_is_never_host_uid_0(sb: Sandboxes) -> None:
    marker = unique("CC-IDENTITY")
    handle = sb.launch()
    async with handle.open_exec(["/bin/sh", "-c", f"sleep 30; echo {marker}"]) as execution:
        pid = await the_one_pid_with(marker, 10.0)
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
        ids = {line.split(":")[0]: line.split()[1:] for line in status.splitlines()
               if line.startswith(("Uid:", "Gid:", "Groups:"))}  # fmt: skip
        uid = int(ids["Uid"][0])
        assert ids["Uid"] == [str(uid)] * 4, status
        if ROOT:  # the session's own identity from the range, its gid the same number
            assert is_sandbox_uid(uid), status
            assert ids["Gid"] == [str(uid)] * 4, status
            assert ids["Groups"] == [], status
        else:
            assert uid == os.geteuid(), status
        assert "0" not in ids["Uid"]
        await execution.kill()
    await sb.manager.destroy(handle.session_id)


async def test_no_file_under_proc_sys_is_writable_and_no_knob_opens_for_writing(
    sb: Sandboxes,
) -> None:
    before = {k: pathlib.Path(k).read_bytes() for k in HOST_KNOBS[:1]}
    spellings = [
        *HOST_KNOBS,
        "//proc//sys/kernel/core_pattern",
        "/proc/self/root/proc/sys/kernel/core_pattern",
        "/proc/1/root/proc/sys/kernel/core_pattern",
        "/proc/thread-self/../../sys/kernel/core_pattern",
        "/proc/sys/net/ipv4/ip_forward",
        "/proc/sys/kernel/modprobe",
    ]
    script = "find /proc/sys -type f -writable 2>/dev/null | wc -l\n" + "".join(
        f"if ( : > {p} ) 2>/dev/null; then echo 'OPENED {p}'; fi\n" for p in spellings
    ) + "python3 -c \"import os; os.open('/proc/sys/kernel/core_pattern', os.O_WRONLY)\" " \
        "2>&1 | tail -1\n"
    result = await sb.run(script)
    out = result.stdout.decode()
    assert out.splitlines()[0] == "0", out
    assert "OPENED" not in out, out
    assert "Read-only file system" in out or "Permission denied" in out, out
    assert {k: pathlib.Path(k).read_bytes() for k in before} == before


async def test_the_kernel_s_secrets_in_procfs_are_masked(sb: Sandboxes) -> None:
    present = [p for p in MASKED if os.path.lexists(p)]
    script = "".join(f"if head -c1 {p} >/dev/null 2>&1; then echo 'READ {p}'; fi\n"
                     for p in present)  # fmt: skip
    script += "ls -A /proc/acpi 2>/dev/null | wc -l\n"
    result = await sb.run(script)
    out = result.stdout.decode()
    assert "READ" not in out, out
    assert out.splitlines()[-1] == "0", out


async def test_a_file_created_in_a_bind_belongs_to_the_binds_owner(sb: Sandboxes) -> None:
    owned = sb.root / "owned"
    owned.mkdir()
    owner = (4242, 4343) if ROOT else (os.geteuid(), os.getegid())
    os.chown(owned, *owner)
    (owned / "theirs").write_text("0600 file of the owner\n")
    os.chown(owned / "theirs", *owner)
    os.chmod(owned / "theirs", 0o600)
    result = await sb.run(
        f"echo a > {sb.worktree}/mine && mkdir {sb.worktree}/dir && "
        f"cat {owned}/theirs && echo b > {owned}/new && mkdir {owned}/sub && echo ok",
        bindMounts=[{"hostPath": str(sb.worktree)}, {"hostPath": str(owned)}],
    )
    assert result.stdout.decode().endswith("ok\n"), result
    me = (os.geteuid(), os.getegid())
    for path in (sb.worktree / "mine", sb.worktree / "dir"):
        st = os.lstat(path)
        assert (st.st_uid, st.st_gid) == me, path
    for path in (owned / "new", owned / "sub"):
        st = os.lstat(path)
        assert (st.st_uid, st.st_gid) == owner, path


@pytest.mark.parametrize("name", sorted(SETUID_ATTEMPTS))
async def test_no_setuid_or_setgid_file_is_left_in_a_bind(sb: Sandboxes, name: str) -> None:
    suid_tar(sb.worktree / "suid.tar")
    result = await sb.run(f"cd {sb.worktree} && {{ {SETUID_ATTEMPTS[name]}; }}; echo rc=$?")
    out = result.stdout.decode()
    assert set_id_files(sb.worktree) == [], out
    if name != "cp-preserve":  # cp -p copies the file and reports the refused chmod
        assert "rc=0" not in out, out


async def test_a_plain_chmod_and_an_executable_still_work(sb: Sandboxes) -> None:
    # The control: the filter refuses only the set-id bits.
    result = await sb.run(
        f"cd {sb.worktree} && cp /bin/true t && chmod 0755 t && ./t && chmod u-x,go-w t && "
        "mkdir -m 0700 p && echo ok"
    )
    assert result.stdout.decode() == "ok\n", result
    assert stat.S_IMODE(os.lstat(sb.worktree / "t").st_mode) == 0o655


# --- an unprivileged user: the CLI and the server run as it ----------------------------------


def _cli_run(user: OtherUser, work: pathlib.Path, script: str) -> subprocess.CompletedProcess[str]:
    return user.run(
        ["/usr/bin/python3", "-m", "cc_server.cli", "run", "--bind", str(work), "--workdir",
         str(work), "--", "/bin/sh", "-c", script],
        cwd=work, env={"CC_SERVER_DAEMON": "off"},
    )  # fmt: skip


def test_as_an_unprivileged_user_no_knob_opens_and_no_setuid_file_lands(
    other_user: OtherUser, user_dir: pathlib.Path
) -> None:
    before = pathlib.Path("/proc/sys/kernel/core_pattern").read_bytes()
    suid_tar(user_dir / "suid.tar")
    os.chown(user_dir / "suid.tar", other_user.uid, other_user.gid)
    attempts = "".join(f"( {cmd} ) 2>/dev/null\n" for cmd in SETUID_ATTEMPTS.values())
    script = (
        "find /proc/sys -type f -writable 2>/dev/null | wc -l\n"
        + "".join(f"( : > {p} ) 2>/dev/null && echo 'OPENED {p}'\n" for p in HOST_KNOBS)
        + attempts
        + "echo done\n"
    )
    done = _cli_run(other_user, user_dir, script)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "0" and lines[-1] == "done", done.stdout
    assert "OPENED" not in done.stdout
    assert set_id_files(user_dir) == []
    assert pathlib.Path("/proc/sys/kernel/core_pattern").read_bytes() == before
    # What it created there is the user's own, not root's.
    created = [p for p in user_dir.iterdir() if p.name != "suid.tar"]
    assert created and all(os.lstat(p).st_uid == other_user.uid for p in created)


def test_as_an_unprivileged_user_the_sandbox_is_that_user_on_the_host(
    other_user: OtherUser, user_dir: pathlib.Path
) -> None:
    marker = unique("CC-USER-ID")
    proc = subprocess.Popen(
        other_user.argv("/usr/bin/python3", "-m", "cc_server.cli", "run", "--bind",
                        str(user_dir), "--", "/bin/sh", "-c", f"exec sleep 20 # {marker}"),
        cwd=user_dir, env=other_user.env({"CC_SERVER_DAEMON": "off"}),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not host_pids_with(marker) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        pids = host_pids_with(marker)
        assert pids
        uids = {pathlib.Path(f"/proc/{p}/status").read_text().split("Uid:")[1].split()[0]
                for p in pids}  # fmt: skip
        assert uids == {str(other_user.uid)}
    finally:
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
        for pid in host_pids_with(marker):
            os.kill(pid, 9)


def test_as_an_unprivileged_user_the_server_s_sandboxes_hold_too(
    other_user: OtherUser, user_dir: pathlib.Path
) -> None:
    import json
    import urllib.request

    home = other_user.workdir()  # the token file's directory: not inside the bind
    log = home / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            other_user.cli("serve", "--port", "0", "--log-json", "--token-file",
                           str(home / "token")),
            cwd=user_dir, env=other_user.env({"HOME": str(home), "XDG_RUNTIME_DIR": ""}),
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        port = None
        deadline = time.monotonic() + 30
        while port is None and time.monotonic() < deadline:
            assert server.poll() is None, log.read_text()
            for line in log.read_text().splitlines():
                if '"listening"' in line:
                    port = json.loads(line)["port"]
            time.sleep(0.05)
        assert port is not None, log.read_text()
        token = (home / "token").read_text().strip()

        def post(path: str, body: dict[str, object]) -> dict[str, object]:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                headers={"Authorization": f"Bearer {token}"},
            )  # fmt: skip
            with urllib.request.urlopen(req, timeout=30) as reply:
                data: dict[str, object] = json.loads(reply.read() or b"{}")
                return data

        spec = {"sessionId": "u1", "workspaceId": "w", "bindMounts": [{"hostPath": str(user_dir)}]}
        post("/v1/sandboxes", {"spec": spec})
        script = (
            "find /proc/sys -type f -writable 2>/dev/null | wc -l; "
            f"cd {user_dir} && cp /bin/true x && chmod 4755 x; echo rc=$?"
        )
        result = post("/v1/sandboxes/u1/exec", {"argv": ["/bin/sh", "-c", script]})
        import base64

        out = base64.b64decode(str(result["stdoutBase64"])).decode()
        assert out.splitlines() == ["0", "rc=1"], result
        assert set_id_files(user_dir) == []
        assert os.lstat(user_dir / "x").st_uid == other_user.uid
    finally:
        server.terminate()
        server.wait(timeout=20)
        remove(home)


# --- the create-rule supervisor is nobody's deputy ---------------------------------------------

# Existing kernel objects opened with O_CREAT: the supervisor would open them for the task, with
# the credentials of the sandbox's user-namespace owner (every capability in that namespace).
DEPUTY_TARGETS = (
    "/proc/1/mem",  # the launcher, PID 1: not dumpable, so the task itself cannot open it
    "/proc/1/environ",
    "/proc/1/maps",
    "/proc/self/attr/current",
    "/proc/sys/net/ipv4/ip_forward",
    "/proc/sys/kernel/core_pattern",
)
DEPUTY_SCRIPT = (
    "import os\n"
    f"for p in {DEPUTY_TARGETS!r}:\n"
    "    try:\n"
    "        os.close(os.open(p, os.O_RDWR | os.O_CREAT)); print('OPENED', p)\n"
    "    except OSError as exc:\n"
    "        print('refused', p, exc.errno)\n"
    "try:\n"
    "    os.close(os.open('/dev/null', os.O_WRONLY | os.O_CREAT | os.O_TRUNC)); print('null ok')\n"
    "except OSError as exc:\n"
    "    print('null refused', exc.errno)\n"
)


async def test_the_create_rule_supervisor_opens_no_kernel_object_for_a_task(sb: Sandboxes) -> None:
    from cc_server.policy import STANDARD_DENY_CREATE_GLOBS, parse_spec

    before = pathlib.Path("/proc/sys/kernel/core_pattern").read_bytes()
    handle = sb.manager.launch(parse_spec(sb.spec()), deny_create_globs=STANDARD_DENY_CREATE_GLOBS)
    result = await sb.sh(handle, f"python3 -c {shlex.quote(DEPUTY_SCRIPT)}")
    out = result.stdout.decode()
    assert "OPENED" not in out, out
    assert out.count("refused") == len(DEPUTY_TARGETS) and "null ok" in out, out
    assert pathlib.Path("/proc/sys/kernel/core_pattern").read_bytes() == before
    # /proc/1/mem would have been opened (the launcher is not dumpable to the task, but its
    # namespace's owner may ptrace it): that refusal is the supervisor's, and reported.
    assert any(v.target == "/proc/1/mem" for v in handle.violations), handle.violations


def test_as_an_unprivileged_user_the_supervisor_opens_no_kernel_object(
    other_user: OtherUser, user_dir: pathlib.Path
) -> None:
    done = other_user.run(
        ["/usr/bin/python3", "-m", "cc_server.cli", "run", "--deny-create", "*.pem", "--bind",
         str(user_dir), "--", "/usr/bin/python3", "-c", DEPUTY_SCRIPT],
        cwd=user_dir, env={"CC_SERVER_DAEMON": "off"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "OPENED" not in done.stdout, done.stdout
    assert done.stdout.count("refused") == len(DEPUTY_TARGETS), done.stdout
    assert "null ok" in done.stdout, done.stdout


# --- the CLI daemon of another base directory, as an unprivileged user -----------------------



def test_as_an_unprivileged_user_a_daemon_in_another_base_runs_nothing(
    other_user: OtherUser, user_dir: pathlib.Path
) -> None:
    # The exploit, as the user it was found with: a daemon whose base directory lies in
    # another TMPDIR, a sandbox (its own runtime directory elsewhere) that binds that TMPDIR.
    tmpdir, xdg = user_dir / "tmp", user_dir / "xdg"
    for path in (tmpdir, xdg):
        path.mkdir(mode=0o700)
        os.chown(path, other_user.uid, other_user.gid)
    where = other_user.run(
        ["/usr/bin/python3", "-c", "from cc_server.rundir import egress_base_dir as b; print(b())"],
        cwd=user_dir, env={"TMPDIR": str(tmpdir), "XDG_RUNTIME_DIR": ""},
    )  # fmt: skip
    assert where.returncode == 0, where.stderr
    sock = os.path.join(where.stdout.strip(), "cli-attack-test.sock")
    script = daemon_attack_script(tmpdir)  # inside what the sandbox binds
    marker = pathlib.Path("/var/tmp") / unique("cc-pwned")  # /var/tmp is private inside
    log = open(user_dir / "daemon.log", "wb")  # noqa: SIM115 (closed in finally)
    daemon = subprocess.Popen(
        other_user.python("-m", "cc_server.cli_daemon", sock), cwd="/",
        env=other_user.env({"TMPDIR": str(tmpdir)}), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=log,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            assert daemon.poll() is None and time.monotonic() < deadline, (
                (user_dir / "daemon.log").read_text()
            )
            time.sleep(0.05)
        # Control: the same request from the user's own namespaces runs.
        control = other_user.run(
            ["/usr/bin/python3", str(script), sock, str(marker)], cwd=user_dir
        )
        assert marker.exists(), control.stdout + control.stderr
        marker.unlink()
        attack = other_user.run(
            ["/usr/bin/python3", "-m", "cc_server.cli", "run", "--bind", str(tmpdir), "--",
             "/usr/bin/python3", str(script), sock, str(marker)],
            cwd=user_dir, env={"XDG_RUNTIME_DIR": str(xdg), "CC_SERVER_DAEMON": "off"},
        )  # fmt: skip
        assert attack.returncode == 0, attack.stderr
        assert "visible False" in attack.stdout, attack.stdout  # hidden by device and inode
        time.sleep(0.5)
        assert not marker.exists(), attack.stdout
    finally:
        daemon.kill()
        daemon.wait()
        log.close()
        with contextlib.suppress(OSError):
            marker.unlink()


# --- the same promises through the server (its own identity: root in CI) ---------------------


async def test_through_the_server_the_identity_procfs_set_id_and_write_policy_hold(
    tmp_path: pathlib.Path,
) -> None:
    from server_kit import running_server

    work = tmp_path / "wt"
    work.mkdir()
    subprocess.run(["git", "init", "-q", str(work / "repoA")], check=True)
    before = pathlib.Path("/proc/sys/kernel/core_pattern").read_bytes()
    script = (
        "awk '/^Uid:/{print \"uid\", $2}' /proc/self/status; "
        "find /proc/sys -type f -writable 2>/dev/null | wc -l; "
        f"cd {work} && cp /bin/true x && chmod 4755 x; echo chmod=$?; "
        "echo evil > repoA/.git/hooks/pre-commit; echo hook=$?; "
        "echo {{}} > .mcp.json; echo mcp=$?; echo ok > fine.txt; echo fine=$?"
    )
    with running_server(tmp_path) as server:
        async with server.client() as http:
            spec = {"sessionId": "srv-identity", "workspaceId": "w",
                    "bindMounts": [{"hostPath": str(work)}]}  # fmt: skip
            assert (await http.post("/v1/sandboxes", json={"spec": spec})).status == 201
            reply = await http.post("/v1/sandboxes/srv-identity/exec",
                                    json={"argv": ["/bin/sh", "-c", script]})  # fmt: skip
            result = await reply.json()
    lines = result["stdout"].splitlines()
    assert lines[1:] == ["0", "chmod=1", "hook=2", "mcp=2", "fine=0"], result
    assert lines[0] == "uid 0", result  # uid 0 inside, whoever it is on the host
    actions = sorted(v["action"] for v in result["violations"])
    assert actions == ["file-write-create", "file-write-create"], result
    assert set_id_files(work) == []
    assert not (work / "repoA" / ".git" / "hooks" / "pre-commit").exists()
    assert not (work / ".mcp.json").exists() and (work / "fine.txt").exists()
    assert os.lstat(work / "fine.txt").st_uid == os.geteuid()  # the bind owner's
    assert pathlib.Path("/proc/sys/kernel/core_pattern").read_bytes() == before
