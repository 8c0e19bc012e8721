"""What the sans-IO proxy handshake machines say and what they ask of the driver.

The HTTP proxy machine (`http_machine.HttpProxyMachine`) and the SOCKS5 machine
(`socks_machine.Socks5Machine`) hold no sockets, no clock and no allowlist. The asyncio driver
feeds them the client's bytes and asks for events (h11's `receive_data` / `next_event`). An event
is one of:

- `NEED_DATA`: read one chunk from the client and pass it to `receive_data` (``b""`` at EOF).
- `SendToClient`: write these bytes to the client, then ask for the next event (the SOCKS5 method
  selection, which the client waits for before it sends its request).
- `CheckEgress`: ask the session's allowlist; answer with `decide()`, which returns the bytes to
  write to the client (the in-protocol refusal when denied, ``b""`` when allowed), or with
  `unreachable()` when the target is not refused but has nothing to dial (the upstream-failure
  reply).
- `OpenUpstream`: dial exactly this host and port; answer with `upstream_result()`, which returns
  the bytes to write to the client (the success reply, or the failure reply).
- `StartRelay`: write ``to_upstream`` upstream and ``to_client`` to the client, then relay raw
  bytes both ways; the machine is finished and is never fed again.
- Only while a forwarded plain-HTTP request and its response pass through the HTTP machine
  (`State.EXCHANGE`): `SendUpstream` (write these bytes upstream), `NEED_UPSTREAM_DATA` (read a
  chunk from the upstream for `receive_upstream_data`), `NEED_ANY_DATA` (read from whichever of
  the two is readable first), and `CloseConnection` (the conversation is over, not by the
  client's fault: write ``reply`` and close). After a response the machine reads the client's
  next request (`READING`), decided on its own.
- `ProtocolRefused`: the client spoke the protocol wrongly or asked for something the proxy does
  not do; write ``reply`` (possibly empty) and close.

A denial (`decide(allowed=False)`), an upstream failure (`upstream_result(ok=False)`,
`unreachable()`) and `ProtocolRefused` end the conversation: the machine is `CLOSED` and answers
nothing more.

Whose fault: anything the *client* gets wrong becomes a `ProtocolRefused` event carrying the
reply to send; it is never raised. `ProtocolError` is raised only when the *driver* breaks the
call order above (it is a bug in the driver). As in h11, any exception raised inside a machine
moves it to `ERROR`, and every later call raises `ProtocolError` at once.

A driver loop, for either machine::

    while True:
        event = machine.next_event()
        if event is NEED_DATA:
            machine.receive_data(await read_chunk())
        elif isinstance(event, SendToClient):
            await write(event.data)
        elif isinstance(event, CheckEgress):
            verdict = allowlist.check(event.host, event.port)
            await write(machine.decide(verdict.allowed, verdict.reason, verdict.how_to_allow))
            if not verdict.allowed:
                return close()
        elif isinstance(event, OpenUpstream):
            upstream, error = await dial(event.host, event.port)
            await write(machine.upstream_result(upstream is not None, error))
            if upstream is None:
                return close()
        elif isinstance(event, StartRelay):
            return await relay(event.to_upstream, event.to_client)
        else:  # ProtocolRefused
            await write(event.reply)
            return close()
"""

from __future__ import annotations

import abc
import enum
import functools
import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Concatenate, Final, Literal, ParamSpec, TypeAlias, TypeVar

__all__ = [
    "MAX_HEADERS",
    "MAX_HEADER_BYTES",
    "MAX_HOSTNAME_BYTES",
    "NEED_ANY_DATA",
    "NEED_DATA",
    "NEED_UPSTREAM_DATA",
    "UPSTREAM_REFUSED",
    "UPSTREAM_UNREACHABLE",
    "CheckEgress",
    "CloseConnection",
    "Event",
    "HandshakeMachine",
    "NeedData",
    "OpenUpstream",
    "ProtocolError",
    "ProtocolRefused",
    "SendToClient",
    "SendUpstream",
    "StartRelay",
    "State",
]

