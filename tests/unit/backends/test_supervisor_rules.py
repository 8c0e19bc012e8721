"""The supervisor against the real kernel: every way to create a name, refused or emulated.

Each command runs under the launcher and a real supervisor (no bubblewrap; see supervisor_kit).
A refusal is EACCES, leaves no file and yields exactly one report; everything else behaves as
the kernel would, errno included.
"""

from __future__ import annotations

import os
import pathlib
import platform
import shutil
import signal
import stat
import subprocess
import textwrap
import time

import pytest
from supervisor_kit import PYTHON, Launch, py, run, sh

from cc_server.backends.supervisor import CreateRefused

pytestmark = pytest.mark.integration


def _names(root: pathlib.Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _one_refusal(result: object, name: str, target: str | None = None) -> CreateRefused:
    refused = result.refused  # type: ignore[attr-defined]
    assert len(refused) == 1, result
    assert refused[0].name == name
    if target is not None:
        assert refused[0].target == target
    return refused[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("script", "name", "target"),
    [
        ("echo > .env", ".env", ".env"),
        ("mkdir -p a/b && touch a/b/c.pem", "c.pem", "a/b/c.pem"),
        ("echo x > SHOUT.PEM", "SHOUT.PEM", "SHOUT.PEM"),  # case-folded: no alias on vfat
        ("echo id > id && cp id x.pem", "x.pem", "x.pem"),
        ("echo n > notes.txt && mv notes.txt notes.pem", "notes.pem", "notes.pem"),
        ("echo n > notes.txt && ln notes.txt n.pem", "n.pem", "n.pem"),
        ("ln -s whatever s.pem", "s.pem", "s.pem"),
        ("ln -s x.pem link && echo x > link", "x.pem", "link"),
        ("mkdir d && ln -s ../x.pem d/up && echo x > d/up", "x.pem", "d/up"),
        ("mkdir real && ln -s \"$PWD/real\" link && echo x > link/k.key", "k.key", "link/k.key"),
        ("mkfifo f.key", "f.key", "f.key"),
        ("mkdir cert.pem", "cert.pem", "cert.pem"),
        ("echo x > ./sub/../.env || (mkdir sub && echo x > ./sub/../.env)", ".env", None),
    ],
)
def test_a_new_matching_name_is_refused(
    tmp_path: pathlib.Path, script: str, name: str, target: str | None
) -> None:
    result = sh(script, str(tmp_path))
    assert result.returncode != 0, result
    assert "Permission denied" in result.stderr, result
    _one_refusal(result, name, target)
    assert not any(p.name == name for p in tmp_path.rglob("*")), _names(tmp_path)


def test_python_open_and_mknod_are_refused(tmp_path: pathlib.Path) -> None:
    code = textwrap.dedent(
        """
        import errno, os
        for attempt in (lambda: open("x.key", "w"), lambda: os.mknod("m.pem"),
                        lambda: os.mkdir("d.pem"), lambda: os.symlink("t", "l.key")):
            try:
                attempt()
            except PermissionError:
                print("EACCES")
        """
    )
    result = py(code, str(tmp_path))
    assert result.stdout.split() == ["EACCES"] * 4, result
    assert [r.name for r in result.refused] == ["x.key", "m.pem", "d.pem", "l.key"]
    assert _names(tmp_path) == set()


def test_o_tmpfile_then_linkat_is_refused_for_a_matching_name(tmp_path: pathlib.Path) -> None:
    code = textwrap.dedent(
        """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        AT_FDCWD, AT_EMPTY_PATH, AT_SYMLINK_FOLLOW = -100, 0x1000, 0x400
        for name, how in (("t.pem", "empty"), ("u.pem", "proc"), ("t.txt", "empty"),
                          ("u.txt", "proc")):
            fd = os.open(".", os.O_TMPFILE | os.O_WRONLY, 0o600)
            os.write(fd, b"data")
            if how == "empty":
                r = libc.linkat(fd, b"", AT_FDCWD, name.encode(), AT_EMPTY_PATH)
            else:
                r = libc.linkat(AT_FDCWD, f"/proc/self/fd/{fd}".encode(), AT_FDCWD,
                                name.encode(), AT_SYMLINK_FOLLOW)
            print(name, r, os.strerror(ctypes.get_errno()) if r else "ok")
            os.close(fd)
        """
    )
    result = py(code, str(tmp_path))
    lines = result.stdout.splitlines()
    assert lines[0] == "t.pem -1 Permission denied", result
    assert lines[1] == "u.pem -1 Permission denied", result
    assert lines[2:] == ["t.txt 0 ok", "u.txt 0 ok"], result
    assert [r.name for r in result.refused] == ["t.pem", "u.pem"]
    assert _names(tmp_path) == {"t.txt", "u.txt"}
    assert (tmp_path / "t.txt").read_bytes() == b"data"


def test_unix_socket_bind_is_checked_and_emulated(tmp_path: pathlib.Path) -> None:
    code = textwrap.dedent(
        """
        import socket
        for name in ("s.pem", "ok.sock", "\\0abstract"):
            s = socket.socket(socket.AF_UNIX)
            try:
                s.bind(name)
                print(name.strip("\\0"), "bound", s.getsockname())
            except PermissionError:
                print(name, "EACCES")
        t = socket.socket(socket.AF_INET)
        t.bind(("127.0.0.1", 0))
        print("inet", t.getsockname()[1] > 0)
        """
    )
    result = py(code, str(tmp_path))
    assert result.stdout.splitlines() == [
        "s.pem EACCES",
        "ok.sock bound ok.sock",
        "abstract bound b'\\x00abstract'",
        "inet True",
    ], result
    assert [r.name for r in result.refused] == ["s.pem"]
    assert stat.S_ISSOCK((tmp_path / "ok.sock").lstat().st_mode)
    assert not (tmp_path / "s.pem").exists()


GLOB_FORMS = (".env", "*.pem", "id_*", "[ab].key", "*.Cert", "caf\u00e9*")
GLOB_NAMES = {
    # name: whether GLOB_FORMS refuse it. A literal and a "*suffix" glob are compared without
    # fnmatch for an ASCII name; every other glob, and a name with a byte beyond ASCII, use it.
    ".env": True, ".ENV": True, "x.env": False, ".envrc": False, "env": False,
    "x.pem": True, "X.PeM": True, ".pem": True, "pem": False, "x.pem.txt": False,
    "\u00e9t\u00e9.pem": True, "\u00e9t\u00e9.PEM": True, "\u00e9t\u00e9.pen": False,
    "id_rsa": True, "ID_RSA": True, "xid_rsa": False,
    "a.key": True, "B.KEY": True, "c.key": False,
    "site.cert": True, "SITE.CERT": True, "site.certs": False,
    "caf\u00e9-menu": True, "cafe-menu": False,
}  # fmt: skip


def test_each_form_of_glob_matches_as_fnmatch_casefold(tmp_path: pathlib.Path) -> None:
    code = textwrap.dedent(
        f"""
        import os
        for name in {sorted(GLOB_NAMES)!r}:
            try:
                os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                print("made", name.encode().hex())
            except PermissionError:
                print("refused", name.encode().hex())
        """
    )
    result = py(code, str(tmp_path), globs=GLOB_FORMS)
    assert result.returncode == 0, result
    got = {bytes.fromhex(h).decode(): verdict == "refused" for verdict, h in
           (line.split() for line in result.stdout.splitlines())}  # fmt: skip
    assert got == GLOB_NAMES, result
    assert sorted(r.name for r in result.refused) == sorted(n for n, r in GLOB_NAMES.items() if r)
    assert {p.name for p in tmp_path.iterdir()} == {n for n, r in GLOB_NAMES.items() if not r}


def test_ordinary_work_still_works(tmp_path: pathlib.Path) -> None:
    (tmp_path / "existing.pem").write_text("old\n")
    script = """
        set -e
        echo edited >> existing.pem
        echo new > existing.pem
        echo env > .envrc
        echo key > key.txt
        mkdir pem
        echo in > pem/file
        mkdir -p deep/er/est
        echo x > deep/er/est/f
        mv key.txt key2.txt
        ln key2.txt key3.txt
        ln -s key2.txt key4.txt
        echo via > key4.txt
        mkfifo fifo
        (cat fifo > from-fifo &) ; echo through > fifo; wait
        printf a > /dev/null
        echo out > /dev/stdout
        echo err > /proc/self/fd/2
        cd deep && echo rel > ../rel.txt
    """
    result = sh(textwrap.dedent(script), str(tmp_path))
    assert result.returncode == 0, result
    assert result.refused == [] and result.faults == [], result
    assert (tmp_path / "existing.pem").read_text() == "new\n"
    assert (tmp_path / ".envrc").read_text() == "env\n"
    assert (tmp_path / "pem" / "file").read_text() == "in\n"
    assert (tmp_path / "key2.txt").read_text() == "via\n"
    assert os.path.samefile(tmp_path / "key2.txt", tmp_path / "key3.txt")
    assert (tmp_path / "rel.txt").read_text() == "rel\n"
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"


def test_an_existing_matching_file_may_be_opened_but_not_created_exclusively(
    tmp_path: pathlib.Path,
) -> None:
    (tmp_path / "there.pem").write_text("x")
    code = textwrap.dedent(
        """
        import os
        fd = os.open("there.pem", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.write(fd, b"y"); os.close(fd)
        try:
            os.open("there.pem", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except PermissionError:
            print("excl refused")
        """
    )
    result = py(code, str(tmp_path))
    assert result.stdout == "excl refused\n", result
    assert (tmp_path / "there.pem").read_text() == "xy"
    assert len(result.refused) == 1


def test_errno_is_the_kernels(tmp_path: pathlib.Path) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "dir").mkdir()
    os.symlink("file", tmp_path / "lnk")
    code = textwrap.dedent(
        """
        import errno, os
        cases = {
            "excl_existing": lambda: os.open("file", os.O_CREAT | os.O_EXCL | os.O_WRONLY),
            "missing_parent": lambda: os.open("nope/x", os.O_CREAT | os.O_WRONLY),
            "through_file": lambda: os.open("file/x", os.O_CREAT | os.O_WRONLY),
            "dir_creat": lambda: os.open("dir", os.O_CREAT | os.O_WRONLY),
            "trailing_slash": lambda: os.open("new/", os.O_CREAT | os.O_WRONLY),
            "nofollow_link": lambda: os.open("lnk", os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW),
            "excl_link": lambda: os.open("lnk", os.O_CREAT | os.O_EXCL | os.O_WRONLY),
            "bad_dirfd": lambda: os.open("x", os.O_CREAT | os.O_WRONLY, dir_fd=999),
            "file_dirfd": lambda: os.open("x", os.O_CREAT | os.O_WRONLY,
                                          dir_fd=os.open("file", os.O_RDONLY)),
            "mkdir_exists": lambda: os.mkdir("dir"),
            "mkdir_dot": lambda: os.mkdir("."),
            "rename_missing": lambda: os.rename("absent", "other"),
            "link_dir": lambda: os.link("dir", "dir2"),
            "symlink_exists": lambda: os.symlink("t", "file"),
            "long_name": lambda: os.open("n" * 300, os.O_CREAT | os.O_WRONLY),
        }
        for name, call in cases.items():
            try:
                call()
                print(name, "ok")
            except OSError as e:
                print(name, errno.errorcode[e.errno])
        """
    )
    result = py(code, str(tmp_path))
    got = dict(line.split() for line in result.stdout.splitlines())
    assert got == {
        "excl_existing": "EEXIST",
        "missing_parent": "ENOENT",
        "through_file": "ENOTDIR",
        "dir_creat": "EISDIR",
        "trailing_slash": "EISDIR",
        "nofollow_link": "ELOOP",
        "excl_link": "EEXIST",
        "bad_dirfd": "EBADF",
        "file_dirfd": "ENOTDIR",
        "mkdir_exists": "EEXIST",
        "mkdir_dot": "EEXIST",
        "rename_missing": "ENOENT",
        "link_dir": "EPERM",
        "symlink_exists": "EEXIST",
        "long_name": "ENAMETOOLONG",
    }, result
    assert result.refused == [] and result.faults == []


