"""A batch that must wait for its queue delay is held by a free instance's thread, which starts
it at the deadline (engine/batching/instances.py ``Deferred``): Triton's batching rules still hold while
it is held (arrivals join it, a preferred size or a full batch sends it at once, a request that
leaves is not run, timeouts and unloading take it back). A real InstancePool and a recording
backend; no HTTP."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from jupyter_triton.backends.base import Backend, InstanceSpec, ModelFiles
from jupyter_triton.engine.batching.batcher import DynamicBatcher
from jupyter_triton.engine.batching.instances import Instance, InstancePool
from jupyter_triton.engine.batching.scheduler import Pending
from jupyter_triton.engine.observation.statistics import ModelStatistics
from jupyter_triton.protocol.errors import Unavailable
from jupyter_triton.protocol.types import InferRequest

BASE = 'name: "m" input [{name: "IN" data_type: TYPE_FP32 dims: [-1]}] '


class Recording(Backend):
    """Doubles its input; records each batch's ids, start time and thread."""

    def __init__(self, config, log, seconds: float = 0.0):
        super().__init__(config, ModelFiles("m", 1, Path("."), Path(".")), InstanceSpec("m_0_0"))
        self.log, self.seconds = log, seconds

    def load(self) -> None:
        pass

    def execute(self, requests, infer_requests=None):
        self.log.append(([int(r["IN"].flat[0]) for r in requests], time.monotonic_ns(),
                         threading.current_thread().name))
        time.sleep(self.seconds)
        return [{"OUT": r["IN"] * 2} for r in requests]


def batcher(config_text: str, seconds: float = 0.0):
    config = text_format.Parse(BASE + config_text, mc.ModelConfig())
    stats = ModelStatistics("m", "1")
    log: list = []
    pool = InstancePool([Instance(Recording(config, log, seconds))], stats)
    return DynamicBatcher(config, pool, stats), log, stats


def pending(rid: int, rows: int = 1, timeout_us: int = 0) -> Pending:
    inputs = {"IN": np.full((rows, 2), rid, dtype=np.float32)}
    future = asyncio.get_running_loop().create_future()
    return Pending(InferRequest("m"), inputs, rows, future, timeout_ns=timeout_us * 1000)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_a_lone_request_waits_the_whole_delay_then_runs_on_the_instance_thread():
    async def main():
        b, log, stats = batcher("max_batch_size: 8 dynamic_batching { max_queue_delay_microseconds: 1000000 }")
        p = pending(7)
        await b.submit(p)
        assert b._deferred is not None          # held by the thread, not by the loop's alarm
        result = await p.future
        await b.close()
        return p, result, log, stats

    p, result, log, stats = run(main())
    assert np.array_equal(result["OUT"], np.full((1, 2), 14, dtype=np.float32))
    [(ids, start_ns, thread)] = log
    assert ids == [7] and thread == "triton-m_0_0"
    waited = start_ns - p.enqueue_ns
    # the delay, then the thread's wake-up: not a second delay (a busy machine's wake-up may
    # take hundreds of ms; the timers' precision is test_batching_http's median test)
    assert 1_000_000_000 <= waited < 2 * 1_000_000_000
    assert stats.queue.count == 1 and 1_000_000_000 <= stats.queue.ns <= waited


def test_requests_that_arrive_while_a_batch_is_held_join_it_and_keep_the_first_deadline():
    async def main():
        b, log, _ = batcher("max_batch_size: 8 dynamic_batching { max_queue_delay_microseconds: 1500000 }")
        ps = [pending(0)]
        await b.submit(ps[0])
        # a third of the delay: the newest one's own deadline would be 0.5 s past the first's,
        # and a late wake-up of the loop still finds the batch held
        await asyncio.sleep(0.5)
        for i in (1, 2):
            ps.append(pending(i))
            await b.submit(ps[-1])
        results = await asyncio.gather(*(p.future for p in ps))
        await b.close()
        return ps, results, log

    ps, results, log = run(main())
    [(ids, start_ns, _)] = log
    assert ids == [0, 1, 2]
    assert start_ns - ps[0].enqueue_ns >= 1_500_000_000   # the oldest request's delay, in full
    assert start_ns - ps[2].enqueue_ns < 1_500_000_000    # not the newest one's
    assert [int(r["OUT"].flat[0]) for r in results] == [0, 2, 4]


