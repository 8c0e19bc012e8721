"""The HTTP proxy's client side as a sans-IO state machine (see `proto` for the driver protocol).

What it accepts, on one client connection:

- ``CONNECT host:port`` (authority form; IPv6 as ``[::1]:443``; the port is required, 1..65535):
  a tunnel, the connection's last request. After ``200 Connection established`` the bytes the
  client pipelined behind its head (typically the TLS ClientHello) go upstream first.
- Absolute-form plain-HTTP requests, ``GET http://host[:port]/path`` (port 80 by default), as
  many as the client sends (keep-alive): the proxy forwards each one. The ``Host`` header must
  name the same host and port as the request target (case-insensitive, default port elided), so
  the allowlist judges the host the origin server will see. HTTP/1.0 requests without ``Host``
  get one from the target.

Everything else is refused in-protocol: origin-form (``GET /x``: the client thinks this is an
origin server), ``https://`` absolute URIs (use CONNECT), other schemes, user info or fragments in
the target, a request head over `MAX_HEADER_BYTES` or `MAX_HEADERS` (431), a head with obsolete
line folding or a bare LF line end, or not starting with a method (400), transfer codings other
than chunked (h11: 501), HTTP versions other than 1.0 and 1.1 (505).

Both legs of a forward are framed by h11 (`h11.Connection(h11.SERVER)` for the client's
request, `h11.Connection(h11.CLIENT)` for the upstream's response, one of each per exchange):
each request is read as an h11 `Request` and body events, decided on its own (`CheckEgress`; a
pipelined request is parsed only once the response before it has ended), and written again by
h11 for the upstream in origin form (for a request without a body its head is written as h11
writes it, and the response head read with h11's own head parser until the response needs
an h11 connection: one is then given every byte the upstream sent); the response head is
read by h11. So each side gets
exactly one framing, h11's: Content-Length or chunked (chunk extensions and trailers dropped),
no body for HEAD, 204 and 304, 1xx passed on (a 101 is refused), and a response whose body ends
at the upstream's EOF ends the client connection too (it says ``Connection: close``). A
response framed by Content-Length alone (or with no body) for a client connection that stays
open is written for the client as h11 would write it, and its body passed on as counted bytes:
exactly the length the head says, never a byte more; an upstream that closes short of it ends
the client connection. Every other response goes through h11 on both legs. A body h11 refuses
(a bad chunk size or extension, a body cut short) ends the connection.

An upstream is reused only for the next request decided for the same host and port (the
driver also checks it has sent nothing since, `OpenUpstream.reuse`), and only if its last
response ended cleanly with no byte after it: a response that sent more than it framed is
never followed by a read on that connection.

Forwarding drops ``Proxy-Authorization``, ``Proxy-Connection``, the hop-by-hop headers
(``Connection``, ``Keep-Alive``, ``TE``, ``Upgrade``, ``Proxy-Authenticate``) and any header the
client's ``Connection`` header names, except ``Host``, ``Content-Length`` and
``Transfer-Encoding``, which the body framing and the Host check depend on; responses lose the
same hop-by-hop headers. A request with both ``Content-Length`` and ``Transfer-Encoding`` is
refused (the classic smuggling shape, RFC 9112 section 6.3), and so are differing
``Content-Length`` values (h11). The forwarded request says ``Connection: close`` only when the
client's connection ends after it (it said so, or is HTTP/1.0).
"""

from __future__ import annotations

import http
import re
from dataclasses import dataclass
from typing import TypeAlias

import h11

# h11's own parser of a response head (what its client connection runs on the bytes), used
# alone while nothing but a head is awaited; everything else goes through h11.Connection.
from h11._readers import maybe_read_from_SEND_RESPONSE_server
from h11._receivebuffer import ReceiveBuffer

from cc_server.egress.proto import (
    MAX_HEADER_BYTES,
    MAX_HEADERS,
    NEED_ANY_DATA,
    NEED_DATA,
    NEED_UPSTREAM_DATA,
    CheckEgress,
    CloseConnection,
    Event,
    HandshakeMachine,
    NeedData,
    OpenUpstream,
    ProtocolError,
    ProtocolRefused,
    SendToClient,
    SendUpstream,
    State,
    parse_hostname,
    parse_ipv6,
)

