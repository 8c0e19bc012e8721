"""The mode table, checked on the host: writes land exactly where the spec says, in every mode.

| target                         | chat | review | plan | orchestrate |
|--------------------------------|------|--------|------|-------------|
| writable bind                  | yes  | no     | no   | no          |
| readOnly bind                  | no   | no     | no   | no          |
| runnerStateDirs                | yes  | yes    | yes  | yes         |
| protectedPaths (inside a bind) | no   | no     | no   | no          |
| .bashrc in a runner state dir  | no   | no     | no   | no          |

And a policy that needs create-time filename rules is refused on Linux before anything runs when
the host has no create-rule supervisor; with it, the same policy runs and the names are refused.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import pytest
from escape_kit import Sandboxes, attempts, outcomes, output

from cc_server.backends import handoff
from cc_server.errors import BackendUnavailable
from cc_server.policy import STANDARD_DENY_CREATE_GLOBS, Mode, SandboxBackend, parse_spec
from cc_server.runtime.port import SandboxManager
from cc_server.runtime.select import WRITE_PROTECTION_ENV

pytestmark = [pytest.mark.security, pytest.mark.integration]


def _layout(sb: Sandboxes) -> dict[str, pathlib.Path]:
    paths = {
        "bind": sb.worktree,
        "ro_bind": sb.root / "ro",
        "state": sb.root / "state",
        "protected": sb.worktree / "protected",
    }
    for path in paths.values():
        path.mkdir(exist_ok=True)
        (path / "README").write_text(f"control {path.name}\n")
    (paths["state"] / ".bashrc").write_text("# runner bashrc\n")
    return paths


def _spec_fields(paths: dict[str, pathlib.Path], mode: Mode) -> dict[str, Any]:
    return {
        "mode": str(mode),
        "bindMounts": [
            {"hostPath": str(paths["bind"])},
            {"hostPath": str(paths["ro_bind"]), "readOnly": True},
        ],
        "runnerStateDirs": [str(paths["state"])],
        "protectedPaths": [str(paths["protected"])],
    }


EXPECTED_WRITABLE = {
    Mode.CHAT: {"bind": True, "ro_bind": False, "state": True, "protected": False},
    Mode.REVIEW: {"bind": False, "ro_bind": False, "state": True, "protected": False},
    Mode.PLAN: {"bind": False, "ro_bind": False, "state": True, "protected": False},
    Mode.ORCHESTRATE: {"bind": False, "ro_bind": False, "state": True, "protected": False},
}


@pytest.mark.parametrize("mode", list(Mode))
async def test_writes_land_exactly_where_the_mode_allows(sb: Sandboxes, mode: Mode) -> None:
    paths = _layout(sb)
    script_parts = {}
    for name, path in paths.items():
        script_parts[f"read_{name}"] = f"grep -q control {path}/README"
        script_parts[f"write_{name}"] = f"echo landed > {path}/new-{mode}"
        script_parts[f"edit_{name}"] = f"echo edited >> {path}/README"
    script_parts["state_bashrc"] = f"echo evil >> {paths['state']}/.bashrc"
    result = await sb.run(attempts(**script_parts), **_spec_fields(paths, mode))
    verdicts = outcomes(result)
    expected = EXPECTED_WRITABLE[mode]

    for name, path in paths.items():
        # Control: every target is visible in every mode, so a "no" below is a refused write,
        # not a missing directory.
        assert verdicts[f"read_{name}"] == "ok", f"{name} not readable: {verdicts}"
        want = "ok" if expected[name] else "fail"
        assert verdicts[f"write_{name}"] == want, f"{mode} {name}: {verdicts}\n{output(result)}"
        assert verdicts[f"edit_{name}"] == want, f"{mode} {name}: {verdicts}"
        # Host side.
        new = path / f"new-{mode}"
        assert new.exists() == expected[name], f"{mode} {name}: host file {new}"
        edited = (path / "README").read_text() != f"control {path.name}\n"
        assert edited == expected[name], f"{mode} {name}: host README edited={edited}"
    assert verdicts["state_bashrc"] == "fail", verdicts
    assert (paths["state"] / ".bashrc").read_text() == "# runner bashrc\n"


@pytest.mark.parametrize("mode", [Mode.REVIEW, Mode.PLAN, Mode.ORCHESTRATE])
async def test_read_only_modes_refuse_renames_and_deletes_in_binds(
    sb: Sandboxes, mode: Mode
) -> None:
    paths = _layout(sb)
    wt = paths["bind"]
    (wt / "file").write_text("original\n")
    result = await sb.run(
        attempts(
            remove=f"rm -f {wt}/file",
            rename=f"mv {wt}/file {wt}/file.moved",
            mkdir=f"mkdir {wt}/newdir",
            chmod=f"chmod 000 {wt}/file",
            state_ok=f"echo ok > {paths['state']}/scratch && mv {paths['state']}/scratch "
            f"{paths['state']}/scratch2 && rm {paths['state']}/scratch2",
        ),
        **_spec_fields(paths, mode),
    )
    verdicts = outcomes(result)
    assert verdicts.pop("state_ok") == "ok", verdicts  # control: the state dir is writable
    assert verdicts == dict.fromkeys(verdicts, "fail") and len(verdicts) == 4, verdicts
    assert (wt / "file").read_text() == "original\n"
    assert (wt / "file").stat().st_mode & 0o777 != 0
    assert not (wt / "file.moved").exists() and not (wt / "newdir").exists()


class _SpawnSpy:
    """Stands in for the runner's `start`, counting spawns and delegating to the real one."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls = 0

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return await self.real(*args, **kwargs)


