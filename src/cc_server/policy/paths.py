"""The reviewed path sets, each entry with the reason it is there.

Paths under `$HOME` are written relative to it. Keep each list sorted by purpose; a new entry needs
a reason a reviewer can check.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Sequence
from typing import Final

__all__ = [
    "HOME_MANDATORY_DENY_WRITE",
    "PROTECTED_PATTERNS",
    "PROTECTED_PATTERN_NAMES",
    "ROOT_MANDATORY_DENY_WRITE",
    "SECRET_DENY_READ",
    "STANDARD_DENY_CREATE_GLOBS",
    "SYSTEM_DENY_READ",
    "ancestors",
    "first_exposure",
    "is_within",
    "lexical",
    "relative_within",
]

# Credential stores under $HOME: never readable from inside a sandbox.
SECRET_DENY_READ: Final[tuple[tuple[str, str], ...]] = (
    # The five the reference page names.
    (".ssh", "SSH private keys, agent sockets and known hosts"),
    (".aws", "AWS CLI credentials and SSO token cache"),
    (".gnupg", "GnuPG private keys and agent socket"),
    (".config/gh", "GitHub CLI OAuth token (hosts.yml)"),
    ("Library/Keychains", "macOS keychains"),
    # The rest: real credential stores of common tools.
    (".azure", "Azure CLI tokens and service principal secrets"),
    (".config/gcloud", "Google Cloud SDK credentials and access tokens"),
    (".kube", "kubeconfig: cluster certificates and bearer tokens"),
    (".docker/config.json", "Docker registry auth tokens"),
    (".netrc", "machine passwords used by curl, git and ftp"),
    (".git-credentials", "git credential-store plaintext passwords and tokens"),
    (".config/git/credentials", "git credential-store plaintext (XDG location)"),
    (".npmrc", "npm registry auth tokens"),
    (".pypirc", "PyPI upload tokens"),
    (".cargo/credentials", "crates.io API token (old name)"),
    (".cargo/credentials.toml", "crates.io API token"),
    (".gem/credentials", "RubyGems API key"),
    (".config/hub", "hub CLI GitHub token"),
    (".terraform.d/credentials.tfrc.json", "Terraform Cloud API tokens"),
    (".vault-token", "HashiCorp Vault token"),
    (".password-store", "pass password store"),
    (".local/share/keyrings", "GNOME keyring files"),
    (".config/op", "1Password CLI session and config"),
    (".oci", "Oracle Cloud API signing keys"),
    (".config/doctl", "DigitalOcean API token"),
    (".m2/settings-security.xml", "Maven master password"),
    (".gradle/gradle.properties", "Gradle publishing credentials"),
    (".composer/auth.json", "Composer registry tokens"),
    (".boto", "legacy AWS and GCS credentials"),
    (".s3cfg", "s3cmd access keys"),
    (".config/rclone", "rclone remote credentials"),
)

# Host secrets outside $HOME that a read-only view of /etc would otherwise expose.
SYSTEM_DENY_READ: Final[tuple[tuple[str, str], ...]] = (
    ("/etc/shadow", "password hashes"),
    ("/etc/shadow-", "backup of password hashes"),
    ("/etc/gshadow", "group password hashes"),
    ("/etc/gshadow-", "backup of group password hashes"),
    ("/etc/ssh/ssh_host_rsa_key", "SSH host private key"),
    ("/etc/ssh/ssh_host_ecdsa_key", "SSH host private key"),
    ("/etc/ssh/ssh_host_ed25519_key", "SSH host private key"),
    ("/etc/ssh/ssh_host_dsa_key", "SSH host private key"),
    ("/etc/ssl/private", "TLS private keys"),
    ("/etc/krb5.keytab", "Kerberos host keytab"),
)

# Names that are never writable inside any writable root, because writing them runs code on the
# host later (the user's shell, git, an editor, the agent runner) or redirects it.
ROOT_MANDATORY_DENY_WRITE: Final[tuple[tuple[str, str], ...]] = (
    (".bashrc", "shell rc: runs in every interactive bash"),
    (".bash_profile", "shell rc: runs in every bash login"),
    (".bash_login", "shell rc: runs in bash login"),
    (".bash_logout", "shell rc: runs at bash logout"),
    (".profile", "shell rc: runs in every POSIX login shell"),
    (".zshrc", "shell rc: runs in every interactive zsh"),
    (".zshenv", "shell rc: runs in every zsh"),
    (".zprofile", "shell rc: runs in zsh login"),
    (".zlogin", "shell rc: runs in zsh login"),
    (".zlogout", "shell rc: runs at zsh logout"),
    (".config/fish/config.fish", "shell rc: runs in every fish"),
    (".gitconfig", "git config: core.hooksPath, aliases and fsmonitor run code"),
    (".gitmodules", "submodule URLs and update commands"),
    (".git/hooks", "git hooks run on the host at the next commit"),
    (".git/config", "git config: core.hooksPath and fsmonitor run code"),
    (".git/commondir", "points git at another directory, with its own hooks"),
    (".git/config.worktree", "per-worktree git config: hooksPath and fsmonitor run code"),
    (".git/modules", "submodule git dirs, each with its own hooks and config"),
    (".ripgreprc", "redirects the agent's search tool"),
    (".mcp.json", "MCP server commands the agent runner starts"),
    (".claude/settings.json", "Claude config: hooks and allowed commands"),
    (".claude/settings.local.json", "Claude config: hooks and allowed commands"),
    (".claude/commands", "Claude config: slash commands"),
    (".claude/agents", "Claude config: sub-agent definitions"),
    (".vscode", "editor tasks and settings that run code on open"),
    (".idea", "IDE run configurations"),
)

# Under $HOME only: the user's own agent runner config.
HOME_MANDATORY_DENY_WRITE: Final[tuple[tuple[str, str], ...]] = (
    (".claude", "Claude config directory: hooks, commands, credentials"),
    (".claude.json", "Claude config: MCP servers and project settings"),
)

# The write policy the create-rule supervisor enforces when the write happens, at any depth of
# every writable bind (the read-only binds above cover only what exists at launch, at each bind
# root): the names above as path patterns matched on the components below a writable root
# ("X/**" is X and everything below it), plus a new `.git` (a repository or a worktree's pointer,
# whose config and hooks host git would honour) and the credential and login directories a
# command could plant (`~/.ssh/authorized_keys` in a bound home). Runner state directories are
# exempt.
PROTECTED_PATTERNS: Final[tuple[tuple[str, str], ...]] = (
    *(
        (f"{rel}/**" if rel in {".git/hooks", ".git/modules", ".vscode", ".idea"} else rel, why)
        for rel, why in ROOT_MANDATORY_DENY_WRITE
        if not rel.startswith(".claude/")
    ),
    (".git", "a new repository or worktree pointer: its config and hooks run on the host"),
    (".git/worktrees/*/commondir", "points a linked worktree at another repository's hooks"),
    (".git/worktrees/*/config.worktree", "a linked worktree's git config: hooksPath, fsmonitor"),
    (".git/worktrees/*/gitdir", "where a linked worktree lives: rewritten, git would prune it"),
    (".git/worktrees/*/locked", "keeps a linked worktree from being pruned"),
    (".config/git/**", "git's XDG global config: hooksPath, pager, fsmonitor run code"),
    (".bash_aliases", "shell rc: sourced by Debian's default .bashrc"),
    (".config/autostart/**", "desktop autostart entries run at login"),
    (".config/systemd/**", "systemd user units run on the host"),
    (".claude/**", "Claude config: hooks, commands, agents and settings"),
    (".claude.json", "Claude config: MCP servers and project settings"),
    (".ssh/**", "SSH keys and authorized_keys: a login on the host"),
    (".aws/**", "cloud credentials and config (credential_process runs code)"),
    (".gnupg/**", "GnuPG keys and agent config"),
    (".kube/**", "Kubernetes credentials (exec plugins run code)"),
    (".docker/**", "registry credentials (credential helpers run code)"),
)

PROTECTED_PATTERN_NAMES: Final[tuple[str, ...]] = tuple(p for p, _ in PROTECTED_PATTERNS)

# The standard dispatch policy's create-time rules: no new env or key files inside writable binds.
STANDARD_DENY_CREATE_GLOBS: Final[tuple[str, ...]] = (".env", "*.key", "*.pem")


# Paths seen to be in lexical form already, though they have a dot-name (`/home/u/.ssh`): the
# policy's own rule paths come back on every check, and a set lookup is cheaper than normpath.
_LEXICAL: set[str] = set()
MAX_LEXICAL_REMEMBERED: Final = 4096  # a bound, as agents' paths pass here too


def lexical(path: str) -> str:
    """`path` with `.` and `..` components, doubled and trailing slashes taken out (lexically,
    like `posixpath.normpath`, but one leading slash for two)."""
    return _lexical(path)


def ancestors(path: str) -> frozenset[str]:
    """The lexical `path` and every directory above it: `lexical(root) in ancestors(path)` is
    `is_within(path, root)` for an absolute root, one set lookup a root (for many roots)."""
    path = _lexical(path)
    found = {path}
    while "/" in path and path != "/":
        path = path.rsplit("/", 1)[0] or "/"
        found.add(path)
    return frozenset(found)


def _lexical(path: str) -> str:
    """See `lexical`."""
    if ("/." in path or "//" in path or path.endswith("/")) and path not in _LEXICAL:
        return _normalise(path)
    return path  # no component to normalise: the common case, kept cheap


def _normalise(path: str) -> str:
    normal = posixpath.normpath(path)
    if normal.startswith("//"):
        normal = "/" + normal.lstrip("/")
    if normal == path and len(_LEXICAL) < MAX_LEXICAL_REMEMBERED:
        _LEXICAL.add(path)
    return normal


def relative_within(path: str, root: str) -> str | None:
    """The part of `path` below `root` (`""` for `root` itself), or None when it is not there.

    Compared by whole components of the lexical spellings: `.`, `..`, doubled and trailing
    slashes are normalised first, so `/a/b/../c` is not within `/a/b` and `/a/bc` is not within
    `/a/b`; every absolute path is within `/`. Nothing on disk is read: a caller that cares about
    symlinks passes real paths.
    """
    path, root = _lexical(path), _lexical(root)
    if path == root:
        return ""
    prefix = root if root.endswith("/") else root + "/"
    return path[len(prefix) :] if path.startswith(prefix) else None


def is_within(path: str, root: str) -> bool:
    """Whether `path` is `root` or lies below it (as `relative_within` compares them)."""
    # `_lexical` inlined: this runs for every rule on every path the file tools check.
    if ("/." in path or "//" in path or path.endswith("/")) and path not in _LEXICAL:
        path = _normalise(path)
    if ("/." in root or "//" in root or root.endswith("/")) and root not in _LEXICAL:
        root = _normalise(root)
    return path == root or path.startswith(root if root.endswith("/") else root + "/")


def first_exposure(
    host_paths: Sequence[str], private: Sequence[str], realpath: Callable[[str], str]
) -> tuple[int, str] | None:
    """The first bind that would show one of the server's private paths: (its index in
    `host_paths`, the private path), or None. A bind shows a path when its resolved host path
    holds it; `private` are real paths already."""
    for index, host_path in enumerate(host_paths):
        root = realpath(host_path)
        for path in private:
            if is_within(path, root):
                return index, path
    return None
