"""SandboxPort, its two adapters, and the SandboxManager that chooses between them.

The backend choice lives in `runtime.select` (the reference page's rules); the manager applies it
and owns every live handle.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from cc_server.backends.plan import Command, Planner
from cc_server.backends.probe import ProbeResult
from cc_server.egress.driver import Resolver
from cc_server.egress.operator import OperatorEgress
from cc_server.egress.resolver import allowlist_for, suggested_capability
from cc_server.errors import BackendUnavailable, BadSpec, CcServerError
from cc_server.policy import (
    CompiledPolicy,
    HostFacts,
    Platform,
    SandboxBackend,
    SandboxSpec,
    compile_policy,
)
from cc_server.runtime.egress import SessionEgress, egress_base_dir, remove_stale_session_dirs
from cc_server.runtime.events import SandboxState
from cc_server.runtime.handle import SandboxHandle
from cc_server.runtime.seatbelt_monitor import SeatbeltMonitor
from cc_server.runtime.select import (
    EgressRoute,
    choose_backend,
    egress_route,
    microvm_unavailable,
    planner_for,
    protected_patterns_for,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from cc_server.backends.microvm_verdict import MicroVMVerdict
    from cc_server.egress.patterns import Allowlist

__all__ = [
    "MicroVMSandboxAdapter",
    "NativeSandboxAdapter",
    "NoSandboxAdapter",
    "SandboxManager",
    "SandboxPort",
    "VmRuntime",
]

_NO_PROBE = ProbeResult(platform=Platform.OTHER, available=False)  # `none` needs no probe


class SandboxPort(Protocol):
    """Launches sandboxes of one backend."""

    backend: SandboxBackend

    def launch(
        self,
        spec: SandboxSpec,
        *,
        deny_create_globs: Iterable[str] = (),
        operator_egress: OperatorEgress | None = None,
    ) -> SandboxHandle:
        """Compile the spec and return a warm handle, or raise a CcServerError.

        `operator_egress` extends the curated baseline of the session's allowlist and names the
        operator's settings in its refusals (a dispatch run's, `egress.operator`)."""
        ...


def _launch(
    spec: SandboxSpec,
    host: HostFacts,
    backend: SandboxBackend,
    planner: Planner,
    deny_create_globs: Iterable[str],
    egress_base: str | None = None,
    egress_resolver: Resolver | None = None,
    route: EgressRoute | None = None,
    operator_egress: OperatorEgress | None = None,
    protected_patterns: tuple[str, ...] = (),
) -> SandboxHandle:
    policy = compile_policy(
        spec, host, deny_create_globs=deny_create_globs, protected_patterns=protected_patterns
    )
    extra = operator_egress.rules if operator_egress is not None else ()
    allowlist = allowlist_for(spec, extra_baseline=extra) if egress_base is not None else None
    handle = SandboxHandle(
        session_id=spec.session_id, backend=backend, policy=policy, planner=planner
    )
    if egress_base is not None and allowlist is not None:

        def suggest(host_name: str) -> str | None:
            return suggested_capability(host_name, spec)

        seatbelt = route is EgressRoute.LOOPBACK  # Seatbelt: denials in the unified log
        handle.egress = SessionEgress(
            session_id=spec.session_id,
            allowlist=allowlist,
            suggest=suggest,
            advice=operator_egress.advice if operator_egress is not None else None,
            intercept=operator_egress.intercept if operator_egress is not None else None,
            on_violation=handle.record_violation,
            on_change=handle.record_egress_change,
            on_request=handle.record_egress_request,
            base_dir=egress_base,
            resolver=egress_resolver,
            tcp=seatbelt,
            peers=handle.sandbox_peers,  # the Unix sockets serve this session's sandboxes only
            monitor=SeatbeltMonitor(
                session_id=spec.session_id, suggest=suggest, on_violation=handle.record_violation
            )
            if seatbelt
            else None,
        )
    return _warm_up(handle)


def _warm_up(handle: SandboxHandle) -> SandboxHandle:
    """A dry plan at launch, so a policy the backend cannot enforce fails here, before any exec
    (the handle goes to `error`); then the handle is `warm`."""
    try:
        handle.plan(Command(argv=("/bin/true",)))
    except CcServerError as exc:
        handle.fail(exc)
        raise
    handle.details["workdir"] = handle.policy.workdir
    handle.transition(SandboxState.WARM)
    return handle


@dataclass
class NoSandboxAdapter:
    """`none`: the command runs on the host. The caller decides what environment it passes."""

    host: HostFacts
    backend: SandboxBackend = SandboxBackend.NONE

    def launch(
        self,
        spec: SandboxSpec,
        *,
        deny_create_globs: Iterable[str] = (),
        operator_egress: OperatorEgress | None = None,
    ) -> SandboxHandle:
        """Compile the spec (for its working directory) and return a warm `none` handle. There
        is no egress to extend (`operator_egress` is accepted and unused).

        Raises:
            BadSpec: the spec does not compile (a bind source is missing, a glob is malformed).
        """
        planner = planner_for(self.backend, _NO_PROBE, self.host)
        return _launch(spec, self.host, self.backend, planner, deny_create_globs)


@dataclass
class NativeSandboxAdapter:
    """`native`: bubblewrap on Linux and WSL2; Seatbelt on macOS (docs/macos.md)."""

    probe_result: ProbeResult
    host: HostFacts
    backend: SandboxBackend = SandboxBackend.NATIVE
    egress_resolver: Resolver | None = None  # name lookups for the proxies (tests inject one)
    _egress_base: str | None = field(default=None, repr=False)

    def egress_base(self) -> str:
        """The private socket directory base; on first use, what a killed server left there is
        removed."""
        if self._egress_base is None:
            base = egress_base_dir()
            remove_stale_session_dirs(base)
            self._egress_base = base
        return self._egress_base

    @property
    def available(self) -> bool:
        """Whether the boot probe found a native backend on this host."""
        return self.probe_result.available

    def launch(
        self,
        spec: SandboxSpec,
        *,
        deny_create_globs: Iterable[str] = (),
        operator_egress: OperatorEgress | None = None,
    ) -> SandboxHandle:
        """Compile the spec and return a warm native handle.

        On Linux the handle carries the session's egress: an HTTP and a SOCKS5 proxy, started
        with its first command, the only way out of the sandbox's network namespace.

        Raises:
            BackendUnavailable: the probe found no native backend, or the policy needs rules the
                backend cannot enforce (create-time filename globs on Linux).
            BadSpec: the spec does not compile (an egressAllowlist entry is malformed, a bind
                source is missing, ...).
            EnforcementFailed: the seccomp filter could not be built, or the private socket
                directory is not private.
        """
        planner = planner_for(self.backend, self.probe_result, self.host)
        route = egress_route(self.backend, self.probe_result)
        base = self.egress_base() if route is not None else None
        return _launch(
            spec,
            self.host,
            self.backend,
            planner,
            deny_create_globs,
            base,
            self.egress_resolver,
            route,
            operator_egress,
            protected_patterns_for(self.probe_result),
        )


class VmRuntime(Protocol):
    """What the manager needs of the microVM runtime (`cc_server.microvm.runtime.MicroVMRuntime`,
    which is built on this package and so is not imported by it)."""

    @property
    def available(self) -> bool:
        """Whether a launch can get a VM here."""
        ...

    @property
    def probe(self) -> MicroVMVerdict:
        """The microVM probe's verdict: why not, when not available."""
        ...

    def launch(
        self,
        policy: CompiledPolicy,
        *,
        allowlist: Allowlist,
        suggest: Callable[[str], str | None],
        resolver: Resolver | None = None,
    ) -> SandboxHandle:
        """A `created` handle whose VM starts restoring now.

        Raises:
            BackendUnavailable: no VM runtime on this host, or no event loop.
            BadSpec: the mounts do not fit a VM.
        """
        ...

    async def aclose(self) -> None:
        """End what the runtime keeps ahead of need (a spare QEMU). Idempotent."""
        ...


