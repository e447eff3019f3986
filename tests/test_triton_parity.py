"""The same repository served by NVIDIA's tritonserver 2.51 (nvidia-pytriton's, on CPU) and by
us, the same requests sent to both, the answers compared. Skipped, with the reason, where
nvidia-pytriton's venv is not installed (./dev test installs it).

Where Triton answers a client error with 500 we answer 4xx (README, "Differences"); those
comparisons check Triton's answer and ours apart."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from conftest import serve
from tritonserver_peer import TritonServer, call, tritonserver_dist

pytestmark = pytest.mark.timeout(300)

ADD_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if x.sum() < 0:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("negative input")))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x + 1)]))
        return responses
'''

RAISES_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        xs = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        if any(x.sum() < 0 for x in xs):
            raise ValueError("negative input")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x + 1)]) for x in xs]
'''

BAD_INIT_PY = '''
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("cannot initialize")

    def execute(self, requests):
        return []
'''


def _model(root: Path, name: str, source: str, extra: str = "") -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(source)
    (root / name / "config.pbtxt").write_text(f'''name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
{extra}
''')


CHAIN = """name: "chain"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "minus_ten" model_version: -1
    input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "h" } },
  { model_name: "raises" model_version: -1
    input_map { key: "INPUT0" value: "h" } output_map { key: "OUTPUT0" value: "Y" } } ] }
