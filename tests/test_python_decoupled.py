"""Decoupled python models (model_transaction_policy { decoupled: true }) at the backend:
Triton's response-sender API in the worker process and in thread mode, responses after
execute has returned, errors per response, cancellation, and a worker that dies or hangs
with requests still open."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from jupyter_triton.backends.python import PythonBackend
from jupyter_triton.protocol.errors import DeadlineExceeded, Internal, TritonError, Unavailable

from test_backend_python import THREAD_MODE, loaded, write_model

pytestmark = pytest.mark.timeout(120)

MODES = ["process", "thread"]

# Shaped like NVIDIA's examples/decoupled/repeat_model.py: one response per element of IN,
# sent from a thread of the model's own, after execute has returned.
REPEAT_MODEL_PY = '''
import json, os, sys, threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("needs decoupled")
        self.threads = []

    def execute(self, requests):
        for request in requests:
            cmd = pb_utils.get_input_tensor_by_name(request, "CMD").as_numpy().reshape(-1)[0]
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)
            sender = request.get_response_sender()
            if cmd == b"raise":
                raise ValueError("repeat was asked to fail")
            if cmd == b"return":
                return [pb_utils.InferenceResponse([])]
            if cmd == b"kill":
                os._exit(3)
            if cmd == b"hang":
                time.sleep(60)
            t = threading.Thread(target=self.respond, args=(sender, request, cmd, values), daemon=True)
            t.start()
            self.threads.append(t)
        return None

    def respond(self, sender, request, cmd, values):
        if cmd == b"wait_cancel":
            deadline = time.monotonic() + 20
            while not sender.is_cancelled() and time.monotonic() < deadline:
                time.sleep(0.01)
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", np.array([1 if request.is_cancelled() else 0], np.int32))]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        if cmd == b"die_later":
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", values[:1])]))
            time.sleep(0.2)
            os._exit(4)
        for i, v in enumerate(values):
            time.sleep(0.01)
            if cmd == b"bad" and i == 1:
                sender.send(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("element 1 is bad", pb_utils.TritonError.INVALID_ARG)))
                continue
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.array([v], np.int32)),
                pb_utils.Tensor("IDX", np.array([i], np.uint32))]))
        if cmd == b"final_with_response":
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([-1], np.int32)),
                                                    pb_utils.Tensor("IDX", np.array([99], np.uint32))]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        elif cmd != b"forget":
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if cmd == b"twice":
            try:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except pb_utils.TritonModelException as err:
                sys.stdout.write(f"AFTER FINAL: {err}\\n"); sys.stdout.flush()
        if cmd == b"no_response":
            try:
                sender.send()
            except pb_utils.TritonModelException as err:
                sys.stdout.write(f"NO RESPONSE: {err}\\n"); sys.stdout.flush()

    def finalize(self):
        for t in self.threads:
            t.join(5)
'''

REPEAT_CONFIG = '''
name: "repeat"
backend: "python"
model_transaction_policy { decoupled: true }
input [
  { name: "CMD" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }
]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] }
]
'''


class Collector:
    """A ResponseSender as the engine's contract has it: thread-safe, closed by final."""

    def __init__(self) -> None:
        self.responses: list[tuple[dict | None, TritonError | None, bool]] = []
        self.done = threading.Event()
        self.cancel = False
        self._lock = threading.Lock()

    def send(self, outputs=None, *, error=None, final=False) -> None:
        with self._lock:
            if self.done.is_set():
                raise Internal("send after final")
            self.responses.append((outputs, error, final))
            if final:
                self.done.set()

    def is_cancelled(self) -> bool:
        return self.cancel

    def wait(self, seconds: float = 20) -> list:
        assert self.done.wait(seconds), f"no final response in {seconds} s: {self.responses}"
        return self.responses


def request(cmd: str, values: list[int]) -> dict[str, np.ndarray]:
    return {"CMD": np.array([cmd.encode()], dtype=np.object_), "IN": np.array(values, np.int32)}


def repeat_model(tmp_path, mode: str):
    config = REPEAT_CONFIG + (THREAD_MODE if mode == "thread" else "")
    return write_model(tmp_path, "repeat", REPEAT_MODEL_PY, config)


def test_the_python_backend_says_it_supports_decoupled():
    assert PythonBackend.supports_decoupled


