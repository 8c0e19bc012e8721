"""Reading and checking Seatbelt profiles (SBPL) in the tests, with no Mac at hand.

- `parse` reads a profile as S-expressions (strings, `#"regex"` literals, symbols, `;` comments).
- `check` insists that every rule uses only operations, filters and modifiers Seatbelt defines
  (the lists below, with their sources), that every path a rule names is absolute or a parameter
  given on the command line, and that every deny carries the session's message. A typo in an
  operation or filter name therefore fails a test here instead of failing `sandbox-exec` on a Mac.
- `decide` evaluates the checked rules the way Seatbelt does, the last matching rule winning, so
  tests can ask "is a write to X allowed?" rather than grep the text. Regexes are evaluated with
  Python's `re`, which agrees with Seatbelt's matcher on the constructs the generator emits
  (anchors, escaped characters, `[^/]`, `*`, `(/.*)?`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

# Operation names Seatbelt accepts. Source: the libsandbox operation table as reverse-engineered
# for macOS 10.15-13 (the SandBlaster / sandbox_toolkit "operation_names" lists), cross-checked
# with "Apple Sandbox Guide v1.0" (fG!, 2011) and the operations used by Apple's own profiles in
# /System/Library/Sandbox/Profiles, Chromium's sandbox/policy/mac/*.sb and OpenAI Codex's
# seatbelt_base_policy.sbpl. Wildcard names (`file-write*`) cover their family.
OPERATIONS: frozenset[str] = frozenset(
    {
        "default",
        "appleevent-send",
        "authorization-right-obtain",
        "boot-arg-set",
        "device*",
        "device-camera",
        "device-microphone",
        "darwin-notification-post",
        "distributed-notification-post",
        "dynamic-code-generation",
        "file*",
        "file-chroot",
        "file-clone",
        "file-ioctl",
        "file-issue-extension",
        "file-link",
        "file-map-executable",
        "file-mknod",
        "file-mount",
        "file-mount-update",
        "file-read*",
        "file-read-data",
        "file-read-metadata",
        "file-read-xattr",
        "file-revoke",
        "file-search",
        "file-test-existence",
        "file-unmount",
        "file-write*",
        "file-write-acl",
        "file-write-create",
        "file-write-data",
        "file-write-finderinfo",
        "file-write-flags",
        "file-write-mode",
        "file-write-owner",
        "file-write-setugid",
        "file-write-times",
        "file-write-unlink",
        "file-write-xattr",
        "fs-rename",
        "generic-issue-extension",
        "hid-control",
        "iokit*",
        "iokit-open",
        "iokit-get-properties",
        "iokit-set-properties",
        "ipc*",
        "ipc-posix*",
        "ipc-posix-sem",
        "ipc-posix-shm*",
        "ipc-sysv*",
        "job-creation",
        "lsopen",
        "mach*",
        "mach-host*",
        "mach-lookup",
        "mach-priv-task-port",
        "mach-register",
        "network*",
        "network-bind",
        "network-inbound",
        "network-outbound",
        "nvram*",
        "process*",
        "process-exec",
        "process-exec*",
        "process-exec-interpreter",
        "process-fork",
        "process-info*",
        "pseudo-tty",
        "signal",
        "sysctl*",
        "sysctl-read",
        "sysctl-write",
        "system*",
        "system-socket",
        "user-preference*",
        "user-preference-read",
        "user-preference-write",
    }
)
# Path filters (Apple Sandbox Guide v1.0, "Filters: path"; `path-literal` as used inside
# `(remote unix-socket ...)` by Chromium's and Codex's profiles).
PATH_FILTERS: frozenset[str] = frozenset({"literal", "subpath", "regex", "path-literal"})
# Network filters and their address kinds (Guide: "Filters: network"). The host of an ip/tcp/udp
# address may only be `*` or `localhost` ("host must be * or localhost in network address").
NETWORK_FILTERS: frozenset[str] = frozenset({"local", "remote"})
ADDRESS_KINDS: frozenset[str] = frozenset({"ip", "tcp", "udp", "unix-socket"})
NETWORK_ADDRESS = re.compile(r"^(\*|localhost):(\*|[0-9]{1,5})$")
# Action modifiers (Guide: "Modifiers"): the generator uses only `(with message "...")`.
MODIFIERS: frozenset[str] = frozenset({"message"})


@dataclass(frozen=True)
class Sym:
    name: str


@dataclass(frozen=True)
class Str:
    value: str


@dataclass(frozen=True)
class Regex:
    value: str


Node: TypeAlias = "Sym | Str | Regex | list[Node]"


class ProfileError(AssertionError):
    """A profile that Seatbelt would reject or that breaks a rule of the generator."""


_TOKEN = re.compile(r'\s+|;[^\n]*|\(|\)|#"(?:[^"\\]|\\.)*"|"(?:[^"\\]|\\.)*"|[^\s()";]+', re.S)
_ESCAPE = re.compile(r"\\(.)", re.S)


def parse(text: str) -> list[Node]:
    """Every top-level form of `text`."""
    stack: list[list[Node]] = [[]]
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ProfileError(f"cannot read the profile at offset {pos}: {text[pos:pos + 40]!r}")
        token = match.group()
        pos = match.end()
        if token.isspace() or token.startswith(";"):
            continue
        if token == "(":
            stack.append([])
        elif token == ")":
            if len(stack) == 1:
                raise ProfileError(f"unbalanced ')' at offset {match.start()}")
            done = stack.pop()
            stack[-1].append(done)
        elif token.startswith('#"'):
            stack[-1].append(Regex(_ESCAPE.sub(r"\1", token[2:-1])))
        elif token.startswith('"'):
            stack[-1].append(Str(_ESCAPE.sub(r"\1", token[1:-1])))
        else:
            stack[-1].append(Sym(token))
    if len(stack) != 1:
        raise ProfileError("unbalanced '(': the profile ends inside a form")
    return stack[0]


@dataclass(frozen=True)
class Filter:
    kind: str  # literal, subpath, regex, path-literal, or remote-ip/remote-tcp/... for network
    value: str  # the path, regex or address, parameters resolved
    param: str | None  # the parameter it came from, if any


@dataclass(frozen=True)
class Rule:
    action: str
    operations: tuple[str, ...]
    filters: tuple[Filter, ...]
    message: str | None


def _value(node: Node, params: Mapping[str, str], where: str) -> tuple[str, str | None]:
    if isinstance(node, Str | Regex):
        return node.value, None
    if (
        isinstance(node, list)
        and len(node) == 2
        and node[0] == Sym("param")
        and isinstance(node[1], Str)
    ):
        name = node[1].value
        if name not in params:
            raise ProfileError(f"{where}: parameter {name!r} is not given with -D")
        return params[name], name
    raise ProfileError(f"{where}: expected a string or (param \"NAME\"), got {node!r}")


def _filter(node: Node, params: Mapping[str, str], where: str) -> Filter:
    if not isinstance(node, list) or not node or not isinstance(node[0], Sym):
        raise ProfileError(f"{where}: expected a filter, got {node!r}")
    head = node[0].name
    if head in PATH_FILTERS:
        if len(node) != 2:
            raise ProfileError(f"{where}: ({head} ...) takes one argument")
        value, param = _value(node[1], params, where)
        if head == "regex":
            if not value.startswith("^") and not value.startswith("/"):
                raise ProfileError(f"{where}: regex {value!r} is not anchored to a path")
        elif not value.startswith("/"):
            raise ProfileError(f"{where}: ({head} {value!r}) is not an absolute path")
        return Filter(kind=head, value=value, param=param)
    if head in NETWORK_FILTERS:
        if len(node) != 3 or not isinstance(node[1], Sym) or node[1].name not in ADDRESS_KINDS:
            raise ProfileError(f"{where}: ({head} KIND ADDRESS) with KIND in {ADDRESS_KINDS}")
        kind = node[1].name
        if kind == "unix-socket":
            inner = _filter(node[2], params, where)
            if inner.kind not in ("path-literal", "literal", "subpath", "regex"):
                raise ProfileError(f"{where}: a unix-socket address is a path filter")
            return Filter(kind=f"{head}-unix-socket", value=inner.value, param=inner.param)
        value, param = _value(node[2], params, where)
        if not NETWORK_ADDRESS.match(value):
            raise ProfileError(f"{where}: network address {value!r}: host must be * or localhost")
        return Filter(kind=f"{head}-{kind}", value=value, param=param)
    raise ProfileError(f"{where}: unknown filter {head!r}")


def check(text: str, params: Sequence[tuple[str, str]], *, message: str) -> list[Rule]:
    """The rules of `text`, after checking every one (see the module docstring).

    Raises:
        ProfileError: with the offending form; the caller prints the profile.
    """
    given = dict(params)
    if len(given) != len(params):
        raise ProfileError("a parameter is given twice")
    forms = parse(text)
    if not forms or forms[0] != [Sym("version"), Sym("1")]:
        raise ProfileError("the profile must start with (version 1)")
    rules: list[Rule] = []
    used: set[str] = set()
    for index, form in enumerate(forms[1:], start=1):
        where = f"form {index}"
        if not isinstance(form, list) or not form or form[0] not in (Sym("allow"), Sym("deny")):
            raise ProfileError(f"{where}: only (allow ...) and (deny ...) rules, got {form!r}")
        action = form[0].name  # type: ignore[union-attr]
        operations: list[str] = []
        rest = form[1:]
        while rest and isinstance(rest[0], Sym):
            operations.append(rest[0].name)
            rest = rest[1:]
        if not operations:
            raise ProfileError(f"{where}: a rule names at least one operation")
        for op in operations:
            if op not in OPERATIONS:
                raise ProfileError(f"{where}: unknown operation {op!r}")
        filters: list[Filter] = []
        msg: str | None = None
        for item in rest:
            if isinstance(item, list) and item and item[0] == Sym("with"):
                if (
                    len(item) != 3
                    or not isinstance(item[1], Sym)
                    or item[1].name not in MODIFIERS
                    or not isinstance(item[2], Str)
                ):
                    raise ProfileError(f"{where}: bad modifier {item!r}")
                if msg is not None or item is not rest[-1]:
                    raise ProfileError(f"{where}: one (with message ...), last in the rule")
                msg = item[2].value
                continue
            flt = _filter(item, given, where)
            if flt.param is not None:
                used.add(flt.param)
            filters.append(flt)
        if action == "deny" and msg != message:
            raise ProfileError(f"{where}: a deny must carry (with message {message!r})")
        if action == "allow" and msg is not None:
            raise ProfileError(f"{where}: an allow carries no message")
        rules.append(Rule(action, tuple(operations), tuple(filters), msg))
    unused = set(given) - used
    if unused:
        raise ProfileError(f"parameters given but never used: {sorted(unused)}")
    return rules


def _op_matches(rule_op: str, op: str) -> bool:
    if rule_op == "default":
        return True
    if rule_op.endswith("*"):
        return op.startswith(rule_op[:-1])
    return op == rule_op


def _path_matches(flt: Filter, path: str) -> bool:
    if flt.kind in ("literal", "path-literal"):
        return path == flt.value
    if flt.kind == "subpath":
        root = flt.value.rstrip("/") or "/"
        return path == root or path.startswith(root.rstrip("/") + "/")
    if flt.kind == "regex":
        return re.search(flt.value, path) is not None
    return False


def _address_matches(flt: Filter, address: str) -> bool:
    if flt.kind == "remote-unix-socket":
        return address == flt.value
    if not flt.kind.startswith("remote-"):
        return False
    host, _, port = flt.value.partition(":")
    want_host, _, want_port = address.partition(":")
    return host in ("*", want_host) and port in ("*", want_port)


def decide(rules: Sequence[Rule], operation: str, target: str) -> str:
    """"allow" or "deny" for `operation` on `target` (a path, `localhost:PORT`, `*:PORT` for a
    remote host, or a Unix socket path for network operations), the last matching rule winning.
    Seatbelt's default without a matching rule is deny."""
    verdict = "deny"
    for rule in rules:
        if not any(_op_matches(op, operation) for op in rule.operations):
            continue
        if not rule.filters:
            verdict = rule.action
            continue
        if operation.startswith("network"):
            hit = any(_address_matches(f, target) for f in rule.filters)
        else:
            hit = any(_path_matches(f, target) for f in rule.filters)
        if hit:
            verdict = rule.action
    return verdict


def allow_reasons_missing(text: str) -> list[str]:
    """Allow rules without a one-line reason: the comment block right above each `(allow` line
    must contain a line starting with ';; Allow:'."""
    lines = text.splitlines()
    missing: list[str] = []
    for index, line in enumerate(lines):
        if not line.lstrip().startswith("(allow"):
            continue
        above = index - 1
        found = False
        while above >= 0 and lines[above].lstrip().startswith(";"):
            if lines[above].lstrip().startswith(";; Allow:"):
                found = True
                break
            above -= 1
        if not found:
            missing.append(line)
    return missing
