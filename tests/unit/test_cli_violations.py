"""`cc-server run`'s violation line: the reason and the fix that applies, on one line, each
violation once."""

from __future__ import annotations

import io
import types

import pytest

from cc_server.cli_violations import ViolationPrinter, violation_line
from cc_server.egress.driver import NOTHING_DENIED, NOTHING_NETWORK_OFF, default_advice
from cc_server.runtime.events import SandboxViolation

PREFIX = "cc-server: violation: network-outbound pypi.org:443"


@pytest.mark.parametrize(
    ("violation", "line"),
    [
        (SandboxViolation(action="network-outbound", target="pypi.org:443",
                          reason="pypi.org is not on this session's egress allowlist",
                          fix=default_advice("pypi.org:443")),
         f"{PREFIX}: pypi.org is not on this session's egress allowlist; "
         "to allow: --allow-domain pypi.org:443"),
        (SandboxViolation(action="network-outbound", target="pypi.org:443",
                          reason="pypi.org resolves to 192.0.2.7, a documentation address;\n"
                                 "egress reaches ...",
                          fix=default_advice("192.0.2.7:443")),
         f"{PREFIX}: pypi.org resolves to 192.0.2.7, a documentation address; egress reaches "
         "...; to allow: --allow-domain 192.0.2.7:443"),
        (SandboxViolation(action="network-outbound", target="pypi.org:443", reason="denied",
                          fix=NOTHING_DENIED),
         f"{PREFIX}: denied; on the deny list: cannot be allowed"),
        (SandboxViolation(action="network-outbound", target="pypi.org:443", reason="off",
                          fix=NOTHING_NETWORK_OFF + "; or give the agent the canUseNetwork "
                          "capability", suggested_capability="canUseNetwork"),
         f"{PREFIX}: off; the network is off for this run (--no-network): no entry can allow "
         "it (capability canUseNetwork would allow it)"),
        (SandboxViolation(action="network-outbound", target="pypi.org:443", reason="r",
                          fix="ask the operator"),
         f"{PREFIX}: r; to allow: ask the operator"),
        (SandboxViolation(action="file-write-create", target="/w/x.pem", raw="EACCES"),
         "cc-server: violation: file-write-create /w/x.pem"),
    ],
)  # fmt: skip
def test_violation_line(violation: SandboxViolation, line: str) -> None:
    assert violation_line(violation) == line


def test_each_violation_is_printed_once() -> None:
    out = io.StringIO()
    printer = ViolationPrinter(out)
    first = SandboxViolation(action="a", target="t1")
    second = SandboxViolation(action="a", target="t2")
    printer.violation(first)
    printer.violation(first)
    printer.rest(types.SimpleNamespace(violations=[first, second]))  # type: ignore[arg-type]
    assert out.getvalue().splitlines() == [
        "cc-server: violation: a t1", "cc-server: violation: a t2"
    ]
