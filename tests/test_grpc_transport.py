"""The HTTP/2 transport of the gRPC port (frontends/grpc_calls.py) with the unmodified
tritonclient.grpc client and a real engine: tensors larger than every flow-control window,
the receive limit, many calls at once, client deadlines."""
from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from onnx import TensorProto
from tritonclient.utils import InferenceServerException

from conftest import W
from onnx_models import identity, linear
from server_waits import wait_until
from test_grpc_bounds import HOLD_S, SLOW_CONFIG, Served, _x

BIG_CONFIG = """\
name: "big"
backend: "onnxruntime"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1, 1024 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1, 1024 ] } ]
"""


@pytest.fixture
def repo(tmp_path):
    identity(TensorProto.FLOAT, tmp_path / "big" / "1" / "model.onnx", dims=1024)
    (tmp_path / "big" / "config.pbtxt").write_text(BIG_CONFIG)
    linear(W, tmp_path / "slow" / "1" / "model.onnx")
    (tmp_path / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)
    return tmp_path


def _tensor(arr: np.ndarray) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("INPUT0", list(arr.shape), "FP32")
    inp.set_data_from_numpy(arr)
    return [inp]


def test_large_tensors_cross_the_flow_control_windows(repo):
    served = Served(repo, models=("big",))
    try:
        for rows in (1, 64, 8192):          # 4 KiB, 256 KiB, 32 MiB each way
            x = np.random.default_rng(rows).standard_normal((rows, 1024)).astype(np.float32)
            out = served.client.infer("big", _tensor(x)).as_numpy("OUTPUT0")
            np.testing.assert_array_equal(out, x)
    finally:
        served.close()


def test_a_message_over_the_receive_limit_is_refused(repo):
    served = Served(repo, models=("big",), max_receive_message_size=1 << 20)
    try:
        with pytest.raises(InferenceServerException) as err:
            served.client.infer("big", _tensor(np.zeros((512, 1024), np.float32)))
        assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "larger than max" in err.value.message()
        x = np.ones((2, 1024), np.float32)
        np.testing.assert_array_equal(served.client.infer("big", _tensor(x)).as_numpy("OUTPUT0"), x)
    finally:
        served.close()


def test_many_calls_at_once_each_get_their_own_answer(repo):
    served = Served(repo, models=("big",))
    try:
        def call(k: int) -> bool:
            x = np.full((1, 1024), k, np.float32)
            result = served.client.infer("big", _tensor(x), request_id=str(k))
            return result.get_response().id == str(k) and (result.as_numpy("OUTPUT0") == k).all()

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            assert all(pool.map(call, range(400)))
    finally:
        served.close()


def test_a_client_deadline_ends_the_call_and_the_server_serves_on(repo):
    served = Served(repo, models=("slow",))

    def failures() -> int:
        return served.engine.statistics("slow")["model_stats"][0]["inference_stats"]["fail"]["count"]

    try:
        with pytest.raises(InferenceServerException) as err:
            served.client.infer("slow", _x(), client_timeout=HOLD_S / 5)
        assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        # the server ended the call too (a call it had run would count as a success)
        wait_until(lambda: failures() == 1, "the server counts the call as failed")
        result = served.client.infer("slow", _x())
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), np.ones((1, 16)) @ W, rtol=1e-5)
    finally:
        served.close()
