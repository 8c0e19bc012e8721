"""The per-session allowlist: the curated baseline, GitHub when earned, and the spec's extras.

The rules, from the spec's "Network egress":

- networkEnabled false, or an agent without canUseNetwork: the allowlist is empty (the proxies
  still start and refuse everything);
- otherwise the baseline (LLM providers, Git hosting, package registries), plus the operator's
  extension of it (`extra_baseline`: for dispatch, `egress.operator.OperatorEgress.rules`), plus
  GitHub's domains when the agent can call the GitHub API or push, plus
  SandboxSpec.egressAllowlist (entries may carry a port: `host:443`, see `patterns.parse_entry`),
  plus the ticketing domains passed in when the agent can call
  ticketing (dispatch passes none);
- the deny list (cloud metadata, telemetry sinks) wins over every allow, in every case.
"""

from __future__ import annotations

from collections.abc import Iterable

from cc_server.egress.addresses import IPAddress
from cc_server.egress.baseline import (
    BASELINE_ALLOWED,
    BASELINE_DENIED,
    GITHUB_DOMAINS,
    TICKETING_DOMAINS,
)
from cc_server.egress.patterns import (
    Allowlist,
    AllowlistRule,
    InvalidHostName,
    parse_host,
    parse_rules,
)
from cc_server.policy.spec import AgentCapabilities, SandboxSpec

__all__ = ["allowlist_for", "suggested_capability"]

SPEC_ALLOWLIST_REASON = "SandboxSpec.egressAllowlist"
TICKETING_REASON = "ticketing provider (canCallTicketing)"


def allowlist_for(
    spec: SandboxSpec,
    capabilities: AgentCapabilities | None = None,
    *,
    ticketing_domains: Iterable[str] = (),
    extra_baseline: Iterable[AllowlistRule] = (),
) -> Allowlist:
    """The egress allowlist of one session.

    `capabilities` default to `spec.capabilities`. Every egressAllowlist entry and ticketing
    domain is validated even when the network is off, so a bad spec fails the same way always.
    `extra_baseline` extends the curated baseline (already parsed rules, with their reasons);
    like the baseline it applies only when the network is on.

    Raises:
        InvalidPattern: an egressAllowlist entry or a ticketing domain is malformed; the message
            names it (`egressAllowlist[2]`, `ticketing_domains[0]`).
    """
    caps = spec.capabilities if capabilities is None else capabilities
    extra = parse_rules("egressAllowlist", spec.egress_allowlist, SPEC_ALLOWLIST_REASON)
    ticketing = parse_rules("ticketing_domains", ticketing_domains, TICKETING_REASON)
    if not (spec.network_enabled and caps.can_use_network):
        return Allowlist(patterns=(), denied=BASELINE_DENIED)
    rules = [*BASELINE_ALLOWED, *extra_baseline]
    if caps.earns_github:
        rules += GITHUB_DOMAINS
    rules += extra
    if caps.can_call_ticketing:
        rules += ticketing
    return Allowlist(patterns=_unique(rules), denied=BASELINE_DENIED)


def _unique(rules: list[AllowlistRule]) -> tuple[AllowlistRule, ...]:
    """Drop repeated patterns, keeping the first (the baseline's reason over the spec's). A
    rule is repeated when an earlier one has its pattern and allows every port it does."""
    seen: list[AllowlistRule] = []
    for rule in rules:
        if all(
            rule.pattern != kept.pattern or kept.port not in (None, rule.port) for kept in seen
        ):
            seen.append(rule)
    return tuple(seen)


def suggested_capability(
    host: str, spec: SandboxSpec, capabilities: AgentCapabilities | None = None
) -> str | None:
    """The capability (by its JSON name) that would have allowed a refused `host`, if any.

    "canUseNetwork" when the agent lacks the network capability; "canCallGitHubApi" for GitHub's
    domains when the agent has neither GitHub capability; "canCallTicketing" for a known
    ticketing provider when the agent cannot call ticketing; None when no capability would help
    (the host is denied or invalid, the spec turned the network off, or the host is not known).
    Never raises.
    """
    caps = spec.capabilities if capabilities is None else capabilities
    try:
        target = parse_host(host)
    except InvalidHostName:
        return None
    if Allowlist(patterns=(), denied=BASELINE_DENIED).allows(target).rule is not None:
        return None  # denied: no capability allows it
    if not spec.network_enabled:
        return None  # the spec, not a capability, turned the network off
    if not caps.can_use_network:
        return "canUseNetwork"
    if not caps.earns_github and _listed(GITHUB_DOMAINS, target):
        return "canCallGitHubApi"
    if not caps.can_call_ticketing and _listed(TICKETING_DOMAINS, target):
        return "canCallTicketing"
    return None


def _listed(rules: tuple[AllowlistRule, ...], target: IPAddress | str) -> bool:
    return isinstance(target, str) and Allowlist(patterns=rules).allows(target).allowed
