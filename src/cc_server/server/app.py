"""`cc-server serve`: boot, serve, and shut down.

Boot, in order: clean what a killed server left (stale egress directories), probe the host once
and log the one sandbox startup line, write the bearer token, bind, log the `listening` line (with
the bound port, so `--port 0` is usable). SIGTERM or SIGINT then shuts down gracefully: new work is
refused (503), running commands get SIGTERM and, after a grace period, SIGKILL; terminal sessions
and sandboxes are destroyed; proxies closed; open sockets closed; the token file removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import ssl
import time
from typing import Final

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from cc_server import __version__
from cc_server.backends.probe import boot_probe, startup_line
from cc_server.errors import CcServerError, ConfigError
from cc_server.policy import HostFacts, SandboxBackend
from cc_server.rundir import forget_server_token, record_server_token
from cc_server.runtime.egress import (
    egress_base_dir,
    kill_stale_sandboxes,
    remove_stale_session_dirs,
)
from cc_server.runtime.port import SandboxManager
from cc_server.server.api import routes as api_routes
from cc_server.server.auth import (
    bearer_auth,
    default_token_path,
    generate_token,
    remove_token_file,
    write_token_file,
)
from cc_server.server.config import ServerConfig, ServerConfigError
from cc_server.server.dispatch_api import install_dispatch
from cc_server.server.exec_api import routes as exec_routes
from cc_server.server.logs import configure_logging, log_event
from cc_server.server.openapi import openapi_document
from cc_server.server.state import STATE, ServerState
from cc_server.server.status import answer_errors
from cc_server.server.terminal_ws import routes as terminal_routes
from cc_server.terminal import TerminalSessionService

__all__ = ["EXIT_CONFIG", "SHUTDOWN_GRACE_S", "build_app", "run_server", "serve"]

SHUTDOWN_GRACE_S: Final = 5.0  # between SIGTERM and SIGKILL for commands still running
SOCKET_CLOSE_TIMEOUT_S: Final = 5.0  # open connections get this long to finish at shutdown
EXIT_CONFIG: Final = 2  # bad options or environment: nothing started
EXIT_FAILED: Final = 1  # could not start (port taken, private directory not private, ...)


class _AccessLogger(AbstractAccessLogger):
    """One `request` line per request. The path is logged without its query string, which may
    carry a WebSocket client's token."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        log_event("request", f"{request.method} {request.path} {response.status}",
                  method=request.method, path=request.path, status=response.status,
                  ms=round(time * 1000, 1))

    @property
    def enabled(self) -> bool:
        return True


async def _healthz(_request: web.Request) -> web.StreamResponse:
    # Liveness only: no sandbox field, no probe (the probe ran once, at boot).
    return web.json_response({"status": "ok"})


async def _openapi(_request: web.Request) -> web.StreamResponse:
    return web.json_response(openapi_document())


def build_app(state: ServerState, token: str) -> web.Application:
    """The aiohttp application: auth first, then the routes."""
    app = web.Application(middlewares=[bearer_auth(token), answer_errors])
    app[STATE] = state
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_routes(api_routes)
    app.router.add_routes(exec_routes)
    app.router.add_routes(terminal_routes)
    return app


def _ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    if config.tls_cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ServerConfigError(f"cannot load the TLS certificate or key: {exc}") from exc
    return context


async def _shutdown(state: ServerState, runner: web.AppRunner) -> None:
    state.shutting_down = True
    running = state.all_running()
    log_event("shutdown", "shutting down", commands=len(running),
              terminals=len(state.terminals.sessions), sandboxes=len(state.manager.handles),
              graceS=SHUTDOWN_GRACE_S)
    # Commands first, all at once: SIGTERM, the grace period, then SIGKILL.
    async with asyncio.TaskGroup() as tg:
        for execution in running:
            tg.create_task(execution.terminate(SHUTDOWN_GRACE_S, reason="shutdown"),
                           name=f"terminate {execution.exec_id}")
    await state.terminals.aclose()
    await state.manager.aclose()  # every sandbox destroyed, every session's proxies closed
    await runner.cleanup()  # remaining sockets closed, then the listener


