"""Checks an InferRequest against its model's config, with Triton's error text.

Runs before a request is queued, so a bad request never reaches a batch (and never
fails the good requests batched with it).
"""
from __future__ import annotations

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..config.padding import padding
from ..protocol.datatypes import config_to_triton
from ..protocol.errors import InvalidArgument
from ..protocol.types import InferRequest


MAX_DIM = 1 << 32      # the codecs' element limit: no dimension of a real tensor exceeds it


def _fmt(shape) -> str:
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


def _matches(shape: tuple[int, ...], dims: list[int]) -> bool:
    return len(shape) == len(dims) and all(d == -1 or d == s for s, d in zip(shape, dims))


class InputPlan:
    """What ``check_request`` needs from a config, computed once per loaded model version
    (protobuf field access and enum names cost microseconds on every request otherwise)."""

    def __init__(self, config: mc.ModelConfig) -> None:
        self.config = config
        self.model = config.name
        self.max_batch_size = config.max_batch_size
        self.expected = {i.name: i for i in config.input}
        self.required = [n for n, i in self.expected.items() if not i.optional]
        self.datatypes = {i.name: config_to_triton(mc.DataType.Name(i.data_type)) for i in config.input}
        self.dims = {i.name: list(i.dims) for i in config.input}
        lead = [-1] if config.max_batch_size > 0 else []
        self.full = {name: lead + dims for name, dims in self.dims.items()}
        self.reshape = {i.name: list(i.reshape.shape) for i in config.input if i.HasField("reshape")}
        self.known_outputs = frozenset(o.name for o in config.output)
        # ragged_batching "pad" with max_length (config/padding.py): input -> (its length
        # dimension, the longest length it may have)
        pad = padding(config)
        self.max_length = ({name: (axis, pad.max_length) for name, axis in pad.axes.items()}
                           if pad is not None and pad.max_length else {})
        # (name, datatype, shape) of inputs found valid -> their batch rows (0: unbatched):
        # clients repeat a few shapes, each checked once (bounded: shapes come from clients).
        self.accepted: dict[tuple, int] = {}


def _rid(request: InferRequest) -> str:
    # tritonserver 2.51 opens its request-validation errors with the request's id
    return f"[request id: {request.id or '<id_unknown>'}] "


_BATCH_NOTE = (". NOTE: Setting a non-zero max_batch_size in the model config requires a batch "
               "dimension to be prepended to each input shape. If you want to specify the full "
               "shape including the batch dim in your input dims config, try setting "
               "max_batch_size to zero. See the model configuration docs for more info on "
               "max_batch_size.")


def check_request(config: mc.ModelConfig, request: InferRequest, plan: InputPlan | None = None
                  ) -> tuple[dict[str, np.ndarray], int]:
    """The backend's input dict (reshaped where the config says so) and the request's batch size.
    ``plan``: ``InputPlan(config)``, when the caller keeps one."""
    if plan is None:
        plan = InputPlan(config)
    model = plan.model
    expected = plan.expected
    given = {t.name: t for t in request.inputs}
    for name in given:
        if name not in expected:
            raise InvalidArgument(f"unexpected inference input '{name}' for model '{model}'")
    for required in plan.required:      # (a loop: any() over a generator costs more)
        if required not in given:
            missing = [n for n, i in expected.items() if n not in given and not i.optional]
            raise InvalidArgument(
                f"{_rid(request)}expected {len(expected)} inputs but got {len(given)} inputs for "
                f"model '{model}'. Got input(s) {sorted(given)}, but missing required input(s) "
                f"{missing}. Please provide all required input(s).")
    max_batch_size = plan.max_batch_size
    batch = 0
    inputs: dict[str, np.ndarray] = {}
    accepted = plan.accepted
    for name, tensor in given.items():
        key = (name, tensor.datatype, tensor.shape) if type(tensor.shape) is tuple else None
        rows = accepted.get(key) if key is not None else None
        if rows is None:
            rows = _check_input(plan, request, name, tensor, batch, max_batch_size, model)
            if key is not None:
                if len(accepted) >= 64:
                    accepted.clear()
                accepted[key] = rows
        elif batch and rows != batch:
            raise _disagree(model, name, rows, batch)
        batch = rows
        data = tensor.data
        target = plan.reshape.get(name)
        if target is not None:
            lead = [batch] if max_batch_size > 0 else []
            data = data.reshape(lead + target)
        inputs[name] = data
    known_outputs = plan.known_outputs
    for out in request.outputs or ():
        if out.name not in known_outputs:
            raise InvalidArgument(f"unexpected inference output '{out.name}' for model '{model}'")
    return inputs, (batch if max_batch_size > 0 else 1)


def _disagree(model: str, name: str, rows: int, batch: int) -> InvalidArgument:
    return InvalidArgument(
        f"inputs of model '{model}' disagree on the batch size: input '{name}' has "
        f"{rows}, another input has {batch}")


def _check_input(plan: InputPlan, request: InferRequest, name: str, tensor, batch: int,
                 max_batch_size: int, model: str) -> int:
    """Raise unless ``tensor`` fits input ``name``; its batch rows (0: unbatched model).
    ``batch``: the rows of the inputs checked before it (0: none)."""
    want = plan.datatypes[name]
    if tensor.datatype != want:
        raise InvalidArgument(
            f"{_rid(request)}inference input '{name}' data-type is '{tensor.datatype}', but model '{model}' "
            f"expects '{want}'")
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 or d > MAX_DIM for d in shape):
        # requests made in-process (ensemble steps, python models' BLS) skip the codecs'
        # checks: an absurd dimension must still be a 400, not numpy's error later
        raise InvalidArgument(
            f"input '{name}' of model '{model}' has shape {_fmt(shape)}: each dimension "
            f"must be between 0 and {MAX_DIM}")
    dims = plan.dims[name]
    if max_batch_size > 0:
        if not shape:
            raise InvalidArgument(
                f"inference input '{name}' of model '{model}' has no batch dimension; "
                f"expected shape {_fmt([-1] + dims)}")
        rows = shape[0]
        if batch and rows != batch:
            raise _disagree(model, name, rows, batch)
        if rows < 1 or rows > max_batch_size:
            raise InvalidArgument(
                f"{_rid(request)}inference request batch-size must be <= {max_batch_size} for "
                f"'{model}'" if rows > 0 else
                f"{_rid(request)}inference request batch-size must be >= 1 for '{model}'")
    full = plan.full[name]
    if not _matches(shape, full):
        raise InvalidArgument(
            f"{_rid(request)}unexpected shape for input '{name}' for model '{model}'. "
            f"Expected {_fmt(full)}, got {_fmt(shape)}" + (_BATCH_NOTE if max_batch_size > 0 else ""))
    limit = plan.max_length.get(name)
    if limit is not None and shape[limit[0]] > limit[1]:
        raise InvalidArgument(
            f"{_rid(request)}input '{name}' of model '{model}' has length {shape[limit[0]]} "
            f"(shape {_fmt(shape)}), longer than the model allows: max_length {limit[1]}")
    return shape[0] if max_batch_size > 0 else 0
