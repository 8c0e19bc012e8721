"""The user's CLI daemon: runs `cc-server run` for the thin client in `cli_client.py`.

    python -m cc_server.cli_daemon SOCKET_PATH

It probes once, listens on SOCKET_PATH (in the private runtime directory), and serves only a
peer of its own uid (SO_PEERCRED) in its own user and PID namespaces (backends/peer.py: a
sandboxed process has the daemon's uid whenever the daemon is not root, never its namespaces; a
refused peer is closed unread and logged to the daemon's stderr). It serves each client like
`cc-server run` in the client's own process would: the same argument parser, the spec built in
the client's working directory, the same environment passthrough (from the variables the
client sent), one sandbox per request destroyed afterwards, the command's stdio being the
client's own descriptors, violations and errors written to the client's stderr, the exit code
sent back. A forwarded signal ends the
command (SIGTERM first, then SIGKILL after a grace period); a client that goes away kills it.

A run's sandbox takes most of a run's time to start (bubblewrap, the session's proxies, the
write policy's supervisor), so after a native run that ended by itself the daemon starts a spare:
a sandbox of the same spec in a session of its own, no command run in it. The next request is
still parsed, checked and compiled in full; it takes the spare only when its spec is the spare's
and its compiled policy is the spare's (so the host has not changed what the spec means), and its
command runs there only when its plan is the spare sandbox's and the sandbox's mounts are as they
were (`SandboxHandle.session_sandbox`, as for any session's second command). Each sandbox serves
one command and is destroyed after it, as before. A spare nobody takes within `SPARE_KEEP_S` is
destroyed (its mounts would keep the binds' filesystems busy).

The socket is bound under a temporary name and hard-linked into place, so of two daemons started
at once exactly one serves; the other exits. The daemon exits after `IDLE_EXIT_S` with no client,
removing its socket (only if the name still points at its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import struct
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final

from cc_server.backends import peer
from cc_server.backends.fdpass import wait_readable
from cc_server.cli_socket import (
    CMSG_CLOEXEC,
    HEADER_BYTES,
    decode_message,
    message_size,
    send_message,
)
from cc_server.rundir import names_of_dead_owners
from cc_server.tasks import start_task

if TYPE_CHECKING:
    from cc_server.policy import CompiledPolicy, SandboxBackend, SandboxSpec
    from cc_server.runtime.handle import SandboxHandle

__all__ = ["main"]

IDLE_EXIT_S: Final = 300.0
MESSAGE_TIMEOUT_S: Final = 5.0  # the rest of a message, once its first byte is readable
SIGNAL_GRACE_S: Final = 2.0  # a forwarded signal: SIGTERM, then SIGKILL after this
SPARE_KEEP_S: Final = 30.0  # a spare sandbox nobody took is destroyed after this
_PEERCRED: Final = struct.Struct("3i")
_ANY_SESSION: Final = "spare"  # what a spare's spec and policy are compared under


@dataclass(frozen=True)
class _SpareOrder:
    """What a run's sandbox was made of: a spare made of the same serves the next such run."""

    spec: SandboxSpec
    backend: SandboxBackend | None
    deny_create: tuple[str, ...]
    key: tuple[object, ...] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        import msgspec

        spec = msgspec.structs.replace(self.spec, session_id=_ANY_SESSION)
        object.__setattr__(self, "key", (spec, self.backend, self.deny_create))


@dataclass
class _Spare:
    """A sandbox started for the next run like `order`'s, before that run asks."""

    order: _SpareOrder
    task: asyncio.Task[SandboxHandle | None]
    expires: float  # time.monotonic(): destroyed unused after this


def _log(message: str) -> None:
    print(f"cc-server daemon: {message}", file=sys.stderr)


def _session_id() -> str:
    return f"cli-{os.getpid()}-{os.urandom(4).hex()}"  # as cli_spec.build_spec names one


def _sessionless(handle: SandboxHandle) -> CompiledPolicy:
    return replace(handle.policy, session_id=_ANY_SESSION)


