"""The microVM backend: its runtime (probe, image, snapshot pool) and its sandbox handle.

The library's names, each imported from its module on first use (`cc_server.exports`), so the
machine's modules (image, vm, pool, …) import none of the backend above them.
"""

from typing import TYPE_CHECKING, Final

from cc_server.exports import lazy_exports

if TYPE_CHECKING:
    from cc_server.microvm.handle import MicroVMHandle as MicroVMHandle
    from cc_server.microvm.runtime import MicroVMRuntime as MicroVMRuntime
    from cc_server.microvm.runtime import probe_runtime as probe_runtime

_EXPORTS: Final = {
    "MicroVMHandle": "cc_server.microvm.handle",
    "MicroVMRuntime": "cc_server.microvm.runtime",
    "probe_runtime": "cc_server.microvm.runtime",
}

__all__ = sorted(_EXPORTS)  # the names the TYPE_CHECKING block imports
__getattr__ = lazy_exports(__name__, _EXPORTS)
