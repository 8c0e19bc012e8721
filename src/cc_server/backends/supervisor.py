"""The Linux create-time filename rules: no new `.env`, `*.key` or `*.pem` inside the sandbox.

bubblewrap can hide or freeze a path that exists; it cannot refuse a name that does not exist yet.
This module adds that, with seccomp user notification (`SECCOMP_RET_USER_NOTIF`):

- `notify_filter_bpf()` is the filter. It traps what can bring a name into existence:
  `open`/`openat` when O_CREAT is set (checked in BPF, so plain opens never leave the kernel),
  `creat`, `mknod(at)`, `mkdir(at)`, `link(at)`, `symlink(at)`, `rename`, `renameat(2)` and
  every `bind` (the sockaddr is in memory BPF cannot read); and `umask`, the `set*id` calls and
  `execve(at)`, which the supervisor lets run once it has noted them, so it can keep what it read
  of a task instead of reading `/proc/<tid>/status` for every create; and `clone`, `clone3`,
  `fork`, `vfork` and `sched_{set,get}affinity`, let run once a task held to one CPU for a run of
  opens has its affinity back (docs/launch.md). `openat2` gets ENOSYS (its
  flags are in memory too; libc callers fall back), io_uring EPERM (its operations bypass
  seccomp), and a `seccomp()` call asking for another listener EPERM: a newer filter's listener
  would receive the notifications first and could answer them itself.
- `native/launcher.c` runs inside the sandbox as the last step before the command. It installs
  the filter with raw `seccomp(2)` and NEW_LISTENER | WAIT_KILLABLE_RECV (libseccomp 2.5 cannot
  set the latter; without it a signal can make an emulated create run twice), sends the
  listener to the server over an inherited socket, closes it, and execs the command. As the
  sandbox's PID 1 (bwrap --as-pid-1) it stays on as the reaper, so no process inside lacks the
  filter.
- `native/supervisor*.c` (one shared library, loaded here with ctypes; `supervisor.h` maps its
  files) answers the notifications from worker threads inside the server, never from Python and
  never with "continue": it resolves each path itself in the trapping thread's view, creates
  what is allowed on pinned parent fds, hands opened files back with SECCOMP_IOCTL_NOTIF_ADDFD,
  and refuses a matching name with EACCES. The module comment of `supervisor.c` lists every
  step.

Why compiled, and why these two pieces: the Python spike cost ~110 µs per create; the C workers
spend ~10 µs of CPU per create before the answer (plus the create itself), have no GIL to share
with the server's event loop, and can drop their capabilities and unshare their fs attributes
per thread. The rest of what a create costs on a 2-vCPU VM is the kernel switching to the
supervisor and back (docs/SPEC.md, P131). The launcher must be a separate executable because it
runs inside the sandbox, where the server's Python is not.
Both are built by `scripts/bootstrap` with gcc; the probe reports the capability only when both
exist and the kernel passes the launcher's `--selftest`.

Globs match one file name, case-insensitively (so `X.PEM` cannot alias `x.pem` on a
case-folding filesystem), with `fnmatch` rules: `*` also matches a leading dot.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import socket
import stat
import struct
import subprocess
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from cc_server.backends.seccomp import export_bpf
from cc_server.errors import EnforcementFailed

if TYPE_CHECKING:
    import asyncio

    from cc_server.backends.plan import CreateRules, SandboxIdentity

__all__ = [
    "ABI_VERSION",
    "FS_SYSCALLS",
    "GUEST_LAUNCHER",
    "LAUNCHER_NAME",
    "LIBRARY_NAME",
    "NATIVE_DIR",
    "STATE_SYSCALLS",
    "TRAPPED_SYSCALLS",
    "CreateRefused",
    "CreateRuleSupervisor",
    "CreateRulesCheck",
    "LauncherEnds",
    "PathRules",
    "Report",
    "SupervisorFault",
    "SupervisorStats",
    "check_create_rules",
    "notify_filter_bpf",
    "path_rules",
    "receive_listener",
    "stop_supervisor",
    "watch_reports",
]

log = logging.getLogger("cc_server.backends.supervisor")
ABI_VERSION: Final = 10  # must equal CCS_ABI_VERSION in native/supervisor.c
NATIVE_DIR: Final = Path(__file__).resolve().parent / "native"
LAUNCHER_NAME: Final = "cc-create-launcher"
LIBRARY_NAME: Final = "libcc-create-supervisor.so"
GUEST_LAUNCHER: Final = "/run/cc-create/launcher"  # where the sandbox sees the launcher
SELFTEST_TIMEOUT_S: Final = 10.0  # one fork and one notification; milliseconds normally
LISTENER_TIMEOUT_S: Final = 10.0  # from spawning bwrap to the launcher's listener arriving
# Worker threads per sandboxed command. The first takes every call while one task at a time
# makes them: an open is answered with the task kept on that worker's CPU (hold_here in
# native/supervisor_cpu.c), so the worker is back before the task's next call, and a second worker
# polling too would only be woken with it for every call (tar x of 10,000 files on tmpfs, 2 vCPUs:
# ~24 us added per create with the second on standby, ~38 with both polling). When calls of two
# tasks overlap, the second joins for a while and no task is held to a CPU: two tar x at once
# then cost what they did before the CPU hold (~0.65 s for 2 x 10,000 files), where one worker
# alone took 0.74-1.0 s. FIFO waits go to helper threads either way.
WORKERS: Final = 2
REPORT_PIPE_BYTES: Final = 1 << 20  # room for ~500 refusals the event loop has not read yet

# Trapped unconditionally (open and openat only with O_CREAT). Names a libseccomp build does not
# know on an architecture (open, creat, ... on arm64) are skipped by libseccomp itself.
TRAPPED_SYSCALLS: Final[tuple[tuple[str, str], ...]] = (
    ("creat", "creates its path"),
    ("mknod", "creates a file, FIFO or socket node"),
    ("mknodat", "creates a file, FIFO or socket node"),
    ("mkdir", "creates a directory"),
    ("mkdirat", "creates a directory"),
    ("link", "gives an inode a new name"),
    ("linkat", "gives an inode a new name (also an O_TMPFILE file by fd)"),
    ("symlink", "creates a symlink"),
    ("symlinkat", "creates a symlink"),
    ("rename", "moves an inode to a new name"),
    ("renameat", "moves an inode to a new name"),
    ("renameat2", "moves or exchanges names"),
    ("bind", "an AF_UNIX pathname socket creates a name; the family is in memory"),
)
# Trapped so the supervisor can cache what it reads of a task: these are the only calls that
# change its umask or its fs credentials, and an exec by a thread that does not lead its group
# takes over the leader's thread id. None creates a name; the supervisor notes the change and
# lets them run (SECCOMP_USER_NOTIF_FLAG_CONTINUE).
STATE_SYSCALLS: Final[tuple[str, ...]] = (
    "umask", "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid",
    "setfsuid", "setfsgid", "setgroups", "execve", "execveat",
)  # fmt: skip
# Trapped so the supervisor can keep a thread's cwd and root between its calls: the only calls
# that change them (the sandbox's own filter refuses all but chdir and fchdir before they get
# here). Let run once noted.
FS_SYSCALLS: Final[tuple[str, ...]] = (
    "chdir", "fchdir", "chroot", "pivot_root", "setns", "unshare",
)  # fmt: skip
# Trapped as well when the write policy has path rules (protected patterns or paths): what changes
# a name or a file that exists. Decided on the path the supervisor resolves itself, then done for
# the task (fchmodat2 is 452 on every architecture; older libseccomp releases lack its name).
WRITE_SYSCALLS: Final[tuple[tuple[str | int, str], ...]] = (
    ("unlink", "removes a name"),
    ("unlinkat", "removes a name or a directory"),
    ("rmdir", "removes a directory"),
    ("truncate", "changes a file's data"),
    ("connect", "a host process's Unix socket in a bind stays out (the launcher's connector)"),
)
# Refused outright with the path rules (EOPNOTSUPP, what a filesystem without xattrs answers, which
# cp -a, tar and rsync take in their stride): a POSIX ACL is a mode change (it made a hook 0777),
# and judging every name and value is not worth what xattrs are used for in a sandbox.
# setxattrat and removexattrat (Linux 6.13) are 463 and 466 on every architecture.
XATTR_WRITE_SYSCALLS: Final[tuple[str | int, ...]] = (
    "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr", 463, 466,
)  # fmt: skip
# Trapped with the path rules only when the new mode has an execute bit: a mode without one arms
# nothing (a hook runs only when executable; set-id bits are the sandbox's own filter's), and tar
# x restores a mode for every file it makes. Which argument holds the mode (fchmodat2 is 452).
CHMOD_SYSCALLS: Final[tuple[tuple[str | int, int], ...]] = (
    ("chmod", 1), ("fchmod", 1), ("fchmodat", 2), (452, 2),
)  # fmt: skip
EXEC_BITS: Final = (0o100, 0o010, 0o001)
# A task's own Landlock domain does not bind the supervisor and the connector, which act for it:
# with the path rules Landlock is absent (ENOSYS), so a nested sandbox does not believe in rules
# nobody enforces. landlock_create_ruleset, _add_rule and _restrict_self are 444-446 everywhere.
LANDLOCK_SYSCALLS: Final = (444, 445, 446)
# An open of an existing file that can change its data: for writing, or with O_TRUNC.
WRITE_OPEN_FLAGS: Final = (os.O_WRONLY, os.O_RDWR, os.O_TRUNC)
SECCOMP_SET_MODE_FILTER: Final = 1
SECCOMP_FILTER_FLAG_NEW_LISTENER: Final = 1 << 3
SECCOMP_LISTENER_LINK: Final = "anon_inode:seccomp notify"  # readlink of a listener fd


@functools.cache
def notify_filter_bpf(*, writes: bool = False) -> bytes:
    """The create-rule filter as classic BPF bytes, for the launcher's `--filter` fd. With
    `writes` (the write policy has path rules) it traps `WRITE_SYSCALLS` and the opens of
    `WRITE_OPEN_FLAGS` too.

    Raises:
        OSError: libseccomp is missing or refused a rule (the caller refuses the launch).
    """
    import pyseccomp as sc  # lazy import (loads libseccomp via ctypes; only when planning)

    flt = sc.SyscallFilter(sc.ALLOW)
    flt.add_rule(sc.NOTIFY, "open", sc.Arg(1, sc.MASKED_EQ, os.O_CREAT, os.O_CREAT))
    flt.add_rule(sc.NOTIFY, "openat", sc.Arg(2, sc.MASKED_EQ, os.O_CREAT, os.O_CREAT))
    for name, _reason in TRAPPED_SYSCALLS:
        flt.add_rule(sc.NOTIFY, name)
    for name in (*STATE_SYSCALLS, *FS_SYSCALLS):
        flt.add_rule(sc.NOTIFY, name)
    if writes:
        for flag in WRITE_OPEN_FLAGS:
            flt.add_rule(sc.NOTIFY, "open", sc.Arg(1, sc.MASKED_EQ, flag, flag))
            flt.add_rule(sc.NOTIFY, "openat", sc.Arg(2, sc.MASKED_EQ, flag, flag))
        for call, _why in WRITE_SYSCALLS:
            flt.add_rule(sc.NOTIFY, call)
        for call in XATTR_WRITE_SYSCALLS:
            flt.add_rule(sc.ERRNO(errno.EOPNOTSUPP), call)
        for call in LANDLOCK_SYSCALLS:
            flt.add_rule(sc.ERRNO(errno.ENOSYS), call)
        for call, index in CHMOD_SYSCALLS:
            for bit in EXEC_BITS:
                flt.add_rule(sc.NOTIFY, call, sc.Arg(index, sc.MASKED_EQ, bit, bit))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "openat2")
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register"):
        flt.add_rule(sc.ERRNO(errno.EPERM), name)
    flt.add_rule(
        sc.ERRNO(errno.EPERM),
        "seccomp",
        sc.Arg(0, sc.EQ, SECCOMP_SET_MODE_FILTER),
        sc.Arg(1, sc.MASKED_EQ, SECCOMP_FILTER_FLAG_NEW_LISTENER, SECCOMP_FILTER_FLAG_NEW_LISTENER),
    )
    return export_bpf(flt, "cc-write-filter" if writes else "cc-create-filter")


# --- the probe's check ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateRulesCheck:
    """Whether this host can enforce create-time filename rules, and with what."""

    available: bool
    launcher: str | None = None
    """Absolute path of the launcher, when available."""
    library: str | None = None
    """Absolute path of the supervisor library, when available."""
    hint: str | None = None
    """Why not, and the fix; None when available."""


_BUILD_HINT = "build it with scripts/bootstrap (needs gcc and the C library headers)"


def _absent(hint: str) -> CreateRulesCheck:
    return CreateRulesCheck(available=False, hint=hint)


def check_create_rules(native_dir: Path = NATIVE_DIR) -> CreateRulesCheck:
    """Look for the launcher and the supervisor library in `native_dir` and check the kernel
    with `launcher --selftest` (user notification with ADDFD_FLAG_SEND and WAIT_KILLABLE_RECV).

    Raises nothing: every failure is an unavailable result with a hint.
    """
    launcher = native_dir / LAUNCHER_NAME
    library = native_dir / LIBRARY_NAME
    missing = [p.name for p in (launcher, library) if not p.is_file()]
    if missing:
        return CreateRulesCheck(
            available=False,
            hint=f"the create-rule supervisor is not built ({', '.join(missing)} missing in "
            f"{native_dir}); {_BUILD_HINT}",
        )
    if not os.access(launcher, os.X_OK):
        return _absent(f"{launcher} is not executable; {_BUILD_HINT}")
    try:
        done = subprocess.run(
            [str(launcher), "--selftest"],
            env={},
            cwd="/",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=SELFTEST_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return CreateRulesCheck(available=False, hint=f"the launcher selftest failed: {exc}")
    if done.returncode != 0:
        said = (done.stdout + done.stderr).decode(errors="replace").strip() or (
            f"exit status {done.returncode}"
        )
        return CreateRulesCheck(
            available=False, hint=f"this kernel cannot run the create-rule supervisor: {said}"
        )
    try:
        version = _library(str(library)).ccs_abi_version()
    except OSError as exc:
        return _absent(f"cannot load {library}: {exc}; {_BUILD_HINT}")
    if version != ABI_VERSION:
        return CreateRulesCheck(
            available=False,
            hint=f"{library} has ABI {version}, this cc-server needs {ABI_VERSION}; {_BUILD_HINT}",
        )
    return CreateRulesCheck(available=True, launcher=str(launcher), library=str(library))


# --- the supervisor ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateRefused:
    """A call the supervisor refused (the process got EACCES): a name's creation, or with the
    write policy's path rules, a change to a protected name or file."""

    syscall: str
    target: str
    """The path as the process named it (for a rename or link: the new path)."""
    name: str
    """The name that would have been created (through a symlink, the link's target's name)."""
    glob: str
    """The rule it matched: a glob, a protected pattern or path, or why the call was refused."""
    keeper: int | None = None
    """In a session sandbox: the pid (in the sandbox) of the keeper the process runs under,
    which tells the command that made the call (runtime/session_sandbox.py)."""
    action: str = "file-write-create"
    """The reference page's verb: file-write-create, -data, -unlink, -rename, -mode, or
    file-read-data (an O_CREAT open that would only have read a protected file)."""
    resolved: str = ""
    """The path that was judged, absolute in the sandbox's view (never a /proc/self/fd link);
    empty when it could not be read."""

    @property
    def judged_target(self) -> str:
        """The violation's target: the resolved path, or as named when that is unknown."""
        return self.resolved or self.target

    @property
    def reason(self) -> str:
        """Why, in one phrase (SandboxViolation.reason)."""
        if " " in self.glob:
            return self.glob
        return f"the sandbox's write policy protects it (matches {self.glob!r})"

    @property
    def raw(self) -> str:
        """One line for logs and SandboxViolation.raw."""
        verb = _VERBS.get(self.action, "write")
        notes = []
        if self.resolved and self.resolved != self.target:
            notes.append(f"as named: {self.target!r}")
        notes.append(self.glob if " " in self.glob else f"matches {self.glob!r}")
        subject = self.resolved or self.name
        return f"{self.syscall}: refused to {verb} {subject!r} ({'; '.join(notes)})"


