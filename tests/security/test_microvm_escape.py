"""Escapes from a real microVM, each expected to fail: the network other than through the
session's proxies, writes through a read-only bind or a protected path inside a writable one,
reading a secret inside a bind, and undoing the guest's carve-outs.

The egress half reuses the egress suite's local upstream and fake resolver: nothing is looked up
or dialled beyond the test's own servers on 127.0.0.1 (and the addresses tried from inside the
guest, which has no route to anything).
"""

from __future__ import annotations

import asyncio
import errno
import os
import pathlib

import pytest
from microvm_kit import events_of, launch, launch_with_carve_out, manager, read_until
from test_egress import ALLOWED, DENIED, LOOPBACK, FakeDns, open_upstream

from cc_server.backends.identity import SANDBOX_GID, SANDBOX_UID
from cc_server.errors import EnforcementFailed
from cc_server.microvm.mounts import GuestMount
from cc_server.microvm.proto import FrameType
from cc_server.runtime.events import SandboxState
from cc_server.runtime.handle import run_collect

pytestmark = [pytest.mark.security, pytest.mark.integration]

WGET = "timeout 10 wget -q -O -"  # (busybox 1.35 wget -T crashes with a proxy)


async def test_egress_only_through_the_proxy(tmp_path: pathlib.Path) -> None:
    dns = FakeDns({ALLOWED: [LOOPBACK], DENIED: [LOOPBACK]})
    with open_upstream() as upstream:
        m = manager(tmp_path, resolver=dns)
        try:
            handle = await launch(m, egressAllowlist=[ALLOWED, "127.0.0.1"])
            port = upstream.port
            allowed = await run_collect(handle, ["/bin/sh", "-c",
                f"{WGET} http://{ALLOWED}:{port}/"])
            assert allowed.exit_code == 0, allowed.stderr
            assert allowed.stdout.decode().strip() == upstream.marker
            denied = await run_collect(handle, ["/bin/sh", "-c",
                f"{WGET} http://{DENIED}:{port}/"])
            assert denied.exit_code != 0 and upstream.marker.encode() not in denied.stdout
            assert [v.target for v in handle.violations] == [f"{DENIED}:{port}"]
            assert all(v.action == "network-outbound" for v in handle.violations)
            # Around the proxy: the guest has loopback only; no host, gateway or outside
            # address answers, and there is no DNS to ask.
            direct = await run_collect(handle, ["/bin/sh", "-c", (
                "unset http_proxy HTTP_PROXY; ip -o link | cut -d: -f2; ip route; "
                f"for t in 10.0.2.2:{port} 1.1.1.1:80 192.168.0.1:80 169.254.169.254:80; do "
                f"{WGET} http://$t/ && echo REACHED-$t; done; "
                "nslookup example.com 10.0.2.3 >/dev/null 2>&1 && echo DNS-ANSWERED; true"
            )])
            out = direct.stdout.decode()
            assert out.split() == ["lo"], out  # one interface, no route
            assert "REACHED" not in out and "DNS-ANSWERED" not in out
            assert upstream.seen.count(f"{ALLOWED}:{port}") == 1  # the one allowed request
        finally:
            await m.aclose()


async def test_network_off_refuses_everything(tmp_path: pathlib.Path) -> None:
    dns = FakeDns({ALLOWED: [LOOPBACK]})
    with open_upstream() as upstream:
        m = manager(tmp_path, resolver=dns)
        try:
            handle = await launch(m, networkEnabled=False, egressAllowlist=[ALLOWED])
            result = await run_collect(handle, ["/bin/sh", "-c",
                f"{WGET} http://{ALLOWED}:{upstream.port}/"])
            assert result.exit_code != 0 and not upstream.seen
            assert [v.action for v in handle.violations] == ["network-outbound"]
        finally:
            await m.aclose()


