"""Fake host facts for the policy tests: no real home, no real filesystem, no os.environ.

Kept out of conftest.py so test modules can import the names; conftest.py wraps them in fixtures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields

from cc_server.policy import HostFacts, Platform

FAKE_HOME = "/Users/dev"

# Like macOS: /tmp and /var are symlinks into /private.
MACOS_LINKS: Mapping[str, str] = {"/tmp": "/private/tmp", "/var": "/private/var"}


@dataclass(frozen=True, slots=True)
class FakeFs:
    """A symlink table and sets of existing paths, answering like os.path.realpath/lexists/isdir.

    `existing` are directories, `files` are non-directories.
    """

    links: Mapping[str, str] = field(default_factory=dict)
    existing: frozenset[str] = frozenset()
    files: frozenset[str] = frozenset()
    unresolvable: frozenset[str] = frozenset()

    def realpath(self, path: str) -> str:
        if path in self.unresolvable:
            raise OSError(f"fake: cannot resolve {path}")
        # Longest matching link prefix wins, as a real walk would see the deepest link last.
        for link in sorted(self.links, key=len, reverse=True):
            if path == link or path.startswith(link + "/"):
                return self.links[link] + path[len(link) :]
        return path

    def exists(self, path: str) -> bool:
        return path in self.existing or path in self.files

    def is_dir(self, path: str) -> bool:
        return path in self.existing


MakeHost = Callable[..., HostFacts]


def make_fake_host(
    *,
    platform: Platform = Platform.MACOS,
    home: str = FAKE_HOME,
    links: Mapping[str, str] = MACOS_LINKS,
    existing: Iterable[str] = (),
    files: Iterable[str] = (),
    unresolvable: Iterable[str] = (),
) -> HostFacts:
    """HostFacts answered by a FakeFs; every argument has a macOS-like default."""
    fs = FakeFs(
        links=dict(links),
        existing=frozenset(existing),
        files=frozenset(files),
        unresolvable=frozenset(unresolvable),
    )
    # Every host-probing callable HostFacts declares is answered by the fake, so a default
    # that would reach the real filesystem is never used.
    probes = {f.name: getattr(fs, f.name) for f in fields(HostFacts) if hasattr(fs, f.name)}
    return HostFacts(platform=platform, home=home, **probes)
