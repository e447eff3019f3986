"""The benchmark's two models, built here with the onnx helper (nothing is downloaded).

* ``small``: y = x·W, W 256x256 fp32, one row per request: almost no compute, so what the
  server adds around the model (HTTP, decode, queue, encode) dominates.
* ``mlp``: 1024 -> 2048 -> 2048 -> 1024 with ReLUs (about 8.4 M weights): a batch of 64
  takes several milliseconds in onnxruntime on a small CPU, so batching pays.

Each is written twice, with and without ``dynamic_batching``, so one server measures both.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MAX_BATCH_SIZE = 64


@dataclass(frozen=True)
class BenchModel:
    name: str               # the model's base name; <name>_batched and <name>_plain are served
    features_in: int
    features_out: int
    description: str

    def served_name(self, batching: bool) -> str:
        return f"{self.name}_{'batched' if batching else 'plain'}"


SMALL = BenchModel("small", 256, 256, "y = x·W, W 256x256 fp32 (overhead-bound)")
MLP = BenchModel("mlp", 1024, 1024, "MLP 1024-2048-2048-1024, ReLU (compute-bound)")
MODELS = (SMALL, MLP)


def _save(graph: onnx.GraphProto) -> bytes:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def small_onnx(seed: int = 0) -> bytes:
    w = np.random.default_rng(seed).standard_normal((256, 256)).astype(np.float32) / 16
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["INPUT0", "W"], ["OUTPUT0"])], "small",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 256])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 256])],
        [numpy_helper.from_array(w, "W")])
    return _save(graph)


def mlp_onnx(seed: int = 0, widths: tuple[int, ...] = (1024, 2048, 2048, 1024)) -> bytes:
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    x = "INPUT0"
    for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:])):
        w = (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
        b = np.zeros(n_out, dtype=np.float32)
        inits += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(b, f"B{i}")]
        last = i == len(widths) - 2
        y = "OUTPUT0" if last else f"H{i}"
        nodes.append(helper.make_node("Gemm", [x, f"W{i}", f"B{i}"], [y if last else f"G{i}"]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"G{i}"], [y]))
        x = y
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", widths[0]])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", widths[-1]])],
        inits)
    return _save(graph)


ONNX = {"small": small_onnx, "mlp": mlp_onnx}


def config_text(model: BenchModel, batching: bool) -> str:
    # max_queue_delay 0 (Triton's default): a batch is whatever queued while the instance
    # was busy, so batching never adds latency at low load.
    batcher = "dynamic_batching { max_queue_delay_microseconds: 0 }" if batching else ""
    return f'''name: "{model.served_name(batching)}"
backend: "onnxruntime"
max_batch_size: {MAX_BATCH_SIZE}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {model.features_in} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {model.features_out} ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
{batcher}
'''


def build_repository(root: Path) -> dict[str, bytes]:
    """Write every model, batched and plain, under ``root``; returns the ONNX bytes by base name."""
    onnx_bytes = {}
    for model in MODELS:
        data = onnx_bytes[model.name] = ONNX[model.name]()
        for batching in (True, False):
            served = root / model.served_name(batching)
            (served / "1").mkdir(parents=True, exist_ok=True)
            (served / "1" / "model.onnx").write_bytes(data)
            (served / "config.pbtxt").write_text(config_text(model, batching))
    return onnx_bytes
