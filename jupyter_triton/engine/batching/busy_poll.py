"""Busy polling: the event loop keeps polling, instead of sleeping, for a while after each
request arrives (``jupyter-triton serve --busy-poll-us``).

On a virtual machine a core that sleeps is handed back to the hypervisor, and waking it is
slow, several times a request (a request from a client, the worker's answer, the queue delay's
timer); a core that keeps polling sees each at once. At one client that is
the difference between trailing tritonserver, which polls too, and passing it (see
benchmarks/results/notes-engine.md). The price is CPU: up to a core while requests keep
coming, none once they stop (``window`` after the last).

The loop polls by running a callback that schedules itself: each turn the loop checks its
sockets and timers without sleeping (asyncio and uvloop alike), then runs what is ready. Only
requests for models that execute in processes of their own start it (``ModelVersion``): a
thread of this process (ONNX Runtime's, a thread-mode python model's) would wait for the GIL
a polling loop holds. Off (0) in a Jupyter server and a kernel, whose loop and GIL serve the
notebook too.

A queue delay longer than the window would outlast the polling: the batch would leave, and its
answer come back, to a loop that sleeps. So while every request the loop polls for waits in the
dynamic batcher's queue for one deadline past the window (``rest``: one client, or each
client's request in one batch), nothing of theirs can happen before it: the loop sleeps at
once and polls from just before the deadline instead (a ``timer.Alarm``), for the batch's
start, its answer and the next request. A request that arrives meanwhile wakes the loop as any
socket does, and it polls again from there. Within the window the loop keeps polling through
the delay: there a rest costs a sleeping core's wake-up, more throughput than the CPU it saves
is worth; past the window it saves CPU per inference for the same throughput (see
benchmarks/results/notes-engine.md).

A python model's worker polls for its next batch after a batch of one
(``backends/python/worker_main.py``), for the same window. Where the dynamic batcher holds every
batch of one for a delay past the window, the next batch cannot come in it (a request that
arrives after the batch leaves waits out the same delay), so such a worker does not poll
(``worker_window_us``): that saves most of the CPU per inference for a little throughput (see
benchmarks/results/notes-engine.md), since a client on the same machine no longer finds the
worker's core awake.
"""
from __future__ import annotations

import asyncio
import os
import time

from tritonclient.grpc import model_config_pb2 as mc

from .timer import Alarm

# A rest ends this long before its deadline, more than the alarm's lateness at one client
# (benchmarks/results/notes-engine.md), so that the loop polls again by the time the batch leaves.
REST_MARGIN_NS = 100_000


class BusyPoll:
    """Keeps one event loop polling for ``window_us`` after each ``touch``."""

    __slots__ = ("window_us", "window", "until", "loop", "polling", "active", "_alarm")

    def __init__(self, window_us: int) -> None:
        self.window_us = window_us      # what a model's worker is told (Backend.busy_poll_us)
        self.window = window_us / 1e6
        self.until = 0.0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.polling = False
        self.active = 0                 # requests touched and not yet left
        self._alarm: Alarm | None = None

    def worker_window_us(self, config: mc.ModelConfig) -> int:
        """How long the worker of a model with ``config`` polls after a batch of one: 0 where
        each batch of one waits out a queue delay longer than the window (it can leave early
        only when one row fills it: ``max_batch_size`` 1, or a preferred size of 1)."""
        if not config.HasField("dynamic_batching") or config.max_batch_size <= 1:
            return self.window_us
        batching = config.dynamic_batching
        if batching.max_queue_delay_microseconds > self.window_us and 1 not in batching.preferred_batch_size:
            return 0
        return self.window_us

    def touch(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``: a request came; poll until ``window`` from now. Call ``left`` once
        it has its answer."""
        self.active += 1
        self._poll(loop)

    def left(self) -> None:
        self.active -= 1

    def rest(self, held: int, deadline_ns: int) -> None:
        """``held`` requests wait in a queue for one deadline (``time.monotonic_ns()``). If
        they are all the requests this loop polls for and the window ends before the
        deadline, the loop sleeps now and polls from just before the deadline instead."""
        if held != self.active or not self.polling or deadline_ns <= self.until * 1e9:
            return
        wake_ns = deadline_ns - REST_MARGIN_NS
        if wake_ns <= time.monotonic_ns():
            return
        if self._alarm is None:
            self._alarm = Alarm(self._wake)
        self._alarm.set(wake_ns)
        self.until = 0.0                # the next turn ends the polling

    def _wake(self) -> None:
        self._poll(self.loop)

    def _poll(self, loop: asyncio.AbstractEventLoop) -> None:
        self.until = time.monotonic() + self.window
        if not self.polling:
            self.polling = True
            self.loop = loop
            loop.call_soon(self._turn)

    def _turn(self) -> None:
        if time.monotonic() < self.until:
            # Another runnable task on this core (the model's worker, a client on the same
            # machine) gets it now: polling spends only time nobody else wants.
            os.sched_yield()
            self.loop.call_soon(self._turn)
        else:
            self.polling = False
