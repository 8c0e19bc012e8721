"""The bearer token: generated at start, written to a file only this user can read, checked on
every route but `/healthz` in constant time.

Another local user cannot read the file (0600, in a 0700 directory by default), and a web page
cannot learn the token, so neither can drive the server. WebSocket clients that cannot set headers
(browsers) may pass the token as the `token` query parameter instead; plain HTTP routes accept
only the header, so the token does not end up in URLs that get logged or shared.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Middleware

from cc_server.runtime.egress import egress_base_dir
from cc_server.server.config import ServerConfigError

__all__ = [
    "PUBLIC_PATHS",
    "TOKEN_BYTES",
    "bearer_auth",
    "default_token_path",
    "generate_token",
    "remove_token_file",
    "write_token_file",
]

TOKEN_BYTES: Final = 32  # 256 bits of entropy, URL-safe base64 (43 characters)
TOKEN_FILE_NAME: Final = "token"
PUBLIC_PATHS: Final = frozenset({"/healthz"})  # answered without a token; reveals nothing

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def generate_token() -> str:
    """A fresh random token."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def default_token_path(environ: Mapping[str, str] = os.environ) -> str:
    """`$XDG_RUNTIME_DIR/cc-server/token`, else `/tmp/cc-server-<uid>/token`: the same private
    directory the egress sockets use.

    Raises:
        EnforcementFailed: that directory exists but is not private to this user.
    """
    return os.path.join(egress_base_dir(environ), TOKEN_FILE_NAME)


def write_token_file(path: str, token: str) -> None:
    """Write `token` to `path`, mode 0600, atomically (a temporary file renamed over it).

    Raises:
        ServerConfigError: the directory does not exist or cannot be written.
    """
    directory = os.path.dirname(path) or "."
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask says
            os.write(fd, f"{token}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise ServerConfigError(
            f"cannot write the token file {path!r}: {exc.strerror or exc}",
            fix="pass --token-file with a path in an existing directory you own",
        ) from exc


def remove_token_file(path: str, token: str) -> None:
    """Remove the token file if it still holds `token` (another server may have replaced it)."""
    with contextlib.suppress(OSError):
        with open(path, encoding="ascii") as f:
            current = f.read().strip()
        if hmac.compare_digest(current.encode(), token.encode()):
            os.unlink(path)


def _presented(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    if request.headers.get("Upgrade", "").lower() == "websocket":
        return request.query.get("token")
    return None


def bearer_auth(token: str) -> Middleware:
    """Middleware refusing every request outside PUBLIC_PATHS without the right token (401)."""
    expected = token.encode()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PUBLIC_PATHS:
            return await handler(request)
        presented = _presented(request)
        if presented is None or not hmac.compare_digest(
            presented.encode("utf-8", "surrogateescape"), expected
        ):
            raise web.HTTPUnauthorized(
                text=(
                    '{"error": "Unauthorized", "message": "missing or wrong bearer token", '
                    '"fix": "send Authorization: Bearer <token>, the token being the contents '
                    'of the file the server named at start"}'
                ),
                content_type="application/json",
                headers={"WWW-Authenticate": 'Bearer realm="cc-server"'},
            )
        return await handler(request)

    return middleware
