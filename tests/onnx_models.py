"""Small ONNX models the tests build with the onnx helper (nothing is downloaded)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _save(graph, path: Path | None) -> bytes:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    data = model.SerializeToString()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return data


def linear(w: np.ndarray, path: Path | None = None, in_name: str = "INPUT0",
           out_name: str = "OUTPUT0") -> bytes:
    """OUTPUT0 = INPUT0 @ W, with a dynamic batch dim."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", [in_name, "W"], [out_name])], "linear",
        [helper.make_tensor_value_info(in_name, TensorProto.FLOAT, ["batch", w.shape[0]])],
        [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, ["batch", w.shape[1]])],
        [numpy_helper.from_array(w.astype(np.float32), "W")])
    return _save(graph, path)


def add_sub(path: Path | None = None, dims: int = 4, elem=TensorProto.FLOAT) -> bytes:
    """Triton's 'simple' model: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
         helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])], "add_sub",
        [helper.make_tensor_value_info(n, elem, ["batch", dims]) for n in ("INPUT0", "INPUT1")],
        [helper.make_tensor_value_info(n, elem, ["batch", dims]) for n in ("OUTPUT0", "OUTPUT1")])
    return _save(graph, path)


def identity(elem: int, path: Path | None = None, dims: int = 3) -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "identity",
        [helper.make_tensor_value_info("INPUT0", elem, ["batch", dims])],
        [helper.make_tensor_value_info("OUTPUT0", elem, ["batch", dims])])
    return _save(graph, path)
