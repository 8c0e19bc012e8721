"""The unified action guardrails: every action an agent takes passes one fail-closed chain.

A bash command, an in-process file tool call and an ACP file or terminal request are all an
`Action`. `standard_chain` checks them in a fixed order: the tool surface of the mode first (so a
tool outside the surface is refused before any policy is looked at), then the mode's command table
for commands, then the path policy for file actions, then whatever the caller adds. A guardrail
that raises anything but `ActionRefused` has refused too: an error is never an allow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from cc_server.dispatch._paths import PathOutsideBinds, map_guest_path, rule_covering
from cc_server.dispatch.actions import (
    COMMAND_KINDS,
    FILE_KINDS,
    KIND_TOOL,
    WRITE_KINDS,
    Action,
    ActionRefused,
)
from cc_server.dispatch.modes import check_command, tools_for_mode
from cc_server.policy import CompiledPolicy, Mode

__all__ = [
    "CommandPolicyGuardrail",
    "Guardrail",
    "GuardrailChain",
    "PathPolicyGuardrail",
    "ToolSurfaceGuardrail",
    "standard_chain",
]


@runtime_checkable
class Guardrail(Protocol):
    """One check. `check` returns to allow and raises `ActionRefused` to refuse."""

    name: str

    def check(self, action: Action) -> None:
        """Allow by returning; refuse by raising ActionRefused."""
        ...


class GuardrailChain:
    """Runs guardrails in order; the first refusal stops the chain. Fail-closed."""

    def __init__(self, guardrails: Sequence[Guardrail]) -> None:
        self.guardrails: tuple[Guardrail, ...] = tuple(guardrails)

    @property
    def names(self) -> tuple[str, ...]:
        """The guardrails' names, in the order they run."""
        return tuple(getattr(g, "name", type(g).__name__) for g in self.guardrails)

    def check(self, action: Action) -> None:
        """Pass `action` through every guardrail.

        Raises:
            ActionRefused: a guardrail refused, or raised anything at all (named in the reason),
                or the chain is empty (nothing checked is not an allow).
        """
        if not self.guardrails:
            raise ActionRefused(
                action, "guardrail-chain", "the chain has no guardrails, so nothing is allowed"
            )
        for guardrail in self.guardrails:
            name = str(getattr(guardrail, "name", type(guardrail).__name__))
            try:
                guardrail.check(action)
            except ActionRefused:
                raise
            except BaseException as exc:
                if not isinstance(exc, Exception):
                    raise  # KeyboardInterrupt, SystemExit: the action does not happen either
                raise ActionRefused(
                    action,
                    name,
                    f"the guardrail failed ({type(exc).__name__}: {exc}); a failing guardrail "
                    "refuses",
                    fix="fix the guardrail; the action stays refused until it passes",
                ) from exc


class ToolSurfaceGuardrail:
    """The mode's tool surface: a tool the mode does not expose is refused first."""

    name = "tool-surface"

    def __init__(self, mode: Mode) -> None:
        self.mode = mode

    def check(self, action: Action) -> None:
        if action.mode != self.mode:
            raise ActionRefused(
                action,
                self.name,
                f"the action claims {action.mode} mode but the session runs in {self.mode} mode",
            )
        surface = tools_for_mode(self.mode)
        needed = KIND_TOOL[action.kind]
        for tool in dict.fromkeys((action.tool, needed)):
            if tool not in surface:
                raise ActionRefused(
                    action,
                    self.name,
                    f"{self.mode} mode does not expose the {tool!r} tool "
                    f"(its tools: {', '.join(sorted(surface))})",
                    fix="run the session in a mode whose tools include it (chat has them all)",
                )


class CommandPolicyGuardrail:
    """The mode's command table (`command_policy.toml`) for bash and ACP terminal commands."""

    name = "command-policy"

    def check(self, action: Action) -> None:
        if action.kind not in COMMAND_KINDS:
            return
        if not action.argv:
            raise ActionRefused(action, self.name, "a command action without an argv")
        check_command(action.mode, action.argv, action=action)


class PathPolicyGuardrail:
    """The policy's path rules for file actions, on the guest path mapped through the binds.

    Lexical: it refuses what the path as spelled cannot be allowed to reach. The file tools check
    the same rules again on what they actually open, through file descriptors.
    """

    name = "path-policy"

    def __init__(self, policy: CompiledPolicy) -> None:
        self.policy = policy

    def check(self, action: Action) -> None:
        if action.kind not in FILE_KINDS:
            return
        if action.path is None:
            raise ActionRefused(action, self.name, "a file action without a path")
        try:
            mapped = map_guest_path(self.policy, action.path)
        except PathOutsideBinds as exc:
            raise ActionRefused(
                action,
                self.name,
                str(exc),
                fix="use a path inside the session's workdir or another bind",
            ) from None
        secret = rule_covering(self.policy.deny_read, mapped.host)
        if secret is not None:
            raise ActionRefused(
                action,
                self.name,
                f"{mapped.guest!r} is in the secret deny-read set ({secret.reason})",
            )
        if action.kind not in WRITE_KINDS:
            return
        if not mapped.mount.writable:
            raise ActionRefused(
                action,
                self.name,
                f"{mapped.guest!r} is on a read-only bind ({mapped.mount.reason})",
            )
        denied = rule_covering(self.policy.deny_write, mapped.host)
        if denied is not None:
            raise ActionRefused(
                action, self.name, f"{mapped.guest!r} is never writable ({denied.reason})"
            )


def standard_chain(policy: CompiledPolicy, *, extra: Sequence[Guardrail] = ()) -> GuardrailChain:
    """The chain every dispatched action passes: tool surface, command table, path policy, extra."""
    return GuardrailChain(
        [
            ToolSurfaceGuardrail(policy.mode),
            CommandPolicyGuardrail(),
            PathPolicyGuardrail(policy),
            *extra,
        ]
    )
