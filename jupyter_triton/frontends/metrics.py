"""Triton's Prometheus metrics, read from the engine at scrape time.

``TritonMetricsCollector`` keeps no counters of its own: every scrape reads each loaded
model version's ``ModelStatistics`` (the same object ``/v2/models/stats`` renders), so
metrics and statistics agree by construction. Names, labels and help texts are Triton's.

Triton's counters are exposed without the ``_total`` suffix
(``nv_inference_request_success{model="m",version="1"} 3`` under ``# TYPE ... counter``).
prometheus_client's text writer always appends ``_total`` to counters' HELP/TYPE lines, so
``exposition`` renders the (simple) text format itself; Prometheus and prometheus_client's
parser read it. Where prometheus_client's own writer must render the collector (Jupyter
server's ``/metrics`` over the global REGISTRY), build it with ``counter_type="unknown"``:
the names stay Triton's and the TYPE line says ``untyped``.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Iterator

import psutil
from prometheus_client.core import CollectorRegistry, Metric
from prometheus_client.samples import Sample

from ..engine import Engine
from ..engine.lifecycle.memory import metric_samples as memory_samples
from ..engine.model import ModelVersion
from ..engine.cache import metric_values as cache_metric_values
from ..engine.observation.histograms import FAMILIES as HISTOGRAM_FAMILIES
from ..engine.observation.statistics import FAILURE_REASONS, step_metric_values

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
QUANTILES = (0.5, 0.9, 0.95, 0.99)

# name, help, ModelStatistics attribute whose ns become microseconds
_DURATIONS = (
    ("nv_inference_request_duration_us",
     "Cumulative inference request duration in microseconds (includes cached requests)", "success"),
    ("nv_inference_queue_duration_us",
     "Cumulative inference queuing duration in microseconds (includes cached requests)", "queue"),
    ("nv_inference_compute_input_duration_us",
     "Cumulative compute input duration in microseconds (does not include cached requests)",
     "compute_input"),
    ("nv_inference_compute_infer_duration_us",
     "Cumulative compute inference duration in microseconds (does not include cached requests)",
     "compute_infer"),
    ("nv_inference_compute_output_duration_us",
     "Cumulative inference compute output duration in microseconds (does not include cached "
     "requests)", "compute_output"),
)

# name, help, latency kind in ModelStatistics.samples, attribute holding the cumulative count/ns
_SUMMARIES = (
    ("nv_inference_request_summary_us",
     "Summary of inference request duration in microseconds (includes cached requests)",
     "request", "success"),
    ("nv_inference_queue_summary_us",
     "Summary of inference queuing duration in microseconds (includes cached requests)",
     "queue", "queue"),
    ("nv_inference_compute_input_summary_us",
     "Summary of compute input duration in microseconds (does not include cached requests)",
     "compute_input", "compute_input"),
    ("nv_inference_compute_infer_summary_us",
     "Summary of compute inference duration in microseconds (does not include cached requests)",
     "compute_infer", "compute_infer"),
    ("nv_inference_compute_output_summary_us",
     "Summary of inference compute output duration in microseconds (does not include cached "
     "requests)", "compute_output", "compute_output"),
)


class TritonMetricsCollector:
    """A prometheus_client collector over ``engine.models()`` plus CPU and (if any) GPU metrics."""

    def __init__(self, engine: Engine, cpu: bool = True, gpu: bool = True,
                 counter_type: str = "counter") -> None:
        self.engine = engine
        self.cpu = cpu
        self.counter_type = counter_type
        if cpu:
            psutil.cpu_percent(interval=None)   # primes the counter: the next call measures from here
        self._gpus = _Gpus() if gpu else None

    def collect(self) -> Iterator[Metric]:
        for family in self._families():
            if family.type == "counter":
                family.type = self.counter_type
            yield family

    def _families(self) -> Iterator[Metric]:
        models = [(m, {"model": m.name, "version": str(m.version)}) for m in self.engine.models()]
        stats = [(m.stats, labels) for m, labels in models]

        yield _family("nv_inference_request_success",
                      "Number of successful inference requests, all batch sizes", "counter",
                      ((labels, s.success.count) for s, labels in stats))
        failures = []
        for s, labels in stats:
            counts = s.failure_counts()
            failures += [({**labels, "reason": reason}, counts[reason]) for reason in FAILURE_REASONS]
        yield _family("nv_inference_request_failure",
                      "Number of failed inference requests, all batch sizes", "counter", failures)
        yield _family("nv_inference_count",
                      "Number of inferences performed (does not include cached requests)", "counter",
                      ((labels, s.inference_count) for s, labels in stats))
        yield _family("nv_inference_exec_count",
                      "Number of model executions performed (does not include cached requests)",
                      "counter", ((labels, s.execution_count) for s, labels in stats))
        yield _family("nv_inference_pending_request_count",
                      "Instantaneous number of pending requests awaiting execution per-model.",
                      "gauge", ((labels, m.pending_count) for m, labels in models))
        for name, doc, attr in _DURATIONS:
            yield _family(name, doc, "counter",
                          ((labels, getattr(s, attr).ns // 1000) for s, labels in stats))
        options = self.engine.options
        if options.summary_latencies:
            for name, doc, kind, attr in _SUMMARIES:
                yield _summary(name, doc, ((labels, s.samples(kind), getattr(s, attr))
                                           for s, labels in stats))
        if options.histogram_latencies:
            yield _first_response_histogram(models)
            yield from _latency_histograms(models)
        padded = [(s.padding, labels) for s, labels in stats if s.padding is not None]
        if padded:              # ragged_batching "pad" (config/padding.py); Triton has none
            yield from _padding_metrics(padded)
        for name, doc, kind, values in step_metric_values(stats):    # ensembles' steps
            yield _family(name, doc, kind, values)
        for name, doc, kind, values in cache_metric_values(self.engine.response_cache, models):
            yield _family(name, doc, kind, values)
        yield _family("nv_model_load_duration_secs", "Model load time in seconds", "gauge",
                      ((labels, s.load_seconds) for s, labels in stats))
        yield _family("nv_model_memory_bytes", "Memory held by a model version, in bytes, by kind "
                      "(CPU or GPU)", "gauge", memory_samples(stats))
        residency = getattr(self.engine, "residency", None)     # absent on a stand-in engine
        if residency is not None and residency.enabled:
            yield from _residency_metrics(residency.to_json(self.engine.resident_models()))
        if self.cpu:
            yield from _cpu_metrics()
        if self._gpus is not None:
            yield from self._gpus.collect()
        yield from self.engine.custom_metrics.collect()   # models' own (pb_utils.MetricFamily)


def _residency_metrics(residency: dict) -> Iterator[Metric]:
    """Lifecycle as a control (engine/lifecycle/residency.py): per model, loads a request caused and
    evictions; server-wide, resident bytes against the budget."""
    models = residency["models"]
    yield _family("nv_model_cold_starts_total", "Number of model loads caused by a request "
                  "for a model that was not loaded", "counter",
                  (({"model": m["name"]}, m["cold_starts"]) for m in models))
    yield _family("nv_model_evictions_total", "Number of times an idle model was unloaded to "
                  "stay within the residency budget", "counter",
                  (({"model": m["name"]}, m["evictions"]) for m in models))
    yield _family("nv_model_resident", "1 while the model is loaded, 0 while it is not "
                  "(evicted, or not asked for yet)", "gauge",
                  (({"model": m["name"]}, int(m["state"] == "RESIDENT")) for m in models))
    yield _family("nv_model_resident_bytes", "Memory held by the loaded models, in bytes",
                  "gauge", [({}, residency["resident_bytes"])])
    yield _family("nv_model_residency_budget_bytes", "The residency budget, in bytes (0: none)",
                  "gauge", [({}, residency["budget_bytes"])])


def _padding_metrics(padded: list[tuple[Any, dict]]) -> Iterator[Metric]:
    yield _family("nv_inference_padded_tokens",
                  "Number of tokens the padded batches of a model held, padding included",
                  "counter", ((labels, p.batch_tokens) for p, labels in padded))
    yield _family("nv_inference_request_tokens",
                  "Number of tokens the requests of padded batches sent", "counter",
                  ((labels, p.request_tokens) for p, labels in padded))
    yield _family("nv_inference_padding_waste_ratio",
                  "Padded tokens per token sent since the model loaded (1: no padding)", "gauge",
                  ((labels, p.waste) for p, labels in padded))


def _family(name: str, doc: str, kind: str, values: Iterable[tuple[dict, float]]) -> Metric:
    family = Metric(name, doc, kind)
    family.samples = [Sample(name, labels, value) for labels, value in values]
    return family


def _first_response_histogram(models: list[tuple[ModelVersion, dict]]) -> Metric:
    """Triton's nv_inference_first_response_histogram_ms: decoupled models only (a
    non-decoupled model's first response is its whole request)."""
    name = "nv_inference_first_response_histogram_ms"
    family = Metric(name, "Duration from request to first response in milliseconds", "histogram")
    for m, labels in models:
        if not m.decoupled:
            continue
        kept = m.stats.histograms     # with the model's own buckets
        buckets, total_ms, count = (kept.snapshot()["first_response"] if kept is not None
                                    else m.stats.first_response_histogram())
        for bound, n in buckets:
            family.samples.append(Sample(name + "_bucket", {**labels, "le": _value(bound)}, n))
        family.samples.append(Sample(name + "_sum", labels, total_ms))
        family.samples.append(Sample(name + "_count", labels, count))
    return family


