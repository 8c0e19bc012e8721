"""Dispatch: an agent run in a conversation's worktree, behind one policy.

`DispatchService.open_run` turns a request (worktree, mode, capabilities, agent) into a run:

1. the worktree's registered checkout joins `protectedPaths`; the worktree is the one writable
   bind (in chat; read-only in the other modes) and the guest workdir; the run's private state
   directory (its HOME and `CLAUDE_CONFIG_DIR`) is a runner state directory; the agent's install
   directories are read-only binds;
2. the credential broker's grant (only what the capabilities allow) adds its binds and variables;
   the server's CA-bundle variables (`SSL_CERT_FILE`, ...) pass with their files bound read-only
   (`ca_bundle_binds`), and the operator's model endpoint (`ANTHROPIC_BASE_URL`) passes too;
3. an agent run with the operator's model key gets its `ModelBroker` (`dispatch.model_credentials`:
   a sentinel key and the session's CA in the agent's environment, the real key swapped in by the
   session's proxy on the model host only);
   the sandbox is launched with the standard create-time globs (`.env`, `*.key`, `*.pem`) and the
   operator's egress (`egress.operator`: the baseline's extension, the refusal advice, the
   broker's tunnel handler):
   `native` when the boot probe found a backend and `--sandbox` is on, else `none`. Linux native
   without create-time rules refuses here (BackendUnavailable), and that is what the client sees;
4. the guardrail chain of the compiled policy is built, and the agent's own launch passes it as a
   `bash` action: a refusal (or a guardrail that raises) refuses the dispatch;
5. the seam starts: Claude Code (`dispatch.claude`) or an ACP agent (`dispatch.acp`); the harness
   bash tool and the in-process file tools are ready for every run.

Every refusal of the run is a violation of its `ViolationLog` (`dispatch.violations`): kept,
audited once, and told to the agent's model (the notice file of an agent run).

`close_run` revokes the model broker first, then tears the rest down in reverse: agent,
terminals, sandbox (its proxies), the grant (revoked), the state directory. Nothing of the run is
left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from cc_server.backends.bubblewrap import SYSTEM_RO_PATHS
from cc_server.backends.egress_bridge import bridge_env
from cc_server.backends.peer import PeerRule
from cc_server.dispatch.actions import Action, ActionKind
from cc_server.dispatch.agent_hooks import hook_settings
from cc_server.dispatch.env import EnvRefused, ca_bundle_env, ca_bundle_paths, sanitized_env
from cc_server.dispatch.guardrails import Guardrail, GuardrailChain, standard_chain
from cc_server.dispatch.harness import HarnessBash
from cc_server.dispatch.model_credentials import ModelBroker, ModelCredentials
from cc_server.dispatch.tools import FileTools
from cc_server.dispatch.violations import NoticeFile, ViolationLog
from cc_server.dispatch.worktrees import Worktree, WorktreeManager, WorktreeStrategy
from cc_server.egress.operator import MODEL_URL_ENV, OperatorEgress
from cc_server.errors import BadSpec, ConfigError, LimitReached
from cc_server.policy import (
    STANDARD_DENY_CREATE_GLOBS,
    AgentCapabilities,
    Mode,
    SandboxBackend,
    SandboxBindMount,
    SandboxSpec,
)
from cc_server.policy.paths import SECRET_DENY_READ, SYSTEM_DENY_READ, first_exposure, is_within
from cc_server.runtime.handle import SandboxHandle
from cc_server.runtime.port import SandboxManager

__all__ = [
    "AgentKind",
    "CredentialBrokerPort",
    "DispatchConfig",
    "DispatchRun",
    "DispatchService",
    "Grant",
]

log = logging.getLogger("cc_server.dispatch")
MAX_RUNS: Final = 64  # live runs per server: each holds a sandbox, proxies and an agent process


class AgentKind(enum.StrEnum):
    """Which seam a run uses."""

    CLAUDE = "claude"  # seam 1: the configured Claude Code CLI through the SandboxPort
    ACP = "acp"  # seam 2: the configured ACP agent, cc-server as its client
    HARNESS = "harness"  # no agent process: the harness bash tool and the file tools only


class Grant(Protocol):
    """What a run was granted (`dispatch.credentials.Grant`)."""

    @property
    def env(self) -> Mapping[str, str]: ...

    @property
    def bind_mounts(self) -> tuple[SandboxBindMount, ...]: ...


class CredentialBrokerPort(Protocol):
    """What the service needs of the credential broker (`dispatch.credentials`)."""

    def grant(self, spec: SandboxSpec, run_id: str) -> Grant: ...

    def admit(self, run_id: str, rule: PeerRule) -> None: ...

    def revoke(self, run_id: str) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchConfig:
    """The operator's dispatch settings."""

    state_base: str  # private directory for each run's HOME and CLAUDE_CONFIG_DIR
    claude_path: str | None = None  # the Claude Code CLI (absolute path)
    acp_agent: tuple[str, ...] | None = None  # argv of the ACP agent
    agent_dirs: tuple[str, ...] = ()  # read-only binds the agents need (an npm prefix, ...)
    guardrails: tuple[Guardrail, ...] = ()  # the operator's extra guardrails, after the standard
    server_private: tuple[str, ...] = ()  # the token file, the socket base: never inside a bind
    # the operator's extension of the baseline allowlist and the agents' model endpoint
    operator_egress: OperatorEgress = field(default_factory=OperatorEgress)
    # the agents' model key, brokered per run (dispatch.model_credentials); None: not brokered
    model_credentials: ModelCredentials | None = None

    def agent_argv(self, agent: AgentKind) -> tuple[str, ...] | None:
        """The configured command of an agent kind (None for the harness or when not set)."""
        if agent is AgentKind.CLAUDE:
            return None if self.claude_path is None else (self.claude_path,)
        if agent is AgentKind.ACP:
            return self.acp_agent
        return None


