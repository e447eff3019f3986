"""Latency histograms per model version, for Prometheus (``--metrics-config
histogram_latencies=true``, as tritonserver spells it).

Triton has one histogram, ``nv_inference_first_response_histogram_ms``; we keep it under that
name and add request, queue and compute histograms named in its pattern
(``nv_inference_<what>_histogram_ms``). Buckets: the server's (``histogram_buckets_ms``), or
a model's own through Triton's config field ``model_metrics { metric_control {
metric_identifier { family: "<name>" } histogram_options { buckets: [...] } } }``.

``ModelStatistics`` feeds a version's ``LatencyHistograms`` under its own lock (one attribute
check when histograms are off).
"""
from __future__ import annotations

import bisect
import math
from typing import Iterable, Sequence

from tritonclient.grpc import model_config_pb2 as mc

#: Triton's default buckets of nv_inference_first_response_histogram_ms
FIRST_RESPONSE_BUCKETS_MS = (100.0, 500.0, 2000.0, 5000.0)
#: ours for the others: sub-millisecond models to multi-second ones
LATENCY_BUCKETS_MS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0,
                      1000.0, 2500.0, 5000.0, 10000.0)

#: kind -> (metric family, help)
FAMILIES = {
    "first_response": ("nv_inference_first_response_histogram_ms",
                       "Duration from request to first response in milliseconds"),
    "request": ("nv_inference_request_histogram_ms",
                "Histogram of successful inference request durations in milliseconds"),
    "queue": ("nv_inference_queue_histogram_ms",
              "Histogram of inference queuing durations in milliseconds"),
    "compute_input": ("nv_inference_compute_input_histogram_ms",
                      "Histogram of compute input durations in milliseconds"),
    "compute_infer": ("nv_inference_compute_infer_histogram_ms",
                      "Histogram of compute inference durations in milliseconds"),
    "compute_output": ("nv_inference_compute_output_histogram_ms",
                       "Histogram of compute output durations in milliseconds"),
}


class Histogram:
    """Counts per bucket (upper bounds in ms; +Inf implied), a sum and a count."""

    __slots__ = ("bounds", "counts", "sum_ms", "count")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(float(b) for b in bounds if math.isfinite(b)))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum_ms = 0.0
        self.count = 0

    def observe(self, ns: int, times: int = 1) -> None:
        ms = ns / 1e6
        self.counts[bisect.bisect_left(self.bounds, ms)] += times
        self.sum_ms += ms * times
        self.count += times

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, requests at or below it) per bucket, +Inf last (Prometheus' le)."""
        out, running = [], 0
        for bound, n in zip(self.bounds + (math.inf,), self.counts):
            running += n
            out.append((bound, running))
        return out


class LatencyHistograms:
    """One model version's histograms. First responses are a decoupled model's (from its
    response stream); as in Triton, a non-decoupled model has none (its first response is
    its whole request: see the request histogram)."""

    def __init__(self, buckets: dict[str, Sequence[float]], decoupled: bool = False) -> None:
        self.decoupled = decoupled
        self.kinds = {kind: Histogram(buckets[kind]) for kind in FAMILIES}

    # called under ModelStatistics' lock
    def success(self, ns: int) -> None:
        self.kinds["request"].observe(ns)

    def first_response(self, ns: int) -> None:
        self.kinds["first_response"].observe(ns)

    def queues(self, ns: Iterable[int]) -> None:
        queue = self.kinds["queue"]
        for v in ns:
            queue.observe(v)

    def execution(self, n_requests: int, compute_input_ns: int, compute_infer_ns: int,
                  compute_output_ns: int) -> None:
        # as the statistics: each request of the batch is charged the batch's compute time
        self.kinds["compute_input"].observe(compute_input_ns, n_requests)
        self.kinds["compute_infer"].observe(compute_infer_ns, n_requests)
        self.kinds["compute_output"].observe(compute_output_ns, n_requests)

    def snapshot(self) -> dict[str, tuple[list[tuple[float, int]], float, int]]:
        return {kind: (h.cumulative(), h.sum_ms, h.count) for kind, h in self.kinds.items()}

    def to_json(self) -> dict[str, dict]:
        """The statistics' extra field ``latency_histograms`` (Triton has none): per kind its
        finite bucket bounds (ms) and the cumulative counts, one more (+Inf: the total), so a
        client reaching only the statistics (the dashboard's kernel poller) gets percentiles."""
        return {kind: {"bounds_ms": list(h.bounds), "cumulative": [n for _, n in h.cumulative()]}
                for kind, h in self.kinds.items()}


def latency_histograms(config: mc.ModelConfig, enabled: bool,
                       buckets_ms: Sequence[float] | None = None) -> LatencyHistograms | None:
    """A version's histograms when the server keeps them (None otherwise)."""
    if not enabled:
        return None
    default = tuple(buckets_ms) if buckets_ms else LATENCY_BUCKETS_MS
    buckets: dict[str, Sequence[float]] = {kind: default for kind in FAMILIES}
    buckets["first_response"] = FIRST_RESPONSE_BUCKETS_MS
    by_family = {family: kind for kind, (family, _) in FAMILIES.items()}
    for control in config.model_metrics.metric_control:
        kind = by_family.get(control.metric_identifier.family)
        if kind is not None and control.histogram_options.buckets:
            buckets[kind] = tuple(control.histogram_options.buckets)
    return LatencyHistograms(buckets, decoupled=config.model_transaction_policy.decoupled)
