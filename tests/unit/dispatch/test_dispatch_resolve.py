"""The two resolvers against the real kernel: what each follows and what each refuses."""

from __future__ import annotations

import errno
import os
import pathlib
from collections.abc import Iterator

import pytest

from cc_server.dispatch._resolve import (
    Openat2Resolver,
    Resolver,
    WalkResolver,
    default_resolver,
    real_path,
)


@pytest.fixture
def tree(tmp_path: pathlib.Path) -> Iterator[tuple[pathlib.Path, int]]:
    root = tmp_path / "root"
    (root / "dir").mkdir(parents=True)
    (root / "dir" / "f").write_text("inside\n")
    (tmp_path / "outside").write_text("outside\n")
    os.symlink("dir/f", root / "rel-in")
    os.symlink("../outside", root / "rel-out")
    os.symlink(tmp_path / "outside", root / "abs-out")
    os.symlink("dir", root / "dir-link")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield root, fd
    finally:
        os.close(fd)


def _read(resolver: Resolver, fd: int, rel: str, **kw: bool) -> str:
    f = resolver.open_beneath(fd, rel, os.O_RDONLY, **kw)
    with os.fdopen(f) as fh:
        return fh.read()


def test_the_default_on_linux_is_openat2() -> None:
    assert default_resolver().name == "openat2"


@pytest.mark.parametrize("resolver", [Openat2Resolver(), WalkResolver()], ids=["openat2", "walk"])
def test_links_out_are_refused_by_both(resolver: Resolver, tree: tuple[pathlib.Path, int]) -> None:
    _, fd = tree
    assert _read(resolver, fd, "dir/f") == "inside\n"
    for rel in ("rel-out", "abs-out", "../outside", "dir/../../outside"):
        with pytest.raises(OSError) as info:
            _read(resolver, fd, rel)
        assert info.value.errno in (errno.EXDEV, errno.ELOOP), rel


def test_openat2_follows_links_that_stay_beneath(tree: tuple[pathlib.Path, int]) -> None:
    root, fd = tree
    resolver = Openat2Resolver()
    assert _read(resolver, fd, "rel-in") == "inside\n"
    assert _read(resolver, fd, "dir-link/f") == "inside\n"
    f = resolver.open_beneath(fd, "dir-link/f", os.O_RDONLY)
    try:
        assert real_path(f, "?") == str(root / "dir" / "f")
    finally:
        os.close(f)
    with pytest.raises(OSError) as info:
        _read(resolver, fd, "rel-in", follow=False)
    assert info.value.errno == errno.ELOOP


def test_the_walk_refuses_every_link(tree: tuple[pathlib.Path, int]) -> None:
    _, fd = tree
    for rel in ("rel-in", "dir-link/f"):
        with pytest.raises(OSError) as info:
            _read(WalkResolver(), fd, rel)
        assert info.value.errno == errno.ELOOP, rel
