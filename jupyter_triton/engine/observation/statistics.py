"""Per model-version statistics, kept in Triton's units and rendered in Triton's JSON.

One ``ModelStatistics`` per loaded version. The engine and the instance pool record into
it; ``/v2/models/stats`` renders ``to_json()`` and the Prometheus collector reads the same
counters at scrape time, so the two can never disagree.

Updates come from the event loop and from instance threads; one plain lock guards them
(each update is a handful of integer additions, so contention is negligible).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from ...protocol.errors import Cancelled

#: Triton's ``reason`` label values of ``nv_inference_request_failure``.
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")

#: how many recent samples each latency kind keeps for the opt-in summaries
SAMPLE_WINDOW = 1024

#: latency kinds, named as the ``inference_stats`` keys (and the summary metrics) name them
LATENCY_KINDS = ("request", "queue", "compute_input", "compute_infer", "compute_output")


@dataclass
class StatDuration:
    """Triton's ``StatisticDuration``: how many, and their summed nanoseconds."""

    count: int = 0
    ns: int = 0

    def add(self, count: int, ns: int) -> None:
        self.count += count
        self.ns += ns

    def to_json(self) -> dict:
        return {"count": self.count, "ns": self.ns}


@dataclass
class BatchStat:
    compute_input: StatDuration
    compute_infer: StatDuration
    compute_output: StatDuration


@dataclass
class StatPadding:
    """Padding batches' tokens (a field Triton lacks): what ran and what was asked for;
    ``waste`` is their ratio (1.0: no padding)."""

    batch_tokens: int = 0
    request_tokens: int = 0

    @property
    def waste(self) -> float:
        return self.batch_tokens / self.request_tokens if self.request_tokens else 1.0

    def to_json(self) -> dict:
        return {"batch_tokens": self.batch_tokens, "request_tokens": self.request_tokens,
                "waste_ratio": round(self.waste, 6)}


#: Triton's default buckets of nv_inference_first_response_histogram_ms
FIRST_RESPONSE_BUCKETS_MS = (100.0, 500.0, 2000.0, 5000.0)

#: the kinds of one decoupled response, as ``response_stats`` names them
RESPONSE_KINDS = ("success", "fail", "empty_response", "cancel")


@dataclass
class ResponseStat:
    """Triton's ``InferResponseStatistics``: one response index of decoupled requests."""

    compute_infer: StatDuration
    compute_output: StatDuration
    success: StatDuration
    fail: StatDuration
    empty_response: StatDuration
    cancel: StatDuration

    def to_json(self) -> dict:
        return {"compute_infer": self.compute_infer.to_json(),
                "compute_output": self.compute_output.to_json(),
                "success": self.success.to_json(), "fail": self.fail.to_json(),
                "empty_response": self.empty_response.to_json(),
                "cancel": self.cancel.to_json()}


@dataclass
class StepStat:
    """One ensemble step: the composing model (the version it last ran on) and how its
    runs went; ``ns`` is each run's whole time on the composing model."""

    model: str
    version: str
    success: StatDuration
    fail: StatDuration

    def to_json(self, index: int) -> dict:
        return {"step": index, "model": self.model, "version": self.version,
                "success": self.success.to_json(), "fail": self.fail.to_json()}


