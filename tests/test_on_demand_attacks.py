"""Issue 32's attacks on loading on demand and the residency budget, against real servers: a
standalone ``jupyter-triton serve`` in a subprocess (tests/hostile.py) set up as the issue's
operator did (explicit mode, ``--load-model`` of two models, ``--max-loaded-models 2``, the
repository API restricted to an admin header), and the Jupyter server with an inference key.

What each test asserts: an anonymous client loads and evicts nothing (Triton's 404 for a
model that is not loaded), names that are not models leave no state, label or metric behind
(statistics and /metrics keep their size, RSS stays bounded), ``--load-model`` still loads at
start within the budget, a model the operator opted in still loads on demand, one slow load
holds no other model's cold start, and the statistics show the lifecycle history (earlier
configs, golden-set differences) only to a caller who may load models. Every test checks that
the server is alive and a legitimate client is served.
"""
from __future__ import annotations

import base64
import http.client
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

from conftest import INFER_KEY, TOKEN, W, build_repository
from hostile import ServerProcess, assert_survived, legit_http_infer, start_standalone
from onnx_models import identity, linear
from ports import free_port

ADMIN = {"admin-key": "secret"}              # the header the repository API is restricted to
UNKNOWN_NAMES = 2000
NAME_BYTES = 8 * 1024
SIZE_SLACK = 2048                            # counters' digits may grow between two reads
RSS_BOUND_MIB = 32.0
WAIT_S = 60.0                                # bound of every wait on the server

ON_DEMAND = 'parameters { key: "load_on_demand" value: { string_value: "true" } }\n'
INT32_IO = ('input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 3 ] } ]\n'
            'output [ { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 3 ] } ]\n')
GATED_MODEL = '''
import os
import time

import triton_python_backend_utils as pb_utils

STARTED, GATE = {started!r}, {gate!r}


class TritonPythonModel:
    def initialize(self, args):
        open(STARTED, "w").close()
        # the test opens the gate (bounded: a test that failed does not leave a worker behind)
        deadline = time.monotonic() + 120
        while not os.path.exists(GATE) and time.monotonic() < deadline:
            time.sleep(0.02)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]) for r in requests]
'''


def int32_model(root: Path, name: str, opted_in: bool) -> None:
    identity(TensorProto.INT32, root / name / "1" / "model.onnx")
    (root / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: 8\n{INT32_IO}'
        + (ON_DEMAND if opted_in else ""))


def operator_repository(root: Path) -> Path:
    """linear and simple (the operator's, named with --load-model), identity_int32 and
    secret_unlisted (in the repository, never named, not opted in), on_demand (opted in by
    its config), gated (opted in, a python model whose load waits for the test) and quick
    (opted in)."""
    build_repository(root)
    int32_model(root, "secret_unlisted", opted_in=False)
    int32_model(root, "on_demand", opted_in=True)
    int32_model(root, "quick", opted_in=True)
    (root / "gated" / "1").mkdir(parents=True)
    (root / "gated" / "1" / "model.py").write_text(GATED_MODEL.format(
        started=str(root.parent / "gated.started"), gate=str(root.parent / "gated.gate")))
    (root / "gated" / "config.pbtxt").write_text(
        'name: "gated"\nbackend: "python"\nmax_batch_size: 4\n'
        'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 2 ] } ]\n'
        'output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 2 ] } ]\n' + ON_DEMAND)
    return root


@pytest.fixture(scope="module")
def operator_server(tmp_path_factory):
    root = operator_repository(tmp_path_factory.mktemp("on-demand") / "models")
    metrics_port = free_port()
    server = start_standalone(root, extra_args=(
        "--model-control-mode", "explicit", "--load-model", "linear", "--load-model", "simple",
        "--max-loaded-models", "2", "--allow-metrics", "true", "--metrics-port", str(metrics_port),
        "--http-restricted-api", "model-repository:admin-key=secret"))
    server.root, server.metrics_port = root, metrics_port
    yield server
    server.close()


def call(server: ServerProcess, method: str, path: str, body: dict | bytes | None = None,
         headers: dict | None = None, timeout: float = WAIT_S,
         conn: http.client.HTTPConnection | None = None) -> tuple[int, bytes]:
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        if own:
            conn.close()


def int32_infer(server: ServerProcess, name: str, **kwargs) -> tuple[int, bytes]:
    return call(server, "POST", f"/v2/models/{name}/infer", {"inputs": [
        {"name": "INPUT0", "shape": [1, 3], "datatype": "INT32", "data": [1, 2, 3]}]}, **kwargs)