@pytest.mark.parametrize("mode", MODES)
def test_responses_come_from_a_thread_after_execute_returned(tmp_path, mode):
    config, files = repeat_model(tmp_path, mode)
    with loaded(config, files) as backend:
        senders = [Collector(), Collector()]
        started = time.monotonic()
        backend.execute_decoupled([request("go", [5, 6, 7]), request("go", [])], None, senders)
        returned = time.monotonic() - started
        first, empty = senders[0].wait(), senders[1].wait()
    assert returned < 0.5   # execute left before the thread's three 10 ms responses
    assert [(o["OUT"].tolist(), o["IDX"].tolist()) for o, _, _ in first[:3]] == \
        [([5], [0]), ([6], [1]), ([7], [2])]
    assert first[3] == (None, None, True)   # COMPLETE_FINAL without a response
    assert empty == [(None, None, True)]    # zero responses: only the final flag


@pytest.mark.parametrize("mode", MODES)
def test_final_flag_with_a_response_and_requested_outputs(tmp_path, mode):
    from jupyter_triton.protocol.types import InferRequest, RequestedOutput
    config, files = repeat_model(tmp_path, mode)
    with loaded(config, files) as backend:
        sender = Collector()
        backend.execute_decoupled([request("final_with_response", [3])],
                                  [InferRequest("repeat", outputs=[RequestedOutput("IDX")])], [sender])
        got = sender.wait()
    assert [(sorted(o), f) for o, _, f in got] == [(["IDX"], False), (["IDX"], True)]
    assert got[-1][0]["IDX"].tolist() == [99]


@pytest.mark.parametrize("mode", MODES)
def test_an_error_response_mid_stream_keeps_the_stream_open(tmp_path, mode):
    config, files = repeat_model(tmp_path, mode)
    with loaded(config, files) as backend:
        sender = Collector()
        backend.execute_decoupled([request("bad", [1, 2, 3])], None, [sender])
        got = sender.wait()
    assert got[0][0]["OUT"].tolist() == [1]
    assert got[1][0] is None and got[1][1].status == 400 and "element 1 is bad" in str(got[1][1])
    assert got[2][0]["OUT"].tolist() == [3]
    assert got[3] == (None, None, True)


@pytest.mark.parametrize("mode", MODES)
def test_tritons_texts_for_a_send_after_final_and_a_send_without_response(tmp_path, mode, capfd):
    config, files = repeat_model(tmp_path, mode)
    with loaded(config, files) as backend:
        a, b = Collector(), Collector()
        backend.execute_decoupled([request("twice", [1]), request("no_response", [1])], None, [a, b])
        a.wait(), b.wait()
        # the model prints after its last response (a worker process's output comes later)
        texts = ("AFTER FINAL: Unable to send response. Response sender has been closed.",
                 "NO RESPONSE: Inference Response object must be provided when the response "
                 "flags is set to zero.")
        out, deadline = "", time.monotonic() + 10
        while not all(t in out for t in texts) and time.monotonic() < deadline:
            time.sleep(0.05)
            out += capfd.readouterr().out
    assert texts[0] in out
    assert texts[1] in out
    assert [f for _, _, f in a.responses] == [False, True]   # the second final never left


@pytest.mark.parametrize("mode", MODES)
def test_execute_that_raises_or_returns_responses_fails_the_batch(tmp_path, mode):
    config, files = repeat_model(tmp_path, mode)
    with loaded(config, files) as backend:
        with pytest.raises(TritonError, match="repeat was asked to fail"):
            backend.execute_decoupled([request("raise", [1])], None, [Collector()])
        with pytest.raises(TritonError, match="is using the decoupled mode and the execute function "
                                              "must return None"):
            backend.execute_decoupled([request("return", [1])], None, [Collector()])
        sender = Collector()   # the instance serves on
        backend.execute_decoupled([request("go", [4])], None, [sender])
        assert sender.wait()[0][0]["OUT"].tolist() == [4]


@pytest.mark.parametrize("mode", MODES)
def test_a_sender_dropped_without_final_closes_its_request(tmp_path, mode):
    config, files = repeat_model(tmp_path, mode)
    with loaded(config, files) as backend:
        sender = Collector()
        backend.execute_decoupled([request("forget", [1, 2])], None, [sender])
        got = sender.wait()
    assert [o["OUT"].tolist() for o, _, _ in got[:2]] == [[1], [2]]
    assert got[2] == (None, None, True)


