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
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.datatypes import (DATATYPES, numpy_to_triton, parse_datatype, triton_to_config,
                                  triton_to_numpy)
from ..protocol.errors import InvalidArgument
from ..repository.callable_format import pack_callable, pack_model_py

TensorSpec = tuple[str, str, list[int]]

#: max_batch_size of a batchable model when none is asked for (Triton's default-max-batch-size)
DEFAULT_MAX_BATCH_SIZE = 4
#: rows of the probe batch a callable is run on when only its input specs are known
_PROBE_ROWS = 2

_SERVABLE = ("an ONNX model (onnx.ModelProto, its bytes or a .onnx path), a torch.nn.Module, a "
             "TorchScript module, a torch.export program, a TensorRT engine, a Python callable, or "
             "model.py source")

_TORCH_DTYPES = {d.torch: name for name, d in DATATYPES.items() if d.torch}


@dataclass
class Artifact:
    config: mc.ModelConfig
    files: dict[str, bytes]               # "1/<file>" -> bytes (the server renumbers the version)
    format: str                           # onnx | torch_export | torchscript | tensorrt | python
    inputs: list[TensorSpec] | None = None   # full shapes, when known on this side
    batching: bool | None = None          # None: the server's auto-complete decides
    notes: list[str] = field(default_factory=list)

    def config_json(self) -> str:
        return json_format.MessageToJson(self.config, preserving_proto_field_name=True, indent=None)


class ArtifactError(ValueError):
    """The object cannot be served as given; the message says what to pass."""


# ---- entry point --------------------------------------------------------------------------

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


def _base_config(name: str, backend: str, platform: str = "", max_batch_size: int = 0) -> mc.ModelConfig:
    return mc.ModelConfig(name=name, backend=backend, platform=platform, max_batch_size=max_batch_size)


# ---- tensor specs and dtypes ---------------------------------------------------------------

def triton_dtype(value: Any) -> str:
    """Triton's datatype name ("FP32") for an array, a tensor, a dtype or a spelled name."""
    if isinstance(value, str):
        try:
            return parse_datatype(value).name
        except InvalidArgument:
            pass            # maybe a numpy spelling ("float32")
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(value, torch.Tensor):
            value = value.dtype
        if isinstance(value, torch.dtype):
            key = str(value).removeprefix("torch.")
            if key not in _TORCH_DTYPES:
                raise ArtifactError(f"torch dtype {key} cannot be served by Triton")
            return _TORCH_DTYPES[key]
    dtype = value.dtype if hasattr(value, "dtype") and not isinstance(value, type) else value
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise ArtifactError(f"unknown datatype {value!r} (use Triton's names: FP32, INT64, BYTES, ...)") from None
    if dtype.kind in ("U", "S", "O"):
        return "BYTES"
    try:
        return numpy_to_triton(dtype)
    except InvalidArgument:
        raise ArtifactError(f"numpy dtype {dtype} cannot be served by Triton") from None


def _spec(spec: Any, model: str) -> TensorSpec:
    if isinstance(spec, dict):
        spec = (spec.get("name"), spec.get("datatype") or spec.get("data_type"),
                spec.get("shape") or spec.get("dims"))
    try:
        tensor, datatype, shape = spec
        return str(tensor), triton_dtype(datatype), [int(d) for d in shape]
    except (TypeError, ValueError) as err:
        raise ArtifactError(f"model '{model}': a tensor spec is (name, datatype, shape), e.g. "
                            f"(\"x\", \"FP32\", [-1, 4]); got {spec!r} ({err})") from None


def _config_dims(shape: list[int], batching: bool) -> list[int]:
    dims = list(shape[1:] if batching else shape)
    return dims or [1]


