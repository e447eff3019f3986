"""The engine's scheduler on a virtual clock (engine/batching/simulation.py): exact answers where the
arithmetic is known (closed loop at c=1, full queues, timeouts, priorities, preferred sizes,
instances, ordering), and agreement with a real server on the mean batch at one load."""
from __future__ import annotations

import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from jupyter_triton.engine import EngineOptions
from jupyter_triton.engine.batching.simulation import Arrival, ClosedLoop, simulate
from jupyter_triton.standalone import start_in_thread
from python_models import request, sleepy_model

pytestmark = pytest.mark.timeout(120)

MS = 1_000_000
US = 1_000


def config(text: str) -> mc.ModelConfig:
    return text_format.Parse(f'name: "m" input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }} ] {text}',
                             mc.ModelConfig())


def fixed(ns: int):
    return lambda rows, rng: ns


def test_c1_closed_loop_latency_is_delay_plus_service_plus_overhead():
    cfg = config("max_batch_size: 8 dynamic_batching { max_queue_delay_microseconds: 500 }")
    r = simulate(cfg, fixed(2 * MS), [ClosedLoop(1, 20)], overhead_ns=300 * US)
    assert [o.status for o in r.requests] == ["ok"] * 20
    assert {o.end_ns - o.arrival_ns for o in r.requests} == {500 * US + 2 * MS + 300 * US}
    assert {o.start_ns - o.arrival_ns for o in r.requests} == {150 * US + 500 * US}
    assert [rows for _, rows, _ in r.batches] == [1] * 20
    # the next request leaves as the previous answer arrives
    assert all(b.arrival_ns == a.end_ns for a, b in zip(r.requests, r.requests[1:]))
    assert r.duration_ns == r.requests[-1].end_ns == 20 * 2800 * US


def test_think_time_delays_the_next_request():
    cfg = config("max_batch_size: 8 dynamic_batching { }")
    r = simulate(cfg, fixed(MS), [ClosedLoop(1, 3, think_ns=5 * MS)])
    assert [o.arrival_ns for o in r.requests] == [0, 6 * MS, 12 * MS]


def test_a_full_queue_rejects():
    cfg = config("max_batch_size: 1 dynamic_batching { default_queue_policy { max_queue_size: 4 } }")
    r = simulate(cfg, fixed(10 * MS), [Arrival(0, cls=str(i)) for i in range(10)])
    statuses = [o.status for o in r.requests]
    # one runs at once, four wait, the rest find the queue full
    assert statuses == ["ok"] * 5 + ["rejected"] * 5
    assert [o.end_ns for o in r.requests[5:]] == [0] * 5
    assert [o.start_ns for o in r.requests[:5]] == [0, 10 * MS, 20 * MS, 30 * MS, 40 * MS]


def test_queue_timeouts_reject_or_delay():
    reject = config("max_batch_size: 1 dynamic_batching { default_queue_policy { timeout_action: REJECT "
                    "default_timeout_microseconds: 15000 } }")
    r = simulate(reject, fixed(10 * MS), [Arrival(0) for _ in range(4)])
    assert [o.status for o in r.requests] == ["ok", "ok", "timeout", "timeout"]
    assert [o.end_ns for o in r.requests[2:]] == [15 * MS, 15 * MS]
    delay = config("max_batch_size: 1 dynamic_batching { default_queue_policy { timeout_action: DELAY "
                   "default_timeout_microseconds: 15000 } }")
    r = simulate(delay, fixed(10 * MS), [Arrival(0) for _ in range(4)])
    assert [o.status for o in r.requests] == ["ok"] * 4


def test_a_priority_class_overtakes_the_bulk():
    cfg = config("max_batch_size: 1 dynamic_batching { priority_levels: 2 default_priority_level: 2 }")
    bulk = [Arrival(0, cls="bulk") for _ in range(20)]
    urgent = [Arrival(15 * MS, priority=1, cls="urgent")]
    r = simulate(cfg, fixed(10 * MS), bulk + urgent)
    (u,) = [o for o in r.requests if o.cls == "urgent"]
    assert u.start_ns == 20 * MS          # right after the batch running when it came
    assert u.end_ns == 30 * MS
    assert max(o.end_ns for o in r.requests) == 21 * 10 * MS


def test_preferred_size_leaves_at_once_and_the_rest_waits_the_delay():
    cfg = config("max_batch_size: 8 dynamic_batching { preferred_batch_size: [ 4 ] "
                 "max_queue_delay_microseconds: 3000 }")
    r = simulate(cfg, fixed(MS), [Arrival(0) for _ in range(6)])
    assert r.batches == [(0, 4, 0), (3 * MS, 2, 0)]


