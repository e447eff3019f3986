"""The standalone server's metrics port, scraped like Prometheus does: after a known
workload, Triton's counters, gauges and (opt-in) summaries say what happened, and agree with
GET v2/models/stats."""
from __future__ import annotations

import http.client
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from jupyter_triton.engine import EngineOptions
from jupyter_triton.standalone import start_in_thread
from python_models import request, sleepy_model

pytestmark = pytest.mark.timeout(120)

ROWS = (1, 2, 3)          # the batch sizes "counted" is called with, one request each


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("metrics") / "models"
    sleepy_model(root, "counted", max_batch_size=8)
    sleepy_model(root, "busy", sleep_s=0.8, max_batch_size=1,
                 extra="dynamic_batching { default_queue_policy { max_queue_size: 1 } }")
    server = start_in_thread(EngineOptions(model_repository=root, model_control_mode="explicit",
                                           load_models=["*"], summary_latencies=True),
                             host="127.0.0.1", http_port=0, metrics_port=0, grpc_port=None)
    yield server
    server.close()


def new_client(server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=30)


def metrics_text(server) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", server.metrics_port, timeout=10)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    body = resp.read().decode()
    conn.close()
    assert resp.status == 200
    assert resp.getheader("Content-Type").startswith("text/plain")
    return body


def scrape(server) -> dict[tuple[str, frozenset], float]:
    body = metrics_text(server)
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def value(samples: dict, name: str, model: str, **labels) -> float:
    # prometheus_client's parser names a counter's samples <name>_total; Triton's text does not
    # (test_counters_keep_triton_names checks the text itself)
    labels = frozenset({"model": model, "version": "1", **labels}.items())
    for key in ((name, labels), (name + "_total", labels)):
        if key in samples:
            return samples[key]
    raise AssertionError(f"{name} {dict(labels)} not exported")


@pytest.fixture(scope="module")
def counted(server):
    """Three successful requests of 1, 2 and 3 rows and one that the model fails."""
    client = new_client(server)
    try:
        for i, rows in enumerate(ROWS, start=1):
            client.infer("counted", request(i, rows=rows))
        with pytest.raises(InferenceServerException):
            client.infer("counted", request(-1))
        stats = client.get_inference_statistics("counted")["model_stats"][0]
    finally:
        client.close()
    return scrape(server), stats


def test_counts_of_requests_inferences_and_executions(counted):
    samples, _ = counted
    assert value(samples, "nv_inference_request_success", "counted") == len(ROWS)
    # one execution per request here (no dynamic batching), the failed one included
    assert value(samples, "nv_inference_exec_count", "counted") == len(ROWS) + 1
    assert value(samples, "nv_inference_count", "counted") == sum(ROWS)   # a failure is no inference (Triton)


def test_failures_carry_triton_reasons(counted):
    samples, _ = counted
    assert value(samples, "nv_inference_request_failure", "counted", reason="BACKEND") == 1
    for reason in ("REJECTED", "CANCELED", "OTHER"):
        assert value(samples, "nv_inference_request_failure", "counted", reason=reason) == 0


def test_durations_are_counted_in_microseconds(counted):
    samples, _ = counted
    for name in ("nv_inference_request_duration_us", "nv_inference_compute_infer_duration_us",
                 "nv_inference_queue_duration_us"):
        assert value(samples, name, "counted") > 0, name
    for name in ("nv_inference_compute_input_duration_us", "nv_inference_compute_output_duration_us"):
        assert value(samples, name, "counted") >= 0


def test_metrics_agree_with_the_statistics_extension(counted):
    samples, stats = counted
    inference = stats["inference_stats"]
    assert value(samples, "nv_inference_request_success", "counted") == inference["success"]["count"]
    assert value(samples, "nv_inference_count", "counted") == stats["inference_count"]
    assert value(samples, "nv_inference_exec_count", "counted") == stats["execution_count"]
    failures = sum(value(samples, "nv_inference_request_failure", "counted", reason=r)
                   for r in ("REJECTED", "CANCELED", "BACKEND", "OTHER"))
    assert failures == inference["fail"]["count"]
    for name, key in (("nv_inference_request_duration_us", "success"),
                      ("nv_inference_queue_duration_us", "queue"),
                      ("nv_inference_compute_infer_duration_us", "compute_infer")):
        assert value(samples, name, "counted") == inference[key]["ns"] // 1000, name
    assert sorted(b["batch_size"] for b in stats["batch_stats"]) == [1, 2, 3]


