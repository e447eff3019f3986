"""The dynamic batcher's Triton semantics, driven without HTTP: a real InstancePool whose
instances run a recording backend (each request carries its id as data)."""
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
from jupyter_triton.engine.batching import timer
from jupyter_triton.engine.batching.batcher import DEFAULT_MAX_QUEUE_SIZE, DynamicBatcher
from jupyter_triton.engine.batching.instances import Instance, InstancePool
from jupyter_triton.engine.batching.rate_limiter import RateLimiter, instance_resources
from jupyter_triton.engine.batching.scheduler import Pending
from jupyter_triton.engine.observation.statistics import ModelStatistics, failure_reason
from jupyter_triton.engine.lifecycle.warmup import warmup_samples
from jupyter_triton.protocol.errors import Internal, InvalidArgument, TritonError, Unavailable
from jupyter_triton.protocol.types import InferRequest
from server_waits import until

BASE = 'name: "m" input [{name: "IN" data_type: TYPE_FP32 dims: [-1]}] '


class Recording(Backend):
    """Doubles its input; records the ids of each batch; sleeps ``seconds(ids)`` to look busy."""

    def __init__(self, config, name, log, seconds=lambda ids: 0.0, drop_one=False, spans=None):
        super().__init__(config, ModelFiles("m", 1, Path("."), Path(".")), InstanceSpec(name))
        self.log, self.seconds, self.drop_one, self.spans = log, seconds, drop_one, spans

    def load(self) -> None:
        pass

    def execute(self, requests, infer_requests=None):
        ids = [int(r["IN"].flat[0]) for r in requests]
        start = time.monotonic()
        self.log.append(ids)
        time.sleep(self.seconds(ids))
        if self.spans is not None:
            self.spans.append((start, time.monotonic()))
        out = [{"OUT": r["IN"] * 2} for r in requests]
        return out[:-1] if self.drop_one else out


def batcher(config_text: str, instances: int = 1, **backend_kw):
    config = text_format.Parse(BASE + config_text, mc.ModelConfig())
    stats = ModelStatistics("m", "1")
    log: list[list[int]] = []
    pool = InstancePool([Instance(Recording(config, f"m_0_{i}", log, **backend_kw))
                         for i in range(instances)], stats)
    return DynamicBatcher(config, pool, stats), log, stats


def pending(rid: int, rows: int = 1, width: int = 2, priority: int = 0, timeout_us: int = 0) -> Pending:
    """A request as the engine hands it over: 'priority' and 'timeout' parameters already read."""
    inputs = {"IN": np.full((rows, width), rid, dtype=np.float32)}
    future = asyncio.get_running_loop().create_future()
    return Pending(InferRequest("m"), inputs, rows, future, priority=priority, timeout_ns=timeout_us * 1000)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def submit_all(b: DynamicBatcher, ps: list[Pending]) -> list:
    for p in ps:
        await b.submit(p)
    return await asyncio.gather(*(p.future for p in ps), return_exceptions=True)


async def occupy(b: DynamicBatcher, log: list, rows: int = 1) -> Pending:
    """Submit request 0 and wait until it runs, so the next requests queue behind it."""
    first = pending(0, rows=rows)
    await b.submit(first)
    for _ in range(500):
        if log:
            break
        await asyncio.sleep(0.002)
    return first


def held_by(gate: threading.Event):
    """Request 0 keeps the instance busy until ``gate`` is set (10 s at most)."""
    def seconds(ids: list[int]) -> float:
        if 0 in ids:
            gate.wait(10)
        return 0.0
    return seconds


def busy_first(seconds: float):
    """Request 0 keeps the instance busy for ``seconds``; the rest run instantly."""
    return lambda ids: seconds if 0 in ids else 0.0


# -- batch formation ---------------------------------------------------------------------

def test_preferred_size_leaves_at_once_without_waiting_for_the_delay():
    async def main():
        # a delay past run()'s 10 s bound: a batch that waited for it is never answered
        b, log, stats = batcher("max_batch_size: 8 dynamic_batching { preferred_batch_size: [4] "
                                "max_queue_delay_microseconds: 60000000 }")
        results = await submit_all(b, [pending(i) for i in range(4)])
        await b.close()
        return log, results, stats.to_json()

    log, results, stats = run(main())
    assert log == [[0, 1, 2, 3]]
    assert [r["OUT"][0, 0] for r in results] == [0, 2, 4, 6]
    assert stats["execution_count"] == 1 and stats["inference_count"] == 4
    assert [s["batch_size"] for s in stats["batch_stats"]] == [4]