__all__ = ["CONNECT_ESTABLISHED", "DEFAULT_HOW_TO_ALLOW", "HttpProxyMachine"]

CONNECT_ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"
"""The reply that opens a CONNECT tunnel."""

DEFAULT_HOW_TO_ALLOW = (
    "ask the operator to add the host to this session's egress allowlist "
    "(cc-server run --allow-domain HOST[:PORT])."
)
"""The advice in a 403 body when the driver gives none."""

# A header value the proxy writes must stay one short line whatever the driver's reason says.
_MAX_HEADER_REASON_CHARS = 200

# Never forwarded: credentials meant for this proxy, and hop-by-hop fields (RFC 9110 section 7.6.1).
_DROPPED_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"upgrade",
    }
)
# Named by the client's Connection header, still forwarded: the body framing and the Host check
# depend on them.
_KEPT_HEADERS = frozenset({b"host", b"content-length", b"transfer-encoding"})

_HEAD_TOO_LARGE = f"request head over {MAX_HEADER_BYTES} bytes"
# An upstream's response head beyond this is refused by h11's client connection (its default
# max_incomplete_event_size): read without one, a longer head is handed to one to refuse.
_MAX_RESPONSE_HEAD_BYTES = 16 * 1024


_Field: TypeAlias = tuple[bytes, bytes, bytes]  # a header field: (lower-case name, name, value)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Target:
    host: str  # as in CheckEgress: IPv6 compressed, without brackets
    port: int
    origin_form: str  # the forwarded request target; "" for CONNECT


