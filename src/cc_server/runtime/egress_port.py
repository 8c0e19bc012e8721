"""What a handle and its session sandbox need of the session's egress proxies.

Two protocols, below both `handle.py` and `session_sandbox.py` (which each take a session's
proxies) so that neither imports the other for them; `runtime.egress.SessionEgress` is the one
implementation.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Protocol

from cc_server.backends.plan import EgressBridge
from cc_server.egress.changes import EgressChange
from cc_server.egress.patterns import Allowlist
from cc_server.runtime.events import EgressChanged, EgressRequest

__all__ = ["Adopted", "EgressPort"]


class EgressPort(Protocol):
    """A session's egress proxies, as the handle sees them (see runtime.egress)."""

    async def start(self) -> EgressBridge:
        """Start the proxies if needed; return the bridge to plan with."""
        ...

    async def adopt(self, http: socket.socket, socks: socket.socket) -> Sequence[Adopted]:
        """Serve a sandbox's loopback listeners as the session's proxies (see runtime.egress)."""
        ...

    async def aclose(self) -> None:
        """Stop the proxies and remove their sockets. Idempotent."""
        ...

    allowlist: Allowlist
    """The allowlist the next connection is checked against (its deny list included)."""
    watchers: list[Callable[[EgressChanged | EgressRequest], None]]
    """Told of each change and each request (see runtime.egress)."""

    @property
    def entries(self) -> tuple[str, ...]:
        """The session's allowlist entries now, canonical."""
        ...

    def change(self, change: EgressChange, *, by: str = "library") -> EgressChanged:
        """Remove, then add, allowlist entries for the next connection (see runtime.egress)."""
        ...

    def allow(self, *entries: str, by: str = "library") -> EgressChanged:
        """Add allowlist entries for the next connection (see runtime.egress)."""
        ...

    def remove(self, *entries: str, by: str = "library") -> EgressChanged:
        """Remove allowlist entries for the next connection (see runtime.egress)."""
        ...

    def ask(self, timeout_s: float = ...) -> None:
        """Hold connections to unlisted targets until answered (see runtime.egress)."""
        ...

    def stop_asking(self) -> None:
        """Refuse unlisted targets again (see runtime.egress)."""
        ...

    @property
    def asking(self) -> bool:
        """Whether unlisted targets are asked about."""
        ...

    @property
    def pending_requests(self) -> tuple[EgressRequest, ...]:
        """The requests waiting for an answer."""
        ...

    def answer(self, request_id: str, answer: str) -> EgressRequest:
        """Answer a pending request: once, session or deny (see runtime.egress)."""
        ...


class Adopted(Protocol):
    """A listener the proxies accept on until closed."""

    async def aclose(self) -> None:
        """Stop accepting and close it. Idempotent."""
        ...
