"""The egress decision for one connection target, as pure functions: no sockets, no resolver.

The driver (`driver.py`) asks two questions and does the I/O in between:

1. `check_target(allowlist, host, port)` for the target a handshake machine named
   (`CheckEgress`). The host is parsed once (`patterns.parse_host`). The answer is final for a
   refused target and for an IP literal (`Allowed`), or it is `Resolve`: a listed name, to be
   resolved once by the driver.
2. `check_answers(allowlist, resolve, answers)` with what the resolver returned: `Allowed` with
   exactly the addresses to dial, in order (so DNS rebinding gains nothing: the driver never
   resolves again), `Refused` when any answer is an address egress must not reach, or
   `Unresolvable` when there is none. A resolver that failed is `unresolvable(name, error)`.

`Unresolvable` is neither an allowance nor a violation: the target may be listed, but there is
nothing to dial; the client gets an upstream failure (HTTP 502, SOCKS5 0x04), and no refusal is
reported.

The address guard beyond the allowlist: an address that is forbidden
(`addresses.forbidden_reason`: loopback, private, link-local, metadata, ... in every spelling)
or on the deny list is refused, whether the client named it or a name resolved to it, unless
that address itself is on the allowlist (an `IpLiteralPattern` entry for the port; the deny
list still wins).

Ask mode (`ask=True`): a target no entry names, that is not on the deny list, of a session whose
network is on, is checked as if it were listed, and an `Allowed` for it says `ask`: the driver
lets it through only if the one asked agrees. Everything refused outright (the deny list, a
forbidden address, a name resolving to one, an invalid name) is never offered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, TypeAlias

from cc_server.egress.addresses import IPAddress, forbidden_reason
from cc_server.egress.patterns import (
    Allowlist,
    Decision,
    InvalidHostName,
    IpLiteralPattern,
    parse_host,
)

__all__ = [
    "DENIED_ADDRESS",
    "NOTHING_DENIED",
    "NOTHING_INVALID",
    "NOTHING_NETWORK_OFF",
    "Allowed",
    "Refused",
    "Resolve",
    "Unresolvable",
    "Verdict",
    "check_answers",
    "check_target",
    "entry_for",
    "forbidden",
    "unresolvable",
]

# Why no allowlist entry can undo a refusal (the advice of a `Refused` without an entry).
NOTHING_DENIED: Final = "nothing: the deny list wins over every allowlist entry"
NOTHING_NETWORK_OFF: Final = (
    "nothing while the session's network is off (networkEnabled false, or no canUseNetwork)"
)
NOTHING_INVALID: Final = "nothing: this is not a valid host name"
DENIED_ADDRESS: Final = "denied address"  # how `forbidden` names an address the deny list holds

_ONLY_LISTED: Final = (
    "egress reaches such an address only when that address itself is on the allowlist"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Allowed:
    """Dial these addresses, in order, and nothing else."""

    host: str
    """The canonical name or address asked for."""
    addresses: tuple[IPAddress, ...]
    """Checked, without duplicates, never empty."""
    ask: bool = False
    """No entry names the target (ask mode): allowed only if the one asked agrees."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Refused:
    """The target is refused: a violation, reported once and answered in-protocol."""

    host: str
    """The canonical name or address (the client's spelling if it is not a valid name)."""
    reason: str
    """Why, in one sentence."""
    entry: str | None
    """The allowlist entry that would allow it (the driver words the advice), or None when no
    entry can: then `nothing` says why."""
    nothing: str = ""
    """Why no entry can allow it (`NOTHING_DENIED`, ...), when `entry` is None."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Resolve:
    """Resolve this canonical name once, then ask `check_answers`."""

    name: str
    port: int
    ask: bool = False
    """As `Allowed.ask`, carried to the answer."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Unresolvable:
    """A name with nothing to dial: an upstream failure, not a violation."""

    error: str
    """For the log: the resolver's error, or that it returned no address."""


Verdict: TypeAlias = Allowed | Refused | Unresolvable
"""A final answer for one target."""


