"""Settings files for `cc-server run` and `plan`: TOML holding what the flags hold.

Every key is the name of a `run` flag without its `--` (`backend`, `bind`, `allow-domain`,
`home`, ...); a repeatable flag takes a list of strings, `env` also a table of names to
strings, `network` a boolean. A path (`bind`'s host part, `protect`, `runner-state`, `workdir`,
`spec`) may start with `~`, and a relative one is taken from the file's own directory.

Two files are read, then the flags: the per-user file (`default_settings_path`, if it exists),
then `--settings FILE`. A later source replaces a single value (`backend`, `mode`, `home`, ...)
and adds to a list (`bind`, `allow-domain`, ...), as flags add to a `--spec` file. Unknown keys
are refused with the nearest key named. The values are checked by the flags' own parsers, so a
file cannot hold what the command line would refuse.
"""

from __future__ import annotations

import argparse
import difflib
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from cc_server.errors import BadSpec

__all__ = [
    "SETTINGS_NOT_KEYS",
    "Settings",
    "apply_settings",
    "default_settings_path",
    "load_settings",
    "merged_settings",
    "render_settings",
    "settings_keys",
]

# Options of `run` and `plan` a file does not hold: the file itself, how output is shaped, and
# `--ask` (it reads the terminal, so only a command line that shows it may ask for it).
SETTINGS_NOT_KEYS: Final = frozenset({"help", "settings", "events", "json", "platform", "ask"})
# Keys whose strings are host paths: `~` expanded, relative to the file's directory.
PATH_KEYS: Final = frozenset({"protect", "runner-state", "workdir", "spec"})
MAX_SETTINGS_BYTES: Final = 1 << 20  # a settings file is a page of text, never a data file


@dataclass(frozen=True, kw_only=True)
class Settings:
    """One file's keys, checked and with its paths resolved: flag name -> parsed value."""

    source: str  # the file's path, as the messages name it
    values: Mapping[str, Any]


def default_settings_path(environ: Mapping[str, str] = os.environ) -> str:
    """The per-user file: `$XDG_CONFIG_HOME/cc-server/settings.toml`, else
    `~/.config/cc-server/settings.toml`."""
    base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "cc-server", "settings.toml")


