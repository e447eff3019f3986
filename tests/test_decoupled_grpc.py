"""gRPC ModelStreamInfer over a decoupled python model, with tritonclient's stream: many responses per request, Triton's
``triton_final_response`` parameter and (when asked) the empty final response, the request
id on every response, errors in-stream without closing it, a client that goes away cancelling
the model's request; unary ModelInfer and HTTP infer refused with Triton's reason."""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from decoupled_models import write_echo, write_flood, write_words
from jupyter_triton.engine import Engine, EngineOptions
from jupyter_triton.frontends.grpc import start_grpc_server

TIMEOUT_S = 30


class Served:
    """A real engine with the words and echo models, and its gRPC port."""

    def __init__(self, repo) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = Engine(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                           load_models=["words", "echo", "flood"]))
        self._run(self.engine.start())
        self.server, self.port = self._run(
            start_grpc_server(self.engine, "127.0.0.1", 0))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def client(self) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(f"127.0.0.1:{self.port}")

    def close(self) -> None:
        self._run(self.server.stop(None))
        self._run(self.engine.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = write_flood(write_echo(write_words(tmp_path_factory.mktemp("models"))))
    server = Served(repo)
    yield server
    server.close()


def _text(prompt: str, batched: bool = False) -> list[grpcclient.InferInput]:
    shape = [1, 1] if batched else [1]
    inp = grpcclient.InferInput("text_input", shape, "BYTES")
    inp.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_).reshape(shape))
    return [inp]


class Stream:
    """tritonclient's stream with a queue of (result, error)."""

    def __init__(self, served: Served) -> None:
        self.client = served.client()
        self.results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def next(self):
        return self.results.get(timeout=TIMEOUT_S)

    def until_final(self, request_id: str, limit: int = 50) -> list:
        """Every (result, error) up to the final response of ``request_id``."""
        got = []
        for _ in range(limit):
            result, error = self.next()
            got.append((result, error))
            if result is not None:
                response = result.get_response()
                if response.id == request_id and \
                        response.parameters["triton_final_response"].bool_param:
                    return got
        raise AssertionError(f"no final response for {request_id} in {limit} responses: {got}")

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def test_many_responses_per_request_with_the_final_flag(served):
    stream = Stream(served)
    try:
        stream.client.async_stream_infer("words", _text("one two three"), request_id="r1",
                                         enable_empty_final_response=True)
        got = stream.until_final("r1")
    finally:
        stream.close()
    assert all(error is None for _, error in got)
    responses = [result.get_response() for result, _ in got]
    assert [r.id for r in responses] == ["r1"] * 4
    assert [r.parameters["triton_final_response"].bool_param for r in responses] == \
        [False, False, False, True]
    words = [result.as_numpy("text_output") for result, _ in got]
    assert [w.tolist() for w in words[:3]] == [[b"one"], [b"two"], [b"three"]]
    assert words[3] is None                     # the empty final response: no outputs
    assert responses[3].model_name == "words"


def test_without_the_empty_final_response_the_words_come_alone(served):
    stream = Stream(served)
    try:
        stream.client.async_stream_infer("words", _text("alpha beta"), request_id="q")
        first, second = stream.next(), stream.next()
        # a request on the same stream after it: its responses follow, nothing of q's
        stream.client.async_stream_infer("echo", _text("done", batched=True), request_id="e")
        third = stream.next()
    finally:
        stream.close()
    assert [r.as_numpy("text_output").tolist() for r, _ in (first, second)] == \
        [[b"alpha"], [b"beta"]]
    assert [r.get_response().parameters["triton_final_response"].bool_param
            for r, _ in (first, second)] == [False, False]
    result, error = third
    assert error is None
    assert result.get_response().id == "e"
    assert result.as_numpy("text_output").tolist() == [[b"DONE"]]
    # a model that is not decoupled: its one response is final
    assert result.get_response().parameters["triton_final_response"].bool_param is True


def test_errors_travel_on_the_stream_and_it_goes_on(served):
    stream = Stream(served)
    try:
        stream.client.async_stream_infer("words", _text("a FAIL b"), request_id="f",
                                         enable_empty_final_response=True)
        got = stream.until_final("f")
        stream.client.async_stream_infer("nope", _text("x"), request_id="n")
        _, unknown = stream.next()
        stream.client.async_stream_infer("words", _text("still here"), request_id="s",
                                         enable_empty_final_response=True)
        after = stream.until_final("s")
    finally:
        stream.close()
    errors = [error for _, error in got if error is not None]
    assert len(errors) == 1 and "the model failed on FAIL" in errors[0].message()
    words = [r.as_numpy("text_output").tolist() for r, e in got
             if r is not None and r.as_numpy("text_output") is not None]
    assert words == [[b"a"], [b"b"]]
    assert isinstance(unknown, InferenceServerException)
    assert "nope" in unknown.message()
    assert [r.as_numpy("text_output").tolist() for r, e in after[:2]] == [[b"still"], [b"here"]]


