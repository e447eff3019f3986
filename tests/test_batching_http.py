"""Dynamic batching, queue policies, priorities, instance groups and warmup, seen from
outside: concurrent tritonclient HTTP calls against a standalone server, and what the model
(which logs every execution) and GET v2/models/<m>/stats say happened.

Where the behaviour is a timing (waited for the delay or not, refused at once or not), the
server's own figures (queue and failure time in the statistics) say so, with margins of
seconds: a busy machine's stalls only lengthen them.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread
from python_models import executions, request, sleepy_model

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
    # name: (sleep_s, max_batch_size, instances, extra config)
    "pref4": (0.0, 8, 1, "dynamic_batching { preferred_batch_size: [ 4 ] "
                         "max_queue_delay_microseconds: 20000000 }"),
    "delayed": (0.0, 8, 1, "dynamic_batching { preferred_batch_size: [ 4 ] "
                           "max_queue_delay_microseconds: 600000 }"),
    "bounded": (0.8, 1, 1, "dynamic_batching { default_queue_policy { max_queue_size: 2 } }"),
    "bounded_default": (0.8, 1, 1, 'dynamic_batching { } parameters { key: "default_max_queue_size" '
                                   'value: { string_value: "2" } }'),
    "precise": (0.0, 8, 1, "dynamic_batching { max_queue_delay_microseconds: 500 }"),
    "reject": (0.6, 1, 1, "dynamic_batching { default_queue_policy { timeout_action: REJECT "
                          "default_timeout_microseconds: 200000 } }"),
    "delay": (0.5, 1, 1, "dynamic_batching { default_queue_policy { timeout_action: DELAY "
                         "default_timeout_microseconds: 5000000 allow_timeout_override: true } }"),
    "priority": (0.4, 1, 1, "dynamic_batching { priority_levels: 2 default_priority_level: 2 }"),
    "parallel": (0.5, 1, 2, ""),
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


@dataclass
class Call:
    """One inference a test makes: sent ``at`` seconds after the common start."""
    ident: float
    at: float = 0.0
    extra_sleep_s: float = 0.0
    priority: int = 0
    timeout_us: int | None = None


@dataclass
class Outcome:
    sent: float           # seconds since the common start
    done: float
    output: np.ndarray | None
    error: InferenceServerException | None

    @property
    def elapsed(self) -> float:
        return self.done - self.sent


def run_calls(server, model: str, calls: list[Call]) -> list[Outcome]:
    """Make ``calls`` concurrently, one thread and one client each; outcomes in call order.

    A call is sent ``at`` seconds after the common start and not before every call with an
    earlier ``at`` reached the model's scheduler: on a busy machine a thread can lose its
    lead of a few hundred milliseconds, and the test would see another arrival order."""
    url = f"127.0.0.1:{server.http_port}"
    barrier = threading.Barrier(len(calls))
    arrivals = threading.Condition()
    arrived = [0]                          # calls that reached the scheduler
    schedulers = [mv.scheduler for mv in server.engine.models() if mv.name == model]
    assert schedulers, f"{model} is not loaded"

    def counted(submit):
        async def submit_and_count(pending):
            try:
                return await submit(pending)
            finally:
                with arrivals:             # queued, running or refused: it is there
                    arrived[0] += 1
                    arrivals.notify_all()
        return submit_and_count

    def one(call: Call) -> Outcome:
        client = httpclient.InferenceServerClient(url, network_timeout=30)
        earlier = sum(c.at < call.at for c in calls)
        try:
            barrier.wait(timeout=30)
            start = time.monotonic()      # every thread leaves the barrier within a few ms
            time.sleep(call.at)
            with arrivals:
                assert arrivals.wait_for(lambda: arrived[0] >= earlier, timeout=10), \
                    "an earlier call never reached the server"
            sent = time.monotonic()
            try:
                result = client.infer(model, request(call.ident, call.extra_sleep_s),
                                      priority=call.priority, timeout=call.timeout_us)
                output, error = result.as_numpy("OUTPUT0"), None
            except InferenceServerException as err:
                output, error = None, err
            return Outcome(sent - start, time.monotonic() - start, output, error)
        finally:
            client.close()

    for scheduler in schedulers:
        scheduler.submit = counted(scheduler.submit)
    try:
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            return list(pool.map(one, calls, timeout=60))
    finally:
        for scheduler in schedulers:
            del scheduler.submit           # the class's own again


def model_stats(client, model: str) -> dict:
    return client.get_inference_statistics(model)["model_stats"][0]


def ids_in_execution_order(model_dir: Path) -> list[int]:
    return [int(i) for e in sorted(executions(model_dir), key=lambda e: e["start"])
            for ids in e["ids"] for i in ids]


def test_four_concurrent_requests_run_as_one_preferred_batch(server, client, repo):
    outcomes = run_calls(server, "pref4", [Call(i) for i in range(1, 5)])
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


def test_a_lone_request_leaves_after_the_queue_delay(server, client):
    [o] = run_calls(server, "delayed", [Call(7)])
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
def test_a_full_queue_answers_503_at_once(server, client, model):
    # one runs (2.8 s: long beside a busy machine's stalls), two wait (max_queue_size 2, or
    # the default bound set to 2 where no policy sets one), the fourth finds the queue full
    calls = [Call(1, extra_sleep_s=2.0), Call(2, at=0.2), Call(3, at=0.2), Call(4, at=0.4)]
    first, second, third, refused = run_calls(server, model, calls)
    assert refused.error is not None and refused.error.status() == "503"
    assert "Exceeds maximum queue size" in refused.error.message()
    assert all(o.error is None for o in (first, second, third))
    failures = model_stats(client, model)["inference_stats"]["fail"]
    assert failures["count"] == 1
    # at once: the server did not hold it until the running one left (2.4 s after it came)
    assert failures["ns"] < 1e9, failures


def test_a_request_past_its_queue_timeout_is_rejected(server, client):
    # the first runs for 3.6 s; the second's default timeout (0.2 s) passes while it waits
    first, second = run_calls(server, "reject", [Call(1, extra_sleep_s=3.0), Call(2, at=0.1)])
    assert first.error is None
    assert second.error is not None and second.error.status() == "503"
    assert "timeout" in second.error.message().lower()
    # rejected when its timeout passed: not before, and not when the instance came free
    assert second.elapsed >= 0.15
    failed = model_stats(client, "reject")["inference_stats"]["fail"]
    assert failed["count"] == 1 and 0.2e9 <= failed["ns"] < 2e9, failed
    assert ids_in_execution_order(server_repo(server) / "reject") == [1]


def test_a_request_past_its_queue_timeout_is_delayed_behind_the_others(server):
    # 1 runs for 0.5 s; 2 asks a 0.1 s timeout, which passes while it waits; 3 arrives later
    # without one. DELAY moves 2 behind 3, and both are still served.
    calls = [Call(1), Call(2, at=0.1, timeout_us=100_000), Call(3, at=0.25)]
    outcomes = run_calls(server, "delay", calls)
    assert all(o.error is None for o in outcomes)
    assert ids_in_execution_order(server_repo(server) / "delay") == [1, 3, 2]


def test_higher_priority_is_served_first(server):
    # 1 occupies the instance; 2 and 3 wait at the default level 2; 4 arrives last at level 1
    calls = [Call(1), Call(2, at=0.1), Call(3, at=0.15), Call(4, at=0.2, priority=1)]
    outcomes = run_calls(server, "priority", calls)
    assert all(o.error is None for o in outcomes)
    assert ids_in_execution_order(server_repo(server) / "priority") == [1, 4, 2, 3]


def test_a_priority_above_the_levels_is_the_default_level(server):
    # Triton (InferenceRequest::SetPriority): 3 > priority_levels 2 means the default, 2,
    # so 2 stays behind 3 (level 1) and ahead of 4 (level 2, later)
    calls = [Call(1), Call(2, at=0.1, priority=3), Call(3, at=0.15, priority=1), Call(4, at=0.2)]
    outcomes = run_calls(server, "priority", calls)
    assert all(o.error is None for o in outcomes)
    assert ids_in_execution_order(server_repo(server) / "priority")[-4:] == [1, 3, 2, 4]


def test_two_instances_run_side_by_side(server, repo):
    outcomes = run_calls(server, "parallel", [Call(1), Call(2)])
    assert all(o.error is None for o in outcomes)
    runs = executions(repo / "parallel")
    assert {r["instance"] for r in runs} == {"parallel_0_0", "parallel_0_1"}
    # each execution sleeps 0.5 s; their own clocks say they overlapped (a client's wall time
    # would also count a busy machine's stalls)
    a, b = runs
    assert a["start"] < b["end"] and b["start"] < a["end"]


@pytest.mark.parametrize("model,in_order", [("ordered", True), ("unordered", False)])
def test_preserve_ordering(server, repo, model, in_order):
    # 1 runs for 1 s on one instance; 2 arrives after it and is done at once on the other.
    # Its client sees it about when 1's (held back until the earlier response left) or about
    # 0.9 s before: half of that apart splits them, whatever a busy machine's client threads add.
    slow, fast = run_calls(server, model, [Call(1, extra_sleep_s=1.0), Call(2, at=0.1)])
    assert slow.error is None and fast.error is None
    assert {r["instance"] for r in executions(repo / model)} == {f"{model}_0_0", f"{model}_0_1"}
    assert (fast.done >= slow.done - 0.5) == in_order, (fast.done, slow.done)


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


def server_repo(server) -> Path:
    return Path(server.engine.options.model_repository)
