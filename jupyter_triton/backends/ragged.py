"""One batch from many requests, and its outputs back per request: the tensor backends' merge
and split (the engine asks here for a ``TensorBackend``'s batch: engine/batching/instances.py;
the python backend hands each request to the model as sent, as tritonserver's does).

* Same shapes: inputs concatenated on the batch dimension, outputs split by each request's rows.
* Triton's ragged batching (``allow_ragged_batch: true`` on an input, the model's input
  ``[-1]``): that input of every request is flattened and the requests' elements concatenated
  into one 1-D tensor, and each ``batch_input`` the config names is generated (INT32 or FP32),
  from each request's shape of its source input (element count: the product of that shape,
  batch dimension included), as Triton's backends do:

  ============================================  =============================================
  kind                                          tensor
  ============================================  =============================================
  BATCH_ELEMENT_COUNT                           ``[requests]``: each request's element count
  BATCH_ACCUMULATED_ELEMENT_COUNT               ``[requests]``: their running sum (where each ends)
  BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO     ``[requests + 1]``: 0, then the running sum
  BATCH_MAX_ELEMENT_COUNT_AS_SHAPE              ``[largest element count]`` (its shape is the
                                                information; zeros, where Triton leaves it
                                                uninitialized)
  BATCH_ITEM_SHAPE                              ``[rows, rank - 1]``: each row's shape without
                                                the batch dimension
  BATCH_ITEM_SHAPE_FLATTEN                      the same, flattened: ``[rows * (rank - 1)]``
  ============================================  =============================================

  A ``batch_output`` (BATCH_SCATTER_WITH_INPUT_SHAPE) is split from the model's output as one
  flat run of elements: each request in turn takes as many as its shape holds, that shape
  being the output's config dims (after the batch dimension) with each -1 taken from the
  request's source input at the same position. Every other output is split by rows.
* Padding (ours, config/padding.py): each padded input is padded to the batch's longest,
  and outputs are cut back to each request's length.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..config.padding import Padding, padding
from ..protocol.errors import Internal

Tensors = dict[str, np.ndarray]

_K = mc.BatchInput.Kind
_DTYPES = {mc.TYPE_INT32: np.int32, mc.TYPE_FP32: np.float32}


def concatenate(requests: list[Tensors]) -> tuple[Tensors, list[int]]:
    """Same-shape requests as one batch, and each request's rows."""
    rows = [len(next(iter(r.values()))) if r else 0 for r in requests]
    merged = {name: np.concatenate([r[name] for r in requests], axis=0) for name in requests[0]}
    return merged, rows


def split_rows(model: str, outputs: Tensors, rows: list[int],
               cut: Callable[[str, np.ndarray, int], np.ndarray] | None = None) -> list[Tensors]:
    """Each request's rows of every output (``cut(name, part, index)``: its own length, where
    padded); Internal where the model's rows are not the batch's."""
    total = sum(rows)
    for name, value in outputs.items():
        if value.ndim == 0 or value.shape[0] != total:
            raise Internal(
                f"model '{model}' returned {value.shape[0] if value.ndim else 0} "
                f"rows for output '{name}' but the batch had {total}")
    bounds = np.cumsum([0] + rows)
    parts = [{name: value[lo:hi] for name, value in outputs.items()}
             for lo, hi in zip(bounds[:-1], bounds[1:])]
    if cut is not None:
        for index, part in enumerate(parts):
            for name, value in part.items():
                part[name] = cut(name, value, index)
    return parts


@dataclass
class Layout:
    """What ``RaggedPlan.split`` needs of the batch ``merge`` made."""

    rows: list[int]
    shapes: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)  # scatter sources
    own: dict[int, list[int]] = field(default_factory=dict)     # padded axis -> each request's
    longest: dict[int, int] = field(default_factory=dict)       # padded axis -> the batch's


@dataclass(frozen=True)
class _BatchInput:
    targets: tuple[str, ...]
    kind: int
    dtype: type
    source: str