class HttpProxyMachine(HandshakeMachine):
    """One client connection to the HTTP proxy: its requests, each decided on its own, and for
    forwarded ones the exchange with the upstream (`State.EXCHANGE`).

    `receive_data`, `receive_upstream_data`, `next_event`, `decide` and `upstream_result` are
    described on `proto.HandshakeMachine`; they raise `proto.ProtocolError` only for driver
    mistakes.
    """

    def __init__(self) -> None:
        super().__init__()
        # The client's leg. None once the relay owns the rest of the stream (a CONNECT).
        self._conn: h11.Connection | None = h11.Connection(
            h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES
        )
        self._scan = True  # bytes came in since the buffered head was last scanned
        self._empty = True  # the client's parser holds no byte and no EOF
        self._first = True  # no request was read on this connection yet
        self._connect = False
        # The decided request for the upstream (method, origin-form target, fields), and
        # whether it has no body (its upstream's response head is read by h11's parser alone).
        self._request: tuple[bytes, bytes, list[tuple[bytes, bytes]]] | None = None
        self._bodyless = False
        # Before the upstream's response head: the bytes it sent (`_up` None while they are
        # read without an h11 connection), and whether it closed.
        self._up_head = bytearray()
        self._up_eof = False
        self._target: tuple[str, int] = ("", 0)  # its (lower-case host, port)
        # The upstream's leg of a forward, and the (lower-case host, port) it was dialled for.
        self._up: h11.Connection | None = None
        self._up_target: tuple[str, int] = ("", 0)
        self._up_idle = False  # its last response ended cleanly, nothing after: reusable
        self._reuse_offered = False
        self._method = b""  # of the request in EXCHANGE
        self._keep = False  # its client connection stays open after it (HTTP/1.1, no close)
        self._started = False  # its response head was sent to the client
        self._eof_body = False  # its response body ends at the upstream's EOF
        # A Content-Length response body passed on as counted bytes (no h11 events): the bytes
        # still to pass, -1 when the response goes through h11; the chunk read and not passed
        # yet; whether the upstream closed; whether it sent bytes past the body.
        self._counted = -1
        self._raw = b""
        self._raw_eof = False
        self._overrun = False
        self._up_keep = False  # the upstream keeps its connection after this response
        self._up_fed = False  # the upstream's parser got bytes since it last needed data
        self._ended = False  # the response ended this client connection (it is all sent)
        self._to_upstream = bytearray()
        self._to_client = bytearray()

    @property
    def buffered_bytes(self) -> int:
        """Client bytes received and not yet handed on."""
        return 0 if self._conn is None else len(self._conn.trailing_data[0])

    def _feed(self, data: bytes) -> None:
        assert self._conn is not None  # fed only while READING or in EXCHANGE
        self._scan = True
        self._empty = False
        self._conn.receive_data(data)

    def _feed_upstream(self, data: bytes) -> None:
        if self._counted >= 0:
            self._raw = data
            self._raw_eof = not data
            return
        if self._up is None:  # the response head, read by h11's parser alone
            self._up_fed = True
            self._up_head += data
            self._up_eof = not data
            return
        self._up_fed = True
        self._up.receive_data(data)

    def _parse(self) -> NeedData | SendToClient | CheckEgress | ProtocolRefused | CloseConnection:
        assert self._conn is not None  # parsed only while READING
        if self._scan:
            self._scan = False
            refused = _scan_head(self._conn.trailing_data[0])
            if refused is not None:
                return refused
        if self._empty:
            return NEED_DATA  # what h11 says of an empty buffer, without asking it
        try:
            event = self._conn.next_event()
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            return _refuse(status, _HEAD_TOO_LARGE if status == 431 else str(exc))
        if event is h11.NEED_DATA:
            return NEED_DATA
        if isinstance(event, h11.ConnectionClosed):
            if self._first:
                return ProtocolRefused(reply=b"", reason="client closed before sending a request")
            return CloseConnection(reply=b"", reason="the client closed between requests")
        # A server's h11 gives a Request or ConnectionClosed while it reads a request head.
        assert isinstance(event, h11.Request), event
        self._first = False
        if len(event.headers) > MAX_HEADERS:
            return _refuse(431, f"more than {MAX_HEADERS} header fields")
        if event.http_version not in (b"1.0", b"1.1"):
            return _refuse(505, "only HTTP/1.0 and HTTP/1.1 are supported")
        # The fields once, as (lower-case name, name as sent, value): h11's Headers is a
        # Sequence that costs a method call per field on every walk.
        fields = [(raw.lower(), raw, value) for raw, value in event.headers.raw_items()]
        if event.method == b"CONNECT":
            return self._parse_connect(event, fields)
        return self._parse_forward(event, fields)

    def _parse_connect(
        self, request: h11.Request, fields: list[_Field]
    ) -> CheckEgress | ProtocolRefused:
        target = request.target.decode("ascii")  # h11 admits only visible ASCII here
        parsed = _parse_authority(target, default_port=None)
        if isinstance(parsed, str):
            return _refuse(400, f"CONNECT target must be host:port: {parsed}")
        host, port = parsed
        for name, _, value in fields:
            if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
                return _refuse(400, "CONNECT must not carry a request body")
        self._connect = True
        return CheckEgress(host=host, port=port, kind="connect")

    def _parse_forward(
        self, request: h11.Request, fields: list[_Field]
    ) -> CheckEgress | ProtocolRefused:
        parsed = _parse_absolute_target(request.target.decode("ascii"))
        if isinstance(parsed, ProtocolRefused):
            return parsed
        host_header: bytes | None = None
        framing: set[bytes] = set()
        self._bodyless = True
        for name, _, value in fields:
            if name == b"host":
                host_header = value  # h11 refuses a second Host field
            elif name in (b"content-length", b"transfer-encoding"):
                framing.add(name)
                self._bodyless = name == b"content-length" and value == b"0"
        if len(framing) == 2:
            return _refuse(400, "Content-Length and Transfer-Encoding together are refused")
        if host_header is not None:
            refused = _check_host_header(host_header, parsed)
            if refused is not None:
                return refused
        tokens = _connection_tokens(fields)
        self._keep = request.http_version == b"1.1" and b"close" not in tokens
        self._request = _upstream_request(
            request, parsed, fields, tokens, keep=self._keep, add_host=host_header is None
        )
        self._target = (parsed.host.lower(), parsed.port)
        self._method = request.method
        return CheckEgress(host=parsed.host, port=parsed.port, kind="forward")

    def _open_upstream(self, check: CheckEgress) -> OpenUpstream:
        # Reused only for the very host and port it was dialled for, and only when its last
        # response ended cleanly with nothing after it.
        self._reuse_offered = (
            not self._connect and self._up_idle and self._up_target == self._target
        )
        return OpenUpstream(host=check.host, port=check.port, reuse=self._reuse_offered)

    def _opened(self, reused: bool) -> bytes:
        if self._connect:
            return super()._opened(reused)
        if reused and not self._reuse_offered:
            raise ProtocolError("driver bug: reused=True where OpenUpstream offered no reuse")
        if not reused:
            self._up_target = self._target
        # One h11 connection per exchange: a reused upstream's parser starts afresh, as after
        # h11's start_next_cycle (which it could not do after a counted body it never saw).
        # For a request without a body it is made only if the response needs it (`_read_head`).
        assert self._request is not None
        self._up_idle = False
        self._up_head.clear()
        self._up_eof = False
        if self._bodyless:
            self._up = None
            self._to_upstream += _request_head(*self._request)
        else:
            self._up = h11.Connection(h11.CLIENT)
            self._to_upstream += self._up.send(_request_event(*self._request))
        self._started = self._eof_body = self._raw_eof = self._overrun = self._up_fed = False
        self._counted = -1
        self._state = State.EXCHANGE
        return b""

    def _exchange(self) -> Event:
        if self._ended:
            return CloseConnection(reply=b"", reason="the response ended the connection")
        conn, up = self._conn, self._up
        assert conn is not None  # EXCHANGE has the client's leg
        try:
            while conn.their_state is h11.SEND_BODY:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    break
                if isinstance(event, h11.Data):
                    assert up is not None  # a request with a body has its h11 upstream
                    self._to_upstream += up.send(event)
                else:  # EndOfMessage: h11 raises for a body cut short; trailers are dropped
                    assert isinstance(event, h11.EndOfMessage), event
                    if up is not None:
                        self._to_upstream += up.send(h11.EndOfMessage())
        except h11.RemoteProtocolError as exc:
            reason = f"bad request body: {exc}"
            return (
                ProtocolRefused(reply=b"", reason=reason) if self._started else _refuse(400, reason)
            )
        if self._to_upstream:
            data, self._to_upstream = bytes(self._to_upstream), bytearray()
            return SendUpstream(data=data)
        if self._counted < 0:
            try:
                if up is None:
                    up = self._read_head(conn)
                if up is not None:
                    self._pass_response(conn, up)
            except (h11.RemoteProtocolError, _UpstreamBroke) as exc:
                reply = b"" if self._started else self._upstream_failed_reply(None, f"{exc}")
                return CloseConnection(
                    reply=bytes(self._to_client) + reply, reason=f"upstream: {exc}"
                )
        if self._counted >= 0:
            return self._pass_counted()
        if self._to_client:
            data, self._to_client = bytes(self._to_client), bytearray()
            return SendToClient(data=data)
        if up is None:
            return NEED_UPSTREAM_DATA  # the response head is not complete yet
        return self._after_response(conn, up)

    def _read_head(self, conn: h11.Connection) -> h11.Connection | None:
        """Read the response head of a request without a body with h11's parser alone; an h11
        connection for the upstream only if the response needs one (returned): anything but a
        complete head whose body is counted (`_pass_head`), or a head h11 would refuse. It is
        given every byte the upstream sent, so it reads and refuses exactly as it would have
        from the first byte."""
        if not self._up_fed:
            return None
        self._up_fed = False
        buffer = ReceiveBuffer()
        buffer += self._up_head
        try:
            event = maybe_read_from_SEND_RESPONSE_server(buffer)
        except h11.LocalProtocolError:
            event = None  # h11.Connection refuses it, in its own words
        else:
            if event is None and not self._up_eof and len(buffer) <= _MAX_RESPONSE_HEAD_BYTES:
                return None  # more to come
            if isinstance(event, h11.Response):
                rest = bytes(buffer)
                if self._pass_head(conn, event, rest, self._up_eof, fall_back=True):
                    return None
        assert self._request is not None
        up = self._up = h11.Connection(h11.CLIENT)
        up.send(_request_event(*self._request))  # sent already, as `_request_head` wrote it
        up.send(h11.EndOfMessage())
        up.receive_data(bytes(self._up_head))
        if self._up_eof:
            up.receive_data(b"")
        self._up_fed = True
        return up

    def _pass_counted(self) -> Event:
        """Pass on the next bytes of a counted body: exactly its Content-Length, never a byte
        past it (an upstream that sends more is never read again)."""
        raw, self._raw = self._raw, b""
        if len(raw) > self._counted:
            self._overrun = True
            raw = raw[: self._counted]
        self._counted -= len(raw)
        if self._to_client:
            self._to_client += raw
            raw, self._to_client = bytes(self._to_client), bytearray()
        if self._counted == 0:
            self._counted = -1
            return self._counted_done(raw)
        if self._raw_eof:  # the upstream closed short of the body's end
            return CloseConnection(
                reply=raw, reason=f"upstream: the response ended {self._counted} bytes short"
            )
        return SendToClient(data=raw) if raw else NEED_UPSTREAM_DATA

    def _counted_done(self, last: bytes) -> Event:
        """A counted body has been passed on whole: its last bytes for the client, then the
        client's next request (read only once the machine is asked again), or the end."""
        self._up_idle = self._up_keep and not self._overrun and not self._raw_eof
        self._up = None
        if not self._keep:
            self._ended = True
            return SendToClient(data=last) if last else self._exchange()
        self._next_cycle()
        return SendToClient(data=last) if last else self._parse()

    def _next_cycle(self) -> None:
        """Read the client's next request: a new h11 connection holding the bytes (and the
        EOF) the last one received past its request, as h11's `start_next_cycle` would."""
        assert self._conn is not None  # a forward's client leg
        rest, closed = self._conn.trailing_data
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        if rest:
            self._conn.receive_data(rest)
        if closed:
            self._conn.receive_data(b"")
        self._empty = not rest and not closed
        self._state = State.READING
        self._scan = True

    def _pass_response(self, conn: h11.Connection, up: h11.Connection) -> None:
        """Frame for the client what the upstream's response has sent so far."""
        while self._up_fed and (
            up.their_state is h11.SEND_RESPONSE or up.their_state is h11.SEND_BODY
        ):
            event = up.next_event()
            if event is h11.NEED_DATA:
                self._up_fed = False
                return
            if isinstance(event, h11.Data):
                self._to_client += conn.send(event)
            elif isinstance(event, h11.EndOfMessage):
                self._to_client += conn.send(h11.EndOfMessage())
            elif isinstance(event, h11.Response):
                if self._pass_head(conn, event, *up.trailing_data):
                    return  # its body is counted (`_pass_counted`)
            elif isinstance(event, h11.InformationalResponse) and event.status_code != 101:
                headers = _hop_by_hop_dropped(_fields(event.headers))
                self._to_client += conn.send(
                    h11.InformationalResponse(
                        status_code=event.status_code, headers=headers, reason=event.reason
                    )
                )
            else:  # ConnectionClosed (h11 raises for a response cut short), or a 101
                raise _UpstreamBroke(f"the upstream sent {type(event).__name__} mid-response")

    def _pass_head(
        self,
        conn: h11.Connection,
        response: h11.Response,
        rest: bytes,
        eof: bool,
        *,
        fall_back: bool = False,
    ) -> bool:
        """Write the response head for the client; whether its body is counted (`rest`: the
        bytes after the head, `eof`: the upstream closed after them). `fall_back`: a head
        whose body is not counted is left for an h11 connection to read again (False).

        A body framed by Content-Length alone (or none: HEAD, 204, 304) once the request has
        been read whole is counted (`_counted`): the head is written here, as h11 would write
        it for this exchange (with ``Connection: close`` appended when the client's connection
        ends after it), and the body's bytes pass as read, exactly as many as the head says.
        Every other response goes through h11 on both legs (chunked, a body that ends at the
        upstream's EOF, a request body still coming)."""
        fields = _fields(response.headers)
        tokens = _connection_tokens(fields)
        named = tokens - _KEPT_HEADERS
        kept = [f for f in fields if f[0] not in _DROPPED_HEADERS and f[0] not in named]
        length = _counted_length(self._method, response.status_code, kept)
        read = conn.their_state is h11.DONE or conn.their_state is h11.MUST_CLOSE
        if length >= 0 and read:
            self._started = True
            self._to_client += _response_head(response, kept, close=not self._keep)
            self._counted = length
            self._up_keep = (
                self._keep and response.http_version == b"1.1" and b"close" not in tokens
            )
            self._raw, self._raw_eof = rest, eof
            return True
        if fall_back:
            return False
        self._started = True
        headers = [(raw_name, value) for _, raw_name, value in kept]
        framed = any(name in (b"content-length", b"transfer-encoding") for name, _, _ in fields)
        if not framed and self._method != b"HEAD" and response.status_code not in (204, 304):
            # The body ends at the upstream's EOF: so does this client connection.
            self._eof_body = True
            headers.append((b"Connection", b"close"))
        self._to_client += conn.send(
            h11.Response(  # `_parsed`: as in `_upstream_request`
                status_code=response.status_code,
                headers=headers,
                reason=response.reason,
                http_version=b"1.1",
                _parsed=True,
            )
        )
        return False

    def _after_response(self, conn: h11.Connection, up: h11.Connection) -> Event:
        """Both legs said what they could: the next request, a read, or the end."""
        if conn.our_state is h11.DONE or conn.our_state is h11.MUST_CLOSE:
            self._up_idle = (
                up.our_state is h11.DONE
                and up.their_state is h11.DONE
                and not self._eof_body
                and not up.trailing_data[0]  # bytes past the response: never a next one
            )
            self._up = None
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                self._next_cycle()
                return self._parse()
            return CloseConnection(reply=b"", reason="the response ended the connection")
        wants_client = conn.their_state is h11.SEND_BODY
        if up.their_state is h11.SEND_RESPONSE or up.their_state is h11.SEND_BODY:
            return NEED_ANY_DATA if wants_client else NEED_UPSTREAM_DATA
        raise _UpstreamBroke("the exchange cannot go on")  # not reached: h11's states

    def _denied_reply(self, check: CheckEgress, reason: str, how_to_allow: str) -> bytes:
        where = _display(check.host, check.port)
        why = reason or "The host is not on this session's egress allowlist."
        body = (
            f"cc-server egress proxy refused the connection to {where}.\n"
            f"{why}\n"
            f"To allow it: {how_to_allow or DEFAULT_HOW_TO_ALLOW}\n"
        )
        header_reason = _header_text(reason or "not on the session's egress allowlist")
        return _response(
            403,
            body,
            [
                (b"X-Cc-Server-Egress", b"denied"),
                (b"X-Cc-Server-Egress-Reason", header_reason.encode("ascii")),
            ],
        )

    def _upstream_failed_reply(self, check: CheckEgress | None, error: str) -> bytes:
        check = check or self._check
        assert check is not None  # a reply about an upstream follows its check
        where = _display(check.host, check.port)
        body = f"cc-server egress proxy could not connect to {where}: {error or 'failed'}\n"
        return _response(502, body, [(b"X-Cc-Server-Egress", b"upstream-failed")])

    def _established_reply(self) -> bytes:
        return CONNECT_ESTABLISHED if self._connect else b""

    def _take_relay_prefix(self) -> bytes:
        assert self._conn is not None  # the relay prefix is taken once
        rest = self._conn.trailing_data[0]
        self._conn = None  # the relay owns these bytes now; h11's buffer goes with it
        return rest


