"""Each mode's tool surface and command policy.

The surface is fixed here: chat has every tool; review, plan and orchestrate keep every bind
read-only and get no write, edit or apply-patch tool. The command policy is the reviewed table
in `command_policy.toml`, checked when this module is imported: a malformed table fails loudly.
"""

from __future__ import annotations

import functools
import itertools
import posixpath
import re
import shlex
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from cc_server.dispatch.actions import Action, ActionKind, ActionRefused
from cc_server.errors import EnforcementFailed
from cc_server.policy import Mode

__all__ = [
    "ALL_TOOLS",
    "COMMAND_POLICY_RESOURCE",
    "WRITE_TOOLS",
    "CommandPolicy",
    "CommandRule",
    "InvalidCommandPolicy",
    "check_command",
    "load_command_policy",
    "packaged_command_policy",
    "split_shell",
    "tools_for_mode",
]

COMMAND_POLICY_RESOURCE = "command_policy.toml"
ALL_TOOLS = frozenset(
    {"bash", "read", "write", "edit", "apply_patch", "search", "find", "search_files"}
)
WRITE_TOOLS = frozenset({"write", "edit", "apply_patch"})
MAX_COMMAND_BYTES = 256 * 1024  # a command line longer than ARG_MAX-ish is refused, not parsed
MAX_NESTING = 8  # `sh -c "sh -c ..."` deeper than this is refused rather than followed
MAX_WRAPPER_STARTS = 16  # words after a wrapper tried as the start of the wrapped command

_SURFACES: dict[Mode, frozenset[str]] = {
    Mode.CHAT: ALL_TOOLS,
    Mode.REVIEW: ALL_TOOLS - WRITE_TOOLS,
    Mode.PLAN: ALL_TOOLS - WRITE_TOOLS,
    Mode.ORCHESTRATE: ALL_TOOLS - WRITE_TOOLS,  # its binds are read-only too
}


def tools_for_mode(mode: Mode) -> frozenset[str]:
    """The tool names the mode exposes to the agent."""
    return _SURFACES[Mode(mode)]


