"""The reviewed path sets: well-formed entries, each with a reason, none repeated."""

from __future__ import annotations

import pytest

from cc_server.policy import STANDARD_DENY_CREATE_GLOBS
from cc_server.policy.paths import (
    HOME_MANDATORY_DENY_WRITE,
    ROOT_MANDATORY_DENY_WRITE,
    SECRET_DENY_READ,
    SYSTEM_DENY_READ,
)

RELATIVE_SETS = {
    "SECRET_DENY_READ": SECRET_DENY_READ,
    "ROOT_MANDATORY_DENY_WRITE": ROOT_MANDATORY_DENY_WRITE,
    "HOME_MANDATORY_DENY_WRITE": HOME_MANDATORY_DENY_WRITE,
}
ALL_SETS = {**RELATIVE_SETS, "SYSTEM_DENY_READ": SYSTEM_DENY_READ}


@pytest.mark.parametrize("name", sorted(ALL_SETS))
def test_every_entry_has_a_reason_and_is_listed_once(name: str) -> None:
    entries = ALL_SETS[name]
    assert entries
    assert all(reason.strip() for _, reason in entries)
    listed = [path for path, _ in entries]
    assert len(listed) == len(set(listed))


@pytest.mark.parametrize("name", sorted(RELATIVE_SETS))
def test_home_relative_sets_are_relative_and_normalised(name: str) -> None:
    for path, _ in RELATIVE_SETS[name]:
        assert not path.startswith("/"), path
        assert not path.endswith("/"), path
        assert "" not in path.split("/") and ".." not in path.split("/"), path


def test_system_set_is_absolute() -> None:
    assert all(path.startswith("/etc/") for path, _ in SYSTEM_DENY_READ)


def test_the_five_reference_paths_lead_the_secret_set() -> None:
    assert [p for p, _ in SECRET_DENY_READ[:5]] == [
        ".ssh",
        ".aws",
        ".gnupg",
        ".config/gh",
        "Library/Keychains",
    ]


def test_mandatory_write_set_covers_the_reference_pages_examples() -> None:
    names = {p for p, _ in ROOT_MANDATORY_DENY_WRITE}
    assert {".bashrc", ".zshrc", ".git/hooks", ".claude/settings.json"} <= names


def test_standard_create_globs() -> None:
    assert STANDARD_DENY_CREATE_GLOBS == (".env", "*.key", "*.pem")
