"""The private socket directories of session egress: ownership, privacy, stale cleanup."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from cc_server.egress.patterns import Allowlist
from cc_server.errors import EnforcementFailed
from cc_server.rundir import names_of_dead_owners
from cc_server.runtime.egress import SessionEgress, egress_base_dir, remove_stale_session_dirs


def test_base_dir_under_xdg_runtime_dir(tmp_path: Path) -> None:
    base = egress_base_dir({"XDG_RUNTIME_DIR": str(tmp_path)})
    assert base == str(tmp_path / "cc-server")
    assert (os.stat(base).st_mode & 0o777) == 0o700


def test_base_dir_falls_back_to_tmp_with_the_uid(tmp_path: Path) -> None:
    base = egress_base_dir({"XDG_RUNTIME_DIR": "relative/ignored"}, tmp_dir=str(tmp_path))
    assert base == str(tmp_path / f"cc-server-{os.geteuid()}")
    assert egress_base_dir({}, tmp_dir=str(tmp_path)) == base  # existing and private: reused


def test_base_dir_open_to_others_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cc-server").mkdir(mode=0o700)
    os.chmod(tmp_path / "cc-server", 0o755)
    with pytest.raises(EnforcementFailed, match="not a private directory"):
        egress_base_dir({"XDG_RUNTIME_DIR": str(tmp_path)})


def test_base_dir_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "cc-server").symlink_to(target)
    with pytest.raises(EnforcementFailed, match="not a private directory"):
        egress_base_dir({"XDG_RUNTIME_DIR": str(tmp_path)})


def test_base_dir_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a directory owned by another user")
    (tmp_path / "cc-server").mkdir(mode=0o700)
    os.chown(tmp_path / "cc-server", 65534, 65534)
    with pytest.raises(EnforcementFailed, match="owned by this user"):
        egress_base_dir({"XDG_RUNTIME_DIR": str(tmp_path)})


def test_stale_session_dirs_of_dead_servers_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / "egress-999999999-0123456789abcdef"
    alive = tmp_path / f"egress-{os.getpid()}-0123456789abcdef"
    unrelated = tmp_path / "egress-999999999-notours"
    for d in (dead, alive, unrelated):
        d.mkdir()
    (dead / "http.sock").write_text("")
    assert remove_stale_session_dirs(str(tmp_path)) == [dead.name]
    assert not dead.exists()
    assert alive.exists() and unrelated.exists()


def test_stale_cleanup_of_a_missing_base_is_a_no_op(tmp_path: Path) -> None:
    assert remove_stale_session_dirs(str(tmp_path / "absent")) == []


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_names_of_dead_owners_are_only_matching_names_of_gone_processes(tmp_path: Path) -> None:
    dead, mine = _dead_pid(), os.getpid()
    for name in (f"x-{dead}", f"x-{mine}", "x-1", f"y-{dead}", f"x-{dead}-more"):
        (tmp_path / name).mkdir()
    pattern = re.compile(r"^x-(?P<pid>\d+)\Z")
    assert names_of_dead_owners(str(tmp_path), pattern) == [f"x-{dead}"]
    assert names_of_dead_owners(str(tmp_path / "missing"), pattern) == []


def test_the_base_directory_views_are_found_again_when_a_base_appears(tmp_path: Path) -> None:
    # The views a session's plans hide are kept between commands only while every read they
    # were found from gets the same answer (rundir.base_dir_views through HostReads).
    # They are kept per process: another session of the same base directory finds them once.
    own = egress_base_dir({}, tmp_dir=str(tmp_path))
    egress, another = (
        SessionEgress(session_id=name, allowlist=Allowlist(), suggest=lambda _: None,
                      on_violation=lambda _: None, base_dir=own)
        for name in ("s", "t")
    )
    first = egress._hidden_dirs()
    assert own in first and egress._hidden_dirs() is first  # kept: nothing changed
    assert another._hidden_dirs() is first
    (tmp_path / "run").mkdir()
    other = egress_base_dir({"XDG_RUNTIME_DIR": str(tmp_path / "run")})  # registers itself
    try:
        assert other in egress._hidden_dirs() and other in another._hidden_dirs()
    finally:
        os.rmdir(other)  # its registry entry is removed by the next lookup
        assert other not in egress._hidden_dirs() and other not in another._hidden_dirs()
