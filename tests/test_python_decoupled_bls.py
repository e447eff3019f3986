"""A decoupled python model calls other models (BLS) the way a plain one does: from execute,
and (worker process) from a thread of its own after execute has returned. Real server, a gRPC stream of
tritonclient, real worker processes (and thread mode)."""
from __future__ import annotations

import pytest

import numpy as np
import tritonclient.grpc as grpcclient

from test_backend_python import THREAD_MODE
from test_decoupled_examples import Stream, _serve
from test_python_bls import ECHO_CONFIG, ECHO_MODEL_PY
from triton_example_models import add_model

pytestmark = pytest.mark.timeout(180)

# X[0] 0: call "echo" (it doubles X) inside execute; 1: from a thread, after execute has returned
RELAY_PY = '''
import threading
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            sender = request.get_response_sender()
            if x.as_numpy()[0] == 0:
                self.relay(x, sender)
            else:
                t = threading.Thread(target=self.relay, args=(x, sender))
                t.start()
                self.threads.append(t)
        return None

    def relay(self, x, sender):
        called = pb_utils.InferenceRequest(model_name="echo", inputs=[x],
                                           requested_output_names=["Y"]).exec()
        if called.has_error():
            sender.send(pb_utils.InferenceResponse(error=called.error()),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        y = pb_utils.get_output_tensor_by_name(called, "Y")
        sender.send(pb_utils.InferenceResponse([y]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for t in self.threads:
            t.join(5)
'''

RELAY_CONFIG = '''
name: "relay"
backend: "python"
model_transaction_policy { decoupled: true }
input [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]
output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]
'''


# thread mode: BLS works inside execute only (a thread the model starts has no way back)
@pytest.mark.parametrize("mode, xs", [("process", ([0, 5, 6], [1, 7])), ("thread", ([0, 5, 6],))],
                         ids=["process", "thread"])
def test_a_decoupled_model_calls_another_model(tmp_path, mode, xs):
    add_model(tmp_path, "echo", ECHO_MODEL_PY, ECHO_CONFIG)
    add_model(tmp_path, "relay", RELAY_PY, RELAY_CONFIG + (THREAD_MODE if mode == "thread" else ""))
    server = _serve(tmp_path)
    stream = Stream(server.grpc_port)
    try:
        for x in xs:
            tensor = grpcclient.InferInput("X", [len(x)], "FP32")
            tensor.set_data_from_numpy(np.array(x, np.float32))
            stream.client.async_stream_infer("relay", [tensor])
            (result,) = stream.take(1)
            assert result.as_numpy("Y").tolist() == [2 * v for v in x]
    finally:
        stream.close()
        server.close()
