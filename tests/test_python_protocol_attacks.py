"""A python model runs its own code in its worker process, and that code can write anything on
the worker's socket. What the server reads there is loaded with an allow-list (numpy arrays
and scalars, plain data): a pickle that names any other global is refused, never run in the
server; the worker that sent it is killed and restarted, its request fails, and the next
request is served. Real servers and clients, real worker processes."""
from __future__ import annotations

import os
import pickle
import socket
import struct

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import serve
from jupyter_triton.backends.python.messages import BlsCall, Channel, Metric, ProtocolError, Results
from jupyter_triton.protocol.errors import Unavailable

from test_backend_python import loaded, write_model
from test_python_decoupled import Collector

pytestmark = pytest.mark.timeout(180)

# X[0] picks what execute writes on its own socket before it answers: 0 nothing, 1 a side
# message (Metric) carrying an object that runs code when unpickled, 2 an answer (Results)
# made of one, 3 a frame of a kind nobody sends. The object, unpickled, writes the pid of
# the process that unpickled it next to model.py.
ATTACK_MODEL_PY = '''
import gc, os, pickle, struct, threading
import numpy as np
import triton_python_backend_utils as pb_utils

PROOF = os.path.join(os.path.dirname(__file__), "unpickled_in")


class RunsWhereUnpickled:
    def __reduce__(self):
        return (exec, (f"open({PROOF!r}, 'w').write(str(__import__('os').getpid()))",))


def write_on_the_socket(what):
    kind, fields = {1: (32, (0, "set", (RunsWhereUnpickled(),))),
                    2: (23, ([RunsWhereUnpickled()],)),
                    3: (99, ())}[what]
    chan = next(o for o in gc.get_objects() if type(o).__name__ == "Channel")
    data = pickle.dumps(fields, protocol=5)
    os.write(chan.fd, struct.pack("<IB", len(data) + 1, kind) + data)


class TritonPythonModel:
    def initialize(self, args):
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(
            __import__("json").loads(args["model_config"]))

    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if int(x[0]):
                write_on_the_socket(int(x[0]))
            response = pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", x), pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))])
            if self.decoupled:
                sender = request.get_response_sender()
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                out.append(response)
        return None if self.decoupled else out
'''

ATTACK_CONFIG = '''
name: "attack"
backend: "python"
input [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]
output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] },
        { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] }]
'''

DECOUPLED = "model_transaction_policy { decoupled: true }\n"

ATTACKS = {1: "a side message", 2: "an answer", 3: "an unknown kind"}


def infer(client: httpclient.InferenceServerClient, x: list[float]) -> tuple[list[float], int]:
    tensor = httpclient.InferInput("X", [len(x)], "FP32")
    tensor.set_data_from_numpy(np.array(x, np.float32))
    result = client.infer("attack", [tensor])
    return result.as_numpy("Y").tolist(), int(result.as_numpy("PID")[0])


@pytest.mark.parametrize("attack", list(ATTACKS), ids=list(ATTACKS.values()))
def test_a_worker_that_sends_another_class_fails_its_request_and_the_server_serves_on(tmp_path, attack):
    repo = tmp_path / "models"
    write_model(repo, "attack", ATTACK_MODEL_PY, ATTACK_CONFIG)
    proof = repo / "attack" / "1" / "unpickled_in"
    server, client = serve(repo, model_control_mode="explicit", load_models=["attack"])
    try:
        y, first_pid = infer(client, [0, 1])
        assert y == [0, 1]
        with pytest.raises(InferenceServerException) as refused:
            infer(client, [attack, 2])
        assert not proof.exists(), f"unpickled in pid {proof.read_text()} (server {os.getpid()})"
        assert "does not carry" in str(refused.value)
        assert client.is_server_live()
        y, pid = infer(client, [0, 3])          # a legitimate client, served by a new worker
        assert y == [0, 3] and pid != first_pid
    finally:
        server.close()


@pytest.mark.parametrize("attack", list(ATTACKS), ids=list(ATTACKS.values()))
def test_a_batch_run_on_a_thread_refuses_it_too(tmp_path, attack):
    # backend.execute reads the worker on the calling thread (a restart, a region to grow)
    config, files = write_model(tmp_path, "attack", ATTACK_MODEL_PY, ATTACK_CONFIG)
    with loaded(config, files) as backend:
        [error] = backend.execute([{"X": np.array([attack, 2], np.float32)}])
        assert isinstance(error, Unavailable) and "does not carry" in str(error)
        [ok] = backend.execute([{"X": np.array([0, 3], np.float32)}])
        assert ok["Y"].tolist() == [0, 3]
    assert not (files.version_dir / "unpickled_in").exists()


def test_a_decoupled_workers_reader_refuses_it_and_closes_the_request(tmp_path):
    config, files = write_model(tmp_path, "attack", ATTACK_MODEL_PY, ATTACK_CONFIG + DECOUPLED)
    with loaded(config, files) as backend:
        sender = Collector()
        try:
            backend.execute_decoupled([{"X": np.array([1, 2], np.float32)}], None, [sender])
        except Unavailable:
            pass                   # the worker may be killed before its execute returns
        [(outputs, error, final)] = sender.wait()
        assert outputs is None and final and isinstance(error, Unavailable)
        assert "does not carry" in str(error)
        again = Collector()
        backend.execute_decoupled([{"X": np.array([0, 3], np.float32)}], None, [again])
        [(outputs, error, final)] = again.wait()
        assert error is None and final and outputs["Y"].tolist() == [0, 3]
    assert not (files.version_dir / "unpickled_in").exists()


def frame(kind: int, fields: object) -> bytes:
    data = pickle.dumps(fields, protocol=5)
    return struct.pack("<IB", len(data) + 1, kind) + data


class Exec:
    def __reduce__(self):
        return (exec, ("raise SystemExit('ran in the reader')",))


def test_the_server_end_loads_numpy_and_plain_data_and_nothing_else():
    ours, theirs = socket.socketpair()
    try:
        server = Channel(ours.fileno())
        arrays = {"f": np.arange(4, dtype=np.float32), "s": np.array([b"a", b"bc"], dtype=np.object_),
                  "t": np.ones((2, 3))[:, :1]}
        theirs.sendall(frame(BlsCall.KIND, (7, False, ("m", 1, arrays, ["Y"], "id", 0, 0, 0, "{}"))))
        theirs.sendall(frame(Metric.KIND, (0, "set", ("g", 1, np.float64(2.5)))))
        theirs.sendall(frame(Results.KIND, ([Exec()],)))
        theirs.sendall(frame(Results.KIND, ([[("Y", "<f4", (1,), 0, 4)]],)))
        theirs.sendall(frame(Results.KIND, ("too", "many")))
        messages = []
        while len(messages) < 5:
            try:
                msg = server.take()
            except ProtocolError as err:
                messages.append(err)
                continue
            if msg is None:
                assert server.fill()
                continue
            messages.append(msg)
        call, metric, refused, results, short = messages
        assert {k: v.tolist() for k, v in call.spec[2].items()} == {k: v.tolist() for k, v in arrays.items()}
        assert metric.args[2] == 2.5
        assert isinstance(refused, ProtocolError) and "builtins.exec" in str(refused)
        assert results.items == [[("Y", "<f4", (1,), 0, 4)]]   # the frame after it reads whole
        assert isinstance(short, ProtocolError)
    finally:
        ours.close()
        theirs.close()
