"""Environment sanitisation for the ACP and harness bash paths, sandboxed or not.

An allowlist of ordinary variables passes; anything whose name looks like a secret never does,
even when a pattern of the allowlist (`LC_*`) would let it through. What the caller adds (proxy
variables, the credential helper's git config) is applied after and is checked too: a secret-like
name is refused, and so is any value that carries a value the host keeps under a secret-like name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from cc_server.errors import EnforcementFailed

__all__ = [
    "ALLOWED_NAMES",
    "ALLOWED_PREFIXES",
    "SECRET_SUBSTRINGS",
    "SECRET_WORDS",
    "EnvRefused",
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

# Names the caller may add although they contain a secret-like word: git's config-by-environment
# key slots hold a config key name ("credential.helper"), never a secret. Their values are checked
# like every other added value.
_ADD_NAME_EXCEPTIONS: Final = re.compile(r"^GIT_CONFIG_KEY_[0-9]{1,3}\Z")
_VALID_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
MIN_SECRET_VALUE_CHARS: Final = 6  # shorter host values ("1", "yes") would match by accident


class EnvRefused(EnforcementFailed):
    """An environment addition would pass a secret-like name or a host secret's value."""


def looks_secret(name: str) -> bool:
    """Whether a variable name looks like it holds a credential (case-insensitive)."""
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
        value
        for name, value in source.items()
        if looks_secret(name) and len(value) >= MIN_SECRET_VALUE_CHARS
    ]
    for name, value in add.items():
        if not _VALID_NAME.match(name) or "\x00" in value:
            raise EnvRefused(
                f"environment addition {name!r} is not a valid variable",
                fix="add only NAME=value pairs without NUL bytes",
            )
        if looks_secret(name) and not _ADD_NAME_EXCEPTIONS.match(name):
            raise EnvRefused(
                f"environment addition {name!r} is named like a secret",
                fix="broker credentials through the credential broker, never the environment",
            )
        if any(secret in value for secret in secrets):
            raise EnvRefused(
                f"environment addition {name!r} carries the value of a host secret variable",
                fix="do not copy host secrets into a run's environment",
            )
        out[name] = value
    return out
