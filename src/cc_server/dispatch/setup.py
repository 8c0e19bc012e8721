"""Dispatch at boot: its configuration from the server's environment, and the service built on it
(the stale credential grants of a killed server removed, its overlays re-mounted)."""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Mapping, Sequence

from cc_server.dispatch.acp import start_acp
from cc_server.dispatch.credentials import CredentialBroker, remove_stale_grant_dirs
from cc_server.dispatch.model_credentials import ModelCredentials
from cc_server.dispatch.service import AgentKind, DispatchConfig, DispatchRun, DispatchService
from cc_server.dispatch.worktrees import WorktreeManager
from cc_server.egress.operator import OperatorEgress
from cc_server.errors import ConfigError
from cc_server.policy import AgentCapabilities, Mode
from cc_server.policy.paths import is_within
from cc_server.runtime.egress import egress_base_dir
from cc_server.runtime.port import SandboxManager

__all__ = ["config_from_env", "default_agent_dirs", "open_dispatch_run", "open_service"]


def default_agent_dirs(argv: tuple[str, ...]) -> list[str]:
    """The directories an agent command needs read-only: for every absolute word that exists,
    its `node_modules` tree when it lives in one (a package's imports), else its directory."""
    dirs: list[str] = []
    for word in argv:
        if not os.path.isabs(word) or not os.path.exists(word):
            continue
        for path in dict.fromkeys((os.path.abspath(word), os.path.realpath(word))):
            marker = "/node_modules/"
            root = path[: path.index(marker) + len(marker) - 1] if marker in path \
                else os.path.dirname(path)
            if root not in dirs and not any(is_within(root, d) for d in dirs):
                dirs.append(root)
    return dirs


def config_from_env(
    environ: Mapping[str, str], allow_domains: Sequence[str] = ()
) -> tuple[DispatchConfig, str, str | None]:
    """The dispatch config, the worktree directory and the GitHub token file, from the server's
    environment and the `--dispatch-allow-domain` patterns.

    Raises:
        ConfigError: a configured path is not absolute, the agent command does not parse, or
            the model key file is unusable.
        BadSpec: a dispatch egress setting is malformed (InvalidPattern for an allowlist entry).
    """
    claude = environ.get("CC_SERVER_CLAUDE_PATH") or None
    if claude is not None and not os.path.isabs(claude):
        raise ConfigError(f"CC_SERVER_CLAUDE_PATH must be absolute, got {claude!r}")
    acp_line = environ.get("CC_SERVER_ACP_AGENT") or None
    try:
        acp_argv = tuple(shlex.split(acp_line)) if acp_line else None
    except ValueError as exc:
        raise ConfigError(f"CC_SERVER_ACP_AGENT does not parse: {exc}") from None
    state_home = environ.get("XDG_STATE_HOME") or os.path.join(
        environ.get("HOME") or os.path.expanduser("~"), ".local", "state")
    base = environ.get("CC_SERVER_DISPATCH_DIR") or os.path.join(state_home, "cc-server")
    if not os.path.isabs(base):
        raise ConfigError(f"CC_SERVER_DISPATCH_DIR must be absolute, got {base!r}")
    explicit = [d for d in (environ.get("CC_SERVER_AGENT_DIRS") or "").split(":") if d]
    agent_dirs = explicit or [
        *(default_agent_dirs((claude,)) if claude else []),
        *(default_agent_dirs(acp_argv) if acp_argv else []),
    ]
    token_file = environ.get("CC_SERVER_GITHUB_TOKEN_FILE") or None
    egress = OperatorEgress.build(allow_domains, environ)
    config = DispatchConfig(
        state_base=os.path.join(base, "runs"), claude_path=claude, acp_agent=acp_argv,
        agent_dirs=tuple(dict.fromkeys(os.path.realpath(d) for d in agent_dirs)),
        operator_egress=egress,
        model_credentials=ModelCredentials.from_env(environ, egress),
    )
    return config, os.path.join(base, "worktrees"), token_file


def open_service(
    manager: SandboxManager,
    *,
    server_private: Sequence[str] = (),
    environ: Mapping[str, str] = os.environ,
    allow_domains: Sequence[str] = (),
) -> DispatchService:
    """The dispatch service, configured from `environ` and `allow_domains`; what must stay
    out of every run's binds is `server_private` and the model key file.

    Raises:
        ConfigError: the dispatch configuration is wrong (BadSpec: its egress patterns).
        EnforcementFailed: the dispatch directory is not private.
        BackendUnavailable: no way to make worktrees here.
    """
    config, worktree_dir, token_file = config_from_env(environ, allow_domains)
    creds = config.model_credentials
    private = (*server_private, *([creds.key_file] if creds is not None else []))
    config = dataclasses.replace(config, server_private=private)
    remove_stale_grant_dirs(egress_base_dir())
    os.makedirs(os.path.dirname(worktree_dir), mode=0o700, exist_ok=True)
    worktrees = WorktreeManager(base=worktree_dir)  # re-mounts the overlays a killed server left
    try:
        return DispatchService(
            manager=manager, worktrees=worktrees,
            broker=CredentialBroker(base_dir=egress_base_dir(), github_token_file=token_file),
            config=config,
            environ=environ,
        )
    except BaseException:
        worktrees.close()  # a server that does not start leaves no mount
        raise


async def open_dispatch_run(
    service: DispatchService,
    *,
    worktree_id: str,
    agent: AgentKind,
    mode: Mode,
    capabilities: AgentCapabilities | None,
    workspace_id: str,
) -> DispatchRun:
    """Open a run (`DispatchService.open_run`) and, for `acp`, complete the agent's handshake;
    a run whose handshake fails is closed again.

    Raises:
        what `DispatchService.open_run` and `start_acp` raise.
    """
    run = await service.open_run(worktree_id=worktree_id, agent=agent, mode=mode,
                                 capabilities=capabilities, workspace_id=workspace_id)
    if run.agent is AgentKind.ACP:
        try:
            await start_acp(run)
        except BaseException:
            await service.close_run(run.run_id)
            raise
    return run
