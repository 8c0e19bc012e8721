"""A session's egress: its two proxies, the private directory their bridge sockets live in, and
the violations they report.

The proxies start with the session's first command and stop at destroy. Their Unix sockets live in
`<base>/egress-<server pid>-<random>/`, mode 0700, under a base directory that must be ours and
private. A server that is killed leaves its directories behind; the next SandboxManager removes
every one whose server process is gone (`remove_stale_session_dirs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable, Iterable
from typing import Final, Protocol

from cc_server.backends.host_reads import HostReads
from cc_server.backends.identity import sandbox_uids
from cc_server.backends.peer import PeerRule, ThisProcess
from cc_server.backends.plan import EgressBridge
from cc_server.egress.changes import EgressChange, apply_change
from cc_server.egress.driver import (
    AdoptedListener,
    AskAnswer,
    EgressAsk,
    EgressRefused,
    ProxyParams,
    Resolver,
    SessionProxies,
    TunnelHandler,
    default_advice,
    start_session_proxies,
)
from cc_server.egress.patterns import Allowlist
from cc_server.errors import BadSpec, EnforcementFailed
from cc_server.rundir import base_dir_views, egress_base_dir, names_of_dead_owners
from cc_server.runtime.events import EgressChanged, EgressRequest, SandboxViolation

log = logging.getLogger("cc_server.egress")

ASK_TIMEOUT_S: Final = 30.0  # a held connection's wait for an answer; then it is refused
# Connections held for an answer at once, per session; more are refused at once (a command that
# opens hundreds of connections to unlisted hosts must not hold hundreds of sockets).
MAX_PENDING_REQUESTS: Final = 16
# Base directory views kept, each with the reads it was found from (`SessionEgress._hidden_dirs`),
# one per base directory and environment: a process has one or a few.
MAX_KEPT_VIEWS: Final = 16
_FOUND_VIEWS: dict[tuple[object, ...], tuple[HostReads, tuple[str, ...]]] = {}


class Answer(enum.StrEnum):
    """An answer to an egress request."""

    ONCE = "once"  # this connection only
    SESSION = "session"  # this connection, and host:port is added to the allowlist
    DENY = "deny"  # refused, reported as a violation

__all__ = [
    "Monitor",
    "SessionEgress",
    "egress_base_dir",
    "kill_stale_sandboxes",
    "remove_stale_session_dirs",
]


class Monitor(Protocol):
    """A backend's violation monitor (macOS: runtime.seatbelt_monitor)."""

    async def start(self) -> None:
        """Start watching; raise EnforcementFailed if it cannot."""
        ...

    async def aclose(self) -> None:
        """Stop watching. Idempotent."""
        ...

_SESSION_DIR = re.compile(r"^egress-(?P<pid>\d+)-[0-9a-f]{16}$")
def remove_stale_session_dirs(base: str) -> list[str]:
    """Remove session directories whose server process no longer exists; return what was removed.

    Only names this module creates are touched.
    """
    removed = names_of_dead_owners(base, _SESSION_DIR)
    for name in removed:
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return removed


