"""Live allowlist changes, pure: removals then additions, by canonical entry, the deny list
unchanged and never undone."""

from __future__ import annotations

import pytest

from cc_server.egress.baseline import BASELINE_DENIED
from cc_server.egress.changes import LIVE_REASON, EgressChange, apply_change
from cc_server.egress.patterns import Allowlist, AllowlistRule, InvalidPattern, parse_entry
from cc_server.errors import BadSpec


def listed(*texts: str) -> Allowlist:
    rules = []
    for text in texts:
        pattern, port = parse_entry(text)
        rules.append(AllowlistRule(pattern=pattern, reason="spec", port=port))
    return Allowlist(patterns=tuple(rules), denied=BASELINE_DENIED)


def entries(allowlist: Allowlist) -> list[str]:
    return [rule.entry for rule in allowlist.patterns]


def test_allow_adds_at_the_end_with_the_live_reason() -> None:
    applied = apply_change(listed("a.example"), EgressChange(allow=("B.Example:443",)))
    assert entries(applied.allowlist) == ["a.example", "b.example:443"]
    assert applied.added == ("b.example:443",) and applied.removed == ()
    assert applied.allowlist.patterns[-1].reason == LIVE_REASON
    assert applied.allowlist.allows("b.example", 443).allowed
    assert not applied.allowlist.allows("b.example", 80).allowed
    assert applied.allowlist.denied == BASELINE_DENIED


def test_remove_takes_the_exact_entry_only() -> None:
    before = listed("x.a.example", "x.a.example:443", "*.b.example")
    applied = apply_change(before, EgressChange(remove=("X.A.EXAMPLE.", "y.b.example")))
    assert entries(applied.allowlist) == ["x.a.example:443", "*.b.example"]
    assert applied.removed == ("x.a.example",)
    assert not applied.allowlist.allows("x.a.example", 80).allowed
    assert applied.allowlist.allows("x.a.example", 443).allowed
    assert applied.allowlist.allows("y.b.example", 80).allowed  # the wildcard still covers it


def test_remove_a_port_entry() -> None:
    entry = "[2001:db8::1]:8080"
    applied = apply_change(listed(entry), EgressChange(remove=(entry,)))
    assert entries(applied.allowlist) == [] and applied.removed == ("[2001:db8::1]:8080",)
    assert not applied.allowlist.allows("2001:db8::1", 8080).allowed


def test_removing_what_is_not_there_and_adding_what_is_change_nothing() -> None:
    before = listed("a.example")
    applied = apply_change(before, EgressChange(allow=("a.example",), remove=("b.example",)))
    assert applied.allowlist == before and not applied.changed


def test_removals_come_first_then_additions() -> None:
    applied = apply_change(
        listed("a.example", "b.example"), EgressChange(allow=("c.example",), remove=("a.example",))
    )
    assert entries(applied.allowlist) == ["b.example", "c.example"]


def test_an_entry_both_added_and_removed_is_refused() -> None:
    with pytest.raises(BadSpec, match=r"both allows and removes a\.example:443"):
        apply_change(listed(), EgressChange(allow=("a.example:443",), remove=("A.example:443",)))


@pytest.mark.parametrize("entry", ["169.254.169.254", "169.254.169.254:80",
                                   "metadata.google.internal:80", "[::ffff:169.254.169.254]"])
def test_a_deny_listed_host_cannot_be_allowed(entry: str) -> None:
    with pytest.raises(BadSpec, match="on the egress deny list: cannot be allowed"):
        apply_change(listed(), EgressChange(allow=(entry,)))


def test_a_malformed_entry_is_named() -> None:
    with pytest.raises(InvalidPattern, match=r"allow\[1\]: .*port '0'"):
        apply_change(listed(), EgressChange(allow=("ok.example", "bad.example:0")))
    with pytest.raises(InvalidPattern, match=r"remove\[0\]"):
        apply_change(listed(), EgressChange(remove=("*",)))


def test_the_input_is_not_changed() -> None:
    before = listed("a.example")
    apply_change(before, EgressChange(allow=("b.example",), remove=("a.example",)))
    assert entries(before) == ["a.example"]
