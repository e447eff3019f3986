"""The demo repository the extension creates on first start: built locally with the onnx
helper, so nothing is downloaded."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

DEMO_CONFIG = """\
name: "demo"
backend: "onnxruntime"
max_batch_size: 64
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
dynamic_batching { max_queue_delay_microseconds: 500 }
"""


def demo_weights() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((16, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)


def demo_onnx() -> bytes:
    """OUTPUT0 = relu(INPUT0 @ W + b), batch dim dynamic."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w, b = demo_weights()
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["INPUT0", "W"], ["xw"]),
         helper.make_node("Add", ["xw", "B"], ["z"]),
         helper.make_node("Relu", ["z"], ["OUTPUT0"])],
        "demo",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def write_demo_repository(root: Path) -> Path:
    """Create ``root`` holding ``demo/1/model.onnx`` + ``demo/config.pbtxt`` (atomically:
    a half-written repository is never left behind)."""
    root = Path(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=root.parent))
    (tmp / "demo" / "1").mkdir(parents=True)
    (tmp / "demo" / "1" / "model.onnx").write_bytes(demo_onnx())
    (tmp / "demo" / "config.pbtxt").write_text(DEMO_CONFIG)
    try:
        os.rename(tmp, root)
    except OSError:          # someone else created it first: theirs wins, ours goes
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return root