class _UpstreamBroke(Exception):
    """The upstream's response cannot be passed on (the upstream's fault)."""


# The first bare LF, or a line end followed by a space or tab (obs-fold); a bare LF wins when
# both start at the same byte.
_HEAD_OFFENCE = re.compile(rb"(?<!\r)\n|\n[ \t]")


def _scan_head(buffered: bytes) -> ProtocolRefused | None:
    """Refuse what h11 would accept in the request head that starts `buffered`, and a proxy
    must not: a request line not starting with a method token (h11 skips empty lines before
    it, and checks only an incomplete head, with another message), obsolete line folding and
    bare LF line ends (h11 unfolds and accepts them: a peer that reads them otherwise would
    see other fields), and a head over `MAX_HEADER_BYTES`."""
    if not buffered:
        return None
    if buffered[0] < 0x21:
        return _refuse(400, "illegal request line")
    ends = [at for at in (buffered.find(b"\n\r\n"), buffered.find(b"\n\n")) if at != -1]
    end = min(ends) if ends else len(buffered)
    # The first offence in the head's first MAX_HEADER_BYTES decides, so that the answer is
    # the same however the bytes were split.
    head = buffered[: min(end + 1, MAX_HEADER_BYTES)]
    offence = _HEAD_OFFENCE.search(head)
    if offence is not None:
        if offence.group() == b"\n":
            return _refuse(400, "bare LF in the request head")
        return _refuse(400, "obsolete line folding in the request head")
    if (end + 3 if ends else end) > MAX_HEADER_BYTES:
        return _refuse(431, _HEAD_TOO_LARGE)
    return None


