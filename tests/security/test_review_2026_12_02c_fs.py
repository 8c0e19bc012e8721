"""Attacks on the supervisor trusting a judged directory's link as its path in the task's view when
the link is not "/" and the directory is on one of the sandbox's own mounts (supervisor_rules.c
view_path_check, own_mount), on "." and empty components joined like names (join_names,
lexically_clear), and on the task's root judged as "/" directly. Each case makes, writes or
renames a protected path for real (real bubblewrap, a second sandbox, host mounts) and checks the
host afterwards.
"""

from __future__ import annotations

import asyncio
import os
import pathlib

import pytest
from escape_kit import Sandboxes, output
from write_kit import refusals, tree_state

pytestmark = [pytest.mark.security, pytest.mark.integration]

EXCL = "os.O_CREAT | os.O_EXCL | os.O_WRONLY"


def _py(body: str) -> str:
    """A /bin/sh line running the Python `body` with os imported."""
    return f"/usr/bin/python3 - <<'EOF'\nimport os\n{body}\nEOF\n"


# Each try: a label and one statement; it prints "<label> MADE" or "<label> REFUSED <errno>".
def _tries(cases: dict[str, str], cwd: str) -> str:
    lines = [f"os.chdir({cwd!r})"]
    for label, stmt in cases.items():
        lines += [
            "try:",
            f"    {stmt}",
            f"    print({label!r}, 'MADE')",
            "except OSError as e:",
            f"    print({label!r}, 'REFUSED', e.errno)",
        ]
    return "\n".join(lines)


def _made(out: str) -> list[str]:
    return [line.split()[0] for line in out.splitlines() if line.endswith(" MADE")]


# --- "." normalisation and the root shortcut ------------------------------------------------

# protectedPaths whose names are dots, dots with a space, and a plain one; each spelled with ".",
# empty components, trailing "/." and from the root ("//", "/./"). Every create must be refused
# and the kernel's own answer kept where the spelling names no file ("x/." is never a new file).
DOTS = {
    "dot3-rel": f"os.close(os.open('./.../settings.json', {EXCL}))",
    "dot3-slashes": f"os.close(os.open('...//settings.json', {EXCL}))",
    "dot3-abs": f"os.close(os.open(WT + '/./...//./settings.json', {EXCL}))",
    "dotsp-rel": f"os.close(os.open('. /./f', {EXCL}))",
    "dotsp-abs": f"os.close(os.open('/' + WT + '//. /f', {EXCL}))",
    "keep-rootdots": f"os.close(os.open('/./' + WT + '/keep/./settings.json', {EXCL}))",
    "keep-rootslashes": f"os.close(os.open('//' + WT + '//keep//settings.json', {EXCL}))",
    "keep-trunc-abs": "os.close(os.open('/.' + WT + '/./held.txt', os.O_WRONLY | os.O_TRUNC))",
    "keep-trailing-dot": f"os.close(os.open('keep/settings.json/.', {EXCL}))",
    "keep-only-dots": f"os.close(os.open('./././', {EXCL}))",
    "pdir-mkdir-slash": "os.mkdir('pdir/')",
    "pdir-mkdir-dot": "os.mkdir('./pdir/.')",
    "pdir-mkdir-abs": "os.mkdir('//' + WT + '/./pdir//')",
    "keep-rename-in": "os.rename('ok', './keep//./settings.json')",
    "keep-rename-abs": "os.rename('ok', '/./' + WT + '/keep/settings.json')",
    "dot3-link": "os.link('ok', '.../././settings.json')",
    "dot3-symlink": "os.symlink('ok', './...//settings.json')",
}


async def test_dots_empty_components_and_the_root_never_clear_a_protected_path(
    sb: Sandboxes,
) -> None:
    wt = sb.worktree
    for d in ("...", ". ", "keep"):
        (wt / d).mkdir()
    (wt / "held.txt").write_text("kept\n")
    (wt / "ok").write_text("ok\n")
    protected = [wt / "..." / "settings.json", wt / ". " / "f", wt / "keep" / "settings.json",
                 wt / "held.txt", wt / "pdir"]  # fmt: skip
    handle = sb.launch(protectedPaths=[str(p) for p in protected])
    before = tree_state(wt)
    out = output(await sb.sh(handle, _py(f"WT = {str(wt)!r}\n" + _tries(DOTS, str(wt)))))
    assert _made(out) == [], out
    assert len([ln for ln in out.splitlines() if " REFUSED " in ln]) == len(DOTS), out
    assert tree_state(wt) == before, out
    assert not (wt / "pdir").exists() and (wt / "held.txt").read_text() == "kept\n"
    # the same names elsewhere are made: the refusals above are the rules, not the spellings
    ok = output(await sb.sh(handle, _py(_tries({
        "ctl-dot3": f"os.close(os.open('./...//other.json', {EXCL}))",
        "ctl-abs": f"os.close(os.open('//{wt}/./keep//other.json', {EXCL}))",
        "ctl-mkdir": "os.mkdir('./qdir//')",
    }, str(wt)))))  # fmt: skip
    assert sorted(_made(ok)) == ["ctl-abs", "ctl-dot3", "ctl-mkdir"], ok
    assert (wt / "..." / "other.json").exists() and (wt / "keep" / "other.json").exists()


