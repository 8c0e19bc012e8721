"""Fixtures shared by the functional tests: a real probe, a host with a throw-away $HOME, and a
SandboxManager that is closed after each test."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import AsyncIterator

import pytest

from cc_server.backends.probe import ProbeResult
from cc_server.policy import HostFacts
from cc_server.runtime.port import SandboxManager


@pytest.fixture
def host(tmp_path: pathlib.Path) -> HostFacts:
    home = tmp_path / "home"
    home.mkdir()
    return dataclasses.replace(HostFacts.current(), home=str(home))


@pytest.fixture
async def manager(probe_result: ProbeResult, host: HostFacts) -> AsyncIterator[SandboxManager]:
    mgr = SandboxManager(probe_result=probe_result, host=host)
    try:
        yield mgr
    finally:
        await mgr.aclose()
