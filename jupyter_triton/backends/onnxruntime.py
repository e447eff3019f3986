"""Triton's onnxruntime backend: ``model.onnx`` run by an ONNX Runtime InferenceSession.

Config keys are Triton's: ``parameters`` intra_op_thread_count, inter_op_thread_count,
execution_mode, enable_mem_arena, enable_mem_pattern, memory.enable_memory_arena_shrinkage,
session.use_device_allocator_for_initializers (plus any other ``session.*`` ORT session
config entry, our addition); ``optimization.graph.level``; and
``optimization.execution_accelerators`` (gpu: "tensorrt", "cuda"; cpu: "openvino").

Default (ours, not ORT's): ``session.intra_op.allow_spinning`` and
``session.inter_op.allow_spinning`` are "0": ORT's pool threads sleep between operators
instead of spinning for a while, which on a machine shared with the front end (HTTP, gRPC,
Jupyter) burns the cores it needs: less server CPU per inference, for the same latency and more
throughput (see benchmarks/results/notes-backends.md). Set either to "1"
in ``parameters`` for ORT's spinning (a dedicated machine, many tiny operators).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.datatypes import DATATYPES
from ..protocol.errors import Internal, InvalidArgument, TritonError, Unavailable, Unsupported
from .base import ModelFiles, TensorBackend, Tensors
from .devices import require_gpu, resolve_kind
from .signature import (ModelSignature, TensorSignature, as_config_dtype, bool_parameter,
                        check_config, complete_config, int_parameter, numpy_dtype, parameter)

log = logging.getLogger(__name__)

PLATFORM = "onnxruntime_onnx"
DEFAULT_FILENAME = "model.onnx"

# onnxruntime's NodeArg.type -> config data type
_ORT_TYPES: dict[str, int] = {d.onnx: d.code for d in DATATYPES.values()}

# Triton's optimization.graph.level -> onnxruntime's level name; 0 / absent is ORT_ENABLE_ALL
_GRAPH_LEVELS = {-1: "ORT_ENABLE_BASIC", 0: "ORT_ENABLE_ALL", 1: "ORT_ENABLE_EXTENDED",
                 2: "ORT_DISABLE_ALL"}

# Triton's tensorrt accelerator keys that ORT spells differently; other "trt_*" pass through
_TRT_RENAMES = {"max_workspace_size_bytes": "trt_max_workspace_size",
                "int8_calibration_table_name": "trt_int8_calibration_table_name",
                "int8_use_native_calibration_table": "trt_int8_use_native_calibration_table",
                "minimum_segment_size": "trt_min_subgraph_size"}

# ORT session config entries whose default we change (see the module docstring)
_SESSION_DEFAULTS = {"session.intra_op.allow_spinning": "0", "session.inter_op.allow_spinning": "0"}

# Triton's deprecated model-level CUDA EP keys
_CUDA_PARAMETER_KEYS = ("cudnn_conv_algo_search", "gpu_mem_limit", "arena_extend_strategy",
                        "do_copy_in_default_stream")


def _ort():
    import onnxruntime
    return onnxruntime


def model_path(files: ModelFiles) -> Path:
    """The artifact: ``<version>/<default_model_filename>``; a directory of that name holds
    ``model.onnx`` next to its external-data files, as Triton allows."""
    path = files.version_dir / (files.default_filename or DEFAULT_FILENAME)
    if path.is_dir():
        path = path / DEFAULT_FILENAME
    if not path.is_file():
        raise InvalidArgument(
            f"unable to find '{path}' for model '{files.model_name}' version {files.version}")
    return path


def _open_session(path: Path, files: ModelFiles, options=None, providers=None,
                  provider_options=None):
    ort = _ort()
    if options is None:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        # metadata only: skip the optimizer
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        return ort.InferenceSession(str(path), sess_options=options,
                                    providers=providers or ["CPUExecutionProvider"],
                                    provider_options=provider_options)
    except Exception as err:  # onnxruntime raises its own Fail/InvalidGraph/... types
        name = type(err).__name__
        if name in ("InvalidProtobuf", "InvalidGraph", "NotImplemented", "Fail", "InvalidArgument"):
            raise InvalidArgument(
                f"model '{files.model_name}' version {files.version}: '{path.name}' could not be "
                f"loaded by ONNX Runtime: {err}") from None
        raise Unavailable(
            f"model '{files.model_name}' version {files.version}: ONNX Runtime failed to create "
            f"a session for '{path.name}': {err}") from None


def _dim(d: Any) -> int:
    return d if isinstance(d, int) and d >= 0 else -1


def session_signature(session, model: str) -> ModelSignature:
    def tensor(arg) -> TensorSignature:
        if arg.type not in _ORT_TYPES:
            raise Unsupported(
                f"model '{model}': tensor '{arg.name}' has type {arg.type}, which Triton "
                f"cannot serve")
        return TensorSignature(arg.name, _ORT_TYPES[arg.type], [_dim(d) for d in arg.shape])

    return ModelSignature([tensor(a) for a in session.get_inputs()],
                          [tensor(a) for a in session.get_outputs()])


class OnnxRuntimeBackend(TensorBackend):
    backend_name = "onnxruntime"
    platforms = (PLATFORM,)
    default_filename = DEFAULT_FILENAME

    _session: Any = None

    @classmethod
    def auto_complete_config(cls, config: mc.ModelConfig, files: ModelFiles) -> mc.ModelConfig:
        # the CPU provider reads the graph as well as any, and never touches CUDA
        session = _open_session(model_path(files), files)
        signature = session_signature(session, config.name or files.model_name)
        return complete_config(config, signature, backend=cls.backend_name, platform=PLATFORM)

    # -- load -------------------------------------------------------------------------------

    def load(self) -> None:
        ort = _ort()
        path = model_path(self.files)
        providers, provider_options = self._providers()
        self._session = _open_session(path, self.files, self._session_options(), providers,
                                      provider_options)
        if self._on_gpu and "CUDAExecutionProvider" not in self._session.get_providers():
            raise Unavailable(
                f"model '{self.config.name}': ONNX Runtime could not start its CUDA execution "
                f"provider on GPU {self.instance.device_id} (see the server log)")
        self._signature = session_signature(self._session, self.config.name)
        check_config(self.config, self._signature)
        for t in self._signature.inputs + self._signature.outputs:
            if t.data_type == mc.TYPE_BF16:
                raise Unsupported(
                    f"model '{self.config.name}': tensor '{t.name}' is BF16, which ONNX Runtime's "
                    f"Python API cannot exchange with numpy")
        self._model_rank = {t.name: len(t.shape) for t in self._signature.inputs}
        self._output_types = {o.name: o.data_type for o in self._signature.outputs}
        # numeric outputs already in the config's dtype pass through as they are
        self._output_dtypes = {n: numpy_dtype(t) for n, t in self._output_types.items()}
        self._output_names = list(self._output_types)
        self._output_dims = {o.name: list(o.dims) for o in self.config.output}
        self._run_options = ort.RunOptions()
        # a failing run raises with ORT's message; don't also print it to the server's stderr
        self._run_options.log_severity_level = 4
        shrink = parameter(self.config, "memory.enable_memory_arena_shrinkage")
        if shrink:
            self._run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", shrink)
        self._binding = self._session.io_binding() if self._on_gpu else None

    @property
    def _on_gpu(self) -> bool:
        return self.instance.kind == "KIND_GPU"

    def _session_options(self):
        ort = _ort()
        cfg = self.config
        options = ort.SessionOptions()
        options.log_severity_level = 3
        intra = int_parameter(cfg, "intra_op_thread_count")
        if intra is not None:
            options.intra_op_num_threads = max(intra, 0)
        else:
            options.intra_op_num_threads = _default_intra_op_threads(cfg)
        inter = int_parameter(cfg, "inter_op_thread_count")
        if inter is not None:
            options.inter_op_num_threads = max(inter, 0)
        mode = int_parameter(cfg, "execution_mode")
        if mode is not None:
            if mode not in (0, 1):
                raise InvalidArgument(
                    f"model '{cfg.name}': parameter 'execution_mode' must be 0 (sequential) or 1 "
                    f"(parallel), got {mode}")
            options.execution_mode = (ort.ExecutionMode.ORT_PARALLEL if mode == 1
                                      else ort.ExecutionMode.ORT_SEQUENTIAL)
        # Triton documents enable_mem_arena; accept the common misspelling too
        arena = bool_parameter(cfg, "enable_mem_arena")
        if arena is None:
            arena = bool_parameter(cfg, "enable_mem_area")
        if arena is not None:
            options.enable_cpu_mem_arena = arena
        pattern = bool_parameter(cfg, "enable_mem_pattern")
        if pattern is not None:
            options.enable_mem_pattern = pattern
        level = cfg.optimization.graph.level if cfg.optimization.HasField("graph") else 0
        if level not in _GRAPH_LEVELS:
            raise InvalidArgument(
                f"model '{cfg.name}': optimization.graph.level must be -1, 0, 1 or 2, got {level}")
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _GRAPH_LEVELS[level])
        entries = dict(_SESSION_DEFAULTS)
        entries.update((key, cfg.parameters[key].string_value) for key in cfg.parameters
                       if key.startswith("session."))
        for key, value in entries.items():
            # ORT reads anything but "1" as "0" here, silently: refuse what it would misread
            if key in _SESSION_DEFAULTS and value not in ("0", "1"):
                raise InvalidArgument(
                    f"model '{cfg.name}': parameter '{key}' must be \"0\" or \"1\", got '{value}'")
            options.add_session_config_entry(key, value)
        return options

    def _providers(self) -> tuple[list[str], list[dict[str, str]]]:
        ort = _ort()
        cfg = self.config
        available = set(ort.get_available_providers())
        accelerators = cfg.optimization.execution_accelerators
        providers: list[str] = []
        options: list[dict[str, str]] = []
        if self._on_gpu:
            require_gpu(cfg.name, self.instance.device_id)
            if "CUDAExecutionProvider" not in available:
                raise Unavailable(
                    f"model '{cfg.name}': instance kind KIND_GPU needs onnxruntime-gpu "
                    f"(CUDAExecutionProvider is not in this onnxruntime build)")
            device = str(self.instance.device_id)
            cuda = {"device_id": device}
            for key in _CUDA_PARAMETER_KEYS:
                if parameter(cfg, key):
                    cuda[key] = parameter(cfg, key)
            for acc in accelerators.gpu_execution_accelerator:
                if acc.name == "tensorrt":
                    if "TensorrtExecutionProvider" not in available:
                        raise Unsupported(
                            f"model '{cfg.name}': gpu_execution_accelerator 'tensorrt' needs "
                            f"onnxruntime built with the TensorRT execution provider")
                    providers.append("TensorrtExecutionProvider")
                    options.append(_tensorrt_options(cfg.name, dict(acc.parameters), device))
                elif acc.name == "cuda":
                    cuda.update(acc.parameters)
                else:
                    raise Unsupported(
                        f"model '{cfg.name}': unknown gpu_execution_accelerator '{acc.name}' "
                        f"(onnxruntime supports 'tensorrt' and 'cuda')")
            providers.append("CUDAExecutionProvider")
            options.append(cuda)
        else:
            for acc in accelerators.cpu_execution_accelerator:
                if acc.name == "openvino":
                    if "OpenVINOExecutionProvider" not in available:
                        raise Unsupported(
                            f"model '{cfg.name}': cpu_execution_accelerator 'openvino' needs "
                            f"onnxruntime-openvino, which is not installed")
                    providers.append("OpenVINOExecutionProvider")
                    options.append(dict(acc.parameters))
                else:
                    raise Unsupported(
                        f"model '{cfg.name}': unknown cpu_execution_accelerator '{acc.name}' "
                        f"(onnxruntime supports 'openvino')")
        providers.append("CPUExecutionProvider")
        options.append({})
        return providers, options

    # -- run --------------------------------------------------------------------------------

    def run(self, inputs: Tensors) -> Tensors:
        t0 = time.monotonic_ns()
        feeds = {name: self._feed(name, value) for name, value in inputs.items()}
        names = self._output_names
        t1 = time.monotonic_ns()
        try:
            if self._binding is not None:
                values = self._run_bound(feeds, names)
            else:
                values = self._session.run(names, feeds, self._run_options)
        except TritonError:
            raise
        except Exception as err:
            # ORT says INVALID_ARGUMENT for what the request sent (shapes, values)
            kind = InvalidArgument if type(err).__name__ == "InvalidArgument" else Internal
            raise kind(f"onnx runtime error running model '{self.config.name}': {err}") from None
        t2 = time.monotonic_ns()
        outputs = {}
        for name, value in zip(names, values):
            value = np.asarray(value)
            dims = self._output_dims.get(name)
            if value.ndim == 0 and dims is not None:
                # a scalar model output is served with the config's dims ([1])
                value = value.reshape([len(next(iter(inputs.values())))] + dims
                                      if self.config.max_batch_size > 0 else dims)
            want = self._output_dtypes[name]
            value = value if value.dtype == want and want != np.object_ else \
                as_config_dtype(value, self._output_types[name])
            outputs[name] = value
        self.io_ns = (t1 - t0, time.monotonic_ns() - t2)
        return outputs

    def _feed(self, name: str, value: np.ndarray) -> np.ndarray:
        if value.dtype == np.object_:
            try:
                # onnxruntime takes str for tensor(string): bytes would be fed as "b'..'"
                value = np.array([v.decode("utf-8") if isinstance(v, bytes) else str(v)
                                  for v in value.flat], dtype=object).reshape(value.shape)
            except UnicodeDecodeError:
                raise InvalidArgument(
                    f"input '{name}' of model '{self.config.name}': ONNX Runtime string tensors "
                    f"must be UTF-8") from None
        if self._model_rank.get(name) == 0 and value.size == 1:
            value = value.reshape(())
        return value

    def _run_bound(self, feeds: dict[str, np.ndarray], names: list[str]) -> list[np.ndarray]:
        # Outputs stay on the instance's GPU until the whole graph has run, then come back in
        # one copy each; strings live on the host in ORT.
        binding = self._binding
        device = self.instance.device_id
        try:
            for name, value in feeds.items():
                binding.bind_cpu_input(name, value)
            for name in names:
                if self._output_types[name] == mc.TYPE_STRING:
                    binding.bind_output(name, "cpu")
                else:
                    binding.bind_output(name, "cuda", device)
            self._session.run_with_iobinding(binding, self._run_options)
            return binding.copy_outputs_to_cpu()
        finally:
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()

    def unload(self) -> None:
        self._binding = None
        self._session = None


def _tensorrt_options(model: str, params: dict[str, str], device: str) -> dict[str, str]:
    options = {"device_id": device}
    for key, value in params.items():
        if key == "precision_mode":
            mode = value.upper()
            if mode not in ("FP32", "FP16", "INT8"):
                raise InvalidArgument(
                    f"model '{model}': tensorrt precision_mode must be FP32, FP16 or INT8, "
                    f"got '{value}'")
            if mode == "FP16":
                options["trt_fp16_enable"] = "True"
            elif mode == "INT8":
                options["trt_int8_enable"] = "True"
        elif key == "max_cached_engines":
            continue  # TensorRT-EP has no equivalent; Triton ignores it too
        elif key in _TRT_RENAMES:
            options[_TRT_RENAMES[key]] = value
        elif key.startswith("trt_"):
            options[key] = value
        else:
            raise InvalidArgument(
                f"model '{model}': unknown tensorrt accelerator parameter '{key}'")
    return options


def _default_intra_op_threads(config: mc.ModelConfig) -> int:
    """ORT's default is one thread per core *per session*, spinning between ops; several
    CPU instances then fight over the same cores. Give each CPU instance its share."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cpu_instances = sum(max(g.count, 1) for g in config.instance_group
                        if resolve_kind(g.kind) != "KIND_GPU") or 1
    if cpu_instances <= 1:
        return 0  # ORT's own default
    return max(1, cores // cpu_instances)