# --- a directory moved by a second sandbox while the first one's cwd is in it --------------------

MOVED_WAIT = "i=0; while [ ! -e {go} ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done\n"


async def _moved_cwd(
    sb: Sandboxes,
    a_binds: list[str],
    a_protected: list[str],
    b_bind: str,
    cwd: str,
    move: str,
    cases: dict[str, str],
) -> tuple[str, object]:
    """A's command waits in `cwd` until B (binding `b_bind`, no protectedPaths) has run `move`,
    then tries `cases` (see _tries) from there; A's output and handle."""
    a = sb.launch(bindMounts=[{"hostPath": b} for b in a_binds], protectedPaths=a_protected)
    b = sb.launch(bindMounts=[{"hostPath": b_bind}])
    go = pathlib.Path(a_binds[0]) / "go"
    script = f"cd {cwd}\n" + MOVED_WAIT.format(go=go) + _py(_tries(cases, "."))
    waiting = asyncio.ensure_future(sb.sh(a, script))
    await asyncio.sleep(0.6)
    moved = await sb.sh(b, f"{move} && touch {go} && echo moved")
    assert moved.stdout == b"moved\n", output(moved)
    return output(await waiting), a


MOVED_CASES = {
    "bare": f"os.close(os.open('settings.json', {EXCL}))",
    "dot": f"os.close(os.open('./settings.json', {EXCL}))",
    "fd": f"os.close(os.open('settings.json', {EXCL}, dir_fd=os.open('.', os.O_RDONLY)))",
    "rename": "open('/tmp/src', 'w').close(); os.rename('/tmp/src', 'settings.json')",
    "mkdir-then": (
        "os.mkdir('sub'); os.rmdir('sub'); "
        "os.close(os.open('settings.json', os.O_CREAT | os.O_WRONLY))"
    ),
}


async def test_a_cwd_renamed_to_a_protected_parent_within_the_bind_by_a_second_sandbox(
    sb: Sandboxes,
) -> None:
    """A protects wt/keep/settings.json (no keep yet) and waits in wt/x; B, with no protectedPaths,
    renames wt/x to wt/keep. A's cwd's link now reads wt/keep (true, on A's own mount): every
    create of settings.json from it is refused, and none lands."""
    wt = sb.worktree
    (wt / "x").mkdir()
    target = wt / "keep" / "settings.json"
    out, a = await _moved_cwd(
        sb, [str(wt)], [str(target)], str(wt), f"{wt}/x", f"mv {wt}/x {wt}/keep", MOVED_CASES
    )
    assert _made(out) == [] and not target.exists(), (out, refusals(a))
    assert (wt / "keep").is_dir()


async def test_a_cwd_moved_into_another_bind_of_the_same_sandbox_by_a_second_sandbox(
    sb: Sandboxes,
) -> None:
    """A binds p/w1 and p/w2 (one filesystem) and protects p/w2/keep/settings.json; it waits in
    p/w1/x. B binds p and moves p/w1/x to p/w2/keep. A's cwd is still on A's mount of w1, though
    now below w2: its link reads "/" (escaped), it is resolved again and refused."""
    p = sb.root / "p"
    (p / "w1" / "x").mkdir(parents=True)
    (p / "w2").mkdir()
    target = p / "w2" / "keep" / "settings.json"
    out, a = await _moved_cwd(
        sb, [str(p / "w1"), str(p / "w2")], [str(target)], str(p), f"{p}/w1/x",
        f"mv {p}/w1/x {p}/w2/keep", MOVED_CASES,
    )  # fmt: skip
    assert _made(out) == [] and not target.exists(), (out, refusals(a))
    assert os.listdir(p / "w2" / "keep") == [], out


async def test_a_cwd_moved_below_a_read_only_bind_of_the_same_filesystem(sb: Sandboxes) -> None:
    """A binds p/w (writable) and p/ro (read-only, same filesystem), waiting in p/w/x; B moves x
    into p/ro/x. The cwd is on A's writable mount, below what A sees read-only: nothing is made
    there (its link reads "/" and is resolved again)."""
    p = sb.root / "p"
    (p / "w" / "x").mkdir(parents=True)
    (p / "ro").mkdir()
    a = sb.launch(
        bindMounts=[{"hostPath": str(p / "w")}, {"hostPath": str(p / "ro"), "readOnly": True}]
    )
    b = sb.launch(bindMounts=[{"hostPath": str(p)}])
    go = p / "w" / "go"
    script = f"cd {p}/w/x\n" + MOVED_WAIT.format(go=go) + _py(_tries({
        "mcp": f"os.close(os.open('.mcp.json', {EXCL}))",
        "plain": f"os.close(os.open('plain.txt', {EXCL}))",
    }, "."))  # fmt: skip
    waiting = asyncio.ensure_future(sb.sh(a, script))
    await asyncio.sleep(0.6)
    moved = await sb.sh(b, f"mv {p}/w/x {p}/ro/x && touch {go} && echo moved")
    assert moved.stdout == b"moved\n", output(moved)
    out = output(await waiting)
    assert "mcp MADE" not in out and not (p / "ro" / "x" / ".mcp.json").exists(), out
