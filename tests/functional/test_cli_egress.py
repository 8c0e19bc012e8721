"""`cc-server run` and egress while the command runs: each refusal is one stderr line with its
reason and fix the moment it happens (in this process and through the CLI daemon), and `--ask`
asks about unlisted hosts on the terminal (a real PTY), against an HTTP server on the host's
loopback."""

from __future__ import annotations

import contextlib
import os
import pathlib
import pty
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
from cli_kit import daemon_pids
from egress_kit import serve_ok_on_loopback

pytestmark = pytest.mark.integration

DEADLINE_S = 30.0  # a hang guard; each step here takes well under a second
CURL = "curl -sS -m 20 -o /dev/null -w '%{http_code}\\n' --noproxy '' -x http://127.0.0.1:3128"


@pytest.fixture
def upstream_port() -> Iterator[int]:
    with serve_ok_on_loopback() as port:
        yield port


@pytest.fixture
def env(tmp_path: pathlib.Path) -> Iterator[dict[str, str]]:
    home = tmp_path / "home"
    home.mkdir()
    runtime = pathlib.Path(tempfile.mkdtemp(prefix="cce-", dir="/tmp"))  # short socket paths
    try:
        yield {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime)}
    finally:
        for pid in daemon_pids(runtime):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(runtime, ignore_errors=True)


def cwd_beside(env: dict[str, str]) -> pathlib.Path:
    """Never the checkout: `run` binds its cwd when nothing else is bound."""
    cwd = pathlib.Path(env["HOME"]).parent / "cwd"
    cwd.mkdir(exist_ok=True)
    return cwd


@pytest.mark.parametrize("module", ["cc_server.cli", "cc_server.cli_client"])
def test_a_refusal_is_shown_while_the_command_still_runs(env: dict[str, str], module: str) -> None:
    # cc_server.cli runs in this process; cc_server.cli_client hands the run to the daemon.
    script = f"{CURL} http://blocked.example/; echo asked; exec sleep 120"
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "run", "--", "sh", "-c", script],
        env=env, cwd=cwd_beside(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + DEADLINE_S
        line = ""
        while "violation" not in line and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stderr], [], [], 1.0)
            if ready:
                line = proc.stderr.readline()
        assert proc.poll() is None, "the command ended before its violation was shown"
        assert line.rstrip("\n") == (
            "cc-server: violation: network-outbound blocked.example:80: blocked.example is not "
            "on this session's egress allowlist; to allow: --allow-domain blocked.example:80"
        ), line
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=DEADLINE_S)


def test_a_deny_list_refusal_says_it_cannot_be_allowed(env: dict[str, str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cc_server.cli", "run", "--allow-domain", "169.254.169.254:80",
         "--", "sh", "-c", f"{CURL} http://169.254.169.254/"],
        env=env, cwd=cwd_beside(env), stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=DEADLINE_S, check=False,
    )  # fmt: skip
    assert result.stdout.strip() == "403", result
    lines = [x for x in result.stderr.splitlines() if "violation" in x]
    assert len(lines) == 1 and lines[0].endswith("; on the deny list: cannot be allowed"), lines


class Terminal:
    """A process on a PTY: what it wrote so far, and typing into it."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: pathlib.Path) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=slave, stdout=slave,
                                     stderr=slave, start_new_session=True)
        os.close(slave)
        self.text = ""

    def expect(self, needle: str, after: int = 0) -> int:
        """Read until `needle` appears past offset `after`; where it ends."""
        deadline = time.monotonic() + DEADLINE_S
        while needle not in self.text[after:]:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {needle!r} in:\n{self.text}"
            ready, _, _ = select.select([self.master], [], [], remaining)
            if ready:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # EIO: the other side closed
                    chunk = b""
                assert chunk, f"EOF before {needle!r} in:\n{self.text}"
                self.text += chunk.decode(errors="replace")
        return self.text.index(needle, after) + len(needle)

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> int:
        with contextlib.suppress(ProcessLookupError):
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
        code = self.proc.wait(timeout=DEADLINE_S)
        os.close(self.master)
        return code


def test_ask_on_a_terminal_approves_once_then_denies(
    env: dict[str, str], upstream_port: int
) -> None:
    # `localhost` is not listed; the addresses it resolves to are, so it is asked about.
    url = f"http://localhost:{upstream_port}/"
    script = f"{CURL} {url}; {CURL} {url}"
    term = Terminal(
        [sys.executable, "-m", "cc_server.cli_client", "run", "--ask", "--allow-domain",
         "127.0.0.1", "--allow-domain", "::1", "--", "sh", "-c", script],
        env, cwd_beside(env),
    )  # fmt: skip
    try:
        entry = f"localhost:{upstream_port}"
        at = term.expect(f"cc-server: egress request: {entry} (http, from: sh -c")
        at = term.expect("allow [o]nce, for the [s]ession, or [d]eny? (30 s)", at)
        term.type("o\n")
        at = term.expect("200", at)
        at = term.expect(f"cc-server: egress request: {entry}", at)
        at = term.expect("[d]eny?", at)
        term.type("d\n")
        term.expect(f"violation: network-outbound {entry}: {entry} was refused when asked", at)
        term.expect("403", at)
        assert term.proc.wait(timeout=DEADLINE_S) == 0
    finally:
        term.close()


def test_ask_needs_a_terminal(env: dict[str, str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cc_server.cli", "run", "--ask", "--", "true"],
        env=env, cwd=cwd_beside(env), stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=DEADLINE_S, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "--ask asks on the terminal" in result.stderr, result


def test_a_command_cannot_answer_its_own_question(env: dict[str, str], upstream_port: int) -> None:
    # It shares the terminal: typing "s" into it (TIOCSTI) would approve its own request. The
    # sandbox has no controlling terminal and its seccomp filter refuses TIOCSTI.
    inject = ("import fcntl, termios\n"
              "try:\n"
              "    [fcntl.ioctl(0, termios.TIOCSTI, bytes([c])) for c in b's\\n']\n"
              "    print('injected', flush=True)\n"
              "except OSError as exc:\n"
              "    print('injection refused', exc.errno, flush=True)\n")
    url = f"http://localhost:{upstream_port}/"
    term = Terminal(
        [sys.executable, "-m", "cc_server.cli", "run", "--ask", "--allow-domain", "127.0.0.1",
         "--allow-domain", "::1", "--env", f"INJECT={inject}", "--", "sh", "-c",
         f"/usr/bin/python3 -c \"$INJECT\"; {CURL} {url}"],
        env, cwd_beside(env),
    )  # fmt: skip
    try:
        at = term.expect("injection refused")
        at = term.expect("[d]eny?", at)
        term.type("d\n")
        term.expect("403", at)
        assert "injected" not in term.text and ": session" not in term.text, term.text
    finally:
        term.close()
