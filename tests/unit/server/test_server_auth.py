"""The bearer token: its file, and the middleware in front of every route but /healthz."""

from __future__ import annotations

import os
import pathlib
import stat
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from cc_server.server.auth import (
    bearer_auth,
    default_token_path,
    generate_token,
    remove_token_file,
    write_token_file,
)
from cc_server.server.config import ServerConfigError


def test_tokens_are_long_and_fresh() -> None:
    tokens = {generate_token() for _ in range(100)}
    assert len(tokens) == 100 and all(len(t) >= 43 for t in tokens)


def test_the_token_file_is_private_whatever_the_umask(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "token"
    path.write_text("old, world-readable\n")
    os.chmod(path, 0o644)
    old = os.umask(0)
    try:
        write_token_file(str(path), "t0ken")
    finally:
        os.umask(old)
    assert path.read_text() == "t0ken\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["token"]  # no temporary left behind


def test_a_missing_directory_is_a_config_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ServerConfigError, match="cannot write the token file"):
        write_token_file(str(tmp_path / "missing" / "token"), "t")


def test_the_default_path_is_in_the_private_runtime_dir(tmp_path: pathlib.Path) -> None:
    path = default_token_path({"XDG_RUNTIME_DIR": str(tmp_path)})
    assert path == str(tmp_path / "cc-server" / "token")
    assert stat.S_IMODE(os.stat(tmp_path / "cc-server").st_mode) == 0o700


def test_removal_only_of_our_own_token(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "token"
    write_token_file(str(path), "ours")
    remove_token_file(str(path), "theirs")
    assert path.exists()
    remove_token_file(str(path), "ours")
    assert not path.exists()
    remove_token_file(str(path), "ours")  # gone already: fine


TOKEN = "s3cret-token"


@pytest.fixture
async def client() -> AsyncIterator[TestClient[web.Request, web.Application]]:
    async def ok(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[bearer_auth(TOKEN)])
    app.router.add_get("/healthz", ok)
    app.router.add_get("/v1/thing", ok)
    async with TestClient(TestServer(app)) as test_client:
        yield test_client


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": f"Bearer {TOKEN}"}, 200),
        ({"Authorization": f"bearer {TOKEN}"}, 200),  # the scheme is case-insensitive
        ({"Authorization": f"Bearer {TOKEN}x"}, 401),
        ({"Authorization": f"Bearer {TOKEN[:-1]}"}, 401),
        ({"Authorization": TOKEN}, 401),
        ({"Authorization": f"Basic {TOKEN}"}, 401),
        ({"Authorization": "Bearer \u00e9\u00e9"}, 401),
    ],
)
async def test_the_header(
    client: TestClient[web.Request, web.Application], headers: dict[str, str], status: int
) -> None:
    async with client.get("/v1/thing", headers=headers) as response:
        assert response.status == status
    async with client.get("/healthz") as response:
        assert response.status == 200


async def test_the_query_parameter_counts_only_for_websocket_upgrades(
    client: TestClient[web.Request, web.Application],
) -> None:
    async with client.get("/v1/thing", params={"token": TOKEN}) as response:
        assert response.status == 401
    upgrade = {"Upgrade": "websocket", "Connection": "Upgrade"}
    async with client.get("/v1/thing", params={"token": TOKEN}, headers=upgrade) as response:
        assert response.status == 200  # the handler is not a WebSocket one; auth passed
    async with client.get("/v1/thing", params={"token": "no"}, headers=upgrade) as response:
        assert response.status == 401
