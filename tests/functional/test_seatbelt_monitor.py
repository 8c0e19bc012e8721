"""The macOS runtime wiring, exercised here with recorded `log stream` output: the monitor turns
a session's Seatbelt denials into violations, and a session's egress on macOS listens on loopback
TCP for the profile's proxy ports. Nothing here needs a Mac; what does is in docs/macos.md."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cc_server.backends.seatbelt import message_for, session_tag_for
from cc_server.egress.patterns import Allowlist
from cc_server.errors import EnforcementFailed
from cc_server.runtime.egress import SessionEgress, egress_base_dir
from cc_server.runtime.events import SandboxViolation
from cc_server.runtime.seatbelt_monitor import SeatbeltMonitor

SESSION = "mac-session"
SLEEPING_LOG = ["/bin/sleep", "30"]  # a `log stream` that stays up and says nothing


@pytest.fixture
def runtime_dir() -> Iterator[str]:
    """A short private directory: Unix socket paths must stay under 108 bytes."""
    path = tempfile.mkdtemp(prefix="ccm-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def record(message: str, pid: int = 0) -> str:
    return json.dumps(
        {
            "eventType": "logEvent",
            "processID": pid,
            "processImagePath": "/kernel",
            "eventMessage": message,
        }
    )


def fake_log(tmp_path: Path, lines: list[str]) -> list[str]:
    recorded = tmp_path / "log.ndjson"
    recorded.write_text("".join(line + "\n" for line in lines))
    return ["/bin/cat", str(recorded)]


def quiet_monitor(log_argv: list[str]) -> SeatbeltMonitor:
    """A monitor of SESSION that suggests nothing and drops what it sees."""
    return SeatbeltMonitor(
        session_id=SESSION,
        suggest=lambda host: None,
        on_violation=lambda v: None,
        log_argv=log_argv,
    )


def mac_egress(base: str, monitor: SeatbeltMonitor) -> SessionEgress:
    """SESSION's egress as on macOS (loopback TCP), refusing everything, watched by `monitor`."""
    return SessionEgress(
        session_id=SESSION,
        allowlist=Allowlist(patterns=(), denied=()),
        suggest=lambda host: None,
        on_violation=lambda v: None,
        base_dir=base,
        tcp=True,
        monitor=monitor,
    )


async def test_the_monitor_reports_the_sessions_denials_only(tmp_path: Path) -> None:
    mine = message_for(session_tag_for(SESSION))
    theirs = message_for(session_tag_for("another-session"))
    lines = [
        record(f"Sandbox: cat(4242) deny(1) file-read-data /Users/dev/.ssh/id_ed25519\n{mine}"),
        record(f"Sandbox: cat(4243) deny(1) file-read-data /Users/dev/.aws/config\n{theirs}"),
        record(f"Sandbox: curl(77) deny(1) network-outbound 93.184.216.34:443\n{mine}"),
        record(f"Sandbox: evil(9) deny(1) file-read-data /forged\n{mine}", pid=9),  # not the kernel
    ]
    seen: list[SandboxViolation] = []
    monitor = SeatbeltMonitor(
        session_id=SESSION,
        suggest=lambda host: None,
        on_violation=seen.append,
        log_argv=fake_log(tmp_path, lines),
    )
    await monitor.start()
    await monitor.drain()
    await monitor.aclose()
    await monitor.aclose()  # idempotent
    assert [(v.action, v.target) for v in seen] == [
        ("file-read-data", "/Users/dev/.ssh/id_ed25519"),
        ("network-outbound", "93.184.216.34:443"),
    ]


async def test_a_monitor_that_cannot_start_keeps_the_command_from_running(
    tmp_path: Path, runtime_dir: str
) -> None:
    base = egress_base_dir({"XDG_RUNTIME_DIR": runtime_dir})
    egress = mac_egress(base, quiet_monitor([str(tmp_path / "no-such-log")]))
    with pytest.raises(EnforcementFailed, match="could not start"):
        await egress.start()
    assert os.listdir(base) == []  # no socket directory left behind
    await egress.aclose()


async def test_macos_egress_listens_on_loopback_tcp_and_hands_the_ports_over(
    runtime_dir: str,
) -> None:
    base = egress_base_dir({"XDG_RUNTIME_DIR": runtime_dir})
    egress = mac_egress(base, quiet_monitor(SLEEPING_LOG))
    bridge = await egress.start()
    try:
        assert bridge.http_port and bridge.socks_port
        assert bridge.base_dir == base
    finally:
        await egress.aclose()
    assert os.listdir(base) == []


async def test_a_cancelled_close_still_frees_log_and_passes_the_cancellation_on() -> None:
    monitor = quiet_monitor(SLEEPING_LOG)
    await monitor.start()
    proc, transport = monitor._proc, monitor._transport
    assert proc is not None and transport is not None
    closing = asyncio.get_running_loop().create_task(monitor.aclose(), name="close monitor")
    await asyncio.sleep(0)  # aclose has killed `log` and waits for its reader
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert transport.is_closing()  # the pipes to `log` are closed all the same
    async with asyncio.timeout(5):
        assert await proc.wait() != 0  # and `log` is gone, not left running
    await monitor.aclose()  # a second close is fine


async def test_a_log_that_ends_on_its_own_is_reported_and_a_closed_one_is_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ended = quiet_monitor(fake_log(tmp_path, []))
    await ended.start()
    await ended.drain()
    await ended.aclose()
    closed = quiet_monitor(SLEEPING_LOG)
    await closed.start()
    await closed.aclose()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"seatbelt monitor {session_tag_for(SESSION)}: `log` ended; denials are no longer reported"
    ]
