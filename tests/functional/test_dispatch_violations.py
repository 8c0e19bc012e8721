"""Violations of a dispatch run where they matter: in the result of `/claude`, `/bash`,
`/tools/*` and `/acp/prompt`, kept on the run, one audit line each in the server's log, and a
"blocked by sandbox policy" line in what the agent hands its model; ACP permission requests
decided by the run's policy. The agents are the real Claude Code CLI and the real ACP adapter,
driven by a fake Messages API on loopback (`model_kit`)."""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from dispatch_kit import Dispatch, dispatch_app, need_npm_agents, open_dispatch
from model_kit import FakeModel, ToolStep, fake_messages_api

from cc_server.backends.probe import ProbeResult
from cc_server.dispatch.acp import start_acp
from cc_server.dispatch.actions import Action, ActionRefused
from cc_server.dispatch.claude import run_claude
from cc_server.dispatch.service import AgentKind
from cc_server.dispatch.violations import NOTICE_FILE, NOTICE_PREFIX
from cc_server.egress.operator import OperatorEgress
from cc_server.errors import BadSpec
from cc_server.policy import Mode

pytestmark = pytest.mark.integration

UNLISTED = "api.not-on-the-allowlist.example"
QUIET = {"CLAUDE_CODE_MAX_RETRIES": "0", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


class NoCurl:
    """An operator guardrail: no curl."""

    name = "operator-no-curl"

    def check(self, action: Action) -> None:
        if action.argv is not None and "curl" in " ".join(action.argv):
            raise ActionRefused(action, self.name, "curl is not used in this workspace")


def _dummy_key(state_dir: str) -> None:
    """An apiKeyHelper in the run's user settings (merged with what the server wrote there)."""
    path = pathlib.Path(state_dir, ".claude", "settings.json")
    settings = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**settings, "apiKeyHelper": "echo sk-ant-dummy-key"}))


def _audit(caplog: pytest.LogCaptureFixture, run_id: str) -> list[dict[str, Any]]:
    lines = [getattr(r, "fields", {}) for r in caplog.records
             if getattr(r, "event", None) == "dispatch.violation"]
    return [fields for fields in lines if fields["runId"] == run_id]


async def _open_acp(d: Dispatch, mode: Mode = Mode.CHAT) -> dict[str, Any]:
    """An ACP run whose agent has the dummy key before its session starts."""
    wt = d.worktrees.create("r", f"acp-{mode}")
    run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.ACP, mode=mode)
    _dummy_key(run.state_dir)
    await start_acp(run)
    return run.to_json()


@pytest.fixture
async def model_api(
    tmp_path: pathlib.Path, probe_result: ProbeResult, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[TestClient[Any, Any], Dispatch, FakeModel]]:
    steps: list[ToolStep] = getattr(request, "param", [])
    with fake_messages_api(steps) as (url, model):
        egress = OperatorEgress.build([], {"ANTHROPIC_BASE_URL": url})
        async with open_dispatch(tmp_path, probe_result, operator_egress=egress,
                                 guardrails=(NoCurl(),)) as d, \
                TestClient(TestServer(dispatch_app(d.service))) as client:
            yield client, d, model


async def _open(client: TestClient[Any, Any], agent: str, mode: str = "chat",
                conversation: str = "c1") -> dict[str, Any]:
    wt = await (await client.post("/v1/worktrees", json={
        "repoId": "r", "conversationId": conversation})).json()
    resp = await client.post("/v1/dispatches", json={"worktreeId": wt["worktreeId"],
                                                     "agent": agent, "mode": mode})
    assert resp.status == 201, await resp.text()
    run: dict[str, Any] = await resp.json()
    return run


async def test_claude_codes_own_state_is_no_violation_and_the_globs_still_hold_elsewhere(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    need_npm_agents()
    with fake_messages_api([]) as (url, model):
        egress = OperatorEgress.build([], {"ANTHROPIC_BASE_URL": url})
        async with open_dispatch(tmp_path, probe_result, operator_egress=egress) as d:
            wt = d.worktrees.create("r", "c1")
            run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.CLAUDE)
            _dummy_key(run.state_dir)
            result = await run_claude(run, ["-p", "hi"], timeout_s=120, env=QUIET)
            assert result.exit_code == 0 and result.stdout.strip() == "done", result
            assert model.received, "the CLI never reached the fake API"
            # Claude Code writes .claude/sessions/<n>.<hash>.key in its state directory on every
            # call: the runner state directory is exempt from the create-time globs.
            assert result.violations == () and run.violations.total == 0, result
            done = await run.harness.run(
                'touch "$HOME/own.key" && echo made; touch wt.key; '
                'mv "$HOME/own.key" moved.key; ls')
            assert "made" in done.stdout, done
            assert "wt.key" not in done.stdout and "moved.key" not in done.stdout, done
            refused = sorted(v.target.rsplit("/", 1)[-1] for v in done.violations)
            assert refused == ["moved.key", "wt.key"], done
            assert not pathlib.Path(wt.path, "moved.key").exists()
            # Those were told in the bash output; the agent's next call starts without them.
            assert pathlib.Path(run.state_dir, NOTICE_FILE).exists()
            model.steps.append(ToolStep("Bash", {"command": "echo fine", "description": "d"}))
            again = await run_claude(run, ["-p", "hi", "--allowedTools", "Bash"], timeout_s=120,
                                     env=QUIET)
            assert again.exit_code == 0 and again.violations == (), again
            assert model.feedback == ["fine"], model.feedback
            for option in ("--settings={}", "--bare"):  # they would drop the run's hooks
                with pytest.raises(BadSpec, match="the run's settings"):
                    await run_claude(run, ["-p", "hi", option])


