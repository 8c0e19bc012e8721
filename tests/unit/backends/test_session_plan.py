"""The session sandbox's plan: when `plan_bubblewrap` plans one for a command, what it runs (the
launcher serving requests, as PID 1), and what the command it was planned for gets. Pure."""

from __future__ import annotations

import dataclasses

import pytest
from plan_kit import BWRAP, FAKE_BPF, TOOLS, fake_host, work_policy

from cc_server.backends import bubblewrap as bwrap_mod
from cc_server.backends.bubblewrap import DEFAULT_PATH, CreateRuleTools, plan_bubblewrap
from cc_server.backends.egress_bridge import bridge_env
from cc_server.backends.plan import Command, EgressBridge, FdArg, InheritedFd, LaunchPlan
from cc_server.backends.supervisor import GUEST_LAUNCHER
from cc_server.policy import (
    STANDARD_DENY_CREATE_GLOBS,
    CompiledPolicy,
    HostFacts,
)

BRIDGE = EgressBridge(socket_dir="/run/user/1/cc-server/egress-1-0123456789abcdef")
COMMAND = Command(
    argv=("make", "test"),
    env=(("LANG", "C.UTF-8"),),
    cwd="/work/src",
    egress=BRIDGE,
    in_session_sandbox=True,
)


@pytest.fixture(autouse=True)
def fixed_filters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bwrap_mod, "filter_bpf", lambda: FAKE_BPF)
    monkeypatch.setattr(bwrap_mod, "notify_filter_bpf", lambda **_: FAKE_BPF)


def _plan(
    command: Command = COMMAND,
    *,
    policy: CompiledPolicy | None = None,
    host: HostFacts | None = None,
    tools: CreateRuleTools | None = TOOLS,
    **kw: bool,
) -> LaunchPlan:
    return plan_bubblewrap(
        policy or work_policy(), command, host=host or fake_host(), bwrap=BWRAP,
        socat="/usr/bin/socat", create_rules=tools, **kw,
    )  # fmt: skip


def test_a_session_sandbox_plan_serves_the_command_it_was_planned_for() -> None:
    plan = _plan()
    argv = plan.argv
    dash = argv.index("--")
    serve = InheritedFd(name="session.sock")
    assert argv[dash + 1 :] == (
        GUEST_LAUNCHER, "--egress", InheritedFd(name="egress.sock"), "--serve", serve
    )  # fmt: skip
    assert "--as-pid-1" in argv[:dash]
    assert argv[argv.index("--chdir") + 1] == "/"
    assert "make" not in argv and "/work/src" not in argv  # the command is not in the sandbox
    assert plan.env == (("PATH", DEFAULT_PATH),)
    assert plan.session is not None
    assert plan.session.argv == ("make", "test")
    assert plan.session.cwd == "/work/src"
    assert plan.session.socket == serve
    assert dict(plan.session.env) == {
        "LANG": "C.UTF-8", "PATH": DEFAULT_PATH, "HOME": "/home/dev", "PWD": "/work/src",
        **bridge_env(),
    }  # fmt: skip
    assert plan.egress_handoff == InheritedFd(name="egress.sock")
    assert plan.to_json()["session"] == {
        "argv": ["make", "test"], "env": dict(plan.session.env), "cwd": "/work/src"
    }  # fmt: skip
    assert "session sandbox" in plan.render()


def test_the_sandbox_part_is_the_same_steps_as_a_sandbox_per_command() -> None:
    session = _plan().argv
    single = _plan(dataclasses.replace(COMMAND, in_session_sandbox=False)).argv
    # Equal up to the launcher step: namespaces, system paths, binds and every rule.
    cut = single.index(TOOLS.launcher) - 1
    assert session[: session.index("--as-pid-1")] == single[:cut]
    assert session[session.index("--as-pid-1") + 1 :][:3] == single[cut:][:3]


def test_two_commands_share_a_sandbox_only_while_the_host_facts_are_the_same() -> None:
    other = dataclasses.replace(COMMAND, argv=("ls",), cwd="/work", env=())
    first, second = _plan(), _plan(other)
    assert (first.argv, first.env) == (second.argv, second.env)
    # A `.git/hooks` that now exists in the writable root is a new read-only mount: a new plan.
    changed = _plan(other, host=fake_host(existing=("/work/.git/hooks",)))
    hooks = changed.argv.index("/work/.git/hooks")
    assert changed.argv[hooks - 1 : hooks + 2] == ("--ro-bind", "/work/.git/hooks") * 1 + (
        "/work/.git/hooks",
    )
    assert changed.argv != first.argv


@pytest.mark.parametrize(
    ("why", "command", "kw"),
    [
        ("not asked", dataclasses.replace(COMMAND, in_session_sandbox=False), {}),
        ("no egress", dataclasses.replace(COMMAND, egress=None), {}),
        ("no launcher", COMMAND, {"tools": None}),
        ("terminal session", dataclasses.replace(COMMAND, egress=None), {"new_session": False}),
    ],
)
def test_a_sandbox_per_command_when_a_session_sandbox_cannot_serve_it(
    why: str, command: Command, kw: dict[str, object]
) -> None:
    plan = _plan(command, **kw)  # type: ignore[arg-type]
    assert plan.session is None, why
    assert "--serve" not in plan.argv
    assert plan.argv[-2:] == ("make", "test") or plan.argv[-1] == "test"
    assert plan.argv[plan.argv.index("--chdir") + 1] == "/work/src"


def test_the_seccomp_filter_is_part_of_what_must_be_equal(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan()
    assert FdArg(name="seccomp.bpf", data=FAKE_BPF) in plan.argv
    # Another filter (a new build of the server, another libseccomp): another sandbox.
    monkeypatch.setattr(bwrap_mod, "filter_bpf", lambda: FAKE_BPF * 2)
    assert _plan().argv != plan.argv


def test_with_create_time_globs_the_launcher_installs_their_filter_before_it_serves() -> None:
    plan = _plan(policy=work_policy(STANDARD_DENY_CREATE_GLOBS))
    argv = plan.argv
    dash = argv.index("--")
    assert argv[dash + 1 :] == (
        GUEST_LAUNCHER,
        "--egress", InheritedFd(name="egress.sock"),
        "--filter", FdArg(name="create-rules.bpf", data=FAKE_BPF),
        "--socket", InheritedFd(name="create-rules.sock"),
        "--serve", InheritedFd(name="session.sock"),
    )  # fmt: skip
    assert argv[:dash].count("--as-pid-1") == 1
    assert plan.session is not None and plan.create_rules is not None
    assert plan.create_rules.globs == STANDARD_DENY_CREATE_GLOBS
