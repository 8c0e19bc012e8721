"""The real probe on this host: with bwrap and socat installed, bubblewrap must be available."""

from __future__ import annotations

import os
import shutil

import pytest

from cc_server.backends.probe import (
    BUBBLEWRAP_NOTE,
    ProbeFacts,
    SelftestResult,
    probe,
    run_bwrap_selftest,
    startup_line,
)
from cc_server.policy.host import Platform

pytestmark = pytest.mark.integration


@pytest.fixture
def linux_with_tools() -> None:
    facts = ProbeFacts.current()
    if facts.platform not in (Platform.LINUX, Platform.WSL2):
        pytest.skip(f"bubblewrap is a Linux/WSL2 backend; this host is {facts.platform}")
    missing = [t for t in ("bwrap", "socat") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"not installed here: {', '.join(missing)}")


@pytest.mark.usefixtures("linux_with_tools")
def test_real_probe_finds_bubblewrap() -> None:
    result = probe()
    assert result.available, result.hint
    assert result.mechanism == "bubblewrap"
    assert result.note == BUBBLEWRAP_NOTE
    assert result.hint is None
    assert not result.requires_install
    assert result.missing_packages == ()
    # The project's own set-up builds the create-rule supervisor (scripts/bootstrap).
    assert result.create_rules, result.create_rules_hint
    assert set(result.tools) == {
        "bwrap", "socat", "cc-create-launcher", "cc-create-supervisor",
        *(("cc-identity",) if os.geteuid() == 0 else ()),
    }
    for name, path in result.tools.items():
        assert os.path.isabs(path), (name, path)
        assert os.access(path, os.X_OK), (name, path)
    assert startup_line(result, sandbox_flag_on=True) == f"agent sandbox ON ({BUBBLEWRAP_NOTE})"


@pytest.mark.usefixtures("linux_with_tools")
def test_real_selftest_passes_and_fails_closed_on_a_wrong_binary() -> None:
    bwrap = shutil.which("bwrap")
    assert bwrap is not None
    assert run_bwrap_selftest(bwrap) == SelftestResult(ok=True, detail="")
    # /bin/false stands in for a broken bwrap: exit status 1, nothing on stderr.
    broken = run_bwrap_selftest("/bin/false")
    assert not broken.ok
    assert broken.detail.startswith("bwrap exited with status 1")
