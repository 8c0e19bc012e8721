"""Attacks on the HTTP proxy's kept-alive connections: a refused host, port or deny-list name
reached through a kept connection or a reused upstream, one request decided for another (a
live allowlist change, 100-continue, an upgrade, CONNECT after a forward, a response to HEAD,
204 or 304 that carries a body), and the proxy made to hold memory or descriptors (a response or
request body that never ends, an endless response head, many kept connections).

Real sockets end to end: the session's proxies on loopback, raw clients, upstream servers that
record every byte each of their connections received; the last test runs the raw client inside
a real sandbox and reads the handle's violations.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import h11
import pytest
from cli_kit import daemon_pids
from microvm_kit import launch as vm_launch
from microvm_kit import manager as vm_manager
from microvm_kit import shared_runtime
from microvm_kit import unique as vm_unique
from other_user import OtherUser
from server_kit import host_pids_with, wait_until_gone
from test_egress import (
    ALLOWED,
    DENIED,
    PY,
    RUN_TIMEOUT_S,
    Lab,
    assert_violations,
    lab,
    open_upstream,
    output,
)
from test_egress_smuggling import Client, ok

from cc_server.egress.addresses import IPAddress
from cc_server.egress.driver import (
    AskAnswer,
    EgressAsk,
    EgressRefused,
    ProxyLimits,
    ProxyParams,
    SessionProxies,
    open_session_proxies,
)
from cc_server.egress.patterns import Allowlist, parse_rules
from cc_server.errors import CcServerError
from cc_server.microvm.link import VM_DIR_PREFIX
from cc_server.microvm.pool import VmPool
from cc_server.policy import SandboxBackend, parse_spec
from cc_server.runtime.handle import run_collect

pytestmark = [pytest.mark.security, pytest.mark.integration]

__all__ = ["lab"]  # the sandbox lab fixture of test_egress, used by the last test

LOOPBACK_NAME = "up.rnet.test"  # allowed, resolves to the upstreams' 127.0.0.1
DENY_NAME = "deny.rnet.test"  # on the deny list (and allowed by a pattern: the deny list wins)
MiB = 1024 * 1024

Answer = Callable[[bytes, bytes, asyncio.StreamWriter], Awaitable[None]]


async def answer_ok(method: bytes, target: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(ok(target))
    await writer.drain()


@dataclass
class Upstream:
    """An origin server on loopback that records every byte of each connection, the targets
    h11 parsed on it, and whether the proxy closed it; `answer` writes each response raw."""

    answer: Answer = answer_ok
    at_head: bool = False  # answer at the request's head, before (and without) its body
    port: int = 0
    received: list[bytearray] = field(default_factory=list)
    targets: list[list[bytes]] = field(default_factory=list)
    closed: list[asyncio.Event] = field(default_factory=list)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raw, targets, closed = bytearray(), list[bytes](), asyncio.Event()
        self.received.append(raw)
        self.targets.append(targets)
        self.closed.append(closed)
        conn = h11.Connection(h11.SERVER)
        method = b""
        try:
            with contextlib.suppress(ConnectionError, h11.ProtocolError):
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await reader.read(65536)
                        raw += data
                        conn.receive_data(data)
                        if not data:
                            break
                    elif isinstance(event, h11.Request):
                        targets.append(event.target)
                        method = event.method
                        if self.at_head:
                            await self.answer(method, event.target, writer)
                    elif isinstance(event, h11.EndOfMessage):
                        if not self.at_head:
                            await self.answer(method, targets[-1], writer)
                        rest = conn.trailing_data[0]
                        conn = h11.Connection(h11.SERVER)
                        if rest:
                            conn.receive_data(rest)
                    elif isinstance(event, h11.ConnectionClosed):
                        break
            # Read on to the end: what the proxy sends after h11 stopped counts too.
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(65536):
                    raw += data
        finally:
            closed.set()
            writer.close()

    @property
    def requests(self) -> list[bytes]:
        return [t for targets in self.targets for t in targets]


@dataclass
class Net:
    a: Upstream  # allowed (by its port)
    b: Upstream  # not allowed
    proxies: SessionProxies
    refusals: list[EgressRefused]

    def allowlist(self, *entries: str) -> Allowlist:
        return Allowlist(
            patterns=parse_rules("test", entries, "test"),
            denied=parse_rules("deny", [DENY_NAME], "deny"),
        )


async def fixed_resolver(host: str, port: int) -> list[IPAddress]:
    return [ipaddress.ip_address("127.0.0.1")] if host.endswith(".test") else []


@contextlib.asynccontextmanager
async def open_net(
    a: Upstream | None = None, limits: ProxyLimits | None = None
) -> AsyncIterator[Net]:
    a = a or Upstream()
    b = Upstream()
    async with contextlib.AsyncExitStack() as stack:
        for up in (a, b):
            server = await asyncio.start_server(up.serve, "127.0.0.1", 0)
            await stack.enter_async_context(server)
            up.port = server.sockets[0].getsockname()[1]
        refusals: list[EgressRefused] = []
        allowlist = Allowlist(
            patterns=parse_rules(
                "test", [f"127.0.0.1:{a.port}", f"{LOOPBACK_NAME}:{a.port}", "*.rnet.test"], "test"
            ),
            denied=parse_rules("deny", [DENY_NAME], "deny"),
        )
        params = ProxyParams(
            session_id="rnet",
            allowlist=allowlist,
            on_refused=refusals.append,
            resolver=fixed_resolver,
            limits=limits or ProxyLimits(),
        )
        proxies = await stack.enter_async_context(open_session_proxies(params))
        yield Net(a, b, proxies, refusals)


@contextlib.asynccontextmanager
async def client(net: Net) -> AsyncIterator[Client]:
    assert net.proxies.http_port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", net.proxies.http_port)
    try:
        yield Client(reader, writer)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def request(host: str, port: int, path: str, method: str = "GET", extra: str = "") -> bytes:
    authority = f"{host}:{port}"
    return (
        f"{method} http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\n{extra}\r\n".encode()
    )


def get_a(net: Net, path: str, extra: str = "") -> bytes:
    return request("127.0.0.1", net.a.port, path, extra=extra)


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


# --- a refused target behind an allowed one on the same connection ------------------------------


@pytest.mark.parametrize(
    "target",
    ["refused-port", "deny-list-name", "metadata", "loopback-name-on-refused-port"],
)
async def test_a_refused_target_after_a_kept_exchange_is_refused_and_reported_once(
    target: str,
) -> None:
    async with open_net() as net, client(net) as c:
        refused = {
            "refused-port": ("127.0.0.1", net.b.port),
            "deny-list-name": (DENY_NAME, net.a.port),
            "metadata": ("169.254.169.254", 80),
            "loopback-name-on-refused-port": (LOOPBACK_NAME, net.b.port),
        }[target]
        await c.send(get_a(net, "/one") + request(*refused, "/two") + get_a(net, "/three"))
        assert await c.response() == (200, b"ok|/one")
        status, body = await c.response()
        rest = await c.rest()
        await settle()
    assert status == 403, body
    assert rest == b""
    assert net.a.requests == [b"/one"] and net.b.received == []
    assert all(b"/two" not in raw and b"/three" not in raw for raw in net.a.received)
    (refusal,) = net.refusals
    assert refusal.port == refused[1]


async def test_a_live_removal_refuses_the_next_request_on_a_kept_connection() -> None:
    async with open_net() as net, client(net) as c:
        await c.send(request(LOOPBACK_NAME, net.a.port, "/one"))
        assert await c.response() == (200, b"ok|/one")
        # The upstream is kept for the name; the name is removed before the next request.
        net.proxies.set_allowlist(net.allowlist(f"127.0.0.1:{net.b.port}"))
        await c.send(request(LOOPBACK_NAME, net.a.port, "/two"))
        status, body = await c.response()
        await settle()
    assert status == 403, body
    assert net.a.requests == [b"/one"] and b"/two" not in net.a.received[0]
    (refusal,) = net.refusals
    assert (refusal.host, refusal.port) == (LOOPBACK_NAME, net.a.port)


async def test_a_connect_on_a_kept_connection_is_decided_alone_and_dials_anew() -> None:
    async with open_net() as net, client(net) as c:
        await c.send(get_a(net, "/one"))
        assert await c.response() == (200, b"ok|/one")
        authority = f"127.0.0.1:{net.b.port}"
        await c.send(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        refused = await c.rest()
        await settle()
    assert refused.startswith(b"HTTP/1.1 403 "), refused[:80]
    assert net.b.received == [] and len(net.refusals) == 1

    async with open_net() as net, client(net) as c:
        await c.send(get_a(net, "/one"))
        assert await c.response() == (200, b"ok|/one")
        authority = f"127.0.0.1:{net.a.port}"
        tunnelled = get_a(net, "/tunnel")
        await c.send(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = await c.reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 "), head
        await c.send(tunnelled)
        await asyncio.wait_for(net.a.closed[0].wait(), 30)  # the kept upstream was closed
        while len(net.a.targets) < 2 or not net.a.targets[1]:
            await asyncio.sleep(0.01)
        await settle()
    # The tunnel is a connection of its own: the kept one carried only /one.
    assert net.a.targets[0] == [b"/one"] and tunnelled not in net.a.received[0]
    assert net.a.targets[1] == [b"http://" + authority.encode() + b"/tunnel"]
    assert net.refusals == []


# --- one request decided for another ------------------------------------------------------------


async def test_a_body_sent_after_an_early_final_response_is_never_a_request() -> None:
    # Expect: 100-continue, and the upstream answers at the head without waiting for the body.
    async with open_net(Upstream(at_head=True)) as net, client(net) as c:
        hidden = request("127.0.0.1", net.b.port, "/hidden") + get_a(net, "/hidden-a")
        head = request(
            "127.0.0.1",
            net.a.port,
            "/upload",
            method="POST",
            extra=f"Expect: 100-continue\r\nContent-Length: {len(hidden)}\r\n",
        )
        await c.send(head)
        status, body = await c.response(b"POST")
        assert (status, body) == (200, b"ok|/upload")
        with contextlib.suppress(ConnectionError):
            await c.send(hidden)  # the body the upstream never waited for
        rest = await c.rest()
        await settle()
    # The body is the POST's body (or dropped); never a request of its own to anyone.
    assert net.b.received == []
    assert net.a.requests == [b"/upload"], net.a.targets
    assert b"ok|/hidden" not in rest
    assert net.refusals == []


async def answer_switch(method: bytes, target: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\n\r\n" + ok(b"/from-the-switched-protocol")
    )
    await writer.drain()


@pytest.mark.parametrize("upstream_switches", [True, False], ids=["101", "200"])
async def test_an_upgrade_is_never_relayed_raw(upstream_switches: bool) -> None:
    a = Upstream(answer=answer_switch) if upstream_switches else Upstream()
    async with open_net(a) as net, client(net) as c:
        upgrade = get_a(net, "/ws", "Connection: Upgrade\r\nUpgrade: websocket\r\n")
        behind = request("127.0.0.1", net.b.port, "/behind")
        await c.send(upgrade + behind)
        reply = await c.rest()
        await settle()
    assert net.b.received == []
    (raw,) = net.a.received
    assert b"upgrade" not in raw.lower()  # never forwarded
    assert behind not in raw and net.a.requests == [b"/ws"]
    if upstream_switches:
        assert reply.startswith(b"HTTP/1.1 502 "), reply[:80]
        assert b"from-the-switched-protocol" not in reply
        assert net.refusals == []
    else:
        # A plain answer: the request behind it is read as a request, and refused alone.
        assert reply.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 403 " in reply, reply
        (refusal,) = net.refusals
        assert refusal.port == net.b.port


def answer_bodied(status: bytes) -> Answer:
    """A response that carries a body where there is none (HEAD, 204, 304), in the same write:
    the body is another whole response."""

    async def answer(method: bytes, target: bytes, writer: asyncio.StreamWriter) -> None:
        if target == b"/first":
            writer.write(
                b"HTTP/1.1 " + status + b"\r\nContent-Length: 41\r\n\r\n"
                b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil"
            )
        else:
            writer.write(ok(target))
        await writer.drain()

    return answer


@pytest.mark.parametrize(
    ("method", "status"),
    [("HEAD", b"200 OK"), ("GET", b"204 No Content"), ("GET", b"304 Not Modified")],
    ids=["head", "204", "304"],
)
async def test_a_body_where_there_is_none_never_answers_the_next_request(
    method: str, status: bytes
) -> None:
    async with open_net(Upstream(answer=answer_bodied(status))) as net, client(net) as c:
        await c.send(request("127.0.0.1", net.a.port, "/first", method=method))
        first_status, first_body = await c.response(method.encode())
        assert first_status == int(status[:3]) and first_body == b""
        await c.send(get_a(net, "/second"))
        second = await c.response()
        await settle()
    assert second == (200, b"ok|/second"), second
    # The second request went on a new upstream connection, never behind the stray bytes.
    assert net.a.targets == [[b"/first"], [b"/second"]]


# --- memory and descriptors ---------------------------------------------------------------------


async def send_until_stalled(writer: asyncio.StreamWriter, limit: int, stall_s: float) -> int:
    """Write until `limit` bytes went or the peer stopped taking them; the count written."""
    chunk = b"x" * MiB
    written = 0
    with contextlib.suppress(TimeoutError, ConnectionError):
        while written < limit:
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), stall_s)
            written += len(chunk)
    return written


@dataclass
class Endless:
    written: list[int] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    async def answer(self, method: bytes, target: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (MiB, b"y" * MiB)
        total = 0
        with contextlib.suppress(TimeoutError, ConnectionError):
            while total < 512 * MiB:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 3)
                total += MiB
        self.written.append(total)
        self.done.set()


async def test_a_response_that_keeps_sending_to_a_client_that_does_not_read_is_not_buffered() -> (
    None
):
    endless = Endless()
    async with open_net(Upstream(answer=endless.answer)) as net, client(net) as c:
        await c.send(get_a(net, "/endless"))  # and never read
        await asyncio.wait_for(endless.done.wait(), 120)
    # What the upstream could write is what the sockets' buffers hold, not what it offered.
    (written,) = endless.written
    assert written < 64 * MiB, written


async def answer_never(method: bytes, target: bytes, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(3600)  # holds the connection and reads no more of the body


async def test_a_request_body_that_keeps_coming_to_an_upstream_that_does_not_read_is_bounded() -> (
    None
):
    async with open_net(Upstream(answer=answer_never, at_head=True)) as net, client(net) as c:
        head = request(
            "127.0.0.1",
            net.a.port,
            "/upload",
            method="POST",
            extra="Transfer-Encoding: chunked\r\nExpect: 100-continue\r\n",
        )
        await c.send(head)
        written = await send_until_stalled(c.writer, 512 * MiB, 3)
    assert written < 64 * MiB, written


async def answer_endless_head(method: bytes, target: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\n")
    await send_until_stalled(writer, 512 * MiB, 3)


async def test_an_endless_response_head_ends_the_exchange() -> None:
    async with open_net(Upstream(answer=answer_endless_head)) as net, client(net) as c:
        await c.send(get_a(net, "/head"))
        reply = await c.rest()
        await asyncio.wait_for(net.a.closed[0].wait(), 60)
    assert reply.startswith(b"HTTP/1.1 502 "), reply[:80]
    assert len(reply) < 4096


async def test_kept_connections_are_bounded_and_each_holds_one_upstream() -> None:
    limit = 4
    async with open_net(limits=ProxyLimits(max_connections=limit)) as net:
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(client(net)) for _ in range(limit)]
            for number, c in enumerate(clients):
                await c.send(get_a(net, f"/{number}"))
                assert await c.response() == (200, f"ok|/{number}".encode())
            # Every slot is held by a kept connection: one more is closed at once, unread.
            async with client(net) as extra:
                with contextlib.suppress(ConnectionError):
                    await extra.send(get_a(net, "/extra"))
                assert await extra.rest() == b""
            # Each kept connection moves to another upstream: the one it held is closed first.
            for number, c in enumerate(clients):
                await c.send(request(LOOPBACK_NAME, net.a.port, f"/again-{number}"))
                assert await c.response() == (200, f"ok|/again-{number}".encode())
            for closed in net.a.closed[:limit]:
                await asyncio.wait_for(closed.wait(), 30)
            assert len(net.a.received) == 2 * limit
        # The clients left: every upstream the proxy held is closed.
        for closed in net.a.closed:
            await asyncio.wait_for(closed.wait(), 30)
    assert b"/extra" not in b"".join(net.a.received)
    assert net.refusals == []


# --- the same through a real sandbox ------------------------------------------------------------

PIPELINED = r"""
import socket, sys
host_a, host_d, port, marker = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].encode()
port_d = int(sys.argv[5]) if len(sys.argv) > 5 else port
def get(host, path, port=port):
    return f"GET http://{host}:{port}{path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
