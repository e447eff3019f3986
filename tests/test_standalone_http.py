"""The standalone server, driven with the unmodified tritonclient HTTP client."""
from __future__ import annotations

import base64
import http.client
import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import BOTH_FRONTS, W
from onnx_models import linear


@pytest.fixture(params=BOTH_FRONTS)
def http_front(request) -> str:
    """Every test here runs against both HTTP skins of the standalone server."""
    return request.param


@pytest.fixture
def client(standalone):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{standalone.http_port}")
    yield c
    c.close()


def raw(server, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    raw.headers = dict(resp.getheaders())
    return resp.status, data


def infer_linear(client, x: np.ndarray, binary: bool = True, model: str = "linear", version: str = ""):
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
    return client.infer(model, [inp], outputs=[out], model_version=version, request_id="req-7")


def test_server_health_and_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert "binary_tensor_data" in meta["extensions"]
    assert "model_repository" in meta["extensions"]


def test_index_lists_every_model_ready(client):
    index = {row["name"]: row for row in client.get_model_repository_index()}
    assert set(index) == {"linear", "simple", "identity_int32"}
    assert all(row["state"] == "READY" and row["version"] == "1" for row in index.values())


def test_metadata_and_config(client):
    meta = client.get_model_metadata("linear")
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 16]}]
    assert meta["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["versions"] == ["1"]
    config = client.get_model_config("linear")
    assert config["max_batch_size"] == 8
    assert config["input"][0]["dims"] == [16]          # numbers, as Triton prints them
    assert config["input"][0]["data_type"] == "TYPE_FP32"


def test_onnx_auto_complete_as_triton(client):
    config = client.get_model_config("simple")
    assert config["max_batch_size"] == 4
    assert "dynamic_batching" in config
    assert {i["name"] for i in config["input"]} == {"INPUT0", "INPUT1"}
    assert config["input"][0]["dims"] == [4]


@pytest.mark.parametrize("binary", [True, False])
def test_infer_equals_numpy(client, binary):
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    result = infer_linear(client, x, binary=binary)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), x @ W, rtol=1e-5)
    response = result.get_response()
    assert response["id"] == "req-7"
    assert response["model_name"] == "linear" and response["model_version"] == "1"


