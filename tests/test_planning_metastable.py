"""A config with two lasting states, shown as such (issue 21): four closed-loop clients, batches
of up to 4, a queue delay (1 ms) shorter than an execution (4 ms). Merged, the four come back
together and leave as one batch; split into two groups, each group's requests arrive while the
other's batch runs and leave alone when it ends (a mean batch of 2). A client's return drawn
late parts the merged four, a stall of the server's loop bunches the groups again; which state
a run stays in, and for how long, is chance. ``simulate`` runs each row as replicas sharing its
requests and marks the row metastable, with the replicas' range, where they disagree."""
from __future__ import annotations

import pytest

from jupyter_triton.planning.capacity import CapacityPlan, Load
from jupyter_triton.planning.rows import describe_range, replica_range
from jupyter_triton.planning.service import ServiceModel

pytestmark = pytest.mark.timeout(60)

US, MS = 1_000, 1_000_000
CONFIG = {"name": "m", "backend": "python", "max_batch_size": 4, "dynamic_batching": {},
          "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
          "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}]}


def plan(delays: list[int], loads: list[Load]) -> CapacityPlan:
    # 4 ms an execution at any size; a client's path outside the server 300 us, one in 51
    # 1.5 ms later; the loop 100 us a request; a 10 ms stall every two seconds of work
    service = ServiceModel("m", "1", {b: [4 * MS] * 5 for b in (1, 2, 4)}, overhead_ns=300 * US,
                           overhead_samples=[300 * US] * 50 + [1800 * US], loop_ns=100 * US,
                           stall_ns=[10 * MS], stall_rate=0.5)
    return CapacityPlan("m", CONFIG, service, loads, [(4, d, 1) for d in delays], requests=6000, replicas=6)


def test_the_replicas_see_both_states_and_the_row_says_so():
    p = plan([1000], [Load("concurrency", 4.0)])
    [row] = p.results
    assert len(row["replicas"]) == 6 and row["requests"] == 6000      # the requests shared, not multiplied
    low, high = replica_range(row, "mean_batch")
    assert low <= 2.05 and high >= 2.8, row["replicas"]               # split in some, merged in others
    assert low < row["mean_batch"] < high
    slow, fast = replica_range(row, "throughput")
    assert fast > 1.25 * slow
    assert row["metastable"]
    words = describe_range(row)
    assert f"batches of {low:.2f} to {high:.2f}" in words
    assert words in repr(p) and "metastable: replicas form" in p.table_html()
    assert "metastable" in p.best().why                              # the answer carries it
    assert p.plot_png().startswith(b"\x89PNG")


def test_a_stable_config_is_not_flagged():
    # no delay: always two groups of two; a delay as long as an execution: always four
    p = plan([0, 4000], [Load("concurrency", 4.0), Load("qps", 300.0)])
    rows = {(r["max_queue_delay_us"], r["load"]): r for r in p.results}
    assert replica_range(rows[(0, "c=4")], "mean_batch") == pytest.approx((2.0, 2.0), abs=0.02)
    assert replica_range(rows[(4000, "c=4")], "mean_batch") == pytest.approx((4.0, 4.0), abs=0.02)
    assert not any(r["metastable"] for r in p.results), [describe_range(r) for r in p.results]
    assert all(describe_range(r) == "" for r in p.results)


def test_clients_started_together_stay_together_in_one_replica():
    """Nothing here parts or bunches the groups (no late return, no stall): each state lasts
    from the start. Spread over a round trip, four clients split into two groups; started
    together (a row's first replica: perf_analyzer's clients often do), they stay one batch.
    The row shows both."""
    service = ServiceModel("m", "1", {b: [4 * MS] * 5 for b in (1, 2, 4)}, overhead_ns=300 * US,
                           overhead_samples=[300 * US] * 51, loop_ns=100 * US)
    p = CapacityPlan("m", CONFIG, service, [Load("concurrency", 4.0)], [(4, 1000, 1)], requests=4000, replicas=4)
    [row] = p.results
    batches = [r["mean_batch"] for r in row["replicas"]]
    assert batches[0] == pytest.approx(4.0, abs=0.02), batches
    assert batches[1:] == pytest.approx([2.0] * 3, abs=0.02), batches
    assert row["metastable"]
