"""Bounds of the gRPC port: RPCs in flight and request bytes in flight, each a clear
RESOURCE_EXHAUSTED when reached and free again once the RPCs holding them finish; a body that
is no ModelInferRequest is INVALID_ARGUMENT. A real engine serves an ONNX model whose batcher
holds requests for a while (a long queue delay), so requests are reliably in flight."""
from __future__ import annotations

import asyncio
import queue
import threading

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import W
from jupyter_triton.engine import Engine, EngineOptions
from jupyter_triton.frontends.grpc import start_grpc_server
from onnx_models import linear
from server_waits import served_model, wait_for_queued

HOLD_S = 1.5
SLOW_CONFIG = f"""\
name: "slow"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: {int(HOLD_S * 1e6)} }}
"""


class Served:
    """A real engine and gRPC server on a loop of their own (a background thread)."""

    def __init__(self, repo, models: tuple[str, ...] = ("slow",), **grpc_options) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = Engine(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                           load_models=list(models)))
        self._run(self.engine.start())
        self.server, self.port = self._run(
            start_grpc_server(self.engine, "127.0.0.1", 0, **grpc_options))
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.port}")

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def close(self) -> None:
        self.client.close()
        self._run(self.server.stop(None))
        self._run(self.engine.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


@pytest.fixture
def slow_repo(tmp_path):
    linear(W, tmp_path / "slow" / "1" / "model.onnx")
    (tmp_path / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)
    return tmp_path


def _x() -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(np.ones((1, 16), np.float32))
    return [inp]


def _hold(served: Served, n: int) -> queue.Queue:
    """Start ``n`` inferences that the batcher holds for HOLD_S; their results arrive later."""
    done: queue.Queue = queue.Queue()
    slow = served_model(served.engine, "slow")
    before = slow.pending_count
    for _ in range(n):
        served.client.async_infer("slow", _x(), callback=lambda result, error: done.put((result, error)))
    # queued (the batch leaves at the end of the delay): waited for, as a busy machine may
    # deliver them late
    wait_for_queued(slow, before + n, HOLD_S)
    return done


def _finish(done: queue.Queue, n: int) -> None:
    for _ in range(n):
        result, error = done.get(timeout=10 * HOLD_S)
        assert error is None, error
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), np.ones((1, 16)) @ W, rtol=1e-5)


def test_concurrent_rpcs_are_bounded(slow_repo):
    served = Served(slow_repo, max_concurrent_rpcs=2)
    try:
        done = _hold(served, 2)
        with pytest.raises(InferenceServerException) as err:
            served.client.infer("slow", _x())
        assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "limit" in err.value.message().lower()
        _finish(done, 2)
        # the slots are free again, and the server still serves
        assert served.client.is_server_live()
        _finish(_hold(served, 1), 1)
    finally:
        served.close()


def test_request_bytes_in_flight_are_bounded(slow_repo):
    # one [1, 16] FP32 request is ~100 bytes on the wire: room for one, not two
    served = Served(slow_repo, max_inflight_bytes=150)
    try:
        done = _hold(served, 1)
        with pytest.raises(InferenceServerException) as err:
            served.client.infer("slow", _x())
        assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "bytes of requests in flight" in err.value.message()
        assert served.client.is_server_live()      # other RPCs carry no request bytes
        _finish(done, 1)
        _finish(_hold(served, 1), 1)
    finally:
        served.close()


def test_a_body_that_is_no_infer_request_is_invalid_argument(slow_repo):
    served = Served(slow_repo)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            with pytest.raises(grpc.RpcError) as err:
                infer(b"\xff\xff\xff\xff", timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ModelInferRequest" in err.value.details()
        assert served.client.is_model_ready("slow")
    finally:
        served.close()


def test_stream_requests_share_the_byte_bound(slow_repo):
    """Over the limit, a stream request is answered with an error on the stream; the stream
    and the request already held go on."""
    served = Served(slow_repo, max_inflight_bytes=150)
    results: queue.Queue = queue.Queue()
    served.client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        served.client.async_stream_infer("slow", _x(), request_id="held")
        wait_for_queued(served_model(served.engine, "slow"), 1, HOLD_S)
        served.client.async_stream_infer("slow", _x(), request_id="refused")
        result, error = results.get(timeout=10 * HOLD_S)
        assert result is None and "bytes of requests in flight" in error.message()
        result, error = results.get(timeout=10 * HOLD_S)
        assert error is None and result.get_response().id == "held"
    finally:
        served.client.stop_stream()
        served.close()