def test_infer_by_version_and_selected_output(client):
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.ones((2, 4), dtype=np.float32)
    inputs = [httpclient.InferInput("INPUT0", [2, 4], "FP32"), httpclient.InferInput("INPUT1", [2, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("simple", inputs, model_version="1",
                          outputs=[httpclient.InferRequestedOutput("OUTPUT1")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.as_numpy("OUTPUT0") is None


def test_int32_identity(client):
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    inp = httpclient.InferInput("INPUT0", [2, 3], "INT32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("identity_int32", [inp]).as_numpy("OUTPUT0"), x)


def test_classification_extension(client):
    x = np.zeros((1, 16), dtype=np.float32)
    x[0, 15] = 1.0                          # row 15 of W is the largest: index 3 wins
    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("linear", [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0", class_count=2)])
    top = result.as_numpy("OUTPUT0")
    assert top.shape == (1, 2)
    scores = x @ W
    best = int(np.argmax(scores))
    assert top[0, 0].decode().split(":")[1] == str(best)


def test_raw_binary_request(standalone):
    x = np.random.default_rng(2).standard_normal((2, 16)).astype(np.float32)
    status, body = raw(standalone, "POST", "/v2/models/linear/infer", x.tobytes(),
                       {"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"})
    assert status == 200, body
    # A raw request is answered in binary, as Triton does.
    length = int(raw.headers["Inference-Header-Content-Length"])
    result = httpclient.InferResult.from_response_body(body, header_length=length)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), x @ W, rtol=1e-5)


def test_load_persists_new_versions(client, model_repo: Path):
    w2 = np.eye(16, 4, dtype=np.float32)
    files = {"file:1/model.onnx": linear(w2)}
    config = json.dumps({"name": "uploaded", "backend": "onnxruntime", "max_batch_size": 8,
                         "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}],
                         "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}]})
    client.load_model("uploaded", config=config, files=files)
    assert (model_repo / "uploaded" / "1" / "model.onnx").read_bytes() == files["file:1/model.onnx"]
    x = np.ones((1, 16), dtype=np.float32)
    np.testing.assert_allclose(infer_linear(client, x, model="uploaded").as_numpy("OUTPUT0"), x @ w2)
    # Loading again never overwrites version 1: the upload becomes version 2.
    w3 = 2 * w2
    client.load_model("uploaded", config=config, files={"file:1/model.onnx": linear(w3)})
    assert (model_repo / "uploaded" / "1" / "model.onnx").read_bytes() == files["file:1/model.onnx"]
    assert (model_repo / "uploaded" / "2" / "model.onnx").exists()
    result = infer_linear(client, x, model="uploaded")
    assert result.get_response()["model_version"] == "2"
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), x @ w3)


def test_failed_load_keeps_previous_version_serving(client, model_repo: Path):
    config = json.dumps({"name": "linear", "backend": "onnxruntime", "max_batch_size": 8,
                         "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}],
                         "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}]})
    with pytest.raises(InferenceServerException):
        client.load_model("linear", config=config, files={"file:1/model.onnx": b"not an onnx model"})
    x = np.ones((1, 16), dtype=np.float32)
    result = infer_linear(client, x)
    assert result.get_response()["model_version"] == "1"
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), x @ W, rtol=1e-5)
    # The failed upload was staged, never committed: a restart serves version 1 too.
    assert sorted(p.name for p in (model_repo / "linear").iterdir() if p.name.isdigit()) == ["1"]


def test_unload_then_load(client):
    client.unload_model("simple")
    assert not client.is_model_ready("simple")
    states = {r["name"]: r for r in client.get_model_repository_index()}
    assert states["simple"]["state"] == "UNAVAILABLE"
    client.load_model("simple")
    assert client.is_model_ready("simple")


GOOD = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                               "data": [0.5] * 16}]}).encode()


@pytest.mark.parametrize("path,body,headers,status,needle", [
    ("/v2/models/linear/infer", b"{not json", {}, 400, ""),
    ("/v2/models/linear/infer", b"[1, 2]", {}, 400, ""),
    ("/v2/models/linear/infer", b"[" * 100000 + b"]" * 100000, {}, 400, ""),
    ("/v2/models/linear/infer", json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP64",
                                                        "data": [0.5] * 16}]}).encode(), {}, 400, "FP64"),
    ("/v2/models/linear/infer", json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 8], "datatype": "FP32",
                                                        "data": [0.5] * 8}]}).encode(), {}, 400, "INPUT0"),
    ("/v2/models/linear/infer", json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, -16], "datatype": "FP32",
                                                        "data": [0.5] * 16}]}).encode(), {}, 400, "INPUT0"),
    ("/v2/models/linear/infer", json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                                                        "data": [0.5] * 15}]}).encode(), {}, 400, "INPUT0"),
    ("/v2/models/linear/infer", json.dumps({"inputs": [{"name": "INPUT0", "shape": [2 ** 40, 2 ** 40],
                                                        "datatype": "FP32", "data": [0.5]}]}).encode(), {}, 400, ""),
    ("/v2/models/linear/infer", GOOD, {"Inference-Header-Content-Length": str(len(GOOD) + 10)}, 400, ""),
    ("/v2/models/linear/infer", json.dumps({"inputs": [{"name": "X", "shape": [1, 16], "datatype": "FP32",
                                                        "data": [0.5] * 16}]}).encode(), {}, 400, "X"),
    ("/v2/models/nope/infer", GOOD, {}, 404, "nope"),
    ("/v2/models/linear/versions/9/infer", GOOD, {}, 404, ""),
    ("/v2/models/nope", b"", {}, 404, ""),
])
def test_bad_requests_get_clear_errors_and_server_keeps_serving(standalone, client, path, body, headers,
                                                                status, needle):
    method = "GET" if path == "/v2/models/nope" else "POST"
    got, data = raw(standalone, method, path, body, headers)
    assert got == status, data
    err = json.loads(data)
    assert set(err) == {"error"} and err["error"]
    assert needle in err["error"]
    assert "Traceback" not in err["error"]
    x = np.ones((1, 16), dtype=np.float32)
    np.testing.assert_allclose(infer_linear(client, x).as_numpy("OUTPUT0"), x @ W, rtol=1e-5)