def settings_keys(sub: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The keys a file may hold for this verb: its long options, minus SETTINGS_NOT_KEYS."""
    keys: dict[str, argparse.Action] = {}
    for action in sub._actions:
        for option in action.option_strings:
            if option.startswith("--") and not option.startswith("--no-"):
                name = option[2:]
                if name not in SETTINGS_NOT_KEYS:
                    keys[name] = action
    return keys


def load_settings(
    path: str, keys: Mapping[str, argparse.Action], *, required: bool = True
) -> Settings | None:
    """Read and check one file; None when it is absent and not `required`.

    Raises:
        BadSpec: the file cannot be read, is not TOML, holds an unknown key (the message names
            the nearest known one) or a value its flag would refuse.
    """
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_SETTINGS_BYTES + 1)
    except FileNotFoundError:
        if not required:
            return None
        raise BadSpec(f"settings file {path!r} does not exist",
                      fix="check the path given to --settings") from None
    except OSError as exc:
        raise BadSpec(f"cannot read settings file {path!r}: {exc.strerror}") from None
    if len(raw) > MAX_SETTINGS_BYTES:
        raise BadSpec(f"settings file {path!r} is over {MAX_SETTINGS_BYTES} bytes")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise BadSpec(f"settings file {path!r} is not valid TOML: {exc}") from None
    base = os.path.dirname(os.path.abspath(path))
    values: dict[str, Any] = {}
    for key, value in data.items():
        action = keys.get(key)
        if action is None:
            raise _unknown(path, key, keys)
        values[key] = _value(path, key, value, action, base)
    return Settings(source=path, values=values)


def _unknown(path: str, key: str, keys: Mapping[str, argparse.Action]) -> BadSpec:
    spelled = key.replace("_", "-").lower()
    close = difflib.get_close_matches(spelled, list(keys), n=1, cutoff=0.6)
    fix = (f"did you mean {close[0]!r}?" if close
           else f"the keys are the flags of `cc-server run`: {', '.join(sorted(keys))}")
    return BadSpec(f"settings file {path!r}: unknown key {key!r}", fix=fix)


def _value(path: str, key: str, value: object, action: argparse.Action, base: str) -> Any:
    """One key's value parsed as its flag would parse it."""
    where = f"settings file {path!r}: {key}"
    if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreConstAction):
        if not isinstance(value, bool):
            raise BadSpec(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        if key == "env" and isinstance(value, dict):
            value = [f"{name}={val}" if isinstance(val, str) else val
                     for name, val in value.items()]
            if not all(isinstance(item, str) for item in value):
                raise BadSpec(f"{where}: every value of the table must be a string")
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise BadSpec(f"{where} must be a list of strings, got {value!r}")
        return [_one(where, key, item, action, base) for item in value]
    if action.type is float and isinstance(value, int | float) and not isinstance(value, bool):
        return _one(where, key, str(value), action, base)
    if not isinstance(value, str):
        raise BadSpec(f"{where} must be a string, got {value!r}")
    return _one(where, key, value, action, base)


def _one(where: str, key: str, text: str, action: argparse.Action, base: str) -> Any:
    if key in PATH_KEYS:
        text = _path(text, base)
    elif key == "bind":
        host, sep, rest = text.partition(":")
        text = _path(host, base) + sep + rest
    try:
        value = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise BadSpec(f"{where}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise BadSpec(f"{where}: {text!r} is not one of {choices}")
    return value


def _path(text: str, base: str) -> str:
    return os.path.join(base, os.path.expanduser(text))  # an absolute path replaces `base`


def apply_settings(args: argparse.Namespace, layers: Sequence[Settings],
                   keys: Mapping[str, argparse.Action]) -> argparse.Namespace:
    """Fill `args` from the files, earliest first: a flag given wins over a single value, and
    adds after a list's entries. Returns `args`, changed in place."""
    for name, action in keys.items():
        given = getattr(args, action.dest)
        if isinstance(action, argparse._AppendAction):
            merged = [v for layer in layers for v in layer.values.get(name, ())]
            setattr(args, action.dest, merged + list(given or ()))
        elif given is None or given == action.default:  # a flag not given
            for layer in layers:
                if name in layer.values:
                    given = layer.values[name]
            setattr(args, action.dest, given)
    return args


def merged_settings(args: argparse.Namespace,
                    keys: Mapping[str, argparse.Action]) -> dict[str, Any]:
    """The merged settings as a file would spell them (keys with no value left out)."""
    out: dict[str, Any] = {}
    for name, action in sorted(keys.items()):
        value = getattr(args, action.dest)
        if value is None or value == [] or (value is False and action.default is False):
            continue
        if isinstance(value, list):
            out[name] = [_unparse(name, v) for v in value]
        else:
            out[name] = value if isinstance(value, bool | float) else str(value)
    return out


def render_settings(merged: Mapping[str, Any]) -> str:
    """`merged_settings` as TOML lines."""
    lines = []
    for name, value in merged.items():
        if isinstance(value, list):
            lines.append(f"{name} = [{', '.join(_toml_string(v) for v in value)}]")
        elif isinstance(value, bool):
            lines.append(f"{name} = {'true' if value else 'false'}")
        elif isinstance(value, float):
            lines.append(f"{name} = {value!r}")
        else:
            lines.append(f"{name} = {_toml_string(value)}")
    return "\n".join(lines)


def _unparse(name: str, value: Any) -> str:
    if name == "bind" and isinstance(value, dict):
        text = str(value["hostPath"])
        if "guestPath" in value:
            text += f":{value['guestPath']}"
        return text + (":ro" if value.get("readOnly") else "")
    if name == "env" and isinstance(value, tuple):
        return f"{value[0]}={value[1]}"
    return str(value)


def _toml_string(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = "".join(ch if ch.isprintable() else f"\\U{ord(ch):08x}" for ch in escaped)
    return f'"{escaped}"'
