"""Triton's ensemble models: a repository with ensembles loads and serves unchanged."""
from __future__ import annotations

import http.client
import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.grpc import model_config_pb2 as mc
from google.protobuf import text_format
from tritonclient.utils import InferenceServerException

from conftest import build_repository, serve
from jupyter_triton.engine.composition.ensemble import plan
from jupyter_triton.protocol.errors import InvalidArgument, Unavailable
from onnx_models import linear

W4 = (np.arange(16, dtype=np.float32).reshape(4, 4) - 8.0) / 8.0
V4 = np.eye(4, dtype=np.float32) * 3.0


def _linear4(root: Path, name: str, w: np.ndarray) -> None:
    linear(w, root / name / "1" / "model.onnx")
    (root / name / "config.pbtxt").write_text(f"""
name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
dynamic_batching {{ max_queue_delay_microseconds: 2000 }}
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
""")


def _ensemble(root: Path, name: str, text: str) -> None:
    (root / name / "1").mkdir(parents=True)          # Triton's empty version directory
    (root / name / "config.pbtxt").write_text(f'name: "{name}"\nplatform: "ensemble"\n{text}')


PIPELINE = """
max_batch_size: 4
input [ { name: "A", data_type: TYPE_FP32, dims: [ 4 ] }, { name: "B", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] }, { name: "DIFF", data_type: TYPE_FP32, dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "simple" model_version: -1
    input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
    output_map { key: "OUTPUT0" value: "sum" } output_map { key: "OUTPUT1" value: "DIFF" } },
  { model_name: "lin4" model_version: -1
    input_map { key: "INPUT0" value: "sum" } output_map { key: "OUTPUT0" value: "OUT" } } ] }
"""

DIAMOND = """
max_batch_size: 4
input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "simple" model_version: 1
    input_map { key: "INPUT0" value: "p" } input_map { key: "INPUT1" value: "q" }
    output_map { key: "OUTPUT0" value: "Y" } },
  { model_name: "lin4" input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "p" } },
  { model_name: "scale3" input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "q" } } ] }
"""

# no batch dim of its own: the whole tensor goes to 'simple', which allows at most 4 rows
UNBATCHED = """
max_batch_size: 0
input [ { name: "A", data_type: TYPE_FP32, dims: [ -1, 4 ] } ]
output [ { name: "S", data_type: TYPE_FP32, dims: [ -1, 4 ] } ]
ensemble_scheduling { step [
  { model_name: "simple" input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "A" }
    output_map { key: "OUTPUT0" value: "S" } } ] }
"""

BROKEN = PIPELINE.replace('"lin4"', '"nope"')


def build(root: Path) -> Path:
    build_repository(root)
    _linear4(root, "lin4", W4)
    _linear4(root, "scale3", V4)
    _ensemble(root, "pipeline", PIPELINE)
    _ensemble(root, "diamond", DIAMOND)
    _ensemble(root, "unbatched", UNBATCHED)
    _ensemble(root, "broken", BROKEN)
    return root




@pytest.fixture(scope="module")
def ens(tmp_path_factory):
    server, client = serve(build(tmp_path_factory.mktemp("ens") / "models"), model_control_mode="none")
    yield server, client
    server.close()


def _inputs(**arrays: np.ndarray) -> list[httpclient.InferInput]:
    out = []
    for name, arr in arrays.items():
        inp = httpclient.InferInput(name, list(arr.shape), "FP32")
        inp.set_data_from_numpy(arr)
        out.append(inp)
    return out


def _success(client, model: str) -> int:
    stats = client.get_inference_statistics(model)["model_stats"]
    return sum(int(s["inference_stats"]["success"]["count"]) for s in stats)


def test_two_step_pipeline_matches_numpy(ens):
    _, client = ens
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4), np.float32), rng.standard_normal((3, 4), np.float32)
    result = client.infer("pipeline", _inputs(A=a, B=b))
    np.testing.assert_allclose(result.as_numpy("OUT"), (a + b) @ W4, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.as_numpy("DIFF"), a - b, rtol=1e-6)
    only = client.infer("pipeline", _inputs(A=a, B=b), outputs=[httpclient.InferRequestedOutput("OUT")])
    assert only.as_numpy("DIFF") is None
    meta = client.get_model_metadata("pipeline")
    assert meta["platform"] == "ensemble" and meta["versions"] == ["1"]
    assert [i["name"] for i in meta["inputs"]] == ["A", "B"]
    config = client.get_model_config("pipeline")
    assert config["platform"] == "ensemble"
    assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == ["simple", "lin4"]


def test_diamond_dag_concurrent_requests(ens):
    _, client = ens
    xs = [np.full((1, 4), i, np.float32) + np.arange(4, dtype=np.float32) for i in range(6)]
    # several requests at once: each runs lin4 and scale3 side by side, then simple
    asyncs = [client.async_infer("diamond", _inputs(X=x)) for x in xs]
    for x, pending in zip(xs, asyncs):
        np.testing.assert_allclose(pending.get_result(timeout=30).as_numpy("Y"), x @ W4 + x @ V4,
                                   rtol=1e-5, atol=1e-5)


