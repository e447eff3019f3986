"""The scheduler seam: what a request becomes once validated, and how it reaches an instance.

A frontend calls ``Engine.infer``; the engine wraps the request in a ``Pending`` and hands
it to the model's scheduler. A scheduler only decides *which requests run together and
when*; ``InstancePool.execute`` runs them and resolves every ``Pending.future``.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..backends.signature import int_parameter
from ..protocol.errors import InvalidArgument, Unavailable
from ..protocol.types import InferRequest
from .instances import Instance, InstancePool
from .statistics import mark_failure

if TYPE_CHECKING:
    from .streaming import ResponseStream

DEFAULT_MAX_QUEUE_SIZE = 4096             # queued requests per version, where nothing else bounds them


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


def default_max_queue_size(config: mc.ModelConfig) -> int:
    """The version-wide bound on queued requests: ``parameters { key:
    "default_max_queue_size" }``, ``DEFAULT_MAX_QUEUE_SIZE`` when absent, 0 for none. Without
    it a flood of requests to a busy model grows the server's memory without end."""
    bound = int_parameter(config, "default_max_queue_size")
    if bound is not None and bound < 0:
        raise InvalidArgument(f"model '{config.name}': parameter 'default_max_queue_size' "
                              f"must be 0 (unbounded) or more, got {bound}")
    return DEFAULT_MAX_QUEUE_SIZE if bound is None else bound


def queue_full(model: str, queued: int, bound: int) -> Unavailable:
    """Triton's full-queue refusal (503), tagged REJECTED for the failure metric."""
    return mark_failure(Unavailable(
        f"Exceeds maximum queue size: model '{model}' already queues {queued} "
        f"requests (default_max_queue_size {bound})"), "REJECTED")


class DirectScheduler(Scheduler):
    """No batching: each request runs alone on the first free instance, in arrival order.

    While every instance is busy a request waits in a task of its own; at most
    ``default_max_queue_size`` wait (the dynamic batcher's bound and parameter), the next
    one is refused with Unavailable. ``submit`` never waits for an instance, so a request
    that unload fails (a hung model holds every instance) is answered at once."""

    def __init__(self, pool: InstancePool, config: mc.ModelConfig | None = None) -> None:
        super().__init__(pool)
        self.model = config.name if config is not None else ""
        self.max_queue_size = (default_max_queue_size(config) if config is not None
                               else DEFAULT_MAX_QUEUE_SIZE)
        self._waiting: dict[Pending, asyncio.Task] = {}
        self._closed = False

    async def submit(self, pending: Pending) -> None:
        if self._closed:
            raise mark_failure(Unavailable(
                f"model '{self.model}' is unloading: its scheduler has stopped accepting new "
                f"inference requests"), "REJECTED")
        if not self._waiting:
            instance = self.pool.try_acquire()
            if instance is not None:      # the common case: no task, no wait
                asyncio.ensure_future(self.pool.execute(instance, [pending]))
                return
        if self.max_queue_size and len(self._waiting) >= self.max_queue_size:
            raise queue_full(self.model, len(self._waiting), self.max_queue_size)
        self._waiting[pending] = asyncio.ensure_future(self._wait_and_run(pending))
        pending.future.add_done_callback(lambda _, p=pending: self._forget(p))

    async def _wait_and_run(self, pending: Pending) -> None:
        instance: Instance = await self.pool.acquire()
        self._waiting.pop(pending, None)   # from here on it runs: not cancelled by _forget
        await self.pool.execute(instance, [pending])

    def _forget(self, pending: Pending) -> None:
        # Its answer is known while it still waits (client gone, unload): stop waiting, so
        # that it no longer counts against the bound nor takes an instance later.
        task = self._waiting.pop(pending, None)
        if task is not None:
            task.cancel()

    def queued_count(self) -> int:
        return len(self._waiting)

    async def close(self) -> None:
        """Refuse new requests and fail those still waiting for an instance."""
        self._closed = True
        error = Unavailable(f"model '{self.model}' was unloaded before the request could run")
        for pending in list(self._waiting):
            if not pending.future.done():
                pending.future.set_exception(mark_failure(error, "REJECTED"))
            self._forget(pending)
