"""`cc-server run --ask`: the prompter's reading of answers (a pipe stands in for the terminal),
and the thin client keeping `--ask` in the calling process."""

from __future__ import annotations

import asyncio
import io
import os
import types

import pytest

from cc_server import cli_client
from cc_server.cli_ask import Prompter
from cc_server.errors import BadSpec
from cc_server.runtime.events import EgressRequest


class FakeEgress:
    def __init__(self, *requests: EgressRequest) -> None:
        self.pending_requests = requests
        self.answers: list[tuple[str, str]] = []

    def answer(self, request_id: str, answer: str) -> None:
        if request_id not in {r.id for r in self.pending_requests}:
            raise BadSpec("no egress request")
        self.answers.append((request_id, answer))
        self.pending_requests = tuple(r for r in self.pending_requests if r.id != request_id)


def request(rid: str, timeout_s: float = 5.0) -> EgressRequest:
    return EgressRequest(id=rid, host="pypi.org", port=443, protocol="http",
                         entry="pypi.org:443", timeout_s=timeout_s, commands=(("pip",),))


@pytest.mark.parametrize(
    ("typed", "answer"),
    [(b"o\n", "once"), (b"S\n", "session"), (b"session\n", "session"), (b"d\n", "deny"),
     (b"yes\n", "deny"), (b"\n", "deny")],
)
async def test_a_typed_answer(typed: bytes, answer: str) -> None:
    read, write = os.pipe()
    try:
        egress = FakeEgress(request("r1"))
        out = io.StringIO()
        prompter = Prompter(types.SimpleNamespace(egress=egress), read, out)  # type: ignore[arg-type]
        task = asyncio.create_task(prompter.run(), name="prompter")
        prompter.offer(request("r1"))
        await asyncio.sleep(0.05)
        os.write(write, typed)
        for _ in range(100):
            if egress.answers:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert egress.answers == [("r1", answer)]
        assert "egress request: pypi.org:443 (http, from: pip)" in out.getvalue()
    finally:
        os.close(read)
        os.close(write)


async def test_no_answer_in_time_is_said_and_the_next_request_is_asked() -> None:
    read, write = os.pipe()
    try:
        egress = FakeEgress(request("r1", timeout_s=0.2), request("r2"))
        out = io.StringIO()
        prompter = Prompter(types.SimpleNamespace(egress=egress), read, out)  # type: ignore[arg-type]
        task = asyncio.create_task(prompter.run(), name="prompter")
        prompter.offer(request("r1", timeout_s=0.2))
        prompter.offer(request("r2"))
        await asyncio.sleep(0.4)
        os.write(write, b"o\n")
        for _ in range(100):
            if egress.answers:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert egress.answers == [("r2", "once")]
        assert "no answer: refused" in out.getvalue()
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.parametrize("flag", ["--ask", "--as", "--events=json", "--help"])
def test_these_runs_stay_in_the_calling_process(
    flag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli_client, "_peers_identifiable", lambda: True)
    assert not cli_client._eligible(["run", flag, "--", "true"])
    if os.environ.get(cli_client.DAEMON_ENV, "on") != "off":  # the daemon is not turned off
        assert cli_client._eligible(["run", "--", "true", flag])  # the command's own argument
