"""A terminal whose shell runs inside a microVM, on the guest's PTY: the same surface as
terminal.session.TerminalSession (read, write, resize, wait, aclose, to_json), badged `microvm`.

Output is buffered up to OUTPUT_BUFFER_BYTES for a slow reader; past that the event queue of the
command fills and the agent link waits, so the guest shell blocks on its writes instead of the
server buffering without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final

from cc_server.errors import CcServerError
from cc_server.microvm.handle import MicroVMHandle
from cc_server.runtime.events import EventType
from cc_server.runtime.execution import Execution
from cc_server.tasks import start_task
from cc_server.terminal.session import HandleSession, check_window

__all__ = ["GUEST_SHELL", "VmTerminalSession", "open_vm_terminal"]

GUEST_SHELL: Final = "/bin/sh"  # busybox ash: the guest's only shell
EXIT_WAIT_S: Final = 5.0
_DROPPED = (CcServerError, OSError)  # input or a resize for a VM that is gone: dropped


class VmTerminalSession(HandleSession):
    """A shell on a guest PTY."""

    handle: MicroVMHandle

    def __init__(
        self, handle: MicroVMHandle, execution: Execution, stack: contextlib.AsyncExitStack
    ) -> None:
        self.handle = handle
        self._stack = stack  # holds the execution's `open_exec` block
        self._execution = execution
        self._events = execution.__aiter__()
        self._closed = False
        self._exit: int | None = None
        self._exited = asyncio.Event()

    @property
    def pid(self) -> int:
        """The host pid of the VM (QEMU); 0 while it is suspended."""
        return self.handle.qemu_pid or 0

    async def read(self) -> bytes:
        """Output since the last call, waiting for some; b"" once the shell has exited or the
        session is closed."""
        while not self._closed and self._exit is None:
            try:
                event = await anext(self._events)
            except StopAsyncIteration:
                break
            if event.type is EventType.STDOUT and event.data:
                return event.data
            if event.type is EventType.EXIT:
                self._exit = event.exit_code if event.exit_code is not None else -1
                self._exited.set()
        return b""

    async def write(self, data: bytes) -> None:
        """Type `data` into the terminal. Input after the session closed is dropped."""
        if not self._closed and self._exit is None:
            with contextlib.suppress(*_DROPPED):
                await self._execution.write_stdin(data)

    def resize(self, rows: int, cols: int) -> None:
        """Set the guest PTY's window size.

        Raises:
            BadSpec: rows or cols outside 1..MAX_WINDOW.
        """
        check_window(rows, cols)
        if not self._closed:
            with contextlib.suppress(*_DROPPED):
                self.handle.set_window(self._execution, rows, cols)

    async def wait(self) -> int:
        """Wait for the shell to exit; its exit code (128+N for signal N). Output nobody read
        stays buffered for `read()` (as far as the command's event queue holds it)."""
        done = start_task(self._execution.wait_done(), name="vm terminal command done")
        exited = start_task(self._exited.wait(), name="vm terminal exited")
        try:
            await asyncio.wait((done, exited), return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.cancel()
            exited.cancel()
        if self._exit is None:
            code = self._execution.exit_code
            self._exit = code if code is not None else 128 + 9
        return self._exit

    async def aclose(self) -> None:
        """Kill the shell, end the VM and everything in it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(EXIT_WAIT_S):
                    await self._stack.aclose()
        finally:
            if self._exit is None:
                code = self._execution.exit_code
                self._exit = code if code is not None else 128 + 9
            self._exited.set()
            await self.handle.destroy()


async def open_vm_terminal(
    handle: MicroVMHandle, *, env: dict[str, str], cwd: str, rows: int, cols: int
) -> VmTerminalSession:
    """Start the guest's shell on a guest PTY of `rows` x `cols` in `cwd`.

    Raises:
        BadSpec: the window size is out of range.
        CcServerError: the VM did not start or the shell could not run.
    """
    check_window(rows, cols)
    stack = contextlib.AsyncExitStack()
    execution = await stack.enter_async_context(handle.open_exec(
        [GUEST_SHELL, "-l"], env={**env, "SHELL": GUEST_SHELL}, cwd=cwd, pty=(rows, cols)
    ))
    return VmTerminalSession(handle, execution, stack)

