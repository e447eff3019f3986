"""Triton's local response cache: ``response_cache { enable: true }`` and the server's
``--cache-config local,size=<bytes>``. What tritonserver 2.51 answered to the same requests
(read from it): a repeated request is answered without running the model, its own id kept;
a hit counts as a success and in the queue count, not in inference_count/execution_count;
cache_hit / cache_miss count and time lookups; nv_cache_*_per_model per model."""
from __future__ import annotations

import http.client
import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from google.protobuf import json_format, text_format
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from onnx_models import linear

from jupyter_triton.engine import EngineOptions
from jupyter_triton.engine.cache import ResponseCache, parse_cache_config, request_key
from jupyter_triton.repository import VersionIdentity
from jupyter_triton.protocol.errors import InvalidArgument
from jupyter_triton.protocol.types import InferRequest, InferResponse, InferTensor, RequestedOutput
from jupyter_triton.standalone import start_in_thread

pytestmark = pytest.mark.timeout(120)

# OUTPUT0 = INPUT0 + the number of executions so far: an answer that did not run the model
# again shows it; a negative input fails.
COUNTING_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.runs = 0

    def execute(self, requests):
        out = []
        for r in requests:
            self.runs += 1
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            if x.sum() < 0:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative")))
            else:
                out.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUTPUT0", x + self.runs), pb_utils.Tensor("OUTPUT1", x * 0)]))
        return out
'''


def _model(root: Path, name: str, cached: bool) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(COUNTING_PY)
    (root / name / "config.pbtxt").write_text(f'''name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }},
         {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }} ]
