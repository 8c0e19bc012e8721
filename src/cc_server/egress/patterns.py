"""Egress allowlist patterns, host-name normalisation, and the allowlist's decision.

A pattern is one of:

- an exact name: `api.example.com`;
- a leading wildcard label: `*.example.com` matches any subdomain at any depth (`a.example.com`,
  `a.b.example.com`) but not `example.com` itself;
- one middle wildcard label: `bedrock.*.amazonaws.com` matches exactly one label
  (`bedrock.us-east-1.amazonaws.com`, not `bedrock.evil.attacker.amazonaws.com`);
- an IP address literal (`10.0.0.5`, `[fd00::1]`), matched as an address, never as text.

An allowlist *entry* (`parse_entry`) is a pattern with an optional port: `host:port`,
`*.example.com:443`, `10.1.2.3:5432`, `[2001:db8::1]:8080`. The port is decimal, 1 to 65535,
without a sign or a leading zero; an IPv6 address takes a port only in brackets (a bare
`2001:db8::1` is an address on every port). An entry with a port matches only a connection asked
for with that port; an entry without one matches every port, as entries always have. The deny
list is not narrowed by ports: a denied host is denied on every port, whatever an entry says.

The `*` must be a whole label and there is at most one. The fixed part after it must have at
least two labels: `*.com` or `bedrock.*.com` would match names that anyone can register. (Without
the public-suffix list, `*.co.uk` is not caught; review wildcard entries with that in mind.)

Names are compared after normalisation: one trailing dot dropped, IDNA 2008 with UTS 46 mapping
(case folded, `Bücher.example` becomes `xn--bcher-kva.example`). A host that is an IP literal in
any spelling libc accepts, before or after normalisation, never matches a name pattern.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from ipaddress import IPv6Address
from typing import NamedTuple, TypeAlias

import idna

from cc_server.egress.addresses import IPAddress, embedded_ipv4, parse_ip_literal
from cc_server.errors import BadSpec

__all__ = [
    "Allowlist",
    "AllowlistRule",
    "Decision",
    "DomainPattern",
    "HostPattern",
    "InvalidHostName",
    "InvalidPattern",
    "IpLiteralPattern",
    "Wildcard",
    "format_entry",
    "normalise_host",
    "parse_entry",
    "parse_host",
    "parse_pattern",
    "parse_rules",
]

MAX_NAME_LENGTH = 253  # RFC 1035: 255 octets on the wire, 253 characters in text form
MAX_LABEL_LENGTH = 63  # RFC 1035
MIN_WILDCARD_SUFFIX_LABELS = 2  # `*.com` would match names that anyone can register
MAX_PORT = 65535  # TCP ports are 16 bits; 0 is not a port anyone can connect to

# The label separators UTS 46 maps to '.', as the idna package splits on them.
_DOTS = re.compile("[.\u3002\uff0e\uff61]")

ALLOWED_FORMS = (
    "allowed forms: an exact name (api.example.com), a leading wildcard label (*.example.com: "
    "any subdomain, not example.com itself), one middle wildcard label (bedrock.*.amazonaws.com: "
    "exactly one label), or an IP address (10.0.0.5, [fd00::1]); each optionally with a port "
    "(api.example.com:443, *.example.com:443, 10.0.0.5:5432, [fd00::1]:8080)"
)
# A port as written in an entry: decimal ASCII digits, no sign, no leading zero (one spelling).
_PORT = re.compile(r"[1-9][0-9]{0,4}", re.ASCII)


class InvalidPattern(BadSpec, ValueError):
    """An allowlist pattern is malformed; the message names it and the allowed forms.

    Also a ValueError, so a msgspec `__post_init__` that parses patterns reports the field.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, fix=ALLOWED_FORMS)


class InvalidHostName(ValueError):
    """A host name is not a valid DNS name (empty label, label over 63, name over 253, a
    character IDNA 2008 forbids, a malformed A-label)."""