def test_missing_composing_model_fails_load_and_server_keeps_serving(ens):
    _, client = ens
    rows = {r["name"]: r for r in client.get_model_repository_index()}
    assert rows["broken"]["state"] == "UNAVAILABLE"
    assert "nope" in rows["broken"]["reason"] and "broken" in rows["broken"]["reason"]
    assert not client.is_model_ready("broken")
    with pytest.raises(InferenceServerException, match="broken"):
        client.infer("broken", _inputs(A=np.ones((1, 4), np.float32), B=np.ones((1, 4), np.float32)))
    assert client.is_model_ready("pipeline") and client.is_model_ready("lin4")


def _post(port: int, model: str, body: dict) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", f"/v2/models/{model}/infer", body=json.dumps(body).encode())
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data)["error"]


def test_bad_requests_are_400(ens):
    server, client = ens
    status, error = _post(server.http_port, "pipeline", {"inputs": [
        {"name": "A", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]},
        {"name": "B", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]})
    assert status == 400 and "'A'" in error and "pipeline" in error
    # valid for the ensemble, refused by a composing model: its error, naming the ensemble
    rows = [{"name": "A", "shape": [6, 4], "datatype": "FP32", "data": [0.5] * 24}]
    status, error = _post(server.http_port, "unbatched", {"inputs": rows})
    assert status == 400
    assert error.startswith("ensemble 'unbatched' step 1 ('simple' v1) failed: ")
    assert "batch-size must be <= 4" in error
    ok = client.infer("unbatched", _inputs(A=np.ones((2, 4), np.float32))).as_numpy("S")
    np.testing.assert_allclose(ok, np.full((2, 4), 2.0, np.float32))


def test_statistics_count_ensemble_and_composing_requests(ens):
    _, client = ens
    before = {m: _success(client, m) for m in ("pipeline", "simple", "lin4")}
    for _ in range(3):
        client.infer("pipeline", _inputs(A=np.ones((2, 4), np.float32), B=np.ones((2, 4), np.float32)))
    assert _success(client, "pipeline") == before["pipeline"] + 3
    assert _success(client, "simple") == before["simple"] + 3
    assert _success(client, "lin4") == before["lin4"] + 3

    def failed(model: str) -> int:
        stats = client.get_inference_statistics(model)["model_stats"][0]["inference_stats"]
        return int(stats["fail"]["count"])

    fails = failed("unbatched")
    with pytest.raises(InferenceServerException, match="ensemble 'unbatched' step 1"):
        client.infer("unbatched", _inputs(A=np.ones((6, 4), np.float32)))
    assert failed("unbatched") == fails + 1


def test_explicit_load_brings_composing_models_and_unload_dependents(tmp_path):
    server, client = serve(build(tmp_path / "models"), model_control_mode="explicit",
                           load_models=["pipeline"])
    try:
        assert client.is_model_ready("pipeline")
        assert client.is_model_ready("simple") and client.is_model_ready("lin4")
        assert not client.is_model_ready("scale3")
        with pytest.raises(InferenceServerException, match="nope"):
            client.load_model("broken")
        client.unload_model("pipeline")                      # composing models stay
        assert not client.is_model_ready("pipeline") and client.is_model_ready("simple")
        client.load_model("pipeline")
        client.unload_model("pipeline", unload_dependents=True)
        assert not client.is_model_ready("simple") and not client.is_model_ready("lin4")
    finally:
        server.close()


# ---- load-time checks of the step graph (no server needed) -------------------------------
def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse('name: "e"\nplatform: "ensemble"\n' + text, mc.ModelConfig())


def _lookup(name: str, version: str) -> mc.ModelConfig:
    if name != "m":
        raise Unavailable(f"Request for unknown model: '{name}' is not found")
    return text_format.Parse("""name: "m" max_batch_size: 8
        input [ { name: "I", data_type: TYPE_FP32, dims: [ 4 ] } ]
        output [ { name: "O", data_type: TYPE_FP32, dims: [ 4 ] } ]""", mc.ModelConfig())