parameters {{ key: "EXECUTION_MODE" value: {{ string_value: "thread" }} }}
{"response_cache { enable: true }" if cached else ""}
''')


def _start(root: Path, size: int):
    server = start_in_thread(EngineOptions(model_repository=root, model_control_mode="none",
                                           response_cache_size=size),
                             host="127.0.0.1", http_port=0, metrics_port=0, grpc_port=None)
    return server, httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")


def _infer(client, model: str, x, request_id: str = "", outputs=None) -> np.ndarray:
    inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.asarray(x, dtype=np.float32).reshape(1, 4))
    requested = None if outputs is None else [httpclient.InferRequestedOutput(o) for o in outputs]
    result = client.infer(model, [inp], request_id=request_id, outputs=requested)
    assert result.get_response().get("id", "") == request_id
    return result.as_numpy("OUTPUT0")


@pytest.fixture
def cached(tmp_path: Path):
    root = tmp_path / "models"
    _model(root, "cached", True)
    _model(root, "plain", False)
    server, client = _start(root, 1 << 20)
    yield server, client
    client.close()
    server.close()


def _scrape(server) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", server.metrics_port, timeout=10)
    conn.request("GET", "/metrics")
    body = conn.getresponse().read().decode()
    conn.close()
    return {(s.name.removesuffix("_total"), frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def test_a_repeated_request_is_answered_from_the_cache(cached):
    server, client = cached
    ones = np.ones(4)
    first = _infer(client, "cached", ones)                        # run 1: 1 + 1
    np.testing.assert_array_equal(first, [[2, 2, 2, 2]])
    np.testing.assert_array_equal(_infer(client, "cached", ones), first)              # hit
    np.testing.assert_array_equal(_infer(client, "cached", ones, request_id="other"), first)
    with pytest.raises(InferenceServerException, match="negative"):
        _infer(client, "cached", -ones)                             # run 2, a failure
    with pytest.raises(InferenceServerException, match="negative"):
        _infer(client, "cached", -ones)                             # run 3: never cached
    # other requested outputs are another answer (Triton's key leaves them out)
    np.testing.assert_array_equal(_infer(client, "cached", ones, outputs=["OUTPUT0"]), [ones + 4])
    np.testing.assert_array_equal(_infer(client, "cached", ones * 2), [ones * 2 + 5])
    # a model without response_cache runs every time
    assert _infer(client, "plain", ones)[0, 0] != _infer(client, "plain", ones)[0, 0]

    stats = client.get_inference_statistics("cached")["model_stats"][0]
    inference = stats["inference_stats"]
    assert inference["cache_hit"]["count"] == 2 and inference["cache_hit"]["ns"] > 0
    assert inference["cache_miss"]["count"] == 3 and inference["cache_miss"]["ns"] > 0
    assert (inference["success"]["count"], inference["fail"]["count"]) == (5, 2)
    assert inference["queue"]["count"] == 5             # hits too (no failure: Triton's count)
    assert (stats["inference_count"], stats["execution_count"]) == (3, 5)
    assert inference["compute_infer"]["count"] == 3
    plain = client.get_inference_statistics("plain")["model_stats"][0]["inference_stats"]
    assert plain["cache_hit"]["count"] == plain["cache_miss"]["count"] == 0

    samples = _scrape(server)
    labels = frozenset({"model": "cached", "version": "1"}.items())
    assert samples[("nv_cache_num_hits_per_model", labels)] == 2
    assert samples[("nv_cache_num_misses_per_model", labels)] == 3
    assert samples[("nv_cache_hit_duration_per_model", labels)] == inference["cache_hit"]["ns"] // 1000
    assert samples[("nv_cache_miss_duration_per_model", labels)] == inference["cache_miss"]["ns"] // 1000
    assert samples[("nv_cache_num_entries", frozenset())] == 3
    assert 0 < samples[("nv_cache_util", frozenset())] < 1
    assert not any(name.endswith("_per_model") and dict(lbl).get("model") == "plain"
                   for name, lbl in samples)


def test_without_a_server_cache_nothing_is_cached(tmp_path: Path):
    # tritonserver 2.51 without --cache-config: the model loads, runs every request
    root = tmp_path / "models"
    _model(root, "cached", True)
    server, client = _start(root, 0)
    try:
        assert _infer(client, "cached", np.ones(4))[0, 0] != _infer(client, "cached", np.ones(4))[0, 0]
        stats = client.get_inference_statistics("cached")["model_stats"][0]["inference_stats"]
        assert stats["cache_hit"]["count"] == stats["cache_miss"]["count"] == 0
        assert not any(name.startswith("nv_cache") for name, _ in _scrape(server))
    finally:
        client.close()
        server.close()


def _response(nbytes: int) -> InferResponse:
    data = np.zeros(nbytes, dtype=np.uint8)
    return InferResponse("m", "1", outputs=[InferTensor("Y", "UINT8", data.shape, data)])


def test_the_cache_is_an_lru_bounded_in_bytes():
    cache = ResponseCache(4096)
    for key in (b"a", b"b", b"c"):
        cache.insert(key, _response(1000))
    assert len(cache) == 3 and cache.used <= 4096
    assert cache.lookup(b"a") is not None            # a is now the most recent
    cache.insert(b"d", _response(1000))              # evicts b, the least recent
    assert cache.lookup(b"b") is None and cache.lookup(b"a") is not None
    assert cache.evictions == 1 and cache.used <= 4096
    cache.insert(b"huge", _response(10_000))         # larger than the whole cache: not kept
    assert cache.lookup(b"huge") is None and len(cache) == 3


def test_the_key_covers_inputs_outputs_version_and_parameters():
    x = np.arange(4, dtype=np.float32).reshape(1, 4)

    def key(data=x, dtype="FP32", version=1, outputs=None, params=None, request_id="",
            files="files", config="config"):
        return request_key(VersionIdentity("m", version, files, config).key, InferRequest(
            "m", "", request_id, [InferTensor("INPUT0", dtype, data.shape, data)],
            outputs, params or {}))
    base = key()
    assert key(request_id="another") == base
    assert key(params={"priority": 1, "timeout": 5}) == base
    for other in (key(x + 1), key(x.reshape(2, 2)), key(version=2), key(files="other"),
                  key(config="other"), key(params={"k": 1}),
                  key(outputs=[RequestedOutput("OUTPUT0")]),
                  key(x.view(np.int32), dtype="INT32")):
        assert other != base
    strings = np.array([b"ab", b"c"], dtype=object)
    assert key(strings, "BYTES") != key(np.array([b"a", b"bc"], dtype=object), "BYTES")


def test_cache_config_is_parsed_as_tritonserver_spells_it():
    assert parse_cache_config([]) == 0
    assert parse_cache_config(["local,size=1048576"]) == 1048576
    for bad in ("redis,size=1", "local,size=lots", "local,capacity=1", "local,size"):
        with pytest.raises(InvalidArgument):
            parse_cache_config([bad])
    from jupyter_triton.cli import build_parser, options_from
    args = build_parser().parse_args(["serve", "--model-repository", "/tmp/x",
                                      "--cache-config", "local,size=2048"])
    assert options_from(args).response_cache_size == 2048


def test_the_jupyter_trait_sizes_the_engines_cache(tmp_path: Path):
    # c.JupyterTriton.response_cache_size, as --cache-config local,size=<bytes> is for the CLI
    from traitlets import TraitError
    from traitlets.config import Config
    from jupyter_triton.serverext import JupyterTriton
    app = JupyterTriton(config=Config({"JupyterTriton": {"response_cache_size": 4096}}))
    assert app.response_cache_size == 4096
    with pytest.raises(TraitError):
        app.response_cache_size = -1
    from jupyter_triton.engine import Engine
    engine = Engine(EngineOptions(model_repository=tmp_path, response_cache_size=app.response_cache_size))
    assert engine.response_cache is not None and engine.response_cache.size == 4096
    assert Engine(EngineOptions(model_repository=tmp_path)).response_cache is None


# an ensemble whose one step scales by whichever 'scale' version serves
SCALED = '''name: "scaled"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "scale" model_version: -1
  input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "Y" } } ] }
