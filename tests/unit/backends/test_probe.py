"""The probe table, row by row, over fake host facts; and the real selftest over fake bwraps."""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cc_server.backends import probe as probe_mod
from cc_server.backends.probe import (
    BUBBLEWRAP_NOTE,
    CREATE_LAUNCHER_TOOL,
    CREATE_SUPERVISOR_TOOL,
    NOT_OFFERED_HINT,
    SANDBOX_EXEC_PATH,
    SEATBELT_NOTE,
    ProbeFacts,
    ProbeResult,
    SelftestResult,
    boot_probe,
    probe,
    run_bwrap_selftest,
    selftest_argv,
    startup_line,
)
from cc_server.policy.host import Platform, detect_platform

BWRAP = "/usr/bin/bwrap"
SOCAT = "/usr/bin/socat"
PASSED = SelftestResult(ok=True, detail="")


def _no_selftest(bwrap: str) -> SelftestResult:
    raise AssertionError(f"the selftest must not run here (asked for {bwrap})")


def _facts(
    platform: Platform,
    *,
    tools: dict[str, str] | None = None,
    files: frozenset[str] = frozenset(),
    selftest: Callable[[str], SelftestResult] = _no_selftest,
) -> ProbeFacts:
    known = {} if tools is None else tools
    return ProbeFacts(
        platform=platform,
        which=known.get,
        is_file=files.__contains__,
        selftest=selftest,
    )


def _linux_facts_failing_selftest() -> ProbeFacts:
    return _facts(
        Platform.LINUX,
        tools={"bwrap": BWRAP, "socat": SOCAT},
        selftest=lambda _bwrap: SelftestResult(ok=False, detail="boom"),
    )


def _linux_failing(detail: str, platform: Platform = Platform.LINUX) -> ProbeResult:
    """Probe a Linux host with both tools whose selftest fails with `detail`."""
    return probe(
        _facts(
            platform,
            tools={"bwrap": BWRAP, "socat": SOCAT},
            selftest=lambda _bwrap: SelftestResult(ok=False, detail=detail),
        )
    )


# --- macOS ----------------------------------------------------------------------------------------


def test_macos_with_sandbox_exec_is_seatbelt() -> None:
    result = probe(_facts(Platform.MACOS, files=frozenset({SANDBOX_EXEC_PATH})))
    assert result == ProbeResult(
        platform=Platform.MACOS,
        available=True,
        mechanism="seatbelt",
        note="sandbox-exec (Seatbelt) — namespace isolation, no kernel boundary",
        hint=None,
        requires_install=False,
        missing_packages=(),
        tools={"sandbox-exec": "/usr/bin/sandbox-exec"},
    )
    assert result.note == SEATBELT_NOTE


def test_macos_looks_for_sandbox_exec_by_absolute_path_not_path() -> None:
    # A sandbox-exec found on PATH (anywhere) does not count; only /usr/bin/sandbox-exec does.
    result = probe(_facts(Platform.MACOS, tools={"sandbox-exec": "/opt/evil/sandbox-exec"}))
    assert not result.available
    assert result.mechanism is None
    assert result.note is None
    assert result.hint is not None and SANDBOX_EXEC_PATH in result.hint
    assert not result.requires_install
    assert dict(result.tools) == {}


# --- Linux and WSL2 -------------------------------------------------------------------------------


@pytest.mark.parametrize("platform", [Platform.LINUX, Platform.WSL2])
def test_linux_with_both_tools_and_passing_selftest_is_bubblewrap(platform: Platform) -> None:
    asked: list[str] = []

    def selftest(bwrap: str) -> SelftestResult:
        asked.append(bwrap)
        return PASSED

    result = probe(_facts(platform, tools={"bwrap": BWRAP, "socat": SOCAT}, selftest=selftest))
    assert result == ProbeResult(
        platform=platform,
        available=True,
        mechanism="bubblewrap",
        note="bubblewrap — namespace isolation, no kernel boundary",
        tools={"bwrap": BWRAP, "socat": SOCAT},
    )
    assert result.note == BUBBLEWRAP_NOTE
    assert asked == [BWRAP]  # run once, with the absolute path which() gave


