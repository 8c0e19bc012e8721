"""The collected result of `POST /v1/sandboxes/{id}/exec` as its JSON body (`models.ExecResult`),
encoded in pieces, so that a large one is neither encoded on the event loop nor held whole.

A result keeps up to 16 MiB per stream by default (`runtime.output`), and its JSON is up to 7.3x
that: the text form escapes every control byte as six (`\\u0000`) and the base64 form adds a third.
Encoded in one go, on the loop, that is hundreds of MiB of transient strings and a stall for
every other client (`/healthz` included). Here the body is a sequence of pieces, each made from
at most SLICE_BYTES (64 KiB) of output; `send_exec_result` encodes each in a worker thread and
writes it (waiting for the socket to take it) before it makes the next.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
from collections.abc import Iterator
from typing import Any, Final

import msgspec
from aiohttp import web

from cc_server.runtime.handle import CollectedResult

__all__ = ["INLINE_MAX_BYTES", "SLICE_BYTES", "exec_result_json", "exec_result_pieces",
           "send_exec_result"]

# Raw output behind one piece. The worker holds the GIL while it encodes a piece (msgspec and
# base64 do not release it), and the loop thread waits for it: 64 KiB of NULs (384 KiB of
# `\u0000`) take ~1.5 ms, 1 MiB took ~22 ms and kept /healthz p99 at ~20 ms (bench/server.py).
# A multiple of 3, so that the base64 of consecutive slices concatenates without padding.
SLICE_BYTES: Final = (64 * 1024) // 3 * 3
# A result with at most this much output is encoded at once, on the loop: ~1.5 ms at worst (all
# NULs), usually far less, and no thread hop for the common small result.
INLINE_MAX_BYTES: Final = 64 * 1024
CONTENT_TYPE: Final = "application/json; charset=utf-8"


def _small_fields(result: CollectedResult) -> dict[str, Any]:
    return {
        "exitCode": result.exit_code,
        "violations": [v.to_json() for v in result.violations],
        "killed": result.killed is not None,
        "killedReason": result.killed,
        "stdoutTruncated": result.stdout_truncated,
        "stderrTruncated": result.stderr_truncated,
        "stdoutDroppedBytes": result.stdout_dropped,
        "stderrDroppedBytes": result.stderr_dropped,
    }


def _text(data: bytes, slice_bytes: int) -> Iterator[bytes]:
    """The inside of a JSON string holding `data` as UTF-8, undecodable bytes replaced (the
    same text as `data.decode("utf-8", errors="replace")`: a character split across two slices
    is decoded whole with the second)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    view = memoryview(data)
    for start in range(0, len(view), slice_bytes):
        end = start + slice_bytes
        text = decoder.decode(view[start:end], final=end >= len(view))
        yield msgspec.json.encode(text)[1:-1]


def _base64(data: bytes, slice_bytes: int) -> Iterator[bytes]:
    view = memoryview(data)
    for start in range(0, len(view), slice_bytes):
        yield base64.b64encode(view[start : start + slice_bytes])


def _pieces(result: CollectedResult, slice_bytes: int) -> Iterator[bytes]:
    yield msgspec.json.encode(_small_fields(result))[:-1]  # without its closing brace
    for name, data in (("stdout", result.stdout), ("stderr", result.stderr)):
        yield b',"' + name.encode() + b'":"'
        yield from _text(data, slice_bytes)
        yield b'","' + name.encode() + b'Base64":"'
        yield from _base64(data, slice_bytes)
        yield b'"'
    yield b"}"


def exec_result_pieces(
    result: CollectedResult, slice_bytes: int = SLICE_BYTES
) -> Iterator[bytes]:
    """The ExecResult JSON of `result` in pieces, each made from at most `slice_bytes` of
    output (a multiple of 3) per stream and form; small pieces are joined up to that size.

    Raises:
        ValueError: `slice_bytes` is not a positive multiple of 3.
    """
    if slice_bytes <= 0 or slice_bytes % 3:
        raise ValueError(f"slice_bytes must be a positive multiple of 3, got {slice_bytes}")
    return _joined(_pieces(result, slice_bytes), slice_bytes)


def _joined(pieces: Iterator[bytes], at_least: int) -> Iterator[bytes]:
    pending: list[bytes] = []
    size = 0
    for piece in pieces:
        pending.append(piece)
        size += len(piece)
        if size >= at_least:
            yield b"".join(pending)
            pending, size = [], 0
    if pending:
        yield b"".join(pending)


def exec_result_json(result: CollectedResult) -> bytes:
    """The whole ExecResult JSON of `result` at once (for small results and tests)."""
    return b"".join(exec_result_pieces(result))


async def send_exec_result(request: web.Request, result: CollectedResult) -> web.StreamResponse:
    """Answer `request` with `result`: a small one at once, a large one streamed (chunked), each
    piece encoded in a worker thread and written before the next is made.

    Raises:
        ConnectionError: the client went away while the body was being sent.
    """
    if len(result.stdout) + len(result.stderr) <= INLINE_MAX_BYTES:
        return web.Response(body=exec_result_json(result), headers={"Content-Type": CONTENT_TYPE})
    response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
    await response.prepare(request)
    pieces = exec_result_pieces(result)
    while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
        await response.write(piece)
    await response.write_eof()
    return response
