"""Guest paths to host paths through the binds, and the apply_patch format."""

from __future__ import annotations

import pytest

from cc_server.dispatch._paths import (
    PathOutsideBinds,
    map_guest_path,
    matches_create_glob,
    rule_covering,
    rule_under,
)
from cc_server.dispatch._tool_patch import apply_hunks, parse_patch
from cc_server.dispatch.tools import FileToolError
from cc_server.policy import (
    HostFacts,
    PathRule,
    Platform,
    SandboxBindMount,
    SandboxSpec,
    compile_policy,
)


def _policy(workdir: str | None = "/workspace"):  # type: ignore[no-untyped-def]
    spec = SandboxSpec(
        session_id="s",
        workspace_id="w",
        bind_mounts=(
            SandboxBindMount(host_path="/srv/wt", guest_path="/workspace"),
            SandboxBindMount(
                host_path="/srv/vendor", guest_path="/workspace/vendor", read_only=True
            ),
            SandboxBindMount(host_path="/srv/root-file"),
        ),
        guest_workdir=workdir,
    )
    host = HostFacts(
        platform=Platform.LINUX, home="/home/u", realpath=lambda p: p, exists=lambda p: True
    )
    return compile_policy(spec, host)


@pytest.mark.parametrize(
    "path, host, relative",
    [
        ("a.txt", "/srv/wt/a.txt", "a.txt"),
        ("./src/../a.txt", "/srv/wt/a.txt", "a.txt"),
        ("/workspace", "/srv/wt", ""),
        ("/workspace/", "/srv/wt", ""),
        ("//workspace//x", "/srv/wt/x", "x"),
        ("vendor/lib.py", "/srv/vendor/lib.py", "lib.py"),  # the longest guest prefix wins
        ("/workspace/vendor", "/srv/vendor", ""),
        ("/workspace/vendorx", "/srv/wt/vendorx", "vendorx"),
        ("/srv/root-file", "/srv/root-file", ""),
    ],
)
def test_guest_paths_map_through_the_binds(path: str, host: str, relative: str) -> None:
    mapped = map_guest_path(_policy(), path)
    assert (mapped.host, mapped.relative) == (host, relative)


@pytest.mark.parametrize(
    "path", ["", "a\x00", "../x", "/workspace/../etc", "/srv/wt/a", "/", "/work", "x" * 5000]
)
def test_paths_outside_the_binds_are_refused(path: str) -> None:
    with pytest.raises(PathOutsideBinds):
        map_guest_path(_policy(), path)


def test_a_relative_path_needs_a_workdir() -> None:
    with pytest.raises(PathOutsideBinds, match="no workdir"):
        map_guest_path(_policy(workdir=None), "a.txt")


def test_rules_cover_their_path_and_below_only() -> None:
    rules = [PathRule(path="/h/.ssh", reason="keys")]
    assert rule_covering(rules, "/h/.ssh") is rules[0]
    assert rule_covering(rules, "/h/.ssh/id") is rules[0]
    assert rule_covering(rules, "/h/.sshx") is None
    assert rule_covering(rules, "/h") is None
    assert rule_under(rules, "/h") == rules
    assert rule_under(rules, "/h/.ssh") == []


@pytest.mark.parametrize(
    "name, hit",
    [
        ("x.pem", "*.pem"),
        ("X.PEM", "*.pem"),
        (".env", ".env"),
        (".ENV", ".env"),
        ("a.key", "*.key"),
        (".key", "*.key"),
        ("env", None),
        ("x.pem.txt", None),
        ("a.keys", None),
    ],
)
def test_create_globs_match_like_the_supervisor(name: str, hit: str | None) -> None:
    assert matches_create_glob((".env", "*.key", "*.pem"), name) == hit


def test_patch_parsing_and_hunks() -> None:
    ops = parse_patch(
        "*** Begin Patch\n*** Add File: n.txt\n+a\n+b\n*** Delete File: d.txt\n"
        "*** Update File: u.txt\n*** Move to: v.txt\n@@ def f():\n-    return 1\n+    return 2\n"
        "*** End of File\n*** End Patch\n"
    )
    assert [(o.kind, o.path, o.move_to) for o in ops] == [
        ("add", "n.txt", None),
        ("delete", "d.txt", None),
        ("update", "u.txt", "v.txt"),
    ]
    assert ops[0].lines == ("a\n", "b\n")
    text = "x = 0\ndef f():\n    return 1\n"
    assert apply_hunks(text, ops[2].lines, "u.txt") == "x = 0\ndef f():\n    return 2\n"


@pytest.mark.parametrize(
    "patch",
    [
        "",
        "*** Begin Patch\n*** End Patch\n",
        "no header\n",
        "*** Begin Patch\n*** Add File: a\nnot plus\n*** End Patch\n",
        "*** Begin Patch\n*** Frobnicate: a\n*** End Patch\n",
        "*** Begin Patch\n*** Add File: \n+x\n*** End Patch\n",
    ],
)
def test_malformed_patches_are_refused(patch: str) -> None:
    with pytest.raises(FileToolError):
        parse_patch(patch)


def test_a_hunk_that_does_not_apply_is_an_error() -> None:
    with pytest.raises(FileToolError, match="not found"):
        apply_hunks("a\nb\n", ("-c", "+d"), "f")
    with pytest.raises(FileToolError, match="anchor"):
        apply_hunks("a\nb\n", ("@@ nowhere", "-a", "+d"), "f")
