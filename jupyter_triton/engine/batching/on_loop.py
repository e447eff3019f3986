"""Batches the event loop waits for itself (``Backend.start_on_loop``: a backend whose work
runs in another process, the python backend's workers): how their outcome reaches the
instance pool's delivery, as an instance thread's job would bring it, with no thread
waiting and nothing hopping back to the loop (``instances.InstancePool`` uses these)."""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Callable

from ...protocol.errors import Internal

if TYPE_CHECKING:
    from .instances import Instance, InstancePool
    from .pending import Pending


class OnLoopBatch:
    """One batch sent by the loop, called as the ``done`` of ``Backend.start_on_loop``: the
    backend's outcome goes to ``pool.ran`` as the instance thread's job would give it
    (results and timing, or the error), with the blocking part of a failure (``finish``) run
    on the instance's thread. One object a batch rather than a closure for each step: this
    runs once a batch on the loop. ``started_ns``: when the batch started."""

    __slots__ = ("pool", "loop", "instance", "live", "future", "started_ns")

    def __init__(self, pool: "InstancePool", loop: asyncio.AbstractEventLoop, instance: "Instance",
                 live: list["Pending"], future: asyncio.Future, started_ns: int) -> None:
        self.pool = pool
        self.loop = loop
        self.instance = instance
        self.live = live
        self.future = future
        self.started_ns = started_ns

    def __call__(self, responses: list | None, finish: Callable[[], list] | None) -> None:
        if finish is not None:
            try:
                self.instance.thread.post(self.loop, self._finished, self._finish_on_thread, finish)
                return
            except RuntimeError:        # the instance is closing: finish here
                pass
        try:
            result = self._outcome(responses) if finish is None else self._finish_on_thread(finish)
            error = None
        except BaseException as err:
            result, error = None, err
        self._finished(result, error)

    def _finished(self, result: Any, error: BaseException | None) -> None:
        self.pool.ran(self.future, self.instance, self.live, result, error)

    def _outcome(self, responses: list) -> tuple[list, tuple[int, int, int]]:
        backend = self.instance.backend
        if len(responses) != len(self.live):
            raise Internal(f"{backend.instance.name}: backend returned {len(responses)} "
                           f"responses for {len(self.live)} requests")
        ci, co = backend.io_ns
        return responses, (ci, max(0, time.monotonic_ns() - self.started_ns - ci - co), co)

    def _finish_on_thread(self, finish: Callable[[], list]) -> tuple[list, tuple[int, int, int]]:
        try:
            responses = finish()
        except BaseException as err:
            err.compute_ns = (0, time.monotonic_ns() - self.started_ns, 0)  # type: ignore[attr-defined]
            raise
        return self._outcome(responses)