def test_mode_umask_and_owner_are_the_processes(tmp_path: pathlib.Path) -> None:
    code = textwrap.dedent(
        """
        import os
        os.umask(0o027)
        os.close(os.open("a", os.O_CREAT | os.O_WRONLY, 0o666))
        os.mkdir("d", 0o777)
        os.umask(0o000)
        os.close(os.open("b", os.O_CREAT | os.O_WRONLY, 0o604))
        os.close(os.open("c", os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600))
        import ctypes, fcntl
        libc = ctypes.CDLL(None)  # os.open always adds O_CLOEXEC; libc's open does not
        fd = libc.open(b"e", os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        print(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC, fcntl.fcntl(fd, fcntl.F_GETFL)
              & os.O_NONBLOCK)
        fd = libc.open(b"f", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
        print(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC,
              bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND))
        """
    )
    result = py(code, str(tmp_path))
    assert result.stdout.splitlines() == ["1 0", "0 True"], result
    mode = {n: stat.S_IMODE((tmp_path / n).stat().st_mode) for n in ("a", "d", "b")}
    assert mode == {"a": 0o640, "d": 0o750, "b": 0o604}
    assert (tmp_path / "a").stat().st_uid == os.geteuid()


def test_relative_paths_follow_the_threads_own_cwd_and_dirfd(tmp_path: pathlib.Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    code = textwrap.dedent(
        """
        import ctypes, os, threading
        CLONE_FS = 0x200
        def worker():
            assert ctypes.CDLL(None).unshare(CLONE_FS) == 0  # this thread's cwd is its own now
            os.chdir("two")
            open("from-thread", "w").close()
        os.chdir("one")
        t = threading.Thread(target=worker)
        os.chdir("..")
        t.start(); t.join()
        open("from-main", "w").close()
        d = os.open("one", os.O_RDONLY | os.O_DIRECTORY)
        os.close(os.open("via-dirfd", os.O_CREAT | os.O_WRONLY, dir_fd=d))
        """
    )
    result = py(code, str(tmp_path))
    assert result.returncode == 0, result
    assert _names(tmp_path) == {
        "one", "two", "two/from-thread", "from-main", "one/via-dirfd",
    }  # fmt: skip


@pytest.mark.parametrize("workers", [1, 2, 3])  # 2: what a sandbox runs
def test_a_fifo_without_a_reader_does_not_stall_other_creates(
    tmp_path: pathlib.Path, workers: int
) -> None:
    # One process blocks writing a FIFO nobody reads yet; meanwhile another creates files.
    script = """
        mkfifo fifo
        (echo hello > fifo; echo done > writer-done) &
        sleep 0.3
        for i in 1 2 3; do echo $i > other-$i; done
        test -e writer-done && exit 3
        cat fifo > got
        wait
    """
    result = sh(textwrap.dedent(script), str(tmp_path), workers=workers)
    assert result.returncode == 0, result
    assert (tmp_path / "got").read_text() == "hello\n"
    assert (tmp_path / "other-3").read_text() == "3\n"
    assert (tmp_path / "writer-done").read_text() == "done\n"


def _threads_and_fds() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def test_a_fifo_left_waiting_does_not_hold_the_supervisor_open(tmp_path: pathlib.Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    before = _threads_and_fds()
    launch = Launch(["/bin/sh", "-c", "echo hi > fifo"], str(tmp_path))
    with pytest.raises(subprocess.TimeoutExpired):
        launch.proc.wait(timeout=0.5)
    assert launch.proc.poll() is None  # blocked in open, as it would be natively
    assert _threads_and_fds()[0] > before[0]  # control: the workers and the helper are counted
    launch.proc.kill()
    result = launch.finish()  # stopping releases the waiting helper; this returns
    assert result.returncode == -9
    # Nothing of the supervisor outlives it: no worker or helper thread, no listener, pipe or
    # FIFO fd (a detached helper may still be returning for a moment after its last word).
    deadline = time.monotonic() + 5.0
    while _threads_and_fds() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads_and_fds() == before


def test_a_second_listener_cannot_be_installed(tmp_path: pathlib.Path) -> None:
    code = textwrap.dedent(
        """
        import ctypes, errno
        libc = ctypes.CDLL(None, use_errno=True)
        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
        insn = (ctypes.c_uint64 * 1)(0x7FFF0000 << 32 | 0x06)  # BPF_RET|BPF_K ALLOW
        prog = Prog(1, ctypes.addressof(insn))
        SYS_seccomp, SET_MODE_FILTER, NEW_LISTENER = 317, 1, 1 << 3
        r = libc.syscall(SYS_seccomp, SET_MODE_FILTER, NEW_LISTENER, ctypes.byref(prog))
        print(r, errno.errorcode.get(ctypes.get_errno()))
        r = libc.syscall(SYS_seccomp, SET_MODE_FILTER, 0, ctypes.byref(prog))
        print(r)
        """
    )
    result = py(code, str(tmp_path))
    assert result.stdout.splitlines() == ["-1 EPERM", "0"], result


# creat(path, 0644) through another ABI: i386 `int $0x80` (creat is 8 there) or x32 (the
# x86_64 number with bit 30). The path lives below 4 GiB so the 32-bit ABI can point at it.
FOREIGN_CREAT_C = r"""
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(int argc, char **argv) {
    char *low = mmap(NULL, 4096, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_32BIT, -1, 0);
    if (argc != 3 || low == MAP_FAILED)
        return 2;
    strncpy(low, argv[2], 4000);
    long r;
    if (strcmp(argv[1], "i386") == 0)
        __asm__ volatile("int $0x80" : "=a"(r) : "a"(8L), "b"(low), "c"(0644L) : "memory");
    else
        r = syscall(0x40000000L | 85, low, 0644);
    printf("%ld\n", r);
    return 0;
}
"""


@pytest.mark.parametrize("abi", ["i386", "x32"])
def test_another_abi_cannot_create_a_matching_name(tmp_path: pathlib.Path, abi: str) -> None:
    gcc = shutil.which("gcc")
    if platform.machine() != "x86_64" or gcc is None:
        pytest.skip("needs x86_64 and gcc")
    (tmp_path / "creat.c").write_text(FOREIGN_CREAT_C)
    program = tmp_path / "creat"
    subprocess.run([gcc, "-O1", "-o", str(program), str(tmp_path / "creat.c")], check=True)
    work = tmp_path / "work"
    work.mkdir()
    # Control: without the filter this ABI creates the name, or this kernel has no such ABI (x32
    # is often compiled out: the call fails with -1, ENOSYS, and creates nothing even unfiltered).
    # Either way the attempt is made under the filter, which must kill it before the kernel looks.
    native = subprocess.run([program, abi, "control.pem"], cwd=work, capture_output=True)
    if not (work / "control.pem").exists():
        assert abi == "x32" and native.stdout == b"-1\n", native
    result = run([str(program), abi, "x.pem"], str(work))
    assert not (work / "x.pem").exists(), result
    assert result.returncode == -signal.SIGSYS, result  # a foreign ABI kills (libseccomp)


def test_openat2_and_io_uring_are_refused(tmp_path: pathlib.Path) -> None:
    code = textwrap.dedent(
        """
        import ctypes, errno
        libc = ctypes.CDLL(None, use_errno=True)
        how = (ctypes.c_uint64 * 3)(0o100 | 1, 0o644, 0)  # O_CREAT|O_WRONLY
        r = libc.syscall(437, -100, b"x.txt", ctypes.byref(how), 24)
        print("openat2", errno.errorcode.get(ctypes.get_errno()))
        params = (ctypes.c_char * 120)()
        libc.syscall(425, 4, ctypes.byref(params))
        print("io_uring", errno.errorcode.get(ctypes.get_errno()))
        """
    )
    result = py(code, str(tmp_path))
    assert result.stdout.splitlines() == ["openat2 ENOSYS", "io_uring EPERM"], result
    assert _names(tmp_path) == set()


def test_without_a_supervisor_trapped_calls_fail_and_nothing_is_created(
    tmp_path: pathlib.Path,
) -> None:
    # The listener exists but nobody answers; then it is closed: every trapped call fails.
    launch = Launch(
        [PYTHON, "-c", "import os, sys; sys.stdin and None; open('a.txt','w')"],
        str(tmp_path),
        supervise=False,
    )
    os.close(launch.listener)
    launch.listener = os.open("/dev/null", os.O_RDONLY)  # finish() closes it
    result = launch.finish()
    assert result.returncode != 0
    assert "Function not implemented" in result.stderr
    assert _names(tmp_path) == set()


def test_reads_never_reach_the_supervisor(tmp_path: pathlib.Path) -> None:
    (tmp_path / "f").write_text("x")
    script = "import os\nfor _ in range(200): open('f').read(); os.stat('f'); os.listdir('.')"
    launch = Launch([PYTHON, "-c", script], str(tmp_path))
    assert launch.supervisor is not None
    assert launch.proc.wait(timeout=30) == 0
    handled = launch.supervisor.stats().handled
    launch.finish()
    assert handled == 1  # the launcher's exec of the command, noted and let run; no read


def test_a_racing_thread_never_gets_a_matching_name_created(tmp_path: pathlib.Path) -> None:
    # One thread flips the path buffer between ok.txt and ok.pem while another opens it.
    code = textwrap.dedent(
        """
        import ctypes, os, threading
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(b"ok.txt")
        stop = False
        def flip():
            while not stop:
                ctypes.memmove(buf, b"ok.pem", 6)
                ctypes.memmove(buf, b"ok.txt", 6)
        t = threading.Thread(target=flip); t.start()
        made = refused = 0
        for _ in range(3000):
            fd = libc.open(buf, os.O_CREAT | os.O_WRONLY, 0o644)
            if fd >= 0:
                made += 1; libc.close(fd)
            else:
                refused += 1
        stop = True; t.join()
        print(made, refused)
        """
    )
    result = py(code, str(tmp_path))
    made, refused = map(int, result.stdout.split())
    assert made + refused == 3000, result
    # A torn copy of the buffer can name ok.pxt or ok.tem (allowed names); never ok.pem.
    created = _names(tmp_path)
    assert "ok.pem" not in created and all(n.startswith("ok.") for n in created), created
    assert len(result.refused) == refused
    assert {r.name for r in result.refused} <= {"ok.pem"}


def test_a_rename_exchange_cannot_put_an_inode_at_a_matching_name(tmp_path: pathlib.Path) -> None:
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.pem").write_text("b")
    code = textwrap.dedent(
        """
        import ctypes, errno
        libc = ctypes.CDLL(None, use_errno=True)
        r = libc.renameat2(-100, b"a.txt", -100, b"b.pem", 2)  # RENAME_EXCHANGE
        print(r, errno.errorcode.get(ctypes.get_errno()))
        """
    )
    result = py(code, str(tmp_path))
    assert result.stdout.strip() == "-1 EACCES", result
    assert (tmp_path / "b.pem").read_text() == "b"


def test_run_accepts_other_globs(tmp_path: pathlib.Path) -> None:
    result = run(["/bin/sh", "-c", "echo > a.pem; echo > b.secret"], str(tmp_path),
                 globs=("*.secret",))
    assert [r.name for r in result.refused] == ["b.secret"]
    assert _names(tmp_path) == {"a.pem"}


def test_the_task_cache_follows_every_umask_change_of_every_thread(tmp_path: pathlib.Path) -> None:
    # What the supervisor read of a task is reused for its next calls; a umask() by any thread
    # (they share one umask) must reach the very next create of every thread, every time.
    code = textwrap.dedent(
        """
        import os, threading
        def create(name):
            os.close(os.open(name, os.O_CREAT | os.O_WRONLY, 0o666))
        def in_thread(fn):
            t = threading.Thread(target=fn); t.start(); t.join()
        os.umask(0o022)
        for i in range(20):
            create(f"warm-{i}")  # the second and later calls come from the cache
        in_thread(lambda: create("t-022"))
        in_thread(lambda: os.umask(0o077))  # another thread changes the shared umask
        create("m-077")
        in_thread(lambda: create("t-077"))
        os.umask(0o027)
        create("m-027")
        os.umask(0o027)  # a change to the same value
        create("m-027-again")
        os.umask(0o000)
        os.mkdir("d-000", 0o777)
        os.setuid(os.getuid()); os.setresgid(-1, -1, -1)  # no capability: cannot change ids
        for i in range(20):
            create(f"late-{i}")  # still cached
        """
    )
    launch = Launch([PYTHON, "-c", code], str(tmp_path))
    assert launch.supervisor is not None
    assert launch.proc.wait(timeout=30) == 0
    stats = launch.supervisor.stats()
    result = launch.finish()
    assert result.reports == [], result
    mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert {n: m for n, m in mode.items() if not n.startswith(("warm-", "late-"))} == {
        "t-022": 0o644, "m-077": 0o600, "t-077": 0o600, "m-027": 0o640, "m-027-again": 0o640,
        "d-000": 0o777,
    }  # fmt: skip
    assert {mode[f"warm-{i}"] for i in range(20)} == {0o644}
    assert {mode[f"late-{i}"] for i in range(20)} == {0o666}
    # Each worker reads a task once (the kit runs three) and again after each umask; the rest
    # of both loops is cached: set*id calls that cannot change the ids leave the cache alone.
    assert stats.cache_hits >= 2 * (20 - 3 - 1), stats


def test_a_child_process_gets_its_own_umask_not_its_parents_cached_one(
    tmp_path: pathlib.Path,
) -> None:
    # A fork copies the umask; afterwards parent and child change theirs independently.
    script = """
        umask 022; echo > p1
        (umask 077; echo > c1; echo > c2) &
        wait
        echo > p2
        umask 007; echo > p3
    """
    result = sh(textwrap.dedent(script), str(tmp_path))
    assert result.returncode == 0, result
    mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert mode == {"p1": 0o644, "c1": 0o600, "c2": 0o600, "p2": 0o644, "p3": 0o660}


def test_state_calls_run_natively_and_report_nothing(tmp_path: pathlib.Path) -> None:
    # umask and the set*id calls are trapped only to keep the cache true: they run as the
    # kernel runs them (the launcher left no capability, so taking other ids is refused, and a
    # refused setfsgid changes nothing) and never count as a create.
    code = textwrap.dedent(
        """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print(oct(os.umask(0o077)), oct(os.umask(0o022)))
        os.setuid(os.getuid()); os.setgid(os.getgid()); os.setresuid(-1, -1, -1)
        for call in (lambda: os.setgroups(os.getgroups()), lambda: os.setuid(os.getuid() + 1)):
            try:
                call()
                print("ok")
            except PermissionError:
                print("EPERM")
        print(libc.setfsgid(4242) == os.getegid(), libc.setfsgid(4242) == os.getegid())
        open("after", "w").close()
        print(os.stat("after").st_gid == os.getegid())
        """
    )
    old = os.umask(0o022)
    os.umask(old)
    launch = Launch([PYTHON, "-c", code], str(tmp_path))
    assert launch.supervisor is not None
    assert launch.proc.wait(timeout=30) == 0
    handled = launch.supervisor.stats().handled
    result = launch.finish()
    assert result.stdout.splitlines() == [
        f"{oct(old)} 0o77", "EPERM", "EPERM", "True True", "True",
    ], result  # fmt: skip
    assert result.reports == []
    assert handled >= 9, handled  # the state calls did reach the supervisor, and one create


def test_an_exec_from_another_thread_does_not_inherit_the_leaders_cached_umask(
    tmp_path: pathlib.Path,
) -> None:
    # A thread with its own umask (unshare(CLONE_FS)) that execs takes over the leader's thread
    # id: the new program's creates must use that thread's umask, not what was cached for the id.
    code = textwrap.dedent(
        """
        import ctypes, os, threading
        libc = ctypes.CDLL(None, use_errno=True)
        os.umask(0o022)
        open("before", "w").close()
        ready, go = threading.Event(), threading.Event()
        def thread():
            assert libc.unshare(0x200) == 0  # CLONE_FS: a umask of its own
            os.umask(0o077)
            ready.set()
            go.wait()
            os.execv("/bin/sh", ["sh", "-c", "echo > after"])
        threading.Thread(target=thread).start()
        ready.wait()
        open("mid", "w").close()  # the leader's own umask, read again after the change
        go.set()
        threading.Event().wait()  # the exec replaces the whole process
        """
    )
    for _ in range(5):  # one worker, so the id's cached entry is the one consulted
        for p in tmp_path.iterdir():
            p.unlink()
        result = py(code, str(tmp_path), workers=1)
        assert result.returncode == 0, result
        mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
        assert mode == {"before": 0o644, "mid": 0o644, "after": 0o600}


def test_the_sync_wake_up_flag_takes_where_the_kernel_has_it(tmp_path: pathlib.Path) -> None:
    # SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP (6.6+) keeps the task and the supervisor on one CPU;
    # the library reports whether the kernel took it instead of assuming so.
    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    launch = Launch(["/bin/true"], str(tmp_path))
    assert launch.supervisor is not None
    assert launch.proc.wait(timeout=30) == 0
    stats = launch.supervisor.stats()
    launch.finish()
    assert stats.sync_wake == (release >= (6, 6)), (release, stats)
