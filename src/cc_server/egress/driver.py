"""The asyncio driver of a session's egress proxies: the only I/O in `cc_server.egress`.

One HTTP proxy and one SOCKS5 proxy per session, never shared: TCP listeners on 127.0.0.1 with
ephemeral ports, and optionally the same proxies on two Unix sockets in a private directory (the
sandbox's bridge). Each client connection runs one handshake machine (`http_machine`,
`socks_machine`) through the loop in `proto`'s docstring; a tunnel then hands both sockets to
`relay.relay` (splice on the event loop; see that module for why), while forwarded plain-HTTP
requests go on through the machine, one after another on a kept-alive connection, each
checked on its own; the upstream is kept only when the machine offers it
(`OpenUpstream.reuse`) and it has sent nothing since its last response.

On `CheckEgress` the decision is `guard`'s (pure: the allowlist, then the address guard beyond
it); the driver only does its awaits: it resolves a listed name once when the guard asks
(`Resolve`), holds an unlisted target while someone is asked (ask mode), and dials exactly the
checked answers, in order, never resolving again, so DNS rebinding gains nothing. A name that
does not resolve is an upstream failure (502, SOCKS 0x04), not a violation.

Every refusal is written in-protocol (HTTP 403, SOCKS 0x02) and reported once through
`ProxyParams.on_refused`.

Bounds (`ProxyLimits`): the whole handshake, from accept to `StartRelay` or the first forwarded
request's upstream, has one deadline (reads, writes, resolution and dialling; each connection
attempt is further bounded by the connect timeout, and an attempt cut short by the deadline is
answered as unreachable); a later request's check and dial on a kept-alive connection get a
deadline of their own; a relay, or a forwarding connection, with no byte moved for the idle
timeout is closed; a session holds at most ``max_connections``
client connections, and a client over the limit is closed at once.

Concurrency: a session's listeners and client handlers are tasks in one `asyncio.TaskGroup`;
a tunnel's two directions are loop callbacks that its connection's task waits for (`relay`). The
session's group lives in one named supervisor task that `SessionProxies` holds and `aclose()`
cancels and awaits: `start_session_proxies` must return while the group keeps running, and a
TaskGroup cannot be entered in one task and left in another. That task is the only one created
outside a TaskGroup. An exception in one connection is logged at debug level (logger
``cc_server.egress``) and never reaches another connection or a listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias

from cc_server.backends.peer import PeerRule, ThisProcess, admit_async
from cc_server.egress import sockets
from cc_server.egress.addresses import IPAddress
from cc_server.egress.guard import (
    NOTHING_DENIED,
    NOTHING_NETWORK_OFF,
    Allowed,
    Refused,
    Resolve,
    Unresolvable,
    Verdict,
    check_answers,
    check_target,
    entry_for,
    unresolvable,
)
from cc_server.egress.http_machine import HttpProxyMachine
from cc_server.egress.patterns import Allowlist
from cc_server.egress.proto import (
    NEED_ANY_DATA,
    NEED_DATA,
    NEED_UPSTREAM_DATA,
    UPSTREAM_REFUSED,
    UPSTREAM_UNREACHABLE,
    CheckEgress,
    CloseConnection,
    HandshakeMachine,
    OpenUpstream,
    ProtocolRefused,
    SendToClient,
    SendUpstream,
    StartRelay,
    State,
)
from cc_server.egress.relay import relay
from cc_server.egress.socks_machine import Socks5Machine
from cc_server.errors import EnforcementFailed

__all__ = [
    "NOTHING_DENIED",
    "NOTHING_NETWORK_OFF",
    "AdoptedListener",
    "AskAnswer",
    "Asker",
    "EgressAsk",
    "EgressRefused",
    "ProxyLimits",
    "ProxyParams",
    "Resolver",
    "SessionProxies",
    "TunnelHandler",
    "default_advice",
    "entry_for",
    "open_session_proxies",
    "start_session_proxies",
]

log = logging.getLogger("cc_server.egress")

Protocol: TypeAlias = Literal["http", "socks5"]

HTTP_SOCKET_NAME: Final = "http.sock"
SOCKS_SOCKET_NAME: Final = "socks.sock"
# One read from a client during the handshake. A request head is at most MAX_HEADER_BYTES
# (16 KiB); a machine buffers its limit plus one read.
HANDSHAKE_READ_BYTES: Final = 16 * 1024
# One read from either leg of a forwarded exchange (request and response bodies): few system
# calls for a large body, one chunk buffered per leg while the other side is slow.
EXCHANGE_READ_BYTES: Final = 64 * 1024
# After a refusal: time to write the reply and let the client read it before closing. Closing
# while the client's unread bytes (a request body) are queued would send a reset that can destroy
# the reply in flight, so the driver half-closes and discards up to REFUSAL_DRAIN_BYTES first.
REFUSAL_GRACE_S: Final = 1.0
REFUSAL_DRAIN_BYTES: Final = 256 * 1024
# accept() failed (out of descriptors): wait this long before trying again, instead of spinning.
ACCEPT_BACKOFF_S: Final = 0.1

_UNREACHABLE_ERRNOS: Final = frozenset(
    {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ETIMEDOUT, errno.EHOSTDOWN, errno.ENETDOWN}
)


@dataclass(frozen=True, slots=True, kw_only=True)
class EgressRefused:
    """One refusal, reported to the session (the runtime turns it into a SandboxViolation)."""

    host: str
    """The target: the canonical name or address asked for (the client's spelling if invalid)."""
    port: int
    """The target port."""
    reason: str
    """Why, in one sentence (also in the HTTP 403 body)."""
    suggested_capability: str | None
    """The capability that would have allowed it, from `ProxyParams.suggest`."""
    protocol: Literal["http", "socks5"]
    """Which proxy refused."""
    how_to_allow: str
    """What would allow it, in one phrase (the advice of the HTTP 403 body): the setting that
    applies with the entry to add, or why nothing can ("nothing: the deny list wins ...")."""
    raw: str
    """One log line with the details."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EgressAsk:
    """A connection the allowlist does not name, held while someone is asked about it.

    Only a target no entry can be needed for is asked about: a host on the deny list, an
    address the guard refuses (loopback, private, metadata, ...) and a name that resolves to
    one are refused outright, and a session with the network off asks nothing."""

    host: str
    """The canonical name or address asked for."""
    port: int
    """The target port."""
    protocol: Protocol
    """Which proxy holds the connection."""
    kind: Literal["connect", "forward"]
    """A tunnel, or one forwarded plain-HTTP request."""

    @property
    def entry(self) -> str:
        """The allowlist entry that names exactly this target (`host:port`)."""
        return entry_for(self.host, self.port)


@dataclass(frozen=True, slots=True, kw_only=True)
class AskAnswer:
    """What the one asked said: let this connection through, or refuse it and why."""

    allowed: bool
    reason: str = ""
    """Why it is refused (`allowed` false), in one sentence."""


Asker: TypeAlias = Callable[[EgressAsk], Awaitable[AskAnswer]]
"""Holds a connection until it is answered; bounds its own wait (the handshake deadline is
extended by the time it takes)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyLimits:
    """Bounds on every wait and on the number of connections."""

    handshake_timeout_s: float = 10.0
    """The whole handshake, from accept to StartRelay (reads, writes, resolution, dialling)."""
    connect_timeout_s: float = 10.0
    """One connection attempt to one upstream address."""
    idle_timeout_s: float = 300.0
    """A relay with no bytes either way for this long is closed."""
    max_connections: int = 256
    """Client connections per session; over it, new clients are closed at once."""


Resolver: TypeAlias = Callable[[str, int], Awaitable[list[IPAddress]]]
# Serves an allowed tunnel instead of the relay: (client, dialled upstream, early client bytes).
TunnelHandler: TypeAlias = Callable[[socket.socket, socket.socket, bytes], Awaitable[None]]
"""Name, port -> addresses, in the order to dial them."""


def _never_suggest(host: str) -> str | None:
    return None


def default_advice(entry: str) -> str:
    """How to allow a refused target of a session started with an explicit allowlist; `entry`
    is the port-scoped allowlist entry that would allow it (`host:443`, `[2001:db8::1]:8080`)."""
    return (
        f"ask the operator to add {entry} to the session's egressAllowlist "
        f"(cc-server run --allow-domain {entry})"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyParams:
    """What one session's proxies need."""

    session_id: str
    """For task names and log lines."""
    allowlist: Allowlist
    """The session's egress allowlist (its deny list wins)."""
    on_refused: Callable[[EgressRefused], None]
    """Called once per refusal, on the event loop; exceptions are logged and ignored."""
    suggest: Callable[[str], str | None] = _never_suggest
    """The capability that would have allowed a refused host (by its canonical name)."""
    advice: Callable[[str], str] = default_advice
    """How to allow a refused target, given the entry that would allow it (`entry_for`: its
    canonical host or address and the port): the setting that actually applies to this session
    (a dispatch run's is the server's, `egress.operator`)."""
    socket_dir: str | None = None
    """If set, also listen on Unix sockets `http.sock` and `socks.sock` in this directory, which
    must be ours and mode 0700; the sockets are created 0600 and removed by aclose()."""
    unix_peers: PeerRule = field(default_factory=ThisProcess)
    """Whom the Unix sockets serve (backends/peer.py): a native session's own sandboxes
    (`SandboxPeers`); by default only this process (a microVM's link to its guest). Any other
    peer is closed unread, with a log line. The TCP listeners and adopted ones are not asked:
    a sandbox's loopback is reachable from its own network namespace only."""
    listen_tcp: bool = True
    """Listen on 127.0.0.1 TCP too. Any local user can reach a loopback port, so a session whose
    sandbox reaches the proxies through the Unix sockets (Linux) turns this off."""
    resolver: Resolver | None = None
    """Name resolution; None: the loop's getaddrinfo (SOCK_STREAM)."""
    limits: ProxyLimits = ProxyLimits()
    """Timeouts and the connection limit."""
    intercept: Callable[[str, int], TunnelHandler | None] | None = None
    """Asked for each allowed tunnel (the host as the client named it, the port) once it is
    dialled: a handler returned serves it instead of the relay (a dispatch run's model
    credential broker, `dispatch.model_credentials`)."""
    ask: Asker | None = None
    """If set, a target the allowlist does not name is held and asked about (`EgressAsk`)
    instead of refused; the asker can also be set later (`SessionProxies.set_asker`)."""


async def system_resolver(host: str, port: int) -> list[IPAddress]:
    """The loop's getaddrinfo (stream sockets), as addresses in the order it returned them.

    Raises:
        OSError: socket.gaierror when the name does not resolve.
    """
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [
        ipaddress.ip_address(info[4][0])
        for info in infos
        if info[0] in (socket.AF_INET, socket.AF_INET6) and isinstance(info[4][0], str)
    ]


@dataclass(frozen=True, slots=True)
class _Listener:
    sock: socket.socket
    protocol: Protocol
    where: str  # "tcp" or the socket path
    identity: tuple[int, int] | None  # (st_dev, st_ino) of a Unix socket file we created


class AdoptedListener:
    """A listening socket the proxies accept on until `aclose()` (see SessionProxies.adopt)."""

    def __init__(self, sock: socket.socket, task: asyncio.Task[None]) -> None:
        self._sock = sock
        self._task = task
        # The socket is closed once no accept is pending on it any more, however the task ends
        # (this handle closed, the session closed, or a caller cancelled while closing).
        task.add_done_callback(lambda _: sock.close())

    async def aclose(self) -> None:
        """Stop accepting and close the socket; connections already accepted go on. Idempotent.

        If the caller is cancelled while waiting, the closing still completes on the loop.
        """
        self._task.cancel()
        await asyncio.wait([self._task])


class SessionProxies:
    """One HTTP and one SOCKS5 proxy for one session; never shared.

    Made by `start_session_proxies` or `open_session_proxies`.
    """

    http_port: int | None
    """The HTTP proxy's TCP port on 127.0.0.1 (None without ProxyParams.listen_tcp)."""
    socks_port: int | None
    """The SOCKS5 proxy's TCP port on 127.0.0.1 (None without ProxyParams.listen_tcp)."""
    http_socket: str | None
    """The HTTP proxy's Unix socket, when ProxyParams.socket_dir was set."""
    socks_socket: str | None
    """The SOCKS5 proxy's Unix socket, when ProxyParams.socket_dir was set."""

    def __init__(self, params: ProxyParams, listeners: list[_Listener]) -> None:
        self._params = params
        self._listeners = listeners
        self._allowlist = params.allowlist
        self._asker = params.ask
        self._resolver: Resolver = params.resolver or system_resolver
        by_kind = {(lst.protocol, lst.identity is None): lst for lst in listeners}
        tcp_http = by_kind.get(("http", True))
        tcp_socks = by_kind.get(("socks5", True))
        self.http_port = tcp_http.sock.getsockname()[1] if tcp_http else None
        self.socks_port = tcp_socks.sock.getsockname()[1] if tcp_socks else None
        unix_http = by_kind.get(("http", False))
        unix_socks = by_kind.get(("socks5", False))
        self.http_socket = unix_http.where if unix_http else None
        self.socks_socket = unix_socks.where if unix_socks else None
        self._active = 0
        self._served = 0
        self._released = False
        self._group: asyncio.Future[asyncio.TaskGroup] = asyncio.get_running_loop().create_future()
        self._supervisor = asyncio.get_running_loop().create_task(
            self._supervise(), name=f"egress {params.session_id} proxies"
        )
        # However the supervisor ends (even cancelled before it ran), the listeners are closed
        # once no accept is pending on them any more.
        self._supervisor.add_done_callback(lambda _: self._release())

    @property
    def allowlist(self) -> Allowlist:
        """The allowlist the next connection is checked against."""
        return self._allowlist

    def set_allowlist(self, allowlist: Allowlist) -> None:
        """Check every connection from now on against `allowlist` (a connection already past its
        check, a tunnel already open, goes on). The deny list cannot change.

        Raises:
            ValueError: `allowlist` has another deny list than the session's.
        """
        if allowlist.denied != self._params.allowlist.denied:
            raise ValueError("a running session's egress deny list cannot change")
        self._allowlist = allowlist

    def set_asker(self, asker: Asker | None) -> None:
        """Ask about unlisted targets from now on (None: refuse them again)."""
        self._asker = asker

    @property
    def active_connections(self) -> int:
        """Client connections open now (handshaking or relaying)."""
        return self._active

    async def aclose(self) -> None:
        """Close the listeners and every connection, and remove the socket files. Idempotent.

        If the caller is cancelled while waiting, the closing still completes on the loop.
        """
        supervisor = self._supervisor
        supervisor.cancel()
        await asyncio.wait([supervisor])
        self._release()
        if not supervisor.cancelled() and supervisor.exception() is not None:
            log.debug(
                "egress %s: proxies failed",
                self._params.session_id,
                exc_info=supervisor.exception(),
            )

    # The session's task group.

    async def adopt(self, sock: socket.socket, protocol: Protocol, where: str) -> AdoptedListener:
        """Accept on a listening socket someone else made (a sandbox's loopback listener, handed
        over by its launcher), as the session's `protocol` proxy, until the returned handle is
        closed. The socket is ours from here on: closed with the handle, or now on failure.

        Raises:
            EnforcementFailed: the proxies are closed.
        """
        try:
            either: list[asyncio.Future[object]] = [self._group, self._supervisor]  # type: ignore[list-item]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if self._supervisor.done() or not self._group.done():
                raise EnforcementFailed(
                    f"the egress proxies of session {self._params.session_id!r} are closed"
                )
            tg = self._group.result()
            sock.setblocking(False)
            listener = _Listener(sock, protocol, where, None)
            task = tg.create_task(
                self._accept(listener, tg),
                name=f"egress {self._params.session_id} accept {protocol} {where}",
            )
        except BaseException:
            sock.close()
            raise
        return AdoptedListener(sock, task)

    async def _supervise(self) -> None:
        async with asyncio.TaskGroup() as tg:
            self._group.set_result(tg)
            for listener in self._listeners:
                tg.create_task(
                    self._accept(listener, tg),
                    name=f"egress {self._params.session_id} accept {listener.protocol} "
                    f"{listener.where}",
                )

    async def _accept(self, listener: _Listener, tg: asyncio.TaskGroup) -> None:
        """Accept clients until cancelled. The listener stays registered with the loop for as
        long as this runs (the loop's sock_accept registers and removes it for every client),
        and each wake-up accepts every client that is waiting."""
        loop = asyncio.get_running_loop()
        fd = listener.sock.fileno()
        wake: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not wake.done():
                wake.set_result(None)

        loop.add_reader(fd, readable)
        try:
            while True:
                try:
                    client, _ = listener.sock.accept()
                except (BlockingIOError, InterruptedError):
                    await wake
                    wake = loop.create_future()
                    continue
                except OSError as exc:
                    log.debug("egress %s: accept failed: %s", self._params.session_id, exc)
                    await asyncio.sleep(ACCEPT_BACKOFF_S)
                    continue
                self._admit(client, listener, tg)
        finally:
            loop.remove_reader(fd)

    def _admit(self, client: socket.socket, listener: _Listener, tg: asyncio.TaskGroup) -> None:
        """Serve a new client in the session's group, or close it at once over the limit."""
        if self._active >= self._params.limits.max_connections:
            log.debug(
                "egress %s: %d connections open (the limit); closing a new %s client",
                self._params.session_id,
                self._active,
                listener.protocol,
            )
            client.close()
            return
        try:
            client.setblocking(False)
        except OSError:
            client.close()
            return
        self._served += 1
        self._active += 1
        try:
            tg.create_task(
                self._serve(client, listener.protocol, self._served, listener.identity),
                name=f"egress {self._params.session_id} {listener.protocol} #{self._served}",
            )
        except BaseException:
            self._active -= 1
            client.close()
            raise

    async def _serve(
        self,
        client: socket.socket,
        protocol: Protocol,
        number: int,
        unix: tuple[int, int] | None = None,
    ) -> None:
        label = f"egress {self._params.session_id} {protocol} #{number}"
        try:
            if unix is not None and not await admit_async(
                client, self._params.unix_peers, what=label
            ):
                return  # not this session's sandbox: closed unread
            await _Connection(self, client, protocol, label).run()
        except Exception:
            log.debug("%s: failed", label, exc_info=True)
        finally:
            self._active -= 1
            client.close()

    def _release(self) -> None:
        """Close the listeners and remove our socket files (only once no accept is pending)."""
        if self._released:
            return
        self._released = True
        for listener in self._listeners:
            listener.sock.close()
            if listener.identity is not None:
                sockets.remove_socket_file(listener.where, listener.identity)


class _Connection:
    """One client connection: the handshake, then the relay."""

    def __init__(
        self, proxies: SessionProxies, client: socket.socket, protocol: Protocol, label: str
    ) -> None:
        self._proxies = proxies
        self._params = proxies._params
        self._client = client
        self._protocol: Protocol = protocol
        self._label = label
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + self._params.limits.handshake_timeout_s
        self._upstream: socket.socket | None = None
        self._addresses: tuple[IPAddress, ...] = ()  # checked: the only ones dialled
        self._tunnel: tuple[str, int] | None = None  # (host as named, port) of an allowed tunnel
        self._upstream_for: tuple[str, int] = ("", 0)  # (lower-case host, port) it was dialled for
        self._kept = False  # a forwarded exchange began: the connection may carry more requests
        # The guard's last answer for a listed forward target, with the allowlist it was made
        # by and the upstream open then: the same target's next request on that upstream under
        # that allowlist gets it again without asking (a change of the allowlist is another
        # object; an answer given by asking is never kept).
        self._kept_verdict: tuple[Allowlist, socket.socket, str, int, Allowed] | None = None
        if client.family in (socket.AF_INET, socket.AF_INET6):
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def run(self) -> None:
        machine: HandshakeMachine = (
            HttpProxyMachine() if self._protocol == "http" else Socks5Machine()
        )
        try:
            while True:
                event = machine.next_event()
                if event is NEED_DATA:
                    machine.receive_data(await self._recv())
                elif event is NEED_UPSTREAM_DATA:
                    machine.receive_upstream_data(await self._recv_upstream())
                elif event is NEED_ANY_DATA:
                    await self._recv_any(machine)
                elif isinstance(event, SendToClient):
                    await self._send(event.data)
                elif isinstance(event, SendUpstream):
                    await self._send_upstream(event.data)
                elif isinstance(event, CheckEgress):
                    if not await self._answer_check(machine, event):
                        return
                elif isinstance(event, OpenUpstream):
                    if not await self._answer_open(machine, event):
                        return
                elif isinstance(event, StartRelay):
                    return await self._start_relay(event)
                elif isinstance(event, CloseConnection):
                    log.debug("%s: closed: %s", self._label, event.reason)
                    return await self._close_with(event.reply)
                else:
                    assert isinstance(event, ProtocolRefused)
                    log.debug("%s: refused: %s", self._label, event.reason)
                    return await self._close_with(event.reply)
        except TimeoutError:
            log.debug("%s: timed out", self._label)
        finally:
            if self._upstream is not None:
                self._upstream.close()

    async def _answer_check(self, machine: HandshakeMachine, event: CheckEgress) -> bool:
        """Decide `event` and answer the machine; whether the handshake goes on."""
        if self._kept:  # a later request on a kept-alive connection: its own handshake deadline
            self._deadline = self._loop.time() + self._params.limits.handshake_timeout_s
        verdict = await self._check(event)
        if isinstance(verdict, Refused):
            how_to_allow = self._report(event, verdict)
            await self._close_with(machine.decide(False, verdict.reason, how_to_allow))
            return False
        if isinstance(verdict, Unresolvable):
            log.debug("%s: %s: %s", self._label, event.host, verdict.error)
            await self._close_with(machine.unreachable(UPSTREAM_UNREACHABLE))
            return False
        await self._send(machine.decide(True))
        self._addresses = verdict.addresses
        self._tunnel = (event.host, event.port) if event.kind == "connect" else None
        return True

    async def _answer_open(self, machine: HandshakeMachine, event: OpenUpstream) -> bool:
        """Dial the checked addresses (or keep the upstream the machine may reuse) and answer
        the machine; whether the handshake goes on."""
        if event.reuse and self._upstream is not None and _idle(self._upstream):
            await self._send(machine.upstream_result(True, reused=True))
            return True
        if self._upstream is not None:  # dialled for another target, or not idle: never reused
            self._upstream.close()
            self._upstream = None
        self._upstream, error = await self._dial(self._addresses, event.port)
        reply = machine.upstream_result(self._upstream is not None, error)
        if self._upstream is None:
            log.debug("%s: %s:%d: %s", self._label, event.host, event.port, error)
            await self._close_with(reply)
            return False
        self._upstream_for = (event.host.lower(), event.port)
        self._kept = machine.state is State.EXCHANGE
        await self._send(reply)
        return True

    async def _start_relay(self, event: StartRelay) -> None:
        """The handshake is over: serve the tunnel (a handler, or the relay) until it ends."""
        upstream = self._upstream
        assert upstream is not None
        intercept = self._params.intercept
        handler = intercept(*self._tunnel) if intercept and self._tunnel else None
        if handler is not None:
            return await handler(self._client, upstream, event.to_upstream)
        result = await relay(
            self._client,
            upstream,
            to_upstream=event.to_upstream,
            to_client=event.to_client,
            idle_timeout_s=self._params.limits.idle_timeout_s,
            name=self._label,
        )
        log.debug(
            "%s: relay %s (%d bytes up, %d down) %s",
            self._label,
            result.outcome.value,
            result.to_upstream_bytes,
            result.to_client_bytes,
            result.error,
        )

    # Client and upstream I/O, bounded by the handshake's deadline (on a kept-alive connection,
    # past its first request's handshake, by the idle timeout from the last byte moved).

    def _due(self) -> float:
        if self._kept:
            self._deadline = self._loop.time() + self._params.limits.idle_timeout_s
        return self._deadline

    async def _recv(self) -> bytes:
        try:  # the request is usually there already: no timeout scope, no wait
            return self._client.recv(HANDSHAKE_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            pass
        async with asyncio.timeout_at(self._due()):
            return await self._loop.sock_recv(self._client, HANDSHAKE_READ_BYTES)

    async def _recv_upstream(self) -> bytes:
        upstream = self._upstream
        assert upstream is not None  # an exchange has its upstream
        try:
            return upstream.recv(EXCHANGE_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            pass
        async with asyncio.timeout_at(self._due()):
            return await self._loop.sock_recv(upstream, EXCHANGE_READ_BYTES)

    async def _recv_any(self, machine: HandshakeMachine) -> None:
        """Feed the machine one chunk from whichever leg is readable first."""
        upstream = self._upstream
        assert upstream is not None  # an exchange has its upstream
        while True:
            for sock, feed in (
                (upstream, machine.receive_upstream_data),
                (self._client, machine.receive_data),
            ):
                try:
                    data = sock.recv(EXCHANGE_READ_BYTES)
                except (BlockingIOError, InterruptedError):
                    continue
                feed(data)
                return
            async with asyncio.timeout_at(self._due()):
                await _either_readable(self._loop, self._client, upstream)

    async def _send(self, data: bytes) -> None:
        await self._send_to(self._client, data)

    async def _send_upstream(self, data: bytes) -> None:
        assert self._upstream is not None  # an exchange has its upstream
        await self._send_to(self._upstream, data)

    async def _send_to(self, sock: socket.socket, data: bytes) -> None:
        if not data:
            return
        try:  # a short write usually fits at once: no timeout scope, no wait
            sent = sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(data):
            async with asyncio.timeout_at(self._due()):
                await self._loop.sock_sendall(sock, memoryview(data)[sent:])

    async def _close_with(self, reply: bytes) -> None:
        """Write a final reply, half-close, and let the client read it before the close."""
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(REFUSAL_GRACE_S):
                if reply:
                    await self._loop.sock_sendall(self._client, reply)
                self._client.shutdown(socket.SHUT_WR)
                drained = 0
                while drained < REFUSAL_DRAIN_BYTES:
                    chunk = await self._loop.sock_recv(self._client, HANDSHAKE_READ_BYTES)
                    if not chunk:
                        break
                    drained += len(chunk)

    # The decision (`guard`), its awaits, and the dial.

    async def _check(self, event: CheckEgress) -> Verdict:
        """The guard's verdict on `event`: resolved if it asks, asked about if unlisted."""
        allowlist = self._proxies.allowlist
        kept = self._kept_verdict
        if (
            kept is not None
            and kept[0] is allowlist
            and kept[1] is self._upstream
            and kept[2] == event.host
            and kept[3] == event.port
            and event.kind == "forward"
        ):
            return kept[4]
        asker = self._proxies._asker
        first = check_target(allowlist, event.host, event.port, ask=asker is not None)
        if isinstance(first, Resolve):
            peer = self._reusable_peer(event)
            verdict = (
                await self._resolve(allowlist, first)
                if peer is None
                else check_answers(allowlist, first, [peer])
            )
        else:
            verdict = first
        if not isinstance(verdict, Allowed):
            return verdict
        if verdict.ask:
            return verdict if asker is None else await self._ask(asker, event, verdict)
        if event.kind == "forward" and self._upstream is not None:
            self._kept_verdict = (allowlist, self._upstream, event.host, event.port, verdict)
        return verdict

    def _reusable_peer(self, event: CheckEgress) -> IPAddress | None:
        """The address of the open upstream, if it was dialled for this forwarded target: the
        name is checked against it, not resolved again (the machine reuses it if it is idle)."""
        upstream = self._upstream
        if upstream is None or event.kind != "forward":
            return None
        if self._upstream_for != (event.host.lower(), event.port):
            return None
        try:
            return ipaddress.ip_address(upstream.getpeername()[0])
        except (OSError, ValueError):
            return None

    async def _resolve(self, allowlist: Allowlist, resolve: Resolve) -> Verdict:
        """Resolve a listed name once, within the handshake's deadline, and check the answers."""
        try:
            async with asyncio.timeout_at(self._deadline):
                answers = await self._proxies._resolver(resolve.name, resolve.port)
        except Exception as exc:  # any resolver failure is an upstream failure
            return unresolvable(resolve.name, exc)
        return check_answers(allowlist, resolve, answers)

    async def _ask(self, asker: Asker, event: CheckEgress, verdict: Allowed) -> Verdict:
        """Hold an unlisted target (one an entry could allow) until the one asked answers."""
        ask = EgressAsk(
            host=verdict.host, port=event.port, protocol=self._protocol, kind=event.kind
        )
        started = self._loop.time()
        try:
            answer = await asker(ask)
        except Exception as exc:  # a failed asker refuses; it never lets anything through
            answer = AskAnswer(allowed=False, reason=f"asking failed: {exc!r}")
        self._deadline += self._loop.time() - started  # the wait is not the handshake's
        if answer.allowed:
            return verdict
        reason = answer.reason or f"{ask.entry} was refused when asked"
        return Refused(host=verdict.host, reason=reason, entry=ask.entry)

    async def _dial(
        self, addresses: tuple[IPAddress, ...], port: int
    ) -> tuple[socket.socket | None, str]:
        """Connect to the first checked address that answers; (None, error kind) if none."""
        error = UPSTREAM_UNREACHABLE
        for address in addresses:
            remaining = self._deadline - self._loop.time()
            if remaining <= 0:
                return None, UPSTREAM_UNREACHABLE
            family = socket.AF_INET if address.version == 4 else socket.AF_INET6
            sock = socket.socket(family, socket.SOCK_STREAM)
            connected = False
            try:
                sock.setblocking(False)
                if not sockets.connected_at_once(sock, (str(address), port)):
                    timeout_s = min(self._params.limits.connect_timeout_s, remaining)
                    async with asyncio.timeout(timeout_s):
                        await sockets.connect_done(self._loop, sock)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                connected = True
                return sock, ""
            except ConnectionRefusedError:
                error = UPSTREAM_REFUSED
            except TimeoutError:
                error = UPSTREAM_UNREACHABLE
            except OSError as exc:
                error = (
                    UPSTREAM_UNREACHABLE
                    if exc.errno in _UNREACHABLE_ERRNOS
                    else f"connect to {address} failed: {exc.strerror or exc}"
                )
            finally:
                if not connected:
                    sock.close()
        return None, error

    def _report(self, event: CheckEgress, refused: Refused) -> str:
        """Report a refusal through on_refused; return the advice for the client's reply."""
        params = self._params
        capability = _suggest(params, refused.host)
        how_to_allow = refused.nothing if refused.entry is None else params.advice(refused.entry)
        if capability is not None:
            how_to_allow += f"; or give the agent the {capability} capability"
        raw = (
            f"egress refused: session={params.session_id} protocol={self._protocol} "
            f"kind={event.kind} target={event.host}:{event.port} host={refused.host} "
            f"reason={refused.reason} to_allow={how_to_allow}"
        )
        raw = " ".join(raw.split())  # one line, whatever the reason says
        log.debug("%s: %s", self._label, raw)
        refusal = EgressRefused(
            host=refused.host,
            port=event.port,
            reason=refused.reason,
            suggested_capability=capability,
            protocol=self._protocol,
            how_to_allow=how_to_allow,
            raw=raw,
        )
        try:
            params.on_refused(refusal)
        except Exception:
            log.debug("%s: on_refused failed", self._label, exc_info=True)
        return how_to_allow


def _idle(upstream: socket.socket) -> bool:
    """Whether a kept upstream has sent nothing (not even its EOF) since its last response."""
    try:
        upstream.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    return False  # bytes nobody asked for, or the upstream closed


async def _either_readable(
    loop: asyncio.AbstractEventLoop, first: socket.socket, second: socket.socket
) -> None:
    """Wait until one of two sockets is readable."""
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    fds = (first.fileno(), second.fileno())
    for fd in fds:
        loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        for fd in fds:
            loop.remove_reader(fd)


def _suggest(params: ProxyParams, host: str) -> str | None:
    try:
        return params.suggest(host)
    except Exception:
        log.debug("egress %s: suggest(%r) failed", params.session_id, host, exc_info=True)
        return None


async def start_session_proxies(params: ProxyParams) -> SessionProxies:
    """Start a session's proxies; the caller must `aclose()` them.

    Raises:
        EnforcementFailed: socket_dir is not a directory owned by us with mode 0700, a socket
            path exists already or is too long, or a listener could not be bound.
    """
    listeners: list[_Listener] = []
    try:
        kinds: tuple[tuple[Protocol, str], ...] = (
            ("http", HTTP_SOCKET_NAME),
            ("socks5", SOCKS_SOCKET_NAME),
        )
        if not params.listen_tcp and params.socket_dir is None:
            raise EnforcementFailed("egress proxies with neither TCP nor Unix listeners")
        for protocol, _ in kinds if params.listen_tcp else ():
            listeners.append(_Listener(sockets.bind_tcp(), protocol, "tcp", None))
        if params.socket_dir is not None:
            directory = params.socket_dir
            sockets.check_socket_dir(directory)
            for protocol, name in kinds:
                path = os.path.join(directory, name)
                sock, identity = sockets.bind_unix(path)
                listeners.append(_Listener(sock, protocol, path, identity))
        return SessionProxies(params, listeners)
    except BaseException:
        for listener in listeners:
            listener.sock.close()
            if listener.identity is not None:
                sockets.remove_socket_file(listener.where, listener.identity)
        raise


@contextlib.asynccontextmanager
async def open_session_proxies(params: ProxyParams) -> AsyncIterator[SessionProxies]:
    """A session's proxies for the duration of the block; closed (and socket files removed) on
    exit, however the block ends.

    Raises:
        EnforcementFailed: as `start_session_proxies`.
    """
    proxies = await start_session_proxies(params)
    try:
        yield proxies
    finally:
        await proxies.aclose()
