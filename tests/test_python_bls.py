"""BLS: python models calling other served models with Triton's pb_utils API, through a
real standalone server, in the worker process and in thread mode. The calls of NVIDIA's BLS
examples (python_backend examples/bls and bls_decoupled) are made against our own models of
theirs; the published models and clients run unchanged only where
$JUPYTER_TRITON_BACKEND_EXAMPLES names a folder holding them (tests/triton_example_models.py)."""
from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import serve
from server_waits import wait_for_inferences
from test_backend_python import ADD_SUB_CONFIG, ADD_SUB_MODEL_PY, THREAD_MODE
from test_python_decoupled import REPEAT_CONFIG, REPEAT_MODEL_PY
from triton_example_models import (BLS_DECOUPLED_SYNC_PY, BLS_SYNC_PY, SQUARE_INT32_CONFIG,
                                   SQUARE_INT32_PY, TORCH_ADD_SUB_PY, add_model,
                                   published, run_published)

pytestmark = pytest.mark.timeout(180)

MODES = ["process", "thread"]

# examples/bls/config.pbtxt named as the README has it (TYPE_STRING: the TYPE_BYTES of one
# published version is not a DataType in model_config.proto)
BLS_SYNC_CONFIG = '''
name: "bls_sync"
backend: "python"
input [ { name: "MODEL_NAME" data_type: TYPE_STRING dims: [ 1 ] } ]
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
input [ { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [{ kind: KIND_CPU }]
'''

# examples/pytorch/config.pbtxt
PYTORCH_CONFIG = '''
name: "pytorch"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
input [ { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [{ kind: KIND_CPU }]
'''

# Calls the decoupled "repeat" model in every way pb_utils offers and reports what it got.
CALLER_MODEL_PY = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        out = []
        for r in requests:
            how = pb_utils.get_input_tensor_by_name(r, "HOW").as_numpy().reshape(-1)[0].decode()
            values = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().reshape(-1)
            target = "missing_model" if how == "missing" else "repeat"
            call = pb_utils.InferenceRequest(
                model_name=target, requested_output_names=["OUT"],
                inputs=[pb_utils.Tensor("CMD", np.array([b"go"], dtype=np.object_)),
                        pb_utils.Tensor("IN", values)])
            if how == "stream":
                responses = list(call.exec(decoupled=True))
            elif how == "async_stream":
                responses = list(await call.async_exec(decoupled=True))
            elif how == "first_only":    # stops reading: the rest must not pile up anywhere
                stream = call.exec(decoupled=True)
                responses = [next(iter(stream))]
                del stream
            else:                        # "plain", "missing": one response expected
                responses = [call.exec()]
            summary = {
                "outputs": [[t.name(), t.as_numpy().tolist()] for resp in responses
                            for t in resp.output_tensors()],
                "counts": [len(resp.output_tensors()) for resp in responses],
                "errors": [resp.error().message() if resp.has_error() else None for resp in responses]}
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "SUMMARY", np.array([json.dumps(summary).encode()], dtype=np.object_))]))
        return out
