"""Batches the event loop waits for itself (``Backend.start_on_loop``: a backend whose work
runs in another process, the python backend's workers): how their outcome reaches the
instance pool's delivery, as an instance thread's job would bring it, with no thread
waiting and nothing hopping back to the loop (``instances.InstancePool`` uses these)."""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Callable

from ..protocol.errors import Internal

if TYPE_CHECKING:
    from .instances import Deferred, Instance
    from .pending import Pending


#: what a held batch's job returns once it has sent the batch (``send_held``): no call back
QUIET = object()


def send_held(split: Any, batch: list["Pending"]) -> object:
    split.send([p.inputs for p in batch], [p.request for p in batch])
    return QUIET


def on_loop_done(loop: asyncio.AbstractEventLoop, instance: "Instance", started: "int | Deferred",
                 count: int, finished: Callable[[Any, BaseException | None], None]) -> Callable:
    """The ``done`` of ``Backend.start_on_loop``: the backend's outcome as the instance
    thread's job would give it to ``finished`` (results and timing, or the error), with the
    blocking part of a failure (``finish``) run on the instance's thread. ``started``: when
    the batch started (ns), or the held batch whose claim says it."""
    backend = instance.backend

    def outcome(responses: list) -> tuple[list, tuple[int, int, int]]:
        if len(responses) != (count if type(started) is int else len(started.batch)):
            raise Internal(f"{backend.instance.name}: backend returned {len(responses)} "
                           f"responses for {count} requests")
        t0 = started if type(started) is int else started.start_ns
        ci, co = backend.io_ns
        return responses, (ci, max(0, time.monotonic_ns() - t0 - ci - co), co)

    def finish_on_thread(finish: Callable[[], list]) -> tuple[list, tuple[int, int, int]]:
        try:
            responses = finish()
        except BaseException as err:
            t0 = started if type(started) is int else started.start_ns
            err.compute_ns = (0, time.monotonic_ns() - t0, 0)  # type: ignore[attr-defined]
            raise
        return outcome(responses)

    def done(responses: list | None, finish: Callable[[], list] | None) -> None:
        if finish is not None:
            try:
                instance.thread.post(loop, finished, finish_on_thread, finish)
                return
            except RuntimeError:        # the instance is closing: finish here
                pass
        try:
            result = outcome(responses) if finish is None else finish_on_thread(finish)
            error = None
        except BaseException as err:
            result, error = None, err
        finished(result, error)

    return done
