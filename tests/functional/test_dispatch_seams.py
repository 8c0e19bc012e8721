"""The two dispatch seams with real agents from the package registries, in real sandboxes.

Seam 1: the Claude Code CLI (`@anthropic-ai/claude-code`, pinned) through the SandboxPort.
Seam 2: the Claude Agent ACP adapter (`@zed-industries/claude-agent-acp`, pinned) through the
SandboxManager with cc-server as its ACP client; the file, permission and terminal requests are
driven by a small ACP agent of the tests written with the SDK (the real agent makes them only
while answering a model, which needs the network and a key).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import pytest
from dispatch_kit import (
    ACP_AGENT_NAME,
    ACP_AGENT_VERSION,
    CLAUDE_VERSION,
    need_npm_agents,
    open_dispatch,
    scripted_agent,
)

from cc_server.backends.plan import Command
from cc_server.backends.probe import ProbeResult
from cc_server.dispatch.acp import REFUSED_CODE, start_acp
from cc_server.dispatch.actions import ActionRefused
from cc_server.dispatch.claude import run_claude
from cc_server.dispatch.service import AgentKind
from cc_server.errors import BackendUnavailable
from cc_server.policy import Mode, SandboxBackend

pytestmark = pytest.mark.integration

SECRET_ENV = {"MY_SERVICE_TOKEN": "tok-0123456789-server-secret", "DB_PASSWORD": "hunter2-long"}
UNLISTED_API = "https://api.not-on-the-allowlist.example"


def _claude_settings(state_dir: str, helper: str) -> None:
    """Claude Code's settings in the run's CLAUDE_CONFIG_DIR: an apiKeyHelper (run by the CLI, in
    its own process tree) that records what the CLI can see and prints a dummy key."""
    pathlib.Path(state_dir, ".claude", "settings.json").write_text(
        json.dumps({"apiKeyHelper": helper})
    )


async def test_claude_version_runs_through_seam_1_in_a_real_sandbox(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    need_npm_agents()
    async with open_dispatch(tmp_path, probe_result) as d:
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.CLAUDE)
        assert run.backend is SandboxBackend.NATIVE
        first = str(run.handle.plan(Command(argv=("x",))).argv[0])
        assert first.endswith("cc-identity" if os.geteuid() == 0 else "bwrap")
        result = await run_claude(run, ["--version"])
        assert result.exit_code == 0, result
        assert result.stdout.strip() == f"{CLAUDE_VERSION} (Claude Code)"
        assert str(d.repo) in run.spec.protected_paths


async def test_claudes_api_call_goes_through_the_proxy_and_host_secrets_stay_invisible(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    need_npm_agents()
    async with open_dispatch(tmp_path, probe_result, environ=SECRET_ENV,
                             marker="CC-SSH-KEY-OF-THE-HOST") as d:
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.CLAUDE)
        evidence = pathlib.Path(wt.path, "evidence")
        _claude_settings(run.state_dir, (
            f"env > {evidence}.env; cat {d.home}/.ssh/id_ed25519 > {evidence}.ssh 2>&1; "
            "echo sk-ant-dummy-key"
        ))
        result = await run_claude(
            run, ["-p", "hi"], timeout_s=120,
            env={"ANTHROPIC_BASE_URL": UNLISTED_API, "CLAUDE_CODE_MAX_RETRIES": "0"},
        )
        refused = [v for v in result.violations if v.action == "network-outbound"]
        assert refused, result
        assert refused[0].target == "api.not-on-the-allowlist.example:443"
        assert "not on this session's egress allowlist" in (refused[0].raw or "")
        seen_env = pathlib.Path(f"{evidence}.env").read_text()
        assert "HTTPS_PROXY=http://127.0.0.1:3128" in seen_env  # the session's proxy
        for name, value in SECRET_ENV.items():
            assert name not in seen_env and value not in seen_env
        ssh = pathlib.Path(f"{evidence}.ssh").read_text()
        assert "CC-SSH-KEY-OF-THE-HOST" not in ssh and "No such file" in ssh
        assert not pathlib.Path(d.repo, "evidence.env").exists()


async def test_without_a_backend_claude_goes_through_none_with_the_host_environment(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    need_npm_agents()
    async with open_dispatch(tmp_path, probe_result, environ=SECRET_ENV,
                             sandbox_on=False) as d:
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.CLAUDE)
        assert run.backend is SandboxBackend.NONE
        assert run.to_json()["sandboxed"] is False
        result = await run_claude(run, ["--version"])
        assert result.stdout.strip() == f"{CLAUDE_VERSION} (Claude Code)"
        # The reference page: Claude Code through NoSandboxAdapter inherits the host environment,
        # while the harness bash tool of the same run is still sanitised.
        assert run.env["MY_SERVICE_TOKEN"] == SECRET_ENV["MY_SERVICE_TOKEN"]
        env = await run.harness.run("env")
        assert "MY_SERVICE_TOKEN" not in env.stdout and "DB_PASSWORD" not in env.stdout
        # An ACP agent on `none` is sanitised too.
        acp = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.ACP)
        assert acp.backend is SandboxBackend.NONE
        assert not set(SECRET_ENV) & set(acp.env)


async def test_a_real_acp_agent_completes_initialize_and_session_new_in_the_sandbox(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    need_npm_agents()
    async with open_dispatch(tmp_path, probe_result, environ=SECRET_ENV) as d:
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.ACP)
        assert run.backend is SandboxBackend.NATIVE
        session = await start_acp(run)
        assert session.protocol_version == 1
        assert session.agent_info is not None
        assert session.agent_info["name"] == ACP_AGENT_NAME
        assert session.agent_info["version"] == ACP_AGENT_VERSION
        assert session.session_id
        for value in SECRET_ENV.values():
            assert value not in json.dumps(run.env)
        await d.service.close_run(run.run_id)
        assert session.execution.exit_code is not None  # the agent is gone with the run


async def _scripted(d: Any, mode: Mode, ops: list[dict[str, Any]]) -> tuple[Any, list[Any]]:
    wt = d.worktrees.create("r", f"c-{mode}")
    run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.ACP, mode=mode)
    session = await start_acp(run)
    assert session.agent_info == {"name": "cc-scripted-agent", "version": "1"}
    await session.prompt(json.dumps(ops))
    message = session.client.updates[-1]
    return run, json.loads(message["content"]["text"])


async def test_acp_file_requests_are_served_by_the_in_process_tools_and_refused_by_policy(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    argv, dirs = scripted_agent(tmp_path)
    async with open_dispatch(tmp_path, probe_result, acp_agent=argv, agent_dirs=dirs,
                             marker="CC-ACP-SECRET") as d:
        run, results = await _scripted(d, Mode.CHAT, [
            {"op": "read", "path": "README.md"},
            {"op": "write", "path": "notes/new.txt", "content": "from the agent\n"},
            {"op": "read", "path": f"{d.home}/.ssh/id_ed25519"},
            {"op": "write", "path": "server.pem", "content": "x"},
            {"op": "write", "path": ".git/hooks/pre-commit", "content": "#!/bin/sh\n"},
            {"op": "write", "path": f"{d.repo}/README.md", "content": "overwrite original"},
            {"op": "read", "path": "../../../../etc/shadow"},
            {"op": "terminal", "command": "echo from-terminal; hostname"},
            {"op": "terminal", "command": "echo x > .env"},
        ])
        tree = pathlib.Path(run.worktree.path)
        assert results[0] == {"ok": "original readme\n"}
        assert results[1] == {"ok": "written"}
        assert (tree / "notes" / "new.txt").read_text() == "from the agent\n"
        assert not (d.repo / "notes").exists()
        for refused in results[2:7]:
            assert refused["error"]["code"] == REFUSED_CODE, refused
        assert results[2]["error"]["data"]["guardrail"] == "path-policy"
        # What the agent hands its model names the refusal (a violation of the run each).
        assert results[3]["error"]["message"].startswith(
            "blocked by sandbox policy: file-write server.pem (file-tools: creating ")
        assert all(r["error"]["message"].startswith("blocked by sandbox policy: ")
                   for r in results[2:7])
        assert "CC-ACP-SECRET" not in json.dumps(results)
        assert not (tree / "server.pem").exists()
        assert not (tree / ".git" / "hooks" / "pre-commit").exists()
        assert (d.repo / "README.md").read_text() == "original readme\n"
        assert results[7] == {"ok": {"exitCode": 0, "output": "from-terminal\ncc-sandbox\n"}}
        env_file = tree / ".env"
        assert results[8]["ok"]["exitCode"] == 1
        assert results[8]["ok"]["output"].endswith(
            f"blocked by sandbox policy: file-write-create {env_file} (matches '.env')\n")
        assert [v.source for v in run.violations.kept].count("guardrail") == 5
        requests = run.acp.client.file_requests
        assert [r["refused"] is None for r in requests] == [True, True] + [False] * 5


async def test_review_mode_refuses_acp_writes_edit_permissions_and_publishing_commands(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    argv, dirs = scripted_agent(tmp_path)
    async with open_dispatch(tmp_path, probe_result, acp_agent=argv, agent_dirs=dirs) as d:
        run, results = await _scripted(d, Mode.REVIEW, [
            {"op": "read", "path": "README.md"},
            {"op": "write", "path": "new.txt", "content": "x"},
            {"op": "permission", "kind": "edit", "input": {"file_path": "README.md"}},
            {"op": "permission", "kind": "read", "input": {"file_path": "README.md"}},
            {"op": "terminal", "command": "git push origin main"},
            {"op": "terminal", "command": "echo ok"},
        ])
        assert results[0] == {"ok": "original readme\n"}
        assert results[1]["error"]["data"]["guardrail"] == "tool-surface"
        assert results[2] == {"ok": {"outcome": "selected", "optionId": "no"}}
        assert results[3] == {"ok": {"outcome": "selected", "optionId": "yes"}}
        assert results[4]["error"]["data"]["guardrail"] == "command-policy"
        assert results[5] == {"ok": {"exitCode": 0, "output": "ok\n"}}
        assert not pathlib.Path(run.worktree.path, "new.txt").exists()


async def test_the_harness_bash_tool_has_a_timeout_bounded_output_and_the_exit_code(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    async with open_dispatch(tmp_path, probe_result, environ=SECRET_ENV) as d:
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.HARNESS)
        ok = await run.harness.run("echo out; echo err >&2; hostname; exit 3")
        assert (ok.exit_code, ok.stdout, ok.stderr) == (3, "out\ncc-sandbox\n", "err\n")
        slow = await run.harness.run("sleep 60", timeout_s=0.5)
        assert slow.timed_out and slow.exit_code == 137
        big = await run.harness.run("head -c 1000000 /dev/zero | tr '\\0' a",
                                    max_output_bytes=1000)
        assert big.stdout == "a" * 1000 and big.stdout_truncated and big.exit_code == 0
        env = await run.harness.run(["env"])
        for name in SECRET_ENV:
            assert name not in env.stdout
        assert "HTTPS_PROXY=" in env.stdout


async def test_the_harness_refuses_before_anything_runs(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    async with open_dispatch(tmp_path, probe_result) as d:
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.HARNESS,
                                       mode=Mode.PLAN)
        marker = pathlib.Path(wt.path, "ran")
        with pytest.raises(ActionRefused, match="command-policy"):
            await run.harness.run(f"touch {marker}; git push")
        assert not marker.exists()
        assert run.handle.state.value == "warm"  # nothing was started


async def test_linux_native_dispatch_runs_with_create_rules_and_fails_closed_without(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    assert probe_result.create_rules, "this host's probe should find the create-rule supervisor"
    async with open_dispatch(tmp_path / "with", probe_result) as d:
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.HARNESS)
        assert run.handle.policy.deny_create_globs == (".env", "*.key", "*.pem")
        made = await run.harness.run("touch ok.txt x.pem; ls")
        assert "ok.txt" in made.stdout and "x.pem" not in made.stdout
        assert [v.action for v in made.violations] == ["file-write-create"]
    (tmp_path / "without").mkdir()
    weaker = dataclasses.replace(probe_result, create_rules=False)
    async with open_dispatch(tmp_path / "without", weaker) as d:
        wt = d.worktrees.create("r", "c1")
        with pytest.raises(BackendUnavailable, match="cannot refuse a new name"):
            await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.HARNESS)
        assert d.service.runs == {} and d.manager.handles == {}
        assert list((tmp_path / "without" / "runs").iterdir()) == []


async def test_a_run_whose_agent_fails_to_close_still_loses_its_terminals_and_sandbox(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    class Stuck:
        async def aclose(self) -> None:
            raise RuntimeError("the agent's connection would not close")

    async with open_dispatch(tmp_path, probe_result) as d:
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.HARNESS)
        terminal = await run.harness.start(["sleep", "600"])
        run.acp = Stuck()
        with pytest.raises(RuntimeError, match="would not close"):
            await d.service.close_run(run.run_id)
        assert terminal.done and run.harness.terminals == {}
        assert run.handle.state.value == "destroyed"
        assert d.service.runs == {} and d.manager.handles == {}
        assert list((tmp_path / "runs").iterdir()) == []
