"""What the write-policy and host-listener security tests share: a host repository, the state of a
worktree to compare before and after, the violations as (verb, target), a host process's Unix
listener, and a wheel made by hand for an offline pip."""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import stat
import subprocess
import threading
import zipfile
from collections.abc import Iterator, Mapping

from cc_server.runtime.handle import SandboxHandle


def git_repo(path: pathlib.Path) -> None:
    """`git init` on the host, with nothing of the host's git configuration."""
    subprocess.run(["git", "init", "-q", str(path)], check=True, env={"PATH": "/usr/bin:/bin"})


def steps_script(steps: Mapping[str, str]) -> str:
    """A shell script that runs each step and prints `name=ok`, or `name=fail` and its output."""
    return "\n".join(
        f"if ( {cmd} ) >/tmp/log 2>&1; then echo '{k}=ok'; else echo '{k}=fail'; cat /tmp/log; fi"
        for k, cmd in steps.items()
    )


def tree_state(wt: pathlib.Path) -> dict[str, tuple[int, bytes]]:
    """Every name in the worktree but the top-level scratch ones (`s_*`): its mode and content
    (a symlink's target)."""
    out: dict[str, tuple[int, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(wt):
        rel_dir = pathlib.Path(dirpath).relative_to(wt)
        if rel_dir == pathlib.Path("."):
            dirnames[:] = [d for d in dirnames if not d.startswith("s_")]
            filenames = [f for f in filenames if not f.startswith("s_")]
        for name in [*dirnames, *filenames]:
            p = pathlib.Path(dirpath) / name
            st = p.lstat()
            data = (
                p.read_bytes() if stat.S_ISREG(st.st_mode)
                else os.readlink(p).encode() if stat.S_ISLNK(st.st_mode)
                else b""
            )  # fmt: skip
            out[str(rel_dir / name)] = (st.st_mode, data)
    return out


def refusals(handle: SandboxHandle) -> list[tuple[str, str]]:
    """The handle's violations as (verb, target)."""
    return [(v.action, v.target) for v in handle.violations]


class HostListener:
    """A host process's listening Unix socket; `contacts` counts whoever reached it."""

    def __init__(self, path: pathlib.Path, kind: int = socket.SOCK_STREAM, backlog: int = 64):
        self.path = path
        self.kind = kind
        self.contacts = 0
        self.sock = socket.socket(socket.AF_UNIX, kind)
        self.sock.bind(str(path))
        path.chmod(0o777)
        if kind != socket.SOCK_DGRAM:
            self.sock.listen(backlog)
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if self.kind == socket.SOCK_DGRAM:
                    self.sock.recv(100)
                else:
                    conn, _ = self.sock.accept()
                    conn.close()
                self.contacts += 1
            except (TimeoutError, OSError):
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@contextlib.contextmanager
def host_listener(path: pathlib.Path, kind: int = socket.SOCK_STREAM) -> Iterator[HostListener]:
    listener = HostListener(path, kind)
    try:
        yield listener
    finally:
        listener.close()


def wheel(where: pathlib.Path, name: str, version: str, files: Mapping[str, str]) -> pathlib.Path:
    """A pure-Python wheel of `files` (no network, no build step), made by hand: a zip with its
    METADATA, WHEEL and RECORD."""
    info = f"{name}-{version}.dist-info"
    contents = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    contents[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in contents) + f"{info}/RECORD,,\n"
    path = where / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, text in contents.items():
            z.writestr(member, text)
    return path
