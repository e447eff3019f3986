"""A model's execution time per batch size, as ``measure`` (``sweep``) found it: what the
simulation draws for every batch it forms.

A ``ServiceModel`` draws an execution time for any batch size: the median at that size
(linear between measured sizes, and beyond the largest along the least-squares slope of all;
made non-decreasing in rows, since a sweep on a busy machine can show a batch of 2 slower
than one of 4 by chance, and a model whose larger batches truly run faster is rare) times a
ratio drawn from every sample's ratio to its own size's median. Medians and pooled ratios, not
per-size means and samples: a few slow samples (another process took the core) then widen the
spread of every size instead of bending the curve at the size they hit. Sweeps are kept per
model, version, config fingerprint and server (``ServiceModel.cached``).

Beside the executions it carries what the bursts measured (``bursts``) and the fit made of
them (``fitting``): the instance's hand-off, the event loop's CPU, the machine's stalls. The
rest of the c=1 overhead (``overhead_ns - loop_ns - handoff_ns``: the client, sockets,
wake-ups) is a delay per request that requests spend in parallel; its spread, drawn per request
by the simulation, is the body of the one-client burst's round trips less their median
(``round_trip_ns``: the sweep's overhead samples hold too few of the slow ones a p99 rests on;
``jitter_ns``), and their far tail is drawn as holds on the clients' side, which hold every
answer due meanwhile (``holds``).
"""
from __future__ import annotations

import hashlib
import json
import random
import statistics
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..protocol.errors import InvalidArgument
from . import render

if TYPE_CHECKING:
    from ..kernel.discovery import Connection

#: (url, model, version, config fingerprint) -> the sweep; a new version or config re-measures
_CACHE: dict[tuple[str, str, str, str], "ServiceModel"] = {}
#: a c=1 round trip past the median by more than the upper quartile plus this many
#: interquartile ranges (and within a cycle) was held on its way: ``ServiceModel.holds``
HOLD_IQR = 3.0


