"""Environment sanitisation for the ACP and harness bash paths, sandboxed or not.

An allowlist of ordinary variables passes; anything whose name looks like a secret never does,
even when a pattern of the allowlist (`LC_*`) would let it through. What the caller adds (proxy
variables, the credential helper's git config) is applied after and is checked too: a secret-like
name is refused, and so is any value that carries a value the host keeps under a secret-like name.

A few names match a secret-like word and hold nothing secret (`NOT_SECRET_NAMES`): the shell's
`PWD` and `OLDPWD`, the CA-bundle variables (`SSL_CERT_FILE`, `NODE_EXTRA_CA_CERTS`, ...: public
certificates) and the login session's metadata (`XDG_SESSION_TYPE`, `DESKTOP_SESSION`). They are
not secrets: their values never make an addition refused (a server started from its home has
`PWD` = a prefix of every run's `HOME`), and an addition may carry their names. The CA-bundle
variables reach a run through `ca_bundle_env` (the dispatch service binds their files), never
through the allowlist.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Final

from cc_server.errors import BadSpec

__all__ = [
    "ALLOWED_NAMES",
    "ALLOWED_PREFIXES",
    "CA_BUNDLE_NAMES",
    "NOT_SECRET_NAMES",
    "SECRET_SUBSTRINGS",
    "SECRET_WORDS",
    "EnvRefused",
    "ca_bundle_env",
    "ca_bundle_paths",
    "looks_secret",
    "sanitized_env",
]

# Ordinary variables a command expects, none of which holds a credential.
ALLOWED_NAMES: Final = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TERM",
        "COLORTERM",
        "TZ",
        "TMPDIR",
        "EDITOR",
        "VISUAL",
        "PAGER",
        "NO_COLOR",
        "FORCE_COLOR",
        "CLICOLOR",
        "COLUMNS",
        "LINES",
        "XDG_CONFIG_HOME",
        "XDG_CACHE_HOME",
        "XDG_DATA_HOME",
        "XDG_STATE_HOME",
    }
)
# Families passed by prefix: the locale categories.
ALLOWED_PREFIXES: Final = ("LC_",)

# A name containing one of these (case-insensitive) is a secret, whatever else it says.
SECRET_SUBSTRINGS: Final = (
    "TOKEN",
    "SECRET",
    "PASS",  # PASSWORD, PASSWD, PASSPHRASE, ASKPASS
    "PWD",  # DB_PWD; PWD itself is not on the allowlist either
    "KEY",  # API_KEY, APIKEY, PRIVATE_KEY, ACCESS_KEY_ID
    "CREDENTIAL",
    "CRED",
    "AUTH",  # AUTHORIZATION, OAUTH, SSH_AUTH_SOCK
    "SESSION",
    "COOKIE",
    "PRIVATE",
    "CERT",
    "BEARER",
    "SIGNING",
    "SALT",
    "CONNECTION_STRING",
    "DATABASE_URL",
    "WEBHOOK",
)
# A name with one of these as a whole word (split on '_' and digits) is a secret too; they are
# too short to match as substrings.
SECRET_WORDS: Final = frozenset({"PAT", "PW", "PIN", "JWT", "DSN", "SAS", "OTP", "SIG", "MFA"})

# Where TLS clients look for the CA certificates to trust (an operator behind a TLS-inspecting
# proxy sets them). They name public certificates, never a client certificate or key: GIT_SSL_CERT,
# GIT_SSL_KEY, PIP_CLIENT_CERT and the like stay secrets. The *_DIR/CAPATH ones name directories;
# SSL_CERT_DIR may list several, ':'-separated (OpenSSL).
CA_BUNDLE_NAMES: Final = frozenset(
    {
        "SSL_CERT_FILE",  # OpenSSL, Python ssl, Go, Ruby
        "SSL_CERT_DIR",
        "NODE_EXTRA_CA_CERTS",  # Node.js (Claude Code, npm)
        "REQUESTS_CA_BUNDLE",  # Python requests, pip
        "CURL_CA_BUNDLE",  # curl
        "PIP_CERT",  # pip's --cert
        "GIT_SSL_CAINFO",  # git over HTTPS
        "GIT_SSL_CAPATH",
        "AWS_CA_BUNDLE",  # AWS CLI and SDKs
        "CARGO_HTTP_CAINFO",  # cargo
        "NPM_CONFIG_CAFILE",  # npm's cafile
        "npm_config_cafile",
        "DENO_CERT",  # Deno
        "NIX_SSL_CERT_FILE",  # Nix
    }
)
# Names that match a secret-like word but hold nothing secret (see the module docstring).
NOT_SECRET_NAMES: Final = CA_BUNDLE_NAMES | frozenset(
    {
        "PWD",  # the shell's working directory
        "OLDPWD",  # the shell's previous one
        "XDG_SESSION_ID",  # logind session metadata: an id, a type, a class, a desktop name
        "XDG_SESSION_TYPE",
        "XDG_SESSION_CLASS",
        "XDG_SESSION_DESKTOP",
        "DESKTOP_SESSION",
    }
)

# Names the caller may add although they contain a secret-like word: git's config-by-environment
# key slots hold a config key name ("credential.helper"), never a secret. Their values are checked
# like every other added value.
_ADD_NAME_EXCEPTIONS: Final = re.compile(r"^GIT_CONFIG_KEY_[0-9]{1,3}\Z")
_VALID_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
MIN_SECRET_VALUE_CHARS: Final = 6  # shorter host values ("1", "yes") would match by accident


class EnvRefused(BadSpec):
    """An environment addition would pass a secret-like name or a host secret's value.

    `variable` is the refused addition; `host_variable` the host variable whose value it
    carries, if that is why. `operator` is False for a caller's addition (the caller fixes its
    request) and True when the server's own configuration produced it (the dispatch service
    re-raises with True: the operator fixes the server's environment).
    """

    def __init__(
        self,
        message: str,
        *,
        fix: str | None = None,
        variable: str = "",
        host_variable: str | None = None,
        operator: bool = False,
    ) -> None:
        super().__init__(message, fix=fix)
        self.variable = variable
        self.host_variable = host_variable
        self.operator = operator


def looks_secret(name: str) -> bool:
    """Whether a variable name looks like it holds a credential (case-insensitive).

    The names of `NOT_SECRET_NAMES` (exactly as spelled there) do not."""
    if name in NOT_SECRET_NAMES:
        return False
    upper = name.upper()
    if any(part in upper for part in SECRET_SUBSTRINGS):
        return True
    words = {w for w in re.split(r"[^A-Z]+", upper) if w}
    return not words.isdisjoint(SECRET_WORDS)


def _allowed(name: str) -> bool:
    if not _VALID_NAME.match(name) or looks_secret(name):
        return False
    return name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES)


def sanitized_env(
    source: Mapping[str, str], *, add: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment a spawned agent process gets: the allowlisted part of `source`, then `add`.

    Raises:
        EnvRefused: an added name is malformed or looks like a secret (git's GIT_CONFIG_KEY_<n>
            excepted), or an added value contains the value of a secret-like variable of
            `source` (a host token smuggled under an ordinary name).
    """
    out = {name: value for name, value in source.items() if _allowed(name) and "\x00" not in value}
    if not add:
        return out
    secrets = [
        (host_name, value)
        for host_name, value in source.items()
        if looks_secret(host_name) and len(value) >= MIN_SECRET_VALUE_CHARS
    ]
    for name, value in add.items():
        if not _VALID_NAME.match(name) or "\x00" in value:
            raise EnvRefused(
                f"environment addition {name!r} is not a valid variable",
                fix="add only NAME=value pairs without NUL bytes",
                variable=name,
            )
        if looks_secret(name) and not _ADD_NAME_EXCEPTIONS.match(name):
            raise EnvRefused(
                f"environment addition {name!r} is named like a secret",
                fix="broker credentials through the credential broker, never the environment",
                variable=name,
            )
        carried = next((host for host, secret in secrets if secret in value), None)
        if carried is not None:
            raise EnvRefused(
                f"environment addition {name!r} carries the value of the host secret variable "
                f"{carried!r} (a secret-like name)",
                fix=f"do not copy {carried} into a run's environment; if {carried} holds no "
                "secret, unset it in the server's environment",
                variable=name,
                host_variable=carried,
            )
        out[name] = value
    return out


def ca_bundle_env(source: Mapping[str, str]) -> dict[str, str]:
    """The CA-bundle variables of `source` (`CA_BUNDLE_NAMES`) whose value names existing
    absolute paths (every entry of a ':'-separated SSL_CERT_DIR); the rest would be useless in a
    run and are dropped. Never raises."""
    out: dict[str, str] = {}
    for name in sorted(CA_BUNDLE_NAMES):
        value = source.get(name, "")
        paths = ca_bundle_paths(name, value)
        if paths and all(os.path.isabs(p) and os.path.exists(p) for p in paths):
            out[name] = value
    return out


def ca_bundle_paths(name: str, value: str) -> list[str]:
    """The paths a CA-bundle variable's value names (SSL_CERT_DIR: ':'-separated)."""
    if not value or "\x00" in value:
        return []
    return [p for p in value.split(":") if p] if name == "SSL_CERT_DIR" else [value]