@dataclass(eq=False)
class DispatchRun:
    """One live run."""

    run_id: str
    agent: AgentKind
    worktree: Worktree
    spec: SandboxSpec
    handle: SandboxHandle
    chain: GuardrailChain
    tools: FileTools
    harness: HarnessBash
    grant: Grant
    env: dict[str, str]  # what the agent process gets
    state_dir: str
    agent_argv: tuple[str, ...] | None  # the configured agent command (None: harness only)
    violations: ViolationLog  # every refusal of the run: kept, audited, told to the model
    server_environ: Mapping[str, str] = field(repr=False)  # for checking additions only
    # Prepended to the agent's own argv (after the guardrails judged it): sets the agent's
    # NO_PROXY when the model endpoint is on loopback (see `DispatchService.agent_prefix`).
    agent_prefix: tuple[str, ...] = ()
    acp: Any = None  # the AcpSession of an ACP run (dispatch.acp)
    notices: NoticeFile | None = None  # an agent run's notices for its hook
    model: ModelBroker | None = None  # the run's model credential (sentinel, session CA)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def backend(self) -> SandboxBackend:
        """The backend actually running (the run's badge)."""
        return self.handle.backend

    @property
    def mode(self) -> Mode:
        return self.spec.mode

    def to_json(self) -> dict[str, Any]:
        """The API form."""
        return {
            "runId": self.run_id,
            "agent": str(self.agent),
            "backend": str(self.backend),
            "sandboxed": self.backend is not SandboxBackend.NONE,
            "mode": str(self.mode),
            "worktree": self.worktree.to_json(),
            "protectedPaths": list(self.spec.protected_paths),
            "state": str(self.handle.state),
            "violations": self.violations.to_json(),
            "violationCount": self.violations.total,
            "guardrails": list(self.chain.names),
            **self.details,
        }


