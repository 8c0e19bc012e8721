"""Environment sanitisation: no variable named like a secret ever reaches a spawned agent process,
and what the caller adds cannot smuggle a host secret in under another name."""

from __future__ import annotations

import os
import pathlib
import secrets
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cc_server.dispatch.env import (
    ALLOWED_NAMES,
    CA_BUNDLE_NAMES,
    NOT_SECRET_NAMES,
    SECRET_SUBSTRINGS,
    SECRET_WORDS,
    EnvRefused,
    ca_bundle_env,
    looks_secret,
    sanitized_env,
)
from cc_server.errors import BadSpec

pytestmark = pytest.mark.security

NAME_CHARS = st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
SECRET_TERMS = sorted(set(SECRET_SUBSTRINGS) | SECRET_WORDS)


def _mixed_case(word: str, flips: list[bool]) -> str:
    return "".join(
        c.lower() if f else c for c, f in zip(word, flips + [False] * len(word), strict=False)
    )


@st.composite
def secret_names(draw: st.DrawFn) -> str:
    """A name with a secret term in it, in any case, anywhere, even behind an allowed prefix."""
    term = draw(st.sampled_from(SECRET_TERMS))
    term = _mixed_case(term, draw(st.lists(st.booleans(), max_size=len(term))))
    prefix = draw(
        st.sampled_from(["", "LC_", "GH_", "GITHUB_", "AWS_", "X", "MY_", "PATH_", "HOME_"])
    )
    before = draw(st.text(NAME_CHARS, max_size=6))
    after = draw(st.text(NAME_CHARS, max_size=6))
    # Short words are secrets as whole words: keep them apart from their neighbours.
    head = prefix + before
    if term.upper() in SECRET_WORDS:
        head = head + "_" if head and not head.endswith("_") else head
        after = "_" + after if after else after
    name = head + term + after
    name = name if not name[0].isdigit() else "V" + name
    # The few exact names that hold nothing secret (PWD, SSL_CERT_FILE, ...) are not secrets.
    return name if name not in NOT_SECRET_NAMES else name + "_X"


@settings(max_examples=500)
@given(st.lists(secret_names(), min_size=1, max_size=20), st.data())
def test_no_secret_named_variable_is_ever_passed(names: list[str], data: st.DataObject) -> None:
    source = {name: f"value-{i}-{secrets.token_hex(4)}" for i, name in enumerate(names)}
    source.update({"PATH": "/usr/bin:/bin", "HOME": "/home/u", "LANG": "C.UTF-8"})
    out = sanitized_env(source)
    for name in names:
        assert name not in out, name
        assert source[name] not in out.values()
    assert out["PATH"] == "/usr/bin:/bin"


@settings(max_examples=500)
@given(st.dictionaries(st.text(NAME_CHARS, min_size=1, max_size=24), st.text(max_size=20)))
def test_only_allowlisted_names_pass(source: dict[str, str]) -> None:
    for name in sanitized_env(source):
        assert name in ALLOWED_NAMES or name.startswith("LC_"), name
        assert not looks_secret(name), name


@settings(max_examples=300)
@given(secret_names())
def test_an_added_secret_named_variable_is_refused(name: str) -> None:
    with pytest.raises(EnvRefused):
        sanitized_env({"PATH": "/bin"}, add={name: "x"})


@pytest.mark.parametrize(
    "name",
    ["GIT_CONFIG_KEY_0_TOKEN", "GIT_CONFIG_KEY_TOKEN", "GIT_CONFIG_KEY_", "git_config_key_0",
     "GIT_CONFIG_KEY_0000", "X_GIT_CONFIG_KEY_0", "GIT_CONFIG_KEY_0\n"],
)
def test_only_gits_exact_key_slots_are_excepted(name: str) -> None:
    """The one exception (git's GIT_CONFIG_KEY_<n>, which hold a key name) is not a prefix."""
    assert sanitized_env({}, add={"GIT_CONFIG_KEY_0": "credential.helper"})
    with pytest.raises(EnvRefused):
        sanitized_env({"PATH": "/bin"}, add={name: "x"})


def test_an_addition_cannot_carry_a_host_secret_under_an_ordinary_name() -> None:
    secret = f"ghp_{secrets.token_hex(16)}"
    source = {"PATH": "/bin", "GITHUB_TOKEN": secret, "HOME": "/home/u"}
    for value in (secret, f"https://x:{secret}@github.com/", f"prefix {secret} suffix"):
        with pytest.raises(EnvRefused, match="host secret"):
            sanitized_env(source, add={"HTTPS_PROXY": value})
        with pytest.raises(EnvRefused):
            sanitized_env(source, add={"GIT_CONFIG_VALUE_0": value})


def test_ordinary_additions_pass() -> None:
    source = {
        "PATH": "/bin",
        "SSH_AUTH_SOCK": "/run/agent.sock",
        "AWS_SECRET_ACCESS_KEY": "abcdefg",
    }
    add = {
        "HTTP_PROXY": "http://127.0.0.1:4000",
        "HTTPS_PROXY": "http://127.0.0.1:4000",
        "ALL_PROXY": "socks5h://127.0.0.1:4001",
        "GIT_SSH_COMMAND": "ssh -o ProxyCommand='nc -X 5 -x 127.0.0.1:4001 %h %p'",
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": "credential.helper",
        "GIT_CONFIG_VALUE_0": "/run/cc-server/cred-1-0000000000000000/git-credential-cc",
    }
    out = sanitized_env(source, add=add)
    assert out == {"PATH": "/bin", **add}
    for bad in ({"BAD NAME": "x"}, {"A": "nul\x00"}, {"1A": "x"}, {"HTTP_PROXY\n": "x"}):
        with pytest.raises(EnvRefused):
            sanitized_env(source, add=bad)