def test_linux_reports_create_rules_and_their_tools_when_the_check_passes() -> None:
    from cc_server.backends.supervisor import CreateRulesCheck

    launcher, library = "/opt/cc/cc-create-launcher", "/opt/cc/libcc-create-supervisor.so"
    facts = dataclasses.replace(
        _facts(Platform.LINUX, tools={"bwrap": BWRAP, "socat": SOCAT}, selftest=lambda _b: PASSED),
        create_rules=lambda: CreateRulesCheck(available=True, launcher=launcher, library=library),
    )
    result = probe(facts)
    assert result.available and result.create_rules and result.create_rules_hint is None
    assert dict(result.tools) == {
        "bwrap": BWRAP, "socat": SOCAT,
        CREATE_LAUNCHER_TOOL: launcher, CREATE_SUPERVISOR_TOOL: library,
    }  # fmt: skip


def test_linux_without_create_rules_is_still_bubblewrap_with_the_reason() -> None:
    from cc_server.backends.supervisor import CreateRulesCheck

    facts = dataclasses.replace(
        _facts(Platform.LINUX, tools={"bwrap": BWRAP, "socat": SOCAT}, selftest=lambda _b: PASSED),
        create_rules=lambda: CreateRulesCheck(available=False, hint="needs Linux 5.19"),
    )
    result = probe(facts)
    assert result.available and result.mechanism == "bubblewrap"
    assert not result.create_rules and result.create_rules_hint == "needs Linux 5.19"
    assert set(result.tools) == {"bwrap", "socat"}
    assert result.to_json()["createRulesHint"] == "needs Linux 5.19"


def test_create_rules_are_not_checked_without_bubblewrap() -> None:
    def never() -> Any:
        raise AssertionError("the create-rule check must not run without a working bwrap")

    facts = dataclasses.replace(_linux_facts_failing_selftest(), create_rules=never)
    assert not probe(facts).create_rules


@pytest.mark.parametrize(
    ("tools", "missing", "hint"),
    [
        (
            {},
            ("bubblewrap", "socat"),
            "install bubblewrap and socat: sudo apt-get install bubblewrap socat",
        ),
        ({"socat": SOCAT}, ("bubblewrap",), "install bubblewrap: sudo apt-get install bubblewrap"),
        ({"bwrap": BWRAP}, ("socat",), "install socat: sudo apt-get install socat"),
    ],
    ids=["neither", "no-bwrap", "no-socat"],
)
@pytest.mark.parametrize("platform", [Platform.LINUX, Platform.WSL2])
def test_linux_missing_tools_requires_install(
    platform: Platform, tools: dict[str, str], missing: tuple[str, ...], hint: str
) -> None:
    result = probe(_facts(platform, tools=tools))  # the selftest must not run
    assert result == ProbeResult(
        platform=platform,
        available=False,
        hint=hint,
        requires_install=True,
        missing_packages=missing,
        tools=tools,
    )


def test_relative_which_results_are_rejected() -> None:
    result = probe(_facts(Platform.LINUX, tools={"bwrap": "bin/bwrap", "socat": SOCAT}))
    assert not result.available
    assert result.requires_install
    assert result.missing_packages == ("bubblewrap",)
    assert dict(result.tools) == {"socat": SOCAT}
    assert result.hint == (
        "install bubblewrap: sudo apt-get install bubblewrap"
        " (ignored bwrap at non-absolute 'bin/bwrap': a relative PATH entry)"
    )


# --- Linux selftest failures: one remedy each -----------------------------------------------------

APPARMOR_SYSCTL = "sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0"
APPARMOR_PROFILE = f"AppArmor profile for {BWRAP}"
MAX_USERNS_FIX = "sudo sysctl -w user.max_user_namespaces=15000"
CLONE_FIX = "sudo sysctl -w kernel.unprivileged_userns_clone=1"
SECCOMP_FIX = "seccomp profile that allows unshare and clone of namespaces"
NEW_NO_PERMISSION = (
    "bwrap: No permissions to create a new namespace, likely because the kernel does not allow "
    "non-privileged user namespaces. On e.g. debian this can be enabled with "
    "'sysctl kernel.unprivileged_userns_clone=1'."
)
OLD_NO_PERMISSION = NEW_NO_PERMISSION.replace("create a new", "creating new")


