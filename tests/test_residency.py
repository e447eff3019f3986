"""Lifecycle as a control: within a memory budget a request loads the model it asks for (the
operator opted in: --load-on-demand) and the least recently used idle models are evicted
(engine/lifecycle/residency.py). The stories run
through real servers (standalone and Jupyter) with tritonclient, as an operator would see
them: the answers, the repository index, the statistics and the Prometheus metrics."""
from __future__ import annotations

import http.client

import json
import random
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import TOKEN, in_thread, serve
from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread
from onnx_models import linear

N_MODELS = 20
ROWS, COLS = 128, 256            # weights of 128 KiB: what the budget counts
SWEEP = 2000
THREADS = 4
AUTH = {"Authorization": f"token {TOKEN}"}


def fleet(root: Path, n: int = N_MODELS, pinned: tuple[str, ...] = ()) -> int:
    """``n`` ONNX models m0..m<n-1>; m<i> answers i + 1 in every output element for an
    input of ones. Returns the size of one model's file (its weights)."""
    for i in range(n):
        linear(np.full((ROWS, COLS), (i + 1) / ROWS, np.float32), root / f"m{i}" / "1" / "model.onnx")
        extra = ('parameters { key: "residency" value: { string_value: "pinned" } }\n'
                 if f"m{i}" in pinned else "")
        (root / f"m{i}" / "config.pbtxt").write_text(
            f'name: "m{i}"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
            f'input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ {ROWS} ] }} ]\n'
            f'output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ {COLS} ] }} ]\n{extra}')
    return (root / "m0" / "1" / "model.onnx").stat().st_size


def budget_for(models: int, model_bytes: int) -> int:
    return models * model_bytes + model_bytes // 2        # fits ``models``, not one more


def ones() -> httpclient.InferInput:
    inp = httpclient.InferInput("INPUT0", [1, ROWS], "FP32")
    inp.set_data_from_numpy(np.ones((1, ROWS), np.float32))
    return inp


def sweep(make_client, order: list[int], headers: dict | None = None) -> dict:
    """``order`` requests from THREADS clients; each first asks whether its model is ready
    (not ready: the request is a cold start). Returns latencies and failures."""
    results: dict[str, list] = {"cold": [], "warm": [], "failures": []}
    lock = threading.Lock()

    def client_loop(part: list[int]) -> None:
        client = make_client()
        inp = ones()
        try:
            for i in part:
                name = f"m{i}"
                try:
                    cold = not client.is_model_ready(name, headers=headers)
                    start = time.perf_counter()
                    out = client.infer(name, [inp], headers=headers).as_numpy("OUTPUT0")
                    took = time.perf_counter() - start
                    if out.shape != (1, COLS) or not np.allclose(out, i + 1, rtol=1e-5):
                        raise AssertionError(f"{name} answered {out[0, :3]}, expected {i + 1}")
                    with lock:
                        results["cold" if cold else "warm"].append(took)
                except Exception as err:       # noqa: BLE001 - every failure is reported
                    with lock:
                        results["failures"].append(f"{name}: {err}")
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop, args=(order[t::THREADS],)) for t in range(THREADS)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    results["seconds"] = time.monotonic() - started
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    return results


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def metric(text: str, family: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(family + "{") or line.startswith(family + " "))


def check_sweep(results: dict, residency: dict, budget: int, requests: int) -> None:
    assert results["failures"] == [], results["failures"][:5]
    assert len(results["cold"]) + len(results["warm"]) == requests
    largest = residency["largest_model_bytes"]
    assert largest >= max(m["size_bytes"] for m in residency["models"])
    # loads happen before evictions: at most one model more than the budget holds
    assert residency["peak_resident_bytes"] <= budget + largest
    assert residency["resident_bytes"] <= budget
    # each cold start is a model loaded: evicted since, or resident now
    assert residency["cold_starts"] == residency["evictions"] + residency["resident_models"]
    assert residency["cold_starts"] >= N_MODELS
    assert residency["cold_starts"] == sum(m["cold_starts"] for m in residency["models"])
    print(f"\nsweep: {requests} requests in {results['seconds']:.1f} s, "
          f"{residency['cold_starts']} cold starts, {residency['evictions']} evictions; "
          f"cold p50 {percentile(results['cold'], 50):.1f} ms p99 {percentile(results['cold'], 99):.1f} ms "
          f"(n={len(results['cold'])}); warm p50 {percentile(results['warm'], 50):.1f} ms "
          f"p99 {percentile(results['warm'], 99):.1f} ms (n={len(results['warm'])}); "
          f"peak resident {residency['peak_resident_bytes']} B vs budget {budget} B "
          f"(largest model {largest} B)")


