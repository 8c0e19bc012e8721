"""Capability-gated credentials, brokered per launch and revoked on teardown.

A run whose capabilities earn GitHub (canCallGitHubApi or canPush) and whose network is on gets a
per-launch directory (0700, under the server's private runtime directory) holding two things:

- `git-credential-cc`, a git credential helper script, and
- `s`, a unix socket the server listens on for this run only.

The run is given the directory as a read-only bind and git configuration in its environment
(`credential.helper` reset, then pointed at the script; prompts off). When git needs a password
for https://github.com it runs the helper, the helper asks the socket, and the server answers
with the operator's token, read from the operator's token file at that moment. The token is
never in the run's environment, in its argv or in a file it can read.

The socket answers only a peer inside the run's own sandbox: `admit(run_id, rule)` names it once
the run is launched (the handle's `sandbox_peers`, see backends/peer.py); until then, and for any
other process (another sandbox, a process on the host), the connection is closed unread.

`revoke(run_id)` (idempotent) stops the listener, closes the socket and removes the directory:
from then on the helper gets no answer and git has no password. What revocation cannot undo is a
value the run already received and copied (the helper prints the token to git, which the run
controls); the operator's token should be narrowly scoped and short-lived for that reason.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import selectors
import shutil
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Final

from cc_server.backends import peer
from cc_server.backends.identity import sandbox_uids
from cc_server.errors import BadSpec, CcServerError
from cc_server.policy import SandboxBindMount, SandboxSpec
from cc_server.rundir import names_of_dead_owners

__all__ = [
    "HELPER_NAME",
    "CredentialBroker",
    "CredentialUnavailable",
    "Grant",
    "remove_stale_grant_dirs",
]

HELPER_NAME: Final = "git-credential-cc"
SOCKET_NAME: Final = "s"  # short: a unix socket path is limited to 107 bytes
GRANT_DIR_PREFIX: Final = "cred-"
MAX_REQUEST_BYTES: Final = 64 * 1024  # a git credential request is a few short lines
REQUEST_TIMEOUT_S: Final = 5.0  # one helper exchange, whole; git waits on it
REVOKE_POLL_S: Final = 0.1  # how often a request being read looks for a revoke (close() joins)
MAX_TOKEN_CHARS: Final = 4096  # far longer than any GitHub token
LISTEN_BACKLOG: Final = 16
GITHUB_USERNAME: Final = "x-access-token"  # what GitHub expects with a token as password
DEFAULT_GITHUB_HOSTS: Final = ("github.com",)
_GRANT_DIR = re.compile(r"^cred-(?P<pid>\d+)-[0-9a-f]{16}\Z")
_RUN_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}\Z")
_TOKEN = re.compile(r"^[\x21-\x7e]+\Z")  # printable, no whitespace

# The helper: stdlib Python only, so it runs wherever the server's host Python is visible. It
# forwards git's request for `get` and prints whatever the server answers; with the socket gone it
# prints nothing, and git (GIT_TERMINAL_PROMPT=0) fails without asking anyone.
_HELPER_SCRIPT: Final = """#!/usr/bin/env python3
# git credential helper of one cc-server run: asks the server over this run's socket.
import socket
import sys

SOCKET = {socket_path!r}
if len(sys.argv) < 2 or sys.argv[1] != "get":
    sys.exit(0)
request = sys.stdin.buffer.read({max_request})
answer = b""
try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout({timeout})
        conn.connect(SOCKET)
        conn.sendall(request)
        conn.shutdown(socket.SHUT_WR)
        while True:
            chunk = conn.recv(4096)
            if not chunk:
                break
            answer += chunk
except OSError:
    sys.exit(0)
sys.stdout.buffer.write(answer)
"""


class CredentialUnavailable(CcServerError):
    """The operator's credential could not be read; the run was not given one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant:
    """What one run is given: environment and binds. Empty when its capabilities earn nothing."""

    run_id: str
    env: dict[str, str] = field(default_factory=dict)
    bind_mounts: tuple[SandboxBindMount, ...] = ()
    directory: str | None = None  # the per-launch directory, None for an empty grant

    @property
    def empty(self) -> bool:
        """Nothing was granted."""
        return not self.env and not self.bind_mounts