"""


def build(root: Path) -> Path:
    (root / "chain" / "1").mkdir(parents=True)
    (root / "chain" / "config.pbtxt").write_text(CHAIN)
    _model(root, "add", ADD_PY, "dynamic_batching { }")
    (root / "bare" / "1").mkdir(parents=True)       # no instance_group, no batcher
    (root / "bare" / "1" / "model.py").write_text(ADD_PY)
    (root / "bare" / "config.pbtxt").write_text(
        'name: "bare"\nbackend: "python"\nmax_batch_size: 4\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')
    _model(root, "minus_ten", ADD_PY.replace("x + 1", "x - 10").replace("x.sum() < 0", "False"))
    _model(root, "raises", RAISES_PY)
    _model(root, "to_unload", ADD_PY)
    _model(root, "bad_init", BAD_INIT_PY)
    _model(root, "no_version", ADD_PY, "version_policy { specific { versions: [ 3 ] } }")
    return root


LOADED = ["add", "raises", "to_unload", "chain", "bare"]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """(Triton's host:port, ours): two copies of one repository (each server writes
    __pycache__ into its own), the same models loaded at start."""
    tritonserver_dist()                 # skips with the reason where the venv is absent
    base = tmp_path_factory.mktemp("parity")
    theirs_repo = build(base / "theirs")
    ours_repo = base / "ours"
    shutil.copytree(theirs_repo, ours_repo)
    triton = TritonServer(theirs_repo, base / "triton", load=LOADED)
    server, client = serve(ours_repo, model_control_mode="explicit", load_models=LOADED)
    client.close()
    try:
        yield triton.url, f"127.0.0.1:{server.http_port}"
    finally:
        server.close()
        triton.close()


def both_call(both, method: str, path: str, body: object | None = None):
    theirs, ours = both
    return call(theirs, method, path, body), call(ours, method, path, body)


def _infer(data, shape=(1, 4)) -> dict:
    return {"inputs": [{"name": "INPUT0", "shape": list(shape), "datatype": "FP32", "data": data}]}


def test_an_inference_answers_the_same(both):
    (ts, theirs), (os_, ours) = both_call(both, "POST", "/v2/models/add/infer", _infer([1, 2, 3, 4]))
    assert ts == os_ == 200
    assert theirs["outputs"] == ours["outputs"]
    assert (theirs["model_name"], theirs["model_version"]) == (ours["model_name"], ours["model_version"])


@pytest.mark.parametrize("data, shape", [
    ([[1, 2], [3, 4]], [1, 4]),
    ([[1, 2, 3, 4, 5, 6, 7, 8]], [2, 4]),
    ([[[1], [2, 3, 4]]], [1, 4]),
])
def test_data_nested_unlike_its_shape_is_taken_by_both(both, data, shape):
    (ts, theirs), (os_, ours) = both_call(both, "POST", "/v2/models/add/infer", _infer(data, shape))
    assert ts == os_ == 200, (theirs, ours)
    assert theirs["outputs"] == ours["outputs"]


def _with(request_id: str = "", **tensor) -> dict:
    doc = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                       "data": [1, 2, 3, 4], **tensor}]}
    return {"id": request_id, **doc} if request_id else doc


@pytest.mark.parametrize("body", [
    _with(name="WRONG"), {"inputs": []}, _with("r7", datatype="INT32"),
    _with(shape=[1, 5], data=[1, 2, 3, 4, 5]), _with("r8", shape=[9, 4], data=[1] * 36),
    {**_with(), "outputs": [{"name": "NOPE"}]}, {"inputs": _with("r9")["inputs"] * 2, "id": "r9"},
], ids=["unknown input", "no input", "datatype", "shape", "batch size", "unknown output",
        "duplicate input"])
def test_a_refused_request_reads_the_same(both, body):
    (ts, theirs), (os_, ours) = both_call(both, "POST", "/v2/models/add/infer", body)
    assert ts == os_ == 400 and theirs == ours, (theirs, ours)


def test_a_data_count_mismatch_is_refused_by_both(both):
    # Triton: 500 "Unable to parse 'data': Shape does not match true shape of 'data' field"
    (ts, theirs), (os_, ours) = both_call(both, "POST", "/v2/models/add/infer",
                                          _infer([[1, 2], [3]]))
    assert ts == 500 and "Unable to parse 'data'" in theirs["error"]
    assert os_ == 400 and "expects 4 elements, got 3" in ours["error"]


def _stats_after(both, model: str, settled: int) -> tuple[dict, dict]:
    """Both servers' statistics of ``model`` once Triton's success + fail counts reach
    ``settled`` (Triton records a request's statistics after it has replied), at most 10 s."""
    deadline = time.monotonic() + 10
    while True:
        (_, theirs), (_, ours) = both_call(both, "GET", f"/v2/models/{model}/stats")
        theirs, ours = theirs["model_stats"][0], ours["model_stats"][0]
        counts = theirs["inference_stats"]
        if counts["success"]["count"] + counts["fail"]["count"] >= settled or \
                time.monotonic() > deadline:
            return theirs, ours
        time.sleep(0.1)


def test_statistics_count_a_failed_execution_as_triton_does(both):
    for data, shape in (([-1, -1, -1, -1], [1, 4]), ([1, 2, 3, 4], [1, 4]),
                        ([1, 2, 3, 4, 5, 6, 7, 8], [2, 4])):
        both_call(both, "POST", "/v2/models/raises/infer", _infer(data, shape))
    theirs, ours = _stats_after(both, "raises", 3)
    for key in ("inference_count", "execution_count"):
        assert theirs[key] == ours[key], key
    for kind in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        assert theirs["inference_stats"][kind]["count"] == ours["inference_stats"][kind]["count"], kind
    for kind in ("compute_input", "compute_output"):
        assert theirs["inference_stats"][kind]["ns"] > 0 and ours["inference_stats"][kind]["ns"] > 0

    def sizes(stats):
        return {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}
    assert sizes(theirs) == sizes(ours)


def test_an_error_response_is_a_failure_here_and_a_success_in_triton(both):
    # A documented difference (README): Triton 2.51's python backend reports a request the
    # model answered with an error response as a success; it answered 500, so it counts as
    # a BACKEND failure here.
    both_call(both, "POST", "/v2/models/to_unload/infer", _infer([-1, -1, -1, -1]))
    theirs, ours = _stats_after(both, "to_unload", 1)
    assert (theirs["inference_stats"]["success"]["count"], theirs["inference_count"]) == (1, 1)
    assert (ours["inference_stats"]["fail"]["count"], ours["inference_count"]) == (1, 0)


def test_an_ensemble_answers_and_fails_as_tritons_naming_the_step(both):
    # minus_ten(X) = X - 10 feeds raises, which raises when its input sums below 0
    def ask(data):
        return both_call(both, "POST", "/v2/models/chain/infer", {"inputs": [
            {"name": "X", "shape": [1, 4], "datatype": "FP32", "data": data}]})
    (ts, theirs), (os_, ours) = ask([10, 11, 12, 13])
    assert ts == os_ == 200 and theirs["outputs"] == ours["outputs"]
    (ts, theirs), (os_, ours) = ask([1, 2, 3, 4])
    assert ts == os_ == 500, (theirs, ours)
    assert ours["error"].startswith("ensemble 'chain' step 2 ('raises' v1) failed: "), ours
    # Triton's text is the composing model's alone (one endpoint hides the stage); ours has
    # the same words after the step's name
    assert "ValueError: negative input" in theirs["error"], theirs
    assert "ValueError: negative input" in ours["error"], ours
    theirs, ours = _stats_after(both, "chain", 3)      # Triton: 1 success, the failure twice
    for key in ("inference_count", "execution_count"):
        assert theirs[key] == ours[key], key
    for kind in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert theirs["inference_stats"][kind]["count"] == ours["inference_stats"][kind]["count"], kind
    # a documented difference (README): Triton 2.51 counts a failed ensemble request twice
    assert (theirs["inference_stats"]["fail"]["count"], ours["inference_stats"]["fail"]["count"]) \
        == (2, 1)
    assert [(s["success"]["count"], s["fail"]["count"]) for s in ours["ensemble_steps"]] == \
        [(2, 0), (1, 1)]


@pytest.mark.parametrize("model", ["add", "bare", "raises", "chain"])
def test_the_served_config_is_tritons(both, model):
    # normalized alike: preferred sizes, the backend's file name, KIND_AUTO placed
    (_, theirs), (_, ours) = both_call(both, "GET", f"/v2/models/{model}/config")
    assert theirs == ours


def test_dynamic_batching_without_preferred_sizes_is_served_alike(both):
    (_, theirs), (_, ours) = both_call(both, "GET", "/v2/models/add/config")
    assert theirs["dynamic_batching"]["preferred_batch_size"] == \
        ours["dynamic_batching"]["preferred_batch_size"] == [8]


def test_the_repository_index_rows_match(both):
    (_, theirs), (_, ours) = both_call(both, "POST", "/v2/repository/index", {})
    theirs = {r["name"]: r for r in theirs}
    ours = {r["name"]: r for r in ours}
    for name in LOADED:
        assert theirs[name] == ours[name], name
        assert "reason" not in ours[name]


def test_unloaded_model_answers_alike(both):
    # runs after the tests that use to_unload (pytest keeps file order)
    (ts, _), (os_, _) = both_call(both, "POST", "/v2/repository/models/to_unload/unload", {})
    assert ts == os_ == 200
    for method, path, body in (("POST", "/v2/models/to_unload/infer", _infer([1, 2, 3, 4])),
                               ("GET", "/v2/models/to_unload", None),
                               ("GET", "/v2/models/to_unload/config", None),
                               ("POST", "/v2/models/to_unload/versions/1/infer", _infer([1, 2, 3, 4]))):
        (ts, theirs), (os_, ours) = both_call(both, method, path, body)
        assert ts == os_, (path, theirs, ours)
        assert ours["error"].startswith(theirs["error"]), (path, theirs, ours)
    deadline = time.monotonic() + 20       # Triton's unload ends in the background
    while True:
        (_, theirs), (_, ours) = both_call(both, "POST", "/v2/repository/index", {})
        row = next(r for r in theirs if r["name"] == "to_unload")
        if row["state"] != "UNLOADING" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert row == next(r for r in ours if r["name"] == "to_unload") == {
        "name": "to_unload", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}


def test_load_errors_start_with_tritons_words(both):
    # Triton answers a model missing from the repository with 500; it is a 404 here
    (ts, theirs), (os_, ours) = both_call(both, "POST", "/v2/repository/models/nosuch/load", {})
    assert (ts, os_) == (500, 404)
    assert ours["error"].startswith(theirs["error"]), (theirs, ours)
    for name in ("no_version", "bad_init"):
        (ts, theirs), (os_, ours) = both_call(both, "POST", f"/v2/repository/models/{name}/load", {})
        assert ts == os_ == 400, (theirs, ours)
        prefix = theirs["error"].split(":")[0] + ":"
        assert ours["error"].startswith(prefix), (theirs, ours)
    assert "version 1 is at UNAVAILABLE state" in theirs["error"] and \
        "version 1 is at UNAVAILABLE state" in ours["error"]


def test_unloading_a_model_the_repository_lacks_answers_alike(both):
    (ts, _), (os_, _) = both_call(both, "POST", "/v2/repository/models/nosuch/unload", {})
    assert ts == os_ == 200


def test_statistics_of_an_unknown_version_say_the_same(both):
    (ts, theirs), (os_, ours) = both_call(both, "GET", "/v2/models/add/versions/5/stats")
    assert theirs["error"] == ours["error"]
    assert (ts, os_) == (400, 404)          # Triton: 400; NotFound is a 404 here


# ---- the response cache ------------------------------------------------------------------

@pytest.fixture(scope="module")
def cached_both(tmp_path_factory):
    """Both servers with a 1 MiB local cache (--cache-config local,size=1048576) and a model
    whose config enables it."""
    tritonserver_dist()
    base = tmp_path_factory.mktemp("parity-cache")
    theirs_repo = base / "theirs"
    _model(theirs_repo, "cached", ADD_PY, "response_cache { enable: true }")
    ours_repo = base / "ours"
    shutil.copytree(theirs_repo, ours_repo)
    triton = TritonServer(theirs_repo, base / "triton", load=["cached"],
                          extra_args=["--cache-config=local,size=1048576"])
    from jupyter_triton.engine import EngineOptions
    from jupyter_triton.standalone import start_in_thread
    server = start_in_thread(EngineOptions(model_repository=ours_repo, model_control_mode="explicit",
                                           load_models=["cached"], response_cache_size=1 << 20),
                             host="127.0.0.1", http_port=0, metrics_port=0, grpc_port=None)
    try:
        yield (triton, server)
    finally:
        server.close()
        triton.close()


def test_the_response_cache_answers_and_counts_as_tritons(cached_both):
    triton, server = cached_both
    both = (triton.url, f"127.0.0.1:{server.http_port}")
    one, two = _infer([1, 2, 3, 4]), _infer([5, 6, 7, 8])
    for body in (one, one, {**one, "id": "again"}, two, two):
        (ts, theirs), (os_, ours) = both_call(both, "POST", "/v2/models/cached/infer", body)
        assert ts == os_ == 200 and theirs == ours, (theirs, ours)
    theirs, ours = _stats_after(both, "cached", 5)
    assert (theirs["inference_count"], theirs["execution_count"]) == \
        (ours["inference_count"], ours["execution_count"]) == (2, 2)
    for kind in ("success", "queue", "compute_infer", "cache_hit", "cache_miss"):
        assert theirs["inference_stats"][kind]["count"] == ours["inference_stats"][kind]["count"], kind
    assert ours["inference_stats"]["cache_hit"]["count"] == 3

    def scrape(port: int) -> dict:
        import urllib.request
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                if line.startswith("nv_cache_num_") and "_per_model" in line}
    assert scrape(triton.metrics_port) == scrape(server.metrics_port)