_VERBS: Final = {
    "file-write-create": "create",
    "file-write-data": "write",
    "file-write-unlink": "remove",
    "file-write-rename": "rename",
    "file-write-mode": "change the mode of",
    "file-read-data": "open",
    "network-outbound": "connect to",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorFault:
    """A notification the supervisor could not decode or emulate; the call was refused."""

    syscall: str
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorStats:
    """What one supervisor has done so far."""

    handled: int
    """Notifications received (every trapped call)."""
    refused: int
    faults: int
    dropped_reports: int
    """Reports lost because the pipe was full (the refusals themselves still happened)."""
    busy_s: float
    """Time the workers spent handling notifications, from RECV to the answer."""
    cache_hits: int
    """Notifications answered without reading the task's /proc status again."""
    sync_wake: bool
    """The kernel wakes the task and the supervisor on the waker's CPU
    (`SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP`, Linux 6.6+)."""
    replies_here: int
    """Opens answered with the task kept on the worker's CPU for the fd's installation."""


Report = CreateRefused | SupervisorFault
_LENGTH = struct.Struct("<I")
_NSTATS: Final = 8  # ccs_stats fills this many counters


class _Handle(ctypes.c_void_p):
    """The library's `struct ccs *`."""


@functools.cache
def _library(path: str) -> ctypes.CDLL:
    """The supervisor library with its functions typed.

    Raises:
        OSError: it cannot be loaded or lacks one of the functions (a library of another build).
    """
    lib = ctypes.CDLL(path)
    try:
        lib.ccs_abi_version.restype = ctypes.c_int
        lib.ccs_abi_version.argtypes = []
        lib.ccs_start.restype = _Handle
        lib.ccs_start.argtypes = [
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
            ctypes.c_int, ctypes.c_int, ctypes.c_uint, ctypes.c_longlong, ctypes.c_longlong,
            ctypes.c_char_p, ctypes.c_size_t,
        ]  # fmt: skip
        lib.ccs_stop.restype = None
        lib.ccs_stop.argtypes = [_Handle]
        lib.ccs_stats.restype = None
        lib.ccs_stats.argtypes = [_Handle, ctypes.POINTER(ctypes.c_ulonglong * _NSTATS)]
    except AttributeError as exc:  # ctypes names the missing function
        raise OSError(f"not the library this cc-server was built with: {exc}") from exc
    return lib


def _parse(buffer: bytearray) -> list[Report]:
    """Take every complete record off the front of `buffer`."""
    reports: list[Report] = []
    while len(buffer) >= _LENGTH.size:
        (length,) = _LENGTH.unpack_from(buffer)
        if len(buffer) < _LENGTH.size + length:
            break
        body = bytes(buffer[_LENGTH.size : _LENGTH.size + length])
        del buffer[: _LENGTH.size + length]
        fields = [os.fsdecode(f) for f in body.split(b"\0")]
        if len(fields) < 5:
            continue  # not a record this version writes
        kind, syscall, target, name, detail = fields[:5]
        keeper, action, resolved = (*fields[5:8], "", "", "")[:3]
        if kind == "R":
            reports.append(CreateRefused(
                syscall=syscall, target=target, name=name, glob=detail,
                keeper=int(keeper) if keeper.isdigit() else None,
                action=action or "file-write-create", resolved=resolved,
            ))  # fmt: skip
        else:
            reports.append(SupervisorFault(syscall=syscall, detail=detail))
    return reports


@dataclass(frozen=True, slots=True, kw_only=True)
class PathRules:
    """The write policy's path rules, decided by the supervisor on the path in the task's view
    (the pinned directory's own path, never the string the task passed).

    `patterns` ("X", or "X/**" for X and everything below it; '*' stays in one component) are
    matched on the trailing components of a path below the outermost of `roots` that holds it
    (a writable bind nested in another, say a `.git` bound on its own, is judged by its place
    in the outer one), unless one of `exempt` (a runner's state directory) holds it;
    `absolute` paths are refused wherever they are, with everything below them.
    """

    patterns: tuple[str, ...] = ()
    roots: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()
    absolute: tuple[str, ...] = ()
    host_sockets: tuple[str, ...] = ()
    """Directories whose host listeners a command may connect to (a bind that allows them);
    any other pathname Unix socket must be bound inside the sandbox."""


def path_rules(rules: CreateRules) -> PathRules:
    """A plan's path rules, for `CreateRuleSupervisor.start`."""
    return PathRules(
        patterns=rules.patterns, roots=rules.roots, exempt=rules.exempt, absolute=rules.absolute,
        host_sockets=rules.host_sockets,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class LauncherEnds:
    """What the launcher hands the supervisor: its seccomp listener, its connector's control
    socket (connects made inside the sandbox) and a sock_diag socket of its network namespace."""

    listener: int
    connector: int
    diag: int

    def close(self) -> None:
        for fd in (self.listener, self.connector, self.diag):
            with contextlib.suppress(OSError):
                os.close(fd)


class CreateRuleSupervisor:
    """The supervisor of one sandbox (a session's, or one command's own): native worker threads
    answering its listener.

    Reports (refusals and faults) arrive on `report_fd`; call `drain()` when it is readable.
    `close()` stops the workers, closes the listener (calls still pending then fail with
    ENOSYS) and returns the last reports; it is idempotent.
    """

    def __init__(self, handle: _Handle, lib: ctypes.CDLL, report_fd: int) -> None:
        self._handle: _Handle | None = handle
        self._lib = lib
        self.report_fd = report_fd
        self._buffer = bytearray()
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls,
        listener: int | LauncherEnds,
        globs: Iterable[str],
        *,
        library: str,
        workers: int = WORKERS,
        sync_wake: bool = True,
        reply_here: bool = True,
        identity: SandboxIdentity | None = None,
        paths: PathRules | None = None,
    ) -> CreateRuleSupervisor:
        """Supervise `listener` (taken over, closed on failure too) for names matching `globs`.
        With the launcher's `LauncherEnds`, connects are decided too (a bare listener, as in the
        library's own tests, answers a trapped connect with EPERM).

        `sync_wake` asks the kernel to wake the task and the workers on each other's CPU;
        `reply_here` keeps the task on the worker's CPU while an opened file is handed to it.
        `paths` are the write policy's path rules (`PathRules`), decided on the path actually
        created, renamed or linked, below the writable roots.
        `identity` is the sandbox's host identity when it is not the server's own (a root
        server's, `LaunchPlan.identity`): the workers take on its uid and gid.

        Raises:
            EnforcementFailed: the library could not be loaded or its workers not started.
        """
        entries = [("g", g) for g in globs]
        if paths is not None:
            entries += [("p", p) for p in paths.patterns]
            entries += [("r", r) for r in paths.roots]
            entries += [("x", x) for x in paths.exempt]
            entries += [("a", a) for a in paths.absolute]
            entries += [("s", d) for d in paths.host_sockets]
        blob = b"".join(os.fsencode(f"{kind}:{text}") + b"\0" for kind, text in entries)
        ends = listener if isinstance(listener, LauncherEnds) else LauncherEnds(listener, -1, -1)
        try:
            lib = _library(library)
            read_fd, write_fd = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            ends.close()
            raise EnforcementFailed(f"cannot start the create-rule supervisor: {exc}") from exc
        with contextlib.suppress(OSError):  # a smaller pipe only means reports drop sooner
            fcntl_setpipe_sz(write_fd, REPORT_PIPE_BYTES)
        error = ctypes.create_string_buffer(256)
        flags = (1 if sync_wake else 0) | (2 if reply_here else 0)
        uid, gid = (identity.uid, identity.gid) if identity is not None else (-1, -1)
        handle = lib.ccs_start(
            ends.listener, ends.connector, ends.diag, blob, len(blob), write_fd, workers, flags,
            uid, gid, error, 256,
        )  # fmt: skip
        if not handle:  # the library closed the ends and the pipe's write end
            os.close(read_fd)
            raise EnforcementFailed(
                f"cannot start the create-rule supervisor: {error.value.decode(errors='replace')}"
            )
        return cls(handle, lib, read_fd)

    def drain(self) -> list[Report]:
        """The reports written since the last call, without blocking."""
        with self._lock:
            if self.report_fd < 0:
                return []
            while True:
                try:
                    chunk = os.read(self.report_fd, 65536)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                self._buffer += chunk
            return _parse(self._buffer)

    def stats(self) -> SupervisorStats:
        """Counters so far (zeros once closed)."""
        out = (ctypes.c_ulonglong * _NSTATS)()
        with self._lock:
            if self._handle is not None:
                self._lib.ccs_stats(self._handle, ctypes.byref(out))
        return SupervisorStats(
            handled=out[0],
            refused=out[1],
            faults=out[2],
            dropped_reports=out[3],
            busy_s=out[4] / 1e9,
            cache_hits=out[5],
            sync_wake=bool(out[6]),
            replies_here=out[7],
        )

    def close(self) -> list[Report]:
        """Stop the workers (blocking: call it off the event loop) and return the last reports."""
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            self._lib.ccs_stop(handle)  # ctypes releases the GIL meanwhile
        reports = self.drain()
        with self._lock:
            if self.report_fd >= 0:
                os.close(self.report_fd)
                self.report_fd = -1
        return reports


def fcntl_setpipe_sz(fd: int, size: int) -> None:
    """F_SETPIPE_SZ (Linux); raises OSError when refused."""
    import fcntl

    fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)


