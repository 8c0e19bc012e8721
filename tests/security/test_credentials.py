"""Brokered credentials: visible to a run while its grant lives, unusable after revoke, and never
given to a run whose capabilities do not earn them.

Real processes read the credential through what the run was given (its environment and the
per-launch directory): `git credential fill` on the host, and in a real bubblewrap sandbox.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import secrets
import socket
import subprocess
from collections.abc import Iterator

import pytest
from escape_kit import Sandboxes, wait_until

from cc_server.backends.peer import SameNamespaces
from cc_server.dispatch.credentials import (
    REQUEST_TIMEOUT_S,
    SOCKET_NAME,
    CredentialBroker,
    CredentialUnavailable,
    remove_stale_grant_dirs,
)
from cc_server.dispatch.env import sanitized_env
from cc_server.egress.baseline import GITHUB_DOMAINS
from cc_server.egress.resolver import allowlist_for
from cc_server.errors import BadSpec, CcServerError
from cc_server.policy import AgentCapabilities, SandboxSpec, parse_spec
from cc_server.runtime.handle import run_collect

pytestmark = pytest.mark.security

FILL_REQUEST = b"protocol=https\nhost=github.com\n\n"
GIT_TIMEOUT_S = 30


@pytest.fixture
def token(tmp_path: pathlib.Path) -> str:
    return f"ghs_{secrets.token_hex(16)}"


@pytest.fixture
def broker(tmp_path: pathlib.Path, token: str) -> Iterator[CredentialBroker]:
    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    token_file = tmp_path / "operator" / "github-token"
    token_file.parent.mkdir()
    token_file.write_text(token + "\n")
    b = CredentialBroker(base_dir=str(base), github_token_file=str(token_file))
    try:
        yield b
    finally:
        b.close()


def _spec(**caps: bool) -> SandboxSpec:
    return SandboxSpec(session_id="s", workspace_id="w", capabilities=AgentCapabilities(**caps))


def _fill(env: dict[str, str], home: pathlib.Path) -> subprocess.CompletedProcess[bytes]:
    """`git credential fill` with exactly what the run is given (plus an empty HOME)."""
    run_env = sanitized_env({"PATH": "/usr/bin:/bin", "HOME": str(home)}, add=env)
    return subprocess.run(
        ["git", "credential", "fill"],
        input=FILL_REQUEST,
        env=run_env,
        capture_output=True,
        timeout=GIT_TIMEOUT_S,
        check=False,
    )


@pytest.mark.parametrize("caps", [{"can_push": True}, {"can_call_github_api": True}])
def test_a_credential_is_usable_during_the_run_and_not_after_revoke(
    broker: CredentialBroker, token: str, tmp_path: pathlib.Path, caps: dict[str, bool]
) -> None:
    grant = broker.grant(_spec(**caps), "run-1")
    assert grant.directory is not None
    assert token.encode() not in _fill(grant.env, tmp_path).stdout  # nobody, before admit()
    broker.admit("run-1", SameNamespaces())  # this host's processes stand in for the run
    # The token is in no part of what the run is handed: not env, not argv, not a file.
    assert token not in repr(grant.env) and token not in repr(grant.bind_mounts)
    for entry in os.listdir(grant.directory):
        path = os.path.join(grant.directory, entry)
        if os.path.isfile(path):
            assert token not in pathlib.Path(path).read_text()
    assert os.stat(grant.directory).st_mode & 0o777 == 0o700

    during = _fill(grant.env, tmp_path)
    assert during.returncode == 0, during.stderr
    assert f"password={token}".encode() in during.stdout

    broker.revoke("run-1")
    broker.revoke("run-1")  # idempotent
    after = _fill(grant.env, tmp_path)
    assert token.encode() not in after.stdout + after.stderr
    assert after.returncode != 0
    assert not os.path.exists(grant.directory)
    assert broker.live_runs == ()


def test_a_connection_kept_from_during_the_run_gets_nothing_after_revoke(
    broker: CredentialBroker, token: str
) -> None:
    grant = broker.grant(_spec(can_push=True), "run-1")
    assert grant.directory is not None
    broker.admit("run-1", SameNamespaces())
    kept = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    kept.settimeout(GIT_TIMEOUT_S)
    kept.connect(os.path.join(grant.directory, SOCKET_NAME))
    broker.revoke("run-1")
    with kept:
        try:
            kept.sendall(FILL_REQUEST)
            kept.shutdown(socket.SHUT_WR)
            answer = kept.recv(4096)
        except OSError:
            answer = b""
    assert token.encode() not in answer


def test_a_client_dripping_its_request_cannot_hold_the_revoke(
    broker: CredentialBroker, token: str
) -> None:
    """A process of the run that keeps the helper's socket busy (a byte at a time, never ending
    its request) cannot stall revoke(), which the server calls on its event loop."""
    import threading
    import time

    grant = broker.grant(_spec(can_push=True), "run-1")
    assert grant.directory is not None
    broker.admit("run-1", SameNamespaces())
    stop = threading.Event()
    sent = [0]

    def drip() -> None:
        end = time.monotonic() + 3 * REQUEST_TIMEOUT_S  # a listener that waits fails, not hangs
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(os.path.join(grant.directory, SOCKET_NAME))  # type: ignore[arg-type]
            while not stop.wait(REQUEST_TIMEOUT_S / 10) and time.monotonic() < end:
                try:
                    s.sendall(b"p")
                except OSError:
                    return
                sent[0] += 1

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while sent[0] < 3 and time.monotonic() < deadline:  # the listener is reading it
            time.sleep(0.05)
        assert sent[0] >= 3
        start = time.monotonic()
        broker.revoke("run-1")
        took = time.monotonic() - start
    finally:
        stop.set()
        dripper.join()
    assert took < REQUEST_TIMEOUT_S / 2, took
    assert not os.path.exists(grant.directory)


def test_the_helper_answers_only_github_over_https(
    broker: CredentialBroker, token: str, tmp_path: pathlib.Path
) -> None:
    grant = broker.grant(_spec(can_push=True), "run-1")
    broker.admit("run-1", SameNamespaces())
    helper = grant.env["GIT_CONFIG_VALUE_1"]
    for request in (
        b"protocol=http\nhost=github.com\n\n",
        b"protocol=https\nhost=evil.example\n\n",
        b"protocol=https\nhost=github.com.evil.example\n\n",
        b"",
    ):
        out = subprocess.run(
            [helper, "get"], input=request, capture_output=True, timeout=GIT_TIMEOUT_S, check=True
        )
        assert token.encode() not in out.stdout, request
    for operation in ("store", "erase"):
        out = subprocess.run(
            [helper, operation],
            input=FILL_REQUEST,
            capture_output=True,
            timeout=GIT_TIMEOUT_S,
            check=True,
        )
        assert out.stdout == b""


@pytest.mark.parametrize(
    "spec",
    [
        _spec(),  # safe default
        _spec(can_call_ticketing=True),
        _spec(can_use_network=False, can_push=True),  # earns GitHub but has no network
        SandboxSpec(
            session_id="s",
            workspace_id="w",
            network_enabled=False,
            capabilities=AgentCapabilities(can_call_github_api=True),
        ),
    ],
)
def test_a_run_without_the_github_capability_gets_no_credential(
    broker: CredentialBroker, spec: SandboxSpec
) -> None:
    before = sorted(os.listdir(broker.base_dir))
    grant = broker.grant(spec, "run-1")
    assert grant.empty and grant.directory is None
    assert sorted(os.listdir(broker.base_dir)) == before
    assert broker.live_runs == ()


def test_a_run_without_the_github_capability_gets_no_github_domains() -> None:
    github_patterns = {rule.pattern for rule in GITHUB_DOMAINS}
    assert github_patterns
    for spec in (_spec(), _spec(can_call_ticketing=True)):
        allowlist = allowlist_for(spec)
        assert not github_patterns & {rule.pattern for rule in allowlist.patterns}
        for host in ("github.com", "api.github.com", "codeload.github.com"):
            assert not allowlist.allows(host).allowed, host
    earned = allowlist_for(_spec(can_push=True))
    assert earned.allows("api.github.com").allowed


def test_without_an_operator_token_file_nothing_is_granted(tmp_path: pathlib.Path) -> None:
    """The broker never looks in the server's environment: no file configured, no credential."""
    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    broker = CredentialBroker(base_dir=str(base))
    assert broker.grant(_spec(can_push=True), "run-1").empty
    assert os.listdir(base) == []