class InvalidCommandPolicy(EnforcementFailed):
    """The command table is malformed: commands cannot be checked until it is fixed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandRule:
    """One row of the table (see the header of `command_policy.toml`)."""

    index: int
    modes: frozenset[Mode]
    programs: frozenset[str]
    subcommands: tuple[tuple[str, ...], ...]
    flags: tuple[str, ...]
    global_flags: tuple[str, ...]
    except_flags: frozenset[str]
    only: tuple[tuple[str, ...], ...]
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandPolicy:
    """The whole table."""

    rules: tuple[CommandRule, ...]
    wrappers: Mapping[str, int]
    shells: frozenset[str]
    value_options: Mapping[str, frozenset[str]]
    exec_options: Mapping[str, frozenset[str]]
    redirect_modes: frozenset[Mode]
    redirect_reason: str
    variable_modes: frozenset[Mode] = frozenset()
    variable_names: frozenset[str] = frozenset()
    variable_setters: frozenset[str] = frozenset()
    variable_reason: str = ""


_RULE_KEYS = frozenset(
    {
        "modes",
        "program",
        "programs",
        "subcommands",
        "flags",
        "global_flags",
        "except_flags",
        "only",
        "reason",
    }
)
_TOP_KEYS = frozenset(
    {"redirects", "variables", "wrappers", "shells", "value_options", "exec_options", "rule"}
)


def _fail(where: str, problem: str) -> InvalidCommandPolicy:
    return InvalidCommandPolicy(
        f"{COMMAND_POLICY_RESOURCE}: {where}: {problem}",
        fix=f"correct {where} in {COMMAND_POLICY_RESOURCE}",
    )


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _fail(where, "must be a list of non-empty strings")
    return list(value)


def _modes(value: Any, where: str) -> frozenset[Mode]:
    names = _strings(value, where)
    try:
        return frozenset(Mode(n) for n in names)
    except ValueError:
        raise _fail(where, f"unknown mode in {names}") from None


def _parse_rule(index: int, raw: Any) -> CommandRule:
    where = f"rule[{index}]"
    if not isinstance(raw, dict):
        raise _fail(where, "must be a table")
    unknown = set(raw) - _RULE_KEYS
    if unknown:
        raise _fail(where, f"unknown keys {sorted(unknown)}")
    if ("program" in raw) == ("programs" in raw):
        raise _fail(where, "needs exactly one of 'program' or 'programs'")
    programs = (
        [raw["program"]] if "program" in raw else _strings(raw["programs"], f"{where}.programs")
    )
    if not all(isinstance(p, str) and p and "/" not in p for p in programs):
        raise _fail(where, "programs are base names")
    reason = raw.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise _fail(where, "needs a non-empty reason")
    subcommands = tuple(
        tuple(s.split()) for s in _strings(raw.get("subcommands", []), f"{where}.subcommands")
    )
    only = tuple(tuple(s.split()) for s in _strings(raw.get("only", []), f"{where}.only"))
    flags = tuple(_strings(raw.get("flags", []), f"{where}.flags"))
    global_flags = tuple(_strings(raw.get("global_flags", []), f"{where}.global_flags"))
    if only and (subcommands or flags or global_flags):
        raise _fail(where, "'only' cannot be combined with 'subcommands' or 'flags'")
    if "modes" not in raw:
        raise _fail(where, "needs 'modes'")
    return CommandRule(
        index=index,
        modes=_modes(raw["modes"], f"{where}.modes"),
        programs=frozenset(programs),
        subcommands=subcommands,
        flags=flags,
        global_flags=global_flags,
        except_flags=frozenset(_strings(raw.get("except_flags", []), f"{where}.except_flags")),
        only=only,
        reason=reason.strip(),
    )


def load_command_policy(text: str) -> CommandPolicy:
    """Parse and check a table in the format of `command_policy.toml`.

    Raises:
        InvalidCommandPolicy: not TOML, an unknown key, a rule without modes, program or reason,
            an unknown mode, or a wrapper count that is not a small non-negative integer.
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _fail("<document>", f"not TOML ({exc})") from None
    unknown = set(doc) - _TOP_KEYS
    if unknown:
        raise _fail("<document>", f"unknown tables {sorted(unknown)}")
    redirects = doc.get("redirects", {})
    if not isinstance(redirects, dict) or set(redirects) - {"deny_in", "reason"}:
        raise _fail("redirects", "must hold only 'deny_in' and 'reason'")
    wrappers = doc.get("wrappers", {})
    if not isinstance(wrappers, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 4 for v in wrappers.values()
    ):
        raise _fail("wrappers", "each wrapper takes 0 to 4 arguments before its command")
    shells = doc.get("shells", {})
    if not isinstance(shells, dict) or set(shells) - {"names"}:
        raise _fail("shells", "must hold only 'names'")
    value_options = doc.get("value_options", {})
    if not isinstance(value_options, dict):
        raise _fail("value_options", "must be a table")
    exec_options = doc.get("exec_options", {})
    if not isinstance(exec_options, dict):
        raise _fail("exec_options", "must be a table")
    variables = doc.get("variables", {})
    if not isinstance(variables, dict) or set(variables) - {
        "deny_in",
        "names",
        "setters",
        "reason",
    }:
        raise _fail("variables", "must hold only 'deny_in', 'names', 'setters' and 'reason'")
    raw_rules = doc.get("rule", [])
    if not isinstance(raw_rules, list):
        raise _fail("rule", "must be an array of tables")
    return CommandPolicy(
        rules=tuple(_parse_rule(i, raw) for i, raw in enumerate(raw_rules)),
        wrappers=dict(wrappers),
        shells=frozenset(_strings(shells.get("names", []), "shells.names")),
        value_options={
            k: frozenset(_strings(v, f"value_options.{k}")) for k, v in value_options.items()
        },
        exec_options={
            k: frozenset(_strings(v, f"exec_options.{k}")) for k, v in exec_options.items()
        },
        redirect_modes=_modes(redirects.get("deny_in", []), "redirects.deny_in"),
        redirect_reason=str(redirects.get("reason", "writes a file through a redirection")),
        variable_modes=_modes(variables.get("deny_in", []), "variables.deny_in"),
        variable_names=frozenset(_strings(variables.get("names", []), "variables.names")),
        variable_setters=frozenset(_strings(variables.get("setters", []), "variables.setters")),
        variable_reason=str(variables.get("reason", "sets a refused environment variable")),
    )


@functools.cache
def packaged_command_policy() -> CommandPolicy:
    """The reviewed table shipped with the package (parsed once)."""
    text = resources.files("cc_server.dispatch").joinpath(COMMAND_POLICY_RESOURCE).read_text()
    return load_command_policy(text)


# --- shell parsing -----------------------------------------------------------------------------

_SEPARATOR_CHARS = frozenset(";&|\n")
_REDIRECT_TOKENS = frozenset({">", ">>", ">|", "&>", "&>>", "<>"})
_HARMLESS_TARGETS = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty"})
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


class _Unparseable(ValueError):
    pass


