"""Promotion with a golden set and rollback (engine/lifecycle/promotion.py, repository/history.py):
a new version is served only once it answers the golden cases; a rollback brings back the
version and config that served before, in one swap. Through real servers: the notebook API
(kernel side, protocol only), tritonclient HTTP and gRPC (the repository API's load with
``file:lifecycle.json``), and the Jupyter server."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import jupyter_triton as jt
from conftest import TOKEN, in_thread, serve
from jupyter_triton.engine import EngineOptions
from jupyter_triton.kernel import discovery
from jupyter_triton.kernel.golden import PromotionRefused
from jupyter_triton.standalone import start_in_thread
from onnx_models import linear

AUTH = {"Authorization": f"token {TOKEN}"}
X = np.arange(12, dtype=np.float32).reshape(3, 4)
GOLDEN = [(X, X * 2), ({"x": X[:1]}, X[:1] * 2)]


def double(x):
    return x * 2


def triple(x):
    return x * 3


def twice(x):                 # the same answers as double, another version
    return x + x


@pytest.fixture
def kernel_server(tmp_path: Path, monkeypatch):
    """A standalone server that this process's notebook API talks to (as a kernel would)."""
    server, client = serve(tmp_path / "models", model_control_mode="explicit")
    monkeypatch.setenv(discovery.ENV_URL, server.url)
    monkeypatch.setenv(discovery.ENV_TOKEN, "")
    discovery.reset()
    yield server, client, tmp_path / "models"
    discovery.reset()
    server.close()


def served_version(client: httpclient.InferenceServerClient, name: str) -> str:
    inp = httpclient.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(X[:1])
    return client.infer(name, [inp]).get_response()["model_version"]


def test_a_refused_promotion_keeps_the_old_version_and_a_rollback_loses_no_request(kernel_server):
    server, client, repo = kernel_server
    v1 = jt.serve(double, "scale", example=X)
    with pytest.raises(PromotionRefused) as refused:
        jt.serve(triple, "scale", example=X, golden=GOLDEN)
    result = refused.value.result
    assert not result.promoted and result.version == 2 and result.cases == 2
    # per case: which output, how many values, by how much
    assert [c["case"] for c in result.failed] == [0, 1]
    first = result.failed[0]["outputs"][0]
    assert first["output"] and first["mismatched"] == 11 and first["max_abs_diff"] == 11.0
    assert "NOT promoted" in result.summary()
    # the old version keeps serving, with the old answers
    assert served_version(client, "scale") == str(v1.version)
    np.testing.assert_array_equal(jt.model("scale").infer(X), X * 2)
    # the refused version is set aside, never deleted, and the index says why
    rows = [r for r in client.get_model_repository_index() if r["name"] == "scale"]
    assert any(r["state"] == "UNAVAILABLE" and "golden" in r.get("reason", "") for r in rows)
    assert list((repo / ".failed" / "scale").iterdir())

    promoted = jt.serve(twice, "scale", example=X, golden=GOLDEN)
    assert promoted.version > v1.version
    assert served_version(client, "scale") == str(promoted.version)

    # rollback under a bounded client loop: every request answered, by one version or the other
    seen: list[str] = []
    failures: list[str] = []
    stop = threading.Event()

    def loop() -> None:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        inp = httpclient.InferInput("x", [3, 4], "FP32")
        inp.set_data_from_numpy(X)
        deadline = time.monotonic() + 60
        try:
            for _ in range(5000):
                if stop.is_set() or time.monotonic() > deadline:
                    break
                try:
                    result = c.infer("scale", [inp])
                    assert np.array_equal(result.as_numpy(result.get_response()["outputs"][0]["name"]), X * 2)
                    seen.append(result.get_response()["model_version"])
                except Exception as err:    # noqa: BLE001 - counted, then asserted empty
                    failures.append(str(err))
        finally:
            c.close()
    thread = threading.Thread(target=loop)
    thread.start()
    while len(seen) < 20 and thread.is_alive():
        time.sleep(0.01)
    back = jt.rollback("scale")
    after = len(seen)
    deadline = time.monotonic() + 10
    while len(seen) < after + 20 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    thread.join(timeout=60)
    assert failures == []
    assert back.version == v1.version
    assert seen[0] == str(promoted.version) and seen[-1] == str(v1.version)
    assert set(seen) == {str(promoted.version), str(v1.version)}
    # the previous config is back, pinned to the version: the replaced one kept in .history
    config = (repo / "scale" / "config.pbtxt").read_text()
    assert f"versions: {v1.version}" in config
    assert list((repo / "scale" / ".history").glob("config.*.pbtxt"))
    assert (repo / "scale" / str(promoted.version)).is_dir()          # nothing deleted

    history = jt.history("scale")
    assert [r["action"] for r in history] == ["load", "refused", "promote", "rollback"]
    assert history[2]["previous"] == v1.version and history[3]["previous"] == promoted.version

    # the handle's promote brings the rolled-back version back once it passes again
    outcome = back.promote(promoted.version, golden=GOLDEN)
    assert outcome.promoted and served_version(client, "scale") == str(promoted.version)
    bad = back.promote(v1.version, golden=[(X, X * 5)])
    assert not bad.promoted and bad.failed and served_version(client, "scale") == str(promoted.version)