def _latency_histograms(models: list[tuple[ModelVersion, dict]]) -> Iterator[Metric]:
    """Request, queue and compute histograms (engine/observation/histograms.py), named in the pattern of
    Triton's first-response histogram; the bucket counts are cumulative, ``le`` last."""
    snapshots = [(m.stats.histograms.snapshot(), labels) for m, labels in models
                 if m.stats.histograms is not None]
    for kind, (name, doc) in HISTOGRAM_FAMILIES.items():
        if kind == "first_response":
            continue
        family = Metric(name, doc, "histogram")
        for snapshot, labels in snapshots:
            buckets, total_ms, _ = snapshot[kind]
            for bound, n in buckets:
                family.samples.append(Sample(name + "_bucket", {**labels, "le": _value(bound)}, n))
            family.samples.append(Sample(name + "_sum", labels, total_ms))
            # the +Inf bucket: equal to the count by construction, even mid-update
            family.samples.append(Sample(name + "_count", labels, buckets[-1][1]))
        yield family


def _summary(name: str, doc: str, values: Iterable[tuple[dict, list[int], Any]]) -> Metric:
    family = Metric(name, doc, "summary")
    for labels, samples_ns, total in values:
        ordered = sorted(samples_ns)
        for q in QUANTILES:
            value = ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000 if ordered else math.nan
            family.samples.append(Sample(name, {**labels, "quantile": str(q)}, value))
        family.samples.append(Sample(name + "_sum", labels, total.ns / 1000))
        family.samples.append(Sample(name + "_count", labels, total.count))
    return family


