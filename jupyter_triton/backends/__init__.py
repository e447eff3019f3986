"""Runtimes, one module each, found by the config's ``backend``/``platform`` spelled as Triton
spells them, or by the artifact's file name when a config names neither.

Layer note: this layer owns running one model's files: load, execute (a dict of arrays in, a
dict of arrays out), unload, and the runtime's own threads or worker processes. It may import
``protocol`` (datatypes, errors) and ``config`` (the ModelConfig it is given); it must not
import the engine, a frontend or the repository: scheduling, batching and HTTP are above it,
and it is handed its files. Measured costs behind its defaults:
benchmarks/results/notes-backends.md.
"""
from __future__ import annotations

import importlib
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.errors import InvalidArgument
from .base import Backend, InstanceSpec, ModelFiles, TensorBackend, Tensors

# backend name -> (module, class, platforms, artifact file names that imply it)
_REGISTRY: dict[str, tuple[str, str, tuple[str, ...], tuple[str, ...]]] = {
    "onnxruntime": ("onnxruntime", "OnnxRuntimeBackend", ("onnxruntime_onnx",), ("model.onnx",)),
    "pytorch": ("pytorch", "PyTorchBackend", ("pytorch_libtorch", "torch_export"), ("model.pt", "model.pt2")),
    "tensorrt": ("tensorrt", "TensorRTBackend", ("tensorrt_plan",), ("model.plan",)),
    "python": ("python", "PythonBackend", (), ("model.py",)),
}


def backend_name(config: mc.ModelConfig, model_dir: Path | None = None) -> str:
    """Triton's backend name for a config; guessed from the files when it names none."""
    if config.backend:
        if config.backend not in _REGISTRY:
            raise InvalidArgument(
                f"model '{config.name}': unknown backend '{config.backend}' "
                f"(known: {', '.join(sorted(_REGISTRY))})")
        return config.backend
    if config.platform:
        for name, (_, _, platforms, _) in _REGISTRY.items():
            if config.platform in platforms:
                return name
        raise InvalidArgument(f"model '{config.name}': unknown platform '{config.platform}'")
    if model_dir is not None:
        for name, (_, _, _, filenames) in _REGISTRY.items():
            if any(any(v.joinpath(f).exists() for f in filenames)
                   for v in model_dir.iterdir() if v.is_dir() and v.name.isdigit()):
                return name
    raise InvalidArgument(
        f"model '{config.name}': config.pbtxt names no backend or platform and no known "
        f"model file (model.onnx, model.pt, model.pt2, model.plan, model.py) was found")


def backend_class(name: str) -> type[Backend]:
    module, cls, _, _ = _REGISTRY[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


__all__ = ["Backend", "InstanceSpec", "ModelFiles", "TensorBackend", "Tensors",
           "backend_class", "backend_name"]