def _parse_request(data: bytes) -> dict[str, str]:
    fields: dict[str, str] = {}
    for raw in data.decode("utf-8", "replace").splitlines():
        if not raw:
            break
        key, sep, value = raw.partition("=")
        if sep:
            fields.setdefault(key, value)
    return fields


class _Listener:
    """One run's socket and the thread answering it; `close()` ends both."""

    def __init__(self, path: str, answer: _Answer) -> None:
        self.path = path
        self._answer = answer
        self._revoked = threading.Event()
        self.peers: peer.PeerRule | None = None  # whom to answer; nobody until admit()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(path)
            os.chmod(path, 0o600)
            self._sock.listen(LISTEN_BACKLOG)
            self._sock.setblocking(False)
            self._wake_r, self._wake_w = os.pipe()
        except BaseException:
            self._sock.close()
            raise
        self._thread = threading.Thread(
            target=self._serve, name=f"cc-credentials:{os.path.basename(os.path.dirname(path))}"
        )
        self._thread.daemon = True  # revoke() joins it; a dying server must not wait on it
        self._thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._sock, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._revoked.is_set():
                for key, _ in selector.select():
                    if key.fileobj == self._wake_r:
                        return
                    with contextlib.suppress(OSError):
                        conn, _ = self._sock.accept()
                        with conn:
                            self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        conn.setblocking(True)
        if hasattr(socket, "SO_PEERCRED"):
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            if uid not in sandbox_uids():
                return  # only this user's sandboxes (the directory is 0700 as well)
        rule = self.peers
        if rule is None or not peer.admit(conn, rule, what=f"credential broker {self.path}"):
            return  # not the run's own sandbox: nothing is read, nothing answered
        # The whole request within REQUEST_TIMEOUT_S, and a revoke seen within REVOKE_POLL_S: a
        # client that stalls or drips cannot hold this thread, nor close() that joins it.
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        data = b""
        while len(data) <= MAX_REQUEST_BYTES:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._revoked.is_set():
                return
            conn.settimeout(min(remaining, REVOKE_POLL_S))
            try:
                chunk = conn.recv(4096)
            except TimeoutError:
                continue
            if not chunk:
                break
            data += chunk
        if len(data) > MAX_REQUEST_BYTES or self._revoked.is_set():
            return
        reply = self._answer(_parse_request(data))
        if reply and not self._revoked.is_set():
            conn.settimeout(max(deadline - time.monotonic(), REVOKE_POLL_S))
            conn.sendall(reply)

    def close(self) -> None:
        """Stop answering (even a request already read), close the socket, end the thread."""
        if self._revoked.is_set():
            return
        self._revoked.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join()
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


class _Answer:
    """Answers one run's helper: the operator's token for the GitHub hosts over https, else
    nothing. The token file is read per answer, so a rotated token is used at once."""

    def __init__(self, token_file: str, hosts: tuple[str, ...]) -> None:
        self.token_file = token_file
        self.hosts = hosts

    def __call__(self, request: dict[str, str]) -> bytes:
        if request.get("protocol") != "https" or request.get("host") not in self.hosts:
            return b""
        try:
            token = _read_token(self.token_file)
        except CredentialUnavailable:
            return b""
        return f"username={GITHUB_USERNAME}\npassword={token}\n".encode()


