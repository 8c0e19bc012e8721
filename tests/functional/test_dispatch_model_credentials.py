"""The agents' model key brokered per run, with the real Claude Code CLI (seam 1) and the real
ACP adapter (seam 2) against a fake Messages API on loopback over HTTPS (`model_kit`), its
certificate from a test CA the server is told to trust upstream: the agent holds a sentinel,
the session's proxy terminates TLS for the model host alone with the session's CA and swaps the
real key in; nothing inside the sandbox can read the real key; revoked at teardown."""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import AsyncIterator

import pytest
from dispatch_kit import Dispatch, need_npm_agents, open_dispatch
from model_kit import FakeModel, ToolStep, UpstreamCA, fake_messages_api

from cc_server.backends.probe import ProbeResult
from cc_server.dispatch.acp import start_acp
from cc_server.dispatch.claude import run_claude
from cc_server.dispatch.model_credentials import (
    CA_FILE_NAME,
    KEY_FILE_ENV,
    SENTINEL_PREFIX,
    UPSTREAM_CA_ENV,
    ModelCredentials,
)
from cc_server.dispatch.service import AgentKind
from cc_server.egress.operator import OperatorEgress

pytestmark = pytest.mark.integration

REAL_KEY = "sk-ant-api03-REAL-operator-key-7f3c9a1b2d4e6f80"
QUIET = {"CLAUDE_CODE_MAX_RETRIES": "0", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
# What a hostile agent runs to find the key: its environment, every process's environment and
# command line, and every file it can reach that might hold it.
HUNT = (
    "env; echo ==; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' | grep -i anthropic; "
    "echo ==; grep -rl REAL-operator /proc/*/environ /proc/*/cmdline \"$HOME\" . /tmp "
    "2>/dev/null; echo hunt-done"
)


@contextlib.asynccontextmanager
async def brokered(
    tmp_path: pathlib.Path, probe_result: ProbeResult, steps: list[ToolStep],
    *, ca: UpstreamCA | None = None, allow: tuple[str, ...] = (),
) -> AsyncIterator[tuple[Dispatch, FakeModel, UpstreamCA]]:
    """A dispatch service whose operator set an https model endpoint, its key file and the CA
    that endpoint's certificate chains to (and `allow`ed more)."""
    ca = ca or upstream_ca(tmp_path)
    with fake_messages_api(steps, tls=ca) as (url, model):
        egress = OperatorEgress.build(allow, {"ANTHROPIC_BASE_URL": url})
        key_file = tmp_path / "model.key"
        key_file.write_text(REAL_KEY + "\n")
        creds = ModelCredentials.from_env(
            {KEY_FILE_ENV: str(key_file), UPSTREAM_CA_ENV: ca.ca_file}, egress)
        async with open_dispatch(tmp_path, probe_result, operator_egress=egress,
                                 model_credentials=creds) as d:
            yield d, model, ca


def upstream_ca(tmp_path: pathlib.Path) -> UpstreamCA:
    certs = tmp_path / "upstream-certs"
    certs.mkdir()
    return UpstreamCA(str(certs))


def _keys(model: FakeModel) -> list[str | None]:
    return [next((v for k, v in r.headers.items() if k.lower() == "x-api-key"), None)
            for r in model.received]


def _assert_key_never_inside(told: str, sentinel: str) -> None:
    assert "hunt-done" in told, told
    assert REAL_KEY not in told and "REAL-operator" not in told, told
    assert f"ANTHROPIC_API_KEY={sentinel}" in told, told


@pytest.mark.parametrize("agent", [AgentKind.CLAUDE, AgentKind.ACP], ids=["seam-1", "seam-2"])
async def test_the_agent_holds_a_sentinel_and_the_model_api_gets_the_real_key(
    tmp_path: pathlib.Path, probe_result: ProbeResult, agent: AgentKind
) -> None:
    need_npm_agents()
    async with brokered(tmp_path, probe_result, [
        ToolStep("Bash", {"command": HUNT, "description": "hunt"}),
    ]) as (d, model, _):
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=agent)
        assert run.model is not None
        broker = run.model
        sentinel = run.env["ANTHROPIC_API_KEY"]
        assert sentinel == broker.sentinel and sentinel.startswith(SENTINEL_PREFIX)
        assert REAL_KEY not in json.dumps(run.env)
        assert run.env["NODE_EXTRA_CA_CERTS"] == f"{run.state_dir}/{CA_FILE_NAME}"
        # No apiKeyHelper, no settings: the sentinel in its environment is all the agent has.
        if agent is AgentKind.CLAUDE:
            result = await run_claude(run, ["-p", "go", "--allowedTools", "Bash"],
                                      timeout_s=180, env=QUIET)
            assert result.exit_code == 0 and result.stdout.strip() == "done", result
            assert result.violations == (), result
        else:
            session = await start_acp(run)
            answer = await session.prompt("go")
            assert answer["stopReason"] == "end_turn", (answer, session.transport.stderr_text())
            assert [p["allowed"] for p in session.client.permissions] == [True]
        # Every model call reached the fake over TLS with the real key, none with the sentinel.
        keys = _keys(model)
        assert len(keys) >= 2 and set(keys) == {REAL_KEY}, keys
        assert broker.swapped == broker.requests == len(keys)
        _assert_key_never_inside("\n".join(model.feedback), sentinel)
        await d.service.close_run(run.run_id)
        assert broker.revoked