class _Daemon:
    def __init__(self, path: str, listener: socket.socket) -> None:
        from cc_server import cli
        from cc_server.backends.probe import probe
        from cc_server.policy import HostFacts
        from cc_server.runtime.port import SandboxManager

        self.path = path
        self.listener = listener
        self.identity = os.stat(path).st_ino
        self.peers = peer.SameNamespaces()
        self.manager = SandboxManager(probe_result=probe(), host=HostFacts.current())
        self.microvm_probing = asyncio.Lock()  # one probe at a time; an available one is kept
        self.parser = cli.parser()  # made once: parsing leaves it as it is
        self.spare: _Spare | None = None
        self.tasks: asyncio.TaskGroup | None = None
        self.active = 0
        self.stopping = False
        self.idle = asyncio.Event()
        self.idle.set()

    async def serve(self) -> None:
        """Serve until idle for IDLE_EXIT_S or stopped; the spare and every sandbox are torn
        down on the way out, cancelled (SIGINT) included."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.TaskGroup() as tg:
                self.tasks = tg
                accepting = tg.create_task(self._accept(loop, tg))
                while not self.stopping:
                    await self.idle.wait()
                    try:
                        async with asyncio.timeout(IDLE_EXIT_S):
                            while self.idle.is_set() and not self.stopping:
                                await asyncio.sleep(1)
                                self._expire_spare()
                    except TimeoutError:
                        break
                accepting.cancel()
        finally:
            self._unlink()
            self.tasks = None
            await self._drop_spare()
            await self.manager.aclose()

    def _unlink(self) -> None:
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self.identity:
                os.unlink(self.path)

    async def _accept(self, loop: asyncio.AbstractEventLoop, tg: asyncio.TaskGroup) -> None:
        self.listener.setblocking(False)
        while True:
            client, _ = await loop.sock_accept(self.listener)
            uid = _PEERCRED.unpack(
                client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )[1]
            if uid != os.geteuid():
                client.close()
                continue
            if not peer.admit(client, self.peers, what=f"CLI daemon {self.path}"):
                continue  # another user or PID namespace: a sandbox, never served
            self.active += 1
            self.idle.clear()
            tg.create_task(self._client(client))

    async def _client(self, client: socket.socket) -> None:
        fds: list[int] = []
        try:
            client.setblocking(False)
            # A client sends its request at once: one that sends nothing is dropped as well.
            request, fds = await _receive(client, max_fds=3, first_byte_s=MESSAGE_TIMEOUT_S)
            if request.get("stop"):
                self.stopping = True
                send_message(client, {"stopping": True})
                return
            if len(fds) != 3:
                return
            code, spare = await self._run(client, request, (fds[0], fds[1], fds[2]))
            try:
                client.settimeout(MESSAGE_TIMEOUT_S)
                send_message(client, {"exit": code})
            except OSError:
                spare = None  # the client is gone: nobody runs the next command
            if spare is not None:
                await self._replace_spare(spare)
        except (EOFError, ValueError, OSError):
            pass
        except Exception as exc:  # one client's request never ends the daemon and its other runs
            _log(f"a client's request failed: {type(exc).__name__}: {exc}")
        finally:
            for fd in fds:
                os.close(fd)
            client.close()
            self.active -= 1
            if self.active == 0:
                self.idle.set()

    async def _run(
        self, client: socket.socket, request: dict[str, Any], stdio: tuple[int, int, int]
    ) -> tuple[int, _SpareOrder | None]:
        """Run the request's command; its exit code, and what the next run's spare is made
        of (None when this run cannot have one)."""
        from cc_server import cli
        from cc_server.cli_violations import print_live
        from cc_server.errors import CcServerError
        from cc_server.policy import SandboxBackend

        err = os.fdopen(os.dup(stdio[2]), "w", buffering=1, closefd=True)
        with err:
            try:
                args, spec = _parse(request, err, self.parser)
            except SystemExit as exc:  # argparse's usage errors, already printed to `err`
                return (exc.code if isinstance(exc.code, int) else cli.EXIT_USAGE), None
            except CcServerError as exc:
                print(f"cc-server: {type(exc).__name__}: {exc}", file=err)
                return cli.exit_code_for(exc), None
            env = request.get("env")
            environ = env if isinstance(env, dict) else {}
            environ = {**environ, "PATH": os.environ.get("PATH", "")}  # keyed: the client's own
            requested = SandboxBackend(args.backend) if args.backend else None
            # A spare: the sandbox of a spec given whole by the options (a --spec file names
            # its own session), on the native backend.
            order = (
                _SpareOrder(spec, requested, tuple(args.deny_create))
                if args.spec is None and requested in (None, SandboxBackend.NATIVE)
                else None
            )
            handle = None
            try:
                if requested is SandboxBackend.MICROVM:
                    await self._probe_microvm(err)
                if order is not None:
                    handle = await self._take_spare(order)
                if handle is None:
                    handle = self.manager.launch(
                        spec, backend=requested, deny_create_globs=args.deny_create
                    )
                live = print_live(handle, err)  # each violation as it happens
                relay = requested is SandboxBackend.MICROVM  # the guest's stdio: relayed
                async with handle.open_exec(
                    cli.command_argv(args), env=cli.command_env(args, environ),
                    inherit_stdio=False if relay else stdio, interactive_stdin=relay,
                    timeout_s=args.timeout,
                ) as execution:
                    interrupted = asyncio.Event()  # by a forwarded signal, or the client gone
                    watcher = start_task(_watch_client(client, execution, interrupted),
                                         name="daemon client watch")
                    try:
                        if relay:
                            await cli.relay_stdio(execution, stdio)
                        code = await execution.wait()
                    finally:
                        watcher.cancel()
                        await asyncio.wait([watcher])
                live.rest(handle)
                return code, None if interrupted.is_set() else order
            except CcServerError as exc:
                print(f"cc-server: {type(exc).__name__}: {exc}", file=err)
                return cli.exit_code_for(exc), None
            finally:
                if handle is not None:
                    await self.manager.destroy(handle.session_id)

    async def _take_spare(self, order: _SpareOrder) -> SandboxHandle | None:
        """The spare made for this request's spec, when the policy that spec compiles to now is
        the spare's, session aside (the host has not changed what the spec means since the
        spare was made); else None, and the spare is destroyed. The spare's sandbox is the one
        its first command runs in only if the command's plan is still the sandbox's (every host
        fact and mount the same; `SandboxHandle.session_sandbox`), as for any session's second
        command.

        Raises:
            CcServerError: the spec does not compile now (what a launch would raise).
        """
        from cc_server.policy import SandboxBackend, compile_policy
        from cc_server.runtime.select import protected_patterns_for

        spare, self.spare = self.spare, None
        if spare is None:
            return None
        if spare.order.key != order.key:
            self._spawn(self._destroy(spare))
            return None
        prepared = await spare.task
        if prepared is None:
            return None
        try:
            # As the native adapter compiles it (a difference only means no spare).
            policy = compile_policy(
                order.spec, self.manager.host, deny_create_globs=order.deny_create,
                protected_patterns=protected_patterns_for(self.manager.probe_result),
            )  # fmt: skip
        except BaseException:
            await self.manager.destroy(prepared.session_id)
            raise
        same = replace(policy, session_id=_ANY_SESSION) == _sessionless(prepared)
        if prepared.backend is not SandboxBackend.NATIVE or not same:
            await self.manager.destroy(prepared.session_id)
            return None
        return prepared

    async def _replace_spare(self, order: _SpareOrder) -> None:
        """Start the spare for the next request like `order`'s (its own session, its sandbox
        and proxies running, no command run in it), in place of any other spare."""
        if self.stopping or self.tasks is None:
            return
        old, self.spare = self.spare, None
        if old is not None:
            self._spawn(self._destroy(old))
        self.spare = _Spare(order, self.tasks.create_task(self._prepare(order)),
                            time.monotonic() + SPARE_KEEP_S)

    async def _prepare(self, order: _SpareOrder) -> SandboxHandle | None:
        """The spare: None when it cannot be made or has no sandbox to start (the next run
        launches its own, and says why if that fails too)."""
        import msgspec

        from cc_server.backends.plan import Command

        spec = msgspec.structs.replace(order.spec, session_id=_session_id())
        try:
            handle = self.manager.launch(
                spec, backend=order.backend, deny_create_globs=order.deny_create
            )
        except Exception as exc:
            _log(f"no spare sandbox: {type(exc).__name__}: {exc}")
            return None
        try:
            started = False
            if handle.egress is not None:  # a session sandbox: started as its first exec would
                bridge = await handle.egress.start()
                plan = handle.plan(Command(argv=("/bin/true",), in_session_sandbox=True,
                                           egress=bridge))
                if plan.session is not None:
                    await handle.session_sandbox(plan)
                    started = True
        except BaseException as exc:
            await self.manager.destroy(handle.session_id)
            if not isinstance(exc, Exception):
                raise
            _log(f"no spare sandbox: {type(exc).__name__}: {exc}")
            return None
        if not started:
            await self.manager.destroy(handle.session_id)
            return None
        return handle

    def _expire_spare(self) -> None:
        """Destroy a spare nobody took in time: its mounts keep the binds' filesystems busy."""
        if self.spare is not None and time.monotonic() > self.spare.expires:
            spare, self.spare = self.spare, None
            self._spawn(self._destroy(spare))

    async def _destroy(self, spare: _Spare) -> None:
        handle = await spare.task
        if handle is not None:
            try:
                await self.manager.destroy(handle.session_id)
            except Exception as exc:  # a task of the daemon's group: it must not end the daemon
                _log(f"a spare sandbox's teardown failed: {type(exc).__name__}: {exc}")

    async def _drop_spare(self) -> None:
        spare, self.spare = self.spare, None
        if spare is not None and not spare.task.cancelled():  # cancelled: it tore itself down
            await self._destroy(spare)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        if self.tasks is not None:
            self.tasks.create_task(coro)
        else:
            coro.close()

    async def _probe_microvm(self, err: Any) -> None:
        """The microVM runtime, probed on the first `--backend microvm` (its image build's
        progress on that client's stderr) and kept, so later runs restore its snapshot at
        once. A runtime found unavailable is probed again next time (QEMU may be installed)."""
        from cc_server import cli

        async with self.microvm_probing:
            if self.manager.microvm is None or not self.manager.microvm.available:
                self.manager.use_microvm(await cli.probe_microvm_runtime(err))