def test_lone_request_leaves_after_the_queue_delay():
    async def main():
        b, log, stats = batcher("max_batch_size: 8 dynamic_batching { preferred_batch_size: [4] "
                                "max_queue_delay_microseconds: 60000 }")
        start = time.monotonic()
        await submit_all(b, [pending(7)])
        elapsed = time.monotonic() - start
        await b.close()
        return log, elapsed, stats

    log, elapsed, stats = run(main())
    assert log == [[7]]
    # not before the delay (run()'s bound catches never); the batcher's own queue time says so too
    assert elapsed >= 0.055
    assert stats.queue.count == 1 and stats.queue.ns >= 60_000_000


def test_zero_delay_sends_what_is_queued_when_an_instance_frees_up():
    async def main():
        b, log, _ = batcher("max_batch_size: 8 dynamic_batching { }", seconds=busy_first(0.1))
        await occupy(b, log)
        await submit_all(b, [pending(i) for i in range(1, 4)])
        await b.close()
        return log

    # 0 leaves alone at once; 1..3 queue while the only instance is busy, then go together.
    assert run(main()) == [[0], [1, 2, 3]]


@pytest.mark.parametrize("delay_us, expected", [
    # 1..7 queue while 0 runs (100 ms). Delay not yet passed (it is long beside a busy
    # machine's stalls): the largest preferred size that forms leaves (4), then 2, then the
    # last one once the delay passes.
    (1_000_000, [[0], [1, 2, 3, 4], [5, 6], [7]]),
    # Delay already passed when the instance frees: everything that fits leaves (max 6).
    (30_000, [[0], [1, 2, 3, 4, 5, 6], [7]]),
])
def test_batches_prefer_the_largest_preferred_size_and_never_exceed_max_batch_size(delay_us, expected):
    async def main():
        b, log, _ = batcher("max_batch_size: 6 dynamic_batching { preferred_batch_size: [2, 4] "
                            f"max_queue_delay_microseconds: {delay_us} }}", seconds=busy_first(0.1))
        await occupy(b, log, rows=2)
        await submit_all(b, [pending(i) for i in range(1, 8)])
        await b.close()
        return log

    assert run(main()) == expected


def test_multi_row_requests_count_rows_and_are_never_split():
    async def main():
        b, log, stats = batcher("max_batch_size: 4 dynamic_batching { preferred_batch_size: [4] "
                                "max_queue_delay_microseconds: 40000 }", seconds=busy_first(0.1))
        first = await occupy(b, log)
        rest = await submit_all(b, [pending(1, rows=2), pending(2, rows=2),
                                    pending(3, rows=3), pending(4, rows=1)])
        results = [await first.future] + rest
        await b.close()
        return log, results, stats.to_json()

    log, results, stats = run(main())
    assert log == [[0], [1, 2], [3, 4]]          # 2+2 and 3+1 rows: the preferred 4 each time
    assert [r["OUT"].shape[0] for r in results] == [1, 2, 2, 3, 1]
    assert results[3]["OUT"].tolist() == [[6.0, 6.0]] * 3
    assert stats["inference_count"] == 9
    assert {s["batch_size"]: s["compute_infer"]["count"] for s in stats["batch_stats"]} == {1: 1, 4: 2}


def test_requests_of_different_shapes_are_not_batched_together():
    async def main():
        b, log, _ = batcher("max_batch_size: 8 dynamic_batching { max_queue_delay_microseconds: 20000 }",
                            seconds=busy_first(0.1))
        first = await occupy(b, log)
        ps = [pending(1, width=2), pending(2, width=2), pending(3, width=3), pending(4, width=2)]
        rest = await submit_all(b, ps)
        results = [await first.future] + rest
        await b.close()
        return log, results

    log, results = run(main())
    assert log == [[0], [1, 2], [3], [4]]
    assert [r["OUT"].shape for r in results] == [(1, 2), (1, 2), (1, 2), (1, 3), (1, 2)]


# -- queue policy --------------------------------------------------------------------------

def test_full_queue_answers_503_at_once():
    async def main():
        b, log, _ = batcher("max_batch_size: 8 dynamic_batching { preferred_batch_size: [4] "
                            "max_queue_delay_microseconds: 5000000 default_queue_policy { max_queue_size: 2 } }")
        queued = [pending(0), pending(1)]
        for p in queued:
            await b.submit(p)
        with pytest.raises(Unavailable) as refused:
            await b.submit(pending(2))
        await b.close()
        closed = await asyncio.gather(*(p.future for p in queued), return_exceptions=True)
        with pytest.raises(Unavailable):
            await b.submit(pending(3))
        return refused.value, closed, log

    refused, closed, log = run(main())
    assert refused.status == 503 and str(refused).startswith("Exceeds maximum queue size")
    assert failure_reason(refused) == "REJECTED"
    assert all(isinstance(e, Unavailable) for e in closed)   # close() fails what was queued
    assert log == []