def test_a_real_process_sees_none_of_the_host_secrets() -> None:
    """The server's own environment plus planted secrets, through a real `env` process."""
    planted = {
        "GITHUB_TOKEN": f"ghp_{secrets.token_hex(12)}",
        "ANTHROPIC_API_KEY": f"sk-ant-{secrets.token_hex(12)}",
        "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20),
        "AWS_SESSION_TOKEN": secrets.token_hex(20),
        "DATABASE_URL": f"postgres://u:{secrets.token_hex(8)}@db/x",
        "NPM_CONFIG__AUTH": secrets.token_hex(12),
        "LC_SECRET": secrets.token_hex(12),
        "SSH_AUTH_SOCK": f"/tmp/ssh-{secrets.token_hex(6)}/agent.1",
        "GIT_ASKPASS": f"/opt/{secrets.token_hex(6)}/askpass",
        "MY_PAT": secrets.token_hex(12),
        "SENTRY_DSN": f"https://{secrets.token_hex(8)}@sentry.example/1",
        "SLACK_WEBHOOK_URL": f"https://hooks.slack.com/{secrets.token_hex(8)}",
    }
    source = {**os.environ, **planted}
    env = sanitized_env(source)
    seen = subprocess.run(
        ["/usr/bin/env"], env=env, capture_output=True, text=True, check=True
    ).stdout
    for name, value in planted.items():
        assert name not in seen and value not in seen, name
    for line in seen.splitlines():
        name = line.partition("=")[0]
        assert name in ALLOWED_NAMES or name.startswith("LC_"), name


def test_pwd_oldpwd_ca_bundles_and_locale_are_not_secrets() -> None:
    """`cd ~ && cc-server serve`: PWD is the home directory, a prefix of every run's HOME."""
    for name in ("PWD", "OLDPWD", "XDG_SESSION_TYPE", "DESKTOP_SESSION", *CA_BUNDLE_NAMES):
        assert not looks_secret(name), name
    for name in ("GIT_SSL_CERT", "GIT_SSL_KEY", "PIP_CLIENT_CERT", "pwd", "MY_PWD", "OLDPWD_X",
                 "SSL_CERT_FILE_PASSWORD", "LC_PWD"):
        assert looks_secret(name), name  # a client certificate, a key, a password: still secrets
    home = "/home/operator"
    source = {"PATH": "/bin", "HOME": home, "PWD": home, "OLDPWD": home,
              "LANG": "de_DE.UTF-8", "LC_ALL": "de_DE.UTF-8", "LANGUAGE": "de_DE:en",
              "SSL_CERT_FILE": f"{home}/corp-ca.pem", "XDG_SESSION_DESKTOP": "ubuntu"}
    add = {"HOME": f"{home}/.local/state/cc-server/runs/run-1",
           "CLAUDE_CONFIG_DIR": f"{home}/.local/state/cc-server/runs/run-1/.claude",
           "LC_MESSAGES": "de_DE.UTF-8", "NODE_EXTRA_CA_CERTS": f"{home}/corp-ca.pem",
           "PWD": "/work", "SSL_CERT_DIR": "/etc/ssl/certs"}
    out = sanitized_env(source, add=add)
    assert {k: out[k] for k in add} == add
    assert out["LANG"] == out["LC_ALL"] == "de_DE.UTF-8" and out["LANGUAGE"] == "de_DE:en"
    # The CA bundles reach a run through ca_bundle_env (and the service's binds), never through
    # the allowlist; neither do the shell's PWD and OLDPWD.
    assert "SSL_CERT_FILE" not in sanitized_env(source) and "PWD" not in sanitized_env(source)


def test_a_refusal_names_the_host_variable_and_is_a_bad_spec() -> None:
    secret = "/home/operator/.tokens/abcdef"
    source = {"PATH": "/bin", "DEPLOY_TOKEN_DIR": secret}
    with pytest.raises(EnvRefused, match="'DEPLOY_TOKEN_DIR'") as caught:
        sanitized_env(source, add={"HOME": f"{secret}/run-1"})
    assert isinstance(caught.value, BadSpec)
    assert (caught.value.variable, caught.value.host_variable) == ("HOME", "DEPLOY_TOKEN_DIR")
    assert caught.value.operator is False and "DEPLOY_TOKEN_DIR" in (caught.value.fix or "")
    with pytest.raises(EnvRefused) as named:
        sanitized_env(source, add={"MY_TOKEN": "x"})
    assert (named.value.variable, named.value.host_variable) == ("MY_TOKEN", None)


def test_ca_bundle_env_keeps_only_bundles_that_exist(tmp_path: pathlib.Path) -> None:
    bundle = tmp_path / "corp-ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    source = {"SSL_CERT_FILE": str(bundle), "NODE_EXTRA_CA_CERTS": str(tmp_path / "missing.pem"),
              "REQUESTS_CA_BUNDLE": "relative.pem", "SSL_CERT_DIR": f"{tmp_path}:/etc",
              "GIT_SSL_CAINFO": "", "CURL_CA_BUNDLE": str(bundle), "GIT_SSL_CERT": str(bundle)}
    assert ca_bundle_env(source) == {"SSL_CERT_FILE": str(bundle),
                                     "SSL_CERT_DIR": f"{tmp_path}:/etc",
                                     "CURL_CA_BUNDLE": str(bundle)}
