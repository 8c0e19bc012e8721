"""What the server's handlers share: the manager, the terminal service, the running commands."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web

from cc_server.runtime.handle import Execution
from cc_server.runtime.output import DEFAULT_COLLECT_LIMIT_BYTES
from cc_server.runtime.port import SandboxManager
from cc_server.terminal import TerminalSessionService

__all__ = ["STATE", "ServerState"]


@dataclass(eq=False)
class ServerState:
    """Owned by the app; closed by the server's shutdown."""

    manager: SandboxManager
    terminals: TerminalSessionService
    token_path: str  # a native sandbox must never see it (see api.create_sandbox)
    running: dict[str, set[Execution]] = field(default_factory=dict)  # by sandbox id
    exec_output_limit_bytes: int = DEFAULT_COLLECT_LIMIT_BYTES  # per stream, POST .../exec
    shutting_down: bool = False

    def track(self, session_id: str, execution: Execution) -> None:
        """Remember a running command (for kill and shutdown)."""
        self.running.setdefault(session_id, set()).add(execution)

    def untrack(self, session_id: str, execution: Execution) -> None:
        """Forget a finished command."""
        executions = self.running.get(session_id)
        if executions is not None:
            executions.discard(execution)
            if not executions:
                del self.running[session_id]

    def all_running(self) -> list[Execution]:
        """Every command still running, in any sandbox."""
        return [ex for executions in self.running.values() for ex in executions]

    @property
    def token_real_path(self) -> str:
        """The token file's symlink-resolved path."""
        return os.path.realpath(self.token_path)


STATE: Final = web.AppKey("cc_server_state", ServerState)
