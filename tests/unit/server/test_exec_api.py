"""The exec WebSockets' frames: each output chunk decoded once, with the shape `to_json` gives."""

from __future__ import annotations

import pytest

from cc_server.runtime.events import EventType, SandboxEvent
from cc_server.server.exec_api import _TextStreams


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
