"""The registry of base directories: what it names is found, what is gone is forgotten (so the
live ones stay within the read limit however many test servers came and went)."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import pytest

from cc_server import rundir


def test_a_gone_base_is_forgotten_and_a_live_one_found() -> None:
    live_tmp = tempfile.mkdtemp(prefix="ccr-", dir="/tmp")
    gone_tmp = tempfile.mkdtemp(prefix="ccr-", dir="/tmp")
    try:
        live = rundir.egress_base_dir({"TMPDIR": live_tmp}, tmp_dir=live_tmp)
        gone = rundir.egress_base_dir({"TMPDIR": gone_tmp}, tmp_dir=gone_tmp)
        registry = os.path.join(f"/tmp/{rundir.BASE_DIR_NAME}-{os.geteuid()}", "bases")
        entries = set(os.listdir(registry))
        shutil.rmtree(gone_tmp)
        found = rundir.known_base_dirs(environ={})
        assert os.path.realpath(live) in found
        assert os.path.realpath(gone) not in found
        after = set(os.listdir(registry))
        assert len(entries - after) >= 1  # the gone base's entry was removed
    finally:
        shutil.rmtree(live_tmp, ignore_errors=True)
        shutil.rmtree(gone_tmp, ignore_errors=True)


def test_a_base_removed_while_the_views_are_found_is_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    live = tempfile.mkdtemp(prefix="ccr-", dir="/tmp")
    gone = os.path.join(live, "removed-meanwhile")  # found, then removed before its lstat
    monkeypatch.setattr(rundir, "known_base_dirs", lambda own, environ, reader=None: [live, gone])
    try:
        views = rundir.base_dir_views(live, environ={})
        assert live in views and not [v for v in views if v.endswith("/removed-meanwhile")]
    finally:
        shutil.rmtree(live, ignore_errors=True)


def test_an_alias_through_a_mount_is_found_from_the_table_read_at_each_call(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    real = tmp_path / "real"
    base = real / rundir.BASE_DIR_NAME
    base.mkdir(parents=True, mode=0o700)
    # What a bind mount of real/ at alias/ shows: the same directory under another path (here a
    # symlink stands in for the mount; the table says a mount of the same filesystem is there).
    (tmp_path / "alias").symlink_to(real)
    (tmp_path / "elsewhere").mkdir()  # the table's other alias, a different directory
    monkeypatch.setattr(rundir, "known_base_dirs", lambda own, environ, reader=None: [str(base)])
    plain = tmp_path / "plain.mountinfo"
    plain.write_text(f"1 0 0:99 / {tmp_path} rw - tmpfs t rw\n")
    bound = tmp_path / "bound.mountinfo"
    bound.write_text(plain.read_text() + f"2 1 0:99 /real {tmp_path}/alias rw - tmpfs t rw\n"
                     f"3 1 0:99 /elsewhere {tmp_path}/elsewhere rw - tmpfs t rw\n")
    alias = f"{tmp_path}/alias/{rundir.BASE_DIR_NAME}"
    for _ in range(2):  # the second time from the cache, the same answer for each table
        assert rundir.base_dir_views(str(base), {}, str(bound)) == tuple(sorted((str(base), alias)))
        assert rundir.base_dir_views(str(base), {}, str(plain)) == (str(base),)
    (tmp_path / "alias").unlink()  # the alias no longer shows the base: confirmed at each call
    (tmp_path / "alias").mkdir()
    (tmp_path / "alias" / rundir.BASE_DIR_NAME).mkdir()
    assert rundir.base_dir_views(str(base), {}, str(bound)) == (str(base),)
