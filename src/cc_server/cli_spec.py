"""What `cc-server run` and `plan` build from their parsed arguments: the SandboxSpec (with the
defaults a user expects: the current directory bound and the workdir, the `--home` choice), the
command and its environment."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from cc_server.backends.bubblewrap import DEFAULT_PATH
from cc_server.errors import BadSpec
from cc_server.policy import SandboxBackend, SandboxSpec, parse_spec
from cc_server.policy.paths import first_exposure, is_within

__all__ = [
    "DEFAULT_DOTFILES",
    "HOME_CHOICES",
    "PASSTHROUGH_ENV",
    "build_spec",
    "command_argv",
    "command_env",
]

# Ordinary variables `run` passes through from the caller; never tokens, keys or passwords.
PASSTHROUGH_ENV = ("TERM", "COLORTERM", "NO_COLOR", "LANG", "LANGUAGE", "TZ")
# `--home`: empty is a throw-away tmpfs; dotfiles adds read-only binds of DEFAULT_DOTFILES (or the
# --dotfile entries). The secret set (policy.paths.SECRET_DENY_READ) is masked in both.
HOME_CHOICES = ("empty", "dotfiles")
# Git identity and the toolchains installed under $HOME; none of them is a credential store (the
# ones inside, like ~/.cargo/credentials.toml and ~/.config/git/credentials, stay masked).
DEFAULT_DOTFILES = (".gitconfig", ".config/git", ".cargo", ".rustup", ".pyenv", ".nvm")


def build_spec(args: argparse.Namespace) -> SandboxSpec:
    """The spec `run` and `plan` use: `--spec FILE`, then the options added to it."""
    data: dict[str, Any] = {}
    if args.spec:
        try:
            with open(args.spec, encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, ValueError) as exc:
            raise BadSpec(f"cannot read --spec {args.spec!r}: {exc}") from None
        if not isinstance(data, dict):
            raise BadSpec(f"--spec {args.spec!r} must hold a JSON object")
    data.setdefault("sessionId", f"cli-{os.getpid()}-{os.urandom(4).hex()}")
    data.setdefault("workspaceId", "cli")
    home = os.path.expanduser("~")
    cwd = os.getcwd()
    binds: list[dict[str, Any]] = [*data.get("bindMounts", []), *args.bind]
    if not binds and args.bind_cwd is not False and args.backend != SandboxBackend.NONE:
        _refuse_as_cwd_bind(cwd, home)
        binds = [{"hostPath": cwd, "readOnly": False}]
    if args.home == "dotfiles":
        binds += _dotfile_binds(args.dotfile or DEFAULT_DOTFILES, home, binds,
                                explicit=bool(args.dotfile),
                                dirs_only=args.backend == SandboxBackend.MICROVM)
    data["bindMounts"] = binds
    data["protectedPaths"] = [*data.get("protectedPaths", []),
                              *(os.path.abspath(p) for p in args.protect)]
    data["runnerStateDirs"] = [*data.get("runnerStateDirs", []),
                               *(os.path.abspath(p) for p in args.runner_state)]
    if args.mode:
        data["mode"] = args.mode
    if args.workdir:
        data["guestWorkdir"] = os.path.abspath(args.workdir)
    elif "guestWorkdir" not in data:
        inside = cwd if args.backend == SandboxBackend.NONE else _guest_path_of(cwd, binds)
        if inside is not None:
            data["guestWorkdir"] = inside
    if args.network is not None:
        data["networkEnabled"] = args.network
    data["egressAllowlist"] = [*data.get("egressAllowlist", []), *args.allow_domain]
    if args.capability:
        data["capabilities"] = {**data.get("capabilities", {}),
                                **{name: True for name in args.capability}}
    spec = parse_spec(data)
    _refuse_exposed_tokens(spec)
    return spec


def _refuse_as_cwd_bind(cwd: str, home: str) -> None:
    """The current directory is bound writable by default, but never `/`, `$HOME` or a
    directory holding `$HOME`: every project, dotfile and shell history would be writable.

    Raises:
        BadSpec: the current directory is one of those.
    """
    real = os.path.realpath(cwd)
    homes = {home, os.path.realpath(home)}
    if real == "/" or any(is_within(h, real) for h in homes):
        what = "/" if real == "/" else "$HOME" if real in homes else "a directory holding $HOME"
        raise BadSpec(
            f"the current directory {cwd!r} is {what}: binding it writable (what `run` does "
            "when nothing is bound) would let the command change every file of yours",
            fix="cd into the project first, or --bind the directories the command needs, or "
            "--no-bind-cwd to bind nothing",
        )


def _dotfile_binds(
    names: Sequence[str], home: str, binds: Sequence[Mapping[str, Any]], *, explicit: bool,
    dirs_only: bool = False,
) -> list[dict[str, Any]]:
    """Read-only binds of the dotfiles `--home dotfiles` shows: those that exist (a missing
    `--dotfile` is an error) and that no bind already shows.

    Raises:
        BadSpec: a name is outside $HOME, inside the secret set, (given explicitly) absent, or
            a file where only directories can be shared (`dirs_only`: a microVM).
    """
    from cc_server.policy.paths import SECRET_DENY_READ

    out: list[dict[str, Any]] = []
    for name in names:
        rel = name[2:] if name.startswith("~/") else name
        path = os.path.normpath(os.path.join(home, rel))
        rel = os.path.relpath(path, home)
        if rel == "." or rel.startswith(".."):
            raise BadSpec(f"--dotfile {name!r} is not a path under $HOME ({home})",
                          fix="name it relative to $HOME, like .gitconfig")
        secret = next((s for s, _ in SECRET_DENY_READ
                       if is_within(rel, s)), None)
        if secret is not None:
            raise BadSpec(f"--dotfile {name!r}: ~/{secret} is in the secret set and is masked "
                          "in every sandbox", fix="show the tool's other files, not its secrets")
        if not os.path.lexists(path):
            if explicit:
                raise BadSpec(f"--dotfile {name!r}: {path} does not exist")
            continue
        if dirs_only and not os.path.isdir(path):
            raise BadSpec(f"--home dotfiles: {path} is a file, and a microVM shares "
                          "directories only",
                          fix="--dotfile directories only (git reads ~/.config/git/config "
                          "too), or --home empty")
        if _guest_path_of(path, binds) is None:
            out.append({"hostPath": path, "readOnly": True})
    return out


def _guest_path_of(path: str, binds: Sequence[Mapping[str, Any]]) -> str | None:
    """Where host `path` appears in the sandbox: under the deepest bind holding it, else None."""
    best: tuple[int, str] | None = None
    for bind in binds:
        host = str(bind.get("hostPath", ""))
        guest = str(bind.get("guestPath") or host)
        for spelling in {host, os.path.realpath(host)}:
            if is_within(path, spelling):
                inside = guest.rstrip("/") + path[len(spelling.rstrip("/")):] or "/"
                if best is None or len(spelling) > best[0]:
                    best = (len(spelling), inside)
    return best[1] if best is not None else None


def _refuse_exposed_tokens(spec: SandboxSpec) -> None:
    """A sandbox that could read a live server's token could drive that server: refuse a bind
    that would show one, as the server refuses it for its own sandboxes.

    Raises:
        BadSpec: a bind is or contains the token file a live server of this user recorded.
    """
    from cc_server.rundir import live_server_token_files

    binds = [m.host_path for m in spec.bind_mounts]
    tokens = [os.path.realpath(path) for path in live_server_token_files()]
    found = first_exposure(binds, tokens, os.path.realpath)
    if found is not None:
        bind, token = binds[found[0]], found[1]
        raise BadSpec(
            f"the bind {bind!r} would expose the bearer token file {token!r} of a running "
            "cc-server",
            fix="bind a directory that does not contain the token file, or start the server "
            "with --token-file elsewhere",
        )


def command_argv(args: argparse.Namespace) -> list[str]:
    """The command after `--`."""
    argv = list(args.command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise BadSpec("no command given", fix="put the command after '--'")
    return argv


def command_env(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """The command's environment: the ordinary variables of `environ` (the caller's), then
    `--env`."""
    env = {k: environ[k] for k in PASSTHROUGH_ENV if k in environ}
    env.update({k: v for k, v in environ.items() if k.startswith("LC_")})
    if args.home == "dotfiles":  # the toolchains shown: their entries of the caller's PATH first
        home = os.path.expanduser("~")
        shown = [os.path.join(home, n[2:] if n.startswith("~/") else n)
                 for n in args.dotfile or DEFAULT_DOTFILES]
        entries = [e for e in environ.get("PATH", "").split(":")
                   if any(is_within(e, d) for d in shown)]
        if entries:
            env["PATH"] = ":".join([*entries, DEFAULT_PATH])
    env.update(dict(args.env))
    return env
