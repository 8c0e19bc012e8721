"""The pure parts of dispatch: operator settings, the ACP permission table, the harness's bounds,
and the ACP transport's framing over a real `none` execution."""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from types import SimpleNamespace

import pytest
from dispatch_kit import NPM_MODULES

from cc_server.backends.probe import ProbeResult
from cc_server.dispatch.acp import (
    MAX_MESSAGE_BYTES,
    MAX_RECORDS,
    CcAcpClient,
    ExecutionTransport,
    permission_for,
)
from cc_server.dispatch.harness import shell_argv
from cc_server.dispatch.setup import config_from_env, default_agent_dirs
from cc_server.dispatch.violations import MAX_KEPT, ViolationLog
from cc_server.errors import BadSpec, ConfigError
from cc_server.policy import HostFacts, Mode, SandboxBackend, SandboxSpec
from cc_server.runtime.port import SandboxManager


def test_operator_settings_come_from_the_environment(tmp_path: pathlib.Path) -> None:
    env = {"HOME": str(tmp_path), "CC_SERVER_CLAUDE_PATH": "/opt/claude/bin/claude",
           "CC_SERVER_ACP_AGENT": "/usr/bin/node '/opt/my agent/index.js' --acp",
           "CC_SERVER_GITHUB_TOKEN_FILE": "/etc/cc/token"}
    config, worktrees, token = config_from_env(env)
    assert config.claude_path == "/opt/claude/bin/claude"
    assert config.acp_agent == ("/usr/bin/node", "/opt/my agent/index.js", "--acp")
    assert worktrees == f"{tmp_path}/.local/state/cc-server/worktrees"
    assert config.state_base == f"{tmp_path}/.local/state/cc-server/runs"
    assert token == "/etc/cc/token"
    explicit, _, _ = config_from_env({**env, "CC_SERVER_AGENT_DIRS": "/a:/b",
                                      "CC_SERVER_DISPATCH_DIR": "/srv/d"})
    assert explicit.agent_dirs == ("/a", "/b") and explicit.state_base == "/srv/d/runs"
    nothing, _, none_token = config_from_env({"HOME": str(tmp_path)})
    assert (nothing.claude_path, nothing.acp_agent, none_token) == (None, None, None)
    assert nothing.model_credentials is None
    (tmp_path / "model.key").write_text("sk-operator\n")
    keyed, _, _ = config_from_env({**env, "CC_SERVER_MODEL_KEY_FILE": f"{tmp_path}/model.key",
                                   "ANTHROPIC_BASE_URL": "https://gw.example:8443"})
    assert keyed.model_credentials is not None
    assert (keyed.model_credentials.host, keyed.model_credentials.port) == ("gw.example", 8443)


