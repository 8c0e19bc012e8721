"""Domain patterns: the spec's examples, lookalikes, normalisation, IP literals, the allowlist."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address

import pytest

from cc_server.egress import patterns
from cc_server.egress.patterns import (
    ALLOWED_FORMS,
    Allowlist,
    AllowlistRule,
    DomainPattern,
    InvalidHostName,
    InvalidPattern,
    IpLiteralPattern,
    Wildcard,
    normalise_host,
    parse_host,
    parse_pattern,
)
from cc_server.errors import BadSpec

# --- normalise_host -------------------------------------------------------------------------

FULLWIDTH_LOOPBACK = "\uff11\uff12\uff17.\uff10.\uff10.\uff11"  # 127.0.0.1 in fullwidth digits


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("example.com", "example.com"),
        ("EXAMPLE.COM", "example.com"),
        ("Api.GitHub.com", "api.github.com"),
        ("example.com.", "example.com"),
        ("Bücher.example", "xn--bcher-kva.example"),
        ("BÜCHER.example", "xn--bcher-kva.example"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        ("XN--BCHER-KVA.EXAMPLE.", "xn--bcher-kva.example"),
        ("faß.de", "xn--fa-hia.de"),  # IDNA 2008, not transitional
        ("a\u3002b\uff0ec\uff61d", "a.b.c.d"),  # the dots UTS 46 maps to '.'
        ("localhost", "localhost"),
        ("a" * 63 + ".com", "a" * 63 + ".com"),
    ],
)
def test_normalise_host(name: str, canonical: str) -> None:
    assert normalise_host(name) == canonical


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "example.com..",  # only one trailing dot is dropped
        "a..b",
        ".example.com",
        "a" * 64 + ".com",  # label over 63
        ".".join(["a" * 63] * 4),  # 255 characters: name over 253
        "-a.com",
        "a-.com",
        "ab--c.com",
        "a_b.com",
        "a b.com",
        "a\x00.com",
        "example.com:443",
        "[::1]",
        "*.example.com",
        "xn--abc.com",  # malformed A-label
        "xn---e2r.com",  # a non-canonical A-label (xn--e2r is the canonical one)
        "xn--ls8h.la",  # emoji: forbidden by IDNA 2008
    ],
)
def test_normalise_host_refuses_garbage(name: str) -> None:
    with pytest.raises(InvalidHostName):
        normalise_host(name)


def test_a_253_character_name_is_the_longest_accepted() -> None:
    name = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
    assert len(name) == 253
    assert normalise_host(name + ".") == name
    with pytest.raises(InvalidHostName):
        normalise_host(name + "d")


def test_invalid_host_name_is_a_value_error() -> None:
    assert issubclass(InvalidHostName, ValueError)


# --- parse_host -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("example.com", "example.com"),
        ("Bücher.example.", "xn--bcher-kva.example"),
        ("127.0.0.1", IPv4Address("127.0.0.1")),
        ("0x7f.1", IPv4Address("127.0.0.1")),
        ("127.0.0.1.", IPv4Address("127.0.0.1")),  # an address once the dot is dropped
        (FULLWIDTH_LOOPBACK, IPv4Address("127.0.0.1")),  # fullwidth digits normalise to an address
        ("[::1]", IPv6Address("::1")),
    ],
)
def test_parse_host(text: str, expected: object) -> None:
    assert parse_host(text) == expected


# --- DomainPattern: the spec's examples -----------------------------------------------------


def test_leading_wildcard_matches_any_subdomain_but_not_the_apex() -> None:
    pattern = DomainPattern.parse("*.example.com")
    assert pattern.wildcard is Wildcard.SUBDOMAINS
    assert pattern.matches("a.example.com")
    assert pattern.matches("a.b.example.com")
    assert pattern.matches("x.y.z.example.com")
    assert not pattern.matches("example.com")
    assert not pattern.matches("aexample.com")
    assert not pattern.matches("example.com.evil.com")
    assert not pattern.matches("example.org")


def test_middle_wildcard_matches_exactly_one_label() -> None:
    pattern = DomainPattern.parse("bedrock.*.amazonaws.com")
    assert pattern.wildcard is Wildcard.ONE_LABEL
    assert pattern.head == ("bedrock",)
    assert pattern.tail == ("amazonaws", "com")
    assert pattern.matches("bedrock.us-east-1.amazonaws.com")
    assert pattern.matches("BEDROCK.EU-WEST-3.AMAZONAWS.COM.")
    assert not pattern.matches("bedrock.evil.attacker.amazonaws.com")
    assert not pattern.matches("bedrock.amazonaws.com")
    assert not pattern.matches("x.bedrock.us-east-1.amazonaws.com")
    assert not pattern.matches("bedrock-runtime.us-east-1.amazonaws.com")
    assert not pattern.matches("bedrock.us-east-1.amazonaws.com.evil.com")


def test_middle_wildcard_with_several_head_labels() -> None:
    pattern = DomainPattern.parse("a.b.*.example.com")
    assert pattern.matches("a.b.c.example.com")
    assert not pattern.matches("x.b.c.example.com")
    assert not pattern.matches("a.b.c.example.org")


@pytest.mark.parametrize(
    "host",
    [
        "malicious-github.com",
        "github.com.evil.com",
        "evilgithub.com",
        "github.co",
        "github.com.",  # same name: must match (checked below), listed to show the contrast
        "api.github.com",
        "githubXcom",
        "github-com",
    ],
)
def test_exact_name_refuses_lookalikes(host: str) -> None:
    pattern = DomainPattern.parse("github.com")
    assert pattern.wildcard is Wildcard.NONE
    assert pattern.matches(host) == (host == "github.com.")


@pytest.mark.parametrize("host", ["GITHUB.COM", "GitHub.Com", "github.com.", "GITHUB.COM."])
def test_case_and_trailing_dot_do_not_matter(host: str) -> None:
    assert DomainPattern.parse("github.com").matches(host)
    assert DomainPattern.parse("GitHub.COM.").matches(host)


def test_lookalikes_of_a_wildcard_pattern() -> None:
    pattern = DomainPattern.parse("*.github.com")
    assert pattern.matches("api.github.com")
    assert not pattern.matches("malicious-github.com")
    assert not pattern.matches("github.com.evil.com")
    assert not pattern.matches("api.github.com.evil.com")
    assert not pattern.matches("evilgithub.com")
    assert not pattern.matches("github.com")


def test_idn_pattern_and_host_match_in_either_spelling() -> None:
    for pattern_text in ("Bücher.example", "xn--bcher-kva.example", "BÜCHER.EXAMPLE."):
        pattern = DomainPattern.parse(pattern_text)
        assert pattern.text == "xn--bcher-kva.example"
        assert pattern.matches("bücher.example")
        assert pattern.matches("XN--BCHER-KVA.example")
        assert not pattern.matches("bucher.example")
    wildcard = DomainPattern.parse("*.bücher.example")
    assert wildcard.text == "*.xn--bcher-kva.example"
    assert wildcard.matches("www.Bücher.example")
    middle = DomainPattern.parse("ü.*.example.com")
    assert middle.text == "xn--tda.*.example.com"
    assert middle.matches("Ü.x.example.com")


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "2130706433", "0x7f.1", "127.1", "[::1]", "::ffff:7f00:1", FULLWIDTH_LOOPBACK],
)
def test_an_ip_literal_never_matches_a_name_pattern(host: str) -> None:
    # Even a pattern whose labels are those digits: the host is an address, not a name.
    for text in ("*.0.0.1", "127.*.0.1", "*.example.com"):
        assert not DomainPattern.parse(text).matches(host)


@pytest.mark.parametrize("host", ["", "a..b", "a b", "exa_mple.com", "x" * 300])
def test_an_invalid_host_never_matches(host: str) -> None:
    assert not DomainPattern.parse("*.example.com").matches(host)
    assert not IpLiteralPattern.parse("10.0.0.1").matches(host)


def test_matches_name_takes_a_normalised_name() -> None:
    pattern = DomainPattern.parse("*.example.com")
    assert pattern.matches_name("a.example.com")
    assert not pattern.matches_name("example.com")


def test_patterns_are_frozen_canonical_values() -> None:
    pattern = DomainPattern.parse("*.EXAMPLE.com.")
    assert pattern == DomainPattern.parse("*.example.com")
    assert hash(pattern) == hash(DomainPattern.parse("*.example.com"))
    assert str(pattern) == "*.example.com"
    assert DomainPattern.parse(pattern.text) == pattern
    with pytest.raises(AttributeError):
        pattern.text = "other.com"  # type: ignore[misc]


# --- DomainPattern: rejected forms ----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("*", "'*' alone"),
        ("*.", "'*' alone"),
        ("*.com", "at least 2 labels"),
        ("*.com.", "at least 2 labels"),
        ("bedrock.*.com", "at least 2 labels"),
        ("example.*", "cannot be the last label"),
        ("a.b.*", "cannot be the last label"),
        ("*.*.example.com", "more than one '*'"),
        ("a.*.*.example.com", "more than one '*'"),
        ("**.example.com", "more than one '*'"),
        ("a*.b.com", "must be a whole label"),
        ("*a.example.com", "must be a whole label"),
        ("b.a*.example.com", "must be a whole label"),
        ("*..example.com", "empty label"),
        ("a..*.example.com", "empty label"),
        ("*.example.com..", "empty label"),
        (".*.example.com", "empty label"),
        ("*.exa_mple.com", "not a valid host name"),
        ("b_d.*.example.com", "not a valid host name"),
        ("*.-bad.com", "not a valid host name"),
        ("", "is empty"),
        ("a..b", "empty label"),
        ("http://example.com", "not a valid host name"),
        ("example.com/path", "not a valid host name"),
        ("127.0.0.1", "is an IP address"),
        (FULLWIDTH_LOOPBACK, "is an IP address"),
    ],
)
def test_bad_patterns_are_refused_with_a_clear_message(text: str, problem: str) -> None:
    with pytest.raises(InvalidPattern) as caught:
        DomainPattern.parse(text)
    assert problem in caught.value.message
    assert repr(text) in caught.value.message
    assert caught.value.fix == ALLOWED_FORMS
    assert "*.example.com" in str(caught.value)  # the allowed forms are spelled out


def test_a_wildcard_pattern_longer_than_253_is_refused() -> None:
    long_tail = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 60])  # 252 characters, a valid name
    with pytest.raises(InvalidPattern, match="longer than 253"):
        DomainPattern.parse("*." + long_tail)


def test_a_label_that_would_split_in_two_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # UTS 46 maps only the four dots to '.', which the parser splits on first; this guard keeps a
    # future Unicode table from turning one pattern label into two.
    real = patterns.normalise_host
    monkeypatch.setattr(patterns, "normalise_host", lambda name: real(name) + ".extra")
    with pytest.raises(InvalidPattern, match="more than one label"):
        DomainPattern.parse("*.example.com")


def test_invalid_pattern_is_a_bad_spec_and_a_value_error() -> None:
    assert issubclass(InvalidPattern, BadSpec)
    assert issubclass(InvalidPattern, ValueError)


# --- IpLiteralPattern and parse_pattern -----------------------------------------------------


@pytest.mark.parametrize("text", ["10.0.0.5", "012.0.0.5", "0xa.0.0.5", "167772165", "10.5"])
def test_ip_literal_pattern_matches_every_spelling(text: str) -> None:
    pattern = IpLiteralPattern.parse(text)
    assert pattern.address == IPv4Address("10.0.0.5")
    assert pattern.text == str(pattern) == "10.0.0.5"
    for host in ("10.0.0.5", "167772165", "0xa000005", "10.0.5", "::ffff:10.0.0.5"):
        assert pattern.matches(host), host
    for host in ("10.0.0.6", "10.0.0.5.example.com", "64:ff9b::a00:5", "example.com"):
        assert not pattern.matches(host), host


def test_ipv6_literal_pattern() -> None:
    pattern = IpLiteralPattern.parse("[2606:4700::1111]")
    assert pattern.text == "2606:4700::1111"
    assert pattern.matches("2606:4700:0:0:0:0:0:1111")
    assert pattern.matches("[2606:4700::1111]")
    assert not pattern.matches("2606:4700::1111%eth0")
    assert not pattern.matches("10.0.0.5")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("example.com", "is a name"),
        ("a b", "is not an IP address"),
        ("fe80::1%eth0", "zone ids"),
    ],
)
def test_ip_literal_pattern_refusals(text: str, problem: str) -> None:
    with pytest.raises(InvalidPattern, match=problem):
        IpLiteralPattern.parse(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("api.example.com", DomainPattern.parse("api.example.com")),
        ("API.Example.COM.", DomainPattern.parse("api.example.com")),
        ("*.example.com", DomainPattern.parse("*.example.com")),
        ("10.0.0.5", IpLiteralPattern(address=IPv4Address("10.0.0.5"))),
        ("0x7f.1", IpLiteralPattern(address=IPv4Address("127.0.0.1"))),
        (FULLWIDTH_LOOPBACK, IpLiteralPattern(address=IPv4Address("127.0.0.1"))),
        ("[fd00::1]", IpLiteralPattern(address=IPv6Address("fd00::1"))),
    ],
)
def test_parse_pattern_routes_names_and_addresses(text: str, expected: object) -> None:
    assert parse_pattern(text) == expected


@pytest.mark.parametrize("text", ["", "a..b", "exa mple.com", "*.com", "fe80::1%eth0", "example.*"])
def test_parse_pattern_refusals(text: str) -> None:
    with pytest.raises(InvalidPattern):
        parse_pattern(text)


# --- Allowlist -------------------------------------------------------------------------------


def rule(text: str, reason: str = "test") -> AllowlistRule:
    return AllowlistRule(pattern=parse_pattern(text), reason=reason)


ALLOWLIST = Allowlist(
    patterns=(
        rule("*.example.com", "example subdomains"),
        rule("api.github.com"),
        rule("10.0.0.5", "a listed private host"),
        rule("telemetry.example.com"),  # shadowed by the deny list
    ),
    denied=(
        rule("telemetry.example.com", "telemetry sink"),
        rule("169.254.169.254", "cloud metadata"),
    ),
)


def test_allowlist_allows_with_the_deciding_rule() -> None:
    decision = ALLOWLIST.allows("A.Example.COM.")
    assert decision.allowed
    assert decision.host == "a.example.com"
    assert decision.rule == ALLOWLIST.patterns[0]
    assert "*.example.com" in decision.reason
    assert "example subdomains" in decision.reason


def test_allowlist_refuses_an_unlisted_host() -> None:
    decision = ALLOWLIST.allows("github.com")
    assert not decision.allowed
    assert decision.rule is None
    assert "not on this session's egress allowlist" in decision.reason


def test_denied_wins_over_every_allow() -> None:
    decision = ALLOWLIST.allows("telemetry.example.com")
    assert not decision.allowed
    assert decision.rule == ALLOWLIST.denied[0]
    assert "deny list" in decision.reason
    assert "telemetry sink" in decision.reason


@pytest.mark.parametrize(
    "host",
    [
        "169.254.169.254",
        "2852039166",
        "0xa9fea9fe",
        "[::ffff:169.254.169.254]",
        "::ffff:a9fe:a9fe",
        "64:ff9b::a9fe:a9fe",
        "2002:a9fe:a9fe::",
        "2001:0:4136:e378:8000:63bf:5601:5601",
    ],
)
def test_a_denied_address_is_denied_in_every_spelling(host: str) -> None:
    allow_it_too = Allowlist(patterns=(rule(host),), denied=ALLOWLIST.denied)
    for allowlist in (ALLOWLIST, allow_it_too):
        decision = allowlist.allows(host)
        assert not decision.allowed
        assert decision.rule == ALLOWLIST.denied[1]


def test_allowlist_matches_ip_literals_as_addresses() -> None:
    assert ALLOWLIST.allows("10.0.0.5").allowed
    assert ALLOWLIST.allows("012.0.0.5").allowed
    assert ALLOWLIST.allows(IPv4Address("10.0.0.5")).allowed
    assert ALLOWLIST.allows(IPv6Address("::ffff:10.0.0.5")).allowed
    assert not ALLOWLIST.allows("10.0.0.6").allowed
    assert not ALLOWLIST.allows(IPv6Address("2606:4700::1111")).allowed
    # A name pattern never allows an address, and an address pattern never allows a name.
    assert not Allowlist(patterns=(rule("*.0.0.5"),)).allows("10.0.0.5").allowed
    assert not Allowlist(patterns=(rule("10.0.0.5"),)).allows("example.com").allowed


def test_allowlist_refuses_an_invalid_host_without_raising() -> None:
    decision = ALLOWLIST.allows("exa mple.com")
    assert not decision.allowed
    assert decision.host == "exa mple.com"
    assert decision.rule is None
    assert "not a valid host name" in decision.reason


def test_an_empty_allowlist_refuses_everything_and_says_why() -> None:
    empty = Allowlist(denied=ALLOWLIST.denied)
    assert empty.is_empty
    assert not ALLOWLIST.is_empty
    decision = empty.allows("api.example.com")
    assert not decision.allowed
    assert "network access is off" in decision.reason