def _without_create_rules(sb: Sandboxes) -> SandboxManager:
    """The same host as if the create-rule supervisor were not built."""
    result = sb.manager.probe_result
    tools = {k: v for k, v in result.tools.items() if not k.startswith("cc-create-")}
    stripped = dataclasses.replace(result, tools=tools, create_rules=False)
    return SandboxManager(probe_result=stripped, host=sb.manager.host)


@pytest.mark.parametrize("globs", [("*.pem",), STANDARD_DENY_CREATE_GLOBS], ids=["pem", "standard"])
@pytest.mark.parametrize("backend", [None, SandboxBackend.NATIVE], ids=["default", "native"])
async def test_create_time_globs_without_the_supervisor_are_refused_before_anything_runs(
    sb: Sandboxes,
    monkeypatch: pytest.MonkeyPatch,
    globs: tuple[str, ...],
    backend: SandboxBackend | None,
) -> None:
    spy = _SpawnSpy(handoff.start)  # the one spawner of a sandbox (backends/handoff.py)
    monkeypatch.setattr(handoff, "start", spy)
    spec = parse_spec(sb.spec(sessionId="globbed"))
    manager = _without_create_rules(sb)
    try:
        with pytest.raises(BackendUnavailable) as caught:
            manager.launch(spec, backend=backend, deny_create_globs=globs)
        assert "create" in str(caught.value) and globs[0] in str(caught.value)
        # Refused, not stepped down to `none`: no handle, no process, nothing on disk.
        assert manager.handles == {}
        assert spy.calls == 0
        assert sorted(p.name for p in sb.worktree.iterdir()) == ["README"]

        # Without the globs the default write protection still needs the supervisor: refused.
        with pytest.raises(BackendUnavailable, match="CC_SERVER_WRITE_PROTECTION=launch-time"):
            manager.launch(spec, backend=backend)
        assert manager.handles == {} and spy.calls == 0
        # Control: said on purpose, launch-time protection alone launches natively and runs.
        monkeypatch.setenv(WRITE_PROTECTION_ENV, "launch-time")
        handle = manager.launch(spec, backend=backend)
        assert handle.backend is SandboxBackend.NATIVE
        result = await sb.sh(handle, f"echo ran > {sb.worktree}/ran.pem")
        assert result.exit_code == 0 and spy.calls == 1
        assert (sb.worktree / "ran.pem").read_text() == "ran\n"
    finally:
        await manager.aclose()


@pytest.mark.parametrize("globs", [("*.pem",), STANDARD_DENY_CREATE_GLOBS], ids=["pem", "standard"])
@pytest.mark.parametrize("backend", [None, SandboxBackend.NATIVE], ids=["default", "native"])
async def test_create_time_globs_with_the_supervisor_run_natively_and_refuse_the_names(
    sb: Sandboxes, globs: tuple[str, ...], backend: SandboxBackend | None
) -> None:
    assert sb.manager.probe_result.create_rules, sb.manager.probe_result.create_rules_hint
    spec = parse_spec(sb.spec(sessionId="globbed"))
    handle = sb.manager.launch(spec, backend=backend, deny_create_globs=globs)
    assert handle.backend is SandboxBackend.NATIVE  # not stepped down to `none`
    wt = sb.worktree
    result = await sb.sh(
        handle, attempts(refused=f"echo x > {wt}/ran.pem", allowed=f"echo x > {wt}/ran.txt")
    )
    assert outcomes(result) == {"refused": "fail", "allowed": "ok"}, output(result)
    assert sorted(p.name for p in sb.worktree.iterdir()) == ["README", "ran.txt"]
    assert [v.target for v in result.violations] == [f"{sb.worktree}/ran.pem"]