def test_a_sweep_over_twenty_models_within_a_budget_of_three(tmp_path: Path):
    root = tmp_path / "models"
    budget = budget_for(3, fleet(root))
    server = start_in_thread(EngineOptions(model_repository=root, model_control_mode="explicit",
                                           load_on_demand=True, model_residency_bytes=budget),
                             host="127.0.0.1", http_port=0, metrics_port=0, grpc_port=None)
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        # nothing loads at start: every model waits for its first request
        assert client.get_model_repository_index() == [{"name": f"m{i}"} for i in
                                                       sorted(range(N_MODELS), key=str)]
        rng = random.Random(19)
        order = [rng.randrange(N_MODELS) for _ in range(SWEEP)]
        results = sweep(lambda: httpclient.InferenceServerClient(
            f"127.0.0.1:{server.http_port}", network_timeout=120), order)
        residency = client.get_inference_statistics()["residency"]
        check_sweep(results, residency, budget, SWEEP)
        assert residency["budget_bytes"] == budget and residency["resident_models"] <= 3
        # the index: what is resident is READY, what was evicted says so
        index = {r["name"]: r for r in client.get_model_repository_index()}
        resident = {m["name"] for m in residency["models"] if m["state"] == "RESIDENT"}
        for name, row in index.items():
            if name in resident:
                assert row["state"] == "READY"
            else:
                assert (row["state"], row["reason"]) == ("UNAVAILABLE", "evicted: residency budget")
        # the same counts as Prometheus metrics
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as resp:
            text = resp.read().decode()
        assert metric(text, "nv_model_cold_starts_total") == residency["cold_starts"]
        assert metric(text, "nv_model_evictions_total") == residency["evictions"]
        assert metric(text, "nv_model_resident") == residency["resident_models"]
        assert metric(text, "nv_model_residency_budget_bytes") == budget
        assert 0 < metric(text, "nv_model_resident_bytes") <= budget
    finally:
        server.close()


