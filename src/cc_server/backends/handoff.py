"""The fd handoff of a launch: what the launcher inside a new sandbox hands back before it runs
anything.

One sequence, for a sandbox per command and for a session sandbox alike: a socketpair per slot
the plan names (its egress handoff, its create-rule socket) → `runner.start(fds=…)` → the
launcher's two loopback egress listeners (`receive_fds`), given to the session's proxies → its
seccomp listener (`receive_listener`), given to a new create-rule supervisor. The launcher runs
its command (or serves requests) only after both; on any failure here the sandbox is killed and
reaped before the error is raised, so nothing ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from cc_server.backends.child_watch import wait_exited
from cc_server.backends.fdpass import receive_fds
from cc_server.backends.peer import SandboxPeers
from cc_server.backends.plan import LaunchPlan
from cc_server.backends.runner import start
from cc_server.backends.supervisor import CreateRuleSupervisor, path_rules, receive_listener

__all__ = ["HANDOFF_TIMEOUT_S", "Adopt", "Launched", "Listening", "Streams", "launch"]

HANDOFF_TIMEOUT_S: Final = 10.0  # from spawning bwrap to the launcher's egress listeners arriving

Streams = tuple[int | None, int | None, int | None]
"""stdin, stdout, stderr: `asyncio.subprocess.PIPE`, `DEVNULL`, a descriptor, or None (ours)."""


class Listening(Protocol):
    """A listener the session's proxies accept on until closed (runtime.egress_port.Adopted)."""

    async def aclose(self) -> None:
        """Stop accepting and close it. Idempotent."""
        ...


class Adopt(Protocol):
    """Give a sandbox's loopback listeners to the session's proxies (EgressPort.adopt)."""

    async def __call__(
        self, http: socket.socket, socks: socket.socket
    ) -> Sequence[Listening]: ...


@dataclass(eq=False, kw_only=True)
class Launched:
    """A started sandbox whose launcher has handed everything over."""

    proc: asyncio.subprocess.Process
    transport: asyncio.SubprocessTransport
    adopted: Sequence[Listening] = ()  # its egress listeners, as the proxies serve them
    supervisor: CreateRuleSupervisor | None = None  # of its seccomp listener

    async def abort(self) -> None:
        """Kill the sandbox's host-side process group, reap it, free our ends. Idempotent."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        await wait_exited(self.proc)
        self.transport.close()
        adopted, self.adopted = self.adopted, ()
        for listener in adopted:
            await listener.aclose()


async def launch(
    plan: LaunchPlan,
    streams: Streams,
    *,
    adopt: Adopt | None,
    peers: SandboxPeers,
    fds: Mapping[str, int] | None = None,
    spawned: Callable[[Launched], None] | None = None,
) -> Launched:
    """Start `plan` (with `fds` for its other slots) and take its handoff: egress listeners to
    `adopt`, the seccomp listener to a new supervisor (whose reports the caller watches). The
    process is registered in `peers` while it is not reaped; `spawned` is told of it before the
    handoff (a session sandbox reads bwrap's stderr meanwhile).

    Raises:
        EnforcementFailed: the program could not start, or the launcher did not hand over in
            time (HANDOFF_TIMEOUT_S for the listeners); the sandbox is killed and reaped.
    """
    slots = [plan.egress_handoff, plan.create_rules.socket if plan.create_rules else None]
    pairs = {
        slot.name: socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for slot in slots if slot is not None
    }
    try:
        try:
            with peers.launching():
                proc, transport = await start(
                    plan, stdin=streams[0], stdout=streams[1], stderr=streams[2],
                    fds={**(fds or {}), **{name: p[1].fileno() for name, p in pairs.items()}},
                )
                if proc.returncode is None:  # not reaped: the pid is still its own
                    peers.add(proc.pid)
        finally:
            for _, theirs in pairs.values():
                theirs.close()
        launched = Launched(proc=proc, transport=transport)
        if spawned is not None:
            spawned(launched)
        try:
            await _take(plan, launched, adopt, {name: p[0] for name, p in pairs.items()})
        except BaseException:
            await launched.abort()
            raise
    finally:
        for ours, _ in pairs.values():
            ours.close()
    return launched


async def _take(
    plan: LaunchPlan, launched: Launched, adopt: Adopt | None, socks: dict[str, socket.socket]
) -> None:
    if plan.egress_handoff is not None:
        assert adopt is not None  # a plan with a handoff was made with the session's bridge
        received = await receive_fds(
            socks[plan.egress_handoff.name], tag=b"E", count=2, timeout_s=HANDOFF_TIMEOUT_S,
            what="egress listeners",
        )
        http, proxy = (socket.socket(fileno=fd) for fd in received)
        launched.adopted = await adopt(http, proxy)
    if plan.create_rules is not None:
        listener = await receive_listener(socks[plan.create_rules.socket.name])
        launched.supervisor = CreateRuleSupervisor.start(
            listener, plan.create_rules.globs, library=plan.create_rules.library,
            identity=plan.identity, paths=path_rules(plan.create_rules),
        )
