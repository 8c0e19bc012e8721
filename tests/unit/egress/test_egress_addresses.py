"""IP literals in every libc spelling, and every forbidden address class in every spelling."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cc_server.egress.addresses import (
    CLOUD_METADATA,
    IPV4_FORBIDDEN,
    IPV6_FORBIDDEN,
    embedded_ipv4,
    forbidden_reason,
    parse_ip_literal,
)

LOOPBACK = IPv4Address("127.0.0.1")
METADATA = IPv4Address("169.254.169.254")

FULLWIDTH_LOOPBACK = "\uff11\uff12\uff17.\uff10.\uff10.\uff11"  # 127.0.0.1 in fullwidth digits


@pytest.mark.parametrize(
    "text",
    ["127.0.0.1", "2130706433", "0177.0.0.1", "0x7f.1", "0x7F.0.0.1", "127.1", "127.0.1",
     "0x7f000001", "017700000001", "0x7f.0x0.0x0.0x1", "00000000000000177.1"],
)  # fmt: skip
def test_every_libc_spelling_of_loopback_parses(text: str) -> None:
    assert parse_ip_literal(text) == LOOPBACK


@pytest.mark.parametrize(
    "text", ["169.254.169.254", "2852039166", "0251.0376.0251.0376", "0xa9.0xfe.0xa9.0xfe",
             "0xa9fea9fe", "169.254.43518", "0xa9.16689662"],
)  # fmt: skip
def test_every_spelling_of_the_metadata_address_parses(text: str) -> None:
    assert parse_ip_literal(text) == METADATA


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("::1", IPv6Address("::1")),
        ("[::1]", IPv6Address("::1")),
        ("[::ffff:169.254.169.254]", IPv6Address("::ffff:a9fe:a9fe")),
        ("::ffff:7f00:1", IPv6Address("::ffff:127.0.0.1")),
        ("2606:4700::1111", IPv6Address("2606:4700::1111")),
        ("fe80::1%eth0", IPv6Address("fe80::1%eth0")),  # a zone id is kept (and forbidden)
    ],
)
def test_ipv6_literals_parse_bracketed_or_not(text: str, expected: IPv6Address) -> None:
    parsed = parse_ip_literal(text)
    assert parsed == expected
    assert isinstance(parsed, IPv6Address)
    assert parsed.scope_id == expected.scope_id


@pytest.mark.parametrize(
    "text",
    [
        "",
        "example.com",
        "127.0.0.1 x",  # inet_aton would stop at the space and accept it
        "127.0.0.1\t",
        " 127.0.0.1",
        "127.0.0.1\n",
        "127.0.0.1\x00",
        "127.0.0.1.",  # libc's inet_aton refuses the trailing dot; it is a name
        FULLWIDTH_LOOPBACK,  # fullwidth digits: not ASCII, not a literal (names normalise them)
        "1.2.3.256",
        "4294967296",
        "08.0.0.1",
        "[127.0.0.1]",  # brackets hold IPv6 only
        "[::1",
        "::1]",
        "[]",
        ":::",
        "fe80::1%",
        "::ffff:0177.0.0.1",  # the dotted tail of IPv6 takes decimal only
        "localhost",
    ],
)
def test_text_that_is_not_a_literal_returns_none(text: str) -> None:
    assert parse_ip_literal(text) is None


@given(st.text())
@settings(max_examples=500, database=None, deadline=None)
@example("1.2.3.4 ")
@example("0x")
@example("[")
@example("%")
def test_parse_ip_literal_never_raises(text: str) -> None:
    result = parse_ip_literal(text)
    assert result is None or isinstance(result, IPv4Address | IPv6Address)


@given(st.binary(max_size=16).map(lambda b: b.decode("latin-1")))
@settings(max_examples=300, database=None, deadline=None)
def test_parse_ip_literal_never_raises_on_bytes_text(text: str) -> None:
    parse_ip_literal(text)


# Every forbidden class, as (spelling, class name the reason must start with).
FORBIDDEN = [
    # IPv4 classes
    ("0.0.0.0", "unspecified"),
    ("0", "unspecified"),
    ("0.1.2.3", "unspecified"),
    ("127.0.0.1", "loopback"),
    ("2130706433", "loopback"),
    ("0177.0.0.1", "loopback"),
    ("0x7f.1", "loopback"),
    ("127.1", "loopback"),
    ("127.255.255.254", "loopback"),
    ("169.254.1.1", "link-local"),
    ("10.0.0.1", "private"),
    ("012.1", "private"),  # octal 10.0.0.1
    ("172.16.0.1", "private"),
    ("172.31.255.255", "private"),
    ("192.168.1.1", "private"),
    ("0xc0a80101", "private"),
    ("100.64.0.1", "shared address space (CGNAT)"),
    ("100.127.255.255", "shared address space (CGNAT)"),
    ("192.0.0.8", "IETF protocol assignments"),
    ("192.0.2.1", "documentation"),
    ("198.51.100.1", "documentation"),
    ("203.0.113.1", "documentation"),
    ("192.88.99.1", "deprecated 6to4 relay"),
    ("198.18.0.1", "benchmarking"),
    ("198.19.255.255", "benchmarking"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("255.255.255.255", "limited broadcast"),
    ("4294967295", "limited broadcast"),
    ("240.0.0.1", "reserved"),
    # cloud metadata, IPv4 and IPv6
    ("169.254.169.254", "cloud metadata"),
    ("2852039166", "cloud metadata"),
    ("0251.0376.0251.0376", "cloud metadata"),
    ("0xa9.0xfe.0xa9.0xfe", "cloud metadata"),
    ("169.254.170.2", "cloud metadata"),
    ("169.254.170.23", "cloud metadata"),
    ("100.100.100.200", "cloud metadata"),
    ("168.63.129.16", "cloud metadata"),
    ("192.0.0.192", "cloud metadata"),
    ("fd00:ec2::254", "cloud metadata"),
    ("[fd00:ec2::254]", "cloud metadata"),
    ("fd00:ec2::23", "cloud metadata"),
    # IPv6 classes
    ("::", "unspecified"),
    ("::1", "loopback"),
    ("[::1]", "loopback"),
    ("0:0:0:0:0:0:0:1", "loopback"),
    ("fe80::1", "link-local"),
    ("febf::1", "link-local"),
    ("fe80::1%eth0", "zone-scoped"),
    ("2606:4700::1111%1", "zone-scoped"),
    ("fc00::1", "unique-local"),
    ("fd12:3456::1", "unique-local"),
    ("fec0::1", "site-local"),
    ("ff02::1", "multicast"),
    ("100::1", "discard-only"),
    ("2001:db8::1", "documentation"),
    ("3fff::1", "documentation"),
    ("2001:2::1", "benchmarking"),
    ("2001:10::1", "IETF protocol assignments"),
    ("5f00::1", "SRv6"),
    ("4000::1", "reserved"),
    ("::2:0:0:1", "reserved"),  # inside ::/8 but not an IPv4-carrying form
    # NAT64 local-use is refused whole, whatever it embeds
    ("64:ff9b:1::5db8:d822", "NAT64 local-use"),
    ("64:ff9b:1::7f00:1", "NAT64 local-use"),
    # IPv4-carrying IPv6 forms: the reason names the embedded address's class
    ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:7f00:1", "loopback"),
    ("[::ffff:169.254.169.254]", "cloud metadata"),
    ("::ffff:a9fe:a9fe", "cloud metadata"),
    ("::ffff:10.0.0.1", "private"),
    ("::ffff:0:7f00:1", "loopback"),  # SIIT IPv4-translated
    ("::127.0.0.1", "loopback"),  # IPv4-compatible (deprecated)
    ("::a9fe:a9fe", "cloud metadata"),
    ("::2", "unspecified"),  # IPv4-compatible 0.0.0.2
    ("64:ff9b::a9fe:a9fe", "cloud metadata"),  # NAT64
    ("64:ff9b::127.0.0.1", "loopback"),
    ("64:ff9b::c0a8:101", "private"),
    ("2002:a9fe:a9fe::", "cloud metadata"),  # 6to4
    ("2002:7f00:1::1", "loopback"),
    ("2002:c0a8:101:1::1", "private"),
    # Teredo: server in bits 32-63, client is the bitwise NOT of the last 32 bits
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "documentation"),  # client 192.0.2.45
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback"),  # client 127.0.0.1
    ("2001:0:4136:e378:8000:63bf:5601:5601", "cloud metadata"),  # client 169.254.169.254
    ("2001:0:a00:1:8000:63bf:a247:27dd", "private"),  # server 10.0.0.1
]


@pytest.mark.parametrize(("text", "klass"), FORBIDDEN)
def test_every_forbidden_class_in_every_spelling_is_refused(text: str, klass: str) -> None:
    address = parse_ip_literal(text)
    assert address is not None, text
    reason = forbidden_reason(address)
    assert reason is not None, text
    assert reason.startswith(klass), reason


@pytest.mark.parametrize(
    "text",
    [
        "93.184.216.34",
        "8.8.8.8",
        "1.1.1.1",
        "0x5db8d822",  # 93.184.216.34
        "100.63.255.255",  # just below CGNAT
        "100.128.0.0",  # just above CGNAT
        "172.15.255.255",
        "172.32.0.0",
        "169.253.255.255",
        "223.255.255.255",
        "2606:4700::1111",
        "[2606:4700::1111]",
        "2a00:1450:4001:80b::200e",
        "::ffff:93.184.216.34",  # IPv4-mapped public
        "64:ff9b::808:808",  # NAT64 of 8.8.8.8
        "2002:5db8:d822::1",  # 6to4 of 93.184.216.34
        "2001:0:4136:e378:8000:63bf:a247:27dd",  # Teredo: server and client both public
    ],
)
def test_public_addresses_are_not_forbidden(text: str) -> None:
    address = parse_ip_literal(text)
    assert address is not None
    assert forbidden_reason(address) is None


def test_every_table_entry_is_a_named_class() -> None:
    for _network, name in (*IPV4_FORBIDDEN, *IPV6_FORBIDDEN):
        assert name.strip()
    for address, provider in CLOUD_METADATA.items():
        reason = forbidden_reason(address)
        assert reason is not None
        assert reason.startswith("cloud metadata"), reason
        assert provider in reason


@pytest.mark.parametrize(
    ("text", "carried"),
    [
        ("::ffff:7f00:1", ["127.0.0.1"]),
        ("::ffff:0:7f00:1", ["127.0.0.1"]),
        ("::7f00:1", ["127.0.0.1"]),
        ("64:ff9b::7f00:1", ["127.0.0.1"]),
        ("2002:7f00:1::", ["127.0.0.1"]),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", ["65.54.227.120", "127.0.0.1"]),
        ("::", []),
        ("::1", []),
        ("2606:4700::1111", []),
        ("64:ff9b:1::7f00:1", []),  # local-use NAT64 is refused whole, never decoded
    ],
)
def test_embedded_ipv4_extracts_what_each_form_carries(text: str, carried: list[str]) -> None:
    address = IPv6Address(text)
    assert embedded_ipv4(address) == tuple(IPv4Address(a) for a in carried)


@given(st.integers(min_value=0, max_value=2**32 - 1))
@settings(max_examples=300, database=None, deadline=None)
def test_ipv4_mapped_and_nat64_forms_agree_with_the_plain_address(value: int) -> None:
    plain = IPv4Address(value)
    verdict = forbidden_reason(plain) is None
    for prefix in (0xFFFF << 32, 0x64FF9B << 96, (0xFFFF << 48)):
        assert (forbidden_reason(IPv6Address(prefix | value)) is None) == verdict
