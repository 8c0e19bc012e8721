"""IP literals in every spelling libc accepts, and the address classes egress must never reach.

Addresses are classified after parsing, never as strings: `2130706433`, `0177.0.0.1`, `0x7f.1`,
`127.1`, `::ffff:7f00:1` and `64:ff9b::7f00:1` are all loopback. IPv6 forms that carry an IPv4
address (IPv4-mapped, IPv4-compatible, SIIT, NAT64, 6to4, Teredo) are classified by the IPv4
address they carry, with the same rules.

Zone ids: `fe80::1%eth0` is an IP literal (it is never looked up as a name) and every zone-scoped
address is forbidden, since a zone id only means something for an address on a local link.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import TypeAlias

__all__ = ["IPAddress", "embedded_ipv4", "forbidden_reason", "parse_ip_literal"]

IPAddress: TypeAlias = IPv4Address | IPv6Address

# Cloud instance metadata and platform endpoints: the credentials of the host itself.
CLOUD_METADATA: dict[IPAddress, str] = {
    IPv4Address("169.254.169.254"): "instance metadata (AWS, GCP, Azure, Oracle, DigitalOcean)",
    IPv4Address("169.254.170.2"): "AWS ECS task metadata and credentials",
    IPv4Address("169.254.170.23"): "AWS EKS Pod Identity agent",
    IPv4Address("100.100.100.200"): "Alibaba Cloud instance metadata",
    IPv4Address("168.63.129.16"): "Azure WireServer platform endpoint",
    IPv4Address("192.0.0.192"): "Oracle Cloud legacy instance metadata",
    IPv6Address("fd00:ec2::254"): "AWS instance metadata over IPv6",
    IPv6Address("fd00:ec2::23"): "AWS EKS Pod Identity agent over IPv6",
}

# IANA IPv4 special-purpose and multicast ranges; first match wins. Everything else is global
# unicast.
IPV4_FORBIDDEN: tuple[tuple[IPv4Network, str], ...] = (
    (IPv4Network("0.0.0.0/8"), "unspecified ('this network')"),
    (IPv4Network("127.0.0.0/8"), "loopback"),
    (IPv4Network("169.254.0.0/16"), "link-local"),
    (IPv4Network("10.0.0.0/8"), "private"),
    (IPv4Network("172.16.0.0/12"), "private"),
    (IPv4Network("192.168.0.0/16"), "private"),
    (IPv4Network("100.64.0.0/10"), "shared address space (CGNAT)"),
    (IPv4Network("192.0.0.0/24"), "IETF protocol assignments"),
    (IPv4Network("192.0.2.0/24"), "documentation (TEST-NET-1)"),
    (IPv4Network("198.51.100.0/24"), "documentation (TEST-NET-2)"),
    (IPv4Network("203.0.113.0/24"), "documentation (TEST-NET-3)"),
    (IPv4Network("192.88.99.0/24"), "deprecated 6to4 relay anycast"),
    (IPv4Network("198.18.0.0/15"), "benchmarking"),
    (IPv4Network("224.0.0.0/4"), "multicast"),
    (IPv4Network("255.255.255.255/32"), "limited broadcast"),
    (IPv4Network("240.0.0.0/4"), "reserved (class E)"),
)

# IANA IPv6 special-purpose ranges, checked after the IPv4-carrying forms; first match wins.
IPV6_FORBIDDEN: tuple[tuple[IPv6Network, str], ...] = (
    (IPv6Network("::/128"), "unspecified"),
    (IPv6Network("::1/128"), "loopback"),
    (IPv6Network("fc00::/7"), "unique-local"),
    (IPv6Network("fe80::/10"), "link-local"),
    (IPv6Network("fec0::/10"), "site-local (deprecated)"),
    (IPv6Network("ff00::/8"), "multicast"),
    (IPv6Network("100::/64"), "discard-only"),
    (IPv6Network("64:ff9b:1::/48"), "NAT64 local-use"),  # see NAT64_LOCAL_USE below
    (IPv6Network("2001:db8::/32"), "documentation"),
    (IPv6Network("3fff::/20"), "documentation"),
    (IPv6Network("2001:2::/48"), "benchmarking"),
    (IPv6Network("2001::/23"), "IETF protocol assignments"),  # Teredo 2001::/32 is decoded first
    (IPv6Network("5f00::/16"), "SRv6 segment identifiers"),
)
GLOBAL_UNICAST_V6 = IPv6Network("2000::/3")

# The local-use NAT64 prefix is refused whole rather than decoded: where its IPv4 address sits
# depends on the prefix length the local translator was configured with (RFC 6052 allows /48 to
# /96), so no single decoding is safe.

_UNSPECIFIED_V6 = IPv6Address("::")
_LOOPBACK_V6 = IPv6Address("::1")
_MAPPED = IPv6Network("::ffff:0:0/96")
_SIIT = IPv6Network("::ffff:0:0:0/96")
_COMPATIBLE = IPv6Network("::/96")
_NAT64 = IPv6Network("64:ff9b::/96")
_SIXTOFOUR = IPv6Network("2002::/16")
_TEREDO = IPv6Network("2001::/32")
_LOW_32_BITS = 0xFFFF_FFFF


def _low32(addr: IPv6Address) -> IPv4Address:
    return IPv4Address(int(addr) & _LOW_32_BITS)


def _teredo_server(addr: IPv6Address) -> IPv4Address:
    return IPv4Address((int(addr) >> 64) & _LOW_32_BITS)


def _teredo_client(addr: IPv6Address) -> IPv4Address:
    return IPv4Address(~int(addr) & _LOW_32_BITS)


def _sixtofour(addr: IPv6Address) -> IPv4Address:
    return IPv4Address((int(addr) >> 80) & _LOW_32_BITS)


# Each IPv6 form that carries IPv4 addresses: its prefix, its name, and how to extract them.
_CARRIERS: tuple[tuple[IPv6Network, str, tuple[Callable[[IPv6Address], IPv4Address], ...]], ...] = (
    (_MAPPED, "IPv4-mapped", (_low32,)),
    (_SIIT, "IPv4-translated (SIIT)", (_low32,)),
    (_COMPATIBLE, "IPv4-compatible", (_low32,)),
    (_NAT64, "NAT64", (_low32,)),
    (_SIXTOFOUR, "6to4", (_sixtofour,)),
    (_TEREDO, "Teredo", (_teredo_server, _teredo_client)),
)


def parse_ip_literal(text: str) -> IPAddress | None:
    """The address `text` spells, or None when it is not an IP literal. Never raises.

    IPv4 is parsed by the platform's `inet_aton`, so every spelling libc accepts is an address
    here too: `2130706433`, `0177.0.0.1`, `0x7f.1`, `127.1`. Text with whitespace, control
    characters or non-ASCII is not a literal (inet_aton stops at whitespace, so `127.0.0.1 x`
    would otherwise parse). IPv6 may be bracketed (`[::1]`); a zone id (`fe80::1%eth0`) is kept.
    """
    if not text or not text.isascii() or not text.isprintable() or " " in text:
        return None
    if text.startswith("[") and text.endswith("]"):
        return _parse_ipv6(text[1:-1])
    if ":" in text:
        return _parse_ipv6(text)
    try:
        packed = socket.inet_aton(text)
    except OSError:
        return None
    return IPv4Address(packed)


def _parse_ipv6(text: str) -> IPv6Address | None:
    try:
        return IPv6Address(text)
    except ValueError:
        return None


def embedded_ipv4(addr: IPv6Address) -> tuple[IPv4Address, ...]:
    """The IPv4 addresses an IPv6 address carries (mapped, compatible, SIIT, NAT64, 6to4,
    Teredo server and client); empty for any other address, and for `::` and `::1`."""
    if addr in (_UNSPECIFIED_V6, _LOOPBACK_V6):  # inside ::/96 but not IPv4-compatible
        return ()
    for network, _name, extractors in _CARRIERS:
        if addr in network:
            return tuple(extract(addr) for extract in extractors)
    return ()


def forbidden_reason(addr: IPAddress) -> str | None:
    """Why egress must never reach `addr`, or None for a public unicast address.

    The reason starts with the class of the address: "loopback", "private", "cloud metadata",
    ...; an IPv6 form carrying an IPv4 address names the form and the embedded address's class.
    """
    if isinstance(addr, IPv4Address):
        return _forbidden_v4(addr)
    if addr.scope_id is not None:
        return f"zone-scoped ({addr}): a zone id names a local link"
    if addr in CLOUD_METADATA:
        return f"cloud metadata ({addr}: {CLOUD_METADATA[addr]})"
    embedded = embedded_ipv4(addr)
    if embedded:
        return _forbidden_carrier(addr, embedded)
    for network, name in IPV6_FORBIDDEN:
        if addr in network:
            return f"{name} ({network})"
    if addr not in GLOBAL_UNICAST_V6:
        return f"reserved ({addr} is outside global unicast {GLOBAL_UNICAST_V6})"
    return None


def _forbidden_v4(addr: IPv4Address) -> str | None:
    if addr in CLOUD_METADATA:
        return f"cloud metadata ({addr}: {CLOUD_METADATA[addr]})"
    for network, name in IPV4_FORBIDDEN:
        if addr in network:
            return f"{name} ({network})"
    return None


def _forbidden_carrier(addr: IPv6Address, embedded: tuple[IPv4Address, ...]) -> str | None:
    form = next(f"{name} ({network})" for network, name, _ in _CARRIERS if addr in network)
    for v4 in embedded:
        inner = _forbidden_v4(v4)
        if inner is not None:
            return f"{inner}, embedded in {form} address {addr}"
    return None