def test_bytes_with_bad_lengths(standalone, client):
    header = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": 8}}]}).encode()
    body = header + (1000).to_bytes(4, "little") + b"abcd"
    got, data = raw(standalone, "POST", "/v2/models/linear/infer", body,
                    {"Inference-Header-Content-Length": str(len(header))})
    assert got == 400 and "error" in json.loads(data)
    assert client.is_server_live()


def test_load_rejects_bad_payloads(standalone, model_repo: Path):
    before = sorted(p.name for p in model_repo.iterdir())
    for payload in [b"{", json.dumps({"parameters": {"config": "{bad", "file:1/model.onnx": "AAAA"}}).encode(),
                    json.dumps({"parameters": {"config": "{}", "file:../../etc/x": base64.b64encode(b"x").decode()}}
                               ).encode()]:
        got, data = raw(standalone, "POST", "/v2/repository/models/evil/load", payload)
        assert got == 400, data
        assert "error" in json.loads(data)
    assert sorted(p.name for p in model_repo.iterdir()) == before


def test_refused_requests_are_counted_as_failures(standalone, client):
    before = client.get_inference_statistics("linear")["model_stats"][0]["inference_stats"]["fail"]["count"]
    bad = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 8], "datatype": "FP32",
                                  "data": [0.5] * 8}]}).encode()
    assert raw(standalone, "POST", "/v2/models/linear/infer", bad)[0] == 400
    after = client.get_inference_statistics("linear")["model_stats"][0]["inference_stats"]["fail"]["count"]
    assert after == before + 1


TALKER_MODEL = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        pb_utils.Logger.log_warn("talker warns")
        print("talker prints", flush=True)
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
'''

TALKER_CONFIG = '''\
name: "talker"
backend: "python"
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
'''


def test_model_logs_route(standalone, client, model_repo):
    """GET v2/models/{m}[/versions/{v}]/logs: what a model logged and printed, oldest first;
    kept after an unload; an unknown model is 404."""
    import time
    (model_repo / "talker" / "1").mkdir(parents=True)
    (model_repo / "talker" / "1" / "model.py").write_text(TALKER_MODEL)
    (model_repo / "talker" / "config.pbtxt").write_text(TALKER_CONFIG)
    client.load_model("talker")
    inp = httpclient.InferInput("IN", [1], "INT32")
    inp.set_data_from_numpy(np.array([7], np.int32))
    client.infer("talker", [inp])
    deadline = time.monotonic() + 30
    wanted = {("WARNING", "logger", "talker warns"), ("INFO", "stdout", "talker prints")}
    while True:        # each arrives through its own pipe (stderr, stdout), a moment later
        status, body = raw(standalone, "GET", "/v2/models/talker/versions/1/logs")
        assert status == 200, body
        lines = json.loads(body)["lines"]
        messages = [(line["level"], line["source"], line["message"]) for line in lines]
        if wanted <= set(messages) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert ("WARNING", "logger", "talker warns") in messages
    assert ("INFO", "stdout", "talker prints") in messages
    client.unload_model("talker")
    status, body = raw(standalone, "GET", "/v2/models/talker/logs")
    assert status == 200 and json.loads(body)["name"] == "talker"
    assert "talker warns" in [line["message"] for line in json.loads(body)["lines"]]
    status, body = raw(standalone, "GET", "/v2/models/nope/logs")
    assert status == 404 and "nope" in json.loads(body)["error"]


async def test_model_logs_route_on_the_jupyter_server(jp_triton, jp_fetch):
    """The route is the 'logging' group's: the user's token reaches it, an inference key not."""
    from tornado.httpclient import HTTPClientError
    from conftest import INFER_KEY, TOKEN
    response = await jp_fetch("v2", "models", "linear", "logs",
                              headers={"Authorization": f"token {TOKEN}"})
    assert json.loads(response.body) == {"name": "linear", "version": "", "lines": []}
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("v2", "models", "linear", "logs",
                       headers={"Authorization": f"Bearer {INFER_KEY}"})
    assert err.value.code == 403
