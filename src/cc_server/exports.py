"""Lazy re-exports for a subpackage's `__init__`: its curated names, imported from their modules
on first use (PEP 562), so importing one module of the package does not import all of it.

    _EXPORTS: Final = {"SandboxManager": "cc_server.runtime.port", ...}
    __getattr__ = lazy_exports(__name__, _EXPORTS)

`tests/unit/test_import_graph.py` reads each `_EXPORTS` map as edges of the import graph.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The module `__getattr__` of `package`: a name of `exports` is imported from the module
    it maps to (and kept in the package's namespace); any other is an AttributeError."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
