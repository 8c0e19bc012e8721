"""What a running sandbox's mount namespace shows at a host path, against the host itself."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["bound_as_on_host"]


def bound_as_on_host(pid: int, paths: Sequence[str]) -> bool:
    """Whether each of `paths` is, in `pid`'s mount namespace, the file the host has there now
    (same device and inode; a path either side cannot stat is not)."""
    for path in paths:
        try:
            host, inside = os.stat(path), os.stat(f"/proc/{pid}/root{path}")
        except OSError:
            return False
        if (host.st_dev, host.st_ino) != (inside.st_dev, inside.st_ino):
            return False
    return True
