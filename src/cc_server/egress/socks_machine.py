"""The SOCKS5 proxy's client side as a sans-IO state machine (RFC 1928; see `proto` for the
driver protocol).

The conversation, one CONNECT per client connection:

1. Greeting ``05 NMETHODS METHODS...``. The proxy selects 0x00 (no authentication) when offered:
   `SendToClient` ``05 00``. Otherwise it answers ``05 FF`` and refuses. No authentication is
   needed: only processes inside this session's sandbox can reach this proxy, and the allowlist,
   not a password, decides where they may go.
2. Request ``05 CMD 00 ATYP DST.ADDR DST.PORT``. Only CMD 1 (CONNECT) is served; BIND and UDP
   ASSOCIATE are refused with 0x07. ATYP 1 (IPv4) and 4 (IPv6) become the dotted or compressed
   literal; ATYP 3 (domain name, 1..255 bytes) is taken as given when it is a host name
   (letters, digits, '-', '.', '_') or an IPv6 literal (some clients send those as names), and
   refused with 0x01 otherwise (non-ASCII, NUL, spaces, '%', ...). Any other ATYP: 0x08.
   Port 0 cannot be dialled: refused with 0x02 (not allowed by ruleset) without asking the
   allowlist. A bad version or a non-zero reserved byte: 0x01.
3. `CheckEgress` (kind ``connect``). Denied: reply 0x02. Then `OpenUpstream`; failure: 0x05 for
   `UPSTREAM_REFUSED`, 0x04 for `UPSTREAM_UNREACHABLE`, 0x01 for anything else. Success: 0x00.
4. `StartRelay` with any bytes the client pipelined behind its request.

Every reply carries BND.ADDR 0.0.0.0 and BND.PORT 0: the bound address is the proxy's own
outbound socket, which tells the client nothing useful and would tell it about the host.

A SOCKS4 client (first byte 4) gets the SOCKS4 "request rejected" reply, so it fails at once with
a clear code; any other first byte is refused with no reply (it is not a SOCKS client).

Buffers: a greeting is at most 2 + 255 bytes and a request at most 4 + 1 + 255 + 2; the machine
never buffers more than those plus the one chunk just read.
"""

from __future__ import annotations

import ipaddress
from typing import Final

from cc_server.egress.proto import (
    NEED_DATA,
    UPSTREAM_REFUSED,
    UPSTREAM_UNREACHABLE,
    CheckEgress,
    HandshakeMachine,
    NeedData,
    ProtocolRefused,
    SendToClient,
    parse_hostname,
    parse_ipv6,
)

__all__ = [
    "REP_ADDRESS_TYPE_NOT_SUPPORTED",
    "REP_COMMAND_NOT_SUPPORTED",
    "REP_CONNECTION_REFUSED",
    "REP_GENERAL_FAILURE",
    "REP_HOST_UNREACHABLE",
    "REP_NOT_ALLOWED",
    "REP_SUCCEEDED",
    "Socks5Machine",
    "socks5_reply",
]

SOCKS_VERSION: Final = 5
METHOD_NO_AUTH: Final = 0x00
METHOD_NONE_ACCEPTABLE: Final = 0xFF
CMD_CONNECT: Final = 1
ATYP_IPV4: Final = 1
ATYP_DOMAIN: Final = 3
ATYP_IPV6: Final = 4

# Reply codes (RFC 1928 section 6).
REP_SUCCEEDED: Final = 0x00
REP_GENERAL_FAILURE: Final = 0x01
REP_NOT_ALLOWED: Final = 0x02  # "connection not allowed by ruleset"
REP_HOST_UNREACHABLE: Final = 0x04
REP_CONNECTION_REFUSED: Final = 0x05
REP_COMMAND_NOT_SUPPORTED: Final = 0x07
REP_ADDRESS_TYPE_NOT_SUPPORTED: Final = 0x08

# SOCKS4 reply "request rejected or failed" (VN 0, CD 0x5B, port and address zero).
SOCKS4_REJECTED: Final = b"\x00\x5b\x00\x00\x00\x00\x00\x00"

_COMMAND_NAMES: Final = {2: "BIND", 3: "UDP ASSOCIATE"}


def socks5_reply(rep: int) -> bytes:
    """A SOCKS5 reply with code ``rep`` and BND 0.0.0.0:0."""
    return bytes((SOCKS_VERSION, rep, 0x00, ATYP_IPV4, 0, 0, 0, 0, 0, 0))


def _refuse(rep: int, reason: str) -> ProtocolRefused:
    return ProtocolRefused(reply=socks5_reply(rep), reason=reason)