def _reshape_scalars(config: mc.ModelConfig, inputs: list[TensorSpec], outputs: list[TensorSpec],
                     batching: bool) -> None:
    """One value per row is spelled dims [1] with an empty reshape, as Triton spells it."""
    for tensors, specs in ((config.input, inputs), (config.output, outputs)):
        rank = {n: len(s) - (1 if batching else 0) for n, _, s in specs}
        for tensor in tensors:
            if rank.get(tensor.name) == 0 and batching:
                tensor.reshape.SetInParent()


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _rows(value: Any) -> int | None:
    shape = getattr(value, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) else None


def _decide_batch(model: str, batchable: bool, max_batch_size: int | None, why: str) -> int:
    """max_batch_size for a model whose batch support the kernel side has established."""
    if max_batch_size is None:
        return DEFAULT_MAX_BATCH_SIZE if batchable else 0
    if max_batch_size > 0 and not batchable:
        raise ArtifactError(f"model '{model}': max_batch_size {max_batch_size} needs a batch "
                            f"dimension, but {why}")
    return int(max_batch_size)


# ---- examples ------------------------------------------------------------------------------

def _parameter_names(fn: Callable) -> list[str] | None:
    """The names inputs take after the callable's parameters (those without a default,
    else the first one); None when it takes ``*args`` or has no readable signature."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    required = [p.name for p in positional if p.default is inspect.Parameter.empty]
    return required or [p.name for p in positional[:1]] or None


def _is_tensorish(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _split_example(example: Any, names: list[str] | None, model: str) -> tuple[list[str], list[Any], bool]:
    """(input names, values, by keyword) of an example: one array, a tuple of them, or a dict."""
    if isinstance(example, dict):
        return [str(k) for k in example], list(example.values()), True
    if isinstance(example, tuple) or (isinstance(example, list) and example
                                       and all(_is_tensorish(v) for v in example)):
        values = list(example)
    else:
        values = [example if _is_tensorish(example) else np.asarray(example)]
    if names is not None and len(names) >= len(values):
        chosen = names[:len(values)]
    else:
        chosen = [f"INPUT__{i}" for i in range(len(values))]
    return chosen, values, False


def _output_values(result: Any) -> tuple[list[str], list[Any]]:
    if isinstance(result, dict):
        return [str(k) for k in result], list(result.values())
    if isinstance(result, (tuple, list)) and result and all(_is_tensorish(v) for v in result):
        return [f"OUTPUT__{i}" for i in range(len(result))], list(result)
    return ["OUTPUT__0"], [result]


def _specs_of(names: list[str], values: list[Any]) -> list[TensorSpec]:
    specs = []
    for n, v in zip(names, values):
        arr = v if _is_tensorish(v) else np.asarray(v)
        specs.append((n, triton_dtype(arr), [int(d) for d in arr.shape]))
    return specs


def _batchable(inputs: list[TensorSpec], outputs: list[TensorSpec]) -> tuple[bool, str]:
    """Every tensor has the same leading size (the example's rows)."""
    firsts = {s[2][0] if s[2] else None for s in inputs}
    if len(firsts) != 1 or None in firsts:
        return False, "the example inputs do not share a first (batch) dimension"
    rows = firsts.pop()
    bad = [s[0] for s in outputs if not s[2] or s[2][0] != rows]
    if bad:
        return False, (f"output(s) {', '.join(bad)} do not have the example's {rows} rows as "
                       f"their first dimension")
    return True, ""


def _probe_values(specs: list[TensorSpec], batch_rows: int = _PROBE_ROWS) -> list[np.ndarray]:
    """Arrays of ones (not zeros: a probe should not divide by zero) in the declared shapes,
    ``batch_rows`` rows where the first dimension is -1."""
    out = []
    for _, datatype, shape in specs:
        dims = [batch_rows if (i == 0 and d < 0) else (1 if d < 0 else d) for i, d in enumerate(shape)]
        if datatype == "BYTES":
            out.append(np.full(dims, b"a", dtype=np.object_))
        else:
            out.append(np.ones(dims, dtype=triton_to_numpy(datatype)))
    return out


# ---- ONNX, TensorRT, exported programs, model.py ------------------------------------------

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


# ---- torch ----------------------------------------------------------------------------------

def _torch_example(torch, values: list[Any]) -> list[Any]:
    return [v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v)) for v in values]


