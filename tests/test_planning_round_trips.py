"""The spread a simulated request draws outside the server (planning/service.py): the c=1
burst's round trips, some 1,500, less their median, where the burst kept them; the sweep's
overhead samples otherwise. No server: the burst's latencies are given."""
from __future__ import annotations

import random

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
    """A c=1 burst's latencies: 4 ms, most within 100 us, a long right tail up to 3 ms."""
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
    trips = round_trips()
    with_burst, sweep_only = service(round_trip_ns=trips), service()
    median = trips[len(trips) // 2]
    assert with_burst.jitter_ns() == [t - median for t in trips]       # all within one cycle here
    assert sweep_only.jitter_ns() == [k * 10 * US for k in range(-5, 6)]
    # kept with the model, as the sweep is
    assert ServiceModel.from_json(with_burst.to_json()).round_trip_ns == trips
    assert with_burst.scaled(1.5).round_trip_ns == trips


def test_a_simulated_client_sees_the_bursts_quantiles():
    """Alone (c=1), a request's latency is its execution, the overhead and one drawn sample of
    the spread: the simulated latencies' quantiles are the burst's, shifted by the median."""
    trips = round_trips()
    s = service(round_trip_ns=trips)
    plan = CapacityPlan("m", CONFIG, s, [Load("concurrency", 1.0)], [(4, 0, 1)], requests=20000,
                        replicas=1, short_stalls=False)
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


def test_short_stalls_are_the_round_trips_far_out_tail():
    """Past Tukey's far-out fence (upper quartile + 3 interquartile ranges) and within a cycle:
    a short stall, as likely a request as in the burst, and not a request's own delay."""
    trips = round_trips()
    s = service(round_trip_ns=trips)
    lengths, chance = s.short_stalls()
    excess = s.jitter_ns()
    q1, q3 = quantile(excess, 0.25), quantile(excess, 0.75)
    assert lengths == [v for v in excess if v > q3 + 3 * (q3 - q1)]
    assert 0.02 * len(trips) < len(lengths) < 0.06 * len(trips)          # most of the 5 % drawn long
    assert chance == len(lengths) / len(trips)
    assert sorted(s.jitter_ns(short_stalls=True) + lengths) == excess
    assert service().short_stalls() == ([], 0.0)                         # no burst, none known


def test_short_stalls_add_to_the_tail_not_the_median():
    """Held on the server's loop, a short stall holds the answers in flight together: at c=8
    the tail grows against the same round trips without their far-out tail; the median does not."""
    trips = round_trips()
    fence = ServiceModel._fence(service(round_trip_ns=trips).jitter_ns())
    median = trips[len(trips) // 2]
    plain = [t for t in trips if t - median <= fence]

    def row(round_trip_ns: list[int]) -> dict:
        s = service(round_trip_ns=round_trip_ns, loop_ns=100 * US)
        [r] = CapacityPlan("m", CONFIG, s, [Load("concurrency", 8.0)], [(4, 0, 1)], requests=8000,
                           replicas=1).results
        return r
    with_stalls, without = row(trips), row(plain)
    assert with_stalls["p50_ms"] == pytest.approx(without["p50_ms"], rel=0.03)
    assert with_stalls["p99_ms"] > without["p99_ms"] + 0.3
