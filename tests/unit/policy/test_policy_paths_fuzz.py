"""Hypothesis: whatever text arrives as a path, validation rejects it or yields a safe path."""

from __future__ import annotations

import posixpath

from hypothesis import example, given, settings
from hypothesis import strategies as st

from cc_server.errors import BadSpec
from cc_server.policy import SandboxBindMount, parse_spec

# Path-shaped text: components drawn from the troublesome ones plus arbitrary short text,
# joined by '/', with or without a leading '/'.
COMPONENT = st.sampled_from(["", ".", "..", "...", "a", "b c", "\x00", "ü", "*", "~"]) | st.text(
    max_size=6
)
PATH_SHAPED = st.builds(
    lambda lead, parts: lead + "/".join(parts),
    st.sampled_from(["", "/", "//", "///"]),
    st.lists(COMPONENT, max_size=6),
)
ANY_PATH = st.text() | PATH_SHAPED

FUZZ = settings(max_examples=400, database=None, deadline=None)


def assert_safe(path: str) -> None:
    assert path.startswith("/"), path
    assert "\x00" not in path, path
    parts = path.split("/")
    assert ".." not in parts, path
    assert "." not in parts, path
    assert "//" not in path, path
    assert posixpath.normpath(path) == path, path


@FUZZ
@given(ANY_PATH)
@example("/")
@example("//")
@example("/a/")
@example("/a/../b")
@example("/a\x00")
@example("relative")
def test_bind_mount_paths_are_rejected_or_safe(path: str) -> None:
    try:
        mount = SandboxBindMount(host_path=path, guest_path=path)
    except ValueError:
        return
    assert_safe(mount.host_path)
    assert_safe(mount.guest)
    assert mount.host_path != "/"
    # Validating the result again changes nothing.
    assert SandboxBindMount(host_path=mount.host_path).host_path == mount.host_path


@FUZZ
@given(ANY_PATH)
def test_spec_paths_are_rejected_or_safe(path: str) -> None:
    data = {
        "sessionId": "s",
        "workspaceId": "w",
        "bindMounts": [{"hostPath": path}],
        "protectedPaths": [path],
        "guestWorkdir": path,
    }
    try:
        spec = parse_spec(data)
    except BadSpec:
        return
    for checked in (spec.bind_mounts[0].host_path, spec.protected_paths[0], spec.guest_workdir):
        assert checked is not None
        assert_safe(checked)
