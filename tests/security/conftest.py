"""Fixtures for the escape tests: a fake $HOME with planted secrets, a worktree, a manager.

Nothing here touches the real home directory: every secret lives under pytest's tmp_path, and the
sandbox is told that tmp_path/home is $HOME. The probe must find bubblewrap; when it does not, the
tests fail (they never skip), because a security suite that silently skips proves nothing.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import AsyncIterator, Iterator

import pytest
from escape_kit import Sandboxes, unique
from other_user import OtherUser, remove

from cc_server.backends.probe import ProbeResult
from cc_server.policy import HostFacts, Platform, detect_platform
from cc_server.runtime.port import SandboxManager


@pytest.fixture
async def sb(tmp_path: pathlib.Path, probe_result: ProbeResult) -> AsyncIterator[Sandboxes]:
    home = tmp_path / "home"
    marker = unique("CC-SECRET-SSH-KEY")
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text(f"-----BEGIN KEY-----\n{marker}\n")
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text(f"aws_secret_access_key = {marker}\n")
    worktree = tmp_path / "wt"
    worktree.mkdir()
    (worktree / "README").write_text("worktree control file\n")
    platform = detect_platform()
    assert platform in (Platform.LINUX, Platform.WSL2)
    host = HostFacts(
        platform=platform,
        home=str(home),
        realpath=os.path.realpath,
        exists=os.path.lexists,
        is_dir=os.path.isdir,
    )
    manager = SandboxManager(probe_result=probe_result, host=host)
    try:
        yield Sandboxes(
            root=tmp_path, home=home, worktree=worktree, secret_marker=marker, manager=manager
        )
    finally:
        await manager.aclose()


@pytest.fixture
def user_dir(other_user: OtherUser) -> Iterator[pathlib.Path]:
    """A fresh directory the unprivileged test user owns, removed afterwards."""
    path = other_user.workdir()
    yield path
    remove(path)
