"""Traffic capture (issue 37, item 1) through a real server: a model's requests over HTTP and
gRPC land in one bounded sample, read back as a DataFrame (``handle.traffic()``) or over
``GET v2/models/{m}/traffic``; only a caller who may load models reads or steers it."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tornado.httpclient import HTTPClientError

from conftest import INFER_KEY, TOKEN, W
from onnx_models import identity
from jupyter_triton.engine import EngineOptions
from jupyter_triton.frontends.admission import AccessPolicy, Restriction
from jupyter_triton.kernel import api
from jupyter_triton.kernel.discovery import Connection
from jupyter_triton.kernel.handle import ServedModel
from jupyter_triton.protocol.errors import InvalidArgument, NotFound, PermissionDenied
from jupyter_triton.standalone import start_in_thread

pd = pytest.importorskip("pandas")

SECRET = "s3cret"
# the model-repository group (load, unload, traffic) needs this header, as with
# `--http-restricted-api model-repository:authorization=token s3cret`; inference is open
RESTRICTED = [Restriction.parse(f"model-repository:authorization=token {SECRET}")]
ADMIN = {"Authorization": f"token {SECRET}"}


@pytest.fixture
def server(model_repo: Path):
    from onnx import TensorProto
    identity(TensorProto.STRING, model_repo / "identity_bytes" / "1" / "model.onnx", dims=2)
    server = start_in_thread(EngineOptions(model_repository=model_repo, model_control_mode="explicit",
                                           load_models=["*"]),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0,
                             access=AccessPolicy.open(RESTRICTED),
                             grpc_access=AccessPolicy.open(RESTRICTED))
    yield server
    server.close()


@pytest.fixture
def linear(server) -> ServedModel:
    return ServedModel("linear", 1, Connection(server.url, token=SECRET))


def rows(n: int, start: float = 0.0) -> np.ndarray:
    return (np.arange(n * 16, dtype=np.float32).reshape(n, 16) + start) / 100


def http_infer(server, x: np.ndarray, request_id: str, version: str = "") -> np.ndarray:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    try:
        inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return client.infer("linear", [inp], request_id=request_id,
                            model_version=version).as_numpy("OUTPUT0")
    finally:
        client.close()


def grpc_infer(server, x: np.ndarray, request_id: str) -> np.ndarray:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return client.infer("linear", [inp], request_id=request_id).as_numpy("OUTPUT0")
    finally:
        client.close()


def route(server, method: str, model: str = "linear", body: object = None,
          headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON) of ``{method} v2/models/{model}/traffic`` with the admin header."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(f"{server.url}/v2/models/{model}/traffic", data=data,
                                     method=method, headers=ADMIN if headers is None else headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_off_by_default_then_http_and_grpc_requests_land_in_one_dataframe(server, linear):
    x = rows(1)
    http_infer(server, x, "before")
    assert route(server, "GET") == (200, {"model_name": "linear", "capture": None, "requests": []})
    assert not server.engine.traffic.active

    state = linear.capture(fraction=1.0, max_rows=100)
    assert state == {"enabled": True, "fraction": 1.0, "max_rows": 100, "max_bytes": 16 << 20,
                     "requests_seen": 0, "requests_captured": 0, "requests_dropped": 0,
                     "rows": 0, "bytes": 0}
    two = rows(2, start=7)
    np.testing.assert_allclose(http_infer(server, x, "h1"), x @ W, rtol=1e-5)
    np.testing.assert_allclose(grpc_infer(server, two, "g1"), two @ W, rtol=1e-5)
    with pytest.raises(Exception, match="is not found"):
        http_infer(server, x, "h2", version="7")            # the engine's 404, captured too

    frame = linear.traffic()
    assert list(frame.columns) == ["time", "model_version", "id", "trace_id", "latency_ms",
                                   "status", "error", "inputs", "outputs"]
    assert frame["id"].tolist() == ["h1", "g1", "h2"]
    assert frame["status"].tolist() == [200, 200, 404]
    assert frame["model_version"].tolist() == ["1", "1", "7"]
    assert "is not found" in frame["error"][2] and frame["error"][0] == ""
    np.testing.assert_array_equal(frame["inputs"][0]["INPUT0"], x)
    np.testing.assert_array_equal(frame["inputs"][1]["INPUT0"], two)
    np.testing.assert_allclose(frame["outputs"][0]["OUTPUT0"], x @ W, rtol=1e-5)
    np.testing.assert_allclose(frame["outputs"][1]["OUTPUT0"], two @ W, rtol=1e-5)
    assert frame["outputs"][2] == {}
    assert (frame["latency_ms"] > 0).all()
    assert frame["time"].is_monotonic_increasing and str(frame["time"].dt.tz) == "UTC"
    assert linear.traffic(n=1)["id"].tolist() == ["h2"]
    assert linear.traffic(n=0).empty and linear.traffic(n=10)["id"].tolist() == ["h1", "g1", "h2"]
    # the module-level API is the same call
    api_connection = api.connection
    try:
        api.connection = lambda refresh=False: linear.connection
        assert api.traffic("linear")["id"].tolist() == ["h1", "g1", "h2"]
        assert api.capture("linear", capture=False)["enabled"] is False
    finally:
        api.connection = api_connection


def test_bounded_by_rows_and_by_bytes(server, linear):
    linear.capture(max_rows=2)
    for i in range(5):
        http_infer(server, rows(1, i), f"r{i}")
    frame = linear.traffic()
    assert frame["id"].tolist() == ["r3", "r4"]                 # the newest
    status, doc = route(server, "GET")
    assert doc["capture"]["requests_dropped"] == 3 and doc["capture"]["rows"] == 2

    # what one row holds, as the server counts it (its figures and strings, 64 bytes in, 16 out)
    linear.capture(max_rows=1000)
    http_infer(server, rows(1, 0), "one")
    one = route(server, "GET")[1]["capture"]["bytes"]
    assert 64 + 16 < one < 512
    linear.capture(max_rows=1000, max_bytes=2 * one + one // 2)
    for i in range(6):
        http_infer(server, rows(1, i), f"b{i}")
    _, doc = route(server, "GET")
    assert doc["capture"]["rows"] == 2 and doc["capture"]["bytes"] <= 2 * one + one // 2
    assert [r["id"] for r in doc["requests"]] == ["b4", "b5"]

    # one request whose tensors alone are past the bound: kept without them
    linear.capture(max_bytes=300)
    http_infer(server, rows(8), "big")          # 512 bytes in, 128 out
    frame = linear.traffic()
    assert frame["id"].tolist() == ["big"] and frame["inputs"][0] == {}
    assert "tensors not kept" in frame["error"][0]


def test_fraction_samples_and_capture_false_stops(server, linear):
    linear.capture(fraction=1e-12)
    for i in range(10):
        http_infer(server, rows(1, i), f"f{i}")
    _, doc = route(server, "GET")
    assert doc["capture"]["requests_seen"] == 10 and doc["requests"] == []

    linear.capture()
    http_infer(server, rows(1), "kept")
    assert linear.capture(capture=False)["enabled"] is False
    assert not server.engine.traffic.active                     # the data path is free again
    http_infer(server, rows(1), "after")
    grpc_infer(server, rows(1), "after-grpc")
    assert linear.traffic()["id"].tolist() == ["kept"]          # still readable
    assert linear.capture(capture=False, clear=True) is None
    assert route(server, "GET")[1]["requests"] == [] and not server.engine.traffic.samples


def test_tensors_round_trip_with_their_types(server):
    ints = ServedModel("identity_int32", 1, Connection(server.url, token=SECRET))
    ints.capture()
    x = np.array([[3, -4, 2 ** 31 - 1]], dtype=np.int32)
    np.testing.assert_array_equal(ints.infer(x), x)
    (row,) = ints.traffic().itertuples()
    np.testing.assert_array_equal(row.inputs["INPUT0"], x)
    assert row.inputs["INPUT0"].dtype == np.int32

    texts = ServedModel("identity_bytes", 1, Connection(server.url, token=SECRET))
    texts.capture()
    words = np.array([["héllo".encode(), b"w\x00rld"]], dtype=object)
    raw = np.array([[b"\xff\xfe", b"ok"]], dtype=object)        # not UTF-8: onnxruntime refuses
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    for x in (words, raw):
        inp = httpclient.InferInput("INPUT0", [1, 2], "BYTES")
        inp.set_data_from_numpy(x)
        try:
            client.infer("identity_bytes", [inp])
        except Exception as err:
            assert "UTF-8" in str(err) and x is raw
    client.close()
    first, second = texts.traffic().itertuples()
    assert first.inputs["INPUT0"].tolist() == words.tolist()
    assert first.outputs["OUTPUT0"].tolist() == words.tolist()
    assert second.status == 400 and second.inputs["INPUT0"].tolist() == raw.tolist()


@pytest.mark.parametrize("body, words", [
    ({"fraction": 0}, "'fraction' must be a number in (0, 1]"),
    ({"fraction": -1}, "'fraction'"),
    ({"fraction": 1.5}, "'fraction'"),
    ({"fraction": "1"}, "'fraction'"),
    ({"fraction": True}, "'fraction'"),
    (b'{"fraction": NaN}', "'fraction'"),
    (b'{"fraction": 1e999}', "'fraction'"),
    ({"max_rows": 0}, "'max_rows' must be an integer from 1 to 1000000"),
    ({"max_rows": 10 ** 30}, "'max_rows'"),
    ({"max_rows": 1.5}, "'max_rows'"),
    ({"max_rows": "10"}, "'max_rows'"),
    ({"max_rows": True}, "'max_rows'"),
    ({"max_bytes": 1 << 40}, "'max_bytes' must be an integer from 1 to 1073741824"),
    ({"max_bytes": -1}, "'max_bytes'"),
    ({"capture": "yes"}, "'capture' must be a boolean"),
    ({"clear": 1, "capture": False}, "'clear' must be a boolean"),
    ({"clear": True}, "'clear' goes with"),
    ({"fractoin": 0.5}, "unknown key(s) ['fractoin']"),
    ([1, 2], "must be a JSON object"),
    (b"{not json", "failed to parse"),
])
def test_bad_control_bodies_are_400_and_start_nothing(server, body, words):
    status, doc = route(server, "POST", body=body)
    assert status == 400 and words in doc["error"], doc
    assert not server.engine.traffic.active and not server.engine.traffic.samples


def test_the_handle_refuses_as_the_server_does(server, linear):
    with pytest.raises(InvalidArgument, match="'max_rows'"):
        linear.capture(max_rows=10 ** 9)
    with pytest.raises(InvalidArgument, match="traffic\\(n=...\\)"):
        linear.traffic(n=-1)
    assert not server.engine.traffic.samples


@pytest.mark.parametrize("name", ["nope", "..", "linear%2Fx", "a" * 300])
def test_an_unknown_model_is_404_and_leaves_no_state(server, name):
    for method, body in (("POST", {}), ("GET", None)):
        status, doc = route(server, method, model=name, body=body)
        assert status in (400, 404), doc
    assert not server.engine.traffic.active and not server.engine.traffic.samples
    with pytest.raises((NotFound, InvalidArgument)):
        ServedModel(name, 1, Connection(server.url, token=SECRET)).capture()
    assert not server.engine.traffic.samples


def test_only_the_model_repository_scope_reads_or_steers(server, linear):
    linear.capture()
    http_infer(server, rows(1), "secret-row")
    for method, body in (("GET", None), ("POST", {"capture": False})):
        status, doc = route(server, method, body=body, headers={})
        assert status == 403 and "restricted" in doc["error"], doc
    bare = ServedModel("linear", 1, Connection(server.url))
    with pytest.raises(PermissionDenied):
        bare.traffic()
    assert server.engine.traffic.active                         # nothing was changed


async def test_an_inference_key_cannot_read_traffic_on_jupyter(jp_triton, jp_fetch):
    key, token = {"Authorization": f"Bearer {INFER_KEY}"}, {"Authorization": f"token {TOKEN}"}
    started = await jp_fetch("v2", "models", "linear", "traffic", method="POST",
                             body=json.dumps({"max_rows": 5}), headers=token)
    assert json.loads(started.body)["capture"]["max_rows"] == 5
    request = {"id": "by-key", "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
                                           "data": [1.0] * 16}]}
    await jp_fetch("v2", "models", "linear", "infer", method="POST", body=json.dumps(request),
                   headers=key)
    for method, body in (("GET", None), ("POST", json.dumps({"capture": False}))):
        with pytest.raises(HTTPClientError) as err:
            await jp_fetch("v2", "models", "linear", "traffic", method=method, body=body,
                           headers=key)
        assert err.value.code == 403
    read = json.loads((await jp_fetch("v2", "models", "linear", "traffic", headers=token)).body)
    assert [r["id"] for r in read["requests"]] == ["by-key"] and read["capture"]["enabled"]
