"""The search tools find exactly the lines a line-by-line match finds (the whole-file prefilter
never hides one), and bound what they return."""

from __future__ import annotations

import os
import pathlib
import tempfile

import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from cc_server.dispatch.guardrails import standard_chain
from cc_server.dispatch.tools import MAX_SEARCH_LINE_CHARS, FileTools
from cc_server.policy import HostFacts, Platform, SandboxBindMount, SandboxSpec, compile_policy

FRAGMENTS = [
    "a",
    "b",
    "ab",
    " ",
    ".",
    r"\s",
    r"\S",
    r"\w",
    r"\b",
    "^",
    "$",
    "a+",
    "b*",
    "[ab]",
    "[^a]",
    "(a|b)",
    r"\d",
    "1",
    "(?i)A",
    r"\n",
    r"a(?!b)",
    r"(?<=a)b",
    r"\Aa",
    r"b\Z",
    "(?m)^b",
    ".*",
]
CONTENT = st.lists(
    st.sampled_from(["a", "b", " ", "1", "\n", "\r\n", "\r", "\t", "é"]), max_size=60
).map("".join)


def _tools(root: str) -> FileTools:
    spec = SandboxSpec(
        session_id="s",
        workspace_id="w",
        bind_mounts=(SandboxBindMount(host_path=root),),
        guest_workdir=root,
    )
    host = HostFacts(
        platform=Platform.LINUX,
        home="/nonexistent-home",
        realpath=os.path.realpath,
        exists=os.path.lexists,
    )
    policy = compile_policy(spec, host)
    return FileTools(policy, standard_chain(policy))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=4), CONTENT)
def test_search_finds_exactly_the_lines_a_line_by_line_match_finds(
    fragments: list[str], content: str
) -> None:
    pattern = "".join(fragments)
    try:
        compiled = regex.compile(pattern)
    except regex.error:
        return
    with tempfile.TemporaryDirectory() as root:
        pathlib.Path(root, "f.txt").write_bytes(content.encode())
        lines = content.replace("\r\n", "\n").split("\n")
        if lines and not lines[-1]:
            lines.pop()
        expected = [
            n for n, line in enumerate(lines, 1) if compiled.search(line[:MAX_SEARCH_LINE_CHARS])
        ]
        tools = _tools(os.path.realpath(root))
        assert [m.line for m in tools.search(pattern)] == expected, (pattern, content)
        assert bool(tools.search_files(pattern)) == bool(expected)


def test_long_lines_are_cut_and_results_bounded(tmp_path: pathlib.Path) -> None:
    root = tmp_path.resolve()
    (root / "long.txt").write_text("x" * (MAX_SEARCH_LINE_CHARS + 10) + "NEEDLE\n")
    (root / "many.txt").write_text("hit\n" * 5000)
    tools = _tools(str(root))
    assert tools.search("NEEDLE") == []
    assert len(tools.search("hit")) == 2000
    assert tools.search_files("hit") == [f"{root}/many.txt"]
