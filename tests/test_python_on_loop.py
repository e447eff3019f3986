"""A python model's batches with no thread waiting for its worker: the event loop sends a
batch (at its deadline, from its alarm: no batch is held on a thread) and reads the worker's
answer itself (backends/python/worker.py ``LoopWatch``). Real servers, real worker
processes, tritonclient over HTTP and gRPC; each test also checks that the path was taken:
no batch of a healthy model is run on its instance thread's blocking path."""
from __future__ import annotations

import concurrent.futures
import functools
import os
import signal
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import serve
from server_waits import started, wait_for_start

pytestmark = pytest.mark.timeout(120)

# Y = 2 X + the request's own offset (its "offset" parameter): a batch that mixed up rows
# or requests answers wrongly. X[0, 0] == -1 sleeps past the bound, -2 exits the worker.
SCALE_PY = '''
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0, 0] == -1:
                time.sleep(60)
            if x[0, 0] == -2:
                os._exit(3)
            offset = json.loads(request.parameters() or "{}").get("offset", 0)
            out.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("Y", (2 * x + offset).astype(np.float32)),
                pb_utils.Tensor("PID", np.full((x.shape[0], 1), os.getpid(), np.int64))]))
        return out
'''

SCALE_CONFIG = '''
name: "scale"
backend: "python"
max_batch_size: 16
input [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]
output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] }]
instance_group [{ kind: KIND_CPU count: 1 }]
dynamic_batching { max_queue_delay_microseconds: 2000 }
parameters { key: "execute_timeout_seconds" value: { string_value: "2" } }
'''

# Calls "scale" through BLS (a pool thread runs it while the worker waits) and logs a line
# through pb_utils.Logger for every request.
CALLER_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            inner = pb_utils.InferenceRequest(model_name="scale", inputs=[pb_utils.Tensor("X", x)],
                                              requested_output_names=["Y"]).exec()
            if inner.has_error():
                raise pb_utils.TritonModelException(inner.error().message())
            y = pb_utils.get_output_tensor_by_name(inner, "Y").as_numpy()
            pb_utils.Logger.log_info(f"caller saw {float(y[0, 0]):g}")
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("Z", y + 1)]))
        return out
