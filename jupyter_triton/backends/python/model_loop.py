"""The event loop a model instance's coroutines (``async def execute``, and an async
``initialize`` / ``finalize``) run on: one per instance, in a daemon thread of its own, started
the first time the model hands back a coroutine (a model that never does pays nothing).

It keeps running between executes, as Triton's python_backend (24.04+, "Async Execute") runs
a decoupled model's async execute: a task the model started goes on after execute returned
and answers through its request's response sender later. A loop that ran only inside execute
(``run_until_complete``) left such tasks asleep until the next request came, or for good.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any

# how long unload lets the tasks the model left pending wind up once cancelled, and then waits
# for the loop's thread; past that (a task blocking the loop) the thread is left behind
WIND_UP_S = 1.0


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


class ModelLoop:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"pb-model-loop-{name}")
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        while not self._stopping:
            try:
                self.loop.run_forever()
            except BaseException:
                # a task's SystemExit / KeyboardInterrupt leaves run_forever after it was set
                # on the task (the caller waiting on it gets it); the loop serves on
                continue

    def run(self, awaitable: Any) -> Any:
        """Run ``awaitable`` on the loop and wait for its result. The caller's context goes
        with it (``call_soon_threadsafe`` copies it), the BLS host of thread mode included,
        and on to the tasks it starts."""
        return asyncio.run_coroutine_threadsafe(_awaited(awaitable), self.loop).result()

    def close(self) -> None:
        """Cancel the tasks the model left pending, let them wind up, stop the loop; bounded
        by ``WIND_UP_S`` twice over whatever the tasks do."""
        async def cancel_pending() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=WIND_UP_S)

        try:
            asyncio.run_coroutine_threadsafe(cancel_pending(), self.loop).result(WIND_UP_S + 0.5)
        except Exception:   # timed out, or a task's own error: stop regardless
            pass
        self._stopping = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(WIND_UP_S)
        if not self._thread.is_alive():
            self.loop.close()