def test_a_bad_token_file_fails_the_grant_and_leaves_nothing(tmp_path: pathlib.Path) -> None:
    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    for name, content in (("missing", None), ("empty", ""), ("two", "a b\n")):
        path = tmp_path / name
        if content is not None:
            path.write_text(content)
        broker = CredentialBroker(base_dir=str(base), github_token_file=str(path))
        with pytest.raises(CredentialUnavailable):
            broker.grant(_spec(can_push=True), "run-1")
        assert os.listdir(base) == []
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "two")
    with pytest.raises(CredentialUnavailable):
        CredentialBroker(base_dir=str(base), github_token_file=str(link)).grant(
            _spec(can_push=True), "run-1"
        )


def test_run_ids_are_checked_and_grants_are_per_run(
    broker: CredentialBroker, token: str, tmp_path: pathlib.Path
) -> None:
    for bad in ("../escape", "run-1\n"):
        with pytest.raises(BadSpec):
            broker.grant(_spec(can_push=True), bad)
    first = broker.grant(_spec(can_push=True), "run-1")
    with pytest.raises(BadSpec, match="already holds"):
        broker.grant(_spec(can_push=True), "run-1")
    second = broker.grant(_spec(can_push=True), "run-2")
    broker.admit("run-1", SameNamespaces())
    broker.admit("run-2", SameNamespaces())
    assert first.directory != second.directory
    broker.revoke("run-1")
    # Revoking one run leaves the other's credential working.
    assert f"password={token}".encode() in _fill(second.env, tmp_path).stdout
    assert token.encode() not in _fill(first.env, tmp_path).stdout