def fingerprint(config: dict) -> str:
    """What in a config changes execution: everything but the scheduling knobs we vary."""
    keep = {k: v for k, v in config.items()
            if k not in ("name", "max_batch_size", "dynamic_batching", "instance_group",
                         "version_policy")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class ServiceModel:
    """Execution ns per batch size, as measured: ``samples[rows]`` are single executions."""

    model: str
    version: str
    samples: dict[int, list[int]]
    overhead_ns: int = 0                       # client-seen latency beyond queue + compute, c=1
    overhead_samples: list[int] = field(default_factory=list, repr=False)
    method: str = "statistics deltas (compute_input + compute_infer + compute_output), c=1"
    fingerprint: str = ""
    handoff_ns: int = 0                        # per batch: instance occupied beyond the execution
    loop_ns: int = 0                           # per request: the server's event loop's CPU (0: unknown)
    loop_batch_ns: int = 0                     # per batch: the loop's CPU shared by its requests
    stall_ns: list[int] = field(default_factory=list, repr=False)   # stalls seen by the burst
    stall_rate: float = 0.0                    # stalls a second of the (saturated) burst
    stall_chance: float = 0.0                  # stalls a request of the burst (0: unknown)
    burst_qps: float = 0.0                     # requests a second the burst was served
    burst_batch: float = 0.0                   # the burst's mean batch (rows)
    burst_p99_ns: int = 0                      # the burst's p99 (its own client's latency)
    stall_scale: float = 1.0                   # the stalls' lengths as seen, times this (``_fit_stalls``)
    round_trip_ns: list[int] = field(default_factory=list, repr=False)  # the c=1 burst's latencies
    hold_scale: float = 1.0                    # the holds a second at the burst's load over c=1's (``_fit_stalls``)

    def __post_init__(self) -> None:
        self.samples = {int(k): sorted(int(v) for v in vs) for k, vs in self.samples.items() if vs}
        if not self.samples:
            raise InvalidArgument(f"service model of '{self.model}': no sample")
        self._sizes = sorted(self.samples)
        self._means = {b: statistics.fmean(v) for b, v in self.samples.items()}
        medians = {b: float(statistics.median(v)) for b, v in self.samples.items()}
        self._medians, top = {}, 0.0
        for b in self._sizes:
            top = max(top, medians[b])
            self._medians[b] = top
        # An execution held beyond its size's median by more than one c=1 round trip was a
        # stall of the machine (the worker waited for a core), which the bursts measure and the
        # simulation draws apart; kept in the spread, one among a sweep's 24 would make 4 % of
        # all batches that long.
        cycle = medians[self._sizes[0]] + self.overhead_ns
        self._ratios = sorted(v / medians[b] for b, vs in self.samples.items() for v in vs
                              if v - medians[b] <= cycle)
        # past the largest size: the least-squares slope over every size, not the last
        # segment's alone (one noisy size would decide it)
        if len(self._sizes) > 1:
            mx = statistics.fmean(self._sizes)
            my = statistics.fmean(self._medians[b] for b in self._sizes)
            num = sum((b - mx) * (self._medians[b] - my) for b in self._sizes)
            self._slope = max(0.0, num / sum((b - mx) ** 2 for b in self._sizes))
        else:
            self._slope = 0.0

    # -- drawing ---------------------------------------------------------------------------
    def median_ns(self, rows: int) -> float:
        """The typical execution of a batch of ``rows``: interpolated between measured sizes."""
        sizes, med = self._sizes, self._medians
        if rows in med:
            return med[rows]
        if len(sizes) == 1:
            return med[sizes[0]]
        i = bisect_left(sizes, rows)
        if i == len(sizes):
            return med[sizes[-1]] + self._slope * (rows - sizes[-1])
        if i == 0:
            lo, hi = sizes[0], sizes[1]
        else:
            lo, hi = sizes[i - 1], sizes[i]
        slope = (med[hi] - med[lo]) / (hi - lo)
        return max(1.0, med[lo] + slope * (rows - lo))

    def _cycle_ns(self) -> float:
        """One c=1 round trip: a sample held past the median by more than this was a stall."""
        return self.median_ns(1) + statistics.median(self.overhead_samples or [0])

    def _round_trips(self) -> tuple[list[int], list[int], int]:
        """The c=1 burst's round trips less their median, within a cycle: (the body, the tail
        past the upper quartile plus ``HOLD_IQR`` interquartile ranges, that bound)."""
        median = statistics.median(self.round_trip_ns)
        cycle = self._cycle_ns()
        within = sorted(int(v - median) for v in self.round_trip_ns if v - median <= cycle)
        if len(within) < 4:
            return within, [], 0
        q1, _, q3 = statistics.quantiles(within, n=4)
        bound = int(q3 + HOLD_IQR * (q3 - q1))
        return [v for v in within if v <= bound], [v for v in within if v > bound], bound

    def jitter_ns(self) -> list[int]:
        """How much a request's round trip varies beyond its execution (client, front end,
        wake-ups), drawn per request: the body of the c=1 burst's round trips less their
        median (their far tail is drawn as holds, ``holds``), or, without a burst, the
        sweep's overhead samples less theirs. A sample beyond the
        median by more than one c=1 round trip was a stall, not this request's own path (the
        bursts' criterion): stalls hold every request at once and are drawn apart; drawn per
        request, one stall among a sweep's 24 samples would put 4 % of all requests that late."""
        if self.round_trip_ns:
            return self._round_trips()[0]
        if not self.overhead_samples:
            return []
        median = statistics.median(self.overhead_samples)
        cycle = self._cycle_ns()
        return sorted(int(v - median) for v in self.overhead_samples if v - median <= cycle)

    def holds(self, qps: float = 0.0) -> tuple[list[int], float]:
        """The c=1 burst's far tail as holds on the clients' side (``engine/simulation``):
        (their lengths, ns, how many a second). A round trip that far out was held on its
        way, and a hold holds every answer due meanwhile, not one request: at c=4 a group of
        clients answered together comes back late together, as traced (planning-notes.md in
        benchmarks/results). Each is as long as a tail sample; they come as often as makes the
        share of requests held past the bound the burst's share: an answer due inside a hold
        waits what is left of it, past the bound by ``length - bound`` on average over where
        in the hold it falls, so the rate is that share over the lengths' mean past the bound
        (an exponential tail is then given back exactly: what is left of an exponential hold
        is exponential)."""
        if not self.round_trip_ns:
            return [], 0.0
        body, tail, bound = self._round_trips()
        if not tail:
            return [], 0.0
        share = len(tail) / (len(body) + len(tail))
        past = statistics.fmean(v - bound for v in tail)
        return tail, share / past * 1e9 * self.hold_load(qps)

    def hold_load(self, qps: float) -> float:
        """How many more holds a second a load of ``qps`` requests a second meets than one
        client: ``hold_scale`` at the saturating burst's rate (the clients' and the server's
        CPU competing for the cores hold answers more often), 1 at the one-client burst's,
        linear between, and no further past either."""
        if self.hold_scale == 1.0 or not self.burst_qps or not self.round_trip_ns:
            return 1.0
        alone = 1e9 / statistics.median(self.round_trip_ns)
        if self.burst_qps <= alone:
            return 1.0
        share = min(1.0, max(0.0, (qps - alone) / (self.burst_qps - alone)))
        return 1.0 + (self.hold_scale - 1.0) * share

    def mean_ns(self, rows: int) -> float:
        """The mean of what ``__call__`` draws for ``rows``."""
        return self.median_ns(rows) * statistics.fmean(self._ratios)

    def __call__(self, rows: int, rng: random.Random) -> int:
        """How long an instance is occupied by a batch of ``rows``: a drawn execution and the
        measured hand-off around it."""
        return max(1, int(self.median_ns(rows) * rng.choice(self._ratios))) + self.handoff_ns

    @property
    def parallel_ns(self) -> int:
        """The median c=1 overhead less what the simulation models as stages (the event
        loop's turn, the instance's hand-off): the delay requests spend side by side."""
        return max(0, self.overhead_ns - self.loop_ns - self.handoff_ns)

    def scaled(self, factor: float) -> "ServiceModel":
        """Every execution ``factor`` times as long: another machine, or this one under load."""
        if factor <= 0:
            raise InvalidArgument("simulate: a service model's scale must be > 0")
        return ServiceModel(self.model, self.version,
                            {b: [int(v * factor) for v in vs] for b, vs in self.samples.items()},
                            self.overhead_ns, self.overhead_samples,
                            method=self.method + f", scaled x{factor:.2f}", fingerprint=self.fingerprint,
                            handoff_ns=self.handoff_ns, loop_ns=self.loop_ns, loop_batch_ns=self.loop_batch_ns,
                            stall_ns=self.stall_ns, stall_rate=self.stall_rate,
                            stall_chance=self.stall_chance, burst_qps=self.burst_qps,
                            burst_batch=self.burst_batch, burst_p99_ns=self.burst_p99_ns,
                            stall_scale=self.stall_scale, round_trip_ns=self.round_trip_ns,
                            hold_scale=self.hold_scale)

    # -- showing ---------------------------------------------------------------------------
    def table(self) -> list[dict]:
        out = []
        for b in self._sizes:
            v = self.samples[b]
            out.append({"batch_size": b, "n": len(v), "mean_ms": self._means[b] / 1e6,
                        "p50_ms": _q(v, 0.5) / 1e6, "p95_ms": _q(v, 0.95) / 1e6,
                        "max_ms": v[-1] / 1e6, "per_row_ms": self._means[b] / b / 1e6})
        return out

    def plot_png(self) -> bytes:
        """Execution time against batch size: every sample, the mean, the model's line."""
        return render.service_png(self)

    def _repr_html_(self) -> str:
        return render.service_html(self)

    def describe_overhead(self) -> str:
        return (f"overhead {self.overhead_ns / 1e6:.2f} ms a request at c=1 (event loop "
                f"{self.loop_ns / 1e3:.0f} us in turn, parallel {self.parallel_ns / 1e3:.0f} us); "
                f"hand-off {self.handoff_ns / 1e3:.0f} us a batch, event loop {self.loop_batch_ns / 1e3:.0f} us "
                f"a batch; stalls {self.stall_rate:.1f} a second and {self.stall_chance * 1000:.1f} a "
                f"thousand requests; holds {self.holds()[1]:.1f} a second at one client's load, "
                f"{self.hold_scale:.1f} times as many at the burst's")

    def __repr__(self) -> str:
        rows = ", ".join(f"{r['batch_size']}: {r['mean_ms']:.2f} ms" for r in self.table())
        return f"ServiceModel({self.model} v{self.version}: {rows}; {self.describe_overhead()})"

    # -- keeping ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"model": self.model, "version": self.version, "fingerprint": self.fingerprint,
                "method": self.method, "overhead_ns": self.overhead_ns,
                "overhead_samples": list(self.overhead_samples), "handoff_ns": self.handoff_ns,
                "loop_ns": self.loop_ns, "loop_batch_ns": self.loop_batch_ns, "stall_ns": list(self.stall_ns), "stall_rate": self.stall_rate,
                "stall_chance": self.stall_chance, "burst_qps": self.burst_qps,
                "burst_batch": self.burst_batch, "burst_p99_ns": self.burst_p99_ns,
                "stall_scale": self.stall_scale, "round_trip_ns": list(self.round_trip_ns),
                "hold_scale": self.hold_scale,
                "samples": {str(b): v for b, v in self.samples.items()}}

    @classmethod
    def from_json(cls, obj: dict) -> "ServiceModel":
        return cls(obj["model"], str(obj["version"]), {int(b): v for b, v in obj["samples"].items()},
                   int(obj.get("overhead_ns", 0)), [int(v) for v in obj.get("overhead_samples", [])],
                   method=obj.get("method", ""),
                   fingerprint=obj.get("fingerprint", ""), handoff_ns=int(obj.get("handoff_ns", 0)),
                   loop_ns=int(obj.get("loop_ns", 0)), loop_batch_ns=int(obj.get("loop_batch_ns", 0)),
                   stall_ns=[int(v) for v in obj.get("stall_ns", [])],
                   stall_rate=float(obj.get("stall_rate", 0.0)),
                   stall_chance=float(obj.get("stall_chance", 0.0)),
                   burst_qps=float(obj.get("burst_qps", 0.0)),
                   burst_batch=float(obj.get("burst_batch", 0.0)),
                   burst_p99_ns=int(obj.get("burst_p99_ns", 0)),
                   stall_scale=float(obj.get("stall_scale", 1.0)),
                   hold_scale=float(obj.get("hold_scale", 1.0)),
                   round_trip_ns=[int(v) for v in obj.get("round_trip_ns", [])])

    @staticmethod
    def cached(connection: Connection, model: str, version: str, config: dict) -> "ServiceModel | None":
        return _CACHE.get((connection.url, model, version, fingerprint(config)))


def _q(sorted_values: list[int], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
