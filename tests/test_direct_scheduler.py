"""Models without dynamic_batching (the direct scheduler), through a real server: their
queue is bounded like the dynamic batcher's (``default_max_queue_size``), and a request
queued behind a hung execute is answered when unload gives up on it, not never."""
from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread
from python_models import (Caller, executions, held, ids_in_execution_order, model_stats, outcome,
                           request, sleepy_model)
from server_waits import served_model, started, wait_for_queued, wait_for_start, wait_until

BOUND_2 = 'parameters { key: "default_max_queue_size" value: { string_value: "2" } }'


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("direct") / "models"
    # a test that needs an instance busy (or hung) holds its request (python_models.held)
    sleepy_model(root, "direct_bounded", max_batch_size=1, extra=BOUND_2)
    sleepy_model(root, "direct_hung", max_batch_size=1)
    sleepy_model(root, "direct_one", max_batch_size=1,
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
    # one runs (held), two wait (the bound is 2), the fourth finds the queue full
    with Caller(server, client, "direct_bounded") as calls, held(repo / "direct_bounded", 1):
        first, second, third = calls.line_up(1, 2, 3)
        # at once: answered while the running one still holds the instance
        refused = outcome(calls.send(4))
        assert not first.done()
    assert refused.error is not None and refused.error.status() == "503"
    assert "Exceeds maximum queue size" in refused.error.message()
    assert "default_max_queue_size 2" in refused.error.message()
    assert all(outcome(f).error is None for f in (first, second, third))
    assert ids_in_execution_order(repo / "direct_bounded") == [1, 2, 3]   # arrival order
    assert model_stats(client, "direct_bounded")["inference_stats"]["fail"]["count"] == 1
    # the queue drained: the bound counts waiting requests, not past ones
    assert client.infer("direct_bounded", request(5)).as_numpy("OUTPUT0")[0, 0] == 5


def test_a_negative_bound_fails_the_load(client):
    with pytest.raises(InferenceServerException) as err:
        client.load_model("direct_negative")
    assert err.value.status() == "400"
    assert "'default_max_queue_size' must be 0 (unbounded) or more, got -1" in err.value.message()


def test_a_request_queued_behind_a_hung_execute_is_answered_by_unload(server, client, repo):
    # the first hangs in execute (held); the second waits for it. Unload gives requests
    # 0.3 s: both must be answered then, the waiting one too, while the first still hangs.
    with Caller(server, client, "direct_hung") as calls, held(repo / "direct_hung", 1):
        # unloaded once the second waits behind the first (an unload before it would answer
        # it 404, no model, rather than what is tested here)
        running, waiting = calls.line_up(1, 2)
        asked = time.monotonic()
        client.unload_model("direct_hung")
        returned = time.monotonic()
        answers = outcome(running), outcome(waiting)
    for answer in answers:
        assert answer.error is not None and answer.error.status() == "503", answer
    assert "unloaded" in answers[1].error.message()
    assert returned - asked < 10              # bounded, whatever the stuck thread does


def test_a_client_that_hangs_up_while_queued_frees_its_place(server, client, repo):
    # 'direct_one' queues one request. 1 runs (held); 2 waits, then its client hangs up; 3,
    # sent after, takes the freed place instead of finding the queue full, and 2 never runs.
    def post(ident: float) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        conn.request("POST", "/v2/models/direct_one/infer", body=json.dumps(
            {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [ident, 0.0]}]}))
        return conn

    version = served_model(server.engine, "direct_one")
    with held(repo / "direct_one", 1):
        before = started(client, "direct_one")
        first = post(1)
        wait_for_start(client, "direct_one", before)
        gone = post(2)
        wait_for_queued(version, 1)
        gone.close()
        wait_until(lambda: model_stats(client, "direct_one")["inference_stats"]["fail"]["count"],
                   "the hang-up noticed", seconds=10)
        wait_for_queued(version, 0)
        third = post(3)
        wait_for_queued(version, 1)
    assert first.getresponse().status == 200
    resp = third.getresponse()
    assert resp.status == 200, resp.read()
    first.close()
    third.close()
    assert [i for e in executions(repo / "direct_one") for ids in e["ids"] for i in ids] == [1, 3]
