"""Changes to a running session's allowlist: which entries to add and which to remove. Pure.

A change is applied to the session's current `Allowlist` and gives a new one (the proxies read
it for their next connection; a tunnel already open stays open). The rules:

- removals first, then additions; an entry in both is refused;
- an entry is matched by its canonical text (`format_entry`): removing `x.example` removes the
  entry `x.example` (every port) and not `x.example:443`, nor `*.example` that covers it; any
  entry of the allowlist can be removed, the baseline's included (tightening is always safe);
  removing an entry that is not there changes nothing and is not an error (a retried PATCH);
- adding an entry that is there already changes nothing;
- the deny list cannot change, and an entry it would refuse outright (an exact name or address
  it denies) is refused: it could never allow anything.

Raises `InvalidPattern` (a malformed entry, naming it) or `BadSpec` (see `apply_change`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cc_server.egress.addresses import IPAddress
from cc_server.egress.patterns import (
    Allowlist,
    AllowlistRule,
    DomainPattern,
    Wildcard,
    format_entry,
    parse_rules,
)
from cc_server.errors import BadSpec

__all__ = ["LIVE_REASON", "AppliedChange", "EgressChange", "apply_change"]

LIVE_REASON = "allowed while the session runs"


@dataclass(frozen=True, slots=True, kw_only=True)
class EgressChange:
    """Entries to remove from and add to a running session's allowlist (allowlist syntax)."""

    allow: tuple[str, ...] = ()
    """Entries to add (`host`, `host:443`, `*.example.com:443`, `[2001:db8::1]:8080`, ...)."""
    remove: tuple[str, ...] = ()
    """Entries to remove, matched by their canonical text."""
    reason: str = LIVE_REASON
    """Why the added entries are there, as their decisions will say."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AppliedChange:
    """What a change did."""

    allowlist: Allowlist
    """The allowlist after the change."""
    added: tuple[str, ...]
    """The entries it added (canonical), not those already there."""
    removed: tuple[str, ...]
    """The entries it removed (canonical), not those that were not there."""

    @property
    def changed(self) -> bool:
        """Whether the allowlist is different."""
        return bool(self.added or self.removed)


def apply_change(allowlist: Allowlist, change: EgressChange) -> AppliedChange:
    """The allowlist after `change`, and what it added and removed.

    Raises:
        InvalidPattern: an entry is malformed; the message names it (`allow[1]`, `remove[0]`).
        BadSpec: an entry is both added and removed, or an added entry names a host or address
            the deny list refuses on every port.
    """
    adding = parse_rules("allow", change.allow, change.reason)
    removing = {rule.entry for rule in parse_rules("remove", change.remove, change.reason)}
    both = removing.intersection(rule.entry for rule in adding)
    if both:
        raise BadSpec(
            f"egress change both allows and removes {', '.join(sorted(both))}",
            fix="give each entry once",
        )
    for rule in adding:
        _refuse_denied(allowlist, rule)
    kept = tuple(rule for rule in allowlist.patterns if rule.entry not in removing)
    removed = tuple(
        dict.fromkeys(rule.entry for rule in allowlist.patterns if rule.entry in removing)
    )
    present = {rule.entry for rule in kept}
    new: list[AllowlistRule] = []
    for rule in adding:
        if rule.entry not in present:
            present.add(rule.entry)
            new.append(rule)
    result = Allowlist(patterns=(*kept, *new), denied=allowlist.denied)
    return AppliedChange(
        allowlist=result, added=tuple(rule.entry for rule in new), removed=removed
    )


def _refuse_denied(allowlist: Allowlist, rule: AllowlistRule) -> None:
    """An exact name or an address the deny list refuses can never be allowed."""
    pattern = rule.pattern
    if isinstance(pattern, DomainPattern):
        if pattern.wildcard is not Wildcard.NONE:
            return  # a wildcard may still allow names the deny list does not cover
        target: IPAddress | str = pattern.text
    else:
        target = pattern.address
    decision = Allowlist(patterns=(), denied=allowlist.denied).allows(target, rule.port)
    if decision.rule is not None:
        raise BadSpec(
            f"{format_entry(pattern, rule.port)} is on the egress deny list: cannot be allowed "
            f"({decision.rule.pattern}: {decision.rule.reason})"
        )
