"""The QMP client against a fake QEMU on a socket pair: pipelined commands are all sent before
the first answer is read, answers come back in order past QEMU's events, and the first error
is raised once every answer is read (so the connection stays in step)."""

from __future__ import annotations

import asyncio
import json
import os
import socket

import pytest

from cc_server.microvm.vm import QmpClient, QmpError


async def _fake_qemu(sock: socket.socket, answers: dict[str, dict[str, object]],
                     seen: list[str], fds: list[int]) -> None:
    loop = asyncio.get_running_loop()
    buf = b""
    while len(seen) < len(answers):
        data, ancillary, _, _ = await loop.run_in_executor(
            None, lambda: sock.recvmsg(4096, socket.CMSG_SPACE(4)))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.append(int.from_bytes(payload[:4], "little"))
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            seen.append(json.loads(line)["execute"])
    # Every command was received before any answer went out.
    for name in seen:
        sock.sendall(b'{"event": "RESUME"}\n' + json.dumps(answers[name]).encode() + b"\n")


async def test_pipelined_commands_answer_in_order_and_the_fd_rides_along() -> None:
    host, qemu = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    host.setblocking(False)
    seen: list[str] = []
    fds: list[int] = []
    read_end, write_end = os.pipe()
    answers = {"a": {"return": {}}, "getfd": {"return": 7}, "c": {"return": "done"}}
    try:
        fake = asyncio.get_running_loop().create_task(_fake_qemu(qemu, answers, seen, fds))
        client = QmpClient(host)
        results = await client.execute_many(
            [("a", None, None), ("getfd", {"fdname": "x"}, write_end), ("c", None, None)])
        await fake
        assert results == [{}, 7, "done"] and seen == ["a", "getfd", "c"]
        assert len(fds) == 1
        os.close(fds[0])
    finally:
        host.close()
        qemu.close()
        os.close(read_end)
        os.close(write_end)


async def test_the_first_error_is_raised_after_every_answer_is_read() -> None:
    host, qemu = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    host.setblocking(False)
    seen: list[str] = []
    answers = {"a": {"error": {"desc": "no such capability"}}, "b": {"return": {}},
               "after": {"return": "in step"}}
    try:
        loop = asyncio.get_running_loop()
        fake = loop.create_task(_fake_qemu(qemu, {k: answers[k] for k in ("a", "b")}, seen, []))
        client = QmpClient(host)
        with pytest.raises(QmpError, match="QMP a: no such capability"):
            await client.execute_many([("a", None, None), ("b", None, None)])
        await fake
        seen.clear()
        fake = loop.create_task(_fake_qemu(qemu, {"after": answers["after"]}, seen, []))
        assert await client.execute("after") == "in step"
        await fake
    finally:
        host.close()
        qemu.close()