def _parse(request: dict[str, Any], err: Any, parser: Any = None) -> tuple[Any, Any]:
    """Parse the client's arguments (a `run`'s: any other verb is a usage error) and build its
    spec in its working directory (relative `--bind`, `--spec`, `--workdir` paths are the
    client's). Synchronous: nothing else runs on
    the loop while the directory is changed."""
    from cc_server import cli

    argv, cwd = request.get("argv"), request.get("cwd")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError("argv is not a list of strings")
    if not isinstance(cwd, str) or not os.path.isabs(cwd):
        raise ValueError("cwd is not an absolute path")
    from cc_server.errors import BadSpec

    here = os.getcwd()
    try:
        os.chdir(cwd)
    except OSError as exc:
        raise BadSpec(
            f"the client's working directory {cwd!r} cannot be entered: {exc.strerror}",
            fix="run cc-server from a directory that exists",
        ) from None
    saved = sys.stdout, sys.stderr
    try:
        sys.stdout = sys.stderr = err  # argparse prints its usage errors here
        # The settings files too: HOME and XDG_CONFIG_HOME are keyed.
        args = cli.parse_args(argv, parser)
        if args.verb != "run":  # the clients send only `run`; no other verb is served here
            print(f"cc-server: the CLI daemon serves `run` only, not `{args.verb}`", file=err)
            raise SystemExit(cli.EXIT_USAGE)
        return args, cli.build_spec(args)
    finally:
        sys.stdout, sys.stderr = saved
        os.chdir(here)


