"""What `cc-server run` does with no options: the current directory bound writable as the
workdir, refused in $HOME and /, the `--home` choices and the settings files, run as a real
subprocess against real bubblewrap, in the process and through the CLI daemon.

Every invocation gets its own $HOME, XDG_RUNTIME_DIR and working directory under tmp_path.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
from cli_kit import kill_daemons

pytestmark = pytest.mark.integration

CLI_TIMEOUT_S = 60.0
SECRET = "CC-DEFAULTS-SECRET"


@pytest.fixture(params=["in-process", "daemon"])
def env(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[dict[str, str]]:
    """A $HOME with git identity, an SSH key and a cargo token; in-process or through a daemon
    of this test's own (its runtime directory is short: session sockets live under it)."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text(SECRET + "\n")
    (home / ".cargo" / "bin").mkdir(parents=True)
    (home / ".cargo" / "credentials.toml").write_text(f'token = "{SECRET}"\n')
    (home / ".gitconfig").write_text("[user]\n\tname = Ada Tester\n\temail = ada@example.test\n")
    runtime = pathlib.Path(tempfile.mkdtemp(prefix="ccd-", dir="/tmp"))
    base = {"PATH": f"{home}/.cargo/bin:{os.environ['PATH']}", "HOME": str(home),
            "XDG_RUNTIME_DIR": str(runtime)}
    if request.param == "in-process":
        base["CC_SERVER_DAEMON"] = "off"
    try:
        yield base
    finally:
        if request.param == "daemon":
            subprocess.run([sys.executable, "-m", "cc_server.cli", "daemon", "stop"], env=base,
                           capture_output=True, timeout=CLI_TIMEOUT_S, check=False)
            kill_daemons(runtime)
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture
def project(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "project"
    (path / "src").mkdir(parents=True)
    return path


def cli(*args: str | os.PathLike[str], env: dict[str, str],
        cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    entry = "cc_server.cli_client" if args[0] == "run" else "cc_server.cli"
    return subprocess.run(
        [sys.executable, "-m", entry, *map(str, args)], env=env, cwd=cwd,
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
        check=False,
    )  # fmt: skip


# --- the current directory -----------------------------------------------------------------------


def test_run_binds_the_cwd_writable_and_works_there(
    env: dict[str, str], project: pathlib.Path
) -> None:
    proc = cli("run", "--", "sh", "-c", "pwd; echo made > made.txt", env=env, cwd=project)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{project}\n"
    assert (project / "made.txt").read_text() == "made\n"


def test_workdir_defaults_to_the_cwd_inside_a_bind(
    env: dict[str, str], project: pathlib.Path
) -> None:
    proc = cli("run", "--bind", project, "--", "pwd", env=env, cwd=project / "src")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{project}/src\n"
    # A cwd outside every bind leaves the workdir the first bind.
    other = cli("run", "--bind", project / "src", "--", "pwd", env=env, cwd=project)
    assert other.returncode == 0 and other.stdout == f"{project}/src\n", other.stderr


def test_an_explicit_bind_replaces_the_cwd_default(
    env: dict[str, str], project: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = cli("run", "--bind", elsewhere, "--", "sh", "-c", f"touch {project}/x",
               env=env, cwd=project)
    assert proc.returncode != 0
    assert not (project / "x").exists()
    # --no-bind-cwd: nothing of the host's is bound at all.
    bare = cli("run", "--no-bind-cwd", "--", "sh", "-c", f"ls {project}", env=env, cwd=project)
    assert bare.returncode != 0 and "No such file" in bare.stderr, bare.stderr


def test_backend_none_runs_in_the_cwd_and_binds_nothing(
    env: dict[str, str], project: pathlib.Path
) -> None:
    # On the host there is nothing to bind; the cwd is still where the command runs (the
    # daemon's own is /), and $HOME is no refusal.
    proc = cli("run", "--backend", "none", "--", "pwd", env=env, cwd=project)
    assert proc.returncode == 0 and proc.stdout == f"{project}\n", proc.stderr
    home = cli("run", "--backend", "none", "--", "true", env=env, cwd=pathlib.Path(env["HOME"]))
    assert home.returncode == 0, home.stderr


@pytest.mark.parametrize("where", ["home", "root", "above home"])
def test_the_cwd_default_is_refused_in_home_and_root(
    env: dict[str, str], where: str
) -> None:
    home = pathlib.Path(env["HOME"])
    cwd = {"home": home, "root": pathlib.Path("/"), "above home": home.parent}[where]
    marker = home / "ran"
    proc = cli("run", "--", "touch", marker, env=env, cwd=cwd)
    assert proc.returncode == 2, proc.stderr
    assert "BadSpec" in proc.stderr and "binding it writable" in proc.stderr
    assert "fix: cd into the project first" in proc.stderr
    assert not marker.exists()


# --- --home ---------------------------------------------------------------------------------------


def test_home_empty_has_no_git_identity(env: dict[str, str], project: pathlib.Path) -> None:
    script = "git config user.email || echo no identity; ls -A ~"
    proc = cli("run", "--", "sh", "-c", script, env=env, cwd=project)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "no identity\n"  # an empty home: no identity, no dotfiles


def test_home_dotfiles_gives_git_identity_and_keeps_secrets_masked(
    env: dict[str, str], project: pathlib.Path
) -> None:
    subprocess.run(["git", "init", "-q", str(project)], check=True)  # creating .git is refused
    script = (
        "git commit -q --allow-empty -m first && git log --format='%an <%ae>';"
        " cat ~/.ssh/id_ed25519; cat ~/.cargo/credentials.toml; echo $PATH;"
        " echo x >> ~/.gitconfig || echo gitconfig read-only"
    )
    proc = cli("run", "--home", "dotfiles", "--", "sh", "-c", script, env=env, cwd=project)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "Ada Tester <ada@example.test>", proc.stderr
    assert lines[1].startswith(f"{env['HOME']}/.cargo/bin:")  # the toolchain's PATH entry
    assert lines[2] == "gitconfig read-only"
    assert SECRET not in proc.stdout + proc.stderr
    assert (pathlib.Path(env["HOME"]) / ".gitconfig").read_text().endswith("example.test\n")


def test_a_dotfile_in_the_secret_set_is_refused(
    env: dict[str, str], project: pathlib.Path
) -> None:
    proc = cli("run", "--home", "dotfiles", "--dotfile", ".ssh", "--", "true",
               env=env, cwd=project)
    assert proc.returncode == 2
    assert "~/.ssh is in the secret set" in proc.stderr


# --- settings files -------------------------------------------------------------------------------


def _user_settings(env: dict[str, str], text: str) -> None:
    path = pathlib.Path(env["HOME"]) / ".config" / "cc-server" / "settings.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_settings_precedence_user_file_then_settings_then_flags(
    env: dict[str, str], project: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    _user_settings(env, 'home = "dotfiles"\nenv = { WHO = "user-file", KEEP = "kept" }\n')
    team = tmp_path / "team.toml"
    team.write_text('env = ["WHO=team-file"]\nmode = "review"\n')
    script = 'echo "$WHO $KEEP"; git config user.name; touch x 2>/dev/null || echo read-only'
    proc = cli("run", "--settings", team, "--", "sh", "-c", script, env=env, cwd=project)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "team-file kept\nAda Tester\nread-only\n"
    flags = cli("run", "--settings", team, "--mode", "chat", "--env", "WHO=flag", "--", "sh",
                "-c", script, env=env, cwd=project)
    assert flags.returncode == 0, flags.stderr
    assert flags.stdout == "flag kept\nAda Tester\n"
    assert (project / "x").exists()


def test_settings_paths_expand_tilde_and_plan_shows_the_merge(
    env: dict[str, str], project: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    data = pathlib.Path(env["HOME"]) / "data"
    data.mkdir()
    (tmp_path / "conf").mkdir()
    team = tmp_path / "conf" / "team.toml"
    team.write_text('bind = ["~/data:ro", "../project"]\nnetwork = false\n')
    proc = cli("plan", "--json", "--settings", team, "--", "true", env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    merged = json.loads(proc.stdout)["settings"]
    assert merged["merged"] == {"bind": [f"{data}:ro", str(project)], "network": False}
    assert merged["sources"] == [str(team), "flags"]
    text = cli("plan", "--settings", team, "--", "true", env=env, cwd=tmp_path)
    assert f'  bind = ["{data}:ro", "{project}"]' in text.stdout, text.stdout
    run = cli("run", "--settings", team, "--", "sh", "-c", f"test -d {project} && pwd", env=env,
              cwd=tmp_path)
    assert run.returncode == 0 and run.stdout == f"{data}\n", run.stderr  # the first bind


def test_an_unknown_settings_key_says_which_was_meant(
    env: dict[str, str], project: pathlib.Path
) -> None:
    _user_settings(env, 'allow_domains = ["example.com"]\n')
    marker = project / "ran"
    proc = cli("run", "--", "touch", marker, env=env, cwd=project)
    assert proc.returncode == 2
    assert "unknown key 'allow_domains'" in proc.stderr
    assert "did you mean 'allow-domain'?" in proc.stderr
    assert not marker.exists()
