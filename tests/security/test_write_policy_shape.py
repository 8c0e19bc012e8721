"""A directory made a git directory by its shape after its config and hooks were written: the
last of HEAD, objects/ and refs/ is refused outside a `.git` directory, however it is made
(mkdir, rename, symlink, a hard link of a symlink, an exchange, two threads at once), and git's
own work (init, clone, worktree add in a bind) still makes them. Real bubblewrap; the host is
checked afterwards.
"""

from __future__ import annotations

import pathlib
import subprocess

import pytest
from escape_kit import Sandboxes, output, run_attack
from write_kit import refusals, steps_script

pytestmark = [pytest.mark.security, pytest.mark.integration]

GIT_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1"}
HEAD_TEXT = "ref: refs/heads/main\n"
REASON = "the last of HEAD, objects and refs"

# What the sandbox writes while `shaped` is not a git directory yet.
WRITE_FIRST = (
    "os.mkdir('shaped/hooks')\n"
    "open('shaped/config', 'w').write('[core]\\n\\tfsmonitor = touch /tmp/pwned\\n')\n"
    "open('shaped/hooks/pre-commit', 'w').write('#!/bin/sh\\necho evil\\n')\n"
)


def _git(*args: str, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True, capture_output=True, text=True, env=GIT_ENV, cwd=cwd,
    )  # fmt: skip


def _host_takes_it(path: pathlib.Path) -> bool:
    """Whether host git takes `path` for a git directory."""
    done = subprocess.run(
        ["git", "--git-dir", str(path), "rev-parse", "--git-dir"],
        capture_output=True, text=True, env=GIT_ENV,
    )  # fmt: skip
    return done.returncode == 0


