"""Server settings: the `serve` options and the `CC_SERVER_*` variables, checked before anything
starts.

Every check here fails with `ServerConfigError` (the CLI exits 2) and a message naming what is
allowed; nothing is probed, bound or written before they pass.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from cc_server.egress.operator import OperatorEgress
from cc_server.errors import BadSpec, ConfigError
from cc_server.runtime.output import DEFAULT_COLLECT_LIMIT_BYTES

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "EXEC_OUTPUT_LIMIT_ENV",
    "MAX_EXEC_OUTPUT_LIMIT_BYTES",
    "SANDBOX_ENV",
    "SANDBOX_VALUES",
    "ServerConfig",
    "ServerConfigError",
    "check_bind_address",
    "exec_output_limit",
    "resolve_sandbox_flag",
]

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 8421
SANDBOX_ENV: Final = "CC_SERVER_SANDBOX"
SANDBOX_VALUES: Final = ("on", "off")
# off: no microVM runtime; on: probe it at boot so `microvm` can be asked for; default: also
# the backend of requests that name none (stepping down to native, with a log line).
MICROVM_ENV: Final = "CC_SERVER_MICROVM"
MICROVM_VALUES: Final = ("off", "on", "default")
# Bytes of stdout, and of stderr, a collected `POST .../exec` result keeps (the rest is counted
# and dropped as it arrives). Its JSON body is up to 7.3x that (six-byte escapes, plus base64).
EXEC_OUTPUT_LIMIT_ENV: Final = "CC_SERVER_EXEC_OUTPUT_LIMIT"
# Both heads are held in memory until the body is sent; past this a caller wants the WebSocket.
MAX_EXEC_OUTPUT_LIMIT_BYTES: Final = 1024 * 1024 * 1024


class ServerConfigError(ConfigError):
    """The server's own options or environment are wrong; it did not start."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """Everything `cc-server serve` was asked for, already checked."""

    host: str = DEFAULT_HOST  # address to bind; loopback unless TLS is configured
    port: int = DEFAULT_PORT  # 0 picks a free port (logged on the `listening` line)
    sandbox_on: bool = True  # --sandbox / CC_SERVER_SANDBOX: wrap when the host offers a backend
    token_file: str | None = None  # where the bearer token is written; None: the default path
    log_json: bool = False  # one JSON object per log line instead of text
    tls_cert: str | None = None  # PEM certificate chain; with tls_key, serve HTTPS
    tls_key: str | None = None  # PEM private key of tls_cert
    microvm: str = "off"  # CC_SERVER_MICROVM: off, on or default (see MICROVM_VALUES)
    # CC_SERVER_EXEC_OUTPUT_LIMIT: bytes per stream a collected exec result keeps
    exec_output_limit_bytes: int = DEFAULT_COLLECT_LIMIT_BYTES
    # --dispatch-allow-domain (repeatable): extends every dispatch run's baseline allowlist
    dispatch_allow_domains: tuple[str, ...] = ()

    @property
    def tls(self) -> bool:
        """Whether the server speaks TLS."""
        return self.tls_cert is not None

    @classmethod
    def build(
        cls,
        *,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        sandbox_flag: str | None = None,
        environ: Mapping[str, str] = os.environ,
        token_file: str | None = None,
        log_json: bool = False,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        dispatch_allow_domains: tuple[str, ...] = (),
    ) -> ServerConfig:
        """Check the options and build the config.

        Raises:
            ServerConfigError: a bad --sandbox or CC_SERVER_SANDBOX value, a port outside
                0..65535, only one of the TLS files, a relative token file path, a
                non-loopback address without TLS, a bad CC_SERVER_MICROVM or
                CC_SERVER_EXEC_OUTPUT_LIMIT value, or a malformed dispatch egress setting
                (--dispatch-allow-domain, CC_SERVER_DISPATCH_ALLOW_DOMAINS,
                ANTHROPIC_BASE_URL).
        """
        sandbox_on = resolve_sandbox_flag(sandbox_flag, environ)
        if not 0 <= port <= 65535:
            raise ServerConfigError(f"--port must be 0..65535, got {port}")
        if (tls_cert is None) != (tls_key is None):
            raise ServerConfigError("--tls-cert and --tls-key go together; pass both or neither")
        if token_file is not None and not os.path.isabs(token_file):
            token_file = os.path.abspath(token_file)
        check_bind_address(host, tls=tls_cert is not None)
        microvm = environ.get(MICROVM_ENV, "") or "off"
        if microvm not in MICROVM_VALUES:
            raise ServerConfigError(
                f"{MICROVM_ENV} must be one of {', '.join(MICROVM_VALUES)}, got {microvm!r}"
            )
        try:
            OperatorEgress.build(dispatch_allow_domains, environ)  # checked once here
        except BadSpec as exc:
            raise ServerConfigError(exc.message, fix=exc.fix) from None
        return cls(
            dispatch_allow_domains=tuple(dispatch_allow_domains),
            microvm=microvm,
            exec_output_limit_bytes=exec_output_limit(environ),
            host=host,
            port=port,
            sandbox_on=sandbox_on,
            token_file=token_file,
            log_json=log_json,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )


