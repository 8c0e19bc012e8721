"""The in-process file tools: read, write, edit, apply_patch, search, find, search_files.

They run in the server process, outside any sandbox, on every host: only bash is wrapped. So
they enforce the session's policy themselves, on what they actually open:

1. the guardrail chain (tool surface, path policy, extra guardrails) on the path as the agent
   spelled it;
2. the same path rules again here, on the guest path mapped through the binds;
3. the object is opened below its bind's root by a symlink-safe resolver (openat2 with
   RESOLVE_BENEATH, or an O_NOFOLLOW walk): a link swapped between check and use can never lead
   out of the bind; writes never follow a link in their last component;
4. the rules are checked once more on the real path of the opened descriptor, before a byte is
   read or written.

Every refusal is an `ActionRefused`; nothing is read, written or created before all checks pass.
"""

from __future__ import annotations

import os
import posixpath
from typing import Any, Final

import msgspec

from cc_server.dispatch._resolve import Resolver, default_resolver
from cc_server.dispatch._tool_gate import (
    MAX_READ_BYTES,
    MAX_WRITE_BYTES,
    FileToolError,
    ToolGate,
    os_errors_are_tool_errors,
    replace_content,
)
from cc_server.dispatch._tool_patch import apply_patch
from cc_server.dispatch._tool_search import (
    MAX_SEARCH_LINE_CHARS,
    MAX_SEARCH_RESULTS,
    SEARCH_TIMEOUT_S,
    SearchMatch,
    find_paths,
    matching_lines,
)
from cc_server.dispatch.actions import WRITE_KINDS, ActionKind
from cc_server.dispatch.guardrails import GuardrailChain
from cc_server.errors import BadSpec
from cc_server.policy import CompiledPolicy

__all__ = [
    "MAX_READ_BYTES",
    "MAX_SEARCH_LINE_CHARS",
    "MAX_SEARCH_RESULTS",
    "TOOL_NAMES",
    "FileToolError",
    "FileTools",
    "SearchMatch",
    "ToolRequest",
    "call_tool",
]

TOOL_NAMES: Final = ("read", "write", "edit", "apply_patch", "search", "find", "search_files")


class FileTools:
    """The seven file tools of one session, enforcing its compiled policy.

    A façade: the checks and the safe opening are `_tool_gate`'s, the patch format
    `_tool_patch`'s, the walks and searches `_tool_search`'s.
    """

    def __init__(
        self,
        policy: CompiledPolicy,
        chain: GuardrailChain,
        *,
        resolver: Resolver | None = None,
        search_timeout_s: float = SEARCH_TIMEOUT_S,
    ) -> None:
        self.policy = policy
        self.chain = chain
        self.resolver = resolver or default_resolver()
        self.search_timeout_s = search_timeout_s
        self._gate = ToolGate(policy, chain, self.resolver)

    # --- the tools -----------------------------------------------------------------------------

    def judge(self, path: str, *, kind: ActionKind) -> None:
        """Whether `kind` on `path` would be allowed, without doing it (an ACP permission
        request for an action the agent does itself): the chain, the path rules on the path as
        mapped, and for a write of a name that does not exist yet the create-time rules.

        Raises:
            ActionRefused: a guardrail or the policy refuses it.
        """
        action = self._gate.action(kind, path)
        write = kind in WRITE_KINDS
        mapped = self._gate.admit(action, write=write)
        if write and not os.path.lexists(mapped.host):
            self._gate.check_create(action, posixpath.basename(mapped.host), mapped.guest)

    @os_errors_are_tool_errors
    def read(
        self,
        path: str,
        *,
        offset: int = 0,
        limit: int | None = None,
        kind: ActionKind = ActionKind.FILE_READ,
    ) -> str:
        """The file's text from line `offset` (0-based), at most `limit` lines.

        Raises:
            ActionRefused: a guardrail or the policy refuses the path.
            FileToolError: missing, not a regular file, or larger than MAX_READ_BYTES.
        """
        action = self._gate.action(kind, path)
        mapped = self._gate.admit(action, write=False)
        text = self._gate.read_bytes(action, mapped).decode("utf-8", errors="replace")
        if offset == 0 and limit is None:
            return text
        if offset < 0 or (limit is not None and limit < 0):
            raise FileToolError("offset and limit must not be negative")
        lines = text.splitlines(keepends=True)
        end = None if limit is None else offset + limit
        return "".join(lines[offset:end])

    @os_errors_are_tool_errors
    def write(self, path: str, content: str, *, kind: ActionKind = ActionKind.FILE_WRITE) -> None:
        """Write `content` to the file, creating it (and missing directories) if allowed.

        Raises:
            ActionRefused: a guardrail or the policy refuses (read-only bind, protected path,
                mandatory deny, secret path, create-time glob, a link on the way out).
            FileToolError: the path is a directory or another non-regular file.
        """
        action = self._gate.action(kind, path)
        data = content.encode("utf-8", errors="surrogateescape")
        if len(data) > MAX_WRITE_BYTES:
            raise FileToolError(f"content is more than {MAX_WRITE_BYTES} bytes")
        mapped = self._gate.admit(action, write=True)
        with self._gate.open_target(action, mapped, create=True) as target:
            self._gate.write_to(action, target, data)

    @os_errors_are_tool_errors
    def edit(
        self,
        path: str,
        old: str,
        new: str,
        *,
        count: int = 1,
        kind: ActionKind = ActionKind.FILE_EDIT,
    ) -> None:
        """Replace `old` by `new`; `old` must occur exactly `count` times.

        Raises:
            ActionRefused: as `write`.
            FileToolError: the file is missing, or `old` does not occur exactly `count` times.
        """
        action = self._gate.action(kind, path)
        if not old or count < 1:
            raise FileToolError("edit needs a non-empty old text and a count of at least 1")
        mapped = self._gate.admit(action, write=True)
        with self._gate.open_target(action, mapped, create=False) as target:
            try:
                fd = self._gate.open_existing_for_write(action, target, os.O_RDWR)
            except FileNotFoundError:
                raise FileToolError(f"{mapped.guest!r} does not exist") from None
            try:
                text = self._gate.read_fd(action, fd, mapped.guest, MAX_READ_BYTES).decode(
                    "utf-8", errors="surrogateescape"
                )
                found = text.count(old)
                if found != count:
                    raise FileToolError(
                        f"the old text occurs {found} times in {mapped.guest!r}, not {count}",
                        fix="give more context so it is unique, or the right count",
                    )
                data = text.replace(old, new).encode("utf-8", errors="surrogateescape")
                try:
                    replace_content(fd, data)
                except OSError as exc:
                    raise self._gate.os_error(action, mapped.guest, exc) from None
            finally:
                os.close(fd)

    @os_errors_are_tool_errors
    def apply_patch(self, patch: str, *, kind: ActionKind = ActionKind.APPLY_PATCH) -> list[str]:
        """Apply a patch in the apply_patch format (`*** Begin Patch` ... `*** End Patch`, with
        Add File, Delete File and Update File sections, the last optionally with `*** Move to`).

        Every file is checked (chain and policy) and every new content computed before anything
        is written; the guest paths changed are returned.

        Raises:
            ActionRefused: any file of the patch is refused; nothing is changed.
            FileToolError: the patch does not parse or a hunk does not apply; nothing is changed.
        """
        return apply_patch(self._gate, patch, kind)

    @os_errors_are_tool_errors
    def search(
        self, pattern: str, path: str | None = None, *, kind: ActionKind = ActionKind.SEARCH
    ) -> list[SearchMatch]:
        """Lines matching the regular expression `pattern` in the files below `path` (default:
        the workdir). Secret paths, links, `.git`, binary and very large files are skipped.

        Raises:
            ActionRefused: the search root is refused. FileToolError: the pattern is invalid.
        """
        return matching_lines(
            self._gate, kind, pattern, path, first_only=False, timeout_s=self.search_timeout_s
        )

    @os_errors_are_tool_errors
    def search_files(
        self, query: str, path: str | None = None, *, kind: ActionKind = ActionKind.SEARCH_FILES
    ) -> list[str]:
        """Guest paths of the files below `path` whose content matches the regex `query`.

        Raises:
            ActionRefused: the search root is refused. FileToolError: the query is invalid.
        """
        found = matching_lines(
            self._gate, kind, query, path, first_only=True, timeout_s=self.search_timeout_s
        )
        return [m.path for m in found]

    @os_errors_are_tool_errors
    def find(
        self, glob: str, path: str | None = None, *, kind: ActionKind = ActionKind.FIND
    ) -> list[str]:
        """Guest paths below `path` matching `glob`: against the name when the glob has no '/',
        else against the path relative to `path` (`*` crosses '/', so `src/*.py` is recursive).

        Raises:
            ActionRefused: the search root is refused.
        """
        return find_paths(self._gate, kind, glob, path)


