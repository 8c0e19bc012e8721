"""`cc-server serve` as a real process: the one sandbox startup line in each of its three forms,
--sandbox against CC_SERVER_SANDBOX, bad values, /healthz, --port 0, the token file, and the
refusal to bind a non-loopback address without TLS."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import stat
import subprocess
import time

import aiohttp
import pytest
from server_kit import (
    BOOT_TIMEOUT_S,
    Server,
    path_without,
    read_events,
    run_serve_to_exit,
    running_server,
    serve_argv,
    server_env,
    short_runtime_dir,
)

from cc_server.backends.probe import BUBBLEWRAP_NOTE

pytestmark = pytest.mark.integration

ON_LINE = f"agent sandbox ON ({BUBBLEWRAP_NOTE})"
OFF_LINE = "agent sandbox DISABLED by --sandbox off"
NONE_PREFIX = "no OS-native agent sandbox on this host ("
SANDBOX_PHRASES = ("agent sandbox ON", "agent sandbox DISABLED", "no OS-native agent sandbox")


def sandbox_lines(server: Server) -> list[str]:
    """Every log line that talks about the agent sandbox."""
    return [line for line in server.log_text().splitlines()
            if any(p in line for p in SANDBOX_PHRASES)]


def startup_message(server: Server) -> str:
    (event,) = [e for e in server.events if e["event"] == "sandbox"]
    return str(event["message"])


# --- the three startup lines ---------------------------------------------------------------------


def test_a_host_with_bubblewrap_logs_sandbox_on_once(tmp_path: pathlib.Path) -> None:
    with running_server(tmp_path) as server:
        assert startup_message(server) == ON_LINE
        assert len(sandbox_lines(server)) == 1


def test_a_host_without_bwrap_logs_no_backend_with_the_install_hint(
    tmp_path: pathlib.Path,
) -> None:
    # The only fake: bwrap is hidden from PATH, as on a host that lacks it.
    with running_server(tmp_path, env={"PATH": path_without(tmp_path, ["bwrap"])}) as server:
        message = startup_message(server)
        assert message.startswith(NONE_PREFIX), message
        assert "bubblewrap" in message and "apt-get install bubblewrap" in message
        assert len(sandbox_lines(server)) == 1


def test_sandbox_off_logs_disabled(tmp_path: pathlib.Path) -> None:
    with running_server(tmp_path, "--sandbox", "off") as server:
        assert startup_message(server) == OFF_LINE
        assert len(sandbox_lines(server)) == 1


def test_the_text_log_carries_the_same_line(tmp_path: pathlib.Path) -> None:
    argv = [a for a in serve_argv() if a != "--log-json"]
    home, runtime = tmp_path / "home", short_runtime_dir()
    home.mkdir()
    log_path = tmp_path / "text.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=server_env(home, runtime), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while "listening on" not in log_path.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.05)
        lines = log_path.read_text().splitlines()
        (line,) = [ln for ln in lines if any(p in ln for p in SANDBOX_PHRASES)]
        assert re.fullmatch(r"\S+Z info sandbox: " + re.escape(ON_LINE) + r"( \S+=\S+)*", line)
        (listening,) = [ln for ln in lines if " listening: " in ln]
        assert re.search(r" port=\d+\b", listening)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        shutil.rmtree(runtime, ignore_errors=True)


# --- precedence and bad values -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "env_value", "expected"),
    [
        (None, "off", OFF_LINE),
        (None, "on", ON_LINE),
        (None, "", ON_LINE),  # an empty variable counts as unset
        ("on", "off", ON_LINE),  # the flag wins
        ("off", "on", OFF_LINE),
    ],
)
def test_the_flag_wins_over_the_variable(
    tmp_path: pathlib.Path, flag: str | None, env_value: str, expected: str
) -> None:
    args = ("--sandbox", flag) if flag else ()
    with running_server(tmp_path, *args, env={"CC_SERVER_SANDBOX": env_value}) as server:
        assert startup_message(server) == expected


@pytest.mark.parametrize("value", ["maybe", "ON", "1", "true", " on"])
def test_a_bad_flag_value_stops_the_start_naming_the_allowed_values(
    tmp_path: pathlib.Path, value: str
) -> None:
    done = run_serve_to_exit(tmp_path, "--sandbox", value)
    assert done.returncode == 2
    assert "--sandbox must be 'on' or 'off'" in done.stderr and repr(value) in done.stderr
    assert "listening" not in done.stdout + done.stderr


@pytest.mark.parametrize("flag", [None, "on"])
def test_a_bad_variable_stops_the_start_even_under_a_flag(
    tmp_path: pathlib.Path, flag: str | None
) -> None:
    args = ("--sandbox", flag) if flag else ()
    done = run_serve_to_exit(tmp_path, *args, env={"CC_SERVER_SANDBOX": "yes"})
    assert done.returncode == 2
    assert "CC_SERVER_SANDBOX must be 'on' or 'off', got 'yes'" in done.stderr


# --- healthz, port, token ------------------------------------------------------------------------


async def test_healthz_answers_without_a_token_and_has_no_sandbox_field(
    tmp_path: pathlib.Path,
) -> None:
    with running_server(tmp_path) as server:
        async with aiohttp.ClientSession() as client:
            for _ in range(5):
                async with client.get(f"{server.url}/healthz") as response:
                    assert response.status == 200
                    assert await response.json() == {"status": "ok"}
        # Answering /healthz did not probe again: still exactly one startup line.
        assert len(sandbox_lines(server)) == 1


def test_port_zero_logs_the_bound_port_and_the_token_path(tmp_path: pathlib.Path) -> None:
    with running_server(tmp_path) as server:
        assert 0 < server.port < 65536
        (listening,) = [e for e in server.events if e["event"] == "listening"]
        assert listening["url"] == f"http://127.0.0.1:{server.port}"
        expected = server.runtime_dir / "cc-server" / "token"
        assert server.token_path == str(expected)
        info = os.stat(expected)
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
        assert stat.S_IMODE(os.stat(expected.parent).st_mode) == 0o700
        assert len(server.token) >= 43  # 32 random bytes, URL-safe base64


def test_token_file_option_and_removal_at_shutdown(tmp_path: pathlib.Path) -> None:
    token_file = tmp_path / "my-token"
    with running_server(tmp_path, "--token-file", str(token_file)) as server:
        assert server.token_path == str(token_file)
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        assert server.stop() == 0
    assert not token_file.exists()
    events = [e["event"] for e in read_events(server.log_path)]
    assert events.index("shutdown") < events.index("stopped")


async def test_two_boots_get_different_tokens(tmp_path: pathlib.Path) -> None:
    with running_server(tmp_path) as first:
        token = first.token
    with running_server(tmp_path) as second:
        assert second.token != token
        async with aiohttp.ClientSession(
            second.url, headers={"Authorization": f"Bearer {token}"}
        ) as client, client.get("/v1/sandboxes") as response:
            assert response.status == 401


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1", "example.com"])
def test_a_non_loopback_address_without_tls_is_refused(tmp_path: pathlib.Path, host: str) -> None:
    done = run_serve_to_exit(tmp_path, "--host", host)
    assert done.returncode == 2
    assert f"refusing to bind {host!r} without TLS" in done.stderr
    assert "--tls-cert" in done.stderr


async def test_the_openapi_document_is_served_with_the_token(tmp_path: pathlib.Path) -> None:
    with running_server(tmp_path) as server:
        async with server.client() as client, client.get("/openapi.json") as response:
            assert response.status == 200
            doc = await response.json()
        assert doc["openapi"].startswith("3.1")
        assert "SandboxSpec" in doc["components"]["schemas"]
        assert {"/v1/sandboxes", "/v1/sandboxes/{id}/exec/ws", "/v1/terminals"} <= set(doc["paths"])
