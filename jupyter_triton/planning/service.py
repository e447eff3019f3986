"""A model's execution time per batch size, measured through the protocol.

The sweep sends, from one client (c=1), ``repeats`` requests of each batch size and reads the
model's statistics after each one: the request's execution is the delta of the server's
``compute_input + compute_infer + compute_output`` for that batch size. The server's own
figures, not a client's stopwatch, because the simulator needs what occupies an instance;
what a client sees on top of it (front end, network, its own Python) is measured in the same
round trip as ``overhead_ns`` (client latency minus the server's queue and compute). A sample
whose delta is not exactly one execution (someone else used the model) is dropped.

A ``ServiceModel`` draws an execution time for any batch size: the median at that size
(linear between measured sizes, and beyond the largest along the least-squares slope of all;
made non-decreasing in rows, since a sweep on a busy machine can show a batch of 2 slower
than one of 4 by chance, and a model whose larger batches truly run faster is rare) times a
ratio drawn from every sample's ratio to its own size's median. Medians and pooled ratios, not per-size means and samples: a few
slow samples (another process took the core) then widen the spread of every size instead of
bending the curve at the size they hit. Sweeps are kept per model, version, config
fingerprint and server (``ServiceModel.cached``).

After the sweep, two short bursts (one row a request, back to back: ``BURST_CLIENTS`` clients,
saturating, then one client) measure what the c=1 sweep cannot see:

* ``handoff_ns``: how long an instance is occupied per batch beyond the execution the
  statistics record (the hand-off to the instance's worker and back): at saturation the
  instance runs batch after batch, so the saturating burst's wall time less the recorded
  executions and the stalls (below: the instance waited them out, and the simulation
  stalls apart), per execution, is that cycle's remainder;
* ``loop_ns`` and ``loop_batch_ns``: the server's event loop's CPU (read, decode, submit;
  encode, write; dispatching a batch, taking its results), work that requests take in turn on
  its one thread. Per request it falls with the batch (measured with perf_analyzer here: 580-710
  us alone, 400-450 at batches of 2, 170-230 at 8), so it is two parts: one a request and one a
  batch, shared by its requests. The bursts see it at one request a batch and at the
  saturating burst's mean batch, which gives both (``_split_by_load``). The part a batch runs
  while the batch executes (alone, a request's round trip is shorter than the loop's CPU for
  it). It needs the server's process on this host (``server_thread``: the in-kernel server's
  thread, or the pid in a Jupyter server's runtime file); 0 when it cannot be read, and then
  the simulation treats the whole overhead as a delay requests spend in parallel;
* ``stall_ns``, ``stall_rate`` and ``stall_chance``: the moments the machine gave the server no
  core (other processes, the clients themselves). A request whose latency exceeds the burst's
  median by more than one instance cycle was stalled (its place in the queue varies by a cycle
  at most), and the requests answered within a cycle of each other were held by one stall
  (every client at once: nothing completes during one). The stalls come partly whatever the
  load (neighbours: ``stall_rate``, a second of work) and partly with the load's own CPU, the
  clients' and the server's competing for the cores (``stall_chance``, a request): the two
  bursts' rates at their two request rates give both, so a lighter load meets fewer a second
  (and a load served faster than the saturating burst, with less CPU a request, no more a
  second than the burst: ``CapacityPlan.run`` does not extrapolate past ``burst_qps``).
  How long: the least hold a stall left is about the stall, the rest the backlog behind it,
  which the simulation forms itself; ``_fit_stalls`` scales those lengths until the
  simulation of the saturating burst has the burst's own p99. Where no scale of them gives it
  (none seen, or the burst's tail longer than four times their lengths give: measured in 7 of 9
  validation runs), that tail is holds shorter than a cycle (below), more a second under load
  than one client met: ``hold_scale``, fitted the same way, is how many times as many at the
  burst's request rate (``ServiceModel.hold_load``); where no scale up to ``HOLD_SCALE_MAX`` gives
  it either, the holds stay as one client met them.

The burst's clients run in a process of their own (in the kernel's they would take the GIL
from an in-kernel server). What it measures is this machine at that moment: on a shared
machine a later load finds other neighbours; measure again (``refresh=True``) to follow.

The rest of the c=1 overhead (``overhead_ns - loop_ns - handoff_ns``: the client, sockets,
wake-ups) is a delay per request that requests spend in parallel; its spread, drawn per request
by the simulation, is the body of the one-client burst's round trips less their median
(``round_trip_ns``, some 1,500: the sweep's 150 overhead samples hold too few of the slow ones a
p99 rests on; ``jitter_ns``), and their far tail is drawn as holds on the clients' side, which
hold every answer due meanwhile (``holds``).
"""
from __future__ import annotations

