"""Hypothesis: an allowlist entry either parses to a canonical (pattern, port) that reads back
the same, or is refused with InvalidPattern (never another exception); a generated entry with
a port allows exactly that port; a live change adds and removes exactly its entries."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address

from hypothesis import example, given, settings
from hypothesis import strategies as st

from cc_server.egress.changes import EgressChange, apply_change
from cc_server.egress.patterns import (
    MAX_PORT,
    Allowlist,
    AllowlistRule,
    DomainPattern,
    HostPattern,
    InvalidPattern,
    IpLiteralPattern,
    format_entry,
    parse_entry,
)
from cc_server.errors import BadSpec

FUZZ = settings(max_examples=300, database=None, deadline=None)

PORT = st.integers(min_value=1, max_value=MAX_PORT)
PORT_TEXT = (
    st.sampled_from(["", "0", "00", "080", "65535", "65536", "+1", "-1", " 1", "1 ", "1e3",
                     "\u0661", "\uff11", "99999999999999999999"])
    | PORT.map(str)
    | st.text(max_size=6)
)  # fmt: skip
HOST_TEXT = st.sampled_from(
    ["example.com", "*.example.com", "a.*.example.com", "10.1.2.3", "0x7f.1", "::1",
     "2001:db8::1", "[2001:db8::1]", "[::ffff:10.0.0.1]", "[10.0.0.1]", "[", "]", "[]", "*",
     "Bücher.example", "fe80::1%eth0", "[fe80::1%eth0]", "", ":", "::", "a:b", "localhost"]
) | st.text(max_size=12)  # fmt: skip
ENTRY_TEXT = (
    st.builds(lambda host, sep, port: host + sep + port, HOST_TEXT, st.sampled_from([":", ""]),
              PORT_TEXT)
    | st.text(max_size=30)
)  # fmt: skip

# IDNA 2008 reserves "--" in the third and fourth places of a label (xn--...): such a label is
# not a name, so it is not generated here.
LABEL = st.from_regex(r"[a-z]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True).filter(
    lambda label: label[2:4] != "--"
)
NAME_PATTERN = st.builds(
    lambda star, labels: DomainPattern.parse(("*." if star else "") + ".".join(labels)),
    st.booleans(),
    st.lists(LABEL, min_size=2, max_size=4),
)
ADDRESS_PATTERN = st.builds(
    IpLiteralPattern,
    address=st.ip_addresses().filter(lambda a: getattr(a, "scope_id", None) is None),
)
PATTERN: st.SearchStrategy[HostPattern] = NAME_PATTERN | ADDRESS_PATTERN


@FUZZ
@given(ENTRY_TEXT)
@example("example.com:443")
@example("[2001:db8::1]:8080")
@example("2001:db8::1:8080")
@example("10.1.2.3:5432")
@example("example.com:\uff14\uff14\uff13")  # fullwidth digits are not a port
@example("example.com\uff1a443")  # nor is a fullwidth colon a separator
def test_an_entry_is_canonical_or_refused(text: str) -> None:
    try:
        pattern, port = parse_entry(text)
    except InvalidPattern:
        return
    assert port is None or 1 <= port <= MAX_PORT
    canonical = format_entry(pattern, port)
    assert canonical.isascii()
    assert parse_entry(canonical) == (pattern, port)  # reads back the same
    assert format_entry(*parse_entry(canonical)) == canonical  # one spelling
    if port is not None:
        assert canonical.endswith(f":{port}")
        assert text.endswith(f":{port}")  # the port is exactly the digits written last


@FUZZ
@given(PATTERN, st.one_of(st.none(), PORT))
def test_a_formatted_entry_reads_back(pattern: HostPattern, port: int | None) -> None:
    assert parse_entry(format_entry(pattern, port)) == (pattern, port)


@FUZZ
@given(PATTERN, PORT, PORT)
def test_an_entry_with_a_port_allows_that_port_only(
    pattern: HostPattern, port: int, other: int
) -> None:
    rule = AllowlistRule(pattern=pattern, reason="fuzz", port=port)
    allowlist = Allowlist(patterns=(rule,))
    if isinstance(pattern, IpLiteralPattern):
        host: str | IPv4Address | IPv6Address = pattern.address
    elif pattern.head or pattern.wildcard.value != "none":
        host = ".".join((*pattern.head, "x", *pattern.tail))
    else:
        host = pattern.text
    assert allowlist.allows(host, port).allowed
    assert allowlist.allows(host, other).allowed is (other == port)
    assert not allowlist.allows(host, None).allowed


ENTRY = st.builds(format_entry, NAME_PATTERN | ADDRESS_PATTERN, st.one_of(st.none(), PORT))


@FUZZ
@given(st.lists(ENTRY, max_size=6), st.lists(ENTRY, max_size=4), st.lists(ENTRY, max_size=4))
def test_a_live_change_adds_and_removes_exactly_its_entries(
    before: list[str], allow: list[str], remove: list[str]
) -> None:
    start = Allowlist(patterns=tuple(
        AllowlistRule(pattern=p, reason="spec", port=port) for p, port in map(parse_entry, before)
    ))  # fmt: skip
    try:
        applied = apply_change(start, EgressChange(allow=tuple(allow), remove=tuple(remove)))
    except BadSpec:
        assert set(allow) & set(remove)  # the only refusal with no deny list: both ways
        return
    after = [rule.entry for rule in applied.allowlist.patterns]
    assert not set(remove) & set(after) - set(allow)  # what was removed is gone
    assert set(allow) <= set(after)  # what was allowed is there
    assert set(after) <= set(before) | set(allow)  # and nothing else came in
    assert applied.allowlist.denied == start.denied
    again = apply_change(applied.allowlist, EgressChange(allow=tuple(allow),
                                                          remove=tuple(remove)))
    assert not again.changed  # a retried change changes nothing
