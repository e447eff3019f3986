"""Busy polling (`jupyter-triton serve --busy-poll-us`, engine/batching/busy_poll.py): after a request
the server's event loop, and a python model's worker after a batch of one, keep polling for
the window instead of sleeping; once requests stop, the server sleeps again. Read as an
operator would, from /proc: a sleeper spends no CPU; a poller stays runnable (it gives way to
other tasks, so on a busy machine its CPU alone may not show it polled)."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.http as httpclient

from conftest import TOKEN, W
from onnx_models import linear
from python_models import THREAD_MODE, request, sleepy_model
from test_cli_options import one_row, serve, stop

from jupyter_triton.engine.batching.busy_poll import BusyPoll

CLK_TCK = os.sysconf("SC_CLK_TCK")
WINDOW_S = 0.4      # long beside a request (~1 ms), short beside the test
DELAY_S = 1.5 * WINDOW_S


def cpu_seconds(pid: int) -> float:
    """CPU time of the whole process: what "it slept" is checked with."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def awake_seconds(pid: int, tid: int | None = None) -> float:
    """Time a thread (the process's main one, where its loop polls) ran or waited to run:
    what "it polled" is checked with. A poller gives way to other tasks (os.sched_yield), so
    on a busy machine it may get little CPU, but it stays runnable; a sleeper does not."""
    with open(f"/proc/{pid}/task/{tid or pid}/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return (int(on_cpu) + int(waiting)) / 1e9


def descendants(pid: int) -> list[int]:
    """The server's worker processes (forked by its template, a child of the server)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, ()))
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, ()))
    return found


def spent(pids: list[int], seconds: float, since: list[float] | None = None,
          clock=cpu_seconds) -> list[float]:
    """What ``clock`` counts for each of ``pids`` over the next ``seconds``; or from the
    ``since`` readings on. A test that expects polling after a request reads before sending
    it: a stall of the test between the answer and a first reading would move its measure
    past the window."""
    before = since if since is not None else readings(pids, clock)
    time.sleep(seconds)
    return [clock(p) - b for p, b in zip(pids, before)]


def readings(pids: list[int], clock=cpu_seconds) -> list[float]:
    return [clock(p) for p in pids]


def process_model(root: Path, name: str, extra: str = "") -> Path:
    """The sleepy model in its own worker process (python_models writes thread mode)."""
    model_dir = sleepy_model(root, name, extra=extra)
    config = model_dir / "config.pbtxt"
    config.write_text(config.read_text().replace(THREAD_MODE, ""))
    return model_dir


def test_the_loop_polls_for_the_window_then_sleeps():
    async def main() -> tuple[float, float, bool, bool]:
        poll = BusyPoll(int(WINDOW_S * 1e6))
        me = threading.get_native_id()
        start = awake_seconds(os.getpid(), me)
        poll.touch(asyncio.get_running_loop())
        await asyncio.sleep(WINDOW_S / 2)
        polling, busy = poll.polling, awake_seconds(os.getpid(), me) - start
        await asyncio.sleep(WINDOW_S)           # past the window: it stopped
        start = time.thread_time()
        await asyncio.sleep(WINDOW_S / 2)
        return busy, time.thread_time() - start, polling, poll.polling

    busy, idle, polling_then, polling_after = asyncio.run(main())
    assert polling_then and not polling_after
    assert busy > WINDOW_S / 8, f"the loop slept through its window ({busy:.3f} s awake)"
    assert idle < WINDOW_S / 20, f"the loop kept polling past its window ({idle:.3f} s of CPU)"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    process_model(root, "single")
    # a batch of two requests: the worker's busy polling is for batches of one
    process_model(root, "paired", extra="dynamic_batching { preferred_batch_size: [ 2 ] "
                                         "max_queue_delay_microseconds: 2000000 }")
    # one request waits out a queue delay longer than the window, or one within it
    for name, delay_s in (("waiting", DELAY_S), ("brief", WINDOW_S / 2)):
        process_model(root, name, extra="dynamic_batching { preferred_batch_size: [ 2 ] "
                                        f"max_queue_delay_microseconds: {int(delay_s * 1e6)} }}")
    (root / "onnx_linear" / "1").mkdir(parents=True)
    (root / "onnx_linear" / "config.pbtxt").write_text(
        'name: "onnx_linear" backend: "onnxruntime" max_batch_size: 8')
    linear(W, root / "onnx_linear" / "1" / "model.onnx")
    (root / "ensemble_of_onnx" / "1").mkdir(parents=True)
    (root / "ensemble_of_onnx" / "config.pbtxt").write_text(ENSEMBLE_OF_ONNX)
    return root


ENSEMBLE_OF_ONNX = '''
name: "ensemble_of_onnx"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 16 ] } ]
ensemble_scheduling { step [ { model_name: "onnx_linear" model_version: -1
  input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "OUT" } } ] }
'''


def load(client: httpclient.InferenceServerClient, server: int, model: str) -> int:
    """Load ``model``; the pid of the worker process it started. The server starts the template
    in the background, so on a busy machine it may appear only now: it is the server's child,
    the worker its grandchild."""
    before = set(descendants(server))
    client.load_model(model)
    (worker,) = [p for p in set(descendants(server)) - before if psutil.Process(p).ppid() != server]
    return worker


def test_serve_polls_after_a_request_and_sleeps_when_quiet(repo: Path):
    proc, url = serve(repo, "--busy-poll-us", str(int(WINDOW_S * 1e6)))
    client = httpclient.InferenceServerClient(url, concurrency=2, network_timeout=60)
    try:
        single = load(client, proc.pid, "single")
        paired = load(client, proc.pid, "paired")
        client.load_model("onnx_linear")
        client.infer("single", request(0.0))    # a first request's imports, done
        time.sleep(WINDOW_S * 2)
        before = readings([proc.pid, single], awake_seconds)
        client.infer("single", request(1.0))
        loop_s, worker_s = spent([proc.pid, single], WINDOW_S / 2, before, awake_seconds)
        assert loop_s > WINDOW_S / 10, f"the server slept after a request ({loop_s:.3f} s awake)"
        assert worker_s > WINDOW_S / 10, f"the worker slept after a batch of one ({worker_s:.3f} s awake)"

        time.sleep(WINDOW_S)                    # requests stopped: the whole server sleeps
        assert max(spent([proc.pid, *descendants(proc.pid)], WINDOW_S)) < WINDOW_S / 10

        # two requests in one batch: the loop polls after them, their worker does not
        before = readings([proc.pid], awake_seconds)
        results = [client.async_infer("paired", request(float(i))) for i in range(2)]
        for r in results:
            r.get_result(timeout=30)
        (worker_s,) = spent([paired], WINDOW_S / 2)
        (loop_s,) = spent([proc.pid], 0, before, awake_seconds)
        assert loop_s > WINDOW_S / 10, f"the server slept after a batch of two ({loop_s:.3f} s awake)"
        assert worker_s < WINDOW_S / 20, f"the worker polled after a batch of two ({worker_s:.3f} s)"

        # ONNX runs on a thread of the server: a polling loop would keep it from the GIL
        time.sleep(WINDOW_S)
        client.infer("onnx_linear", one_row())
        (loop_s,) = spent([proc.pid], WINDOW_S / 2)
        assert loop_s < WINDOW_S / 20, f"the loop polled for a model on its own threads ({loop_s:.3f} s)"
        # ... and an ensemble of it: each step's model decides
        client.load_model("ensemble_of_onnx")
        time.sleep(WINDOW_S)
        row = httpclient.InferInput("IN", [1, 16], "FP32")
        row.set_data_from_numpy(np.ones((1, 16), np.float32))
        client.infer("ensemble_of_onnx", [row])
        (loop_s,) = spent([proc.pid], WINDOW_S / 2)
        assert loop_s < WINDOW_S / 20, f"the loop polled for an ensemble of such a model ({loop_s:.3f} s)"
    finally:
        client.close()
        stop(proc)


def test_a_delay_past_the_window_is_slept_through_and_polled_at_its_end(repo: Path):
    proc, url = serve(repo, "--busy-poll-us", str(int(WINDOW_S * 1e6)))
    client = httpclient.InferenceServerClient(url, network_timeout=60)
    try:
        waiting = load(client, proc.pid, "waiting")
        brief = load(client, proc.pid, "brief")
        client.infer("brief", request(0.0))
        time.sleep(WINDOW_S * 2)
        # a delay within the window: polled through, as any wait after a request
        before = readings([proc.pid, brief], awake_seconds)
        result = client.async_infer("brief", request(2.0))
        (loop_s,) = spent([proc.pid], WINDOW_S / 4, before[:1], awake_seconds)
        assert loop_s > WINDOW_S / 20, f"the server slept through a delay within its window ({loop_s:.3f} s awake)"
        assert result.get_result(timeout=30).as_numpy("OUTPUT0")[0, 0] == 2.0
        # ... and its worker polls after the batch: a next request's batch may come in the window
        (worker_s,) = spent([brief], WINDOW_S / 4, before[1:], awake_seconds)
        assert worker_s > WINDOW_S / 20, f"the worker slept after a batch of one ({worker_s:.3f} s awake)"
        # a delay past it: nothing of the request's can happen before its deadline
        client.infer("waiting", request(0.0))
        time.sleep(WINDOW_S * 2)
        sent = time.monotonic()
        result = client.async_infer("waiting", request(1.0))
        time.sleep(WINDOW_S / 8)                # arrived: its batch waits for the deadline
        (loop_s,) = spent([proc.pid], WINDOW_S / 2)
        assert loop_s < WINDOW_S / 20, f"the server polled while its one request waited ({loop_s:.3f} s)"
        before = readings([proc.pid], awake_seconds)
        answer = result.get_result(timeout=30).as_numpy("OUTPUT0")
        assert time.monotonic() - sent >= DELAY_S and answer[0, 0] == 1.0
        # polling again from just before the deadline: for the answer, and the next request;
        # not the worker: a next batch of one would wait out the delay too
        (worker_s,) = spent([waiting], WINDOW_S / 2)
        (loop_s,) = spent([proc.pid], 0, before, awake_seconds)
        assert loop_s > WINDOW_S / 10, f"the server slept after the deadline ({loop_s:.3f} s awake)"
        assert worker_s < WINDOW_S / 20, f"the worker polled for a batch the delay holds ({worker_s:.3f} s)"
    finally:
        client.close()
        stop(proc)


def test_busy_poll_off(repo: Path):
    proc, url = serve(repo, "--busy-poll-us", "0")
    client = httpclient.InferenceServerClient(url, network_timeout=60)
    try:
        single = load(client, proc.pid, "single")
        client.infer("single", request(1.0))    # a first request's imports, done
        time.sleep(WINDOW_S / 2)
        client.infer("single", request(2.0))
        assert max(spent([proc.pid, single], WINDOW_S / 2)) < WINDOW_S / 20
    finally:
        client.close()
        stop(proc)


# -- the Jupyter server: off unless asked (its loop serves the notebook) --------------------

AUTH = {"Authorization": f"token {TOKEN}"}
BODY = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2],
                               "data": [1.0, 0.0]}]})


@pytest.fixture(params=[None, int(WINDOW_S * 1e6)], ids=["default", "asked"])
def jp_server_config(jp_server_config, tmp_path: Path, request):
    process_model(tmp_path / "jp_repo", "single")
    traits = {**jp_server_config["JupyterTriton"], "model_repository": str(tmp_path / "jp_repo")}
    if request.param is not None:
        traits["busy_poll_us"] = request.param
    return {**jp_server_config, "JupyterTriton": traits}


async def test_a_jupyter_server_polls_only_when_asked(jp_triton, jp_fetch, jp_server_config):
    asked = "busy_poll_us" in jp_server_config["JupyterTriton"]
    for _ in range(2):      # a first request's imports, done
        await jp_fetch("v2/models/single/infer", method="POST", body=BODY, headers=AUTH)
    await asyncio.sleep(WINDOW_S * 1.5)
    start = time.process_time()                 # this process is the Jupyter server
    await asyncio.sleep(WINDOW_S / 2)
    quiet = time.process_time() - start
    awake = awake_seconds(os.getpid(), threading.get_native_id())     # the loop's thread
    await jp_fetch("v2/models/single/infer", method="POST", body=BODY, headers=AUTH)
    start = time.process_time()
    await asyncio.sleep(WINDOW_S / 2)
    after = time.process_time() - start
    awake = awake_seconds(os.getpid(), threading.get_native_id()) - awake
    assert quiet < WINDOW_S / 20
    if asked:
        assert awake > WINDOW_S / 10, f"the Jupyter server slept after a request ({awake:.3f} s awake)"
    else:
        assert after < WINDOW_S / 20, f"the Jupyter server polled unasked ({after:.3f} s of CPU)"
