"""The reviewed baseline data file: every entry parses and has a reason; bad data fails loudly."""

from __future__ import annotations

import pytest

from cc_server.egress.addresses import forbidden_reason
from cc_server.egress.baseline import (
    BASELINE_ALLOWED,
    BASELINE_DENIED,
    GITHUB_DOMAINS,
    TICKETING_DOMAINS,
    Baseline,
    InvalidBaseline,
    load_baseline,
    packaged_baseline,
)
from cc_server.egress.patterns import Allowlist, AllowlistRule, DomainPattern, IpLiteralPattern
from cc_server.errors import EnforcementFailed

ALL_LISTS = {
    "allowed": BASELINE_ALLOWED,
    "github": GITHUB_DOMAINS,
    "ticketing": TICKETING_DOMAINS,
    "denied": BASELINE_DENIED,
}


def test_the_constants_are_the_packaged_baseline_loaded_once() -> None:
    assert packaged_baseline() is packaged_baseline()
    baseline = packaged_baseline()
    assert baseline.allowed is BASELINE_ALLOWED
    assert baseline.github is GITHUB_DOMAINS
    assert baseline.ticketing is TICKETING_DOMAINS
    assert baseline.denied is BASELINE_DENIED


@pytest.mark.parametrize("name", sorted(ALL_LISTS))
def test_every_entry_has_a_reason_and_a_parsed_pattern(name: str) -> None:
    rules = ALL_LISTS[name]
    assert rules, name
    for rule in rules:
        assert isinstance(rule.pattern, DomainPattern | IpLiteralPattern)
        assert rule.reason.strip() == rule.reason
        assert len(rule.reason) >= 5, rule


def allowed_by(rules: tuple[AllowlistRule, ...], host: str) -> bool:
    return Allowlist(patterns=rules).allows(host).allowed


@pytest.mark.parametrize(
    "host",
    [
        "api.anthropic.com",
        "api.openai.com",
        "generativelanguage.googleapis.com",
        "bedrock-runtime.us-east-1.amazonaws.com",
        "bedrock.eu-west-3.amazonaws.com",
        "my-resource.openai.azure.com",
        "api.mistral.ai",
        "gitlab.com",
        "bitbucket.org",
        "codeberg.org",
        "pypi.org",
        "files.pythonhosted.org",
        "registry.npmjs.org",
        "crates.io",
        "static.crates.io",
        "index.crates.io",
        "proxy.golang.org",
        "sum.golang.org",
        "rubygems.org",
        "repo.maven.apache.org",
        "repo1.maven.org",
        "deb.debian.org",
    ],
)
def test_the_baseline_allows_llm_providers_git_hosting_and_registries(host: str) -> None:
    assert allowed_by(BASELINE_ALLOWED, host)


@pytest.mark.parametrize(
    "host",
    [
        "github.com",
        "api.github.com",
        "codeload.github.com",
        "objects.githubusercontent.com",
        "raw.githubusercontent.com",
        "ghcr.io",
        "uploads.github.com",
    ],
)
def test_github_is_a_separate_list_not_the_baseline(host: str) -> None:
    assert allowed_by(GITHUB_DOMAINS, host)
    assert not allowed_by(BASELINE_ALLOWED, host)


@pytest.mark.parametrize(
    "host",
    [
        "bedrock.evil.attacker.amazonaws.com",
        "bedrock-runtime.amazonaws.com",
        "s3.us-east-1.amazonaws.com",
        "openai.azure.com",
        "evil.com",
        "pypi.org.evil.com",
        "malicious-github.com",
    ],
)
def test_the_baseline_does_not_allow_lookalikes(host: str) -> None:
    assert not allowed_by(BASELINE_ALLOWED + GITHUB_DOMAINS, host)


@pytest.mark.parametrize(
    "host",
    [
        "169.254.169.254",
        "metadata.google.internal",
        "METADATA.GOOGLE.INTERNAL.",
        "metadata",
        "instance-data",
        "fd00:ec2::254",
        "[::ffff:169.254.169.254]",
        "statsig.anthropic.com",
        "sentry.io",
        "o123.ingest.sentry.io",
    ],
)
def test_the_deny_list_covers_metadata_and_telemetry(host: str) -> None:
    assert allowed_by(BASELINE_DENIED, host)  # "allowed by" = matched by the deny list


