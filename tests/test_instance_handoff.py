"""The hand-off of a batch to its instance's thread and back (engine/batching/instances.py): results
come back by one callback on the loop, a backend that crashes fails its requests (never the
server), the instance is always released, and a waiter cancelled mid-run still gets its
requests answered when the thread is done."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from jupyter_triton.backends.base import Backend, InstanceSpec, ModelFiles
from jupyter_triton.engine.batching.batcher import DynamicBatcher
from jupyter_triton.engine.batching.instances import Instance, InstancePool
from jupyter_triton.engine.batching.scheduler import Pending
from jupyter_triton.engine.observation.statistics import ModelStatistics
from jupyter_triton.protocol.errors import Internal
from jupyter_triton.protocol.types import InferRequest

CONFIG = ('name: "m" max_batch_size: 8 input [{name: "IN" data_type: TYPE_FP32 dims: [2]}] '
          'output [{name: "OUT" data_type: TYPE_FP32 dims: [2]}] ')


class Doubler(Backend):
    """Doubles its input on the instance thread; ``fail`` makes execute raise instead;
    ``release`` (an Event) holds execute until it is set."""

    def __init__(self, config, fail: bool = False, release: threading.Event | None = None):
        super().__init__(config, ModelFiles("m", 1, Path("."), Path(".")), InstanceSpec("m_0_0"))
        self.fail, self.release = fail, release
        self.threads: list[str] = []

    def load(self) -> None:
        pass

    def execute(self, requests, infer_requests=None):
        self.threads.append(threading.current_thread().name)
        if self.release is not None:
            self.release.wait(5)
        if self.fail:
            raise RuntimeError("backend bug")
        return [{"OUT": r["IN"] * 2} for r in requests]


def _pool(**kw) -> tuple[InstancePool, Doubler, ModelStatistics, mc.ModelConfig]:
    config = text_format.Parse(CONFIG, mc.ModelConfig())
    backend = Doubler(config, **kw)
    stats = ModelStatistics("m", "1")
    return InstancePool([Instance(backend)], stats), backend, stats, config


def _pending(value: float) -> Pending:
    future = asyncio.get_running_loop().create_future()
    return Pending(InferRequest("m"), {"IN": np.full((1, 2), value, np.float32)}, 1, future)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def _until_running(backend: Doubler, count: int = 1) -> None:
    """Until ``count`` executes have begun on the instance thread (run()'s bound if never)."""
    while len(backend.threads) < count:
        await asyncio.sleep(0.005)


def test_run_takes_a_free_instance_runs_on_its_thread_and_answers_every_request():
    async def main():
        pool, backend, stats, _ = _pool()
        batch = [_pending(1.0), _pending(3.0)]
        stats.pending = 2
        done = pool.run(batch)
        assert pool.idle_count() == 0
        outs = await asyncio.gather(*(p.future for p in batch))
        await done
        assert [o["OUT"].tolist() for o in outs] == [[[2.0, 2.0]], [[6.0, 6.0]]]
        assert backend.threads == ["triton-m_0_0"]
        assert pool.idle_count() == 1 and stats.pending == 0
        assert stats.queue.count == 2 and stats.execution_count == 1 and stats.inference_count == 2
        pool.close()
    run(main())


def test_a_backend_that_crashes_fails_its_requests_and_frees_the_instance():
    async def main():
        pool, _, stats, _ = _pool(fail=True)
        instance = pool.try_acquire()
        batch = [_pending(1.0), _pending(2.0)]
        await pool.launch(instance, batch)
        for p in batch:
            err = p.future.exception()
            assert isinstance(err, Internal) and "RuntimeError: backend bug" in str(err)
        assert pool.idle_count() == 1
        # Triton 2.51 counts a failed execution, but not its requests' rows
        assert (stats.execution_count, stats.inference_count) == (1, 0)
        pool.close()
    run(main())


def test_a_waiter_cancelled_while_the_thread_runs_still_answers_its_requests():
    async def main():
        release = threading.Event()
        pool, backend, _, _ = _pool(release=release)
        instance = pool.try_acquire()
        p = _pending(5.0)
        task = asyncio.ensure_future(pool.execute(instance, [p]))
        await _until_running(backend)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert not p.future.done()
        release.set()
        out = await asyncio.wait_for(p.future, 5)
        assert out["OUT"].tolist() == [[10.0, 10.0]]
        pool.close()
    run(main())


def test_the_batcher_sends_the_next_batch_as_soon_as_the_instance_is_free():
    # Requests queued behind a running batch leave together the moment it ends, without
    # waiting for a timer or a batcher task to be scheduled.
    async def main():
        release = threading.Event()
        pool, backend, stats, _ = _pool(release=release)
        config = text_format.Parse(CONFIG + "dynamic_batching { max_queue_delay_microseconds: 0 }",
                                   mc.ModelConfig())
        b = DynamicBatcher(config, pool, stats)
        first = _pending(1.0)
        await b.submit(first)
        await _until_running(backend)
        rest = [_pending(float(i)) for i in range(2, 6)]
        for p in rest:
            await b.submit(p)
        assert b.queued_count() == 4
        release.set()
        # sent by the release itself (run()'s bound catches a batch that never leaves)
        await asyncio.gather(first.future, *(p.future for p in rest))
        assert stats.execution_count == 2 and sorted(stats.batch_stats) == [1, 4]
        await b.close()
        pool.close()
    run(main())


def test_a_held_batch_taken_back_never_runs_and_frees_its_instance():
    async def main():
        pool, backend, stats, _ = _pool()
        released = []
        pool.on_release = lambda: released.append(pool.idle_count())
        p = _pending(1.0)
        assert pool.can_hold()
        held = pool.hold([p], time.monotonic_ns() + 50_000_000, lambda _: None)
        assert pool.idle_count() == 0 and not pool.can_hold()
        assert held.retract()
        assert held.done.done() and released == [1] and pool.idle_count() == 1
        await asyncio.sleep(0.08)                  # past its deadline: the thread skipped it
        assert backend.threads == [] and not p.future.done()
        # held again and left alone: it starts at its deadline on the thread
        held = pool.hold([p], time.monotonic_ns() + 10_000_000, lambda _: None)
        out = await p.future
        await held.done
        assert not held.retract()                  # claimed: too late to take back
        assert out["OUT"].tolist() == [[2.0, 2.0]] and backend.threads == ["triton-m_0_0"]
        assert pool.idle_count() == 1
        pool.close()
    run(main())
