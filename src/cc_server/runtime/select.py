"""Which backend runs a launch, and the planner for it. No asyncio here: the CLI's attached path
uses this directly and pays no event-loop import.

The choice is the reference page's, exactly:
- unspecified backend: the configured default when there is one (a server that prefers
  `microvm`); `microvm` there steps down to `native` when this host cannot boot a VM, with a log
  line saying so, and fails loudly when native is missing too (stepping down never reaches
  `none`). Without a configured default: `native` when the boot probe found one and
  `--sandbox` is on, else `none`;
- an explicit `native` that the host cannot provide fails loudly (never steps down to `none`);
- an explicit `microvm` on a host whose microVM probe found no way to boot one fails loudly,
  with the probe's reason;
- an explicit `none` runs on the host.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from enum import StrEnum
from typing import Final

from cc_server.backends.bubblewrap import BubblewrapPlanner
from cc_server.backends.identity import IDENTITY_TOOL, SANDBOX_GID, SANDBOX_UID
from cc_server.backends.microvm_verdict import MicroVMVerdict, microvm_unavailable
from cc_server.backends.none import NonePlanner
from cc_server.backends.plan import Planner, SandboxIdentity
from cc_server.backends.probe import BubblewrapTools, Mechanism, ProbeResult
from cc_server.backends.seatbelt import SeatbeltPlanner, darwin_user_temp_dir
from cc_server.errors import BackendUnavailable, ConfigError
from cc_server.policy import PROTECTED_PATTERN_NAMES, HostFacts, Platform, SandboxBackend

__all__ = [
    "WRITE_PROTECTION_ENV",
    "EgressRoute",
    "MicroVMVerdict",  # backends.microvm_verdict, handed on
    "choose_backend",
    "egress_route",
    "microvm_unavailable",
    "planner_for",
    "protected_patterns_for",
    "sandbox_identity",
]

log = logging.getLogger("cc_server.runtime")


def choose_backend(
    probe_result: ProbeResult,
    requested: SandboxBackend | None,
    *,
    sandbox_on: bool,
    microvm: MicroVMVerdict | None = None,
    default: SandboxBackend | None = None,
) -> SandboxBackend:
    """The backend a launch gets; `requested=None` means the caller did not specify one, and
    `default` is what this process prefers then (None: the reference page's native-or-none).

    Raises:
        BackendUnavailable: an explicitly requested backend cannot run on this host, or a
            `microvm` default cannot step down because native is missing too.
    """
    if requested is None:
        if default is SandboxBackend.MICROVM and sandbox_on:
            if microvm is not None and microvm.available:
                return SandboxBackend.MICROVM
            why = microvm.reason if microvm is not None else "the microVM runtime was not probed"
            if not probe_result.available:
                raise BackendUnavailable(
                    f"the default backend 'microvm' cannot run here ({why}) and there is no "
                    "native sandbox to step down to",
                    fix=probe_result.hint or "install QEMU (scripts/bootstrap) or bubblewrap",
                )
            log.warning("microvm unavailable (%s); stepping down to native", why)
            return SandboxBackend.NATIVE
        if sandbox_on and probe_result.available:
            return SandboxBackend.NATIVE
        return SandboxBackend.NONE
    if requested is SandboxBackend.NATIVE and not probe_result.available:
        raise BackendUnavailable(
            "backend 'native' was requested but this host has no OS-native sandbox",
            fix=probe_result.hint or "install the native sandbox tools",
        )
    if requested is SandboxBackend.MICROVM and not (microvm is not None and microvm.available):
        raise microvm_unavailable(microvm)
    return requested


WRITE_PROTECTION_ENV: Final = "CC_SERVER_WRITE_PROTECTION"
LAUNCH_TIME_ONLY: Final = "launch-time"


def protected_patterns_for(
    probe_result: ProbeResult, env: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """The write policy's path patterns a native launch gets by default: bubblewrap's
    create-rule supervisor enforces them at any depth of a writable bind when a write happens.

    A bubblewrap host without the supervisor gets them too, so the launch is refused
    (`BackendUnavailable`, the fix names the build) rather than started with less. Only
    `CC_SERVER_WRITE_PROTECTION=launch-time`, said on purpose, keeps the launch-time read-only
    binds alone (docs/threat-model.md says what they leave open). Other mechanisms have their
    launch-time rules only.

    Raises:
        ConfigError: `CC_SERVER_WRITE_PROTECTION` holds something else.
    """
    env = os.environ if env is None else env
    if probe_result.mechanism is not Mechanism.BUBBLEWRAP:
        return ()
    choice = env.get(WRITE_PROTECTION_ENV, "")
    if choice == LAUNCH_TIME_ONLY:
        return ()
    if choice not in ("", "write-time"):
        raise ConfigError(
            f"{WRITE_PROTECTION_ENV}={choice!r} is not a choice",
            fix=f"unset it (protection when a write happens), or set it to {LAUNCH_TIME_ONLY!r}",
        )
    return PROTECTED_PATTERN_NAMES


def sandbox_identity(probe_result: ProbeResult) -> SandboxIdentity | None:
    """The probe's sandbox identity helper, when this server needs one (it runs as root)."""
    helper = probe_result.tools.get(IDENTITY_TOOL)
    if helper is None:
        return None
    return SandboxIdentity(helper=helper, uid=SANDBOX_UID, gid=SANDBOX_GID)


class EgressRoute(StrEnum):
    """How a native sandbox reaches its session's egress proxies."""

    SOCKETS = "sockets"  # bubblewrap: the proxies' Unix sockets, handed into its own network
    LOOPBACK = "loopback"  # Seatbelt: the host's loopback, shared; the proxies listen on TCP too


def egress_route(backend: SandboxBackend, probe_result: ProbeResult) -> EgressRoute | None:
    """The way a sandbox of `backend` reaches the session's proxies, or None when it gets none
    from the host (`none` keeps the host's network; a microVM has its own link)."""
    if backend is not SandboxBackend.NATIVE:
        return None
    if probe_result.mechanism is Mechanism.BUBBLEWRAP:
        return EgressRoute.SOCKETS
    if probe_result.mechanism is Mechanism.SEATBELT:
        return EgressRoute.LOOPBACK
    return None


def planner_for(
    backend: SandboxBackend,
    probe_result: ProbeResult,
    host: HostFacts,
    *,
    terminal: bool = False,
    temp_dir: str | None = None,
) -> Planner:
    """The planner for `backend` on this host, with tool paths from the probe.

    `terminal` plans the server-hosted terminal's fixed profile (the host network, no new
    session, no egress bridge and no create-time rules: terminal.profile); `temp_dir` stands in
    for the user's temp dir on macOS (`cc-server plan --platform macos` elsewhere).

    Raises:
        BackendUnavailable: the backend cannot plan on this host (no probe result for it, or
            its adapter is not built for this platform).
    """
    if backend is SandboxBackend.NONE:
        return NonePlanner()
    if backend is SandboxBackend.NATIVE and probe_result.available:
        bubblewrap, seatbelt = probe_result.bubblewrap, probe_result.seatbelt
        if bubblewrap is not None and host.platform in (Platform.LINUX, Platform.WSL2):
            if terminal:
                bubblewrap = BubblewrapTools(bwrap=bubblewrap.bwrap)
            return BubblewrapPlanner(
                host=host, tools=bubblewrap, identity=sandbox_identity(probe_result),
                new_session=not terminal, share_net=terminal,
            )
        if seatbelt is not None and host.platform is Platform.MACOS:
            return SeatbeltPlanner(
                host=host, sandbox_exec=seatbelt.sandbox_exec,
                temp_dir=darwin_user_temp_dir(os.environ) if temp_dir is None else temp_dir,
                share_net=terminal,
            )
        if terminal:
            raise BackendUnavailable(
                f"the native terminal profile is not built for {probe_result.mechanism}",
                fix="ask for backend 'none', or use macOS or a Linux host with bubblewrap",
            )
        raise BackendUnavailable(
            f"the {probe_result.mechanism} adapter is not available in this build",
            fix="use macOS or a Linux host with bubblewrap, or request backend 'none' explicitly",
        )
    raise BackendUnavailable(
        f"backend {backend!s} cannot run on this host",
        fix=probe_result.hint or "request 'native' or leave the backend unspecified",
    )