def test_without_max_queue_size_a_version_still_queues_at_most_the_default_bound():
    async def main():
        # Triton would queue without end here (no max_queue_size); the default bound refuses.
        gate = threading.Event()          # request 0 holds the only instance until the end
        b, log, _ = batcher("max_batch_size: 1 dynamic_batching { }", seconds=held_by(gate))
        running = await occupy(b, log)
        queued = [pending(i) for i in range(1, DEFAULT_MAX_QUEUE_SIZE + 1)]
        for p in queued:
            await b.submit(p)
        with pytest.raises(Unavailable) as refused:
            await b.submit(pending(DEFAULT_MAX_QUEUE_SIZE + 1))
        gate.set()
        await b.close()
        await asyncio.gather(running.future, *(p.future for p in queued), return_exceptions=True)
        return refused.value

    refused = asyncio.run(asyncio.wait_for(main(), 30))
    assert DEFAULT_MAX_QUEUE_SIZE == 4096
    assert refused.status == 503 and str(refused).startswith("Exceeds maximum queue size")
    assert f"already queues {DEFAULT_MAX_QUEUE_SIZE} requests" in str(refused)
    assert failure_reason(refused) == "REJECTED"


def test_the_default_bound_is_a_parameter_counted_over_every_priority_level():
    async def main():
        gate = threading.Event()
        b, log, _ = batcher('max_batch_size: 1 dynamic_batching { priority_levels: 2 } '
                            'parameters { key: "default_max_queue_size" value: { string_value: "3" } }',
                            seconds=held_by(gate))
        running = await occupy(b, log)
        queued = [pending(1, priority=1), pending(2, priority=2), pending(3, priority=2)]
        for p in queued:
            await b.submit(p)
        with pytest.raises(Unavailable) as refused:
            await b.submit(pending(4, priority=1))
        gate.set()
        unbounded, _, _ = batcher('max_batch_size: 1 dynamic_batching { } parameters { key: '
                                  '"default_max_queue_size" value: { string_value: "0" } }')
        await b.close()
        await asyncio.gather(running.future, *(p.future for p in queued), return_exceptions=True)
        return refused.value, unbounded.default_max_queue_size

    refused, unbounded = run(main())
    assert refused.status == 503 and "already queues 3 requests (default_max_queue_size 3)" in str(refused)
    assert unbounded == 0
    with pytest.raises(InvalidArgument, match="default_max_queue_size"):
        batcher('max_batch_size: 1 dynamic_batching { } parameters { key: '
                '"default_max_queue_size" value: { string_value: "-1" } }')


def test_timeout_reject_fails_the_queued_request_with_503():
    async def main():
        b, log, _ = batcher("max_batch_size: 1 dynamic_batching { default_queue_policy { "
                            "timeout_action: REJECT default_timeout_microseconds: 30000 } }",
                            seconds=busy_first(1.0))
        first = await occupy(b, log)              # 0 is running now; 1 would wait 1 s
        late = pending(1)
        await b.submit(late)
        with pytest.raises(Unavailable) as expired:
            await late.future
        busy = not first.future.done()
        await first.future
        await b.close()
        return expired.value, busy, log

    expired, busy, log = run(main())
    assert "Request timeout expired" in str(expired) and expired.status == 503
    assert failure_reason(expired) == "REJECTED"
    assert busy                                  # rejected while the instance was still busy
    assert log == [[0]]


def test_timeout_delay_moves_expired_requests_behind_the_others():
    config = ("max_batch_size: 1 dynamic_batching { default_queue_policy { timeout_action: DELAY "
              "default_timeout_microseconds: 5000000 allow_timeout_override: true } }")

    async def main(timeout_us: int):
        b, log, _ = batcher(config, seconds=busy_first(0.1))
        await occupy(b, log)
        await submit_all(b, [pending(1, timeout_us=timeout_us), pending(2), pending(3)])
        await b.close()
        return log

    assert run(main(0)) == [[0], [1], [2], [3]]
    assert run(main(20000)) == [[0], [2], [3], [1]]


