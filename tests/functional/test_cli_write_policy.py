"""`cc-server run` and the write policy: a refused write is one stderr line the moment it is
refused, with the resolved path and why (in this process and through the CLI daemon)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest
from test_cli_egress import DEADLINE_S, cwd_beside, env  # noqa: F401 (env is a fixture)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("module", ["cc_server.cli", "cc_server.cli_client"])
def test_a_refused_write_is_shown_while_the_command_still_runs(
    env: dict[str, str],  # noqa: F811
    module: str,
) -> None:
    cwd = cwd_beside(env)
    subprocess.run(["git", "init", "-q", str(cwd / "repo")], check=True)
    config = (cwd / "repo" / ".git" / "config").read_bytes()
    script = "echo evil >> repo/.git/config; echo tried; exec sleep 120"
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "run", "--", "sh", "-c", script],
        env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + DEADLINE_S
        text = ""  # read from the fd itself: the shell's error and the line may come at once
        while "violation" not in text and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stderr], [], [], 1.0)
            if ready:
                text += os.read(proc.stderr.fileno(), 65536).decode()
        assert proc.poll() is None, "the command ended before its violation was shown"
        # The command's own error and the line go to one stderr from two processes: a write of
        # one may land inside the other's line, so the line is looked for, not split out.
        assert (
            f"cc-server: violation: file-write-data {cwd}/repo/.git/config: the sandbox's "
            "write policy protects it (matches '.git/config')"
        ) in text, text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=DEADLINE_S)
    assert (cwd / "repo" / ".git" / "config").read_bytes() == config