def _run_module(torch, module, args: list[Any], kwargs: dict[str, Any]) -> Any:
    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            return module(*args, **kwargs)
    finally:
        module.train(training)


def _leading_linear(torch, module) -> tuple[int, Any] | None:
    """(in_features, dtype) of a module that starts with nn.Linear, else None."""
    first = module
    while isinstance(first, torch.nn.Sequential) and len(first):
        first = first[0]
    if isinstance(first, torch.nn.Linear):
        return first.in_features, first.weight.dtype
    return None


def _torch_module(module, name: str, example, inputs, outputs, max_batch_size) -> Artifact:
    torch = sys.modules["torch"]
    names = _parameter_names(module.forward)
    notes: list[str] = []
    if example is None:
        if inputs is None:
            found = _leading_linear(torch, module)
            if found is None:
                raise ArtifactError(
                    f"model '{name}': cannot tell the inputs of this {type(module).__name__}: pass "
                    f"example=<a batch of inputs> (--example VAR) or inputs=[(\"x\", \"FP32\", "
                    f"[-1, 16])]")
            width, dtype = found
            input_name = names[0] if names else "INPUT__0"
            inputs = [(input_name, triton_dtype(dtype), [-1, width])]
            notes.append(f"input '{input_name}' of width {width} read from the leading nn.Linear")
        return _callable(module, name, None, inputs, outputs, max_batch_size, notes=notes)

    in_names, values, keyword = _split_example(example, names, name)
    values = _torch_example(torch, values)
    args, kwargs = ([], dict(zip(in_names, values))) if keyword else (values, {})
    try:
        result = _run_module(torch, module, args, kwargs)
    except Exception as err:
        raise ArtifactError(f"model '{name}': running the module on the example failed: "
                            f"{type(err).__name__}: {err}") from None
    out_names, out_values = _output_values(result)
    in_specs, out_specs = _specs_of(in_names, values), _specs_of(out_names, out_values)
    batchable, why = _batchable(in_specs, out_specs)
    mbs = _decide_batch(name, batchable, max_batch_size, why)
    batching = mbs > 0
    full_inputs = [(n, d, [-1, *s[1:]] if batching else s) for n, d, s in in_specs]

    try:
        data = _export(torch, module, args, kwargs, batching)
        art = _pt2(data, name, mbs, full_inputs, batching)
        art.config.max_batch_size = mbs
        return art
    except Exception as err:  # unsupported ops, data-dependent control flow, ...
        notes.append(f"torch.export failed ({type(err).__name__}: {_first_line(err)}); ")
    if not keyword and all(isinstance(v, torch.Tensor) for v in _flat(result)):
        try:
            traced = _trace(torch, module, args)
            specs_in = [(f"INPUT__{i}", d, s) for i, (_, d, s) in enumerate(full_inputs)]
            specs_out = [(f"OUTPUT__{i}", d, [-1, *s[1:]] if batching else s)
                         for i, (_, d, s) in enumerate(out_specs)]
            notes[-1] += "served as a TorchScript trace"
            return _script_artifact(traced, name, specs_in, specs_out, mbs, notes)
        except Exception as err:
            notes[-1] += f"TorchScript trace failed too ({type(err).__name__}: {_first_line(err)}); "
    notes[-1] += "served as a Python callable"
    specs_out = [(n, d, [-1, *s[1:]] if batching else s) for n, d, s in out_specs]
    return _callable(module, name, None, full_inputs, outputs or specs_out, mbs, notes=notes,
                     keyword_names=in_names if keyword else None)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else ""


def _flat(result: Any) -> list[Any]:
    if isinstance(result, dict):
        return list(result.values())
    if isinstance(result, (tuple, list)):
        return list(result)
    return [result]