def _parse_absolute_target(target: str) -> _Target | ProtocolRefused:
    lowered = target.lower()
    if lowered.startswith("https://"):
        return _refuse(400, "use CONNECT for https:// URIs")
    if not lowered.startswith("http://"):
        if target.startswith("/"):
            return _refuse(400, "this is a proxy: use an absolute URI or CONNECT")
        return _refuse(400, "request target must be an absolute http:// URI, or use CONNECT")
    if "#" in target:
        return _refuse(400, "fragment in the request target")
    rest = target[len("http://") :]
    end = len(rest)
    for stop in "/?":
        index = rest.find(stop)
        if index != -1:
            end = min(end, index)
    authority, path = rest[:end], rest[end:]
    if "@" in authority:
        return _refuse(400, "user info in the request target")
    parsed = _parse_authority(authority, default_port=80)
    if isinstance(parsed, str):
        return _refuse(400, f"bad request target: {parsed}")
    if not path.startswith("/"):
        path = "/" + path  # "http://h" and "http://h?q" have an empty path
    return _Target(host=parsed[0], port=parsed[1], origin_form=path)


def _parse_authority(text: str, *, default_port: int | None) -> tuple[str, int] | str:
    """``host[:port]`` or ``[v6][:port]`` → (host, port), or a message saying what is wrong."""
    if text.startswith("["):
        close = text.find("]")
        if close == -1:
            return "unterminated IPv6 literal"
        host = parse_ipv6(text[1:close])
        if host is None:
            return "bad IPv6 literal"
        rest = text[close + 1 :]
        if rest and not rest.startswith(":"):
            return "junk after the IPv6 literal"
        port_text = rest[1:] if rest else None
    else:
        name, colon, port_text_or_empty = text.partition(":")
        checked = parse_hostname(name)
        if checked is None:
            return "bad host name (IPv6 literals go in brackets)"
        host = checked
        port_text = port_text_or_empty if colon else None
    if port_text is None:
        if default_port is None:
            return "missing port"
        return host, default_port
    if not (1 <= len(port_text) <= 5 and port_text.isascii() and port_text.isdigit()):
        return "bad port"
    port = int(port_text)
    if not 1 <= port <= 65535:
        return "port out of range 1..65535"
    return host, port


