"""The guardrail chain: fixed order, fail-closed, one chain for every seam's actions."""

from __future__ import annotations

import pytest

from cc_server.dispatch.actions import KIND_TOOL, Action, ActionKind, ActionRefused
from cc_server.dispatch.guardrails import Guardrail, GuardrailChain, standard_chain
from cc_server.policy import (
    STANDARD_DENY_CREATE_GLOBS,
    CompiledPolicy,
    HostFacts,
    Mode,
    Platform,
    SandboxBindMount,
    SandboxSpec,
    compile_policy,
)

HOME = "/home/dev"
WT = "/srv/wt/conv-1"
REPO = "/srv/repos/app"


def _policy(mode: Mode = Mode.CHAT) -> CompiledPolicy:
    spec = SandboxSpec(
        session_id="s1",
        workspace_id="w1",
        bind_mounts=(
            SandboxBindMount(host_path=WT, guest_path="/workspace"),
            SandboxBindMount(host_path=REPO),
            SandboxBindMount(host_path=HOME, read_only=True),
        ),
        guest_workdir="/workspace",
        mode=mode,
        protected_paths=(REPO,),
    )
    host = HostFacts(
        platform=Platform.LINUX, home=HOME, realpath=lambda p: p, exists=lambda p: True
    )
    return compile_policy(spec, host, deny_create_globs=STANDARD_DENY_CREATE_GLOBS)


def _action(kind: ActionKind, mode: Mode = Mode.CHAT, **kw: object) -> Action:
    return Action(kind=kind, tool=KIND_TOOL[kind], session_id="s1", mode=mode, **kw)  # type: ignore[arg-type]


class Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[Action] = []

    def check(self, action: Action) -> None:
        self.seen.append(action)


def test_the_standard_chain_runs_in_the_contract_order() -> None:
    extra = Recorder()
    chain = standard_chain(_policy(), extra=[extra])
    assert chain.names == ("tool-surface", "command-policy", "path-policy", "recorder")
    assert isinstance(extra, Guardrail)


@pytest.mark.parametrize(
    "error", [RuntimeError("boom"), KeyError("k"), AssertionError(), OSError(5, "io")]
)
def test_a_raising_guardrail_refuses(error: Exception) -> None:
    class Raising:
        name = "raising"

        def check(self, action: Action) -> None:
            raise error

    after = Recorder()
    chain = GuardrailChain([Raising(), after])
    with pytest.raises(ActionRefused) as info:
        chain.check(_action(ActionKind.BASH, argv=("ls",)))
    assert info.value.guardrail == "raising"
    assert type(error).__name__ in info.value.reason
    assert after.seen == []


def test_a_guardrail_without_a_name_is_named_by_its_type() -> None:
    class Nameless:
        def check(self, action: Action) -> None:
            raise ValueError("x")

    with pytest.raises(ActionRefused) as info:
        GuardrailChain([Nameless()]).check(_action(ActionKind.BASH, argv=("ls",)))  # type: ignore[list-item]
    assert info.value.guardrail == "Nameless"


def test_an_empty_chain_allows_nothing() -> None:
    with pytest.raises(ActionRefused, match="no guardrails"):
        GuardrailChain([]).check(_action(ActionKind.FILE_READ, path="a"))


def test_interrupts_are_not_swallowed() -> None:
    class Interrupted:
        name = "interrupted"

        def check(self, action: Action) -> None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        GuardrailChain([Interrupted()]).check(_action(ActionKind.BASH, argv=("ls",)))


@pytest.mark.parametrize("mode", [Mode.REVIEW, Mode.PLAN, Mode.ORCHESTRATE])
@pytest.mark.parametrize(
    "kind",
    [ActionKind.FILE_WRITE, ActionKind.FILE_EDIT, ActionKind.APPLY_PATCH, ActionKind.ACP_WRITE],
)
def test_write_kinds_are_refused_at_the_surface_before_any_policy(
    mode: Mode, kind: ActionKind
) -> None:
    later = Recorder()
    chain = standard_chain(_policy(mode), extra=[later])
    with pytest.raises(ActionRefused) as info:
        chain.check(_action(kind, mode, path="/home/dev/.ssh/id_ed25519"))
    assert info.value.guardrail == "tool-surface"
    assert later.seen == []