def _export(torch, module, args: list[Any], kwargs: dict[str, Any], batching: bool) -> bytes:
    values = list(args) + list(kwargs.values())
    if batching and values and values[0].shape[0] == 1:
        # torch.export specializes a dimension of size 1: trace with two rows
        args = [torch.cat([a, a]) for a in args]
        kwargs = {k: torch.cat([v, v]) for k, v in kwargs.items()}
    dynamic = None
    if batching:
        batch = torch.export.Dim("batch")
        dynamic = ({k: {0: batch} for k in kwargs} if kwargs else tuple({0: batch} for _ in args))
    training = module.training
    module.eval()
    try:
        with _quiet_torch_logs():
            program = torch.export.export(module, tuple(args), kwargs or None, dynamic_shapes=dynamic)
    finally:
        module.train(training)
    buf = io.BytesIO()
    torch.export.save(program, buf)
    return buf.getvalue()


def _trace(torch, module, args: list[Any]):
    """A TorchScript trace, refused when the tracer warns that it froze a data-dependent
    decision (the trace would silently give wrong answers for other inputs)."""
    training = module.training
    module.eval()
    try:
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", torch.jit.TracerWarning)
            traced = torch.jit.trace(module, tuple(args), check_trace=False)
    finally:
        module.train(training)
    frozen = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
    if frozen:
        raise RuntimeError(f"the trace would be wrong for other inputs: {frozen[0].message}")
    return traced


@contextlib.contextmanager
def _quiet_torch_logs():
    # A failed export logs and prints the graph it got stuck in; the note we keep says enough.
    handlers = {h for name, lg in logging.root.manager.loggerDict.items()
                if name.startswith("torch") and isinstance(lg, logging.Logger) for h in lg.handlers}
    drop = _DropBelowError()
    for h in handlers:
        h.addFilter(drop)
    try:
        with contextlib.redirect_stderr(io.StringIO()):   # export also prints the graph
            yield
    finally:
        for h in handlers:
            h.removeFilter(drop)


class _DropBelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def _script_artifact(script, name: str, inputs: list[TensorSpec], outputs: list[TensorSpec],
                     max_batch_size: int | None, notes: list[str]) -> Artifact:
    if isinstance(script, bytes):
        data = script
    else:
        buf = io.BytesIO()
        sys.modules["torch"].jit.save(script, buf)
        data = buf.getvalue()
    batching = all(s[2] and s[2][0] == -1 for s in inputs + outputs) and max_batch_size != 0
    mbs = _decide_batch(name, batching, max_batch_size,
                        "not every input and output has -1 as its first dimension")
    config = _base_config(name, "pytorch", "pytorch_libtorch", mbs)
    for kind, specs in (("input", inputs), ("output", outputs)):
        for tensor, datatype, shape in specs:
            getattr(config, kind).add(name=tensor, data_type=mc.DataType.Value(
                triton_to_config(datatype)), dims=_config_dims(shape, mbs > 0))
    _reshape_scalars(config, inputs, outputs, mbs > 0)
    return Artifact(config, {"1/model.pt": data}, "torchscript", list(inputs), mbs > 0, notes)


