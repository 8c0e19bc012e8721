"""The pure egress decision (`egress.guard`): the allowlist, the deny list, the address guard and
ask mode, without sockets or a resolver. Hypothesis draws the hosts, the addresses and the
answers; the tables pin the wording the refusal events carry."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address, ip_address

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cc_server.egress import guard, patterns
from cc_server.egress.addresses import IPAddress, forbidden_reason
from cc_server.egress.guard import (
    NOTHING_DENIED,
    NOTHING_INVALID,
    NOTHING_NETWORK_OFF,
    Allowed,
    Refused,
    Resolve,
    Unresolvable,
    check_answers,
    check_target,
    entry_for,
    forbidden,
    unresolvable,
)
from cc_server.egress.patterns import Allowlist, AllowlistRule, parse_entry

FUZZ = settings(max_examples=300, database=None, deadline=None)


def allowlist(*entries: str, denied: tuple[str, ...] = ()) -> Allowlist:
    def rule(text: str, reason: str) -> AllowlistRule:
        pattern, port = parse_entry(text)
        return AllowlistRule(pattern=pattern, reason=reason, port=port)

    return Allowlist(
        patterns=tuple(rule(e, "test") for e in entries),
        denied=tuple(rule(d, "test deny") for d in denied),
    )


LISTED = allowlist(
    "allowed.test",
    "*.allowed.test",
    "api.test:443",
    "10.1.2.3:5432",
    denied=("evil.allowed.test", "192.0.2.66"),
)
OFF = Allowlist(patterns=(), denied=LISTED.denied)

ADDRESSES = st.ip_addresses()
PORTS = st.integers(min_value=1, max_value=65535)
# Host text as a client can write it: names, labels that IDNA refuses, literals in odd spellings.
HOSTS = st.sampled_from(
    ["allowed.test", "ALLOWED.test.", "a.b.allowed.test", "evil.allowed.test", "api.test",
     "other.test", "10.1.2.3", "0x7f.1", "127.0.0.1", "169.254.169.254", "::ffff:10.1.2.3",
     "fe80::1%eth0", "a_b.test", "", "xn---e2r", "192.0.2.66", "\uff11\uff12\uff17.0.0.1",
     "2001:db8::1", "93.184.215.14"]
) | st.text(max_size=12) | ADDRESSES.map(str)  # fmt: skip
LISTS = st.sampled_from(
    [
        LISTED,
        OFF,
        allowlist("*.allowed.test", "127.0.0.1"),
        allowlist("allowed.test", denied=("*.allowed.test",)),
    ]
)


@FUZZ
@given(LISTS, HOSTS, PORTS, st.booleans())
@example(LISTED, "evil.allowed.test", 443, True)
@example(LISTED, "a_b.test", 80, True)
@example(OFF, "allowed.test", 80, True)
def test_check_target_never_raises_and_never_allows_a_name_unresolved(
    lst: Allowlist, host: str, port: int, ask: bool
) -> None:
    verdict = check_target(lst, host, port, ask=ask)
    if isinstance(verdict, Allowed):  # only an address: a name is always resolved first
        assert verdict.addresses == (ip_address(verdict.host),)
        assert forbidden(lst, verdict.addresses[0], port) is None
        assert verdict.ask == (not lst.allows(host, port).allowed)
    elif isinstance(verdict, Resolve):
        assert patterns.parse_host(host) == verdict.name and verdict.port == port
        assert verdict.ask == (not lst.allows(host, port).allowed)
    else:
        assert isinstance(verdict, Refused)
        assert (verdict.entry is None) != (verdict.nothing == "")
    if isinstance(verdict, (Allowed, Resolve)) and verdict.ask:
        assert ask and not lst.is_empty  # only a session that asks, with its network on


@FUZZ
@given(LISTS, HOSTS, PORTS, st.booleans())
def test_the_deny_list_wins_over_everything(
    lst: Allowlist, host: str, port: int, ask: bool
) -> None:
    decision = lst.allows(host, port)
    if decision.allowed or decision.rule is None:
        return
    verdict = check_target(lst, host, port, ask=ask)
    assert verdict == Refused(
        host=decision.host, reason=decision.reason, entry=None, nothing=NOTHING_DENIED
    )


@FUZZ
@given(HOSTS, PORTS, st.booleans())
def test_with_the_network_off_nothing_is_allowed_or_asked(host: str, port: int, ask: bool) -> None:
    verdict = check_target(OFF, host, port, ask=ask)
    assert isinstance(verdict, Refused)
    assert verdict.nothing in (NOTHING_NETWORK_OFF, NOTHING_DENIED)


@FUZZ
@given(ADDRESSES, PORTS, st.booleans())
@example(ip_address("169.254.169.254"), 80, True)
@example(ip_address("::ffff:127.0.0.1"), 80, True)
def test_a_forbidden_literal_is_refused_unless_itself_listed(
    address: IPAddress, port: int, ask: bool
) -> None:
    why = forbidden_reason(address)
    unlisted = check_target(allowlist("*.allowed.test"), str(address), port, ask=ask)
    listed = check_target(allowlist(str(address)), str(address), port, ask=ask)
    if why is None:
        assert isinstance(unlisted, (Allowed if ask else Refused))
        assert listed == Allowed(host=str(address), addresses=(address,))
        return
    assert isinstance(unlisted, Refused)
    if ask:  # checked as if listed: refused as an address, and the advice is its own literal
        assert f"{address} is a {why} address" in unlisted.reason
        assert unlisted.entry == entry_for(str(address), port)
    assert listed == Allowed(host=str(address), addresses=(address,))


@FUZZ
@given(st.lists(ADDRESSES, max_size=6), PORTS, st.booleans())
@example([IPv4Address("127.0.0.1"), IPv4Address("127.0.0.1")], 80, False)
@example([IPv4Address("93.184.215.14"), IPv4Address("10.0.0.1")], 443, False)
def test_every_answer_must_be_reachable(answers: list[IPAddress], port: int, ask: bool) -> None:
    lst = allowlist("allowed.test", "127.0.0.1", denied=("192.0.2.66",))
    resolve = Resolve(name="allowed.test", port=port, ask=ask)
    verdict = check_answers(lst, resolve, answers)
    refused = [a for a in dict.fromkeys(answers) if forbidden(lst, a, port) is not None]
    if not answers:
        assert verdict == Unresolvable(error="allowed.test has no addresses")
    elif refused:
        assert isinstance(verdict, Refused) and verdict.host == "allowed.test"
        assert verdict.reason.startswith(f"allowed.test resolves to {refused[0]}, a ")
    else:  # exactly the answers, once each, in the resolver's order
        assert verdict == Allowed(
            host="allowed.test", addresses=tuple(dict.fromkeys(answers)), ask=ask
        )


@pytest.mark.parametrize(
    ("lst", "host", "port", "ask", "expected"),
    [
        (LISTED, "allowed.test", 80, False, Resolve(name="allowed.test", port=80)),
        (LISTED, "Sub.Allowed.Test.", 80, False, Resolve(name="sub.allowed.test", port=80)),
        (LISTED, "api.test", 443, False, Resolve(name="api.test", port=443)),
        (
            LISTED,
            "api.test",
            80,
            False,
            Refused(
                host="api.test",
                reason="api.test is not on this session's egress allowlist",
                entry="api.test:80",
            ),
        ),
        (LISTED, "api.test", 80, True, Resolve(name="api.test", port=80, ask=True)),
        (
            LISTED,
            "10.1.2.3",
            5432,
            False,
            Allowed(host="10.1.2.3", addresses=(IPv4Address("10.1.2.3"),)),
        ),
        (
            LISTED,
            "10.1.2.3",
            5433,
            True,
            Refused(
                host="10.1.2.3",
                reason="10.1.2.3 is a private (10.0.0.0/8) address; egress reaches "
                "such an address only when that address itself is on the allowlist",
                entry="10.1.2.3:5433",
            ),
        ),
        (
            LISTED,
            "192.0.2.66",
            80,
            True,
            Refused(
                host="192.0.2.66",
                reason="192.0.2.66 is on the egress deny list (192.0.2.66: test deny)",
                entry=None,
                nothing=NOTHING_DENIED,
            ),
        ),
        (
            LISTED,
            "2001:db8::1",
            443,
            False,
            Refused(
                host="2001:db8::1",
                reason="2001:db8::1 is not on this session's egress allowlist",
                entry="[2001:db8::1]:443",
            ),
        ),
        (
            OFF,
            "allowed.test",
            80,
            True,
            Refused(
                host="allowed.test",
                reason="allowed.test: network access is off for this session "
                "(the allowlist is empty)",
                entry=None,
                nothing=NOTHING_NETWORK_OFF,
            ),
        ),
    ],
)
def test_target_table(lst: Allowlist, host: str, port: int, ask: bool, expected: object) -> None:
    assert check_target(lst, host, port, ask=ask) == expected


def test_an_invalid_name_is_refused_with_advice_only_when_not_asking() -> None:
    plain = check_target(LISTED, "a_b.test", 80)
    asked = check_target(LISTED, "a_b.test", 80, ask=True)
    assert isinstance(plain, Refused) and plain.entry == "a_b.test:80"
    assert isinstance(asked, Refused) and asked.entry is None and asked.nothing == NOTHING_INVALID
    assert plain.reason == asked.reason and "not a valid host name" in plain.reason


def test_an_address_on_the_deny_list_is_refused_even_when_a_name_resolves_to_it() -> None:
    verdict = check_answers(
        LISTED, Resolve(name="allowed.test", port=443), [IPv4Address("192.0.2.66")]
    )
    assert verdict == Refused(
        host="allowed.test",
        reason="allowed.test resolves to 192.0.2.66, a denied address (192.0.2.66 is on the "
        "egress deny list (192.0.2.66: test deny)); egress reaches such an address only when "
        "that address itself is on the allowlist",
        entry=None,
        nothing=NOTHING_DENIED,
    )


def test_a_listed_literal_lets_a_name_resolve_to_it_on_its_port_only() -> None:
    lst = allowlist("allowed.test", "10.1.2.3:5432")
    answers: list[IPAddress] = [IPv4Address("10.1.2.3")]
    assert isinstance(check_answers(lst, Resolve(name="allowed.test", port=5432), answers), Allowed)
    refused = check_answers(lst, Resolve(name="allowed.test", port=80), answers)
    assert isinstance(refused, Refused) and refused.entry == "10.1.2.3:80"
    mapped = check_answers(
        lst, Resolve(name="allowed.test", port=5432), [IPv6Address("::ffff:10.1.2.3")]
    )
    assert isinstance(mapped, Allowed)  # the same host in its IPv4-mapped form


def test_a_failed_resolver_is_unresolvable_not_a_refusal() -> None:
    assert unresolvable("allowed.test", OSError("Name or service not known")) == Unresolvable(
        error="cannot resolve allowed.test: Name or service not known"
    )
    assert unresolvable("allowed.test", TimeoutError()) == Unresolvable(
        error="cannot resolve allowed.test: TimeoutError"
    )


def test_the_host_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = patterns.parse_host

    def counting(text: str) -> IPAddress | str:
        calls.append(text)
        return real(text)

    monkeypatch.setattr(guard, "parse_host", counting)
    monkeypatch.setattr(patterns, "parse_host", counting)
    for host in ("Sub.Allowed.Test.", "10.1.2.3", "evil.allowed.test", "other.test"):
        calls.clear()
        check_target(LISTED, host, 5432, ask=True)
        assert calls == [host]