def _check_host_header(value: bytes, target: _Target) -> ProtocolRefused | None:
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return _refuse(400, "Host header is not ASCII")
    parsed = _parse_authority(text, default_port=80)
    if isinstance(parsed, str):
        return _refuse(400, f"bad Host header: {parsed}")
    if parsed[0].lower() != target.host.lower() or parsed[1] != target.port:
        return _refuse(400, "Host header does not match the request target")
    return None


def _counted_length(method: bytes, status: int, fields: list[_Field]) -> int:
    """The body length of a response to pass on counted, or -1 if it goes through h11: its
    framing is Content-Length alone, or none at all for HEAD, 204 and 304 (h11's rules, where
    h11 would write the head unchanged: a HEAD response without Content-Length gets chunked
    framing from h11)."""
    length = -1
    for name, _, value in fields:
        if name == b"transfer-encoding":
            return -1
        if name == b"content-length":
            length = int(value)  # h11 checked it: digits, one value
    if status in (204, 304):
        return 0
    if method == b"HEAD":
        return 0 if length >= 0 else -1
    return length


def _response_head(response: h11.Response, fields: list[_Field], *, close: bool) -> bytes:
    """The head h11 writes for `response` with these fields (none of them Connection): Host
    first, and ``Connection: close`` last when the client's connection ends after it."""
    start = b"HTTP/1.1 %d %s" % (response.status_code, response.reason)
    return _head(start, [(raw, value) for _, raw, value in fields], close=close)