def _torchscript(script, name: str, example, inputs, outputs, max_batch_size) -> Artifact:
    torch = sys.modules["torch"]
    if example is None and inputs is None:
        raise ArtifactError(f"model '{name}': a TorchScript module does not record its tensor "
                            f"shapes: pass example=<a batch of inputs> or inputs=[(\"INPUT__0\", "
                            f"\"FP32\", [-1, 4])] (and outputs=[...])")
    if example is not None:
        _, values, keyword = _split_example(example, None, name)
        if keyword:
            raise ArtifactError(f"model '{name}': a TorchScript module takes positional inputs; "
                                f"pass the example as a tensor or a tuple of tensors")
        values = _torch_example(torch, values)
        in_specs = _specs_of([f"INPUT__{i}" for i in range(len(values))], values)
    else:
        in_specs = [(f"INPUT__{i}", d, s) for i, (_, d, s) in enumerate(inputs)]
        values = [torch.as_tensor(z) for z in _probe_values(in_specs)]
    if outputs is None:
        try:
            result = _run_module(torch, script, values, {})
        except Exception as err:
            raise ArtifactError(f"model '{name}': running the TorchScript module on the "
                                f"{'example' if example is not None else 'declared inputs'} failed "
                                f"({type(err).__name__}: {_first_line(err)}); pass outputs=[...]") from None
        out_specs = _specs_of([f"OUTPUT__{i}" for i in range(len(_flat(result)))], _flat(result))
    else:
        out_specs = [(f"OUTPUT__{i}", d, s) for i, (_, d, s) in enumerate(outputs)]
    if example is not None:
        batchable, why = _batchable(in_specs, out_specs)
        mbs = _decide_batch(name, batchable, max_batch_size, why)
        if mbs > 0:
            in_specs = [(n, d, [-1, *s[1:]]) for n, d, s in in_specs]
            out_specs = [(n, d, [-1, *s[1:]]) for n, d, s in out_specs]
        max_batch_size = mbs
    elif outputs is None and in_specs and all(s[2] and s[2][0] == -1 for s in in_specs):
        out_specs = [(n, d, [-1, *s[1:]]) if s and s[0] == _PROBE_ROWS else (n, d, s) for n, d, s in out_specs]
    return _script_artifact(script, name, in_specs, out_specs, max_batch_size, [])


# ---- Python callables -----------------------------------------------------------------------

def _callable(fn: Callable, name: str, example, inputs, outputs, max_batch_size,
              notes: list[str] | None = None, keyword_names: list[str] | None = None) -> Artifact:
    notes = list(notes or [])
    target = fn.forward if hasattr(fn, "forward") else fn
    names = keyword_names or _parameter_names(target)
    if example is None and inputs is None:
        raise ArtifactError(
            f"model '{name}': cannot tell the inputs of {_describe(fn)}: pass example=<a batch "
            f"of inputs> (--example VAR) or inputs=[(\"x\", \"FP32\", [-1, 4])]")
    if example is not None:
        in_names, values, keyword = _split_example(example, names, name)
        in_specs = _specs_of(in_names, values)
        call_values = values
    else:
        in_specs = list(inputs)
        call_values = _probe_values(in_specs)
        keyword = False
    if outputs is None:
        result = _call(fn, name, in_specs, call_values, keyword,
                       "example" if example is not None else "ones in the declared input shapes")
        out_names, out_values = _output_values(result)
        out_specs = _specs_of(out_names, out_values)
    else:
        out_specs = list(outputs)

    if example is not None:
        batchable, why = _batchable(in_specs, out_specs) if outputs is None else (
            all(s[2] and s[2][0] == -1 for s in out_specs), "an output's first dimension is not -1")
        mbs = _decide_batch(name, batchable, max_batch_size, why)
        if mbs > 0:
            in_specs = [(n, d, [-1, *s[1:]]) for n, d, s in in_specs]
            if outputs is None:
                out_specs = [(n, d, [-1, *s[1:]]) for n, d, s in out_specs]
    else:
        declared_batch = bool(in_specs) and all(s[2] and s[2][0] == -1 for s in in_specs)
        if outputs is None and declared_batch:
            rows_ok = all(s[2] and s[2][0] == _PROBE_ROWS for s in out_specs)
            out_specs = [(n, d, [-1, *s[1:]]) if rows_ok else (n, d, s) for n, d, s in out_specs]
            batchable, why = rows_ok, ("its outputs do not keep the batch rows of the input "
                                       "(2 rows in, not 2 rows out)")
        else:
            batchable = declared_batch and all(s[2] and s[2][0] == -1 for s in out_specs)
            why = "not every declared input and output has -1 as its first dimension"
        mbs = _decide_batch(name, batchable, max_batch_size, why)
    batching = mbs > 0
    config_json, files = pack_callable(
        fn, name=name, max_batch_size=mbs, batched=True,
        inputs=[(n, d, _config_dims(s, batching)) for n, d, s in in_specs],
        outputs=[(n, d, _config_dims(s, batching)) for n, d, s in out_specs])
    config = json_format.Parse(config_json, mc.ModelConfig())
    _reshape_scalars(config, in_specs, out_specs, batching)
    return Artifact(config, files, "python", in_specs, batching, notes)


