"""Reading secrets: every route to a planted key must come back empty.

Each test plants a key with a unique marker under a fake $HOME, tries to read it from inside the
sandbox, and asserts the marker appears nowhere in the output, next to a control read that proves
the same command did run and can read what it is allowed to.
"""

from __future__ import annotations

import pytest
from escape_kit import Sandboxes, output, unique

from cc_server.runtime.session_sandbox import MAX_REQUEST_BYTES

pytestmark = [pytest.mark.security, pytest.mark.integration]

CONTROL = "worktree control file"


def _assert_control_and_no_secret(text: str, marker: str) -> None:
    assert CONTROL in text, f"control read failed, so the command may not have run:\n{text}"
    assert marker not in text, f"secret leaked into the sandbox:\n{text}"


async def test_secret_in_unbound_home_is_not_readable_by_path(sb: Sandboxes) -> None:
    result = await sb.run(
        f"""
        cat {sb.worktree}/README
        cat {sb.ssh_key} {sb.home}/.aws/credentials
        ls -A {sb.home}; echo "home-entries=$(ls -A {sb.home} | wc -l)"
        grep -rs {sb.secret_marker!r} {sb.home} /tmp /var/tmp
        """
    )
    text = output(result)
    _assert_control_and_no_secret(text, sb.secret_marker)
    assert "home-entries=0" in text, text
    assert "No such file" in text, text


async def test_symlink_in_worktree_to_secret_is_not_followed_to_the_host(sb: Sandboxes) -> None:
    (sb.worktree / "key").symlink_to(sb.ssh_key)
    (sb.worktree / "sshdir").symlink_to(sb.home / ".ssh")
    (sb.worktree / "readme-link").symlink_to(sb.worktree / "README")
    result = await sb.run(
        f"""
        cd {sb.worktree}
        cat readme-link
        cat key
        cat sshdir/id_ed25519
        ls -A sshdir/
        """
    )
    text = output(result)
    _assert_control_and_no_secret(text, sb.secret_marker)
    assert "No such file" in text, text


@pytest.mark.parametrize("proc_root", ["/proc/self/root", "/proc/$$/root"])
async def test_secret_is_not_readable_through_proc_root(sb: Sandboxes, proc_root: str) -> None:
    result = await sb.run(
        f"""
        cat {proc_root}{sb.worktree}/README
        cat {proc_root}{sb.ssh_key}
        cat {proc_root}{sb.home}/.aws/credentials
        echo "home-entries=$(ls -A {proc_root}{sb.home}/ | wc -l)"
        """
    )
    text = output(result)
    _assert_control_and_no_secret(text, sb.secret_marker)
    assert "No such file" in text and "home-entries=0" in text, text


async def test_pid_1_is_inside_the_sandbox(sb: Sandboxes) -> None:
    # /proc/1/root is only harmless if PID 1 is the sandbox's own init, not the host's. Here it
    # is the launcher serving the session's commands, which no command may even look into.
    marker = unique("inside-file")
    (sb.worktree / "inside").write_text(marker)
    result = await sb.run(
        "cat /proc/sys/kernel/hostname; tr '\\0' ' ' </proc/1/cmdline; echo; "
        f"cat {sb.worktree}/inside; echo; "
        f"cat /proc/1/root{sb.worktree}/inside; ls /proc/1/root/; cat /proc/1/root{sb.ssh_key}"
    )
    text = output(result)
    assert marker in text, text  # control: the file is readable by its own path
    assert "cc-sandbox" in text, text
    assert "/run/cc-create/launcher --egress" in text and "--serve" in text, text
    assert text.count("Permission denied") == 3, text
    assert sb.secret_marker not in text, text