def split_shell(line: str) -> list[list[str]]:
    """Split a shell command line into simple commands (lists of words, redirections kept).

    Newlines, command substitutions, backticks, subshells and braces become command boundaries, so
    what runs inside them is checked as a command of its own. (Inside quotes too: that can only
    make more words count as commands, never fewer.)

    Raises:
        ValueError: the line cannot be tokenised (an unclosed quote): refuse it, do not guess.
    """
    # Boundaries for what shlex does not know: $( ... ), `...`, ( ... ), { ...; }.
    prepared = (
        line.replace("\n", " ; ")
        .replace("$(", " ; ")
        .replace("`", " ; ")
        .replace("(", " ; ")
        .replace(")", " ; ")
        .replace("{", " ; ")
        .replace("}", " ; ")
    )
    lexer = shlex.shlex(prepared, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError as exc:
        raise _Unparseable(str(exc)) from None
    commands: list[list[str]] = [[]]
    for token in tokens:
        if token and set(token) <= _SEPARATOR_CHARS:
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def _refuse(action: Action, reason: str) -> ActionRefused:
    return ActionRefused(
        action,
        "command-policy",
        reason,
        fix=f"run it in chat mode, or leave it out of the {action.mode} session",
    )


def _leading_words(args: Sequence[str], value_options: frozenset[str]) -> list[str]:
    """Arguments that are not options, in order (values of known valued options skipped)."""
    words: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg.startswith("-"):
            if arg in value_options:
                skip = True
            continue
        words.append(arg)
    return words


def _flag_hit(args: Sequence[str], flags: Sequence[str]) -> str | None:
    for arg in args:
        for flag in flags:
            if arg == flag:
                return flag
            if flag.startswith("--") and arg.startswith(flag + "="):
                return flag
            if not flag.startswith("--") and len(flag) == 2 and arg.startswith(flag):
                return flag
            # bundled short flags: -ni for sed, -pi for perl
            if (
                len(flag) == 2
                and not arg.startswith("--")
                and arg.startswith("-")
                and flag[1] in arg[1:]
                and arg[1:].isalpha()
            ):
                return flag
    return None


def _global_args(args: Sequence[str], value_options: frozenset[str]) -> list[str]:
    """The options before the first subcommand word (`git -c k=v -C dir`), with their values."""
    out: list[str] = []
    takes_value = False
    for arg in args:
        if takes_value:
            out.append(arg)
            takes_value = False
            continue
        if not arg.startswith("-"):
            break
        out.append(arg)
        takes_value = arg in value_options
    return out


def _split_string_value(word: str) -> str:
    """The command line in a wrapper's word that holds spaces: the word itself, or the value of
    the option carrying it (`--split-string=LINE`, or `-S` in a cluster: `-S LINE`, `-vSLINE`)."""
    if word.startswith("--"):
        return word.partition("=")[2] if "=" in word else word
    if word.startswith("-") and "S" in word:
        return word[word.index("S") + 1 :]
    return word


def _check_variables(policy: CommandPolicy, action: Action, words: Sequence[str]) -> None:
    """Refuse a command that assigns one of [variables]' names: as a leading `NAME=value`, or
    named (with or without a value) to a setter (`export NAME`, `declare -x NAME=v`)."""
    named = [w.partition("=")[0] for w in itertools.takewhile(_ASSIGNMENT.match, words)]
    rest = words[len(named) :]
    if rest and posixpath.basename(rest[0]) in policy.variable_setters:
        named += [w.partition("=")[0] for w in rest[1:]]
    for name in named:
        if name in policy.variable_names:
            raise _refuse(action, f"{name!r} {policy.variable_reason}")


def _rule_applies(
    rule: CommandRule, args: Sequence[str], words: Sequence[str], global_args: Sequence[str]
) -> bool:
    if rule.except_flags and any(a in rule.except_flags for a in args):
        return False
    if rule.only:
        return not any(tuple(words[: len(seq)]) == seq for seq in rule.only) and bool(words)
    if rule.subcommands:
        # A subcommand sequence may contain options (`branch -d`): match on all arguments then.
        matched = False
        for seq in rule.subcommands:
            if any(part.startswith("-") for part in seq):
                head = seq[0]
                if words[:1] == [head] and all(p in args for p in seq[1:]):
                    matched = True
            elif tuple(words[: len(seq)]) == seq:
                matched = True
        if not matched:
            return False
    if rule.global_flags and _flag_hit(global_args, rule.global_flags) is None:
        return False
    if rule.flags:
        return _flag_hit(args, rule.flags) is not None
    return True


def _check_simple(
    policy: CommandPolicy, mode: Mode, words: list[str], action: Action, depth: int
) -> None:
    if depth > MAX_NESTING:
        raise _refuse(action, f"commands nested deeper than {MAX_NESTING} are not followed")
    # Redirections: writing a file is a modification.
    clean: list[str] = []
    i = 0
    while i < len(words):
        token = words[i]
        if token in _REDIRECT_TOKENS or (token.endswith(">") and token.rstrip(">&").isdigit()):
            target = words[i + 1] if i + 1 < len(words) else ""
            if mode in policy.redirect_modes and target not in _HARMLESS_TARGETS:
                raise _refuse(action, f"{policy.redirect_reason} ({target!r})")
            i += 2
            continue
        if token in {"<", "<<", "<<<", ">&", "<&"} or set(token) <= set("<>&"):
            i += 2
            continue
        clean.append(token)
        i += 1
    # Leading assignments and wrappers.
    if mode in policy.variable_modes:
        _check_variables(policy, action, clean)
    while clean and _ASSIGNMENT.match(clean[0]):
        clean.pop(0)
    if not clean:
        return
    if posixpath.basename(clean[0]) in policy.wrappers:
        # A wrapper's own options may take values (`sudo -u root git push`): rather than know
        # every wrapper's options, check the command starting at each later word.
        starts = [k for k in range(1, len(clean)) if not clean[k].startswith("-")]
        for k in starts[:MAX_WRAPPER_STARTS]:
            _check_simple(policy, mode, clean[k:], action, depth + 1)
        for word in clean[1:]:
            if any(c.isspace() for c in word):  # `env -S 'git push'` splits its argument
                _check_line(policy, mode, _split_string_value(word), action, depth + 1)
        if len(starts) > MAX_WRAPPER_STARTS:
            raise _refuse(action, "a wrapped command with too many leading words to check")
        return
    program = posixpath.basename(clean[0])
    args = clean[1:]
    if program in policy.shells:
        for j, arg in enumerate(args):
            if arg == "-c" or (arg.startswith("-") and not arg.startswith("--") and "c" in arg):
                if j + 1 < len(args):
                    _check_line(policy, mode, args[j + 1], action, depth + 1)
                return
        return
    exec_options = policy.exec_options.get(program, frozenset())
    for j, arg in enumerate(args):
        if arg in exec_options:  # `find -exec rm {} ;`: the words up to ';' or '+' are a command
            end = next((k for k in range(j + 1, len(args)) if args[k] in (";", "+")), len(args))
            if j + 1 < end:
                _check_simple(policy, mode, list(args[j + 1 : end]), action, depth + 1)
    value_options = policy.value_options.get(program, frozenset())
    words_ = _leading_words(args, value_options)
    global_args = _global_args(args, value_options)
    for rule in policy.rules:
        if (
            mode in rule.modes
            and program in rule.programs
            and _rule_applies(rule, args, words_, global_args)
        ):
            shown = " ".join([program, *words_[:1]])
            raise _refuse(action, f"{shown!r} {rule.reason}")


def _check_line(policy: CommandPolicy, mode: Mode, line: str, action: Action, depth: int) -> None:
    if depth > MAX_NESTING:
        raise _refuse(action, f"shell commands nested deeper than {MAX_NESTING} are not followed")
    if len(line.encode("utf-8", "surrogateescape")) > MAX_COMMAND_BYTES:
        raise _refuse(action, f"the command line is longer than {MAX_COMMAND_BYTES} bytes")
    try:
        commands = split_shell(line)
    except ValueError as exc:
        raise _refuse(action, f"the shell command cannot be parsed ({exc})") from None
    for words in commands:
        _check_simple(policy, mode, words, action, depth)


def check_command(
    mode: Mode,
    argv: Sequence[str],
    *,
    action: Action | None = None,
    policy: CommandPolicy | None = None,
) -> None:
    """Check a command against the mode's row of the table before it is launched.

    `argv` is the command as it will be exec'd (`["bash", "-c", "git push"]` is checked as the
    shell line it carries). `action` is the action to name in a refusal.

    Raises:
        ActionRefused: the table refuses the command (guardrail `command-policy`, with the rule's
            reason), or it cannot be parsed well enough to check.
    """
    mode = Mode(mode)
    table = packaged_command_policy() if policy is None else policy
    act = action or Action(
        kind=ActionKind.BASH, tool="bash", session_id="", mode=mode, argv=tuple(argv)
    )
    if not argv:
        raise _refuse(act, "an empty command")
    if any("\x00" in a for a in argv):
        raise _refuse(act, "an argument contains a NUL byte")
    if mode not in table.redirect_modes and not any(mode in r.modes for r in table.rules):
        return  # the mode's row is empty: nothing to check, nothing to parse
    # The argv is a simple command (a literal '>' in it is an argument, not a redirection);
    # shells recurse into their -c string.
    words = [shlex.quote(a) if a in _REDIRECT_TOKENS else a for a in argv]
    _check_simple(table, mode, words, act, 0)