def test_a_mislabelled_tool_or_mode_is_refused_at_the_surface() -> None:
    chain = standard_chain(_policy(Mode.REVIEW))
    # The kind needs the write tool even if the action claims the read tool.
    disguised = Action(
        kind=ActionKind.ACP_WRITE, tool="read", session_id="s1", mode=Mode.REVIEW, path="a"
    )
    with pytest.raises(ActionRefused, match="'write' tool") as info:
        chain.check(disguised)
    assert info.value.guardrail == "tool-surface"
    # An action claiming chat in a review session.
    with pytest.raises(ActionRefused, match="claims chat mode"):
        chain.check(_action(ActionKind.FILE_WRITE, Mode.CHAT, path="a"))


def test_acp_and_harness_actions_pass_the_same_rules() -> None:
    chain = standard_chain(_policy(Mode.REVIEW))
    for kind in (ActionKind.BASH, ActionKind.ACP_TERMINAL):
        with pytest.raises(ActionRefused) as info:
            chain.check(_action(kind, Mode.REVIEW, argv=("git", "push")))
        assert info.value.guardrail == "command-policy"
        chain.check(_action(kind, Mode.REVIEW, argv=("git", "status")))
    for kind in (ActionKind.FILE_READ, ActionKind.ACP_READ):
        with pytest.raises(ActionRefused) as info:
            chain.check(_action(kind, Mode.REVIEW, path="/home/dev/.ssh/id_ed25519"))
        assert info.value.guardrail == "path-policy"
        chain.check(_action(kind, Mode.REVIEW, path="src/main.py"))


@pytest.mark.parametrize(
    "kind, path, refused",
    [
        (ActionKind.FILE_READ, "src/a.py", None),
        (ActionKind.FILE_READ, "/workspace/../srv/wt/conv-1/a", "outside"),
        (ActionKind.FILE_READ, "../../etc/passwd", "outside"),
        (ActionKind.FILE_READ, "/etc/passwd", "outside"),
        (ActionKind.FILE_READ, "/home/dev/.aws/credentials", "secret"),
        (ActionKind.FILE_READ, f"{REPO}/README", None),
        (ActionKind.SEARCH, "/home/dev", None),  # a walk of home skips the secrets itself
        (ActionKind.FILE_WRITE, "src/a.py", None),
        (ActionKind.FILE_WRITE, ".git/hooks/pre-commit", "never writable"),
        (ActionKind.FILE_WRITE, f"{REPO}/README", "protected path"),
        (ActionKind.FILE_WRITE, "/home/dev/notes", "read-only bind"),
        (ActionKind.ACP_WRITE, "/home/dev/.ssh/authorized_keys", "secret"),
        (ActionKind.FILE_WRITE, "", "empty"),
        (ActionKind.FILE_WRITE, "a\x00b", "NUL"),
    ],
)
def test_path_policy_on_the_path_as_spelled(
    kind: ActionKind, path: str, refused: str | None
) -> None:
    chain = standard_chain(_policy())
    action = _action(kind, path=path)
    if refused is None:
        chain.check(action)
        return
    with pytest.raises(ActionRefused, match=refused) as info:
        chain.check(action)
    assert info.value.guardrail == "path-policy"


def test_file_and_command_actions_without_their_target_are_refused() -> None:
    chain = standard_chain(_policy())
    with pytest.raises(ActionRefused, match="without a path"):
        chain.check(_action(ActionKind.FILE_READ))
    with pytest.raises(ActionRefused, match="without an argv"):
        chain.check(_action(ActionKind.BASH))


def test_a_refusal_says_which_guardrail_what_and_why() -> None:
    action = _action(ActionKind.BASH, Mode.CHAT, argv=("x" * 500,))
    err = ActionRefused(action, "g", "because", fix="do y")
    assert err.action is action and err.guardrail == "g" and err.reason == "because"
    text = str(err)
    assert text.startswith("g refused bash 'xxx") and "because" in text and "do y" in text
    assert len(text) < 400