def _call(fn: Callable, model: str, specs: list[TensorSpec], values: list[Any], keyword: bool,
          what: str) -> Any:
    torch = sys.modules.get("torch")
    is_module = torch is not None and isinstance(fn, torch.nn.Module)
    if is_module:
        values = _torch_example(torch, values)
    try:
        if is_module:
            names = [s[0] for s in specs]
            return _run_module(torch, fn, [] if keyword else values,
                               dict(zip(names, values)) if keyword else {})
        if keyword:
            return fn(**{s[0]: v for s, v in zip(specs, values)})
        return fn(*values)
    except Exception as err:
        raise ArtifactError(f"model '{model}': calling {_describe(fn)} on the {what} failed "
                            f"({type(err).__name__}: {_first_line(err)}); pass outputs=[(\"y\", "
                            f"\"FP32\", [-1, 4])] or a working example=") from None


def _describe(fn: Any) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return f"{name}()" if inspect.isfunction(fn) or inspect.ismethod(fn) else f"this {type(fn).__name__}"


# ---- generators, the text convention, state ------------------------------------------------

#: the generate extension's text convention: what generate/generate_stream and the OpenAI
#: routes serve (Triton's extension_generate doc)
TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"
STATE_PARAMETER = "state"
_PROBE_TEXT = "hello world"


def _call_target(fn: Any) -> Any:
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        return fn
    return getattr(fn, "forward", None) or getattr(type(fn), "__call__", fn)


def _is_generator(fn: Any) -> bool:
    target = _call_target(fn)
    return inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target)


def _text_convention(fn: Any, example: Any) -> str | None:
    """The name of the prompt parameter when ``fn`` takes one string (annotated ``str`` or
    given a ``str`` example), else None."""
    if not callable(fn) or isinstance(fn, (str, bytes)):
        return None
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                  and p.name != STATE_PARAMETER]
    except (TypeError, ValueError):
        return None
    if not params:
        return None
    first = params[0]
    if first.annotation in (str, "str") or isinstance(example, str):
        return first.name
    return None


def _keyword_parameters(fn: Any, skip: set[str]) -> list[str]:
    """Parameters with defaults that a request parameter may set (``max_tokens``...)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is not inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            and p.name not in skip]


def _first_value(result: Any, model: str) -> Any:
    """What a call gave: a generator's first yield, a coroutine's value, else the value.
    Async work runs on its own loop in a thread: the kernel's loop is already running."""
    if inspect.isgenerator(result):
        try:
            return next(result)
        except StopIteration:
            raise ArtifactError(f"model '{model}': the generator yielded nothing on the example; "
                                f"pass outputs=[(\"y\", \"FP32\", [-1])]") from None
        finally:
            result.close()
    if inspect.isasyncgen(result) or inspect.iscoroutine(result):
        import asyncio
        import concurrent.futures

        async def first() -> Any:
            if inspect.iscoroutine(result):
                return await result
            try:
                return await result.__anext__()
            except StopAsyncIteration:
                raise ArtifactError(f"model '{model}': the async generator yielded nothing on the "
                                    f"example; pass outputs=[...]") from None
            finally:
                await result.aclose()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, first()).result()
    return result