@dataclass
class MicroVMSandboxAdapter:
    """`microvm`: each sandbox is a QEMU microVM restored from the runtime's snapshot; its
    commands run on the guest's kernel and its network is the session's proxies only."""

    runtime: VmRuntime | None
    host: HostFacts
    backend: SandboxBackend = SandboxBackend.MICROVM
    egress_resolver: Resolver | None = None

    def launch(
        self,
        spec: SandboxSpec,
        *,
        deny_create_globs: Iterable[str] = (),
        operator_egress: OperatorEgress | None = None,
    ) -> SandboxHandle:
        """Compile the spec and return a `created` handle whose VM is being restored (its first
        exec waits for `warm`; `await handle.ready()` does too). `operator_egress` extends the
        allowlist (its refusal advice is the runtime's own).

        Raises:
            BackendUnavailable: this host cannot boot a microVM (the probe's reason), or the
                policy needs create-time filename rules, which the guest does not enforce yet.
            BadSpec: the spec does not compile or its mounts do not fit a VM.
        """
        policy = compile_policy(spec, self.host, deny_create_globs=deny_create_globs)
        return self.launch_policy(policy, allowlist_spec=spec, operator_egress=operator_egress)

    def launch_policy(
        self,
        policy: CompiledPolicy,
        *,
        allowlist_spec: SandboxSpec | None,
        operator_egress: OperatorEgress | None = None,
    ) -> SandboxHandle:
        """A handle for an already compiled policy. Terminals have no spec: their guest
        reaches the curated baseline through the session's proxies (a VM has no other way out).
        """
        from cc_server.egress.baseline import BASELINE_ALLOWED, BASELINE_DENIED
        from cc_server.egress.patterns import Allowlist

        if self.runtime is None or not self.runtime.available:
            raise microvm_unavailable(self.runtime.probe if self.runtime is not None else None)
        if policy.requires_create_rules:
            raise BackendUnavailable(
                "the policy forbids creating files by name (create-time globs), which the "
                "microVM guest does not enforce",
                fix="request 'native' (with the create-rule supervisor) for this policy",
            )
        spec = allowlist_spec
        extra = operator_egress.rules if operator_egress is not None else ()
        allowlist = (
            allowlist_for(spec, extra_baseline=extra)
            if spec is not None
            else Allowlist(patterns=tuple(BASELINE_ALLOWED), denied=BASELINE_DENIED)
        )

        def suggest(host_name: str) -> str | None:
            return suggested_capability(host_name, spec) if spec is not None else None

        return self.runtime.launch(
            policy, allowlist=allowlist, suggest=suggest, resolver=self.egress_resolver
        )


