"""The HTTP proxy's client side as a sans-IO state machine (see `proto` for the driver protocol).

What it accepts, one request per client connection:

- ``CONNECT host:port`` (authority form; IPv6 as ``[::1]:443``; the port is required, 1..65535):
  a tunnel. After ``200 Connection established`` the bytes the client pipelined behind its head
  (typically the TLS ClientHello, often in the same packet) go upstream first.
- An absolute-form plain-HTTP request, ``GET http://host[:port]/path`` (port 80 by default): the
  proxy forwards it. The ``Host`` header must name the same host and port as the request target
  (case-insensitive, default port elided), so the allowlist judges the host the origin server will
  see. HTTP/1.0 requests without ``Host`` get one from the target.

Everything else is refused in-protocol: origin-form (``GET /x``: the client thinks this is an
origin server), ``https://`` absolute URIs (use CONNECT), other schemes, user info or fragments in
the target, a request head over `MAX_HEADER_BYTES` or `MAX_HEADERS` (431), transfer codings other
than chunked (h11: 501), HTTP versions other than 1.0 and 1.1 (505).

Parsing is h11's (`h11.Connection(h11.SERVER)`), used for the request head only. Once h11 returns
the `Request`, everything it has not parsed yet (``Connection.trailing_data``) is the raw rest of
the stream: a CONNECT's pipelined tunnel bytes, or the start of a plain request's body. The
machine never asks h11 for body events: for a forwarded request it re-serialises the head itself
in origin form and the driver relays the body as raw bytes in the client's own framing
(Content-Length or chunked, which h11 has validated in the head). That is the simplest correct
approach: the proxy never re-frames a body, so it cannot get the framing wrong.

One request per client connection: the forwarded head always says ``Connection: close``, so the
origin closes after its response and the client must open a new proxy connection (and pass a new
allowlist check) for its next request. Bytes a client pipelines behind the first request reach only
the origin the allowlist approved, exactly as bytes inside a CONNECT tunnel do.

Forwarding drops ``Proxy-Authorization``, ``Proxy-Connection``, the hop-by-hop headers
(``Connection``, ``Keep-Alive``, ``TE``, ``Upgrade``, ``Proxy-Authenticate``) and any header the
client's ``Connection`` header names, except ``Host``, ``Content-Length`` and
``Transfer-Encoding``, which the body framing and the Host check depend on. A request with both
``Content-Length`` and ``Transfer-Encoding`` is refused (the classic smuggling shape, RFC 9112
section 6.3).
"""

from __future__ import annotations

import http
from dataclasses import dataclass
from typing import TypeAlias

import h11

from cc_server.egress.proto import (
    MAX_HEADER_BYTES,
    MAX_HEADERS,
    NEED_DATA,
    CheckEgress,
    HandshakeMachine,
    NeedData,
    ProtocolRefused,
    SendToClient,
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


_Field: TypeAlias = tuple[bytes, bytes, bytes]  # a header field: (lower-case name, name, value)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Target:
    host: str  # as in CheckEgress: IPv6 compressed, without brackets
    port: int
    origin_form: str  # the forwarded request target; "" for CONNECT


class HttpProxyMachine(HandshakeMachine):
    """One client connection to the HTTP proxy, from the first byte to `StartRelay`.

    `receive_data`, `next_event`, `decide` and `upstream_result` are described on
    `proto.HandshakeMachine`; they raise `proto.ProtocolError` only for driver mistakes.
    """

    def __init__(self) -> None:
        super().__init__()
        # None once the relay owns the rest of the stream (h11 is never asked again).
        self._conn: h11.Connection | None = h11.Connection(
            h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES
        )
        self._received = 0  # every byte fed, to measure the head once h11 has parsed it
        self._first_byte: int | None = None
        self._connect = False
        self._forward_head = b""

    @property
    def buffered_bytes(self) -> int:
        """Client bytes received and not yet handed on."""
        return 0 if self._conn is None else len(self._conn.trailing_data[0])

    def _feed(self, data: bytes) -> None:
        assert self._conn is not None  # fed only while READING
        if self._first_byte is None and data:
            self._first_byte = data[0]
        self._received += len(data)
        self._conn.receive_data(data)

    def _parse(self) -> NeedData | SendToClient | CheckEgress | ProtocolRefused:
        # A request line starts with a method token. h11 checks this too, but only while the head
        # is incomplete, with a different message than once it is complete; checking here gives
        # the same answer however the bytes were split. (h11 would skip a leading empty line, a
        # keep-alive leftover that cannot occur on a fresh one-request connection.)
        if self._first_byte is not None and self._first_byte < 0x21:
            return _refuse(400, "illegal request line")
        assert self._conn is not None  # parsed only while READING
        try:
            event = self._conn.next_event()
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            return _refuse(status, _HEAD_TOO_LARGE if status == 431 else str(exc))
        if event is h11.NEED_DATA:
            return NEED_DATA
        if isinstance(event, h11.ConnectionClosed):
            return ProtocolRefused(reply=b"", reason="client closed before sending a request")
        # The first event h11 gives a server is a Request or ConnectionClosed; nothing else can
        # come before the machine stops asking h11.
        assert isinstance(event, h11.Request), event
        if self._received - self.buffered_bytes > MAX_HEADER_BYTES:
            return _refuse(431, _HEAD_TOO_LARGE)
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
        for name, _, value in fields:
            if name == b"host":
                host_header = value  # h11 refuses a second Host field
            elif name in (b"content-length", b"transfer-encoding"):
                framing.add(name)
        if len(framing) == 2:
            return _refuse(400, "Content-Length and Transfer-Encoding together are refused")
        if host_header is not None:
            refused = _check_host_header(host_header, parsed)
            if refused is not None:
                return refused
        self._forward_head = _forward_head(request, parsed, fields, add_host=host_header is None)
        return CheckEgress(host=parsed.host, port=parsed.port, kind="forward")

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

    def _upstream_failed_reply(self, check: CheckEgress, error: str) -> bytes:
        where = _display(check.host, check.port)
        body = f"cc-server egress proxy could not connect to {where}: {error or 'failed'}\n"
        return _response(502, body, [(b"X-Cc-Server-Egress", b"upstream-failed")])

    def _established_reply(self) -> bytes:
        return CONNECT_ESTABLISHED if self._connect else b""

    def _take_relay_prefix(self) -> bytes:
        assert self._conn is not None  # the relay prefix is taken once
        rest = self._conn.trailing_data[0]
        self._conn = None  # the relay owns these bytes now; h11's buffer goes with it
        return self._forward_head + rest


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


def _forward_head(
    request: h11.Request, target: _Target, fields: list[_Field], *, add_host: bool
) -> bytes:
    named_by_connection = {
        token.strip().lower()
        for name, _, value in fields
        if name == b"connection"
        for token in value.split(b",")
    } - _KEPT_HEADERS
    lines = [b"%s %s HTTP/%s" % (request.method, target.origin_form.encode(), request.http_version)]
    if add_host:
        host = f"[{target.host}]" if ":" in target.host else target.host
        lines.append(b"Host: " + (host if target.port == 80 else f"{host}:{target.port}").encode())
    for name, raw_name, value in fields:
        if name not in _DROPPED_HEADERS and name not in named_by_connection:
            lines.append(raw_name + b": " + value)
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


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
