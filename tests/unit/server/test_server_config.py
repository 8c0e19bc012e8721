"""Server settings: --sandbox against CC_SERVER_SANDBOX, what may be bound without TLS, and the
collected exec result's output limit."""

from __future__ import annotations

import pytest

from cc_server.server.config import (
    ServerConfig,
    ServerConfigError,
    check_bind_address,
    exec_output_limit,
    resolve_sandbox_flag,
)


@pytest.mark.parametrize(
    ("flag", "env", "on"),
    [
        (None, {}, True),
        (None, {"CC_SERVER_SANDBOX": ""}, True),
        (None, {"CC_SERVER_SANDBOX": "on"}, True),
        (None, {"CC_SERVER_SANDBOX": "off"}, False),
        ("on", {"CC_SERVER_SANDBOX": "off"}, True),
        ("off", {"CC_SERVER_SANDBOX": "on"}, False),
        ("off", {}, False),
    ],
)
def test_the_flag_wins_and_on_is_the_default(
    flag: str | None, env: dict[str, str], on: bool
) -> None:
    assert resolve_sandbox_flag(flag, env) is on


@pytest.mark.parametrize("value", ["On", "OFF", "yes", "1", "true", " off", "off "])
def test_anything_else_is_an_error_naming_the_allowed_values(value: str) -> None:
    with pytest.raises(ServerConfigError, match=r"--sandbox must be 'on' or 'off'"):
        resolve_sandbox_flag(value, {})
    with pytest.raises(ServerConfigError, match=r"CC_SERVER_SANDBOX must be 'on' or 'off'"):
        resolve_sandbox_flag(None, {"CC_SERVER_SANDBOX": value})
    with pytest.raises(ServerConfigError, match="CC_SERVER_SANDBOX"):  # even under a flag
        resolve_sandbox_flag("on", {"CC_SERVER_SANDBOX": value})


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_tls(host: str) -> None:
    check_bind_address(host, tls=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.1", "192.0.2.1", "example.com",
                                  "localhost.example.com", "::ffff:127.0.0.1x"])
def test_anything_else_needs_tls(host: str) -> None:
    with pytest.raises(ServerConfigError, match="without TLS"):
        check_bind_address(host, tls=False)
    check_bind_address(host, tls=True)


def test_build_checks_everything() -> None:
    config = ServerConfig.build(port=0, environ={}, token_file="rel/token")
    assert config.sandbox_on and config.port == 0 and config.token_file is not None
    assert config.token_file.endswith("/rel/token") and config.token_file.startswith("/")
    with pytest.raises(ServerConfigError, match="--port"):
        ServerConfig.build(port=70000, environ={})
    with pytest.raises(ServerConfigError, match="go together"):
        ServerConfig.build(environ={}, tls_cert="/c.pem")
    with pytest.raises(ServerConfigError, match="empty"):
        ServerConfig.build(environ={}, host="")
    assert ServerConfig.build(environ={}, host="0.0.0.0", tls_cert="/c", tls_key="/k").tls


@pytest.mark.parametrize(
    ("env", "limit"),
    [({}, 16 * 1024 * 1024), ({"CC_SERVER_EXEC_OUTPUT_LIMIT": ""}, 16 * 1024 * 1024),
     ({"CC_SERVER_EXEC_OUTPUT_LIMIT": "0"}, 0), ({"CC_SERVER_EXEC_OUTPUT_LIMIT": "4096"}, 4096),
     ({"CC_SERVER_EXEC_OUTPUT_LIMIT": str(2**30)}, 2**30)],
)
def test_the_exec_output_limit_defaults_to_16_mib(env: dict[str, str], limit: int) -> None:
    assert exec_output_limit(env) == limit
    assert ServerConfig.build(environ=env).exec_output_limit_bytes == limit


@pytest.mark.parametrize("value", ["-1", "16MiB", "1e6", " 5", "\u0661", str(2**30 + 1)])
def test_a_bad_exec_output_limit_stops_the_start(value: str) -> None:
    with pytest.raises(ServerConfigError, match="CC_SERVER_EXEC_OUTPUT_LIMIT must be a number"):
        ServerConfig.build(environ={"CC_SERVER_EXEC_OUTPUT_LIMIT": value})


def test_dispatch_egress_settings_are_checked_before_the_server_starts() -> None:
    config = ServerConfig.build(environ={"CC_SERVER_DISPATCH_ALLOW_DOMAINS": "10.0.0.5"},
                                dispatch_allow_domains=("models.corp.example",))
    assert config.dispatch_allow_domains == ("models.corp.example",)
    with pytest.raises(ServerConfigError, match=r"--dispatch-allow-domain '\*\.com'"):
        ServerConfig.build(environ={}, dispatch_allow_domains=("*.com",))
    with pytest.raises(ServerConfigError, match="CC_SERVER_DISPATCH_ALLOW_DOMAINS 'a b'"):
        ServerConfig.build(environ={"CC_SERVER_DISPATCH_ALLOW_DOMAINS": "ok.example,a b"})
    with pytest.raises(ServerConfigError, match="ANTHROPIC_BASE_URL carries a user name"):
        ServerConfig.build(environ={"ANTHROPIC_BASE_URL": "https://u:p@models.example"})