def _read_token(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise CredentialUnavailable(
            f"the GitHub token file {path!r} cannot be opened: {exc.strerror}",
            fix="point the operator's token file setting at a readable regular file",
        ) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise CredentialUnavailable(f"the GitHub token file {path!r} is not a regular file")
        raw = f.read(MAX_TOKEN_CHARS + 2)
    token = raw.decode("utf-8", "replace").strip()
    if not token or len(token) > MAX_TOKEN_CHARS or not _TOKEN.match(token):
        raise CredentialUnavailable(
            f"the GitHub token file {path!r} does not hold one token",
            fix="write the token alone on one line",
        )
    return token


def remove_stale_grant_dirs(base: str) -> list[str]:
    """Remove per-launch credential directories of server processes that no longer exist."""
    removed = names_of_dead_owners(base, _GRANT_DIR)
    for name in removed:
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return removed


class CredentialBroker:
    """Grants runs the credentials their capabilities earn, and revokes them.

    `github_token_file` is the operator's configuration; without it no run gets a GitHub
    credential. Credentials never come from the server's environment. `base_dir` must be a
    private (0700) directory of this user: the egress code's runtime directory.
    """

    def __init__(
        self,
        *,
        base_dir: str,
        github_token_file: str | None = None,
        github_hosts: tuple[str, ...] = DEFAULT_GITHUB_HOSTS,
    ) -> None:
        self.base_dir = base_dir
        self.github_token_file = github_token_file
        self.github_hosts = github_hosts
        self._lock = threading.Lock()
        self._live: dict[str, tuple[Grant, _Listener]] = {}

    @property
    def live_runs(self) -> tuple[str, ...]:
        """Run ids holding a grant."""
        with self._lock:
            return tuple(self._live)

    def grant(self, spec: SandboxSpec, run_id: str) -> Grant:
        """The credentials `spec`'s capabilities earn, for run `run_id` only.

        A GitHub credential needs canCallGitHubApi or canPush, the network on, and an operator
        token file; otherwise the grant is empty and nothing is created.

        Raises:
            BadSpec: `run_id` is malformed or already holds a grant.
            CredentialUnavailable: the token file is configured but unreadable or malformed.
        """
        if not _RUN_ID.match(run_id):
            raise BadSpec(
                f"run id {run_id!r} must be 1 to 128 letters, digits or '._:-'",
                fix="use the dispatch's own run id",
            )
        with self._lock:
            if run_id in self._live:
                raise BadSpec(f"run {run_id!r} already holds a grant", fix="revoke it first")
        if not (
            spec.capabilities.earns_github
            and spec.network_allowed
            and self.github_token_file is not None
        ):
            return Grant(run_id=run_id)
        _read_token(self.github_token_file)  # fail at grant time, not inside the run
        directory = os.path.join(
            self.base_dir, f"{GRANT_DIR_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        )
        os.mkdir(directory, 0o700)
        try:
            sock_path = os.path.join(directory, SOCKET_NAME)
            helper = os.path.join(directory, HELPER_NAME)
            script = _HELPER_SCRIPT.format(
                socket_path=sock_path, max_request=MAX_REQUEST_BYTES, timeout=REQUEST_TIMEOUT_S
            )
            fd = os.open(helper, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o700)
            with os.fdopen(fd, "w") as f:
                f.write(script)
            listener = _Listener(sock_path, _Answer(self.github_token_file, self.github_hosts))
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        grant = Grant(
            run_id=run_id,
            env={
                # Reset every helper the host's git config names, then use this run's only.
                "GIT_CONFIG_COUNT": "2",
                "GIT_CONFIG_KEY_0": "credential.helper",
                "GIT_CONFIG_VALUE_0": "",
                "GIT_CONFIG_KEY_1": "credential.helper",
                "GIT_CONFIG_VALUE_1": helper,
                "GIT_TERMINAL_PROMPT": "0",
            },
            bind_mounts=(SandboxBindMount(host_path=directory, read_only=True, host_sockets=True),),
            directory=directory,
        )
        with self._lock:
            raced = run_id in self._live
            if not raced:
                self._live[run_id] = (grant, listener)
        if raced:
            listener.close()
            shutil.rmtree(directory, ignore_errors=True)
            raise BadSpec(f"run {run_id!r} already holds a grant", fix="revoke it first")
        return grant

    def admit(self, run_id: str, rule: peer.PeerRule) -> None:
        """Answer run `run_id`'s helper only for a peer `rule` admits: its sandbox's processes
        (`SandboxHandle.sandbox_peers`). Before this, the socket answers nobody. A run without
        a grant is a no-op."""
        with self._lock:
            entry = self._live.get(run_id)
        if entry is not None:
            entry[1].peers = rule

    def revoke(self, run_id: str) -> None:
        """End run `run_id`'s grant: the socket stops answering and the directory is removed.
        Idempotent; an unknown run id is a no-op."""
        with self._lock:
            entry = self._live.pop(run_id, None)
        if entry is None:
            return
        grant, listener = entry
        listener.close()
        if grant.directory is not None:
            shutil.rmtree(grant.directory, ignore_errors=True)

    def close(self) -> None:
        """Revoke every live grant (server shutdown)."""
        for run_id in self.live_runs:
            self.revoke(run_id)