async def test_a_sandbox_of_its_own_has_its_own_pid_1(sb: Sandboxes) -> None:
    # A command too big for one request to the session's sandbox gets a sandbox of its own,
    # whose PID 1 (bwrap's init) can be looked into: its root must be the sandbox's.
    marker = unique("inside-file")
    (sb.worktree / "inside").write_text(marker)
    result = await sb.sh(
        sb.launch(),
        f"cat /proc/1/root{sb.worktree}/inside; echo; ls /proc/1/root/; "
        f"cat /proc/1/root{sb.ssh_key}",
        env={"PAD1": "x" * (MAX_REQUEST_BYTES // 2), "PAD2": "y" * (MAX_REQUEST_BYTES // 2)},
    )
    text = output(result)
    assert marker in text, text  # PID 1 sees the sandbox's mounts
    assert "root\n" not in text.split(marker)[-1], text  # the host's /root is not there
    assert sb.secret_marker not in text and "No such file" in text, text


@pytest.mark.parametrize(
    "how", ["home-writable", "home-read-only", "parent-writable", "home-and-worktree"]
)
async def test_secret_stays_masked_when_home_is_bound(sb: Sandboxes, how: str) -> None:
    binds = {
        "home-writable": [{"hostPath": str(sb.home)}],
        "home-read-only": [{"hostPath": str(sb.home), "readOnly": True}],
        "parent-writable": [{"hostPath": str(sb.root)}],
        "home-and-worktree": [{"hostPath": str(sb.home)}, {"hostPath": str(sb.worktree)}],
    }[how]
    (sb.home / "README").write_text(CONTROL + "\n")
    key_before = sb.ssh_key.read_bytes()
    result = await sb.run(
        f"""
        cat {sb.home}/README
        cat {sb.ssh_key} {sb.home}/.aws/credentials
        cp {sb.ssh_key} {sb.home}/stolen
        tar -cf - -C {sb.home} .ssh .aws | tar -tvf -
        find {sb.home} -type f -exec cat {{}} +
        grep -rs {sb.secret_marker!r} {sb.home}
        rm -rf {sb.home}/.ssh/*; mv {sb.home}/.ssh {sb.home}/ssh-moved
        echo "ssh-entries=$(ls -A {sb.home}/.ssh | wc -l)"
        """,
        bindMounts=binds,
    )
    text = output(result)
    _assert_control_and_no_secret(text, sb.secret_marker)
    assert "ssh-entries=0" in text, text
    assert sb.ssh_key.read_bytes() == key_before
    assert not (sb.home / "ssh-moved").exists()
    stolen = sb.home / "stolen"
    assert not stolen.exists() or sb.secret_marker not in stolen.read_text()


@pytest.mark.parametrize("inner", [".ssh", ".ssh/id_ed25519", ".ssh/keys", ".aws"])
async def test_a_bind_at_or_inside_a_secret_path_does_not_expose_it(
    sb: Sandboxes, inner: str
) -> None:
    # The deny-read set wins over the spec's binds: binding ~/.ssh (or a file or directory
    # inside it) must not turn the mask off.
    (sb.home / ".ssh" / "keys").mkdir()
    (sb.home / ".ssh" / "keys" / "deploy").write_text(sb.secret_marker)
    result = await sb.run(
        f"""
        cat {sb.worktree}/README
        cat {sb.home}/{inner}
        find {sb.home} -type f -exec cat {{}} +
        grep -rs {sb.secret_marker!r} {sb.home}
        """,
        bindMounts=[
            {"hostPath": str(sb.worktree)},
            {"hostPath": str(sb.home / inner), "readOnly": True},
        ],
    )
    _assert_control_and_no_secret(output(result), sb.secret_marker)


async def test_etc_shadow_is_not_readable(sb: Sandboxes) -> None:
    with open("/etc/shadow") as f:
        host_shadow = f.read()
    assert host_shadow.startswith("root:"), "the host's /etc/shadow is the thing we protect"
    result = await sb.run(
        f"""
        cat {sb.worktree}/README
        echo "passwd-root=$(grep -c '^root:' /etc/passwd)"
        cat /etc/shadow /etc/gshadow /proc/self/root/etc/shadow /proc/1/root/etc/shadow
        cp /etc/shadow {sb.worktree}/shadow-copy
        """
    )
    text = output(result)
    assert CONTROL in text and "passwd-root=1" in text, text
    # The mask is an empty, unopenable file: "Permission denied" or nothing, never a hash line.
    for line in host_shadow.splitlines():
        assert line not in text, text
    copy = sb.worktree / "shadow-copy"
    assert not copy.exists() or copy.read_text() == ""
    with open("/etc/shadow") as f:
        assert f.read() == host_shadow


async def test_host_devices_and_sysfs_are_not_exposed(sb: Sandboxes) -> None:
    result = await sb.run(
        f"""
        cat {sb.worktree}/README
        echo "dev=$(ls /dev | tr '\\n' ' ')"
        echo "sys=$(ls -A /sys 2>/dev/null | wc -l)"
        head -c 1 /dev/mem; head -c 1 /dev/kmsg; head -c 1 /dev/vda; head -c 1 /dev/sda
        echo "urandom=$(head -c 4 /dev/urandom | wc -c)"
        """
    )
    text = output(result)
    assert CONTROL in text and "urandom=4" in text, text  # control: the safe devices work
    devices = set(text.split("dev=")[1].split("\n")[0].split())
    assert devices <= {
        "console",
        "core",
        "fd",
        "full",
        "mqueue",
        "null",
        "ptmx",
        "pts",
        "random",
        "shm",
        "stderr",
        "stdin",
        "stdout",
        "tty",
        "urandom",
        "zero",
    }, devices
    assert "sys=0" in text, text
