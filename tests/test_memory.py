"""Memory per model: Triton's ``memory_usage`` statistics for every backend, the
``nv_model_memory_bytes`` gauge, and unloading giving the memory back (RSS of the serving
process tree, read with psutil, before load, while loaded and after unload)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import LINEAR_CONFIG, W
from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread
from onnx_models import linear
from test_backend_python import ADD_SUB_CONFIG, ADD_SUB_MODEL_PY

MB = 1 << 20

TORCHSCRIPT_CONFIG = '''
name: "torchscript"
platform: "pytorch_libtorch"
max_batch_size: 8
input [{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ 8 ] }]
output [{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] }]
'''

# Holds HOLD_MB of touched memory from initialize on: what its worker's RSS must show.
HEAVY_MODEL_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.weights = np.ones(HOLD_MB * (1 << 20) // 8, dtype=np.float64)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() + self.weights[0])])
            for r in requests]
'''

HEAVY_CONFIG = '''
name: "heavy"
backend: "python"
max_batch_size: 4
input [{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }]
output [{ name: "Y" data_type: TYPE_FP32 dims: [ 2 ] }]
'''

BIG_ONNX_CONFIG = '''
name: "big_onnx"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4096 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 8192 ] } ]
'''

HOLD_MB = 192
BIG_ONNX_MB = 128          # 4096 x 8192 float32 weights


def tree_rss() -> int:
    """RSS of the serving tree: this process (the server runs in one of its threads) and
    every worker process it started."""
    me = psutil.Process(os.getpid())
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total


def build(root: Path) -> Path:
    (root / "add_sub" / "1").mkdir(parents=True)
    (root / "add_sub" / "1" / "model.py").write_text(ADD_SUB_MODEL_PY)
    (root / "add_sub" / "config.pbtxt").write_text(ADD_SUB_CONFIG)
    linear(W, root / "linear" / "1" / "model.onnx")
    (root / "linear" / "config.pbtxt").write_text(LINEAR_CONFIG)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 3), torch.nn.Tanh()).eval()
    (root / "torchscript" / "1").mkdir(parents=True)
    torch.jit.trace(net, torch.zeros(1, 8)).save(str(root / "torchscript" / "1" / "model.pt"))
    (root / "torchscript" / "config.pbtxt").write_text(TORCHSCRIPT_CONFIG)
    return root


@pytest.fixture
def server(tmp_path: Path):
    repo = build(tmp_path / "models")
    server = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                           load_models=["add_sub", "linear", "torchscript"]),
                             host="127.0.0.1", http_port=0, metrics_port=0, grpc_port=0)
    yield server, repo
    server.close()


def test_memory_usage_for_every_backend_in_statistics_and_metrics(server):
    server, _ = server
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    usage = {}
    for model in ("add_sub", "linear", "torchscript"):
        [stats] = client.get_inference_statistics(model)["model_stats"]
        usage[model] = stats["memory_usage"]
        assert usage[model], f"{model}: memory_usage is empty"
        for entry in usage[model]:
            assert entry["type"] in ("CPU", "GPU") and isinstance(entry["id"], int)
            assert isinstance(entry["byte_size"], int) and entry["byte_size"] >= 0
    # the python model's worker is a whole Python process with numpy: tens of MB at least
    [cpu] = [e for e in usage["add_sub"] if e["type"] == "CPU"]
    assert cpu["byte_size"] > 10 * MB
    worker_rss = sum(c.memory_info().rss for c in psutil.Process().children(recursive=True))
    assert cpu["byte_size"] <= worker_rss

    # the same figures over gRPC, in Triton's MemoryUsage messages
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    [stats] = grpc.get_inference_statistics("add_sub").model_stats
    assert [u.type for u in stats.memory_usage] == [e["type"] for e in usage["add_sub"]]
    assert stats.memory_usage[0].byte_size > 10 * MB

    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("nv_model_memory_bytes{")]
    for model in ("add_sub", "linear", "torchscript"):
        assert any(f'model="{model}"' in line and 'kind="CPU"' in line for line in lines), lines
    [add_sub] = [line for line in lines if 'model="add_sub"' in line]
    assert int(float(add_sub.rsplit(" ", 1)[1])) > 10 * MB


def wait_rss_below(limit: int, seconds: float = 15.0) -> int:
    """Poll (bounded) until the tree's RSS falls to ``limit``; the last reading either way."""
    deadline = time.monotonic() + seconds
    while True:
        now = tree_rss()
        if now <= limit or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def test_unloading_a_python_model_returns_its_workers_memory(server):
    server, repo = server
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    (repo / "heavy" / "1").mkdir(parents=True)
    (repo / "heavy" / "1" / "model.py").write_text(HEAVY_MODEL_PY.replace("HOLD_MB", str(HOLD_MB)))
    (repo / "heavy" / "config.pbtxt").write_text(HEAVY_CONFIG)
    before = tree_rss()
    client.load_model("heavy")
    x = httpclient.InferInput("X", [1, 2], "FP32")
    x.set_data_from_numpy(np.zeros((1, 2), np.float32))
    assert client.infer("heavy", [x]).as_numpy("Y").tolist() == [[1.0, 1.0]]
    loaded = tree_rss()
    [cpu] = [e for e in client.get_inference_statistics("heavy")["model_stats"][0]["memory_usage"]
             if e["type"] == "CPU"]
    assert cpu["byte_size"] >= HOLD_MB * MB                     # what it holds, and its interpreter
    assert loaded - before >= HOLD_MB * MB * 0.9
    client.unload_model("heavy")
    after = wait_rss_below(before + 16 * MB)
    # The worker exits: everything it held goes. The bound is the server's own allocations
    # for a load and an unload (config, logs): measured at +0.3 MB.
    assert after <= before + 16 * MB, f"{(after - before) / MB:.1f} MB still held after unload"


def test_unloading_an_onnx_model_returns_the_runtimes_memory(server, tmp_path: Path):
    server, repo = server
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    weights = np.random.default_rng(0).standard_normal((4096, 8192)).astype(np.float32) / 64
    linear(weights, repo / "big_onnx" / "1" / "model.onnx")
    (repo / "big_onnx" / "config.pbtxt").write_text(BIG_ONNX_CONFIG)
    x = np.random.default_rng(1).standard_normal((4, 4096)).astype(np.float32)
    del weights
    before = tree_rss()
    client.load_model("big_onnx")
    inp = httpclient.InferInput("INPUT0", [4, 4096], "FP32")
    inp.set_data_from_numpy(x)
    for _ in range(3):
        assert client.infer("big_onnx", [inp]).as_numpy("OUTPUT0").shape == (4, 8192)
    loaded = tree_rss()
    [cpu] = [e for e in client.get_inference_statistics("big_onnx")["model_stats"][0]["memory_usage"]
             if e["type"] == "CPU"]
    # measured as the process's RSS growth across the load: the weights at least
    assert cpu["byte_size"] >= BIG_ONNX_MB * MB * 0.9
    assert loaded - before >= BIG_ONNX_MB * MB * 0.9
    client.unload_model("big_onnx")
    after = wait_rss_below(before + 32 * MB)
    # onnxruntime frees the session's weights and arena; what stays is allocator slack
    # (glibc keeps freed small chunks) from the load and the three requests: measured at +5 MB.
    assert after <= before + 32 * MB, f"{(after - before) / MB:.1f} MB still held after unload"
