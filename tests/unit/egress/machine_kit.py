"""Drive a sans-IO handshake machine the way the asyncio driver does (shared by the HTTP and
SOCKS5 machine tests)."""

from __future__ import annotations

from collections.abc import Callable

from cc_server.egress.proto import (
    NEED_ANY_DATA,
    NEED_DATA,
    NEED_UPSTREAM_DATA,
    CheckEgress,
    Event,
    HandshakeMachine,
    OpenUpstream,
    SendToClient,
    SendUpstream,
    StartRelay,
)

Step = Event | tuple[str, bytes]


def drive_machine(
    make: Callable[[], HandshakeMachine],
    data: bytes,
    *,
    chunk: int | None = None,
    allowed: bool = True,
    ok: bool = True,
    error: str = "",
    eof: bool = True,
    reason: str = "",
    how_to_allow: str = "",
    response: bytes | list[bytes] | None = None,
    reuse: bool = True,
) -> list[Step]:
    """Run a fresh machine on `data`; return what it said and what the answers returned.

    NEED_DATA is left out (it depends on how the bytes were split), except a final one when the
    input ran out without EOF. StartRelay.to_upstream is shown with the bytes not fed yet appended,
    as the relay would send them: where the handshake ends in the input depends on the split.
    SendToClient is recorded and the conversation goes on, as the driver does.

    A forward's upstream sends `response` (in pieces of `chunk` too) and then EOF; a list: each
    request forwarded gets the next one (on a reused upstream too: its parser goes on); None:
    it never answers, and the transcript ends in NEED_UPSTREAM_DATA once the machine waits.
    Consecutive SendUpstream (and SendToClient) events are one step, since how many there are
    depends on the split. `reuse`: keep the upstream when OpenUpstream offers it.
    """
    machine = make()
    size = chunk or max(len(data), 1)
    chunks = [data[i : i + size] for i in range(0, len(data), size)]
    pieces = iter(chunks)
    fed = 0  # client chunks fed so far
    answers = [response] if isinstance(response, bytes) else list(response or [])
    answer_pieces = iter([b""])
    transcript: list[Step] = []
    for _ in range(2 * (len(data) + sum(map(len, answers))) + 30):
        event = machine.next_event()
        # Either leg readable: the client's bytes first while there are any (a body before
        # its response), as they would be when the client sends its whole request at once.
        client_first = response is None or fed < len(chunks)
        if event is NEED_DATA or (event is NEED_ANY_DATA and client_first):
            piece = next(pieces, None)
            fed += 1
            if piece is None and not eof:
                return [*transcript, NEED_DATA]
            machine.receive_data(piece or b"")
            continue
        if event is NEED_UPSTREAM_DATA or event is NEED_ANY_DATA:
            if response is None:
                return [*transcript, NEED_UPSTREAM_DATA]
            machine.receive_upstream_data(next(answer_pieces, b""))
            continue
        if isinstance(event, StartRelay):
            rest = b"".join(pieces)
            event = StartRelay(to_upstream=event.to_upstream + rest, to_client=event.to_client)
        if isinstance(event, (SendUpstream, SendToClient)) and transcript:
            last = transcript[-1]
            if type(last) is type(event):
                transcript.pop()
                event = type(event)(data=last.data + event.data)
        transcript.append(event)
        if isinstance(event, CheckEgress):
            transcript.append(("decide", machine.decide(allowed, reason, how_to_allow)))
            if not allowed:
                return transcript
        elif isinstance(event, OpenUpstream):
            reused = event.reuse and reuse
            if answers:
                answer = answers.pop(0)
                answer_pieces = iter([answer[i : i + size] for i in range(0, len(answer), size)])
            transcript.append(("upstream", machine.upstream_result(ok, error, reused=reused)))
            if not ok:
                return transcript
        elif not isinstance(event, (SendToClient, SendUpstream)):
            return transcript
    raise AssertionError("machine did not finish")
