"""The scheduler seam: what a request becomes once validated, and how it reaches an instance.

A frontend calls ``Engine.infer``; the engine wraps the request in a ``Pending`` and hands
it to the model's scheduler. A scheduler only decides *which requests run together and
when*; ``InstancePool.execute`` runs them and resolves every ``Pending.future``.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from ..protocol.types import InferRequest
from .instances import InstancePool


@dataclass(eq=False)
class Pending:
    request: InferRequest
    inputs: dict[str, np.ndarray]
    batch_size: int                       # rows this request carries (1 when max_batch_size == 0)
    future: asyncio.Future
    priority: int = 0                     # resolved level, 1 is highest (Triton's numbering)
    timeout_ns: int = 0                   # 0: no timeout
    enqueue_ns: int = field(default_factory=time.monotonic_ns)

    started: bool = False                 # set when an instance starts executing it
    _shape_key: tuple | None = field(default=None, repr=False)

    def shape_key(self) -> tuple:
        """Requests batch together only when every input agrees beyond the batch dim
        (computed once: the batcher asks on every pass over its queue)."""
        if self._shape_key is None:
            self._shape_key = tuple((name, arr.dtype.str, arr.shape[1:])
                                    for name, arr in sorted(self.inputs.items()))
        return self._shape_key


class Scheduler:
    """Receives validated requests for one model version."""

    def __init__(self, pool: InstancePool) -> None:
        self.pool = pool

    async def submit(self, pending: Pending) -> None:
        """Take ``pending``; its future is resolved when its outputs (or error) are known."""
        raise NotImplementedError

    async def close(self) -> None:
        """Stop taking requests; fail what is still queued with Unavailable."""


class DirectScheduler(Scheduler):
    """No batching: each request runs alone on the first free instance."""

    async def submit(self, pending: Pending) -> None:
        instance = await self.pool.acquire()
        asyncio.ensure_future(self.pool.execute(instance, [pending]))
