"""Seam 1: the configured Claude Code CLI, run through the SandboxPort of a dispatch run.

The operator sets the CLI's path (`CC_SERVER_CLAUDE_PATH`; the reference client is the
`@anthropic-ai/claude-code` package from the npm registry, which `scripts/bootstrap --test`
installs pinned under `.cache/npm`). The run's sandbox was launched by `DispatchService.open_run`
through the port the manager chose: `NativeSandboxAdapter` when the probe reports a backend and
`--sandbox` is not off, else `NoSandboxAdapter`, badged `none`.

Inside a native sandbox the CLI sees only the worktree, its own install directory (read-only) and
the run's state directory (HOME, CLAUDE_CONFIG_DIR); its environment is sanitised, and its network
is the session's proxies, so its API calls are allowed or refused by the allowlist and every
refusal is a `network-outbound` violation. Through `none` it inherits the host environment, as
the reference page says, and nothing stands between it and the host.

What the sandbox refuses while the CLI runs reaches its model: every invocation gets
`--settings` with the run's hooks (`dispatch.agent_hooks`): after each tool call the notices of
what the sandbox refused reach the model with the tool's result, and a file tool writing outside
every writable bind is denied with the reason (it would vanish in the sandbox's tmpfs) and
reported: the call's result carries it as a `hook` violation, taken from the run's refusal file
when the CLI exits. The hooks run inside the sandbox like the tools; an agent that tampers with
them only loses its own notices and reports.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Final

from cc_server.dispatch.actions import Action, ActionKind
from cc_server.dispatch.agent_hooks import hook_settings, take_refusals
from cc_server.dispatch.env import sanitized_env
from cc_server.dispatch.harness import BashResult, run_bounded, with_notices
from cc_server.dispatch.service import AgentKind, DispatchRun
from cc_server.errors import BadSpec

__all__ = ["CLAUDE_TIMEOUT_S", "run_claude"]

CLAUDE_TIMEOUT_S: Final = 600.0  # one non-interactive CLI invocation (`-p`), by default
MAX_ARGS: Final = 256  # arguments a client may pass to the CLI
# Options that would replace the run's settings or skip its hooks (`dispatch.agent_hooks`).
RUN_OWNED_OPTIONS: Final = frozenset({"--settings", "--bare"})


async def run_claude(
    run: DispatchRun,
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdin: bytes | None = None,
    timeout_s: float | None = None,
    max_output_bytes: int | None = None,
) -> BashResult:
    """Run the CLI with `args` in the run's sandbox and collect its result.

    The invocation passes the run's guardrail chain as a `bash` action first. `env` adds
    variables (`ANTHROPIC_BASE_URL`, say) to the run's environment; they pass the same check as
    every addition (never a secret-named variable, never a host secret's value).

    Raises:
        BadSpec: the run is not a Claude Code run, the arguments are malformed, or they
            name `--settings` or `--bare` (the run's settings carry its hooks).
        EnvRefused: an added variable is named like a secret or carries a host secret.
        ActionRefused: a guardrail refused the invocation (nothing ran).
        CcServerError: the sandbox could not start it (nothing ran).
    """
    if run.agent is not AgentKind.CLAUDE:
        raise BadSpec(
            f"run {run.run_id} is a {run.agent} run, not a Claude Code run",
            fix="open a dispatch with agent 'claude'",
        )
    if len(args) > MAX_ARGS or any("\x00" in a for a in args):
        raise BadSpec(f"give at most {MAX_ARGS} arguments without NUL bytes")
    taken = [a for a in args if a.split("=", 1)[0] in RUN_OWNED_OPTIONS]
    if taken:
        raise BadSpec(
            f"{taken[0]!r} is the run's: cc-server passes the run's settings (its hooks tell the "
            "model what the sandbox refused and refuse writes that would vanish)",
            fix="leave out --settings and --bare",
        )
    assert run.agent_argv is not None  # open_run refuses an agent that is not configured
    argv = (*run.agent_argv, *args)
    run.chain.check(
        Action(kind=ActionKind.BASH, tool="bash", session_id=run.run_id, mode=run.mode, argv=argv)
    )
    added: dict[str, str] = {}
    if env:
        checked = sanitized_env(run.server_environ, add=dict(env))
        added = {name: checked[name] for name in env}
    settings: tuple[str, ...] = ()
    if run.notices is not None:
        run.notices.clear()
        roots = [m.guest_path for m in run.handle.policy.mounts if m.writable]
        hooks = hook_settings(run.state_dir, write_roots=roots)
        settings = ("--settings", json.dumps(hooks, separators=(",", ":")))
    result = await run_bounded(
        run.handle,
        (*run.agent_prefix, *run.agent_argv, *settings, *args),
        env={**run.env, **added},
        cwd=run.worktree.path,
        stdin=stdin,
        timeout_s=timeout_s or CLAUDE_TIMEOUT_S,
        max_output_bytes=max_output_bytes,
    )
    # The model was told by the hook itself: kept and audited, no second notice.
    refused = tuple(run.violations.record(v, notify=False) for v in take_refusals(run.state_dir))
    result = with_notices(result)
    return dataclasses.replace(result, refusals=refused) if refused else result
