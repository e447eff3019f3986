"""Serving is activity: inference on the extension's gRPC port (and its token-header fast
routes, which Jupyter's own handlers never see) moves the server's ``last_activity``
(``/api/status``), which Jupyter's idle shutdown and JupyterHub's culler read."""
from __future__ import annotations

import json
import time
from datetime import datetime

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import TOKEN, in_thread

AUTH = {"Authorization": f"token {TOKEN}"}


@pytest.fixture
def jp_server_config(jp_server_config):
    return {**jp_server_config, "JupyterTriton": {**jp_server_config["JupyterTriton"],
                                                   "activity_interval": 0.1}}


async def _last_activity(jp_fetch) -> datetime:
    status = json.loads((await jp_fetch("api/status", headers=AUTH)).body)
    return datetime.fromisoformat(status["last_activity"].replace("Z", "+00:00"))


async def _moved_past(jp_fetch, before: datetime) -> datetime:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = await _last_activity(jp_fetch)
        if now > before:
            return now
        await in_thread(time.sleep, 0.1)
    raise AssertionError(f"last_activity stayed at {before} after inference")


def _grpc_infer(port: int) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    x = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    x.set_data_from_numpy(np.ones((1, 16), np.float32))
    assert client.infer("linear", [x], headers={"authorization": f"token {TOKEN}"}).as_numpy("OUTPUT0").shape == (1, 4)
    client.close()


def _http_infer(port: int, base: str) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}{base.rstrip('/')}")
    x = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    x.set_data_from_numpy(np.ones((1, 16), np.float32))
    assert client.infer("linear", [x], headers=dict(AUTH)).as_numpy("OUTPUT0").shape == (1, 4)


async def test_inference_on_every_port_is_the_servers_activity(jp_triton, jp_fetch, jp_http_port,
                                                               jp_base_url):
    (app,) = jp_triton.extension_manager.extension_apps["jupyter_triton"]
    assert app.bound_grpc_port > 0
    # /api/status is itself activity for nobody (Jupyter leaves it out); start from what it says
    before = await _last_activity(jp_fetch)
    await in_thread(_grpc_infer, app.bound_grpc_port)
    after_grpc = await _moved_past(jp_fetch, before)
    await in_thread(_http_infer, jp_http_port, jp_base_url)   # the fast routes: not Jupyter's handlers
    await _moved_past(jp_fetch, after_grpc)
