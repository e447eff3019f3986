"""A client that hangs up while its request is queued: the request is dropped from the
batcher's queue (never executed) and counted as CANCELED; the server keeps serving."""
from __future__ import annotations

import http.client
import json

import numpy as np
import pytest

from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread
from python_models import executions, sleepy_model
from server_waits import served_model, wait_for_queued, wait_until


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "models"
    sleepy_model(root, "slow", max_batch_size=8,
                 extra="dynamic_batching { preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 1500000 }")
    s = start_in_thread(EngineOptions(model_repository=root, model_control_mode="none"),
                        host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None)
    s.root = root
    yield s
    s.close()


def body(ident: float) -> bytes:
    return json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32",
                                   "data": [ident, 0.0]}]}).encode()


def stats(server) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    conn.request("GET", "/v2/models/slow/stats")
    data = json.loads(conn.getresponse().read())
    conn.close()
    return data["model_stats"][0]


def test_a_client_that_hangs_up_is_dropped_from_the_queue(server):
    gone = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    gone.request("POST", "/v2/models/slow/infer", body=body(1))
    wait_for_queued(served_model(server.engine, "slow"), 1)    # the batcher waits 1.5 s for 8 rows
    gone.close()
    wait_until(lambda: stats(server)["inference_stats"]["fail"]["count"], "the hang-up counted",
               seconds=10)
    assert stats(server)["inference_stats"]["fail"]["count"] == 1
    # A client that stays gets its answer once the delay passes, in a batch of its own: the
    # one that hung up is no longer queued to join it (nor ran before it).
    stay = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    stay.request("POST", "/v2/models/slow/infer", body=body(2))
    resp = stay.getresponse()
    assert resp.status == 200
    out = json.loads(resp.read())["outputs"][0]["data"]
    np.testing.assert_allclose(out, [2.0, 0.0])
    assert [e["ids"] for e in executions(server.root / "slow")] == [[[2.0]]]
