"""Dynamic batching, queue policies, priorities, instance groups and warmup, seen from
outside: concurrent tritonclient HTTP calls against a standalone server, and what the model
(which logs every execution) and GET v2/models/<m>/stats say happened.

A test orders its calls by what the server shows (a request started, so many queued), and
keeps an instance busy by holding its request (``python_models.held``) rather than by a sleep
a busy machine can outlast. Where the behaviour is a timing (the queue delay, a queue
timeout), the server's own figures (queue and failure time in the statistics) say so, as
lower bounds or with margins of seconds: a busy machine's stalls only lengthen them.
"""
from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread
from python_models import (Caller, executions, held, ids_in_execution_order, model_stats, outcome,
                           request, sleepy_model)
from server_waits import wait_until

pytestmark = pytest.mark.timeout(120)

WARMUP = '''
model_warmup [
  { name: "single" batch_size: 1 count: 3
    inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } },
  { name: "pair" batch_size: 2
    inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } }
]
'''

MODELS = {
    # name: (sleep_s, max_batch_size, instances, extra config); a test that needs an instance
    # busy holds its request (python_models.held) instead of sleeping
    "pref4": (0.0, 8, 1, "dynamic_batching { preferred_batch_size: [ 4 ] "
                         "max_queue_delay_microseconds: 20000000 }"),
    "delayed": (0.0, 8, 1, "dynamic_batching { preferred_batch_size: [ 4 ] "
                           "max_queue_delay_microseconds: 600000 }"),
    "bounded": (0.0, 1, 1, "dynamic_batching { default_queue_policy { max_queue_size: 2 } }"),
    "bounded_default": (0.0, 1, 1, 'dynamic_batching { } parameters { key: "default_max_queue_size" '
                                   'value: { string_value: "2" } }'),
    "precise": (0.0, 8, 1, "dynamic_batching { max_queue_delay_microseconds: 500 }"),
    "reject": (0.0, 1, 1, "dynamic_batching { default_queue_policy { timeout_action: REJECT "
                          "default_timeout_microseconds: 200000 } }"),
    "delay": (0.0, 1, 1, "dynamic_batching { default_queue_policy { timeout_action: DELAY "
                         "default_timeout_microseconds: 5000000 allow_timeout_override: true } }"),
    "priority": (0.0, 1, 1, "dynamic_batching { priority_levels: 2 default_priority_level: 2 }"),
    "parallel": (0.0, 1, 2, ""),
    "ordered": (0.0, 1, 2, "dynamic_batching { preserve_ordering: true }"),
    "unordered": (0.0, 1, 2, "dynamic_batching { }"),
    "warm": (0.0, 8, 1, WARMUP),
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("batching") / "models"
    for name, (sleep_s, mbs, instances, extra) in MODELS.items():
        sleepy_model(root, name, sleep_s=sleep_s, max_batch_size=mbs, instances=instances, extra=extra)
    return root


@pytest.fixture(scope="module")
def server(repo):
    # "warm" is loaded by its test, to watch warmup happen during a load.
    server = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                           load_models=[m for m in MODELS if m != "warm"]),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None)
    yield server
    server.close()


@pytest.fixture
def client(server):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=30)
    yield c
    c.close()


@pytest.fixture
def caller(server, client):
    callers = []

    def make(model: str) -> Caller:
        callers.append(Caller(server, client, model))
        return callers[-1]
    yield make
    for c in callers:
        c.close()


def test_four_concurrent_requests_run_as_one_preferred_batch(client, repo, caller):
    pref4 = caller("pref4")
    outcomes = [outcome(f) for f in [pref4.send(i) for i in range(1, 5)]]
    for i, o in enumerate(outcomes, start=1):
        assert o.error is None
        np.testing.assert_array_equal(o.output, [[i, 0.0]])      # each got its own row back
    stats = model_stats(client, "pref4")
    # The preferred size was reached: the batch left without waiting for the 20 s delay (the
    # first request alone would have queued that long).
    assert stats["inference_stats"]["queue"]["ns"] < 20e9
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [(4, 1)]
    assert stats["execution_count"] == 1 and stats["inference_count"] == 4
    assert stats["inference_stats"]["success"]["count"] == 4
    [execution] = executions(repo / "pref4")
    assert sorted(i for ids in execution["ids"] for i in ids) == [1, 2, 3, 4]


