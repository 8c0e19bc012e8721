"""Egress decided per connection: an entry with a port opens only that port, on every route, and
a change to a running session's allowlist applies to its next connection.

The lab (real sandboxes, a fake resolver, upstream HTTP servers on the host's loopback, the raw
client that speaks CONNECT, absolute-form HTTP and SOCKS5 byte by byte) is `test_egress`'s.
A second upstream listens on another loopback port: what an entry for the first port must not
reach.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from escape_kit import Sandboxes
from test_egress import (
    ALLOWED,
    LOOP_NAME,
    LOOPBACK,
    META_NAME,
    PY,
    Lab,
    Upstream,
    assert_violations,
    attempt,
    open_lab,
    open_upstream,
    reached,
    refused,
    run_raw,
)

from cc_server.backends.probe import ProbeResult
from cc_server.egress.addresses import parse_ip_literal
from cc_server.errors import BadSpec
from cc_server.runtime.events import EgressRequest, EventType
from cc_server.runtime.handle import SandboxHandle

pytestmark = [pytest.mark.security, pytest.mark.integration]

LOOPBACK6 = parse_ip_literal("::1")


@pytest.fixture
async def lab(sb: Sandboxes, probe_result: ProbeResult) -> AsyncIterator[Lab]:
    async with open_lab(sb, probe_result) as lab:
        yield lab


@pytest.fixture
def other() -> AsyncIterator[Upstream]:
    """A second upstream on other loopback ports (127.0.0.1 and ::1)."""
    with open_upstream() as upstream:
        yield upstream


ROUTES = ("connect", "forward", "socks-domain")


async def test_a_port_entry_allows_only_its_port_on_every_route(lab: Lab, other: Upstream) -> None:
    up = lab.upstream
    handle = lab.launch(egressAllowlist=[f"{ALLOWED}:{up.port}", f"127.0.0.1:{up.port}",
                                         f"[::1]:{up.port6}"])
    tries = []
    for kind in ROUTES:
        tries += [
            attempt(f"{kind} listed port", kind, ALLOWED, up.port),
            attempt(f"{kind} other port", kind, ALLOWED, other.port),
        ]
    tries += [
        attempt("socks-ipv4 listed port", "socks-ipv4", "127.0.0.1", up.port),
        attempt("socks-ipv4 other port", "socks-ipv4", "127.0.0.1", other.port),
        attempt("socks-ipv6 listed port", "socks-ipv6", "::1", up.port6),
        attempt("socks-ipv6 other port", "socks-ipv6", "::1", other.port6),
        attempt("connect-ipv6 listed port", "connect", "[::1]", up.port6),
        attempt("connect-ipv6 other port", "connect", "[::1]", other.port6),
    ]
    found, _ = await run_raw(handle, *tries)
    for name, entry in found.items():
        if name.endswith("listed port"):
            assert reached(entry, up), (name, entry)
        else:
            assert refused(entry), (name, entry)
            assert not reached(entry, other), (name, entry)
    assert other.seen == [], "a refused port was reached"
    assert len(up.seen) == len(ROUTES) + 3
    assert_violations(handle, [(ALLOWED, other.port)] * len(ROUTES) + [
        (LOOPBACK, other.port), (LOOPBACK6, other.port6), (LOOPBACK6, other.port6)])
    reasons = [v.raw or "" for v in handle.violations]
    assert all("not on this session's egress allowlist" in r for r in reasons), reasons
    assert all(f"--allow-domain {ALLOWED}:{other.port}" in r for r in reasons[:3]), reasons
    assert f"--allow-domain [::1]:{other.port6}" in reasons[-1], reasons


async def test_an_address_entry_with_a_port_guards_a_name_on_that_port_only(
    lab: Lab, other: Upstream
) -> None:
    # LOOP_NAME resolves to 127.0.0.1: the name is listed on every port, its address on one, so
    # the address guard lets the name through on that port and refuses it on any other.
    up = lab.upstream
    handle = lab.launch(egressAllowlist=[LOOP_NAME, f"127.0.0.1:{up.port}"])
    found, _ = await run_raw(
        handle,
        attempt("listed", "connect", LOOP_NAME, up.port),
        attempt("other", "connect", LOOP_NAME, other.port),
        attempt("socks other", "socks-domain", LOOP_NAME, other.port),
    )
    assert reached(found["listed"], up), found
    assert refused(found["other"]) and refused(found["socks other"]), found
    assert other.seen == []
    assert_violations(handle, [(LOOP_NAME, other.port)] * 2)
    assert all("resolves to 127.0.0.1, a loopback" in (v.raw or "") for v in handle.violations)
    assert all(f"--allow-domain 127.0.0.1:{other.port}" in (v.raw or "")
               for v in handle.violations)  # fmt: skip


# Inside: CONNECT to argv[1]:argv[2] every 0.1 s, printing each reply's status line, until one is
# not 200 (or 200 attempts).
CONNECT_LOOP = r"""
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
for _ in range(200):
    with socket.create_connection(("127.0.0.1", 3128), timeout=5) as s:
        s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        status = s.recv(65536).split(b"\r\n")[0].decode()
    print(status, flush=True)
    if not status.startswith("HTTP/1.1 200"):
        break
    time.sleep(0.1)