@pytest.mark.parametrize("model_api", [[
    ToolStep("Bash", {"command": "echo x > .env", "description": "env file"}),
    ToolStep("Write", {"file_path": "WORKTREE/server.pem", "content": "key"}),
    ToolStep("Bash", {"command": f"curl -sS --max-time 10 https://{UNLISTED}/ || true",
                      "description": "unlisted host"}),
]], indirect=True)
async def test_claude_refusals_reach_the_result_the_run_the_audit_log_and_the_model(
    model_api: tuple[TestClient[Any, Any], Dispatch, FakeModel],
    caplog: pytest.LogCaptureFixture,
) -> None:
    need_npm_agents()
    client, d, model = model_api
    run = await _open(client, "claude")
    live = d.service.get(run["runId"])
    worktree = run["worktree"]["path"]
    model.steps[1] = ToolStep("Write", {"file_path": f"{worktree}/server.pem", "content": "k"})
    _dummy_key(live.state_dir)
    caplog.set_level(logging.WARNING, logger="cc_server.dispatch.audit")
    resp = await client.post(f"/v1/dispatches/{run['runId']}/claude", json={
        "args": ["-p", "go", "--allowedTools", "Bash", "Write"], "env": QUIET,
        "timeoutS": 180})
    out = await resp.json()
    assert resp.status == 200 and out["exitCode"] == 0, out
    # Claude Code's Write makes a temporary file and renames it: a refused rename.
    targets = {(v["action"].replace("-rename", "-create"), v["target"])
               for v in out["violations"]}
    assert ("file-write-create", f"{worktree}/.env") in targets, out
    assert ("file-write-create", f"{worktree}/server.pem") in targets, out
    assert ("network-outbound", f"{UNLISTED}:443") in targets, out
    assert all(v["reason"] for v in out["violations"])
    # Kept on the run.
    kept = (await (await client.get(f"/v1/dispatches/{run['runId']}")).json())["violations"]
    assert targets <= {(v["action"].replace("-rename", "-create"), v["target"]) for v in kept}
    # One audit line each, with run, session, action, target and reason.
    audit = _audit(caplog, run["runId"])
    assert {(a["action"].replace("-rename", "-create"), a["target"]) for a in audit} >= targets
    assert len(audit) == len(kept)
    assert all(a["sessionId"] == run["runId"] and a["reason"] for a in audit)
    # The model heard of each refusal with the tool's result.
    feedback = model.feedback
    assert len(feedback) == 3, feedback
    assert f"{NOTICE_PREFIX}: file-write-create {worktree}/.env" in feedback[0]
    assert f"{NOTICE_PREFIX}: file-write-" in feedback[1]
    assert f"{worktree}/server.pem" in feedback[1]
    assert f"{NOTICE_PREFIX}: network-outbound {UNLISTED}:443" in feedback[2]
    assert not pathlib.Path(worktree, ".env").exists()
    assert not pathlib.Path(worktree, "server.pem").exists()


async def test_bash_and_tool_refusals_reach_the_result_the_run_and_the_audit_log(
    model_api: tuple[TestClient[Any, Any], Dispatch, FakeModel],
    caplog: pytest.LogCaptureFixture, tmp_path: pathlib.Path,
) -> None:
    client, _, _ = model_api
    run = await _open(client, "harness")
    url = f"/v1/dispatches/{run['runId']}"
    caplog.set_level(logging.WARNING, logger="cc_server.dispatch.audit")
    bash = await (await client.post(f"{url}/bash", json={"command": "echo x > .env"})).json()
    env_file = f"{run['worktree']['path']}/.env"
    assert [(v["action"], v["target"]) for v in bash["violations"]] == [
        ("file-write-create", env_file)], bash
    assert f"{NOTICE_PREFIX}: file-write-create {env_file} (matches '.env')" in bash["stderr"]
    outside = str(tmp_path / "outside.txt")
    write = await client.post(f"{url}/tools/write", json={"path": outside, "content": "x"})
    body = await write.json()
    assert write.status == 403 and body["error"] == "ActionRefused", body
    [violation] = body["violations"]
    assert (violation["action"], violation["target"], violation["source"]) == (
        "file-write", outside, "guardrail")
    assert body["notice"].startswith(f"{NOTICE_PREFIX}: file-write {outside} (path-policy: ")
    refused = await client.post(f"{url}/bash", json={"command": f"curl -s https://{UNLISTED}/"})
    assert refused.status == 403
    assert (await refused.json())["violations"][0]["guardrail"] == "operator-no-curl"
    kept = (await (await client.get(url)).json())
    assert [v["action"] for v in kept["violations"]] == [
        "file-write-create", "file-write", "command"]
    assert kept["violationCount"] == 3
    assert [a["action"] for a in _audit(caplog, run["runId"])] == [
        "file-write-create", "file-write", "command"]
    assert not (tmp_path / "outside.txt").exists()


