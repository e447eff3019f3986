"""Custom metrics that models define (python backend's ``pb_utils.MetricFamily``), held by the
server and shown on its metrics endpoint next to Triton's own.

A family is a name, a description and a kind (counter, gauge, histogram); its metrics are
one per label set. As in Triton, creating a family whose name exists already gives the same
family (the first description stays; another kind is an error), and creating a metric whose
labels exist already gives the same metric. A family lives while some model instance holds
it: ``release(owner)`` at unload lets it go, so a model's metrics leave with the model.

It depends on nothing of the server. The engine owns one (``Engine.custom_metrics``) and
hands it to the backends it loads (``ServerCalls.custom_metrics``), so that two servers in one
process show each its own models' families; the python backend (in-process, or for its
worker processes) writes to it, and ``frontends/metrics.py`` reads it through the engine at
scrape time.
"""
from __future__ import annotations

import json
import math
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from prometheus_client.core import Metric

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
KINDS = (COUNTER, GAUGE, HISTOGRAM)

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class MetricError(ValueError):
    """A metric operation the model may not do; the message is what the model sees."""


@dataclass
class _Series:
    labels: dict[str, str]
    value: float = 0.0
    buckets: tuple[float, ...] = ()            # histogram upper bounds, ascending
    counts: list[int] = field(default_factory=list)
    count: int = 0


@dataclass
class _Family:
    name: str
    description: str
    kind: str
    series: dict[str, _Series] = field(default_factory=dict)
    owners: dict[Any, int] = field(default_factory=dict)


def labels_key(labels: dict[str, str]) -> str:
    """One string per label set (the form metric operations name a metric by)."""
    return json.dumps(labels, sort_keys=True, separators=(",", ":"))


class CustomMetrics:
    """Every model-defined metric family of one server."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}
        self._lock = threading.Lock()

    def family(self, name: str, description: str, kind: str, owner: Any) -> None:
        if kind not in KINDS:
            raise MetricError(f"unknown metric kind '{kind}' for metric family '{name}' "
                              "(COUNTER, GAUGE or HISTOGRAM)")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise MetricError(f"invalid metric family name '{name}': Prometheus names match "
                              "[a-zA-Z_:][a-zA-Z0-9_:]*")
        if name.startswith("nv_"):
            raise MetricError(f"metric family name '{name}': the 'nv_' prefix is Triton's own")
        with self._lock:
            family = self._families.get(name)
            if family is None:
                family = self._families[name] = _Family(name, str(description), kind)
            elif family.kind != kind:
                raise MetricError(
                    f"metric family '{name}' already exists as a {family.kind}; "
                    f"it cannot be created again as a {kind}")
            family.owners[owner] = family.owners.get(owner, 0) + 1

    def metric(self, name: str, labels: dict[str, str], buckets: list[float] | None = None) -> str:
        """Creates (or finds) the metric of ``labels``; returns its key."""
        if not isinstance(labels, dict) or not all(
                isinstance(k, str) and _LABEL.fullmatch(k) and isinstance(v, str) for k, v in labels.items()):
            raise MetricError(f"metric of family '{name}': labels must map label names "
                              "([a-zA-Z_][a-zA-Z0-9_]*) to strings")
        key = labels_key(labels)
        with self._lock:
            family = self._get(name)
            series = family.series.get(key)
            if family.kind == HISTOGRAM:
                if buckets is None:
                    raise MetricError(f"metric of histogram family '{name}' needs its buckets")
                bounds = tuple(sorted(float(b) for b in buckets))
                if series is not None and series.buckets != bounds:
                    raise MetricError(f"metric {key} of family '{name}' exists with other buckets")
            elif buckets is not None:
                raise MetricError(f"buckets are for histograms; family '{name}' is a {family.kind}")
            else:
                bounds = ()
            if series is None:
                family.series[key] = _Series(dict(labels), buckets=bounds, counts=[0] * (len(bounds) + 1))
        return key

    def increment(self, name: str, key: str, value: float) -> None:
        with self._lock:
            family, series = self._series(name, key)
            if family.kind == HISTOGRAM:
                raise MetricError(f"metric family '{name}' is a histogram: use observe()")
            if family.kind == COUNTER and value < 0:
                raise MetricError(f"metric family '{name}' is a counter: it can only be "
                                  "incremented by a non-negative value")
            series.value += float(value)

    def set(self, name: str, key: str, value: float) -> None:
        with self._lock:
            family, series = self._series(name, key)
            if family.kind != GAUGE:
                raise MetricError(f"metric family '{name}' is a {family.kind}: only a gauge can be set")
            series.value = float(value)

    def observe(self, name: str, key: str, value: float) -> None:
        with self._lock:
            family, series = self._series(name, key)
            if family.kind != HISTOGRAM:
                raise MetricError(f"metric family '{name}' is a {family.kind}: only a histogram "
                                  "observes values")
            value = float(value)
            i = next((i for i, b in enumerate(series.buckets) if value <= b), len(series.buckets))
            series.counts[i] += 1
            series.count += 1
            series.value += value

    def value(self, name: str, key: str) -> float:
        with self._lock:
            family, series = self._series(name, key)
            if family.kind == HISTOGRAM:
                raise MetricError(f"metric family '{name}' is a histogram: it has no single value")
            return series.value

    def release(self, owner: Any) -> None:
        """``owner`` (a model instance) is gone: families nobody holds any more go too."""
        with self._lock:
            for name in list(self._families):
                family = self._families[name]
                if family.owners.pop(owner, None) is not None and not family.owners:
                    del self._families[name]

    def apply(self, op: str, args: tuple, owner: Any) -> Any:
        """One operation by name, as a worker process sends it: ``family``, ``metric``,
        ``increment``, ``set``, ``observe``, ``value``."""
        if op == "family":
            return self.family(*args, owner=owner)
        if op in ("metric", "increment", "set", "observe", "value"):
            return getattr(self, op)(*args)
        raise MetricError(f"unknown metric operation '{op}'")

    def collect(self) -> Iterator["Metric"]:
        """The families as prometheus_client metrics (for the metrics endpoint)."""
        # imported at the first scrape, not with the engine: a long import that a python
        # worker process, or a notebook that only plans, never needs
        from prometheus_client.core import Metric
        from prometheus_client.samples import Sample
        with self._lock:
            families = [(f.name, f.description, f.kind,
                         [(dict(s.labels), s.value, s.buckets, list(s.counts), s.count)
                          for s in f.series.values()]) for f in self._families.values()]
        for name, description, kind, series in families:
            metric = Metric(name, description, kind)
            for labels, value, buckets, counts, count in series:
                if kind != HISTOGRAM:
                    metric.samples.append(Sample(name, labels, value))
                    continue
                running = 0
                for bound, n in zip(list(buckets) + [math.inf], counts):
                    running += n
                    le = "+Inf" if bound == math.inf else repr(float(bound))
                    metric.samples.append(Sample(name + "_bucket", {**labels, "le": le}, running))
                metric.samples.append(Sample(name + "_sum", labels, value))
                metric.samples.append(Sample(name + "_count", labels, count))
            yield metric

    def _get(self, name: str) -> _Family:
        family = self._families.get(name)
        if family is None:
            raise MetricError(f"metric family '{name}' does not exist (any more)")
        return family

    def _series(self, name: str, key: str) -> tuple[_Family, _Series]:
        family = self._get(name)
        series = family.series.get(key)
        if series is None:
            raise MetricError(f"metric {key} of family '{name}' does not exist")
        return family, series


__all__ = ["COUNTER", "GAUGE", "HISTOGRAM", "CustomMetrics", "MetricError", "labels_key"]
