"""Fixtures for the policy tests: fake hosts only, never the real home or os.environ."""

from __future__ import annotations

import pytest
from policy_fakes import MakeHost, make_fake_host

from cc_server.policy import HostFacts


@pytest.fixture
def make_host() -> MakeHost:
    """Build HostFacts from a fake filesystem (see policy_fakes.make_fake_host)."""
    return make_fake_host


@pytest.fixture
def host() -> HostFacts:
    """A macOS-like host where /tmp/work, /tmp/state, /Users/dev/repo and /opt/ro exist."""
    return make_fake_host(existing={"/tmp/work", "/tmp/state", "/Users/dev/repo", "/opt/ro"})