def residency(server: ServerProcess) -> dict:
    status, body = call(server, "GET", "/v2/models/stats")
    assert status == 200, body
    return json.loads(body)["residency"]


def ready_models(server: ServerProcess) -> set[str]:
    status, body = call(server, "POST", "/v2/repository/index", {}, ADMIN)
    assert status == 200, body
    return {r["name"] for r in json.loads(body) if r.get("state") == "READY"}


def metrics_size(server: ServerProcess) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.metrics_port, timeout=WAIT_S)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        text = resp.read()
        assert resp.status == 200
        return len(text)
    finally:
        conn.close()


def stats_size(server: ServerProcess) -> int:
    status, body = call(server, "GET", "/v2/models/stats")
    assert status == 200
    return len(body)


def wait_for(condition, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not in {timeout} s: {what}"
        time.sleep(0.05)


def test_load_model_with_a_budget_loads_at_start(operator_server):
    """The issue: with a budget set, --load-model loaded nothing at start."""
    server = operator_server
    # simple was never asked for: it is READY because the operator named it
    assert {"linear", "simple"} <= ready_models(server)
    per_model = {m["name"]: m for m in residency(server)["models"]}
    assert per_model["simple"]["state"] == "RESIDENT" and per_model["simple"]["cold_starts"] == 0
    assert_survived(server, server.rss())


def test_an_anonymous_client_loads_and_evicts_nothing(operator_server):
    """The issue: an anonymous infer of a model the operator never named answered 200 after
    loading it; cycling three names evicted the operator's models."""
    server = operator_server
    before = residency(server)
    for _ in range(3):
        for name in ("secret_unlisted", "identity_int32", "no_such_model"):
            status, body = int32_infer(server, name)
            assert status == 404, (name, status, body)
            assert json.loads(body) == {"error": f"Request for unknown model: '{name}' is not found"}
    after = residency(server)
    assert (after["cold_starts"], after["evictions"]) == (before["cold_starts"], before["evictions"])
    assert {"secret_unlisted", "identity_int32", "no_such_model"}.isdisjoint(
        m["name"] for m in after["models"])
    assert {"secret_unlisted", "identity_int32"}.isdisjoint(ready_models(server))
    assert {"linear", "simple"} <= ready_models(server)
    # metadata and config answer as Triton's for a model that is not loaded
    for route in ("", "/config"):
        assert call(server, "GET", f"/v2/models/secret_unlisted{route}")[0] == 404
    # gRPC's ModelInfer takes the same lookup
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    inp = grpcclient.InferInput("INPUT0", [1, 3], "INT32")
    inp.set_data_from_numpy(np.array([[1, 2, 3]], np.int32))
    try:
        with pytest.raises(InferenceServerException) as err:
            client.infer("secret_unlisted", [inp])
        assert "NOT_FOUND" in str(err.value.status())
    finally:
        client.close()
    assert "secret_unlisted" not in ready_models(server)
    legit_http_infer(server)


def test_unknown_names_leave_no_state_label_or_metric(operator_server):
    """The issue: 5,000 404s with 8 KB names grew v2/models/stats to 40 MB, /metrics to
    120 MB and the server by 46 MB, for good."""
    server = operator_server
    legit_http_infer(server)
    sizes = stats_size(server), metrics_size(server)
    rss = server.rss()
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=WAIT_S)
    deadline = time.monotonic() + 120
    try:
        for i in range(UNKNOWN_NAMES):
            assert time.monotonic() < deadline, f"{i} requests in 120 s"
            name = f"{i:06d}".ljust(NAME_BYTES, "x")
            status, _ = int32_infer(server, name, conn=conn)
            assert status in (400, 404), status
    finally:
        conn.close()
    legit_http_infer(server)
    after = stats_size(server), metrics_size(server)
    assert after[0] <= sizes[0] + SIZE_SLACK and after[1] <= sizes[1] + SIZE_SLACK, (sizes, after)
    assert_survived(server, rss, max_growth=RSS_BOUND_MIB)


def test_an_opted_in_model_still_loads_on_demand(operator_server):
    server = operator_server
    status, body = int32_infer(server, "on_demand")
    assert status == 200, body
    assert json.loads(body)["outputs"][0]["data"] == [1, 2, 3]
    per_model = {m["name"]: m for m in residency(server)["models"]}
    assert per_model["on_demand"]["cold_starts"] >= 1
    # the operator's models were not opted in: an on-demand load never evicts them
    assert per_model["linear"]["evictions"] == per_model["simple"]["evictions"] == 0
    assert {"linear", "simple"} <= ready_models(server)
    legit_http_infer(server)


