"""The session sandbox's request encoding and its handling of what the launcher sends back. The
launcher is inside the sandbox, so its replies are untrusted input; no sandbox is started here
(tests/security/test_session_sandbox.py runs the real one)."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cc_server.backends.plan import InheritedFd, LaunchPlan, SessionCommand
from cc_server.policy import SandboxBackend
from cc_server.runtime.session_sandbox import (
    KEEPER_KILLED,
    MAX_REQUEST_BYTES,
    MAX_WORDS,
    SessionProcess,
    SessionSandbox,
    encode_request,
)

SLOT = InheritedFd(name="session.sock")


def _command(argv: tuple[str, ...] = ("ls", "-l"), **kw: Any) -> SessionCommand:
    fields: dict[str, Any] = {"env": (("A", "1"), ("B", "x=y")), "cwd": "/work", "socket": SLOT}
    fields.update(kw)
    return SessionCommand(argv=argv, **fields)


def test_a_request_is_the_header_then_nul_terminated_words() -> None:
    message = encode_request(7, _command())
    assert message is not None
    assert message[:16] == struct.pack("<c3xIII", b"X", 7, 2, 2)
    assert message[16:] == b"/work\0ls\0-l\0A=1\0B=x=y\0"


@pytest.mark.parametrize(
    "command",
    [
        _command(argv=("x" * MAX_REQUEST_BYTES,)),
        _command(argv=("a\0b",)),
        _command(env=(("A", "\0"),)),
        _command(cwd="/a\0"),
        _command(argv=("a",) * (MAX_WORDS + 1), env=()),
    ],
    ids=["too-big", "nul-in-argv", "nul-in-env", "nul-in-cwd", "too-many-words"],
)
def test_what_does_not_fit_one_request_is_not_encoded(command: SessionCommand) -> None:
    assert encode_request(1, command) is None


@given(st.lists(st.text(st.characters(blacklist_characters="\0"), max_size=20), min_size=1,
                max_size=20))
def test_words_survive_encoding(argv: list[str]) -> None:
    message = encode_request(3, _command(argv=tuple(argv), env=()))
    try:
        encoded = [os.fsencode(w) for w in argv]
    except UnicodeEncodeError:  # exec could not take it either
        assert message is None
        return
    assert message is not None
    assert message[16:].split(b"\0")[:-1] == [b"/work", *encoded]


class _FakeProc:
    pid = 4242
    returncode = None
    stderr = None


def _sandbox() -> tuple[SessionSandbox, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    plan = LaunchPlan(backend=SandboxBackend.NATIVE, argv=("bwrap",), env=())
    return SessionSandbox(plan, _FakeProc(), None, ours), theirs  # type: ignore[arg-type]


async def test_replies_end_only_the_command_they_name_and_garbage_is_ignored() -> None:
    sandbox, launcher = _sandbox()
    first, second = SessionProcess(sandbox, 1), SessionProcess(sandbox, 2)
    sandbox._running.update({1: first, 2: second})
    for garbage in (b"", b"D", b"X" + b"\0" * 11, b"D" + b"\0" * 12, b"\xff" * 64):
        if garbage:
            launcher.send(garbage)
    launcher.send(struct.pack("<c3xII", b"D", 99, 0))  # not running: ignored
    launcher.send(struct.pack("<c3xII", b"D", 2, 3))
    sandbox._on_reply()
    assert second.returncode == 3 and first.returncode is None
    assert sandbox.running == 1 and sandbox.reusable
    launcher.send(struct.pack("<c3xII", b"D", 1, 137 | KEEPER_KILLED))
    sandbox._on_reply()
    assert first.returncode == 137
    assert sandbox.alive and not sandbox.reusable  # its keeper was killed: not reused
    launcher.close()
    sandbox._requests.close()


async def test_a_code_out_of_range_is_a_kill() -> None:
    sandbox, launcher = _sandbox()
    proc = SessionProcess(sandbox, 5)
    sandbox._running[5] = proc
    launcher.send(struct.pack("<c3xII", b"D", 5, 0xFFFF))
    sandbox._on_reply()
    assert proc.returncode == 137
    launcher.close()
    sandbox._requests.close()


async def test_when_the_launcher_goes_away_every_running_command_ends_killed() -> None:
    sandbox, launcher = _sandbox()
    loop = asyncio.get_running_loop()
    procs = [SessionProcess(sandbox, i) for i in (1, 2)]
    sandbox._running.update({p.request_id: p for p in procs})
    loop.add_reader(sandbox._requests.fileno(), sandbox._on_reply)
    launcher.close()
    async with asyncio.timeout(5):
        await asyncio.gather(*(p.exited() for p in procs))
    assert [p.returncode for p in procs] == [137, 137]
    assert not sandbox.alive and sandbox.running == 0
    sandbox._requests.close()
