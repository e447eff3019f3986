"""What NVIDIA's example clients (triton-inference-server/client src/python/examples) ask of a
server, asked here the way they ask it: simple_http/grpc_health_metadata.py (the server's
name is "triton"), grpc_explicit_int_content_client.py and grpc_explicit_int8_content_client.py
(typed ``contents`` through the raw gRPC stub, then Triton's words for two client errors).

Their text is NVIDIA's and stays out of this repository: the calls are made here with
tritonclient and its stubs, and where $JUPYTER_TRITON_CLIENT_EXAMPLES names a folder holding
the published files, they also run unchanged against the same server."""
from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from jupyter_triton.engine import EngineOptions
from triton_example_models import published, run_published

pytestmark = pytest.mark.timeout(120)

# Triton's example repository's simple_int8 (INT8 add/sub: onnxruntime has no INT8 Add)
ADD_SUB_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
'''


def example_repository(root: Path) -> Path:
    """'simple' (INT32 [16] add/sub) and 'simple_int8', as the examples expect them."""
    from onnx import TensorProto
    from onnx_models import add_sub
    add_sub(root / "simple" / "1" / "model.onnx", dims=16, elem=TensorProto.INT32)
    (root / "simple" / "config.pbtxt").write_text(
        'name: "simple"\nbackend: "onnxruntime"\nmax_batch_size: 8\n')
    (root / "simple_int8" / "1").mkdir(parents=True)
    (root / "simple_int8" / "1" / "model.py").write_text(ADD_SUB_PY)
    def tensors(prefix: str) -> str:
        return ", ".join(f'{{ name: "{prefix}{i}" data_type: TYPE_INT8 dims: [ 16 ] }}'
                         for i in (0, 1))
    (root / "simple_int8" / "config.pbtxt").write_text(f'''