'''

CALLER_CONFIG = '''
name: "caller"
backend: "python"
input [
  { name: "HOW" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }
]
output [{ name: "SUMMARY" data_type: TYPE_STRING dims: [ 1 ] }]
'''


def _add_sub_inputs(callee: str, a: np.ndarray, b: np.ndarray) -> list[httpclient.InferInput]:
    inputs = [httpclient.InferInput("INPUT0", [4], "FP32"), httpclient.InferInput("INPUT1", [4], "FP32"),
              httpclient.InferInput("MODEL_NAME", [1], "BYTES")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    inputs[2].set_data_from_numpy(np.array([callee], dtype=np.object_))
    return inputs


@pytest.mark.parametrize("mode", MODES)
def test_the_bls_sync_examples_calls(tmp_path, mode):
    # examples/bls sync_client.py: bls_sync passes two random FP32 [4] inputs on to the model
    # its MODEL_NAME names (add_sub, then the torch model "pytorch") and answers their sum and
    # difference; naming a model that is not there fails the request with the callee's error
    repo = tmp_path / "models"
    add_model(repo, "add_sub", textwrap.dedent(ADD_SUB_MODEL_PY), ADD_SUB_CONFIG)
    add_model(repo, "pytorch", TORCH_ADD_SUB_PY, PYTORCH_CONFIG)
    add_model(repo, "bls_sync", BLS_SYNC_PY, BLS_SYNC_CONFIG + (THREAD_MODE if mode == "thread" else ""))
    server, client = serve(repo, model_control_mode="explicit", load_models=["*"])
    try:
        rng = np.random.default_rng(7)
        a, b = rng.random(4, dtype=np.float32), rng.random(4, dtype=np.float32)
        outputs = [httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("OUTPUT1")]
        for callee in ("add_sub", "pytorch"):
            result = client.infer("bls_sync", _add_sub_inputs(callee, a, b), request_id="1",
                                  outputs=outputs)
            np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
            np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)
        with pytest.raises(InferenceServerException) as err:
            client.infer("bls_sync", _add_sub_inputs("undefined_model", a, b), request_id="1",
                         outputs=outputs)
        assert "undefined_model" in err.value.message()
        # each BLS request is counted by the model it reached, as Triton counts it
        for name in ("add_sub", "pytorch"):
            stats = client.get_inference_statistics(name)["model_stats"][0]
            assert stats["inference_count"] == 1, (name, stats)
    finally:
        server.close()


@pytest.mark.parametrize("mode", MODES)
def test_nvidias_bls_sync_example_runs_unchanged(tmp_path, mode):
    pytorch, bls_sync, script = (published("JUPYTER_TRITON_BACKEND_EXAMPLES", name) for name in (
        "pytorch/model.py", "bls/sync_model.py", "bls/sync_client.py"))
    repo = tmp_path / "models"
    add_model(repo, "add_sub", textwrap.dedent(ADD_SUB_MODEL_PY), ADD_SUB_CONFIG)
    add_model(repo, "pytorch", pytorch.read_text(), PYTORCH_CONFIG)
    add_model(repo, "bls_sync", bls_sync.read_text(),
              BLS_SYNC_CONFIG + (THREAD_MODE if mode == "thread" else ""))
    server, client = serve(repo, model_control_mode="explicit", load_models=["*"])
    try:
        # The client has no address flag: only its address is changed, in a copy.
        run = run_published(script, workdir=tmp_path, addresses={
            '"localhost:8000"': f'"127.0.0.1:{server.http_port}"'})
        assert run.returncode == 0, run.stdout + run.stderr
        assert "PASS: BLS Sync" in run.stdout
        # the undefined model's error came back as the BLS response's error, named
        assert "undefined_model" in run.stdout.split("'undefined' model result")[1]
        # each BLS request is counted by the model it reached, as Triton counts it
        for name in ("add_sub", "pytorch"):
            stats = client.get_inference_statistics(name)["model_stats"][0]
            assert stats["inference_count"] == 1, (name, stats)
    finally:
        server.close()


@pytest.fixture(params=MODES)
def caller(request, tmp_path):
    repo = tmp_path / "models"
    add_model(repo, "repeat", textwrap.dedent(REPEAT_MODEL_PY), REPEAT_CONFIG)
    add_model(repo, "caller", textwrap.dedent(CALLER_MODEL_PY),
              CALLER_CONFIG + (THREAD_MODE if request.param == "thread" else ""))
    server, client = serve(repo, model_control_mode="explicit", load_models=["*"])
    yield client
    server.close()


def call(client: httpclient.InferenceServerClient, how: str, values: list[int]) -> dict:
    inputs = [httpclient.InferInput("HOW", [1], "BYTES"), httpclient.InferInput("IN", [len(values)], "INT32")]
    inputs[0].set_data_from_numpy(np.array([how.encode()], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array(values, dtype=np.int32))
    return json.loads(client.infer("caller", inputs).as_numpy("SUMMARY")[0])


@pytest.mark.parametrize("how", ["stream", "async_stream"])
def test_a_decoupled_bls_call_yields_every_response_and_the_empty_final_one(caller, how):
    got = call(caller, how, [5, 6, 7])
    assert got["outputs"] == [["OUT", [5]], ["OUT", [6]], ["OUT", [7]]]   # only the requested output
    assert got["counts"] == [1, 1, 1, 0]          # Triton's last, empty response
    assert got["errors"] == [None] * 4
    assert call(caller, how, [])["counts"] == [0]  # zero responses: only the final one


def test_bls_errors_come_back_in_the_response(caller):
    missing = call(caller, "missing", [1])
    assert missing["counts"] == [0] and "missing_model" in missing["errors"][0]
    plain = call(caller, "plain", [1])
    assert plain["counts"] == [0]
    assert "decoupled" in plain["errors"][0]      # use exec(decoupled=True) for such a model


def test_a_bls_stream_dropped_early_leaves_the_server_serving(caller):
    for _ in range(3):
        got = call(caller, "first_only", [1, 2, 3, 4])
        assert got["outputs"] == [["OUT", [1]]]
    assert call(caller, "stream", [9])["outputs"] == [["OUT", [9]]]


BLS_DECOUPLED_SYNC_CONFIG = '''
name: "bls_decoupled_sync"
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [{ kind: KIND_CPU }]
'''


@pytest.mark.parametrize("mode", MODES)
def test_the_bls_decoupled_sync_examples_calls(tmp_path, mode):
    # examples/bls_decoupled sync_client.py: for IN 4 2 0 1 (one request each), the sum of
    # square_int32's streamed answers is IN squared (0: no answer but the final flag)
    repo = tmp_path / "models"
    add_model(repo, "square_int32", SQUARE_INT32_PY, SQUARE_INT32_CONFIG)
    add_model(repo, "bls_decoupled_sync", BLS_DECOUPLED_SYNC_PY,
              BLS_DECOUPLED_SYNC_CONFIG + (THREAD_MODE if mode == "thread" else ""))
    server, client = serve(repo, model_control_mode="explicit", load_models=["*"])
    try:
        for k in (4, 2, 0, 1):
            tensor = httpclient.InferInput("IN", [1], "INT32")
            tensor.set_data_from_numpy(np.array([k], dtype=np.int32))
            result = client.infer("bls_decoupled_sync", [tensor], request_id="1",
                                  outputs=[httpclient.InferRequestedOutput("SUM")])
            assert result.as_numpy("SUM").tolist() == [k * k]
        stats = wait_for_inferences(client, "square_int32", 4)
        assert stats["inference_count"] == 4   # each BLS stream counted by the model it reached
    finally:
        server.close()


@pytest.mark.parametrize("mode", MODES)
def test_nvidias_bls_decoupled_sync_example_runs_unchanged(tmp_path, mode):
    square, square_config, bls, script = (published("JUPYTER_TRITON_BACKEND_EXAMPLES", name) for name in (
        "decoupled/square_model.py", "decoupled/square_config.pbtxt", "bls_decoupled/sync_model.py",
        "bls_decoupled/sync_client.py"))
    repo = tmp_path / "models"
    add_model(repo, "square_int32", square.read_text(), square_config.read_text())
    add_model(repo, "bls_decoupled_sync", bls.read_text(),
              BLS_DECOUPLED_SYNC_CONFIG + (THREAD_MODE if mode == "thread" else ""))
    server, client = serve(repo, model_control_mode="explicit", load_models=["*"])
    try:
        run = run_published(script, workdir=tmp_path, addresses={
            '"localhost:8000"': f'"127.0.0.1:{server.http_port}"'})
        assert run.returncode == 0, run.stdout + run.stderr
        assert "PASS: BLS Decoupled Sync" in run.stdout
        stats = wait_for_inferences(client, "square_int32", 4)
        assert stats["inference_count"] == 4   # each BLS stream counted by the model it reached
    finally:
        server.close()


ECHO_MODEL_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)])
                for r in requests]
'''

