"""The server's event loop spends its CPU a request on decoding what the clients send, so
``measure``'s bursts send what the load the plan is for sends: JSON (tune's loadgen, the
default) or the binary tensor extension (perf_analyzer, tritonclient), ``binary=True``. A
served model answers both the same, the bursts' requests are all answered, and the two
service models are kept apart (each is what that encoding costs the loop)."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import numpy as np
import pytest
import tritonclient.http as httpclient

import jupyter_triton as jt
from jupyter_triton.kernel.client import TritonHTTP
from jupyter_triton.planning import measure
from jupyter_triton.planning.sweep import binary_request, request_body
from test_capacity_planning import kernel_server  # noqa: F401 -- the fixture: a server in this process

pytestmark = pytest.mark.timeout(90)

# 3 ms an execution, as the validation's model: the stalls' fit simulates the burst it saw
DOUBLE_PY = '''
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.003)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2 + 1)]) for r in requests]
'''


def post(conn, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
    parts = urlsplit(conn.url)
    c = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        c.request("POST", parts.path.rstrip("/") + "/v2/models/double/infer", body,
                  {**headers, **conn.headers})
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


def test_the_bursts_send_the_clients_encoding(kernel_server):
    jt.serve(DOUBLE_PY, "double", max_batch_size=8, inputs=[("X", "FP32", [-1, 4])],
             outputs=[("Y", "FP32", [-1, 4])])
    meta = TritonHTTP(kernel_server).metadata("double")

    # the same request both ways, the same answer (rows of zeros: 1 everywhere)
    status, _, raw = post(kernel_server, request_body(meta, 3), {"Content-Type": "application/json"})
    assert status == 200
    [out] = json.loads(raw)["outputs"]
    assert out["shape"] == [3, 4] and out["data"] == [1.0] * 12
    body, headers = binary_request(meta, 3)
    assert int(headers["Inference-Header-Content-Length"]) == len(body) - 3 * 4 * 4
    status, answer_headers, raw = post(kernel_server, body, headers)
    assert status == 200
    result = httpclient.InferResult.from_response_body(
        raw, header_length=int(answer_headers["Inference-Header-Content-Length"]))
    np.testing.assert_array_equal(result.as_numpy("Y"), np.ones((3, 4), np.float32))
    assert "data" not in result.get_output("Y")             # answered binary, as asked

    # each burst's requests all answered (a refused one raises), its loop CPU a request read,
    # and each encoding's service model kept apart
    as_json = measure(kernel_server, "double", repeats=3, burst_s=0.5)
    as_binary = measure(kernel_server, "double", repeats=3, burst_s=0.5, binary=True)
    assert as_binary is not as_json
    assert as_json.loop_ns > 0 and as_binary.loop_ns > 0 and as_binary.burst_qps > 0
    assert measure(kernel_server, "double", binary=True) is as_binary
    assert measure(kernel_server, "double") is as_json
