"""`cc-server run`'s refusals on stderr, one line each, as they happen.

Each violation becomes one line the moment the handle records it (a listener on the handle, so
it is the same whether the command's events are read or not: the CLI daemon does not read
them), with the reason and the fix that applies to a `cc-server run`:

    cc-server: violation: network-outbound pypi.org:443: pypi.org is not on this session's
    egress allowlist; to allow: --allow-domain pypi.org:443

(one line on the terminal), or "on the deny list: cannot be allowed", or the capability that
would allow it. After the command, `rest` prints anything recorded before the printer listened,
so every violation is shown exactly once.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final, TextIO

if TYPE_CHECKING:
    from cc_server.runtime.events import SandboxViolation
    from cc_server.runtime.handle import SandboxHandle

__all__ = ["ViolationPrinter", "cli_fix", "print_live", "violation_line"]

# The fixes the proxies give (egress.driver), read back as what a `cc-server run` user can do.
_ALLOW_DOMAIN: Final = re.compile(r"--allow-domain (\S+?)\)")
_DENIED_PREFIX: Final = "nothing: the deny list"
_NETWORK_OFF_PREFIX: Final = "nothing while the session's network is off"


def cli_fix(violation: SandboxViolation) -> str | None:
    """What a `cc-server run` user can do about `violation`, in a few words, or None."""
    fix = violation.fix
    if fix is None:
        return None
    if fix.startswith(_DENIED_PREFIX):
        return "on the deny list: cannot be allowed"
    if fix.startswith(_NETWORK_OFF_PREFIX):
        return "the network is off for this run (--no-network): no entry can allow it"
    found = _ALLOW_DOMAIN.search(fix)
    return f"to allow: --allow-domain {found.group(1)}" if found else f"to allow: {fix}"


def violation_line(violation: SandboxViolation) -> str:
    """One line: the verb, the target, the reason and the fix (or the capability) that apply."""
    parts = [f"cc-server: violation: {violation.action} {violation.target}"]
    if violation.reason:
        parts.append(f": {violation.reason}")
    fix = cli_fix(violation)
    if fix:
        parts.append(f"; {fix}")
    if violation.suggested_capability:
        parts.append(f" (capability {violation.suggested_capability} would allow it)")
    return " ".join("".join(parts).split())  # one line, whatever a reason says


class ViolationPrinter:
    """Prints each violation once: as it is recorded (`violation`), or after (`rest`)."""

    def __init__(self, file: TextIO) -> None:
        self._file = file
        self._shown: set[int] = set()

    def violation(self, violation: SandboxViolation) -> None:
        """Print `violation` now, unless it was shown already."""
        if id(violation) in self._shown:
            return
        self._shown.add(id(violation))
        print(violation_line(violation), file=self._file, flush=True)

    def rest(self, handle: SandboxHandle) -> None:
        """Print every violation `handle` recorded that is not shown yet."""
        for violation in handle.violations:
            self.violation(violation)


def print_live(handle: SandboxHandle, file: TextIO) -> ViolationPrinter:
    """Print each violation of `handle` on `file` as it is recorded, from now on; call `rest`
    on the printer after the command for any recorded before."""
    printer = ViolationPrinter(file)
    handle.violation_listeners.append(printer.violation)
    return printer
