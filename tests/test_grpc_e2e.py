"""The real engine behind the gRPC frontend, called with the unmodified tritonclient gRPC client."""
from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import W
from onnx_models import linear


@pytest.fixture
def gclient(standalone):
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{standalone.grpc_port}")
    yield c
    c.close()


def test_grpc_story(gclient, model_repo):
    assert gclient.is_server_live() and gclient.is_server_ready()
    assert gclient.is_model_ready("linear")
    meta = gclient.get_model_metadata("linear", as_json=True)
    assert meta["inputs"][0]["shape"] == ["-1", "16"]
    config = gclient.get_model_config("linear", as_json=True)["config"]
    assert config["max_batch_size"] == 8
    x = np.random.default_rng(3).standard_normal((4, 16)).astype(np.float32)
    inp = grpcclient.InferInput("INPUT0", [4, 16], "FP32")
    inp.set_data_from_numpy(x)
    result = gclient.infer("linear", [inp], request_id="g1")
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), x @ W, rtol=1e-5)
    assert result.get_response().id == "g1"
    stats = gclient.get_inference_statistics("linear", as_json=True)["model_stats"][0]
    assert int(stats["inference_stats"]["success"]["count"]) == 1
    index = {m["name"] for m in gclient.get_model_repository_index(as_json=True)["models"]}
    assert {"linear", "simple", "identity_int32"} <= index
    cfg = json.dumps({"name": "g", "backend": "onnxruntime", "max_batch_size": 8,
                      "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}],
                      "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}]})
    gclient.load_model("g", config=cfg, files={"file:1/model.onnx": linear(W)})
    assert (model_repo / "g" / "1" / "model.onnx").exists()
    assert gclient.is_model_ready("g")
    gclient.unload_model("g")
    assert not gclient.is_model_ready("g")


def test_grpc_errors_keep_server_serving(gclient):
    bad = grpcclient.InferInput("INPUT0", [1, 8], "FP32")
    bad.set_data_from_numpy(np.ones((1, 8), np.float32))
    with pytest.raises(InferenceServerException) as err:
        gclient.infer("linear", [bad])
    assert "INPUT0" in str(err.value) and "StatusCode.INVALID_ARGUMENT" in err.value.status()
    with pytest.raises(InferenceServerException) as err:
        gclient.infer("nope", [bad])
    assert err.value.status() == "StatusCode.NOT_FOUND"
    good = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    good.set_data_from_numpy(np.ones((1, 16), np.float32))
    assert gclient.infer("linear", [good]).as_numpy("OUTPUT0").shape == (1, 4)
