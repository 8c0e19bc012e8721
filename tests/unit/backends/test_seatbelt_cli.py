"""`cc-server plan --platform macos`: the Seatbelt profile and the sandbox-exec command line,
printed on any OS, running nothing."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
from seatbelt_sbpl import check

from cc_server import cli
from cc_server.backends.seatbelt import message_for, session_tag_for


@pytest.fixture(autouse=True)
def _nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> int:
        raise AssertionError("`plan` must not run anything")

    monkeypatch.setattr(cli, "run_attached", refuse)


def _params(argv: list[str]) -> list[tuple[str, str]]:
    end = argv.index("--")
    return [(w[2:].partition("=")[0], w[2:].partition("=")[2]) for w in argv[3:end]]


def test_plan_platform_macos_prints_the_profile_and_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["plan", "--platform", "macos", "--", "true"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("backend: native (seatbelt)\n")
    assert "\nprofile:\n  (version 1)\n" in out
    assert "  (allow default)\n" in out
    assert '/usr/bin/sandbox-exec -p "$PROFILE" ' in out
    command_line = out.split("(PROFILE is the profile above):\n", 1)[1].splitlines()[0]
    assert command_line.endswith(" -- true")
    assert "planned off a Mac" in out or os.uname().sysname == "Darwin"


def test_plan_platform_macos_json_is_a_checkable_profile(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    argv = ["plan", "--platform", "macos", "--json", "--bind", str(work),
            "--protect", str(tmp_path / "checkout"), "--deny-create", "*.pem", "--", "ls", "-l"]
    assert cli.main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    words = plan["argv"]
    assert words[:2] == ["/usr/bin/sandbox-exec", "-p"]
    assert words[-3:] == ["--", "ls", "-l"]
    params = _params(words)
    values = [v for _, v in params]
    real = os.path.realpath(work)
    if real.startswith("/tmp/"):  # macOS spells /tmp as /private/tmp: both spellings are denied
        assert "/private" + real in values and f"{real}/.git/hooks" in values
    else:
        assert real in values
    message = next(line for line in words[2].splitlines() if "(with message" in line)
    tag = message.split('"')[1]
    rules = check(words[2], params, message=tag)
    assert any(r.action == "allow" and "file-write*" in r.operations for r in rules)
    assert tag.startswith("cc-")
    assert "HTTPS_PROXY" in plan["env"]


def test_plan_platform_macos_uses_the_spec_session_id_for_the_tag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"sessionId": "space-42", "workspaceId": "w"}))
    assert cli.main(["plan", "--platform", "macos", "--spec", str(spec), "--", "true"]) == 0
    out = capsys.readouterr().out
    assert f'(with message "{message_for(session_tag_for("space-42"))}")' in out


def test_plan_platform_macos_shows_a_hostile_path_only_quoted(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    hostile = tmp_path / 'x") (allow default) ("'
    hostile.mkdir()
    assert cli.main(["plan", "--platform", "macos", "--bind", str(hostile), "--", "true"]) == 0
    out = capsys.readouterr().out
    profile = out.split("\nprofile:\n", 1)[1].split("\nparameters:\n", 1)[0]
    assert str(hostile) not in profile
    command_line = out.split("(PROFILE is the profile above):\n", 1)[1].splitlines()[0]
    words = shlex.split(command_line)
    resolved = os.path.realpath(hostile)
    if os.uname().sysname != "Darwin":
        resolved = cli._macos_realpath(str(hostile))
    assert f"-DWRITABLE_ROOT_0={resolved}" in words


def test_plan_platform_linux_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--platform", "linux", "--backend", "none", "--", "true"]) == 0
    assert "backend: none" in capsys.readouterr().out


def test_plan_rejects_an_unknown_platform(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", "--platform", "windows", "--", "true"])
    assert info.value.code == 2