async def test_read_only_and_protected_paths_hold(tmp_path: pathlib.Path) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("SECRET-KEY\n")
    (home / ".git" / "hooks").mkdir(parents=True)  # a mandatory deny-write in every root
    work = home / "work"
    (work / "protected").mkdir(parents=True)
    (work / "protected" / "file").write_text("original\n")
    m = manager(home)
    try:
        handle = await launch(
            m,
            bindMounts=[{"hostPath": str(home), "guestPath": "/home/u"}],
            protectedPaths=[str(work / "protected")],
        )
        result = await run_collect(handle, ["/bin/sh", "-c", (
            "cat /home/u/.ssh/id_ed25519; ls -a /home/u/.ssh; "
            "echo evil > /home/u/work/protected/file; "
            "echo hook > /home/u/.git/hooks/pre-commit; "
            "umount /home/u/work/protected; umount -l /home/u/.ssh; umount /home/u; "
            "mount -o remount,rw /home/u/work/protected; "
            "echo evil > /home/u/work/protected/file; cat /home/u/.ssh/id_ed25519; "
            "echo ok > /home/u/work/fine; true"
        )])
        assert b"SECRET-KEY" not in result.stdout
        assert (work / "protected" / "file").read_text() == "original\n"
        assert not (home / ".git" / "hooks" / "pre-commit").exists()
        assert (work / "fine").read_text() == "ok\n"  # the rest of the bind stays writable
    finally:
        await m.aclose()


async def test_a_command_racing_a_suspend_cannot_touch_a_protected_path(
    tmp_path: pathlib.Path,
) -> None:
    # A suspend takes the mounts off, carve-outs first; a shell whose working directory is in
    # the bind keeps it busy, so the suspend is refused and the carve-outs are put back. A
    # command looping on the protected directory must not get at it while it is off: the
    # guest's commands are frozen meanwhile (unfrozen, this loop removes it while the carve-out
    # is off, and the command could then recreate it and write through the bind). The carve-out
    # stays off for a while here: a round trip to the guest alone is too short a window to lose.
    work = tmp_path / "work"
    m = manager(tmp_path)
    try:
        handle = await launch_with_carve_out(m, work)
        put_back = handle._put_back_mounts

        async def slow_put_back(steps: tuple[GuestMount, ...] | None = None) -> None:
            await asyncio.sleep(1.0)
            await put_back(steps)

        handle._put_back_mounts = slow_put_back  # type: ignore[method-assign]
        qemu_pid = handle.qemu_pid
        async with handle.open_exec(["/bin/sh"], cwd="/work", interactive_stdin=True) as shell:
            events = events_of(shell)
            await shell.write_stdin(b"(echo loop-$((1+1)); "
                                    b"while ! rmdir /work/protected 2>/dev/null; do :; done) &\n")
            await read_until(events, "loop-2")
            for _ in range(3):
                with pytest.raises(EnforcementFailed, match="/work is in use"):
                    await handle.suspend()
                assert handle.state is SandboxState.ACTIVE and handle.qemu_pid == qemu_pid
                assert (work / "protected").is_dir()
            # Thawed: the shell answers, and the protected path still holds.
            await shell.write_stdin(b"echo evil > /work/protected/x; echo done-$((1+1))\n")
            await read_until(events, "done-2")
        assert (work / "protected").is_dir()
        assert not (work / "protected" / "x").exists()
    finally:
        await m.aclose()


async def test_a_resume_that_cannot_put_a_carve_out_back_thaws_nothing(
    tmp_path: pathlib.Path,
) -> None:
    # The guest's commands stay frozen from the suspend until every mount is back; when a
    # carve-out cannot be (its directory went away meanwhile), the VM is ended without one
    # command running with the bind on and the carve-out off.
    work = tmp_path / "work"
    m = manager(tmp_path)
    try:
        handle = await launch_with_carve_out(m, work)
        await handle.suspend()
        (work / "protected").rmdir()
        assert handle._link is not None
        sent: list[FrameType] = []
        send = handle._link.send

        def spy(channel: int, kind: FrameType, payload: bytes = b"") -> None:
            sent.append(kind)
            send(channel, kind, payload)

        handle._link.send = spy  # type: ignore[method-assign]
        with pytest.raises(EnforcementFailed, match="/work/protected"):
            await handle.resume()
        assert FrameType.MOUNT in sent and FrameType.THAW not in sent
        assert handle.state is SandboxState.ERROR and handle.qemu_pid is None
    finally:
        await m.aclose()


