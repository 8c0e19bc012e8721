"""SandboxPort, its two adapters, and the SandboxManager that chooses between them.

The choice is the reference page's, exactly:
- unspecified backend: `native` when the boot probe found one and `--sandbox` is on, else `none`;
- an explicit `native` that the host cannot provide fails loudly (never steps down to `none`);
- an explicit `microvm` fails loudly until the microVM backend exists here;
- an explicit `none` runs on the host.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from cc_server.backends.bubblewrap import plan_bubblewrap
from cc_server.backends.none import plan_none
from cc_server.backends.plan import Command
from cc_server.backends.probe import ProbeResult
from cc_server.errors import BackendUnavailable, BadSpec, CcServerError
from cc_server.policy import (
    HostFacts,
    Platform,
    SandboxBackend,
    SandboxSpec,
    compile_policy,
)
from cc_server.runtime.events import SandboxState
from cc_server.runtime.handle import Planner, SandboxHandle

__all__ = ["NativeSandboxAdapter", "NoSandboxAdapter", "SandboxManager", "SandboxPort"]


class SandboxPort(Protocol):
    """Launches sandboxes of one backend."""

    backend: SandboxBackend

    def launch(
        self, spec: SandboxSpec, *, deny_create_globs: Iterable[str] = ()
    ) -> SandboxHandle:
        """Compile the spec and return a warm handle, or raise a CcServerError."""
        ...


def _launch(
    spec: SandboxSpec,
    host: HostFacts,
    backend: SandboxBackend,
    planner_for: Planner | None,
    deny_create_globs: Iterable[str],
) -> SandboxHandle:
    policy = compile_policy(spec, host, deny_create_globs=deny_create_globs)
    planner = planner_for if planner_for is not None else plan_none
    handle = SandboxHandle(
        session_id=spec.session_id, backend=backend, policy=policy, planner=planner
    )
    try:
        # A dry plan at launch: a policy the backend cannot enforce fails here, before any exec.
        handle.plan(Command(argv=("/bin/true",)))
    except CcServerError as exc:
        handle.fail(exc)
        raise
    handle.details["workdir"] = policy.workdir
    handle.transition(SandboxState.WARM)
    return handle


@dataclass
class NoSandboxAdapter:
    """`none`: the command runs on the host. The caller decides what environment it passes."""

    host: HostFacts
    backend: SandboxBackend = SandboxBackend.NONE

    def launch(
        self, spec: SandboxSpec, *, deny_create_globs: Iterable[str] = ()
    ) -> SandboxHandle:
        """Compile the spec (for its working directory) and return a warm `none` handle.

        Raises:
            BadSpec: the spec does not compile (a bind source is missing, a glob is malformed).
        """
        return _launch(spec, self.host, self.backend, None, deny_create_globs)


@dataclass
class NativeSandboxAdapter:
    """`native`: bubblewrap on Linux and WSL2; Seatbelt on macOS (not built here yet)."""

    probe_result: ProbeResult
    host: HostFacts
    backend: SandboxBackend = SandboxBackend.NATIVE

    @property
    def available(self) -> bool:
        """Whether the boot probe found a native backend on this host."""
        return self.probe_result.available

    def _planner(self) -> Planner:
        result = self.probe_result
        if not result.available:
            raise BackendUnavailable(
                "no OS-native sandbox on this host",
                fix=result.hint or "install the native sandbox tools",
            )
        if result.mechanism == "bubblewrap" and self.host.platform in (
            Platform.LINUX,
            Platform.WSL2,
        ):
            return partial(plan_bubblewrap, host=self.host, bwrap=result.tools["bwrap"])
        raise BackendUnavailable(
            f"the {result.mechanism} adapter is not available in this build",
            fix="use a Linux host with bubblewrap, or request backend 'none' explicitly",
        )

    def launch(
        self, spec: SandboxSpec, *, deny_create_globs: Iterable[str] = ()
    ) -> SandboxHandle:
        """Compile the spec and return a warm native handle.

        Raises:
            BackendUnavailable: the probe found no native backend, or the policy needs rules the
                backend cannot enforce (create-time filename globs on Linux).
            BadSpec: the spec does not compile.
            EnforcementFailed: the seccomp filter could not be built.
        """
        return _launch(spec, self.host, self.backend, self._planner(), deny_create_globs)


@dataclass
class SandboxManager:
    """Owns every live sandbox of a process and picks the backend for each launch."""

    probe_result: ProbeResult
    host: HostFacts
    sandbox_on: bool = True
    handles: dict[str, SandboxHandle] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.native = NativeSandboxAdapter(probe_result=self.probe_result, host=self.host)
        self.none = NoSandboxAdapter(host=self.host)

    def choose(self, requested: SandboxBackend | None) -> SandboxPort:
        """The adapter for a request; `None` means the caller did not specify one.

        Raises:
            BackendUnavailable: an explicitly requested backend cannot run on this host.
        """
        if requested is None:
            if self.sandbox_on and self.native.available:
                return self.native
            return self.none
        if requested is SandboxBackend.NONE:
            return self.none
        if requested is SandboxBackend.NATIVE:
            if not self.native.available:
                raise BackendUnavailable(
                    "backend 'native' was requested but this host has no OS-native sandbox",
                    fix=self.probe_result.hint or "install the native sandbox tools",
                )
            return self.native
        raise BackendUnavailable(
            "backend 'microvm' was requested but this host cannot boot a microVM",
            fix="request 'native' or leave the backend unspecified",
        )

    def launch(
        self,
        spec: SandboxSpec,
        *,
        backend: SandboxBackend | None = None,
        deny_create_globs: Iterable[str] = (),
    ) -> SandboxHandle:
        """Launch a sandbox for `spec` and keep it until `destroy`.

        Raises:
            BadSpec: the spec is invalid, or a sandbox with this sessionId is already live.
            BackendUnavailable: the requested backend cannot run here.
            EnforcementFailed: isolation could not be prepared.
        """
        if spec.session_id in self.handles:
            raise BadSpec(
                f"a sandbox with sessionId {spec.session_id!r} is already live",
                fix="destroy it first or use another sessionId",
            )
        handle = self.choose(backend).launch(spec, deny_create_globs=deny_create_globs)
        self.handles[spec.session_id] = handle
        return handle

    async def destroy(self, session_id: str) -> None:
        """Destroy one sandbox; unknown or already destroyed ids are fine (idempotent)."""
        handle = self.handles.pop(session_id, None)
        if handle is not None:
            await handle.destroy()

    async def aclose(self) -> None:
        """Destroy every live sandbox. Idempotent."""
        for session_id in list(self.handles):
            await self.destroy(session_id)

