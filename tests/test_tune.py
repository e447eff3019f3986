"""The batching tuner from the notebook's side: ``jupyter_triton.tune`` against the server a
kernel starts, load from a subprocess (loadgen.py) or perf_analyzer, the recommendation per
SLO, the plot and the CSV, ``apply()`` swapping with zero failed requests, ``%triton tune``."""
from __future__ import annotations

import csv
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import jupyter_triton as jt
from jupyter_triton.kernel import api, discovery
from jupyter_triton.kernel.tune import COLUMNS, find_perf_analyzer, pareto_front
from jupyter_triton.protocol.errors import InvalidArgument, NotFound
from server_waits import wait_until

pytestmark = pytest.mark.timeout(240)

# A fixed cost per execution whatever the batch (a kernel launch, a Python call): batching
# multiplies throughput, queueing behind it costs latency. That is what the tuner must see.
# 40 ms: well above the scheduling hiccups of a loaded machine, so the p99s stay apart.
SLOW_MODEL_PY = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.04)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)]) for r in requests]
'''
IO = dict(inputs=[("X", "FP32", [-1, 4])], outputs=[("Y", "FP32", [-1, 4])])


@pytest.fixture
def kernel_server(tmp_path: Path):
    """What a notebook without the server extension gets: a server in this process."""
    discovery.reset()
    conn = discovery.start_in_kernel(tmp_path / "repo")
    yield conn
    discovery.stop_in_kernel()
    discovery.reset()
    api.uploaded.clear()


def serve_slow(max_batch_size: int = 4, max_queue_delay_us: int = 0):
    return jt.serve(SLOW_MODEL_PY, "slow", max_batch_size=max_batch_size,
                    max_queue_delay_us=max_queue_delay_us, **IO)


def test_tune_measures_every_config_and_recommends_per_slo(kernel_server, tmp_path):
    serve_slow()
    t = jt.tune("slow", max_batch_size=[1, 8], max_queue_delay_us=[0], concurrency=[1, 8],
                seconds=1, slo_p99_ms=1000, load_generator="loadgen")
    assert t.load_generator == "loadgen"
    assert sorted((r["max_batch_size"], r["concurrency"]) for r in t.results) == \
        [(1, 1), (1, 8), (8, 1), (8, 8)]
    for r in t.results:
        assert set(COLUMNS) <= set(r)
        assert r["failures"] == 0 and r["throughput"] > 0
        assert r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"]
        assert r["p50_ms"] >= 40                          # the model sleeps 40 ms an execution
    by = {(r["max_batch_size"], r["concurrency"]): r for r in t.results}
    # read from the server's statistics: max_batch_size 1 never batches, 8 clients do
    assert by[(1, 8)]["mean_batch"] == 1.0
    assert by[(8, 8)]["mean_batch"] > 2
    assert by[(8, 8)]["throughput"] > 2 * by[(1, 8)]["throughput"]

    # the recommendation moves with the SLO: loose takes the batched throughput, a tight
    # one (the lowest p99 measured) the single client that never queues
    loose = t.recommend(None)
    assert (loose.config["max_batch_size"], loose.concurrency) == (8, 8)
    tight = t.recommend(min(r["p99_ms"] for r in t.results))
    assert tight.concurrency == 1 and tight.within_slo
    assert (tight.config, tight.concurrency) != (loose.config, loose.concurrency)
    assert loose.throughput > 2 * tight.throughput
    assert (t.best.config, t.best.concurrency) == (loose.config, loose.concurrency)   # 1 s: loose
    assert "infer/s" in t.best.why and "p99" in t.best.why
    impossible = t.recommend(0.001)
    assert not impossible.within_slo and "no config met" in impossible.why
    front = pareto_front(t.results)
    assert front[-1] is by[(8, 8)]

    page = t._repr_html_()
    assert 'src="data:image/png;base64,' in page and "<table>" in page
    assert "<script" not in page and 'src="http' not in page          # nothing from a CDN
    assert t.plot_png().startswith(b"\x89PNG\r\n\x1a\n")

    with t.to_csv(tmp_path / "tune.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["concurrency"]) for r in rows] == [r["concurrency"] for r in t.results]
    assert float(rows[0]["throughput"]) == pytest.approx(t.results[0]["throughput"])

    # the temporary model is gone from the repository; the user's model was never touched
    index = jt.models()
    assert not [r for r in index if r["name"] == "slow__tune"]
    assert [r["version"] for r in index if r["name"] == "slow" and r.get("state") == "READY"] == ["1"]


@pytest.mark.skipif(find_perf_analyzer() is None, reason="perf_analyzer not installed")
def test_tune_with_perf_analyzer(kernel_server):
    serve_slow()
    t = jt.tune("slow", max_batch_size=[8], max_queue_delay_us=[0, 2000], concurrency=[4],
                seconds=1, load_generator="perf_analyzer")
    assert t.load_generator == "perf_analyzer"
    assert [(r["max_queue_delay_us"], r["concurrency"]) for r in t.results] == [(0, 4), (2000, 4)]
    for r in t.results:
        assert r["throughput"] > 0 and 40 <= r["p50_ms"] <= r["p99_ms"]
        assert r["mean_batch"] > 1


def test_apply_swaps_to_the_best_config_with_zero_failed_requests(kernel_server):
    served = serve_slow(max_batch_size=4)
    t = jt.tune("slow", max_batch_size=[8], max_queue_delay_us=[500], concurrency=[4],
                seconds=0.5, load_generator="loadgen")
    conn = kernel_server
    client = httpclient.InferenceServerClient(conn.url.split("://")[1].rstrip("/"), concurrency=1)
    x = httpclient.InferInput("X", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    stop = threading.Event()
    outcome = {"ok": 0, "failed": []}

    def clients_loop() -> None:
        deadline = time.monotonic() + 60           # bounded: 60 s or 3,000 requests
        for _ in range(3000):
            if stop.is_set() or time.monotonic() > deadline:
                return
            try:
                y = client.infer("slow", [x], headers=conn.headers).as_numpy("Y")
                assert y.tolist() == [[2.0] * 4]
                outcome["ok"] += 1
            except (InferenceServerException, AssertionError) as err:
                outcome["failed"].append(str(err))

    loop = threading.Thread(target=clients_loop)
    loop.start()
    wait_until(lambda: outcome["ok"] or outcome["failed"], "the clients served before the swap")
    before = outcome["ok"]
    applied = t.apply()
    after = outcome["ok"]
    wait_until(lambda: outcome["ok"] > after or outcome["failed"], "the clients served after it")
    stop.set()
    loop.join(70)
    assert outcome["failed"] == []
    assert before > 0 and outcome["ok"] > before
    assert applied.version > served.version
    config = api._client().config("slow")
    assert config["max_batch_size"] == 8
    assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 500
    # measured and served as written: the preferred size filled in for max_batch_size 4 is not
    # carried over to cap batches of 8
    assert config["dynamic_batching"]["preferred_batch_size"] == [8]
    assert [r["version"] for r in jt.models() if r["name"] == "slow" and r.get("state") == "READY"] \
        == [str(applied.version)]


def test_tune_refusals(kernel_server):
    with pytest.raises(NotFound):
        jt.tune("nothing_here", files={"1/model.py": b""}, seconds=0.5)
    serve_slow()
    api.uploaded.clear()                      # as if another kernel had served it
    with pytest.raises(InvalidArgument, match="did not serve"):
        jt.tune("slow", seconds=0.5)
    serve_slow()
    with pytest.raises(InvalidArgument, match="max_batch_size"):
        jt.tune("slow", max_batch_size=[0], seconds=0.5)
    with pytest.raises(InvalidArgument, match="concurrency"):
        jt.tune("slow", concurrency=[0], seconds=0.5)


def test_triton_tune_line_magic(kernel_server):
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    jt.load_ipython_extension(shell)
    serve_slow()
    t = shell.run_line_magic("triton", "tune slow --max-batch-size 2,4 --concurrency 2 "
                                       "--seconds 0.5 --slo-p99-ms 5000 --load-generator loadgen")
    assert [(r["max_batch_size"], r["concurrency"]) for r in t.results] == [(2, 2), (4, 2)]
    assert t.best is not None and t.best.within_slo
    with pytest.raises(UsageError):
        shell.run_line_magic("triton", "tune slow --concurrency x")


BROKEN_MODEL_PY = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        raise RuntimeError("broken on purpose")
'''


def test_a_model_that_fails_every_request_gets_no_recommendation(kernel_server):
    jt.serve(BROKEN_MODEL_PY, "broken", max_batch_size=4, **IO)
    t = jt.tune("broken", concurrency=[2], seconds=0.5, slo_p99_ms=1000, load_generator="loadgen")
    [row] = t.results
    assert row["failures"] > 0 and row["throughput"] == 0
    assert "broken on purpose" in row["error"]           # the server's error, as the client got it
    assert t.best is None
    assert "broken on purpose" in t._repr_html_()
