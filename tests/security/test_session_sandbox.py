"""One sandbox per session (runtime/session_sandbox.py): the commands of a session run in one
long-lived bubblewrap sandbox, and nothing one command leaves or changes reaches the next one
unchecked: its processes die with it, a host fact it changes gets a new sandbox planned from
scratch, and the launcher serving the commands cannot be killed, read or bypassed from inside.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from escape_kit import (
    RUN_TIMEOUT_S,
    Sandboxes,
    attempts,
    grep_pattern,
    host_pids_with,
    outcomes,
    output,
    shell_word,
    unique,
    wait_until,
)

from cc_server.policy import STANDARD_DENY_CREATE_GLOBS, parse_spec
from cc_server.runtime.handle import run_collect
from cc_server.runtime.session_sandbox import MAX_REQUEST_BYTES

pytestmark = [pytest.mark.security, pytest.mark.integration]

LEFTOVERS = {
    "background": "/bin/sh -c {body} </dev/null >/dev/null 2>&1 &",
    "setsid": "setsid /bin/sh -c {body} </dev/null >/dev/null 2>&1 &",
    "nohup": "nohup /bin/sh -c {body} </dev/null >/dev/null 2>&1 &",
    "double-fork": "( ( /bin/sh -c {body} </dev/null >/dev/null 2>&1 & ) & )",
    "holds-stdout": "( /bin/sh -c {body} & )",
    # Still forking while its keeper kills: every new process must be found too.
    "fork-loop": "( /bin/sh -c {body} & while :; do (sleep 300 &); done ) "
    "</dev/null >/dev/null 2>&1 &",
}


def _start_leftover(marker: str, how: str) -> str:
    """A script that leaves a `sleep 300` carrying `marker` behind and waits until it runs."""
    body = "'sleep 300; : '\"$m\""  # the marker reaches the child's argv, not the script's
    pattern = grep_pattern(marker)
    return f"""
        m={shell_word(marker)}
        {LEFTOVERS[how].format(body=body)}
        for i in 1 2 3 4 5 6 7 8 9 10; do
            grep -qs '{pattern}' /proc/[0-9]*/cmdline && break; sleep 0.1
        done
        grep -qs '{pattern}' /proc/[0-9]*/cmdline && echo leftover-running
    """


def _sees(marker: str) -> str:
    return f"grep -qs '{grep_pattern(marker)}' /proc/[0-9]*/cmdline && echo seen || echo unseen"


async def test_the_commands_of_a_session_share_one_sandbox(sb: Sandboxes) -> None:
    # Control for the tests below: they would prove nothing if every command got a new sandbox.
    handle = sb.launch()
    await sb.sh(handle, "echo from-the-first > /tmp/note")
    sandbox = handle.details["sandboxPid"]
    result = await sb.sh(handle, "cat /tmp/note")
    assert result.stdout == b"from-the-first\n"
    assert handle.details["sandboxPid"] == sandbox


@pytest.mark.parametrize("how", sorted(LEFTOVERS))
async def test_what_a_command_leaves_running_is_dead_when_its_exit_is_reported(
    sb: Sandboxes, how: str
) -> None:
    handle = sb.launch()
    marker = unique(f"cc-leftover-{how}")
    result = await sb.sh(handle, _start_leftover(marker, how))
    assert "leftover-running" in output(result), output(result)  # control: it really ran
    assert result.exit_code == 0
    # No waiting: the exit is reported only after the command's keeper killed and reaped it.
    assert host_pids_with(marker) == []
    after = await sb.sh(handle, _sees(marker))
    assert after.stdout == b"unseen\n"


async def test_a_killed_command_takes_what_it_started_and_the_sandbox_stays(
    sb: Sandboxes,
) -> None:
    handle = sb.launch()
    await sb.sh(handle, "true")
    sandbox = handle.details["sandboxPid"]
    marker = unique("cc-leftover-killed")
    script = _start_leftover(marker, "setsid") + "\nsleep 300"
    result = await run_collect(handle, ["/bin/sh", "-c", script], timeout_s=2.0)
    assert result.killed == "timeout" and result.exit_code == 137, result
    assert "leftover-running" in output(result), output(result)
    assert host_pids_with(marker) == []
    after = await sb.sh(handle, _sees(marker))
    assert after.stdout == b"unseen\n"
    assert handle.details["sandboxPid"] == sandbox


async def test_killing_its_keeper_gets_the_session_a_new_sandbox(sb: Sandboxes) -> None:
    # The commands share a uid, so a command can kill the process that would clean up after
    # it. What it leaves then cannot be told apart inside; the sandbox is retired instead.
    handle = sb.launch()
    await sb.sh(handle, "true")
    sandbox = handle.details["sandboxPid"]
    marker = unique("cc-leftover-keeper")
    script = _start_leftover(marker, "setsid") + '\nkill -9 "$PPID"; sleep 300'
    result = await run_collect(handle, ["/bin/sh", "-c", script], timeout_s=RUN_TIMEOUT_S)
    assert "leftover-running" in output(result), output(result)
    assert result.exit_code == 137, result
    assert await wait_until(lambda: not host_pids_with(marker)), host_pids_with(marker)
    after = await sb.sh(handle, _sees(marker))
    assert after.stdout == b"unseen\n"
    assert handle.details["sandboxPid"] != sandbox


async def test_a_protected_path_one_command_creates_is_read_only_for_the_next(
    sb: Sandboxes,
) -> None:
    # `.git/hooks` is denied for writing in every writable root, but only a path that exists
    # when a sandbox is planned can be mounted read-only. The next command's plan sees it. A
    # command cannot make a new `.git` any more (the supervisor's path rules refuse it: see
    # test_write_policy.py), so it appears here as the host would make it, between commands.
    handle = sb.launch()
    created = await sb.sh(handle, "mkdir -p .git/hooks && echo created")
    assert created.stdout == b"", output(created)  # refused inside
    (sb.worktree / ".git" / "hooks").mkdir(parents=True)
    sandbox = handle.details["sandboxPid"]
    result = await sb.sh(
        handle,
        attempts(
            control="echo x > notes.txt",
            write_hook="echo x > .git/hooks/pre-commit",
            replace_hooks="mv .git/hooks .git/old && mkdir .git/hooks",
        ),
    )
    assert outcomes(result) == {"control": "ok", "write_hook": "fail", "replace_hooks": "fail"}
    assert not (sb.worktree / ".git" / "hooks" / "pre-commit").exists()
    assert handle.details["sandboxPid"] != sandbox


async def test_the_launcher_cannot_be_killed_read_or_stopped_from_inside(sb: Sandboxes) -> None:
    handle = sb.launch()
    result = await sb.sh(
        handle,
        attempts(
            control="cat /proc/self/environ",
            read_environ="cat /proc/1/environ",
            read_mem="head -c 1 /proc/1/mem",
            follow_fds='for f in /proc/1/fd/*; do readlink "$f" && exit 0; done; exit 1',
            open_fds='for f in /proc/1/fd/*; do cat "$f" </dev/null && exit 0; done; exit 1',
        )
        + "\nkill -KILL 1; kill -STOP 1; kill -TERM 1; echo signalled",
    )
    assert outcomes(result) == {
        "control": "ok",
        "read_environ": "fail",
        "read_mem": "fail",
        "follow_fds": "fail",
        "open_fds": "fail",
    }
    assert b"signalled" in result.stdout
    sandbox = handle.details["sandboxPid"]
    after = await sb.sh(handle, "echo still-served")
    assert after.stdout == b"still-served\n"
    assert handle.details["sandboxPid"] == sandbox


async def test_commands_run_side_by_side_in_one_sandbox(sb: Sandboxes) -> None:
    handle = sb.launch()
    results = await asyncio.gather(
        *(sb.sh(handle, f"sleep 0.3; echo {i}") for i in range(4))
    )
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(4)]
    assert all(r.exit_code == 0 for r in results)


async def test_a_command_too_big_for_one_request_still_runs_sandboxed(sb: Sandboxes) -> None:
    handle = sb.launch()
    await sb.sh(handle, "true")
    sandbox = handle.details["sandboxPid"]
    half = MAX_REQUEST_BYTES // 2  # one word may not exceed 128 KiB (MAX_ARG_STRLEN)
    result = await sb.sh(
        handle,
        attempts(read_key=f"cat {sb.ssh_key}") + '\nprintf %s "$BIG1$BIG2" | wc -c',
        env={"BIG1": "x" * half, "BIG2": "y" * half},
    )
    assert outcomes(result) == {"read_key": "fail"}
    assert result.stdout.splitlines()[-1].strip() == str(2 * half).encode()
    assert handle.details["sandboxPid"] == sandbox  # it had a sandbox of its own


async def test_destroy_ends_the_session_sandbox_and_everything_in_it(sb: Sandboxes) -> None:
    handle = sb.launch()
    marker = unique("cc-session-destroy")
    await sb.sh(handle, "true")
    sandbox = handle.details["sandboxPid"]
    assert isinstance(sandbox, int)
    script = _start_leftover(marker, "setsid") + "\nsleep 300"
    async with handle.open_exec(["/bin/sh", "-c", script]):
        assert await wait_until(lambda: bool(host_pids_with(marker)), timeout_s=5.0)
        await handle.destroy()
    assert host_pids_with(marker) == []
    assert await wait_until(lambda: not _alive(sandbox)), f"bwrap {sandbox} still runs"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("change", ["moved-away", "replaced-file"])
async def test_a_secret_the_host_moves_under_a_mask_stays_masked_for_the_next_command(
    sb: Sandboxes, change: str
) -> None:
    # The masks are mounts on the secrets' paths. Moving the masked directory away on the host
    # carries the mask along with it, and renaming a file over a masked file detaches its mask;
    # the same plan then no longer describes the running sandbox, whose mount table changed.
    netrc = sb.home / ".netrc"  # a file: masked by binding /dev/null over it
    netrc.write_text(f"machine example.com password {sb.secret_marker}\n")
    handle = sb.launch(bindMounts=[{"hostPath": str(sb.home)}, {"hostPath": str(sb.worktree)}])
    before = await sb.sh(handle, f"cat {sb.ssh_key} {netrc}; cat {sb.worktree}/README")
    assert b"worktree control file" in before.stdout  # control
    assert sb.secret_marker not in output(before)
    sandbox = handle.details["sandboxPid"]
    fresh = unique("CC-SECRET-NEW")
    if change == "moved-away":
        (sb.home / ".ssh").rename(sb.home / ".ssh-old")
        (sb.home / ".ssh").mkdir()
        sb.ssh_key.write_text(fresh)
    else:
        (sb.home / "new-netrc").write_text(fresh)
        (sb.home / "new-netrc").rename(netrc)
    after = await sb.sh(handle, f"cat {sb.ssh_key} {netrc}; cat {sb.worktree}/README")
    assert b"worktree control file" in after.stdout
    assert fresh not in output(after), output(after)
    assert handle.details["sandboxPid"] != sandbox, output(after)


async def test_a_refused_create_is_reported_to_the_command_that_made_it(sb: Sandboxes) -> None:
    # With create-time globs the session's commands share one sandbox and one supervisor; each
    # refusal still goes to the command whose process made the call, even from a process it
    # left in the background, and before that command's exit.
    handle = sb.manager.launch(
        parse_spec(sb.spec()), deny_create_globs=list(STANDARD_DENY_CREATE_GLOBS)
    )
    await sb.sh(handle, "true")
    sandbox = handle.details["sandboxPid"]
    wt = sb.worktree
    offender = sb.sh(handle, f"sleep 0.3; echo > {wt}/a.pem; (setsid sh -c 'echo > {wt}/b.key' &); "
                             f"sleep 0.3; echo done")
    bystander = sb.sh(handle, f"sleep 0.3; echo > {wt}/fine.txt; sleep 0.5; echo done")
    bad, good = await asyncio.gather(offender, bystander)
    assert sorted(v.target for v in bad.violations) == [f"{wt}/a.pem", f"{wt}/b.key"], bad
    assert good.violations == () and (wt / "fine.txt").exists(), good
    assert not (wt / "a.pem").exists() and not (wt / "b.key").exists()
    assert handle.details["sandboxPid"] == sandbox


async def test_a_sandbox_whose_launcher_does_not_answer_is_closed_on_kill(sb: Sandboxes) -> None:
    # The end of a command is reported from inside the sandbox. If nothing answers a kill (here
    # the launcher is stopped from the host), the whole sandbox goes, and the command with it.
    handle = sb.launch()
    marker = unique("cc-session-wedged")
    async with handle.open_exec(["/bin/sh", "-c", f": {marker}; sleep 300"]) as execution:
        assert await wait_until(lambda: bool(host_pids_with(marker)), timeout_s=5.0)
        sandbox = handle._in_sandbox.get(execution)  # white box: the launcher's host pid
        assert sandbox is not None and sandbox._launcher_pid is not None
        os.kill(sandbox._launcher_pid, signal.SIGSTOP)
        await execution.kill()
    assert execution.exit_code == 137
    assert host_pids_with(marker) == []
    assert not sandbox.alive
    after = await sb.sh(handle, "echo served")  # the session goes on, in a new sandbox
    assert after.stdout == b"served\n"


async def test_a_refusal_under_a_killed_keeper_is_still_reported(sb: Sandboxes) -> None:
    # A process whose keeper was killed from inside runs under no keeper the runtime knows: its
    # refusal cannot be given to one command, and is kept on the handle (and sent to every
    # command running then) instead of being lost.
    handle = sb.manager.launch(
        parse_spec(sb.spec()), deny_create_globs=list(STANDARD_DENY_CREATE_GLOBS)
    )
    wt = sb.worktree
    script = f'kill -9 "$PPID"; sleep 0.2; echo > {wt}/orphan.pem; echo created=$?'
    result = await run_collect(handle, ["/bin/sh", "-c", script], timeout_s=RUN_TIMEOUT_S)
    assert result.exit_code == 137, result
    assert not (wt / "orphan.pem").exists()
    assert await wait_until(
        lambda: [v.target for v in handle.violations] == [f"{wt}/orphan.pem"]
    ), handle.violations
