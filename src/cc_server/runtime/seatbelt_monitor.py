"""The macOS violation monitor of one session: `log stream` for the session's Seatbelt denials,
each reported on the handle as a SandboxViolation.

Started with the session's first command and stopped at destroy, like the session's proxies. If
`log` cannot be started the command does not run (fail closed: a sandbox whose refusals nobody
would see is not what the caller asked for).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from cc_server.backends.plan import LaunchPlan
from cc_server.backends.runner import start
from cc_server.backends.seatbelt import session_tag_for
from cc_server.backends.seatbelt_log import (
    SeatbeltDenial,
    SeatbeltLogParser,
    log_stream_argv,
    watch_denials,
)
from cc_server.errors import EnforcementFailed
from cc_server.policy import SandboxBackend
from cc_server.runtime.events import SandboxViolation

__all__ = ["SeatbeltMonitor"]

log = logging.getLogger("cc_server.runtime.seatbelt_monitor")
LOG_ENV = (("PATH", "/usr/bin:/bin"), ("LC_ALL", "C"))  # `log` needs nothing of ours


class SeatbeltMonitor:
    """Watches the unified log for one session's denials."""

    def __init__(
        self,
        *,
        session_id: str,
        suggest: Callable[[str], str | None],
        on_violation: Callable[[SandboxViolation], None],
        log_argv: Sequence[str] | None = None,
    ) -> None:
        """`log_argv` replaces `log stream ...` (tests feed recorded lines this way)."""
        self._tag = session_tag_for(session_id)
        self._parser = SeatbeltLogParser(session_tag=self._tag, suggest=suggest)
        self._on_violation = on_violation
        self._argv = tuple(log_argv) if log_argv is not None else log_stream_argv(self._tag)
        self._proc: asyncio.subprocess.Process | None = None
        self._transport: asyncio.SubprocessTransport | None = None
        self._reader: asyncio.Task[None] | None = None
        self._closed = False

    def _report(self, denial: SeatbeltDenial) -> None:
        self._on_violation(
            SandboxViolation(
                action=denial.action,
                target=denial.target,
                suggested_capability=denial.suggested_capability,
                raw=denial.raw,
            )
        )

    async def start(self) -> None:
        """Start watching, once.

        Raises:
            EnforcementFailed: the monitor is closed or `log` could not be started.
        """
        if self._closed:
            raise EnforcementFailed("the session's violation monitor is closed")
        if self._proc is not None:
            return
        plan = LaunchPlan(backend=SandboxBackend.NONE, argv=self._argv, env=LOG_ENV)
        self._proc, self._transport = await start(
            plan,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        assert self._proc.stdout is not None
        self._reader = asyncio.get_running_loop().create_task(
            self._watch(self._proc.stdout), name=f"seatbelt monitor {self._tag}"
        )

    async def _watch(self, stdout: asyncio.StreamReader) -> None:
        try:
            await watch_denials(stdout, self._parser, self._report)
        except Exception:
            if not self._closed:
                log.warning(
                    "seatbelt monitor %s failed; denials are no longer reported",
                    self._tag,
                    exc_info=True,
                )
            raise
        if not self._closed:
            log.warning(
                "seatbelt monitor %s: `log` ended; denials are no longer reported", self._tag
            )

    async def drain(self) -> None:
        """Wait until `log` has exited and every line it wrote has been reported (tests)."""
        if self._reader is not None:
            await asyncio.shield(self._reader)

    async def aclose(self) -> None:
        """Stop `log` and the reader. Idempotent; the pipes to `log` are closed (and `log` killed)
        even when this is cancelled, and the cancellation is passed on."""
        self._closed = True
        proc, self._proc = self._proc, None
        reader, self._reader = self._reader, None
        transport, self._transport = self._transport, None
        try:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            if reader is not None:
                reader.cancel()
                await asyncio.wait([reader])  # how the reader ended is not the caller's error
                if not reader.cancelled():
                    reader.exception()  # retrieved: nothing is left to report once closing
            if proc is not None:
                with contextlib.suppress(Exception):
                    await proc.wait()
        finally:
            if transport is not None:
                transport.close()
