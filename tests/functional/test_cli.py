"""The `cc-server` command line, run as a real subprocess against real bubblewrap.

Every invocation gets an explicit environment (PATH and a $HOME under tmp_path, plus whatever a
test adds), never the test process's own.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import pytest

pytestmark = pytest.mark.integration

CLI_TIMEOUT_S = 60.0  # a hang guard; every invocation here finishes in a second or two
PROMPT_S = 10.0  # "promptly" for a --timeout 1 run, far below the command's own 30 s
IMAGE_BUILD_TIMEOUT_S = 900.0  # `probe --microvm` on a fresh machine: download and build


@pytest.fixture
def env(tmp_path: pathlib.Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    return {"PATH": os.environ["PATH"], "HOME": str(home)}


@pytest.fixture
def work(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory bound into the sandbox, so a command there could leave a visible marker."""
    path = tmp_path / "work"
    path.mkdir()
    return path


def cli(
    *args: str | os.PathLike[str],
    env: dict[str, str],
    cwd: pathlib.Path | None = None,
    timeout: float = CLI_TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    """Run the CLI in `cwd`, by default a directory beside the test's $HOME: never the checkout,
    which `run` would bind writable when nothing else is bound."""
    if cwd is None:
        cwd = pathlib.Path(env["HOME"]).parent / "cwd"
        cwd.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "cc_server.cli", *map(str, args)],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def json_lines(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


# --- run -----------------------------------------------------------------------------------------


def test_run_exits_with_the_commands_code(env: dict[str, str]) -> None:
    proc = cli("run", "--", "sh", "-c", "exit 7", env=env)
    assert proc.returncode == 7, proc.stderr
    ok = cli("run", "--", "true", env=env)
    assert ok.returncode == 0, ok.stderr


def test_run_passes_output_through(env: dict[str, str]) -> None:
    proc = cli("run", "--", "sh", "-c", "echo out; echo err >&2; hostname", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "out\ncc-sandbox\n"
    assert proc.stderr == "err\n"


def test_run_events_json_streams_every_event(env: dict[str, str]) -> None:
    proc = cli("run", "--events", "json", "--", "echo", "hi", env=env)
    assert proc.returncode == 0, proc.stderr
    events = json_lines(proc.stdout)
    assert [e["type"] for e in events] == ["starting", "ready", "stdout", "exit"]
    assert events[2]["data"] == "hi\n"
    assert events[3]["exitCode"] == 0
    assert len({e["sessionId"] for e in events}) == 1
    assert len({e["execId"] for e in events}) == 1


def test_run_events_json_reports_stderr_and_the_exit_code(env: dict[str, str]) -> None:
    proc = cli("run", "--events", "json", "--", "sh", "-c", "echo oops >&2; exit 5", env=env)
    assert proc.returncode == 5, proc.stderr
    events = json_lines(proc.stdout)
    assert {"type": "stderr", "data": "oops\n"}.items() <= events[2].items()
    assert events[-1]["type"] == "exit" and events[-1]["exitCode"] == 5


def test_run_with_a_deny_create_rule_refuses_the_name_and_reports_it(
    env: dict[str, str], work: pathlib.Path
) -> None:
    script = f"touch {work}/ran.txt && touch {work}/no.pem"
    proc = cli("run", "--deny-create", "*.pem", "--bind", work, "--", "sh", "-c", script, env=env)
    assert proc.returncode == 1, proc.stderr
    assert "Permission denied" in proc.stderr
    assert f"cc-server: violation: file-write-create {work}/no.pem" in proc.stderr
    assert (work / "ran.txt").exists() and not (work / "no.pem").exists()


def _without_create_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's CLI sees the host as if the create-rule supervisor were not built."""
    import dataclasses

    from cc_server import cli as cli_module
    from cc_server.backends.probe import probe

    def stripped() -> Any:
        result = probe()
        tools = {k: v for k, v in result.tools.items() if not k.startswith("cc-create-")}
        return dataclasses.replace(result, tools=tools, create_rules=False)

    monkeypatch.setattr(cli_module, "probe", stripped)


@pytest.mark.parametrize("verb", ["run", "plan"])
def test_a_deny_create_rule_without_the_supervisor_is_refused_and_never_runs(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    work: pathlib.Path,
    verb: str,
) -> None:
    from cc_server.cli import main

    _without_create_rules(monkeypatch)
    marker = work / "ran"
    code = main([verb, "--deny-create", "*.pem", "--bind", str(work), "--", "touch", str(marker)])
    err = capsys.readouterr().err
    assert code == 125, err
    assert "create-time filename rules" in err and "BackendUnavailable" in err
    assert not marker.exists()


def test_run_with_a_missing_relative_bind_is_a_usage_error(
    env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    proc = cli("run", "--bind", "relative/missing", "--", "true", env=env, cwd=tmp_path)
    assert proc.returncode == 2
    assert "BadSpec" in proc.stderr
    assert str(tmp_path / "relative" / "missing") in proc.stderr  # resolved against the cwd


def test_run_with_an_unknown_spec_field_names_it(
    env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"sessionId": "x", "workspaceId": "w", "bogusFieldName": 1}))
    proc = cli("run", "--spec", spec, "--", "true", env=env)
    assert proc.returncode == 2
    assert "bogusFieldName" in proc.stderr


def test_run_with_an_unreadable_spec_is_a_usage_error(
    env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    missing = cli("run", "--spec", tmp_path / "nope.json", "--", "true", env=env)
    assert missing.returncode == 2
    assert "nope.json" in missing.stderr
    not_json = tmp_path / "bad.json"
    not_json.write_text("{not json")
    assert cli("run", "--spec", not_json, "--", "true", env=env).returncode == 2


def test_run_without_a_command_is_a_usage_error(env: dict[str, str]) -> None:
    proc = cli("run", env=env)
    assert proc.returncode == 2
    assert "no command given" in proc.stderr


def test_run_with_backend_none_runs_on_the_host(env: dict[str, str]) -> None:
    proc = cli("run", "--backend", "none", "--", "cat", "/proc/sys/kernel/hostname", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() not in ("", "cc-sandbox")


def test_run_timeout_kills_promptly_with_137(env: dict[str, str]) -> None:
    started = time.monotonic()
    proc = cli("run", "--timeout", "1", "--", "sleep", "30", env=env)
    assert time.monotonic() - started < PROMPT_S
    assert proc.returncode == 137
    assert "killed (timeout)" in proc.stderr


def test_run_timeout_with_events_reports_killed_then_exit(env: dict[str, str]) -> None:
    proc = cli("run", "--events", "json", "--timeout", "1", "--", "sleep", "30", env=env)
    assert proc.returncode == 137
    events = json_lines(proc.stdout)
    assert [e["type"] for e in events][-2:] == ["killed", "exit"]
    assert events[-2]["reason"] == "timeout"
    assert events[-1]["exitCode"] == 137


@pytest.mark.parametrize(
    "extra", [[], ["--timeout", "30"]], ids=["attached", "streaming-inherited"]
)
def test_caller_secrets_do_not_reach_the_command_but_term_does(
    env: dict[str, str], extra: list[str]
) -> None:
    env = {
        **env,
        "GITHUB_TOKEN": "xyz",
        "AWS_SECRET_ACCESS_KEY": "abc",
        "TERM": "xterm-cc-test",
        "LC_CC_TEST": "lc-passes",
    }
    script = (
        "echo ${GITHUB_TOKEN:-absent}; echo ${AWS_SECRET_ACCESS_KEY:-absent}; "
        "echo ${TERM:-unset}; echo ${LC_CC_TEST:-unset}"
    )
    proc = cli("run", *extra, "--", "sh", "-c", script, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["absent", "absent", "xterm-cc-test", "lc-passes"]


def test_run_env_option_sets_a_variable(env: dict[str, str]) -> None:
    proc = cli("run", "--env", "FOO=bar=baz", "--", "sh", "-c", "echo $FOO", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "bar=baz\n"
    assert cli("run", "--env", "NOEQUALS", "--", "true", env=env).returncode == 2


# --- plan and probe ------------------------------------------------------------------------------


def test_plan_prints_the_bwrap_argv_and_runs_nothing(
    env: dict[str, str], work: pathlib.Path
) -> None:
    marker = work / "ran"
    proc = cli("plan", "--bind", work, "--", "touch", marker, env=env)
    assert proc.returncode == 0, proc.stderr
    words = [line.strip() for line in proc.stdout.splitlines()]
    assert "backend: native" in words
    assert "--unshare-net" in words
    assert "--seccomp" in words
    assert str(marker) in words
    assert not marker.exists()


def test_plan_json_parses_and_runs_nothing(env: dict[str, str], work: pathlib.Path) -> None:
    marker = work / "ran"
    env = {**env, "GITHUB_TOKEN": "xyz"}
    proc = cli("plan", "--json", "--bind", work, "--", "touch", marker, env=env)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["backend"] == "native"
    assert "--unshare-net" in plan["argv"] and "--seccomp" in plan["argv"]
    assert plan["argv"][-2:] == ["touch", str(marker)]  # after the egress bridge's prologue
    assert "GITHUB_TOKEN" not in plan["env"]
    assert plan["env"]["HOME"] == env["HOME"]
    assert not marker.exists()


def test_plan_with_a_deny_create_rule_shows_the_launcher(env: dict[str, str]) -> None:
    proc = cli("plan", "--json", "--deny-create", "*.pem", "--", "true", env=env)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["createRules"] == {"globs": ["*.pem"], "supervised": True}
    argv = plan["argv"]
    assert "--as-pid-1" in argv
    launcher = argv.index("/run/cc-create/launcher", argv.index("--seccomp"))
    assert argv[launcher + 1 : launcher + 7] == [
        "--egress", "<fd:egress.sock>",
        "--filter", "<fd:create-rules.bpf>", "--socket", "<fd:create-rules.sock>",
    ]  # fmt: skip
    assert plan["egressHandoff"] is True


def test_probe_json_reports_bubblewrap(env: dict[str, str]) -> None:
    proc = cli("probe", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["available"] is True
    assert result["mechanism"] == "bubblewrap"
    assert set(result["tools"]) == {
        "bwrap", "socat", "cc-create-launcher", "cc-create-supervisor",
        *(("cc-identity",) if os.geteuid() == 0 else ()),
    }
    assert result["createRules"] is True and result["createRulesHint"] is None


def test_probe_microvm_says_which_accelerator_and_why(env: dict[str, str]) -> None:
    # The user's image cache (the microVM tests share it), not the throw-away HOME's.
    from cc_server.microvm.image import default_cache_dir

    env = {**env, "CC_SERVER_MICROVM_CACHE": str(default_cache_dir())}
    # On a fresh machine this first call builds the guest image from Debian's packages.
    proc = cli("probe", "--json", "--microvm", env=env, timeout=IMAGE_BUILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    microvm = json.loads(proc.stdout)["microvm"]
    # This machine's /dev/kvm cannot boot a guest: the boot test says so and TCG is used.
    assert microvm["available"] is True and microvm["accelerator"] == "tcg", microvm
    assert microvm["kvmDetail"] and "KVM" in microvm["reason"], microvm
    text = cli("probe", "--microvm", env=env)
    assert text.returncode == 0 and "microvm:   tcg: " in text.stdout, text.stderr
    without = json.loads(cli("probe", "--json", env=env).stdout)
    assert "microvm" not in without  # only on request: the boot test takes seconds


def test_probe_text(env: dict[str, str]) -> None:
    proc = cli("probe", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "available: yes" in proc.stdout
    assert "mechanism: bubblewrap" in proc.stdout


# --- egress options --------------------------------------------------------------------------


def test_plan_shows_the_egress_bridge_and_proxy_environment(env: dict[str, str]) -> None:
    result = cli("plan", "--json", "--", "true", env=env)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    # The launcher (built here) hands the loopback listeners over; no socket is bound in.
    assert plan["egressHandoff"] is True and "<fd:egress.sock>" in plan["argv"]
    assert "/run/cc-egress" not in plan["argv"]
    assert plan["env"]["HTTPS_PROXY"] == "http://127.0.0.1:3128"
    assert plan["env"]["ALL_PROXY"] == "socks5h://127.0.0.1:1080"


def test_a_malformed_allow_domain_is_a_usage_error(env: dict[str, str]) -> None:
    result = cli("run", "--allow-domain", "*.*.example.com", "--", "true", env=env)
    assert result.returncode == 2, result.stderr
    assert "egressAllowlist[0]" in result.stderr


def test_no_network_refuses_in_protocol_and_reports_the_violation(env: dict[str, str]) -> None:
    # The name is refused by the (empty) allowlist before any lookup: nothing leaves the host.
    result = cli(
        "run", "--no-network", "--allow-domain", "blocked.example", "--",
        "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "http://blocked.example/",
        env=env,
    )
    assert result.stdout == "403"
    assert "violation: network-outbound blocked.example:80" in result.stderr


def test_capability_flag_takes_the_json_names_only(env: dict[str, str]) -> None:
    ok = cli("plan", "--capability", "canCallGitHubApi", "--", "true", env=env)
    assert ok.returncode == 0, ok.stderr
    bad = cli("plan", "--capability", "github", "--", "true", env=env)
    assert bad.returncode == 2
