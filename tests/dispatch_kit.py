"""Shared helpers of the dispatch tests: throw-away git checkouts, the pinned npm agents, and a
DispatchService over a real SandboxManager.

The npm agents are installed by `scripts/bootstrap --test` under `.cache/npm`; a test that needs
them fails (never skips) when they are missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pathlib
import subprocess
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from aiohttp import web

from cc_server.backends.probe import ProbeResult
from cc_server.dispatch.guardrails import Guardrail
from cc_server.dispatch.model_credentials import ModelCredentials
from cc_server.dispatch.service import DispatchConfig, DispatchService
from cc_server.dispatch.worktrees import WorktreeManager, WorktreeStrategy, mounted_under
from cc_server.egress.operator import OperatorEgress
from cc_server.policy import HostFacts
from cc_server.runtime.port import SandboxManager

ROOT = pathlib.Path(__file__).resolve().parent.parent
NPM_MODULES = ROOT / ".cache" / "npm" / "node_modules"
CLAUDE_BIN = NPM_MODULES / ".bin" / "claude"
ACP_AGENT_BIN = NPM_MODULES / ".bin" / "claude-agent-acp"
CLAUDE_VERSION = "2.1.332"  # pinned in scripts/bootstrap
ACP_AGENT_NAME = "@zed-industries/claude-agent-acp"
ACP_AGENT_VERSION = "0.23.1"  # pinned in scripts/bootstrap


def need_npm_agents() -> None:
    """Fail (not skip) when bootstrap did not install the npm agents."""
    missing = [str(p) for p in (CLAUDE_BIN, ACP_AGENT_BIN) if not p.exists()]
    assert not missing, f"run scripts/bootstrap --test; missing: {missing}"


def git(*args: str, cwd: pathlib.Path) -> str:
    done = subprocess.run(
        ["git", "-c", "user.email=t@example.invalid", "-c", "user.name=t", *args],
        cwd=cwd, capture_output=True, text=True, check=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd),
             "GIT_CONFIG_NOSYSTEM": "1"},
    )
    return done.stdout


def make_repo(path: pathlib.Path) -> pathlib.Path:
    """A git checkout with a few files and one commit."""
    path.mkdir(parents=True)
    git("init", "-q", cwd=path)
    (path / "README.md").write_text("original readme\n")
    (path / "src").mkdir()
    (path / "src" / "main.py").write_text("print('original')\n")
    (path / "keep").mkdir()
    (path / "keep" / "data.txt").write_text("data\n")
    git("add", "-A", cwd=path)
    git("commit", "-qm", "initial", cwd=path)
    return path


def tree_digest(root: pathlib.Path) -> dict[str, str]:
    """Every entry below `root` (files by content hash, links by target, dirs by mode)."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if os.path.islink(full):
                out[rel] = "link:" + os.readlink(full)
            elif os.path.isdir(full):
                out[rel] = f"dir:{os.lstat(full).st_mode:o}"
            else:
                with open(full, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def dispatch_app(service: DispatchService) -> web.Application:
    """An aiohttp app with the dispatch routes over `service` (for TestClient), its errors
    answered by the server's own middleware."""
    from cc_server.server.dispatch_api import DISPATCH, routes
    from cc_server.server.status import answer_errors

    app = web.Application(middlewares=[answer_errors])
    app[DISPATCH] = service
    app.router.add_routes(routes)
    return app


def fake_home(tmp: pathlib.Path, marker: str) -> pathlib.Path:
    """A $HOME with a planted SSH key carrying `marker`."""
    home = tmp / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text(f"-----BEGIN KEY-----\n{marker}\n")
    return home


@dataclasses.dataclass
class Dispatch:
    """What a dispatch test works with."""

    service: DispatchService
    manager: SandboxManager
    worktrees: WorktreeManager
    repo: pathlib.Path
    home: pathlib.Path
    tmp: pathlib.Path


@contextlib.asynccontextmanager
async def open_dispatch(
    tmp: pathlib.Path,
    probe_result: ProbeResult,
    *,
    environ: Mapping[str, str] | None = None,
    sandbox_on: bool = True,
    guardrails: Sequence[Guardrail] = (),
    github_token_file: str | None = None,
    marker: str = "CC-DISPATCH-SECRET",
    acp_agent: tuple[str, ...] | None = None,
    agent_dirs: tuple[str, ...] = (),
    strategy: WorktreeStrategy | None = None,
    operator_egress: OperatorEgress | None = None,
    model_credentials: ModelCredentials | None = None,
) -> AsyncIterator[Dispatch]:
    """A service with a registered repo `r` and the npm agents configured; everything is torn
    down after, and no mount is left under tmp."""
    from cc_server.dispatch.credentials import CredentialBroker

    home = fake_home(tmp, marker)
    repo = make_repo(tmp / "repo")
    host = dataclasses.replace(HostFacts.current(), home=str(home))
    manager = SandboxManager(probe_result=probe_result, host=host, sandbox_on=sandbox_on)
    worktrees = WorktreeManager(base=str(tmp / "worktrees"), strategy=strategy)
    modules = os.path.realpath(NPM_MODULES)
    config = DispatchConfig(
        state_base=str(tmp / "runs"), claude_path=str(CLAUDE_BIN),
        acp_agent=acp_agent or (str(ACP_AGENT_BIN),), agent_dirs=(modules, *agent_dirs),
        guardrails=tuple(guardrails), operator_egress=operator_egress or OperatorEgress(),
        model_credentials=model_credentials,
    )
    env: dict[str, Any] = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
                           "LANG": "C.UTF-8"}
    env.update(environ or {})
    grants = tempfile.mkdtemp(prefix="ccs-", dir="/tmp")  # short: the helper's socket path
    broker = CredentialBroker(base_dir=grants, github_token_file=github_token_file)
    service = DispatchService(manager=manager, worktrees=worktrees, broker=broker, config=config,
                              environ=env)
    worktrees.register("r", str(repo))
    try:
        yield Dispatch(service=service, manager=manager, worktrees=worktrees, repo=repo,
                       home=home, tmp=tmp)
    finally:
        await service.aclose()
        await manager.aclose()
        worktrees.remove_all()
        assert mounted_under(str(tmp)) == []
        assert os.listdir(grants) == [], "a credential grant outlived its run"
        os.rmdir(grants)


