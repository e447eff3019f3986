"""A request once the engine has validated it: what every scheduler queues and every
instance runs. ``Engine.infer`` wraps each request in a ``Pending``; a scheduler decides
which ones run together and when; the instance pool runs them and resolves ``future``."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from ...protocol.types import InferRequest

if TYPE_CHECKING:
    from ..composition.streaming import ResponseStream


@dataclass(eq=False)
class Pending:
    request: InferRequest
    inputs: dict[str, np.ndarray]
    batch_size: int                       # rows this request carries (1 when max_batch_size == 0)
    future: asyncio.Future
    priority: int = 0                     # resolved level, 1 is highest (Triton's numbering)
    timeout_ns: int = 0                   # 0: no timeout
    enqueue_ns: int = field(default_factory=time.monotonic_ns)
    stream: "ResponseStream | None" = None   # a decoupled model's request: its responses' way out

    started: bool = False                 # set when an instance starts executing it
    start_ns: int = 0                     # when it did (its queue time ends there)
    _shape_key: tuple | None = field(default=None, repr=False)
    # the scheduler's done callback while the request is queued: taken off as it leaves the
    # queue, so that a request that ran costs no loop handle for it when its future ends
    forget: "Callable[[asyncio.Future], None] | None" = field(default=None, repr=False)

    def shape_key(self) -> tuple:
        """Requests batch together only when every input agrees beyond the batch dim
        (computed once: the batcher asks on every pass over its queue)."""
        if self._shape_key is None:
            inputs = self.inputs
            if len(inputs) == 1:        # most models: no sort, no generator
                for name, arr in inputs.items():
                    self._shape_key = ((name, arr.dtype.str, arr.shape[1:]),)
            else:
                self._shape_key = tuple([(name, arr.dtype.str, arr.shape[1:])
                                         for name, arr in sorted(inputs.items())])
        return self._shape_key

