"""A decoupled python model's ``async def execute`` (Triton's python_backend 24.04+, "Async
Execute"): its coroutine runs on an event loop of the model instance's own that keeps
running after execute returns, so a task it started answers later through the request's
response sender; the next request's execute runs while that task waits; unload cancels what
is still pending, bounded. Through a standalone server and tritonclient's gRPC stream, in
process and thread mode."""
from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from server_waits import started, wait_for_start, wait_until
from test_decoupled_examples import _serve as serve
from triton_example_models import add_model

pytestmark = pytest.mark.timeout(180)

MODES = ["process", "thread"]

ASYNC_MODEL_PY = '''
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.gate = None
        self.tasks = set()

    async def execute(self, requests):
        if self.gate is None:   # made on the loop execute runs on
            self.gate = asyncio.Event()
        for request in requests:
            cmd = pb_utils.get_input_tensor_by_name(request, "CMD").as_numpy().reshape(-1)[0]
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)[0]
            task = asyncio.ensure_future(self.respond(request.get_response_sender(), cmd, value))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return None

    async def respond(self, sender, cmd, value):
        out = value * 2
        if cmd == b"later":
            await asyncio.sleep(0.05)
        elif cmd == b"wait_gate":
            await self.gate.wait()   # opened only by a later request's execute
        elif cmd == b"open_gate":
            self.gate.set()
        elif cmd == b"hold":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                out = -1
                sender.send(pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", np.array([out], np.int32))]), flags=FINAL)
                raise
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([out], np.int32))]),
                    flags=FINAL)
'''

CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "CMD" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }}
]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
parameters {{ key: "EXECUTION_MODE" value: {{ string_value: "{mode}" }} }}
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("models")
    for mode in MODES:
        for name in (f"async_{mode}", f"async_unload_{mode}"):
            add_model(repo, name, ASYNC_MODEL_PY, CONFIG.format(name=name, mode=mode))
    served = serve(repo)
    yield served
    served.close()


class Stream:
    """One gRPC stream; ``take(n)`` waits for the next n answers (result or error)."""

    def __init__(self, port: int) -> None:
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        self.answers: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.answers.put((result, error)))

    def send(self, model: str, cmd: bytes, value: int, request_id: str) -> None:
        command = grpcclient.InferInput("CMD", [1], "BYTES")
        command.set_data_from_numpy(np.array([cmd], dtype=object))
        number = grpcclient.InferInput("IN", [1], "INT32")
        number.set_data_from_numpy(np.array([value], np.int32))
        self.client.async_stream_infer(model, [command, number], request_id=request_id)

    def take(self, n: int, seconds: float = 10) -> list:
        got = []
        for _ in range(n):
            try:
                got.append(self.answers.get(timeout=seconds))
            except queue.Empty:
                raise AssertionError(f"{len(got)} of {n} answers within {seconds:g} s") from None
        return got

    def close(self) -> None:
        # cancel what is still open: a request left unanswered (the failure tested for)
        # would otherwise keep the stream, and the test, waiting
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def _outputs(answers: list) -> dict[str, list]:
    for _, error in answers:
        assert error is None, error
    return {result.get_response().id: result.as_numpy("OUT").tolist() for result, _ in answers}


@pytest.mark.parametrize("mode", MODES)
def test_a_task_started_by_async_execute_answers_after_execute_returned(server, mode):
    stream = Stream(server.grpc_port)
    try:
        stream.send(f"async_{mode}", b"later", 21, "a")
        assert _outputs(stream.take(1)) == {"a": [42]}
        stream.send(f"async_{mode}", b"later", 5, "b")     # the same loop serves the next one
        assert _outputs(stream.take(1)) == {"b": [10]}
    finally:
        stream.close()


@pytest.mark.parametrize("mode", MODES)
def test_the_next_execute_runs_while_the_first_requests_task_waits(server, mode):
    # the first request's task waits for a gate only the second request's task opens: both
    # answer only if the second execute ran while the first task was pending (one instance)
    stream = Stream(server.grpc_port)
    try:
        stream.send(f"async_{mode}", b"wait_gate", 1, "first")
        stream.send(f"async_{mode}", b"open_gate", 2, "second")
        assert _outputs(stream.take(2)) == {"first": [2], "second": [4]}
    finally:
        stream.close()


@pytest.mark.parametrize("mode", MODES)
def test_unload_cancels_a_pending_task_and_returns(server, mode):
    model = f"async_unload_{mode}"
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=60)
    stream = Stream(server.grpc_port)
    try:
        before = started(http, model)
        stream.send(model, b"hold", 7, "held")
        wait_for_start(http, model, before)
        http.unload_model(model)
        wait_until(lambda: not http.is_model_ready(model), f"{model} unloaded")
        # the held request is answered, not left open: the model's own answer on cancel, or
        # the server's error when the instance went away first
        (answer,) = stream.take(1, seconds=30)
        result, error = answer
        assert error is not None or result.as_numpy("OUT").tolist() == [-1]
    finally:
        stream.close()
        http.close()
