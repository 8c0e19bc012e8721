"""The HTTP + WebSocket server: boot probe and startup line, `/healthz`, the sandbox API, the
server-hosted terminal. The outermost tier: nothing in cc_server imports it but the CLI."""

from cc_server.server.app import build_app, run_server, serve
from cc_server.server.config import ServerConfig, ServerConfigError, resolve_sandbox_flag

__all__ = [
    "ServerConfig",
    "ServerConfigError",
    "build_app",
    "resolve_sandbox_flag",
    "run_server",
    "serve",
]
