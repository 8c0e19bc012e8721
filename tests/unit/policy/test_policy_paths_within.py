"""`is_within` and `relative_within`: whole components of the lexical spelling, against a model
that walks the components one by one (Hypothesis), and the spellings that fool a prefix test."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cc_server.policy.paths import ancestors, first_exposure, is_within, lexical, relative_within

COMPONENT = st.sampled_from(["", ".", "..", "a", "b", "bc", "a.b", ".git", "..a"])
ABSOLUTE = st.builds(
    lambda lead, parts, tail: lead + "/".join(parts) + tail,
    st.sampled_from(["/", "//", "///"]),
    st.lists(COMPONENT, max_size=6),
    st.sampled_from(["", "/", "//"]),
)


def components(path: str) -> list[str]:
    """The model: an absolute path's components after `.` and `..` are walked."""
    out: list[str] = []
    for part in path.split("/"):
        if part == "..":
            if out:
                out.pop()
        elif part not in ("", "."):
            out.append(part)
    return out


@settings(max_examples=400, database=None, deadline=None)
@given(ABSOLUTE, ABSOLUTE)
@example("/a/bc", "/a/b")
@example("/a/b/../c", "/a/b")
@example("/a/b/", "/a/b")
@example("/a/b", "/a/b/")
@example("/", "/")
def test_within_is_a_prefix_of_the_walked_components(path: str, root: str) -> None:
    p, r = components(path), components(root)
    inside = p[: len(r)] == r
    assert is_within(path, root) is inside
    assert relative_within(path, root) == ("/".join(p[len(r) :]) if inside else None)


@settings(max_examples=400, database=None, deadline=None)
@given(ABSOLUTE, ABSOLUTE)
@example("/a/bc", "/a/b")
@example("/a/b/../c", "/a/b")
@example("/x", "/")
def test_a_root_among_the_ancestors_is_within(path: str, root: str) -> None:
    """The set form the rule lookups use answers as `is_within` does."""
    assert (lexical(root) in ancestors(path)) is is_within(path, root)
    assert lexical(path) == ("/" + "/".join(components(path)))


@pytest.mark.parametrize(
    ("path", "root", "expected"),
    [
        ("/a/b", "/a/b", ""),
        ("/a/b/c/d", "/a/b", "c/d"),
        ("/a/b/", "/a/b", ""),  # a trailing slash on the path
        ("/a/b/c", "/a/b/", "c"),  # and on the root
        ("/a/bc", "/a/b", None),  # a prefix that is not a child
        ("/a/b.c", "/a/b", None),
        ("/a", "/a/b", None),  # the parent is not within its child
        ("/a/b/../c", "/a/b", None),  # `..` leaves the root
        ("/a/b/../b/c", "/a/b", "c"),  # and comes back
        ("/a/./b//c", "/a/b", "c"),
        ("/a/b/..", "/a/b", None),
        ("/..", "/", ""),
        ("/anything/at/all", "/", "anything/at/all"),
        ("relative/path", "/", None),  # a relative path is within no absolute root
    ],
)
def test_spellings_a_prefix_test_gets_wrong(path: str, root: str, expected: str | None) -> None:
    assert relative_within(path, root) == expected
    assert is_within(path, root) is (expected is not None)


def test_first_exposure_is_the_first_bind_holding_a_private_path() -> None:
    links = {"/link": "/srv/state"}

    def realpath(path: str) -> str:
        return next((links[k] + path[len(k):] for k in links if is_within(path, k)), path)

    private = ["/srv/state/token", "/run/cc/sockets"]
    assert first_exposure(["/work", "/srv/stat"], private, realpath) is None  # a prefix only
    assert first_exposure(["/work", "/srv"], private, realpath) == (1, "/srv/state/token")
    assert first_exposure(["/link"], private, realpath) == (0, "/srv/state/token")  # resolved
    assert first_exposure(["/run/cc/sockets"], private, realpath) == (0, "/run/cc/sockets")
    assert first_exposure(["/srv/state/token/x"], private, realpath) is None  # below is fine
    assert first_exposure(["/", "/srv"], private, realpath) == (0, "/srv/state/token")