def normalise_host(name: str) -> str:
    """The canonical ASCII form of a host name: one trailing dot dropped, lower case, IDNA 2008
    with UTS 46 mapping (`Bücher.Example.` becomes `xn--bcher-kva.example`).

    IP literals are not special here; see parse_host.

    Raises:
        InvalidHostName: empty, an empty label, a label over 63 or a name over 253 characters,
            a character IDNA 2008 forbids (`_`, `*`, space, `:`), or a non-canonical A-label.
    """
    try:
        encoded = idna.encode(name, uts46=True, std3_rules=True)
    except (idna.IDNAError, UnicodeError) as exc:
        raise InvalidHostName(f"{name!r} is not a valid host name: {exc}") from None
    # idna has already refused labels over MAX_LABEL_LENGTH and names over MAX_NAME_LENGTH.
    ascii_name = encoded.decode("ascii").lower()
    if ascii_name.endswith("."):
        ascii_name = ascii_name[:-1]
    for label in ascii_name.split("."):
        if label.startswith("xn--") and idna.encode(idna.decode(label)).decode() != label:
            # Two A-labels can decode to one U-label (xn---e2r, xn--e2r); only the canonical
            # one is accepted, so that one name has one spelling.
            raise InvalidHostName(f"{name!r} has a non-canonical A-label {label!r}")
    return ascii_name


def parse_host(text: str) -> IPAddress | str:
    """A connection target as an address or a canonical name.

    The text is an address if it is an IP literal as written or once normalised (fullwidth
    digits and `127.0.0.1.` are 127.0.0.1); otherwise it is the normalised name.

    Raises:
        InvalidHostName: neither an IP literal nor a valid host name.
    """
    address = parse_ip_literal(text)
    if address is not None:
        return address
    name = normalise_host(text)
    address = parse_ip_literal(name)
    return name if address is None else address


class Wildcard(enum.Enum):
    """Where a DomainPattern's `*` stands."""

    NONE = "none"  # an exact name
    SUBDOMAINS = "subdomains"  # *.example.com: one or more labels, any depth
    ONE_LABEL = "one-label"  # bedrock.*.amazonaws.com: exactly one label


@dataclass(frozen=True, slots=True, kw_only=True)
class DomainPattern:
    """A name pattern; built from `text`, which is stored in canonical form.

    Raises (on construction):
        InvalidPattern: the text is not one of the allowed forms; the message says why.
    """

    text: str
    wildcard: Wildcard = field(init=False, compare=False, repr=False)
    head: tuple[str, ...] = field(init=False, compare=False, repr=False)  # before a middle `*`
    tail: tuple[str, ...] = field(init=False, compare=False, repr=False)  # after `*`, or all

    def __post_init__(self) -> None:
        text = self.text
        if not text:
            raise InvalidPattern("egress pattern '' is empty")
        labels = _DOTS.split(text)
        if len(labels) > 1 and labels[-1] == "":
            labels.pop()  # one trailing dot
        stars = [i for i, label in enumerate(labels) if "*" in label]
        head: tuple[str, ...] = ()
        if not stars:
            wildcard, tail = Wildcard.NONE, _canonical_labels(text, labels)
            name = ".".join(tail)
            if parse_ip_literal(name) is not None:
                raise InvalidPattern(
                    f"egress pattern {text!r} is an IP address, not a name; parse it with "
                    "parse_pattern so it is matched as an address"
                )
        else:
            where = stars[0]
            _check_star(text, labels, stars)
            wildcard = Wildcard.SUBDOMAINS if where == 0 else Wildcard.ONE_LABEL
            if where:
                head = _canonical_labels(text, labels[:where])
            tail = _canonical_labels(text, labels[where + 1 :])
            if len(tail) < MIN_WILDCARD_SUFFIX_LABELS:
                raise InvalidPattern(
                    f"egress pattern {text!r}: the fixed part after '*' must have at least "
                    f"{MIN_WILDCARD_SUFFIX_LABELS} labels ('*.com' would match names anyone "
                    "can register)"
                )
            name = ".".join((*head, "*", *tail))
        if len(name) > MAX_NAME_LENGTH:
            raise InvalidPattern(
                f"egress pattern {text!r} is longer than {MAX_NAME_LENGTH} characters"
            )
        object.__setattr__(self, "text", name)
        object.__setattr__(self, "wildcard", wildcard)
        object.__setattr__(self, "head", head)
        object.__setattr__(self, "tail", tail)

    @classmethod
    def parse(cls, text: str) -> DomainPattern:
        """Parse a name pattern (see the module docstring for the forms).

        Raises:
            InvalidPattern: not an allowed form, not a valid name, or an IP address.
        """
        return cls(text=text)

    def matches(self, host: str) -> bool:
        """Whether `host` (any spelling; normalised first) matches. IP literals never match;
        invalid names never match."""
        try:
            target = parse_host(host)
        except InvalidHostName:
            return False
        return isinstance(target, str) and self.matches_name(target)

    def matches_name(self, name: str) -> bool:
        """Whether an already normalised name (from normalise_host) matches."""
        if self.wildcard is Wildcard.NONE:
            return name == self.text
        labels = name.split(".")
        n_head, n_tail = len(self.head), len(self.tail)
        if self.wildcard is Wildcard.SUBDOMAINS:
            return len(labels) > n_tail and tuple(labels[-n_tail:]) == self.tail
        return (
            len(labels) == n_head + 1 + n_tail
            and tuple(labels[:n_head]) == self.head
            and tuple(labels[-n_tail:]) == self.tail
        )

    def __str__(self) -> str:
        return self.text


