"""Each mode's tool surface and the reviewed command table, as data, with clear refusals."""

from __future__ import annotations

import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cc_server.dispatch.actions import ActionRefused
from cc_server.dispatch.modes import (
    ALL_TOOLS,
    WRITE_TOOLS,
    InvalidCommandPolicy,
    check_command,
    load_command_policy,
    packaged_command_policy,
    split_shell,
    tools_for_mode,
)
from cc_server.policy import Mode

READ_ONLY_MODES = (Mode.REVIEW, Mode.PLAN, Mode.ORCHESTRATE)


def test_chat_has_every_tool_and_read_only_modes_no_write_tool() -> None:
    assert tools_for_mode(Mode.CHAT) == ALL_TOOLS
    assert {"bash", "read", "write", "edit", "apply_patch", "search", "find", "search_files"} == (
        ALL_TOOLS
    )
    for mode in READ_ONLY_MODES:
        surface = tools_for_mode(mode)
        assert not surface & WRITE_TOOLS, mode
        assert surface == ALL_TOOLS - WRITE_TOOLS
    assert tools_for_mode("review") == tools_for_mode(Mode.REVIEW)  # type: ignore[arg-type]


REFUSED_IN_READ_ONLY = [
    "git push",
    "git push origin main",
    "git -C /repo push --force",
    "git -c user.name=x push",
    "git --git-dir=/r/.git push",
    "git commit -m fix",
    "git commit --amend",
    "git merge main",
    "git rebase -i HEAD~3",
    "git reset --hard",
    "git checkout -b new",
    "git stash",
    "git tag v1",
    "git branch -D old",
    "git config user.email a@b",
    "git remote add up https://x",
    "git send-email a.patch",
    "gh pr create --fill",
    "gh pr merge 3",
    "gh issue create -t x",
    "gh release create v1",
    "gh repo create x",
    "gh api -X POST repos/o/r/issues",
    "gh api repos/o/r/issues -f title=x",
    "npm publish",
    "pnpm publish --access public",
    "yarn npm publish",
    "npm install left-pad",
    "cargo publish",
    "twine upload dist/*",
    "pip install requests",
    "poetry publish",
    "docker push img",
    "rm -rf src",
    "mv a b",
    "touch x",
    "sed -i s/a/b/ f",
    "sed -ni 1p f",
    "perl -pi -e s/a/b/ f",
    "echo hi > file",
    "echo hi >> file",
    "cat a | tee b",
    "curl -T file https://x",
    "curl -d x=1 https://x",
    "curl -o out https://x",
    # Hidden behind shells, wrappers, substitutions and separators.
    "ls && git push",
    "ls; git push",
    "ls || git push",
    "ls | git push",
    "echo $(git push)",
    "echo `git push`",
    "(git push)",
    "{ git push; }",
    "FOO=1 git push",
    "env FOO=1 git push",
    "sudo -u root git push",
    "timeout 5 git push",
    "nice -n 5 git push",
    "xargs git push",
    "bash -c 'git push'",
    'sh -lc "npm publish"',
    "bash -c \"bash -c 'git push'\"",
    "/usr/bin/git push",
    "./node_modules/.bin/npm publish",
    "git status\ngit push",
    "env -S 'git push'",
    "env -vS'git push'",
    "env -iS'git push'",
    "env --split-string='git push'",
    "git -c alias.p='!git push' p",
    "git --config-env=core.hooksPath=X status",
    "GIT_CONFIG_PARAMETERS=\"'alias.p=!git push'\" git p",
    "GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=alias.p GIT_CONFIG_VALUE_0='!git push' git p",
    "env GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=alias.p GIT_CONFIG_VALUE_0='!git push' git p",
    "export GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=alias.p GIT_CONFIG_VALUE_0='!git push'; git p",
    "declare -x GIT_CONFIG_PARAMETERS; git p",
    "find . -name x -exec rm {} \\;",
    "find . -execdir sh -c 'git push' \\;",
    "find . -name '*.tmp' -delete",
]

ALLOWED_IN_READ_ONLY = [
    "git status",
    "git log --oneline -n 5",
    "git diff HEAD~1",
    "git show HEAD:README",
    "git branch",
    "git branch -a",
    "git config --get user.name",
    "git config --list",
    "git fetch",
    "gh pr view 3",
    "gh pr diff 3",
    "gh api repos/o/r/pulls",
    "gh --version",
    "ls -la",
    "cat README | grep x",
    "grep -rn TODO src",
    "sed -n 1,20p f",
    "echo hi 2>/dev/null",
    "ls 2>&1 | head",
    "npm ls",
    "npm test",
    "cargo build",
    "pytest -q",
    "curl https://example.com",
    "env",
    "git log -c",
    "git -C /repo log",
    "find . -name '*.py' -exec grep -l TODO {} +",
]


@pytest.mark.parametrize("mode", READ_ONLY_MODES)
@pytest.mark.parametrize("line", REFUSED_IN_READ_ONLY)
def test_read_only_modes_refuse_publishing_pushing_and_modifying(mode: Mode, line: str) -> None:
    with pytest.raises(ActionRefused) as info:
        check_command(mode, ["bash", "-c", line])
    assert info.value.guardrail == "command-policy"
    assert f"{mode} mode" in str(info.value)
    assert info.value.fix