def test_a_slow_load_does_not_hold_another_models_cold_start(operator_server):
    """The issue: one slow load held every other cold start (up to 60 s, then 503)."""
    server = operator_server
    work = server.root.parent
    started, gate = work / "gated.started", work / "gated.gate"
    slow: dict = {}

    def ask_gated() -> None:
        slow["answer"] = call(server, "POST", "/v2/models/gated/infer", {"inputs": [
            {"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]},
            timeout=2 * WAIT_S)

    thread = threading.Thread(target=ask_gated)
    thread.start()
    try:
        wait_for(started.exists, "the gated model's load began")
        # gated is loading (and waits for the gate): quick's cold start goes on meanwhile
        status, body = int32_infer(server, "quick", timeout=30)
        assert status == 200, body
        assert not gate.exists() and "answer" not in slow
    finally:
        gate.touch()
        thread.join(2 * WAIT_S)
    assert not thread.is_alive()
    status, body = slow["answer"]
    assert status == 200, body
    assert json.loads(body)["outputs"][0]["data"] == [1.0, 2.0]
    legit_http_infer(server)


def test_statistics_show_the_history_only_to_who_may_load(operator_server):
    """The issue: statistics (reachable without the repository API's credential) carried
    earlier config text and golden-set differences."""
    from test_promotion import CONFIG, W as LIN_W, golden_json, lifecycle
    server = operator_server

    def load(files: dict[str, bytes]) -> tuple[int, bytes]:
        params = {"config": CONFIG, **{k: base64.b64encode(v).decode() for k, v in files.items()}}
        return call(server, "POST", "/v2/repository/models/lin/load", {"parameters": params}, ADMIN)

    assert load({"file:1/model.onnx": linear(LIN_W)})[0] == 200
    assert load({"file:1/model.onnx": linear(LIN_W + 1)})[0] == 200       # a load with a config before it
    status, refused = load({"file:1/model.onnx": linear(LIN_W * 3),
                            "file:lifecycle.json": lifecycle(golden=golden_json(LIN_W + 1))})
    assert status == 400 and b"max_abs_diff" in refused
    for path in ("/v2/models/lin/stats", "/v2/models/stats"):
        status, anonymous = call(server, "GET", path)
        assert status == 200
        assert "history" not in json.loads(anonymous)
        assert b"max_abs_diff" not in anonymous and b"TYPE_FP32" not in anonymous
    status, admin = call(server, "GET", "/v2/models/lin/stats", headers=ADMIN)
    history = json.loads(admin)["history"]
    assert [r["action"] for r in history] == ["load", "load", "refused"]
    assert "TYPE_FP32" in history[1]["previous_config"] and "max_abs_diff" in history[2]["reason"]
    legit_http_infer(server)


# -- the Jupyter server: an inference key ----------------------------------------------------
KEY = {"Authorization": f"Bearer {INFER_KEY}"}
JUPYTER = {"Authorization": f"token {TOKEN}"}


async def test_an_inference_key_reads_no_history_on_the_jupyter_server(jp_triton, jp_fetch):
    """On Jupyter's port, through the fast routes (a header credential) and tornado's
    handlers (a query string, or a login cookie, takes them)."""
    config = json.loads((await jp_fetch("v2/models/linear/config", headers=JUPYTER)).body)
    body = json.dumps({"parameters": {
        "config": json.dumps(config),
        "file:2/model.onnx": base64.b64encode(linear(W)).decode()}})
    await jp_fetch("v2/repository/models/linear/load", method="POST", body=body, headers=JUPYTER)

    async def stats(headers: dict, params: dict | None = None) -> dict:
        resp = await jp_fetch("v2/models/linear/stats", headers=headers, params=params or {})
        return json.loads(resp.body)

    for params in (None, {"via": "tornado"}):
        keyed = await stats(KEY, params)
        assert keyed["model_stats"] and "history" not in keyed
        full = await stats(JUPYTER, params)
        assert full["history"][-1]["previous_config"].startswith('name: "linear"')
    # a browser's login cookie (tornado's handlers, Jupyter's authorizer)
    resp = await jp_fetch("v2/models/linear/ready", headers={"Authorization": ""},
                          params={"token": TOKEN})
    cookie = "; ".join(h.split(";", 1)[0] for h in resp.headers.get_list("Set-Cookie"))
    assert "history" in await stats({"Authorization": "", "Cookie": cookie})
