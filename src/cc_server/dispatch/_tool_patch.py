"""The file tools' apply_patch: the patch format parsed and applied to text (pure), and a patch
applied to a session's files through its policy gate, every file checked before one is written."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

from cc_server.dispatch._paths import GuestPath
from cc_server.dispatch._tool_gate import MAX_READ_BYTES, FileToolError, ToolGate
from cc_server.dispatch.actions import Action, ActionKind

__all__ = ["MAX_PATCH_OPS", "PatchOp", "apply_hunks", "apply_patch", "parse_patch"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PatchOp:
    """One section of a patch."""

    kind: str  # "add", "delete", "update"
    path: str
    move_to: str | None = None
    lines: tuple[str, ...] = ()  # add: the content lines; update: the hunk lines


def apply_patch(gate: ToolGate, patch: str, kind: ActionKind) -> list[str]:
    """Apply `patch` to the session's files; the guest paths changed (see `FileTools.apply_patch`).

    Raises:
        ActionRefused: any file of the patch is refused; nothing is changed.
        FileToolError: the patch does not parse or a hunk does not apply; nothing is changed.
    """
    ops = parse_patch(patch)
    planned: list[tuple[Action, GuestPath, bytes | None]] = []
    for op in ops:
        action = gate.action(kind, op.path)
        mapped = gate.admit(action, write=True)
        if op.kind == "add":
            planned.append((action, mapped, "".join(op.lines).encode()))
            continue
        with gate.open_target(action, mapped, create=False) as target:
            try:
                fd = gate.open_existing_for_write(action, target, os.O_RDONLY)
            except FileNotFoundError:
                raise FileToolError(f"{mapped.guest!r} does not exist") from None
            try:
                old = gate.read_fd(action, fd, mapped.guest, MAX_READ_BYTES)
            finally:
                os.close(fd)
        if op.kind == "delete":
            planned.append((action, mapped, None))
            continue
        new = apply_hunks(old.decode("utf-8", "surrogateescape"), op.lines, mapped.guest)
        data = new.encode("utf-8", "surrogateescape")
        if op.move_to is not None:
            move_action = gate.action(kind, op.move_to)
            moved = gate.admit(move_action, write=True)
            planned.append((action, mapped, None))
            planned.append((move_action, moved, data))
        else:
            planned.append((action, mapped, data))
    # Every write must be possible: check it now, so a refusal changes nothing.
    for action, mapped, content in planned:
        if content is not None:
            gate.precheck_write(action, mapped)
    changed: list[str] = []
    for action, mapped, content in planned:
        if content is None:
            with gate.open_target(action, mapped, create=False) as target:
                fd = gate.open_existing_for_write(action, target, os.O_RDONLY)
                os.close(fd)
                os.unlink(target.name, dir_fd=target.parent_fd)
        else:
            with gate.open_target(action, mapped, create=True) as target:
                gate.write_to(action, target, content)
        changed.append(mapped.guest)
    return list(dict.fromkeys(changed))


# --- the apply_patch format ----------------------------------------------------------------------

_BEGIN, _END = "*** Begin Patch", "*** End Patch"
_ADD, _DELETE, _UPDATE, _MOVE = (
    "*** Add File: ",
    "*** Delete File: ",
    "*** Update File: ",
    "*** Move to: ",
)
_EOF_MARK = "*** End of File"
MAX_PATCH_OPS: Final = 1000  # files one patch may touch


def parse_patch(patch: str) -> list[PatchOp]:
    """The sections of a patch in the apply_patch format, in order.

    Raises:
        FileToolError: it does not parse, changes nothing or touches too many files.
    """
    lines = patch.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines or lines[0].strip() != _BEGIN or lines[-1].strip() != _END:
        raise FileToolError(
            "a patch starts with '*** Begin Patch' and ends with '*** End Patch'",
            fix="send the patch in the apply_patch format",
        )
    ops: list[PatchOp] = []
    i = 1
    body = lines[1:-1]
    i = 0
    while i < len(body):
        line = body[i]
        if line.startswith(_ADD):
            path = line[len(_ADD) :].strip()
            i += 1
            content: list[str] = []
            while i < len(body) and not body[i].startswith("*** "):
                if not body[i].startswith("+"):
                    raise FileToolError(f"line {i + 2}: an added file's lines start with '+'")
                content.append(body[i][1:] + "\n")
                i += 1
            ops.append(PatchOp(kind="add", path=path, lines=tuple(content)))
        elif line.startswith(_DELETE):
            ops.append(PatchOp(kind="delete", path=line[len(_DELETE) :].strip()))
            i += 1
        elif line.startswith(_UPDATE):
            path = line[len(_UPDATE) :].strip()
            i += 1
            move_to = None
            if i < len(body) and body[i].startswith(_MOVE):
                move_to = body[i][len(_MOVE) :].strip()
                i += 1
            hunk: list[str] = []
            while i < len(body) and (
                not body[i].startswith("*** ") or body[i].strip() == _EOF_MARK
            ):
                if body[i].strip() != _EOF_MARK:
                    hunk.append(body[i])
                i += 1
            ops.append(PatchOp(kind="update", path=path, move_to=move_to, lines=tuple(hunk)))
        elif not line.strip():
            i += 1
        else:
            raise FileToolError(f"line {i + 2}: unexpected {line[:80]!r}")
        if len(ops) > MAX_PATCH_OPS:
            raise FileToolError(f"a patch touches at most {MAX_PATCH_OPS} files")
    if not ops:
        raise FileToolError("the patch changes nothing")
    if any(not op.path for op in ops):
        raise FileToolError("a patch section names no file")
    return ops


def apply_hunks(text: str, hunk_lines: tuple[str, ...], guest: str) -> str:
    """Apply `@@`-separated hunks of ' ', '-' and '+' lines, in order, to `text`."""
    lines = text.splitlines()
    trailing_newline = text.endswith("\n") or not text
    hunks: list[tuple[str, list[str]]] = []
    for line in hunk_lines:
        if line.startswith("@@"):
            hunks.append((line[2:].strip(), []))
        else:
            if not hunks:
                hunks.append(("", []))
            hunks[-1][1].append(line)
    position = 0
    for anchor, body in hunks:
        old: list[str] = []
        new: list[str] = []
        for line in body:
            marker, rest = (line[:1], line[1:]) if line else (" ", "")
            if marker == " ":
                old.append(rest)
                new.append(rest)
            elif marker == "-":
                old.append(rest)
            elif marker == "+":
                new.append(rest)
            else:
                raise FileToolError(f"{guest!r}: a hunk line starts with ' ', '-' or '+'")
        if anchor:
            found = next(
                (k for k in range(position, len(lines)) if lines[k].strip() == anchor.strip()),
                None,
            )
            if found is None:
                raise FileToolError(f"{guest!r}: the hunk anchor {anchor!r} is not found")
            position = found + 1 if old and old[0].strip() != anchor.strip() else found
        at = find_block(lines, old, position)
        if at is None:
            raise FileToolError(
                f"{guest!r}: a hunk's lines are not found in the file",
                fix="read the file again and patch what it holds now",
            )
        lines[at : at + len(old)] = new
        position = at + len(new)
    result = "\n".join(lines)
    return result + "\n" if trailing_newline and lines else result


def find_block(lines: list[str], block: list[str], start: int) -> int | None:
    """Where `block` first occurs in `lines` from `start`: exactly, else ignoring trailing
    whitespace; None when it does not."""
    if not block:
        return start
    for k in range(start, len(lines) - len(block) + 1):
        if lines[k : k + len(block)] == block:
            return k
    for k in range(start, len(lines) - len(block) + 1):  # then ignoring trailing whitespace
        if [x.rstrip() for x in lines[k : k + len(block)]] == [x.rstrip() for x in block]:
            return k
    return None
