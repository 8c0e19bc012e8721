"""No import circle among cc_server's modules, and no import up the layers, read from the source
with `ast` (nothing is imported).

The graph has an edge from a module to every cc_server module it imports, wherever the import
statement is: at module level (under `if`, `try`, `with` too) and inside functions and methods.
Only imports under `if TYPE_CHECKING:` are left out: they never run, so they cannot order an
import. A function-level import is allowed (the thin CLI client and the terminal service import
heavy modules late, for start-up cost), but it is an edge like any other: an import moved into a
function still closes the circle it is part of, so it cannot be the way a circle is hidden.

`from package import name` is an edge to `package.name` when that is a module, else to the
package's `__init__`; a package's `__init__` is not implied by importing one of its modules.
A subpackage's `__init__` re-exports its names lazily (`cc_server.exports`): each module its
`_EXPORTS` map names is an edge too (function-level: it runs on first use), and the `__init__`
sits in the layer of the highest module of its package, so nothing below imports the façade.
"""

from __future__ import annotations

import ast
import functools
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import cc_server

PACKAGE = pathlib.Path(cc_server.__file__).parent

# The layers, lowest first (the README's code map says the same). A module may import any layer
# below its own, and within its layer only its own package; the shell's modules (the CLI) may
# import each other, the circle test keeping them in order. A layer names packages, top-level
# modules, or single modules of a package that sit higher than the rest of it.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(names.split())
    for names in (
        "errors exports tasks",
        "cc_server policy",  # cc_server: the package's root (its errors, __version__)
        "rundir",  # the run directory: base directories, their registry, dead owners' names
        "backends",
        "egress microvm",  # microvm: the machine (image, vm, pool, link, probe), a backend's part
        "runtime",
        "microvm.handle microvm.runtime",  # the microVM backend's handle, built on runtime's
        "dispatch terminal",
        "server",
        "cli cli_ask cli_client cli_daemon cli_socket cli_spec cli_violations settings",
    )
)


@dataclass(frozen=True, slots=True)
class Edge:
    source: str
    target: str
    line: int
    lazy: bool  # the import runs when a function is called, not when the module is imported

    def __str__(self) -> str:
        where = "function-level" if self.lazy else "module-level"
        return f"{self.source} -> {self.target} (line {self.line}, {where})"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def package_modules() -> dict[str, pathlib.Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(
    modules: dict[str, pathlib.Path], module: str, node: ast.Import | ast.ImportFrom
) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names if alias.name in modules)
        return
    if node.level:
        base = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:
            yield f"{base}.{alias.name}"
        elif base in modules:
            yield base


def _imports(
    modules: dict[str, pathlib.Path], module: str, body: list[ast.stmt], lazy: bool
) -> Iterator[Edge]:
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            for target in _targets(modules, module, node):
                yield Edge(module, target, node.lineno, lazy)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(modules, module, node.orelse, lazy)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _imports(modules, module, node.body, True)
        elif isinstance(node, ast.Match):
            for case in node.cases:
                yield from _imports(modules, module, case.body, lazy)
        else:
            for name in ("body", "orelse", "finalbody"):
                yield from _imports(modules, module, getattr(node, name, []), lazy)
            for handler in getattr(node, "handlers", []):
                yield from _imports(modules, module, handler.body, lazy)


def _lazy_exports(
    modules: dict[str, pathlib.Path], module: str, tree: ast.Module
) -> Iterator[Edge]:
    """The edges of an `__init__`'s `_EXPORTS` map (name -> module it is imported from)."""
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id == "_EXPORTS":
            assert isinstance(value, ast.Dict), f"{module}: _EXPORTS is not a dict literal"
            for item in value.values:
                assert isinstance(item, ast.Constant) and item.value in modules, (module, item)
                yield Edge(module, item.value, item.lineno, True)


