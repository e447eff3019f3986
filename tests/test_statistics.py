"""Statistics in Triton's JSON shape, and Prometheus metrics that agree with them."""
from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from jupyter_triton.engine import EngineOptions
from jupyter_triton.engine.observation.statistics import ModelStatistics
from jupyter_triton.frontends.metrics import exposition, metrics_registry
from jupyter_triton.model_metrics import CustomMetrics

from test_batcher import batcher, pending, submit_all

DURATION = {"count": 0, "ns": 0}


def test_fresh_statistics_have_triton_shape():
    stats = ModelStatistics("m", "3").to_json()
    assert stats == {
        "name": "m", "version": "3", "last_inference": 0, "inference_count": 0, "execution_count": 0,
        "inference_stats": {k: DURATION for k in ("success", "fail", "queue", "compute_input",
                                                  "compute_infer", "compute_output", "cache_hit",
                                                  "cache_miss")},
        "response_stats": {}, "batch_stats": [], "memory_usage": []}


def test_recorded_values_land_where_triton_puts_them():
    s = ModelStatistics("m", "1")
    for ns in (100, 300, 200):
        s.record_queue(ns)
    s.record_execution(batch_rows=5, n_requests=2, compute_input_ns=10, compute_infer_ns=1000,
                       compute_output_ns=20)
    s.record_execution(batch_rows=1, n_requests=1, compute_input_ns=1, compute_infer_ns=500,
                       compute_output_ns=2)
    s.record_success(5000)
    s.record_success(7000)
    s.record_failure("REJECTED", 50)
    s.record_failure("nonsense", 10)
    j = s.to_json()
    assert (j["inference_count"], j["execution_count"]) == (6, 2)
    inf = j["inference_stats"]
    assert inf["success"] == {"count": 2, "ns": 12000}
    assert inf["fail"] == {"count": 2, "ns": 60}
    assert inf["queue"] == {"count": 3, "ns": 600}
    # every request of a batch is charged the whole batch's compute time
    assert inf["compute_infer"] == {"count": 3, "ns": 2 * 1000 + 500}
    assert inf["compute_input"] == {"count": 3, "ns": 2 * 10 + 1}
    assert j["batch_stats"] == [
        {"batch_size": 1, "compute_input": {"count": 1, "ns": 1},
         "compute_infer": {"count": 1, "ns": 500}, "compute_output": {"count": 1, "ns": 2}},
        {"batch_size": 5, "compute_input": {"count": 1, "ns": 10},
         "compute_infer": {"count": 1, "ns": 1000}, "compute_output": {"count": 1, "ns": 20}}]
    assert j["last_inference"] > 1_600_000_000_000            # ms since the epoch
    assert s.failure_counts() == {"REJECTED": 1, "CANCELED": 0, "BACKEND": 0, "OTHER": 1}
    assert s.samples("request") == [5000, 7000]


def test_statistics_json_parses_as_tritons_grpc_message():
    from google.protobuf import json_format
    from tritonclient.grpc import service_pb2 as pb
    s = ModelStatistics("m", "1")
    s.record_execution(2, 2, 1, 2, 3)
    message = json_format.ParseDict({"model_stats": [s.to_json()]}, pb.ModelStatisticsResponse())
    assert message.model_stats[0].batch_stats[0].compute_infer.ns == 2


def _options(summaries: bool) -> EngineOptions:
    return EngineOptions(model_repository=Path("unused"), summary_latencies=summaries)


