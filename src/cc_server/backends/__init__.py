"""The transform and enforcement tiers: the host probe, the planners (a `CompiledPolicy` and a
command become a `LaunchPlan`, running nothing) and the one runner that spawns.

The library's names, each imported from its module on first use (`cc_server.exports`).
"""

from typing import TYPE_CHECKING, Final

from cc_server.exports import lazy_exports

if TYPE_CHECKING:
    from cc_server.backends.bubblewrap import plan_bubblewrap as plan_bubblewrap
    from cc_server.backends.none import plan_none as plan_none
    from cc_server.backends.plan import Command as Command
    from cc_server.backends.plan import LaunchPlan as LaunchPlan
    from cc_server.backends.probe import ProbeResult as ProbeResult
    from cc_server.backends.probe import boot_probe as boot_probe
    from cc_server.backends.seatbelt import plan_seatbelt as plan_seatbelt

_EXPORTS: Final = {
    "plan_bubblewrap": "cc_server.backends.bubblewrap",
    "plan_none": "cc_server.backends.none",
    "Command": "cc_server.backends.plan",
    "LaunchPlan": "cc_server.backends.plan",
    "ProbeResult": "cc_server.backends.probe",
    "boot_probe": "cc_server.backends.probe",
    "plan_seatbelt": "cc_server.backends.seatbelt",
}

__all__ = sorted(_EXPORTS)  # the names the TYPE_CHECKING block imports
__getattr__ = lazy_exports(__name__, _EXPORTS)
