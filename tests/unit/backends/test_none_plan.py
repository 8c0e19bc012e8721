"""plan_none: the command as given, no defaults added, no isolation."""

from __future__ import annotations

import pytest

from cc_server.backends.none import plan_none
from cc_server.backends.plan import Command, FdArg
from cc_server.errors import BadSpec
from cc_server.policy import (
    CompiledPolicy,
    HostFacts,
    Platform,
    SandboxBackend,
    compile_policy,
    parse_spec,
)

HOST = HostFacts(
    platform=Platform.LINUX,
    home="/home/dev",
    realpath=lambda p: p,
    exists=lambda p: p in {"/work/repo"},
    is_dir=lambda p: p in {"/work/repo"},
)


def _policy(**fields: object) -> CompiledPolicy:
    data: dict[str, object] = {
        "sessionId": "s",
        "workspaceId": "w",
        "bindMounts": [{"hostPath": "/work/repo"}],
    }
    data.update(fields)
    return compile_policy(parse_spec(data), HOST)


def test_argv_env_cwd_passed_through_unchanged() -> None:
    command = Command(argv=("make", "test"), env=(("Z", "1"), ("A", "2")), cwd="/work/repo/src")
    plan = plan_none(_policy(guestWorkdir="/work/repo"), command)
    assert plan.backend is SandboxBackend.NONE
    assert plan.argv == ("make", "test"), plan.render()
    assert plan.env == (("Z", "1"), ("A", "2")), plan.render()  # not sorted, nothing added
    assert plan.cwd == "/work/repo/src"
    assert plan.notes == (
        "no isolation: the command runs on the host with the server user's access",
    )


def test_no_defaults_no_isolation_words() -> None:
    plan = plan_none(_policy(), Command(argv=("true",)))
    assert plan.env == (), plan.render()  # no PATH or HOME default, unlike native
    assert plan.cwd is None  # the server's own cwd
    assert not any(isinstance(a, FdArg) for a in plan.argv)
    assert not any(str(a).startswith("--") for a in plan.argv), plan.render()


def test_cwd_falls_back_to_workdir() -> None:
    plan = plan_none(_policy(guestWorkdir="/work/repo"), Command(argv=("true",)))
    assert plan.cwd == "/work/repo"


def test_policy_denies_do_not_change_the_plan() -> None:
    # The mounts, deny sets, globs and network switch are ignored by `none`.
    strict = compile_policy(
        parse_spec({"sessionId": "s", "workspaceId": "w", "networkEnabled": False}),
        HOST,
        deny_create_globs=[".env"],
    )
    command = Command(argv=("true",), env=(("K", "v"),))
    assert plan_none(strict, command) == plan_none(_policy(), command)


def test_empty_argv_refused() -> None:
    with pytest.raises(BadSpec, match="empty"):
        plan_none(_policy(), Command(argv=()))