def test_concurrent_requests_for_an_evicted_model_load_it_once(tmp_path: Path):
    root = tmp_path / "models"
    fleet(root, n=3)
    server, client = serve(root, model_control_mode="explicit", load_models=["*"],
                           load_on_demand=True, max_loaded_models=1)
    try:
        assert client.infer("m1", [ones()]).as_numpy("OUTPUT0")[0, 0] == 2
        answers: list = []

        def ask() -> None:
            c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=60)
            try:
                answers.append(float(c.infer("m0", [ones()]).as_numpy("OUTPUT0")[0, 0]))
            except InferenceServerException as err:
                answers.append(str(err))
            finally:
                c.close()
        threads = [threading.Thread(target=ask) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert answers == [1.0] * 8
        residency = client.get_inference_statistics()["residency"]
        per_model = {m["name"]: m for m in residency["models"]}
        assert per_model["m0"]["cold_starts"] == 1          # eight requests, one load
        assert (per_model["m1"]["state"], per_model["m1"]["evictions"]) == ("EVICTED", 1)
        assert residency["resident_models"] == 1
    finally:
        server.close()


def test_a_pinned_model_stays_and_an_unloaded_one_stays_unloaded(tmp_path: Path):
    root = tmp_path / "models"
    model_bytes = fleet(root, n=4, pinned=("m3",))
    server, client = serve(root, model_control_mode="explicit", load_models=["*"],
                           load_on_demand=True, model_residency_bytes=budget_for(1, model_bytes))
    try:
        # the pinned model loads at start, first; the others do not fit beside it: on demand
        assert [r["name"] for r in client.get_model_repository_index() if r.get("state") == "READY"] == ["m3"]
        for i in (0, 1, 2, 0, 1):
            assert client.infer(f"m{i}", [ones()]).as_numpy("OUTPUT0")[0, 0] == i + 1
        per_model = {m["name"]: m for m in client.get_inference_statistics()["residency"]["models"]}
        assert per_model["m3"]["state"] == "RESIDENT" and per_model["m3"]["pinned"]
        assert per_model["m3"]["evictions"] == 0 and per_model["m3"]["cold_starts"] == 0
        assert per_model["m0"]["cold_starts"] == 2 and per_model["m2"]["state"] == "EVICTED"
        # an evicted model still answers what a client asks before its first request
        assert not client.is_model_ready("m2")
        assert client.get_model_metadata("m2")["versions"] == ["1"]
        assert client.get_model_config("m2")["input"][0]["dims"] == [ROWS]
        assert client.infer("m2", [ones()]).as_numpy("OUTPUT0")[0, 0] == 3
        # an operator's unload is not undone by the next request
        client.unload_model("m1")
        with pytest.raises(InferenceServerException, match="m1"):
            client.infer("m1", [ones()])
        client.load_model("m1")
        assert client.infer("m1", [ones()]).as_numpy("OUTPUT0")[0, 0] == 2
    finally:
        server.close()


SLOW_MODEL = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        time.sleep(3)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]) for r in requests]
'''


def test_a_load_slower_than_the_wait_answers_503_then_serves(tmp_path: Path):
    root = tmp_path / "models"
    (root / "slow" / "1").mkdir(parents=True)
    (root / "slow" / "1" / "model.py").write_text(SLOW_MODEL)
    (root / "slow" / "config.pbtxt").write_text(
        'name: "slow"\nbackend: "python"\nmax_batch_size: 4\n'
        'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 2 ] } ]\n'
        'output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 2 ] } ]\n')
    server, client = serve(root, model_control_mode="explicit", load_on_demand=True, max_loaded_models=2)
    server.engine.on_demand_wait_secs = 0.5
    try:
        inp = httpclient.InferInput("INPUT0", [1, 2], "FP32")
        inp.set_data_from_numpy(np.ones((1, 2), np.float32))
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
        conn.request("POST", "/v2/models/slow/infer", json.dumps({"inputs": [
            {"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 1]}]}),
            {"Content-Type": "application/json"})
        refused = conn.getresponse()
        body = json.loads(refused.read())
        conn.close()
        assert refused.status == 503 and "retry" in body["error"]
        assert refused.getheader("Retry-After") == "1"
        deadline = time.monotonic() + 60
        while not client.is_model_ready("slow") and time.monotonic() < deadline:
            time.sleep(0.2)                  # the load went on without the client
        assert client.infer("slow", [inp]).as_numpy("OUTPUT0").tolist() == [[1.0, 1.0]]
        [m] = client.get_inference_statistics()["residency"]["models"]
        assert m["cold_starts"] == 1
    finally:
        server.close()


@pytest.fixture
def jp_server_config(jp_server_config, model_repo: Path):
    model_bytes = fleet(model_repo)
    return {**jp_server_config,
            "JupyterTriton": {**jp_server_config["JupyterTriton"], "load_models": [],
                              "load_on_demand": True,
                              "model_residency_bytes": budget_for(3, model_bytes)}}


async def test_the_jupyter_server_honours_the_budget(jp_triton, jp_http_port, jp_base_url, model_repo):
    budget = budget_for(3, (model_repo / "m0" / "1" / "model.onnx").stat().st_size)
    base = f"127.0.0.1:{jp_http_port}{jp_base_url.rstrip('/')}"
    rng = random.Random(7)
    order = [rng.randrange(N_MODELS) for _ in range(400)]

    def story() -> tuple[dict, dict]:
        results = sweep(lambda: httpclient.InferenceServerClient(base, network_timeout=120),
                        order, headers=dict(AUTH))
        client = httpclient.InferenceServerClient(base)
        try:
            return results, client.get_inference_statistics(headers=dict(AUTH))["residency"]
        finally:
            client.close()
    results, residency = await in_thread(story)
    check_sweep(results, residency, budget, len(order))
    assert residency["budget_bytes"] == budget
    # conftest's own models (linear, simple, identity_int32) are in the repository too:
    # they load on demand like the rest
    assert json.dumps(residency).count('"state": "RESIDENT"') <= 3


def test_the_command_line_bounds(tmp_path: Path):
    """``jupyter-triton serve --load-on-demand --max-loaded-models 2 --model-residency-bytes B``."""
    from test_cli_options import serve as serve_command, stop
    root = tmp_path / "models"
    fleet(root, n=4)
    proc, url = serve_command(root, "--load-on-demand", "--max-loaded-models", "2",
                              "--model-residency-bytes", str(1 << 30))
    client = httpclient.InferenceServerClient(url)
    try:
        for i in (0, 1, 2, 3, 0):
            assert client.infer(f"m{i}", [ones()]).as_numpy("OUTPUT0")[0, 0] == i + 1
        residency = client.get_inference_statistics()["residency"]
        assert (residency["max_loaded_models"], residency["budget_bytes"]) == (2, 1 << 30)
        # the count binds first: two resident, five cold starts, three evictions
        assert (residency["resident_models"], residency["cold_starts"], residency["evictions"]) == (2, 5, 3)
    finally:
        client.close()
        stop(proc)