def _check_star(text: str, labels: list[str], stars: list[int]) -> None:
    if text.count("*") > 1:
        raise InvalidPattern(f"egress pattern {text!r} has more than one '*'")
    where = stars[0]
    if labels[where] != "*":
        raise InvalidPattern(
            f"egress pattern {text!r}: '*' must be a whole label ({labels[where]!r} is not)"
        )
    if len(labels) == 1:
        raise InvalidPattern(f"egress pattern {text!r}: '*' alone would allow every host")
    if where == len(labels) - 1:
        raise InvalidPattern(
            f"egress pattern {text!r}: '*' cannot be the last label (it would match any "
            "top-level domain)"
        )


def _canonical_labels(text: str, labels: list[str]) -> tuple[str, ...]:
    """Normalise a run of labels from a pattern; the run must keep its number of labels."""
    if "" in labels:
        raise InvalidPattern(f"egress pattern {text!r} has an empty label")
    try:
        name = normalise_host(".".join(labels))
    except InvalidHostName as exc:
        raise InvalidPattern(f"egress pattern {text!r}: {exc}") from None
    canonical = tuple(name.split("."))
    if len(canonical) != len(labels):  # UTS 46 maps only the dots themselves to '.' today
        raise InvalidPattern(f"egress pattern {text!r}: a label maps to more than one label")
    return canonical


@dataclass(frozen=True, slots=True, kw_only=True)
class IpLiteralPattern:
    """An allowlist entry that is one IP address, matched in any spelling.

    As an allow entry it matches the address and its IPv4-mapped form (the same host). As a
    deny entry the Allowlist also applies it to every IPv4 address an IPv6 target carries
    (NAT64, 6to4, Teredo, ...), so no spelling slips past a denied address.

    Raises (on construction):
        InvalidPattern: the address has a zone id (`fe80::1%eth0`).
    """

    address: IPAddress

    def __post_init__(self) -> None:
        if getattr(self.address, "scope_id", None) is not None:
            raise InvalidPattern(
                f"egress pattern {str(self.address)!r}: zone ids are not allowed in the allowlist"
            )

    @classmethod
    def parse(cls, text: str) -> IpLiteralPattern:
        """Parse an IP literal in any spelling libc accepts, bracketed or not.

        Raises:
            InvalidPattern: not an IP literal, or it has a zone id.
        """
        try:
            target = parse_host(text)
        except InvalidHostName as exc:
            raise InvalidPattern(f"egress pattern {text!r} is not an IP address: {exc}") from None
        if isinstance(target, str):
            raise InvalidPattern(f"egress pattern {text!r} is a name, not an IP address")
        return cls(address=target)

    @property
    def text(self) -> str:
        """The address in its standard spelling."""
        return str(self.address)

    def matches(self, host: str) -> bool:
        """Whether `host` is this address in any spelling. Names never match."""
        try:
            target = parse_host(host)
        except InvalidHostName:
            return False
        return not isinstance(target, str) and self.matches_address(target)

    def matches_address(self, address: IPAddress) -> bool:
        """Whether `address` is this address, or its IPv4-mapped form (the same host), either
        way round (an entry `::ffff:10.0.0.1` is the host 10.0.0.1)."""
        return _unmapped(address) == _unmapped(self.address)

    def __str__(self) -> str:
        return self.text


