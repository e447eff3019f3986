"""A runtime's own view of a model's tensors, and Triton's rules between it and config.pbtxt.

Each tensor backend reads a ``ModelSignature`` from its artifact (ONNX graph, exported
program, TensorRT engine); from here on the rules are the same for all of them:
auto-complete fills what the config left out, and ``check_config`` is the check Triton's
backends make when an instance loads (data types, ranks, the batch dimension), in
Triton's wording.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..config import enable_default_batching
from ..config.padding import padding
from ..protocol.datatypes import config_to_triton, triton_to_numpy
from ..protocol.errors import InvalidArgument

WILDCARD_DIM = -1
# Triton's --backend-config=<backend>,default-max-batch-size
DEFAULT_MAX_BATCH_SIZE = 4


@dataclass
class TensorSignature:
    name: str
    data_type: int                    # mc.DataType value
    shape: list[int]                  # the model's full shape; -1 where dynamic


@dataclass
class ModelSignature:
    inputs: list[TensorSignature] = field(default_factory=list)
    outputs: list[TensorSignature] = field(default_factory=list)
    # the largest batch the runtime accepts (TensorRT profiles, torch.export ranges)
    max_batch_limit: int | None = None

    def can_batch(self) -> bool:
        """Triton's test: every input and output has a variable first dimension."""
        return all(t.shape and t.shape[0] == WILDCARD_DIM for t in self.inputs + self.outputs)


def shape_text(shape) -> str:
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


def type_name(data_type: int) -> str:
    return mc.DataType.Name(data_type)


def numpy_dtype(data_type: int) -> np.dtype:
    """The in-server numpy dtype of a config data type (BYTES: object, BF16: float32)."""
    return triton_to_numpy(config_to_triton(type_name(data_type)))


def as_config_dtype(value: np.ndarray, data_type: int) -> np.ndarray:
    """An output array in the dtype the config promises (strings become bytes)."""
    want = numpy_dtype(data_type)
    if want == np.object_:
        if value.dtype == np.object_ and all(isinstance(v, bytes) for v in value.flat):
            return value
        flat = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in value.flat]
        return np.array(flat, dtype=object).reshape(value.shape)
    return value if value.dtype == want else value.astype(want)


def complete_config(config: mc.ModelConfig, signature: ModelSignature, *, backend: str,
                    platform: str) -> mc.ModelConfig:
    """Triton's auto-complete for a tensor backend, on a copy of ``config``.

    A model whose every tensor has a variable first dimension gets ``max_batch_size`` 4
    and ``dynamic_batching {}`` when the config left it 0, unless the config already spells
    dims (then they include any batch dimension and we keep max_batch_size 0). Inputs and
    outputs the config does not list are added; listed ones missing a data type or dims
    get them from the model. The result is then checked like a loading instance would.
    """
    out = mc.ModelConfig()
    out.CopyFrom(config)
    if not out.backend:
        out.backend = backend
    if not out.platform:
        out.platform = platform

    given = list(out.input) + list(out.output)
    spelled_dims = any(t.dims for t in given)
    if signature.can_batch():
        limit = signature.max_batch_limit
        if out.max_batch_size == 0 and not spelled_dims:
            enable_default_batching(out, min(DEFAULT_MAX_BATCH_SIZE, limit or DEFAULT_MAX_BATCH_SIZE))
    elif out.max_batch_size != 0:
        raise InvalidArgument(
            f"autofill failed for model '{out.name}': model does not support batching while "
            f"non-zero max_batch_size is specified")

    # the sequence batcher feeds control and state tensors itself, the server each batch
    # input: never config inputs
    inputs, outputs = sequence_tensors(out)
    inputs |= batch_input_targets(out)
    _fill(out, out.input, [t for t in signature.inputs if t.name not in inputs])
    _fill(out, out.output, [t for t in signature.outputs if t.name not in outputs])
    check_config(out, signature)
    return out


def _fill(config: mc.ModelConfig, tensors, model: list[TensorSignature]) -> None:
    listed = {t.name: t for t in tensors}
    for sig in model:
        tensor = listed.get(sig.name)
        if tensor is None:
            tensor = tensors.add(name=sig.name)
        if tensor.data_type == mc.TYPE_INVALID:
            tensor.data_type = sig.data_type
        if not tensor.dims and not tensor.HasField("reshape"):
            dims = sig.shape[1:] if config.max_batch_size > 0 else sig.shape
            if dims:
                tensor.dims.extend(dims)
            else:
                # Triton's spelling of a scalar: dims [1], and with batching an empty reshape
                tensor.dims.append(1)
                if config.max_batch_size > 0:
                    tensor.reshape.SetInParent()