def _fields(headers: h11._headers.Headers) -> list[_Field]:
    return [(raw.lower(), raw, value) for raw, value in headers.raw_items()]


def _connection_tokens(fields: list[_Field]) -> set[bytes]:
    return {
        token.strip().lower()
        for name, _, value in fields
        if name == b"connection"
        for token in value.split(b",")
    }


def _hop_by_hop_dropped(
    fields: list[_Field], tokens: set[bytes] | None = None
) -> list[tuple[bytes, bytes]]:
    """The fields to pass on: not hop-by-hop, not named by Connection (framing and Host kept)."""
    named = (_connection_tokens(fields) if tokens is None else tokens) - _KEPT_HEADERS
    return [
        (raw_name, value)
        for name, raw_name, value in fields
        if name not in _DROPPED_HEADERS and name not in named
    ]


def _upstream_request(
    request: h11.Request,
    target: _Target,
    fields: list[_Field],
    tokens: set[bytes],
    *,
    keep: bool,
    add_host: bool,
) -> tuple[bytes, bytes, list[tuple[bytes, bytes]]]:
    headers = _hop_by_hop_dropped(fields, tokens)
    if add_host:
        host = f"[{target.host}]" if ":" in target.host else target.host
        value = host if target.port == 80 else f"{host}:{target.port}"
        headers.insert(0, (b"Host", value.encode()))
    if not keep:
        headers.append((b"Connection", b"close"))  # this client connection ends after it
    return request.method, target.origin_form.encode(), headers


