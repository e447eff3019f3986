"""The spread a simulated request draws outside the server (planning/service.py): the c=1
burst's round trips, some 1,500, less their median, where the burst kept them; the sweep's
overhead samples otherwise. No server: the burst's latencies are given."""
from __future__ import annotations

import random
import statistics

import pytest

from jupyter_triton.planning.capacity import CapacityPlan, Load
from jupyter_triton.planning.service import ServiceModel

pytestmark = pytest.mark.timeout(60)

US, MS = 1_000, 1_000_000
CONFIG = {"name": "m", "backend": "python", "max_batch_size": 4,
          "dynamic_batching": {"max_queue_delay_microseconds": 0},
          "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
          "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}]}


def round_trips(n: int = 1501, seed: int = 7) -> list[int]:
    """A c=1 burst's latencies: 4 ms, most within 100 us, 5 % of them 600 us later on average."""
    rng = random.Random(seed)
    return sorted(4 * MS + int(rng.gauss(0, 40 * US)) + (int(rng.expovariate(1 / (600 * US)))
                                                          if rng.random() < 0.05 else 0)
                  for _ in range(n))


def service(**kw) -> ServiceModel:
    return ServiceModel("m", "1", {b: [3 * MS] * 5 for b in (1, 2, 4)}, overhead_ns=MS,
                        overhead_samples=[MS + k * 10 * US for k in range(-5, 6)], **kw)


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[int(q * len(values))]


def test_the_spread_is_the_bursts_round_trips_less_their_median():
    """Their body is each request's own spread; their far tail (past the upper quartile plus
    three interquartile ranges) is drawn as holds, which hold every answer due meanwhile."""
    trips = round_trips()
    with_burst, sweep_only = service(round_trip_ns=trips), service()
    median = trips[len(trips) // 2]
    holds, rate = with_burst.holds()
    body = with_burst.jitter_ns()
    assert sorted(body + holds) == [t - median for t in trips]        # all within one cycle here
    assert 30 < len(holds) < 75 and min(holds) > max(body) > 100 * US  # the 5 % held 600 us, mostly
    # as often as makes the burst's share of requests held past the body: share / mean past it
    assert rate == pytest.approx(len(holds) / len(trips) / statistics.fmean(h - max(body) for h in holds) * 1e9,
                                 rel=0.05)
    assert sweep_only.jitter_ns() == [k * 10 * US for k in range(-5, 6)] and sweep_only.holds() == ([], 0.0)
    # kept with the model, as the sweep is
    assert ServiceModel.from_json(with_burst.to_json()).round_trip_ns == trips
    assert with_burst.scaled(1.5).round_trip_ns == trips


def test_a_simulated_client_sees_the_bursts_quantiles():
    """Alone (c=1), a request's latency is its execution, the overhead and one drawn sample of
    the spread: the simulated latencies' quantiles are the burst's, shifted by the median."""
    trips = round_trips()
    s = service(round_trip_ns=trips)
    plan = CapacityPlan("m", CONFIG, s, [Load("concurrency", 1.0)], [(4, 0, 1)], requests=20000,
                        replicas=1)
    [row] = plan.results
    median = trips[len(trips) // 2]
    # (a p99 of 20,000 draws rests on the burst's 15 slowest: within 0.1 ms of theirs)
    for q, figure, within in ((0.5, "p50_ms", 0.02), (0.95, "p95_ms", 0.05), (0.99, "p99_ms", 0.1)):
        expected = (3 * MS + MS + quantile(trips, q) - median) / MS
        assert row[figure] == pytest.approx(expected, abs=within), (q, row)
    # the sweep's eleven samples have no such tail
    [narrow] = CapacityPlan("m", CONFIG, service(), [Load("concurrency", 1.0)], [(4, 0, 1)],
                            requests=6000, replicas=1).results
    assert narrow["p99_ms"] < 4.1 < row["p99_ms"]


def test_a_stall_among_the_round_trips_is_drawn_apart():
    """A round trip held past the median by more than one c=1 cycle (execution and overhead,
    4 ms here) was a stall (the bursts count it as one), not a request's own delay."""
    trips = round_trips() + [40 * MS]
    assert max(service(round_trip_ns=trips).jitter_ns()) < 4 * MS



def test_a_load_meets_more_holds_up_to_the_bursts():
    """Holds come one client's rate at one client's load and ``hold_scale`` times it at the
    saturating burst's, linear between, no further past either; kept with the model."""
    trips = round_trips()                               # a median of 4 ms: 250 requests a second
    s = service(round_trip_ns=trips, burst_qps=750.0, hold_scale=3.0)
    base = service(round_trip_ns=trips).holds()[1]
    alone = 1e9 / statistics.median(trips)
    for qps, factor in ((0.0, 1.0), (alone, 1.0), ((alone + 750) / 2, 2.0), (750.0, 3.0), (3000.0, 3.0)):
        assert s.hold_load(qps) == pytest.approx(factor)
        assert s.holds(qps)[1] == pytest.approx(base * factor)
    assert ServiceModel.from_json(s.to_json()).hold_scale == 3.0 and s.scaled(2.0).hold_scale == 3.0


def test_holds_fitted_to_the_bursts_tail_where_no_stall_gives_it():
    """No stall seen, and the saturating burst's p99 longer than its simulation with one
    client's holds: the holds come as often as gives that p99 at the burst's load (the clients'
    and the server's CPU competing for the cores). A p99 the simulation already gives, or one
    that even the most holds do not give: as one client's."""
    from jupyter_triton.planning.bursts import BURST_CLIENTS, Burst
    from jupyter_triton.planning.fitting import FIT_REQUESTS, _fit_stalls
    trips = round_trips()

    def burst_p99(s: ServiceModel) -> float:
        plan = CapacityPlan("m", CONFIG, s, [Load("concurrency", float(BURST_CLIENTS))], [(4, 0, 1)],
                            requests=FIT_REQUESTS)
        return plan.results[0]["p99_ms"] * MS

    plain = burst_p99(service(round_trip_ns=trips, burst_qps=1000.0))
    target = plain + 1.5 * MS
    s = service(round_trip_ns=trips, burst_qps=1000.0)
    _fit_stalls(s, CONFIG, Burst(4 * MS, 4.0, 4 * MS, 0, [], 0.0, 0.0, 1000.0, int(target), 8000))
    assert 1.5 < s.hold_scale < 8
    assert burst_p99(s) == pytest.approx(target, rel=0.1)
    short = service(round_trip_ns=trips, burst_qps=1000.0)
    _fit_stalls(short, CONFIG, Burst(4 * MS, 4.0, 4 * MS, 0, [], 0.0, 0.0, 1000.0, int(plain - MS), 8000))
    assert short.hold_scale == 1.0
    # a tail no number of these holds gives: not theirs, so as one client met them
    beyond = service(round_trip_ns=trips, burst_qps=1000.0)
    _fit_stalls(beyond, CONFIG, Burst(4 * MS, 4.0, 4 * MS, 0, [], 0.0, 0.0, 1000.0, int(plain + 50 * MS), 8000))
    assert beyond.hold_scale == 1.0
