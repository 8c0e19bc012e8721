"""The lifecycle tier: `SandboxManager` and its adapters, handles, states and events.

The library's names, each imported from its module on first use (`cc_server.exports`).
"""

from typing import TYPE_CHECKING, Final

from cc_server.exports import lazy_exports

if TYPE_CHECKING:
    from cc_server.runtime.events import EventType as EventType
    from cc_server.runtime.events import SandboxEvent as SandboxEvent
    from cc_server.runtime.events import SandboxState as SandboxState
    from cc_server.runtime.events import SandboxViolation as SandboxViolation
    from cc_server.runtime.handle import SandboxHandle as SandboxHandle
    from cc_server.runtime.handle import run_collect as run_collect
    from cc_server.runtime.port import NativeSandboxAdapter as NativeSandboxAdapter
    from cc_server.runtime.port import NoSandboxAdapter as NoSandboxAdapter
    from cc_server.runtime.port import SandboxManager as SandboxManager
    from cc_server.runtime.port import SandboxPort as SandboxPort

_EXPORTS: Final = {
    "EventType": "cc_server.runtime.events",
    "SandboxEvent": "cc_server.runtime.events",
    "SandboxState": "cc_server.runtime.events",
    "SandboxViolation": "cc_server.runtime.events",
    "SandboxHandle": "cc_server.runtime.handle",
    "run_collect": "cc_server.runtime.handle",
    "NativeSandboxAdapter": "cc_server.runtime.port",
    "NoSandboxAdapter": "cc_server.runtime.port",
    "SandboxManager": "cc_server.runtime.port",
    "SandboxPort": "cc_server.runtime.port",
}

__all__ = sorted(_EXPORTS)  # the names the TYPE_CHECKING block imports
__getattr__ = lazy_exports(__name__, _EXPORTS)
