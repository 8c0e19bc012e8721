"""Create-time filename rules in a real sandbox: no new `.env`, `*.key` or `*.pem`, however named.

Every sandbox here is launched with the standard dispatch globs. Each escape attempt must fail with
EACCES, leave no file on the host and yield exactly one `file-write-create` violation; ordinary
work in the same sandbox must still succeed. The verdicts are read on the host.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import textwrap

import pytest
from escape_kit import Sandboxes, host_pids_with, output, shell_word, unique, wait_until

from cc_server.policy import STANDARD_DENY_CREATE_GLOBS, parse_spec
from cc_server.runtime.handle import CollectedResult, SandboxHandle, run_collect

pytestmark = [pytest.mark.security, pytest.mark.integration]

PYTHON = "/usr/bin/python3"  # the interpreter the sandbox sees (/usr is bound read-only)
RACE_OPENS = 20_000  # racing opens; answering CONTINUE let 904 of 9,251 through in the spike
RUN_TIMEOUT_S = 120.0


def _launch(sb: Sandboxes) -> SandboxHandle:
    assert sb.manager.probe_result.create_rules, sb.manager.probe_result.create_rules_hint
    return sb.manager.launch(parse_spec(sb.spec()), deny_create_globs=STANDARD_DENY_CREATE_GLOBS)


async def _sh(sb: Sandboxes, handle: SandboxHandle, script: str) -> CollectedResult:
    return await sb.sh(handle, f"cd {sb.worktree} && {script}", timeout_s=RUN_TIMEOUT_S)


def _tree(root: pathlib.Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


ESCAPES = {
    "dotenv": ("echo secret > .env", ".env"),
    "touch_nested": ("mkdir -p a/b && touch a/b/c.pem", "a/b/c.pem"),
    "python_open": (f"{PYTHON} -c \"open('x.key','w')\"", "x.key"),
    "cp": ("cp id x.pem", "x.pem"),
    "mv": ("mv notes.txt notes.pem", "notes.pem"),
    "hard_link": ("ln notes.txt n.pem", "n.pem"),
    "symlink": ("ln -s whatever s.pem", "s.pem"),
    "through_symlink": ("ln -s x.pem link && echo x > link", "x.pem"),  # the name judged
    "tmpfile_linkat": (
        f'{PYTHON} -c "'
        + textwrap.dedent(
            """
            import ctypes, os
            fd = os.open('.', os.O_TMPFILE | os.O_WRONLY, 0o600)
            os.write(fd, b'key material')
            r = ctypes.CDLL(None, use_errno=True).linkat(fd, b'', -100, b't.pem', 0x1000)
            raise SystemExit(os.strerror(ctypes.get_errno()) if r else 0)
            """
        )
        .strip()
        .replace("\n", "; ")
        + '"',
        "t.pem",
    ),
    "mknod": (f"{PYTHON} -c \"import os; os.mknod('m.key')\"", "m.key"),
    "mkfifo": ("mkfifo f.key", "f.key"),
}


@pytest.mark.parametrize("case", list(ESCAPES))
async def test_creating_a_forbidden_name_fails_leaves_nothing_and_is_reported_once(
    sb: Sandboxes, case: str
) -> None:
    script, target = ESCAPES[case]
    (sb.worktree / "id").write_text("identity\n")
    (sb.worktree / "notes.txt").write_text("notes\n")
    before = _tree(sb.worktree)
    result = await _sh(sb, _launch(sb), script)
    text = output(result)
    assert result.exit_code != 0, text
    assert "Permission denied" in text, text
    created = _tree(sb.worktree) - before - {"a", "a/b", "link"}
    assert created == set(), created
    assert (sb.worktree / "notes.txt").read_text() == "notes\n"  # mv left it where it was
    action = "file-write-rename" if case == "mv" else "file-write-create"
    # The target is the path judged, absolute in the sandbox's view (the worktree is bound at its
    # host path); the spelling the command used is in `raw`.
    assert [(v.action, v.target) for v in result.violations] == [
        (action, f"{sb.worktree}/{target}")
    ]


async def test_ordinary_work_still_works(sb: Sandboxes) -> None:
    wt = sb.worktree
    (wt / "existing.txt").write_text("one\n")
    (wt / "old.pem").write_text("pre-existing\n")
    tree = sb.root / "tree"
    for i in range(20):
        (tree / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (tree / f"d{i % 4}" / f"f{i}.txt").write_text(f"{i}\n")
    os.symlink("d0/f0.txt", tree / "link")
    with tarfile.open(wt / "tree.tar", "w") as tar:
        tar.add(tree, arcname="tree")
    git = "git -c user.name=Agent -c user.email=agent@example.invalid"
    # The repository is the host's (a command may not make a new `.git`: test_write_policy.py);
    # committing in it, nested in the worktree, is ordinary work.
    subprocess.run(["git", "init", "-q", str(wt / "repo")], check=True)
    script = f"""
        set -e
        echo two >> existing.txt
        sed -i s/one/uno/ existing.txt
        echo appended >> old.pem
        echo 'export A=1' > .envrc
        echo not-a-key > key.txt
        mkdir pem && echo inside > pem/file
        cd repo && echo hi > README && {git} add README
        {git} commit -qm first && cd ..
        tar xf tree.tar
        {PYTHON} -c "import compileall, sys; sys.exit(not compileall.compile_dir('pem', quiet=1))"
        echo ok
    """
    result = await _sh(sb, _launch(sb), textwrap.dedent(script))
    assert result.exit_code == 0, output(result)
    assert result.violations == (), result.violations
    assert (wt / "existing.txt").read_text() == "uno\ntwo\n"
    assert (wt / "old.pem").read_text() == "pre-existing\nappended\n"
    assert (wt / ".envrc").exists() and (wt / "key.txt").exists()
    assert (wt / "pem" / "file").read_text() == "inside\n"
    log = subprocess.run(
        ["git", "-C", str(wt / "repo"), "log", "--format=%s"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert log.stdout == "first\n"
    assert _tree(wt / "tree") == _tree(tree)
    assert os.readlink(wt / "tree" / "link") == "d0/f0.txt"


async def test_a_tar_member_with_a_forbidden_name_is_refused_and_the_rest_extracted(
    sb: Sandboxes,
) -> None:
    src = sb.root / "src"
    (src / "pkg").mkdir(parents=True)
    for name in ("a.txt", "server.pem", "b.txt", ".env"):
        (src / "pkg" / name).write_text(name)
    with tarfile.open(sb.worktree / "pkg.tar", "w") as tar:
        tar.add(src / "pkg", arcname="pkg")
    result = await _sh(sb, _launch(sb), "tar xf pkg.tar")
    assert result.exit_code != 0
    assert sorted(p.name for p in (sb.worktree / "pkg").iterdir()) == ["a.txt", "b.txt"]
    assert sorted(v.target for v in result.violations) == [
        f"{sb.worktree}/pkg/.env",
        f"{sb.worktree}/pkg/server.pem",
    ]


@pytest.fixture(scope="module")
def race_binary(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A C racer: one thread flips the path buffer between ok.txt and ok.pem while the main
    thread opens it with O_CREAT, `RACE_OPENS` times. Prints `made refused other`."""
    gcc = shutil.which("gcc")
    assert gcc is not None, "the race test needs gcc (scripts/bootstrap installs it)"
    source = tmp_path_factory.mktemp("race") / "race.c"
    source.write_text(
        textwrap.dedent(
            """
            #include <errno.h>
            #include <fcntl.h>
            #include <pthread.h>
            #include <stdio.h>
            #include <stdlib.h>
            #include <string.h>
            #include <unistd.h>
            static char path[16] = "ok.txt";
            static volatile int stop;
            static void *flip(void *arg) {
                (void)arg;
                while (!stop) {  /* the barriers keep both stores: neither is dead */
                    memcpy(path, "ok.pem", 7);
                    __asm__ volatile("" ::: "memory");
                    memcpy(path, "ok.txt", 7);
                    __asm__ volatile("" ::: "memory");
                }
                return NULL;
            }
            int main(int argc, char **argv) {
                int n = atoi(argv[1]), made = 0, refused = 0, other = 0;
                pthread_t t;
                pthread_create(&t, NULL, flip, NULL);
                for (int i = 0; i < n; i++) {
                    int fd = open(path, O_WRONLY | O_CREAT, 0644);
                    if (fd >= 0) { made++; close(fd); }
                    else if (errno == EACCES) refused++;
                    else other++;
                }
                stop = 1;
                pthread_join(t, NULL);
                printf("%d %d %d\\n", made, refused, other);
                return 0;
            }
            """
        )
    )
    binary = source.with_suffix("")
    subprocess.run([gcc, "-O2", "-pthread", "-o", str(binary), str(source)], check=True)
    return binary


