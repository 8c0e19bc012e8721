"""A probe removes what a killed identity selftest left, and only that."""

from __future__ import annotations

import os
import pathlib

from cc_server.backends.identity import _remove_dead_selftests


def test_a_dead_selftests_directory_is_removed_a_live_ones_kept(tmp_path: pathlib.Path) -> None:
    dead = tmp_path / "cc-identity-selftest-999999999-abcdef"
    live = tmp_path / f"cc-identity-selftest-{os.getpid()}-ghijkl"
    other = tmp_path / "cc-identity-selftest-notapid"
    for path in (dead / "src", live / "src", other):
        path.mkdir(parents=True)
    _remove_dead_selftests(str(tmp_path))
    assert not dead.exists() and live.exists() and other.exists()