def _engine_after_traffic(summaries: bool):
    """Run real batches through a DynamicBatcher, recording end-to-end results like the engine."""
    async def main():
        b, _, stats = batcher("max_batch_size: 8 dynamic_batching { preferred_batch_size: [2] "
                              "max_queue_delay_microseconds: 1000000 }")
        results = await submit_all(b, [pending(i) for i in range(4)])
        for _ in results:
            stats.record_success(2_500_000)
        stats.record_failure("REJECTED", 1000)
        await b.close()
        return stats

    stats = asyncio.run(asyncio.wait_for(main(), 10))
    stats.load_seconds = 1.5
    config = text_format.Parse('name: "m"', mc.ModelConfig())
    model = SimpleNamespace(name="m", version=1, stats=stats, pending_count=0, config=config)
    return SimpleNamespace(models=lambda: [model], options=_options(summaries), response_cache=None,
                           custom_metrics=CustomMetrics()), stats


def _scrape(engine) -> tuple[str, dict]:
    body, content_type = exposition(metrics_registry(engine))
    assert content_type.startswith("text/plain")
    text = body.decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(family.name, family.type, s.name,
                     tuple(sorted(s.labels.items())))] = s.value
    return text, samples


def value(samples: dict, family: str, **labels) -> float:
    key = tuple(sorted({"model": "m", "version": "1", **labels}.items()))
    [v] = [v for (f, _, _, lab), v in samples.items() if f == family and lab == key]
    return v


def test_metrics_agree_with_statistics_and_use_tritons_names():
    engine, stats = _engine_after_traffic(summaries=False)
    text, samples = _scrape(engine)
    j = stats.to_json()
    # Triton's exposition: TYPE counter, no _total suffix, integer values
    assert "# TYPE nv_inference_request_success counter" in text
    assert 'nv_inference_request_success{model="m",version="1"} 4\n' in text
    assert "_total{" not in text and "_total " not in text
    assert value(samples, "nv_inference_request_success") == j["inference_stats"]["success"]["count"] == 4
    assert value(samples, "nv_inference_count") == j["inference_count"] == 4
    assert value(samples, "nv_inference_exec_count") == j["execution_count"] == 2
    assert value(samples, "nv_inference_request_failure", reason="REJECTED") == 1
    for reason in ("CANCELED", "BACKEND", "OTHER"):
        assert value(samples, "nv_inference_request_failure", reason=reason) == 0
    for metric, key in (("nv_inference_request_duration_us", "success"), ("nv_inference_queue_duration_us", "queue"),
                        ("nv_inference_compute_infer_duration_us", "compute_infer")):
        assert value(samples, metric) == j["inference_stats"][key]["ns"] // 1000
    assert value(samples, "nv_inference_request_duration_us") == 10_000
    assert value(samples, "nv_inference_pending_request_count") == 0
    assert value(samples, "nv_model_load_duration_secs") == 1.5
    assert not any(f.endswith("summary_us") for f, *_ in samples)           # opt-in only
    cpu = {f: v for (f, _, _, lab), v in samples.items() if f.startswith("nv_cpu")}
    assert set(cpu) == {"nv_cpu_utilization", "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes"}
    assert 0 <= cpu["nv_cpu_utilization"] <= 1
    assert 0 < cpu["nv_cpu_memory_used_bytes"] < cpu["nv_cpu_memory_total_bytes"]


def test_latency_summaries_are_opt_in_with_tritons_quantiles():
    engine, stats = _engine_after_traffic(summaries=True)
    text, samples = _scrape(engine)
    assert "# TYPE nv_inference_request_summary_us summary" in text
    for q in ("0.5", "0.9", "0.95", "0.99"):
        assert value(samples, "nv_inference_request_summary_us", quantile=q) == 2500
    families = {f for f, *_ in samples}
    assert {"nv_inference_queue_summary_us", "nv_inference_compute_input_summary_us",
            "nv_inference_compute_infer_summary_us", "nv_inference_compute_output_summary_us"} <= families
    count = [v for (f, _, name, _), v in samples.items() if name == "nv_inference_request_summary_us_count"]
    total = [v for (f, _, name, _), v in samples.items() if name == "nv_inference_request_summary_us_sum"]
    assert count == [4] and total == [10_000]


