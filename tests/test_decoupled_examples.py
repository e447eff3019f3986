"""What NVIDIA's decoupled examples ask of a server over a gRPC stream, asked the way they ask
it: python_backend examples/decoupled (repeat_int32 and square_int32, their clients) and
tritonclient's simple_grpc_custom_repeat.py, against our own models of the same behaviour
(tests/triton_example_models.py). The published files run unchanged only where
$JUPYTER_TRITON_BACKEND_EXAMPLES / $JUPYTER_TRITON_CLIENT_EXAMPLES name folders holding them
(see tests/triton_example_models.py)."""
from __future__ import annotations

import queue
import shutil

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread
from triton_example_models import (REPEAT_INT32_CONFIG, REPEAT_INT32_PY, SQUARE_INT32_CONFIG,
                                   SQUARE_INT32_PY, add_model, published, run_published)

pytestmark = pytest.mark.timeout(180)


def _serve(repo):
    return start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                         load_models=["*"]),
                           host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("models")
    add_model(repo, "repeat_int32", REPEAT_INT32_PY, REPEAT_INT32_CONFIG)
    add_model(repo, "square_int32", SQUARE_INT32_PY, SQUARE_INT32_CONFIG)
    served = _serve(repo)
    yield served
    served.close()


class Stream:
    """One gRPC stream of tritonclient; ``take(n)`` waits for the next n results in order."""

    def __init__(self, port: int) -> None:
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        self.results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def take(self, n: int) -> list:
        got = []
        for _ in range(n):
            result, error = self.results.get(timeout=60)
            assert error is None, error
            got.append(result)
        return got

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def _tensor(name: str, values, datatype: str) -> grpcclient.InferInput:
    array = np.array(values, dtype={"INT32": np.int32, "UINT32": np.uint32}[datatype])
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _repeat(values, delay_ms, wait_ms: int) -> list[grpcclient.InferInput]:
    return [_tensor("IN", values, "INT32"), _tensor("DELAY", delay_ms, "UINT32"),
            _tensor("WAIT", [wait_ms], "UINT32")]


def test_repeat_int32_answers_each_value_in_order_under_the_requests_id(server):
    # repeat_client.py: IN 4 2 0 1 with delays of 1 to 4 ms and WAIT 5 ms, OUT and IDX asked for
    stream = Stream(server.grpc_port)
    try:
        outputs = [grpcclient.InferRequestedOutput("OUT"), grpcclient.InferRequestedOutput("IDX")]
        stream.client.async_stream_infer("repeat_int32", _repeat([4, 2, 0, 1], [1, 2, 3, 4], 5),
                                         request_id="0", outputs=outputs)
        got = stream.take(4)
        assert [r.get_response().id for r in got] == ["0"] * 4
        assert [r.as_numpy("OUT").tolist() for r in got] == [[4], [2], [0], [1]]
        assert [r.as_numpy("IDX").tolist() for r in got] == [[0], [1], [2], [3]]
        # the final flag alone reaches no client that did not ask for it: the next thing on
        # the stream is the next request's first response
        stream.client.async_stream_infer("repeat_int32", _repeat([9], [0], 0), request_id="1",
                                         outputs=outputs)
        (after,) = stream.take(1)
        assert after.get_response().id == "1" and after.as_numpy("OUT").tolist() == [9]
    finally:
        stream.close()


def test_square_int32_answers_k_times_for_k_and_never_for_zero(server):
    # square_client.py: four requests on one stream, ids "0".."3", IN 4 2 0 1: 7 responses
    stream = Stream(server.grpc_port)
    try:
        values = [4, 2, 0, 1]
        for i, k in enumerate(values):
            stream.client.async_stream_infer("square_int32", [_tensor("IN", [k], "INT32")],
                                             request_id=str(i),
                                             outputs=[grpcclient.InferRequestedOutput("OUT")])
        by_id: dict[str, list] = {}
        for result in stream.take(sum(values)):
            by_id.setdefault(result.get_response().id, []).append(result.as_numpy("OUT").tolist())
        assert by_id == {"0": [[4]] * 4, "1": [[2]] * 2, "3": [[1]]}
    finally:
        stream.close()


def test_custom_repeat_streams_ten_responses_past_executes_return(server):
    # simple_grpc_custom_repeat.py: IN 100..109 from one request, only OUT asked for; its
    # delays (1 s each, execute returning after 1 s) shortened here to 50 ms and 120 ms: most
    # responses still come after execute returned
    stream = Stream(server.grpc_port)
    try:
        stream.client.async_stream_infer("repeat_int32",
                                         _repeat(list(range(100, 110)), [50] * 10, 120),
                                         outputs=[grpcclient.InferRequestedOutput("OUT")])
        got = stream.take(10)
        assert [r.as_numpy("OUT").tolist() for r in got] == [[v] for v in range(100, 110)]
        assert all(r.as_numpy("IDX") is None for r in got)      # only the output asked for
    finally:
        stream.close()


@pytest.fixture(scope="module")
def published_server(tmp_path_factory):
    """NVIDIA's decoupled models and configs, as published, served."""
    repo = tmp_path_factory.mktemp("published")
    for model, stem in (("repeat_int32", "repeat"), ("square_int32", "square")):
        (repo / model / "1").mkdir(parents=True)
        shutil.copy(published("JUPYTER_TRITON_BACKEND_EXAMPLES", f"decoupled/{stem}_model.py"),
                    repo / model / "1" / "model.py")
        shutil.copy(published("JUPYTER_TRITON_BACKEND_EXAMPLES", f"decoupled/{stem}_config.pbtxt"),
                    repo / model / "config.pbtxt")
    served = _serve(repo)
    yield served
    served.close()


@pytest.mark.parametrize("client", ["repeat_client.py", "square_client.py"])
def test_the_published_decoupled_example_passes(published_server, client, tmp_path):
    # the clients take no flags: only their address is changed, in a copy
    script = published("JUPYTER_TRITON_BACKEND_EXAMPLES", f"decoupled/{client}")
    done = run_published(script, workdir=tmp_path, addresses={
        'url="localhost:8001"': f'url="127.0.0.1:{published_server.grpc_port}"'})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"PASS: {client.replace('_client.py', '_int32')}" in done.stdout


def test_the_published_custom_repeat_client_passes(server):
    script = published("JUPYTER_TRITON_CLIENT_EXAMPLES", "simple_grpc_custom_repeat.py")
    done = run_published(script, "-u", f"127.0.0.1:{server.grpc_port}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "PASS: Decoupled API" in done.stdout