def test_instances_share_the_load_and_preserve_ordering_holds_answers():
    two = "instance_group [ { kind: KIND_CPU count: 2 } ]"
    slow_first = lambda rows, rng: 10 * MS if rows == 1 else MS    # noqa: E731

    unordered = config(f"max_batch_size: 1 dynamic_batching {{ }} {two}")
    r = simulate(unordered, fixed(10 * MS), [Arrival(0) for _ in range(4)])
    assert sorted((s, i) for s, _, i in r.batches) == [(0, 0), (0, 1), (10 * MS, 0), (10 * MS, 1)]
    assert r.duration_ns == 20 * MS

    # the first request (alone, slow) runs beside a quick second one of 2 rows
    traffic = [Arrival(0, rows=1), Arrival(1 * US, rows=2)]
    cfg = config(f"max_batch_size: 2 dynamic_batching {{ }} {two}")
    r = simulate(cfg, slow_first, traffic)
    assert [o.end_ns for o in r.requests] == [10 * MS, 1 * US + MS]
    ordered = config(f"max_batch_size: 2 dynamic_batching {{ preserve_ordering: true }} {two}")
    r = simulate(ordered, slow_first, traffic)
    assert [o.end_ns for o in r.requests] == [10 * MS, 10 * MS]


def test_without_dynamic_batching_each_request_runs_alone():
    cfg = config("max_batch_size: 8 instance_group [ { kind: KIND_CPU count: 2 } ]")
    r = simulate(cfg, fixed(MS), [ClosedLoop(4, 40)])
    assert {rows for _, rows, _ in r.batches} == {1}
    assert len(r.batches) == 40
    assert r.duration_ns == 20 * MS


def test_the_seed_decides_the_draws():
    cfg = config("max_batch_size: 16 dynamic_batching { max_queue_delay_microseconds: 200 }")
    service = lambda rows, rng: int(rng.expovariate(1 / MS)) + rows * 10 * US   # noqa: E731
    a = simulate(cfg, service, [ClosedLoop(8, 500)], seed=1)
    b = simulate(cfg, service, [ClosedLoop(8, 500)], seed=1)
    c = simulate(cfg, service, [ClosedLoop(8, 500)], seed=2)
    assert a.batches == b.batches and a.requests == b.requests
    assert a.batches != c.batches


def test_bad_traffic_is_refused():
    cfg = config("max_batch_size: 1")
    with pytest.raises(ValueError):
        simulate(cfg, fixed(MS), [ClosedLoop(0, 3)])
    with pytest.raises(ValueError):
        simulate(cfg, fixed(MS), [], overhead_ns=-1)
    assert simulate(cfg, fixed(MS), []).requests == []


def test_24_simulations_of_3000_requests_take_seconds():
    cfg = config("max_batch_size: 64 dynamic_batching { max_queue_delay_microseconds: 500 } "
                 "instance_group [ { count: 2 } ]")
    service = lambda rows, rng: 200 * US + rows * 20 * US + int(rng.random() * 50 * US)   # noqa: E731
    t0 = time.process_time()
    results = [simulate(cfg, service, [ClosedLoop(32, 3000)], overhead_ns=300 * US, seed=i)
               for i in range(24)]
    spent = time.process_time() - t0
    assert all(len(r.requests) == 3000 for r in results)
    assert all(o.status == "ok" for r in results for o in r.requests)
    # a regression guard with a wide margin (the aim is under 10 s on a shared 2-core box)
    assert spent < 60, spent