def test_stale_grant_directories_of_a_dead_server_are_removed(tmp_path: pathlib.Path) -> None:
    dead = subprocess.Popen(["/bin/true"])
    dead.wait()
    stale = tmp_path / f"cred-{dead.pid}-{'0' * 16}"
    stale.mkdir()
    mine = tmp_path / f"cred-{os.getpid()}-{'1' * 16}"
    mine.mkdir()
    other = tmp_path / "egress-1-0000000000000000"
    other.mkdir()
    assert remove_stale_grant_dirs(str(tmp_path)) == [stale.name]
    assert mine.exists() and other.exists() and not stale.exists()


async def test_inside_a_real_sandbox_the_credential_works_until_revoke(
    sb: Sandboxes, tmp_path: pathlib.Path, token: str
) -> None:
    """One sandboxed process asks during the run, waits while the host revokes, asks again."""
    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    token_file = tmp_path / "github-token"
    token_file.write_text(token)
    broker = CredentialBroker(base_dir=str(base), github_token_file=str(token_file))
    wt = sb.worktree
    (wt / "request").write_bytes(FILL_REQUEST)
    script = (
        "git credential fill <request >during.out 2>&1; echo $? >during.rc; touch ready; "
        "while [ ! -e go ]; do sleep 0.05; done; "
        "git credential fill <request >after.out 2>&1; echo $? >after.rc; "
        'test -e "$HELPER"; echo $? >helper.rc'
    )
    try:
        data = sb.spec(capabilities={"canPush": True}, guestWorkdir=str(wt))
        grant = broker.grant(parse_spec(data), "run-sandboxed")
        data["bindMounts"] = [*data["bindMounts"], *(m.to_json() for m in grant.bind_mounts)]
        handle = sb.manager.launch(parse_spec(data))
        broker.admit("run-sandboxed", handle.sandbox_peers)
        env = sanitized_env(
            {"PATH": "/usr/bin:/bin", "HOME": str(wt)},
            add={**grant.env, "HELPER": grant.env["GIT_CONFIG_VALUE_1"]},
        )
        running = asyncio.create_task(
            run_collect(handle, ["/bin/sh", "-c", script], env=env, cwd=str(wt), timeout_s=60)
        )
        assert await wait_until(lambda: (wt / "ready").exists() or running.done(), 30)
        assert (wt / "during.rc").read_text().strip() == "0", (wt / "during.out").read_text()
        assert f"password={token}" in (wt / "during.out").read_text()

        broker.revoke("run-sandboxed")
        (wt / "go").touch()
        result = await running
        assert result.exit_code == 0, result
        assert (wt / "after.rc").read_text().strip() != "0"
        assert token not in (wt / "after.out").read_text()
        assert (wt / "helper.rc").read_text().strip() != "0"  # the helper is gone inside too
        # A new command of the torn-down run cannot even start: its grant's bind is gone.
        with pytest.raises(CcServerError):
            await run_collect(handle, ["/bin/true"], timeout_s=30)
    finally:
        broker.close()


async def test_another_sandbox_and_the_host_get_nothing_from_a_runs_broker(
    sb: Sandboxes, tmp_path: pathlib.Path, token: str
) -> None:
    """The grant's socket answers the run's own sandbox only: a sandbox of another session that
    binds the same directory, and a process on the host, are closed unanswered."""
    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    token_file = tmp_path / "github-token"
    token_file.write_text(token)
    broker = CredentialBroker(base_dir=str(base), github_token_file=str(token_file))
    wt = sb.worktree
    (wt / "request").write_bytes(FILL_REQUEST)
    try:
        data = sb.spec(capabilities={"canPush": True}, guestWorkdir=str(wt))
        grant = broker.grant(parse_spec(data), "run-own")
        data["bindMounts"] = [*data["bindMounts"], *(m.to_json() for m in grant.bind_mounts)]
        own = sb.manager.launch(parse_spec(data))
        broker.admit("run-own", own.sandbox_peers)
        foreign_data = sb.spec(capabilities={"canPush": True}, guestWorkdir=str(wt))
        foreign_data["bindMounts"] = data["bindMounts"]
        foreign = sb.manager.launch(parse_spec(foreign_data))
        env = sanitized_env({"PATH": "/usr/bin:/bin", "HOME": str(wt)}, add=grant.env)
        script = "git credential fill <request 2>&1; echo rc=$?"
        theirs = await run_collect(foreign, ["/bin/sh", "-c", script], env=env, cwd=str(wt),
                                   timeout_s=60)
        assert theirs.exit_code == 0 and b"rc=" in theirs.stdout, theirs
        assert token.encode() not in theirs.stdout + theirs.stderr, theirs
        assert token.encode() not in _fill(grant.env, tmp_path).stdout  # the host
        ours = await run_collect(own, ["/bin/sh", "-c", script], env=env, cwd=str(wt),
                                 timeout_s=60)
        assert f"password={token}".encode() in ours.stdout, ours  # control
    finally:
        broker.close()