# Limits. The driver feeds a machine only after it returned NEED_DATA, so no machine ever buffers
# more than its limit plus the one chunk just read.

# The whole HTTP request head (request line and header fields). h11's default is 16 KiB too; real
# proxied requests carry a few hundred bytes, and a proxy that buffers more is a memory lever for
# whoever is inside the sandbox. Beyond it: 431.
MAX_HEADER_BYTES: Final = 16 * 1024
# Header fields in one request head: an attacker can make many tiny fields that fit in
# MAX_HEADER_BYTES; 100 is far above what a real client sends (curl sends about five). Beyond: 431.
MAX_HEADERS: Final = 100
# A host name is at most 253 characters plus a trailing dot in DNS; SOCKS5 bounds a domain name by
# its one length byte (255), and the HTTP machine uses the same bound so both agree.
MAX_HOSTNAME_BYTES: Final = 255

# `upstream_result(ok=False, error=...)` error kinds that a reply can tell apart (SOCKS5 has a code
# for each); any other string is a general failure, and its text appears in the HTTP 502 body.
UPSTREAM_REFUSED: Final = "refused"
UPSTREAM_UNREACHABLE: Final = "unreachable"


class State(enum.Enum):
    """Where a machine is in its conversation with the client and the driver."""

    READING = "READING"
    """Reading the handshake: `next_event` returns NEED_DATA, SendToClient or the next command."""
    CHECKING = "CHECKING"
    """`CheckEgress` was returned; waiting for `decide()`."""
    OPENING = "OPENING"
    """Allowed; `OpenUpstream` is (or was) returned; waiting for `upstream_result()`."""
    EXCHANGE = "EXCHANGE"
    """A forwarded request and its response pass through the machine (HTTP only)."""
    RELAY = "RELAY"
    """Upstream is open; `StartRelay` is (or was) returned; the driver relays raw bytes."""
    CLOSED = "CLOSED"
    """Refused, denied or upstream failed; the driver writes the reply and closes."""
    ERROR = "ERROR"
    """An exception was raised inside the machine; every later call raises `ProtocolError`."""


class NeedData(enum.Enum):
    """The type of the read sentinels (enum members so that `is` narrows types)."""

    NEED_DATA = "NEED_DATA"
    NEED_UPSTREAM_DATA = "NEED_UPSTREAM_DATA"
    NEED_ANY_DATA = "NEED_ANY_DATA"

    def __repr__(self) -> str:
        return self.value


