"""The collected exec result's JSON body (`server.exec_result`): encoded in pieces, it is the same
document as encoding the whole result at once, and it is what `models.ExecResult` publishes."""

from __future__ import annotations

import base64
import json

import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cc_server.runtime.events import SandboxViolation
from cc_server.runtime.handle import CollectedResult
from cc_server.server.exec_result import (
    SLICE_BYTES,
    exec_result_json,
    exec_result_pieces,
)
from cc_server.server.models import ExecResult

VIOLATION = SandboxViolation(action="file-write-create", target="/w/x.pem", raw="line")


def result(stdout: bytes = b"", stderr: bytes = b"", **fields: object) -> CollectedResult:
    values: dict[str, object] = {
        "exit_code": 0, "stdout_dropped": 0, "stderr_dropped": 0, "violations": (),
        "killed": None, **fields}
    return CollectedResult(stdout=stdout, stderr=stderr, **values)  # type: ignore[arg-type]


def expected(r: CollectedResult) -> dict[str, object]:
    """The body as the handler built it before it was streamed: one dict, encoded at once."""
    return {
        "exitCode": r.exit_code,
        "stdout": r.stdout.decode("utf-8", errors="replace"),
        "stderr": r.stderr.decode("utf-8", errors="replace"),
        "stdoutBase64": base64.b64encode(r.stdout).decode(),
        "stderrBase64": base64.b64encode(r.stderr).decode(),
        "stdoutTruncated": r.stdout_dropped > 0,
        "stderrTruncated": r.stderr_dropped > 0,
        "stdoutDroppedBytes": r.stdout_dropped,
        "stderrDroppedBytes": r.stderr_dropped,
        "violations": [v.to_json() for v in r.violations],
        "killed": r.killed is not None,
        "killedReason": r.killed,
    }


def test_the_body_is_the_published_exec_result() -> None:
    r = result(b"out\n", b"err\xff", exit_code=137, stdout_dropped=5, violations=(VIOLATION,),
               killed="timeout")
    body = exec_result_json(r)
    view = msgspec.json.decode(body, type=ExecResult)  # unknown or missing fields would fail
    assert msgspec.to_builtins(view) == expected(r)
    assert view.stdout_truncated is True and view.stderr_truncated is False


utf8_heavy = st.lists(
    st.sampled_from([b"a", b"\x00", b"\n", b'"', b"\\", "é".encode(), "€".encode(),
                     "😀".encode(), b"\xff", b"\xe2\x82", b"\x1f"]),
    max_size=60,
).map(b"".join)


@given(utf8_heavy | st.binary(max_size=200), st.binary(max_size=50),
       st.sampled_from([3, 6, 9, 30]))
@example("€".encode() * 3, b"", 3)  # every character split across two slices
def test_pieces_join_to_the_body_encoded_at_once(stdout: bytes, stderr: bytes,
                                                 slice_bytes: int) -> None:
    r = result(stdout, stderr)
    body = b"".join(exec_result_pieces(r, slice_bytes))
    assert json.loads(body) == expected(r)


def test_each_piece_comes_from_one_slice_of_output() -> None:
    r = result(b"\x00" * (10 * SLICE_BYTES + 1))
    pieces = list(exec_result_pieces(r))
    # Text of NULs is six bytes a byte: a piece holds at most one slice's text (plus the
    # small pieces joined to it), never the whole stream's.
    assert max(len(p) for p in pieces) <= 6 * SLICE_BYTES + 1024
    assert len(pieces) > 10
    assert json.loads(b"".join(pieces)) == expected(r)


@pytest.mark.parametrize("slice_bytes", [0, -3, 4])
def test_a_slice_that_would_break_base64_is_refused(slice_bytes: int) -> None:
    with pytest.raises(ValueError, match="multiple of 3"):
        exec_result_pieces(result(), slice_bytes)