def entry_for(host: str, port: int) -> str:
    """The allowlist entry naming exactly `host` (a canonical name or address) on `port`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_target(
    allowlist: Allowlist, host: str, port: int, *, ask: bool = False
) -> Allowed | Refused | Resolve:
    """The decision for `host` (as the client spelled it) on `port`, as far as it can be made
    without resolving; `ask`: the session asks about unlisted targets. Never raises."""
    try:
        target = parse_host(host)
    except InvalidHostName as exc:
        decision = Decision(allowed=False, host=host, rule=None, reason=str(exc))
        if ask and not allowlist.is_empty:
            return Refused(host=host, reason=str(exc), entry=None, nothing=NOTHING_INVALID)
        return _unlisted(decision, port, allowlist)
    rule, allowed = allowlist.match(target, port)  # the wording only for a refusal
    unlisted = not allowed
    if unlisted and not (ask and rule is None and not allowlist.is_empty):
        return _unlisted(allowlist.decide(target, port), port, allowlist)
    if isinstance(target, str):
        return Resolve(name=target, port=port, ask=unlisted)
    why = forbidden(allowlist, target, port)
    if why is not None:
        return _forbidden_address(f"{target} is a {why}", str(target), why, port)
    return Allowed(host=str(target), addresses=(target,), ask=unlisted)


def check_answers(allowlist: Allowlist, resolve: Resolve, answers: list[IPAddress]) -> Verdict:
    """The decision for a name once resolved to `answers` (in the resolver's order): every
    answer must be an address egress may reach. Never raises."""
    unique = tuple(dict.fromkeys(answers))
    if not unique:
        return Unresolvable(error=f"{resolve.name} has no addresses")
    for address in unique:
        why = forbidden(allowlist, address, resolve.port)
        if why is not None:
            said = f"{resolve.name} resolves to {address}, a {why}"
            return _forbidden_address(said, resolve.name, why, resolve.port, address)
    return Allowed(host=resolve.name, addresses=unique, ask=resolve.ask)


def unresolvable(name: str, error: BaseException) -> Unresolvable:
    """The answer for a name whose resolver failed (any failure is an upstream failure)."""
    return Unresolvable(error=f"cannot resolve {name}: {str(error) or type(error).__name__}")


def forbidden(allowlist: Allowlist, address: IPAddress, port: int) -> str | None:
    """Why egress must not dial `address` on `port`, or None. Never raises."""
    rule, allowed = allowlist.match(address, port)
    if rule is not None:
        if allowed:
            if isinstance(rule.pattern, IpLiteralPattern):
                return None  # the address itself is on the allowlist (and not on the deny list)
        else:  # a rule that refuses is a deny rule (deny rules match on every port)
            return f"{DENIED_ADDRESS} ({allowlist.decide(address, port).reason})"
    why = forbidden_reason(address)
    return None if why is None else f"{why} address"


def _unlisted(decision: Decision, port: int, allowlist: Allowlist) -> Refused:
    """A target the allowlist refused: the deny list, the network off, or not listed."""
    if decision.rule is not None:  # the deny list matched: no allowlist entry can help
        return Refused(
            host=decision.host, reason=decision.reason, entry=None, nothing=NOTHING_DENIED
        )
    if allowlist.is_empty:  # the network is off: an entry would not be enough
        return Refused(
            host=decision.host, reason=decision.reason, entry=None, nothing=NOTHING_NETWORK_OFF
        )
    return Refused(host=decision.host, reason=decision.reason, entry=entry_for(decision.host, port))


def _forbidden_address(
    said: str, host: str, why: str, port: int, address: IPAddress | None = None
) -> Refused:
    """A refused address: a denied one has no entry; any other is allowed by its own literal."""
    reason = f"{said}; {_ONLY_LISTED}"
    if why.startswith(DENIED_ADDRESS):
        return Refused(host=host, reason=reason, entry=None, nothing=NOTHING_DENIED)
    return Refused(host=host, reason=reason, entry=entry_for(str(address or host), port))