def test_request_timeout_may_only_lower_the_default_when_override_is_allowed():
    def config(allow: str) -> str:
        return ("max_batch_size: 1 dynamic_batching { default_queue_policy { timeout_action: REJECT "
                f"default_timeout_microseconds: 5000000 allow_timeout_override: {allow} }} }}")

    async def main(allow: str, timeout_us: int):
        b, log, _ = batcher(config(allow), seconds=busy_first(0.1))
        await occupy(b, log)
        results = await submit_all(b, [pending(1, timeout_us=timeout_us)])
        await b.close()
        return results[0]

    assert isinstance(run(main("true", 20000)), Unavailable)       # lowered: expires
    assert isinstance(run(main("false", 20000)), dict)             # override not allowed
    assert isinstance(run(main("true", 50_000_000)), dict)         # cannot raise the default


def test_priority_levels_serve_level_one_first():
    async def main():
        b, log, _ = batcher("max_batch_size: 1 dynamic_batching { priority_levels: 2 "
                            "default_priority_level: 2 }", seconds=busy_first(0.1))
        await occupy(b, log)
        # 0 and 3 (above the levels) both mean the default level, 2 (Triton)
        await submit_all(b, [pending(1, priority=2), pending(2), pending(3, priority=1),
                             pending(4, priority=3)])
        with pytest.raises(InvalidArgument, match="priority -1"):
            await b.submit(pending(5, priority=-1))
        await b.close()
        return log

    assert run(main()) == [[0], [3], [1], [2], [4]]


def test_max_queue_size_is_per_priority_level():
    async def main():
        b, _, _ = batcher("max_batch_size: 8 dynamic_batching { priority_levels: 2 default_priority_level: 2 "
                          "max_queue_delay_microseconds: 5000000 preferred_batch_size: [8] "
                          "priority_queue_policy { key: 2 value: { max_queue_size: 1 } } }")
        await b.submit(pending(0))
        await b.submit(pending(1, priority=1))      # level 1 has no limit
        with pytest.raises(Unavailable, match="Exceeds maximum queue size"):
            await b.submit(pending(2))
        await b.close()

    run(main())


def test_preserve_ordering_delivers_responses_in_arrival_order_across_instances():
    async def main(preserve: bool):
        b, _, _ = batcher("max_batch_size: 1 dynamic_batching { preserve_ordering: %s }"
                          % str(preserve).lower(), instances=2, seconds=busy_first(0.5))
        ps = [pending(0), pending(1)]
        finished: list[int] = []
        for i, p in enumerate(ps):
            p.future.add_done_callback(lambda _, i=i: finished.append(i))
        await submit_all(b, ps)
        await b.close()
        return finished

    assert run(main(False)) == [1, 0]           # 1 ran on the other instance and finished first
    assert run(main(True)) == [0, 1]


def test_cancelled_request_leaves_the_queue():
    async def main():
        b, log, _ = batcher("max_batch_size: 8 dynamic_batching { preferred_batch_size: [3] "
                            "max_queue_delay_microseconds: 5000000 }")
        gone, kept = pending(0), pending(1)
        await b.submit(gone)
        await b.submit(kept)
        gone.future.cancel()
        await asyncio.sleep(0)
        queued_after_cancel = b.queued_count()
        await submit_all(b, [pending(2), pending(3)])
        await kept.future
        await b.close()
        return log, queued_after_cancel

    log, queued = run(main())
    assert queued == 1
    assert log == [[1, 2, 3]]


def test_backend_returning_the_wrong_number_of_responses_fails_every_request():
    async def main():
        b, _, stats = batcher("max_batch_size: 8 dynamic_batching { preferred_batch_size: [2] "
                              "max_queue_delay_microseconds: 1000000 }", drop_one=True)
        results = await submit_all(b, [pending(0), pending(1)])
        await b.close()
        return results

    results = run(main())
    assert all(isinstance(r, Internal) for r in results)
    assert "returned 1 responses for 2 requests" in str(results[0])
    assert failure_reason(results[0]) == "BACKEND"


# -- rate limiter --------------------------------------------------------------------------

def test_rate_limiter_keeps_instances_of_two_models_from_overlapping():
    group = text_format.Parse('count: 1 rate_limiter { resources [{ name: "R" global: true count: 1 }] }',
                              mc.ModelInstanceGroup())
    needs = instance_resources(group)

    async def main():
        limiter = RateLimiter()
        spans: list[tuple[float, float]] = []
        batchers = []
        for _ in range(2):
            b, _, _ = batcher("max_batch_size: 1 dynamic_batching { }", seconds=lambda ids: 0.05, spans=spans)
            b.pool.rate_limiter = limiter
            for inst in b.pool.instances:
                inst.resources = needs
                limiter.register(needs, "m")
            batchers.append(b)
        await asyncio.gather(*(submit_all(b, [pending(i)]) for i, b in enumerate(batchers)))
        for b in batchers:
            await b.close()
        return sorted(spans), limiter.in_use()

    (a, b), in_use = run(main())
    assert needs == {"R": 1}
    assert b[0] >= a[1]                          # the second ran only after the first ended
    assert in_use == {}


