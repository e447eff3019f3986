"""A python model that keeps a decoupled BLS call's responses past its execute (reading the
last of them later, or never) holds no BLS call open: as in Triton, where a BLS request is
released when its callee sends the final response, not when the model reads it, the call
ends when the callee ends it (and gives back its place among the model's calls in flight,
engine/composition/bls.py). Real server, tritonclient, worker process and thread mode."""
from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import serve
from server_waits import served_model, wait_until
from test_backend_python import THREAD_MODE
from test_python_bls import CALLER_CONFIG
from test_python_decoupled import REPEAT_CONFIG, REPEAT_MODEL_PY
from triton_example_models import add_model

pytestmark = pytest.mark.timeout(180)

# Calls "repeat" (one response per element of IN, then an empty final one) and reads as many
# responses as it sent values; the request and the rest of the responses are kept, and read
# in the next execute: each kept call has its empty final response left.
KEEPER_MODEL_PY = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.kept = []

    def execute(self, requests):
        left = [len(list(responses)) for _, responses in self.kept]
        self.kept = []
        out = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)
            call = pb_utils.InferenceRequest(
                model_name="repeat", requested_output_names=["OUT"],
                inputs=[pb_utils.Tensor("CMD", np.array([b"go"], dtype=np.object_)),
                        pb_utils.Tensor("IN", values)])
            responses = call.exec(decoupled=True)
            got = [pb_utils.get_output_tensor_by_name(next(responses), "OUT").as_numpy().tolist()
                   for _ in values]
            self.kept.append((request, responses))
            summary = {"got": got, "left": left}
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "SUMMARY", np.array([json.dumps(summary).encode()], dtype=np.object_))]))
        return out
'''


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_kept_bls_stream_holds_no_call_open_past_its_final_response(tmp_path, mode):
    add_model(tmp_path, "repeat", REPEAT_MODEL_PY, REPEAT_CONFIG)
    add_model(tmp_path, "caller", KEEPER_MODEL_PY, CALLER_CONFIG + (THREAD_MODE if mode == "thread" else ""))
    server, client = serve(tmp_path, model_control_mode="explicit", load_models=["*"])
    try:
        calls = served_model(server.engine, "caller").pool.instances[0].backend.server_calls
        summaries = []
        for _ in range(3):
            how = httpclient.InferInput("HOW", [1], "BYTES")
            how.set_data_from_numpy(np.array([b"keep"], dtype=np.object_))
            values = httpclient.InferInput("IN", [3], "INT32")
            values.set_data_from_numpy(np.array([4, 5, 6], np.int32))
            summaries.append(json.loads(client.infer("caller", [how, values]).as_numpy("SUMMARY")[0]))
            # the model's execute has returned and holds the call's responses: the call
            # itself ended with the callee's final response
            wait_until(lambda: calls.in_flight == 0, "the kept BLS call ends", 10)
        assert [s["got"] for s in summaries] == [[[4], [5], [6]]] * 3
        # what the model did not read yet stays for it: the empty final response
        assert [s["left"] for s in summaries] == [[], [1], [1]]
    finally:
        client.close()
        server.close()
