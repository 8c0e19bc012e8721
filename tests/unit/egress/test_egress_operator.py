"""The operator's egress for dispatch: the baseline's extension, the model endpoint on its own
port, and refusal advice that names the settings that apply."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from ipaddress import ip_address

import pytest

from cc_server.egress.baseline import BASELINE_ALLOWED
from cc_server.egress.driver import EgressRefused, ProxyParams, open_session_proxies
from cc_server.egress.operator import (
    ALLOW_ENV,
    ALLOW_FLAG,
    MODEL_REASON,
    OPERATOR_REASON,
    OperatorEgress,
)
from cc_server.egress.patterns import (
    Allowlist,
    AllowlistRule,
    DomainPattern,
    InvalidPattern,
    IpLiteralPattern,
)
from cc_server.egress.resolver import allowlist_for
from cc_server.errors import BadSpec
from cc_server.policy.spec import AgentCapabilities, SandboxSpec

SPEC = SandboxSpec(session_id="s1", workspace_id="w1")


def test_the_flag_and_the_variable_extend_the_baseline_in_the_allowlist_syntax() -> None:
    egress = OperatorEgress.build(
        ["models.corp.example", "*.registry.corp.example"],
        {ALLOW_ENV: " 10.0.0.5 , [fd00::1],,Bücher.example "},
    )
    assert egress.patterns == (
        "models.corp.example", "*.registry.corp.example", "10.0.0.5", "fd00::1",
        "xn--bcher-kva.example",
    )
    assert {rule.reason for rule in egress.rules} == {OPERATOR_REASON}
    allowlist = allowlist_for(SPEC, extra_baseline=egress.rules)
    assert allowlist.patterns[: len(BASELINE_ALLOWED)] == BASELINE_ALLOWED
    for host in ("models.corp.example", "npm.registry.corp.example", "10.0.0.5", "[fd00::1]",
                 "api.anthropic.com"):
        assert allowlist.allows(host, 443).allowed, host
    assert not allowlist.allows("registry.corp.example", 443).allowed
    assert egress.model_url is None and not egress.model_on_loopback


def test_the_extension_is_still_no_network_for_an_agent_without_it() -> None:
    egress = OperatorEgress.build(["models.corp.example"])
    off = allowlist_for(SPEC, AgentCapabilities(can_use_network=False),
                        extra_baseline=egress.rules)
    assert off.is_empty and not off.allows("models.corp.example", 443).allowed
    network_off = allowlist_for(SandboxSpec(session_id="s1", workspace_id="w1",
                                            network_enabled=False), extra_baseline=egress.rules)
    assert network_off.is_empty


@pytest.mark.parametrize(
    ("flag", "env", "named"),
    [
        (["*.com"], {}, f"{ALLOW_FLAG} '*.com'"),
        ([], {ALLOW_ENV: "ok.example,bad_name.example"}, f"{ALLOW_ENV} 'bad_name.example'"),
        (["http://x.example"], {}, f"{ALLOW_FLAG} 'http://x.example'"),
    ],
)
def test_a_malformed_entry_is_refused_naming_the_setting(
    flag: list[str], env: dict[str, str], named: str
) -> None:
    with pytest.raises(InvalidPattern) as caught:
        OperatorEgress.build(flag, env)
    assert named in caught.value.message


def test_the_model_endpoint_is_allowed_on_its_own_port_only() -> None:
    egress = OperatorEgress.build([], {"ANTHROPIC_BASE_URL": "http://127.0.0.1:4000/v1"})
    assert egress.model_url == "http://127.0.0.1:4000/v1" and egress.model_on_loopback
    assert egress.rules == (
        AllowlistRule(pattern=IpLiteralPattern(address=ip_address("127.0.0.1")),
                      reason=MODEL_REASON, port=4000),
    )
    allowlist = allowlist_for(SPEC, extra_baseline=egress.rules)
    assert allowlist.allows("127.0.0.1", 4000).allowed
    assert "allowed by 127.0.0.1:4000 " in allowlist.allows("127.0.0.1", 4000).reason
    assert not allowlist.allows("127.0.0.1", 8421).allowed  # the server's own API, say
    assert not allowlist.allows("127.0.0.1").allowed  # a port-scoped rule needs the port


def test_a_named_model_endpoint_gets_its_schemes_port_and_localhost_its_addresses() -> None:
    https = OperatorEgress.build([], {"ANTHROPIC_BASE_URL": "https://Gateway.Corp.Example"})
    assert https.rules == (
        AllowlistRule(pattern=DomainPattern(text="gateway.corp.example"), reason=MODEL_REASON,
                      port=443),
    )
    assert not https.model_on_loopback
    local = OperatorEgress.build([], {"ANTHROPIC_BASE_URL": "http://localhost:9000"})
    assert [(str(r.pattern), r.port) for r in local.rules] == [
        ("localhost", 9000), ("127.0.0.1", 9000), ("::1", 9000)]
    assert local.model_on_loopback
    six = OperatorEgress.build([], {"ANTHROPIC_BASE_URL": "http://[::1]:9000"})
    assert six.model_on_loopback and six.no_proxy("localhost,127.0.0.1,::1") == (
        "localhost,127.0.0.1")


def test_no_proxy_loses_the_model_endpoints_host_in_every_spelling() -> None:
    default = "localhost,127.0.0.1,::1"
    assert OperatorEgress().no_proxy(default) == default
    ip = OperatorEgress.build([], {"ANTHROPIC_BASE_URL": "http://127.0.0.1:4000"})
    assert ip.no_proxy(default) == "localhost,::1"
    name = OperatorEgress.build([], {"ANTHROPIC_BASE_URL": "http://localhost:4000"})
    assert name.no_proxy(default) == ""


def test_an_operator_entry_for_the_same_host_allows_every_port() -> None:
    egress = OperatorEgress.build(["127.0.0.1"], {"ANTHROPIC_BASE_URL": "http://127.0.0.1:4000"})
    allowlist = allowlist_for(SPEC, extra_baseline=egress.rules)
    assert [(str(r.pattern), r.port) for r in allowlist.patterns[len(BASELINE_ALLOWED):]] == [
        ("127.0.0.1", None)]  # the port-scoped rule adds nothing to it
    assert allowlist.allows("127.0.0.1", 22).allowed


@pytest.mark.parametrize(
    "url",
    ["ftp://models.example", "models.example:443", "http://", "http://x:notaport",
     "https://user:sk-secret@models.example", "https://bad_host.example"],
)
def test_a_model_endpoint_that_is_not_a_plain_http_url_is_refused(url: str) -> None:
    with pytest.raises(BadSpec) as caught:
        OperatorEgress.build([], {"ANTHROPIC_BASE_URL": url})
    assert "ANTHROPIC_BASE_URL" in caught.value.message
    assert "sk-secret" not in str(caught.value)


def test_the_advice_names_the_serve_flag_and_the_variable() -> None:
    advice = OperatorEgress().advice("x.example")
    assert f"{ALLOW_FLAG} x.example" in advice and ALLOW_ENV in advice
    assert "cc-server run" not in advice


@contextlib.asynccontextmanager
async def _echo_server() -> AsyncIterator[int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.read(100))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def _connect(proxy_port: int, target: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
    try:
        writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200 "):
            return head + await reader.read()
        writer.write(b"ping")
        return head + await reader.read(4)
    finally:
        writer.close()


async def test_the_proxy_dials_a_port_scoped_address_on_its_port_and_advises_the_operator() -> None:
    """Through the real driver: the loopback model endpoint's port passes the address guard,
    another port of the same address is refused, and the refusal says how to allow it."""
    refusals: list[EgressRefused] = []
    async with _echo_server() as port, _echo_server() as other:
        egress = OperatorEgress.build(
            [], {"ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}"}
        )
        params = ProxyParams(
            session_id="s1",
            allowlist=Allowlist(patterns=egress.rules),
            on_refused=refusals.append,
            advice=egress.advice,
        )
        async with open_session_proxies(params) as proxies:
            assert proxies.http_port is not None
            allowed = await _connect(proxies.http_port, f"127.0.0.1:{port}")
            assert allowed.startswith(b"HTTP/1.1 200 ") and allowed.endswith(b"ping")
            refused = await _connect(proxies.http_port, f"127.0.0.1:{other}")
    assert refused.startswith(b"HTTP/1.1 403 "), refused
    assert f"{ALLOW_FLAG} 127.0.0.1".encode() in refused
    [refusal] = refusals
    assert (refusal.host, refusal.port) == ("127.0.0.1", other)
    assert f"{ALLOW_FLAG} 127.0.0.1" in refusal.raw and ALLOW_ENV in refusal.raw
