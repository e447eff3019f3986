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
    from .instances import Instance


def on_loop_done(loop: asyncio.AbstractEventLoop, instance: "Instance", started_ns: int,
                 count: int, finished: Callable[[Any, BaseException | None], None]) -> Callable:
    """The ``done`` of ``Backend.start_on_loop``: the backend's outcome as the instance
    thread's job would give it to ``finished`` (results and timing, or the error), with the
    blocking part of a failure (``finish``) run on the instance's thread. ``started_ns``: when
    the batch started."""
    backend = instance.backend

    def outcome(responses: list) -> tuple[list, tuple[int, int, int]]:
        if len(responses) != count:
            raise Internal(f"{backend.instance.name}: backend returned {len(responses)} "
                           f"responses for {count} requests")
        ci, co = backend.io_ns
        return responses, (ci, max(0, time.monotonic_ns() - started_ns - ci - co), co)

    def finish_on_thread(finish: Callable[[], list]) -> tuple[list, tuple[int, int, int]]:
        try:
            responses = finish()
        except BaseException as err:
            err.compute_ns = (0, time.monotonic_ns() - started_ns, 0)  # type: ignore[attr-defined]
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