NEED_DATA: Final = NeedData.NEED_DATA
"""Read one chunk from the client and pass it to `receive_data` (``b""`` at EOF)."""
NEED_UPSTREAM_DATA: Final = NeedData.NEED_UPSTREAM_DATA
"""Read one chunk from the upstream and pass it to `receive_upstream_data` (``b""`` at EOF)."""
NEED_ANY_DATA: Final = NeedData.NEED_ANY_DATA
"""Read one chunk from whichever of the client and the upstream is readable first."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SendToClient:
    """Write ``data`` to the client, then ask for the next event; no answer is expected."""

    data: bytes
    """Bytes for the client (the SOCKS5 method selection)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SendUpstream:
    """Write ``data`` to the upstream, then ask for the next event."""

    data: bytes
    """A forwarded request's head or body, framed by the machine."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseConnection:
    """The conversation is over, and not by the client's fault: write ``reply`` (possibly
    empty) to the client, then close both connections."""

    reply: bytes
    """The last bytes for the client (a 502 when the upstream failed before its response)."""
    reason: str
    """Why, for the log."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckEgress:
    """Ask the session's allowlist whether the client may reach ``host:port``.

    Answer with `decide()`.
    """

    host: str
    """The target as the client named it: a name (not lower-cased, not resolved), a dotted IPv4
    literal, or a compressed IPv6 literal without brackets. ASCII only."""
    port: int
    """The target port, 1..65535."""
    kind: Literal["connect", "forward"]
    """``connect`` for a tunnel (HTTP CONNECT, SOCKS5 CONNECT), ``forward`` for one plain-HTTP
    request the proxy forwards."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenUpstream:
    """Dial ``host:port`` (the address the allowlist check approved); answer with
    `upstream_result()`."""

    host: str
    """Same spelling as in the `CheckEgress` that preceded it."""
    port: int
    """The target port, 1..65535."""
    reuse: bool = False
    """The upstream open now was dialled for this same host and port (a kept-alive forward):
    answer ``upstream_result(True, reused=True)`` without dialling if it is still idle and has
    sent nothing since its last response; otherwise close it and dial. False: close any
    upstream held and dial."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StartRelay:
    """The handshake is over: send these bytes, then relay raw bytes both ways until both sides
    close. The machine is finished and must not be fed again."""

    to_upstream: bytes
    """Bytes to send upstream before relaying: for plain HTTP the rewritten request head and any
    body bytes already received; for a tunnel, bytes the client pipelined after its handshake."""
    to_client: bytes
    """Bytes to send to the client before relaying, after the reply `upstream_result()` returned.
    Both machines return their whole reply from `upstream_result()`, so this is ``b""`` today;
    a driver writes it when it is not empty."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProtocolRefused:
    """The client broke the protocol or asked for something the proxy does not do."""

    reply: bytes
    """Write this to the client, then close (an HTTP 4xx/5xx response, a SOCKS failure reply, or
    ``b""`` when the client cannot be answered in its protocol)."""
    reason: str
    """What the client did wrong, for the log."""


Event: TypeAlias = (
    NeedData
    | SendToClient
    | SendUpstream
    | CheckEgress
    | OpenUpstream
    | StartRelay
    | CloseConnection
    | ProtocolRefused
)
"""Everything `next_event()` returns."""


class ProtocolError(Exception):
    """The driver broke the call order (its bug, not the client's), or used a machine in ERROR.

    A client's mistakes never raise: they become `ProtocolRefused` events.
    """


_M = TypeVar("_M", bound="HandshakeMachine")
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _guarded(method: Callable[Concatenate[_M, _P], _R]) -> Callable[Concatenate[_M, _P], _R]:
    """h11's rule for a public method: in ERROR it raises at once, and an exception anywhere
    inside moves the machine to ERROR for good. (A wrapper, not a context manager: it is on
    every call of every connection's handshake, and a generator-based one costs several times
    as much.)"""

    @functools.wraps(method)
    def guarded(self: _M, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if self._state is State.ERROR:
            raise ProtocolError("the machine is in ERROR after an earlier exception")
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self._state = State.ERROR
            raise

    return guarded


_FEEDABLE: Final = frozenset({State.READING, State.EXCHANGE})


class HandshakeMachine(abc.ABC):
    """The call-order rules both proxy machines share; subclasses parse their protocol."""

    def __init__(self) -> None:
        self._state = State.READING
        # True when the last next_event() returned NEED_DATA (and at the start): the only time the
        # driver may feed. This is what bounds every buffer to its limit plus one chunk.
        self._wants_data = True
        self._wants_upstream = False  # the same for the upstream of a forwarded exchange
        self._eof = False
        self._check: CheckEgress | None = None
        # A command that decide()/upstream_result() queued and next_event() has not returned yet.
        self._queued: OpenUpstream | StartRelay | None = None

    @property
    def state(self) -> State:
        """Where the machine is; see `State`."""
        return self._state

    @property
    @abc.abstractmethod
    def buffered_bytes(self) -> int:
        """Client bytes received and not yet handed on (for limits and tests)."""

    @_guarded
    def receive_data(self, data: bytes) -> None:
        """Feed one chunk read from the client; ``b""`` means the client closed (EOF).

        Raises `ProtocolError` unless the last `next_event()` returned `NEED_DATA` (or nothing was
        asked yet), or after EOF was fed.
        """
        if self._state not in _FEEDABLE or not self._wants_data:
            raise ProtocolError(
                "driver bug: receive_data() is only allowed after next_event() returned "
                f"NEED_DATA (state {self._state.value})"
            )
        if self._eof:
            raise ProtocolError("driver bug: receive_data() after EOF (b'') was fed")
        self._wants_data = False
        self._wants_upstream = False
        self._eof = not data
        self._feed(data)

    @_guarded
    def receive_upstream_data(self, data: bytes) -> None:
        """Feed one chunk read from the upstream of a forwarded exchange; ``b""`` at EOF.

        Raises `ProtocolError` unless the last `next_event()` returned `NEED_UPSTREAM_DATA` or
        `NEED_ANY_DATA`.
        """
        if self._state is not State.EXCHANGE or not self._wants_upstream:
            raise ProtocolError(
                "driver bug: receive_upstream_data() is only allowed after next_event() returned "
                f"NEED_UPSTREAM_DATA or NEED_ANY_DATA (state {self._state.value})"
            )
        self._wants_upstream = False
        self._wants_data = False
        self._feed_upstream(data)

    @_guarded
    def next_event(self) -> Event:
        """Return the next thing the driver must do; see the module docstring.

        Raises `ProtocolError` when a command is still unanswered (`CheckEgress` needs `decide()`,
        `OpenUpstream` needs `upstream_result()`), after the conversation ended (`CLOSED`, or
        `StartRelay` was returned), or in `ERROR`.
        """
        if self._state is State.READING or self._state is State.EXCHANGE:
            event = self._parse() if self._state is State.READING else self._exchange()
            if event is NEED_DATA or event is NEED_ANY_DATA:
                self._wants_data = True
                self._wants_upstream = event is NEED_ANY_DATA
            elif event is NEED_UPSTREAM_DATA:
                self._wants_upstream = True
            elif isinstance(event, (ProtocolRefused, CloseConnection)):
                self._state = State.CLOSED
            elif isinstance(event, CheckEgress):
                self._check = event
                self._state = State.CHECKING
            return event
        if self._queued is not None:
            queued, self._queued = self._queued, None
            return queued
        raise ProtocolError(
            {
                State.CHECKING: "driver bug: answer CheckEgress with decide() first",
                State.OPENING: "driver bug: answer OpenUpstream with upstream_result() first",
                State.RELAY: "driver bug: the machine handed over to the relay (StartRelay)",
                State.CLOSED: "driver bug: the conversation is over; close the connection",
            }[self._state]
        )

    @_guarded
    def decide(self, allowed: bool, reason: str = "", how_to_allow: str = "") -> bytes:
        """Answer `CheckEgress`; return the bytes to write to the client.

        Allowed: ``b""``, and `next_event()` returns `OpenUpstream`. Denied: the in-protocol
        refusal (HTTP 403 naming ``reason`` and ``how_to_allow``; SOCKS5 reply 0x02, which has no
        room for text), and the machine is `CLOSED`.

        Raises `ProtocolError` unless the last event was `CheckEgress`.
        """
        check = self._pending_check("decide()")
        if not allowed:
            self._state = State.CLOSED
            return self._denied_reply(check, reason, how_to_allow)
        self._state = State.OPENING
        self._queued = self._open_upstream(check)
        return b""

    @_guarded
    def unreachable(self, error: str = UPSTREAM_UNREACHABLE) -> bytes:
        """Answer `CheckEgress` with: not refused, but there is nothing to dial (a name that
        does not resolve); return the failure reply `upstream_result(False, error)` would, and
        the machine is `CLOSED`.

        Raises `ProtocolError` unless the last event was `CheckEgress`.
        """
        check = self._pending_check("unreachable()")
        self._state = State.CLOSED
        return self._upstream_failed_reply(check, error)

    def _pending_check(self, call: str) -> CheckEgress:
        """The `CheckEgress` `call` answers; a driver bug if none is pending."""
        if self._state is not State.CHECKING or self._check is None:
            raise ProtocolError(
                f"driver bug: {call} without a pending CheckEgress (state {self._state.value})"
            )
        return self._check

    @_guarded
    def upstream_result(self, ok: bool, error: str = "", *, reused: bool = False) -> bytes:
        """Answer `OpenUpstream`; return the bytes to write to the client.

        ``ok``: the success reply (HTTP ``200 Connection established`` for CONNECT, nothing for a
        forwarded request, SOCKS5 success), and `next_event()` returns `StartRelay`. Not ``ok``:
        the failure reply (HTTP 502 with ``error`` in its body; SOCKS5 0x05 for
        `UPSTREAM_REFUSED`, 0x04 for `UPSTREAM_UNREACHABLE`, 0x01 otherwise), and the machine is
        `CLOSED`. A forwarded plain-HTTP request goes to `EXCHANGE` instead of `StartRelay`;
        ``reused``: the driver kept the upstream `OpenUpstream.reuse` offered.

        Raises `ProtocolError` unless the last event was `OpenUpstream`, or for ``reused``
        where no reuse was offered.
        """
        if self._state is not State.OPENING or self._queued is not None:
            raise ProtocolError(
                "driver bug: upstream_result() without a pending OpenUpstream "
                f"(state {self._state.value})"
            )
        assert self._check is not None  # set whenever the state is OPENING
        if not ok:
            self._state = State.CLOSED
            return self._upstream_failed_reply(self._check, error)
        return self._opened(reused)

    # Hooks with a default (the HTTP machine's forwarding overrides them).

    def _open_upstream(self, check: CheckEgress) -> OpenUpstream:
        """The command that follows an allowed check."""
        return OpenUpstream(host=check.host, port=check.port)

    def _opened(self, reused: bool) -> bytes:
        """The upstream is open: go on (here: to the relay); return the reply for the client."""
        if reused:
            raise ProtocolError("driver bug: reused=True where OpenUpstream offered no reuse")
        self._state = State.RELAY
        self._queued = StartRelay(to_upstream=self._take_relay_prefix(), to_client=b"")
        return self._established_reply()

    def _exchange(self) -> Event:
        """The next event of a forwarded exchange; called only in EXCHANGE."""
        raise ProtocolError("driver bug: this machine has no EXCHANGE state")

    def _feed_upstream(self, data: bytes) -> None:
        """Buffer a chunk from the upstream of a forwarded exchange."""
        raise ProtocolError("driver bug: this machine has no EXCHANGE state")

    # What each protocol supplies.

    @abc.abstractmethod
    def _feed(self, data: bytes) -> None:
        """Buffer a chunk (``b""``: EOF)."""

    @abc.abstractmethod
    def _parse(
        self,
    ) -> NeedData | SendToClient | CheckEgress | ProtocolRefused | CloseConnection:
        """Parse what is buffered; called only in READING."""

    @abc.abstractmethod
    def _denied_reply(self, check: CheckEgress, reason: str, how_to_allow: str) -> bytes:
        """The in-protocol answer to a denied target."""

    @abc.abstractmethod
    def _upstream_failed_reply(self, check: CheckEgress, error: str) -> bytes:
        """The in-protocol answer when the upstream could not be opened."""

    @abc.abstractmethod
    def _established_reply(self) -> bytes:
        """The in-protocol answer when the upstream is open."""

    @abc.abstractmethod
    def _take_relay_prefix(self) -> bytes:
        """Return (and drop from the buffer) what must go upstream before the raw relay."""


# Host names: letters, digits, '-', '.', '_' (underscores occur in real service names). Stricter
# than DNS allows on purpose: no '%', '@', '\\', spaces or controls that a resolver, URL parser or
# log could read differently from the allowlist. Internationalised names arrive as punycode.
_HOSTNAME = re.compile(r"[A-Za-z0-9._-]+")


def parse_hostname(text: str) -> str | None:
    """Return ``text`` if it is an acceptable host name (or IPv4 literal), else None."""
    if len(text) > MAX_HOSTNAME_BYTES or _HOSTNAME.fullmatch(text) is None:
        return None
    return text


def parse_ipv6(text: str) -> str | None:
    """Return the compressed form of an IPv6 literal (no brackets, no zone id), else None."""
    if "%" in text:  # zone ids name a local interface: never a remote target
        return None
    try:
        return str(ipaddress.IPv6Address(text))
    except ValueError:
        return None
