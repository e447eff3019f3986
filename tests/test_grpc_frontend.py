"""The gRPC frontend, called with the unmodified tritonclient.grpc client, over a fake engine
that implements the Engine API with a numpy identity model (the real engine has its own
end-to-end tests)."""
from __future__ import annotations

import asyncio
import queue
import threading
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from jupyter_triton.engine import EngineOptions
from jupyter_triton.engine.shared_memory import SharedMemoryRegistry
from jupyter_triton.frontends.grpc import start_grpc_server
from jupyter_triton.protocol.errors import InvalidArgument, NotFound
from jupyter_triton.engine.observation.trace import Tracing
from jupyter_triton.protocol.types import InferRequest, InferResponse, InferTensor


class FakeEngine:
    """The Engine API over one model, 'identity': OUTPUTn = INPUTn for any datatype."""

    def __init__(self) -> None:
        self.options = EngineOptions(model_repository=Path("unused"))   # the limits it serves with
        self.tracing = Tracing()        # the engine's, off (engine/observation/trace.py)
        self.loaded: list[tuple] = []
        self.unloaded: list[tuple] = []
        self.seen: list[InferRequest] = []
        self.shared_memory = SharedMemoryRegistry()

    def _check(self, name: str) -> None:
        if name not in ("identity", "boom"):
            raise NotFound(f"Request for unknown model: '{name}' is not found")

    async def infer(self, request: InferRequest) -> InferResponse:
        self._check(request.model_name)
        self.seen.append(request)
        if request.model_name == "boom":
            raise RuntimeError("backend exploded")
        outputs = []
        for t in request.inputs:
            if not t.name.startswith("INPUT"):
                raise InvalidArgument(
                    f"unexpected inference input '{t.name}' for model '{request.model_name}'")
            outputs.append(InferTensor(name="OUTPUT" + t.name[5:], datatype=t.datatype,
                                       shape=t.shape, data=np.array(t.data)))
        if request.outputs is not None:
            wanted = {o.name for o in request.outputs}
            outputs = [o for o in outputs if o.name in wanted]
        await asyncio.sleep(0)
        return InferResponse(model_name=request.model_name, model_version="1", id=request.id,
                             outputs=outputs)

    async def infer_stream(self, request: InferRequest):
        """The Engine contract for a model that is not decoupled: its one response."""
        yield await self.infer(request)

    def is_decoupled(self, model: str, version: str = "") -> bool:
        self._check(model)
        return False

    def server_metadata(self) -> dict:
        return {"name": "triton", "version": "2.51.0", "extensions": ["binary_tensor_data"]}

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    def model_ready(self, name: str, version: str = "") -> bool:
        return name == "identity"

    def model_metadata(self, name: str, version: str = "") -> dict:
        self._check(name)
        return {"name": name, "versions": ["1"], "platform": "onnxruntime_onnx",
                "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}],
                "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 4]}]}

    def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        self._check(name)
        return mc.ModelConfig(
            name=name, platform="onnxruntime_onnx", max_batch_size=8,
            input=[mc.ModelInput(name="INPUT0", data_type=mc.TYPE_FP32, dims=[4])],
            output=[mc.ModelOutput(name="OUTPUT0", data_type=mc.TYPE_FP32, dims=[4])])

    def repository_index(self, ready_only: bool = False) -> list[dict]:
        models = [{"name": "identity", "version": "1", "state": "READY", "reason": ""},
                  {"name": "broken", "version": "1", "state": "UNAVAILABLE",
                   "reason": "failed to load"}]
        return [m for m in models if m["state"] == "READY"] if ready_only else models

    async def load_model(self, name: str, config: str | None = None,
                         files: dict[str, bytes] | None = None, parameters: dict | None = None) -> None:
        self.loaded.append((name, config, files))

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        self._check(name)
        self.unloaded.append((name, unload_dependents))

    def statistics(self, name: str = "", version: str = "", history: bool = False) -> dict:
        return {"model_stats": [{
            "name": "identity", "version": "1", "last_inference": 17, "inference_count": 3,
            "execution_count": 2, "not_a_triton_field": {"x": 1},
            "inference_stats": {"success": {"count": 3, "ns": 3000},
                                "queue": {"count": 3, "ns": 300}},
            "batch_stats": []}]}


@pytest.fixture(scope="module")
def served():
    """The gRPC server over FakeEngine, its loop in a background thread."""
    engine = FakeEngine()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server, port = asyncio.run_coroutine_threadsafe(
        start_grpc_server(engine, "127.0.0.1", 0), loop).result(timeout=30)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        yield engine, client, port
    finally:
        client.close()
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


def _input(name: str, arr: np.ndarray, datatype: str) -> grpcclient.InferInput:
    inp = grpcclient.InferInput(name, list(arr.shape), datatype)
    inp.set_data_from_numpy(arr)
    return inp


def test_health_and_metadata(served):
    engine, client, port = served
    assert port > 0
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("identity")
    assert not client.is_model_ready("nope")
    meta = client.get_server_metadata()
    assert meta.name == "triton" and meta.version == "2.51.0"
    assert list(meta.extensions) == ["binary_tensor_data"]
    mmeta = client.get_model_metadata("identity", as_json=True)
    assert mmeta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": ["-1", "4"]}]
    assert mmeta["platform"] == "onnxruntime_onnx"


def test_model_config_is_the_proto(served):
    _, client, _ = served
    cfg = client.get_model_config("identity").config
    assert cfg.max_batch_size == 8
    assert cfg.input[0].name == "INPUT0" and cfg.input[0].data_type == mc.TYPE_FP32


@pytest.mark.parametrize("datatype,arr", [
    ("FP32", np.arange(8, dtype=np.float32).reshape(2, 4)),
    ("FP16", np.array([[0.5, -1.25]], dtype=np.float16)),
    ("FP64", np.array([1e300, -2.5])),
    ("INT8", np.array([-128, 127], dtype=np.int8)),
    ("UINT64", np.array([2**64 - 1, 0], dtype=np.uint64)),
    ("BOOL", np.array([[True, False, True]])),
    ("BF16", np.array([1.5, -2.0, 3.140625], dtype=ml_dtypes.bfloat16)),
    ("BYTES", np.array([[b"hello", b"\xff\x00 raw", b""]], dtype=np.object_)),
])
def test_infer_round_trips_every_datatype(served, datatype, arr):
    _, client, _ = served
    result = client.infer("identity", [_input("INPUT0", arr, datatype)], request_id="req-7")
    out = result.as_numpy("OUTPUT0")
    assert out.shape == arr.shape
    if datatype == "BF16":
        np.testing.assert_array_equal(out.astype(np.float32), arr.astype(np.float32))
    else:
        np.testing.assert_array_equal(out, arr)
    response = result.get_response()
    assert response.id == "req-7" and response.model_name == "identity"
    assert response.outputs[0].datatype == datatype


def test_infer_requested_outputs_and_parameters(served):
    engine, client, _ = served
    a = np.ones((1, 4), np.float32)
    b = np.zeros((1, 2), np.int32)
    result = client.infer("identity", [_input("INPUT0", a, "FP32"), _input("INPUT1", b, "INT32")],
                          outputs=[grpcclient.InferRequestedOutput("OUTPUT1")],
                          priority=2, timeout=1000, parameters={"user_key": "v", "n": 3})
    assert result.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), b)
    seen = engine.seen[-1]
    assert [o.name for o in seen.outputs] == ["OUTPUT1"]
    assert seen.parameters["priority"] == 2 and seen.parameters["timeout"] == 1000
    assert seen.parameters["user_key"] == "v" and seen.parameters["n"] == 3