IO = """max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""


def _step(src: str, dst: str, model: str = "m", key_in: str = "I", key_out: str = "O") -> str:
    return (f'{{ model_name: "{model}" input_map {{ key: "{key_in}" value: "{src}" }} '
            f'output_map {{ key: "{key_out}" value: "{dst}" }} }}')


@pytest.mark.parametrize("steps, match", [
    ([_step("X", "t"), _step("t", "Y")], None),
    ([_step("u", "Y")], "'u'.*neither an ensemble input"),
    ([_step("X", "t")], "output 'Y' is not produced"),
    ([_step("X", "a"), _step("b", "c"), _step("c", "b"), _step("a", "Y")], "cycle"),
    ([_step("X", "Y"), _step("X", "Y")], "'Y' can only be produced once"),
    ([_step("X", "Y", model="gone")], "'gone'"),
    ([_step("X", "Y", key_in="J")], "input 'J'"),
])
def test_plan_checks_the_graph(steps, match):
    config = _config(IO + "ensemble_scheduling { step [ " + ", ".join(steps) + " ] }")
    if match is None:
        assert [s.outputs for s in plan(config, _lookup)] == [{"O": "t"}, {"O": "Y"}]
    else:
        with pytest.raises(InvalidArgument, match=match):
            plan(config, _lookup)


def test_plan_checks_max_batch_size():
    config = _config(IO.replace("max_batch_size: 8", "max_batch_size: 16")
                     + "ensemble_scheduling { step [ " + _step("X", "Y") + " ] }")
    with pytest.raises(InvalidArgument, match="maximum batch size 16.*'m'.*8"):
        plan(config, _lookup)


CHECKER_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        xs = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        if any(x.sum() < 0 for x in xs):
            raise ValueError("negative sum")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]) for x in xs]
'''

GUARDED = """
max_batch_size: 4
input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "lin4" input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "h" } },
  { model_name: "checker" input_map { key: "INPUT0" value: "h" } output_map { key: "OUTPUT0" value: "Y" } } ] }
"""


def test_a_failing_step_is_named_counted_and_exported(tmp_path):
    # X @ W4 sums to -sum(X): ones fail in 'checker' (step 2), minus ones pass
    import tritonclient.grpc as grpcclient
    from prometheus_client.parser import text_string_to_metric_families
    from jupyter_triton.engine import EngineOptions
    from jupyter_triton.standalone import start_in_thread
    root = tmp_path / "models"
    _linear4(root, "lin4", W4)
    (root / "checker" / "1").mkdir(parents=True)
    (root / "checker" / "1" / "model.py").write_text(CHECKER_PY)
    (root / "checker" / "config.pbtxt").write_text('''name: "checker"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
parameters { key: "EXECUTION_MODE" value: { string_value: "thread" } }
''')
    _ensemble(root, "guarded", GUARDED)
    server = start_in_thread(EngineOptions(model_repository=root, model_control_mode="none"),
                             host="127.0.0.1", http_port=0, metrics_port=0, grpc_port=0)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        ok = client.infer("guarded", _inputs(X=-np.ones((1, 4), np.float32))).as_numpy("Y")
        np.testing.assert_allclose(ok, -np.ones((1, 4), np.float32) @ W4)
        with pytest.raises(InferenceServerException) as err:
            client.infer("guarded", _inputs(X=np.ones((1, 4), np.float32)))
        message = err.value.message()
        assert message.startswith("ensemble 'guarded' step 2 ('checker' v1) failed: "), message
        assert "negative sum" in message and err.value.status() == "500"   # the step's status
        x = grpcclient.InferInput("X", [1, 4], "FP32")
        x.set_data_from_numpy(np.ones((1, 4), np.float32))
        with pytest.raises(InferenceServerException) as err:
            grpc.infer("guarded", [x])
        assert err.value.status() == "StatusCode.INTERNAL"
        assert "ensemble 'guarded' step 2 ('checker' v1) failed: " in err.value.message()

        stats = client.get_inference_statistics("guarded")["model_stats"][0]
        steps = {s["step"]: s for s in stats["ensemble_steps"]}
        assert (steps[1]["model"], steps[1]["version"]) == ("lin4", "1")
        assert (steps[1]["success"]["count"], steps[1]["fail"]["count"]) == (3, 0)
        assert (steps[2]["model"], steps[2]["success"]["count"], steps[2]["fail"]["count"]) == \
            ("checker", 1, 2)
        assert steps[1]["success"]["ns"] > 0 and steps[2]["fail"]["ns"] > 0
        assert stats["inference_stats"]["fail"]["count"] == 2
        assert grpc.get_inference_statistics("guarded").model_stats[0].name == "guarded"

        conn = http.client.HTTPConnection("127.0.0.1", server.metrics_port, timeout=10)
        conn.request("GET", "/metrics")
        body = conn.getresponse().read().decode()
        conn.close()
        # prometheus_client's parser names a counter's samples <name>_total
        samples = {(s.name.removesuffix("_total"), frozenset(s.labels.items())): s.value
                   for family in text_string_to_metric_families(body) for s in family.samples}
        assert 'nv_ensemble_step_failure{' in body
        step2 = frozenset({"model": "guarded", "version": "1", "step": "2",
                           "composing_model": "checker", "composing_version": "1"}.items())
        assert samples[("nv_ensemble_step_failure", step2)] == 2
        assert samples[("nv_ensemble_step_success", step2)] == 1
        assert samples[("nv_ensemble_step_duration_us", step2)] >= 0
    finally:
        client.close()
        grpc.close()
        server.close()
