"""Who is at the other end of a local Unix socket, and whether to serve it.

A local socket that can run or relay anything (the CLI daemon, a session's egress proxies, the
credential broker) authenticates its peer by namespace, not by uid alone: a sandboxed process has
the server's uid whenever the server is not root, so a uid says nothing about whether the peer is
a sandbox. `identify` reads the peer's PID and user namespaces (the (st_dev, st_ino) of
`/proc/PID/ns/{pid,user}`) race-free: the kernel hands over a pidfd of the process that connected
(SO_PEERPIDFD, Linux 6.5+), its pid is read from the pidfd itself, and the facts read through
`/proc/PID` count only if the pidfd is still alive afterwards (a live process keeps its pid, so
`/proc/PID` was that process all along). Without SO_PEERPIDFD nothing is admitted.

A rule says whom a listener serves:

- `SameNamespaces`: the CLI daemon's, a peer in the daemon's own user and PID namespaces. A
  sandboxed process is in new ones (bubblewrap's `--unshare-user --unshare-pid`; a microVM guest
  is not on this kernel at all).
- `SandboxPeers`: a session's proxies and a run's credential broker, a peer inside one of the
  sandboxes launched for that session: its PID namespace is the one of a process whose parent is a
  launch the runtime registered (bubblewrap's outer process; the sandbox's PID 1 is its child).
  The sandbox's commands cannot leave that namespace (no capabilities, no nested user
  namespaces), and no other sandbox is in it.
- `ThisProcess`: the server process itself (a microVM's proxies, reached by the server's own
  link to the guest).

`admit` and `admit_async` identify the peer, apply the rule and log a refusal with its reason;
the caller closes a refused connection without reading from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Protocol

__all__ = [
    "NamespaceId",
    "Peer",
    "PeerRule",
    "PeerUnknown",
    "SameNamespaces",
    "SandboxPeers",
    "ThisProcess",
    "admit",
    "admit_async",
    "identify",
    "own_namespaces",
    "supported",
]

log = logging.getLogger("cc_server.peer")

SO_PEERPIDFD: Final = getattr(socket, "SO_PEERPIDFD", 77)  # <asm-generic/socket.h>, Linux 6.5
MAX_ANCESTORS: Final = 64  # parent hops from a peer up to its sandbox's launch; a tree is shallower
# While a launch is in flight, a peer not yet admitted may belong to it: wait this long for the
# launch to be registered before refusing (the launch registers right after the spawn returns).
SETTLE_WAIT_S: Final = 2.0
SETTLE_POLL_S: Final = 0.01


class PeerUnknown(Exception):
    """The peer could not be identified (no pidfd, gone, not visible): it is refused."""


@dataclass(frozen=True, slots=True)
class NamespaceId:
    """A namespace's identity: the device and inode of its nsfs file."""

    dev: int
    ino: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Peer:
    """The process that connected, as this process's PID namespace sees it."""

    pid: int
    user_ns: NamespaceId
    pid_ns: NamespaceId


class PeerRule(Protocol):
    """Whom a listener serves."""

    def refusal(self, peer: Peer) -> str | None:
        """Why `peer` is refused, or None to serve it."""
        ...

    def settling(self) -> bool:
        """Whether a launch is in flight that might yet admit a refused peer."""
        ...


def _namespace(pid: int | str, kind: str) -> NamespaceId:
    try:
        info = os.stat(f"/proc/{pid}/ns/{kind}")
    except OSError as exc:
        raise PeerUnknown(f"its {kind} namespace cannot be read ({exc.strerror})") from None
    return NamespaceId(info.st_dev, info.st_ino)


def own_namespaces() -> tuple[NamespaceId, NamespaceId]:
    """This process's (user, PID) namespaces.

    Raises:
        PeerUnknown: /proc/self/ns cannot be read.
    """
    return _namespace("self", "user"), _namespace("self", "pid")