class ModelStatistics:
    def __init__(self, name: str, version: str) -> None:
        self.name = name
        self.version = str(version)
        self._lock = threading.Lock()
        self.last_inference = 0          # ms since the epoch, 0 until the first request ends
        self.inference_count = 0         # rows (batch elements) inferred
        self.execution_count = 0         # batches executed
        self.success = StatDuration()
        self.fail = StatDuration()
        self.queue = StatDuration()
        self.compute_input = StatDuration()
        self.compute_infer = StatDuration()
        self.compute_output = StatDuration()
        self.cache_hit = StatDuration()
        self.cache_miss = StatDuration()
        self.batch_stats: dict[int, BatchStat] = {}
        # decoupled models only: per response index, and the time to each request's first one
        self.response_stats: dict[int, ResponseStat] = {}
        self.first_response_buckets = [0] * (len(FIRST_RESPONSE_BUCKETS_MS) + 1)   # last: +Inf
        self.first_response = StatDuration()
        self.failures: dict[str, int] = {reason: 0 for reason in FAILURE_REASONS}
        # Requests accepted but not finished; the engine increments/decrements it.
        self.pending = 0
        self.load_ns = 0                 # load duration (the engine includes warmup in it)
        self.warmup_ns = 0
        self._samples: dict[str, deque[int]] = {k: deque(maxlen=SAMPLE_WINDOW) for k in LATENCY_KINDS}
        # an ensemble's steps by index (1-based): latency and failures, fields Triton lacks
        self.steps: dict[int, StepStat] = {}
        # memory_usage: set by the engine once the version is loaded (engine/lifecycle/memory.py)
        self.memory: Callable[[], list[dict]] | None = None
        # engine/observation/histograms.py's LatencyHistograms when the server keeps them (fed under _lock)
        self.histograms = None
        # ragged_batching "pad" (config/padding.py): tokens the padded batches held, and the
        # tokens their requests sent; None for a model that does not pad
        self.padding: StatPadding | None = None

    # -- recording ---------------------------------------------------------------------

    def record_queue(self, ns: int) -> None:
        """One request left the queue after ``ns`` nanoseconds in it."""
        ns = max(0, int(ns))
        with self._lock:
            self.queue.add(1, ns)
            self._samples["queue"].append(ns)
            if self.histograms is not None:
                self.histograms.queues((ns,))

    def record_execution(self, batch_rows: int, n_requests: int, compute_input_ns: int,
                         compute_infer_ns: int, compute_output_ns: int, failed_rows: int = 0,
                         failed_requests: int = 0, failed_queue_ns: int = 0) -> None:
        """One batch of ``n_requests`` requests (``batch_rows`` rows) ran once, of which
        ``failed_requests`` (``failed_rows`` rows, ``failed_queue_ns`` in the queue) failed.

        Like Triton 2.51: every execution counts in ``execution_count`` and ``batch_stats``,
        but only requests that succeeded count in ``inference_count`` and in the
        ``inference_stats`` queue and compute durations (a failure lands in ``fail`` alone;
        its queue time, recorded when it left the queue, is taken back); every request of
        the batch is charged the whole batch's compute time.
        """
        ci, cf, co = int(compute_input_ns), int(compute_infer_ns), int(compute_output_ns)
        n = n_requests - failed_requests
        repeat = min(n, SAMPLE_WINDOW)
        samples = self._samples
        with self._lock:
            self.execution_count += 1
            self.inference_count += batch_rows - failed_rows
            stat = self.batch_stats.get(batch_rows)
            if stat is None:
                stat = self.batch_stats[batch_rows] = BatchStat(StatDuration(), StatDuration(), StatDuration())
            # unrolled: this runs once a batch on the data path
            stat.compute_input.count += 1
            stat.compute_input.ns += ci
            stat.compute_infer.count += 1
            stat.compute_infer.ns += cf
            stat.compute_output.count += 1
            stat.compute_output.ns += co
            self.last_inference = max(self.last_inference, _now_ms())
            if failed_requests:
                self.queue.count -= failed_requests
                self.queue.ns -= max(0, int(failed_queue_ns))
            if n <= 0:
                return
            self.compute_input.count += n
            self.compute_input.ns += n * ci
            self.compute_infer.count += n
            self.compute_infer.ns += n * cf
            self.compute_output.count += n
            self.compute_output.ns += n * co
            if self.histograms is not None:
                self.histograms.execution(n, ci, cf, co)
            if repeat == 1:
                samples["compute_input"].append(ci)
                samples["compute_infer"].append(cf)
                samples["compute_output"].append(co)
            else:
                samples["compute_input"].extend([ci] * repeat)
                samples["compute_infer"].extend([cf] * repeat)
                samples["compute_output"].extend([co] * repeat)

    def record_padding(self, batch_tokens: int, request_tokens: int) -> None:
        """One padded batch ran: ``batch_tokens`` (padding included) for ``request_tokens``."""
        with self._lock:
            if self.padding is None:
                self.padding = StatPadding()
            self.padding.batch_tokens += batch_tokens
            self.padding.request_tokens += request_tokens

    def record_queues(self, ns: list[int]) -> None:
        """Requests left the queue together, after ``ns`` nanoseconds each in it."""
        ns = [max(0, int(v)) for v in ns]
        with self._lock:
            self.queue.count += len(ns)
            self.queue.ns += sum(ns)
            self._samples["queue"].extend(ns)
            if self.histograms is not None:
                self.histograms.queues(ns)

    def record_success(self, request_ns: int) -> None:
        """One request finished successfully, ``request_ns`` after it arrived."""
        request_ns = max(0, int(request_ns))
        with self._lock:
            self.success.add(1, request_ns)
            self._samples["request"].append(request_ns)
            if self.histograms is not None:
                self.histograms.success(request_ns)
            self.last_inference = max(self.last_inference, _now_ms())

    def record_failure(self, reason: str, request_ns: int) -> None:
        """One request failed; ``reason`` is Triton's label (REJECTED, CANCELED, BACKEND, OTHER)."""
        if reason not in self.failures:
            reason = "OTHER"
        with self._lock:
            self.fail.add(1, max(0, int(request_ns)))
            self.failures[reason] += 1
            self.last_inference = max(self.last_inference, _now_ms())

    def record_response(self, index: int, kind: str, compute_infer_ns: int,
                        compute_output_ns: int, total_ns: int) -> None:
        """Response ``index`` of a decoupled request was sent: ``kind`` is success, fail,
        empty (the final flag alone) or cancel (sent after the client went away)."""
        kind = "empty_response" if kind == "empty" else kind
        with self._lock:
            stat = self.response_stats.get(index)
            if stat is None:
                stat = self.response_stats[index] = ResponseStat(*(StatDuration() for _ in range(6)))
            if kind in ("success", "fail"):
                stat.compute_infer.add(1, max(0, int(compute_infer_ns)))
                stat.compute_output.add(1, max(0, int(compute_output_ns)))
            getattr(stat, kind).add(1, max(0, int(total_ns)))

    def record_first_response(self, ns: int) -> None:
        """A decoupled request's first response, ``ns`` after the request arrived."""
        ms = max(0, int(ns)) / 1e6
        with self._lock:
            self.first_response.add(1, max(0, int(ns)))
            if self.histograms is not None:
                self.histograms.first_response(max(0, int(ns)))
            for i, bound in enumerate(FIRST_RESPONSE_BUCKETS_MS):
                if ms <= bound:
                    self.first_response_buckets[i] += 1
                    break
            else:
                self.first_response_buckets[-1] += 1

    def first_response_histogram(self) -> tuple[list[tuple[float, int]], float, int]:
        """(cumulative (upper bound ms, count) per bucket with +Inf last, sum ms, count)."""
        with self._lock:
            counts, total = list(self.first_response_buckets), self.first_response
            bounds = list(FIRST_RESPONSE_BUCKETS_MS) + [float("inf")]
            cumulative, running = [], 0
            for bound, n in zip(bounds, counts):
                running += n
                cumulative.append((bound, running))
            return cumulative, total.ns / 1e6, total.count

    def record_step(self, index: int, model: str, version: str, ok: bool, ns: int) -> None:
        """Step ``index`` of an ensemble request ran on ``model`` ``version`` for ``ns``
        (queue and compute on the composing model), and succeeded or not."""
        ns = max(0, int(ns))
        with self._lock:
            stat = self.steps.get(index)
            if stat is None:
                stat = self.steps[index] = StepStat(model, str(version), StatDuration(), StatDuration())
            stat.version = str(version)
            (stat.success if ok else stat.fail).add(1, ns)

    def step_counts(self) -> list[tuple[int, StepStat]]:
        """(index, a copy of its StepStat) per ensemble step, for the metrics."""
        with self._lock:
            return [(i, StepStat(st.model, st.version, StatDuration(st.success.count, st.success.ns),
                                 StatDuration(st.fail.count, st.fail.ns)))
                    for i, st in sorted(self.steps.items())]

    def record_cache_hit(self, ns: int) -> None:
        """A request answered from the response cache after a ``ns`` lookup: Triton counts
        it a success and in the queue (no time), not an inference nor an execution."""
        ns = max(0, int(ns))
        with self._lock:
            self.cache_hit.add(1, ns)
            self.success.add(1, ns)
            self.queue.add(1, 0)
            self._samples["request"].append(ns)
            self.last_inference = max(self.last_inference, _now_ms())

    def record_cache_miss(self, ns: int) -> None:
        """A request the cache did not hold: ``ns`` of lookup and insertion (the model's run
        is recorded as any other)."""
        with self._lock:
            self.cache_miss.add(1, max(0, int(ns)))

    def record_warmup(self, ns: int) -> None:
        """Warmup time; Triton does not report it in statistics, only as part of load time."""
        with self._lock:
            self.warmup_ns += int(ns)

    def record_load(self, ns: int) -> None:
        """Total load duration (including warmup), exported as nv_model_load_duration_secs."""
        with self._lock:
            self.load_ns = int(ns)

    @property
    def load_seconds(self) -> float:
        return self.load_ns / 1e9

    @load_seconds.setter
    def load_seconds(self, seconds: float) -> None:
        self.record_load(int(seconds * 1e9))

    # -- reading -----------------------------------------------------------------------

    def samples(self, kind: str) -> list[int]:
        """Recent latencies of ``kind`` (one of LATENCY_KINDS), in nanoseconds, oldest first."""
        with self._lock:
            return list(self._samples[kind])

    def failure_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.failures)

    def to_json(self) -> dict:
        """This version's entry of ``/v2/models/stats`` ``model_stats``, in Triton's shape."""
        memory = self.memory() if self.memory is not None else []   # reads /proc: outside the lock
        with self._lock:
            return {
                "name": self.name,
                "version": self.version,
                "last_inference": self.last_inference,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {
                    "success": self.success.to_json(),
                    "fail": self.fail.to_json(),
                    "queue": self.queue.to_json(),
                    "compute_input": self.compute_input.to_json(),
                    "compute_infer": self.compute_infer.to_json(),
                    "compute_output": self.compute_output.to_json(),
                    "cache_hit": self.cache_hit.to_json(),
                    "cache_miss": self.cache_miss.to_json(),
                },
                "response_stats": {str(i): stat.to_json()
                                   for i, stat in sorted(self.response_stats.items())},
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": stat.compute_input.to_json(),
                        "compute_infer": stat.compute_infer.to_json(),
                        "compute_output": stat.compute_output.to_json(),
                    }
                    for size, stat in sorted(self.batch_stats.items())
                ],
                "memory_usage": memory,
                **({"ensemble_steps": [stat.to_json(i) for i, stat in sorted(self.steps.items())]}
                   if self.steps else {}),
                **({"latency_histograms": self.histograms.to_json()} if self.histograms is not None else {}),
                **({"padding": self.padding.to_json()} if self.padding is not None else {}),
            }


