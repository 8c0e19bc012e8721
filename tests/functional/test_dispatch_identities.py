"""A server started the way an operator starts one opens a dispatch: as an unprivileged user from
its home directory (`cd ~ && cc-server serve`) and as root from `/`, each with the default
dispatch directory (`$HOME/.local/state/cc-server`) and nothing else configured."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from dispatch_kit import make_repo
from other_user import OtherUser, remove

from cc_server.dispatch.worktrees import mounted_under

pytestmark = pytest.mark.integration

BOOT_TIMEOUT_S = 30.0


def _serve_and_dispatch(argv: Sequence[str], *, cwd: str, env: Mapping[str, str],
                        home: pathlib.Path, repo: pathlib.Path) -> dict[str, Any]:
    """Start `serve` (argv), open a harness dispatch in a worktree of `repo`, run one command,
    close everything; the run's JSON with the command's result under `bash`."""
    log = home / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [*argv, "serve", "--port", "0", "--log-json", "--token-file", str(home / "token")],
            cwd=cwd, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
    try:
        port = None
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while port is None and time.monotonic() < deadline:
            assert server.poll() is None, log.read_text()
            for line in log.read_text().splitlines():
                if '"listening"' in line:
                    port = json.loads(line)["port"]
            time.sleep(0.05)
        assert port is not None, log.read_text()
        token = (home / "token").read_text().strip()

        def call(method: str, path: str, body: dict[str, Any] | None = None) -> Any:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}{path}", method=method,
                data=None if body is None else json.dumps(body).encode(),
                headers={"Authorization": f"Bearer {token}"})
            try:
                with urllib.request.urlopen(request, timeout=60) as reply:
                    return json.loads(reply.read() or b"{}")
            except urllib.error.HTTPError as exc:
                raise AssertionError((exc.code, exc.read(), log.read_text()[-3000:])) from None

        call("POST", "/v1/repos", {"repoId": "r", "path": str(repo)})
        wt = call("POST", "/v1/worktrees", {"repoId": "r", "conversationId": "c1"})
        run: dict[str, Any] = call("POST", "/v1/dispatches", {"worktreeId": wt["worktreeId"]})
        run["bash"] = call("POST", f"/v1/dispatches/{run['runId']}/bash",
                           {"command": "echo hi > note.txt; cat note.txt; echo \"$HOME\""})
        call("DELETE", f"/v1/dispatches/{run['runId']}")
        call("DELETE", f"/v1/worktrees/{wt['worktreeId']}")
        return run
    finally:
        server.terminate()
        server.wait(timeout=20)


def _check(run: dict[str, Any], home: pathlib.Path) -> None:
    state = str(home / ".local" / "state" / "cc-server")
    assert run["backend"] == "native" and run["worktree"]["path"].startswith(state), run
    out = run["bash"]
    assert out["exitCode"] == 0, out
    assert out["stdout"].splitlines() == ["hi", f"{state}/runs/{run['runId']}"], out
    assert out["violations"] == []


def test_an_unprivileged_server_started_from_its_home_dispatches(other_user: OtherUser) -> None:
    home = other_user.workdir()
    try:
        repo = make_repo(home / "repo")
        subprocess.run(["chown", "-R", f"{other_user.uid}:{other_user.gid}", str(repo)],
                       check=True)
        env = other_user.env({"HOME": str(home), "PWD": str(home), "OLDPWD": str(home),
                              "XDG_RUNTIME_DIR": ""})
        run = _serve_and_dispatch(other_user.python("-m", "cc_server.cli"), cwd=str(home),
                                  env=env, home=home, repo=repo)
        _check(run, home)
        assert mounted_under(str(home)) == []
    finally:
        remove(home)


def test_a_server_started_from_the_root_directory_dispatches(  # as root in CI
    tmp_path: pathlib.Path,
) -> None:
    home = tmp_path / "root-home"
    home.mkdir()
    repo = make_repo(tmp_path / "repo")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "PWD": "/",
           "OLDPWD": str(home), "LANG": "C.UTF-8", "XDG_RUNTIME_DIR": ""}
    run = _serve_and_dispatch([sys.executable, "-m", "cc_server.cli"], cwd="/", env=env,
                              home=home, repo=repo)
    _check(run, home)
    assert mounted_under(str(tmp_path)) == []