def _alive(pidfd: int) -> bool:
    """A pidfd turns readable when its process exits."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return not poller.poll(0)


def _pidfd_pid(pidfd: int) -> int:
    """The pid (in this process's PID namespace) a pidfd refers to: 0 when the process is not
    visible here, -1 once it has exited."""
    with open(f"/proc/self/fdinfo/{pidfd}", encoding="ascii") as f:
        for line in f:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    raise PeerUnknown("its pidfd names no process")


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def identify(sock: socket.socket) -> Peer:
    """The process at the other end of connected Unix socket `sock` (the one that connected).

    Raises:
        PeerUnknown: this kernel hands over no pidfd, or the peer exited, is not visible in this
            PID namespace, or its namespaces cannot be read.
    """
    try:
        pidfd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as exc:
        raise PeerUnknown(f"the kernel gives no pidfd of the peer ({exc.strerror})") from None
    try:
        pid = _pidfd_pid(pidfd)
        if pid == -1:
            raise PeerUnknown("it has exited")
        if pid == 0:
            raise PeerUnknown("it is in a PID namespace this process cannot see")
        peer = Peer(pid=pid, user_ns=_namespace(pid, "user"), pid_ns=_namespace(pid, "pid"))
        if not _alive(pidfd):
            raise PeerUnknown("it exited while it was being identified")
        return peer
    finally:
        os.close(pidfd)


def supported() -> bool:
    """Whether peers can be identified here (SO_PEERPIDFD and /proc/PID/ns)."""
    try:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:
        return False
    with a, b:
        try:
            peer = identify(a)
        except PeerUnknown:
            return False
    return peer.pid == os.getpid()


def _refused(what: str, sock: socket.socket, reason: str, peer: Peer | None) -> None:
    who = f"pid {peer.pid}" if peer is not None else "an unidentified process"
    log.warning("%s: refused %s: %s", what, who, reason)
    with contextlib.suppress(OSError):
        sock.close()


def _identified(sock: socket.socket, what: str) -> Peer | None:
    try:
        return identify(sock)
    except PeerUnknown as exc:
        _refused(what, sock, str(exc), None)
        return None


def _verdict(
    sock: socket.socket, rule: PeerRule, peer: Peer, deadline: float, what: str
) -> bool | None:
    """True: serve it; False: refused (closed and logged); None: a launch is in flight, ask
    again after SETTLE_POLL_S."""
    reason = rule.refusal(peer)
    if reason is None:
        return True
    if not rule.settling() or time.monotonic() >= deadline:
        _refused(what, sock, reason, peer)
        return False
    return None


def admit(sock: socket.socket, rule: PeerRule, *, what: str) -> bool:
    """Whether to serve the peer of `sock` under `rule`. A refused peer's socket is closed and
    the reason logged (logger `cc_server.peer`, naming `what`). May wait up to SETTLE_WAIT_S
    while a launch is in flight (blocking: for threads and synchronous servers)."""
    peer = _identified(sock, what)
    if peer is None:
        return False
    deadline = time.monotonic() + SETTLE_WAIT_S
    while (verdict := _verdict(sock, rule, peer, deadline, what)) is None:
        time.sleep(SETTLE_POLL_S)
    return verdict


async def admit_async(sock: socket.socket, rule: PeerRule, *, what: str) -> bool:
    """`admit` for the event loop: the wait for a launch in flight does not block the loop."""
    peer = _identified(sock, what)
    if peer is None:
        return False
    deadline = time.monotonic() + SETTLE_WAIT_S
    while (verdict := _verdict(sock, rule, peer, deadline, what)) is None:
        await asyncio.sleep(SETTLE_POLL_S)
    return verdict


class SameNamespaces:
    """A peer in this process's own user and PID namespaces (the CLI daemon's clients)."""

    def __init__(self) -> None:
        """Raises PeerUnknown when this process's namespaces cannot be read."""
        self.user_ns, self.pid_ns = own_namespaces()

    def refusal(self, peer: Peer) -> str | None:
        """A peer in another user or PID namespace (a sandbox) is refused."""
        if peer.user_ns != self.user_ns:
            return "it is in another user namespace (a sandbox?)"
        if peer.pid_ns != self.pid_ns:
            return "it is in another PID namespace (a sandbox?)"
        return None

    def settling(self) -> bool:
        """Never: nothing registers."""
        return False


class ThisProcess:
    """The server process itself, nothing else (a microVM's proxies: the server's link)."""

    def refusal(self, peer: Peer) -> str | None:
        """Any other process is refused."""
        return None if peer.pid == os.getpid() else "only the server itself connects here"

    def settling(self) -> bool:
        """Never: nothing registers."""
        return False


@dataclass(slots=True)
class _Launch:
    pid: int
    pidfd: int
    # Its sandbox's PID namespace, once learnt from its child; the open nsfs file keeps that
    # namespace (and so its inode number) from being freed and reused while it is cached.
    sandbox_pid_ns: NamespaceId | None = None
    sandbox_ns_fd: int | None = None

    def release(self) -> None:
        os.close(self.pidfd)
        if self.sandbox_ns_fd is not None:
            os.close(self.sandbox_ns_fd)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