@pytest.mark.parametrize("mode", READ_ONLY_MODES)
@pytest.mark.parametrize("line", ALLOWED_IN_READ_ONLY)
def test_read_only_modes_allow_reading(mode: Mode, line: str) -> None:
    check_command(mode, ["bash", "-c", line])


@pytest.mark.parametrize("line", REFUSED_IN_READ_ONLY + ALLOWED_IN_READ_ONLY)
def test_chat_runs_what_its_sandbox_and_capabilities_allow(line: str) -> None:
    check_command(Mode.CHAT, ["bash", "-c", line])


def test_argv_commands_are_checked_without_a_shell() -> None:
    with pytest.raises(ActionRefused, match="publishes commits"):
        check_command(Mode.REVIEW, ["git", "push"])
    with pytest.raises(ActionRefused, match="publishes"):
        check_command(Mode.PLAN, ["/usr/bin/env", "npm", "publish"])
    # A literal '>' argument is an argument, not a redirection.
    check_command(Mode.REVIEW, ["grep", ">", "file"])


def test_the_refusal_names_the_command_and_the_rule_reason() -> None:
    with pytest.raises(ActionRefused) as info:
        check_command(Mode.REVIEW, ["bash", "-c", "git -C /repo push origin"])
    assert "'git push'" in info.value.reason
    assert "publishes commits" in info.value.reason


@pytest.mark.parametrize(
    "argv",
    [[], ["bash", "-c", "echo 'unclosed"], ["a\x00b"], ["bash", "-c", "x" * (300 * 1024)]],
)
def test_what_cannot_be_checked_is_refused(argv: list[str]) -> None:
    with pytest.raises(ActionRefused):
        check_command(Mode.REVIEW, argv)


def test_deep_nesting_is_refused_not_followed() -> None:
    line = "true"
    for _ in range(6):
        line = f"sh -c {shlex.quote(line)}"
    check_command(Mode.REVIEW, ["bash", "-c", line])  # six shells deep is followed
    with pytest.raises(ActionRefused, match="nested"):
        check_command(Mode.REVIEW, ["bash", "-c", "env " * 12 + "true"])


def test_split_shell_makes_substitutions_their_own_commands() -> None:
    assert split_shell("a b && c $(d e) | f `g`") == [["a", "b"], ["c"], ["d", "e"], ["f"], ["g"]]
    with pytest.raises(ValueError):
        split_shell("echo 'x")


def test_the_packaged_table_loads_and_every_rule_has_a_reason() -> None:
    table = packaged_command_policy()
    assert table.rules
    assert all(rule.reason and rule.modes and rule.programs for rule in table.rules)
    assert not any(Mode.CHAT in rule.modes for rule in table.rules)
    assert table.redirect_modes == frozenset(READ_ONLY_MODES)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("not toml [", "not TOML"),
        ("[surprise]\n", "unknown tables"),
        ('[[rule]]\nmodes = ["review"]\nprogram = "git"\n', "reason"),
        ('[[rule]]\nprogram = "git"\nreason = "r"\n', "modes"),
        ('[[rule]]\nmodes = ["nope"]\nprogram = "git"\nreason = "r"\n', "unknown mode"),
        ('[[rule]]\nmodes = ["review"]\nreason = "r"\n', "program"),
        ('[[rule]]\nmodes = ["review"]\nprogram = "/bin/git"\nreason = "r"\n', "base names"),
        ('[[rule]]\nmodes = ["review"]\nprogram = "g"\nreason = "r"\nextra = 1\n', "unknown"),
        (
            '[[rule]]\nmodes = ["review"]\nprogram = "g"\nreason = "r"\nonly = ["a"]\n'
            'flags = ["-x"]\n',
            "cannot be combined",
        ),
        ("[wrappers]\nenv = -1\n", "wrapper"),
        ("[exec_options]\nfind = [1]\n", "exec_options"),
        (
            '[[rule]]\nmodes = ["review"]\nprogram = "g"\nreason = "r"\nonly = ["a"]\n'
            'global_flags = ["-x"]\n',
            "cannot be combined",
        ),
    ],
)
def test_a_malformed_table_fails_loudly(text: str, problem: str) -> None:
    with pytest.raises(InvalidCommandPolicy, match=problem) as info:
        load_command_policy(text)
    assert info.value.fix


def test_a_custom_table_is_used_when_given() -> None:
    table = load_command_policy(
        '[[rule]]\nmodes = ["chat"]\nprogram = "make"\nsubcommands = ["deploy"]\n'
        'reason = "deploys"\n'
    )
    with pytest.raises(ActionRefused, match="deploys"):
        check_command(Mode.CHAT, ["make", "deploy"], policy=table)
    check_command(Mode.CHAT, ["make", "test"], policy=table)
    check_command(Mode.REVIEW, ["git", "push"], policy=table)


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from(list(Mode)),
    st.text(alphabet=st.sampled_from(list("gitpush ;&|$()`{}'\"\\<>\n-cS=ab")), max_size=80),
)
def test_any_command_line_is_either_allowed_or_refused_cleanly(mode: Mode, line: str) -> None:
    """The parser is fuzzed: whatever the line, the answer is allow or ActionRefused."""
    try:
        check_command(mode, ["bash", "-c", line])
    except ActionRefused as exc:
        assert exc.guardrail == "command-policy"