def test_the_real_engine_and_the_simulation_agree_on_the_mean_batch(tmp_path):
    """c=12 closed loop against a model that takes 20 ms a batch whatever its size: the
    batches the server forms (its statistics) and the simulated ones."""
    sleep_s, concurrency, count = 0.02, 12, 120
    extra = "dynamic_batching { max_queue_delay_microseconds: 2000 }"
    sleepy_model(tmp_path, "m", sleep_s=sleep_s, max_batch_size=8, extra=extra)
    server = start_in_thread(EngineOptions(model_repository=tmp_path, model_control_mode="explicit",
                                           load_models=["m"]),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None)
    try:
        url = f"127.0.0.1:{server.http_port}"

        def client(n: int) -> None:
            with httpclient.InferenceServerClient(url, network_timeout=30) as c:
                for i in range(n):
                    c.infer("m", request(float(i)))

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(client, [count // concurrency] * concurrency))
        with httpclient.InferenceServerClient(url) as c:
            stats = c.get_inference_statistics("m")["model_stats"][0]
        measured = stats["inference_count"] / stats["execution_count"]
    finally:
        server.close()
    cfg = config(f"max_batch_size: 8 {extra}")
    # what lies outside the scheduler (client, HTTP, decoding) on a loaded 2-core box
    overhead_ns = 1 * MS
    r = simulate(cfg, lambda rows, rng: int(sleep_s * 1e9), [ClosedLoop(concurrency, count)],
                 overhead_ns=overhead_ns)
    simulated = sum(rows for _, rows, _ in r.batches) / len(r.batches)
    print(f"mean batch: measured {measured:.2f}, simulated {simulated:.2f}")
    assert simulated == pytest.approx(measured, rel=0.25), (simulated, measured)


def test_it_runs_inside_a_running_loop_as_in_a_notebook():
    cfg = config("max_batch_size: 8 dynamic_batching { max_queue_delay_microseconds: 500 }")

    async def cell():
        outer = asyncio.get_running_loop()
        r = simulate(cfg, fixed(MS), [ClosedLoop(1, 3)])
        assert asyncio.get_running_loop() is outer       # the notebook's loop is untouched
        await asyncio.sleep(0)
        return r

    r = asyncio.run(cell())
    assert [o.end_ns - o.arrival_ns for o in r.requests] == [1500 * US] * 3


def test_the_servers_loop_is_taken_in_turn():
    cfg = config("max_batch_size: 64 dynamic_batching { max_queue_delay_microseconds: 500 }")
    # alone, the loop's work only adds to the latency
    r = simulate(cfg, fixed(MS), [ClosedLoop(1, 5)], overhead_ns=200 * US, loop_ns=100 * US)
    assert {o.end_ns - o.arrival_ns for o in r.requests} == {200 * US + 100 * US + 500 * US + MS}
    # at c=32 it spreads the arrivals: batches smaller than 32, throughput at most 1 / loop_ns
    r = simulate(cfg, fixed(10 * US), [ClosedLoop(32, 3200)], loop_ns=100 * US)
    assert r.duration_ns >= 3200 * 100 * US
    mean_batch = sum(rows for _, rows, _ in r.batches) / len(r.batches)
    assert 1 < mean_batch < 16, mean_batch
    free = simulate(cfg, fixed(10 * US), [ClosedLoop(32, 3200)])
    assert sum(rows for _, rows, _ in free.batches) / len(free.batches) > 30


def test_each_request_draws_its_own_delay_outside_the_server():
    cfg = config("max_batch_size: 8 dynamic_batching { }")
    jitter = [-200 * US, 0, 200 * US]
    r = simulate(cfg, fixed(2 * MS), [ClosedLoop(1, 60)], overhead_ns=300 * US, jitter_ns=jitter, seed=3)
    latencies = [o.end_ns - o.arrival_ns for o in r.requests]
    assert set(latencies) == {2 * MS + 100 * US, 2 * MS + 300 * US, 2 * MS + 500 * US}
    again = simulate(cfg, fixed(2 * MS), [ClosedLoop(1, 60)], overhead_ns=300 * US, jitter_ns=jitter, seed=3)
    assert [o.end_ns for o in again.requests] == [o.end_ns for o in r.requests]     # seeded
    # a draw below zero is no delay, not a negative one
    r = simulate(cfg, fixed(MS), [ClosedLoop(1, 20)], overhead_ns=100 * US, jitter_ns=[-500 * US])
    assert {o.end_ns - o.arrival_ns for o in r.requests} == {MS}


def test_closed_loop_clients_start_apart_and_leave_lockstep():
    """Four clients, batches of up to 4 and a long delay: started together with a fixed
    overhead they stay in lockstep (batches of 4); started over one round trip with drawn
    delays outside the server they come apart, as real clients do."""
    cfg = config("max_batch_size: 4 dynamic_batching { max_queue_delay_microseconds: 1000 }")
    service = fixed(4 * MS)
    r = simulate(cfg, service, [ClosedLoop(4, 4)], overhead_ns=500 * US, stagger_ns=5 * MS, seed=1)
    starts = sorted(o.arrival_ns for o in r.requests)
    assert len(set(starts)) == 4 and 0 <= starts[0] and starts[-1] < 5 * MS
    together = simulate(cfg, service, [ClosedLoop(4, 400)], overhead_ns=500 * US)
    assert {rows for _, rows, _ in together.batches} == {4}
    apart = simulate(cfg, service, [ClosedLoop(4, 400)], overhead_ns=500 * US, stagger_ns=5 * MS,
                     jitter_ns=[-300 * US, -100 * US, 100 * US, 300 * US], seed=1)
    assert len({rows for _, rows, _ in apart.batches}) > 1


def test_a_hold_delivers_every_answer_due_in_it_at_its_end():
    """Holds on the clients' side: alone, an answer due inside one waits what is left of it
    (as often as the holds cover the time, half a hold on average); answers due together
    are held together, never one of them alone."""
    cfg = config("max_batch_size: 8 dynamic_batching { }")
    r = simulate(cfg, fixed(2 * MS), [ClosedLoop(1, 4000)], hold_ns=[MS], hold_rate=50.0, seed=2)
    latencies = [o.end_ns - o.arrival_ns for o in r.requests]
    held = [v - 2 * MS for v in latencies if v > 2 * MS]
    assert min(latencies) == 2 * MS and max(latencies) <= 3 * MS
    assert 0.035 < len(held) / len(latencies) < 0.065                 # 50 a second of 1 ms: 5 %
    assert 0.4 * MS < statistics.fmean(held) < 0.6 * MS
    cfg = config("max_batch_size: 4 dynamic_batching { max_queue_delay_microseconds: 4000 }")
    r = simulate(cfg, fixed(3 * MS), [ClosedLoop(4, 4000)], overhead_ns=300 * US, hold_ns=[MS],
                 hold_rate=50.0, seed=2)
    ends: dict[int, set[int]] = {}
    for o in r.requests:
        ends.setdefault(o.start_ns, set()).add(o.end_ns)
    assert len(ends) == 1000 and all(len(e) == 1 for e in ends.values())
    assert sum(o.end_ns - o.start_ns > 3 * MS + 150 * US for o in r.requests) > 100


def test_holds_regroup_closed_loop_clients_split_by_a_short_delay():
    """Four clients, batches of up to 4, a delay shorter than an execution: split in two
    groups, each waits out its delay behind the other's batch and they stay split. A group
    held longer than the execution less the delay comes back as the other's batch ends and
    the other group joins it: the merged state real servers show at times."""
    cfg = config("max_batch_size: 4 dynamic_batching { max_queue_delay_microseconds: 500 }")
    jitter = [-100 * US, -50 * US, 0, 50 * US, 100 * US]

    def mean_batch(rate: float) -> float:
        r = simulate(cfg, fixed(3500 * US), [ClosedLoop(4, 8000)], overhead_ns=300 * US, stagger_ns=4 * MS,
                     jitter_ns=jitter, hold_ns=[3 * MS, 4 * MS], hold_rate=rate, seed=0)
        return sum(rows for _, rows, _ in r.batches) / len(r.batches)

    assert mean_batch(0.0) == 2.0
    assert mean_batch(10.0) > 3.0


def test_stalls_hold_up_every_request_behind_them():
    """A stall of the server's event loop delays every request waiting for it, and the answers
    behind it: the tail a shared machine shows; the typical request does not see one, and a
    server left idle has nothing for a stall to hold."""
    cfg = config("max_batch_size: 8 dynamic_batching { }")
    arrivals = [Arrival(i * MS) for i in range(4000)]
    plain = simulate(cfg, fixed(MS // 2), arrivals, loop_ns=50 * US)
    stalled = simulate(cfg, fixed(MS // 2), arrivals, loop_ns=50 * US, stall_ns=[20 * MS], stall_rate=4.0)

    def p(r, q):
        lat = sorted(o.end_ns - o.arrival_ns for o in r.requests)
        return lat[int(q * len(lat))]
    assert p(stalled, 0.5) == p(plain, 0.5) == 50 * US + MS // 2
    assert p(stalled, 0.99) > p(plain, 0.99) + 5 * MS
    # one stall holds up the ~20 requests that arrive during it, not only the one that met it
    held = sum(o.end_ns - o.arrival_ns > 2 * MS for o in stalled.requests)
    assert held > 5 * sum(o.end_ns - o.arrival_ns > 2 * MS for o in plain.requests) + 40
    # a request every 100 ms keeps the server at work 0.5 % of the time: (almost) no stall
    sparse = [Arrival(i * 100 * MS) for i in range(200)]
    idle = simulate(cfg, fixed(MS // 2), sparse, loop_ns=50 * US, stall_ns=[20 * MS], stall_rate=4.0)
    assert sum(o.end_ns - o.arrival_ns > 2 * MS for o in idle.requests) <= 2
    with pytest.raises(ValueError):
        simulate(cfg, fixed(MS), [ClosedLoop(1, 1)], stall_ns=[MS], stall_rate=-1)