def _unmapped(address: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address as its IPv4 address; any other address as it is."""
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


HostPattern: TypeAlias = DomainPattern | IpLiteralPattern


def parse_pattern(text: str) -> HostPattern:
    """Parse an allowlist entry: an IP literal, or a name pattern.

    Raises:
        InvalidPattern: neither; the message says why and lists the allowed forms.
    """
    if "*" in text:
        return DomainPattern.parse(text)
    try:
        target = parse_host(text)
    except InvalidHostName as exc:
        raise InvalidPattern(f"egress pattern {text!r}: {exc}") from None
    if isinstance(target, str):
        return DomainPattern(text=target)
    return IpLiteralPattern(address=target)


def parse_entry(text: str) -> tuple[HostPattern, int | None]:
    """Parse an allowlist entry: a pattern (see parse_pattern) and an optional port.

    `api.example.com:443`, `*.example.com:443`, `10.1.2.3:5432` and `[2001:db8::1]:8080` carry
    a port; `api.example.com`, `10.1.2.3`, `[2001:db8::1]` and `2001:db8::1` do not (every port).

    Raises:
        InvalidPattern: the pattern or the port is malformed; the message says which and why.
    """
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise InvalidPattern(f"egress entry {text!r} opens '[' and never closes it")
        inner, rest = text[1:close], text[close + 1 :]
        if ":" not in inner:
            raise InvalidPattern(
                f"egress entry {text!r}: brackets are for an IPv6 address only "
                "([2001:db8::1]:8080); write a name or an IPv4 address without them"
            )
        pattern = _ipv6_pattern(text, inner)
        if not rest:
            return pattern, None
        if not rest.startswith(":"):
            raise InvalidPattern(f"egress entry {text!r}: only ':PORT' may follow ']'")
        return pattern, _port(text, rest[1:])
    if text.count(":") > 1:  # a bare IPv6 address: every port
        return _ipv6_pattern(text, text), None
    host, colon, port = text.partition(":")
    if not colon:
        return parse_pattern(text), None
    if not host:
        raise InvalidPattern(f"egress entry {text!r} names a port but no host")
    return parse_pattern(host), _port(text, port)


def _ipv6_pattern(text: str, inner: str) -> IpLiteralPattern:
    address = parse_ip_literal(inner)
    if not isinstance(address, IPv6Address):
        raise InvalidPattern(
            f"egress entry {text!r}: {inner!r} is not an IPv6 address (an IPv6 address with a "
            "port is written in brackets: [2001:db8::1]:8080)"
        )
    return IpLiteralPattern(address=address)


def _port(text: str, port: str) -> int:
    if not _PORT.fullmatch(port) or int(port) > MAX_PORT:
        raise InvalidPattern(
            f"egress entry {text!r}: the port {port!r} is not a number from 1 to {MAX_PORT} "
            "(decimal, no sign or leading zero)"
        )
    return int(port)


def format_entry(pattern: HostPattern, port: int | None = None) -> str:
    """An entry's canonical text, which parse_entry reads back: `pattern` or `pattern:port`,
    an IPv6 address in brackets when it has a port (`[2001:db8::1]:8080`)."""
    if port is None:
        return str(pattern)
    if isinstance(pattern, IpLiteralPattern) and pattern.address.version == 6:
        return f"[{pattern}]:{port}"
    return f"{pattern}:{port}"


class AllowlistRule(NamedTuple):
    """One allowlist or deny-list entry and why it is there.

    `port` narrows an allow entry to one port (an entry written `host:port`, or set by the
    server itself: the agents' model endpoint, `egress.operator`). A rule with a port matches
    only a target asked for with that port. A deny rule's port is never set."""

    pattern: HostPattern
    reason: str
    port: int | None = None

    @property
    def entry(self) -> str:
        """The entry's canonical text (`format_entry`)."""
        return format_entry(self.pattern, self.port)

    def __str__(self) -> str:
        return self.entry


def parse_rules(field: str, texts: Iterable[str], reason: str) -> tuple[AllowlistRule, ...]:
    """Parse allowlist entries into rules with one `reason`.

    Raises:
        InvalidPattern: an entry is malformed; the message names it as `field[i]`.
    """
    rules = []
    for i, text in enumerate(texts):
        try:
            pattern, port = parse_entry(text)
        except InvalidPattern as exc:
            raise InvalidPattern(f"{field}[{i}]: {exc.message}") from None
        rules.append(AllowlistRule(pattern=pattern, reason=reason, port=port))
    return tuple(rules)


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """The allowlist's answer for one host."""

    allowed: bool
    host: str  # the canonical name or address asked about, or the raw text if invalid
    rule: AllowlistRule | None  # the entry that decided; None when nothing matched
    reason: str  # one sentence for the violation event and the refusal body


@dataclass(frozen=True, slots=True, kw_only=True)
class Allowlist:
    """A session's egress allowlist. `denied` wins over every entry of `patterns`."""

    patterns: tuple[AllowlistRule, ...] = ()
    denied: tuple[AllowlistRule, ...] = ()

    @property
    def is_empty(self) -> bool:
        """Nothing is allowed (network off for the session)."""
        return not self.patterns

    def allows(self, host: str | IPAddress, port: int | None = None) -> Decision:
        """Decide one connection target: a host as the client spelled it, or an address, and
        the port asked for (None: unknown, so no port-scoped rule matches).

        Never raises: an invalid host name is refused with a reason.
        """
        if isinstance(host, str):
            try:
                target = parse_host(host)
            except InvalidHostName as exc:
                return Decision(allowed=False, host=host, rule=None, reason=str(exc))
        else:
            target = host
        return self.decide(target, port)

    def decide(self, target: IPAddress | str, port: int | None = None) -> Decision:
        """`allows` for a target `parse_host` returned already (an address, or a canonical name:
        it is not parsed again).

        Never raises.
        """
        shown = str(target)
        rule, allowed = self.match(target, port)
        if rule is not None and not allowed:
            return Decision(
                allowed=False,
                host=shown,
                rule=rule,
                reason=f"{shown} is on the egress deny list ({rule.pattern}: {rule.reason})",
            )
        if rule is not None:
            return Decision(
                allowed=True,
                host=shown,
                rule=rule,
                reason=f"{shown} is allowed by {rule} ({rule.reason})",
            )
        if self.is_empty:
            reason = f"{shown}: network access is off for this session (the allowlist is empty)"
        else:
            reason = f"{shown} is not on this session's egress allowlist"
        return Decision(allowed=False, host=shown, rule=None, reason=reason)

    def match(
        self, target: IPAddress | str, port: int | None = None
    ) -> tuple[AllowlistRule | None, bool]:
        """`decide` without the wording: the rule that decides a parsed target and whether it
        allows it, (deny rule, False), (entry, True), or (None, False) when nothing matches.

        Never raises.
        """
        for rule in self.denied:
            if _rule_matches(rule, target, deny=True):
                return rule, False
        for rule in self.patterns:
            if (rule.port is None or rule.port == port) and _rule_matches(rule, target):
                return rule, True
        return None, False


def _rule_matches(rule: AllowlistRule, target: IPAddress | str, *, deny: bool = False) -> bool:
    """Whether a rule matches a parsed target; deny rules also see carried IPv4 addresses."""
    pattern = rule.pattern
    if isinstance(target, str):
        return isinstance(pattern, DomainPattern) and pattern.matches_name(target)
    if not isinstance(pattern, IpLiteralPattern):
        return False
    carried = embedded_ipv4(target) if deny and isinstance(target, IPv6Address) else ()
    return pattern.matches_address(target) or any(map(pattern.matches_address, carried))
