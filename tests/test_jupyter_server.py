"""The extension on a real (in-process) Jupyter server with a base URL and auth on, called
with the unmodified tritonclient HTTP client and with raw requests."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tornado.httpclient import HTTPClientError

from conftest import INFER_KEY, TOKEN, W, in_thread
from jupyter_triton.frontends.http import ROUTES
from onnx_models import linear

AUTH = {"Authorization": f"token {TOKEN}"}


def triton_session(port: int, base: str, headers: dict):
    """Run a whole tritonclient session in a worker thread (the client blocks)."""
    def run(fn):
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}{base.rstrip('/')}", network_timeout=60)
        try:
            return fn(client, headers)
        finally:
            client.close()
    return run


async def test_tritonclient_every_call_under_base_url(jp_triton, jp_http_port, jp_base_url, model_repo):
    session = triton_session(jp_http_port, jp_base_url, AUTH)

    def story(c, h):
        assert c.is_server_live(headers=dict(h)) and c.is_server_ready(headers=dict(h))
        names = {r["name"] for r in c.get_model_repository_index(headers=dict(h))}
        meta = c.get_model_metadata("linear", headers=dict(h))
        config = c.get_model_config("linear", headers=dict(h))
        x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
        inp = httpclient.InferInput("INPUT0", [2, 16], "FP32")
        inp.set_data_from_numpy(x)
        out = c.infer("linear", [inp], headers=dict(h)).as_numpy("OUTPUT0")
        inp = httpclient.InferInput("INPUT0", [2, 16], "FP32")
        inp.set_data_from_numpy(x, binary_data=False)
        out_json = c.infer("linear", [inp], headers=dict(h),
                           outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)]
                           ).as_numpy("OUTPUT0")
        cfg = json.dumps(config)
        c.load_model("linear_copy", config=cfg.replace('"linear"', '"linear_copy"'),
                     files={"file:1/model.onnx": linear(W)}, headers=dict(h))
        copy_ready = c.is_model_ready("linear_copy", headers=dict(h))
        c.unload_model("linear_copy", headers=dict(h))
        return names, meta, x, out, out_json, copy_ready, c.is_model_ready("linear_copy", headers=dict(h))

    names, meta, x, out, out_json, copy_ready, after_unload = await in_thread(session, story)
    assert {"linear", "simple", "identity_int32"} <= names
    assert meta["inputs"][0]["shape"] == [-1, 16]
    np.testing.assert_allclose(out, x @ W, rtol=1e-5)
    np.testing.assert_allclose(out_json, x @ W, rtol=1e-5)
    assert copy_ready and not after_unload
    assert (model_repo / "linear_copy" / "1" / "model.onnx").exists()


def _sample_path(pattern: str) -> str:
    return (pattern.replace("(?P<model>[^/]+)", "linear")
            .replace("(?:/versions/(?P<version>[0-9]+))?", "/versions/1")
            .replace("/?", "").replace(".*", "anything"))


@pytest.mark.parametrize("pattern,handler", ROUTES)
async def test_every_route_refuses_unauthenticated(jp_triton, jp_fetch, pattern, handler):
    path = _sample_path(pattern)
    for method in ("GET", "POST"):
        if not hasattr(handler, method.lower()):
            continue
        with pytest.raises(HTTPClientError) as err:
            await jp_fetch(path, method=method, headers={"Authorization": ""},
                           body=b"{}" if method == "POST" else None)
        assert err.value.code == 403, (method, path)


async def test_inference_key_reaches_infer_but_not_load(jp_triton, jp_fetch):
    key = {"Authorization": f"Bearer {INFER_KEY}"}
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]})
    resp = await jp_fetch("v2/models/linear/infer", method="POST", body=body, headers=key)
    out = json.loads(resp.body)["outputs"][0]
    np.testing.assert_allclose(out["data"], (np.ones((1, 16), np.float32) @ W).ravel(), rtol=1e-5)
    for path, method in [("v2/repository/models/linear/unload", "POST"), ("v2/repository/index", "POST"),
                         ("api/contents", "GET"), ("api/kernels", "GET")]:
        with pytest.raises(HTTPClientError) as err:
            await jp_fetch(path, method=method, headers=key, body=b"{}" if method == "POST" else None)
        assert err.value.code == 403, path


async def test_errors_are_triton_shaped(jp_triton, jp_fetch):
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("v2/models/linear/infer", method="POST", body=b"{oops", headers=AUTH)
    assert err.value.code == 400
    assert set(json.loads(err.value.response.body)) == {"error"}
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("v2/models/missing", headers=AUTH)
    assert err.value.code == 404
    assert "missing" in json.loads(err.value.response.body)["error"]


async def test_metrics_join_the_server_metrics_endpoint(jp_triton, jp_fetch):
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [2, 16], "datatype": "FP32", "data": [1.0] * 32}]})
    for _ in range(3):
        await jp_fetch("v2/models/linear/infer", method="POST", body=body, headers=AUTH)
    resp = await jp_fetch("metrics", headers=AUTH)
    samples = {(s.name, s.labels.get("model"), s.labels.get("version")): s.value
               for fam in text_string_to_metric_families(resp.body.decode()) for s in fam.samples}
    assert samples[("nv_inference_request_success", "linear", "1")] == 3
    assert samples[("nv_inference_count", "linear", "1")] == 6
    stats = json.loads((await jp_fetch("v2/models/linear/stats", headers=AUTH)).body)["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == 3
    assert stats["inference_count"] == 6


async def test_kernels_find_the_server(jp_triton, jp_base_url):
    url = os.environ["JUPYTER_TRITON_URL"]
    assert url.endswith(jp_base_url) and url.startswith("http://")
    assert os.environ["JUPYTER_TRITON_TOKEN"]
    files = list(Path(jp_triton.runtime_dir).glob("jupyter_triton-*.json"))
    assert files and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert json.loads(files[0].read_text())["url"] == url