ECHO_CONFIG = '''
name: "echo"
backend: "python"
input [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]
output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]
'''

# Decoupled: two big responses per request.
HALVES_MODEL_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            sender = r.get_response_sender()
            for part in np.array_split(x, 2):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", part + 1)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

HALVES_CONFIG = '''
name: "halves"
backend: "python"
model_transaction_policy { decoupled: true }
input [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]
output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]
'''

BIG_CALLER_MODEL_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X")
            doubled = pb_utils.InferenceRequest(model_name="echo", inputs=[x],
                                                requested_output_names=["Y"]).exec()
            if doubled.has_error():
                raise pb_utils.TritonModelException(doubled.error().message())
            parts = [pb_utils.get_output_tensor_by_name(resp, "Y").as_numpy()
                     for resp in pb_utils.InferenceRequest(model_name="halves", inputs=[x],
                                                           requested_output_names=["Y"]).exec(decoupled=True)
                     if resp.output_tensors()]
            y = pb_utils.get_output_tensor_by_name(doubled, "Y").as_numpy() + np.concatenate(parts)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return out
'''

BIG_CALLER_CONFIG = '''
name: "big_caller"
backend: "python"
input [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]
output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]
'''


def our_segments() -> set[str]:
    import os
    from jupyter_triton.backends.python.shm import segment_prefix
    return {n for n in os.listdir("/dev/shm") if n.startswith(segment_prefix())}


@pytest.mark.parametrize("mode", MODES)
def test_large_tensors_cross_bls_and_decoupled_responses_whole(tmp_path, mode):
    repo = tmp_path / "models"
    extra = THREAD_MODE if mode == "thread" else ""
    add_model(repo, "echo", textwrap.dedent(ECHO_MODEL_PY), ECHO_CONFIG + extra)
    add_model(repo, "halves", textwrap.dedent(HALVES_MODEL_PY), HALVES_CONFIG + extra)
    add_model(repo, "big_caller", textwrap.dedent(BIG_CALLER_MODEL_PY), BIG_CALLER_CONFIG + extra)
    server, client = serve(repo, model_control_mode="explicit", load_models=["*"])
    at_start = our_segments()
    try:
        x = np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32)   # 4 MB
        inp = httpclient.InferInput("X", [x.size], "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        batches = None
        for _ in range(3):
            y = client.infer("big_caller", [inp]).as_numpy("Y")
            np.testing.assert_allclose(y, x * 2 + (x + 1), rtol=1e-6, atol=1e-6)
            # each region lent for the way there and back is given back; the regions of the
            # batches (two per worker, one for a decoupled one's inputs) stay for the next
            if batches is None:
                batches = our_segments()
            assert our_segments() == batches
    finally:
        server.close()
    assert our_segments() - at_start == set()


IDLE_CALLER_MODEL_PY = '''
import threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        def later():
            time.sleep(0.2)   # initialize has returned: no batch runs
            try:
                pb_utils.InferenceRequest(model_name="echo", inputs=[], requested_output_names=[]).exec()
                pb_utils.Logger.log_info("idle call: answered")
            except pb_utils.TritonModelException as err:
                pb_utils.Logger.log_error("idle call: " + str(err))
        threading.Thread(target=later, daemon=True).start()

    def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for _ in requests]
'''


def test_a_bls_call_between_batches_of_a_plain_model_fails_clearly_not_forever(tmp_path):
    from test_backend_python import loaded, write_model
    from test_python_logs import wait_for
    config, files = write_model(tmp_path, "idle_caller", IDLE_CALLER_MODEL_PY, CALLER_CONFIG.replace(
        '"caller"', '"idle_caller"'))
    with loaded(config, files) as backend:
        model_logs = backend.calls.logs.lines
        wait_for(lambda: any(e["message"].startswith("idle call:") for e in model_logs("idle_caller")), 10)
    line = next(e for e in model_logs("idle_caller") if e["message"].startswith("idle call:"))
    assert "between batches gets no answer" in line["message"] and "decoupled" in line["message"]
