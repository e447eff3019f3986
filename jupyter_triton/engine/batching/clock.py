"""The time a scheduler reads and the wake-ups it asks for, so that the same batcher runs
on the wall clock (serving) or on a virtual one (``engine/batching/simulation.py``).

A clock offers ``now_ns()`` and ``alarm(callback)``, an object with ``set(deadline_ns)``,
``cancel()``, ``close()`` and ``deadline_ns`` that calls ``callback`` on the running loop
once ``now_ns()`` reaches the deadline (``timer.Alarm`` on the wall clock).

``VirtualLoop`` is an asyncio loop whose time only moves when nothing is ready to run: it
then jumps to the next timer. Futures, tasks and callbacks behave as on any loop, so code
written for asyncio runs unchanged; a discrete-event simulation is then a run of that loop.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Protocol

from .timer import Alarm


class AlarmLike(Protocol):
    deadline_ns: int | None

    def set(self, deadline_ns: int) -> None: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...


class Clock(Protocol):
    def now_ns(self) -> int: ...

    def alarm(self, callback: Callable[[], object]) -> AlarmLike: ...


class MonotonicClock:
    """The wall clock: ``time.monotonic_ns`` and a timerfd ``Alarm``."""

    now_ns = staticmethod(time.monotonic_ns)
    alarm = Alarm


MONOTONIC = MonotonicClock()


class _VirtualSelector:
    """Never waits: where the loop would sleep, virtual time jumps to its next timer."""

    def __init__(self, loop: "VirtualLoop") -> None:
        self._loop = loop

    def select(self, timeout: float | None) -> list:
        if timeout is None:
            # nothing ready, nothing scheduled: on a real loop, waiting for I/O forever
            raise RuntimeError("virtual loop stalled: nothing is scheduled and nothing can arrive")
        if timeout > 0:
            loop = self._loop
            # timers are kept in float seconds; deadlines are whole ns, so rounding recovers them
            loop.now = max(loop.now, round(loop._scheduled[0]._when * 1e9))
        return []

    def close(self) -> None:
        pass


class VirtualLoop(asyncio.BaseEventLoop):
    """An event loop on virtual time (``now``, integer ns from 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self._selector = _VirtualSelector(self)
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self.now / 1e9

    def _process_events(self, event_list: list) -> None:
        pass

    def _write_to_self(self) -> None:
        pass          # one thread: nothing ever waits in select to be woken


class VirtualClock:
    """The clock of a ``VirtualLoop``."""

    def __init__(self, loop: VirtualLoop) -> None:
        self.loop = loop

    def now_ns(self) -> int:
        return self.loop.now

    def alarm(self, callback: Callable[[], object]) -> "VirtualAlarm":
        return VirtualAlarm(self.loop, callback)


class VirtualAlarm:
    def __init__(self, loop: VirtualLoop, callback: Callable[[], object]) -> None:
        self._loop = loop
        self._callback = callback
        self.deadline_ns: int | None = None
        self._handle: asyncio.TimerHandle | None = None

    def set(self, deadline_ns: int) -> None:
        if deadline_ns == self.deadline_ns:
            return
        if self._handle is not None:
            self._handle.cancel()
        self.deadline_ns = deadline_ns
        self._handle = self._loop.call_at(deadline_ns / 1e9, self._fire)

    def cancel(self) -> None:
        self.deadline_ns = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    close = cancel

    def _fire(self) -> None:
        self._handle = None
        self.deadline_ns = None
        self._callback()
