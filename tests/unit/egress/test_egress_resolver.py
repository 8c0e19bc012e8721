"""The resolver's composition rules, from the spec's "Network egress"."""

from __future__ import annotations

import pytest

from cc_server.egress.baseline import BASELINE_ALLOWED, BASELINE_DENIED, GITHUB_DOMAINS
from cc_server.egress.patterns import Allowlist, DomainPattern, InvalidPattern
from cc_server.egress.resolver import (
    SPEC_ALLOWLIST_REASON,
    TICKETING_REASON,
    allowlist_for,
    suggested_capability,
)
from cc_server.errors import BadSpec
from cc_server.policy.spec import AgentCapabilities, SandboxSpec, parse_spec

NO_NETWORK = AgentCapabilities(can_use_network=False)
API = AgentCapabilities(can_call_github_api=True)
PUSH = AgentCapabilities(can_push=True)
TICKETS = AgentCapabilities(can_call_ticketing=True)
EVERYTHING = AgentCapabilities(can_call_github_api=True, can_push=True, can_call_ticketing=True)


def spec(**fields: object) -> SandboxSpec:
    return SandboxSpec(session_id="s1", workspace_id="w1", **fields)  # type: ignore[arg-type]


def allowed(allowlist: Allowlist, host: str) -> bool:
    return allowlist.allows(host).allowed


def test_safe_default_gets_the_baseline_and_nothing_else() -> None:
    allowlist = allowlist_for(spec())
    assert allowlist.patterns == BASELINE_ALLOWED
    assert allowlist.denied == BASELINE_DENIED
    assert allowed(allowlist, "api.anthropic.com")
    assert allowed(allowlist, "pypi.org")
    assert not allowed(allowlist, "github.com")
    assert not allowed(allowlist, "api.linear.app")
    assert not allowed(allowlist, "example.com")


@pytest.mark.parametrize(
    ("network_enabled", "capabilities"),
    [(False, AgentCapabilities()), (True, NO_NETWORK), (False, NO_NETWORK), (False, EVERYTHING)],
)
def test_network_off_gives_an_empty_allowlist_with_the_deny_list(
    network_enabled: bool, capabilities: AgentCapabilities
) -> None:
    session = spec(
        network_enabled=network_enabled, capabilities=capabilities, egress_allowlist=("a.com",)
    )
    allowlist = allowlist_for(session, ticketing_domains=["api.linear.app"])
    assert allowlist.is_empty
    assert allowlist.denied == BASELINE_DENIED
    for host in ("api.anthropic.com", "github.com", "a.com", "api.linear.app"):
        decision = allowlist.allows(host)
        assert not decision.allowed
        assert "network access is off" in decision.reason


@pytest.mark.parametrize("capabilities", [API, PUSH, EVERYTHING])
def test_github_is_earned_by_the_api_or_by_push(capabilities: AgentCapabilities) -> None:
    allowlist = allowlist_for(spec(capabilities=capabilities))
    assert allowlist.patterns == BASELINE_ALLOWED + GITHUB_DOMAINS
    for host in ("github.com", "api.github.com", "codeload.github.com", "ghcr.io"):
        assert allowed(allowlist, host), host
    for host in ("malicious-github.com", "github.com.evil.com", "evilgithub.com"):
        assert not allowed(allowlist, host), host


def test_the_capabilities_argument_overrides_the_spec() -> None:
    session = spec(capabilities=PUSH)
    assert allowed(allowlist_for(session), "github.com")
    assert not allowed(allowlist_for(session, AgentCapabilities()), "github.com")
    assert allowlist_for(session, NO_NETWORK).is_empty
    assert allowed(allowlist_for(spec(), API), "api.github.com")


