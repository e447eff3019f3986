"""Artifacts whose files are already serialized: ONNX (bytes, a ``ModelProto``), a TensorRT
plan, a ``torch.export`` program (``model.pt2``), ``model.py`` source.
"""
from __future__ import annotations

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from ..repository.callable_format import pack_model_py
from .artifact_specs import (_SERVABLE, Artifact, ArtifactError, TensorSpec, _base_config, _config_dims,
                             triton_dtype)


def _onnx_bytes(data: bytes, name: str, max_batch_size: int | None) -> Artifact:
    import onnx
    try:
        model = onnx.load_from_string(data)
    except Exception as err:
        raise ArtifactError(f"model '{name}': these bytes are not an ONNX model ({err}); serve "
                            f"{_SERVABLE}") from None
    if not model.graph.output:
        raise ArtifactError(f"model '{name}': these bytes are not an ONNX model (no graph "
                            f"outputs); serve {_SERVABLE}")
    initializers = {i.name for i in model.graph.initializer}

    def spec(value_info) -> TensorSpec:
        t = value_info.type.tensor_type
        datatype = triton_dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)) if t.elem_type else "FP32"
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        return value_info.name, datatype, dims

    ins = [spec(v) for v in model.graph.input if v.name not in initializers]
    outs = [spec(v) for v in model.graph.output]
    dynamic_first = all(s[2] and s[2][0] == -1 for s in ins + outs)
    batching = (max_batch_size > 0) if max_batch_size is not None else dynamic_first
    config = _base_config(name, "onnxruntime", "onnxruntime_onnx", max_batch_size or 0)
    return Artifact(config, {"1/model.onnx": data}, "onnx", ins, batching)


def _plan(data: bytes, name: str, max_batch_size: int | None) -> Artifact:
    config = _base_config(name, "tensorrt", "tensorrt_plan", max_batch_size or 0)
    return Artifact(config, {"1/model.plan": data}, "tensorrt",
                    batching=None if max_batch_size is None else max_batch_size > 0)


def _pt2(data: bytes, name: str, max_batch_size: int | None, inputs: list[TensorSpec] | None,
         batching: bool | None) -> Artifact:
    config = _base_config(name, "pytorch", "torch_export", max_batch_size or 0)
    return Artifact(config, {"1/model.pt2": data}, "torch_export", inputs,
                    batching if max_batch_size is None else max_batch_size > 0)


def _model_py(source: str, name: str, inputs, outputs, max_batch_size: int | None) -> Artifact:
    mbs = max_batch_size or 0
    config_json, files = pack_model_py(
        source, name=name, max_batch_size=mbs,
        inputs=[(n, d, _config_dims(s, mbs > 0)) for n, d, s in inputs or []],
        outputs=[(n, d, _config_dims(s, mbs > 0)) for n, d, s in outputs or []])
    return Artifact(json_format.Parse(config_json, mc.ModelConfig()), files, "python", inputs, mbs > 0)
