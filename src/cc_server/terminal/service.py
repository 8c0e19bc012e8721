"""TerminalSessionService: opens server-hosted terminal sessions and owns them until closed.

Its `default_backend` is `none`, as the reference page says, and the server does not override it:
a terminal runs the host shell unless the client explicitly asks for `native` or `microvm`. A
`native` session is wrapped through the SandboxManager under the fixed terminal profile; a
`microvm` session runs the guest's shell on the guest's PTY, with the profile's binds shared
into the VM. If this host cannot provide the backend asked for, opening fails
(BackendUnavailable) and no shell starts: never a host shell under a native or microvm badge.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Mapping
from typing import Final

from cc_server.policy import SandboxBackend
from cc_server.runtime.handle import SandboxHandle
from cc_server.runtime.port import SandboxManager
from cc_server.terminal.profile import terminal_policy
from cc_server.terminal.session import TerminalSession, open_terminal_session

__all__ = ["DEFAULT_WINDOW", "TerminalSessionService", "host_shell"]

DEFAULT_WINDOW: Final = (24, 80)  # rows, cols until the client resizes
TERM: Final = "xterm-256color"
# What a `native` shell gets from the server's environment; everything else is left behind.
NATIVE_PASSTHROUGH_ENV: Final = ("LANG", "LANGUAGE", "TZ", "USER", "LOGNAME", "COLORTERM")
# Set in a `none` shell's environment: how closing the session finds what it started that left
# the shell's session and process tree (terminal.session._kill_session_tree).
TERMINAL_ENV: Final = "CC_SERVER_TERMINAL_SESSION"
# Server settings a `none` shell does not need to see.
_SERVER_ENV_PREFIX: Final = "CC_SERVER_"


def host_shell(exists: Callable[[str], bool] = os.path.exists) -> str:
    """`/bin/bash` when present, else `/bin/sh`."""
    return "/bin/bash" if exists("/bin/bash") else "/bin/sh"


class TerminalSessionService:
    """Opens terminal sessions and closes every one still open in `aclose()`."""

    def __init__(
        self,
        manager: SandboxManager,
        *,
        default_backend: SandboxBackend = SandboxBackend.NONE,
        environ: Mapping[str, str] = os.environ,
        server_private: tuple[str, ...] = (),
    ) -> None:
        self.manager = manager
        self.default_backend = default_backend
        self.server_private = server_private  # hidden from native shells (terminal_policy)
        self._environ = dict(environ)
        self.sessions: dict[str, TerminalSession] = {}

    def _env(self, backend: SandboxBackend, shell: str) -> dict[str, str]:
        home = self.manager.host.home
        if backend is SandboxBackend.NONE:  # the host shell: the server user's environment
            env = {k: v for k, v in self._environ.items() if not k.startswith(_SERVER_ENV_PREFIX)}
        else:
            env = {k: self._environ[k] for k in NATIVE_PASSTHROUGH_ENV if k in self._environ}
            env.update({k: v for k, v in self._environ.items() if k.startswith("LC_")})
        env.update({"TERM": TERM, "HOME": home, "SHELL": shell})
        return env

    async def open(
        self,
        *,
        backend: SandboxBackend | None = None,
        cwd: str | None = None,
        rows: int = DEFAULT_WINDOW[0],
        cols: int = DEFAULT_WINDOW[1],
    ) -> TerminalSession:
        """Start a shell in `cwd` (default `$HOME`) on a new PTY; `backend=None` means the
        service's default (`none`).

        Raises:
            BadSpec: `cwd` is not an absolute path to a directory, or the window size is bad.
            BackendUnavailable: `native` (or `microvm`) cannot run here; no shell was started.
            EnforcementFailed: the PTY or the shell could not be started.
        """
        chosen = self.default_backend if backend is None else backend
        session_id = f"terminal-{secrets.token_hex(8)}"
        policy = terminal_policy(
            session_id,
            cwd or self.manager.host.home,
            self.manager.host,
            server_private=self.server_private,
        )
        handle = self.manager.launch_terminal(policy, backend=chosen)
        if handle.backend is SandboxBackend.MICROVM:
            return await self._open_in_vm(handle, session_id, policy.workdir, rows, cols)
        shell = host_shell()
        env = self._env(handle.backend, shell)
        marker = None
        if handle.backend is SandboxBackend.NONE:  # native: the PID namespace holds everything
            marker = f"{TERMINAL_ENV}={session_id}"
            env[TERMINAL_ENV] = session_id
        assert policy.workdir is not None
        try:
            session = await open_terminal_session(
                handle,
                argv=(shell,),
                env=env,
                cwd=policy.workdir,
                rows=rows,
                cols=cols,
                env_marker=marker,
            )
        except BaseException:
            await handle.destroy()
            raise
        self.sessions[session_id] = session
        return session

    async def _open_in_vm(
        self, handle: SandboxHandle, session_id: str, cwd: str | None, rows: int, cols: int
    ) -> TerminalSession:
        """The shell in the guest, on the guest's PTY (cc_server.terminal.vm_session)."""
        # Lazy imports: a server that never opens a VM terminal never loads the microVM modules.
        from cc_server.microvm.handle import MicroVMHandle
        from cc_server.terminal.vm_session import GUEST_SHELL, open_vm_terminal

        try:
            assert isinstance(handle, MicroVMHandle) and cwd is not None
            await handle.ready()
            session = await open_vm_terminal(
                handle, env=self._env(handle.backend, GUEST_SHELL), cwd=cwd, rows=rows, cols=cols
            )
        except BaseException:
            await handle.destroy()
            raise
        self.sessions[session_id] = session  # type: ignore[assignment]
        return session  # type: ignore[return-value]

    async def close(self, session_id: str) -> None:
        """End one session and everything it started; unknown ids are fine."""
        session = self.sessions.pop(session_id, None)
        if session is not None:
            await session.aclose()

    async def aclose(self) -> None:
        """End every open session. Idempotent."""
        for session_id in list(self.sessions):
            await self.close(session_id)
