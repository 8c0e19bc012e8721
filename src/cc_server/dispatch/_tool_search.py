"""The file tools' searches: a walk of the files a session may read below a root, the regex
search of their lines, and the glob find of their paths. Every bound has a named limit."""

from __future__ import annotations

import fnmatch
import os
import posixpath
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import regex

from cc_server.dispatch._paths import rule_covering, rule_under
from cc_server.dispatch._resolve import real_path
from cc_server.dispatch._tool_gate import (
    DIR_FLAGS,
    GIT_DIR_NAME,
    READ_FLAGS,
    FileToolError,
    ToolGate,
)
from cc_server.dispatch.actions import ActionKind
from cc_server.policy.paths import is_within

__all__ = [
    "MAX_SEARCH_LINE_CHARS",
    "MAX_SEARCH_RESULTS",
    "SEARCH_TIMEOUT_S",
    "SearchMatch",
    "find_paths",
    "matching_lines",
    "walk_files",
]

MAX_SEARCH_FILE_BYTES: Final = 4 * 1024 * 1024  # larger files are skipped by the searches
MAX_SEARCH_RESULTS: Final = 2000  # matches (or paths) returned by one search
MAX_SEARCH_LINE_CHARS: Final = 4096  # longer lines are searched up to this length only
MAX_PATTERN_CHARS: Final = 1000  # a longer regex is refused (bounds compile and match cost)
SEARCH_TIMEOUT_S: Final = 10.0  # one search's matching, all files together (the server's CPU)
MAX_WALK_ENTRIES: Final = 200_000  # directory entries one search visits at most
BINARY_SNIFF_BYTES: Final = 8192  # a NUL in the first bytes marks a file as binary
SKIPPED_DIRS: Final = frozenset({GIT_DIR_NAME})  # repository internals: noise for every search


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchMatch:
    """One matching line."""

    path: str  # guest path
    line: int  # 1-based line number
    text: str  # the line, without its newline (cut at MAX_SEARCH_LINE_CHARS)


# Anchors, lookarounds and flags that see a line's ends differently inside a whole file.
_LINE_ONLY: Final = regex.compile(r"\\[AZzG`']|\(\?<?[=!]|\(\?[a-zA-Z]*[msw]")


def compile_pattern(pattern: str, flags: int = 0) -> regex.Pattern[str]:
    """`pattern` compiled, within its length bound (raises FileToolError)."""
    if not pattern or len(pattern) > MAX_PATTERN_CHARS:
        raise FileToolError(f"the pattern must be 1 to {MAX_PATTERN_CHARS} characters")
    try:
        return regex.compile(pattern, flags)
    except regex.error as exc:
        raise FileToolError(f"invalid regular expression: {exc}") from None


def matching_lines(
    gate: ToolGate,
    kind: ActionKind,
    pattern: str,
    path: str | None,
    *,
    first_only: bool,
    timeout_s: float,
) -> list[SearchMatch]:
    """Matching lines below `path` (only each file's first with `first_only`), bounded."""
    compiled = compile_pattern(pattern)
    # One pass over the whole file first (^ and $ at line ends) skips files without a match;
    # patterns whose meaning depends on being given one line at a time are not prefiltered.
    prefilter = None if _LINE_ONLY.search(pattern) else compile_pattern(pattern, regex.MULTILINE)
    deadline = time.monotonic() + timeout_s

    def search(compiled: regex.Pattern[str], text: str) -> bool:
        try:
            timeout = max(deadline - time.monotonic(), 0.0)
            return compiled.search(text, timeout=timeout) is not None
        except TimeoutError:
            raise FileToolError(
                f"the search took longer than {timeout_s:g} s (a pattern that "
                "backtracks badly, or too much to search)",
                fix="use a simpler pattern or search a smaller directory",
            ) from None

    matches: list[SearchMatch] = []
    for guest, _, data in walk_files(gate, kind, path, with_content=True):
        assert data is not None
        # Lines end at '\n' (and '\r\n'), as the prefilter's ^ and $ see them.
        content = data.decode("utf-8", "replace").replace("\r\n", "\n")
        if prefilter is not None and not search(prefilter, content):
            continue
        lines = content.split("\n")
        if lines and not lines[-1]:
            lines.pop()
        for number, line in enumerate(lines, 1):
            text = line[:MAX_SEARCH_LINE_CHARS]
            if search(compiled, text):
                matches.append(SearchMatch(path=guest, line=number, text=text))
                if len(matches) >= MAX_SEARCH_RESULTS:
                    return matches
                if first_only:
                    break
    return matches


