"""`none`: the command runs directly on the host. What environment it gets is the caller's choice,
because the spec's two dispatch paths differ (ACP and harness bash sanitise; Claude Code inherits).
"""

from __future__ import annotations

from dataclasses import dataclass

from cc_server.backends.plan import Command, LaunchPlan
from cc_server.errors import BadSpec
from cc_server.policy import CompiledPolicy, SandboxBackend

__all__ = ["NonePlanner", "plan_none"]


@dataclass(frozen=True, slots=True)
class NonePlanner:
    """The `none` backend's Planner: `plan_none`, which needs no host fact and no tool."""

    def plan(self, policy: CompiledPolicy, command: Command) -> LaunchPlan:
        """See plan_none."""
        return plan_none(policy, command)


def plan_none(policy: CompiledPolicy, command: Command) -> LaunchPlan:
    """Plan a host launch: no isolation, the command's own env and cwd.

    Raises:
        BadSpec: the command is empty.
    """
    if not command.argv:
        raise BadSpec("the command is empty", fix="pass the program to run after '--'")
    return LaunchPlan(
        backend=SandboxBackend.NONE,
        argv=command.argv,
        env=command.env,
        cwd=command.cwd or policy.workdir,
        notes=("no isolation: the command runs on the host with the server user's access",),
    )
