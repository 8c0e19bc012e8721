"""The operator's egress for dispatch: what every dispatch run may reach beyond the baseline.

The reference page's rule stays: the dispatch path passes no per-run `egressAllowlist`, and a
run gets the curated baseline plus what its capabilities earn. The curation is the operator's:

- `cc-server serve --dispatch-allow-domain PATTERN` (repeatable) and
  `CC_SERVER_DISPATCH_ALLOW_DOMAINS` (comma-separated) add entries in the allowlist syntax
  (`egress.patterns.parse_entry`: a name, `*.example.com`, `a.*.example.com`, an IP literal,
  each with an optional port, `registry.internal:5000`, `[fd00::5]:443`) to the baseline of every
  dispatch run; an entry without a port allows every port. An IP literal is also how a name that
  resolves to a non-public address (an internal registry) is reached: the address guard lets
  through only an address that is itself on the allowlist.
- the agents' model endpoint, `ANTHROPIC_BASE_URL` in the server's environment, is allowed
  automatically, on its own port only (`AllowlistRule.port`): `http://127.0.0.1:4000` allows
  127.0.0.1 port 4000, not the host's other loopback services. `localhost` stands for
  127.0.0.1 and ::1 (what it resolves to). Any other name that resolves to a non-public address
  needs that address from the operator (the flag), on every port.

A refusal in a dispatch run names these settings (`advice`), not `cc-server run --allow-domain`,
which does not apply to a dispatch. Pure: nothing here resolves a name or opens a socket.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from cc_server.egress.addresses import IPAddress
from cc_server.egress.patterns import (
    AllowlistRule,
    DomainPattern,
    InvalidHostName,
    InvalidPattern,
    IpLiteralPattern,
    parse_entry,
    parse_host,
)
from cc_server.errors import BadSpec

if TYPE_CHECKING:
    from cc_server.egress.driver import TunnelHandler

__all__ = [
    "ALLOW_ENV",
    "ALLOW_FLAG",
    "MODEL_URL_ENV",
    "OperatorEgress",
]

ALLOW_FLAG: Final = "--dispatch-allow-domain"
ALLOW_ENV: Final = "CC_SERVER_DISPATCH_ALLOW_DOMAINS"
MODEL_URL_ENV: Final = "ANTHROPIC_BASE_URL"
OPERATOR_REASON: Final = f"the operator's dispatch allowlist ({ALLOW_FLAG}, {ALLOW_ENV})"
MODEL_REASON: Final = f"the agents' model endpoint ({MODEL_URL_ENV})"
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
_LOCALHOST_ADDRESSES: Final = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorEgress:
    """The operator's extension of the dispatch baseline, already checked."""

    patterns: tuple[str, ...] = ()
    """The operator's entries, canonical (`Bücher.example` as `xn--bcher-kva.example`)."""
    model_url: str | None = None
    """The agents' model endpoint (`ANTHROPIC_BASE_URL`), passed to every agent."""
    model_host: IPAddress | str | None = None
    """Its host: a canonical name or an address."""
    model_port: int | None = None
    """Its port (the scheme's default when the URL names none)."""
    rules: tuple[AllowlistRule, ...] = ()
    """What extends the baseline: the operator's entries, then the model endpoint's."""
    intercept: Callable[[str, int], TunnelHandler | None] | None = None
    """One run's: the handler of its tunnels to the model API (`dispatch.model_credentials`),
    set per run by the dispatch service (`ProxyParams.intercept`)."""

    @classmethod
    def build(
        cls, flag_patterns: Iterable[str] = (), environ: Mapping[str, str] | None = None
    ) -> OperatorEgress:
        """The operator's settings: the serve flag's patterns, then `CC_SERVER_DISPATCH_ALLOW_
        DOMAINS` (comma-separated, blanks ignored), then `ANTHROPIC_BASE_URL`, from `environ`.

        Raises:
            InvalidPattern: an entry is malformed; the message names the setting and the entry.
            BadSpec: the model endpoint is not an http(s) URL with a valid host, or it carries
                a user name or password (a credential in the environment of every agent).
        """
        env = environ or {}
        entries = [(ALLOW_FLAG, text) for text in flag_patterns]
        entries += [
            (ALLOW_ENV, text.strip()) for text in env.get(ALLOW_ENV, "").split(",") if text.strip()
        ]
        rules: list[AllowlistRule] = []
        for source, text in entries:
            try:
                pattern, port = parse_entry(text)
            except InvalidPattern as exc:
                raise InvalidPattern(f"{source} {text!r}: {exc.message}") from None
            rules.append(AllowlistRule(pattern=pattern, reason=OPERATOR_REASON, port=port))
        patterns = tuple(dict.fromkeys(rule.entry for rule in rules))
        url = env.get(MODEL_URL_ENV) or None
        if url is None:
            return cls(patterns=patterns, rules=tuple(rules))
        host, port = _endpoint(url)
        if host == "localhost":
            targets: tuple[IPAddress | str, ...] = (host, *_LOCALHOST_ADDRESSES)
        else:
            targets = (host,)
        for target in targets:
            pattern_for = (
                DomainPattern(text=target)
                if isinstance(target, str)
                else IpLiteralPattern(address=target)
            )
            rules.append(AllowlistRule(pattern=pattern_for, reason=MODEL_REASON, port=port))
        return cls(
            patterns=patterns,
            model_url=url,
            model_host=host,
            model_port=port,
            rules=tuple(rules),
        )

    @property
    def model_on_loopback(self) -> bool:
        """Whether the model endpoint is on the host's loopback (`localhost` included): a
        sandbox must reach it through its proxies, never around them (`NO_PROXY`)."""
        host = self.model_host
        if host is None:
            return False
        return host == "localhost" if isinstance(host, str) else host.is_loopback

    def no_proxy(self, default: str) -> str:
        """`default` (a `NO_PROXY` list) without the model endpoint's host in any spelling, so
        that a loopback endpoint goes through the session's proxies."""
        host = self.model_host
        if host is None:
            return default
        names = {str(host)}
        if host == "localhost":
            names.update(map(str, _LOCALHOST_ADDRESSES))
        kept = [e for e in default.split(",") if e.strip().strip("[]").lower() not in names]
        return ",".join(kept)

    def advice(self, entry: str) -> str:
        """How to allow a refused target for every dispatch run: the settings that apply, with
        the port-scoped entry that would allow it (`host:443`, `driver.entry_for`)."""
        return (
            f"ask the operator to allow {entry} for every dispatch run "
            f"(cc-server serve {ALLOW_FLAG} {entry}, or {entry} in {ALLOW_ENV})"
        )


def _endpoint(url: str) -> tuple[IPAddress | str, int]:
    fix = f"set {MODEL_URL_ENV} to the endpoint's URL, such as https://gateway.example.com"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise BadSpec(f"{MODEL_URL_ENV} is not a URL: {exc}", fix=fix) from None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise BadSpec(f"{MODEL_URL_ENV} is not an http or https URL", fix=fix)
    if parts.username is not None or parts.password is not None:
        raise BadSpec(
            f"{MODEL_URL_ENV} carries a user name or password: every agent would see it",
            fix="give the endpoint without credentials",
        )
    try:
        host = parse_host(parts.hostname)
    except InvalidHostName as exc:
        raise BadSpec(f"{MODEL_URL_ENV} has no valid host: {exc}", fix=fix) from None
    return host, port if port is not None else _DEFAULT_PORTS[parts.scheme]
