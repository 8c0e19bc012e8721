"""The curated egress baseline, loaded once from the reviewed `baseline_domains.toml`.

The data file is checked on load: every entry must parse as a pattern and carry a non-empty
reason; unknown keys, unknown lists and duplicates are refused. A bad entry fails loudly when this
module is imported (the constants below are loaded then), naming the list, the entry's position
and its pattern.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any

from cc_server.egress.patterns import AllowlistRule, InvalidPattern, parse_pattern
from cc_server.errors import EnforcementFailed

__all__ = [
    "BASELINE_ALLOWED",
    "BASELINE_DENIED",
    "BASELINE_RESOURCE",
    "GITHUB_DOMAINS",
    "TICKETING_DOMAINS",
    "Baseline",
    "InvalidBaseline",
    "load_baseline",
    "packaged_baseline",
]

BASELINE_RESOURCE = "baseline_domains.toml"
_LISTS = ("allowed", "github", "ticketing", "denied")
_ENTRY_KEYS = frozenset({"pattern", "reason"})


class InvalidBaseline(EnforcementFailed):
    """The baseline data file is malformed: egress cannot be enforced until it is fixed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Baseline:
    """The four lists of the data file, each entry a (pattern, reason) rule."""

    allowed: tuple[AllowlistRule, ...]  # every session with network access
    github: tuple[AllowlistRule, ...]  # earned by canCallGitHubApi or canPush
    ticketing: tuple[AllowlistRule, ...]  # known ticketing providers (suggestions)
    denied: tuple[AllowlistRule, ...]  # wins over every allow


def load_baseline(text: str, *, source: str = BASELINE_RESOURCE) -> Baseline:
    """Parse and check baseline data in the format of `baseline_domains.toml`.

    Raises:
        InvalidBaseline: not TOML, an unknown list or key, an entry that is not a table, a
            pattern that does not parse, a missing or empty reason, or a duplicate in a list.
    """
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidBaseline(f"{source} is not valid TOML: {exc}") from None
    unknown = sorted(set(document) - set(_LISTS))
    if unknown:
        raise _bad(source, f"unknown list(s) {unknown}; expected {list(_LISTS)}")
    lists = {name: _load_list(source, name, document.get(name, [])) for name in _LISTS}
    return Baseline(**lists)


def _load_list(source: str, name: str, entries: Any) -> tuple[AllowlistRule, ...]:
    if not isinstance(entries, list):
        raise _bad(source, f"{name} must be an array of tables ([[{name}]])")
    rules: list[AllowlistRule] = []
    for i, entry in enumerate(entries):
        where = f"[[{name}]] entry {i + 1}"
        if not isinstance(entry, dict):
            raise _bad(source, f"{where} must be a table with pattern and reason")
        keys = set(entry)
        if keys != _ENTRY_KEYS:
            raise _bad(source, f"{where} has keys {sorted(keys)}; expected {sorted(_ENTRY_KEYS)}")
        pattern_text, reason = entry["pattern"], entry["reason"]
        if not isinstance(pattern_text, str):
            raise _bad(source, f"{where}: pattern must be a string")
        if not isinstance(reason, str) or not reason.strip():
            raise _bad(source, f"{where} ({pattern_text!r}): reason must be a non-empty string")
        try:
            pattern = parse_pattern(pattern_text)
        except InvalidPattern as exc:
            raise _bad(source, f"{where}: {exc.message}") from None
        if any(rule.pattern == pattern for rule in rules):
            raise _bad(source, f"{where} ({pattern_text!r}) duplicates an earlier entry")
        rules.append(AllowlistRule(pattern=pattern, reason=reason.strip()))
    return tuple(rules)


def _bad(source: str, problem: str) -> InvalidBaseline:
    return InvalidBaseline(f"{source}: {problem}", fix=f"correct {source} and reinstall")


@functools.cache
def packaged_baseline() -> Baseline:
    """The baseline shipped with the package, loaded and checked once.

    Raises:
        InvalidBaseline: the packaged file is malformed (see load_baseline).
    """
    text = (
        resources.files("cc_server.egress").joinpath(BASELINE_RESOURCE).read_text(encoding="utf-8")
    )
    return load_baseline(text)


BASELINE_ALLOWED: tuple[AllowlistRule, ...] = packaged_baseline().allowed
BASELINE_DENIED: tuple[AllowlistRule, ...] = packaged_baseline().denied
GITHUB_DOMAINS: tuple[AllowlistRule, ...] = packaged_baseline().github
TICKETING_DOMAINS: tuple[AllowlistRule, ...] = packaged_baseline().ticketing
