"""The in-kernel server's metrics port is as guarded as its HTTP port: model names and
counts are not for any local user (or a web page) to read. The kernel's own dashboard
poller reads them with the kernel's token."""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from jupyter_triton.kernel import discovery
from jupyter_triton.widgets.poller import StatsPoller, stats_url


@pytest.fixture
def in_kernel(monkeypatch, tmp_path, model_repo: Path):
    for name in [k for k in os.environ if k.startswith(("JUPYTER_TRITON_", "JUPYTERHUB_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    discovery.reset()
    conn = discovery.start_in_kernel(model_repo)
    try:
        yield conn
    finally:
        discovery.stop_in_kernel()
        discovery.reset()


def get(url: str, headers: dict[str, str]) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_in_kernel_metrics_need_the_kernels_token(in_kernel):
    conn = in_kernel
    c = httpclient.InferenceServerClient(conn.url[len("http://"):].rstrip("/"))
    try:
        c.load_model("linear", headers=conn.headers)
        inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(np.ones((1, 16), np.float32))
        c.infer("linear", [inp], headers=conn.headers)
    finally:
        c.close()
    assert conn.metrics_url.startswith("http://127.0.0.1:")

    status, body = get(conn.metrics_url, {})
    assert status == 401 and "linear" not in body
    assert "authentication required" in json.loads(body)["error"]
    status, body = get(conn.metrics_url, {"Authorization": "token not-the-token"})
    assert status == 401 and "linear" not in body
    status, body = get(conn.metrics_url, {**conn.headers, "Host": "rebound.example"})   # DNS rebinding
    assert status == 403 and "linear" not in body
    status, body = get(conn.metrics_url, conn.headers)
    assert status == 200
    assert 'nv_inference_request_success{model="linear",version="1"} 1' in body

    # the dashboard's poller sends the token, so it reads pending counts
    poller = StatsPoller(stats_url(conn.url, "linear"), conn.headers, lambda snapshot: None,
                         metrics_url=conn.metrics_url)
    snapshot = poller.poll_once()
    assert snapshot.pending == {"linear/1": 0}
    assert poller.metrics_url == conn.metrics_url            # not given up on
