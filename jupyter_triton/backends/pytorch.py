"""Triton's pytorch backend: TorchScript ``model.pt`` (platform pytorch_libtorch), and
``torch.export`` programs ``model.pt2`` (platform torch_export, our addition).

TorchScript tensor names follow Triton's pytorch backend: inputs named after forward()'s
arguments, or ``<name>__<index>``, or else taken in config order; outputs ``<name>__<index>``
or config order (a dict output is matched by key). A TorchScript module does not say its
shapes, so its config must list inputs and outputs (Triton cannot auto-complete it either).
An exported program does: its config is auto-completed like an ONNX model's, inputs named
after forward()'s arguments and outputs ``OUTPUT__<index>`` (or the keys of a dict output).
A ``model.pt2`` is read by ``exported_program.load_program``, which refuses a file that would
run its own code in this process (pickled objects, compiled libraries, code as shapes).

Parameters (Triton's keys): INTRA_OP_THREAD_COUNT, INTER_OP_THREAD_COUNT (both are
process-wide in torch, as in Triton), INFERENCE_MODE (default true),
DISABLE_OPTIMIZED_EXECUTION; and ours, OMP_WAIT_POLICY (PASSIVE by default, or ACTIVE).

torch's intra-op threads are OpenMP's, which by default spin ~300,000 rounds after each
parallel region before they sleep: on cores shared with the front end that spinning is
most of the server's CPU, and slows the model itself (see benchmarks/results/notes-backends.md).
OpenMP reads its wait policy once, when torch is first imported; so the first model to import
torch here decides it (the parameter, else ``$OMP_WAIT_POLICY``, else PASSIVE), and the
environment is left as it was (kernels the server starts later keep their own default).
Where torch was imported before, it is what it was, and a model asking otherwise logs a warning.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.datatypes import DATATYPES
from ..protocol.errors import Internal, InvalidArgument, TritonError, Unavailable, Unsupported
from .base import ModelFiles, TensorBackend, Tensors
from .devices import require_gpu
from .exported_program import load_program
from .signature import (WILDCARD_DIM, ModelSignature, TensorSignature, as_config_dtype,
                        batch_input_targets, bool_parameter, check_config, complete_config,
                        int_parameter, parameter)

log = logging.getLogger(__name__)

TORCHSCRIPT_PLATFORM = "pytorch_libtorch"
EXPORT_PLATFORM = "torch_export"
TORCHSCRIPT_FILENAME = "model.pt"
EXPORT_FILENAME = "model.pt2"

_INDEXED = re.compile(r"^.*__(\d+)$")
_THREADS_LOCK = threading.Lock()

# torch dtype name -> config data type
_TORCH_TYPES: dict[str, int] = {d.torch: d.code for d in DATATYPES.values() if d.torch}


_WAIT_POLICIES = ("PASSIVE", "ACTIVE")
_omp_wait_policy: str | None = None     # what torch's OpenMP started with, when we imported it


def _torch():
    try:
        import torch
    except ImportError:
        raise Unavailable("PyTorch backend needs torch: pip install jupyter-triton[torch]") from None
    return torch


def _start_torch(config: mc.ModelConfig):
    """torch, imported (if nobody has yet) with the OpenMP wait policy this model asks."""
    global _omp_wait_policy
    asked = parameter(config, "OMP_WAIT_POLICY")
    if asked is not None and asked.strip().upper() not in _WAIT_POLICIES:
        raise InvalidArgument(f"model '{config.name}': parameter 'OMP_WAIT_POLICY' must be "
                              f"PASSIVE or ACTIVE, got '{asked}'")
    asked = asked.strip().upper() if asked is not None else None
    with _THREADS_LOCK:
        if "torch" not in sys.modules:
            before = os.environ.get("OMP_WAIT_POLICY")
            policy = asked or (before or "PASSIVE").upper()
            os.environ["OMP_WAIT_POLICY"] = policy
            try:
                _torch()
                _omp_wait_policy = policy
            finally:
                if before is None:
                    del os.environ["OMP_WAIT_POLICY"]
                else:
                    os.environ["OMP_WAIT_POLICY"] = before
        elif asked is not None and asked != _omp_wait_policy:
            log.warning("model '%s': OMP_WAIT_POLICY=%s not applied: torch's OpenMP threads "
                        "started %s", config.name, asked,
                        f"with {_omp_wait_policy}" if _omp_wait_policy else "before this server loaded torch")
    return _torch()


def _artifact(files: ModelFiles, config: mc.ModelConfig) -> Path:
    """model.pt2 when the config says torch_export or only a .pt2 is there; else model.pt."""
    if files.default_filename and files.default_filename not in (TORCHSCRIPT_FILENAME, EXPORT_FILENAME):
        path = files.version_dir / files.default_filename
    elif config.platform == EXPORT_PLATFORM:
        path = files.version_dir / EXPORT_FILENAME
    elif config.platform == TORCHSCRIPT_PLATFORM:
        path = files.version_dir / TORCHSCRIPT_FILENAME
    elif files.default_filename:
        path = files.version_dir / files.default_filename
        if not path.exists() and (files.version_dir / EXPORT_FILENAME).exists():
            path = files.version_dir / EXPORT_FILENAME
    else:
        path = files.version_dir / TORCHSCRIPT_FILENAME
        if not path.exists() and (files.version_dir / EXPORT_FILENAME).exists():
            path = files.version_dir / EXPORT_FILENAME
    if not path.is_file():
        raise InvalidArgument(
            f"unable to find '{path}' for model '{files.model_name}' version {files.version}")
    return path


def _is_export(path: Path) -> bool:
    return path.suffix == ".pt2"


def _load_export(path: Path, files: ModelFiles):
    _torch()
    return load_program(path, files.model_name, files.version)


def _load_script(path: Path, files: ModelFiles, device: str):
    torch = _torch()
    try:
        return torch.jit.load(str(path), map_location=device)
    except Exception as err:
        raise InvalidArgument(
            f"model '{files.model_name}' version {files.version}: '{path.name}' is not a "
            f"TorchScript module saved by torch.jit.save: {err}") from None


def export_signature(program, model: str, config: mc.ModelConfig | None = None) -> ModelSignature:
    """The signature of an ExportedProgram, tensors in call order: inputs named after
    forward()'s arguments, outputs after the keys of a dict output, else OUTPUT__<i>; a
    config that names them ``<name>__<index>`` instead has its names adopted by index."""
    torch = _torch()
    in_spec = program.call_spec.in_spec
    args_spec = _children(in_spec)[0] if in_spec is not None and _children(in_spec) else None
    if args_spec is not None and any(not c.is_leaf() for c in _children(args_spec)):
        raise Unsupported(f"model '{model}': exported forward() takes nested arguments; "
                          f"only tensors can be served")
    nodes = {n.name: n for n in program.graph.nodes}
    input_names = list(program.graph_signature.user_inputs)
    out_spec = program.call_spec.out_spec
    count = len(program.graph_signature.user_outputs)
    if out_spec is not None and out_spec.type is dict and all(c.is_leaf() for c in _children(out_spec)):
        output_names = [str(k) for k in out_spec.context]
    else:
        output_names = [f"OUTPUT__{i}" for i in range(count)]

    def tensor(name: str, val: Any) -> TensorSignature:
        if not isinstance(val, torch.Tensor):
            raise Unsupported(f"model '{model}': '{name}' is not a tensor ({type(val).__name__})")
        dtype = str(val.dtype).replace("torch.", "")
        if dtype not in _TORCH_TYPES:
            raise Unsupported(f"model '{model}': tensor '{name}' has dtype {dtype}, which Triton "
                              f"cannot serve")
        shape = [d if isinstance(d, int) else WILDCARD_DIM for d in val.shape]
        return TensorSignature(name, _TORCH_TYPES[dtype], shape)

    inputs = [tensor(n, nodes[n].meta.get("val")) for n in input_names]
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    user_out = set(program.graph_signature.user_outputs)
    out_vals = [a.meta.get("val") for a in output_node.args[0]
                if getattr(a, "name", None) in user_out]
    outputs = [tensor(name, val) for name, val in zip(output_names, out_vals)]
    if config is not None:
        _adopt_indexed_names(inputs, [i.name for i in config.input])
        _adopt_indexed_names(outputs, [o.name for o in config.output])

    # the batch limit: the upper bound of the symbols the inputs' first dims use
    limit = None
    for n in input_names:
        val = nodes[n].meta["val"]
        if val.ndim and isinstance(val.shape[0], torch.SymInt):
            bound = program.range_constraints.get(val.shape[0].node.expr)
            try:
                upper = int(getattr(bound, "upper", None))
            except Exception:  # unbounded: sympy's oo / torch's int_oo
                upper = None
            if upper is not None:
                limit = upper if limit is None else min(limit, upper)
    return ModelSignature(inputs, outputs, limit)


def _children(spec) -> list:
    # torch >= 2.10 deprecates TreeSpec.children_specs for children()
    return list(spec.children()) if hasattr(spec, "children") else list(spec.children_specs)


def _adopt_indexed_names(tensors: list[TensorSignature], names: list[str]) -> None:
    """Triton's ``<name>__<index>`` convention: tensor i takes the config name with index i."""
    known = {t.name for t in tensors}
    if not names or all(n in known for n in names):
        return
    matches = [_INDEXED.match(n) for n in names]
    if not all(matches):
        return   # check_config names the tensor that matches nothing
    for name, m in zip(names, matches):
        index = int(m.group(1))
        if index < len(tensors):
            tensors[index].name = name


