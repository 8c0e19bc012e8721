"""A directory moved out of a sandbox's bind by a second sandbox (whose bind holds the first
one's) while the first holds it as its cwd or a dirfd: still writable through the first one's
mount, its kernel-named path is then not a path of the first sandbox's view (it names it from its
filesystem's root), and judged by that string nothing in it would be protected. The supervisor
checks every judged path against the task's own root; a directory that is not where its path
says is refused in, whatever the name. Real bubblewrap, two sandboxes on nested binds, the host
checked afterwards.
"""

from __future__ import annotations

import asyncio
import pathlib

import pytest
from escape_kit import Sandboxes, output

pytestmark = [pytest.mark.security, pytest.mark.integration]

PROTECTED = (".mcp.json", "sub/.mcp.json", "sub/.bashrc", "sub/.claude/settings.json")


def _first(w: pathlib.Path, start: str) -> str:
    # Waits in w/x (as its cwd, or holding a dirfd of it) until the second sandbox has moved it.
    opener = {
        "cwd": "os.chdir('x'); at = None",
        "dirfd": "at = os.open('x', os.O_RDONLY | os.O_DIRECTORY)",
    }[start]
    return (
        "import os, time\n"
        f"os.chdir({str(w)!r})\n{opener}\n"
        f"while not os.path.exists({str(w / 'go')!r}):\n    time.sleep(0.02)\n"
        "for rel in ('sub/.claude',):\n"
        "    try:\n        os.mkdir(rel, dir_fd=at); print('MADE', rel)\n"
        "    except OSError as e:\n        print('REFUSED', rel, e.errno)\n"
        f"for rel in {PROTECTED!r}:\n"
        "    try:\n"
        "        os.close(os.open(rel, os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=at))\n"
        "        print('MADE', rel)\n"
        "    except OSError as e:\n        print('REFUSED', rel, e.errno)\n"
    )


@pytest.mark.parametrize("start", ["cwd", "dirfd"])
async def test_a_cwd_moved_out_of_the_bind_by_a_second_sandbox_makes_no_protected_file(
    sb: Sandboxes, tmp_path: pathlib.Path, start: str
) -> None:
    outer = sb.worktree
    w = outer / "w"
    (w / "x" / "sub").mkdir(parents=True)
    script = tmp_path / "first.py"
    script.write_text(_first(w, start))
    kit = {"hostPath": str(tmp_path), "readOnly": True}
    first = sb.launch(bindMounts=[{"hostPath": str(w)}, kit])
    second = sb.launch(bindMounts=[{"hostPath": str(outer)}])
    waiting = asyncio.ensure_future(sb.sh(first, f"/usr/bin/python3 {script} 2>&1"))
    await asyncio.sleep(1.0)  # the first sandbox is in w/x
    moved = await sb.sh(second, f"mv {w}/x {outer}/x && touch {w}/go && echo MOVED")
    assert "MOVED" in output(moved), output(moved)
    out = output(await asyncio.wait_for(waiting, 60))
    assert "MADE" not in out, out
    assert out.count("REFUSED") == len(PROTECTED) + 1, out
    for rel in PROTECTED:
        assert not (outer / "x" / rel).exists(), out
    assert not (outer / "x" / "sub" / ".claude").exists(), out
    assert first.violations, out  # each refusal is reported