def test_a_held_batch_that_reaches_the_preferred_size_leaves_at_once():
    async def main():
        # a delay past run()'s 20 s bound: a batch that waited for it is never answered
        b, log, _ = batcher("max_batch_size: 8 dynamic_batching { preferred_batch_size: [3] "
                            "max_queue_delay_microseconds: 60000000 }")
        ps = []
        for i in range(3):
            ps.append(pending(i))
            await b.submit(ps[-1])
            await asyncio.sleep(0.002)
        await asyncio.gather(*(p.future for p in ps))
        await b.close()
        return log

    log = run(main())
    assert [ids for ids, _, _ in log] == [[0, 1, 2]]


def test_a_request_that_does_not_fit_sends_the_held_batch_at_once_and_waits_itself():
    async def main():
        b, log, _ = batcher("max_batch_size: 4 dynamic_batching { max_queue_delay_microseconds: 2000000 }")
        first, second = pending(0, rows=2), pending(1, rows=3)
        await b.submit(first)
        await b.submit(second)
        await first.future
        await second.future
        first_start = log[0][1] - first.enqueue_ns
        second_start = log[1][1] - second.enqueue_ns
        await b.close()
        return first_start, second_start, log

    first_start, second_start, log = run(main())
    assert [ids for ids, _, _ in log] == [[0], [1]]
    assert first_start < 1_000_000_000                    # it left when [1] could not join, not at its 2 s
    assert second_start >= 2_000_000_000                  # [1] waited its own full delay


def test_a_request_that_leaves_while_held_is_not_run():
    async def main():
        # the delay long beside a busy machine's stall: the batch is still held when it leaves
        b, log, stats = batcher("max_batch_size: 8 dynamic_batching { max_queue_delay_microseconds: 1000000 }")
        kept, gone = pending(0), pending(1)
        await b.submit(kept)
        await b.submit(gone)
        await asyncio.sleep(0.01)
        assert not log
        gone.future.cancel()                              # the client went away
        result = await kept.future
        await b.close()
        return result, log, stats

    result, log, stats = run(main())
    assert [ids for ids, _, _ in log] == [[0]]
    assert int(result["OUT"].flat[0]) == 0
    assert stats.queue.count == 1


def test_a_queue_timeout_takes_the_held_batch_back_to_the_loop():
    async def main():
        b, log, _ = batcher("max_batch_size: 8 dynamic_batching { max_queue_delay_microseconds: 2000000 "
                            "default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 5000000 "
                            "allow_timeout_override: true } }")
        patient, hurried = pending(0), pending(1, timeout_us=20000)
        start = time.monotonic()
        await b.submit(patient)
        await b.submit(hurried)
        outcome = await asyncio.gather(hurried.future, return_exceptions=True)
        timed_out = time.monotonic() - start
        await patient.future
        ran_after = log[0][1] - patient.enqueue_ns
        await b.close()
        return outcome[0], timed_out, ran_after, log

    err, timed_out, ran_after, log = run(main())
    assert isinstance(err, Unavailable) and "timeout" in str(err)
    assert 0.02 <= timed_out < 1.0                        # on its own time, not the batch's 2 s
    assert [ids for ids, _, _ in log] == [[0]]
    assert ran_after >= 2_000_000_000


def test_unloading_takes_a_held_batch_back_fails_its_requests_and_frees_the_instance():
    async def main():
        # a delay past run()'s 20 s bound: a close that waited for the held batch never returns
        b, log, _ = batcher("max_batch_size: 8 dynamic_batching { max_queue_delay_microseconds: 60000000 }")
        ps = [pending(0), pending(1)]
        for p in ps:
            await b.submit(p)
        await b.close()
        outcomes = await asyncio.gather(*(p.future for p in ps), return_exceptions=True)
        await asyncio.sleep(0.05)                         # a thread that ran it would log by now
        return outcomes, log, b.pool.idle_count()

    outcomes, log, idle = run(main())
    assert all(isinstance(o, Unavailable) for o in outcomes)
    assert log == [] and idle == 1


def test_instance_threads_wait_for_deadlines_without_timer_slack():
    # Linux lets a timed wait end up to the thread's timer slack late (50 us by default); the
    # instance thread, which waits for batch deadlines, asks for none.
    async def main():
        b, _, _ = batcher("max_batch_size: 8 dynamic_batching { max_queue_delay_microseconds: 100 }")
        thread = b.pool.instances[0].thread._thread
        p = pending(1)
        await b.submit(p)
        await p.future                    # the thread is surely past its start by now
        await b.close()
        return thread.native_id

    tid = run(main())
    path = Path(f"/proc/{tid}/timerslack_ns")   # a thread id names its own /proc entry
    if not path.exists():
        pytest.skip("no /proc timer slack here (not Linux)")
    assert int(path.read_text()) == 1
    assert int(Path(f"/proc/{threading.get_native_id()}/timerslack_ns").read_text()) != 1


