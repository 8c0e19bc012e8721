"""A bind's source swapped for a symlink after its policy was made (by a second sandbox whose
bind holds it, or by the host) must not bind where the symlink leads: the secrets there (the
server user's own ~/.ssh) were never chosen for masking. A server that is not root binds each
spec bind by an fd the runner opens with no symlink on the way (`--bind-fd`); a root server's
identity helper opens each root the same way. Judged on what the command could read.
"""

from __future__ import annotations

import pathlib
import subprocess
import textwrap

import pytest
from other_user import OtherUser

pytestmark = [pytest.mark.security, pytest.mark.integration]

SESSION = textwrap.dedent(
    """
    import asyncio, os, sys
    from cc_server.backends.probe import probe
    from cc_server.errors import EnforcementFailed
    from cc_server.policy import HostFacts, parse_spec
    from cc_server.runtime.handle import run_collect
    from cc_server.runtime.port import SandboxManager

    side, secret = sys.argv[1], sys.argv[2]

    async def main():
        manager = SandboxManager(probe_result=probe(), host=HostFacts.current())
        spec = {"sessionId": "swap", "workspaceId": "w", "bindMounts": [{"hostPath": side}]}
        handle = manager.launch(parse_spec(spec))
        try:
            for _ in range(2):
                first = await run_collect(handle, ["/bin/true"], timeout_s=60)
                assert first.exit_code == 0, first
            os.rename(side, side + ".old")
            os.symlink(os.path.expanduser("~"), side)
            try:
                got = await run_collect(handle, ["/bin/cat", secret], timeout_s=60)
                print("READ", got.exit_code, got.stdout.decode(errors="replace"))
            except EnforcementFailed as exc:
                print("REFUSED", exc)
        finally:
            await manager.aclose()

    asyncio.run(main())
    """
)


def test_a_bind_source_swapped_for_a_symlink_after_the_policy_binds_nothing_else(
    other_user: OtherUser, user_dir: pathlib.Path
) -> None:
    marker = "CC-SWAPPED-BIND-SECRET"
    ssh = other_user.home / ".ssh"
    subprocess.run(["install", "-d", "-m", "700", "-o", str(other_user.uid), "-g",
                    str(other_user.gid), str(ssh)], check=True)  # fmt: skip
    key = ssh / "id_swap_test"
    key.write_text(f"{marker}\n")
    try:
        os_chown(key, other_user)
        side = user_dir / "side"
        side.mkdir()
        os_chown(side, other_user)
        script = user_dir / "session.py"
        script.write_text(SESSION)
        done = other_user.run(
            other_user.python(str(script), str(side), f"{side}/.ssh/id_swap_test")[
                len(other_user.argv()) :
            ],
            cwd=user_dir,
        )
        out = done.stdout + done.stderr
        assert marker not in out, out
        assert "REFUSED" in done.stdout and "symlink" in done.stdout, out
    finally:
        key.unlink()


def os_chown(path: pathlib.Path, user: OtherUser) -> None:
    import os

    os.chown(path, user.uid, user.gid)
