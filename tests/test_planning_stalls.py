"""What the simulation takes from ``measure``'s two bursts (planning/bursts.py, fitting.py) and
how it uses it (engine/batching/simulation.py): stalls that come with the requests, so a lighter load
meets fewer a second; the event loop's CPU split into a part per request and a part per batch;
a stall as long as the least hold it left, scaled until the simulated burst has the burst's own
p99.
No server here: the bursts' figures are given, what is checked is the arithmetic on them."""
from __future__ import annotations

import random

import pytest

from jupyter_triton.config.formats import config_from_json
from jupyter_triton.engine.batching.simulation import Arrival, ClosedLoop, simulate
from jupyter_triton.planning import ServiceModel
from jupyter_triton.planning.bursts import BURST_CLIENTS, Burst, _stalls
from jupyter_triton.planning.capacity import CapacityPlan, Load
from jupyter_triton.planning.fitting import FIT_REQUESTS, _fit_stalls, _split_by_load
from jupyter_triton.planning.rows import summarize
from test_simulation import MS, US, config, fixed

pytestmark = pytest.mark.timeout(90)



def p(result, q: float) -> int:
    lat = sorted(o.end_ns - o.arrival_ns for o in result.requests)
    return lat[int(q * len(lat))]


def test_stalls_a_request_come_as_often_as_requests_do():
    """Drawn a request, a stall meets a light load as often per request as a heavy one: fewer
    a second. Drawn a second of work, the light load meets as many a second, so many more of
    its requests are held: the over-predicted tail at c=4 of a rate measured at c=8."""
    cfg = config("max_batch_size: 8 dynamic_batching { }")
    stall = [15 * MS]

    def held(arrivals, **stalls):
        r = simulate(cfg, fixed(2 * MS), arrivals, loop_ns=100 * US, stall_ns=stall, seed=2, **stalls)
        return sum(o.end_ns - o.arrival_ns > 10 * MS for o in r.requests) / len(r.requests), r

    light = [Arrival(i * 4 * MS) for i in range(3000)]         # 250 requests a second
    heavy = [Arrival(i * MS) for i in range(3000)]             # 1000 a second
    # 10 stalls a second at 1000 requests a second: 1 a hundred requests
    light_chance, r_light = held(light, stall_chance=0.01)
    heavy_chance, _ = held(heavy, stall_chance=0.01)
    light_rate, r_rate = held(light, stall_rate=10.0)
    # a heavier load meets more of them
    assert heavy_chance > 2 * light_chance
    # at a quarter of it, a stall a hundred requests is 2.5 a second, not 10: far fewer held
    assert light_chance < 0.5 * light_rate
    # (how many are held, not how long: overlapping stalls hold the loop once, so the
    # longest holds are alike, one stall and its backlog, either way)
    assert p(r_light, 0.95) < p(r_rate, 0.95)
    # the typical request meets none either way
    assert p(r_light, 0.5) == p(r_rate, 0.5) == 100 * US + 2 * MS
    # a chance with no lengths to draw (``simulate(stalls=False)`` passes none) holds nothing
    r = simulate(cfg, fixed(MS), [ClosedLoop(1, 20)], loop_ns=100 * US, stall_chance=0.5)
    assert {o.end_ns - o.arrival_ns for o in r.requests} == {100 * US + MS}
    with pytest.raises(ValueError):
        simulate(cfg, fixed(MS), [ClosedLoop(1, 1)], stall_ns=[MS], stall_chance=-0.1)


def test_the_loops_work_per_batch_runs_beside_the_execution():
    """A part of the loop's CPU per batch (dispatching it, taking its answers) overlaps the
    execution: alone a request never waits for it; at c=16 a batch of 16 shares it, so the
    loop bounds throughput far above one request per (request + batch) part."""
    cfg = config("max_batch_size: 16 dynamic_batching { max_queue_delay_microseconds: 4000 }")
    alone = simulate(cfg, fixed(4 * MS), [ClosedLoop(1, 10)], loop_ns=150 * US, loop_batch_ns=450 * US)
    assert {o.end_ns - o.arrival_ns for o in alone.requests} == {4 * MS + 150 * US + 4 * MS}
    per_batch = simulate(cfg, fixed(2 * MS), [ClosedLoop(16, 1600)], loop_ns=150 * US, loop_batch_ns=450 * US)
    all_per_request = simulate(cfg, fixed(2 * MS), [ClosedLoop(16, 1600)], loop_ns=600 * US)
    thr = lambda r: len(r.requests) / r.duration_ns * 1e9     # noqa: E731
    assert thr(per_batch) > 1.5 * thr(all_per_request)
    # a batch of 16 a cycle: its execution, then its 16 answers and the 16 requests back in
    # turn (150 us each); the 450 us of the batch spent while it executes
    assert {rows for _, rows, _ in per_batch.batches} == {16}
    assert thr(per_batch) == pytest.approx(16 / (16 * 150e-6 + 2e-3), rel=0.01)