async def _receive(
    client: socket.socket, max_fds: int = 0, first_byte_s: float | None = None
) -> tuple[dict[str, Any], list[int]]:
    """One message from the non-blocking `client` (and up to `max_fds` descriptors sent with
    it), read with the loop: a client that stalls mid-message holds up only itself, and is
    dropped (TimeoutError) when the rest has not come `MESSAGE_TIMEOUT_S` after its first byte
    (or its first byte not within `first_byte_s`, when given). Raises as
    `cli_socket.receive_message`; the descriptors are closed whenever it raises."""
    fds: list[int] = []
    try:
        async with asyncio.timeout(first_byte_s):
            await wait_readable(client)
        async with asyncio.timeout(MESSAGE_TIMEOUT_S):
            header = await _read(client, HEADER_BYTES, fds, max_fds)
            body = await _read(client, message_size(header), fds, 0)
        return decode_message(body), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


async def _read(client: socket.socket, size: int, fds: list[int], max_fds: int) -> bytes:
    """`size` bytes, the descriptors on the first of them (up to `max_fds`) added to `fds`."""
    data = b""
    while len(data) < size:
        try:
            if max_fds and not data:
                chunk, got, _flags, _addr = socket.recv_fds(client, size, max_fds, CMSG_CLOEXEC)
                fds.extend(got)
            else:
                chunk = client.recv(size - len(data))
        except BlockingIOError:
            await wait_readable(client)
            continue
        if not chunk:
            raise EOFError
        data += chunk
    return data