def test_errors_carry_their_status(served):
    _, client, _ = served
    arr = np.ones((1, 4), np.float32)
    with pytest.raises(InferenceServerException) as e:
        client.infer("nope", [_input("INPUT0", arr, "FP32")])
    assert e.value.status() == "StatusCode.NOT_FOUND"
    assert "nope" in e.value.message()

    with pytest.raises(InferenceServerException) as e:
        client.infer("identity", [_input("WRONG", arr, "FP32")])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "WRONG" in e.value.message()

    with pytest.raises(InferenceServerException) as e:
        client.infer("boom", [_input("INPUT0", arr, "FP32")])
    assert e.value.status() == "StatusCode.INTERNAL"
    assert "backend exploded" in e.value.message() and "Traceback" not in e.value.message()


def test_malformed_raw_contents_is_invalid_argument(served):
    """A request whose byte count does not match its shape is refused before it is used."""
    _, _, port = served
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    request = service_pb2.ModelInferRequest(model_name="identity")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1_000_000_000, 1_000_000_000])
    request.raw_input_contents.append(b"\0" * 16)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(request, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "INPUT0" in e.value.details()


def test_stream_infer_answers_each_request_and_errors_on_the_stream(served):
    _, client, _ = served
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i in range(5):
            arr = np.full((1, 4), i, np.float32)
            client.async_stream_infer("identity", [_input("INPUT0", arr, "FP32")],
                                      request_id=str(i))
        client.async_stream_infer("nope", [_input("INPUT0", np.ones((1, 4), np.float32), "FP32")],
                                  request_id="bad")
        got = [results.get(timeout=10) for _ in range(6)]
    finally:
        client.stop_stream()
    errors = [e for r, e in got if e is not None]
    answers = {r.get_response().id: r.as_numpy("OUTPUT0") for r, e in got if e is None}
    assert len(errors) == 1 and "nope" in errors[0].message()
    assert sorted(answers) == ["0", "1", "2", "3", "4"]
    for i in range(5):
        np.testing.assert_array_equal(answers[str(i)], np.full((1, 4), i, np.float32))


def test_statistics_ignore_unknown_fields(served):
    _, client, _ = served
    stats = client.get_inference_statistics("identity")
    s = stats.model_stats[0]
    assert s.name == "identity" and s.inference_count == 3 and s.execution_count == 2
    assert s.inference_stats.success.count == 3 and s.inference_stats.queue.ns == 300


def test_repository_index_load_and_unload(served):
    engine, client, _ = served
    index = client.get_model_repository_index()
    assert [(m.name, m.state) for m in index.models] == [("identity", "READY"),
                                                          ("broken", "UNAVAILABLE")]
    assert index.models[1].reason == "failed to load"

    client.load_model("new", config='{"backend": "python"}',
                      files={"file:1/model.py": b"print('hi')"})
    assert engine.loaded[-1] == ("new", '{"backend": "python"}', {"file:1/model.py": b"print('hi')"})

    client.unload_model("identity", unload_dependents=True)
    assert engine.unloaded[-1] == ("identity", True)
    with pytest.raises(InferenceServerException) as e:
        client.unload_model("nope")
    assert e.value.status() == "StatusCode.NOT_FOUND"


def test_cuda_shared_memory_is_refused_without_a_gpu(served):
    _, client, _ = served
    assert not client.get_system_shared_memory_status().regions
    client.unregister_cuda_shared_memory()          # nothing registered: nothing to do
    with pytest.raises(InferenceServerException) as e:
        client.register_cuda_shared_memory("r", b"\0" * 64, 0, 64)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "GPUs not supported" in e.value.message()