def test_denied_addresses_are_forbidden_addresses_too() -> None:
    for rule in BASELINE_DENIED:
        if isinstance(rule.pattern, IpLiteralPattern):
            reason = forbidden_reason(rule.pattern.address)
            assert reason is not None
            assert reason.startswith("cloud metadata"), reason


def test_no_allow_entry_is_itself_denied() -> None:
    deny = Allowlist(patterns=BASELINE_DENIED)
    for rule in BASELINE_ALLOWED + GITHUB_DOMAINS + TICKETING_DOMAINS:
        if isinstance(rule.pattern, DomainPattern):
            assert not deny.allows(rule.pattern.text.replace("*", "x")).allowed, rule


def test_ticketing_lists_linear_and_jira() -> None:
    assert allowed_by(TICKETING_DOMAINS, "api.linear.app")
    assert allowed_by(TICKETING_DOMAINS, "acme.atlassian.net")


# --- load_baseline on malformed samples -------------------------------------------------------

GOOD = """
[[allowed]]
pattern = "api.example.com"
reason = "an example"

[[denied]]
pattern = "169.254.169.254"
reason = "metadata"
"""


def test_load_baseline_reads_a_sample() -> None:
    baseline = load_baseline(GOOD)
    assert baseline == Baseline(
        allowed=(baseline.allowed[0],), github=(), ticketing=(), denied=(baseline.denied[0],)
    )
    assert baseline.allowed[0].pattern == DomainPattern.parse("api.example.com")
    assert baseline.allowed[0].reason == "an example"
    assert isinstance(baseline.denied[0].pattern, IpLiteralPattern)


def test_reasons_are_stripped() -> None:
    baseline = load_baseline('[[github]]\npattern = "github.com"\nreason = "  hub  "\n')
    assert baseline.github[0].reason == "hub"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[[allowed]\n", "not valid TOML"),
        ('[[alowed]]\npattern = "a.com"\nreason = "r"\n', "unknown list"),
        ('allowed = "a.com"\n', "must be an array of tables"),
        ("allowed = [1]\n", "must be a table"),
        ('[[allowed]]\npattern = "a.com"\n', "expected ['pattern', 'reason']"),
        ('[[allowed]]\npattern = "a.com"\nreason = "r"\nwhy = "x"\n', "has keys"),
        ('[[allowed]]\npattern = 1\nreason = "r"\n', "pattern must be a string"),
        ('[[allowed]]\npattern = "a.com"\nreason = ""\n', "reason must be a non-empty"),
        ('[[allowed]]\npattern = "a.com"\nreason = "   "\n', "reason must be a non-empty"),
        ('[[allowed]]\npattern = "a.com"\nreason = 3\n', "reason must be a non-empty"),
        ('[[allowed]]\npattern = "*.com"\nreason = "r"\n', "at least 2 labels"),
        ('[[denied]]\npattern = "a*.b.com"\nreason = "r"\n', "must be a whole label"),
        (
            '[[allowed]]\npattern = "a.com"\nreason = "r"\n'
            '[[allowed]]\npattern = "A.com."\nreason = "r2"\n',
            "duplicates an earlier entry",
        ),
    ],
)
def test_a_malformed_baseline_fails_loudly_naming_the_entry(text: str, problem: str) -> None:
    with pytest.raises(InvalidBaseline) as caught:
        load_baseline(text, source="sample.toml")
    message = str(caught.value)
    assert problem in message
    assert message.startswith("sample.toml")


def test_a_bad_entry_is_named_by_list_and_position() -> None:
    text = GOOD + '[[allowed]]\npattern = "bad..name"\nreason = "r"\n'
    with pytest.raises(InvalidBaseline, match=r"\[\[allowed\]\] entry 2.*bad\.\.name"):
        load_baseline(text)


def test_invalid_baseline_is_an_enforcement_failure() -> None:
    assert issubclass(InvalidBaseline, EnforcementFailed)
