"""The Claude Code hooks of a dispatch run, run as Claude Code runs them (a shell command with
the hook's JSON on stdin), and the server's reading of what they report."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

from cc_server.dispatch.agent_hooks import REFUSALS_FILE, hook_settings, take_refusals
from cc_server.dispatch.violations import NOTICE_FILE, NOTICE_PREFIX, ViolationSource


def _run_hook(command: str, payload: dict[str, object]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/sh", "-c", command], input=json.dumps(payload), text=True,
                          capture_output=True, check=False, timeout=30)


def _write_scope(tmp_path: pathlib.Path) -> tuple[str, pathlib.Path, pathlib.Path]:
    state, work = tmp_path / "state", tmp_path / "work"
    state.mkdir()
    work.mkdir()
    hooks = hook_settings(str(state), write_roots=[str(work), str(state)])["hooks"]
    [entry] = hooks["PreToolUse"]
    assert entry["matcher"] == "Write|Edit|MultiEdit|NotebookEdit"
    return entry["hooks"][0]["command"], state, work


def test_a_write_inside_a_writable_bind_passes(tmp_path: pathlib.Path) -> None:
    command, state, work = _write_scope(tmp_path)
    for path in ("notes.txt", f"{work}/src/new.py", f"{state}/.claude/x.json"):
        done = _run_hook(command, {"tool_name": "Write", "cwd": str(work),
                                   "tool_input": {"file_path": path}})
        assert (done.returncode, done.stdout) == (0, ""), (path, done)
    assert not (state / REFUSALS_FILE).exists()


def test_a_write_outside_is_denied_with_the_notice_and_reported(tmp_path: pathlib.Path) -> None:
    command, state, work = _write_scope(tmp_path)
    (work / "out").symlink_to(tmp_path)  # a link inside that leads out
    targets = [str(tmp_path / "elsewhere.txt"), "../escape.txt", "out/through-link.txt"]
    for path in targets:
        done = _run_hook(command, {"tool_name": "Edit", "cwd": str(work),
                                   "tool_input": {"file_path": path}})
        assert done.returncode == 0, done
        decision = json.loads(done.stdout)["hookSpecificOutput"]
        assert decision["permissionDecision"] == "deny"
        assert decision["permissionDecisionReason"].startswith(f"{NOTICE_PREFIX}: file-write ")
    refused = take_refusals(str(state))
    assert [v.target for v in refused] == [
        str(tmp_path / "elsewhere.txt"), str(tmp_path / "escape.txt"),
        str(work / "out" / "through-link.txt")]
    assert {v.source for v in refused} == {ViolationSource.HOOK}
    assert all("outside the sandbox's writable binds" in v.reason for v in refused)
    assert take_refusals(str(state)) == []  # taken once


def test_the_notice_hooks_print_and_consume_the_notices(tmp_path: pathlib.Path) -> None:
    hooks = hook_settings(str(tmp_path))["hooks"]
    assert "PreToolUse" not in hooks  # the ACP adapter's permission requests judge its writes
    (tmp_path / NOTICE_FILE).write_text(json.dumps('blocked "x"')[1:-1] + "\\n\n")
    done = _run_hook(hooks["PostToolUse"][0]["hooks"][0]["command"], {})
    output = json.loads(done.stdout)["hookSpecificOutput"]
    assert output == {"hookEventName": "PostToolUse", "additionalContext": 'blocked "x"\n'}
    assert os.listdir(tmp_path) == []
    again = _run_hook(hooks["PostToolUseFailure"][0]["hooks"][0]["command"], {})
    assert (again.returncode, again.stdout) == (0, "")


def test_what_the_agent_plants_as_the_refusal_file_is_not_followed(tmp_path: pathlib.Path) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text(json.dumps({"target": "/x", "reason": "forged from a host file"}) + "\n")
    state = tmp_path / "state"
    state.mkdir()
    (state / REFUSALS_FILE).symlink_to(secret)
    assert take_refusals(str(state)) == []
    os.mkfifo(state / "fifo")
    os.replace(state / "fifo", state / REFUSALS_FILE)
    assert take_refusals(str(state)) == []  # no block on a FIFO
    (state / REFUSALS_FILE).unlink(missing_ok=True)
    (state / REFUSALS_FILE).write_text("not json\n[1]\n" + json.dumps({"target": 3}) + "\n"
                                       + json.dumps({"target": "/t", "reason": "r"}) + "\n")
    assert [(v.target, v.reason) for v in take_refusals(str(state))] == [("/t", "r")]
    assert secret.exists()
