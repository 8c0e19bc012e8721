"""Settings files: each key parsed by its flag's own parser, strict, with paths resolved."""

from __future__ import annotations

import argparse
import pathlib
import tomllib

import pytest

from cc_server import cli
from cc_server.errors import BadSpec
from cc_server.settings import (
    apply_settings,
    default_settings_path,
    load_settings,
    merged_settings,
    render_settings,
)


def keys(verb: str = "run") -> dict[str, argparse.Action]:
    return cli._settings_keys(cli.parser(), verb)


def load(tmp_path: pathlib.Path, text: str) -> dict[str, object]:
    path = tmp_path / "s.toml"
    path.write_text(text)
    found = load_settings(str(path), keys())
    assert found is not None
    return dict(found.values)


def test_every_run_flag_is_a_key_but_the_output_shapes() -> None:
    run = set(keys("run"))
    assert {"backend", "bind", "bind-cwd", "home", "dotfile", "network", "allow-domain", "env",
            "timeout", "spec", "workdir"} <= run
    assert not run & {"settings", "events", "help", "json", "platform", "ask"}
    assert set(keys("plan")) < run and "timeout" in run - set(keys("plan"))  # run's own too


@pytest.mark.parametrize(("text", "message"), [
    ('backend = "vm"', "'vm' is not one of microvm, native, none"),
    ("bind = '/x'", "bind must be a list of strings"),
    ("network = 'no'", "network must be true or false"),
    ("env = { A = 1 }", "every value of the table must be a string"),
    ('env = ["NOEQUALS"]', "expected NAME=VALUE"),
    ("timeout = 'soon'", "could not convert"),
    ("[bind]\nx = 1", "bind must be a list of strings"),
    ("Backend = 'none'", "did you mean 'backend'?"),
    ("not toml", "is not valid TOML"),
])  # fmt: skip
def test_a_bad_value_is_refused_with_its_key(
    tmp_path: pathlib.Path, text: str, message: str
) -> None:
    with pytest.raises(BadSpec, match="settings file") as caught:
        load(tmp_path, text)
    assert message in str(caught.value)


def test_a_missing_file_is_an_error_only_when_asked_for(tmp_path: pathlib.Path) -> None:
    assert load_settings(str(tmp_path / "none.toml"), keys(), required=False) is None
    with pytest.raises(BadSpec, match="does not exist"):
        load_settings(str(tmp_path / "none.toml"), keys())


def test_paths_take_tilde_and_the_files_directory(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", "/home/ada")
    values = load(tmp_path, 'bind = ["~/src", "rel:ro"]\nprotect = ["~/.git"]\nspec = "s.json"')
    assert values["bind"] == [{"hostPath": "/home/ada/src", "readOnly": False},
                              {"hostPath": f"{tmp_path}/rel", "readOnly": True}]
    assert values["protect"] == ["/home/ada/.git"]
    assert values["spec"] == f"{tmp_path}/s.json"


def test_the_default_file_follows_xdg_config_home() -> None:
    assert default_settings_path({"XDG_CONFIG_HOME": "/c"}) == "/c/cc-server/settings.toml"
    assert default_settings_path({}).endswith("/.config/cc-server/settings.toml")


def test_flags_replace_values_and_add_to_lists(tmp_path: pathlib.Path) -> None:
    first = tmp_path / "a.toml"
    first.write_text('mode = "review"\nallow-domain = ["a.test"]\ntimeout = 5\n')
    second = tmp_path / "b.toml"
    second.write_text('mode = "plan"\nallow-domain = ["b.test"]\n')
    layers = [load_settings(str(p), keys()) for p in (first, second)]
    args = cli.parser().parse_args(["run", "--allow-domain", "c.test", "--", "true"])
    apply_settings(args, [layer for layer in layers if layer is not None], keys())
    assert args.mode == "plan" and args.timeout == 5.0
    assert args.allow_domain == ["a.test", "b.test", "c.test"]
    flag = cli.parser().parse_args(["run", "--mode", "chat", "--", "true"])
    apply_settings(flag, [layer for layer in layers if layer is not None], keys())
    assert flag.mode == "chat"


def test_the_merged_view_reads_back_as_the_same_settings(tmp_path: pathlib.Path) -> None:
    args = cli.parser().parse_args(
        ["run", "--bind", "/w:ro", "--no-network", "--env", 'Q="x\\y"', "--timeout", "2",
         "--", "true"])  # fmt: skip
    merged = merged_settings(args, keys())
    assert merged == {"bind": ["/w:ro"], "env": ['Q="x\\y"'], "network": False, "timeout": 2.0}
    assert tomllib.loads(render_settings(merged)) == merged
    assert load(tmp_path, render_settings(merged))["env"] == [("Q", '"x\\y"')]
