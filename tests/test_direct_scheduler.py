"""Models without dynamic_batching (the direct scheduler), through a real server: their
queue is bounded like the dynamic batcher's (``default_max_queue_size``), and a request
queued behind a hung execute is answered when unload gives up on it, not never."""
from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread
from python_models import executions, request, sleepy_model
from server_waits import served_model, started, wait_for_queued, wait_for_start
from test_batching_http import Call, ids_in_execution_order, model_stats, run_calls

BOUND_2 = 'parameters { key: "default_max_queue_size" value: { string_value: "2" } }'


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("direct") / "models"
    sleepy_model(root, "direct_bounded", sleep_s=0.8, max_batch_size=1, extra=BOUND_2)
    sleepy_model(root, "direct_hung", sleep_s=8.0, max_batch_size=1)
    sleepy_model(root, "direct_one", sleep_s=1.0, max_batch_size=1,
                 extra='parameters { key: "default_max_queue_size" value: { string_value: "1" } }')
    sleepy_model(root, "direct_negative", max_batch_size=1,
                 extra='parameters { key: "default_max_queue_size" value: { string_value: "-1" } }')
    return root


@pytest.fixture(scope="module")
def server(repo):
    server = start_in_thread(EngineOptions(model_repository=repo, model_control_mode="explicit",
                                           load_models=["direct_bounded", "direct_hung", "direct_one"],
                                           unload_timeout_secs=0.3),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None)
    yield server
    server.close()


@pytest.fixture
def client(server):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=30)
    yield c
    c.close()


def test_a_full_direct_queue_answers_503_at_once(server, client, repo):
    # one runs (2.8 s: long beside a busy machine's stalls), two wait (the bound is 2), the
    # fourth finds the queue full
    calls = [Call(1, extra_sleep_s=2.0), Call(2, at=0.2), Call(3, at=0.3), Call(4, at=0.45)]
    first, second, third, refused = run_calls(server, "direct_bounded", calls)
    assert refused.error is not None and refused.error.status() == "503"
    assert "Exceeds maximum queue size" in refused.error.message()
    assert "default_max_queue_size 2" in refused.error.message()
    assert all(o.error is None for o in (first, second, third))
    assert ids_in_execution_order(repo / "direct_bounded") == [1, 2, 3]   # arrival order
    failed = model_stats(client, "direct_bounded")["inference_stats"]["fail"]
    # at once: the server did not hold it until the running one left (2.3 s after it came)
    assert failed["count"] == 1 and failed["ns"] < 1e9, failed
    # the queue drained: the bound counts waiting requests, not past ones
    assert client.infer("direct_bounded", request(5)).as_numpy("OUTPUT0")[0, 0] == 5


def test_a_negative_bound_fails_the_load(client):
    with pytest.raises(InferenceServerException) as err:
        client.load_model("direct_negative")
    assert err.value.status() == "400"
    assert "'default_max_queue_size' must be 0 (unbounded) or more, got -1" in err.value.message()


def test_a_request_queued_behind_a_hung_execute_is_answered_by_unload(server, client):
    # the first holds the only instance for 8 s; the second waits for it. Unload gives
    # requests 0.3 s: both must be answered then, the waiting one too.
    calls = [Call(1), Call(2, at=0.2)]
    unloaded: list[float] = []
    hung = served_model(server.engine, "direct_hung")

    def unload_soon():
        # once the second waits behind the first (on a busy machine it may come late: an
        # unload before it would answer it 404, no model, rather than what is tested here)
        wait_for_queued(hung, 1)
        c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=30)
        unloaded.append(time.monotonic())
        c.unload_model("direct_hung")
        unloaded.append(time.monotonic())
        c.close()

    t = threading.Thread(target=unload_soon)
    t.start()
    try:
        running, waiting = run_calls(server, "direct_hung", calls)
        answered = time.monotonic()
    finally:
        t.join(timeout=30)
    for outcome in (running, waiting):
        assert outcome.error is not None and outcome.error.status() == "503", outcome
    assert "unloaded" in waiting.error.message()
    assert len(unloaded) == 2, "the unload did not return"
    asked, returned = unloaded
    # both answered once unload gave up (0.3 s): not at the end of the 8 s execute, not never
    assert answered - asked < 5, answered - asked
    assert returned - asked < 10              # bounded, whatever the stuck thread does


def test_a_client_that_hangs_up_while_queued_frees_its_place(server, client, repo):
    # 'direct_one' queues one request. 1 runs (1 s); 2 waits, then its client hangs up; 3,
    # sent after, takes the freed place instead of finding the queue full, and 2 never runs.
    def post(ident: float) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        conn.request("POST", "/v2/models/direct_one/infer", body=json.dumps(
            {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [ident, 0.0]}]}))
        return conn

    before = started(client, "direct_one")
    first = post(1)
    wait_for_start(client, "direct_one", before)
    gone = post(2)
    wait_for_queued(served_model(server.engine, "direct_one"), 1)
    gone.close()
    deadline = time.monotonic() + 10
    while model_stats(client, "direct_one")["inference_stats"]["fail"]["count"] == 0:
        assert time.monotonic() < deadline, "the hang-up was never noticed"
        time.sleep(0.05)
    third = post(3)
    assert first.getresponse().status == 200
    resp = third.getresponse()
    assert resp.status == 200, resp.read()
    first.close()
    third.close()
    assert [i for e in executions(repo / "direct_one") for ids in e["ids"] for i in ids] == [1, 3]