def burst(loop_us: float, rows: float, stall_rate: float, qps: float, stalls=(6 * MS,)) -> Burst:
    return Burst(cycle_ns=4 * MS, rows=rows, compute_ns=4 * MS, loop_ns=int(loop_us * US),
                 stall_ns=list(stalls), stall_rate=stall_rate, stall_chance=stall_rate / qps, qps=qps,
                 p99_ns=20 * MS, requests=int(qps * 3))


def test_two_loads_split_the_loops_cpu_and_the_stalls():
    """150 us a request and 450 us a batch: alone (a batch a request) 600 us, at a mean batch of
    4 262.5 us. Stalls: 1 a second whatever the load and 1 a hundred requests: 3.2 a second at
    220 requests a second, 8 at 700."""
    service = ServiceModel("m", "1", {1: [4 * MS]})
    busy = burst(150 + 450 / 4, 4.0, 1 + 0.01 * 700, 700.0, stalls=(8 * MS, 12 * MS))
    alone = burst(600, 1.0, 1 + 0.01 * 220, 220.0, stalls=(7 * MS,))
    _split_by_load(service, busy, alone)
    assert service.loop_ns == pytest.approx(150 * US, abs=2 * US)
    assert service.loop_batch_ns == pytest.approx(450 * US, abs=2 * US)
    assert service.stall_chance == pytest.approx(0.01)
    assert service.stall_rate == pytest.approx(1.0)
    assert service.stall_ns == [7 * MS, 8 * MS, 12 * MS]
    # noise that would make a part negative leaves it at 0: no negative CPU, no negative rate
    odd = ServiceModel("m", "1", {1: [4 * MS]})
    _split_by_load(odd, burst(300, 4.0, 10.0, 700.0), burst(250, 1.0, 12.0, 220.0))
    assert odd.loop_batch_ns == 0 and odd.loop_ns == 300 * US
    assert odd.stall_chance == 0 and odd.stall_rate == pytest.approx(10.0)


def test_a_stall_is_as_long_as_the_least_hold_it_left():
    """Eight clients held by one stall are answered one after the other as the backlog
    drains: the first answered was held about the stall, the last the stall and the backlog."""
    rng = random.Random(1)
    sent = [(i * 2 * MS, 10 * MS + rng.randrange(0, 500 * US)) for i in range(400)]
    # a stall of 20 ms at 400 ms: the 8 requests in flight answered 20 to 34 ms late, 2 ms apart
    sent += [(400 * MS + k * 100 * US, 10 * MS + 20 * MS + k * 2 * MS) for k in range(8)]
    [stall] = _stalls(sent, 4 * MS)
    # (beyond the median latency, which the random half millisecond moves)
    assert stall == pytest.approx(20 * MS, abs=500 * US)