def _cpu_metrics() -> Iterator[Metric]:
    memory = psutil.virtual_memory()
    yield _family("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", "gauge",
                  [({}, psutil.cpu_percent(interval=None) / 100)])
    yield _family("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", "gauge",
                  [({}, memory.total)])
    # Triton counts used as MemTotal - MemAvailable.
    yield _family("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", "gauge",
                  [({}, memory.total - memory.available)])


class _Gpus:
    """NVML readings per GPU; silently nothing when pynvml is missing or finds no GPU."""

    def __init__(self) -> None:
        self.handles: list[tuple[str, Any]] = []
        self._energy_start: dict[str, float] = {}
        try:
            import pynvml
            pynvml.nvmlInit()
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                self.handles.append((uuid.decode() if isinstance(uuid, bytes) else uuid, handle))
        except Exception:
            self.handles = []
            return
        self.nvml = pynvml
        for uuid, handle in self.handles:
            energy = self._read(pynvml.nvmlDeviceGetTotalEnergyConsumption, handle)
            if energy is not None:
                self._energy_start[uuid] = energy

    @staticmethod
    def _read(fn: Any, handle: Any) -> Any:
        try:
            return fn(handle)
        except Exception:   # NVMLError_NotSupported and friends: skip that reading
            return None

    def collect(self) -> Iterator[Metric]:
        if not self.handles:
            return
        nvml = self.nvml
        readings: dict[str, list] = {k: [] for k in (
            "util", "total", "used", "power", "limit", "energy")}
        for uuid, handle in self.handles:
            labels = {"gpu_uuid": uuid}
            util = self._read(nvml.nvmlDeviceGetUtilizationRates, handle)
            if util is not None:
                readings["util"].append((labels, util.gpu / 100))
            memory = self._read(nvml.nvmlDeviceGetMemoryInfo, handle)
            if memory is not None:
                readings["total"].append((labels, memory.total))
                readings["used"].append((labels, memory.used))
            power = self._read(nvml.nvmlDeviceGetPowerUsage, handle)
            if power is not None:
                readings["power"].append((labels, power / 1000))
            limit = self._read(nvml.nvmlDeviceGetPowerManagementLimit, handle)
            if limit is not None:
                readings["limit"].append((labels, limit / 1000))
            energy = self._read(nvml.nvmlDeviceGetTotalEnergyConsumption, handle)
            if energy is not None and uuid in self._energy_start:
                readings["energy"].append((labels, (energy - self._energy_start[uuid]) / 1000))
        yield _family("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", "gauge", readings["util"])
        yield _family("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", "gauge", readings["total"])
        yield _family("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", "gauge", readings["used"])
        yield _family("nv_gpu_power_usage", "GPU power usage in watts", "gauge", readings["power"])
        yield _family("nv_gpu_power_limit", "GPU power management limit in watts", "gauge",
                      readings["limit"])
        yield _family("nv_energy_consumption",
                      "GPU energy consumption in joules since the Triton Server started", "counter",
                      readings["energy"])


def metrics_registry(engine: Engine, cpu: bool = True, gpu: bool = True) -> CollectorRegistry:
    """A registry of its own (no global state) holding the engine's Triton metrics, for
    ``exposition``. Keep it: each scrape's CPU utilization is measured since the previous one."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TritonMetricsCollector(engine, cpu=cpu, gpu=gpu))
    return registry


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The Prometheus text format body and its Content-Type, counters named as Triton names them."""
    lines = []
    for family in registry.collect():
        kind = {"unknown": "untyped", "info": "gauge", "stateset": "gauge"}.get(family.type, family.type)
        doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        lines.append(f"# HELP {family.name} {doc}")
        lines.append(f"# TYPE {family.name} {kind}")
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            lines.append(f"{sample.name}{_labels(sample.labels)} {_value(sample.value)}")
    return ("\n".join(lines) + "\n").encode(), CONTENT_TYPE


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    # sorted, but a histogram's "le" last, where Triton (prometheus-cpp) puts it
    ordered = sorted(labels.items(), key=lambda kv: (kv[0] == "le", kv[0]))
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in ordered) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _value(value: float) -> str:
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 2**53):
        return str(int(value))
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