class Socks5Machine(HandshakeMachine):
    """One client connection to the SOCKS5 proxy, from the greeting to `StartRelay`.

    `receive_data`, `next_event`, `decide` and `upstream_result` are described on
    `proto.HandshakeMachine`; they raise `proto.ProtocolError` only for driver mistakes.
    """

    def __init__(self) -> None:
        super().__init__()
        self._buffer = bytearray()
        self._greeted = False

    @property
    def buffered_bytes(self) -> int:
        """Client bytes received and not yet handed on."""
        return len(self._buffer)

    def _feed(self, data: bytes) -> None:
        self._buffer += data

    def _parse(self) -> NeedData | SendToClient | CheckEgress | ProtocolRefused:
        if not self._greeted:
            return self._parse_greeting()
        return self._parse_request()

    def _need_more(self) -> NeedData | ProtocolRefused:
        if self._eof:
            return ProtocolRefused(reply=b"", reason="client closed during the SOCKS5 handshake")
        return NEED_DATA

    def _parse_greeting(self) -> NeedData | SendToClient | ProtocolRefused:
        buf = self._buffer
        if not buf:
            return self._need_more()
        if buf[0] == 4:
            return ProtocolRefused(
                reply=SOCKS4_REJECTED, reason="SOCKS4 is not supported: use SOCKS5"
            )
        if buf[0] != SOCKS_VERSION:
            return ProtocolRefused(
                reply=b"", reason=f"not a SOCKS5 greeting (first byte 0x{buf[0]:02x})"
            )
        if len(buf) < 2:
            return self._need_more()
        count = buf[1]
        if count == 0:
            return self._refuse_method("SOCKS5 greeting offers no authentication method")
        if len(buf) < 2 + count:
            return self._need_more()
        methods = bytes(buf[2 : 2 + count])
        del buf[: 2 + count]
        if METHOD_NO_AUTH not in methods:
            return self._refuse_method("client does not offer method 0x00 (no authentication)")
        self._greeted = True
        return SendToClient(data=bytes((SOCKS_VERSION, METHOD_NO_AUTH)))

    @staticmethod
    def _refuse_method(reason: str) -> ProtocolRefused:
        return ProtocolRefused(reply=bytes((SOCKS_VERSION, METHOD_NONE_ACCEPTABLE)), reason=reason)

    def _parse_request(self) -> NeedData | CheckEgress | ProtocolRefused:
        buf = self._buffer
        if len(buf) < 4:
            return self._need_more()
        version, command, reserved, address_type = buf[:4]
        if version != SOCKS_VERSION:
            return _refuse(REP_GENERAL_FAILURE, f"request version {version}, expected 5")
        if command != CMD_CONNECT:
            name = _COMMAND_NAMES.get(command, f"command 0x{command:02x}")
            return _refuse(REP_COMMAND_NOT_SUPPORTED, f"{name} is not supported: CONNECT only")
        if reserved != 0:
            return _refuse(REP_GENERAL_FAILURE, "reserved byte is not zero")
        if address_type == ATYP_IPV4:
            address_end = 4 + 4
        elif address_type == ATYP_IPV6:
            address_end = 4 + 16
        elif address_type == ATYP_DOMAIN:
            if len(buf) < 5:
                return self._need_more()
            if buf[4] == 0:
                return _refuse(REP_GENERAL_FAILURE, "empty domain name")
            address_end = 5 + buf[4]
        else:
            return _refuse(
                REP_ADDRESS_TYPE_NOT_SUPPORTED,
                f"address type 0x{address_type:02x} is not supported",
            )
        if len(buf) < address_end + 2:
            return self._need_more()
        address = bytes(buf[4:address_end])
        port = int.from_bytes(buf[address_end : address_end + 2], "big")
        del buf[: address_end + 2]
        if address_type == ATYP_IPV4:
            host = str(ipaddress.IPv4Address(address))
        elif address_type == ATYP_IPV6:
            host = str(ipaddress.IPv6Address(address))
        else:
            domain = _domain(address[1:])
            if domain is None:
                return _refuse(REP_GENERAL_FAILURE, f"bad domain name {address[1:]!r}")
            host = domain
        if port == 0:
            return _refuse(REP_NOT_ALLOWED, "port 0 cannot be dialled")
        return CheckEgress(host=host, port=port, kind="connect")

    def _denied_reply(self, check: CheckEgress, reason: str, how_to_allow: str) -> bytes:
        # SOCKS5 has no room for text: the reason reaches the agent through the violation event.
        return socks5_reply(REP_NOT_ALLOWED)

    def _upstream_failed_reply(self, check: CheckEgress, error: str) -> bytes:
        if error == UPSTREAM_REFUSED:
            return socks5_reply(REP_CONNECTION_REFUSED)
        if error == UPSTREAM_UNREACHABLE:
            return socks5_reply(REP_HOST_UNREACHABLE)
        return socks5_reply(REP_GENERAL_FAILURE)

    def _established_reply(self) -> bytes:
        return socks5_reply(REP_SUCCEEDED)

    def _take_relay_prefix(self) -> bytes:
        rest = bytes(self._buffer)
        self._buffer.clear()
        return rest


def _domain(raw: bytes) -> str | None:
    """A domain name as given, or an IPv6 literal sent as a name (compressed); else None."""
    if not raw.isascii():
        return None
    text = raw.decode("ascii")
    if ":" in text:
        return parse_ipv6(text)
    return parse_hostname(text)
