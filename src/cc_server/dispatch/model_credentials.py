"""Model credentials brokered per launch: the agent holds a sentinel, the session's proxy swaps it.

The operator gives the server the real key of the agents' model API (`CC_SERVER_MODEL_KEY_FILE`,
read once at boot; never in any environment) and, for an upstream with a private CA, the CA to
trust (`CC_SERVER_MODEL_CA_FILE`). The model API host is the operator's endpoint
(`ANTHROPIC_BASE_URL`, which must be https) or `api.anthropic.com:443`. For each run,
`ModelBroker`:

1. makes a sentinel (`sk-ant-cc-sentinel-` and 24 random bytes): the agent's `ANTHROPIC_API_KEY`.
   It is no key anywhere: the model API refuses it, and only this run's proxy knows it;
2. makes a CA of the session and a leaf for the model host alone (`cryptography`, EC P-256, valid
   for the run's day), keeps both keys in the server's memory and writes the CA certificate (after
   the operator's own `NODE_EXTRA_CA_CERTS`, if any) to the run's state directory, named by
   `NODE_EXTRA_CA_CERTS` for the agent: Claude Code and the ACP adapter trust it, nothing else in
   the sandbox is told to;
3. intercepts the session's tunnels to that host and port only (`intercept`, asked by the
   session's proxies after their allowlist and address guard allowed and dialled the
   connection): it terminates the agent's TLS with the leaf (stdlib `ssl`, http/1.1), opens TLS
   to the real upstream on the connection the proxy dialled (verified against the system CAs
   and the operator's CA, for the model host's name), and relays HTTP/1.1 requests (`h11`),
   replacing the sentinel by the real key in `x-api-key` or `Authorization: Bearer`;
4. is revoked at teardown: the sentinel is forgotten, live connections are closed and a new one
   is refused.

Every other host's TLS is relayed untouched by the proxy: the broker never sees it.

What this does not protect: while the run lives, anything inside its sandbox can *use* the model
through the proxy with the sentinel (that is what the agent is for); the agent chooses the
requests, so it can spend the key's quota. The real key never enters the sandbox, and the
sentinel is worthless outside this run.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import ipaddress
import logging
import os
import secrets
import socket
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

import h11
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cc_server.egress.addresses import IPAddress
from cc_server.egress.driver import TunnelHandler
from cc_server.egress.operator import OperatorEgress
from cc_server.egress.patterns import InvalidHostName, parse_host
from cc_server.errors import ConfigError

__all__ = [
    "CA_FILE_NAME",
    "DEFAULT_MODEL_HOST",
    "KEY_ENV",
    "KEY_FILE_ENV",
    "UPSTREAM_CA_ENV",
    "ModelBroker",
    "ModelCredentials",
]

log = logging.getLogger("cc_server.dispatch.model")
KEY_FILE_ENV: Final = "CC_SERVER_MODEL_KEY_FILE"  # the real key, in a file the server reads once
UPSTREAM_CA_ENV: Final = "CC_SERVER_MODEL_CA_FILE"  # a CA the server trusts for the upstream
KEY_ENV: Final = "ANTHROPIC_API_KEY"  # what the agent is given: the sentinel
CA_ENV: Final = "NODE_EXTRA_CA_CERTS"  # how Node (Claude Code, the ACP adapter) trusts the CA
CA_FILE_NAME: Final = "cc-server-model-ca.pem"  # in the run's state directory
DEFAULT_MODEL_HOST: Final = ("api.anthropic.com", 443)
SENTINEL_PREFIX: Final = "sk-ant-cc-sentinel-"
MAX_KEY_BYTES: Final = 4096  # a key file larger than this is not a key
MAX_HEADER_BYTES: Final = 64 * 1024  # one request or response head (h11's incomplete event)
READ_BYTES: Final = 64 * 1024  # one read of either side
IDLE_TIMEOUT_S: Final = 600.0  # no byte either way for this long closes the connection
TLS_HANDSHAKE_TIMEOUT_S: Final = 30.0  # each side's handshake
CERT_VALIDITY: Final = datetime.timedelta(days=1)  # the session CA and leaf (a run is shorter)
# The methods relayed with the key: what a model API is called with. TRACE (a server that
# supports it echoes the request's headers, the key among them) and the rest get 405.
RELAYED_METHODS: Final = frozenset({b"GET", b"POST", b"HEAD", b"DELETE", b"PUT", b"PATCH"})


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCredentials:
    """The operator's model credential, read at boot."""

    key: str = field(repr=False)  # the real key: in the server's memory only
    host: IPAddress | str  # the model API host (canonical name or address)
    port: int
    key_file: str  # where it was read (never inside a bind: `server_private`)
    upstream_ca_file: str | None = None  # a CA the upstream's certificate may chain to

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], egress: OperatorEgress
    ) -> ModelCredentials | None:
        """The credential from `CC_SERVER_MODEL_KEY_FILE` (None when unset), for the
        operator's model endpoint.

        Raises:
            ConfigError: the key file is not absolute, unreadable, empty or too large; the upstream
                CA file is not absolute or missing; the model endpoint is not https.
        """
        key_file = environ.get(KEY_FILE_ENV) or None
        if key_file is None:
            return None
        if not os.path.isabs(key_file):
            raise ConfigError(f"{KEY_FILE_ENV} must be absolute, got {key_file!r}")
        try:
            with open(key_file, "rb") as f:
                data = f.read(MAX_KEY_BYTES + 1)
        except OSError as exc:
            raise ConfigError(
                f"{KEY_FILE_ENV} {key_file!r} cannot be read: {exc.strerror}"
            ) from None
        key = data.decode("utf-8", errors="replace").strip()
        if not key or len(data) > MAX_KEY_BYTES or any(c.isspace() for c in key):
            raise ConfigError(f"{KEY_FILE_ENV} {key_file!r} does not hold one key",
                              fix="put the key alone in the file")
        ca = environ.get(UPSTREAM_CA_ENV) or None
        if ca is not None and (not os.path.isabs(ca) or not os.path.isfile(ca)):
            raise ConfigError(
                f"{UPSTREAM_CA_ENV} must be an absolute path to a PEM file, got {ca!r}"
            )
        if egress.model_url is None:
            host: IPAddress | str = DEFAULT_MODEL_HOST[0]
            port = DEFAULT_MODEL_HOST[1]
        else:
            if not egress.model_url.lower().startswith("https://"):
                raise ConfigError(
                    f"{KEY_FILE_ENV} needs an https model endpoint, and ANTHROPIC_BASE_URL is "
                    f"{egress.model_url!r}: the key is swapped in inside TLS only",
                    fix="give the endpoint as https://, or unset the key file",
                )
            assert egress.model_host is not None and egress.model_port is not None
            host, port = egress.model_host, egress.model_port
        return cls(key=key, host=host, port=port, key_file=key_file, upstream_ca_file=ca)

    def names(self) -> tuple[IPAddress | str, ...]:
        """The host in every spelling a tunnel may name it (`localhost` is its addresses too)."""
        if self.host == "localhost":
            return ("localhost", ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))
        return (self.host,)