def _streaming_callable(fn: Callable, name: str, example, inputs, outputs, max_batch_size,
                        decoupled: bool, sequence: bool) -> Artifact:
    """A callable served one request at a time: decoupled (each yield one response), the
    text convention (a prompt string in, text out), or stateful (``state``, per sequence)."""
    notes: list[str] = []
    state = None
    if sequence:
        try:
            has_state = STATE_PARAMETER in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            has_state = False
        if not has_state:
            raise ArtifactError(f"model '{name}': a sequence model receives its state in a "
                                f"parameter named '{STATE_PARAMETER}' (a dict per correlation id, "
                                f"new at the sequence's start); {_describe(fn)} has none")
        state = STATE_PARAMETER
    prompt = _text_convention(fn, example)
    skip = {state} if state else set()
    if prompt is not None:
        if inputs is not None or outputs is not None:
            raise ArtifactError(f"model '{name}': a function of one string follows the generate "
                                f"text convention ({TEXT_INPUT} -> {TEXT_OUTPUT}); inputs= and "
                                f"outputs= do not apply")
        kwargs = {state: {}} if state else {}
        text = example if isinstance(example, str) else _PROBE_TEXT
        try:
            value = _first_value(fn(text, **kwargs), name)
        except ArtifactError:
            raise
        except Exception as err:
            raise ArtifactError(f"model '{name}': calling {_describe(fn)} on {text!r} failed "
                                f"({type(err).__name__}: {_first_line(err)})") from None
        if not isinstance(value, (str, bytes)):
            raise ArtifactError(f"model '{name}': {_describe(fn)} takes a string but gave a "
                                f"{type(value).__name__}; under the generate text convention it "
                                f"returns (or yields) strings")
        in_specs = [(TEXT_INPUT, "BYTES", [1])]
        out_specs = [(TEXT_OUTPUT, "BYTES", [1])]
        skip.add(prompt)
        notes.append(f"text convention: '{prompt}' is {TEXT_INPUT}, each "
                     f"{'yield' if decoupled else 'result'} is {TEXT_OUTPUT} (generate, OpenAI routes)")
        mbs = 0
        if max_batch_size:
            raise ArtifactError(f"model '{name}': a text model takes one prompt a request; "
                                f"max_batch_size must be 0")
        keyword = False
    else:
        names = [n for n in (_parameter_names(_call_target(fn)) or []) if n != state]
        if example is None and inputs is None:
            raise ArtifactError(
                f"model '{name}': cannot tell the inputs of {_describe(fn)}: pass example=<inputs> "
                f"(--example VAR), inputs=[(\"x\", \"FP32\", [4])], or annotate a single "
                f"string parameter (': str') for the text convention")
        if example is not None:
            in_names, values, keyword = _split_example(example, names or None, name)
            in_specs = _specs_of(in_names, values)
        else:
            in_specs, values, keyword = list(inputs), _probe_values(list(inputs), 1), False
        if outputs is None:
            call_kwargs = {state: {}} if state else {}
            try:
                if keyword:
                    result = fn(**{s[0]: v for s, v in zip(in_specs, values)}, **call_kwargs)
                else:
                    result = fn(*values, **call_kwargs)
                value = _first_value(result, name)
            except ArtifactError:
                raise
            except Exception as err:
                raise ArtifactError(f"model '{name}': calling {_describe(fn)} on the example failed "
                                    f"({type(err).__name__}: {_first_line(err)}); pass outputs=[...]") from None
            out_names, out_values = _output_values(value)
            out_specs = _specs_of(out_names, out_values)
        else:
            out_specs = list(outputs)
        mbs = int(max_batch_size or 0)
        skip.update(s[0] for s in in_specs)
    config_json, files = pack_callable(
        fn, name=name, max_batch_size=mbs, batched=True, decoupled=decoupled,
        text=prompt is not None, state=state, parameters=_keyword_parameters(fn, skip),
        inputs=[(n, d, _config_dims(s, mbs > 0)) for n, d, s in in_specs],
        outputs=[(n, d, _config_dims(s, mbs > 0)) for n, d, s in out_specs])
    if decoupled:
        notes.append("decoupled: each yield is one response (gRPC stream, generate_stream)")
    if state:
        notes.append("sequence: 'state' is one dict per correlation id (sequence_start/_end)")
    config = json_format.Parse(config_json, mc.ModelConfig())
    return Artifact(config, files, "python", in_specs, mbs > 0, notes)