class DispatchService:
    """Owns the worktrees and the live runs of one server."""

    def __init__(
        self,
        *,
        manager: SandboxManager,
        worktrees: WorktreeManager,
        broker: CredentialBrokerPort,
        config: DispatchConfig,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.manager = manager
        self.worktrees = worktrees
        self.broker = broker
        self.config = config
        self.environ = dict(os.environ if environ is None else environ)  # the server's own
        self.runs: dict[str, DispatchRun] = {}
        os.makedirs(config.state_base, mode=0o700, exist_ok=True)
        # No run survives its server: what a killed one left is removed (one server per
        # dispatch directory, like the worktrees).
        for name in os.listdir(config.state_base):
            if name.startswith("run-"):
                shutil.rmtree(os.path.join(config.state_base, name), ignore_errors=True)

    # -- the spec --

    def spec_for(
        self,
        run_id: str,
        worktree: Worktree,
        *,
        workspace_id: str,
        mode: Mode,
        capabilities: AgentCapabilities,
        state_dir: str,
        extra_binds: Sequence[SandboxBindMount] = (),
    ) -> SandboxSpec:
        """The standard dispatch spec of a run (see the module docstring)."""
        binds = [SandboxBindMount(host_path=worktree.path)]
        if worktree.strategy is WorktreeStrategy.GIT:
            # The worktree's .git names the checkout's: git reads it there (never writes).
            binds.append(SandboxBindMount(host_path=os.path.join(worktree.original, ".git"),
                                          read_only=True))
        binds += [
            SandboxBindMount(host_path=d, read_only=True)
            for d in self.config.agent_dirs
            if d != worktree.path
        ]
        binds += list(extra_binds)
        return SandboxSpec(
            session_id=run_id,
            workspace_id=workspace_id,
            agent_id=None,
            bind_mounts=tuple(binds),
            guest_workdir=worktree.path,
            mode=mode,
            capabilities=capabilities,
            protected_paths=(worktree.original,),
            runner_state_dirs=(state_dir,),
        )

    def _check_private(self, spec: SandboxSpec) -> None:
        """A run that could read the server's token could drive the server: refuse binds that
        would show it (or the socket base holding every session's proxies)."""
        private = [os.path.realpath(p) for p in self.config.server_private]
        binds = [mount.host_path for mount in spec.bind_mounts]
        exposed = first_exposure(binds, private, os.path.realpath)
        if exposed is not None:
            raise BadSpec(
                f"the dispatch bind {binds[exposed[0]]!r} would expose the server's "
                f"private {exposed[1]!r}",
                fix="configure agent directories and the dispatch directory outside it",
            )

    def agent_env(
        self,
        state_dir: str,
        grant: Grant,
        *,
        inherit_host: bool,
        ca_env: Mapping[str, str] | None = None,
        brokered: Mapping[str, str] | None = None,
    ) -> dict[str, str]:
        """The agent process's environment.

        Sanitised (the allowlist, never a secret-named variable) plus the run's HOME and Claude
        config directory, the CA-bundle variables `ca_env`, the operator's model endpoint and the
        grant's variables; the proxy variables are added by the native plan where egress
        applies. `inherit_host` is the one exception the reference page names: Claude Code
        through NoSandboxAdapter inherits the host environment. `brokered` comes last and
        unchecked: the model broker's sentinel key (worthless outside this run's proxy, so no
        secret) and its CA bundle.

        Raises:
            EnvRefused: (`operator` set) an addition carries the value of a secret-like variable
                of the server's environment; the message names both.
        """
        ca_env = ca_env or {}
        add = {
            "HOME": state_dir,
            "CLAUDE_CONFIG_DIR": os.path.join(state_dir, ".claude"),
            **ca_env,
            **grant.env,
        }
        model_url = self.config.operator_egress.model_url
        if model_url is not None:
            add[MODEL_URL_ENV] = model_url
        if inherit_host:
            return {**self.environ, **add}
        try:
            return {**sanitized_env(self.environ, add=add), **(brokered or {})}
        except EnvRefused as exc:
            # Nothing here came from the caller: the server's configuration is what to fix.
            raise EnvRefused(
                f"the run's environment cannot be built: {exc.message}",
                fix=(
                    f"the server's {exc.host_variable} is named like a secret and its value "
                    f"appears in {exc.variable}: unset or rename {exc.host_variable} in the "
                    "server's environment (or move CC_SERVER_DISPATCH_DIR), then restart"
                    if exc.host_variable is not None
                    else exc.fix
                ),
                variable=exc.variable,
                host_variable=exc.host_variable,
                operator=True,
            ) from None

    def ca_bundle_binds(self) -> tuple[dict[str, str], tuple[SandboxBindMount, ...]]:
        """The server's CA-bundle variables a run gets, and the read-only binds that make their
        files visible inside its sandbox.

        A bundle under the system paths every sandbox sees read-only (`/usr`, `/etc`, ...) needs
        no bind; any other is bound read-only at its own path (a CA bundle is public). A bundle
        inside a read-denied path (`~/.ssh`, `/etc/ssl/private`, ...) is never bound, and its
        variable is dropped with a log line; so is one that does not exist.
        """
        env: dict[str, str] = {}
        binds: list[SandboxBindMount] = []
        home = self.manager.host.home.rstrip("/") or "/"
        denied = [os.path.join(home, rel) for rel, _ in SECRET_DENY_READ]
        denied += [path for path, _ in SYSTEM_DENY_READ]
        denied = [os.path.realpath(p) for p in denied]
        for name, value in ca_bundle_env(self.environ).items():
            paths = [os.path.realpath(p) for p in ca_bundle_paths(name, value)]
            if any(is_within(path, d) for path in paths for d in denied):
                log.warning("dispatch: %s=%s is in a read-denied path; not passed", name, value)
                continue
            env[name] = value
            binds += [
                SandboxBindMount(host_path=path, read_only=True)
                for path in paths
                if not any(is_within(path, root) for root in SYSTEM_RO_PATHS)
            ]
        unique = {b.host_path: b for b in binds}
        return env, tuple(unique.values())

    def agent_prefix(self, backend: SandboxBackend) -> tuple[str, ...]:
        """What goes before the agent's argv so that a loopback model endpoint is reached
        through the session's proxies: the native plan sets `NO_PROXY` to the loopback
        addresses, which would send the agent to the sandbox's own loopback instead (no
        violation, no answer). `env` resets NO_PROXY for the agent's process tree, without the
        endpoint's host. Empty when there is no such endpoint or no proxy (`none`)."""
        egress = self.config.operator_egress
        if backend is SandboxBackend.NONE or not egress.model_on_loopback:
            return ()
        no_proxy = egress.no_proxy(bridge_env()["NO_PROXY"])
        # /usr/bin/env: on every host the native backends run on, inside every sandbox.
        return ("/usr/bin/env", f"NO_PROXY={no_proxy}", f"no_proxy={no_proxy}")

    # -- runs --

    async def open_run(
        self,
        *,
        worktree_id: str,
        agent: AgentKind,
        mode: Mode = Mode.CHAT,
        capabilities: AgentCapabilities | None = None,
        workspace_id: str = "default",
    ) -> DispatchRun:
        """Launch the run's sandbox and check the agent's launch against the guardrails. The seam
        itself is started by the caller (`dispatch.claude`, `dispatch.acp`).

        Raises:
            BadSpec: unknown worktree.
            ConfigError: the agent is not configured on this server.
            LimitReached: MAX_RUNS runs are live.
            BackendUnavailable: the native backend cannot enforce the dispatch policy here (no
                create-time rules on Linux).
            ActionRefused: a guardrail refused the agent's launch.
            EnvRefused: (a BadSpec, `operator` set) the server's environment would put a
                secret-like variable's value into the run's.
            CcServerError: anything else that kept the sandbox from starting.
        """
        worktree, argv = self._admit_run(worktree_id, agent)
        run_id = f"run-{secrets.token_hex(8)}"
        notices: NoticeFile | None = None
        model: ModelBroker | None = None
        state_dir = os.path.join(self.config.state_base, run_id)
        os.mkdir(state_dir, 0o700)
        caps = capabilities or AgentCapabilities.safe_default()
        try:
            os.mkdir(os.path.join(state_dir, ".claude"), 0o700)
            spec, grant, ca_env = self._spec_and_grant(run_id, functools.partial(
                self.spec_for, run_id, worktree, workspace_id=workspace_id, mode=mode,
                capabilities=caps, state_dir=state_dir))
            egress = self.config.operator_egress
            if self.config.model_credentials is not None and agent is not AgentKind.HARNESS:
                model = ModelBroker(self.config.model_credentials, state_dir, environ=ca_env)
                egress = dataclasses.replace(egress, intercept=model.handler)
            # Seam 1 goes through the SandboxPort the manager picks; the manager keeps the handle
            # so a server shutdown destroys it with the rest.
            handle = self.manager.launch(
                spec,
                deny_create_globs=STANDARD_DENY_CREATE_GLOBS,
                operator_egress=egress,
            )
            if model is not None and handle.backend is SandboxBackend.NONE:
                _unbroker(model, run_id)
                model = None
            self.broker.admit(run_id, handle.sandbox_peers)  # its sandbox asks, nothing else
            violations = _watch_violations(run_id, spec, worktree, handle)
            chain = self._launch_chain(handle, run_id, mode, argv)
            notices = _open_notices(agent, state_dir, violations)
            inherit = agent is AgentKind.CLAUDE and handle.backend is SandboxBackend.NONE
            env = self.agent_env(state_dir, grant, inherit_host=inherit, ca_env=ca_env,
                                 brokered=model.env if model is not None else None)
            harness_env = self.agent_env(state_dir, grant, inherit_host=False, ca_env=ca_env)
            run = DispatchRun(
                run_id=run_id, agent=agent, worktree=worktree, spec=spec, handle=handle,
                chain=chain, tools=FileTools(handle.policy, chain),
                harness=HarnessBash(handle, chain, mode=mode, env=harness_env, cwd=worktree.path),
                grant=grant, env=env, state_dir=state_dir, agent_argv=argv,
                violations=violations, server_environ=self.environ,
                agent_prefix=self.agent_prefix(handle.backend), notices=notices, model=model,
            )
        except BaseException:
            if model is not None:
                model.revoke()
            if notices is not None:
                notices.close()
            await self._release(run_id, state_dir)
            raise
        self.runs[run_id] = run
        return run

    def _admit_run(
        self, worktree_id: str, agent: AgentKind
    ) -> tuple[Worktree, tuple[str, ...] | None]:
        """The worktree and the agent's argv of a run about to open, if one may (see `open_run`:
        LimitReached, BadSpec, ConfigError)."""
        if len(self.runs) >= MAX_RUNS:
            raise LimitReached(f"{MAX_RUNS} runs are live",
                               fix="close one (DELETE /v1/dispatches/ID)")
        worktree = self.worktrees.get(worktree_id)
        argv = self.config.agent_argv(agent)
        if agent is not AgentKind.HARNESS and argv is None:
            raise ConfigError(
                f"no {agent} agent is configured on this server",
                fix="set CC_SERVER_CLAUDE_PATH or CC_SERVER_ACP_AGENT and restart",
            )
        return worktree, argv

    def _spec_and_grant(
        self, run_id: str, make_spec: Callable[..., SandboxSpec]
    ) -> tuple[SandboxSpec, Grant, dict[str, str]]:
        """The run's spec (`make_spec`: `spec_for` with the run's arguments) with its credential
        grant's and the CA bundle's binds, the grant, and the CA-bundle variables (BadSpec: the
        spec would show the server's private files)."""
        grant = self.broker.grant(make_spec(), run_id)
        ca_env, ca_binds = self.ca_bundle_binds()
        spec = make_spec(extra_binds=(*grant.bind_mounts, *ca_binds))
        self._check_private(spec)
        return spec, grant, ca_env

    def _launch_chain(
        self, handle: SandboxHandle, run_id: str, mode: Mode, argv: tuple[str, ...] | None
    ) -> GuardrailChain:
        """The run's guardrail chain, the agent's launch checked against it (ActionRefused)."""
        chain = standard_chain(handle.policy, extra=self.config.guardrails)
        if argv is not None:
            chain.check(
                Action(kind=ActionKind.BASH, tool="bash", session_id=run_id, mode=mode, argv=argv)
            )
        return chain

    async def _release(self, run_id: str, state_dir: str) -> None:
        """Destroy a run's sandbox (its proxies), revoke its grant, remove its state directory.
        Each step runs even when one before it fails; each is a no-op for what was never made."""
        try:
            await self.manager.destroy(run_id)
        finally:
            self.broker.revoke(run_id)
            shutil.rmtree(state_dir, ignore_errors=True)

    def get(self, run_id: str) -> DispatchRun:
        """A live run, or BadSpec."""
        run = self.runs.get(run_id)
        if run is None:
            raise BadSpec(f"no live dispatch run {run_id!r}", fix="open one (POST /v1/dispatches)")
        return run

    def runs_using(self, worktree_id: str) -> list[str]:
        """The ids of the live runs in the worktree (it is not removed while there are any)."""
        return [r.run_id for r in self.runs.values() if r.worktree.worktree_id == worktree_id]

    async def close_run(self, run_id: str) -> bool:
        """Tear a run down: agent, terminals, sandbox and proxies, grant, state. Idempotent;
        False when unknown."""
        run = self.runs.pop(run_id, None)
        if run is None:
            return False
        if run.model is not None:
            run.model.revoke()  # first: nothing can use the key while the rest goes down
        try:
            if run.acp is not None:
                await run.acp.aclose()
        finally:
            try:
                await run.harness.aclose()
            finally:
                if run.notices is not None:
                    run.notices.close()
                await self._release(run_id, run.state_dir)
        return True

    async def aclose(self) -> None:
        """Close every run, then unmount the worktrees (their layers stay). Idempotent; the
        grants are revoked and the worktrees unmounted even when a run's teardown fails or the
        close is cancelled."""
        try:
            for run_id in list(self.runs):
                with contextlib.suppress(Exception):
                    await self.close_run(run_id)
        finally:
            try:
                self.broker.close()
            finally:
                self.worktrees.close()


def _open_notices(agent: AgentKind, state_dir: str, violations: ViolationLog) -> NoticeFile | None:
    """An agent's notice file, fed every refusal of the run: its model hears of each from the
    notice hook (seam 1 passes it with --settings; the ACP adapter's Claude Code reads the user
    settings, written here). None for the harness, which has no model."""
    if agent is AgentKind.HARNESS:
        return None
    notices = NoticeFile(state_dir)
    try:
        violations.listeners.append(notices.append)
        if agent is AgentKind.ACP:
            with open(os.path.join(state_dir, ".claude", "settings.json"), "x") as f:
                json.dump(hook_settings(state_dir), f)
    except BaseException:
        notices.close()
        raise
    return notices


def _watch_violations(
    run_id: str, spec: SandboxSpec, worktree: Worktree, handle: SandboxHandle
) -> ViolationLog:
    """The run's violation log, fed by its sandbox from now on."""
    violations = ViolationLog(run_id, spec.session_id, conversation_id=worktree.conversation_id)
    for seen in handle.violations:  # none yet: nothing has run
        violations.sandbox(seen)
    handle.violation_listeners.append(violations.sandbox)
    return violations


def _unbroker(model: ModelBroker, run_id: str) -> None:
    """Revoke a run's model broker: without a sandbox there is no proxy to swap the sentinel
    in, so its agent gets no model key at all."""
    log.warning("dispatch: run %s has no sandbox; its model key is not brokered", run_id)
    model.revoke()