import hashlib
import html
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

from ..progress import progress as show_progress
from ..protocol.datatypes import element_size
from ..protocol.errors import InvalidArgument, Unavailable
from ..kernel.client import TritonHTTP
from ..kernel.discovery import IN_KERNEL, Connection, runtime_files
from ..kernel.tune import png_bytes

#: (url, model, version, config fingerprint) -> the sweep; a new version or config re-measures
_CACHE: dict[tuple[str, str, str, str], "ServiceModel"] = {}
REQUEST_TIMEOUT_S = 30.0
#: clients of the saturating burst: enough that the queue is never empty when a batch ends
BURST_CLIENTS = 8
#: the stalls' lengths are fitted within [0, this] times the shortest hold each left
STALL_SCALE_MAX = 4.0
#: the holds a second at the saturating burst's load are fitted within [1, this] times one client's
HOLD_SCALE_MAX = 8.0
#: a c=1 round trip past the median by more than the upper quartile plus this many
#: interquartile ranges (and within a cycle) was held on its way: ``ServiceModel.holds``
HOLD_IQR = 3.0
#: requests of each simulated burst in the fit: a p99 of 2000 rests on 20 requests, a few
#: stalls drawn more or less, and moved +-40 % from seed to seed; of 8000, on 80
FIT_REQUESTS = 8000
#: the burst's clients (standard library only: it starts fast): argv host, port, clients;
#: stdin a JSON line {path, headers, body}, then "measure" and "stop"; stdout "go" once all
#: send, then {requests: [sent, latency] (ns) of those sent between measure and stop, errors}
BURST_CLIENT = """
import http.client, json, sys, threading, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
job = json.loads(sys.stdin.readline())
body = job["body"].encode("latin-1")
measuring, stop = threading.Event(), threading.Event()
started, requests, errors = threading.Barrier(n + 1), [], []
def send():
    conn = http.client.HTTPConnection(host, port, timeout=30)
    started.wait()
    while not stop.is_set():
        counted = measuring.is_set()
        sent = time.perf_counter_ns()
        try:
            conn.request("POST", job["path"], body, job["headers"])
            resp = conn.getresponse()
            data = resp.read()
        except Exception as err:
            errors.append(repr(err))
            return
        if resp.status != 200:
            errors.append(data[:300].decode("utf-8", "replace"))
            return
        if counted and not stop.is_set():
            requests.append((sent, time.perf_counter_ns() - sent))
threads = [threading.Thread(target=send, daemon=True) for _ in range(n)]
for t in threads:
    t.start()
started.wait()
time.sleep(0.2)
print("go", flush=True)
sys.stdin.readline()
measuring.set()
sys.stdin.readline()
stop.set()
for t in threads:
    t.join(30)
print(json.dumps({"requests": requests, "errors": errors}), flush=True)
"""


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
        median (some 1,500; their far tail is drawn as holds, ``holds``), or, without a
        burst, the sweep's overhead samples less theirs (some 150). A sample beyond the
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
        clients answered together comes back late together, as traced (late answer clumps 0.5
        to 4 ms, 3.6 to 3.9 a second, 0.7 % of requests). Each is as long as a tail sample;
        they come as often as makes the share of requests held past the bound the burst's
        share: an answer due inside a hold waits what is left of it, past the bound by
        ``length - bound`` on average over where in the hold it falls, so the rate is that
        share over the lengths' mean past the bound (an exponential tail is then given back
        exactly: what is left of an exponential hold is exponential)."""
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
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.0, 3.6), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for b in self._sizes:
            ax.scatter([b] * len(self.samples[b]), [v / 1e6 for v in self.samples[b]], s=8,
                       alpha=0.35, color="tab:blue")
        ax.plot(self._sizes, [self._medians[b] / 1e6 for b in self._sizes], "o-", color="tab:red",
                label="median (the model's)")
        ax.plot(self._sizes, [self._means[b] / 1e6 for b in self._sizes], "x", color="k", label="mean")
        top = self._sizes[-1] * 2
        ax.plot([self._sizes[-1], top], [self.median_ns(self._sizes[-1]) / 1e6, self.median_ns(top) / 1e6],
                ":", color="tab:red", label="extrapolated")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (rows)")
        ax.set_ylabel("execution (ms)")
        ax.set_title(f"{self.model} v{self.version}: overhead {self.overhead_ns / 1e6:.2f} ms a request")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        return png_bytes(fig)

    def _repr_html_(self) -> str:
        import base64
        png = base64.b64encode(self.plot_png()).decode("ascii")
        cols = ("batch_size", "n", "mean_ms", "p50_ms", "p95_ms", "max_ms", "per_row_ms")
        rows = "".join("<tr>" + "".join(f"<td>{_fmt(r[c])}</td>" for c in cols) + "</tr>"
                       for r in self.table())
        head = "".join(f"<th>{c}</th>" for c in cols)
        return (f'<div><img alt="service time" src="data:image/png;base64,{png}"/>'
                f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
                f"<p><small>{self.method}; {html.escape(self.describe_overhead())}</small></p></div>")

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


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def sweep_sizes(largest: int) -> list[int]:
    """1, 2, 4, ... and ``largest`` itself."""
    sizes, b = [], 1
    while b < largest:
        sizes.append(b)
        b *= 2
    return sizes + [largest]


def request_body(metadata: dict, rows: int) -> bytes:
    """A JSON infer request of ``rows`` rows of zeros (variable dims 1), as tune's load has."""
    inputs = []
    for inp in metadata["inputs"]:
        shape = [rows] + [1 if int(d) < 0 else int(d) for d in inp["shape"][1:]]
        n = 1
        for d in shape:
            n *= d
        value: Any = "0" if inp["datatype"] == "BYTES" else False if inp["datatype"] == "BOOL" else 0
        inputs.append({"name": inp["name"], "shape": shape, "datatype": inp["datatype"],
                       "data": [value] * n})
    return json.dumps({"inputs": inputs}).encode()


