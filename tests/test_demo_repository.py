"""A fresh install with no configuration: the extension creates its demo repository (built
locally, nothing downloaded) and serves the demo model."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import TOKEN
from jupyter_triton.demo import demo_weights

AUTH = {"Authorization": f"token {TOKEN}"}


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"jupyter_triton": True}, "token": TOKEN},
            "IdentityProvider": {"token": TOKEN}}


async def test_demo_model_served_out_of_the_box(jp_triton, jp_fetch, jp_data_dir):
    repo = jp_data_dir / "jupyter_triton" / "model_repository"
    assert (repo / "demo" / "1" / "model.onnx").exists()
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [2, 16], "datatype": "FP32",
                                   "data": x.ravel().tolist()}]})
    resp = await jp_fetch("v2/models/demo/infer", method="POST", body=body, headers=AUTH)
    out = json.loads(resp.body)["outputs"][0]
    w, b = demo_weights()
    np.testing.assert_allclose(np.array(out["data"]).reshape(2, 4), np.maximum(x @ w + b, 0), rtol=1e-5, atol=1e-6)