def find_paths(gate: ToolGate, kind: ActionKind, glob: str, path: str | None) -> list[str]:
    """Guest paths below `path` matching `glob`: against the name when the glob has no '/',
    else against the path relative to `path` (`*` crosses '/', so `src/*.py` is recursive).

    Raises:
        ActionRefused: the search root is refused.
    """
    if not glob or len(glob) > MAX_PATTERN_CHARS:
        raise FileToolError(f"the glob must be 1 to {MAX_PATTERN_CHARS} characters")
    found: list[str] = []
    for guest, relative, _ in walk_files(gate, kind, path, with_content=False):
        subject = relative if "/" in glob else posixpath.basename(relative)
        if fnmatch.fnmatchcase(subject, glob.lstrip("/")):
            found.append(guest)
            if len(found) >= MAX_SEARCH_RESULTS:
                break
    return sorted(found)


def walk_files(
    gate: ToolGate, kind: ActionKind, path: str | None, *, with_content: bool
) -> Iterator[tuple[str, str, bytes | None]]:
    """(guest path, path relative to the root, content) of every regular file below the
    root that the policy lets the session read. Links are never followed."""
    start = path if path is not None else (gate.policy.workdir or "")
    action = gate.action(kind, start)
    mapped = gate.admit(action, write=False)
    root_fd, root_real = gate.open_read(action, mapped, DIR_FLAGS)
    # Only the secrets below the root can be met (one covering the root was refused above).
    secrets_below = rule_under(gate.policy.deny_read, root_real)
    mount_root = mapped.mount.host_path
    seen = 0
    try:
        for dirpath, dirnames, filenames, dirfd in os.fwalk(
            ".", dir_fd=root_fd, follow_symlinks=False
        ):
            rel_dir = posixpath.normpath(dirpath)
            rel_dir = "" if rel_dir == "." else rel_dir
            expected = posixpath.join(root_real, rel_dir) if rel_dir else root_real
            # What the directory descriptor really is, once per directory: files are then
            # opened in it with O_NOFOLLOW, so their real path is this plus their name.
            dir_real = real_path(dirfd, expected)
            if dir_real != expected or not is_within(dir_real, mount_root):
                dirnames[:] = []
                continue  # swapped while walking: skip it rather than guess
            dirnames[:] = [
                name
                for name in sorted(dirnames)
                if name not in SKIPPED_DIRS
                and not rule_covering(secrets_below, posixpath.join(dir_real, name))
            ]
            for name in sorted(filenames):
                seen += 1
                if seen > MAX_WALK_ENTRIES:
                    return
                if secrets_below and rule_covering(
                    secrets_below, posixpath.join(dir_real, name)
                ):
                    continue
                relative = posixpath.join(rel_dir, name) if rel_dir else name
                data = _read_walked(dirfd, name, with_content)
                if data is not None:
                    content = data if with_content else None
                    yield posixpath.join(mapped.guest, relative), relative, content
    finally:
        os.close(root_fd)


def _read_walked(dirfd: int, name: str, with_content: bool) -> bytes | None:
    """A walked file's bytes (b"" without content); None to skip it (a link, not regular, gone,
    too large or binary)."""
    if not with_content:
        try:
            info = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except OSError:
            return None
        return b"" if stat.S_ISREG(info.st_mode) else None
    try:
        fd = os.open(name, READ_FLAGS | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return None  # a link, gone, or unreadable: searches skip it
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_SEARCH_FILE_BYTES:
            return None
        data = os.read(fd, MAX_SEARCH_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SEARCH_FILE_BYTES or b"\x00" in data[:BINARY_SNIFF_BYTES]:
        return None
    return data