async def test_a_directory_is_not_made_a_repository_after_its_config_was_written(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # E6: the host has a stray HEAD beside refs/; the sandbox writes config and a hook, then
    # renames an objects/ into place.
    wt = sb.worktree
    for d in ("shaped/refs", "plain/objects"):
        (wt / d).mkdir(parents=True)
    (wt / "shaped" / "HEAD").write_text(HEAD_TEXT)  # the host's stray HEAD
    body = WRITE_FIRST + "os.rename('plain/objects', 'shaped/objects')\n"
    handle, out = await run_attack(sb, tmp_path, body)
    shaped = (wt / "shaped" / "objects").is_dir() and (wt / "shaped" / "HEAD").is_file()
    written = (wt / "shaped" / "config").exists() or (
        wt / "shaped" / "hooks" / "pre-commit"
    ).exists()
    assert not (shaped and written), out
    assert "RESULT=refused [Errno 13]" in out, out
    assert refusals(handle) == [("file-write-rename", f"{wt}/shaped/objects")], out
    assert REASON in handle.violations[0].reason
    assert not _host_takes_it(wt / "shaped")


# name -> (what the host has in `shaped` besides HEAD, the completing step, verb, refused name)
COMPLETIONS: dict[str, tuple[tuple[str, ...], str, str, str]] = {
    "mkdir-objects": (("refs",), "os.mkdir('shaped/objects')", "file-write-create", "objects"),
    "mkdir-refs": (("objects",), "os.mkdir('shaped/refs')", "file-write-create", "refs"),
    # Beside a symlinked HEAD (git takes its directory as well).
    "mkdir-objects-beside-a-symlinked-head": (
        ("HEAD:symlink", "refs"), "os.mkdir('shaped/objects')", "file-write-create", "objects",
    ),
    "rename-refs": (
        ("objects",), "os.makedirs('plain/refs')\nos.rename('plain/refs', 'shaped/refs')",
        "file-write-rename", "refs",
    ),
    "symlink-objects": (
        ("refs",), "os.makedirs('plain/objects')\nos.symlink('../plain/objects', 'shaped/objects')",
        "file-write-create", "objects",
    ),
    "symlink-refs": (
        ("objects",), "os.makedirs('plain/refs')\nos.symlink('../plain/refs', 'shaped/refs')",
        "file-write-create", "refs",
    ),
    # A hard link of a symlink (linkat without AT_SYMLINK_FOLLOW links the symlink itself).
    "hard-link-of-a-symlink": (
        ("refs",),
        "os.makedirs('plain/objects')\nos.symlink('../plain/objects', 'plain/l')\n"
        "os.link('plain/l', 'shaped/objects', follow_symlinks=False)",
        "file-write-create", "objects",
    ),
    # A symlink renamed over a regular file named objects (not a shape yet).
    "rename-over-a-file": (
        ("refs", "objects:file"),
        "os.makedirs('plain/objects')\nos.symlink('../plain/objects', 'plain/l')\n"
        "os.rename('plain/l', 'shaped/objects')",
        "file-write-rename", "objects",
    ),
    # RENAME_EXCHANGE of a directory with that file, either side first.
    "exchange-new-side": (
        ("refs", "objects:file"),
        "os.makedirs('plain/objects')\n"
        "if libc.renameat2(-100, b'plain/objects', -100, b'shaped/objects', 2): fail()",
        "file-write-rename", "objects",
    ),
    "exchange-old-side": (
        ("refs", "objects:file"),
        "os.makedirs('plain/objects')\n"
        "if libc.renameat2(-100, b'shaped/objects', -100, b'plain/objects', 2): fail()",
        "file-write-rename", "objects",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(COMPLETIONS))
async def test_the_last_of_objects_and_refs_is_refused_beside_a_host_head(
    sb: Sandboxes, tmp_path: pathlib.Path, name: str
) -> None:
    wt = sb.worktree
    has, step, action, refused = COMPLETIONS[name]
    (wt / "shaped").mkdir()
    (wt / "shaped" / "HEAD").write_text(HEAD_TEXT)
    for entry in has:
        if entry == "HEAD:symlink":
            (wt / "shaped" / "HEAD").unlink()
            (wt / "shaped" / "HEAD").symlink_to("refs/heads/main")
        elif entry.endswith(":file"):
            (wt / "shaped" / entry.removesuffix(":file")).write_text("not a directory\n")
        else:
            (wt / "shaped" / entry).mkdir()
    handle, out = await run_attack(sb, tmp_path, WRITE_FIRST + step)
    assert "RESULT=refused [Errno 13]" in out, out
    assert (wt / "shaped" / "config").exists(), out  # the control: written before the step
    assert not _host_takes_it(wt / "shaped"), out
    assert refusals(handle) == [(action, f"{wt}/shaped/{refused}")], (refusals(handle), out)
    assert REASON in handle.violations[0].reason


async def test_a_git_directory_with_a_symlinked_head_keeps_its_config(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # A host repository whose HEAD is a symlink (core.preferSymlinkRefs) is a git directory by
    # its shape too: its config is not written.
    linked = sb.worktree / "linked"
    (linked / "refs" / "heads").mkdir(parents=True)
    (linked / "objects").mkdir()
    (linked / "HEAD").symlink_to("refs/heads/main")
    assert _host_takes_it(linked)  # the control: host git takes it
    body = "open('linked/config', 'w').write('[core]\\n\\tfsmonitor = touch /tmp/pwned\\n')\n"
    handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=refused [Errno 13]" in out, out
    assert not (linked / "config").exists(), out
    assert refusals(handle) == [("file-write-create", f"{linked}/config")], out


async def test_a_head_below_a_bare_repository_is_refused_where_it_would_make_another(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # A HEAD in a directory below a bare repository is git's (refs/remotes/x/HEAD), but not in
    # one that has objects/ and refs/ and a config the sandbox wrote: that HEAD makes a second
    # repository.
    wt = sb.worktree
    _git("init", "-q", "--bare", str(wt / "bare"))
    body = (
        "os.makedirs('bare/sub/objects')\nos.makedirs('bare/sub/refs')\n"
        "open('bare/sub/config', 'w').write('[core]\\n\\tfsmonitor = touch /tmp/pwned\\n')\n"
        f"open('bare/sub/HEAD', 'w').write({HEAD_TEXT!r})\n"
    )
    handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=refused [Errno 13]" in out, out
    assert (wt / "bare" / "sub" / "config").exists(), out
    assert not (wt / "bare" / "sub" / "HEAD").exists(), out
    assert refusals(handle) == [("file-write-create", f"{wt}/bare/sub/HEAD")], out
    assert REASON in handle.violations[0].reason


# name -> (what the host has in each directory, the two steps run at once)
RACES: dict[str, tuple[str, tuple[str, str]]] = {
    # Beside a host HEAD alone: objects/ and refs/.
    "objects-and-refs": ("HEAD", ("os.mkdir(d + '/objects')", "os.mkdir(d + '/refs')")),
    # Below a bare repository (where a HEAD is git's), beside refs/: objects/ and a HEAD.
    "objects-and-head": (
        "refs", ("os.mkdir(d + '/objects')", f"open(d + '/HEAD', 'x').write({HEAD_TEXT!r})"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(RACES))
async def test_two_threads_completing_a_shape_at_once_never_both_succeed(
    sb: Sandboxes, tmp_path: pathlib.Path, name: str
) -> None:
    # Each check must see what the other thread made.
    wt = sb.worktree
    has, steps = RACES[name]
    _git("init", "-q", "--bare", str(wt / "bare"))
    rounds = 600
    for i in range(rounds):
        d = wt / "bare" / f"d{i}"
        d.mkdir()
        if has == "HEAD":
            (d / "HEAD").write_text(HEAD_TEXT)
        else:
            (d / has).mkdir()
    body = (
        "import threading\n"
        f"for i in range({rounds}):\n"
        "    go = threading.Barrier(2)\n"
        "    def make(step, d=f'bare/d{i}', go=go):\n"
        "        go.wait()\n"
        "        try:\n"
        "            exec(step)\n"
        "        except PermissionError:\n"
        "            pass\n"
        f"    ts = [threading.Thread(target=make, args=(s,)) for s in {steps!r}]\n"
        "    [t.start() for t in ts]\n"
        "    [t.join() for t in ts]\n"
    )
    handle, out = await run_attack(sb, tmp_path, body)
    assert "RESULT=done" in out, out
    dirs = [wt / "bare" / f"d{i}" for i in range(rounds)]
    made = [sum((d / n).exists() for n in ("HEAD", "objects", "refs")) for d in dirs]
    assert [i for i, n in enumerate(made) if n == 3] == [], out
    assert made == [2] * rounds, out  # the control: the first of the two is made every time
    assert len(refusals(handle)) == rounds, out


async def test_git_still_makes_its_own_objects_and_refs(
    sb: Sandboxes, tmp_path: pathlib.Path
) -> None:
    # git makes HEAD, objects and refs itself inside .git directories: git init and git clone of
    # the bind's repository in /tmp (a new .git in a bind is refused by its own rule), git
    # worktree add of it to /tmp, a fetch into it from the clone (new refs and objects), a
    # branch, gc and commits in it, each checked on the host.
    wt = sb.worktree
    _git("init", "-q", "-b", "main", str(wt / "src"))
    _git("-C", str(wt / "src"), "commit", "-q", "--allow-empty", "-m", "one")
    g = "git -c user.name=t -c user.email=t@t"
    steps = {
        "init": f"cd /tmp && {g} init -q -b main new && cd new && echo x > x && {g} add x && "
        f"{g} commit -qm x",
        "clone": f"cd /tmp && {g} clone -q {wt}/src copy && cd copy && echo y > y && "
        f"{g} add y && {g} commit -qm y",
        "fetch": f"cd {wt}/src && {g} fetch -q /tmp/copy main:from-copy",
        "worktree-add": f"cd {wt}/src && {g} worktree add -q /tmp/side -b side && cd /tmp/side && "
        f"echo z > z && {g} add z && {g} commit -qm z",
        "branch-gc-commit": f"cd {wt}/src && {g} branch b2 && {g} gc -q && echo w > w && "
        f"{g} add w && {g} commit -qm two",
    }
    script = steps_script(steps)
    handle = sb.launch(bindMounts=[{"hostPath": str(wt)}])
    out = output(await sb.sh(handle, script, timeout_s=120))
    for k in steps:
        assert f"{k}=ok" in out, out
    assert refusals(handle) == [], out
    log = _git("-C", str(wt / "src"), "log", "--all", "--format=%s").stdout.split()
    assert sorted(log) == ["one", "two", "y", "z"], out