def test_label_values_are_escaped():
    s = ModelStatistics('we"ird\\name', "1")
    model = SimpleNamespace(name=s.name, version=1, stats=s, pending_count=2, config=mc.ModelConfig())
    engine = SimpleNamespace(models=lambda: [model], options=_options(False), response_cache=None,
                             custom_metrics=CustomMetrics())
    body, _ = exposition(metrics_registry(engine, cpu=False, gpu=False))
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    [sample] = families["nv_inference_pending_request_count"].samples
    assert sample.labels["model"] == 'we"ird\\name' and sample.value == 2
    assert np.isfinite(sample.value)


def test_collector_in_prometheus_clients_own_writer_keeps_tritons_names():
    from prometheus_client import CollectorRegistry, generate_latest
    from jupyter_triton.frontends.metrics import TritonMetricsCollector
    engine, _ = _engine_after_traffic(summaries=False)
    registry = CollectorRegistry()
    registry.register(TritonMetricsCollector(engine, counter_type="unknown"))
    text = generate_latest(registry).decode()
    assert "# TYPE nv_inference_request_success untyped" in text
    assert 'nv_inference_request_success{model="m",version="1"} 4.0' in text
    assert "_total{" not in text


def test_gpu_metrics_come_from_nvml_per_gpu_uuid(monkeypatch):
    """No GPU here: a stand-in NVML with one GPU whose power limit is not supported."""
    class NotSupported(Exception):
        pass

    def unsupported(handle):
        raise NotSupported()

    energy = iter([1_000_000, 1_250_000])        # mJ: at startup, then at the scrape
    fake = SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}", nvmlDeviceGetUUID=lambda h: b"GPU-1234",
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=37),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=80 * 2**30, used=2**30),
        nvmlDeviceGetPowerUsage=lambda h: 123_456, nvmlDeviceGetPowerManagementLimit=unsupported,
        nvmlDeviceGetTotalEnergyConsumption=lambda h: next(energy))
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    engine = SimpleNamespace(models=lambda: [], options=_options(False), response_cache=None,
                             custom_metrics=CustomMetrics())
    body, _ = exposition(metrics_registry(engine, cpu=False))
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    gpu = {"gpu_uuid": "GPU-1234"}

    def reading(name):
        [s] = families[name].samples
        assert s.labels == gpu
        return s.value

    assert reading("nv_gpu_utilization") == 0.37
    assert reading("nv_gpu_memory_total_bytes") == 80 * 2**30
    assert reading("nv_gpu_memory_used_bytes") == 2**30
    assert reading("nv_gpu_power_usage") == 123.456
    assert reading("nv_energy_consumption") == 250.0
    assert families["nv_gpu_power_limit"].samples == []


def test_no_nvml_means_no_gpu_metrics(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)   # import fails
    engine = SimpleNamespace(models=lambda: [], options=_options(False), response_cache=None,
                             custom_metrics=CustomMetrics())
    body, _ = exposition(metrics_registry(engine, cpu=False))
    assert b"nv_gpu" not in body and b"nv_energy" not in body


def test_failed_requests_count_as_executions_not_inferences():
    # Triton 2.51: a batch with a failed request still counts in execution_count and
    # batch_stats; the failed rows are not in inference_count nor in the compute durations.
    s = ModelStatistics("m", "1")
    s.record_queues([5, 7, 11])
    s.record_execution(3, 2, 10, 100, 20, failed_rows=1, failed_requests=1, failed_queue_ns=7)
    s.record_execution(1, 1, 10, 100, 20, failed_rows=1, failed_requests=1, failed_queue_ns=11)
    j = s.to_json()
    assert (j["inference_count"], j["execution_count"]) == (2, 2)
    assert j["inference_stats"]["queue"] == {"count": 1, "ns": 5}
    assert j["inference_stats"]["compute_infer"] == {"count": 1, "ns": 100}
    assert [b["compute_infer"]["count"] for b in j["batch_stats"]] == [1, 1]
    assert s.samples("compute_infer") == [100]