async def _watch_client(
    client: socket.socket, execution: Any, interrupted: asyncio.Event
) -> None:
    """A forwarded signal ends the command gracefully; the client going away, or a message that
    is not ours (a signal number that names no signal included), kills it. Either sets
    `interrupted`."""
    while True:
        try:
            message, _ = await _receive(client)
        except (EOFError, ValueError, OSError):
            interrupted.set()
            await execution.kill(reason="client gone")
            return
        if "signal" in message:
            interrupted.set()
            number = _signal(message["signal"])
            if number is None:  # not a signal: a message not ours, as a garbage frame is
                await execution.kill(reason="client gone")
                return
            await execution.terminate(SIGNAL_GRACE_S, reason=number.name)


def _signal(number: object) -> signal.Signals | None:
    """The signal a client forwarded; None when `number` names none."""
    if not isinstance(number, int) or isinstance(number, bool):
        return None
    try:
        return signal.Signals(number)
    except ValueError:
        return None


_TEMPORARY: Final = re.compile(r"^cli-[0-9a-f]+\.sock\.(?P<pid>\d+)\.tmp\Z")


def _remove_stale_temporaries(directory: str) -> None:
    """A daemon killed between binding its temporary name and removing it left that name: remove
    the ones whose daemon is gone (only names of this form)."""
    for name in names_of_dead_owners(directory, _TEMPORARY):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


def _listen(path: str) -> socket.socket | None:
    """Bind under a temporary name, then hard-link into place: None if another daemon won."""
    _remove_stale_temporaries(os.path.dirname(path))
    temporary = f"{path}.{os.getpid()}.tmp"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old_umask = os.umask(0o177)
        try:
            sock.bind(temporary)
        finally:
            os.umask(old_umask)
        try:
            sock.listen(64)
            for _ in range(2):
                try:
                    os.link(temporary, path)
                    return sock
                except FileExistsError:
                    if _answers(path):
                        break  # a live daemon serves this path
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)  # a dead daemon's socket
        finally:
            os.unlink(temporary)
    except BaseException:
        sock.close()
        raise
    sock.close()
    return None


def _answers(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not os.path.isabs(args[0]):
        print("usage: python -m cc_server.cli_daemon SOCKET_PATH", file=sys.stderr)
        return 2
    if not peer.supported():
        # Without SO_PEERPIDFD a peer's namespaces cannot be read race-free: serve nobody (the
        # client checks the same and runs in its own process).
        print("cc-server daemon: this kernel cannot identify a peer (SO_PEERPIDFD)",
              file=sys.stderr)
        return 0
    listener = _listen(args[0])
    if listener is None:
        return 0
    # Its own dispositions, not those of whichever shell started the first client (a
    # background job's SIGINT is ignored): a hang-up is ignored, SIGINT ends it (torn down),
    # SIGTERM at once.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with listener:
        asyncio.run(_serve(args[0], listener))
    return 0


async def _serve(path: str, listener: socket.socket) -> None:
    await _Daemon(path, listener).serve()


if __name__ == "__main__":
    sys.exit(main())