@pytest.mark.parametrize("model_api", [[
    ToolStep("Write", {"file_path": "OUTSIDE", "content": "x"}),
    ToolStep("Bash", {"command": f"curl -s https://{UNLISTED}/", "description": "guardrail"}),
    ToolStep("Write", {"file_path": "notes.txt", "content": "allowed\n"}),
    ToolStep("Bash", {"command": "echo more >> notes.txt", "description": "allowed"}),
]], indirect=True)
async def test_acp_permission_requests_are_decided_by_the_runs_policy(
    model_api: tuple[TestClient[Any, Any], Dispatch, FakeModel],
    caplog: pytest.LogCaptureFixture, tmp_path: pathlib.Path,
) -> None:
    need_npm_agents()
    client, d, model = model_api
    outside = str(tmp_path / "outside.txt")
    model.steps[0] = ToolStep("Write", {"file_path": outside, "content": "x"})
    run = await _open_acp(d)
    caplog.set_level(logging.WARNING, logger="cc_server.dispatch.audit")
    resp = await client.post(f"/v1/dispatches/{run['runId']}/acp/prompt", json={"text": "go"})
    out = await resp.json()
    assert resp.status == 200 and out["response"]["stopReason"] == "end_turn", out
    decisions = [(p["kind"], p["allowed"], p["optionId"]) for p in out["acp"]["permissions"]]
    assert decisions == [("edit", False, "reject"), ("execute", False, "reject"),
                         ("edit", True, "allow"), ("execute", True, "allow")], out
    reasons = [p["reason"] for p in out["acp"]["permissions"]]
    assert reasons[0].startswith("path-policy: ") and "outside" in reasons[0]
    assert reasons[1] == "operator-no-curl: curl is not used in this workspace"
    refused = [(v["action"], v["target"]) for v in out["violations"]
               if v["source"] == "permission"]
    assert refused == [("permission-edit", outside),
                       ("permission-execute", f"curl -s https://{UNLISTED}/")], out
    assert {(a["action"], a["target"]) for a in _audit(caplog, run["runId"])} >= set(refused)
    # Only what the policy allows happened, once: never an "always" beyond this run.
    assert not pathlib.Path(outside).exists()
    assert pathlib.Path(run["worktree"]["path"], "notes.txt").read_text() == "allowed\nmore\n"
    assert "allow_always" not in json.dumps(out["acp"]["permissions"])
    # The reasons reach the model (the adapter's own text for a rejected call is fixed; the
    # notice comes with the next tool's result).
    told = "\n".join(model.feedback)
    assert f"{NOTICE_PREFIX}: permission-edit {outside}" in told, model.feedback
    assert f"{NOTICE_PREFIX}: permission-execute curl" in told, model.feedback


@pytest.mark.parametrize("model_api", [[
    ToolStep("Bash", {"command": "echo x > notes.txt", "description": "redirect"}),
    ToolStep("Write", {"file_path": "notes.txt", "content": "x"}),
]], indirect=True)
async def test_acp_permissions_in_review_mode_follow_its_command_policy_and_surface(
    model_api: tuple[TestClient[Any, Any], Dispatch, FakeModel],
) -> None:
    need_npm_agents()
    client, d, _ = model_api
    run = await _open_acp(d, Mode.REVIEW)
    out = await (await client.post(f"/v1/dispatches/{run['runId']}/acp/prompt",
                                   json={"text": "go"})).json()
    decisions = [(p["kind"], p["allowed"]) for p in out["acp"]["permissions"]]
    assert decisions == [("execute", False), ("edit", False)], out
    reasons = [p["reason"] for p in out["acp"]["permissions"]]
    assert reasons[0].startswith("command-policy: ") and "redirection" in reasons[0], reasons
    assert "review mode does not expose" in reasons[1], reasons
    assert not pathlib.Path(run["worktree"]["path"], "notes.txt").exists()