# A small ACP agent written with the SDK, for what the real agent cannot be driven to do offline:
# each prompt is a JSON list of requests it makes of its client (cc-server), and it answers with
# one agent message holding what each request returned or the error it got.
SCRIPTED_AGENT = """
import asyncio, json
from acp import PROTOCOL_VERSION, RequestError, run_agent, update_agent_message_text
from acp.schema import (Implementation, InitializeResponse, NewSessionResponse, PermissionOption,
                        PromptResponse, ToolCallUpdate)


class ScriptedAgent:
    def on_connect(self, conn):
        self.conn = conn

    async def initialize(self, protocol_version, client_capabilities=None, client_info=None, **kw):
        return InitializeResponse(protocol_version=PROTOCOL_VERSION,
                                  agent_info=Implementation(name="cc-scripted-agent", version="1"))

    async def new_session(self, cwd, mcp_servers=None, **kw):
        return NewSessionResponse(session_id="scripted-1")

    async def _one(self, sid, op):
        kind = op["op"]
        if kind == "read":
            return (await self.conn.read_text_file(session_id=sid, path=op["path"])).content
        if kind == "write":
            await self.conn.write_text_file(session_id=sid, path=op["path"], content=op["content"])
            return "written"
        if kind == "permission":
            options = [PermissionOption(option_id="yes", name="Allow", kind="allow_once"),
                       PermissionOption(option_id="no", name="Reject", kind="reject_once")]
            answer = await self.conn.request_permission(
                session_id=sid, options=options,
                tool_call=ToolCallUpdate(tool_call_id="t1", kind=op["kind"], title=op["kind"],
                                         raw_input=op.get("input")))
            return answer.outcome.model_dump(by_alias=True, exclude_none=True)
        if kind == "terminal":
            term = await self.conn.create_terminal(session_id=sid, command=op["command"])
            done = await self.conn.wait_for_terminal_exit(session_id=sid,
                                                          terminal_id=term.terminal_id)
            out = await self.conn.terminal_output(session_id=sid, terminal_id=term.terminal_id)
            await self.conn.release_terminal(session_id=sid, terminal_id=term.terminal_id)
            return {"exitCode": done.exit_code, "output": out.output}
        if kind == "local":  # the agent's own process, not a request to its client
            try:
                with open(op["path"], "a" if "content" in op else "r") as f:
                    return f.write(op["content"]) if "content" in op else f.read()
            except OSError as exc:
                return {"oserror": exc.strerror}
        raise ValueError(kind)

    async def prompt(self, session_id, prompt, **kw):
        results = []
        for op in json.loads(prompt[0].text):
            try:
                results.append({"ok": await self._one(session_id, op)})
            except RequestError as exc:
                results.append({"error": {"code": exc.code, "message": str(exc),
                                          "data": exc.data}})
        await self.conn.session_update(session_id=session_id,
                                       update=update_agent_message_text(json.dumps(results)))
        return PromptResponse(stop_reason="end_turn")


asyncio.run(run_agent(ScriptedAgent()))
"""


def scripted_agent(tmp: pathlib.Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The scripted agent's argv and the directories it needs bound read-only (this venv's
    interpreter and site-packages, and the script)."""
    import sys

    bindir = tmp / "agent"
    bindir.mkdir()
    script = bindir / "scripted_agent.py"
    script.write_text(SCRIPTED_AGENT)
    dirs = (str(bindir), os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix))
    return (sys.executable, str(script)), dirs