@pytest.mark.parametrize(
    ("detail", "must_contain"),
    [
        pytest.param(
            "bwrap: setting up uid map: Permission denied",
            (APPARMOR_PROFILE, APPARMOR_SYSCTL),
            id="apparmor-uid-map",
        ),
        pytest.param(
            "bwrap: setting up gid map: Permission denied [host: Seccomp: 0]",
            (APPARMOR_PROFILE, APPARMOR_SYSCTL),
            id="apparmor-gid-map",
        ),
        pytest.param(
            "bwrap: No permissions to create new namespace",
            (APPARMOR_PROFILE, APPARMOR_SYSCTL),
            id="apparmor-no-permissions-no-evidence",
        ),
        pytest.param(
            f"{NEW_NO_PERMISSION} [host: kernel.apparmor_restrict_unprivileged_userns = 1, "
            "user.max_user_namespaces = 62000, Seccomp: 0]",
            (APPARMOR_PROFILE, APPARMOR_SYSCTL),
            id="apparmor-no-permissions-with-evidence",
        ),
        pytest.param(
            "bwrap: Creating new namespace failed: nesting depth or "
            "/proc/sys/user/max_*_namespaces exceeded (ENOSPC)",
            (MAX_USERNS_FIX,),
            id="max-userns-enospc",
        ),
        pytest.param(
            "bwrap: unshare user ns: No space left on device",
            (MAX_USERNS_FIX,),
            id="max-userns-no-space",
        ),
        pytest.param(
            "bwrap: something else [host: user.max_user_namespaces = 0, Seccomp: 0]",
            (MAX_USERNS_FIX,),
            id="max-userns-evidence",
        ),
        pytest.param(
            f"{OLD_NO_PERMISSION} [host: kernel.unprivileged_userns_clone = 0, "
            "user.max_user_namespaces = 62000, Seccomp: 0]",
            (CLONE_FIX,),
            id="unprivileged-userns-clone",
        ),
        pytest.param(
            f"{NEW_NO_PERMISSION} [host: kernel.apparmor_restrict_unprivileged_userns = 1, "
            "user.max_user_namespaces = 62000, Seccomp: 2]",
            (SECCOMP_FIX,),
            id="seccomp-no-permissions",
        ),
        pytest.param(
            "bwrap: unshare user ns: Operation not permitted",
            (SECCOMP_FIX,),
            id="seccomp-unshare-eperm",
        ),
        pytest.param(
            "bwrap: Creating new namespace failed: Operation not permitted",
            (SECCOMP_FIX,),
            id="seccomp-clone-eperm",
        ),
        pytest.param(
            "bwrap: Unknown option --disable-userns",
            (f"{BWRAP} is too old", "bubblewrap 0.8.0 or newer"),
            id="bwrap-too-old",
        ),
    ],
)
def test_selftest_failure_names_the_specific_remedy(
    detail: str, must_contain: tuple[str, ...]
) -> None:
    result = _linux_failing(detail)
    assert not result.available
    assert not result.requires_install
    assert result.missing_packages == ()
    assert result.mechanism is None and result.note is None
    assert dict(result.tools) == {"bwrap": BWRAP, "socat": SOCAT}
    assert result.hint is not None
    for text in must_contain:
        assert text in result.hint, result.hint
    # One remedy, not a menu of all of them.
    others = {APPARMOR_SYSCTL, MAX_USERNS_FIX, CLONE_FIX, SECCOMP_FIX} - set(must_contain)
    assert not [o for o in others if o in result.hint], result.hint


def test_bwraps_own_clone_suggestion_is_not_mistaken_for_host_evidence() -> None:
    # bwrap's EPERM text quotes "kernel.unprivileged_userns_clone=1"; only a reading of 0 counts.
    hint = _linux_failing(NEW_NO_PERMISSION).hint
    assert hint is not None and APPARMOR_SYSCTL in hint and CLONE_FIX not in hint


@pytest.mark.parametrize(
    ("detail", "shown"),
    [
        pytest.param(
            "bwrap: Can't mount proc on /newroot/proc: Operation not permitted",
            "bwrap: Can't mount proc on /newroot/proc: Operation not permitted",
            id="unrecognised",
        ),
        pytest.param(
            f"{NEW_NO_PERMISSION} [host: user.max_user_namespaces = 62000, Seccomp: 0]",
            "'sysctl kernel.unprivileged_userns_clone=1'. [host: user.max_user_namespaces",
            id="no-permissions-but-evidence-explains-nothing",
        ),
        pytest.param("line one\n\n  line two  \n", "line one; line two", id="multi-line"),
        pytest.param("", "no detail", id="empty"),
    ],
)
def test_unrecognised_selftest_failure_quotes_the_detail_on_one_line(
    detail: str, shown: str
) -> None:
    result = _linux_failing(detail, Platform.WSL2)
    assert not result.available
    assert not result.requires_install
    assert result.hint is not None
    assert result.hint.startswith("bwrap is installed but its selftest failed: ")
    assert shown in result.hint
    assert "\n" not in result.hint


# --- other platforms and failures of the facts themselves -----------------------------------------