def exec_output_limit(environ: Mapping[str, str] = os.environ) -> int:
    """`CC_SERVER_EXEC_OUTPUT_LIMIT` as bytes: a decimal integer in 0..1 GiB; unset or empty is
    the default (16 MiB).

    Raises:
        ServerConfigError: anything else.
    """
    value = environ.get(EXEC_OUTPUT_LIMIT_ENV, "")
    if not value:
        return DEFAULT_COLLECT_LIMIT_BYTES
    limit = int(value) if value.isdecimal() and value.isascii() else -1
    if not 0 <= limit <= MAX_EXEC_OUTPUT_LIMIT_BYTES:
        raise ServerConfigError(
            f"{EXEC_OUTPUT_LIMIT_ENV} must be a number of bytes in "
            f"0..{MAX_EXEC_OUTPUT_LIMIT_BYTES}, got {value!r}",
            fix=f"leave it unset for {DEFAULT_COLLECT_LIMIT_BYTES} (16 MiB) per stream",
        )
    return limit


def _parse_switch(value: str, source: str) -> bool:
    if value not in SANDBOX_VALUES:
        allowed = " or ".join(repr(v) for v in SANDBOX_VALUES)
        raise ServerConfigError(
            f"{source} must be {allowed}, got {value!r}",
            fix="'on' wraps commands when the host offers a sandbox backend (the default); "
            "'off' opts out",
        )
    return value == "on"


def resolve_sandbox_flag(flag: str | None, environ: Mapping[str, str] = os.environ) -> bool:
    """`--sandbox` wins over `CC_SERVER_SANDBOX`; neither set means on. An empty variable counts
    as unset. A bad value is an error even where the other source overrides it: a typo in the
    environment must not pass unnoticed.

    Raises:
        ServerConfigError: either source holds something other than "on" or "off".
    """
    from_env = environ.get(SANDBOX_ENV, "")
    env_on = _parse_switch(from_env, SANDBOX_ENV) if from_env else True
    return _parse_switch(flag, "--sandbox") if flag is not None else env_on


def check_bind_address(host: str, *, tls: bool) -> None:
    """Refuse a non-loopback address unless TLS is configured: the bearer token would otherwise
    cross the network in clear text. Loopback is `localhost` or a loopback IP literal.

    Raises:
        ServerConfigError: a non-loopback address without TLS, or an empty address.
    """
    if not host:
        raise ServerConfigError("--host must not be empty", fix=f"use {DEFAULT_HOST}")
    if tls or host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ServerConfigError(
            f"refusing to bind {host!r} without TLS: the bearer token and every command's "
            "output would cross the network in clear text",
            fix=f"bind a loopback address ({DEFAULT_HOST}), or pass --tls-cert and --tls-key",
        )