def binary_request(metadata: dict, rows: int) -> tuple[bytes, dict[str, str]]:
    """``request_body``'s request in the binary tensor extension (what perf_analyzer and
    tritonclient send; answers asked binary too), with its headers: the server's loop does
    less a request than for JSON, and the bursts measure its CPU with the clients' encoding."""
    inputs, data = [], []
    for inp in metadata["inputs"]:
        shape = [rows] + [1 if int(d) < 0 else int(d) for d in inp["shape"][1:]]
        n = 1
        for d in shape:
            n *= d
        raw = (b"\x01\x00\x00\x000" * n if inp["datatype"] == "BYTES"
               else bytes(n * (element_size(inp["datatype"]) or 1)))
        inputs.append({"name": inp["name"], "shape": shape, "datatype": inp["datatype"],
                       "parameters": {"binary_data_size": len(raw)}})
        data.append(raw)
    head = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    return head + b"".join(data), {"Content-Type": "application/octet-stream",
                                   "Inference-Header-Content-Length": str(len(head))}


def _stats(client: TritonHTTP, model: str, version: str) -> dict:
    [s] = client.stats(model, version)["model_stats"]
    return s


def _executions(s: dict) -> tuple[int, dict[int, int]]:
    per = {}
    for b in s.get("batch_stats") or []:
        per[int(b["batch_size"])] = sum(int(b[k]["ns"]) for k in
                                        ("compute_input", "compute_infer", "compute_output"))
    return int(s["execution_count"]), per


