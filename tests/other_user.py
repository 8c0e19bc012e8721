"""An unprivileged host user for the tests that must hold for both identities.

CI runs as root; these tests also run the CLI and the server as a user made for them (`useradd`),
so a promise that holds only because the server is root (or only because it is not) shows up.
The user runs the host's own Python (/usr/bin/python3, the same minor version as the venv's) with
the checkout's sources and the venv's packages on PYTHONPATH: the venv's interpreter may live
where that user cannot read (a pyenv build under /root).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

NAME = "ccs-sec-test"
HOST_PYTHON = "/usr/bin/python3"
SETPRIV = "/usr/bin/setpriv"  # util-linux; absolute: it changes the identity of what runs
SRC = str(pathlib.Path(__file__).resolve().parents[1] / "src")


@dataclass(frozen=True)
class OtherUser:
    """A host user without privileges; `argv()` runs a command as it."""

    name: str
    uid: int
    gid: int
    home: pathlib.Path
    pythonpath: str = ""
    """Where this user imports cc-server and its packages from (`reachable()` sets it)."""
    copy: pathlib.Path | None = None
    """The copy `reachable()` made of them, if it had to: removed after the session."""

    def argv(self, *argv: str) -> list[str]:
        if os.geteuid() == self.uid:
            return list(argv)
        return [SETPRIV, f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups", *argv]

    def python(self, *argv: str) -> list[str]:
        return self.argv(HOST_PYTHON, *argv)

    def cli(self, *argv: str) -> list[str]:
        return self.python("-m", "cc_server.cli", *argv)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "PYTHONPATH": self.pythonpath or _default_pythonpath(),
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        env.update(extra or {})
        return env

    def workdir(self) -> pathlib.Path:
        """A fresh directory this user owns, reachable by it (pytest's tmp_path is not)."""
        path = pathlib.Path(tempfile.mkdtemp(prefix="ccs-user-", dir="/tmp"))
        os.chown(path, self.uid, self.gid)
        return path

    def run(
        self, argv: Sequence[str], *, cwd: pathlib.Path, timeout_s: float = 60.0,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*argv), cwd=cwd, env=self.env(env), capture_output=True, text=True,
            timeout=timeout_s, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip


def ensure_user() -> OtherUser:
    """The test user: made with useradd when the tests run as root, else the caller itself."""
    if os.geteuid() != 0:
        me = pwd.getpwuid(os.geteuid())
        home = pathlib.Path(me.pw_dir)
        return OtherUser(name=me.pw_name, uid=me.pw_uid, gid=me.pw_gid, home=home)
    try:
        entry = pwd.getpwnam(NAME)
    except KeyError:
        subprocess.run(
            ["useradd", "--create-home", "--user-group", "--shell", "/bin/sh", NAME],
            check=True, capture_output=True,
        )  # fmt: skip
        entry = pwd.getpwnam(NAME)
    home = pathlib.Path(entry.pw_dir)
    return OtherUser(name=NAME, uid=entry.pw_uid, gid=entry.pw_gid, home=home)


def _site_packages() -> list[str]:
    return [p for p in sys.path if p.endswith("site-packages") and ".venv" in p]


def _default_pythonpath() -> str:
    return ":".join([SRC, *_site_packages()])


def _imports(user: OtherUser) -> subprocess.CompletedProcess[str]:
    return user.run(
        [HOST_PYTHON, "-c", "import cc_server.cli, msgspec, pyseccomp"], cwd=user.home
    )


def reachable(user: OtherUser) -> OtherUser:
    """The user with a PYTHONPATH it can read: the checkout's own, or, where the checkout lies
    below a directory the user cannot search (a clone under /root), a world-readable copy of
    the sources (with the built helpers) and the venv's packages in /tmp. Fails, never skips,
    when neither imports."""
    user = dataclasses.replace(user, pythonpath=_default_pythonpath())
    if _imports(user).returncode == 0:
        return user
    copy = pathlib.Path(tempfile.mkdtemp(prefix="ccs-user-py-", dir="/tmp"))
    os.chmod(copy, 0o755)
    shutil.copytree(SRC, copy / "src", symlinks=True)
    paths = [str(copy / "src")]
    for i, site in enumerate(_site_packages()):
        shutil.copytree(site, copy / f"site-{i}", symlinks=True)
        paths.append(str(copy / f"site-{i}"))
    for dirpath, dirs, files in os.walk(copy):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, os.lstat(path).st_mode | 0o444 | (0o111 if name in dirs else 0))
    user = dataclasses.replace(user, pythonpath=":".join(paths), copy=copy)
    probe = _imports(user)
    assert probe.returncode == 0, (
        f"user {user.name} cannot import cc-server with {HOST_PYTHON}, from the checkout or a "
        f"copy in {copy}: {probe.stderr}"
    )
    return user


def remove(path: pathlib.Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