# --- handing the listener over ------------------------------------------------------------------


def _is_listener(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == SECCOMP_LISTENER_LINK
    except OSError:
        return False


async def receive_listener(
    sock: socket.socket, timeout_s: float = LISTENER_TIMEOUT_S
) -> LauncherEnds:
    """Wait for the launcher's listener, connector and sock_diag socket on `sock` (the server's
    end of the socketpair).

    Raises:
        EnforcementFailed: the launcher exited or sent something else, or nothing came in
            `timeout_s`; the command has not run (the launcher execs it only after sending).
    """
    from cc_server.backends.fdpass import receive_fds  # lazy import: asyncio

    what = "seccomp listener"
    fds = await receive_fds(sock, tag=b"L", count=3, timeout_s=timeout_s, what=what)
    ends = LauncherEnds(*fds)
    if not _is_listener(ends.listener) or not all(map(_is_socket, (ends.connector, ends.diag))):
        ends.close()
        raise EnforcementFailed(f"the launcher sent something other than its {what}")
    return ends


def _is_socket(fd: int) -> bool:
    try:
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError:
        return False


async def stop_supervisor(
    supervisor: CreateRuleSupervisor, on_report: Callable[[Report], None]
) -> None:
    """Stop `supervisor` off the event loop and pass its last reports to `on_report`."""
    import asyncio

    loop = asyncio.get_running_loop()
    with contextlib.suppress(ValueError, OSError):
        loop.remove_reader(supervisor.report_fd)
    dropped = supervisor.stats().dropped_reports
    for report in await asyncio.to_thread(supervisor.close):
        on_report(report)
    if dropped:
        log.warning("create-rule supervisor: %d refusal reports were lost (pipe full)", dropped)


def watch_reports(
    loop: asyncio.AbstractEventLoop,
    supervisor: CreateRuleSupervisor,
    on_report: Callable[[Report], None],
) -> None:
    """Pass every report to `on_report` as soon as the event loop sees the pipe readable."""

    def readable() -> None:
        for report in supervisor.drain():
            on_report(report)

    loop.add_reader(supervisor.report_fd, readable)