#: the metric families of ensemble steps (Triton has none): name, help, kind
STEP_FAMILIES = (
    ("nv_ensemble_step_success", "Number of successful runs of an ensemble step", "counter"),
    ("nv_ensemble_step_failure", "Number of failed runs of an ensemble step", "counter"),
    ("nv_ensemble_step_duration_us",
     "Cumulative time of an ensemble step's runs on its composing model, in microseconds",
     "counter"),
)


def step_metric_values(stats: Iterable[tuple["ModelStatistics", dict]]
                       ) -> list[tuple[str, str, str, list[tuple[dict, float]]]]:
    """Per family of STEP_FAMILIES, its samples: one per ensemble step, labelled with the
    ensemble's labels plus ``step``, ``composing_model`` and ``composing_version``. Empty
    for a server without ensembles."""
    samples: list[list[tuple[dict, float]]] = [[], [], []]
    for s, labels in stats:
        if not s.steps:
            continue
        for index, st in s.step_counts():
            step_labels = {**labels, "step": str(index), "composing_model": st.model,
                           "composing_version": st.version}
            samples[0].append((step_labels, st.success.count))
            samples[1].append((step_labels, st.fail.count))
            samples[2].append((step_labels, (st.success.ns + st.fail.ns) // 1000))
    if not samples[0]:
        return []
    return [(name, doc, kind, values) for (name, doc, kind), values in zip(STEP_FAMILIES, samples)]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def mark_failure(err: BaseException, reason: str) -> BaseException:
    """Tag ``err`` with the ``nv_inference_request_failure`` reason it counts under."""
    err.failure_reason = reason  # type: ignore[attr-defined]
    return err


def failure_reason(err: BaseException) -> str:
    """The Triton failure reason for an error a request ended with.

    Errors tagged by ``mark_failure`` (the batcher tags REJECTED, the instance pool
    BACKEND) keep their tag; a cancelled request is CANCELED; everything else is OTHER.
    """
    reason = getattr(err, "failure_reason", None)
    if reason in FAILURE_REASONS:
        return reason
    # Cancelled (the protocol error) and asyncio.CancelledError both mean the client went away.
    if isinstance(err, (Cancelled, asyncio.CancelledError)):
        return "CANCELED"
    return "OTHER"