def kill_stale_sandboxes(base: str, names: Iterable[str], proc_root: str = "/proc") -> list[int]:
    """SIGKILL this user's processes whose argv names one of the stale session directories
    `names` under `base`; return the pids signalled.

    These are sandboxes of a killed server that outlived it: bwrap arms `--die-with-parent` in
    the sandbox's PID 1 only after creating it, so a server killed in that window leaves the
    sandbox running. Its argv still names the session's socket directory, which carries the dead
    server's pid. Killing the sandbox's PID 1 ends its whole PID namespace.
    """
    wanted = {os.path.join(base, name).encode() for name in names}
    killed: list[int] = []
    if not wanted:
        return killed
    uids = sandbox_uids()
    for entry in os.listdir(proc_root):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.stat(os.path.join(proc_root, entry)).st_uid not in uids:
                continue
            with open(os.path.join(proc_root, entry, "cmdline"), "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if wanted.intersection(argv):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
    return killed


def _host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 address in brackets so the two stay apart."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class SessionEgress:
    """The egress of one session: started on first use, closed once."""

    def __init__(
        self,
        *,
        session_id: str,
        allowlist: Allowlist,
        suggest: Callable[[str], str | None],
        on_violation: Callable[[SandboxViolation], None],
        base_dir: str,
        advice: Callable[[str], str] | None = None,
        resolver: Resolver | None = None,
        tcp: bool = False,
        monitor: Monitor | None = None,
        peers: PeerRule | None = None,
        on_change: Callable[[EgressChanged], None] | None = None,
        on_request: Callable[[EgressRequest], None] | None = None,
        intercept: Callable[[str, int], TunnelHandler | None] | None = None,
    ) -> None:
        """`tcp`: the proxies also listen on loopback TCP, for a sandbox that shares the host's
        loopback (macOS); `monitor`: the backend's violation monitor, started and stopped with
        the proxies; `peers`: whom the Unix sockets serve (a native session: its own sandboxes,
        `SandboxPeers`; by default only this process, as a microVM's link); `advice`: how a
        refused host is allowed, when not by the session's egressAllowlist; `on_change`: told
        of each change to the allowlist (`change`), after it applies; `on_request`: told of each
        connection held for an answer (`ask`)."""
        self.session_id = session_id
        self.allowlist = allowlist
        self._on_change = on_change
        self._on_request = on_request
        self._ask_timeout_s: float | None = None
        # Told of each change and each request too, after on_change / on_request (a session's
        # egress stream on the API); one that raises is logged and the rest still run.
        self.watchers: list[Callable[[EgressChanged | EgressRequest], None]] = []
        self._pending: dict[str, tuple[EgressRequest, asyncio.Future[Answer]]] = {}
        self._suggest = suggest
        self._advice = advice or default_advice
        self._on_violation = on_violation
        self._intercept = intercept  # ProxyParams.intercept (a dispatch run's model broker)
        self._base_dir = base_dir
        self._resolver = resolver
        self._tcp = tcp
        self._monitor = monitor
        self._peers = peers if peers is not None else ThisProcess()
        self._dir: str | None = None
        self._proxies: SessionProxies | None = None
        self._closed = False

    @property
    def proxies(self) -> SessionProxies | None:
        """The running proxies, once started."""
        return self._proxies

    @property
    def entries(self) -> tuple[str, ...]:
        """The allowlist's entries now, canonical (`host`, `host:443`), in order."""
        return tuple(rule.entry for rule in self.allowlist.patterns)

    def change(self, change: EgressChange, *, by: str = "library") -> EgressChanged:
        """Remove, then add, allowlist entries (`egress.changes`); the next connection of the
        session is checked against the result, a tunnel already open goes on. A change that
        changes something is logged (one line) and reported through `on_change`; `by` says who
        asked. Works before the proxies start too (their first check sees it).

        Raises:
            InvalidPattern: an entry is malformed (named `allow[i]` or `remove[i]`).
            BadSpec: an entry is both added and removed, or is on the deny list.
            EnforcementFailed: the session is closed.
        """
        if self._closed:
            raise EnforcementFailed(f"the egress of session {self.session_id!r} is closed")
        applied = apply_change(self.allowlist, change)
        self.allowlist = applied.allowlist
        if self._proxies is not None:
            self._proxies.set_allowlist(applied.allowlist)
        event = EgressChanged(added=applied.added, removed=applied.removed, by=by)
        if applied.changed:
            log.info(
                "egress %s: allowlist changed by %s: added %s, removed %s",
                self.session_id,
                by,
                ", ".join(applied.added) or "nothing",
                ", ".join(applied.removed) or "nothing",
            )
            if self._on_change is not None:
                self._on_change(event)
            self._tell_watchers(event)
        return event

    def _tell_watchers(self, item: EgressChanged | EgressRequest) -> None:
        for watcher in list(self.watchers):
            try:
                watcher(item)
            except Exception:
                log.exception("egress %s: a watcher failed", self.session_id)

    def allow(self, *entries: str, by: str = "library") -> EgressChanged:
        """Add entries (`host`, `host:443`, ...) to the running session's allowlist; see
        `change`, which says what it raises."""
        return self.change(EgressChange(allow=entries), by=by)

    def remove(self, *entries: str, by: str = "library") -> EgressChanged:
        """Remove entries (by their canonical text) from the running session's allowlist; see
        `change`, which says what it raises."""
        return self.change(EgressChange(remove=entries), by=by)

    # Ask mode: the approval queue.

    def ask(self, timeout_s: float = ASK_TIMEOUT_S) -> None:
        """From now on hold a connection to a target the allowlist does not name, for at most
        `timeout_s`, and tell `on_request` (an `egress-request`); `answer` lets it through or
        refuses it. Deny-list targets, refused addresses and a session with the network off are
        refused as before, never asked about.

        Raises:
            BadSpec: `timeout_s` is not positive.
        """
        if not timeout_s > 0:
            raise BadSpec(f"an egress request's timeout must be positive, not {timeout_s!r}")
        self._ask_timeout_s = timeout_s
        if self._proxies is not None:
            self._proxies.set_asker(self._asked)

    def stop_asking(self) -> None:
        """Refuse unlisted targets again from now on; requests already waiting can still be
        answered until their time runs out."""
        self._ask_timeout_s = None
        if self._proxies is not None:
            self._proxies.set_asker(None)

    @property
    def asking(self) -> bool:
        """Whether unlisted targets are asked about (`ask`)."""
        return self._ask_timeout_s is not None

    @property
    def pending_requests(self) -> tuple[EgressRequest, ...]:
        """The requests waiting for an answer, oldest first."""
        return tuple(request for request, _ in self._pending.values())

    def answer(self, request_id: str, answer: Answer | str) -> EgressRequest:
        """Answer a pending request: `once`, `session` (adds its `host:port` entry, an
        `egress-changed` event) or `deny`. Every connection waiting on it gets the answer.

        Raises:
            BadSpec: no such request is pending (answered, timed out, or never asked), or the
                answer is not once, session or deny.
        """
        try:
            chosen = Answer(answer)
        except ValueError:
            raise BadSpec(
                f"{answer!r} is not an answer", fix="answer once, session or deny"
            ) from None
        pending = self._pending.get(request_id)
        if pending is None or pending[1].done():
            raise BadSpec(
                f"no egress request {request_id!r} is waiting in session {self.session_id!r}",
                fix="it was answered already, or its time ran out (a denial)",
            )
        request, future = pending
        if chosen is Answer.SESSION:
            self.allow(request.entry, by="approval")
        future.set_result(chosen)
        log.info("egress %s: request %s for %s answered %s", self.session_id, request_id,
                 request.entry, chosen)
        return request

    async def _asked(self, ask: EgressAsk) -> AskAnswer:
        """The proxies' asker: hold the connection until an answer or the timeout."""
        timeout_s = self._ask_timeout_s
        if timeout_s is None:  # ask mode was never on; the proxies were told otherwise
            return AskAnswer(allowed=False, reason=f"{ask.entry} is not on the allowlist")
        for held, waiting in self._pending.values():  # the same target asked already
            if held.entry == ask.entry and not waiting.done():
                return await self._wait(held, waiting, timeout_s)
        if len(self._pending) >= MAX_PENDING_REQUESTS:
            return AskAnswer(
                allowed=False,
                reason=f"{ask.entry}: {MAX_PENDING_REQUESTS} connections are waiting for an "
                "answer already",
            )
        request = EgressRequest(id=secrets.token_hex(6), host=ask.host, port=ask.port,
                                protocol=ask.protocol, entry=ask.entry, timeout_s=timeout_s)
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._pending[request.id] = (request, future)
        log.info("egress %s: request %s: %s held for an answer (%g s)", self.session_id,
                 request.id, request.entry, timeout_s)
        try:
            if self._on_request is not None:
                self._on_request(request)
            self._tell_watchers(request)
            return await self._wait(request, future, timeout_s)
        finally:
            self._pending.pop(request.id, None)
            if not future.done():  # its time ran out: so it has for every connection on it
                future.set_exception(TimeoutError())
                future.exception()  # retrieved: no "never retrieved" warning

    async def _wait(
        self, request: EgressRequest, future: asyncio.Future[Answer], timeout_s: float
    ) -> AskAnswer:
        try:
            async with asyncio.timeout(timeout_s):
                answer = await asyncio.shield(future)
        except TimeoutError:
            return AskAnswer(
                allowed=False,
                reason=f"{request.entry} was held for an answer and none came in {timeout_s:g} s",
            )
        if answer is Answer.DENY:
            return AskAnswer(allowed=False, reason=f"{request.entry} was refused when asked")
        return AskAnswer(allowed=True)

    def _refused(self, refusal: EgressRefused) -> None:
        self._on_violation(
            SandboxViolation(
                action="network-outbound",
                target=_host_port(refusal.host, refusal.port),
                suggested_capability=refusal.suggested_capability,
                raw=refusal.raw,
                reason=refusal.reason,
                fix=refusal.how_to_allow,
            )
        )

    async def start(self) -> EgressBridge:
        """Start the proxies if they are not running; return the bridge to plan with.

        Raises:
            EnforcementFailed: the session is closed, or the directory or proxies could not be
                set up (the command must not run).
        """
        if self._closed:
            raise EnforcementFailed(f"the egress of session {self.session_id!r} is closed")
        if self._proxies is None:
            directory = os.path.join(
                self._base_dir, f"egress-{os.getpid()}-{secrets.token_hex(8)}"
            )
            os.mkdir(directory, 0o700)
            proxies: SessionProxies | None = None
            try:
                proxies = await start_session_proxies(
                    ProxyParams(
                        session_id=self.session_id,
                        allowlist=self.allowlist,
                        on_refused=self._refused,
                        suggest=self._suggest,
                        advice=self._advice,
                        socket_dir=directory,
                        # On Linux the sandbox comes in through the sockets only.
                        listen_tcp=self._tcp,
                        resolver=self._resolver,
                        unix_peers=self._peers,
                        intercept=self._intercept,
                        ask=self._asked if self._ask_timeout_s is not None else None,
                    )
                )
                if self._monitor is not None:
                    await self._monitor.start()
            except BaseException:
                if proxies is not None:
                    await proxies.aclose()
                shutil.rmtree(directory, ignore_errors=True)
                raise
            # A change or `ask` while the monitor started went to self only: the proxies
            # take the session's state as it is now.
            proxies.set_allowlist(self.allowlist)
            proxies.set_asker(self._asked if self._ask_timeout_s is not None else None)
            self._proxies, self._dir = proxies, directory
        assert self._dir is not None and self._proxies is not None
        return EgressBridge(
            socket_dir=self._dir,
            base_dir=self._base_dir,
            hidden_dirs=self._hidden_dirs(),
            http_port=self._proxies.http_port,
            socks_port=self._proxies.socks_port,
        )

    def _hidden_dirs(self) -> tuple[str, ...]:
        """Every view of every base directory of this user, by device and inode
        (rundir.base_dir_views): the last ones this process found from the same inputs while
        every read they were found from gets the same answer from the host
        (backends/host_reads.py), else found again. Kept per process, not per session: every
        session of a server finds the same views, so a base coming or going is found once."""
        key = (self._base_dir, os.geteuid(), os.environ.get("TMPDIR"),
               os.environ.get("XDG_RUNTIME_DIR"),
               tempfile.gettempdir())  # what base_dir_views takes from the process
        found = _FOUND_VIEWS.get(key)
        if found is not None and found[0].hold():
            return found[1]
        for _ in range(2):  # a lookup that removed a gone base's entry read the registry before
            reads = HostReads()
            views = base_dir_views(self._base_dir, reader=reads)
            if reads.hold():
                break
        _FOUND_VIEWS.pop(key, None)
        if len(_FOUND_VIEWS) >= MAX_KEPT_VIEWS:
            del _FOUND_VIEWS[next(iter(_FOUND_VIEWS))]
        _FOUND_VIEWS[key] = (reads, views)
        return views

    async def adopt(self, http: socket.socket, socks: socket.socket) -> list[AdoptedListener]:
        """Serve a sandbox's own loopback listeners (handed over by its launcher) as this
        session's HTTP and SOCKS5 proxies, until each returned handle is closed. The sockets are
        ours from here on, closed on failure too.

        Raises:
            EnforcementFailed: the proxies are not running (the command must not run).
        """
        adopted: list[AdoptedListener] = []
        try:
            if self._proxies is None:
                raise EnforcementFailed(f"the egress of session {self.session_id!r} is not running")
            adopted.append(await self._proxies.adopt(http, "http", "sandbox loopback"))
            adopted.append(await self._proxies.adopt(socks, "socks5", "sandbox loopback"))
        except BaseException:
            http.close()
            socks.close()
            for listener in adopted:
                await listener.aclose()
            raise
        return adopted

    async def aclose(self) -> None:
        """Stop the proxies and remove the socket directory. Idempotent."""
        self._closed = True
        proxies, self._proxies = self._proxies, None
        try:
            if self._monitor is not None:
                await self._monitor.aclose()
            if proxies is not None:
                await proxies.aclose()
        finally:
            directory, self._dir = self._dir, None
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
