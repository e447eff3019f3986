"""A busy model does not flood the single-user server's log: under a log function of the
server's own that writes every request at INFO (as JupyterHub's single-user server's does),
the v2 routes' successes are not handed to it; their errors are."""
from __future__ import annotations

import json

import pytest
from tornado.httpclient import HTTPClientError

from conftest import TOKEN

AUTH = {"Authorization": f"token {TOKEN}"}
ROW = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                              "data": [1.0] * 16}]})
LOGGED: list[tuple[int, str]] = []


def hub_like_log_function(handler) -> None:
    LOGGED.append((handler.get_status(), handler.request.path))


@pytest.fixture
def jp_server_config(jp_server_config):
    server = {**jp_server_config["ServerApp"],
              "tornado_settings": {"log_function": hub_like_log_function}}
    # the tornado handlers themselves (the fast routes log nothing per request either way)
    return {**jp_server_config, "ServerApp": server,
            "JupyterTriton": {**jp_server_config["JupyterTriton"], "fast_routes": False}}


async def test_successes_stay_out_of_a_servers_own_log_function(jp_triton, jp_fetch):
    LOGGED.clear()
    for _ in range(20):
        resp = await jp_fetch("v2/models/linear/infer", method="POST", body=ROW, headers=AUTH)
        assert resp.code == 200
    await jp_fetch("v2/models/linear", headers=AUTH)
    with pytest.raises(HTTPClientError):
        await jp_fetch("v2/models/nothing_here", headers=AUTH)
    await jp_fetch("api/status", headers=AUTH)        # Jupyter's own routes: as before
    ours = [(status, path) for status, path in LOGGED if "/v2/" in path]
    assert ours == [(404, "/user/alice/v2/models/nothing_here")]
    assert any(path.endswith("/api/status") for _, path in LOGGED)
