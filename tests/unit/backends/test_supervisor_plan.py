"""The create-rule supervisor's pure and glue parts: the plan's launcher step, the runner's fd
slots, the report pipe's records, the listener hand-over, and the probe's check. Nothing here needs
bubblewrap; the filter itself is run against the kernel in test_supervisor_rules.py."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import struct
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from plan_kit import BWRAP, FAKE_BPF, FAKE_RULES_BPF, TOOLS, fake_host, work_policy

from cc_server.backends import bubblewrap as bwrap_mod
from cc_server.backends import supervisor as sup
from cc_server.backends.bubblewrap import CreateRuleTools, plan_bubblewrap
from cc_server.backends.fdpass import receive_fds
from cc_server.backends.plan import Command, EgressBridge, FdArg, InheritedFd, LaunchPlan, PathFd
from cc_server.backends.runner import run_attached
from cc_server.backends.supervisor import (
    GUEST_LAUNCHER,
    CreateRefused,
    SupervisorFault,
    check_create_rules,
    notify_filter_bpf,
    receive_listener,
)
from cc_server.errors import BackendUnavailable, EnforcementFailed
from cc_server.policy import (
    STANDARD_DENY_CREATE_GLOBS,
    SandboxBackend,
)

SOCAT = "/usr/bin/socat"


@pytest.fixture(autouse=True)
def fixed_filters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bwrap_mod, "filter_bpf", lambda: FAKE_BPF)
    monkeypatch.setattr(bwrap_mod, "notify_filter_bpf", lambda **_: FAKE_RULES_BPF)


def _plan(
    command: Command,
    tools: CreateRuleTools | None = TOOLS,
    globs: tuple[str, ...] = STANDARD_DENY_CREATE_GLOBS,
) -> LaunchPlan:
    return plan_bubblewrap(
        work_policy(globs),
        command,
        host=fake_host(),
        bwrap=BWRAP,
        socat=SOCAT,
        create_rules=tools,
    )


# --- the plan ----------------------------------------------------------------------------------


def test_the_launcher_wraps_the_command_as_pid_1() -> None:
    plan = _plan(Command(argv=("make", "test")))
    argv = plan.argv
    dash = argv.index("--")
    assert argv[dash + 1 :] == (
        GUEST_LAUNCHER,
        "--filter", FdArg(name="create-rules.bpf", data=FAKE_RULES_BPF),
        "--socket", InheritedFd(name="create-rules.sock"),
        "--", "make", "test",
    )  # fmt: skip
    assert "--as-pid-1" in argv[:dash]
    bind = argv.index(TOOLS.launcher)
    assert argv[bind - 1 : bind + 2] == ("--ro-bind", TOOLS.launcher, GUEST_LAUNCHER)
    # Bound before the root goes read-only, and the bwrap filter still comes last.
    assert bind < argv.index("--remount-ro") < argv.index("--seccomp") < dash
    assert plan.create_rules is not None
    assert plan.create_rules.globs == STANDARD_DENY_CREATE_GLOBS
    assert plan.create_rules.library == TOOLS.library
    assert plan.create_rules.socket == InheritedFd(name="create-rules.sock")
    assert plan.backend is SandboxBackend.NATIVE
    assert any("create-time names refused: .env, *.key, *.pem" in n for n in plan.notes)


def test_the_launcher_hands_over_the_egress_listeners_instead_of_socat() -> None:
    bridge = EgressBridge(socket_dir="/run/user/1/cc-server/egress-1-0123456789abcdef")
    plan = _plan(Command(argv=("curl", "x"), egress=bridge))
    argv = plan.argv
    inner = argv[argv.index("--") + 1 :]
    assert inner[0] == GUEST_LAUNCHER
    handoff = InheritedFd(name="egress.sock")
    assert plan.egress_handoff == handoff and inner[1:3] == ("--egress", handoff)
    assert inner[inner.index("--") + 1 :] == ("curl", "x")  # no socat prologue
    assert bridge.socket_dir not in argv  # nothing of the proxies is bound in
    assert plan.to_json()["egressHandoff"] is True


def test_without_globs_the_launcher_still_hands_over_egress() -> None:
    bridge = EgressBridge(socket_dir="/run/user/1/cc-server/egress-1-0123456789abcdef")
    plan = _plan(Command(argv=("curl", "x"), egress=bridge), globs=())
    argv = plan.argv
    assert plan.create_rules is None and "--as-pid-1" not in argv  # bwrap's init stays PID 1
    inner = argv[argv.index("--") + 1 :]
    assert inner == (GUEST_LAUNCHER, "--egress", InheritedFd(name="egress.sock"), "--", "curl", "x")


def test_without_globs_there_is_no_launcher_even_when_the_tools_exist() -> None:
    plan = _plan(Command(argv=("true",)), globs=())
    assert plan.create_rules is None
    assert GUEST_LAUNCHER not in plan.argv and "--as-pid-1" not in plan.argv
    assert not any(isinstance(a, InheritedFd) for a in plan.argv)
    assert "createRules" not in plan.to_json()


def test_globs_without_the_tools_are_refused() -> None:
    with pytest.raises(BackendUnavailable, match="create-time filename rules"):
        _plan(Command(argv=("true",)), tools=None)


@pytest.mark.parametrize(
    "tools",
    [
        CreateRuleTools(launcher="cc-create-launcher", library=TOOLS.library),
        CreateRuleTools(launcher=TOOLS.launcher, library="lib.so"),
    ],
)
def test_relative_tool_paths_are_refused(tools: CreateRuleTools) -> None:
    with pytest.raises(EnforcementFailed, match="absolute"):
        _plan(Command(argv=("true",)), tools=tools)


def test_a_filter_that_cannot_be_built_refuses_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(**_: object) -> bytes:
        raise OSError("libseccomp.so.2: cannot open shared object file")

    monkeypatch.setattr(bwrap_mod, "notify_filter_bpf", broken)
    with pytest.raises(EnforcementFailed, match="create-rule filter"):
        _plan(Command(argv=("true",)))


def test_the_plan_renders_and_serialises_its_rules_without_the_filter_bytes() -> None:
    plan = _plan(Command(argv=("true",)))
    text = plan.render()
    assert "create rules: .env, *.key, *.pem (supervised)" in text
    assert "<fd:create-rules.sock>" in text and "<fd:create-rules.bpf>" in text
    rules = plan.to_json()["createRules"]
    assert rules == {"globs": [".env", "*.key", "*.pem"], "supervised": True}
    assert repr(FAKE_RULES_BPF) not in text


def test_the_real_filter_builds() -> None:
    bpf = notify_filter_bpf()
    assert bpf and len(bpf) % 8 == 0


# --- the runner's slots ------------------------------------------------------------------------


def test_a_plan_with_an_unfilled_slot_is_refused_before_anything_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    plan = LaunchPlan(
        backend=SandboxBackend.NATIVE,
        argv=("/bin/sh", "-c", f"touch {marker}", InheritedFd(name="create-rules.sock")),
        env=(),
    )
    with pytest.raises(EnforcementFailed, match=r"create-rules\.sock"):
        run_attached(plan)
    assert not marker.exists()


@pytest.mark.parametrize("case", ["symlink-on-the-way", "symlink-at-the-end", "gone", "dotdot"])
def test_a_bind_source_with_a_symlink_or_gone_is_refused_before_anything_runs(
    tmp_path: Path, case: str
) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    source = {
        "symlink-on-the-way": f"{tmp_path}/link/sub",
        "symlink-at-the-end": f"{tmp_path}/link",
        "gone": f"{tmp_path}/real/missing",
        "dotdot": f"{tmp_path}/real/../link",
    }[case]
    plan = LaunchPlan(
        backend=SandboxBackend.NATIVE,
        argv=("/bin/sh", "-c", f"touch {marker}", PathFd(path=source)),
        env=(),
    )
    with pytest.raises(EnforcementFailed, match="bind source"):
        run_attached(plan)
    assert not marker.exists()


def test_a_bind_source_of_plain_directories_is_handed_over_as_an_fd(tmp_path: Path) -> None:
    (tmp_path / "real" / "sub").mkdir(parents=True)
    out = tmp_path / "out"
    plan = LaunchPlan(
        backend=SandboxBackend.NATIVE,
        argv=("/bin/sh", "-c", f'readlink /proc/self/fd/"$0" > {out}',
              PathFd(path=f"{tmp_path}/real/sub")),
        env=(),
    )  # fmt: skip
    assert run_attached(plan) == 0
    assert out.read_text().strip() == f"{tmp_path}/real/sub"


# --- the report pipe ---------------------------------------------------------------------------


def _record(*fields: bytes) -> bytes:
    body = b"".join(f + b"\0" for f in fields)
    return struct.pack("<I", len(body)) + body


def test_records_are_parsed_whole_and_partial_ones_wait() -> None:
    data = _record(b"R", b"openat", b"a/b/c.pem", b"c.pem", b"*.pem") + _record(
        b"E", b"bind", b"", b"", b"pidfd_open: EINVAL"
    )
    buffer = bytearray(data[:-3])
    first = sup._parse(buffer)
    assert first == [
        CreateRefused(syscall="openat", target="a/b/c.pem", name="c.pem", glob="*.pem")
    ]
    buffer += data[-3:]
    assert sup._parse(buffer) == [SupervisorFault(syscall="bind", detail="pidfd_open: EINVAL")]
    assert buffer == bytearray()
    refused = first[0]
    assert isinstance(refused, CreateRefused)
    assert refused.raw == "openat: refused to create 'c.pem' (matches '*.pem')"


def test_a_refusal_names_the_keeper_it_runs_under_when_there_is_one() -> None:
    # As the supervisor writes them: a sixth field, a decimal pid or empty.
    data = _record(b"R", b"openat", b"a.pem", b"a.pem", b"*.pem", b"42") + _record(
        b"R", b"mkdir", b"b.pem", b"b.pem", b"*.pem", b""
    )
    named, unnamed = sup._parse(bytearray(data))
    assert isinstance(named, CreateRefused) and named.keeper == 42
    assert isinstance(unnamed, CreateRefused) and unnamed.keeper is None


def test_a_path_that_is_not_utf8_survives() -> None:
    (report,) = sup._parse(bytearray(_record(b"R", b"open", b"\xff.pem", b"\xff.pem", b"*.pem")))
    assert isinstance(report, CreateRefused)
    assert os.fsencode(report.target) == b"\xff.pem"


@given(st.binary(max_size=512))
def test_any_bytes_never_raise(data: bytes) -> None:
    buffer = bytearray(data)
    sup._parse(buffer)
    assert len(buffer) <= len(data)


# --- handing the listener over -----------------------------------------------------------------


async def test_a_launcher_that_exits_without_sending_is_an_enforcement_failure() -> None:
    ours, theirs = socket.socketpair()
    theirs.close()
    with pytest.raises(EnforcementFailed, match="without handing over"):
        await receive_listener(ours)
    ours.close()


async def test_nothing_arriving_in_time_is_an_enforcement_failure() -> None:
    ours, theirs = socket.socketpair()
    try:
        with pytest.raises(EnforcementFailed, match="no seccomp listener within"):
            await receive_listener(ours, timeout_s=0.05)
    finally:
        ours.close()
        theirs.close()


async def test_the_egress_handoff_needs_both_listeners_with_its_tag() -> None:
    for tag, count in ((b"E", 1), (b"L", 2)):
        ours, theirs = socket.socketpair()
        a, b = socket.socketpair()
        try:
            socket.send_fds(theirs, [tag], [a.fileno(), b.fileno()][:count])
            before = set(os.listdir("/proc/self/fd"))
            with pytest.raises(EnforcementFailed, match="egress listeners"):
                await receive_fds(ours, tag=b"E", count=2, timeout_s=5, what="egress listeners")
            assert set(os.listdir("/proc/self/fd")) <= before  # what arrived was closed
        finally:
            for s in (ours, theirs, a, b):
                s.close()


async def test_an_fd_that_is_not_a_listener_is_refused_and_closed() -> None:
    ours, theirs = socket.socketpair()
    r, w = os.pipe()
    try:
        socket.send_fds(theirs, [b"L"], [r])
        before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(EnforcementFailed):
            await receive_listener(ours)
        await asyncio.sleep(0)
        assert set(os.listdir("/proc/self/fd")) <= before  # the received copy was closed
    finally:
        for fd in (r, w):
            os.close(fd)
        ours.close()
        theirs.close()


# --- the probe's check -------------------------------------------------------------------------


def test_the_check_names_what_is_missing(tmp_path: Path) -> None:
    result = check_create_rules(tmp_path)
    assert not result.available and result.launcher is None
    assert result.hint is not None
    assert "cc-create-launcher" in result.hint and "scripts/bootstrap" in result.hint


def test_the_check_reports_a_failing_selftest(tmp_path: Path) -> None:
    launcher = tmp_path / sup.LAUNCHER_NAME
    launcher.write_text("#!/bin/sh\necho 'the kernel refused WAIT_KILLABLE_RECV'\nexit 1\n")
    launcher.chmod(0o755)
    (tmp_path / sup.LIBRARY_NAME).write_bytes(b"")
    result = check_create_rules(tmp_path)
    assert not result.available
    assert result.hint == (
        "this kernel cannot run the create-rule supervisor: the kernel refused WAIT_KILLABLE_RECV"
    )


@pytest.mark.parametrize(
    ("source", "hint"),
    [
        # A library of an older build: the version answers, a later function is missing.
        (f"int ccs_abi_version(void) {{ return {sup.ABI_VERSION}; }}", "not the library"),
        (
            "int ccs_abi_version(void) { return 1; }\n"
            "void ccs_start(void) {}\nvoid ccs_stop(void) {}\nvoid ccs_stats(void) {}",
            f"has ABI 1, this cc-server needs {sup.ABI_VERSION}",
        ),
    ],
)
def test_a_library_of_another_build_is_unavailable_with_a_hint(
    tmp_path: Path, source: str, hint: str
) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc")
    launcher = tmp_path / sup.LAUNCHER_NAME
    launcher.write_text("#!/bin/sh\nexit 0\n")  # a kernel that passes the selftest
    launcher.chmod(0o755)
    (tmp_path / "lib.c").write_text(source + "\n")
    library = tmp_path / sup.LIBRARY_NAME
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-o", str(library), str(tmp_path / "lib.c")], check=True
    )
    result = check_create_rules(tmp_path)  # raises nothing
    assert not result.available and result.library is None
    assert result.hint is not None and hint in result.hint, result.hint
    assert "scripts/bootstrap" in result.hint


def test_the_built_supervisor_passes_its_check() -> None:
    result = check_create_rules()
    assert result.available, result.hint
    assert result.launcher is not None and os.path.isabs(result.launcher)
    assert result.library is not None and os.path.isabs(result.library)
