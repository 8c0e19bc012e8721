"""The microVM probe's verdict, as backend choice sees it, and the loud failure it gives.

Here, below both `runtime.select` (which chooses a backend by the verdict) and
`microvm.probe` (which reaches it), so that the probe does not import the runtime above it.
"""

from __future__ import annotations

from typing import Protocol

from cc_server.errors import BackendUnavailable

__all__ = ["MicroVMVerdict", "microvm_unavailable"]


class MicroVMVerdict(Protocol):
    """What backend choice needs of the microVM probe (cc_server.microvm.probe.MicroVMProbe)."""

    @property
    def available(self) -> bool: ...

    @property
    def reason(self) -> str: ...

    @property
    def fix(self) -> str | None: ...


def microvm_unavailable(microvm: MicroVMVerdict | None) -> BackendUnavailable:
    """The loud failure of an explicit `microvm` request; `None`: the runtime was not probed."""
    if microvm is None:
        return BackendUnavailable(
            "backend 'microvm' was requested but this process runs without the microVM "
            "runtime: CC_SERVER_MICROVM is off, so it was never probed",
            fix="start the server with CC_SERVER_MICROVM=on (or =default) and QEMU installed "
            "(scripts/bootstrap); `cc-server run --backend microvm` probes it itself",
        )
    return BackendUnavailable(
        f"backend 'microvm' was requested but this host cannot boot a microVM: {microvm.reason}",
        fix=microvm.fix or "request 'native' or leave the backend unspecified",
    )