"""


async def test_a_live_removal_refuses_the_next_connection_of_a_running_command(lab: Lab) -> None:
    up = lab.upstream
    entry = f"{ALLOWED}:{up.port}"
    handle = lab.launch(egressAllowlist=[entry, f"127.0.0.1:{up.port}"])
    assert handle.egress is not None and entry in handle.egress.entries
    kinds: list[EventType] = []
    statuses: list[str] = []
    changed = None
    async with handle.open_exec(
        [PY, "-c", CONNECT_LOOP, ALLOWED, str(up.port)], timeout_s=60
    ) as execution:
        async for event in execution:
            kinds.append(event.type)
            if event.type is EventType.STDOUT and event.data:
                statuses += event.data.decode().split()
                if changed is None and "200" in statuses:
                    changed = handle.egress.remove(entry, by="test")
            if event.type is EventType.EGRESS_CHANGED:
                assert event.egress == changed
    assert changed is not None and changed.removed == (entry,) and changed.added == ()
    assert await execution.wait() == 0
    assert "200" in statuses and statuses[-2:] == ["403", "Forbidden"], statuses
    assert entry not in handle.egress.entries
    # The command saw the change, then its refusal, as events.
    assert kinds.index(EventType.EGRESS_CHANGED) < kinds.index(EventType.VIOLATION), kinds
    assert_violations(handle, [(ALLOWED, up.port)])
    # Allowed again: the next connection passes.
    handle.egress.allow(entry)
    found, _ = await run_raw(handle, attempt("again", "connect", ALLOWED, up.port))
    assert reached(found["again"], up), found


async def test_a_live_allow_cannot_undo_the_deny_list(lab: Lab) -> None:
    handle = lab.launch(egressAllowlist=[])
    assert handle.egress is not None
    with pytest.raises(BadSpec, match="deny list"):
        handle.egress.allow("169.254.169.254:80")
    handle.egress.allow(f"{META_NAME}:80")  # a name the deny list does not hold ...
    found, _ = await run_raw(handle, attempt("meta", "connect", META_NAME, 80))
    assert refused(found["meta"]), found  # ... is still refused: it resolves to metadata
    assert "nothing: the deny list" in (handle.violations[0].fix or "")


# Inside: CONNECT to each host:port of argv[1:] in turn, printing each reply's status code.
CONNECT_EACH = r"""
import socket, sys
for target in sys.argv[1:]:
    with socket.create_connection(("127.0.0.1", 3128), timeout=30) as s:
        s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        print(s.recv(65536).split(b" ")[1].decode(), flush=True)
"""


async def run_answering(
    handle: SandboxHandle, targets: list[str], answers: list[str | None]
) -> tuple[list[str], list[EgressRequest]]:
    """Run CONNECT_EACH on `targets`, answering each egress-request with the next of `answers`
    (None: no answer, so it times out); the status codes and the requests seen."""
    assert handle.egress is not None
    pending = iter(answers)
    statuses: list[str] = []
    requests: list[EgressRequest] = []
    async with handle.open_exec([PY, "-c", CONNECT_EACH, *targets], timeout_s=60) as execution:
        async for event in execution:
            if event.type is EventType.STDOUT and event.data:
                statuses += event.data.decode().split()
            if event.type is EventType.EGRESS_REQUEST:
                assert event.request is not None
                requests.append(event.request)
                answer = next(pending)
                if answer is not None:
                    handle.egress.answer(event.request.id, answer)
    assert await execution.wait() == 0
    return statuses, requests


async def test_an_approval_lets_exactly_that_host_port_through_for_the_scope_chosen(
    lab: Lab, other: Upstream
) -> None:
    up = lab.upstream
    # The names resolve to 127.0.0.1, listed as an address so the guard would let them through:
    # what is asked about is the name itself.
    handle = lab.launch(egressAllowlist=["127.0.0.1"])
    assert handle.egress is not None
    handle.egress.ask(timeout_s=2.0)
    here, there = f"{ALLOWED}:{up.port}", f"{ALLOWED}:{other.port}"
    statuses, requests = await run_answering(
        handle, [here, here, here, here, there], ["once", "deny", "session", None]
    )
    # once: this connection; deny: refused; session: this one and the next (not asked again);
    # another port of the same host is asked about, and no answer in 2 s refuses it.
    assert statuses == ["200", "403", "200", "200", "403"], statuses
    assert [r.entry for r in requests] == [here, here, here, there]
    assert all(r.protocol == "http" and r.timeout_s == 2.0 for r in requests)
    assert all(r.commands and r.commands[0][0] == PY for r in requests), requests
    assert here in handle.egress.entries and there not in handle.egress.entries
    assert handle.egress.pending_requests == ()
    assert_violations(handle, [(ALLOWED, up.port), (ALLOWED, other.port)])
    assert "was refused when asked" in (handle.violations[0].reason or "")
    assert "none came in 2 s" in (handle.violations[1].reason or "")
    assert len(up.seen) == 0 and other.seen == []  # CONNECT_EACH sends nothing through
    with pytest.raises(BadSpec, match="no egress request"):
        handle.egress.answer(requests[0].id, "once")  # answered already


async def test_deny_list_hosts_and_refused_addresses_are_never_offered(lab: Lab) -> None:
    up = lab.upstream
    handle = lab.launch(egressAllowlist=[])
    assert handle.egress is not None
    handle.egress.ask(timeout_s=30.0)
    targets = [f"{META_NAME}:80", "169.254.169.254:80", f"{LOOP_NAME}:{up.port}",
               f"127.0.0.1:{up.port}", f"[::1]:{up.port6}"]
    statuses, requests = await run_answering(handle, targets, [])
    assert statuses == ["403"] * len(targets), statuses
    assert requests == []  # refused at once, nothing held
    assert len(handle.violations) == len(targets)
    assert up.seen == []