@pytest.mark.parametrize("platform", [Platform.WINDOWS, Platform.OTHER])
def test_other_platforms_are_not_offered(platform: Platform) -> None:
    # Even with every tool present: the platform row decides.
    result = probe(
        _facts(
            platform,
            tools={"bwrap": BWRAP, "socat": SOCAT},
            files=frozenset({SANDBOX_EXEC_PATH}),
        )
    )
    assert result == ProbeResult(
        platform=platform,
        available=False,
        hint="Native sandbox is not offered on this platform",
    )
    assert result.hint == NOT_OFFERED_HINT


def test_a_raising_fact_source_becomes_an_unavailable_result() -> None:
    def broken(_bwrap: str) -> SelftestResult:
        raise RuntimeError("boom")

    result = probe(_facts(Platform.LINUX, tools={"bwrap": BWRAP, "socat": SOCAT}, selftest=broken))
    assert not result.available
    assert result.mechanism is None
    assert result.hint == "the sandbox probe failed: RuntimeError('boom')"


# --- ProbeResult ----------------------------------------------------------------------------------


def test_to_json_uses_camel_case_keys() -> None:
    result = probe(_facts(Platform.LINUX, tools={"bwrap": BWRAP}))
    assert result.to_json() == {
        "platform": "linux",
        "available": False,
        "mechanism": None,
        "note": None,
        "hint": "install socat: sudo apt-get install socat",
        "requiresInstall": True,
        "missingPackages": ["socat"],
        "tools": {"bwrap": BWRAP},
        "createRules": False,
        "createRulesHint": None,
    }
    available = probe(_facts(Platform.MACOS, files=frozenset({SANDBOX_EXEC_PATH}))).to_json()
    assert available["mechanism"] == "seatbelt"
    assert available["tools"] == {"sandbox-exec": SANDBOX_EXEC_PATH}


def test_result_stays_frozen_even_when_given_a_dict() -> None:
    tools = {"bwrap": BWRAP}
    result = ProbeResult(platform=Platform.LINUX, available=False, tools=tools)
    tools["socat"] = SOCAT
    assert dict(result.tools) == {"bwrap": BWRAP}
    with pytest.raises(TypeError):
        result.tools["socat"] = SOCAT  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.available = True  # type: ignore[misc]
    assert hash(result) == hash(ProbeResult(platform=Platform.LINUX, available=False))


# --- startup_line ---------------------------------------------------------------------------------


def test_startup_line_sandbox_on() -> None:
    result = ProbeResult(
        platform=Platform.LINUX, available=True, mechanism="bubblewrap", note=BUBBLEWRAP_NOTE
    )
    assert startup_line(result, sandbox_flag_on=True) == (
        "agent sandbox ON (bubblewrap — namespace isolation, no kernel boundary)"
    )


def test_startup_line_no_backend() -> None:
    result = ProbeResult(platform=Platform.WINDOWS, available=False, hint=NOT_OFFERED_HINT)
    assert startup_line(result, sandbox_flag_on=True) == (
        "no OS-native agent sandbox on this host (Native sandbox is not offered on this platform)"
    )


@pytest.mark.parametrize("available", [True, False])
def test_startup_line_flag_off_wins_over_the_probe(available: bool) -> None:
    result = ProbeResult(platform=Platform.LINUX, available=available, note="n", hint="h")
    assert startup_line(result, sandbox_flag_on=False) == "agent sandbox DISABLED by --sandbox off"
    assert startup_line(None, sandbox_flag_on=False) == "agent sandbox DISABLED by --sandbox off"


def test_startup_line_needs_a_result_when_the_flag_is_on() -> None:
    with pytest.raises(ValueError, match="needs a probe result"):
        startup_line(None, sandbox_flag_on=True)


# --- the real fact sources ------------------------------------------------------------------------


def test_selftest_argv_is_exact() -> None:
    tail = ("--proc", "/proc", "--dev", "/dev", "--", "/bin/true")
    head = (
        BWRAP,
        "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
        "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--disable-userns",
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/bin", "/bin",
        "--symlink", "usr/lib", "/lib",
    )  # fmt: skip
    assert selftest_argv(BWRAP, with_lib64=True) == (
        *head,
        *("--symlink", "usr/lib64", "/lib64"),
        *tail,
    )
    assert selftest_argv(BWRAP, with_lib64=False) == (*head, *tail)
    assert "/lib64" not in selftest_argv(BWRAP, with_lib64=False)