async def serve(config: ServerConfig, *, ready: asyncio.Event | None = None) -> int:
    """Run the server until SIGTERM or SIGINT; return the process exit code.

    Raises:
        ServerConfigError: the TLS files cannot be loaded or the token file cannot be written.
        EnforcementFailed: the private directory exists but is not private to this user.
    """
    base = egress_base_dir()
    removed = remove_stale_session_dirs(base)
    killed = kill_stale_sandboxes(base, removed)
    if removed:
        log_event("cleanup", f"removed {len(removed)} stale egress directories of killed servers"
                  f" and killed {len(killed)} sandbox processes that outlived them",
                  removed=removed, killed=killed)
    result = boot_probe()  # the only probe of this process
    log_event("sandbox", startup_line(result, config.sandbox_on),
              available=result.available, sandbox=config.sandbox_on)
    ssl_context = _ssl_context(config)
    token = generate_token()
    token_path = config.token_file or default_token_path()
    write_token_file(token_path, token)
    token_record = record_server_token(base, token_path)  # `cc-server run` refuses to bind it
    log_event("token", f"bearer token written to {token_path}", path=token_path)

    microvm = None
    if config.microvm != "off":  # the microVM runtime's own probe (first use builds its image)
        from cc_server.microvm.runtime import probe_runtime

        microvm = await probe_runtime()
        log_event("microvm", f"microVM {'available' if microvm.available else 'unavailable'}: "
                  f"{microvm.probe.reason}", microvm=microvm.probe.to_json())
    manager = SandboxManager(
        probe_result=result, host=HostFacts.current(), sandbox_on=config.sandbox_on,
        microvm=microvm,
        default_backend=SandboxBackend.MICROVM if config.microvm == "default" else None,
    )
    terminals = TerminalSessionService(manager, server_private=(token_path, base))
    state = ServerState(manager=manager, terminals=terminals, token_path=token_path,
                        exec_output_limit_bytes=config.exec_output_limit_bytes)
    app = build_app(state, token)
    try:  # repos, worktrees and dispatch runs (server/dispatch_api.py)
        install_dispatch(app, manager, server_private=(token_path, base),
                         allow_domains=config.dispatch_allow_domains)
    except BaseException:
        remove_token_file(token_path, token)
        forget_server_token(token_record)
        raise
    runner = web.AppRunner(
        app,
        access_log_class=_AccessLogger,
        handler_cancellation=True,  # a client that goes away cancels (and kills) its command
        shutdown_timeout=SOCKET_CLOSE_TIMEOUT_S,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port, ssl_context=ssl_context)
        try:
            await site.start()
        except OSError as exc:
            log_event("error", f"cannot listen on {config.host}:{config.port}: {exc.strerror}",
                      level=logging.ERROR)
            return EXIT_FAILED
        # What start-up made (modules, the app, the manager) lives as long as the server: kept
        # out of the collector's full passes, which walked it every few hundred commands.
        gc.collect()
        gc.freeze()
        port = runner.addresses[0][1]
        scheme = "https" if config.tls else "http"
        host = f"[{config.host}]" if ":" in config.host else config.host
        log_event("listening", f"cc-server {__version__} listening on {scheme}://{host}:{port}",
                  url=f"{scheme}://{host}:{port}", port=port, pid=os.getpid())
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        if ready is not None:
            ready.set()
        await stop.wait()
        started = time.monotonic()
        await _shutdown(state, runner)
        log_event("stopped", "cc-server stopped",
                  ms=round((time.monotonic() - started) * 1000, 1))
        return 0
    finally:
        state.shutting_down = True
        with contextlib.suppress(Exception):
            await terminals.aclose()
        with contextlib.suppress(Exception):
            await manager.aclose()
        await runner.cleanup()
        remove_token_file(token_path, token)
        forget_server_token(token_record)


def run_server(config: ServerConfig) -> int:
    """Configure logging and run `serve` in a new event loop; the process exit code."""
    configure_logging(as_json=config.log_json)
    try:
        return asyncio.run(serve(config))
    except ConfigError as exc:  # ServerConfigError, or the dispatch configuration's
        log_event("error", str(exc), level=logging.ERROR)
        return EXIT_CONFIG
    except CcServerError as exc:
        log_event("error", f"{type(exc).__name__}: {exc}", level=logging.ERROR)
        return EXIT_FAILED