async def test_a_racing_thread_never_gets_the_forbidden_name_created(
    sb: Sandboxes, race_binary: pathlib.Path
) -> None:
    shutil.copy(race_binary, sb.worktree / "race")
    handle = _launch(sb)
    result = await _sh(sb, handle, f"./race {RACE_OPENS}")
    assert result.exit_code == 0, output(result)
    made, refused, other = map(int, result.stdout.decode().split())
    assert made + refused + other == RACE_OPENS and other == 0, result.stdout
    assert refused > 0, "the flip never landed inside a call: the race did not run"
    assert not (sb.worktree / "ok.pem").exists()
    assert {v.target for v in handle.violations} == {f"{sb.worktree}/ok.pem"}
    assert len(handle.violations) == refused


async def test_killing_everything_inside_does_not_open_the_gate(sb: Sandboxes) -> None:
    script = """
        kill -9 -1 2>/dev/null; kill -9 1 2>/dev/null; sleep 0.2
        for f in /proc/[0-9]*/status; do
            n=$(sed -n 's/^Seccomp_filters:[[:space:]]*//p' "$f")
            [ -n "$n" ] && [ "$n" -lt 2 ] && echo "unfiltered: $f"
        done
        ls -l /proc/[0-9]*/fd 2>/dev/null | grep -c 'seccomp notify'
        echo x > after-kill.pem
    """
    result = await _sh(sb, _launch(sb), textwrap.dedent(script))
    text = output(result)
    assert "unfiltered" not in text, text
    assert result.stdout.decode().splitlines()[0] == "0", text  # nobody inside holds a listener
    assert "Permission denied" in text, text
    assert not (sb.worktree / "after-kill.pem").exists()
    assert [v.target for v in result.violations] == [f"{sb.worktree}/after-kill.pem"]


