"""Dispatch escapes, each attempted for real and expected to fail.

A run's credential is usable only inside that run and stops working at teardown; a run without
the GitHub capability gets neither a credential nor the GitHub domains; the server's secret
variables never reach a sandboxed agent; the registered checkout is never writable from a run in
any mode; and the ACP agent's own process sees no more than its sandbox.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
from typing import Any

import pytest
from dispatch_kit import open_dispatch, scripted_agent

from cc_server.backends.probe import ProbeResult
from cc_server.dispatch.acp import start_acp
from cc_server.dispatch.actions import ActionRefused
from cc_server.dispatch.claude import run_claude
from cc_server.dispatch.env import EnvRefused
from cc_server.dispatch.service import AgentKind
from cc_server.dispatch.worktrees import WorktreeStrategy
from cc_server.policy import AgentCapabilities, Mode
from cc_server.runtime.handle import SandboxHandle

pytestmark = pytest.mark.security

TOKEN = "ghp_dispatchTestToken0123456789abcdef"
FILL = "printf 'protocol=https\\nhost=github.com\\n\\n' | git credential fill"
GITHUB = AgentCapabilities(can_call_github_api=True)


def _token_file(tmp: pathlib.Path) -> str:
    path = tmp / "operator" / "github-token"
    path.parent.mkdir(mode=0o700)
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


async def test_a_runs_credential_works_inside_it_and_not_after_teardown(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    async with open_dispatch(tmp_path, probe_result,
                             github_token_file=_token_file(tmp_path)) as d:
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.HARNESS,
                                       capabilities=GITHUB)
        assert TOKEN not in json.dumps(run.env)  # never in the environment
        filled = await run.harness.run(FILL)
        assert f"password={TOKEN}" in filled.stdout, filled
        helper = run.env["GIT_CONFIG_VALUE_1"]
        grant_dir = os.path.dirname(helper)
        await d.service.close_run(run.run_id)
        # What the run saw is gone: the helper, its socket, its directory.
        assert not os.path.exists(grant_dir)
        with pytest.raises(OSError):
            subprocess.run([helper, "get"], input=b"protocol=https\nhost=github.com\n\n",
                           capture_output=True, check=True, timeout=10)
        with socket.socket(socket.AF_UNIX) as s, pytest.raises(OSError):
            s.connect(os.path.join(grant_dir, "s"))
        # A later run of the same worktree without the capability gets nothing.
        later = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.HARNESS)
        again = await later.harness.run(FILL + " 2>&1; echo rc=$?")
        assert TOKEN not in again.stdout and "password=" not in again.stdout


async def test_a_run_without_the_github_capability_gets_no_credential_and_no_github_domains(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    async with open_dispatch(tmp_path, probe_result,
                             github_token_file=_token_file(tmp_path)) as d:
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.HARNESS)
        assert run.grant.bind_mounts == () and not any(
            k.startswith("GIT_CONFIG") for k in run.env)
        filled = await run.harness.run(FILL + " 2>&1")
        assert TOKEN not in filled.stdout and "password=" not in filled.stdout
        curl = await run.harness.run(
            "curl -sS --max-time 20 -o /dev/null https://api.github.com/ 2>&1; echo rc=$?")
        refused = [v for v in curl.violations if v.target.startswith("api.github.com")]
        assert refused and refused[0].action == "network-outbound", curl
        assert refused[0].suggested_capability == "canCallGitHubApi"
        # With the capability the proxy lets the same host through (no violation for it).
        wt2 = d.worktrees.create("r", "c2")
        earned = await d.service.open_run(worktree_id=wt2.worktree_id, agent=AgentKind.HARNESS,
                                          capabilities=GITHUB)
        curl2 = await earned.harness.run(
            "curl -sS --max-time 20 -o /dev/null https://api.github.com/ 2>&1; echo rc=$?")
        assert not [v for v in curl2.violations if v.target.startswith("api.github.com")]


async def test_a_refused_launch_leaves_no_credential_sandbox_or_state_even_if_teardown_fails(
    tmp_path: pathlib.Path, probe_result: ProbeResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Broken:
        name = "broken"

        def check(self, action: Any) -> None:
            raise RuntimeError("this guardrail is broken")

    destroyed: list[SandboxHandle] = []
    real_destroy = SandboxHandle.destroy

    async def destroy_then_fail(self: SandboxHandle) -> None:
        await real_destroy(self)
        destroyed.append(self)
        raise OSError("the sandbox's teardown failed")

    monkeypatch.setattr(SandboxHandle, "destroy", destroy_then_fail)
    async with open_dispatch(tmp_path, probe_result, guardrails=[Broken()],
                             github_token_file=_token_file(tmp_path)) as d:
        wt = d.worktrees.create("r", "c1")
        with pytest.raises(OSError, match="teardown failed") as failed:
            await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.CLAUDE,
                                     capabilities=GITHUB)
        assert isinstance(failed.value.__context__, ActionRefused)  # the launch was refused
        assert [h.state.value for h in destroyed] == ["destroyed"]
        assert d.service.runs == {} and d.manager.handles == {}
        assert d.service.broker.live_runs == ()  # type: ignore[attr-defined]
        assert list((tmp_path / "runs").iterdir()) == []
    # open_dispatch checks that no grant directory and no mount is left.


SECRET_NAMES = [
    "GITHUB_TOKEN", "GH_TOKEN", "ANTHROPIC_API_KEY", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN", "DB_PASSWORD", "PGPASSWORD", "NPM_AUTH", "SSH_AUTH_SOCK",
    "SESSION_COOKIE", "MY_CREDENTIALS", "PRIVATE_KEY_PEM", "LC_SECRET", "PATH_TOKEN",
]


@pytest.mark.parametrize("agent", [AgentKind.HARNESS, AgentKind.CLAUDE])
async def test_the_servers_secret_variables_never_reach_a_sandboxed_agent(
    tmp_path: pathlib.Path, probe_result: ProbeResult, agent: AgentKind
) -> None:
    environ = {name: f"value-of-{name.lower()}-0123456789" for name in SECRET_NAMES}
    async with open_dispatch(tmp_path, probe_result, environ=environ) as d:
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=agent)
        seen = (await run.harness.run(["env"])).stdout
        for name, value in environ.items():
            assert name not in run.env and value not in json.dumps(run.env)
            assert value not in seen
        if agent is AgentKind.CLAUDE:  # nor can a client smuggle one in with the call
            with pytest.raises(EnvRefused, match="named like a secret"):
                await run_claude(run, ["--version"], env={"GH_TOKEN": "x"})


@pytest.mark.parametrize("mode", list(Mode))
async def test_the_registered_checkout_is_never_writable_from_a_run(
    tmp_path: pathlib.Path, probe_result: ProbeResult, mode: Mode
) -> None:
    async with open_dispatch(tmp_path, probe_result) as d:
        before = (d.repo / "README.md").read_text()
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.HARNESS,
                                       mode=mode)
        readme = d.repo / "README.md"
        code = (
            "import os\n"
            f"acts = [lambda: open({str(readme)!r}, 'w').write('pwned'),\n"
            f"        lambda: open({str(d.repo / 'new.txt')!r}, 'w').write('pwned'),\n"
            f"        lambda: os.unlink({str(d.repo / 'src' / 'main.py')!r}),\n"
            f"        lambda: os.rename({str(d.repo / 'keep')!r}, {str(d.repo / 'moved')!r})]\n"
            "for act in acts:\n"
            "    try:\n"
            "        act(); print('DONE')\n"
            "    except OSError as exc:\n"
            "        print('REFUSED', exc.errno)\n"
        )
        attempt = await run.harness.run(["python3", "-c", code])
        if wt.strategy is WorktreeStrategy.OVERLAY:
            assert attempt.stdout.count("REFUSED") == 4 and "DONE" not in attempt.stdout, attempt
        # Otherwise (a git worktree: what a root server gets) the checkout's .git is bound, so
        # bwrap made the checkout's directory inside, in the sandbox's own /tmp: a write there
        # lands in that tmpfs. What counts is the host, checked below.
        if mode is Mode.CHAT:  # the shell way too (other modes refuse redirections up front)
            await run.harness.run(f"echo pwned > {readme}; echo pwned > README.md")
        for tool, args in (("write", (str(readme), "pwned")),
                           ("write", (f"{d.repo}/new.txt", "pwned")),
                           ("edit", (str(readme), "original", "pwned"))):
            with pytest.raises(ActionRefused):
                getattr(run.tools, tool)(*args)
        assert readme.read_text() == before
        assert not (d.repo / "new.txt").exists() and (d.repo / "src" / "main.py").exists()
        assert (d.repo / "keep").exists() and not (d.repo / "moved").exists()
        worktree_readme = pathlib.Path(wt.path, "README.md").read_text()
        assert worktree_readme == ("pwned\n" if mode is Mode.CHAT else before)


async def test_the_acp_agents_own_process_sees_no_more_than_its_sandbox(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    argv, dirs = scripted_agent(tmp_path)
    async with open_dispatch(tmp_path, probe_result, acp_agent=argv, agent_dirs=dirs,
                             marker="CC-AGENT-SIDE-SECRET") as d:
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.ACP)
        session = await start_acp(run)
        await session.prompt(json.dumps([
            {"op": "local", "path": f"{d.home}/.ssh/id_ed25519"},
            {"op": "local", "path": f"{d.repo}/README.md", "content": "pwned\n"},
            {"op": "local", "path": f"{wt.path}/README.md", "content": "agent edit\n"},
            {"op": "local", "path": f"{wt.path}/agent.key", "content": "k"},
        ]))
        results: list[Any] = json.loads(session.client.updates[-1]["content"]["text"])
        assert "oserror" in results[0]["ok"] and "CC-AGENT-SIDE-SECRET" not in json.dumps(results)
        if wt.strategy is WorktreeStrategy.OVERLAY:  # else it lands in the sandbox's /tmp
            assert "oserror" in results[1]["ok"]
        assert results[2] == {"ok": len("agent edit\n")}
        assert "oserror" in results[3]["ok"]  # a new *.key is refused at create time
        assert (d.repo / "README.md").read_text() == "original readme\n"
        assert not pathlib.Path(wt.path, "agent.key").exists()
        assert any(v.action == "file-write-create" for v in run.handle.violations)


async def test_a_git_worktree_run_reads_git_but_cannot_write_the_checkouts_git(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    from dispatch_kit import git, tree_digest


    async with open_dispatch(tmp_path, probe_result, strategy=WorktreeStrategy.GIT) as d:
        before = tree_digest(d.repo)
        wt = d.worktrees.create("r", "c1")
        head = git("rev-parse", "HEAD", cwd=d.repo).strip()
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.HARNESS)
        status = await run.harness.run("echo changed > README.md; git status --short; "
                                       "git rev-parse HEAD")
        assert status.exit_code == 0, status
        assert " M README.md" in status.stdout and head in status.stdout
        commit = await run.harness.run(
            "git -c user.email=a@b -c user.name=a commit -qam pwned 2>&1; echo rc=$?;"
            f" echo x > {d.repo}/.git/hooks/post-checkout 2>&1; echo hook=$?")
        assert "rc=0" not in commit.stdout and "hook=0" not in commit.stdout, commit
        assert git("rev-parse", "HEAD", cwd=d.repo).strip() == head
        after = tree_digest(d.repo)
        changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        # Only `git worktree add`'s own bookkeeping (made by the server, before the run).
        assert all(k.startswith(".git/worktrees") for k in changed), changed


async def test_a_dispatch_run_cannot_plant_a_host_run_file_in_its_worktree(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    # The write policy reaches dispatch too: the harness bash tool in a chat-mode run.
    async with open_dispatch(tmp_path, probe_result) as d:
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.HARNESS)
        done = await run.harness.run(
            "mkdir -p sub && cd sub && git init -q; echo init=$?; cd ..; "
            "echo evil > .bashrc; echo rc=$?; mkdir .vscode; echo vscode=$?; "
            "echo ok > fine.txt; echo fine=$?"
        )
        codes = dict(word.split("=") for word in done.stdout.split())
        assert codes["fine"] == "0" and "0" not in (codes["init"], codes["rc"], codes["vscode"])
        tree = pathlib.Path(wt.path)
        assert not (tree / "sub" / ".git").exists() and not (tree / ".bashrc").exists()
        assert not (tree / ".vscode").exists() and (tree / "fine.txt").exists()
        refused = [v for v in run.handle.violations if v.action == "file-write-create"]
        assert len(refused) == 3, refused


@pytest.mark.parametrize("plant", [
    "ln -s {victim} cc-server-notices",
    "mkfifo cc-server-notices",
    "echo '{{}}' > mine.json && ln mine.json cc-server-notices",
], ids=["symlink", "fifo", "hard-link"])
async def test_the_server_never_writes_a_notice_through_what_the_agent_planted(
    tmp_path: pathlib.Path, probe_result: ProbeResult, plant: str
) -> None:
    """The notice file is in the run's state directory, which the agent can write: a symlink
    there to a host file, a FIFO, or a second name of another file is never written through,
    and the server does not block."""
    victim = tmp_path / "host-file.txt"  # outside every bind: the agent names it blind
    victim.write_text("host content\n")
    async with open_dispatch(tmp_path, probe_result) as d:
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.CLAUDE)
        assert run.notices is not None
        planted = await run.harness.run(f'cd "$HOME" && {plant.format(victim=victim)}; ls -l')
        assert "cc-server-notices" in planted.stdout, planted
        refused = await run.harness.run("echo x > .env")
        assert [v.action for v in refused.violations] == ["file-write-create"], refused
        assert run.violations.total == 1
        assert victim.read_text() == "host content\n"
        notices = pathlib.Path(run.state_dir, "cc-server-notices")
        if notices.is_file() and not notices.is_symlink():
            assert "blocked by sandbox policy" not in notices.read_text()
