"""Answers that must be Triton 2.51's, each checked against what the real tritonserver said
to the same request (the values in these tests were read from it; tests/test_triton_parity.py
asks it again where nvidia-pytriton's venv is installed).

Where Triton answers a client error with 500 we keep our 4xx (README, "Differences")."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import serve

pytestmark = pytest.mark.timeout(120)

# Raises from execute (Triton: the whole batch fails, reason BACKEND) when the input's sum
# is negative; otherwise adds one.
FAILING_MODEL_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        xs = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        if any(x.sum() < 0 for x in xs):
            raise ValueError("negative input")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x + 1)]) for x in xs]
'''


def python_model(root: Path, name: str, source: str, extra: str = "") -> Path:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    (root / name / "1" / "model.py").write_text(source)
    (root / name / "config.pbtxt").write_text(f'''
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
parameters {{ key: "EXECUTION_MODE" value: {{ string_value: "thread" }} }}
{extra}
''')
    return root / name


def inputs(x: np.ndarray) -> list[httpclient.InferInput]:
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x.astype(np.float32))
    return [inp]


@pytest.fixture
def failing(tmp_path: Path):
    root = tmp_path / "models"
    python_model(root, "failing", FAILING_MODEL_PY)
    server, client = serve(root, model_control_mode="explicit", load_models=["*"])
    yield server, client
    client.close()
    server.close()


def test_a_failed_inference_counts_as_an_execution_but_not_as_an_inference(failing):
    # tritonserver 2.51, same model, same three requests: inference_count 3 (the failed row
    # left out), execution_count 3, success 2, fail 1, compute_* counts 2, batch_stats of
    # sizes 1 (twice: the failure too) and 2 (once).
    _, client = failing
    with pytest.raises(InferenceServerException) as err:
        client.infer("failing", inputs(-np.ones((1, 4))))
    assert err.value.status() == "500" and "negative input" in err.value.message()
    client.infer("failing", inputs(np.ones((1, 4))))
    client.infer("failing", inputs(np.ones((2, 4))))
    stats = client.get_inference_statistics("failing")["model_stats"][0]
    assert (stats["inference_count"], stats["execution_count"]) == (3, 3)
    inference = stats["inference_stats"]
    assert (inference["success"]["count"], inference["fail"]["count"]) == (2, 1)
    for kind in ("compute_input", "compute_infer", "compute_output"):
        assert inference[kind]["count"] == 2 and inference[kind]["ns"] > 0, (kind, inference[kind])
    assert inference["queue"]["count"] == 2             # Triton: the failure's queue time too
    assert {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]} == {1: 2, 2: 1}


def test_compute_input_and_output_are_measured(standalone):
    # Triton times the tensor copies in and out around the model apart from compute_infer;
    # they are never exactly zero there, and must not be here.
    client = httpclient.InferenceServerClient(f"127.0.0.1:{standalone.http_port}")
    try:
        for rows in (1, 3):
            client.infer("linear", _linear(rows))
        stats = client.get_inference_statistics("linear")["model_stats"][0]
    finally:
        client.close()
    inference = stats["inference_stats"]
    for kind in ("compute_input", "compute_output", "compute_infer"):
        assert inference[kind]["count"] == 2 and inference[kind]["ns"] > 0, (kind, inference[kind])
    for batch in stats["batch_stats"]:
        assert batch["compute_input"]["ns"] > 0 and batch["compute_output"]["ns"] > 0, batch
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", standalone.metrics_port, timeout=10)
    conn.request("GET", "/metrics")
    lines = conn.getresponse().read().decode().splitlines()
    conn.close()
    for kind in ("compute_input", "compute_output"):
        name = f'nv_inference_{kind}_duration_us{{model="linear",version="1"}}'
        assert f"{name} {inference[kind]['ns'] // 1000}" in lines, name


def _linear(rows: int) -> list[httpclient.InferInput]:
    inp = httpclient.InferInput("INPUT0", [rows, 16], "FP32")
    inp.set_data_from_numpy(np.ones((rows, 16), dtype=np.float32))
    return [inp]


def _error(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value


def test_after_unload_infer_and_metadata_answer_404_and_the_index_keeps_only_set_reasons(standalone):
    # tritonserver 2.51 after unload: infer, metadata and config of the model answer 404
    # "Request for unknown model: '<m>' has no available versions"; a named version 503
    # "... version 1 is not at ready state"; the index row says "reason": "unloaded", and a
    # READY row has no "reason" at all.
    import tritonclient.grpc as grpcclient
    client = httpclient.InferenceServerClient(f"127.0.0.1:{standalone.http_port}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{standalone.grpc_port}")
    try:
        ready_rows = client.get_model_repository_index()
        assert ready_rows and all("reason" not in row for row in ready_rows), ready_rows
        client.unload_model("linear")
        expected = "Request for unknown model: 'linear' has no available versions"
        for call in (lambda: client.infer("linear", _linear(1)),
                     lambda: client.get_model_metadata("linear"),
                     lambda: client.get_model_config("linear")):
            err = _error(call)
            assert err.status() == "404" and err.message().startswith(expected), err
        err = _error(lambda: client.infer("linear", _linear(1), model_version="1"))
        assert err.status() == "503"
        assert err.message() == "Request for unknown model: 'linear' version 1 is not at ready state"
        infer_input = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        infer_input.set_data_from_numpy(np.ones((1, 16), dtype=np.float32))
        err = _error(lambda: grpc.infer("linear", [infer_input]))
        assert err.status() == "StatusCode.NOT_FOUND" and expected in err.message()
        rows = {row["name"]: row for row in client.get_model_repository_index()}
        assert rows["linear"] == {"name": "linear", "version": "1", "state": "UNAVAILABLE",
                                  "reason": "unloaded"}
        assert rows["simple"] == {"name": "simple", "version": "1", "state": "READY"}
    finally:
        client.close()
        grpc.close()


def _control_repository(root: Path, models: int) -> Path:
    """'simple' (ONNX add/sub, max_batch_size 8 as in Triton's example repository) and
    identity models up to ``models`` in all: NVIDIA's model-control examples count them."""
    from onnx import TensorProto
    from onnx_models import add_sub, identity
    add_sub(root / "simple" / "1" / "model.onnx")
    (root / "simple" / "config.pbtxt").write_text('name: "simple"\nbackend: "onnxruntime"\n'
                                                   'max_batch_size: 8\n')
    for i in range(models - 1):
        identity(TensorProto.FLOAT, root / f"identity_{i}" / "1" / "model.onnx")
    return root


def test_the_model_control_examples_calls(tmp_path: Path):
    # simple_http_model_control.py and simple_grpc_model_control.py: the index counts every
    # model of the repository, loaded or not; load, ready, unload, not ready; a load of a model
    # not in the repository fails saying "failed to load"; over HTTP a config override that is
    # not JSON fails the same way, and a JSON one ('"16"' read as a number) takes effect
    import tritonclient.grpc as grpcclient
    from jupyter_triton.engine import EngineOptions
    from jupyter_triton.standalone import start_in_thread
    root = _control_repository(tmp_path / "models", 4)
    server = start_in_thread(EngineOptions(model_repository=root, model_control_mode="explicit"),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        assert len(http.get_model_repository_index()) == 4
        assert len(grpc.get_model_repository_index().models) == 4
        for client in (http, grpc):
            client.load_model("simple")
            assert client.is_model_ready("simple")
            if client is http:
                err = _error(lambda: http.load_model(
                    "simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}'))
                assert "failed to load" in err.message(), err
                http.load_model("simple", config='{"max_batch_size":"16"}')
                assert http.get_model_config("simple")["max_batch_size"] == 16
            client.unload_model("simple")
            assert not client.is_model_ready("simple")
            err = _error(lambda: client.load_model("wrong_model_name"))
            assert "failed to load" in err.message(), err
    finally:
        http.close()
        grpc.close()
        server.close()


@pytest.mark.parametrize("example, models, port", [
    ("simple_http_model_control.py", 7, "http_port"),
    ("simple_grpc_model_control.py", 8, "grpc_port"),
])
def test_nvidia_model_control_examples_run_unchanged(tmp_path: Path, example: str, models: int,
                                                     port: str):
    # They need Triton's load-error words ("failed to load") for a config that is not JSON
    # and for a model that is not in the repository, and a JSON config override; they count
    # the repository's models (7 over HTTP, 8 over gRPC).
    from jupyter_triton.engine import EngineOptions
    from jupyter_triton.standalone import start_in_thread
    from triton_example_models import published, run_published
    script = published("JUPYTER_TRITON_CLIENT_EXAMPLES", example)
    root = _control_repository(tmp_path / "models", models)
    server = start_in_thread(EngineOptions(model_repository=root, model_control_mode="explicit"),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    try:
        done = run_published(script, "-u", f"127.0.0.1:{getattr(server, port)}")
    finally:
        server.close()
    assert done.returncode == 0 and "PASS: model control" in done.stdout, done.stdout + done.stderr


def test_load_errors_speak_tritons_words(tmp_path: Path):
    # tritonserver 2.51's answers to the same loads: a model not in the repository and a
    # config that does not parse: "failed to load '<m>', failed to poll from model repository"
    # (Triton: 500; a client error is a 4xx here); no version under the policy: "load failed
    # for model '<m>': at least one version must be available ..." (400); a model whose
    # initialize raises: "load failed for model '<m>': version 1 is at UNAVAILABLE state: ..."
    # (400), while the index keeps the bare reason.
    root = tmp_path / "models"
    python_model(root, "raises", FAILING_MODEL_PY.replace(
        "    def execute(", "    def initialize(self, args):\n        raise RuntimeError('cannot initialize')\n\n    def execute("))
    python_model(root, "unparsable", FAILING_MODEL_PY)
    (root / "unparsable" / "config.pbtxt").write_text('name: "unparsable"\ninput [ { name: "X" ')
    python_model(root, "no_version", FAILING_MODEL_PY,
                 extra="version_policy { specific { versions: [ 3 ] } }")
    (root / "nothing_on_disk").mkdir()
    (root / "nothing_on_disk" / "config.pbtxt").write_text(
        (root / "raises" / "config.pbtxt").read_text().replace('"raises"', '"nothing_on_disk"'))
    server, client = serve(root, model_control_mode="explicit")
    try:
        for name, status in (("wrong_model_name", "404"), ("unparsable", "400")):
            err = _error(lambda: client.load_model(name))
            assert err.status() == status, err
            assert err.message().startswith(
                f"failed to load '{name}', failed to poll from model repository"), err
        err = _error(lambda: client.load_model("simple", config='"parameters": {"config": {{}}}'))
        assert err.message().startswith("failed to load 'simple', failed to poll"), err
        for name in ("no_version", "nothing_on_disk"):
            err = _error(lambda: client.load_model(name))
            assert err.status() == "400" and err.message().startswith(
                f"load failed for model '{name}': "), err
        err = _error(lambda: client.load_model("nothing_on_disk"))
        assert "at least one version must be available under the version policy of model " \
               "'nothing_on_disk'" in err.message()
        err = _error(lambda: client.load_model("raises"))
        assert err.status() == "400" and err.message().startswith(
            "load failed for model 'raises': version 1 is at UNAVAILABLE state: "), err
        assert "cannot initialize" in err.message()
        rows = {row["name"]: row for row in client.get_model_repository_index()}
        assert rows["raises"]["state"] == "UNAVAILABLE"
        assert not rows["raises"]["reason"].startswith("load failed"), rows["raises"]
    finally:
        client.close()
        server.close()


def test_statistics_of_an_unknown_model_or_version_say_what_triton_says(standalone):
    # tritonserver 2.51 (with 400; NotFound is a 404 here)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{standalone.http_port}")
    try:
        err = _error(lambda: client.get_inference_statistics("linear", "5"))
        assert (err.status(), err.message()) == (
            "404", "requested model version is not available for model 'linear'")
        err = _error(lambda: client.get_inference_statistics("nosuch"))
        assert (err.status(), err.message()) == ("404", "requested model 'nosuch' is not available")
        err = _error(lambda: client.get_inference_statistics("nosuch", "1"))
        assert err.message() == "requested model 'nosuch' is not available"
    finally:
        client.close()


def test_no_message_shows_doubled_braces():
    # "{{ decoupled: true }}" reached clients from a plain string written as if it were an
    # f-string; Triton's texts say "{ decoupled: true }". Every string literal of the package
    # that is not an f-string must not hold a doubled-brace config snippet.
    import io
    import re
    import tokenize
    import jupyter_triton
    snippet = re.compile(r"\{\{ *\w+ *:[^{}]*\}\}")   # "{{ key: value }}", not a dict in a docstring
    found = []
    for path in Path(jupyter_triton.__file__).parent.rglob("*.py"):
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type != tokenize.STRING:
                continue
            prefix = re.match(r"[A-Za-z]*", tok.string).group(0).lower()
            if "f" not in prefix and "{%" not in tok.string and snippet.search(tok.string):
                found.append(f"{path.name}:{tok.start[0]}")
    assert not found, found


def test_unloading_a_model_the_repository_lacks_is_a_no_op(standalone):
    # tritonserver 2.51 answers 200 (HTTP and gRPC); a name that is no model name stays a 400
    import tritonclient.grpc as grpcclient
    client = httpclient.InferenceServerClient(f"127.0.0.1:{standalone.http_port}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{standalone.grpc_port}")
    try:
        client.unload_model("nosuch")
        grpc.unload_model("nosuch")
        assert "nosuch" not in {row["name"] for row in client.get_model_repository_index()}
        assert client.is_model_ready("linear")
        err = _error(lambda: grpc.unload_model("../linear"))
        assert err.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        client.close()
        grpc.close()


def test_grpc_input_data_given_twice_is_refused_in_tritons_words():
    # tritonserver 2.51's gRPC front (infer_handler.cc), per input in order: typed contents
    # beside a shared memory region, then typed contents beside raw_input_contents
    from tritonclient.grpc import service_pb2
    from jupyter_triton.protocol.errors import InvalidArgument
    from jupyter_triton.frontends.grpc_codec import decode_grpc_request
    request = service_pb2.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, 2])
        tensor.contents.int_contents[:] = [1, 2]
    request.inputs[1].parameters["shared_memory_region"].string_param = "region"
    request.inputs[1].parameters["shared_memory_byte_size"].int64_param = 8
    with pytest.raises(InvalidArgument) as err:
        decode_grpc_request(request)
    assert str(err.value) == ("unexpected 'content' provided when using shared memory for "
                              "input tensor 'INPUT1' for model 'simple'")
    request.raw_input_contents.append(np.array([1, 2], np.int32).tobytes())
    with pytest.raises(InvalidArgument) as err:
        decode_grpc_request(request)
    assert str(err.value) == ("contents field must not be specified when using "
                              "raw_input_contents for 'INPUT0' for model 'simple'")
    del request.inputs[1].parameters["shared_memory_region"]
    request.inputs[1].ClearField("contents")
    request.inputs[0].ClearField("contents")
    with pytest.raises(InvalidArgument) as err:      # only then the count of raw entries
        decode_grpc_request(request)
    assert "expected 2 inputs but got 1 inputs in 'raw_input_contents'" in str(err.value)