class RaggedPlan:
    """A model version's merge and split where requests may differ in shape (ragged inputs,
    batch inputs or outputs, padding); ``from_config`` is None for every other model."""

    def __init__(self, config: mc.ModelConfig, pad: Padding | None) -> None:
        self.model = config.name
        self.padding = pad
        padded = pad.axes if pad is not None else {}
        self.flattened = frozenset(i.name for i in config.input
                                   if i.allow_ragged_batch and i.name not in padded)
        self.batch_inputs = [_BatchInput(tuple(b.target_name), b.kind, _DTYPES[b.data_type],
                                         b.source_input[0]) for b in config.batch_input]
        dims = {o.name: [-1] + list(o.dims) for o in config.output}
        # batch output -> (its source input, its batched config shape)
        self.scatter = {target: (b.source_input[0], dims[target])
                        for b in config.batch_output for target in b.target_name}
        # output -> the padded axes where it has -1 (cut back to each request's length)
        axes = set(padded.values())
        self.cuts = {name: [k for k, d in enumerate(shape) if k and d == -1 and k in axes]
                     for name, shape in dims.items() if name not in self.scatter}
        self.cuts = {name: ks for name, ks in self.cuts.items() if ks}

    @classmethod
    def from_config(cls, config: mc.ModelConfig) -> "RaggedPlan | None":
        if config.max_batch_size <= 0:
            return None
        pad = padding(config)
        if pad is None and not config.batch_input and not config.batch_output and not any(
                i.allow_ragged_batch for i in config.input):
            return None
        return cls(config, pad)

    # -- merge ------------------------------------------------------------------------------

    def merge(self, requests: list[Tensors]) -> tuple[Tensors, Layout]:
        rows = [len(next(iter(r.values()))) if r else 0 for r in requests]
        layout = Layout(rows)
        padded = self.padding.axes if self.padding is not None else {}
        merged: Tensors = {}
        for name in requests[0]:
            values = [r[name] for r in requests]
            if name in self.flattened:
                merged[name] = np.concatenate([v.reshape(-1) for v in values])
            elif name in padded:
                merged[name] = self._pad(name, values, padded[name], layout)
            else:
                merged[name] = values[0] if len(values) == 1 else np.concatenate(values, axis=0)
        for b in self.batch_inputs:
            value = _batch_input(b, [r[b.source] for r in requests])
            for target in b.targets:
                merged[target] = value
        for source, _ in self.scatter.values():
            layout.shapes[source] = [r[source].shape for r in requests]
        return merged, layout

    def _pad(self, name: str, values: list[np.ndarray], axis: int, layout: Layout) -> np.ndarray:
        lengths = [v.shape[axis] for v in values]
        longest = max(lengths)
        own = layout.own.setdefault(axis, [0] * len(values))
        for i, n in enumerate(lengths):
            own[i] = max(own[i], n)
        layout.longest[axis] = max(layout.longest.get(axis, 0), longest)
        if all(n == longest for n in lengths):
            return values[0] if len(values) == 1 else np.concatenate(values, axis=0)
        first = values[0]
        shape = list(first.shape)
        shape[0] = sum(v.shape[0] for v in values)
        shape[axis] = longest
        out = np.full(shape, self.padding.values[name], dtype=first.dtype)
        row = 0
        for v in values:
            index = [slice(row, row + v.shape[0])] + [slice(None)] * (v.ndim - 1)
            index[axis] = slice(0, v.shape[axis])
            out[tuple(index)] = v
            row += v.shape[0]
        return out

    # -- split ------------------------------------------------------------------------------

    def split(self, outputs: Tensors, layout: Layout) -> list[Tensors]:
        scattered = {name: outputs.pop(name) for name in self.scatter if name in outputs}
        parts = split_rows(self.model, outputs, layout.rows, self._cut(layout) if layout.own else None)
        for name, value in scattered.items():
            source, dims = self.scatter[name]
            flat = value.reshape(-1)
            start = 0
            for part, shape in zip(parts, layout.shapes[source]):
                if len(dims) > len(shape) and -1 in dims[len(shape):]:
                    raise Internal(f"batch output '{name}' of model '{self.model}' has dims "
                                   f"{dims[1:]}: a -1 past the rank of its source input "
                                   f"'{source}' ({len(shape)}) takes no size from it")
                own = [shape[k] if d == -1 else d for k, d in enumerate(dims)]
                size = int(np.prod(own))
                if start + size > flat.size:
                    raise Internal(f"model '{self.model}' returned {flat.size} elements for batch "
                                   f"output '{name}', fewer than the batch's inputs '{source}' "
                                   f"scatter ({sum(int(np.prod(s)) for s in layout.shapes[source])})")
                part[name] = flat[start:start + size].reshape(own)
                start += size
        return parts

    def _cut(self, layout: Layout) -> Callable[[str, np.ndarray, int], np.ndarray]:
        def cut(name: str, value: np.ndarray, index: int) -> np.ndarray:
            for axis in self.cuts.get(name, ()):
                longest = layout.longest[axis]
                own = layout.own[axis][index]
                if own < longest and value.ndim > axis and value.shape[axis] == longest:
                    keep = [slice(None)] * value.ndim
                    keep[axis] = slice(0, own)
                    value = value[tuple(keep)]
            return value
        return cut


def _batch_input(b: _BatchInput, sources: list[np.ndarray]) -> np.ndarray:
    kind = b.kind
    if kind in (_K.BATCH_ITEM_SHAPE, _K.BATCH_ITEM_SHAPE_FLATTEN):
        rank = sources[0].ndim - 1
        shapes = np.array([s.shape[1:] for s in sources for _ in range(s.shape[0])],
                          dtype=b.dtype).reshape(-1, rank)
        return shapes if kind == _K.BATCH_ITEM_SHAPE else shapes.reshape(-1)
    counts = np.array([s.size for s in sources], dtype=np.int64)
    if kind == _K.BATCH_ELEMENT_COUNT:
        return counts.astype(b.dtype)
    if kind == _K.BATCH_ACCUMULATED_ELEMENT_COUNT:
        return np.cumsum(counts).astype(b.dtype)
    if kind == _K.BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO:
        return np.concatenate([[0], np.cumsum(counts)]).astype(b.dtype)
    if kind == _K.BATCH_MAX_ELEMENT_COUNT_AS_SHAPE:
        return np.zeros(int(counts.max()), dtype=b.dtype)
    raise Internal(f"unknown batch input kind {kind}")
