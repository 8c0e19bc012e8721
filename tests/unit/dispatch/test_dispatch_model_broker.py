"""The operator's model credential settings and a run's broker, without a sandbox."""

from __future__ import annotations

import ipaddress
import pathlib
import ssl

import pytest
from cryptography import x509

from cc_server.dispatch.model_credentials import (
    CA_FILE_NAME,
    KEY_FILE_ENV,
    SENTINEL_PREFIX,
    UPSTREAM_CA_ENV,
    ModelBroker,
    ModelCredentials,
)
from cc_server.egress.operator import OperatorEgress
from cc_server.errors import ConfigError


def _creds(tmp_path: pathlib.Path, url: str | None = None) -> ModelCredentials:
    (tmp_path / "k").write_text("sk-real\n")
    env = {"ANTHROPIC_BASE_URL": url} if url else {}
    creds = ModelCredentials.from_env({KEY_FILE_ENV: str(tmp_path / "k")},
                                      OperatorEgress.build([], env))
    assert creds is not None
    return creds


def test_no_key_file_means_no_brokering() -> None:
    assert ModelCredentials.from_env({}, OperatorEgress()) is None


def test_the_default_model_host_and_the_operators_endpoint(tmp_path: pathlib.Path) -> None:
    default = _creds(tmp_path)
    assert (default.host, default.port, default.key) == ("api.anthropic.com", 443, "sk-real")
    gateway = _creds(tmp_path, "https://Gateway.Example.com:8443/v1")
    assert (gateway.host, gateway.port) == ("gateway.example.com", 8443)
    assert "sk-real" not in repr(gateway)


@pytest.mark.parametrize(("env", "url", "problem"), [
    ({KEY_FILE_ENV: "relative/key"}, None, "must be absolute"),
    ({KEY_FILE_ENV: "/nonexistent/key"}, None, "cannot be read"),
    ({KEY_FILE_ENV: "EMPTY"}, None, "does not hold one key"),
    ({KEY_FILE_ENV: "GOOD"}, "http://127.0.0.1:4000", "needs an https model endpoint"),
    ({KEY_FILE_ENV: "GOOD", UPSTREAM_CA_ENV: "ca.pem"}, None, UPSTREAM_CA_ENV),
])
def test_bad_settings_are_refused(tmp_path: pathlib.Path, env: dict[str, str], url: str | None,
                                  problem: str) -> None:
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "good").write_text("sk-x\n")
    env = {k: {"EMPTY": str(tmp_path / "empty"), "GOOD": str(tmp_path / "good")}.get(v, v)
           for k, v in env.items()}
    with pytest.raises(ConfigError, match=problem):
        ModelCredentials.from_env(env, OperatorEgress.build(
            [], {"ANTHROPIC_BASE_URL": url} if url else {}))


def test_a_broker_intercepts_the_model_host_alone_with_a_session_ca(tmp_path: pathlib.Path) -> None:
    creds = _creds(tmp_path, "https://localhost:9443")
    state = tmp_path / "state"
    state.mkdir()
    operator_bundle = tmp_path / "corp.pem"
    operator_bundle.write_text("-----BEGIN CERTIFICATE-----\nCORP\n-----END CERTIFICATE-----\n")
    broker = ModelBroker(creds, str(state), environ={"NODE_EXTRA_CA_CERTS": str(operator_bundle)})
    assert broker.sentinel.startswith(SENTINEL_PREFIX) and "sk-real" not in broker.sentinel
    assert broker.env == {"ANTHROPIC_API_KEY": broker.sentinel,
                          "NODE_EXTRA_CA_CERTS": str(state / CA_FILE_NAME)}
    bundle = (state / CA_FILE_NAME).read_text()
    assert bundle.startswith("-----BEGIN CERTIFICATE-----\nCORP\n")
    [ca] = x509.load_pem_x509_certificates(bundle.split("-----END CERTIFICATE-----\n", 1)[1]
                                           .encode())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert "PRIVATE KEY" not in bundle and list(state.iterdir()) == [state / CA_FILE_NAME]
    for host in ("localhost", "127.0.0.1", "::1"):
        assert broker.handler(host, 9443) is not None
    for host, port in (("localhost", 443), ("127.0.0.2", 9443), ("example.com", 9443),
                       ("not a host", 9443)):
        assert broker.handler(host, port) is None
    assert ipaddress.ip_address("127.0.0.1") in creds.names()
    assert isinstance(broker._server, ssl.SSLContext)
    two = ModelBroker(creds, str(tmp_path), environ={})
    assert two.sentinel != broker.sentinel  # per run


def test_revoked_the_sentinel_is_swapped_no_more(tmp_path: pathlib.Path) -> None:
    broker = ModelBroker(_creds(tmp_path), str(tmp_path))
    sentinel = broker.sentinel.encode()
    assert broker._swap([(b"X-Api-Key", sentinel)]) == [(b"X-Api-Key", b"sk-real")]
    assert broker._swap([(b"authorization", b"Bearer " + sentinel)]) == [
        (b"authorization", b"Bearer sk-real")]
    assert broker._swap([(b"x-api-key", b"sk-other")]) == [(b"x-api-key", b"sk-other")]
    broker.revoke()
    broker.revoke()
    assert broker._swap([(b"x-api-key", sentinel)]) == [(b"x-api-key", sentinel)]
