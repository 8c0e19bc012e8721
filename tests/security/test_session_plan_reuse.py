"""A session sandbox's plan is made again only when a host fact it was planned from has changed
(backends/session_plan.py, backends/host_reads.py): between two commands of one session, each
host fact below changes, and the second command must get the policy a fresh sandbox would, judged
on the host (what the command read or wrote, and the mount table of the sandbox it ran in).
"""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest
from escape_kit import Sandboxes, attempts, outcomes, output, unique
from stamp_kit import past_the_tick, stampable

from cc_server.backends import host_reads
from cc_server.rundir import egress_base_dir
from cc_server.runtime.handle import CollectedResult, SandboxHandle

pytestmark = [pytest.mark.security, pytest.mark.integration]

MOUNT = "/usr/bin/mount"  # util-linux, by absolute path: the test's own host-side step
UMOUNT = "/usr/bin/umount"


def _unescape(field: str) -> str:
    """A mountinfo path field (spaces, tabs, newlines and backslashes octal-escaped)."""
    return field.encode().decode("unicode_escape")


def _sandbox_mounts(handle: SandboxHandle) -> dict[str, str]:
    """Mount point -> filesystem type in the mount namespace of the session's current sandbox,
    read on the host from its PID 1 (bwrap's one child)."""
    pid = handle.details["sandboxPid"]
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
        (launcher,) = f.read().split()
    mounts: dict[str, str] = {}
    with open(f"/proc/{launcher}/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            mounts[_unescape(fields[4])] = fields[fields.index("-") + 1]
    return mounts


async def _twice(sb: Sandboxes, handle: SandboxHandle, script: str) -> CollectedResult:
    """Run `script` twice: the second run checks the first plan's reads again, as every later
    command of a session does."""
    await sb.sh(handle, script)
    return await sb.sh(handle, script)


def _bind_home(sb: Sandboxes) -> list[dict[str, str]]:
    return [{"hostPath": str(sb.worktree)}, {"hostPath": str(sb.home)}]


async def test_a_secret_that_appears_in_a_bound_directory_is_masked_for_the_next_command(
    sb: Sandboxes,
) -> None:
    handle = sb.launch(bindMounts=_bind_home(sb))
    netrc = sb.home / ".netrc"
    first = await _twice(sb, handle, f"cat {netrc} 2>/dev/null; echo ran")
    assert first.stdout == b"ran\n", output(first)  # control: nothing there yet
    marker = unique("CC-SECRET-NETRC")
    netrc.write_text(f"machine example.com password {marker}\n")
    second = await sb.sh(handle, attempts(read=f"grep -q {marker} {netrc}"))
    assert outcomes(second) == {"read": "fail"}, output(second)
    assert str(netrc) in _sandbox_mounts(handle)  # masked in the sandbox that ran it
    assert marker in netrc.read_text()


async def test_a_secret_that_appears_where_names_are_known_by_a_stamp_is_masked_next(
    sb: Sandboxes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The names a plan asked in a directory are taken from its stamp (device, inode, ctime)
    while that is the same; a secret made there (and one below a missing ancestor) is an entry
    added, a new ctime."""
    monkeypatch.setattr(host_reads, "STAMP_AGE_NS", 0)  # trusted at once (see past_the_tick)
    handle = sb.launch(bindMounts=_bind_home(sb))
    await _twice(sb, handle, "true")
    past_the_tick(sb.home)
    await sb.sh(handle, "true")
    reading = handle._reading
    assert reading is not None and (reading.reads.stamped > 0 or not stampable(sb.home))
    netrc, keys = sb.home / ".netrc", sb.home / ".config" / "gh" / "hosts.yml"
    marker = unique("CC-SECRET-STAMP")
    netrc.write_text(f"machine example.com password {marker}\n")
    keys.parent.mkdir(parents=True)
    keys.write_text(f"oauth_token: {marker}\n")
    result = await sb.sh(handle, attempts(netrc=f"grep -q {marker} {netrc}",
                                          gh=f"grep -q {marker} {keys}"))
    assert outcomes(result) == {"netrc": "fail", "gh": "fail"}, output(result)
    mounts = _sandbox_mounts(handle)
    assert str(netrc) in mounts and str(keys.parent) in mounts, mounts
    assert marker in netrc.read_text() and marker in keys.read_text()


async def test_a_protected_path_that_appears_is_read_only_for_the_next_command(
    sb: Sandboxes,
) -> None:
    ledger = sb.worktree / "ledger"
    handle = sb.launch(protectedPaths=[str(ledger)])
    await _twice(sb, handle, "true")
    ledger.mkdir()
    (ledger / "entry").write_text("original\n")
    result = await sb.sh(
        handle,
        attempts(control="echo x > notes.txt", write=f"echo changed > {ledger}/entry"),
    )
    assert outcomes(result) == {"control": "ok", "write": "fail"}, output(result)
    assert (ledger / "entry").read_text() == "original\n"
    assert str(ledger) in _sandbox_mounts(handle)  # bound read-only over the writable root


async def test_a_secret_name_that_appears_as_a_symlink_masks_the_directory_it_names(
    sb: Sandboxes,
) -> None:
    stash = sb.home / "stash"
    stash.mkdir()
    marker = unique("CC-SECRET-GNUPG")
    (stash / "key").write_text(f"{marker}\n")
    handle = sb.launch(bindMounts=_bind_home(sb))
    first = await _twice(sb, handle, f"cat {stash}/key")
    assert marker.encode() in first.stdout, output(first)  # control: not a secret yet
    (sb.home / ".gnupg").symlink_to(stash)  # the secret's name now leads there
    second = await sb.sh(handle, attempts(read=f"grep -q {marker} {stash}/key",
                                          via_name=f"grep -q {marker} {sb.home}/.gnupg/key"))
    assert outcomes(second) == {"read": "fail", "via_name": "fail"}, output(second)
    assert _sandbox_mounts(handle).get(str(stash)) == "tmpfs"


async def test_a_directory_renamed_over_another_gets_its_protection_for_the_next_command(
    sb: Sandboxes,
) -> None:
    dot_git = sb.worktree / ".git"
    dot_git.mkdir()  # empty: nothing in it to protect yet
    staged = sb.worktree / "staged"
    (staged / "hooks").mkdir(parents=True)
    (staged / "config").write_text("[core]\n")
    handle = sb.launch()
    await _twice(sb, handle, "true")
    os.rename(staged, dot_git)  # over the empty .git: a repository's hooks and config now
    result = await sb.sh(
        handle,
        attempts(
            control="echo x > notes.txt",
            hook="echo 'touch /tmp/pwned' > .git/hooks/pre-commit",
            config="echo '[core] hooksPath = /tmp' >> .git/config",
        ),
    )
    assert outcomes(result) == {"control": "ok", "hook": "fail", "config": "fail"}, output(result)
    assert not (dot_git / "hooks" / "pre-commit").exists()
    assert (dot_git / "config").read_text() == "[core]\n"
    mounts = _sandbox_mounts(handle)
    assert str(dot_git / "hooks") in mounts and str(dot_git / "config") in mounts


async def test_a_mount_of_the_servers_base_directory_under_a_bound_path_is_hidden(
    sb: Sandboxes,
) -> None:
    assert os.geteuid() == 0, "this test mounts on the host: run the security suite as root"
    peek = sb.worktree / "peek"
    peek.mkdir()
    handle = sb.launch()
    first = await _twice(sb, handle, f"ls -A {peek}; echo listed")
    assert first.stdout == b"listed\n", output(first)  # control: an empty directory
    base = pathlib.Path(egress_base_dir())  # the sessions' sockets live here
    assert any(p.name.startswith("egress-") for p in base.iterdir())
    subprocess.run([MOUNT, "--bind", str(base), str(peek)], check=True)
    try:
        second = await sb.sh(handle, f"ls -A {peek}; echo listed")
        assert second.stdout == b"listed\n", output(second)
        assert _sandbox_mounts(handle).get(str(peek)) == "tmpfs"
    finally:
        subprocess.run([UMOUNT, "-l", str(peek)], check=True)


async def test_a_base_directory_registered_inside_a_bound_path_is_hidden(
    sb: Sandboxes,
) -> None:
    # A plan is given again while the views no bind shows change (backends/bubblewrap.py
    # planned_egress); one inside a bind is a change to the plan.
    runtime = sb.worktree / "runtime"
    runtime.mkdir()
    handle = sb.launch()
    first = await _twice(sb, handle, f"ls -A {runtime}; echo listed")
    assert first.stdout == b"listed\n", output(first)  # control: nothing there yet
    base = pathlib.Path(egress_base_dir({"XDG_RUNTIME_DIR": str(runtime)}))  # registered
    marker = unique("CC-BASE-TOKEN")
    (base / "token").write_text(f"{marker}\n")
    second = await sb.sh(handle, attempts(read=f"grep -q {marker} {base}/token"))
    assert outcomes(second) == {"read": "fail"}, output(second)
    assert _sandbox_mounts(handle).get(str(base)) == "tmpfs"
    assert marker in (base / "token").read_text()