def test_the_stalls_are_scaled_until_the_simulated_burst_has_the_bursts_p99():
    base = {"name": "m", "backend": "python", "max_batch_size": 16,
            "dynamic_batching": {"max_queue_delay_microseconds": 0},
            "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
            "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}]}

    def service() -> ServiceModel:
        return ServiceModel("m", "1", {b: [int((3 + 0.25 * b) * MS)] * 5 for b in (1, 4, 16)},
                         overhead_ns=300 * US, loop_ns=150 * US, stall_ns=[4 * MS, 6 * MS, 8 * MS],
                         stall_chance=0.01)

    def simulated_p99(s: ServiceModel) -> float:
        plan = CapacityPlan("m", base, s, [Load("concurrency", float(BURST_CLIENTS))], [(16, 0, 1)],
                            requests=FIT_REQUESTS)
        return plan.results[0]["p99_ms"] * MS

    for target_ms in (15, 25):
        s = service()
        _fit_stalls(s, base, Burst(4 * MS, 4.0, 4 * MS, 0, list(s.stall_ns), 7.0, 0.01, 700.0,
                                   target_ms * MS, 2100))
        assert 0 < s.stall_scale < 4
        assert s.stall_ns == [max(1, int(v * s.stall_scale)) for v in (4 * MS, 6 * MS, 8 * MS)]
        assert simulated_p99(s) == pytest.approx(target_ms * MS, rel=0.15)
    # a tail shorter than the simulation gives without stalls: no stall at all
    s = service()
    _fit_stalls(s, base, Burst(4 * MS, 4.0, 4 * MS, 0, list(s.stall_ns), 7.0, 0.01, 700.0, MS, 2100))
    assert s.stall_scale == 0


def test_a_stall_in_the_sweep_is_not_a_requests_own_delay():
    """One c=1 round trip held 170 ms among 24: a stall (the bursts draw those), not a delay
    that 1 request in 24 spends on its own path; the ordinary spread is kept."""
    samples = [800 * US + k * 20 * US for k in range(23)] + [170 * MS]
    service = ServiceModel("m", "1", {1: [4 * MS] * 5}, overhead_ns=1 * MS, overhead_samples=samples)
    jitter = service.jitter_ns()
    assert len(jitter) == 23 and max(jitter) < MS and min(jitter) < 0


def test_a_stall_in_the_sweep_is_not_an_executions_spread():
    """An execution of a batch of 4 held 118 ms among 24 (3.7 to 5.8 ms): the machine held the
    worker; drawn as the executions' spread, 1 batch in 24 would take 25 times its median."""
    samples = {1: [3_750_000, 3_800_000, 3_820_000, 3_840_000, 3_850_000, 3_920_000],
               4: [4_550_000, 4_580_000, 4_590_000, 4_590_000, 4_660_000, 118_400_000]}
    service = ServiceModel("m", "1", samples, overhead_ns=960 * US)
    draws = [service(4, random.Random(i)) for i in range(400)]
    assert max(draws) < 6 * MS
    assert service.samples[4][-1] == 118_400_000        # kept: the table and plot show it


def test_stalls_a_request_stop_growing_past_the_bursts_request_rate():
    """The stalls a request were measured between one client and the saturating burst (here
    500 requests a second). A load served faster (larger batches: less CPU a request) meets
    them at most as often a second as the burst did; a load below it as measured."""
    base = {"name": "m", "backend": "python", "max_batch_size": 16,
            "dynamic_batching": {"max_queue_delay_microseconds": 0},
            "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
            "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}]}
    service = ServiceModel("m", "1", {b: [int((3 + 0.25 * b) * MS)] * 5 for b in (1, 4, 16)},
                           overhead_ns=300 * US, loop_ns=100 * US, stall_ns=[10 * MS],
                           stall_chance=0.01, burst_qps=500.0)
    plan = CapacityPlan("m", base, service, [Load("concurrency", 2.0), Load("concurrency", 32.0)],
                        [(16, 0, 1)], requests=6000)
    slow, fast = plan.results
    assert slow["throughput"] < 500 < fast["throughput"]

    def uncapped(concurrency: int) -> dict:
        r = simulate(config_from_json(plan.config(16, 0, 1), "m"), service,
                     [ClosedLoop(concurrency, 6000)], overhead_ns=plan.overhead_ns,
                     jitter_ns=service.jitter_ns(), loop_ns=100 * US, stall_ns=[10 * MS],
                     stall_chance=0.01,
                     stagger_ns=plan.overhead_ns + 100 * US + int(service.median_ns(1)))
        return summarize(r)
    assert uncapped(2)["p99_ms"] == slow["p99_ms"]
    raw = uncapped(32)
    assert fast["p99_ms"] < raw["p99_ms"] and fast["throughput"] > raw["throughput"]


def test_overlapping_stalls_hold_the_loop_once():
    """Stalls a second are the machine's cores taken from the server: two that overlap hold
    its loop for their union, not their sum. Summed, 400 stalls of 5 ms a second (two seconds
    of hold a second) put the loop's next free moment ever further ahead and the run never
    ended; as a union the loop works in the gaps, about e^-2 of the time."""
    cfg = config("max_batch_size: 8 dynamic_batching { }")
    r = simulate(cfg, fixed(MS), [ClosedLoop(4, 400)], loop_ns=100 * US, stall_ns=[5 * MS],
                 stall_rate=400.0, seed=1)
    assert len(r.requests) == 400 and all(o.status == "ok" for o in r.requests)
    # each request waits out the holds around it: several stalls long, never the sum of the
    # run's stalls (about 2 s of them a second of the run)
    span = max(o.end_ns for o in r.requests) - min(o.arrival_ns for o in r.requests)
    assert p(r, 0.5) > 5 * MS and p(r, 0.99) < span / 10