name: "simple_int8"
backend: "python"
max_batch_size: 8
input [ {tensors("INPUT")} ]
output [ {tensors("OUTPUT")} ]
parameters {{ key: "EXECUTION_MODE" value: {{ string_value: "thread" }} }}
''')
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from jupyter_triton.standalone import start_in_thread
    root = example_repository(tmp_path_factory.mktemp("examples") / "models")
    server = start_in_thread(EngineOptions(model_repository=root), host="127.0.0.1",
                             http_port=0, metrics_port=None, grpc_port=0)
    yield server
    server.close()


def test_health_and_metadata_as_simple_http_health_metadata_asks(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    try:
        assert client.is_server_live(query_params={"test_1": 1, "test_2": 2})
        assert client.is_server_ready() and client.is_model_ready("simple")
        metadata = client.get_server_metadata()
        assert metadata["name"] == "triton"
        # sequence ids work (tests/test_sequence.py): listed as Triton lists it
        assert {"sequence", "classification", "model_repository"} <= set(metadata["extensions"])
        model = client.get_model_metadata("simple", query_params={"test_1": 1, "test_2": 2})
        assert model["name"] == "simple"
        with pytest.raises(InferenceServerException) as err:
            client.get_model_metadata("wrong_model_name")
        assert "Request for unknown model" in err.value.message()
    finally:
        client.close()


def test_health_and_metadata_as_simple_grpc_health_metadata_asks(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        assert client.is_server_live(headers={"test": "1", "dummy": "2"})
        assert client.is_server_ready() and client.is_model_ready("simple")
        metadata = client.get_server_metadata()
        assert metadata.name == "triton" and "sequence" in metadata.extensions
        model = client.get_model_metadata("simple", headers={"test": "1", "dummy": "2"})
        assert model.name == "simple"
        with pytest.raises(InferenceServerException) as err:
            client.get_model_metadata("wrong_model_name")
        assert "Request for unknown model" in err.value.message()
        assert client.get_model_config("simple").config.name == "simple"
    finally:
        client.close()


def _typed_request(model: str, datatype: str) -> service_pb2.ModelInferRequest:
    """The examples' request: two [1, 16] inputs in ``int_contents``, both outputs asked."""
    request = service_pb2.ModelInferRequest(model_name=model, model_version="")
    for name, values in (("INPUT0", list(range(16))), ("INPUT1", [1] * 16)):
        tensor = request.inputs.add(name=name, datatype=datatype, shape=[1, 16])
        tensor.contents.int_contents[:] = values
    request.outputs.add(name="OUTPUT0")
    request.outputs.add(name="OUTPUT1")
    return request


@pytest.mark.parametrize("model, datatype, dtype", [("simple", "INT32", np.int32),
                                                    ("simple_int8", "INT8", np.int8)])
def test_typed_contents_through_the_raw_stub(server, model: str, datatype: str, dtype):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = _typed_request(model, datatype)
        response = stub.ModelInfer(request, timeout=30)
        sums, diffs = (np.frombuffer(raw, dtype=dtype).reshape(list(out.shape))
                       for raw, out in zip(response.raw_output_contents, response.outputs))
        x = np.arange(16)
        assert sums[0].tolist() == (x + 1).tolist() and diffs[0].tolist() == (x - 1).tolist()

        # grpc_explicit_int_content_client.py: one raw entry beside typed contents (two
        # inputs): Triton names the input that has both before it counts the raw entries
        request.raw_input_contents.extend([np.arange(8).tobytes()])
        request.inputs[0].contents.int_contents[:] = list(range(8, 16))
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (
            f"contents field must not be specified when using raw_input_contents for 'INPUT0' "
            f"for model '{model}'")

        # grpc_explicit_int8_content_client.py: a version that is not a number
        request = _typed_request(model, datatype)
        request.model_version = "wrong_specification"
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "failed to get model version from specified version string " \
               "'wrong_specification'" in err.value.details()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        try:        # the same words wherever a version is named
            for call in (client.is_model_ready, client.get_model_metadata,
                         client.get_model_config, client.get_inference_statistics):
                with pytest.raises(InferenceServerException) as refused:
                    call(model, model_version="wrong_specification")
                assert refused.value.status() == "StatusCode.INVALID_ARGUMENT", call
                assert "from specified version string 'wrong_specification'" in \
                    refused.value.message(), call
        finally:
            client.close()
        request.model_version = "-1"
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request, timeout=30)
        assert err.value.details() == ("invalid model version specified '-1' , version should "
                                       "be an integral value > 0")


# the published file -> (the port it is pointed at, the line that says it passed; None: its
# exit status says it)
EXAMPLES = {
    "simple_http_health_metadata.py": ("http_port", None),
    "simple_grpc_health_metadata.py": ("grpc_port", None),
    "grpc_explicit_int_content_client.py": ("grpc_port", "PASS: explicit int"),
    "grpc_explicit_int8_content_client.py": ("grpc_port", "PASS: explicit int8"),
}


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_published_example_runs_unchanged(server, example: str):
    path = published("JUPYTER_TRITON_CLIENT_EXAMPLES", example)
    port, line = EXAMPLES[example]
    done = run_published(path, "-u", f"127.0.0.1:{getattr(server, port)}")
    assert done.returncode == 0 and "FAILED" not in done.stdout, done.stdout + done.stderr
    assert line is None or line in done.stdout, done.stdout + done.stderr


def _refusals(port: int, model: str, datatype: str) -> list[tuple[str, str]]:
    """(status, details) of the examples' refused requests, as a server answers them."""
    answers = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        both = _typed_request(model, datatype)
        both.raw_input_contents.extend([np.arange(8).tobytes()])
        wrong, negative = _typed_request(model, datatype), _typed_request(model, datatype)
        wrong.model_version, negative.model_version = "wrong_specification", "-1"
        for request in (both, wrong, negative):
            try:
                stub.ModelInfer(request, timeout=30)
                answers.append(("OK", ""))
            except grpc.RpcError as err:
                answers.append((err.code().name, err.details()))
    return answers


def test_tritonserver_refuses_them_in_the_same_words(server, tmp_path: Path):
    from tritonserver_peer import TritonServer, tritonserver_dist
    tritonserver_dist()                 # skips with the reason where the venv is absent
    import shutil
    root = tmp_path / "models"
    shutil.copytree(Path(server.engine.options.model_repository) / "simple_int8",
                    root / "simple_int8", dirs_exist_ok=True)
    triton = TritonServer(root, tmp_path / "triton", load=["simple_int8"])
    try:
        theirs = _refusals(triton.grpc_port, "simple_int8", "INT8")
    finally:
        triton.close()
    ours = _refusals(server.grpc_port, "simple_int8", "INT8")
    assert ours == theirs and all(code == "INVALID_ARGUMENT" for code, _ in ours), (ours, theirs)
