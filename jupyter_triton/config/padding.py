"""Padding batches (ours): a config's ``ragged_batching: "pad"`` and the parameters beside it.

A model whose inputs are ``[batch, length]`` (config dims holding one -1 after the batch
dimension, as every Hugging Face export has) batches requests of different lengths: each
batch is padded to its longest member, and each output whose dimension followed the padded
length is cut back to the request's own length (backends/ragged.py). The parameters live in
``parameters``, so tritonserver still loads the config (and batches equal lengths only).

=======================  ================================================================
parameter                meaning
=======================  ================================================================
``ragged_batching``      ``"pad"``; absent: Triton's behaviour (ragged inputs concatenated)
``pad_value.<input>``    what pads that input: a number (true/false for TYPE_BOOL); default 0
``length_buckets``       e.g. ``"16,32,64,128"``: a batch mixes only lengths of one bucket
                         (up to 16, 17 to 32, ..., 65 to 128, above 128); absent: one bucket
``max_batch_tokens``     padded tokens a batch may hold (its rows x its longest length); a
                         request over it alone runs alone; absent or 0: no budget (a batch
                         may then hold max_batch_size x the longest request's tokens)
``max_length``           the longest length a request may have; a longer one is a 400 before
                         it is queued (set it to the model's limit, e.g. its position table:
                         a request the model fails on fails the whole batch it was padded into)
=======================  ================================================================

The padded inputs are those whose dims hold a -1 (one each: the length dimension); a
request's length is the longest of its padded inputs. The cut outputs are those whose dims
hold -1 at the position of a padded input's length dimension (``[batch, length, hidden]``
beside ``[batch, length]`` inputs): where the batch's output is as long there as the batch's
longest input, each request gets its own length back; any other output (a pooled
``[batch, hidden]``) is returned as the model computed it. The python backend hands each
request to its model as sent, as tritonserver's does: there these parameters only shape the
batches (buckets, budget) and refuse what is too long.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.datatypes import config_to_triton, triton_to_numpy
from ..protocol.errors import InvalidArgument

MODE = "ragged_batching"
PAD = "pad"
PAD_VALUE = "pad_value."
BUCKETS = "length_buckets"
BUDGET = "max_batch_tokens"
MAX_LENGTH = "max_length"

_BOOL = {"true": True, "1": True, "false": False, "0": False}


@dataclass(frozen=True)
class Padding:
    """One model version's padding rules, read once from its config (``padding``)."""

    axes: dict[str, int]                  # padded input -> its length dim in the batched shape
    values: dict[str, Any]                # padded input -> what pads it
    buckets: tuple[int, ...] = ()         # increasing upper bounds of the length buckets
    max_batch_tokens: int = 0             # 0: no budget
    max_length: int = 0                   # 0: no limit

    def length(self, inputs: Mapping[str, np.ndarray]) -> int:
        """A request's length: the longest of its padded inputs."""
        longest = 0
        for name, axis in self.axes.items():
            value = inputs.get(name)
            if value is not None and value.shape[axis] > longest:
                longest = value.shape[axis]
        return longest

    def bucket(self, length: int) -> int:
        """The index of the bucket ``length`` falls in (len(buckets): above the last)."""
        return bisect_left(self.buckets, length)

    def tokens(self, requests: list[Mapping[str, np.ndarray]]) -> tuple[int, int]:
        """(tokens the padded batch holds, tokens its requests sent): rows x the batch's longest
        length, and the sum of each request's rows x its own length."""
        longest = rows = real = 0
        for inputs in requests:
            length = self.length(inputs)
            n = _rows(inputs)
            rows += n
            real += n * length
            if length > longest:
                longest = length
        return rows * longest, real


def _rows(inputs: Mapping[str, np.ndarray]) -> int:
    for value in inputs.values():
        return int(value.shape[0]) if value.ndim else 1
    return 0


def padding(config: mc.ModelConfig) -> Padding | None:
    """The config's padding rules, None without ``ragged_batching: "pad"`` (the other keys are
    then left alone); InvalidArgument naming the parameter a config gets wrong (checked by
    validate_config before a load)."""
    params = config.parameters
    mode = params[MODE].string_value.strip() if MODE in params else ""
    if not mode:
        # the other keys mean nothing then: a Triton config may use them for its own model
        return None
    if mode != PAD:
        raise _fail(config, MODE, f"must be \"{PAD}\" (or absent: Triton's ragged batching), "
                                  f"got '{mode}'")
    if config.max_batch_size <= 0:
        raise _fail(config, MODE, "pads batches, so it needs max_batch_size > 0")
    axes: dict[str, int] = {}
    types: dict[str, int] = {}
    for tensor in config.input:
        dims = list(tensor.dims)
        variable = [k for k, d in enumerate(dims) if d == -1]
        if not variable:
            continue
        if len(variable) > 1 or tensor.HasField("reshape") or tensor.data_type == mc.TYPE_STRING:
            raise _fail(config, MODE, f"pads one length dimension of a numeric input without "
                                      f"reshape; input '{tensor.name}' has dims {dims}"
                                      f"{' and a reshape' if tensor.HasField('reshape') else ''}"
                                      f" ({mc.DataType.Name(tensor.data_type)})")
        axes[tensor.name] = variable[0] + 1          # after the batch dimension
        types[tensor.name] = tensor.data_type
    if not axes:
        raise _fail(config, MODE, "no input has a length dimension to pad (a -1 in its dims)")
    values: dict[str, Any] = {name: 0 for name in axes}
    for key in params:
        if key.startswith(PAD_VALUE):
            name = key[len(PAD_VALUE):]
            if name not in axes:
                raise _fail(config, key, f"names no padded input (padded: {', '.join(axes)})")
            values[name] = _pad_value(config, key, params[key].string_value, types[name])
    return Padding(axes, values, _buckets(config), _positive(config, BUDGET),
                   _positive(config, MAX_LENGTH))


def _pad_value(config: mc.ModelConfig, key: str, text: str, data_type: int) -> Any:
    dtype = triton_to_numpy(config_to_triton(mc.DataType.Name(data_type)))
    text = text.strip()
    try:
        if dtype == np.bool_:
            return _BOOL[text.lower()]
        if np.issubdtype(dtype, np.integer):
            value = int(text)
            info = np.iinfo(dtype)
            if not info.min <= value <= info.max:
                raise ValueError
            return value
        return float(text)
    except (KeyError, ValueError):
        raise _fail(config, key, f"must be a {dtype.name} value, got '{text}'") from None


def _buckets(config: mc.ModelConfig) -> tuple[int, ...]:
    if BUCKETS not in config.parameters:
        return ()
    text = config.parameters[BUCKETS].string_value
    try:
        bounds = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        bounds = ()
    if not bounds or any(b < 1 for b in bounds) or list(bounds) != sorted(set(bounds)):
        raise _fail(config, BUCKETS, f"must be increasing positive lengths separated by commas "
                                     f"(e.g. \"16,32,64,128\"), got '{text}'")
    return bounds


def _positive(config: mc.ModelConfig, key: str) -> int:
    if key not in config.parameters or not config.parameters[key].string_value.strip():
        return 0
    text = config.parameters[key].string_value.strip()
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise _fail(config, key, f"must be a whole number of tokens (0: none), got '{text}'")
    return value


def _fail(config: mc.ModelConfig, key: str, rule: str) -> InvalidArgument:
    return InvalidArgument(f"model '{config.name}' config field 'parameters.{key}': {rule}")
