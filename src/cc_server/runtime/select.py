"""Which backend runs a launch, and the planner for it. No asyncio here: the CLI's attached path
uses this directly and pays no event-loop import.

The choice is the reference page's, exactly:
- unspecified backend: `native` when the boot probe found one and `--sandbox` is on, else `none`;
- an explicit `native` that the host cannot provide fails loudly (never steps down to `none`);
- an explicit `microvm` fails loudly until the microVM backend exists here;
- an explicit `none` runs on the host.
"""

from __future__ import annotations

import os
from functools import partial

from cc_server.backends.bubblewrap import CreateRuleTools, plan_bubblewrap
from cc_server.backends.none import plan_none
from cc_server.backends.plan import Planner
from cc_server.backends.probe import CREATE_LAUNCHER_TOOL, CREATE_SUPERVISOR_TOOL, ProbeResult
from cc_server.backends.seatbelt import darwin_user_temp_dir, plan_seatbelt
from cc_server.errors import BackendUnavailable
from cc_server.policy import HostFacts, Platform, SandboxBackend

__all__ = ["choose_backend", "planner_for"]


def choose_backend(
    probe_result: ProbeResult, requested: SandboxBackend | None, *, sandbox_on: bool
) -> SandboxBackend:
    """The backend a launch gets; `requested=None` means the caller did not specify one.

    Raises:
        BackendUnavailable: an explicitly requested backend cannot run on this host.
    """
    if requested is None:
        if sandbox_on and probe_result.available:
            return SandboxBackend.NATIVE
        return SandboxBackend.NONE
    if requested is SandboxBackend.NATIVE and not probe_result.available:
        raise BackendUnavailable(
            "backend 'native' was requested but this host has no OS-native sandbox",
            fix=probe_result.hint or "install the native sandbox tools",
        )
    if requested is SandboxBackend.MICROVM:
        raise BackendUnavailable(
            "backend 'microvm' was requested but this host cannot boot a microVM",
            fix="request 'native' or leave the backend unspecified",
        )
    return requested


def _create_rule_tools(probe_result: ProbeResult) -> CreateRuleTools | None:
    """The probe's create-rule supervisor, when it found one that this kernel runs."""
    launcher = probe_result.tools.get(CREATE_LAUNCHER_TOOL)
    library = probe_result.tools.get(CREATE_SUPERVISOR_TOOL)
    if not probe_result.create_rules or launcher is None or library is None:
        return None
    return CreateRuleTools(launcher=launcher, library=library)


def planner_for(backend: SandboxBackend, probe_result: ProbeResult, host: HostFacts) -> Planner:
    """The planning function for `backend` on this host, with tool paths from the probe.

    Raises:
        BackendUnavailable: the backend cannot plan on this host (no probe result for it, or
            its adapter is not built for this platform).
    """
    if backend is SandboxBackend.NONE:
        return plan_none
    if backend is SandboxBackend.NATIVE and probe_result.available:
        if probe_result.mechanism == "bubblewrap" and host.platform in (
            Platform.LINUX,
            Platform.WSL2,
        ):
            return partial(
                plan_bubblewrap,
                host=host,
                bwrap=probe_result.tools["bwrap"],
                socat=probe_result.tools.get("socat"),
                create_rules=_create_rule_tools(probe_result),
            )
        if probe_result.mechanism == "seatbelt" and host.platform is Platform.MACOS:
            return partial(
                plan_seatbelt,
                host=host,
                sandbox_exec=probe_result.tools["sandbox-exec"],
                temp_dir=darwin_user_temp_dir(os.environ),
            )
        raise BackendUnavailable(
            f"the {probe_result.mechanism} adapter is not available in this build",
            fix="use macOS or a Linux host with bubblewrap, or request backend 'none' explicitly",
        )
    raise BackendUnavailable(
        f"backend {backend!s} cannot run on this host",
        fix=probe_result.hint or "request 'native' or leave the backend unspecified",
    )
