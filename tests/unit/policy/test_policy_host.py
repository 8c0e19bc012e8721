"""Platform detection and the HostFacts value."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import pytest
from policy_fakes import FakeFs

from cc_server.policy import HostFacts, Platform, detect_platform
from cc_server.policy import host as host_module


@pytest.mark.parametrize(
    ("sys_platform", "release", "platform"),
    [
        ("linux", "6.8.0-45-generic", Platform.LINUX),
        ("linux", "5.15.153.1-microsoft-standard-WSL2", Platform.WSL2),
        ("linux", "4.4.0-19041-Microsoft", Platform.WSL2),
        ("linux2", "3.2.0", Platform.LINUX),
        ("darwin", "ignored", Platform.MACOS),
        ("win32", "ignored", Platform.WINDOWS),
        ("cygwin", "ignored", Platform.WINDOWS),
        ("freebsd14", "ignored", Platform.OTHER),
        ("emscripten", "ignored", Platform.OTHER),
    ],
)
def test_detect_platform(sys_platform: str, release: str, platform: Platform) -> None:
    assert detect_platform(sys_platform, kernel_release=release) is platform


@pytest.mark.parametrize(
    ("release", "platform"),
    [("6.1.0-generic", Platform.LINUX), ("5.10.16.3-microsoft-standard-WSL2", Platform.WSL2)],
)
def test_detect_platform_reads_the_kernel_release_when_not_given(
    monkeypatch: pytest.MonkeyPatch, release: str, platform: Platform
) -> None:
    monkeypatch.setattr(host_module._platform, "release", lambda: release)
    assert detect_platform("linux") is platform


def test_detect_platform_does_not_read_the_kernel_release_off_linux(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def boom() -> str:
        raise AssertionError("platform.release() must not be called")

    monkeypatch.setattr(host_module._platform, "release", boom)
    assert detect_platform("darwin") is Platform.MACOS


def test_detect_platform_defaults_to_the_running_host() -> None:
    assert isinstance(detect_platform(), Platform)


def test_platform_values() -> None:
    assert [p.value for p in Platform] == ["linux", "wsl2", "macos", "windows", "other"]


def probe_fields() -> list[str]:
    return [
        f.name
        for f in dataclasses.fields(HostFacts)
        if f.name not in ("platform", "home", "server_is_root")
    ]


def test_current_returns_a_platform_and_callables() -> None:
    facts = HostFacts.current()
    assert isinstance(facts.platform, Platform)
    assert facts.platform is detect_platform()
    assert isinstance(facts.home, str)
    assert facts.home.startswith("/")
    for name in probe_fields():
        assert callable(getattr(facts, name)), name
    # Read-only lookups of the real root; nothing under the real home is touched.
    assert facts.realpath("/") == "/"
    assert facts.exists("/") is True
    assert facts.server_is_root is (os.geteuid() == 0)


def test_current_keeps_a_given_platform() -> None:
    assert HostFacts.current(Platform.WSL2).platform is Platform.WSL2


def test_host_facts_are_frozen_and_compare_without_callables() -> None:
    a = HostFacts(platform=Platform.LINUX, home="/h", realpath=str, exists=bool)
    b = HostFacts(platform=Platform.LINUX, home="/h", realpath=str.strip, exists=callable)
    assert a == b
    assert a != HostFacts(platform=Platform.MACOS, home="/h", realpath=str, exists=bool)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.home = "/elsewhere"  # type: ignore[misc]


def test_fake_host_answers_every_probe(make_host: Callable[..., HostFacts]) -> None:
    # Guards the fixtures: if HostFacts grows a probe with a real default, the fake must answer it.
    facts = make_host()
    for name in probe_fields():
        probe = getattr(facts, name)
        assert isinstance(getattr(probe, "__self__", None), FakeFs), name