response_cache { enable: true }
'''

# its composing model, as the load API takes a config (JSON); config.pbtxt is the same
SCALE = {"name": "scale", "backend": "onnxruntime", "max_batch_size": 8,
         "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
         "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}]}


def _scale_model(k: float, path: Path | None = None) -> bytes:
    return linear(np.eye(4, dtype=np.float32) * k, path)


def _scale(root: Path, version: int, k: float) -> None:
    _scale_model(k, root / "scale" / str(version) / "model.onnx")


def test_an_ensembles_cached_answer_follows_its_composing_models(tmp_path: Path):
    """The ensemble's answers are its composing models': a new version of one served, or the
    same version loaded again with other files, is never answered for by the cache's older
    answers (nor by anything it kept of them)."""
    root = tmp_path / "models"
    _scale(root, 1, 2.0)
    (root / "scale" / "config.pbtxt").write_text(
        text_format.MessageToString(json_format.ParseDict(SCALE, mc.ModelConfig())))
    (root / "scaled" / "1").mkdir(parents=True)
    (root / "scaled" / "config.pbtxt").write_text(SCALED)
    server = start_in_thread(EngineOptions(model_repository=root, model_control_mode="explicit",
                                           load_models=["scaled"], response_cache_size=1 << 20),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    x = np.array([[1, 2, 3, 4]], dtype=np.float32)

    def scaled() -> np.ndarray:
        inp = httpclient.InferInput("X", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        return client.infer("scaled", [inp]).as_numpy("Y")

    def hits_and_misses() -> tuple[int, int]:
        stats = client.get_inference_statistics("scaled")["model_stats"][0]["inference_stats"]
        return stats["cache_hit"]["count"], stats["cache_miss"]["count"]

    try:
        np.testing.assert_array_equal(scaled(), x * 2)
        np.testing.assert_array_equal(scaled(), x * 2)
        assert hits_and_misses() == (1, 1)
        # version 2 comes and serves (the step asks for the latest)
        _scale(root, 2, 3.0)
        client.load_model("scale")
        np.testing.assert_array_equal(scaled(), x * 3)
        assert hits_and_misses() == (1, 2)
        np.testing.assert_array_equal(scaled(), x * 3)
        assert hits_and_misses() == (2, 2)
        # version 2's files replaced under the same number, loaded again
        _scale(root, 2, 5.0)
        client.load_model("scale")
        np.testing.assert_array_equal(scaled(), x * 5)
        assert hits_and_misses() == (2, 3)
        # a canary of 'scale' takes half the requests: which version answers is a draw, and
        # the ensemble's answer is not kept while it runs (both answers come back)
        client.load_model("scale", config=json.dumps(SCALE), files={
            "file:3/model.onnx": _scale_model(7.0),
            "file:lifecycle.json": json.dumps({"canary": 0.5}).encode()})
        answers = {float(scaled()[0, 0]) for _ in range(24)}
        assert answers == {5.0, 7.0} and hits_and_misses() == (2, 3)
    finally:
        client.close()
        server.close()