class SandboxPeers:
    """The sandboxes launched for one session (or one dispatch run): a peer is served when its
    PID namespace is one of theirs. Thread-safe: the broker asks from its own threads.

    The runtime registers each launch (`launching()`, then `add(pid)` with the pid of the
    process it spawned: bubblewrap's outer process, which stays in the server's namespaces and
    whose only child is the sandbox's PID 1). A launch in the server's own PID namespace (the
    `none` backend) admits its descendants; that is no sandbox, and says so in its name.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._launches: list[_Launch] = []
        self._pending = 0
        self._closed = False
        self._own_pid_ns: NamespaceId | None = None

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        """Around a spawn: a peer refused meanwhile is asked about again once it is registered."""
        with self._lock:
            self._pending += 1
        try:
            yield
        finally:
            with self._lock:
                self._pending -= 1

    def add(self, pid: int) -> None:
        """Register the launch of process `pid`, a child of this process not yet reaped (so its
        pid is still its own). A process that is gone already is not registered."""
        pidfd = _open_pidfd(pid)
        if pidfd is None:
            return
        with self._lock:
            if self._closed:
                os.close(pidfd)
                return
            self._prune()
            self._launches.append(_Launch(pid=pid, pidfd=pidfd))

    def _prune(self) -> None:
        """Forget launches that have exited (under the lock)."""
        live = []
        for launch in self._launches:
            if _alive(launch.pidfd):
                live.append(launch)
            else:
                launch.release()
        self._launches = live

    def close(self) -> None:
        """Admit nobody from now on and release the pidfds. Idempotent."""
        with self._lock:
            self._closed = True
            for launch in self._launches:
                launch.release()
            self._launches = []

    def settling(self) -> bool:
        """Whether a launch is between its spawn and its registration."""
        with self._lock:
            return self._pending > 0 and not self._closed

    def refusal(self, peer: Peer) -> str | None:
        """None when `peer` is inside one of the registered sandboxes."""
        if self._own_pid_ns is None:
            self._own_pid_ns = own_namespaces()[1]
        with self._lock:
            if self._closed:
                return "its session is closed"
            self._prune()
            by_pid = {launch.pid: launch for launch in self._launches}
            # A sandbox's namespace, once learnt, settles the question at once.
            if any(launch.sandbox_pid_ns == peer.pid_ns for launch in self._launches):
                return None
            # Walk up from the peer to the first process whose parent is a registered launch.
            # The walk is only a search: what counts is checked on that process through a pidfd.
            child, hops = peer.pid, 0
            while hops < MAX_ANCESTORS:
                parent = _parent(child)
                if parent is None or parent <= 1:
                    break
                launch = by_pid.get(parent)
                if launch is not None:
                    return self._check(launch, child, peer)
                child, hops = parent, hops + 1
            if peer.pid in by_pid and peer.pid_ns == self._own_pid_ns:
                return None  # the `none` backend's command itself
        return "it is in no sandbox of this session"

    def _check(self, launch: _Launch, child: int, peer: Peer) -> str | None:
        """`child` is the launch's child (the sandbox's PID 1) if its parent is still the
        launch while both are alive; then its PID namespace is the sandbox's."""
        pidfd = _open_pidfd(child)
        if pidfd is None:
            return "its sandbox is gone"
        ns_fd: int | None = None
        try:
            try:
                ns_fd = os.open(f"/proc/{child}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
                info = os.fstat(ns_fd)
            except OSError as exc:
                return f"its sandbox cannot be identified ({exc.strerror})"
            pid_ns = NamespaceId(info.st_dev, info.st_ino)
            parent = _parent(child)
            if not (_alive(pidfd) and _alive(launch.pidfd) and parent == launch.pid):
                return "its sandbox changed while it was being identified"
            if pid_ns == self._own_pid_ns:
                # No sandbox around this launch (`none`): its descendants are what it runs.
                return None
            if launch.sandbox_ns_fd is None:
                launch.sandbox_pid_ns, launch.sandbox_ns_fd, ns_fd = pid_ns, ns_fd, None
        finally:
            os.close(pidfd)
            if ns_fd is not None:
                os.close(ns_fd)
        if pid_ns != peer.pid_ns:
            return "it is in another PID namespace than its sandbox"
        return None
