"""Shared by the microVM tests: one probed runtime per test process (the image and the snapshot
are built once, on first use, into the user's microVM cache), a manager around it, and helpers
that drive an interactive command in the guest."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import pathlib
import secrets
from collections.abc import AsyncIterator
from typing import Any

from cc_server.backends.probe import probe
from cc_server.egress.driver import Resolver
from cc_server.microvm.handle import MicroVMHandle
from cc_server.microvm.runtime import MicroVMRuntime, probe_runtime
from cc_server.policy import HostFacts, SandboxBackend, detect_platform, parse_spec
from cc_server.runtime.events import EventType
from cc_server.runtime.handle import Execution
from cc_server.runtime.port import SandboxManager

READ_TIMEOUT_S = 60.0  # one answer from a guest shell under TCG on a loaded host: ms normally


@functools.lru_cache(maxsize=1)
def shared_runtime() -> MicroVMRuntime:
    """The microVM runtime of this host, probed once per test process. It must be available:
    scripts/bootstrap installs QEMU and builds the agent, so a missing runtime is a failure."""
    # In a thread of its own: the async tests that get here first already run an event loop.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        runtime = pool.submit(asyncio.run, probe_runtime()).result()
    assert runtime.available, f"the microVM probe found no runtime: {runtime.probe.to_json()}"
    return runtime


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(6)}"


def host_facts(home: pathlib.Path) -> HostFacts:
    return HostFacts(
        platform=detect_platform(),
        home=str(home),
        realpath=os.path.realpath,
        exists=os.path.lexists,
        is_dir=os.path.isdir,
    )


def manager(
    home: pathlib.Path, *, resolver: Resolver | None = None, **fields: Any
) -> SandboxManager:
    return SandboxManager(
        probe_result=probe(),
        host=host_facts(home),
        microvm=shared_runtime(),
        egress_resolver=resolver,
        **fields,
    )


async def launch(m: SandboxManager, **spec: Any) -> MicroVMHandle:
    """Launch a microVM sandbox and wait until it is warm."""
    body = {"sessionId": unique("vm"), "workspaceId": "ws", **spec}
    handle = m.launch(parse_spec(body), backend=SandboxBackend.MICROVM)
    assert isinstance(handle, MicroVMHandle)
    await handle.ready()
    return handle


async def launch_with_carve_out(m: SandboxManager, work: pathlib.Path) -> MicroVMHandle:
    """A microVM with `work` bound at /work and `work/protected` (created here) a protected
    path in it: a carve-out a suspend takes off and puts back."""
    (work / "protected").mkdir(parents=True)
    return await launch(m, bindMounts=[{"hostPath": str(work), "guestPath": "/work"}],
                        protectedPaths=[str(work / "protected")])


async def read_until(events: AsyncIterator[Any], marker: str) -> str:
    """Output of an interactive command until `marker` appears."""
    seen = ""
    async with asyncio.timeout(READ_TIMEOUT_S):
        while marker not in seen:
            event = await anext(events)
            if event.type in (EventType.STDOUT, EventType.STDERR) and event.data:
                seen += event.data.decode(errors="replace")
            assert event.type is not EventType.EXIT, f"exited before {marker!r}: {seen}"
    return seen


def events_of(execution: Execution) -> AsyncIterator[Any]:
    return execution.__aiter__()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