@pytest.mark.parametrize("env", [
    {"CC_SERVER_CLAUDE_PATH": "claude"},
    {"CC_SERVER_ACP_AGENT": "node 'unclosed"},
    {"CC_SERVER_DISPATCH_DIR": "relative/dir"},
    {"CC_SERVER_MODEL_KEY_FILE": "relative/key"},
    {"CC_SERVER_MODEL_KEY_FILE": "/nonexistent/key"},
])
def test_bad_operator_settings_are_refused(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        config_from_env({"HOME": "/nonexistent", **env})


def test_an_npm_agent_gets_its_node_modules_tree_read_only() -> None:
    claude = NPM_MODULES / ".bin" / "claude"
    if claude.exists():
        assert default_agent_dirs((str(claude),)) == [str(NPM_MODULES)]
    assert default_agent_dirs(("/bin/sh", "-c", "relative")) in (["/bin"], ["/usr/bin"],
                                                                 ["/bin", "/usr/bin"])
    assert default_agent_dirs(("not-absolute",)) == []


@pytest.mark.parametrize(
    ("mode", "kind", "allowed"),
    [
        (Mode.CHAT, "edit", True), (Mode.CHAT, "delete", True), (Mode.CHAT, "move", True),
        (Mode.CHAT, "execute", True), (Mode.CHAT, "read", True), (Mode.CHAT, "think", True),
        (Mode.REVIEW, "edit", False), (Mode.REVIEW, "delete", False),
        (Mode.PLAN, "move", False), (Mode.ORCHESTRATE, "edit", False),
        (Mode.REVIEW, "read", True), (Mode.PLAN, "search", True), (Mode.REVIEW, "execute", True),
        (Mode.CHAT, "other", False), (Mode.CHAT, None, False), (Mode.CHAT, "unheard-of", False),
    ],
)
def test_the_acp_permission_table_follows_the_modes_tool_surface(
    mode: Mode, kind: str | None, allowed: bool
) -> None:
    assert permission_for(mode, kind, network_allowed=True)[0] is allowed


def test_fetch_is_allowed_only_when_the_network_is() -> None:
    assert permission_for(Mode.REVIEW, "fetch", network_allowed=True)[0] is True
    assert permission_for(Mode.CHAT, "fetch", network_allowed=False)[0] is False


async def test_an_agent_asking_without_end_cannot_grow_what_a_run_records() -> None:
    from acp import RequestError
    from acp.schema import PermissionOption, ToolCallUpdate

    class Refusing:
        def read(self, path: str, **_: object) -> str:
            raise BadSpec(f"{path} refused")

    policy = SimpleNamespace(network_allowed=False)
    run = SimpleNamespace(mode=Mode.CHAT, handle=SimpleNamespace(policy=policy), tools=Refusing(),
                          violations=ViolationLog("r", "r"))
    client = CcAcpClient(run)  # type: ignore[arg-type]
    options = [PermissionOption(option_id="yes", name="Allow", kind="allow_once")]
    for i in range(MAX_RECORDS + 5):
        await client.request_permission(
            "s", ToolCallUpdate(tool_call_id=f"t{i}", kind="read", title="read"), options)
        with pytest.raises(RequestError):
            await client.read_text_file("s", f"f{i}")
    assert len(client.permissions) == len(client.file_requests) == MAX_RECORDS
    # The newest are kept.
    assert client.permissions[-1]["toolCallId"] == f"t{MAX_RECORDS + 4}"
    assert client.file_requests[-1]["path"] == f"f{MAX_RECORDS + 4}"
    # A read that names no path cannot be judged: each is a violation, and the run keeps a
    # bounded number of them.
    assert run.violations.total == MAX_RECORDS + 5
    assert len(run.violations.kept) == MAX_KEPT


def test_shell_argv_refuses_what_cannot_run() -> None:
    assert shell_argv("echo hi") == ("/bin/bash", "-c", "echo hi")
    assert shell_argv(["ls", "-l"]) == ("ls", "-l")
    for bad in ("", "   ", [], [""], ["a\x00b"], "x\x00"):
        with pytest.raises(BadSpec):
            shell_argv(bad)


async def test_the_acp_transport_frames_lines_and_drops_an_oversized_one(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    host = dataclasses.replace(HostFacts.current(), home=str(tmp_path))
    manager = SandboxManager(probe_result=probe_result, host=host)
    try:
        handle = manager.launch(SandboxSpec(session_id="t", workspace_id="w"),
                                backend=SandboxBackend.NONE)
        script = (
            "import sys\n"
            "w = sys.stdout.write\n"
            "w('{\"a\": 1}\\n\\nnot json\\n[1]\\n{\"b\"'); sys.stdout.flush()\n"
            "w(': 2}\\n'); sys.stdout.flush()\n"
            "line = sys.stdin.readline(); w(line); sys.stdout.flush()\n"
            f"w('x' * {MAX_MESSAGE_BYTES + 10})\n"
        )
        async with handle.open_exec(
            [sys.executable, "-c", script], interactive_stdin=True
        ) as execution:
            transport = ExecutionTransport(execution)
            assert await transport.receive() == {"a": 1}
            assert await transport.receive() == {"b": 2}  # not-JSON and non-object lines skipped
            await transport.send({"echo": "back"})
            assert await transport.receive() == {"echo": "back"}
            assert await transport.receive() is None  # the oversized line ends the connection
    finally:
        await manager.aclose()


async def test_run_state_a_killed_server_left_is_removed_at_start(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    from cc_server.dispatch.credentials import CredentialBroker
    from cc_server.dispatch.service import DispatchConfig, DispatchService
    from cc_server.dispatch.worktrees import WorktreeManager

    stale = tmp_path / "runs" / "run-0123456789abcdef" / ".claude"
    stale.mkdir(parents=True)
    (stale / "settings.json").write_text("{}")
    keep = tmp_path / "runs" / "operator-notes"
    keep.mkdir()
    manager = SandboxManager(probe_result=probe_result,
                             host=dataclasses.replace(HostFacts.current(), home=str(tmp_path)))
    worktrees = WorktreeManager(base=str(tmp_path / "wt"))
    broker = CredentialBroker(base_dir=str(tmp_path))
    DispatchService(manager=manager, worktrees=worktrees, broker=broker,
                    config=DispatchConfig(state_base=str(tmp_path / "runs")), environ={})
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["operator-notes"]
    await manager.aclose()