def test_a_lone_request_leaves_after_the_queue_delay(client, caller):
    o = outcome(caller("delayed").send(7))
    assert o.error is None
    assert o.elapsed >= 0.55                # max_queue_delay_microseconds is 600000
    stats = model_stats(client, "delayed")
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [(1, 1)]
    # the wait shows as queue time: the delay, not ten of them
    assert 0.55e9 <= stats["inference_stats"]["queue"]["ns"] < 6e9


def test_a_lone_request_waits_the_configured_delay_not_a_millisecond_more(server, client):
    # One request at a time (c=1): each one's queue time, from the server's own statistics,
    # is the 500 us delay plus the loop's wake-up. asyncio's timers (epoll, whole ms) made it
    # at least 1 ms every time. A window's median keeps stray stalls out; a loaded machine
    # may stall a whole window, so up to five are tried: the old timers fail every one.
    delay_ns = 500_000
    medians = []
    before = model_stats(client, "precise")["inference_stats"]["queue"]
    for _window in range(5):
        queue_ns = []
        for i in range(40):
            client.infer("precise", request(i))
            after = model_stats(client, "precise")["inference_stats"]["queue"]
            assert after["count"] == before["count"] + 1
            queue_ns.append(after["ns"] - before["ns"])
            before = after
        assert min(queue_ns) >= delay_ns             # a batch never leaves before its delay
        medians.append(sorted(queue_ns)[len(queue_ns) // 2])
        if medians[-1] < delay_ns + 300_000:
            break
    assert min(medians) < delay_ns + 300_000, f"median queue per window (us): {[m // 1000 for m in medians]}"


@pytest.mark.parametrize("model", ["bounded", "bounded_default"])
def test_a_full_queue_answers_503_at_once(client, repo, caller, model):
    # one runs (held), two wait (max_queue_size 2, or the default bound set to 2 where no
    # policy sets one), the fourth finds the queue full
    calls = caller(model)
    with held(repo / model, 1):
        first, second, third = calls.line_up(1, 2, 3)
        # at once: answered while the running one still holds the instance
        refused = outcome(calls.send(4))
        assert not first.done()
    assert refused.error is not None and refused.error.status() == "503"
    assert "Exceeds maximum queue size" in refused.error.message()
    assert all(outcome(f).error is None for f in (first, second, third))
    assert model_stats(client, model)["inference_stats"]["fail"]["count"] == 1


def test_a_request_past_its_queue_timeout_is_rejected(client, repo, caller):
    # the first runs (held); the second's default timeout (0.2 s) passes while it waits
    calls = caller("reject")
    with held(repo / "reject", 1):
        first = calls.send(1)
        calls.running()
        # rejected when its timeout passed, not when the instance came free
        second = outcome(calls.send(2))
        assert not first.done()
    assert outcome(first).error is None
    assert second.error is not None and second.error.status() == "503"
    assert "timeout" in second.error.message().lower()
    # and not before it passed (a busy machine only makes the wait longer)
    assert second.elapsed >= 0.2
    failed = model_stats(client, "reject")["inference_stats"]["fail"]
    assert failed["count"] == 1 and failed["ns"] >= 0.2e9, failed
    assert ids_in_execution_order(repo / "reject") == [1]


def test_a_request_past_its_queue_timeout_is_delayed_behind_the_others(repo, caller):
    # 1 runs (held); 2 asks a 0.1 s timeout, which passes while it waits; 3 arrives later
    # without one. DELAY moves 2 behind 3, and both are still served.
    calls = caller("delay")
    with held(repo / "delay", 1):
        futures = [calls.send(1)]
        calls.running()
        futures.append(calls.send(2, timeout_us=100_000))
        calls.queued(1)
        futures.append(calls.send(3))
        calls.queued(2)
        time.sleep(0.3)            # 2's timeout is the behaviour: it passes while 1 holds on
    assert all(outcome(f).error is None for f in futures)
    assert ids_in_execution_order(repo / "delay") == [1, 3, 2]


def served_in_turn(repo: Path, calls: Caller, priorities: list[int]) -> list[int]:
    """Request 1 occupies the instance (held) while requests 2, 3... with ``priorities`` queue
    in that order; the ids in the order they then ran."""
    with held(repo / calls.model, 1):
        futures = calls.line_up(*range(1, len(priorities) + 2), priorities=[0, *priorities])
    assert all(outcome(f).error is None for f in futures)
    return ids_in_execution_order(repo / calls.model)[-len(futures):]


def test_higher_priority_is_served_first(repo, caller):
    # 2 and 3 wait at the default level 2; 4 arrives last at level 1
    assert served_in_turn(repo, caller("priority"), [0, 0, 1]) == [1, 4, 2, 3]


def test_a_priority_above_the_levels_is_the_default_level(repo, caller):
    # Triton (InferenceRequest::SetPriority): 3 > priority_levels 2 means the default, 2,
    # so 2 stays behind 3 (level 1) and ahead of 4 (level 2, later)
    assert served_in_turn(repo, caller("priority"), [3, 1, 0]) == [1, 3, 2, 4]


def test_two_instances_run_side_by_side(repo, caller):
    calls = caller("parallel")
    with held(repo / "parallel", 1, 2):
        futures = [calls.send(1), calls.send(2)]
        calls.running(2)           # both left the queue while neither could end
    assert all(outcome(f).error is None for f in futures)
    runs = executions(repo / "parallel")
    assert {r["instance"] for r in runs} == {"parallel_0_0", "parallel_0_1"}


@pytest.mark.parametrize("model,in_order", [("ordered", True), ("unordered", False)])
def test_preserve_ordering(repo, caller, model, in_order):
    # 1 runs (held) on one instance; 2 arrives after it and runs at once on the other. Its
    # answer waits for 1's (preserve_ordering) or reaches its caller while 1 still runs.
    calls = caller(model)
    with held(repo / model, 1):
        slow = calls.send(1)
        calls.running()
        fast = calls.send(2)
        wait_until(lambda: 2 in ids_in_execution_order(repo / model), f"{model}: 2 ran")
        if in_order:
            # held back: a second after it ran its caller still waits (unordered, the answer
            # takes milliseconds; a busy machine can only hide a failure here, not make one)
            with pytest.raises(FutureTimeout):
                fast.result(timeout=1.0)
        else:
            outcome(fast)
        assert not slow.done()
    assert outcome(slow).error is None and outcome(fast).error is None
    assert {r["instance"] for r in executions(repo / model)} == {f"{model}_0_0", f"{model}_0_1"}


def test_warmup_runs_before_the_model_is_ready(server, client, repo):
    assert executions(repo / "warm") == []
    client.load_model("warm")
    assert client.is_model_ready("warm")
    # every sample ran before the load returned: "single" 3 times one request, "pair" once
    # as one execution of two requests (Triton's batch_size means requests per execution)
    runs = executions(repo / "warm")
    assert [len(r["ids"]) for r in runs] == [1, 1, 1, 2]
    assert all(ids == [0.0] for r in runs for ids in r["ids"])          # zero_data
    # warmup is not inference: statistics start at zero
    stats = model_stats(client, "warm")
    assert stats["execution_count"] == 0 and stats["inference_count"] == 0
    client.infer("warm", request(5))
    assert len(executions(repo / "warm")) == 5
    assert model_stats(client, "warm")["execution_count"] == 1