async def test_review_mode_binds_are_read_only_at_the_host(tmp_path: pathlib.Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    m = manager(tmp_path)
    try:
        handle = await launch(m, mode="review",
                              bindMounts=[{"hostPath": str(work), "guestPath": "/work"}])
        assert handle.mount_plan is not None
        assert all(share.read_only for share in handle.mount_plan.shares)
        result = await run_collect(handle, ["/bin/sh", "-c",
            "mount -o remount,rw /work; echo x > /work/f"])
        assert result.exit_code != 0 and not (work / "f").exists()
    finally:
        await m.aclose()


async def test_the_agent_channel_is_out_of_reach(tmp_path: pathlib.Path) -> None:
    m = manager(tmp_path)
    try:
        handle = await launch(m)
        result = await run_collect(handle, ["/bin/sh", "-c", (
            "test -e /dev/hvc0 && echo PORT-NODE-PRESENT; "
            "printf junk > /dev/vport0p0 && echo WROTE-VPORT; "
            "timeout 1 cat /dev/vport0p0 && echo READ-VPORT; "
            "mknod /tmp/port c 229 0 && echo MADE-NODE; "
            "cat /proc/1/environ && echo READ-AGENT; "
            "head -c1 /proc/1/mem && echo READ-AGENT-MEM; "
            "head -c1 /dev/mem && echo READ-MEM; "
            "kill -9 1; true"
        )])
        out = result.stdout.decode()
        for escaped in ("PORT-NODE-PRESENT", "WROTE-VPORT", "READ-VPORT", "MADE-NODE",
                        "READ-AGENT", "READ-MEM"):
            assert escaped not in out, (escaped, out, result.stderr)
        after = await run_collect(handle, ["echo", "agent-still-answers"])
        assert after.stdout == b"agent-still-answers\n"
    finally:
        await m.aclose()


# The capabilities no command may hold or regain (agent.c's dropped_caps): CAP_SYS_ADMIN,
# CAP_SYS_MODULE, CAP_SYS_RAWIO, CAP_SYS_PTRACE, CAP_SYS_BOOT, CAP_MKNOD, CAP_SYS_TIME, ...
DROPPED_CAPS = (21, 16, 17, 19, 22, 27, 25, 33, 32, 39, 38, 34, 9, 12, 24)


async def test_commands_hold_no_dropped_capability_and_cannot_regain_one(
    tmp_path: pathlib.Path,
) -> None:
    # The agent drops them once from its own bounding and inheritable sets; a command (and what
    # it execs) gets at most the bounding set, runs with no_new_privs, in the freezable cgroup.
    m = manager(tmp_path)
    try:
        handle = await launch(m)
        for argv in (["cat", "/proc/self/status", "/proc/self/cgroup"],
                     ["/bin/sh", "-c", "exec cat /proc/self/status /proc/self/cgroup"]):
            result = await run_collect(handle, argv)
            text = result.stdout.decode()
            fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
            for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
                held = int(fields[name].strip(), 16)
                assert not [c for c in DROPPED_CAPS if held >> c & 1], (name, text)
            assert fields["NoNewPrivs"].strip() == "1", text
            assert "0::/cmds" in text.splitlines(), text
        refused = await run_collect(handle, ["/bin/sh", "-c",
                                             "mount -t tmpfs x /tmp && echo MOUNTED"])
        assert b"MOUNTED" not in refused.stdout, refused
    finally:
        await m.aclose()


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(x for x in f if x.startswith("PPid:")).split()[1])