def test_bursts_and_departures_over_two_instances_run_every_request_once():
    # Held batches are reshaped, claimed and taken back from two threads at once; whatever the
    # interleaving, each request runs at most once, every one that stayed gets its own answer,
    # and both instances end free.
    import random

    async def main():
        config = text_format.Parse(
            BASE + "max_batch_size: 8 dynamic_batching { preferred_batch_size: [4] "
                   "max_queue_delay_microseconds: 2000 }", mc.ModelConfig())
        stats = ModelStatistics("m", "1")
        log: list = []
        pool = InstancePool([Instance(Recording(config, log)) for _ in range(2)], stats)
        b = DynamicBatcher(config, pool, stats)
        rng = random.Random(8)
        ps, gone = [], set()
        for rid in range(400):
            p = pending(rid, rows=rng.choice((1, 1, 2, 3)))
            ps.append(p)
            await b.submit(p)
            if rng.random() < 0.1:
                gone.add(rid)
                p.future.cancel()
            if rng.random() < 0.3:
                await asyncio.sleep(rng.choice((0, 0.0005, 0.002)))
        outcomes = await asyncio.gather(*(p.future for p in ps), return_exceptions=True)
        await b.close()
        return ps, gone, outcomes, log, pool.idle_count()

    ps, gone, outcomes, log, idle = run(main())
    ran = [rid for ids, _, _ in log for rid in ids]
    assert len(ran) == len(set(ran))                      # nothing ran twice
    for rid, (p, outcome) in enumerate(zip(ps, outcomes)):
        if rid in gone:
            assert isinstance(outcome, asyncio.CancelledError)
        else:
            assert rid in ran
            assert np.array_equal(outcome["OUT"], np.full((p.batch_size, 2), 2 * rid, dtype=np.float32))
    assert all(sum(ps[rid].batch_size for rid in ids) <= 8 for ids, _, _ in log)
    assert any(len(ids) > 1 for ids, _, _ in log)       # requests did join held batches
    assert idle == 2


def test_a_held_batch_leaves_the_queue_and_the_pending_count_as_it_starts_not_as_it_ends():
    # Triton: queue time and nv_inference_pending_request_count end when the backend is about
    # to execute; a long execution must not keep its requests "pending".
    async def main():
        b, log, stats = batcher("max_batch_size: 8 dynamic_batching { max_queue_delay_microseconds: 10000 }",
                                seconds=0.5)
        ps = [pending(0), pending(1)]
        for p in ps:
            stats.pending += 1                # as the engine counts a request it accepts
            await b.submit(p)
        for _ in range(1000):                 # until the loop has heard the thread started it
            if all(p.started for p in ps):
                break
            await asyncio.sleep(0.005)
        during = (stats.queue.count, stats.pending, all(p.started for p in ps), ps[0].future.done())
        await asyncio.gather(*(p.future for p in ps))
        await b.close()
        return during, stats.queue.count, stats.pending

    during, queued_after, pending_after = run(main())
    assert during == (2, 0, True, False)
    assert queued_after == 2 and pending_after == 0


def test_under_load_the_batch_waits_on_the_loop_so_requests_it_is_reading_join():
    """After a batch of several requests (load: many clients), the next batch is not held by
    the thread until its deadline but left to the loop's alarm: a request the loop is still
    busy reading at the deadline then joins it, as the whole wave does in tritonserver,
    whose front reads requests in parallel. Alone again (c=1), the thread holds it."""
    delay_ns = 30_000_000

    async def main():
        b, log, _ = batcher("max_batch_size: 8 dynamic_batching { max_queue_delay_microseconds: 30000 }")
        wave = [pending(0), pending(1)]
        for p in wave:
            await b.submit(p)
        await asyncio.gather(*(p.future for p in wave))
        assert [ids for ids, _, _ in log] == [[0, 1]]
        first, late = pending(2), pending(3)
        await b.submit(first)
        assert b._deferred is None and b._alarm.deadline_ns is not None
        loop = asyncio.get_running_loop()

        def busy_reading() -> None:
            # the loop is busy until past the deadline...
            time.sleep(max(0.0, (first.enqueue_ns + delay_ns - time.monotonic_ns()) / 1e9) + 0.01)
            loop.create_task(b.submit(late))    # ...with a request that then arrives

        loop.call_soon(busy_reading)
        await asyncio.gather(first.future, late.future)
        held = []
        for rid in (4, 5):
            alone = pending(rid)
            await b.submit(alone)
            held.append(b._deferred is not None)
            await alone.future
        await b.close()
        return log, held

    log, held = run(main())
    assert [ids for ids, _, _ in log] == [[0, 1], [2, 3], [4], [5]]
    assert held == [False, True]          # after a batch of one, held by the thread again
