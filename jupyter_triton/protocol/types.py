"""Transport-neutral v2 inference request and response.

Every frontend decodes into these and encodes from these; the engine sees nothing else.
Tensor data is always a numpy array already shaped; BYTES tensors are ``object`` arrays of
``bytes``; BF16 tensors travel as ``float32`` arrays (numpy has no bfloat16) and are narrowed
again when encoded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class InferTensor:
    name: str
    datatype: str                       # Triton spelling: "FP32", "BYTES", ...
    shape: tuple[int, ...]
    data: np.ndarray | None             # None: in a shared memory region (engine/shared_memory.py)
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestedOutput:
    name: str
    # binary_data (bool), classification (int) as the client sent them
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferRequest:
    model_name: str
    model_version: str = ""             # "" means: the policy's latest ready version
    id: str = ""
    inputs: list[InferTensor] = field(default_factory=list)
    outputs: list[RequestedOutput] | None = None   # None: every output of the model
    # request parameters: priority, timeout, binary_data_output, sequence_*, user keys
    parameters: dict[str, Any] = field(default_factory=dict)
    # how many BLS calls deep this request was made (0: from a client); never on the wire
    bls_depth: int = 0
    # engine/observation/trace.py's Trace while the request is traced; a class attribute, not a field,
    # so that the untraced path pays nothing to build a request
    trace = None
    # engine/observation/capture.py: set once a captured model's request went through its capture
    captured = False
    # set by the codec that decoded it where a tensor names a shared memory region (an
    # input's data is then None): only such a request has the engine read or write regions
    # (engine/shared_memory.py); requests made in-process never name one
    shared_memory = False


@dataclass
class InferResponse:
    model_name: str
    model_version: str
    id: str = ""
    outputs: list[InferTensor] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    # A decoupled model answers a request with zero or more responses; the last one a
    # stream carries has ``final`` set (it may have no outputs: Triton's empty final
    # response). A non-decoupled model's one response is final.
    final: bool = True
    # An error response of a decoupled model (the stream goes on unless ``final``);
    # never set on the responses ``Engine.infer`` returns (it raises instead).
    error: Exception | None = None


_SCALARS = frozenset((str, int, bool, float, type(None)))


def scalar_values(params: dict) -> bool:
    """Every value of ``params`` a scalar: what a codec's request plan may copy shallowly."""
    return all(type(v) in _SCALARS for v in params.values())