def _fake_bwrap(tmp_path: Path, body: str) -> str:
    """An executable standing in for bwrap; it records its argv and environment."""
    script = tmp_path / "bwrap"
    script.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/argv"\nenv > "{tmp_path}/env"\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def _fake_proc(tmp_path: Path, sysctls: dict[str, str], seccomp: str | None) -> str:
    root = tmp_path / "proc"
    for name, value in sysctls.items():
        path = root.joinpath("sys", *name.split("."))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")
    (root / "self").mkdir(parents=True)
    status = "Name:\tpython3\nUmask:\t0022\n"
    if seccomp is not None:
        status += f"Seccomp:\t{seccomp}\nSeccomp_filters:\t1\n"
    (root / "self" / "status").write_text(status)
    return str(root)


def test_selftest_passes_with_an_empty_environment(tmp_path: Path) -> None:
    bwrap = _fake_bwrap(tmp_path, "exit 0")
    result = run_bwrap_selftest(bwrap, proc_root=str(tmp_path / "no-proc"))
    assert result == SelftestResult(ok=True, detail="")
    argv = (tmp_path / "argv").read_text().split()
    assert argv == list(selftest_argv(bwrap, with_lib64=os.path.exists("/lib64"))[1:])
    env_names = {line.split("=", 1)[0] for line in (tmp_path / "env").read_text().splitlines()}
    assert env_names <= {"PWD", "SHLVL", "_", "OLDPWD"}  # only what sh itself sets


def test_selftest_failure_reports_stderr_and_host_evidence(tmp_path: Path) -> None:
    bwrap = _fake_bwrap(tmp_path, 'echo "bwrap: setting up uid map: Permission denied" >&2; exit 1')
    proc = _fake_proc(
        tmp_path,
        {
            "kernel.apparmor_restrict_unprivileged_userns": "1",
            "user.max_user_namespaces": "62000",
        },
        seccomp="0",
    )
    result = run_bwrap_selftest(bwrap, proc_root=proc)
    assert result == SelftestResult(
        ok=False,
        detail="bwrap: setting up uid map: Permission denied [host: "
        "kernel.apparmor_restrict_unprivileged_userns = 1, user.max_user_namespaces = 62000, "
        "Seccomp: 0]",
    )


def test_selftest_evidence_feeds_the_remedy(tmp_path: Path) -> None:
    # End to end through the real selftest: the same message, told apart by the host settings.
    bwrap = _fake_bwrap(tmp_path, f'echo "{NEW_NO_PERMISSION}" >&2; exit 1')
    proc = _fake_proc(tmp_path, {"kernel.unprivileged_userns_clone": "0"}, seccomp=None)
    result = probe(
        ProbeFacts(
            platform=Platform.LINUX,
            which={"bwrap": bwrap, "socat": SOCAT}.get,
            is_file=lambda _path: False,
            selftest=lambda b: run_bwrap_selftest(b, proc_root=proc),
        )
    )
    assert result.hint is not None and CLONE_FIX in result.hint


def test_selftest_silent_failure_reports_the_exit_status(tmp_path: Path) -> None:
    bwrap = _fake_bwrap(tmp_path, "exit 3")
    result = run_bwrap_selftest(bwrap, proc_root=str(tmp_path / "no-proc"))
    assert result == SelftestResult(ok=False, detail="bwrap exited with status 3")


def test_selftest_timeout_is_a_failure(tmp_path: Path) -> None:
    bwrap = _fake_bwrap(tmp_path, "exec sleep 5")
    result = run_bwrap_selftest(bwrap, timeout_s=0.2, proc_root=str(tmp_path / "no-proc"))
    assert result == SelftestResult(ok=False, detail="bwrap selftest timed out after 0.2 s")


def test_selftest_that_cannot_start_is_a_failure(tmp_path: Path) -> None:
    missing = str(tmp_path / "not-there")
    result = run_bwrap_selftest(missing, proc_root=str(tmp_path / "no-proc"))
    assert not result.ok
    assert result.detail.startswith(f"could not run {missing}: ")
    assert "No such file or directory" in result.detail


def test_which_absolute_rejects_relative_path_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tool = tmp_path / "bin" / "sometool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    assert probe_mod._which_absolute("sometool", path="bin") is None
    assert probe_mod._which_absolute("sometool", path=str(tool.parent)) == str(tool)


def test_current_facts_describe_this_host() -> None:
    facts = ProbeFacts.current()
    assert facts.platform == detect_platform()
    assert facts.is_file(__file__)
    assert not facts.is_file(os.path.dirname(__file__))
    assert facts.which("definitely-not-a-tool-cc-server") is None
    assert facts.selftest is run_bwrap_selftest


def test_boot_probe_runs_once_and_remembers() -> None:
    first = boot_probe()
    assert boot_probe() is first
    assert first.platform == detect_platform()
