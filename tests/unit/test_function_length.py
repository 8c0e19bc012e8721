"""No function or method over MAX_FUNCTION_LINES lines in the packages that keep to it, read
from the source with `ast` (nothing is imported). A function is counted from its `def` (its
decorators aside) to its last line, docstring and nested functions included."""

from __future__ import annotations

import ast
import pathlib

import cc_server

PACKAGE = pathlib.Path(cc_server.__file__).parent
MAX_FUNCTION_LINES = 80
# Packages (directories) and single modules held to the limit, relative to the package root.
HELD: tuple[str, ...] = ("dispatch", "runtime", "egress/driver")


def long_functions(tree: ast.AST, limit: int) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function in `tree` longer than `limit` lines."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > limit:
                found.append((node.name, node.lineno, length))
    return found


def held_files() -> list[pathlib.Path]:
    files: list[pathlib.Path] = []
    for name in HELD:
        path = PACKAGE / name
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")])
    return files


def test_no_function_is_longer_than_the_limit() -> None:
    files = held_files()
    assert len(files) > 10, files  # the walk found the held packages
    long = [
        f"{path.relative_to(PACKAGE)}:{line} {name} ({length} lines)"
        for path in files
        for name, line, length in long_functions(ast.parse(path.read_text()), MAX_FUNCTION_LINES)
    ]
    assert not long, f"over {MAX_FUNCTION_LINES} lines:\n  " + "\n  ".join(long)


def test_the_counter_sees_methods_and_nested_functions() -> None:
    """The checker itself: a long method and a long nested function are found, a short one not."""
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = (
        "class C:\n    async def long(self):\n" + body + "\n"
        "def outer():\n    def inner():\n" + body.replace("        ", "        ") + "\n"
        "def short():\n    return 1\n"
    )
    found = {name: length for name, _, length in long_functions(ast.parse(source), 80)}
    assert found == {"long": 81, "outer": 82, "inner": 81}