@pytest.mark.parametrize("mode", MODES)
def test_the_model_sees_a_cancellation(tmp_path, mode):
    config, files = repeat_model(tmp_path, mode)
    with loaded(config, files) as backend:
        sender = Collector()
        backend.execute_decoupled([request("wait_cancel", [0])], None, [sender])
        time.sleep(0.2)
        assert not sender.done.is_set()
        sender.cancel = True
        got = sender.wait()
    assert got[0][0]["OUT"].tolist() == [1] and got[0][2]   # request.is_cancelled() too


def test_a_worker_that_dies_after_execute_closes_its_open_requests(tmp_path):
    config, files = repeat_model(tmp_path, "process")
    with loaded(config, files) as backend:
        sender = Collector()
        backend.execute_decoupled([request("die_later", [8])], None, [sender])
        got = sender.wait()
        assert got[0][0]["OUT"].tolist() == [8]
        assert got[1][0] is None and got[1][2] and isinstance(got[1][1], Unavailable)
        assert "exit code 4" in str(got[1][1])
        # the next batch gets a new worker
        again = Collector()
        for _ in range(3):
            try:
                backend.execute_decoupled([request("go", [2])], None, [again])
                break
            except Unavailable:   # the death noticed by the next batch, at worst
                again = Collector()
        assert again.wait()[0][0]["OUT"].tolist() == [2]


def test_a_worker_killed_in_execute_fails_the_batch(tmp_path):
    config, files = repeat_model(tmp_path, "process")
    with loaded(config, files) as backend:
        sender = Collector()
        with pytest.raises(Unavailable, match="exit code 3"):
            backend.execute_decoupled([request("kill", [1])], None, [sender])
        assert sender.wait()[-1][2] and isinstance(sender.responses[-1][1], Unavailable)


def test_execute_past_its_bound_closes_the_open_requests(tmp_path):
    config, files = repeat_model(tmp_path, "process")
    with loaded(config, files, execute_timeout_s=0.5) as backend:
        hung = Collector()
        with pytest.raises(DeadlineExceeded):
            backend.execute_decoupled([request("hang", [1])], None, [hung])
        got = hung.wait()
        assert len(got) == 1 and isinstance(got[0][1], DeadlineExceeded) and got[0][2]


def test_unload_closes_requests_still_open(tmp_path):
    config, files = repeat_model(tmp_path, "process")
    with loaded(config, files, finalize_timeout_s=0.5) as backend:
        sender = Collector()
        backend.execute_decoupled([request("wait_cancel", [0])], None, [sender])
    got = sender.wait(5)
    assert got[-1][2] and isinstance(got[-1][1], (Unavailable, type(None)))


# Triton 23.10+: a default (non-decoupled) model may answer through response senders too.
SENDER_MODEL_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils

def text(message):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([message.encode()], dtype=np.object_))])

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            cmd = pb_utils.get_input_tensor_by_name(request, "CMD").as_numpy().reshape(-1)[0]
            sender = request.get_response_sender()
            if cmd == b"one":
                sender.send(text("hello"), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            elif cmd == b"final_first":
                try:
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except pb_utils.TritonModelException as err:
                    sender.send(text(str(err)), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            elif cmd == b"two":
                sender.send(text("first"))
                try:
                    sender.send(text("second"))
                except pb_utils.TritonModelException as err:
                    print("TWO:", err)
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

SENDER_CONFIG = '''
name: "sender"
backend: "python"
input [{ name: "CMD" data_type: TYPE_STRING dims: [ 1 ] }]
output [{ name: "OUT" data_type: TYPE_STRING dims: [ 1 ] }]
'''


@pytest.mark.parametrize("mode", MODES)
def test_a_default_model_may_answer_through_its_response_senders(tmp_path, mode):
    config, files = write_model(tmp_path, "sender", SENDER_MODEL_PY,
                                SENDER_CONFIG + (THREAD_MODE if mode == "thread" else ""))
    cmds = [{"CMD": np.array([c.encode()], dtype=np.object_)} for c in ("one", "final_first", "two", "none")]
    with loaded(config, files) as backend:
        one, final_first, two, none = backend.execute(cmds)
    assert one["OUT"].tolist() == [b"hello"]
    assert final_first["OUT"].tolist() == [b"Unable to send response. Non-decoupled model cannot send "
                                           b"complete final before sending a response."]
    assert two["OUT"].tolist() == [b"first"]
    assert isinstance(none, TritonError) and "sent no response" in str(none)
