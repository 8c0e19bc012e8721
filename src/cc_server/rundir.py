"""The user's private runtime directory for cc-server: session sockets, the server's token, the
CLI daemon's socket. Stdlib only, so the `cc-server` command's first step can use it cheaply."""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Mapping
from typing import Final

from cc_server.errors import EnforcementFailed

__all__ = ["BASE_DIR_NAME", "egress_base_dir", "names_of_dead_owners", "pid_alive"]

BASE_DIR_NAME: Final = "cc-server"


def egress_base_dir(
    environ: Mapping[str, str] = os.environ, tmp_dir: str | None = None
) -> str:
    """The private base directory for session sockets: `$XDG_RUNTIME_DIR/cc-server` when that is
    set, else `<tmp>/cc-server-<uid>`. Created 0700; refused unless it is ours and private.

    Raises:
        EnforcementFailed: the directory exists but belongs to someone else or is open to others.
    """
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        base = os.path.join(runtime, BASE_DIR_NAME)
    else:
        if tmp_dir is None:
            import tempfile  # lazy import: only without XDG_RUNTIME_DIR

            tmp_dir = tempfile.gettempdir()
        tmp = tmp_dir
        base = os.path.join(tmp, f"{BASE_DIR_NAME}-{os.geteuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(base, 0o700)
    info = os.lstat(base)
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.geteuid()
        or stat.S_IMODE(info.st_mode) & 0o077
    ):
        raise EnforcementFailed(
            f"{base} is not a private directory owned by this user",
            fix=f"remove {base} (someone else may have created it) and start again",
        )
    return base


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one this user may not signal counts as existing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def names_of_dead_owners(directory: str, pattern: re.Pattern[str]) -> list[str]:
    """The names in `directory` that `pattern` matches and whose `pid` group names a process that
    is gone: what a killed server, daemon or build left behind. None when there is no directory."""
    dead: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            match = pattern.match(name)
            if match is not None and not pid_alive(int(match["pid"])):
                dead.append(name)
    return dead
