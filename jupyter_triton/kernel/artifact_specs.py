"""What an artifact is (``Artifact``: a ``ModelConfig`` and the files of one version
directory) and how the kernel side reads tensor specs: from what users write
(``("x", "FP32", [-1, 4])``), from an example batch and what the model returns for it, or
from probe arrays in the declared shapes; and whether those specs batch.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.datatypes import DATATYPES, numpy_to_triton, parse_datatype, triton_to_numpy
from ..protocol.errors import InvalidArgument

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


# ---- running a module on an example (torch builders and callables alike) -------------------

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


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else ""


def _flat(result: Any) -> list[Any]:
    if isinstance(result, dict):
        return list(result.values())
    if isinstance(result, (tuple, list)):
        return list(result)
    return [result]


def _describe(fn: Any) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return f"{name}()" if inspect.isfunction(fn) or inspect.ismethod(fn) else f"this {type(fn).__name__}"
