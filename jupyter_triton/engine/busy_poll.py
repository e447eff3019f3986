"""Busy polling: the event loop keeps polling, instead of sleeping, for a while after each
request arrives (``jupyter-triton serve --busy-poll-us``).

On a virtual machine a core that sleeps is handed back to the hypervisor, and waking it
(a request from a client, the worker's answer, the queue delay's timer) costs ~45 us each,
several times a request; a core that keeps polling sees each at once. Measured on the 2-core
dev box, one client, the python model.py row of ``benchmarks/run.py``: 939 -> 1,212
inferences/s with the loop polling, 1,386/s with the python worker polling too
(``backends/python/worker_main.py``), against tritonserver's 1,087/s on the same model.py
(tritonserver polls too: ~1.2 ms of CPU an inference at one client). The price is CPU: up to a
core while requests keep coming, none once they stop (``window`` after the last).

The loop polls by running a callback that schedules itself: each turn the loop checks its
sockets and timers without sleeping (asyncio and uvloop alike), then runs what is ready. Only
requests for models that execute in processes of their own start it (``ModelVersion``): a
thread of this process (ONNX Runtime's, a thread-mode python model's) would wait for the GIL
a polling loop holds. Off (0) in a Jupyter server and a kernel, whose loop and GIL serve the
notebook too.
"""
from __future__ import annotations

import asyncio
import os
import time


class BusyPoll:
    """Keeps one event loop polling for ``window_us`` after each ``touch``."""

    __slots__ = ("window_us", "window", "until", "loop", "polling")

    def __init__(self, window_us: int) -> None:
        self.window_us = window_us      # what a model's worker is told (Backend.busy_poll_us)
        self.window = window_us / 1e6
        self.until = 0.0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.polling = False

    def touch(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``: a request came; poll until ``window`` from now."""
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
