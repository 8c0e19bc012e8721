"""LaunchPlan.render() and to_json(): exact text, fd slots named, fd data never printed."""

from __future__ import annotations

import json

from cc_server.backends.plan import Command, FdArg, LaunchPlan
from cc_server.policy import SandboxBackend

SECRET = b"SECRET-FD-CONTENT"
FD = FdArg(name="seccomp.bpf", data=SECRET)


def _plan(cwd: str | None = "/work/repo") -> LaunchPlan:
    return LaunchPlan(
        backend=SandboxBackend.NATIVE,
        argv=("/usr/bin/bwrap", "--seccomp", FD, "--", "sh", "-c", "echo 'hi there'"),
        env=(("HOME", "/home/dev"), ("MSG", "a b$c")),
        cwd=cwd,
        notes=("network: none", "second note"),
    )


def test_render_exact() -> None:
    text = _plan().render()
    assert text == "\n".join(
        [
            "backend: native",
            "cwd: /work/repo",
            "env:",
            "  HOME=/home/dev",
            "  MSG='a b$c'",
            "argv:",
            "  /usr/bin/bwrap",
            "  --seccomp",
            "  '<fd:seccomp.bpf>'",
            "  --",
            "  sh",
            "  -c",
            "  'echo '\"'\"'hi there'\"'\"''",
            "note: network: none",
            "note: second note",
        ]
    ), text


def test_render_without_cwd_env_or_notes() -> None:
    plan = LaunchPlan(backend=SandboxBackend.NONE, argv=("true",), env=())
    assert plan.render() == "backend: none\nenv:\nargv:\n  true", plan.render()


def test_to_json_exact() -> None:
    plan = _plan(cwd=None)
    assert plan.to_json() == {
        "backend": "native",
        "argv": [
            "/usr/bin/bwrap",
            "--seccomp",
            "<fd:seccomp.bpf>",
            "--",
            "sh",
            "-c",
            "echo 'hi there'",
        ],
        "env": {"HOME": "/home/dev", "MSG": "a b$c"},
        "cwd": None,
        "notes": ["network: none", "second note"],
    }
    json.dumps(plan.to_json())  # JSON-ready as it is


def test_fd_data_never_printed() -> None:
    plan = _plan()
    secret = SECRET.decode()
    for text in (plan.render(), json.dumps(plan.to_json()), repr(plan), str(FD), repr(FD)):
        assert secret not in text, text
        assert repr(SECRET) not in text, text
    assert str(FD) == "<fd:seccomp.bpf>"


def test_fd_args_compare_by_name_and_data() -> None:
    assert FdArg(name="x", data=b"1") == FdArg(name="x", data=b"1")
    assert FdArg(name="x", data=b"1") != FdArg(name="x", data=b"2")


def test_command_defaults() -> None:
    command = Command(argv=("true",))
    assert command.env == ()
    assert command.cwd is None