def measure(connection: Connection, model: str, sizes: list[int] | None = None, repeats: int = 15,
            warmup: int = 3, version: str = "", refresh: bool = False,
            time_limit_s: float = 60.0, burst_s: float = 3.0,
            server_pid: int | None = None, binary: bool = False, progress: bool = True) -> ServiceModel:
    """Sweep ``sizes`` (default 1, 2, 4, ... up to the model's max_batch_size) ``repeats``
    times each at c=1, then a saturating burst of ``burst_s`` (0: none); see the module
    docstring. ``server_pid``: the server's process when ``server_thread`` cannot find it
    (a standalone server started elsewhere on this host). ``binary``: the bursts send the
    binary tensor extension, as perf_analyzer and tritonclient do (default JSON, as tune's
    load does): the loop's CPU a request is the clients' encoding's. Cached unless ``refresh``.
    ``progress``: a bar (a notebook) or text lines (elsewhere) through the sweep and bursts."""
    client = TritonHTTP(connection)
    meta = client.metadata(model, version)
    version = version or str(max(int(v) for v in meta["versions"]))
    config = client.config(model, version)
    # the bursts' encoding is part of what was measured (the loop's CPU a request)
    key = (connection.url, model, version, fingerprint(config) + (" binary" if binary else ""))
    if not refresh and sizes is None and key in _CACHE:
        return _CACHE[key]
    mbs = int(config.get("max_batch_size", 0) or 0)
    if mbs < 1:
        raise InvalidArgument(f"simulate '{model}': the model does not batch (max_batch_size 0)")
    sizes = sorted({int(b) for b in (sizes or sweep_sizes(mbs))})
    if sizes[0] < 1 or sizes[-1] > mbs:
        raise InvalidArgument(f"simulate '{model}': batch sizes must be in [1, {mbs}] "
                              f"(its max_batch_size)")
    if repeats < 1 or repeats > 1000:
        raise InvalidArgument("simulate: repeats must be in [1, 1000]")
    parts = urlsplit(connection.url)
    path = parts.path.rstrip("/") + f"/v2/models/{quote(model, safe='')}/versions/{version}/infer"
    headers = {"Content-Type": "application/json", **connection.headers}
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S)
    samples: dict[int, list[int]] = {b: [] for b in sizes}
    overheads: list[int] = []
    bodies = {b: request_body(meta, b) for b in sizes}
    deadline = time.monotonic() + time_limit_s
    before = _stats(client, model, version)
    # sizes interleaved, round after round: a machine whose load drifts during the sweep
    # shifts every size alike instead of bending the curve
    rounds = [(b, True) for _ in range(warmup) for b in sizes] + \
        [(b, False) for _ in range(repeats) for b in sizes]
    steps = len(rounds) + (2 if burst_s > 0 else 0)
    with show_progress(steps, f"measure {model} v{version}", progress) as bar:
        try:
            for i, (b, warming) in enumerate(rounds):
                if time.monotonic() > deadline:
                    break
                bar.update(i, f"{'warm-up' if warming else 'sweep'}: batch of {b}")
                sent = time.perf_counter_ns()
                conn.request("POST", path, bodies[b], headers)
                resp = conn.getresponse()
                data = resp.read()
                latency = time.perf_counter_ns() - sent
                if resp.status != 200:
                    raise Unavailable(f"simulate '{model}': a batch of {b} failed: "
                                      f"{data[:300].decode('utf-8', 'replace')}")
                after = _stats(client, model, version)
                execs0, per0 = _executions(before)
                execs1, per1 = _executions(after)
                queue = (int(after["inference_stats"]["queue"]["ns"])
                         - int(before["inference_stats"]["queue"]["ns"]))
                before = after
                compute = per1.get(b, 0) - per0.get(b, 0)
                if warming or execs1 - execs0 != 1 or compute <= 0:
                    continue
                samples[b].append(compute)
                overheads.append(max(0, latency - queue - compute))
        finally:
            conn.close()
        if not any(samples.values()):
            raise Unavailable(f"simulate '{model}': no clean sample (is another client using it?)")
        result = ServiceModel(model, version, samples, int(statistics.median(overheads)), overheads,
                              fingerprint=fingerprint(config))
        if burst_s > 0:
            thread = server_thread(connection, server_pid)
            body, kind = binary_request(meta, 1) if binary else (request_body(meta, 1), None)
            bar.update(len(rounds), f"burst: {BURST_CLIENTS} clients for {burst_s:g} s")
            seen = burst(connection, model, version, path, body, burst_s, thread, content=kind)
            bar.update(len(rounds) + 1, f"burst: 1 client for {burst_s:g} s")
            alone = burst(connection, model, version, path, body, burst_s, thread, clients=1, content=kind) \
                if seen is not None else None
            if seen is not None:
                # the cycle at saturation less the executions the statistics recorded in it
                result.handoff_ns = max(0, seen.cycle_ns - seen.compute_ns)
                result.loop_ns = seen.loop_ns
                result.stall_ns, result.stall_rate = seen.stall_ns, seen.stall_rate
                result.stall_chance, result.burst_qps = seen.stall_chance, seen.qps
                result.burst_batch = seen.rows
                result.method += f"; hand-off, event loop and stalls from {burst_s:g} s bursts at c={BURST_CLIENTS} and 1"
                if alone is not None:
                    _split_by_load(result, seen, alone)
                    result.round_trip_ns = alone.latencies_ns
                result.burst_p99_ns = seen.p99_ns
                _fit_stalls(result, config, seen)
    _CACHE[key] = result
    return result