def _script_forward_args(module) -> list[str]:
    try:
        args = module.forward.schema.arguments
    except Exception:
        return []
    return [a.name for a in args][1:]   # drop self


class PyTorchBackend(TensorBackend):
    backend_name = "pytorch"
    platforms = (TORCHSCRIPT_PLATFORM, EXPORT_PLATFORM)
    default_filename = TORCHSCRIPT_FILENAME

    @classmethod
    def auto_complete_config(cls, config: mc.ModelConfig, files: ModelFiles) -> mc.ModelConfig:
        path = _artifact(files, config)
        model = config.name or files.model_name
        _start_torch(config)
        if _is_export(path):
            program = _load_export(path, files)
            signature = export_signature(program, model, config)
            return complete_config(config, signature, backend=cls.backend_name,
                                   platform=EXPORT_PLATFORM)
        out = mc.ModelConfig()
        out.CopyFrom(config)
        out.backend = out.backend or cls.backend_name
        out.platform = out.platform or TORCHSCRIPT_PLATFORM
        _require_io(out)
        return out

    # -- load -------------------------------------------------------------------------------

    def load(self) -> None:
        cfg = self.config
        torch = _start_torch(cfg)
        for t in list(cfg.input) + list(cfg.output):
            if t.data_type == mc.TYPE_STRING:
                raise Unsupported(
                    f"model '{cfg.name}': tensor '{t.name}' is TYPE_STRING; the PyTorch backend "
                    f"serves numeric tensors only")
        if self.instance.kind == "KIND_GPU":
            require_gpu(cfg.name, self.instance.device_id)
            if not torch.cuda.is_available():
                raise Unavailable(f"model '{cfg.name}': KIND_GPU needs a CUDA build of torch "
                                  f"(installed: {torch.__version__})")
            self.device = torch.device("cuda", self.instance.device_id)
        else:
            self.device = torch.device("cpu")
        self._apply_threads(torch)
        self._inference_mode = bool_parameter(cfg, "INFERENCE_MODE")
        if self._inference_mode is None:
            self._inference_mode = True
        self._optimized = not bool_parameter(cfg, "DISABLE_OPTIMIZED_EXECUTION")
        path = _artifact(self.files, cfg)
        self._exported = _is_export(path)
        if self._exported:
            program = _load_export(path, self.files)
            signature = export_signature(program, cfg.name, cfg)
            check_config(cfg, signature)
            self._module = program.module().to(self.device)
            self._input_order = [t.name for t in signature.inputs]
            self._output_names = [t.name for t in signature.outputs]
            # a program exported from keyword arguments (a dict example) takes them so again
            in_spec = program.call_spec.in_spec
            self._by_name = bool(in_spec is not None and len(_children(in_spec)) > 1
                                 and list(_children(in_spec)[1].context or ()))
        else:
            _require_io(cfg)
            self._module = _load_script(path, self.files, str(self.device))
            self._module.eval()
            self._input_order = self._order_inputs(_script_forward_args(self._module))
            self._output_names = self._order_outputs()
            self._by_name = False
        self._output_types = {o.name: o.data_type for o in cfg.output}
        # the config's inputs and the batch inputs the server generates (backends/ragged.py)
        self._input_types = {i.name: i.data_type for i in cfg.input}
        for batch_input in cfg.batch_input:
            self._input_types.update(dict.fromkeys(batch_input.target_name, batch_input.data_type))

    def _apply_threads(self, torch) -> None:
        intra = int_parameter(self.config, "INTRA_OP_THREAD_COUNT")
        inter = int_parameter(self.config, "INTER_OP_THREAD_COUNT")
        with _THREADS_LOCK:
            if intra is not None and intra > 0:
                torch.set_num_threads(intra)
            if inter is not None and inter > 0 and torch.get_num_interop_threads() != inter:
                try:
                    torch.set_num_interop_threads(inter)
                except RuntimeError as err:
                    # torch allows it once, before any inter-op work: say so, keep serving
                    log.warning("model '%s': INTER_OP_THREAD_COUNT=%d not applied: %s",
                                self.config.name, inter, err)

    def _order_inputs(self, arg_names: list[str]) -> list[str]:
        """Config input names in forward()'s argument order (Triton's three conventions)."""
        cfg = self.config
        names = [i.name for i in cfg.input] + sorted(batch_input_targets(cfg))
        if arg_names and len(names) > len(arg_names):
            raise InvalidArgument(
                f"unable to load model '{cfg.name}', configuration expects {len(names)} inputs, "
                f"model provides {len(arg_names)}")
        if arg_names and all(n in arg_names for n in names):
            skipped = [a for a in arg_names[:len(names)] if a not in names]
            if skipped:
                raise InvalidArgument(
                    f"unable to load model '{cfg.name}', forward() argument(s) "
                    f"{', '.join(skipped)} have no input in the configuration")
            return sorted(names, key=arg_names.index)
        indexed = [_INDEXED.match(n) for n in names]
        if all(indexed):
            order = sorted(range(len(names)), key=lambda i: int(indexed[i].group(1)))
            positions = sorted(int(m.group(1)) for m in indexed)
            if positions != list(range(len(names))):
                raise InvalidArgument(
                    f"unable to load model '{cfg.name}', input indices "
                    f"{positions} must be 0..{len(names) - 1} (names like INPUT__0)")
            return [names[i] for i in order]
        return names

    def _order_outputs(self) -> list[str]:
        names = [o.name for o in self.config.output]
        indexed = [_INDEXED.match(n) for n in names]
        if all(indexed):
            by_index = {int(m.group(1)): n for m, n in zip(indexed, names)}
            if len(by_index) != len(names):
                raise InvalidArgument(
                    f"unable to load model '{self.config.name}', two outputs share an index")
            width = max(by_index) + 1
            return [by_index.get(i, "") for i in range(width)]
        return names

    # -- run --------------------------------------------------------------------------------

    def run(self, inputs: Tensors) -> Tensors:
        torch = _torch()
        cfg = self.config
        t0 = time.monotonic_ns()
        args = [self._to_torch(torch, name, inputs[name]) for name in self._input_order]
        t1 = time.monotonic_ns()
        mode = torch.inference_mode() if self._inference_mode else torch.no_grad()
        try:
            with mode, torch.jit.optimized_execution(self._optimized):
                result = (self._module(**dict(zip(self._input_order, args))) if self._by_name
                          else self._module(*args))
        except TritonError:
            raise
        except Exception as err:
            raise InvalidArgument(f"PyTorch execute failure for model '{cfg.name}': "
                                  f"{str(err).strip().splitlines()[-1] if str(err).strip() else err}") from None
        t2 = time.monotonic_ns()
        outputs = self._outputs(torch, result)
        self.io_ns = (t1 - t0, time.monotonic_ns() - t2)
        return outputs

    def _to_torch(self, torch, name: str, value: np.ndarray):
        data_type = self._input_types[name]
        if value.dtype == np.object_:
            raise Unsupported(f"input '{name}' of model '{self.config.name}': BYTES tensors are "
                              f"not supported by the PyTorch backend")
        try:
            # Zero-copy where the array may be written; request bytes are read-only views,
            # which torch refuses to wrap without a warning, so those are copied once.
            tensor = torch.from_numpy(np.require(value, requirements=["C", "W"]))
        except TypeError as err:
            raise Unsupported(f"input '{name}' of model '{self.config.name}': {err}") from None
        if data_type == mc.TYPE_BF16:
            tensor = tensor.to(torch.bfloat16)
        return tensor.to(self.device) if self.device.type != "cpu" else tensor

    def _outputs(self, torch, result: Any) -> Tensors:
        cfg = self.config
        if isinstance(result, dict):
            values = {str(k): v for k, v in result.items()}
        else:
            seq = list(result) if isinstance(result, (tuple, list)) else [result]
            if len(seq) < len([n for n in self._output_names if n]):
                raise Internal(f"model '{cfg.name}' returned {len(seq)} output(s) but the "
                               f"configuration expects {len(self._output_names)}")
            values = {n: v for n, v in zip(self._output_names, seq) if n}
        outputs = {}
        for name, data_type in self._output_types.items():
            value = values.get(name)
            if value is None:
                raise Internal(f"model '{cfg.name}' did not produce output '{name}'")
            if not isinstance(value, torch.Tensor):
                value = torch.as_tensor(value)
            value = value.detach()
            if value.dtype == torch.bfloat16:
                value = value.float()   # numpy has no bfloat16; BF16 travels as float32
            outputs[name] = as_config_dtype(value.cpu().numpy(), data_type)
        return outputs

    def unload(self) -> None:
        self._module = None


def _require_io(config: mc.ModelConfig) -> None:
    missing = [f"'{kind}'" for kind, io in (("input", config.input), ("output", config.output))
               if not io]
    incomplete = [t.name for t in list(config.input) + list(config.output)
                  if t.data_type == mc.TYPE_INVALID or (not t.dims and not t.HasField("reshape"))]
    if missing or incomplete:
        what = (f"must list {' and '.join(missing)} tensors" if missing else
                f"must give data_type and dims for {', '.join(incomplete)}")
        raise InvalidArgument(
            f"model '{config.name}': a TorchScript model does not record its tensor shapes, so "
            f"its configuration {what} (names like INPUT__0 / OUTPUT__0, or forward()'s "
            f"argument names)")