def test_interleaved_requests_are_matched_by_id(served):
    stream = Stream(served)
    try:
        for i in range(4):
            stream.client.async_stream_infer("words", _text(f"w{i} x{i}"), request_id=f"id{i}",
                                             enable_empty_final_response=True)
        seen: dict[str, list] = {f"id{i}": [] for i in range(4)}
        finals = 0
        while finals < 4:
            result, error = stream.next()
            assert error is None
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                finals += 1
            else:
                seen[response.id].append(result.as_numpy("text_output")[0])
    finally:
        stream.close()
    assert seen == {f"id{i}": [f"w{i}".encode(), f"x{i}".encode()] for i in range(4)}


def test_a_client_that_goes_away_cancels_the_request(served, tmp_path):
    marker = tmp_path / f"cancelled-{served.port}"
    stream = Stream(served)
    words = " ".join(f"w{i}" for i in range(200))
    stream.client.async_stream_infer(
        "words", _text(words), request_id="long",
        parameters={"delay": 0.05, "cancel_marker": str(marker)})
    result, error = stream.next()
    assert error is None and result.as_numpy("text_output").tolist() == [b"w0"]
    stream.client.stop_stream(cancel_requests=True)
    stream.client.close()
    deadline = time.monotonic() + TIMEOUT_S
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the model never saw is_cancelled() after the client left"


def test_unary_infer_on_a_decoupled_model_is_refused(served):
    client = served.client()
    try:
        with pytest.raises(InferenceServerException) as err:
            client.infer("words", _text("a b"))
    finally:
        client.close()
    # Triton's status and words (TRITONSERVER_ERROR_UNSUPPORTED)
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"
    assert err.value.message().startswith(
        "ModelInfer RPC doesn't support models with decoupled transaction policy")


def test_a_client_that_does_not_read_holds_the_model_back(served, tmp_path):
    """The server's memory is not where a fast model's responses pile up: with the client not
    reading, the model's sends stop once the bounded buffers on the way are full (the engine's
    stream, the stream's response queue, HTTP/2 flow control); then the client leaves."""
    progress = tmp_path / f"progress-{served.port}"
    count, size = 4000, 64 * 1024           # 256 MiB if nothing held the model back
    async def scenario() -> tuple[int, int]:
        from tritonclient.grpc import service_pb2, service_pb2_grpc
        request = service_pb2.ModelInferRequest(model_name="flood", id="f")
        request.inputs.add(name="COUNT", datatype="INT32", shape=[1])
        request.raw_input_contents.append(np.array([count], np.int32).tobytes())
        request.parameters["progress"].string_param = str(progress)
        request.parameters["bytes"].int64_param = size
        async with grpc.aio.insecure_channel(f"127.0.0.1:{served.port}", options=[
                ("grpc.max_receive_message_length", 1 << 26)]) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            call = stub.ModelStreamInfer(iter([request]))
            first = await call.read()                       # the stream is flowing
            assert not first.error_message
            deadline = time.monotonic() + TIMEOUT_S
            sent, settled = 0, 0
            while time.monotonic() < deadline and settled < 10:   # until the model stalls
                await asyncio.sleep(0.2)
                now = int(progress.read_text() or 0) if progress.exists() else 0
                settled = settled + 1 if now == sent else 0
                sent = now
            call.cancel()
        return sent, count

    sent, total = asyncio.run(scenario())
    print(f"the model sent {sent} of {total} responses while the client read one")
    assert 0 < sent < total // 2, f"the model sent {sent} of {total} responses unread"
    cancelled = Path(f"{progress}.cancelled")
    deadline = time.monotonic() + TIMEOUT_S
    while not cancelled.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled.exists(), "the held-back model never saw is_cancelled() after the client left"


def test_the_model_sees_the_clients_parameters_but_not_the_frontends(served):
    stream = Stream(served)
    try:
        stream.client.async_stream_infer("echo", _text("p", batched=True), request_id="p",
                                         enable_empty_final_response=True,
                                         parameters={"mine": 3})
        result, error = stream.next()
    finally:
        stream.close()
    assert error is None
    seen = json.loads(result.as_numpy("parameters_seen")[0][0])
    assert seen == {"mine": 3}


def test_triton_grpc_error_mode_ends_the_stream_with_the_status(served):
    """Triton's ``triton_grpc_error: true`` stream metadata: the first error closes the stream
    with its gRPC status (nothing after it arrives)."""
    client = served.client()
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)),
                        headers={"triton_grpc_error": "true"})
    try:
        client.async_stream_infer("words", _text("a FAIL b"), request_id="g",
                                  parameters={"delay": 0.2})
        first, _ = results.get(timeout=TIMEOUT_S)
        _, error = results.get(timeout=TIMEOUT_S)
        with pytest.raises(queue.Empty):
            results.get(timeout=1.0)
    finally:
        client.stop_stream()
        client.close()
    assert first.as_numpy("text_output").tolist() == [b"a"]
    assert isinstance(error, InferenceServerException)
    assert "the model failed on FAIL" in error.message()
    assert error.status() == "StatusCode.INTERNAL"   # pb_utils.TritonError's default code