def import_graph() -> dict[str, dict[str, Edge]]:
    """Each module's edges, by target: the first import statement of that target."""
    modules = package_modules()
    graph: dict[str, dict[str, Edge]] = {module: {} for module in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for edge in (*_imports(modules, module, tree.body, False),
                     *_lazy_exports(modules, module, tree)):
            if edge.target != module:
                graph[module].setdefault(edge.target, edge)
    return graph


def find_cycle(graph: dict[str, dict[str, Edge]]) -> list[Edge] | None:
    """One cycle of the graph, as its edges in order; None when it has none."""
    done: set[str] = set()
    for start in graph:
        if start in done:
            continue
        path: list[Edge] = []
        on_path = {start: 0}
        stack = [iter(graph[start].values())]
        while stack:
            edge = next(stack[-1], None)
            if edge is None:
                stack.pop()
                node = path.pop().target if path else start
                done.add(node)
                del on_path[node]
                continue
            if edge.target in on_path:
                return [*path[on_path[edge.target]:], edge]
            if edge.target in done:
                continue
            path.append(edge)
            on_path[edge.target] = len(path)
            stack.append(iter(graph[edge.target].values()))
    return None


def test_there_is_no_import_circle_among_cc_server_modules() -> None:
    graph = import_graph()
    assert len(graph) > 50, sorted(graph)  # the walk found the package's modules
    cycle = find_cycle(graph)
    assert cycle is None, "an import circle:\n  " + "\n  ".join(map(str, cycle or ()))


def package_of(module: str) -> str:
    """The subpackage a module belongs to (`runtime`), or the top-level module's own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_of(module: str) -> int:
    modules = package_modules()
    if module != "cc_server" and modules[module].name == "__init__.py":
        # A subpackage's façade: the layer of the highest module of its package.
        return max(layer_of(m) for m in modules if m.startswith(module + "."))
    name = module.removeprefix("cc_server.")
    for unit in (name, package_of(module)):
        found = [i for i, layer in enumerate(LAYERS) if unit in layer]
        if found:
            return found[0]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS (and the README's code map)")


def test_no_module_imports_a_layer_above_its_own() -> None:
    shell = len(LAYERS) - 1
    upward = []
    for edges in import_graph().values():
        for edge in edges.values():
            source, target = layer_of(edge.source), layer_of(edge.target)
            if target > source or (
                target == source
                and source != shell
                and package_of(edge.source) != package_of(edge.target)
            ):
                upward.append(edge)
    assert not upward, "imports up (or across) the layers:\n  " + "\n  ".join(map(str, upward))


def test_the_graph_sees_each_kind_of_import(tmp_path: pathlib.Path) -> None:
    """The checker itself: a circle closed by a function-level import is found, one closed only
    under TYPE_CHECKING is not, and relative and package imports resolve."""
    source = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "def later():\n    from . import c\n",
        "pkg/c.py": "try:\n    import pkg.a\nexcept ImportError:\n    pass\n",
        "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n",
        "pkg/e.py": "from .d import x\n",
    }
    for name, text in source.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = {
        ".".join(path.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"): path
        for path in sorted(tmp_path.rglob("*.py"))
    }
    graph = {
        module: {e.target: e for e in _imports(modules, module, ast.parse(p.read_text()).body,
                                               False)}
        for module, p in modules.items()
    }
    assert set(graph["pkg.b"]) == {"pkg.c"} and graph["pkg.b"]["pkg.c"].lazy
    assert set(graph["pkg.c"]) == {"pkg.a"} and not graph["pkg.c"]["pkg.a"].lazy
    assert graph["pkg.d"] == {}  # TYPE_CHECKING only
    assert set(graph["pkg.e"]) == {"pkg.d"}
    cycle = find_cycle(graph)
    assert cycle is not None
    assert {(e.source, e.target) for e in cycle} == {
        ("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a")
    }
    del graph["pkg.b"]["pkg.c"]
    assert find_cycle(graph) is None


def test_a_facade_is_as_high_as_what_it_re_exports() -> None:
    """A lazy `_EXPORTS` map is read as edges, and a subpackage's `__init__` takes the layer of
    its highest module: the microVM façade re-exports the backend, above the machine."""
    modules = package_modules()
    tree = ast.parse(modules["cc_server.microvm"].read_text())
    targets = {edge.target for edge in _lazy_exports(modules, "cc_server.microvm", tree)}
    assert targets == {"cc_server.microvm.handle", "cc_server.microvm.runtime"}
    assert layer_of("cc_server.microvm") == layer_of("cc_server.microvm.runtime")
    assert layer_of("cc_server.microvm") > layer_of("cc_server.microvm.vm")
    assert layer_of("cc_server.runtime") == layer_of("cc_server.runtime.port")