def test_egress_allowlist_entries_are_added() -> None:
    session = spec(egress_allowlist=("*.example.com", "bedrock.*.internal.corp", "10.0.0.5"))
    allowlist = allowlist_for(session)
    assert allowed(allowlist, "a.b.example.com")
    assert not allowed(allowlist, "example.com")
    assert allowed(allowlist, "bedrock.x.internal.corp")
    assert not allowed(allowlist, "bedrock.x.y.internal.corp")
    assert allowed(allowlist, "10.0.0.5")
    assert allowed(allowlist, "0xa000005")
    decision = allowlist.allows("a.example.com")
    assert decision.rule is not None
    assert decision.rule.reason == SPEC_ALLOWLIST_REASON


def test_egress_allowlist_through_parse_spec() -> None:
    session = parse_spec(
        {"sessionId": "s", "workspaceId": "w", "egressAllowlist": ["api.internal.example"]}
    )
    assert allowed(allowlist_for(session), "API.internal.example.")


def test_a_repeated_entry_keeps_the_first_reason() -> None:
    allowlist = allowlist_for(spec(egress_allowlist=("PyPI.org.", "pypi.org")))
    assert allowlist.patterns == BASELINE_ALLOWED
    decision = allowlist.allows("pypi.org")
    assert decision.rule is not None
    assert decision.rule.reason != SPEC_ALLOWLIST_REASON


@pytest.mark.parametrize(
    "entry",
    [
        "statsig.anthropic.com",
        "metadata.google.internal",
        "169.254.169.254",
        "0xa9fea9fe",
        "::ffff:169.254.169.254",
        "64:ff9b::a9fe:a9fe",
        "o1.ingest.sentry.io",
    ],
)
def test_denied_wins_over_an_egress_allowlist_entry(entry: str) -> None:
    allowlist = allowlist_for(spec(egress_allowlist=(entry,), capabilities=EVERYTHING))
    decision = allowlist.allows(entry)
    assert not decision.allowed
    assert decision.rule is not None
    assert decision.rule in BASELINE_DENIED


def test_a_denied_wildcard_wins_over_an_allowed_wildcard() -> None:
    allowlist = allowlist_for(spec(egress_allowlist=("*.ingest.sentry.io",)))
    assert not allowed(allowlist, "o1.ingest.sentry.io")


@pytest.mark.parametrize(
    ("index", "entries", "bad"),
    [
        (0, ("*.com",), "*.com"),
        (1, ("ok.example.com", "a*.b.com"), "a*.b.com"),
        (2, ("a.com", "b.com", "example.*"), "example.*"),
        (0, ("exa mple.com",), "exa mple.com"),
    ],
)
def test_a_bad_egress_allowlist_entry_is_named(
    index: int, entries: tuple[str, ...], bad: str
) -> None:
    with pytest.raises(InvalidPattern) as caught:
        allowlist_for(spec(egress_allowlist=entries))
    assert caught.value.message.startswith(f"egressAllowlist[{index}]: ")
    assert repr(bad) in caught.value.message
    assert isinstance(caught.value, BadSpec)


def test_bad_entries_fail_even_with_the_network_off() -> None:
    with pytest.raises(InvalidPattern, match=r"egressAllowlist\[0\]"):
        allowlist_for(spec(network_enabled=False, egress_allowlist=("*",)))
    with pytest.raises(InvalidPattern, match=r"ticketing_domains\[1\]"):
        allowlist_for(spec(network_enabled=False), ticketing_domains=["a.com", "*.com"])


def test_ticketing_domains_need_the_capability() -> None:
    domains = ["api.linear.app", "*.atlassian.net"]
    without = allowlist_for(spec(), ticketing_domains=domains)
    assert not allowed(without, "api.linear.app")
    assert not allowed(without, "acme.atlassian.net")
    with_capability = allowlist_for(spec(capabilities=TICKETS), ticketing_domains=domains)
    assert allowed(with_capability, "api.linear.app")
    assert allowed(with_capability, "acme.atlassian.net")
    decision = with_capability.allows("api.linear.app")
    assert decision.rule is not None
    assert decision.rule.reason == TICKETING_REASON