def _session_certificates(creds: ModelCredentials) -> tuple[bytes, bytes, bytes]:
    """A CA of the session and a leaf for the model host: (CA PEM, leaf PEM, leaf key PEM)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([
        x509.NameAttribute(NameOID.COMMON_NAME, f"cc-server session CA {secrets.token_hex(4)}"),
    ])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + CERT_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    sans: list[x509.GeneralName] = [
        x509.DNSName(name) if isinstance(name, str) else x509.IPAddress(name)
        for name in creds.names()
    ]
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(creds.host))]))
        .issuer_name(ca_name).public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + CERT_VALIDITY)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
    return ca.public_bytes(pem), leaf.public_bytes(pem), key_pem


def _server_context(leaf_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """The TLS server context of the leaf. `load_cert_chain` reads files only: they are written
    to a private directory of the server and removed at once."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    with tempfile.TemporaryDirectory(prefix="cc-model-") as directory:
        cert_file = os.path.join(directory, "leaf.crt")
        key_file = os.path.join(directory, "leaf.key")
        for path, data in ((cert_file, leaf_pem), (key_file, key_pem)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        context.load_cert_chain(cert_file, key_file)
    return context


@functools.lru_cache(maxsize=4)
def _upstream_context(ca_file: str | None) -> ssl.SSLContext:
    """The upstream's TLS client context: the system CAs (about 50 ms to load) and the
    operator's CA, made once per server and shared by every run's connections."""
    context = ssl.create_default_context()
    if ca_file is not None:
        context.load_verify_locations(cafile=ca_file)
    context.set_alpn_protocols(["http/1.1"])
    return context


class ModelBroker:
    """The model credential of one run (see the module docstring)."""

    def __init__(self, creds: ModelCredentials, state_dir: str,
                 environ: Mapping[str, str] | None = None) -> None:
        """Make the sentinel and the session's certificates; write the CA to `state_dir`
        (after the operator's `NODE_EXTRA_CA_CERTS` file of `environ`, if it is readable)."""
        self.creds = creds
        self.sentinel = SENTINEL_PREFIX + secrets.token_hex(24)
        ca_pem, leaf_pem, key_pem = _session_certificates(creds)
        self._server = _server_context(leaf_pem, key_pem)
        self._upstream = _upstream_context(creds.upstream_ca_file)
        self.ca_file = os.path.join(state_dir, CA_FILE_NAME)
        bundle = b""
        extra = (environ or {}).get(CA_ENV)
        if extra:
            with contextlib.suppress(OSError), open(extra, "rb") as f:
                bundle = f.read().rstrip(b"\n") + b"\n"
        fd = os.open(self.ca_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(bundle + ca_pem)
        self.revoked = False
        self.requests = 0  # requests relayed
        self.swapped = 0  # of them, with the sentinel replaced by the key
        self._live: set[asyncio.StreamWriter] = set()

    @property
    def env(self) -> dict[str, str]:
        """What the agent's environment gets: the sentinel and the CA bundle."""
        return {KEY_ENV: self.sentinel, CA_ENV: self.ca_file}

    def handler(self, host: str, port: int) -> TunnelHandler | None:
        """`ProxyParams.intercept`: `serve` for a tunnel to the model API, else None."""
        return self.serve if self.intercepts(host, port) else None

    def intercepts(self, host: str, port: int) -> bool:
        """Whether a tunnel to `host`:`port` (as the client named it) is the model API's."""
        if port != self.creds.port:
            return False
        try:
            target = parse_host(host)
        except InvalidHostName:
            return False
        return target in self.creds.names()

    async def serve(self, client: socket.socket, upstream: socket.socket, early: bytes) -> None:
        """Terminate the agent's TLS on `client`, open TLS to the model API on `upstream` (the
        proxy dialled it), relay requests with the key swapped in. Closes both sockets' TLS
        streams; a protocol error, a timeout or the revocation ends the connection."""
        if self.revoked or early:
            # Bytes pipelined before the tunnel's reply cannot be fed to the TLS server here.
            log.info("model broker: connection refused (%s)",
                     "revoked" if self.revoked else "early bytes")
            return
        loop = asyncio.get_running_loop()
        server_name = str(self.creds.host)
        a_writer: asyncio.StreamWriter | None = None
        u_writer: asyncio.StreamWriter | None = None
        try:
            a_reader = asyncio.StreamReader(limit=READ_BYTES)
            protocol = asyncio.StreamReaderProtocol(a_reader)
            transport, _ = await loop.connect_accepted_socket(
                lambda: protocol, sock=client, ssl=self._server,
                ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S)
            a_writer = asyncio.StreamWriter(transport, protocol, a_reader, loop)
            self._live.add(a_writer)
            u_reader, u_writer = await asyncio.open_connection(
                sock=upstream, ssl=self._upstream, server_hostname=server_name,
                ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S, limit=READ_BYTES)
            self._live.add(u_writer)
            await self._relay(a_reader, a_writer, u_reader, u_writer)
        except (OSError, ssl.SSLError, h11.ProtocolError, TimeoutError,
                asyncio.IncompleteReadError) as exc:
            log.info("model broker: connection ended: %s: %s", type(exc).__name__, exc)
        finally:
            for writer in (a_writer, u_writer):
                if writer is not None:
                    self._live.discard(writer)
                    writer.close()
                    with contextlib.suppress(Exception):
                        await writer.wait_closed()

    async def _next(self, conn: h11.Connection, reader: asyncio.StreamReader) -> h11.Event:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]
            async with asyncio.timeout(IDLE_TIMEOUT_S):
                data = await reader.read(READ_BYTES)
            conn.receive_data(data)

    def _swap(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        if self.revoked:
            return headers
        sentinel = self.sentinel.encode()
        key = self.creds.key.encode()
        out: list[tuple[bytes, bytes]] = []
        for name, value in headers:
            lower = name.lower()
            if lower == b"x-api-key" and value == sentinel:
                value = key
                self.swapped += 1
            elif lower == b"authorization" and value == b"Bearer " + sentinel:
                value = b"Bearer " + key
                self.swapped += 1
            out.append((name, value))
        return out

    async def _relay(self, a_reader: asyncio.StreamReader, a_writer: asyncio.StreamWriter,
                     u_reader: asyncio.StreamReader, u_writer: asyncio.StreamWriter) -> None:
        agent = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        up = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
        while not self.revoked:
            event = await self._next(agent, a_reader)
            if not isinstance(event, h11.Request):
                return  # the agent closed between requests (ConnectionClosed)
            if event.method.upper() not in RELAYED_METHODS:
                a_writer.write(agent.send(h11.Response(
                    status_code=405, headers=[(b"content-length", b"0"), (b"connection", b"close")],
                    reason=b"Method Not Allowed")) or b"")
                a_writer.write(agent.send(h11.EndOfMessage()) or b"")
                await a_writer.drain()
                return
            self.requests += 1
            u_writer.write(up.send(h11.Request(
                method=event.method, target=event.target,
                headers=self._swap(list(event.headers)), http_version=event.http_version)) or b"")
            while True:
                body = await self._next(agent, a_reader)
                if isinstance(body, h11.Data):
                    u_writer.write(up.send(h11.Data(data=body.data)) or b"")
                elif isinstance(body, h11.EndOfMessage):
                    u_writer.write(up.send(h11.EndOfMessage()) or b"")
                    break
                else:
                    return
            await u_writer.drain()
            while True:
                answer = await self._next(up, u_reader)
                if isinstance(answer, h11.InformationalResponse | h11.Response):
                    a_writer.write(agent.send(type(answer)(
                        status_code=answer.status_code, headers=list(answer.headers),
                        reason=answer.reason)) or b"")
                    if isinstance(answer, h11.InformationalResponse):
                        continue
                elif isinstance(answer, h11.Data):
                    a_writer.write(agent.send(h11.Data(data=answer.data)) or b"")
                    await a_writer.drain()
                elif isinstance(answer, h11.EndOfMessage):
                    a_writer.write(agent.send(h11.EndOfMessage()) or b"")
                    await a_writer.drain()
                    break
                else:
                    return
            if h11.MUST_CLOSE in (agent.our_state, up.our_state, up.their_state):
                return
            agent.start_next_cycle()
            up.start_next_cycle()

    def revoke(self) -> None:
        """Forget the sentinel and close every live connection. Idempotent."""
        self.revoked = True
        for writer in list(self._live):
            writer.close()
        self._live.clear()