async def test_a_second_listener_cannot_be_installed_inside(sb: Sandboxes) -> None:
    # A newer filter's listener would receive the creates first and could answer them itself.
    code = textwrap.dedent(
        """
        import ctypes, errno
        libc = ctypes.CDLL(None, use_errno=True)
        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
        insn = (ctypes.c_uint64 * 1)(0x7FFF0000 << 32 | 0x06)
        prog = Prog(1, ctypes.addressof(insn))
        r = libc.syscall(317, 1, 1 << 3, ctypes.byref(prog))
        print(r, errno.errorcode.get(ctypes.get_errno()))
        """
    )
    (sb.worktree / "second.py").write_text(code)
    result = await _sh(sb, _launch(sb), f"{PYTHON} second.py")
    assert result.stdout.decode().strip() == "-1 EPERM", output(result)


async def test_when_the_supervisor_is_gone_trapped_calls_fail(sb: Sandboxes) -> None:
    handle = _launch(sb)
    ready, go = sb.worktree / "ready", sb.worktree / "go"
    # The wait is builtins only: a `sleep` forked after the supervisor stops fails too (clone is
    # trapped), and the shell would stop at "Cannot fork" before the create this test is about.
    script = f"echo > {ready}; while [ ! -e {go} ]; do :; done; echo x > {sb.worktree}/late.txt"
    async with handle.open_exec(["/bin/sh", "-c", script], timeout_s=RUN_TIMEOUT_S) as execution:
        # The command itself runs (past the egress prologue, whose socat binds are trapped too).
        assert await wait_until(ready.exists, timeout_s=10.0)
        # White box: stop it as a crash would (the session sandbox's, or the command's own).
        sandbox = handle._in_sandbox.get(execution)
        own = execution._child._launched if sandbox is None else None  # a HostChild's
        supervisor = sandbox._rules if sandbox is not None else own.supervisor
        assert supervisor is not None
        await asyncio.to_thread(supervisor.close)
        go.write_text("")
        result = await execution.collect()
    assert result.exit_code != 0
    assert "Function not implemented" in output(result), output(result)
    assert not (sb.worktree / "late.txt").exists()


