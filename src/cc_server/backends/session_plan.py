"""A session sandbox's plan made again without planning, while nothing it was planned from has
changed.

Each command of a session is planned as if its sandbox were new, and the running sandbox is
reused only when the plans are equal (runtime/session_sandbox.py). A session sandbox's plan
depends on the command's argv, env and cwd only through `LaunchPlan.session`; everything else is
the planner's, the policy's, the command's egress bridge and what planning read of the host. So
`plan_reusing` records those reads (backends/host_reads.py) and, while each gets the same answer
from the host, gives the last plan again with the new command in `session`: the plan planning
would give, for the cost of asking the recorded questions again.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from cc_server.backends.bubblewrap import BubblewrapPlanner, planned_egress, session_command
from cc_server.backends.host_reads import HostReads
from cc_server.backends.plan import Command, LaunchPlan
from cc_server.policy import CompiledPolicy

__all__ = ["SessionPlanReading", "plan_reusing"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionPlanReading:
    """A session sandbox's plan, what it was planned from, and every host read its planning
    made."""

    planner: BubblewrapPlanner
    policy: CompiledPolicy
    command: Command
    plan: LaunchPlan
    reads: HostReads
    egress: object  # what the plan took of the command's egress bridge (planned_egress)


def plan_reusing(
    planner: BubblewrapPlanner,
    policy: CompiledPolicy,
    command: Command,
    last: SessionPlanReading | None,
) -> tuple[LaunchPlan, SessionPlanReading | None]:
    """`planner.plan(policy, command)`, and the `last` to pass next time.

    While `last` was made by this planner for the same policy and a command whose egress bridge
    it plans the same (`planned_egress`: base directory views no bind shows do not count), and
    every host read its planning made gets the same answer now, its plan is given again with
    `command` in `session` (its cwd, when it names none, the policy's default read now, as
    planning would). Otherwise `command` is planned, reading the host through a HostReads. A
    planner whose host facts are not this host's os functions (a test's fakes) plans every time.

    Raises:
        CcServerError: as the planner's `plan`.
    """
    if (
        last is not None
        and last.planner is planner
        and last.policy is policy
        and command.argv
        and command.in_session_sandbox
        and planned_egress(policy, command.egress) == last.egress
        and last.reads.hold()
    ):
        assert last.plan.session is not None
        cwd = command.cwd or policy.default_cwd(planner.host)
        session = session_command(command, cwd, planner.host.home, last.plan.session.socket)
        return dataclasses.replace(last.plan, session=session), last
    host = planner.host
    if not (
        host.realpath is os.path.realpath
        and host.exists is os.path.lexists
        and host.is_dir is os.path.isdir
    ):
        return planner.plan(policy, command), None
    reads = HostReads()
    recording = dataclasses.replace(
        host, realpath=reads.realpath, exists=reads.lexists, is_dir=reads.isdir
    )
    plan = dataclasses.replace(planner, host=recording).plan(policy, command)
    if plan.session is None:
        return plan, None
    return plan, SessionPlanReading(
        planner=planner, policy=policy, command=command, plan=plan, reads=reads,
        egress=planned_egress(policy, command.egress),
    )