# The arguments of one tool call through the API (each tool reads the ones it needs); no
# docstring, as it would become the OpenAPI schema's description.
class ToolRequest(msgspec.Struct, rename="camel", forbid_unknown_fields=True, kw_only=True):
    path: str | None = None  # guest path (absolute, or relative to the worktree)
    content: str | None = None  # write
    old: str | None = None  # edit
    new: str | None = None  # edit
    count: int = 1  # edit
    offset: int = 0  # read: first line (0-based)
    limit: int | None = None  # read: at most this many lines
    patch: str | None = None  # apply_patch
    pattern: str | None = None  # search
    glob: str | None = None  # find
    query: str | None = None  # search_files


def _need(value: Any, name: str, tool: str) -> Any:
    if value is None:
        raise BadSpec(f"the {tool} tool needs {name!r}")
    return value


def call_tool(tools: FileTools, tool: str, b: ToolRequest) -> dict[str, Any]:
    """One call of the tool named `tool` (one of TOOL_NAMES), its answer as JSON data.

    Raises:
        BadSpec: an argument the tool needs is missing; what the tool raises.
    """
    if tool == "read":
        return {"content": tools.read(_need(b.path, "path", tool), offset=b.offset,
                                      limit=b.limit)}
    if tool == "write":
        tools.write(_need(b.path, "path", tool), _need(b.content, "content", tool))
        return {"ok": True}
    if tool == "edit":
        tools.edit(_need(b.path, "path", tool), _need(b.old, "old", tool),
                   _need(b.new, "new", tool), count=b.count)
        return {"ok": True}
    if tool == "apply_patch":
        return {"files": tools.apply_patch(_need(b.patch, "patch", tool))}
    if tool == "search":
        matches = tools.search(_need(b.pattern, "pattern", tool), b.path)
        return {"matches": [msgspec.to_builtins(m) for m in matches]}
    if tool == "find":
        return {"paths": tools.find(_need(b.glob, "glob", tool), b.path)}
    if tool == "search_files":
        return {"paths": tools.search_files(_need(b.query, "query", tool), b.path)}
    raise BadSpec(f"no file tool {tool!r}", fix=f"use one of {', '.join(TOOL_NAMES)}")
