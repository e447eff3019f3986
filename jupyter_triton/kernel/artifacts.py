"""Notebook objects as Triton model artifacts: a ``ModelConfig`` and the files of one
version directory (``{"1/model.onnx": bytes}``), ready for the repository load request.

What becomes what:

* ONNX (``onnx.ModelProto``, its bytes, a path to ``.onnx``) -> ``model.onnx``, onnxruntime;
  the server auto-completes inputs and outputs.
* ``torch.nn.Module`` with an example batch -> ``torch.export`` (``model.pt2``, a dynamic batch
  dimension), else a TorchScript trace (``model.pt``, ``INPUT__0``/``OUTPUT__0``), else the
  module as a python-backend callable. Without an example -> a callable, its input width
  read from a leading ``nn.Linear`` (or given by ``inputs=``).
* ``torch.jit.ScriptModule`` -> ``model.pt``; ``torch.export.ExportedProgram`` -> ``model.pt2``.
* a TensorRT ``ICudaEngine`` (or a ``.plan`` path) -> ``model.plan``.
* a Python callable -> ``model.pkl`` + a generic ``model.py`` (python backend).
* ``model.py`` source (a ``TritonPythonModel`` class) -> itself.

Tensor specs, as users write them: ``("x", "FP32", [-1, 4])``, the full shape the model sees,
``-1`` where any size goes; when the model batches, the first dimension is the batch.

Here: which builder an object goes to. The builders: ``artifact_files`` (already serialized),
``artifact_torch`` (modules, TorchScript), ``artifact_callables`` (Python callables); what
they share, the ``Artifact`` and its tensor specs: ``artifact_specs``.
"""
from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from .artifact_callables import (TEXT_INPUT, TEXT_OUTPUT, _callable, _is_generator, _streaming_callable,
                                 _text_convention)
from .artifact_files import _model_py, _onnx_bytes, _plan, _pt2
from .artifact_specs import (_SERVABLE, DEFAULT_MAX_BATCH_SIZE, Artifact, ArtifactError, TensorSpec, _spec,
                             triton_dtype)
from .artifact_torch import _script_artifact, _torch_module, _torchscript

__all__ = ["Artifact", "ArtifactError", "DEFAULT_MAX_BATCH_SIZE", "TEXT_INPUT", "TEXT_OUTPUT", "TensorSpec",
           "build_artifact", "triton_dtype"]


def build_artifact(obj: Any, name: str, *, example: Any = None,
                   inputs: Sequence[TensorSpec] | None = None,
                   outputs: Sequence[TensorSpec] | None = None,
                   max_batch_size: int | None = None, decoupled: bool | None = None,
                   sequence: bool = False) -> Artifact:
    """Turn ``obj`` into a Triton model named ``name`` (see the module docstring).

    ``decoupled``: every value a generator yields is one response (None: a generator or
    async-generator function is decoupled). ``sequence``: a stateful callable, its ``state``
    parameter one dict per correlation id (``sequence_batching``)."""
    if obj is None:
        raise ArtifactError(f"model '{name}': nothing to serve (the value is None); serve "
                            f"{_SERVABLE}")
    streaming = bool(decoupled) or sequence or (decoupled is None and _is_generator(obj))
    if streaming or _text_convention(obj, example) is not None:
        if not callable(obj) or isinstance(obj, (str, bytes)):
            raise ArtifactError(f"model '{name}': only a Python callable can be served "
                                f"{'decoupled' if decoupled else 'as a sequence model'}")
        return _streaming_callable(obj, name, example, inputs, outputs, max_batch_size,
                                   decoupled=bool(decoupled) or (decoupled is None and _is_generator(obj)),
                                   sequence=sequence)
    inputs = [_spec(s, name) for s in inputs] if inputs is not None else None
    outputs = [_spec(s, name) for s in outputs] if outputs is not None else None
    if isinstance(obj, str) and "TritonPythonModel" in obj:
        return _model_py(obj, name, inputs, outputs, max_batch_size)
    if isinstance(obj, (str, os.PathLike)):
        return _from_path(Path(obj), name, inputs, outputs, max_batch_size)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return _onnx_bytes(bytes(obj), name, max_batch_size)
    if _is_type(obj, "onnx", "ModelProto"):
        return _onnx_bytes(obj.SerializeToString(), name, max_batch_size)
    if type(obj).__name__ == "ICudaEngine":
        return _plan(bytes(obj.serialize()), name, max_batch_size)
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(obj, torch.export.ExportedProgram):
            buf = io.BytesIO()
            torch.export.save(obj, buf)
            return _pt2(buf.getvalue(), name, max_batch_size, None, None)
        if isinstance(obj, torch.jit.ScriptModule):
            return _torchscript(obj, name, example, inputs, outputs, max_batch_size)
        if isinstance(obj, torch.nn.Module):
            return _torch_module(obj, name, example, inputs, outputs, max_batch_size)
    if callable(obj):
        return _callable(obj, name, example, inputs, outputs, max_batch_size)
    raise ArtifactError(f"model '{name}': cannot serve a {type(obj).__module__}.{type(obj).__qualname__}; "
                        f"serve {_SERVABLE}")


def _is_type(obj: Any, module: str, cls: str) -> bool:
    return type(obj).__name__ == cls and type(obj).__module__.split(".")[0] == module


def _from_path(path: Path, name: str, inputs, outputs, max_batch_size: int | None) -> Artifact:
    if not path.is_file():
        raise ArtifactError(f"model '{name}': no such file '{path}'; serve {_SERVABLE}")
    data = path.read_bytes()
    suffix = path.suffix.lower()
    if suffix == ".onnx":
        return _onnx_bytes(data, name, max_batch_size)
    if suffix in (".plan", ".engine"):
        return _plan(data, name, max_batch_size)
    if suffix == ".pt2":
        return _pt2(data, name, max_batch_size, None, None)
    if suffix == ".py":
        return _model_py(data.decode("utf-8"), name, inputs, outputs, max_batch_size)
    if suffix in (".pt", ".pth", ".ts"):
        if not inputs or not outputs:
            raise ArtifactError(f"model '{name}': a TorchScript file does not record its tensor "
                                f"shapes: pass inputs=[(\"INPUT__0\", \"FP32\", [-1, 4])] and "
                                f"outputs=[...]")
        return _script_artifact(data, name, inputs, outputs, max_batch_size, [])
    raise ArtifactError(f"model '{name}': unknown model file type '{path.name}' (known: .onnx, "
                        f".pt, .pt2, .plan, .py)")
