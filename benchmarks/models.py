"""The benchmark's model, in every form it is served (built here, nothing is downloaded).

y = x·W, W 256x256 fp32 (the same W everywhere: numpy's default_rng(0), scaled by 1/16), one
[1, 256] row per request, max_batch_size 64, dynamic_batching with a 0.5 ms queue delay, one
CPU instance. Almost no compute: what a server adds around the model (transport, decode,
queue, batching, worker hand-off, encode) is what gets measured.

* ``matmul_onnx``: the ONNX model (a MatMul node), onnxruntime backend;
* ``matmul_python``: Triton's python backend, a ``model.py`` that concatenates the batch's
  rows, multiplies once and splits the result back (what PyTriton's ``@batch`` does);
* ``matmul_python_0..3``: four copies of it, served together by one server;
* the peers: NVIDIA's tritonserver 2.51 serves the same repository (``tritonserver_peer.py``),
  PyTriton (``pytriton_peer.py``) the same function as a ``@batch`` model.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

FEATURES = 256
MAX_BATCH_SIZE = 64
QUEUE_DELAY_US = 500
ONNX_MODEL = "matmul_onnx"
PYTHON_MODEL = "matmul_python"
# The many-models row: four copies of the python model in one server (the seeds' recommender
# serving four models on one instance), each with its own worker / stub.
MANY_MODELS = tuple(f"matmul_python_{i}" for i in range(4))
DESCRIPTION = (f"y = x·W, W {FEATURES}x{FEATURES} fp32, one [1,{FEATURES}] row per request, "
               f"max_batch_size {MAX_BATCH_SIZE}, dynamic_batching max_queue_delay_microseconds "
               f"{QUEUE_DELAY_US}, one CPU instance")


def weights() -> np.ndarray:
    """The one W every server multiplies by (pytriton_peer.py computes the same)."""
    return (np.random.default_rng(0).standard_normal((FEATURES, FEATURES)) / 16).astype(np.float32)


def onnx_bytes() -> bytes:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["INPUT0", "W"], ["OUTPUT0"])], "matmul",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", FEATURES])],
        [numpy_helper.from_array(weights(), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


# Triton's python backend hands execute() every request of the batch the dynamic batcher
# formed; one matmul over all rows, as PyTriton's @batch does, keeps the two models' work equal.
MODEL_PY = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.w = (np.random.default_rng(0).standard_normal((256, 256)) / 16).astype(np.float32)

    def execute(self, requests):
        xs = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        y = np.concatenate(xs) @ self.w if len(xs) > 1 else xs[0] @ self.w
        responses, start = [], 0
        for x in xs:
            out = pb_utils.Tensor("OUTPUT0", y[start:start + len(x)])
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            start += len(x)
        return responses
'''


def config_text(name: str, backend: str) -> str:
    return f'''name: "{name}"
backend: "{backend}"
max_batch_size: {MAX_BATCH_SIZE}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
dynamic_batching {{ max_queue_delay_microseconds: {QUEUE_DELAY_US} }}
'''


def build_repository(root: Path, models: tuple[str, ...] = (ONNX_MODEL, PYTHON_MODEL)) -> None:
    """Write ``models`` under ``root`` as a Triton model repository."""
    data = onnx_bytes()
    for name in models:
        version = root / name / "1"
        version.mkdir(parents=True, exist_ok=True)
        if name == ONNX_MODEL:
            (version / "model.onnx").write_bytes(data)
            backend = "onnxruntime"
        else:
            (version / "model.py").write_text(MODEL_PY)
            backend = "python"
        (root / name / "config.pbtxt").write_text(config_text(name, backend))