def _split_by_load(result: ServiceModel, busy: "Burst", alone: "Burst") -> None:
    """Two loads, two unknowns each. The event loop's CPU per request is a part per request and
    a part per batch shared by its requests: alone (one request a batch) it costs both, at
    saturation the batch's part divided by the burst's mean batch. The stalls are some a second
    whatever the load (neighbours) and some a request (this load's own CPU, the clients' and the
    server's, competing for the cores): the rates at the two request rates give both."""
    if busy.loop_ns and alone.loop_ns and busy.rows > 1:
        per_batch = max(0.0, (alone.loop_ns - busy.loop_ns) / (1 - 1 / busy.rows))
        result.loop_batch_ns = int(per_batch)
        result.loop_ns = int(max(0.0, busy.loop_ns - per_batch / busy.rows))
    if busy.qps > alone.qps:
        chance = (busy.stall_rate - alone.stall_rate) / (busy.qps - alone.qps)
        chance = min(max(0.0, chance), busy.stall_rate / busy.qps)
        result.stall_chance = chance
        result.stall_rate = max(0.0, busy.stall_rate - chance * busy.qps)
    result.stall_ns = sorted(busy.stall_ns + alone.stall_ns)


def _fit_stalls(result: ServiceModel, config: dict, busy: "Burst", requests: int = 0) -> None:
    """How long the stalls are, from the tail they left. A stall shows as requests held
    beyond a cycle, but how much of that hold was the stall and how much the backlog behind
    it the latencies cannot say (``_stalls`` takes the least held). So the burst is
    simulated (its clients, config and load, the stalls as seen times a scale) and the scale
    chosen whose simulated p99 is the burst's own: the stalls that, with the backlog the
    simulation forms behind them, give the tail that was measured.

    Where the stalls cannot give that tail (none seen, or the longest scale still short: the
    burst's tail is made of holds shorter than a cycle, more of them under its load than one
    client met), the holds come ``hold_scale`` times as often at the burst's load: the scale
    whose simulated burst has the burst's p99 (``ServiceModel.hold_load``); 1 where none up to
    ``HOLD_SCALE_MAX`` gives it."""
    from .capacity import CapacityPlan, Load
    if not busy.p99_ns:
        return
    mbs = int(config.get("max_batch_size", 1) or 1)
    delay = int((config.get("dynamic_batching") or {}).get("max_queue_delay_microseconds", 0) or 0)
    instances = sum(int(g.get("count", 1) or 1) for g in config.get("instance_group") or [{}])
    load = [Load("concurrency", float(BURST_CLIENTS))]
    requests = requests or FIT_REQUESTS

    def p99() -> float:
        plan = CapacityPlan(result.model, config, result, load, [(mbs, delay, instances)], requests=requests)
        return plan.results[0]["p99_ms"] * 1e6

    def largest_within(apply, lo: float, hi: float) -> float:
        """The largest value in [lo, hi] (within 1/128 of the range) whose simulated p99 is
        at most the burst's."""
        apply(hi)
        if p99() <= busy.p99_ns:
            return hi
        for _ in range(7):
            mid = (lo + hi) / 2
            apply(mid)
            if p99() < busy.p99_ns:
                lo = mid
            else:
                hi = mid
        apply(lo)
        return lo

    result.hold_scale = 1.0
    stalled = bool(result.stall_ns) and bool(result.stall_rate or result.stall_chance)
    if stalled:
        seen = list(result.stall_ns)

        def stalls(scale: float) -> None:
            result.stall_ns = [max(1, int(v * scale)) for v in seen]
        result.stall_scale = largest_within(stalls, 0.0, STALL_SCALE_MAX)
        if result.stall_scale < STALL_SCALE_MAX:
            return
    if result.holds()[0]:
        def holds(scale: float) -> None:
            result.hold_scale = scale
        if largest_within(holds, 1.0, HOLD_SCALE_MAX) >= HOLD_SCALE_MAX:
            # Not even the most holds give that tail: holds of these lengths are not what made
            # it, and as many more of them would only part the groups of clients a batch
            # answers together (the merged state at c=4), so they stay as one client met them.
            result.hold_scale = 1.0