async def test_no_core_file_can_be_dumped(sb: Sandboxes) -> None:
    # A core file is a name the kernel creates without a trapped call: the hard limit is 0.
    script = "ulimit -Hc; ulimit -c unlimited && echo raised; sh -c 'kill -SEGV $$'; ls"
    result = await _sh(sb, _launch(sb), script)
    assert result.stdout.decode().splitlines()[0] == "0", output(result)
    assert "raised" not in result.stdout.decode()
    assert not [p for p in sb.worktree.iterdir() if p.name.startswith("core")]


async def test_violations_reach_the_event_stream_in_order(sb: Sandboxes) -> None:
    result = await run_collect(
        _launch(sb),
        ["/bin/sh", "-c", f"cd {sb.worktree}; echo > one.pem; echo > ok; echo > two.key; true"],
        timeout_s=RUN_TIMEOUT_S,
    )
    assert result.exit_code == 0
    assert [v.target for v in result.violations] == [
        f"{sb.worktree}/{n}" for n in ("one.pem", "two.key")
    ]
    assert all(v.raw and "refused to create" in v.raw for v in result.violations)


CRASHING_SERVER = """
import asyncio, os, sys
from cc_server.backends.probe import probe
from cc_server.policy import STANDARD_DENY_CREATE_GLOBS, HostFacts, parse_spec
from cc_server.runtime.port import SandboxManager
from cc_server.runtime.handle import run_collect

async def main():
    home, wt, script = sys.argv[1:4]
    host = HostFacts.current()
    host = HostFacts(platform=host.platform, home=home, realpath=os.path.realpath,
                     exists=os.path.lexists, is_dir=os.path.isdir)
    mgr = SandboxManager(probe_result=probe(), host=host)
    spec = {"sessionId": "crash", "workspaceId": "w", "bindMounts": [{"hostPath": wt}]}
    handle = mgr.launch(parse_spec(spec), deny_create_globs=STANDARD_DENY_CREATE_GLOBS)
    print("launching", flush=True)
    await run_collect(handle, ["/bin/sh", "-c", script], timeout_s=600)

asyncio.run(main())
"""


async def test_the_sandbox_dies_with_a_crashed_server_that_held_its_supervisor(
    sb: Sandboxes,
) -> None:
    # The launcher is the sandbox's PID 1 here (bwrap --as-pid-1): --die-with-parent must still
    # take it, and with it everything inside, when the server (and its supervisor) is killed.
    marker = unique("cc-crash-rules")
    script = (
        f"m={shell_word(marker)}; setsid /bin/sh -c 'sleep 300; : '\"$m\" </dev/null "
        ">/dev/null 2>&1 & sleep 300"
    )
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CRASHING_SERVER, str(sb.home), str(sb.worktree), script,
        stdout=asyncio.subprocess.PIPE, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    try:
        assert server.stdout is not None
        assert await asyncio.wait_for(server.stdout.readline(), 10) == b"launching\n"
        assert await wait_until(lambda: len(host_pids_with(marker)) == 1, timeout_s=5.0)
    finally:
        server.kill()
        await server.wait()
    assert await wait_until(lambda: not host_pids_with(marker)), host_pids_with(marker)


async def test_a_refusal_is_reported_to_the_command_that_made_it_only(sb: Sandboxes) -> None:
    handle = _launch(sb)
    wt = sb.worktree
    quiet = ["/bin/sh", "-c", f"while [ ! -e {wt}/go ]; do sleep 0.05; done"]
    async with handle.open_exec(quiet, timeout_s=RUN_TIMEOUT_S) as bystander:
        result = await _sh(sb, handle, "echo > mine.pem")
        (wt / "go").write_text("")
        seen = await bystander.collect()
    assert [v.target for v in result.violations] == [f"{wt}/mine.pem"]
    assert seen.violations == ()
    assert [v.target for v in handle.violations] == [f"{wt}/mine.pem"]
