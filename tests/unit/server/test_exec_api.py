"""The exec WebSockets' frames: each output chunk decoded once, with the shape `to_json` gives;
a session stream's command that fails unexpectedly ends as an error frame, not the stream."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest

from cc_server.runtime.events import EventType, SandboxEvent, SandboxState
from cc_server.server.exec_api import _SessionStream, _TextStreams
from cc_server.server.models import ExecRequest


@pytest.mark.parametrize(
    "event",
    [
        SandboxEvent(type=EventType.STDOUT, session_id="s", exec_id="s:1", data=b"hi \xc3\xa9\n"),
        SandboxEvent(type=EventType.STDERR, session_id="s", exec_id="s:1", data=b"bad \xff"),
        SandboxEvent(type=EventType.STDOUT, session_id="s", data=b"no exec id"),
        SandboxEvent(type=EventType.KILLED, session_id="s", exec_id="s:1", reason="manual"),
        SandboxEvent(type=EventType.EXIT, session_id="s", exec_id="s:1", exit_code=3),
    ],
)
def test_a_whole_chunk_is_the_frame_to_json_gives(event: SandboxEvent) -> None:
    assert _TextStreams().render(event) == [event.to_json()]


def test_a_split_character_comes_whole_with_the_next_chunk_and_a_cut_one_before_exit() -> None:
    texts = _TextStreams()
    out = [texts.render(SandboxEvent(type=EventType.STDOUT, session_id="s", exec_id="s:1",
                                     data=chunk)) for chunk in (b"a\xc3", b"\xa9b", b"\xe2\x82")]
    assert out == [
        [{"type": "stdout", "sessionId": "s", "execId": "s:1", "data": "a"}],
        [{"type": "stdout", "sessionId": "s", "execId": "s:1", "data": "éb"}],
        [],
    ]
    exit_event = SandboxEvent(type=EventType.EXIT, session_id="s", exec_id="s:1", exit_code=0)
    assert texts.render(exit_event) == [
        {"type": "stdout", "sessionId": "s", "execId": "s:1", "data": "\ufffd"},
        exit_event.to_json(),
    ]


class _FaultyHandle:
    """A sandbox whose every exec fails with an error no route expects (a host fault)."""

    session_id = "s"
    state = SandboxState.WARM

    @contextlib.asynccontextmanager
    async def open_exec(self, *_args: Any, **_kwargs: Any) -> AsyncIterator[Any]:
        raise OSError("the host said no")
        yield  # an async generator: the context manager's shape


class _Frames:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send_frame(self, data: bytes, _opcode: Any) -> None:
        self.sent.append(msgspec.json.decode(data))


async def test_a_command_that_fails_unexpectedly_is_an_error_frame_not_the_streams_end() -> None:
    handle = _FaultyHandle()
    state = SimpleNamespace(manager=SimpleNamespace(handles={"s": handle}), shutting_down=False)
    ws = _Frames()
    stream = _SessionStream(cast(Any, ws), cast(Any, state), cast(Any, handle))
    async with asyncio.TaskGroup() as tg:  # the stream's group: one failed command must not end it
        stream._start("a", ExecRequest(argv=["true"]), tg)
    assert [(f["type"], f["id"], f["status"], f["error"]) for f in ws.sent] == [
        ("error", "a", 500, "InternalError")]
    assert "OSError" in ws.sent[0]["message"]
    assert stream._commands == {}  # the id is free again
