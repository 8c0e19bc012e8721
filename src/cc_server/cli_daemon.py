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
from typing import Any, Final

from cc_server.backends import peer
from cc_server.backends.fdpass import wait_readable
from cc_server.cli_socket import receive_message, send_message
from cc_server.rundir import names_of_dead_owners

__all__ = ["main"]

IDLE_EXIT_S: Final = 300.0
MESSAGE_TIMEOUT_S: Final = 5.0  # the rest of a message, once its first byte is readable
SIGNAL_GRACE_S: Final = 2.0  # a forwarded signal: SIGTERM, then SIGKILL after this
_PEERCRED: Final = struct.Struct("3i")


class _Daemon:
    def __init__(self, path: str, listener: socket.socket) -> None:
        from cc_server.backends.probe import probe
        from cc_server.policy import HostFacts
        from cc_server.runtime.port import SandboxManager

        self.path = path
        self.listener = listener
        self.identity = os.stat(path).st_ino
        self.peers = peer.SameNamespaces()
        self.manager = SandboxManager(probe_result=probe(), host=HostFacts.current())
        self.microvm_probing = asyncio.Lock()  # one probe at a time; an available one is kept
        self.active = 0
        self.stopping = False
        self.idle = asyncio.Event()
        self.idle.set()

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
            accepting = tg.create_task(self._accept(loop, tg))
            while not self.stopping:
                await self.idle.wait()
                try:
                    async with asyncio.timeout(IDLE_EXIT_S):
                        while self.idle.is_set() and not self.stopping:
                            await asyncio.sleep(1)
                except TimeoutError:
                    break
            accepting.cancel()
        self._unlink()
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
            await wait_readable(client)
            client.settimeout(MESSAGE_TIMEOUT_S)  # a client that stalls mid-message is dropped
            request, fds = receive_message(client, max_fds=3)
            client.setblocking(False)
            if request.get("stop"):
                self.stopping = True
                send_message(client, {"stopping": True})
                return
            if len(fds) != 3:
                return
            code = await self._run(client, request, (fds[0], fds[1], fds[2]))
            with contextlib.suppress(OSError):
                client.settimeout(MESSAGE_TIMEOUT_S)
                send_message(client, {"exit": code})
        except (EOFError, ValueError, OSError):
            pass
        finally:
            for fd in fds:
                os.close(fd)
            client.close()
            self.active -= 1
            if self.active == 0:
                self.idle.set()

    async def _run(
        self, client: socket.socket, request: dict[str, Any], stdio: tuple[int, int, int]
    ) -> int:
        from cc_server import cli
        from cc_server.cli_violations import print_live
        from cc_server.errors import CcServerError
        from cc_server.policy import SandboxBackend

        err = os.fdopen(os.dup(stdio[2]), "w", buffering=1, closefd=True)
        with err:
            try:
                args, spec = _parse(request, err)
            except SystemExit as exc:  # argparse's usage errors, already printed to `err`
                return exc.code if isinstance(exc.code, int) else cli.EXIT_USAGE
            except CcServerError as exc:
                print(f"cc-server: {type(exc).__name__}: {exc}", file=err)
                return cli.exit_code_for(exc)
            env = request.get("env")
            environ = env if isinstance(env, dict) else {}
            environ = {**environ, "PATH": os.environ.get("PATH", "")}  # keyed: the client's own
            requested = SandboxBackend(args.backend) if args.backend else None
            handle = None
            try:
                if requested is SandboxBackend.MICROVM:
                    await self._probe_microvm(err)
                handle = self.manager.launch(
                    spec, backend=requested, deny_create_globs=args.deny_create
                )
                live = print_live(handle, err)  # each violation as it happens
                relay = requested is SandboxBackend.MICROVM  # the guest's stdio: relayed
                execution = handle.exec(
                    cli.command_argv(args), env=cli.command_env(args, environ),
                    inherit_stdio=False if relay else stdio, interactive_stdin=relay,
                    timeout_s=args.timeout,
                )
                async with execution:
                    watcher = asyncio.create_task(_watch_client(client, execution))
                    try:
                        if relay:
                            await cli.relay_stdio(execution, stdio)
                        code = await execution.wait()
                    finally:
                        watcher.cancel()
                        await asyncio.wait([watcher])
                live.rest(handle)
                return code
            except CcServerError as exc:
                print(f"cc-server: {type(exc).__name__}: {exc}", file=err)
                return cli.exit_code_for(exc)
            finally:
                if handle is not None:
                    await self.manager.destroy(handle.session_id)

    async def _probe_microvm(self, err: Any) -> None:
        """The microVM runtime, probed on the first `--backend microvm` (its image build's
        progress on that client's stderr) and kept, so later runs restore its snapshot at
        once. A runtime found unavailable is probed again next time (QEMU may be installed)."""
        from cc_server import cli

        async with self.microvm_probing:
            if self.manager.microvm is None or not self.manager.microvm.available:
                self.manager.use_microvm(await cli.probe_microvm_runtime(err))


def _parse(request: dict[str, Any], err: Any) -> tuple[Any, Any]:
    """Parse the client's arguments and build its spec in its working directory (relative
    `--bind`, `--spec`, `--workdir` paths are the client's). Synchronous: nothing else runs on
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
        args = cli.parse_args(argv)  # the settings files too: HOME and XDG_CONFIG_HOME are keyed
        return args, cli.build_spec(args)
    finally:
        sys.stdout, sys.stderr = saved
        os.chdir(here)


async def _watch_client(client: socket.socket, execution: Any) -> None:
    """A forwarded signal ends the command gracefully; the client going away kills it."""
    while True:
        await wait_readable(client)
        try:
            client.settimeout(MESSAGE_TIMEOUT_S)
            message, _ = receive_message(client)
        except (EOFError, ValueError, OSError):
            await execution.kill(reason="client gone")
            return
        finally:
            client.setblocking(False)
        if isinstance(message.get("signal"), int):
            name = signal.Signals(message["signal"]).name
            await execution.terminate(SIGNAL_GRACE_S, reason=name)


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
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with listener:
        asyncio.run(_serve(args[0], listener))
    return 0


async def _serve(path: str, listener: socket.socket) -> None:
    await _Daemon(path, listener).serve()


if __name__ == "__main__":
    sys.exit(main())
