"""Allowlist entries with a port: the grammar (`parse_entry`, `format_entry`) and the matching
table (an entry with a port allows only that port; one without allows every port; the deny list
wins on every port), through every place an allowlist is written."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address

import pytest

from cc_server.egress.baseline import BASELINE_DENIED
from cc_server.egress.operator import ALLOW_ENV, ALLOW_FLAG, OperatorEgress
from cc_server.egress.patterns import (
    Allowlist,
    AllowlistRule,
    DomainPattern,
    InvalidPattern,
    IpLiteralPattern,
    format_entry,
    parse_entry,
)
from cc_server.egress.resolver import allowlist_for
from cc_server.policy import parse_spec

V4 = IpLiteralPattern(address=IPv4Address("10.1.2.3"))
V6 = IpLiteralPattern(address=IPv6Address("2001:db8::1"))


@pytest.mark.parametrize(
    ("text", "pattern", "port", "canonical"),
    [
        ("api.example.com", DomainPattern.parse("api.example.com"), None, "api.example.com"),
        ("api.example.com:443", DomainPattern.parse("api.example.com"), 443, "api.example.com:443"),
        ("API.Example.COM.:443", DomainPattern.parse("api.example.com"), 443,
         "api.example.com:443"),
        ("*.example.com:443", DomainPattern.parse("*.example.com"), 443, "*.example.com:443"),
        ("bedrock.*.amazonaws.com:443", DomainPattern.parse("bedrock.*.amazonaws.com"), 443,
         "bedrock.*.amazonaws.com:443"),
        ("Bücher.example:8080", DomainPattern.parse("xn--bcher-kva.example"), 8080,
         "xn--bcher-kva.example:8080"),
        ("10.1.2.3", V4, None, "10.1.2.3"),
        ("10.1.2.3:5432", V4, 5432, "10.1.2.3:5432"),
        ("0x0a.1.2.3:5432", V4, 5432, "10.1.2.3:5432"),  # any spelling libc reads, made canonical
        ("2001:db8::1", V6, None, "2001:db8::1"),  # bare IPv6: every port
        ("[2001:db8::1]", V6, None, "2001:db8::1"),
        ("[2001:db8::1]:8080", V6, 8080, "[2001:db8::1]:8080"),
        ("[2001:DB8:0::1]:1", V6, 1, "[2001:db8::1]:1"),
        ("localhost:65535", DomainPattern.parse("localhost"), 65535, "localhost:65535"),
    ],
)  # fmt: skip
def test_parse_entry(text: str, pattern: object, port: int | None, canonical: str) -> None:
    assert parse_entry(text) == (pattern, port)
    assert format_entry(*parse_entry(text)) == canonical
    assert parse_entry(canonical) == (pattern, port)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("example.com:", "port ''"),
        ("example.com:0", "port '0'"),
        ("example.com:65536", "port '65536'"),
        ("example.com:0443", "leading zero"),
        ("example.com:+443", "port '+443'"),
        ("example.com:-1", "port '-1'"),
        ("example.com: 443", "port ' 443'"),
        ("example.com:443 ", "port '443 '"),
        ("example.com:\u0664\u0664\u0663", "decimal"),  # Arabic-Indic digits: not ASCII
        ("example.com:80-90", "port '80-90'"),
        ("example.com:http", "port 'http'"),
        (":443", "no host"),
        ("*:443", "every host"),
        ("*.com:443", "at least 2 labels"),
        ("10.1.2.3:5432:1", "not an IPv6 address"),
        ("[2001:db8::1", "never closes"),
        ("[2001:db8::1]8080", "only ':PORT'"),
        ("[2001:db8::1]:", "port ''"),
        ("[2001:db8::1]:99999", "port '99999'"),
        ("[10.1.2.3]:80", "brackets are for an IPv6 address only"),
        ("[example.com]:80", "brackets are for an IPv6 address only"),
        ("[fe80::1%eth0]:80", "zone ids are not allowed"),
        ("[::g]:80", "not an IPv6 address"),
        ("2001:db8::1:8080x", "not an IPv6 address"),
        ("exa mple.com:443", "not a valid host name"),
        ("", "Empty domain"),
    ],
)
def test_bad_entries_are_refused_with_a_reason(text: str, problem: str) -> None:
    with pytest.raises(InvalidPattern) as caught:
        parse_entry(text)
    assert problem in str(caught.value)
    assert "[fd00::1]:8080" in (caught.value.fix or "")  # the allowed forms name the port form


def _listed(*texts: str) -> Allowlist:
    rules = []
    for text in texts:
        pattern, port = parse_entry(text)
        rules.append(AllowlistRule(pattern=pattern, reason="test", port=port))
    return Allowlist(patterns=tuple(rules), denied=BASELINE_DENIED)


# (entries, host, port, allowed)
MATCHING = [
    (["api.example.com:443"], "api.example.com", 443, True),
    (["api.example.com:443"], "api.example.com", 80, False),
    (["api.example.com:443"], "api.example.com", None, False),  # port unknown: no scoped rule
    (["api.example.com:443"], "API.EXAMPLE.COM.", 443, True),
    (["api.example.com:443"], "other.example.com", 443, False),
    (["api.example.com"], "api.example.com", 22, True),  # no port: every port, as before
    (["api.example.com"], "api.example.com", 65535, True),
    (["api.example.com:443", "api.example.com:22"], "api.example.com", 22, True),
    (["api.example.com:443", "api.example.com:22"], "api.example.com", 80, False),
    (["api.example.com:443", "api.example.com"], "api.example.com", 80, True),
    (["*.example.com:443"], "a.b.example.com", 443, True),
    (["*.example.com:443"], "a.example.com", 8443, False),
    (["*.example.com:443"], "example.com", 443, False),  # still never the apex
    (["bedrock.*.amazonaws.com:443"], "bedrock.us-east-1.amazonaws.com", 443, True),
    (["bedrock.*.amazonaws.com:443"], "bedrock.us-east-1.amazonaws.com", 80, False),
    (["10.1.2.3:5432"], "10.1.2.3", 5432, True),
    (["10.1.2.3:5432"], "10.1.2.3", 5433, False),
    (["10.1.2.3:5432"], "0x0a010203", 5432, True),  # any spelling of the address
    (["10.1.2.3:5432"], "::ffff:10.1.2.3", 5432, True),  # its IPv4-mapped form
    (["10.1.2.3:5432"], "::ffff:10.1.2.3", 22, False),
    (["[2001:db8::1]:8080"], "2001:db8::1", 8080, True),
    (["[2001:db8::1]:8080"], "[2001:db8:0::1]", 8080, True),
    (["[2001:db8::1]:8080"], "2001:db8::1", 8081, False),
    (["2001:db8::1"], "2001:db8::1", 8081, True),
    (["10.1.2.3:5432"], "api.example.com", 5432, False),  # an address entry is not a name
    (["api.example.com:443"], "10.1.2.3", 443, False),
    # The deny list wins on every port, whatever an entry names.
    (["169.254.169.254:80"], "169.254.169.254", 80, False),
    (["169.254.169.254"], "169.254.169.254", 8080, False),
    (["metadata.google.internal:80"], "metadata.google.internal", 80, False),
]


@pytest.mark.parametrize(("entries", "host", "port", "allowed"), MATCHING)
def test_the_matching_table(entries: list[str], host: str, port: int | None, allowed: bool) -> None:
    decision = _listed(*entries).allows(host, port)
    assert decision.allowed is allowed, decision.reason
    if allowed:
        assert decision.rule is not None and decision.rule.port in (None, port)


def test_a_denied_host_is_refused_with_the_deny_list_as_the_reason() -> None:
    decision = _listed("169.254.169.254:80").allows("169.254.169.254", 80)
    assert "deny list" in decision.reason and decision.rule in BASELINE_DENIED


def test_the_decision_names_the_entry_with_its_port() -> None:
    decision = _listed("[2001:db8::1]:8080").allows("2001:db8::1", 8080)
    assert "allowed by [2001:db8::1]:8080 (test)" in decision.reason


SPEC = {"sessionId": "s", "workspaceId": "w"}


def test_spec_egress_allowlist_takes_port_entries() -> None:
    spec = parse_spec({**SPEC, "egressAllowlist": ["db.internal.example:5432", "[fd00::5]:443"]})
    allowlist = allowlist_for(spec)
    assert allowlist.allows("db.internal.example", 5432).allowed
    assert not allowlist.allows("db.internal.example", 5433).allowed
    assert allowlist.allows("fd00::5", 443).allowed
    assert not allowlist.allows("fd00::5", 22).allowed


def test_a_bad_spec_entry_names_its_index() -> None:
    spec = parse_spec({**SPEC, "egressAllowlist": ["ok.example", "bad.example:0"]})
    with pytest.raises(InvalidPattern, match=r"egressAllowlist\[1\]: .*port '0'"):
        allowlist_for(spec)


def test_a_port_entry_and_a_portless_one_are_both_kept() -> None:
    spec = parse_spec({**SPEC, "egressAllowlist": ["x.example:443", "x.example", "x.example:443"]})
    rules = [r for r in allowlist_for(spec).patterns if str(r.pattern) == "x.example"]
    assert [r.entry for r in rules] == ["x.example:443", "x.example"]


def test_operator_settings_take_port_entries() -> None:
    egress = OperatorEgress.build(
        ["registry.internal.example:5000"], {ALLOW_ENV: "10.0.0.7:8443, [fd00::7]:22"}
    )
    assert egress.patterns == ("registry.internal.example:5000", "10.0.0.7:8443", "[fd00::7]:22")
    allowlist = Allowlist(patterns=egress.rules)
    assert allowlist.allows("registry.internal.example", 5000).allowed
    assert not allowlist.allows("registry.internal.example", 443).allowed
    assert allowlist.allows("10.0.0.7", 8443).allowed
    assert not allowlist.allows("10.0.0.7", 22).allowed
    assert allowlist.allows("fd00::7", 22).allowed


def test_a_bad_operator_entry_names_the_setting() -> None:
    with pytest.raises(InvalidPattern, match=f"{ALLOW_FLAG} 'x.example:99999'"):
        OperatorEgress.build(["x.example:99999"], {})


def test_an_ipv4_mapped_entry_is_its_ipv4_host() -> None:
    # Found by the fuzzer: an entry spelled as an IPv4-mapped address matched nothing, itself
    # included.
    allowlist = _listed("[::ffff:10.1.2.3]:5432")
    assert allowlist.allows("::ffff:10.1.2.3", 5432).allowed
    assert allowlist.allows("10.1.2.3", 5432).allowed
    assert not allowlist.allows("10.1.2.3", 5433).allowed