@dataclass
class SandboxManager:
    """Owns every live sandbox of a process and picks the backend for each launch.

    `microvm` is the microVM runtime the process probed (None: not probed, so an explicit
    `microvm` fails loudly); `default_backend` is what an unspecified request prefers (None:
    native when available, else none; `microvm`: steps down to native with a log line).
    """

    probe_result: ProbeResult
    host: HostFacts
    sandbox_on: bool = True
    egress_resolver: Resolver | None = None  # name lookups for the proxies (tests inject one)
    handles: dict[str, SandboxHandle] = field(default_factory=dict)
    microvm: VmRuntime | None = None
    default_backend: SandboxBackend | None = None

    def __post_init__(self) -> None:
        self.native = NativeSandboxAdapter(
            probe_result=self.probe_result, host=self.host, egress_resolver=self.egress_resolver
        )
        self.none = NoSandboxAdapter(host=self.host)
        self.vm = MicroVMSandboxAdapter(
            runtime=self.microvm, host=self.host, egress_resolver=self.egress_resolver
        )

    def use_microvm(self, runtime: VmRuntime) -> None:
        """Serve `microvm` with this runtime from now on (a CLI daemon probes it on first use)."""
        self.microvm = runtime
        self.vm.runtime = runtime

    def choose(self, requested: SandboxBackend | None) -> SandboxPort:
        """The adapter for a request; `None` means the caller did not specify one.

        Raises:
            BackendUnavailable: an explicitly requested backend cannot run on this host.
        """
        backend = choose_backend(
            self.probe_result,
            requested,
            sandbox_on=self.sandbox_on,
            microvm=self.microvm.probe if self.microvm is not None else None,
            default=self.default_backend,
        )
        if backend is SandboxBackend.MICROVM:
            return self.vm
        return self.native if backend is SandboxBackend.NATIVE else self.none

    def launch(
        self,
        spec: SandboxSpec,
        *,
        backend: SandboxBackend | None = None,
        deny_create_globs: Iterable[str] = (),
        operator_egress: OperatorEgress | None = None,
    ) -> SandboxHandle:
        """Launch a sandbox for `spec` and keep it until `destroy`. `operator_egress`: the
        operator's extension of the baseline allowlist (dispatch runs).

        Raises:
            BadSpec: a sandbox with this sessionId is already live, or the spec does not compile.
            BackendUnavailable: the requested backend cannot run here.
            EnforcementFailed: isolation could not be prepared.
        """
        if spec.session_id in self.handles:
            raise BadSpec(
                f"a sandbox with sessionId {spec.session_id!r} is already live",
                fix="destroy it first or use another sessionId",
            )
        handle = self.choose(backend).launch(
            spec, deny_create_globs=deny_create_globs, operator_egress=operator_egress
        )
        self.handles[spec.session_id] = handle
        return handle

    def launch_terminal(self, policy: CompiledPolicy, *, backend: SandboxBackend) -> SandboxHandle:
        """A warm handle for a server-hosted terminal under `policy`, the fixed terminal profile
        (terminal.profile builds it; there is no spec to compile and no capability gating).

        The backend is always explicit here: `native` never steps down to `none`, whatever
        `--sandbox` says. On bubblewrap the plan keeps the host network (the profile's network
        is open, so no egress proxies) and omits `--new-session` (the shell's PTY stays its
        controlling terminal). The handle is not kept in `handles`: the terminal service owns it.

        Raises:
            BackendUnavailable: `native` on a host without a native backend or whose mechanism
                has no terminal plan here; `microvm` on a host that cannot boot one.
            CcServerError: the backend refuses the profile (the dry plan failed).
        """
        chosen = choose_backend(
            self.probe_result,
            backend,
            sandbox_on=True,
            microvm=self.microvm.probe if self.microvm is not None else None,
        )
        if chosen is SandboxBackend.MICROVM:
            # The shell runs in the guest, on the guest's PTY; the profile's binds are 9p slots
            # and its network is the session's proxies (the VM has no other way out).
            return self.vm.launch_policy(policy, allowlist_spec=None)
        probe_result = _NO_PROBE if chosen is SandboxBackend.NONE else self.probe_result
        planner = planner_for(chosen, probe_result, self.host, terminal=True)
        return _warm_up(
            SandboxHandle(
                session_id=policy.session_id, backend=chosen, policy=policy, planner=planner
            )
        )

    async def destroy(self, session_id: str) -> None:
        """Destroy one sandbox; unknown or already destroyed ids are fine (idempotent)."""
        handle = self.handles.pop(session_id, None)
        if handle is not None:
            await handle.destroy()

    async def aclose(self) -> None:
        """Destroy every live sandbox and end the microVM runtime's spare. Idempotent."""
        for session_id in list(self.handles):
            await self.destroy(session_id)
        if self.microvm is not None:
            await self.microvm.aclose()