async def test_only_the_model_host_is_terminated_and_a_revoked_sentinel_gets_nothing(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    ca = upstream_ca(tmp_path)
    with fake_messages_api([], tls=ca) as (other_url, other):
        other_port = int(other_url.rsplit(":", 1)[1])
        async with brokered(tmp_path, probe_result, [], ca=ca,
                            allow=(f"127.0.0.1:{other_port}",)) as (d, model, _):
            wt = d.worktrees.create("r", "c1")
            run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.CLAUDE)
            assert run.model is not None
            broker = run.model
            model_url = d.service.config.operator_egress.model_url
            upstream_pem = pathlib.Path(wt.path, "upstream-ca.crt")  # a public certificate
            upstream_pem.write_text(pathlib.Path(ca.ca_file).read_text())

            async def ask(ca_file: str, url: str | None) -> str:
                done = await run.harness.run(
                    "curl -sS --max-time 20 --noproxy '' -o /dev/null -w 'status=%{http_code}' "
                    f"--cacert {ca_file} -H 'x-api-key: {broker.sentinel}' "
                    "-H 'content-type: application/json' -d '{\"model\":\"m\",\"messages\":[]}' "
                    f"{url}/v1/messages; echo \" rc=$?\"")
                return done.stdout

            # Another allowed host's TLS is relayed untouched: its own certificate, no swap.
            assert "status=200" in await ask(str(upstream_pem), other_url)
            assert _keys(other) == [broker.sentinel]
            # The model host is terminated with the session's CA, not the upstream's ...
            assert "rc=60" in await ask(str(upstream_pem), model_url)  # not trusted
            # ... and there the sentinel becomes the real key.
            assert "status=200" in await ask(broker.ca_file, model_url)
            assert _keys(model) == [REAL_KEY]
            # A method that would echo the request (the key) back is not relayed.
            trace = await run.harness.run(
                f"curl -sS --noproxy '' -o /dev/null -w 'status=%{{http_code}}' -X TRACE "
                f"--cacert {broker.ca_file} -H 'x-api-key: {broker.sentinel}' {model_url}/")
            assert "status=405" in trace.stdout, trace
            assert _keys(model) == [REAL_KEY]
            # Revoked (as at teardown): the connection is closed, nothing reaches the API.
            broker.revoke()
            assert "status=200" not in await ask(broker.ca_file, model_url)
            assert _keys(model) == [REAL_KEY]


async def test_without_a_sandbox_there_is_no_broker_and_no_key(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    egress = OperatorEgress.build([], {"ANTHROPIC_BASE_URL": "https://127.0.0.1:9"})
    key_file = tmp_path / "model.key"
    key_file.write_text(REAL_KEY)
    creds = ModelCredentials.from_env({KEY_FILE_ENV: str(key_file)}, egress)
    async with open_dispatch(tmp_path, probe_result, sandbox_on=False, operator_egress=egress,
                             model_credentials=creds) as d:
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.CLAUDE)
        assert run.backend.value == "none" and run.model is None
        assert "ANTHROPIC_API_KEY" not in run.env and REAL_KEY not in json.dumps(run.env)