def check_config(config: mc.ModelConfig, signature: ModelSignature) -> None:
    """What Triton's onnxruntime/tensorrt backends check when an instance loads."""
    model = config.name
    inputs = {t.name: t for t in signature.inputs}
    outputs = {t.name: t for t in signature.outputs}
    limit = signature.max_batch_limit
    if limit is not None and config.max_batch_size > limit:
        raise InvalidArgument(
            f"unable to load model '{model}', configuration specified max-batch "
            f"{config.max_batch_size} but the model only supports max-batch {limit}")
    # Triton's ragged batching: a ragged input reaches the model flattened ([-1]); a batch
    # output's shape is the server's to make (backends/ragged.py)
    flattened = {i.name for i in config.input if i.allow_ragged_batch} - set(padded_inputs(config))
    scattered = {t for b in config.batch_output for t in b.target_name}
    for io, kind, known in ((config.input, "input", inputs), (config.output, "output", outputs)):
        for tensor in io:
            sig = known.get(tensor.name)
            if sig is None:
                raise InvalidArgument(
                    f"unable to load model '{model}', unexpected inference {kind} "
                    f"'{tensor.name}', allowed {kind}s are: {', '.join(known)}")
            if tensor.data_type != sig.data_type:
                raise InvalidArgument(
                    f"unable to load model '{model}', configuration expects datatype "
                    f"{type_name(tensor.data_type)} for {kind} '{tensor.name}', model provides "
                    f"{type_name(sig.data_type)}")
            if tensor.name in flattened:
                _check_ragged(config, tensor.name, sig.shape)
                continue
            if tensor.name in scattered:
                continue
            dims = list(tensor.reshape.shape) if tensor.HasField("reshape") else list(tensor.dims)
            _compare_dims(model, tensor.name, sig.shape, dims, config.max_batch_size,
                          exact=(kind == "output"))
    for batch_input in config.batch_input:
        for target in batch_input.target_name:
            sig = inputs.get(target)
            if sig is None or sig.data_type != batch_input.data_type:
                raise InvalidArgument(
                    f"unable to load model '{model}', batch input '{target}' "
                    f"({type_name(batch_input.data_type)}) is not "
                    f"{'an input' if sig is None else 'the type of the input'} of the model; "
                    f"model inputs: " + ", ".join(f"{t.name} ({type_name(t.data_type)})"
                                                  for t in signature.inputs))
    listed = ({t.name for t in config.input} | sequence_tensors(config)[0]
              | batch_input_targets(config))
    required = [t.name for t in signature.inputs if t.name not in listed]
    if required:
        raise InvalidArgument(
            f"unable to load model '{model}', configuration expects {len(config.input)} inputs, "
            f"model provides {len(signature.inputs)} (missing: {', '.join(required)})")


def _check_ragged(config: mc.ModelConfig, name: str, model_shape: list[int]) -> None:
    """Triton's onnxruntime backend: a ragged input is one 1-D tensor of every request's
    elements; a [batch, length] model pads instead (ours: ragged_batching "pad")."""
    if model_shape != [WILDCARD_DIM]:
        raise InvalidArgument(
            f"unable to load model '{config.name}', configuration expects model provides input "
            f"with shape [-1] for ragged input '{name}', model provides {shape_text(model_shape)}"
            f" (a model that takes [batch, length] batches different lengths with "
            f"parameters {{ key: \"ragged_batching\" value: {{ string_value: \"pad\" }} }})")


def batch_input_targets(config: mc.ModelConfig) -> set[str]:
    """The model inputs the server generates for each batch (``batch_input``)."""
    return {t for b in config.batch_input for t in b.target_name}


def padded_inputs(config: mc.ModelConfig) -> dict[str, int]:
    """The inputs ragged_batching "pad" pads (config/padding.py), none without it."""
    pad = padding(config)
    return pad.axes if pad is not None else {}


def sequence_tensors(config: mc.ModelConfig) -> tuple[set[str], set[str]]:
    """The model inputs (control and state inputs) and outputs (state outputs) that
    ``sequence_batching`` names: the sequence batcher supplies and takes them."""
    if not config.HasField("sequence_batching"):
        return set(), set()
    seq = config.sequence_batching
    return ({c.name for c in seq.control_input} | {s.input_name for s in seq.state},
            {s.output_name for s in seq.state})


def _compare_dims(model: str, name: str, model_shape: list[int], dims: list[int],
                  max_batch_size: int, exact: bool) -> None:
    """Triton's CompareDimsSupported: inputs may narrow a dynamic model dim, outputs may not."""
    if not model_shape:
        if any(d != 1 for d in dims):
            raise InvalidArgument(
                f"unable to load model '{model}', scalar tensor '{name}', should only provide 1 "
                f"in the model configuration when the model doesn't support batching. Model "
                f"configuration provided: {shape_text(dims)}.")
        return
    batching = max_batch_size > 0
    if batching and model_shape[0] != WILDCARD_DIM:
        raise InvalidArgument(
            f"model '{model}', tensor '{name}': for the model to support batching the shape "
            f"should have at least 1 dimension and the first dimension must be -1; but shape "
            f"expected by the model is {shape_text(model_shape)}")
    full = ([WILDCARD_DIM] if batching else []) + dims
    same = len(full) == len(model_shape) and all(
        m == c for m, c in zip(model_shape, full) if exact or m != WILDCARD_DIM)
    if not same:
        said = (f"{len(full)} dimensions (an initial batch dimension because max_batch_size > 0 "
                f"followed by the explicit tensor shape, making complete shape {shape_text(full)})"
                if batching else f"{len(full)} dimensions (shape {shape_text(full)})")
        raise InvalidArgument(
            f"model '{model}', tensor '{name}': the model expects {len(model_shape)} dimensions "
            f"(shape {shape_text(model_shape)}) but the model configuration specifies {said}")


def parameter(config: mc.ModelConfig, key: str) -> str | None:
    """A config ``parameters`` value, or None when the key is absent."""
    if key in config.parameters:
        return config.parameters[key].string_value
    return None


def int_parameter(config: mc.ModelConfig, key: str) -> int | None:
    value = parameter(config, key)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise InvalidArgument(
            f"model '{config.name}': parameter '{key}' must be an integer, got '{value}'") from None


def bool_parameter(config: mc.ModelConfig, key: str) -> bool | None:
    value = parameter(config, key)
    if value is None or value.strip() == "":
        return None
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise InvalidArgument(
        f"model '{config.name}': parameter '{key}' must be true/false or 1/0, got '{value}'")
