"""The scheduler seam: how a validated request (``pending.Pending``) reaches an instance.

A frontend calls ``Engine.infer``; the engine wraps the request in a ``Pending`` and hands
it to the model's scheduler. A scheduler only decides *which requests run together and
when*; the model's instance pool runs a batch (``Pool.run``) and resolves every
``Pending.future``. Schedulers know the pool only by the ``Pool`` protocol below.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Protocol

from tritonclient.grpc import model_config_pb2 as mc

from ...backends.signature import int_parameter
from ...protocol.errors import InvalidArgument, Unavailable
from .pending import Pending
from ..observation.statistics import mark_failure

__all__ = ["DEFAULT_MAX_QUEUE_SIZE", "DirectScheduler", "Pending", "Pool", "Scheduler",
           "default_max_queue_size", "queue_full"]

DEFAULT_MAX_QUEUE_SIZE = 4096             # queued requests per version, where nothing else bounds them


class Pool(Protocol):
    """What a scheduler asks of a model's instances (``instances.InstancePool``; a simulated
    pool in ``simulation.py``)."""

    on_release: Callable[[], Any] | None     # called whenever an instance is free again

    def idle_count(self) -> int:
        """Instances free now."""

    def run(self, batch: list[Pending], instance: Any = None) -> asyncio.Future:
        """Run ``batch`` on ``instance`` (one taken from ``acquire``) or, by default, on a
        free one (there must be one); every ``Pending.future`` is resolved and the instance
        freed before the returned future ends."""

    async def acquire(self) -> Any:
        """Wait for a free instance and take it (for ``run``)."""


class Scheduler:
    """Receives validated requests for one model version."""

    def __init__(self, pool: Pool) -> None:
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

    def __init__(self, pool: Pool, config: mc.ModelConfig | None = None) -> None:
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
        if not self._waiting and self.pool.idle_count():
            self.pool.run([pending])      # the common case: no task, no wait
            return
        if self.max_queue_size and len(self._waiting) >= self.max_queue_size:
            raise queue_full(self.model, len(self._waiting), self.max_queue_size)
        self._waiting[pending] = asyncio.ensure_future(self._wait_and_run(pending))
        pending.future.add_done_callback(lambda _, p=pending: self._forget(p))

    async def _wait_and_run(self, pending: Pending) -> None:
        instance = await self.pool.acquire()
        self._waiting.pop(pending, None)   # from here on it runs: not cancelled by _forget
        self.pool.run([pending], instance)

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
