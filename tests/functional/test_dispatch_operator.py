"""The operator's settings in a real dispatch run: the CA bundles the agents need, and the model
endpoint on the host's loopback, reached through the session's proxies (never around them)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from dispatch_kit import need_npm_agents, open_dispatch

from cc_server.backends.probe import ProbeResult
from cc_server.dispatch.claude import run_claude
from cc_server.dispatch.service import AgentKind
from cc_server.egress.operator import ALLOW_FLAG, OperatorEgress
from cc_server.policy import SandboxBackend

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def loopback_upstream() -> Iterator[tuple[int, list[str]]]:
    """An HTTP server on the host's 127.0.0.1 recording each request line (a model gateway)."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append(self.requestline)
            body = json.dumps({"type": "error", "error": {"type": "api_error",
                                                          "message": "test gateway"}}).encode()
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="gateway", daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_a_loopback_model_endpoint_is_reached_through_the_proxies(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    need_npm_agents()
    with loopback_upstream() as (port, seen):
        egress = OperatorEgress.build([], {"ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}"})
        async with open_dispatch(tmp_path, probe_result, operator_egress=egress) as d:
            wt = d.worktrees.create("r", "c1")
            run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.CLAUDE)
            assert run.backend is SandboxBackend.NATIVE
            assert run.agent_prefix == ("/usr/bin/env", "NO_PROXY=localhost,::1",
                                        "no_proxy=localhost,::1")
            evidence = pathlib.Path(wt.path, "evidence.env")
            pathlib.Path(run.state_dir, ".claude", "settings.json").write_text(json.dumps(
                {"apiKeyHelper": f"env > {evidence}; echo sk-ant-dummy-key"}))
            result = await run_claude(run, ["-p", "hi"], timeout_s=120,
                                      env={"CLAUDE_CODE_MAX_RETRIES": "0"})
            # The CLI's request reached the host's loopback gateway, through the proxy: the
            # sandbox's own loopback has no such port.
            assert any(line.startswith("POST /v1/messages") for line in seen), (seen, result)
            assert [v for v in result.violations if v.action == "network-outbound"] == []
            seen_env = evidence.read_text()
            assert f"ANTHROPIC_BASE_URL=http://127.0.0.1:{port}\n" in seen_env
            assert "NO_PROXY=localhost,::1\n" in seen_env
            # Another port of the same loopback address is refused and reported, with advice
            # that names the serve flag.
            other = await run.harness.run(
                f"curl --noproxy '' -sS --max-time 20 http://127.0.0.1:{port + 1}/ -o /dev/null"
                " -w '%{http_code}'")
            assert other.stdout == "403", other
            [refused] = [v for v in other.violations if v.action == "network-outbound"]
            assert refused.target == f"127.0.0.1:{port + 1}"
            assert f"{ALLOW_FLAG} 127.0.0.1" in (refused.raw or "")


async def test_ca_bundles_reach_the_run_read_only_and_never_from_a_denied_path(
    tmp_path: pathlib.Path, probe_result: ProbeResult
) -> None:
    certs = tmp_path / "corp-certs"
    certs.mkdir()
    bundle = certs / "corp-ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\nCORP-CA\n-----END CERTIFICATE-----\n")
    hidden = tmp_path / "home" / ".ssh" / "ca.pem"  # in open_dispatch's fake home
    system = "/etc/ssl/certs/ca-certificates.crt"
    environ = {"SSL_CERT_FILE": str(bundle), "NODE_EXTRA_CA_CERTS": str(hidden),
               "SSL_CERT_DIR": str(certs), "CURL_CA_BUNDLE": str(tmp_path / "missing.pem")}
    if os.path.exists(system):
        environ["REQUESTS_CA_BUNDLE"] = system
    async with open_dispatch(tmp_path, probe_result, environ=environ) as d:
        hidden.write_text("not for the sandbox\n")
        wt = d.worktrees.create("r", "c1")
        run = await d.service.open_run(worktree_id=wt.worktree_id, agent=AgentKind.HARNESS)
        binds = {m.host_path: m.read_only for m in run.spec.bind_mounts}
        assert binds[str(bundle)] is True and binds[str(certs)] is True
        assert str(hidden) not in binds and system not in binds
        assert run.env["SSL_CERT_FILE"] == str(bundle)
        assert "NODE_EXTRA_CA_CERTS" not in run.env and "CURL_CA_BUNDLE" not in run.env
        done = await run.harness.run(
            'cat "$SSL_CERT_FILE"; ls "$SSL_CERT_DIR"; echo x >> "$SSL_CERT_FILE"; echo "w=$?"; '
            'echo "node=${NODE_EXTRA_CA_CERTS:-unset}"; '
            'test -r "${REQUESTS_CA_BUNDLE:-/etc/hostname}" && echo system-readable')
        assert "CORP-CA" in done.stdout and "corp-ca.pem" in done.stdout, done
        assert "w=1" in done.stdout and "node=unset" in done.stdout, done
        assert "system-readable" in done.stdout, done
    assert bundle.read_text().count("CORP-CA") == 1
