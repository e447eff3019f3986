"""repeat_int32 (our model of python_backend's examples/decoupled one) streamed over
tritonclient's gRPC stream by NVIDIA's tritonserver 2.51 and by ours: the same responses and
final flags, and the same request statistics (a decoupled request counted once, by its
execute). Skipped where nvidia-pytriton's tritonserver is not installed.

tritonserver 2.51's python backend leaves ``response_stats`` empty; ours fills it in
Triton's schema (one entry per response index), which is checked here too."""
from __future__ import annotations

import queue
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread
from test_export import nvidia_tritonserver
from triton_example_models import REPEAT_INT32_CONFIG, REPEAT_INT32_PY, add_model

pytestmark = pytest.mark.timeout(240)


def _repository(root: Path) -> Path:
    add_model(root, "repeat_int32", REPEAT_INT32_PY, REPEAT_INT32_CONFIG)
    return root


def _inputs(values: list[int], delay_ms: int, wait_ms: int) -> list[grpcclient.InferInput]:
    tensors = [grpcclient.InferInput("IN", [len(values)], "INT32"),
               grpcclient.InferInput("DELAY", [len(values)], "UINT32"),
               grpcclient.InferInput("WAIT", [1], "UINT32")]
    tensors[0].set_data_from_numpy(np.array(values, np.int32))
    tensors[1].set_data_from_numpy(np.full(len(values), delay_ms, np.uint32))
    tensors[2].set_data_from_numpy(np.array([wait_ms], np.uint32))
    return tensors


def _exercise(grpc_port: int) -> tuple[list, dict]:
    """Three requests on one stream (3 values, none, 2 values), each until its final
    response; then the model's statistics once both executions are counted."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    results: queue.Queue = queue.Queue()
    seen = []
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        for values in ([1, 2, 3], [], [7, 8]):
            client.async_stream_infer("repeat_int32", _inputs(values, 10, 50),
                                      enable_empty_final_response=True)
            while True:
                result, error = results.get(timeout=30)
                assert error is None, error
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param
                seen.append((result.as_numpy("OUT").tolist() if response.outputs else None, final))
                if final:
                    break
        client.stop_stream()
        deadline = time.monotonic() + 10
        while True:
            stats = client.get_inference_statistics("repeat_int32", as_json=True)["model_stats"][0]
            if int(stats.get("execution_count", 0)) >= 3 or time.monotonic() > deadline:
                return seen, stats
            time.sleep(0.05)
    finally:
        client.close()


def test_repeat_int32_streams_and_counts_as_in_tritonserver(tmp_path):
    repo = _repository(tmp_path / "models")
    with nvidia_tritonserver(repo, tmp_path / "triton") as (_, grpc_port):
        theirs, their_stats = _exercise(grpc_port)
    server = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                           load_models=["*"]),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)
    try:
        ours, our_stats = _exercise(server.grpc_port)
    finally:
        server.close()
    assert ours == theirs
    assert theirs == [([1], False), ([2], False), ([3], False), (None, True), (None, True),
                      ([7], False), ([8], False), (None, True)]
    for key in ("inference_count", "execution_count"):
        assert our_stats[key] == their_stats[key] == "3"
    assert (our_stats["inference_stats"]["success"]["count"]
            == their_stats["inference_stats"]["success"]["count"] == "3")
    assert "count" not in our_stats["inference_stats"]["fail"]
    assert not their_stats.get("response_stats")
    rs = our_stats["response_stats"]
    assert rs["0"]["success"]["count"] == "2" and rs["0"]["empty_response"]["count"] == "1"
    assert rs["2"]["empty_response"]["count"] == "1" and rs["3"]["empty_response"]["count"] == "1"
