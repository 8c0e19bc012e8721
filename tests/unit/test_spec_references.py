"""docs/SPEC.md cannot drift: every test and benchmark a promise cites exists, and the page stays
short enough to be read (under 40 KB, no row over 600 characters)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPEC = ROOT / "docs" / "SPEC.md"
MAX_SPEC_BYTES = 40 * 1024  # the budget: a page one reads, not a log
MAX_ROW_CHARS = 600  # about two lines of a wide terminal
# A backticked citation: `path.py`, `path.py::name` or `::name`.
_CITATION = re.compile(r"`((?:[\w./-]+\.py)?::\w+|[\w./-]+\.py)`")
_TESTS_LINE = re.compile(r"^Tests: (.*)$")


def _defined(path: pathlib.Path, name: str) -> bool:
    return re.search(rf"^\s*(async\s+)?def {re.escape(name)}\(", path.read_text(), re.M) is not None


def _resolve(path: str) -> pathlib.Path:
    """A cited file: `bench/...` from the checkout's root, anything else under tests/."""
    return ROOT / path if path.startswith("bench/") else ROOT / "tests" / path


def citations(text: str) -> list[tuple[str, str, tuple[str, ...], str]]:
    """(promise, cited token, the files a bare `::name` may be in, problem) for every citation
    of every promise row; problem is "" when the citation resolves."""
    found = []
    defaults: tuple[str, ...] = ()
    for line in text.splitlines():
        if line.startswith("## "):
            defaults = ()
        match = _TESTS_LINE.match(line)
        if match:
            defaults = tuple(re.findall(r"`([\w./-]+\.py)`", match.group(1)))
        if not line.startswith("| P"):
            continue
        promise = line.split("|")[1].strip()
        files = defaults
        for token in _CITATION.findall(line):
            path, _, name = token.partition("::")
            if path:
                files = (path,)
            problem = ""
            missing = [f for f in files if not _resolve(f).is_file()]
            if name and not files:
                problem = "a bare ::name with no Tests: line"
            elif missing:
                problem = f"no file {missing[0]}"
            elif name and not any(_defined(_resolve(f), name) for f in files):
                problem = f"no {name} in {', '.join(files)}"
            found.append((promise, token, files, problem))
    return found


def test_every_test_spec_md_cites_exists() -> None:
    text = SPEC.read_text()
    cited = citations(text)
    assert len(cited) > 200  # the parser found the rows
    broken = [f"{promise}: {token}: {problem}" for promise, token, _, problem in cited if problem]
    assert broken == [], "\n".join(broken)


def test_spec_md_is_short_enough_to_read() -> None:
    size = len(SPEC.read_bytes())
    assert size < MAX_SPEC_BYTES, f"docs/SPEC.md is {size} bytes; move detail to the docs it cites"
    long_rows = [line[:60] for line in SPEC.read_text().splitlines() if len(line) > MAX_ROW_CHARS]
    assert long_rows == []


def test_every_promise_number_is_used_once() -> None:
    numbers = re.findall(r"^\| (P\d+) \|", SPEC.read_text(), re.M)
    assert len(numbers) == len(set(numbers)), sorted(n for n in numbers if numbers.count(n) > 1)


@pytest.mark.parametrize(("row", "problem"), [
    ("Tests: `unit/test_settings.py`\n| P1 | x | `::test_no_such_test` |", "no test_no_such_test"),
    ("| P1 | x | `unit/no_such_file.py::test_a` |", "no file unit/no_such_file.py"),
    ("| P1 | x | `::test_a` |", "a bare ::name"),
    ("Tests: `unit/test_settings.py`\n| P1 | x | `unit/test_spec_references.py::test_"
     "every_test_spec_md_cites_exists`, `::test_spec_md_is_short_enough_to_read` |", ""),
])  # fmt: skip
def test_the_checker_catches_a_missing_test(row: str, problem: str) -> None:
    [*_, last] = citations(row)
    assert problem in last[3] and bool(problem) == bool(last[3])