def test_rate_limiter_refuses_an_instance_that_could_never_run():
    limiter = RateLimiter({"R": 1})
    with pytest.raises(InvalidArgument, match="minimum required count is 2"):
        limiter.register({"R:0": 2}, "m")


# -- warmup ----------------------------------------------------------------------------------

WARMUP = '''name: "w" max_batch_size: 4
input [{ name: "A" data_type: TYPE_FP32 dims: [2] }, { name: "S" data_type: TYPE_STRING dims: [1] },
       { name: "I" data_type: TYPE_INT32 dims: [3] }]
model_warmup [{ name: "s1" batch_size: 2 count: 3 inputs [
  { key: "A" value: { data_type: TYPE_FP32 dims: [2] zero_data: true } },
  { key: "S" value: { data_type: TYPE_STRING dims: [1] random_data: true } },
  { key: "I" value: { data_type: TYPE_INT32 dims: [3] input_data_file: "ints" } } ] }]
'''


def test_warmup_samples_build_each_input_with_a_batch_dimension(tmp_path: Path):
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "ints").write_bytes(np.array([5, 6, 7], dtype=np.int32).tobytes())
    [sample] = warmup_samples(text_format.Parse(WARMUP, mc.ModelConfig()), tmp_path)
    assert (sample.name, sample.batch_size, sample.count) == ("s1", 2, 3)
    assert sample.inputs["A"].shape == (1, 2) and sample.inputs["A"].dtype == np.float32
    assert not sample.inputs["A"].any()
    assert sample.inputs["S"].tolist() == [[b""]]
    assert sample.inputs["I"].tolist() == [[5, 6, 7]]
    assert len(sample.requests()) == 2


def test_warmup_errors_name_the_sample_and_input(tmp_path: Path):
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "ints").write_bytes(b"\0" * 4)
    with pytest.raises(TritonError, match="model_warmup 's1' of model 'w': input 'I' needs 12 bytes"):
        warmup_samples(text_format.Parse(WARMUP, mc.ModelConfig()), tmp_path)
    escaping = WARMUP.replace('"ints"', '"../config.pbtxt"')
    with pytest.raises(InvalidArgument, match="under the model's warmup/ directory"):
        warmup_samples(text_format.Parse(escaping, mc.ModelConfig()), tmp_path)


# -- the queue delay's alarm -------------------------------------------------------------------

@pytest.mark.parametrize("timerfd", [True, False], ids=["timerfd", "loop-timer"])
def test_the_alarm_fires_once_at_its_latest_deadline_and_never_after_cancel(monkeypatch, timerfd):
    if timerfd and timer._LIBC is None:
        pytest.skip("no timerfd on this platform")
    if not timerfd:
        monkeypatch.setattr(timer, "_LIBC", None)      # the fallback other platforms take

    async def main():
        fired: list[int] = []
        alarm = timer.Alarm(lambda: fired.append(time.monotonic_ns()))

        async def fired_count(n: int) -> None:
            await until(lambda: len(fired) >= n, f"the alarm's firing {n}", seconds=10)
        start = time.monotonic_ns()
        alarm.set(start + 3_000_000_000)
        alarm.set(start + 20_000_000)                  # replaces the first deadline
        assert alarm.deadline_ns == start + 20_000_000
        await fired_count(1)
        await asyncio.sleep(0.1)                       # room for a second firing: there is none
        once = list(fired)
        alarm.set(time.monotonic_ns() + 20_000_000)
        alarm.cancel()
        await asyncio.sleep(0.1)                       # five times its delay: it never fires
        cancelled = list(fired)
        past = time.monotonic_ns() - 1                 # a deadline already gone fires at once
        alarm.set(past)
        await fired_count(len(cancelled) + 1)
        alarm.close()
        return start, once, cancelled, fired

    start, once, cancelled, fired = run(main())
    assert len(once) == 1 and once[0] >= start + 20_000_000
    assert once[0] < start + 3_000_000_000            # the replaced deadline did not wait
    assert cancelled == once                           # the cancelled one never fired
    assert len(fired) == 2