'''

CALLER_CONFIG = '''
name: "caller"
backend: "python"
max_batch_size: 16
input [{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }]
output [{ name: "Z" data_type: TYPE_FP32 dims: [ 4 ] }]
instance_group [{ kind: KIND_CPU count: 1 }]
dynamic_batching { max_queue_delay_microseconds: 500 }
'''


def write_models(root: Path) -> Path:
    for name, py, config in (("scale", SCALE_PY, SCALE_CONFIG), ("caller", CALLER_PY, CALLER_CONFIG)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(textwrap.dedent(py))
        (root / name / "config.pbtxt").write_text(textwrap.dedent(config))
    return root


class ThreadUse:
    """What a model's instance threads are given: ``blocking`` counts batches run there the
    old way (execute, then a hand-back to the loop) and clean-ups after a failure; ``held``
    the batches handed to a thread to hold to their deadline (none: the loop's alarm sends
    them)."""

    def __init__(self, server, model: str) -> None:
        self.blocking = 0
        self.held: list = []
        for instance in server.engine._version(model).pool.instances:
            thread = instance.thread
            thread.post = self._count(thread.post)
            thread.post_deferred = self._note_held(thread.post_deferred)

    def _count(self, post):
        @functools.wraps(post)
        def counted(*args, **kwargs):
            self.blocking += 1
            return post(*args, **kwargs)
        return counted

    def _note_held(self, post_deferred):
        @functools.wraps(post_deferred)
        def noted(loop, done, fn, deferred):
            self.held.append(getattr(fn, "func", fn))
            return post_deferred(loop, done, fn, deferred)
        return noted

    def assert_on_loop(self) -> None:
        assert self.blocking == 0, f"{self.blocking} batch(es) ran on the instance thread"
        assert self.held == [], self.held   # no batch handed to a thread to hold


def x_rows(i: int, rows: int = 1) -> np.ndarray:
    return (np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + 10 * i)


@pytest.fixture
def server(tmp_path):
    server, client = serve(write_models(tmp_path / "models"), model_control_mode="explicit",
                           load_models=["scale", "caller"])
    try:
        yield server
    finally:
        server.close()


def _http_call(url: str, i: int) -> tuple[np.ndarray, np.ndarray]:
    client = httpclient.InferenceServerClient(url)
    x = x_rows(i, 1 + i % 3)
    inp = httpclient.InferInput("X", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("scale", [inp], parameters={"offset": i})
    return x, result.as_numpy("Y") - i


def _grpc_call(url: str, i: int) -> tuple[np.ndarray, np.ndarray]:
    client = grpcclient.InferenceServerClient(url)
    x = x_rows(i, 1 + i % 3)
    inp = grpcclient.InferInput("X", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("scale", [inp], parameters={"offset": i})
    return x, result.as_numpy("Y") - i


def _start_grpc(tmp_path):
    from jupyter_triton.engine.options import EngineOptions
    from jupyter_triton.standalone import start_in_thread
    return start_in_thread(EngineOptions(model_repository=write_models(tmp_path / "models"),
                                         model_control_mode="explicit", load_models=["scale"]),
                           host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=0)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_concurrent_batches_answer_right_with_no_thread_waiting(tmp_path, protocol):
    srv = _start_grpc(tmp_path)
    try:
        use = ThreadUse(srv, "scale")
        url = f"127.0.0.1:{srv.http_port if protocol == 'http' else srv.grpc_port}"
        call = _http_call if protocol == "http" else _grpc_call
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            for x, y in pool.map(functools.partial(call, url), range(160)):
                np.testing.assert_array_equal(y, 2 * x)
        use.assert_on_loop()
        stats = httpclient.InferenceServerClient(f"127.0.0.1:{srv.http_port}") \
            .get_inference_statistics("scale")["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 160
        assert stats["execution_count"] < 160          # batches formed, not one call each
        for key in ("queue", "compute_input", "compute_infer", "compute_output"):
            assert stats["inference_stats"][key]["count"] == 160, key
        assert stats["inference_stats"]["compute_infer"]["ns"] > 0
    finally:
        srv.close()


def test_one_client_at_a_time_is_sent_by_the_loop_at_its_deadline(server):
    # The loop's alarm sends a batch of one at its deadline: no instance thread is handed it
    # (a held batch would cost the thread two wake-ups for nothing the loop cannot do).
    use = ThreadUse(server, "scale")
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    for i in range(20):
        x = x_rows(i)
        inp = httpclient.InferInput("X", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("scale", [inp]).as_numpy("Y"), 2 * x)
    use.assert_on_loop()
    assert use.held == []
    queue = client.get_inference_statistics("scale")["model_stats"][0]["inference_stats"]["queue"]
    assert queue["count"] == 20
    assert queue["ns"] / queue["count"] >= 1_500_000   # each waited out its 2 ms delay


def _infer(client, value: float, model: str = "scale", output: str = "Y") -> np.ndarray:
    inp = httpclient.InferInput("X", [1, 4], "FP32")
    inp.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return client.infer(model, [inp]).as_numpy(output)


def _pid(client) -> int:
    inp = httpclient.InferInput("X", [1, 4], "FP32")
    inp.set_data_from_numpy(np.ones((1, 4), np.float32))
    return int(client.infer("scale", [inp]).as_numpy("PID")[0, 0])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_an_execute_past_its_timeout_is_a_504_and_the_restarted_worker_serves_the_next(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    first = _pid(client)
    use = ThreadUse(server, "scale")
    start = time.monotonic()
    with pytest.raises(InferenceServerException) as err:
        _infer(client, -1)
    elapsed = time.monotonic() - start
    assert err.value.status() == "504", err.value
    assert "execute_timeout_seconds" in str(err.value) and "2 s" in str(err.value), err.value
    assert 1.5 < elapsed < 15, elapsed
    assert use.blocking == 1        # only the restart ran on the thread
    deadline = time.monotonic() + 10
    while not _gone(first) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(first)
    np.testing.assert_array_equal(_infer(client, 3), np.full((1, 4), 6, np.float32))
    assert _pid(client) != first
    blocking = use.blocking
    for _ in range(5):
        _infer(client, 1)
    assert use.blocking == blocking    # the new worker's batches are the loop's again
    assert client.is_model_ready("scale")


def test_a_worker_that_exits_mid_batch_fails_its_requests_and_the_next_is_served(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    first = _pid(client)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        # the exit and three requests that may share its batch: each gets an answer
        futures = [pool.submit(_infer, httpclient.InferenceServerClient(
            f"127.0.0.1:{server.http_port}"), v) for v in (-2, 5, 5, 5)]
        outcomes = []
        for future in futures:
            try:
                outcomes.append(future.result(timeout=30))
            except InferenceServerException as err:
                outcomes.append(err)
    died = outcomes[0]
    assert isinstance(died, InferenceServerException) and died.status() == "503", died
    assert "died" in str(died) and "exit code 3" in str(died), died
    for outcome in outcomes[1:]:
        assert isinstance(outcome, InferenceServerException) or \
            np.array_equal(outcome, np.full((1, 4), 10, np.float32)), outcome
    np.testing.assert_array_equal(_infer(client, 4), np.full((1, 4), 8, np.float32))
    assert _pid(client) != first and _gone(first)
    assert client.is_server_live() and client.is_model_ready("scale")


def test_a_worker_killed_between_batches_is_restarted_for_the_next(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    first = _pid(client)
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not _gone(first) and time.monotonic() < deadline:
        time.sleep(0.05)
    answers = []
    for _ in range(3):      # the first may still meet the dead worker: an error, never a hang
        try:
            answers.append(_infer(client, 2))
        except InferenceServerException as err:
            assert err.status() == "503", err
    assert answers and np.array_equal(answers[-1], np.full((1, 4), 4, np.float32))
    assert _pid(client) != first


def test_batches_past_the_shared_regions_grow_them_and_answer_right(server):
    # The first input region is made on the loop; a bigger one replaces it on the instance
    # thread (the worker may have to let go of the old one first), and outputs past their
    # region make the worker ask for a bigger one (Grow), answered on the loop.
    use = ThreadUse(server, "scale")
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=60)
    for width in (4, 3_000_000, 4, 6_000_000, 4):
        x = np.random.default_rng(width).random((1, width), dtype=np.float32)
        inp = httpclient.InferInput("X", [1, width], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("scale", [inp]).as_numpy("Y"), 2 * x)
    assert 1 <= use.blocking <= 2   # the batches that outgrew the input region, only
    blocking = use.blocking
    for _ in range(3):
        _infer(client, 1)
    assert use.blocking == blocking


def test_a_bls_calling_and_logging_model_still_works(server):
    use_caller, use_scale = ThreadUse(server, "caller"), ThreadUse(server, "scale")
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda v: _infer(httpclient.InferenceServerClient(
            f"127.0.0.1:{server.http_port}"), v, "caller", "Z"), [1.0, 2.0, 3.0, 4.0] * 3))
    for value, z in zip([1.0, 2.0, 3.0, 4.0] * 3, results):
        np.testing.assert_array_equal(z, np.full((1, 4), 2 * value + 1, np.float32))
    use_caller.assert_on_loop()
    use_scale.assert_on_loop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [e["message"] for e in server.engine.model_logs.lines("caller")
                 if e["source"] == "logger"]
        if len(lines) >= 12:
            break
        time.sleep(0.05)
    assert sorted(set(lines)) == ["caller saw 2", "caller saw 4", "caller saw 6", "caller saw 8"], lines


def test_unload_while_a_batch_runs_answers_it_and_finishes(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}",
                                              network_timeout=60)
    before = started(client, "scale")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(_infer, httpclient.InferenceServerClient(
            f"127.0.0.1:{server.http_port}", network_timeout=60), -1)
        wait_for_start(client, "scale", before)
        start = time.monotonic()
        client.unload_model("scale")
        with pytest.raises(InferenceServerException) as err:
            stuck.result(timeout=30)
    assert time.monotonic() - start < 20
    assert err.value.status() in ("503", "504"), err.value
    assert not client.is_model_ready("scale") and client.is_server_live()