def test_dispatch_default_passes_no_ticketing_domains() -> None:
    # The dispatch path calls allowlist_for(spec) and nothing more: even an agent that can call
    # ticketing gets no ticketing domains, exactly as the spec says.
    allowlist = allowlist_for(spec(capabilities=EVERYTHING))
    assert allowlist.patterns == BASELINE_ALLOWED + GITHUB_DOMAINS
    assert not allowed(allowlist, "api.linear.app")
    assert not allowed(allowlist, "acme.atlassian.net")


def test_ticketing_domains_accept_any_iterable() -> None:
    allowlist = allowlist_for(
        spec(capabilities=TICKETS), ticketing_domains=(d for d in ["api.linear.app"])
    )
    assert allowed(allowlist, "api.linear.app")


def test_the_allowlist_order_is_baseline_github_spec_ticketing() -> None:
    allowlist = allowlist_for(
        spec(capabilities=EVERYTHING, egress_allowlist=("extra.example.com",)),
        ticketing_domains=["api.linear.app"],
    )
    texts = [str(rule.pattern) for rule in allowlist.patterns]
    n_base, n_github = len(BASELINE_ALLOWED), len(GITHUB_DOMAINS)
    assert texts[:n_base] == [str(rule.pattern) for rule in BASELINE_ALLOWED]
    assert texts[n_base : n_base + n_github] == [str(rule.pattern) for rule in GITHUB_DOMAINS]
    assert texts[n_base + n_github :] == ["extra.example.com", "api.linear.app"]


def test_the_resolver_is_pure() -> None:
    session = spec(capabilities=PUSH, egress_allowlist=("*.example.com",))
    assert allowlist_for(session) == allowlist_for(session)
    assert DomainPattern.parse("*.example.com") in [
        r.pattern for r in allowlist_for(session).patterns
    ]


# --- suggested_capability --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "session", "suggestion"),
    [
        ("github.com", spec(), "canCallGitHubApi"),
        ("API.GitHub.com.", spec(), "canCallGitHubApi"),
        ("raw.githubusercontent.com", spec(), "canCallGitHubApi"),
        ("api.linear.app", spec(), "canCallTicketing"),
        ("acme.atlassian.net", spec(), "canCallTicketing"),
        ("api.anthropic.com", spec(capabilities=NO_NETWORK), "canUseNetwork"),
        ("github.com", spec(capabilities=NO_NETWORK), "canUseNetwork"),
        ("example.com", spec(capabilities=NO_NETWORK), "canUseNetwork"),
        # nothing would help: the spec turned the network off, or the host is unknown or denied
        ("api.anthropic.com", spec(network_enabled=False), None),
        ("github.com", spec(network_enabled=False), None),
        ("example.com", spec(), None),
        ("malicious-github.com", spec(), None),
        ("github.com", spec(capabilities=PUSH), None),  # already earned
        ("api.linear.app", spec(capabilities=TICKETS), None),  # already held
        ("statsig.anthropic.com", spec(capabilities=NO_NETWORK), None),  # denied
        ("169.254.169.254", spec(capabilities=NO_NETWORK), None),  # denied
        ("10.0.0.5", spec(), None),  # an address is never in a capability's domains
        ("exa mple.com", spec(capabilities=NO_NETWORK), None),  # invalid
    ],
)
def test_suggested_capability(host: str, session: SandboxSpec, suggestion: str | None) -> None:
    assert suggested_capability(host, session) == suggestion


def test_suggested_capability_takes_the_capabilities_override() -> None:
    assert suggested_capability("github.com", spec(capabilities=PUSH), AgentCapabilities()) == (
        "canCallGitHubApi"
    )
    assert suggested_capability("github.com", spec(), API) is None


def test_every_suggestion_names_a_capability_field() -> None:
    json_fields = set(AgentCapabilities().to_json())
    for suggestion in ("canUseNetwork", "canCallGitHubApi", "canCallTicketing"):
        assert suggestion in json_fields
