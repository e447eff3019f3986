"""Triton's tensorrt backend: a serialized engine ``model.plan`` run with the TensorRT 10
Python runtime on the instance's GPU.

Device buffers are torch CUDA tensors: whoever builds TensorRT engines in Python almost
always has torch with CUDA, and it gives allocation, host<->device copies and streams
without another dependency (cuda-python would need all three written by hand). So this
backend needs ``tensorrt`` (>= 10, the name-based I/O API) and a CUDA build of ``torch``.

Dynamic shapes: each run picks the first optimization profile whose [min, max] range
covers every input's shape. Engines with data-dependent output shapes or shape tensors are
refused at load, with the reason.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.datatypes import DATATYPES
from ..protocol.errors import Internal, InvalidArgument, Unavailable, Unsupported
from .base import ModelFiles, TensorBackend, Tensors
from .devices import gpu_count, require_gpu
from .signature import (WILDCARD_DIM, ModelSignature, TensorSignature, as_config_dtype,
                        check_config, complete_config)

log = logging.getLogger(__name__)

PLATFORM = "tensorrt_plan"
DEFAULT_FILENAME = "model.plan"

# trt.DataType name -> (config data type, torch dtype name)
_TRT_TYPES: dict[str, tuple[int, str]] = {
    d.tensorrt: (d.code, d.torch) for d in DATATYPES.values() if d.tensorrt}

_RUNTIME_LOCK = threading.Lock()


def _runtime_modules(model: str) -> tuple[Any, Any]:
    """(tensorrt, torch), or Unavailable saying which is missing."""
    try:
        import tensorrt as trt
    except ImportError:
        raise Unavailable(f"model '{model}': the TensorRT backend needs the tensorrt Python "
                          f"package: pip install jupyter-triton[tensorrt]") from None
    if int(trt.__version__.split(".")[0]) < 10:
        raise Unavailable(f"model '{model}': the TensorRT backend needs tensorrt >= 10 "
                          f"(installed: {trt.__version__})")
    if gpu_count() == 0:
        raise Unavailable(f"model '{model}': TensorRT engines run only on an NVIDIA GPU, and "
                          f"there is no NVIDIA GPU on this machine")
    try:
        import torch
    except ImportError:
        raise Unavailable(f"model '{model}': the TensorRT backend allocates GPU buffers with "
                          f"torch: pip install jupyter-triton[torch] (a CUDA build)") from None
    if not torch.cuda.is_available():
        raise Unavailable(f"model '{model}': the TensorRT backend needs a CUDA build of torch "
                          f"(installed: {torch.__version__})")
    return trt, torch


def _plan_path(files: ModelFiles) -> Path:
    path = files.version_dir / (files.default_filename or DEFAULT_FILENAME)
    if not path.is_file():
        raise InvalidArgument(
            f"unable to find '{path}' for model '{files.model_name}' version {files.version}")
    return path


def _deserialize(trt, torch, path: Path, files: ModelFiles, device_id: int):
    logger = trt.Logger(trt.Logger.WARNING)
    with _RUNTIME_LOCK, torch.cuda.device(device_id):
        runtime = trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise InvalidArgument(
            f"model '{files.model_name}' version {files.version}: '{path.name}' is not a "
            f"TensorRT engine this TensorRT ({trt.__version__}) and GPU can deserialize "
            f"(plans are specific to the TensorRT version and GPU they were built with)")
    return runtime, engine


def engine_signature(trt, engine, model: str) -> tuple[ModelSignature, dict[str, list[tuple]]]:
    """Inputs/outputs of an engine, the largest batch some profile allows, and per input
    the (min, max) shape of each optimization profile."""
    inputs, outputs = [], []
    profiles: dict[str, list[tuple]] = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        dtype = engine.get_tensor_dtype(name).name
        if dtype not in _TRT_TYPES:
            raise Unsupported(f"model '{model}': tensor '{name}' has TensorRT type {dtype}, which "
                              f"Triton cannot serve")
        if engine.is_shape_inference_io(name):
            raise Unsupported(f"model '{model}': '{name}' is a shape tensor; shape tensors are "
                              f"not supported here")
        shape = [int(d) if d >= 0 else WILDCARD_DIM for d in engine.get_tensor_shape(name)]
        tensor = TensorSignature(name, _TRT_TYPES[dtype][0], shape)
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            inputs.append(tensor)
            profiles[name] = []
            for p in range(engine.num_optimization_profiles):
                low, _opt, high = engine.get_tensor_profile_shape(name, p)
                profiles[name].append((tuple(low), tuple(high)))
        else:
            outputs.append(tensor)
    limit = None
    dynamic_batch = [t.name for t in inputs if t.shape and t.shape[0] == WILDCARD_DIM]
    if dynamic_batch:
        limit = max(min(profiles[n][p][1][0] for n in dynamic_batch)
                    for p in range(engine.num_optimization_profiles))
    return ModelSignature(inputs, outputs, limit), profiles


class TensorRTBackend(TensorBackend):
    backend_name = "tensorrt"
    platforms = (PLATFORM,)
    default_filename = DEFAULT_FILENAME

    @classmethod
    def auto_complete_config(cls, config: mc.ModelConfig, files: ModelFiles) -> mc.ModelConfig:
        model = config.name or files.model_name
        path = _plan_path(files)
        try:
            trt, torch = _runtime_modules(model)
        except Unavailable:
            # a complete config needs nothing from the engine; load() will say what is missing
            if config.input and config.output:
                out = mc.ModelConfig()
                out.CopyFrom(config)
                out.backend = out.backend or cls.backend_name
                out.platform = out.platform or PLATFORM
                return out
            raise
        _, engine = _deserialize(trt, torch, path, files, 0)
        signature, _ = engine_signature(trt, engine, model)
        return complete_config(config, signature, backend=cls.backend_name, platform=PLATFORM)

    def load(self) -> None:
        cfg = self.config
        trt, torch = _runtime_modules(cfg.name)
        if self.instance.kind != "KIND_GPU":
            raise InvalidArgument(
                f"model '{cfg.name}': TensorRT models run on GPU instances only; instance "
                f"'{self.instance.name}' is {self.instance.kind}")
        require_gpu(cfg.name, self.instance.device_id)
        self._torch = torch
        self.device = torch.device("cuda", self.instance.device_id)
        self._runtime, self._engine = _deserialize(trt, torch, _plan_path(self.files), self.files,
                                                   self.instance.device_id)
        signature, self._profiles = engine_signature(trt, self._engine, cfg.name)
        check_config(cfg, signature)
        self._inputs = [t.name for t in signature.inputs]
        self._outputs = [t.name for t in signature.outputs]
        self._engine_dtype = {}
        for name in self._inputs + self._outputs:
            trt_name = self._engine.get_tensor_dtype(name).name
            self._engine_dtype[name] = getattr(torch, _TRT_TYPES[trt_name][1])
        self._output_types = {o.name: o.data_type for o in cfg.output}
        with torch.cuda.device(self.device):
            self._context = self._engine.create_execution_context()
            self._stream = torch.cuda.Stream(self.device)
        if self._context is None:
            raise Unavailable(f"model '{cfg.name}': TensorRT could not create an execution context "
                              f"on GPU {self.instance.device_id} (out of GPU memory?)")
        self._profile = 0 if self._engine.num_optimization_profiles else -1

    def _choose_profile(self, shapes: dict[str, tuple[int, ...]]) -> int:
        count = self._engine.num_optimization_profiles
        for p in range(count):
            if all(_within(shapes[n], *self._profiles[n][p]) for n in self._inputs):
                return p
        ranges = "; ".join(f"{n}: " + ", ".join(f"{list(lo)}..{list(hi)}"
                                                  for lo, hi in self._profiles[n])
                           for n in self._inputs)
        raise InvalidArgument(
            f"model '{self.config.name}': no optimization profile of the TensorRT engine "
            f"accepts input shapes {dict((n, list(s)) for n, s in shapes.items())} "
            f"(profiles: {ranges})")

    def run(self, inputs: Tensors) -> Tensors:
        torch = self._torch
        ctx = self._context
        shapes = {n: tuple(inputs[n].shape) for n in self._inputs}
        keep = []   # device tensors must outlive the enqueue
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            profile = self._choose_profile(shapes)
            if profile != self._profile:
                ctx.set_optimization_profile_async(profile, self._stream.cuda_stream)
                self._profile = profile
            for name in self._inputs:
                value = inputs[name]
                if value.dtype == np.object_:
                    raise Unsupported(f"input '{name}' of model '{self.config.name}': BYTES "
                                      f"tensors are not supported by TensorRT")
                host = torch.from_numpy(np.ascontiguousarray(value))
                dev = host.to(self.device, non_blocking=False).to(self._engine_dtype[name])
                if not ctx.set_input_shape(name, tuple(dev.shape)):
                    raise InvalidArgument(f"model '{self.config.name}': TensorRT rejected shape "
                                          f"{list(dev.shape)} for input '{name}'")
                ctx.set_tensor_address(name, dev.data_ptr())
                keep.append(dev)
            results = {}
            for name in self._outputs:
                shape = tuple(ctx.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise Unsupported(f"model '{self.config.name}': output '{name}' has a "
                                      f"data-dependent shape {list(shape)}, which is not supported")
                out = torch.empty(shape, dtype=self._engine_dtype[name], device=self.device)
                ctx.set_tensor_address(name, out.data_ptr())
                results[name] = out
            if not ctx.execute_async_v3(self._stream.cuda_stream):
                raise Internal(f"model '{self.config.name}': TensorRT failed to enqueue the batch")
            self._stream.synchronize()
        outputs = {}
        for name, value in results.items():
            if name not in self._output_types:
                continue
            if value.dtype == torch.bfloat16:
                value = value.float()
            outputs[name] = as_config_dtype(value.cpu().numpy(), self._output_types[name])
        return outputs

    def unload(self) -> None:
        self._context = None
        self._engine = None
        self._runtime = None


def _within(shape: tuple[int, ...], low: tuple, high: tuple) -> bool:
    return len(shape) == len(low) and all(lo <= s <= hi for s, lo, hi in zip(shape, low, high))

