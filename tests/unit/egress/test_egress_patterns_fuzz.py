"""Hypothesis: a pattern is refused, or it matches its own concrete instances and nothing the
wildcard forbids; host parsing never raises anything but InvalidHostName."""

from __future__ import annotations

from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from cc_server.egress.patterns import (
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

FUZZ = settings(max_examples=400, database=None, deadline=None)

# Labels drawn from the troublesome ones plus arbitrary short text.
LABEL = st.sampled_from(
    ["", "*", "a*", "**", "a", "example", "com", "EXAMPLE", "Bücher", "xn--bcher-kva", "-a",
     "a-", "a_b", "1", "0x7f", "127", "ü", "a" * 64, "xn---e2r", " ", "。"]
) | st.text(max_size=5)  # fmt: skip
PATTERN_TEXT = st.builds(
    lambda labels, dot: ".".join(labels) + dot,
    st.lists(LABEL, min_size=1, max_size=5),
    st.sampled_from(["", "."]),
)
# Concrete labels that can stand in for a '*'.
CONCRETE = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)

FULLWIDTH_LOOPBACK = "\uff11\uff12\uff17.\uff10.\uff10.\uff11"  # 127.0.0.1 in fullwidth digits


@FUZZ
@given(PATTERN_TEXT, st.lists(CONCRETE, min_size=1, max_size=3), CONCRETE)
@example("*.example.com", ["a"], "x")
@example("bedrock.*.amazonaws.com", ["us-east-1"], "evil")
@example("Bücher.example.", ["a"], "x")
def test_a_parsed_pattern_matches_its_own_instances(text: str, fill: list[str], extra: str) -> None:
    try:
        pattern = DomainPattern.parse(text)
    except InvalidPattern:
        return
    assert DomainPattern.parse(pattern.text) == pattern  # canonical and stable
    assert pattern.text.isascii()
    assert pattern.text == pattern.text.lower()
    if pattern.wildcard is Wildcard.NONE:
        assert pattern.matches(text)
        assert pattern.matches(pattern.text.upper() + ".")
        assert not pattern.matches(f"{extra}.{pattern.text}")
        assert not pattern.matches(f"{pattern.text}.{extra}")
        return
    head, tail = ".".join(pattern.head), ".".join(pattern.tail)
    if pattern.wildcard is Wildcard.SUBDOMAINS:
        instance = f"{'.'.join(fill)}.{tail}"
        assume(len(instance) <= 253)
        assert pattern.matches(instance)
        assert pattern.matches(instance.upper() + ".")
        assert not pattern.matches(tail)  # never the apex
        assert not pattern.matches(f"{instance}.{extra}")
        return
    instance = f"{head}.{fill[0]}.{tail}"
    assume(len(instance) <= 253 - len(extra) - 1)
    assert pattern.matches(instance)
    assert pattern.matches(instance.upper())
    assert not pattern.matches(f"{head}.{tail}")  # the one label is required
    assert not pattern.matches(f"{head}.{fill[0]}.{extra}.{tail}")  # and only one
    assert not pattern.matches(f"{extra}.{instance}")


@FUZZ
@given(st.text(max_size=30) | PATTERN_TEXT)
@example(FULLWIDTH_LOOPBACK)
@example("[::1]")
def test_parse_pattern_refuses_or_yields_a_stable_pattern(text: str) -> None:
    try:
        pattern = parse_pattern(text)
    except InvalidPattern:
        return
    assert parse_pattern(pattern.text) == pattern
    if isinstance(pattern, IpLiteralPattern):
        assert pattern.matches(text)


@FUZZ
@given(st.text(max_size=30))
def test_host_parsing_raises_only_invalid_host_name(text: str) -> None:
    try:
        target = parse_host(text)
    except InvalidHostName:
        return
    if isinstance(target, str):
        assert normalise_host(target) == target  # idempotent
        assert len(target) <= 253
        assert all(0 < len(label) <= 63 for label in target.split("."))


@FUZZ
@given(st.text(max_size=30))
def test_the_allowlist_never_raises_and_refuses_when_empty(host: str) -> None:
    rules = (AllowlistRule(pattern=parse_pattern("*.example.com"), reason="fuzz"),)
    assert not Allowlist().allows(host).allowed
    decision = Allowlist(patterns=rules).allows(host)
    assert decision.allowed == DomainPattern.parse("*.example.com").matches(host)