def test_summaries_when_summary_latencies_is_on(counted):
    samples, stats = counted
    success = stats["inference_stats"]["success"]
    assert value(samples, "nv_inference_request_summary_us_count", "counted") == success["count"]
    assert value(samples, "nv_inference_request_summary_us_sum", "counted") == pytest.approx(
        success["ns"] / 1000)
    median = value(samples, "nv_inference_request_summary_us", "counted", quantile="0.5")
    p99 = value(samples, "nv_inference_request_summary_us", "counted", quantile="0.99")
    assert 0 < median <= p99 <= success["ns"] / 1000
    for kind in ("queue", "compute_infer"):
        assert value(samples, f"nv_inference_{kind}_summary_us_count", "counted") > 0


def test_pending_gauge_and_rejections_of_a_busy_model(server):
    # "busy" runs one request for 0.8 s at a time and queues at most one more. Each call is
    # sent once the one before is seen running or queued, not after a fixed delay (a loaded
    # machine can take longer than any delay to get a request in).
    def call(i: int):
        client = new_client(server)
        try:
            client.infer("busy", request(i))
            return None
        except InferenceServerException as err:
            return err
        finally:
            client.close()

    def until(predicate) -> None:
        deadline = time.monotonic() + 10
        while not predicate():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def started() -> int:
        client = new_client(server)
        try:
            stats = client.get_inference_statistics("busy")["model_stats"][0]
        finally:
            client.close()
        return int(stats["inference_stats"]["queue"]["count"])   # counted when execution starts

    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = [pool.submit(call, 1)]
        until(lambda: started() == 1)
        futures.append(pool.submit(call, 2))
        until(lambda: value(scrape(server), "nv_inference_pending_request_count", "busy") == 1)
        during = scrape(server)
        futures.append(pool.submit(call, 3))
        results = [f.result(timeout=30) for f in futures]
    after = scrape(server)
    assert results[0] is None and results[1] is None
    assert results[2] is not None and results[2].status() == "503"
    # Triton's gauge counts requests awaiting execution: the queued one, not the running one
    assert value(during, "nv_inference_pending_request_count", "busy") == 1
    assert value(after, "nv_inference_pending_request_count", "busy") == 0
    assert value(after, "nv_inference_request_failure", "busy", reason="REJECTED") == 1
    assert value(after, "nv_inference_request_success", "busy") == 2


def test_counters_keep_triton_names(server, counted):
    lines = metrics_text(server).splitlines()
    assert "# TYPE nv_inference_request_success counter" in lines
    assert any(line.startswith('nv_inference_request_success{model="counted",version="1"} ')
               for line in lines)
    assert not any(line.startswith("nv_inference_request_success_total") for line in lines)


def test_cpu_metrics_are_exported(server):
    samples = scrape(server)
    names = {name for name, _ in samples}
    assert {"nv_cpu_utilization", "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes"} <= names


# -- latency histograms (--metrics-config histogram_latencies=true) ---------------------------

SLOW_BUCKETS = """model_metrics { metric_control [ {
  metric_identifier { family: "nv_inference_request_histogram_ms" }
  histogram_options { buckets: [ 100, 5000 ] } } ] }"""