def _qemu_in(root: int) -> int:
    """QEMU's pid in the VM's host process tree (bubblewrap's child's child)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0]
            chain = _ppid(int(name))
        except OSError:
            continue
        if argv0.endswith(b"qemu-system-x86_64"):
            for _ in range(3):
                if chain == root:
                    return int(name)
                chain = _ppid(chain)
    raise AssertionError(f"no QEMU under {root}")


async def test_qemu_itself_sees_only_its_own_files(tmp_path: pathlib.Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "outside").write_text("not for QEMU\n")
    m = manager(tmp_path)
    try:
        handle = await launch(m, bindMounts=[{"hostPath": str(work), "guestPath": "/work"}])
        assert handle.qemu_pid is not None
        qemu = _qemu_in(handle.qemu_pid)
        root = f"/proc/{qemu}/root"
        assert os.path.isdir(f"{root}{work}")  # the share it serves
        assert not os.path.exists(f"{root}{tmp_path}/outside")  # nothing else of the host
        assert not os.path.exists(f"{root}/etc/hostname")
        assert os.listdir(f"{root}/etc") == ["ld.so.cache"]
        for ns in ("net", "pid", "ipc", "uts"):  # no network at all: the guest has no device
            assert os.readlink(f"/proc/{qemu}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}")
    finally:
        await m.aclose()


# Each plants a set-id file or directory in the share, through a different syscall of QEMU's
# (what QEMU 7.2 turns each into, as traced): a mode change after the fact (chmod of
# /proc/self/fd/N), a creation mode (openat, mknodat; mkdirat gets no set-id bit from a Linux
# guest, which strips it), and the mode-preserving copies and extractions (`cp -p`, `tar -p`,
# `cpio`) that do both. The sources of the copies are empty: a write by a process without
# CAP_FSETID (QEMU as the sandbox identity) would clear the bits on the host by itself.
SET_ID_ATTEMPTS = (
    "cp /bin/busybox /work/chmod-4755 && chmod 4755 /work/chmod-4755",
    "cp /bin/busybox /work/chmod-u+s && chmod u+s /work/chmod-u+s",
    "cp /bin/busybox /work/chmod-g+s && chmod g+s /work/chmod-g+s",
    "mkdir /work/dir-g+s && chmod g+s /work/dir-g+s",
    "mkdir -m 2755 /work/mkdir-mode",
    "cp /tmp/suid /work/open-mode",  # busybox cp creates with the source's mode
    "cp -p /tmp/suid /work/cp-p",
    "mknod -m 4755 /work/mknod-mode p",
    "mkfifo -m 6755 /work/mkfifo-mode",
    "tar -xpf /tmp/suid.tar -C /work/tar",
    "cd /work/cpio && cpio -i -d -m < /tmp/suid.cpio",
)
SET_ID_SOURCES = (  # in the guest's own RAM filesystem, where the guest kernel allows them
    "touch /tmp/suid && chmod 6755 /tmp/suid && tar -cpf /tmp/suid.tar -C /tmp suid"
    " && cd /tmp && echo suid | cpio -o -H newc > /tmp/suid.cpio && stat -c %a /tmp/suid"
)


def _set_id_files(root: pathlib.Path) -> list[str]:
    found = []
    for path in (root, *root.rglob("*")):
        if path.lstat().st_mode & 0o6000:
            found.append(f"{path} {oct(path.lstat().st_mode)}")
    return found


async def test_no_set_id_file_lands_on_the_host_through_a_share(tmp_path: pathlib.Path) -> None:
    # QEMU exports the share with security_model=none: the guest's modes land as QEMU's. The
    # seccomp filter QEMU's bubblewrap loads refuses a set-id bit in every mode QEMU sets
    # (backends/seccomp.filter_bpf), so each attempt gets EPERM and nothing set-id is left.
    work = tmp_path / "work"
    (work / "tar").mkdir(parents=True)
    (work / "cpio").mkdir()
    m = manager(tmp_path)
    try:
        handle = await launch(m, bindMounts=[{"hostPath": str(work), "guestPath": "/work"}])
        setup = await run_collect(handle, ["/bin/sh", "-c", SET_ID_SOURCES])
        assert setup.stdout.strip() == b"6755", setup.stderr
        for index, attempt in enumerate(SET_ID_ATTEMPTS):
            result = await run_collect(handle, ["/bin/sh", "-c",
                f"{attempt}; echo status=$?"])
            out = result.stdout.decode()
            assert "status=0" not in out, (attempt, out, result.stderr)
            assert b"Operation not permitted" in result.stderr, (attempt, result.stderr)
            assert not _set_id_files(work), (index, attempt, _set_id_files(work))
        # The share still takes ordinary files and modes.
        plain = await run_collect(handle, ["/bin/sh", "-c",
            "cp /bin/busybox /work/plain && chmod 755 /work/plain && mkdir -m 700 /work/d"])
        assert plain.exit_code == 0, plain.stderr
        assert (work / "plain").stat().st_mode & 0o7777 == 0o755
        assert (work / "d").stat().st_mode & 0o7777 == 0o700
    finally:
        await m.aclose()
    assert not _set_id_files(work)


def _host_ids(pid: int) -> tuple[list[int], list[int]]:
    """A process's real, effective, saved and filesystem uids and gids, as the host sees them."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return ([int(x) for x in fields["Uid"].split()], [int(x) for x in fields["Gid"].split()])