CONFIG = json.dumps({"name": "lin", "backend": "onnxruntime", "max_batch_size": 8,
                     "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
                     "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [2]}]})
W = np.arange(8, dtype=np.float32).reshape(4, 2)


def lifecycle(**keys) -> bytes:
    return json.dumps(keys).encode()


def golden_json(w: np.ndarray) -> list[dict]:
    x = np.ones((2, 4), np.float32)
    return [{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2, 4], "data": x.ravel().tolist()}],
             "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [2, 2],
                          "data": (x @ w).ravel().tolist()}]}]


def repository_api_story(load, unload_config_check, infer_version) -> None:
    """The same story over any client: load v1, refuse a wrong v2, promote a right one,
    roll back."""
    load(files={"file:1/model.onnx": linear(W)})
    with pytest.raises(InferenceServerException) as refused:
        load(files={"file:1/model.onnx": linear(W * 3),
                    "file:lifecycle.json": lifecycle(golden=golden_json(W))})
    assert "refused" in refused.value.message() and "max_abs_diff" in refused.value.message()
    assert infer_version() == "1"
    load(files={"file:1/model.onnx": linear(W + 1e-7),
                "file:lifecycle.json": lifecycle(golden=golden_json(W), atol=1e-4)})
    # a refused version is set aside and keeps its number: the next upload is version 3
    assert infer_version() == "3"
    load(files={"file:lifecycle.json": lifecycle(rollback=True)})
    assert infer_version() == "1"
    with pytest.raises(InferenceServerException, match="rollback"):
        load(files={"file:lifecycle.json": lifecycle(rollback=True, golden=[])})
    with pytest.raises(InferenceServerException, match="golden"):
        load(files={"file:1/model.onnx": linear(W), "file:lifecycle.json": lifecycle(golden="nope")})
    assert infer_version() == "1"


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_promotion_and_rollback_through_the_repository_api(tmp_path: Path, transport: str):
    server = start_in_thread(EngineOptions(model_repository=tmp_path / "models",
                                           model_control_mode="explicit"),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    try:
        if transport == "http":
            client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
            inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        else:
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
            inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(np.ones((1, 4), np.float32))

        def infer_version() -> str:
            response = client.infer("lin", [inp]).get_response()
            return response["model_version"] if isinstance(response, dict) else response.model_version
        repository_api_story(lambda files: client.load_model("lin", config=CONFIG, files=files)
                             if any(k.startswith("file:1/") for k in files)
                             else client.load_model("lin", files=files), None, infer_version)
        stats = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}") \
            .get_inference_statistics("lin")
        assert [r["action"] for r in stats["history"]] == ["load", "refused", "promote", "rollback"]
        assert sorted(p.name for p in (tmp_path / "models" / "lin").iterdir() if p.name.isdigit()) \
            == ["1", "3"]
    finally:
        server.close()


async def test_promotion_and_rollback_on_the_jupyter_server(jp_triton, jp_http_port, jp_base_url):
    base = f"127.0.0.1:{jp_http_port}{jp_base_url.rstrip('/')}"

    def story() -> list[str]:
        client = httpclient.InferenceServerClient(base, network_timeout=60)
        inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(np.ones((1, 4), np.float32))
        try:
            repository_api_story(
                lambda files: client.load_model("lin", config=CONFIG if any(
                    k.startswith("file:1/") for k in files) else None, files=files,
                    headers=dict(AUTH)),
                None, lambda: client.infer("lin", [inp], headers=dict(AUTH)).get_response()["model_version"])
            return [r["action"] for r in
                    client.get_inference_statistics("lin", headers=dict(AUTH))["history"]]
        finally:
            client.close()
    assert await in_thread(story) == ["load", "refused", "promote", "rollback"]