def rest(s):
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data
s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
s.sendall(get(host_a, "/one") + get(host_d, "/two", port_d) + get(host_a, "/three"))
sys.stdout.write(rest(s).decode("latin-1") + "\n--\n")
s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
s.sendall(get(host_a, "/four"))
head = b""
while marker not in head:
    chunk = s.recv(65536)
    if not chunk:
        break
    head += chunk
s.sendall(f"CONNECT {host_d}:{port_d} HTTP/1.1\r\nHost: {host_d}:{port_d}\r\n\r\n".encode())
sys.stdout.write((head + rest(s)).decode("latin-1"))
"""


async def test_in_a_sandbox_a_refused_host_on_a_kept_connection_is_one_violation(
    lab: Lab,
) -> None:
    up = lab.upstream
    handle = lab.launch(egressAllowlist=[ALLOWED, "127.0.0.1"])
    result = await run_collect(
        handle,
        [PY, "-c", PIPELINED, ALLOWED, DENIED, str(up.port), up.marker],
        timeout_s=RUN_TIMEOUT_S,
    )
    text = output(result)
    assert result.exit_code == 0, text
    first, _, second = text.partition("\n--\n")
    assert first.count(up.marker) == 1 and "HTTP/1.1 403 " in first, first
    assert second.count(up.marker) == 1 and "HTTP/1.1 403 " in second, second
    # Only the allowed requests reached the upstream; each refusal is one violation.
    assert up.seen == [f"{ALLOWED}:{up.port}"] * 2
    assert_violations(handle, [(DENIED, up.port), (DENIED, up.port)])


# --- the microVM pool's spare QEMU ---------------------------------------------------------------


def vm_pool() -> VmPool:
    pool = shared_runtime().pool
    assert pool is not None
    return pool


def our_vm_processes() -> list[int]:
    """Host processes of any VM directory of this test process (QEMU names its own)."""
    return host_pids_with(f"/{VM_DIR_PREFIX}-{os.getpid()}-")


def vm_bind(path: pathlib.Path) -> list[dict[str, object]]:
    return [{"hostPath": str(path), "guestPath": "/work"}]


async def test_a_spare_is_not_taken_once_its_share_path_is_a_symlink_elsewhere(
    tmp_path: pathlib.Path,
) -> None:
    work, moved, other = tmp_path / "work", tmp_path / "moved", tmp_path / "other"
    work.mkdir()
    other.mkdir()
    (work / "old-file").write_text("x")
    (other / "other-file").write_text("x")
    m = vm_manager(tmp_path)
    try:
        await vm_launch(m, bindMounts=vm_bind(work))
        spare = vm_pool()._spare
        assert spare is not None
        async with asyncio.timeout(60):
            await asyncio.shield(spare.up)
        # The path the spare bound now leads elsewhere: what the host has there is `other`.
        work.rename(moved)
        work.symlink_to(other)
        try:
            handle = await vm_launch(m, bindMounts=vm_bind(work))
        except CcServerError:
            return  # a bind through a symlink is refused: nothing runs
        # The bind is the symlink's target (the spec resolves it): another key than the spare's.
        listed = (await run_collect(handle, ["ls", "/work"])).stdout
        assert listed == b"other-file\n", listed
        assert not handle.from_spare and handle.run_dir != spare.run_dir
        assert wait_until_gone(str(spare.run_dir), 10) == []
    finally:
        await m.aclose()


@pytest.mark.parametrize("delay", [0.0, 0.01, 0.05, 0.2, "ready", "spare-starting"])
async def test_closing_the_runtime_mid_start_leaves_no_qemu(
    tmp_path: pathlib.Path, delay: float | str
) -> None:
    m = vm_manager(tmp_path)
    try:
        handle = m.launch(
            parse_spec({"sessionId": vm_unique("mid"), "workspaceId": "ws"}),
            backend=SandboxBackend.MICROVM,
        )
        if delay == "ready":
            await handle.ready()
        elif delay == "spare-starting":
            await handle.ready()
            spare = vm_pool()._spare
            assert spare is not None
            while spare.inner_pid is None and not spare.up.done():
                await asyncio.sleep(0)
        else:
            assert isinstance(delay, float)
            await asyncio.sleep(delay)
    finally:
        await m.aclose()
    # Whatever was starting (the session's QEMU, the spare's) is gone with the runtime's close,
    # and nothing starts after it.
    assert wait_until_gone(f"/{VM_DIR_PREFIX}-{os.getpid()}-", 10) == []
    for _ in range(20):
        await asyncio.sleep(0.05)
    assert vm_pool()._spare is None
    assert our_vm_processes() == []


# --- the same through the CLI (in-process and its daemon), as root and as an unprivileged user --


@pytest.mark.parametrize("module", ["cc_server.cli", "cc_server.cli_client"])
@pytest.mark.parametrize("who", ["server-user", "unprivileged"])
def test_through_the_cli_a_refused_port_on_a_kept_connection_is_one_violation(
    module: str, who: str, other_user: OtherUser, user_dir: pathlib.Path
) -> None:
    runtime = user_dir / "run"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, other_user.uid, other_user.gid)
    cwd = user_dir / "cwd"
    cwd.mkdir()
    os.chown(cwd, other_user.uid, other_user.gid)
    with open_upstream() as a, open_upstream() as b:
        command = [
            "run", "--allow-domain", f"127.0.0.1:{a.port}", "--",
            "/usr/bin/python3", "-c", PIPELINED, "127.0.0.1", "127.0.0.1", str(a.port),
            a.marker, str(b.port),
        ]  # fmt: skip
        if who == "unprivileged":
            argv = other_user.python("-m", module, *command)
            env = other_user.env({"XDG_RUNTIME_DIR": str(runtime)})
        else:
            argv = [sys.executable, "-m", module, *command]
            env = {
                "PATH": os.environ["PATH"],
                "HOME": str(user_dir),
                "XDG_RUNTIME_DIR": str(runtime),
            }
        try:
            result = subprocess.run(
                argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                text=True, timeout=120, check=False,
            )  # fmt: skip
        finally:
            for pid in daemon_pids(runtime):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        assert result.returncode == 0, result
        first, _, second = result.stdout.partition("\n--\n")
        assert first.count(a.marker) == 1 and "HTTP/1.1 403 " in first, result
        assert second.count(a.marker) == 1 and "HTTP/1.1 403 " in second, result
        assert a.seen == [f"127.0.0.1:{a.port}"] * 2 and b.seen == []
    violations = [line for line in result.stderr.splitlines() if "violation" in line]
    assert len(violations) == 2, result.stderr
    assert all(f"127.0.0.1:{b.port}" in line for line in violations), violations


async def test_a_resume_from_the_spare_gets_its_own_state_never_another_sessions(
    tmp_path: pathlib.Path,
) -> None:
    m = vm_manager(tmp_path)
    try:
        x, y = await vm_launch(m), await vm_launch(m)
        for handle, name in ((x, "x"), (y, "y")):
            wrote = await run_collect(handle, ["/bin/sh", "-c", f"echo {name} > /tmp/who"])
            assert wrote.exit_code == 0, wrote
        x_state, y_state = x.run_dir, y.run_dir
        assert x_state is not None and y_state is not None
        await x.suspend()
        await y.suspend()
        await x.resume()  # the spare (a resume maps the template, as a restore); then a spare
        spare = vm_pool()._spare  # for a resume with the same shares: y's
        assert spare is not None and spare.key.ram == (await vm_pool().template()).ram
        async with asyncio.timeout(60):
            await asyncio.shield(spare.up)
        await y.resume()
        assert y.from_spare and y.run_dir == spare.run_dir  # so the check below can fail
        for handle, name in ((x, "x"), (y, "y")):
            read = await run_collect(handle, ["cat", "/tmp/who"])
            assert read.stdout == f"{name}\n".encode(), (name, read)
        # Each suspended state is gone once its session is warm again.
        async with asyncio.timeout(30):
            while x_state.exists() or y_state.exists():
                await asyncio.sleep(0.02)
    finally:
        await m.aclose()


async def test_an_approval_asked_for_one_request_is_not_reused_by_the_next_on_the_connection() -> (
    None
):
    # Ask mode: the first request to an unlisted name is approved, the second (same name and
    # port, the kept upstream idle) is asked about again and refused.
    a = Upstream()
    asked: list[EgressAsk] = []

    async def asker(ask: EgressAsk) -> AskAnswer:
        asked.append(ask)
        return AskAnswer(allowed=len(asked) == 1, reason="refused the second time")

    async with contextlib.AsyncExitStack() as stack:
        server = await asyncio.start_server(a.serve, "127.0.0.1", 0)
        await stack.enter_async_context(server)
        a.port = server.sockets[0].getsockname()[1]
        refusals: list[EgressRefused] = []
        params = ProxyParams(
            session_id="rnet-ask",
            allowlist=Allowlist(patterns=parse_rules("test", ["127.0.0.1"], "test")),
            on_refused=refusals.append,
            resolver=fixed_resolver,
            ask=asker,
        )
        proxies = await stack.enter_async_context(open_session_proxies(params))
        net = Net(a, Upstream(), proxies, refusals)
        async with client(net) as c:
            await c.send(request("ask.other.test", a.port, "/one"))
            assert await c.response() == (200, b"ok|/one")
            await c.send(request("ask.other.test", a.port, "/two"))
            status, body = await c.response()
            await settle()
    assert status == 403, body
    assert [(ask.host, ask.port) for ask in asked] == [("ask.other.test", a.port)] * 2
    assert a.requests == [b"/one"] and all(b"/two" not in raw for raw in a.received)
    (refusal,) = refusals
    assert (refusal.host, refusal.port) == ("ask.other.test", a.port)


async def test_no_process_of_the_spare_runs_once_the_runtime_is_closed(
    tmp_path: pathlib.Path,
) -> None:
    # QEMU runs under bubblewrap, whose processes die with their parent's death signal: the
    # close must wait for them too, not only for the process it started. Five rounds, since
    # that death is asynchronous.
    for round_number in range(5):
        m = vm_manager(tmp_path / str(round_number))
        try:
            await vm_launch(m)
            spare = vm_pool()._spare
            assert spare is not None
            async with asyncio.timeout(60):
                await asyncio.shield(spare.up)
            assert host_pids_with(str(spare.run_dir))
        finally:
            await m.aclose()
        assert host_pids_with(str(spare.run_dir)) == [], round_number