async def test_qemu_is_not_host_root_and_its_proc_sys_is_read_only(
    tmp_path: pathlib.Path,
) -> None:
    # A root server's QEMU runs as the sandbox identity (cc-identity), so it owns no host-global
    # kernel knob; whoever it runs as, its /proc/sys and the other knobs are read-only.
    work = tmp_path / "work"
    work.mkdir()
    m = manager(tmp_path)
    try:
        handle = await launch(m, bindMounts=[{"hostPath": str(work), "guestPath": "/work"}])
        assert handle.qemu_pid is not None and handle.pool is not None
        qemu = _qemu_in(handle.qemu_pid)
        uids, gids = _host_ids(qemu)
        if os.geteuid() != 0:
            assert uids == [os.geteuid()] * 4
        elif handle.pool.qemu_identity is None:
            assert handle.pool.config.accel == "kvm", handle.pool.identity
            pytest.skip("/dev/kvm opens for root only: QEMU under KVM stays root here")
        else:
            assert uids == [SANDBOX_UID] * 4 and gids == [SANDBOX_GID] * 4, (uids, gids)
        knobs = ("sys/kernel/core_pattern", "sys/vm/drop_caches", "sysrq-trigger")
        for knob in (k for k in knobs if os.path.exists(f"/proc/{k}")):  # as the host has them
            # Opened through QEMU's own root, by the host's root: read-only mounts refuse it
            # whoever asks (nothing is written: the open alone is refused).
            with pytest.raises(OSError) as refused:
                os.close(os.open(f"/proc/{qemu}/root/proc/{knob}", os.O_WRONLY))
            assert refused.value.errno == errno.EROFS, (knob, refused.value)
    finally:
        await m.aclose()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a root server: shares of another owner")
async def test_what_the_guest_creates_in_a_share_belongs_to_the_share_owner(
    tmp_path: pathlib.Path,
) -> None:
    # A root server's QEMU writes through an idmapped stage of the share: a file the guest
    # creates belongs on the host to the share's owner (here uid 4321), not to root.
    owner = 4321
    work = tmp_path / "work"
    work.mkdir()
    os.chown(work, owner, owner)
    m = manager(tmp_path)
    try:
        handle = await launch(m, bindMounts=[{"hostPath": str(work), "guestPath": "/work"}])
        result = await run_collect(handle, ["/bin/sh", "-c",
            "echo x > /work/file && mkdir /work/dir && echo y > /work/dir/inner"])
        assert result.exit_code == 0, result.stderr
        for name in ("file", "dir", "dir/inner"):
            st = (work / name).lstat()
            assert (st.st_uid, st.st_gid) == (owner, owner), (name, st.st_uid, st.st_gid)
    finally:
        await m.aclose()