def test_a_refused_first_upload_leaves_no_model_behind(tmp_path: Path):
    server, client = serve(tmp_path / "models", model_control_mode="explicit")
    try:
        with pytest.raises(InferenceServerException, match="refused"):
            client.load_model("lin", config=CONFIG, files={
                "file:1/model.onnx": linear(W * 3), "file:lifecycle.json": lifecycle(golden=golden_json(W))})
        assert not (tmp_path / "models" / "lin").exists()      # Triton would see an empty model
        [row] = client.get_model_repository_index()
        assert row["state"] == "UNAVAILABLE" and "golden" in row["reason"]
        assert list((tmp_path / "models" / ".failed" / "lin").iterdir())
    finally:
        server.close()


def test_a_canary_takes_its_fraction_then_is_promoted_or_stopped(kernel_server):
    server, client, repo = kernel_server
    v1 = jt.serve(double, "scale", example=X)
    canary = jt.serve(twice, "scale", example=X, canary=0.5)
    assert canary.version == v1.version + 1
    # while it runs, other loads of the model are refused, naming the way out
    with pytest.raises(Exception, match="canary running"):
        jt.serve(triple, "scale", example=X)
    with pytest.raises(Exception, match="canary running"):
        jt.rollback("scale")
    seen = [served_version(client, "scale") for _ in range(200)]
    counts = {v: seen.count(v) for v in set(seen)}
    assert set(counts) == {str(v1.version), str(canary.version)}
    assert min(counts.values()) > 40        # binomial(200, 0.5): below 41 has p < 1e-11
    # each version's own statistics, side by side
    rows = {r["version"]: r for r in client.get_inference_statistics("scale")["model_stats"]}
    assert {v: rows[v]["inference_count"] for v in rows} == counts
    # the canary is promoted once it passes the golden set: every request goes to it
    assert canary.promote(canary.version, golden=GOLDEN).promoted
    assert {served_version(client, "scale") for _ in range(20)} == {str(canary.version)}

    third = jt.serve(triple, "scale", example=X, canary=0.25)
    third.stop_canary()
    assert {served_version(client, "scale") for _ in range(20)} == {str(canary.version)}
    rows = [r for r in client.get_model_repository_index()
            if r["name"] == "scale" and r.get("version") == str(third.version)]
    assert rows and rows[0]["state"] == "UNAVAILABLE" and "canary stopped" in rows[0]["reason"]
    assert [r["action"] for r in jt.history("scale")] == \
        ["load", "canary", "promote", "canary", "canary stopped"]


def test_a_canary_is_not_served_after_a_restart(tmp_path: Path):
    repo = tmp_path / "models"
    server, client = serve(repo, model_control_mode="explicit")
    try:
        client.load_model("lin", config=CONFIG, files={"file:1/model.onnx": linear(W)})
        client.load_model("lin", config=CONFIG, files={"file:1/model.onnx": linear(W * 2),
                                                       "file:lifecycle.json": lifecycle(canary=1.0)})
        inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(np.ones((1, 4), np.float32))
        assert client.infer("lin", [inp]).get_response()["model_version"] == "2"    # fraction 1
        with pytest.raises(InferenceServerException, match="canary"):
            client.load_model("lin", files={"file:lifecycle.json": lifecycle(canary=2)})
    finally:
        server.close()
    # never committed: the next start sets it aside and serves version 1
    server, client = serve(repo, model_control_mode="explicit", load_models=["*"])
    try:
        assert client.infer("lin", [inp]).get_response()["model_version"] == "1"
        assert not (repo / "lin" / "2").exists() and list((repo / ".failed" / "lin").iterdir())
    finally:
        server.close()


def test_lifecycle_keys_reach_the_engine_as_plain_load_parameters(tmp_path: Path):
    """Besides file:lifecycle.json, a load's own parameters carry the lifecycle keys (a raw v2
    client can send them): a malformed golden set is refused by name over HTTP and gRPC."""
    import http.client
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    import grpc

    server = start_in_thread(EngineOptions(model_repository=tmp_path / "models",
                                           model_control_mode="explicit"),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
        conn.request("POST", "/v2/repository/models/lin/load",
                     json.dumps({"parameters": {"config": CONFIG, "golden": "not json"}}),
                     {"Content-Type": "application/json"})
        reply = conn.getresponse()
        body = json.loads(reply.read())
        conn.close()
        assert reply.status == 400 and "load parameter 'golden' is not JSON" in body["error"]
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            request = service_pb2.RepositoryModelLoadRequest(model_name="lin")
            request.parameters["config"].string_param = CONFIG
            request.parameters["golden"].string_param = "not json"
            with pytest.raises(grpc.RpcError) as refused:
                stub.RepositoryModelLoad(request, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "load parameter 'golden' is not JSON" in refused.value.details()
    finally:
        server.close()