@pytest.fixture(scope="module")
def histograms(tmp_path_factory):
    """A server keeping histograms: 'quick' with the server's buckets, 'slow' (120 ms a
    request) with its own request buckets from its config; three requests each."""
    root: Path = tmp_path_factory.mktemp("histograms") / "models"
    sleepy_model(root, "quick", max_batch_size=8)
    sleepy_model(root, "slow", sleep_s=0.12, max_batch_size=8, extra=SLOW_BUCKETS)
    server = start_in_thread(EngineOptions(model_repository=root, model_control_mode="explicit",
                                           load_models=["*"], histogram_latencies=True,
                                           histogram_buckets_ms=(100.0, 60000.0)),
                             host="127.0.0.1", http_port=0, metrics_port=0, grpc_port=None)
    client = new_client(server)
    try:
        for i in range(3):
            client.infer("quick", request(i))
            client.infer("slow", request(i))
    finally:
        client.close()
    yield server
    server.close()


def buckets(samples: dict, name: str, model: str) -> dict[str, float]:
    return {dict(labels)["le"]: v for (n, labels), v in samples.items()
            if n == name + "_bucket" and dict(labels)["model"] == model}


def test_latency_histograms_per_model(histograms):
    samples = scrape(histograms)
    for model in ("quick", "slow"):
        for kind in ("request", "queue", "compute_infer"):
            name = f"nv_inference_{kind}_histogram_ms"
            assert value(samples, name + "_count", model) == 3, (model, kind)
            assert buckets(samples, name, model)["+Inf"] == 3
    # the server's buckets, and the slow model's own (its config's model_metrics)
    assert set(buckets(samples, "nv_inference_queue_histogram_ms", "slow")) == {"100", "60000", "+Inf"}
    assert set(buckets(samples, "nv_inference_request_histogram_ms", "slow")) == {"100", "5000", "+Inf"}
    # a 120 ms model is above 100 ms every time; the sums are in milliseconds
    assert buckets(samples, "nv_inference_request_histogram_ms", "slow")["100"] == 0
    assert buckets(samples, "nv_inference_compute_infer_histogram_ms", "slow")["100"] == 0
    assert value(samples, "nv_inference_request_histogram_ms_sum", "slow") >= 3 * 120
    assert value(samples, "nv_inference_compute_infer_histogram_ms_sum", "slow") >= 3 * 120
    assert value(samples, "nv_inference_request_histogram_ms_sum", "quick") < \
        value(samples, "nv_inference_request_histogram_ms_sum", "slow")
    # non-decoupled models have no first responses (Triton's histogram: decoupled models only)
    assert not buckets(samples, "nv_inference_first_response_histogram_ms", "quick")
    text = metrics_text(histograms)
    assert "# TYPE nv_inference_request_histogram_ms histogram" in text
    assert 'nv_inference_request_histogram_ms_bucket{model="slow",version="1",le="100"} 0' in text


def test_histogram_quantiles_for_the_dashboard(histograms):
    from jupyter_triton.protocol.quantiles import quantile
    [slow] = [m for m in histograms.engine.models() if m.name == "slow"]
    cumulative, _, count = slow.stats.histograms.snapshot()["request"]
    assert count == 3
    assert 100 < quantile(cumulative, 0.5) <= 5000
    assert quantile([(1.0, 0), (float("inf"), 0)], 0.5) != quantile([(1.0, 0), (float("inf"), 0)], 0.5)  # NaN


def test_no_histograms_unless_asked(server, counted):
    text = metrics_text(server)
    assert "_histogram_ms" not in text


def test_recent_quantiles_cover_the_last_window_only():
    from jupyter_triton.engine.observation.histograms import Histogram
    from jupyter_triton.protocol.quantiles import RecentQuantiles
    h = Histogram((1.0, 10.0, 100.0))
    recent = RecentQuantiles(seconds=60)
    for _ in range(100):
        h.observe(50_000_000)                 # 50 ms each
    first = recent.add(h.cumulative(), now=0.0)
    assert first["count"] == 100 and 10 < first["p50"] <= 100
    for _ in range(100):
        h.observe(500_000)                    # then 0.5 ms each
    # 61 s later: only the fast ones are in the last minute
    later = recent.add(h.cumulative(), now=61.0)
    assert later["count"] == 100 and later["p99"] <= 1.0
    quiet = recent.add(h.cumulative(), now=130.0)
    assert quiet["count"] == 0 and quiet["p50"] != quiet["p50"]      # NaN: nothing finished