def _request_event(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]
) -> h11.Request:
    # `_parsed`: the fields are h11's own parse of the client's head (or ours, constant and
    # valid), so h11 need not match each against its grammar again; the framing checks run.
    return h11.Request(
        method=method, target=target, headers=headers, http_version=b"1.1", _parsed=True
    )


def _request_head(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The head h11 writes for `_request_event(...)`: the request line, Host first, the rest
    as given (h11's parse of the client's fields, already in the form h11 writes)."""
    return _head(b"%s %s HTTP/1.1" % (method, target), headers, close=False)


def _head(start: bytes, headers: list[tuple[bytes, bytes]], *, close: bool) -> bytes:
    """A message head as h11 writes it: the start line, Host first, the other fields in order,
    and ``Connection: close`` last if `close`."""
    lines = [start + b"\r\n"]
    lines += [b"%s: %s\r\n" % (name, value) for name, value in headers if name.lower() == b"host"]
    lines += [b"%s: %s\r\n" % (name, value) for name, value in headers if name.lower() != b"host"]
    lines.append(b"Connection: close\r\n\r\n" if close else b"\r\n")
    return b"".join(lines)


def _refuse(status: int, reason: str) -> ProtocolRefused:
    body = f"cc-server egress proxy: {reason}\n"
    reply = _response(status, body, [(b"X-Cc-Server-Egress", b"bad-request")])
    return ProtocolRefused(reply=reply, reason=reason)


def _response(status: int, body: str, headers: list[tuple[bytes, bytes]]) -> bytes:
    payload = body.encode("utf-8")
    phrase = http.HTTPStatus(status).phrase.encode("ascii")
    lines = [
        b"HTTP/1.1 %d %s" % (status, phrase),
        b"Content-Type: text/plain; charset=utf-8",
        *(name + b": " + value for name, value in headers),
        b"Connection: close",
        b"Content-Length: %d" % len(payload),
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + payload


def _header_text(text: str) -> str:
    """One line of visible ASCII: CR, LF and other controls become spaces, the rest '?'."""
    cleaned = "".join(
        char if " " <= char <= "~" else (" " if ord(char) < 0x80 else "?") for char in text
    )
    return " ".join(cleaned.split())[:_MAX_HEADER_REASON_CHARS]


def _display(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