def server_thread(connection: Connection, pid: int | None = None) -> tuple[int, int] | None:
    """(pid, thread id) of the server's event loop on this host: the in-kernel server's thread,
    a Jupyter server's main thread (the pid its runtime file gives for this URL), or ``pid``'s
    main thread; None when not found or /proc is not there."""
    found: tuple[int, int] | None = None
    thread = getattr(connection.server, "thread", None)
    if pid is not None:
        found = (pid, pid)
    elif connection.mode == IN_KERNEL and getattr(thread, "native_id", None):
        found = (os.getpid(), thread.native_id)
    else:
        try:
            infos = runtime_files()
        except Exception:          # no Jupyter runtime directory here
            infos = []
        for info in infos:
            if str(info.get("url", "")).rstrip("/") == connection.url.rstrip("/"):
                found = (int(info["pid"]), int(info["pid"]))
                break
    if found is None or _thread_cpu_ns(*found) is None:
        return None
    return found


def _thread_cpu_ns(pid: int, tid: int) -> int | None:
    """User + system CPU of one thread (Linux /proc), ns."""
    try:
        stat = open(f"/proc/{pid}/task/{tid}/stat").read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def burst(connection: Connection, model: str, version: str, path: str, body: bytes, seconds: float,
          thread: tuple[int, int] | None, clients: int = BURST_CLIENTS,
          content: dict[str, str] | None = None) -> "Burst | None":
    """``clients`` clients sending one-row requests back to back for ``seconds``; None
    when nothing was executed.

    At saturation an instance runs batch after batch: the wall time over the executions is
    its cycle (with n instances, n times the wall time), and the cycle less the execution
    the statistics recorded and the stalls is the hand-off. A request's latency beyond the median by more
    than one cycle is not its place in the queue (that varies by a cycle at most) but a stall:
    the server's threads or processes waiting for a core while something else runs; one
    stall holds up the requests in flight with it (``_stalls``)."""
    client = TritonHTTP(connection)
    parts = urlsplit(connection.url)
    headers = {**(content or {"Content-Type": "application/json"}), **connection.headers}
    instances = sum(int(g.get("count", 1) or 1)
                    for g in client.config(model, version).get("instance_group") or [{}])
    # The clients run in a process of their own: in this one they would take the GIL from an
    # in-kernel server's loop (and from the measurement), which no real client does.
    proc = subprocess.Popen([sys.executable, "-c", BURST_CLIENT, parts.hostname or "127.0.0.1",
                             str(parts.port), str(clients)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        proc.stdin.write(json.dumps({"path": path, "headers": headers,
                                     "body": body.decode("latin-1")}) + "\n")
        proc.stdin.flush()
        if proc.stdout.readline().strip() != "go":      # every client sending, past the start
            raise Unavailable(f"simulate '{model}': the burst's clients did not start: "
                              f"{proc.stderr.read()[-500:]}")
        before, cpu0, t0 = _stats(client, model, version), thread and _thread_cpu_ns(*thread), time.monotonic_ns()
        proc.stdin.write("measure\n")
        proc.stdin.flush()
        time.sleep(seconds)
        after, cpu1, t1 = _stats(client, model, version), thread and _thread_cpu_ns(*thread), time.monotonic_ns()
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=REQUEST_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    try:
        report = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise Unavailable(f"simulate '{model}': the burst's clients failed: {err[-500:]}") from None
    if report["errors"]:
        raise Unavailable(f"simulate '{model}': a request of the burst failed: {report['errors'][0]}")
    sent = report["requests"]
    execs0, per0 = _executions(before)
    execs1, per1 = _executions(after)
    execs = execs1 - execs0
    served = (int(after["inference_stats"]["success"]["count"])
              - int(before["inference_stats"]["success"]["count"]))
    if execs < 1 or served < 1 or not sent:
        return None
    rows = int(after["inference_count"]) - int(before["inference_count"])
    compute = sum(per1.values()) - sum(per0.values())
    cycle = (t1 - t0) * instances // execs
    loop = max(0, (cpu1 - cpu0) // served) if thread and cpu0 is not None and cpu1 is not None else 0
    stalls = _stalls(sent, cycle)
    # the instance waited out the stalls too: its cycle is the wall time without them
    cycle = max(0, (t1 - t0 - sum(stalls)) * instances // execs)
    latencies = sorted(lat for _, lat in sent)
    return Burst(cycle, rows / execs, compute // execs, int(loop), stalls, len(stalls) / seconds,
                 len(stalls) / served, served / seconds, latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                 len(latencies), latencies)


def _stalls(sent: list[tuple[int, int]], cycle_ns: int) -> list[int]:
    """Each stall's length, from the burst's (sent, latency) pairs: the
    requests held beyond the median latency by more than one cycle, those answered within a
    cycle of each other one stall (it held all of them), as long as the least it held. The
    others waited longer behind the backlog it left (answers and batches queued), which the
    simulation forms itself from the stall: taking the longest would count that twice."""
    median = statistics.median(lat for _, lat in sent)
    held = sorted((t + lat, lat - median) for t, lat in sent if lat - median > cycle_ns)
    stalls: list[int] = []
    last_end = None
    for end, excess in held:
        if last_end is not None and end - last_end <= cycle_ns:
            stalls[-1] = min(stalls[-1], int(excess))
        else:
            stalls.append(int(excess))
        last_end = end
    return sorted(stalls)


@dataclass
class Burst:
    """What a saturating burst saw (``burst``)."""
    cycle_ns: int          # an instance's cycle, one batch to the next
    rows: float            # the mean batch
    compute_ns: int        # the mean execution the statistics recorded
    loop_ns: int           # the event loop's CPU per request (0: unread)
    stall_ns: list[int]
    stall_rate: float      # stalls a second
    stall_chance: float    # stalls a request served
    qps: float             # requests served a second
    p99_ns: int = 0        # the burst's p99 latency (its own client's)
    requests: int = 0      # requests measured
    latencies_ns: list[int] = field(default_factory=list)   # each one's, sorted


def calibrate_overhead(connection: Connection, model: str, service: ServiceModel,
                       seconds: float = 2.0, load_generator: str = "auto") -> dict:
    """What one client of ``load_generator`` (perf_analyzer when installed, else tune's
    loadgen) sees beyond one execution at c=1: its p50 latency minus the service model's
    median for one row (medians both: a few slow outliers move neither). Use it as
    ``simulate(..., overhead_us=...)`` when comparing with that generator. Run it on a model
    with max_queue_delay 0, as the sweep's figures are."""
    from ..kernel import tune as tu
    client = TritonHTTP(connection)
    meta = client.metadata(model)
    perf = tu.find_perf_analyzer() if load_generator in ("auto", "perf_analyzer") else None
    if perf:
        run = tu._run_perf_analyzer(perf, connection, model, tu._shapes(meta), 1, seconds)
    else:
        run = tu._run_loadgen(connection, model, tu._shapes(meta), 1, seconds)
    server_ms = service.median_ns(1) / 1e6
    return {"overhead_us": max(0.0, (run["p50_ms"] - server_ms) * 1000), "client_p50_ms": run["p50_ms"],
            "server_ms": server_ms, "load_generator": "perf_analyzer" if perf else "loadgen"}
