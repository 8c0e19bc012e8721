"""What the compiler may learn about the host, behind one small value so tests can fake it."""

from __future__ import annotations

import enum
import os
import platform as _platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["HostFacts", "Platform", "detect_platform"]


class Platform(enum.StrEnum):
    """Host platforms the probe and the compiler tell apart."""

    LINUX = "linux"
    WSL2 = "wsl2"
    MACOS = "macos"
    WINDOWS = "windows"
    OTHER = "other"


@dataclass(frozen=True, slots=True, kw_only=True)
class HostFacts:
    """What the compiler may learn about the host; tests pass fakes."""

    platform: Platform
    home: str
    realpath: Callable[[str], str] = field(compare=False)
    exists: Callable[[str], bool] = field(compare=False)
    is_dir: Callable[[str], bool] = field(default=os.path.isdir, compare=False)
    server_is_root: bool = field(default_factory=lambda: os.geteuid() == 0)
    """The server runs as host uid 0: its sandboxes must then run as another identity. The
    default is the truth about this process, so a HostFacts built by hand cannot forget it."""

    @classmethod
    def current(cls, platform: Platform | None = None) -> HostFacts:
        """Facts of the running host."""
        return cls(
            platform=platform or detect_platform(),
            home=os.path.expanduser("~"),
            realpath=os.path.realpath,
            exists=os.path.lexists,
            is_dir=os.path.isdir,
            server_is_root=os.geteuid() == 0,
        )


def detect_platform(
    sys_platform: str = sys.platform, kernel_release: str | None = None
) -> Platform:
    """Which platform row of the probe table this host is; WSL2 is Linux with a Microsoft kernel."""
    if sys_platform.startswith("linux"):
        release = _platform.release() if kernel_release is None else kernel_release
        return Platform.WSL2 if "microsoft" in release.lower() else Platform.LINUX
    if sys_platform == "darwin":
        return Platform.MACOS
    if sys_platform in ("win32", "cygwin"):
        return Platform.WINDOWS
    return Platform.OTHER
