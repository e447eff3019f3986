"""The dashboard widget, kernel side: its poller reads a real server's statistics, and the
figures it shows (rates, per-request means, batch sizes) are the right deltas."""
from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from jupyter_triton.widgets import Dashboard, Snapshot, figures
from jupyter_triton.widgets.figures import batch_histogram, parse_pending


@dataclass
class FakeConnection:
    """What the widget needs of jupyter_triton.kernel.discovery.Connection."""
    url: str
    mode: str = "in-kernel"
    token: str = ""
    metrics_url: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"} if self.token else {}


def infer_linear(server_url: str, batch: int) -> None:
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [batch, 16], "datatype": "FP32",
                                   "data": [0.5] * (16 * batch)}]}).encode()
    req = urllib.request.Request(f"{server_url}/v2/models/linear/infer", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def wait_for(predicate, timeout: float = 10.0, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"condition not met within {timeout} s")


class CountedWaits(threading.Event):
    """A poller's stop event that counts its rounds: each round ends in one wait."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.count += 1
        return super().wait(timeout)


def stats_row(name="m", version="1", inferences=0, success=(0, 0), queue=(0, 0), compute=(0, 0, 0, 0),
              fail=0, batches=()):
    """A Triton statistics row; compute = (count, input ns, infer ns, output ns)."""
    count, c_in, c_infer, c_out = compute
    return {"name": name, "version": version, "inference_count": inferences, "execution_count": count,
            "inference_stats": {"success": {"count": success[0], "ns": success[1]},
                                "fail": {"count": fail, "ns": 0},
                                "queue": {"count": queue[0], "ns": queue[1]},
                                "compute_input": {"count": count, "ns": c_in},
                                "compute_infer": {"count": count, "ns": c_infer},
                                "compute_output": {"count": count, "ns": c_out}},
            "batch_stats": [{"batch_size": b, "compute_infer": {"count": n, "ns": 0}} for b, n in batches]}


def test_deltas_are_rates_and_means_over_the_interval():
    before = Snapshot(t=100.0, model_stats=[stats_row(inferences=10, success=(4, 0), queue=(4, 4000),
                                                     compute=(4, 400, 4000, 400), fail=1)])
    after = Snapshot(t=102.0, model_stats=[stats_row(inferences=50, success=(14, 0), queue=(14, 34000),
                                                    compute=(14, 1400, 54000, 1400), fail=3)],
                     pending={"m/1": 5})
    (f,) = figures(before, after)
    assert f.inferences_per_s == pytest.approx(20.0)        # 40 inferences in 2 s
    assert f.requests_per_s == pytest.approx(5.0)           # 10 requests in 2 s
    assert f.queue_us == pytest.approx(3.0)                 # 30000 ns over 10 requests
    assert f.compute_us == pytest.approx(5.2)               # (1000 + 50000 + 1000) ns over 10
    assert f.failures == 3 and f.pending == 5


def test_no_rates_without_an_earlier_reading_or_after_a_reload():
    cur = Snapshot(t=5.0, model_stats=[stats_row(inferences=10, success=(2, 0), queue=(2, 10))])
    (first,) = figures(None, cur)
    assert first.inferences_per_s == 0 and first.queue_us is None and first.pending is None
    reloaded = Snapshot(t=6.0, model_stats=[stats_row(inferences=1, success=(1, 0), queue=(1, 10))])
    (after_reload,) = figures(cur, reloaded)
    assert after_reload.inferences_per_s == 0 and after_reload.queue_us is None
    # a new version is a new row: no delta against the old version's counters
    v2 = Snapshot(t=7.0, model_stats=[stats_row(version="2", inferences=50, success=(5, 0))])
    (new_version,) = figures(cur, v2)
    assert new_version.version == "2" and new_version.inferences_per_s == 0


def test_histogram_counts_executions_per_batch_size():
    row = stats_row(batches=[(8, 3), (1, 5), (4, 0)])
    assert batch_histogram(row) == {1: 5, 8: 3}            # sorted, empty sizes left out


def test_pending_from_prometheus_text():
    text = ('# HELP nv_inference_pending_request_count x\n# TYPE nv_inference_pending_request_count gauge\n'
            'nv_inference_pending_request_count{model="a",version="1"} 3\n'
            'nv_inference_pending_request_count{model="b",version="2"} 0\n'
            '# TYPE nv_inference_count counter\nnv_inference_count{model="a",version="1"} 9\n')
    assert parse_pending(text) == {"a/1": 3, "b/2": 0}


def test_kernel_poller_sees_statistics_change_after_requests(standalone):
    conn = FakeConnection(url=standalone.url + "/",
                          metrics_url=f"http://127.0.0.1:{standalone.metrics_port}/metrics")
    dash = Dashboard(conn, interval=0.1)
    try:
        assert dash.server_path == ""          # in-kernel server: the browser cannot fetch it
        assert {f.name for f in dash.figures} == {"linear", "simple", "identity_int32"}
        assert dash.figures_for("linear").inference_count == 0
        ticks_before = dash.snapshot["t"]
        for _ in range(3):
            infer_linear(standalone.url, 3)
        infer_linear(standalone.url, 2)
        f = wait_for(lambda: (f := dash.figures_for("linear")) and f.inference_count == 11 and f)
        assert dash.snapshot["t"] > ticks_before                  # the trait pushed to the front end moves
        assert f.batch_sizes == {2: 1, 3: 3}
        assert f.failures == 0 and f.pending == 0
        assert dash.poller.running
        # the reading that sees the new request shows it in the histogram with a rate, and idle
        # readings after it fall back to 0. The poller sets the figures before it pushes the trait, so
        # the first push observed may still be the reading that saw the first 11: each reading is kept
        # whole and the one with the new batch is looked for, not the first one to arrive.
        readings = []
        dash.observe(lambda ch: readings.append((lambda f: (f.inferences_per_s, f.batch_sizes))(
            dash.figures_for("linear"))), "snapshot")
        infer_linear(standalone.url, 4)
        new_batch = {2: 1, 3: 3, 4: 1}
        wait_for(lambda: any(r > 0 and b == new_batch for r, b in readings))
        seen = next(i for i, (r, b) in enumerate(readings) if b == new_batch)
        assert readings[seen][0] > 0
        wait_for(lambda: len(readings) > seen + 1 and readings[-1] == (0, new_batch))
    finally:
        dash.close()
    assert not dash.poller.running


def test_single_model_dashboard_and_static_repr(standalone):
    dash = Dashboard(FakeConnection(url=standalone.url + "/"), model="linear", poll_kernel=False)
    infer_linear(standalone.url, 5)
    rows = dash.refresh()
    assert [f.name for f in rows] == ["linear"] and rows[0].batch_sizes == {5: 1}
    data, _ = dash._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    assert "linear" in data["text/plain"] and "5:1" in data["text/plain"]
    assert "<table" in data["text/html"] and "5×1" in data["text/html"]
    dash.close()


def test_browser_polling_pauses_the_kernel_poller(standalone):
    dash = Dashboard(FakeConnection(url=standalone.url + "/", mode="server-extension"), interval=0.1)
    try:
        assert dash.server_path == "/"         # same server as the page: the browser may fetch
        dash.browser_polling = True            # what a browser view reports
        # counted from here: a round the pause caught mid-poll has shown its reading before
        # its wait, so two waits later nothing more comes from before the pause
        dash.poller._stop = rounds = CountedWaits()
        wait_for(lambda: rounds.count >= 2)
        t_paused = dash.snapshot["t"]
        infer_linear(standalone.url, 1)
        wait_for(lambda: rounds.count >= 5)    # three rounds, each of which would have polled
        assert dash.snapshot["t"] == t_paused
        dash.browser_polling = False
        wait_for(lambda: dash.snapshot["t"] > t_paused)
    finally:
        dash.close()


def test_unreachable_server_and_unknown_model_are_reported_not_raised(standalone):
    dash = Dashboard(FakeConnection(url=standalone.url + "/"), model="nope", poll_kernel=False)
    assert "404" in dash.error and "nope" in dash.error
    dash.close()
    dash = Dashboard(FakeConnection(url="http://127.0.0.1:9/"), poll_kernel=False)
    assert "unreachable" in dash.error
    dash.close()


@pytest.mark.skipif(shutil.which("node") is None, reason="node not installed (needed to run dashboard.js here)")
def test_browser_figures_match_the_kernel_figures(tmp_path):
    """dashboard.js computes the same figures from the same two snapshots as figures.py."""
    import jupyter_triton.widgets as widgets
    before = Snapshot(t=10.0, model_stats=[stats_row(inferences=4, success=(2, 0), queue=(2, 100),
                                                    compute=(2, 10, 200, 10), batches=[(2, 2)])])
    after = Snapshot(t=10.5, model_stats=[stats_row(inferences=20, success=(6, 0), queue=(6, 4100),
                                                   compute=(6, 30, 1000, 50), fail=2, batches=[(2, 2), (4, 4)])],
                     pending={"m/1": 3})
    script = tmp_path / "run.mjs"
    script.write_text(
        f"import {{ figures }} from {json.dumps((Path(widgets.__file__).parent / 'dashboard.js').as_uri())};\n"
        f"console.log(JSON.stringify(figures({json.dumps(before.to_json())}, {json.dumps(after.to_json())})));\n")
    done = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    (js,) = json.loads(done.stdout)
    (py,) = figures(before, after)
    assert js["infPerS"] == pytest.approx(py.inferences_per_s) == pytest.approx(32.0)
    assert js["reqPerS"] == pytest.approx(py.requests_per_s) == pytest.approx(8.0)
    assert js["queueUs"] == pytest.approx(py.queue_us) == pytest.approx(1.0)
    assert js["computeUs"] == pytest.approx(py.compute_us)
    assert js["failures"] == py.failures == 2 and js["pending"] == py.pending == 3
    assert {b: n for b, n in js["batches"]} == py.batch_sizes == {2: 2, 4: 4}


# ---- decoupled models: responses per request, time to the first response ------------------

def with_responses(row: dict, responses: dict[int, tuple[int, int]], empty: int = 0) -> dict:
    """``response_stats`` as Triton writes them: per index, (success count, ns)."""
    row["response_stats"] = {
        str(i): {"success": {"count": c, "ns": ns}, "fail": {"count": 0, "ns": 0},
                 "empty_response": {"count": empty if i == max(responses) else 0, "ns": 0},
                 "cancel": {"count": 0, "ns": 0},
                 "compute_infer": {"count": c, "ns": ns}, "compute_output": {"count": c, "ns": 0}}
        for i, (c, ns) in responses.items()}
    return row


def decoupled_snapshots() -> tuple[Snapshot, Snapshot]:
    before = Snapshot(t=1.0, model_stats=[with_responses(
        stats_row(inferences=2, success=(2, 0), queue=(2, 2000)), {0: (2, 10_000), 1: (2, 0), 2: (2, 0)})])
    after = Snapshot(t=3.0, model_stats=[with_responses(
        stats_row(inferences=6, success=(6, 0), queue=(6, 10_000)), {0: (6, 50_000), 1: (6, 0), 2: (6, 0)},
        empty=6), stats_row(name="plain", inferences=1, success=(1, 0))])
    return before, after


def test_a_decoupled_model_shows_responses_per_request_and_time_to_first_response():
    (f, plain) = figures(*decoupled_snapshots())
    assert f.decoupled and not plain.decoupled
    assert f.responses_per_request == pytest.approx(3.0)        # 12 responses, 4 requests
    assert f.first_response_us == pytest.approx(2.0 + 10.0)      # queue 8000/4 ns + 40000/4 ns
    assert plain.responses_per_request is None and plain.first_response_us is None
    from jupyter_triton.widgets.figures import html_table, text_table
    assert "resp/req" in text_table([f, plain]) and "responses/req" in html_table([f, plain])
    assert "resp/req" not in text_table([plain])                 # only where a model streams


@pytest.mark.skipif(shutil.which("node") is None, reason="node not installed (needed to run dashboard.js here)")
def test_browser_figures_of_a_decoupled_model_match(tmp_path):
    import jupyter_triton.widgets as widgets
    before, after = decoupled_snapshots()
    script = tmp_path / "run.mjs"
    script.write_text(
        f"import {{ figures }} from {json.dumps((Path(widgets.__file__).parent / 'dashboard.js').as_uri())};\n"
        f"console.log(JSON.stringify(figures({json.dumps(before.to_json())}, {json.dumps(after.to_json())})));\n")
    done = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    js, js_plain = json.loads(done.stdout)
    py, _ = figures(before, after)
    assert js["decoupled"] and not js_plain["decoupled"]
    assert js["responsesPerRequest"] == pytest.approx(py.responses_per_request)
    assert js["firstResponseUs"] == pytest.approx(py.first_response_us)
    assert js_plain["responsesPerRequest"] is None


def test_the_dashboard_reads_a_served_generators_response_stats(tmp_path):
    import tritonclient.http as httpclient

    from jupyter_triton.engine import EngineOptions
    from jupyter_triton.kernel.artifacts import build_artifact
    from jupyter_triton.standalone import start_in_thread

    def words(prompt: str):
        for word in prompt.split():
            yield word

    (tmp_path / "models").mkdir()
    server = start_in_thread(EngineOptions(model_repository=tmp_path / "models", model_control_mode="explicit"),
                             host="127.0.0.1", http_port=0, metrics_port=None, grpc_port=None)
    try:
        art = build_artifact(words, "words")
        httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}").load_model(
            "words", config=art.config_json(), files={f"file:{k}": v for k, v in art.files.items()})
        dash = Dashboard(FakeConnection(url=server.url + "/"), model="words", poll_kernel=False)
        for prompt in ("a b c", "d e f g h"):
            req = urllib.request.Request(f"{server.url}/v2/models/words/generate_stream", method="POST",
                                         data=json.dumps({"text_input": prompt}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.read().count(b"data:") == len(prompt.split())
        # the server records a request's statistics after its last response: read them settled
        settled = wait_for(lambda: (s := dash.poller.poll_once()) and
                           s.model_stats[0]["inference_stats"]["success"]["count"] == 2 and s)
        dash._on_snapshot(settled)
        (f,) = dash.figures
        assert f.decoupled and f.responses_per_request == pytest.approx(4.0)   # 8 responses, 2 requests
        assert f.first_response_us is not None and f.first_response_us > 0
        assert "resp/req" in dash._repr_mimebundle_()[0]["text/plain"]
        dash.close()
    finally:
        server.close()


def test_an_ensemble_shows_each_steps_time_and_failures(tmp_path):
    def row(runs: tuple[int, int], ns: tuple[int, int], failed: int) -> dict:
        r = stats_row(name="pipe", inferences=runs[0], success=(runs[0], 0))
        r["ensemble_steps"] = [
            {"step": 1, "model": "double", "version": "1", "success": {"count": runs[0], "ns": ns[0]},
             "fail": {"count": 0, "ns": 0}},
            {"step": 2, "model": "checker", "version": "3", "success": {"count": runs[1], "ns": ns[1]},
             "fail": {"count": failed, "ns": 0}}]
        return r
    before = Snapshot(t=1.0, model_stats=[row((2, 2), (2000, 8000), 0)])
    after = Snapshot(t=2.0, model_stats=[row((6, 5), (6000, 20000), 1)])
    (f,) = figures(before, after)
    assert [(s.label, s.mean_us, s.runs, s.failures) for s in f.steps] == [
        ("step 1 double v1", pytest.approx(1.0), 6, 0), ("step 2 checker v3", pytest.approx(4.0), 5, 1)]
    from jupyter_triton.widgets.figures import html_table, text_table
    assert "step 2 checker v3" in text_table([f]) and "1 failed" in html_table([f])
    if shutil.which("node") is None:
        return
    import jupyter_triton.widgets as widgets
    script = tmp_path / "run.mjs"
    script.write_text(
        f"import {{ figures }} from {json.dumps((Path(widgets.__file__).parent / 'dashboard.js').as_uri())};\n"
        f"console.log(JSON.stringify(figures({json.dumps(before.to_json())}, {json.dumps(after.to_json())})));\n")
    done = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    (js,) = json.loads(done.stdout)
    assert [(s["step"], s["meanUs"], s["runs"], s["failures"]) for s in js["steps"]] == [
        (s.step, pytest.approx(s.mean_us), s.runs, s.failures) for s in f.steps]


# ---- p50/p95/p99 over the last minute, from the latency histograms -------------------------

def with_histogram(row: dict, cumulative: list[int], bounds=(1.0, 10.0, 100.0)) -> dict:
    """The statistics' ``latency_histograms``: the same request histogram for each kind."""
    row["latency_histograms"] = {kind: {"bounds_ms": list(bounds), "cumulative": list(cumulative)}
                                 for kind in ("request", "queue", "compute_infer")}
    return row


def histogram_snapshots() -> list[Snapshot]:
    """Readings 30 s apart: 3 fast requests (< 1 ms) before the first, 10 more, then 10 slow
    ones (10-100 ms)."""
    totals = [[3, 3, 3, 3], [13, 13, 13, 13], [13, 13, 23, 23], [13, 13, 23, 23]]
    return [Snapshot(t=100.0 + 30 * i, model_stats=[with_histogram(stats_row(), c)]) for i, c in enumerate(totals)]


def test_percentiles_are_over_the_last_minute_of_readings():
    from jupyter_triton.widgets.figures import LatencyWindows, html_table, text_table
    windows, prev, seen = LatencyWindows(60.0), None, []
    for snap in histogram_snapshots():
        (f,) = figures(prev, snap, windows)
        seen.append(f.latency["request"])
        prev = snap
    # until the first reading is a minute old the window runs from the load: those before it too
    assert seen[0]["count"] == 3 and seen[0]["window"] == "3 since load"
    assert seen[1]["count"] == 13 and seen[1]["p99"] == pytest.approx(0.99)       # all below 1 ms
    # half fast, half slow: the median at the 1 ms bound, p95 interpolated in 10..100 ms
    assert seen[2]["count"] == 20 and seen[2]["p50"] == pytest.approx(1.0)
    assert seen[2]["window"] == "20 in the last minute"
    assert seen[2]["p95"] == pytest.approx(10 + 90 * 0.9)
    # a minute later the fast requests have left the window: only the slow ones count
    assert seen[3]["count"] == 10 and seen[3]["p50"] == pytest.approx(55.0)
    assert "request p50 55.0 ms" in text_table([f]) and "p99" in html_table([f])
    # a reload (counts going down) starts the window again instead of negative counts
    (f,) = figures(prev, Snapshot(t=300.0, model_stats=[with_histogram(stats_row(), [2, 2, 2, 2])]), windows)
    assert f.latency["request"]["count"] == 2 and f.latency["request"]["p50"] == pytest.approx(0.5)


def test_without_histograms_the_dashboard_says_how_to_get_percentiles():
    from jupyter_triton.widgets.figures import HISTOGRAMS_OFF, text_table
    (f,) = figures(None, Snapshot(t=1.0, model_stats=[stats_row()]))
    assert f.latency is None and text_table([f]).endswith(HISTOGRAMS_OFF)


@pytest.mark.skipif(shutil.which("node") is None, reason="node not installed (needed to run dashboard.js here)")
def test_browser_percentiles_match_the_kernel_percentiles(tmp_path):
    import jupyter_triton.widgets as widgets
    from jupyter_triton.widgets.figures import LatencyWindows
    snaps = histogram_snapshots()
    script = tmp_path / "run.mjs"
    script.write_text(
        f"import {{ figures, latencyWindows }} from "
        f"{json.dumps((Path(widgets.__file__).parent / 'dashboard.js').as_uri())};\n"
        f"const snaps = {json.dumps([s.to_json() for s in snaps])}, w = latencyWindows(60);\n"
        "let prev = null; const out = [];\n"
        "for (const s of snaps) { out.push(figures(prev, s, w)[0].latency); prev = s; }\n"
        "console.log(JSON.stringify(out));\n")
    done = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    windows, prev, py = LatencyWindows(60.0), None, []
    for snap in snaps:
        py.append(figures(prev, snap, windows)[0].latency)
        prev = snap
    js = json.loads(done.stdout)
    for a, b in zip(js, py):
        assert a.keys() == b.keys() == {"request", "queue", "compute_infer"}
        for kind in a:
            assert a[kind]["count"] == b[kind]["count"]
            for q in ("p50", "p95", "p99"):
                assert (a[kind][q] is None and b[kind][q] is None) or a[kind][q] == pytest.approx(b[kind][q])


TALKER_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            pb_utils.Logger.log_warn(f"talker saw {x.shape[0]} rows")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return out
"""


@pytest.fixture(scope="module")
def histogram_server(tmp_path_factory):
    """A server keeping latency histograms (10/30/1000 ms buckets): 'sleepy' takes 20 ms a
    request, 'talker' logs a warning at each one (pb_utils.Logger)."""
    from conftest import serve
    from python_models import sleepy_model
    root = tmp_path_factory.mktemp("widgets") / "models"
    sleepy_model(root, "sleepy", sleep_s=0.02)
    talker = sleepy_model(root, "talker")
    (talker / "1" / "model.py").write_text(TALKER_PY)
    server, client = serve(root, model_control_mode="explicit", load_models=["*"],
                           histogram_latencies=True, histogram_buckets_ms=(10.0, 30.0, 1000.0))
    yield server, client
    client.close()
    server.close()


def infer_rows(client, model: str, rows: int = 1) -> None:
    import numpy as np
    import tritonclient.http as httpclient
    x = httpclient.InferInput("INPUT0", [rows, 2], "FP32")
    x.set_data_from_numpy(np.zeros((rows, 2), np.float32))
    client.infer(model, [x])


def test_dashboard_percentiles_from_a_server_keeping_histograms(histogram_server):
    """The kernel reads them through the statistics (the Jupyter server's /metrics wants
    Jupyter's login): a 20 ms model's requests land in its 10..30 ms bucket."""
    server, client = histogram_server
    infer_rows(client, "sleepy")          # before the dashboard: in its window (since load)
    dash = Dashboard(FakeConnection(url=server.url + "/"), model="sleepy", poll_kernel=False)
    assert dash.figures[0].latency["request"]["count"] == 1
    for _ in range(5):
        infer_rows(client, "sleepy")
    (f,) = dash.refresh()
    request = f.latency["request"]
    assert request["count"] == 6 and 10.0 <= request["p50"] <= request["p99"] <= 30.0, request
    assert f.latency["compute_infer"]["count"] == 6 and f.latency["queue"]["count"] == 6
    assert "request p50" in dash._repr_mimebundle_()[0]["text/plain"]
    dash.close()
    # what the server adds to the statistics: every kind's cumulative buckets, +Inf last
    kept = client.get_inference_statistics("sleepy")["model_stats"][0]["latency_histograms"]
    assert kept["request"]["bounds_ms"] == [10.0, 30.0, 1000.0] and kept["request"]["cumulative"][-1] == 6


def test_logs_tab_shows_the_models_last_lines(histogram_server):
    server, client = histogram_server
    for rows in (1, 2, 3):
        infer_rows(client, "talker", rows)
    dash = Dashboard(FakeConnection(url=server.url + "/"), model="talker", interval=0.1)
    try:
        wait_for(lambda: dash.refresh() and "talker saw 3 rows" in dash.logs_text())
        text = dash.logs_text()
        assert [line.split("[")[0].split()[-1] for line in text.splitlines() if "talker saw" in line] == \
            ["WARNING"] * 3, text
        assert dash.logs[-1]["model"] == "talker"
        # while no view shows the logs tab, the kernel poller reads the statistics alone
        assert dash.poller.poll_once().logs is None
        dash.tab = "logs"                     # what a view sets when its logs tab is opened
        infer_rows(client, "talker", 4)
        wait_for(lambda: any("talker saw 4 rows" in e["message"] for e in dash.logs))
    finally:
        dash.close()
    # a dashboard of every model has no logs tab (the route is per model)
    every = Dashboard(FakeConnection(url=server.url + "/"), poll_kernel=False)
    assert every.poller.logs_url is None and every.logs == []
    every.close()
