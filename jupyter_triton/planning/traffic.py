"""Traffic for the simulator: lists of ``Arrival`` (open loop) or one ``ClosedLoop`` per
class, each generated from a seed so that a simulation repeats exactly.

* ``poisson``: open loop at a mean rate (exponential gaps), what a large user population sends;
* ``bursty``: on/off, Poisson at ``qps`` during ``on_s`` then ``off_qps`` for ``off_s``;
* ``closed``: ``concurrency`` clients, each sending when its last answer came (perf_analyzer,
  ``tune()``);
* ``from_trace``: the REQUEST_START stamps of a trace file the server wrote (Triton's format,
  ``--trace-config triton,file=...``), one model's requests, replayed at ``speed`` x;
* ``TrafficClass`` + ``mix``: several classes, each with its rows, priority and timeout.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..engine.batching.simulation import Arrival, ClosedLoop
from ..protocol.errors import InvalidArgument

#: arrivals per open-loop simulation unless a class says otherwise: enough for a p99
DEFAULT_REQUESTS = 2000
#: on/off cycles a bursty stream may span
MAX_CYCLES = 100_000


def poisson(qps: float, requests: int = DEFAULT_REQUESTS, *, rows: int = 1, priority: int = 0,
            timeout_us: int = 0, cls: str = "", seed: int = 0, start_ns: int = 0) -> list[Arrival]:
    if qps <= 0:
        raise InvalidArgument("simulate: qps must be > 0")
    rng = random.Random(f"poisson/{seed}/{cls}")
    t, out = float(start_ns), []
    for _ in range(int(requests)):
        t += rng.expovariate(qps) * 1e9
        out.append(Arrival(int(t), rows, priority, timeout_us, cls))
    return out


def bursty(qps: float, on_s: float, off_s: float, requests: int = DEFAULT_REQUESTS, *,
           off_qps: float = 0.0, rows: int = 1, priority: int = 0, timeout_us: int = 0,
           cls: str = "", seed: int = 0) -> list[Arrival]:
    """Poisson at ``qps`` for ``on_s``, then at ``off_qps`` (0: silence) for ``off_s``, again."""
    if qps <= 0 or on_s <= 0 or off_s < 0 or off_qps < 0:
        raise InvalidArgument("simulate: bursty needs qps > 0, on_s > 0, off_s >= 0, off_qps >= 0")
    rng = random.Random(f"bursty/{seed}/{cls}")
    period = on_s + off_s
    out: list[Arrival] = []
    # cycle by cycle (no float phase arithmetic at the edges); a cycle that sends nothing
    # still counts, so a rate too low for ``requests`` ends after MAX_CYCLES
    for cycle in range(MAX_CYCLES):
        for offset, length, rate in ((0.0, on_s, qps), (on_s, off_s, off_qps)):
            t = rng.expovariate(rate) if rate > 0 else length
            while t < length and len(out) < requests:
                out.append(Arrival(int((cycle * period + offset + t) * 1e9), rows, priority,
                                   timeout_us, cls))
                t += rng.expovariate(rate)
        if len(out) >= requests:
            break
    return out


def closed(concurrency: int, requests: int = DEFAULT_REQUESTS, *, rows: int = 1,
           think_us: int = 0, priority: int = 0, timeout_us: int = 0, cls: str = "") -> ClosedLoop:
    if concurrency < 1:
        raise InvalidArgument("simulate: concurrency must be >= 1")
    return ClosedLoop(int(concurrency), int(requests), rows, int(think_us) * 1000, priority,
                      timeout_us, cls)


def from_trace(path: str | Path, model: str | None = None, *, speed: float = 1.0, rows: int = 1,
               priority: int = 0, timeout_us: int = 0, cls: str = "") -> list[Arrival]:
    """Arrivals at the REQUEST_START stamps of a Triton trace file (a top-level request's, not
    an ensemble step's), relative to the first, divided by ``speed``. A file still being
    written (no closing ``]``) is read as far as it goes."""
    text = Path(path).read_text(encoding="utf-8").strip()
    try:
        entries = json.loads(text)
    except ValueError:
        try:
            entries = json.loads(text.rstrip(",") + "]")
        except ValueError:
            raise InvalidArgument(f"simulate: {path} is not a Triton trace file") from None
    if not isinstance(entries, list):
        raise InvalidArgument(f"simulate: {path} is not a Triton trace file (a JSON array)")
    heads = {e["id"]: e for e in entries if isinstance(e, dict) and "model_name" in e}
    wanted = {i for i, h in heads.items() if not h.get("parent_id")
              and (model is None or h["model_name"] == model)}
    starts = sorted(ts["ns"] for e in entries if isinstance(e, dict) and e.get("id") in wanted
                    for ts in e.get("timestamps", ()) if ts.get("name") == "REQUEST_START")
    if not starts:
        raise InvalidArgument(f"simulate: no request of {model or 'any model'} in {path}")
    if speed <= 0:
        raise InvalidArgument("simulate: speed must be > 0")
    return [Arrival(int((t - starts[0]) / speed), rows, priority, timeout_us, cls) for t in starts]


@dataclass(frozen=True)
class TrafficClass:
    """One class of traffic: open loop at ``qps`` (or closed at ``concurrency``) with its own
    rows per request, priority level (1 is first; 0 the model's default) and queue timeout."""

    name: str
    qps: float | None = None
    concurrency: int | None = None
    rows: int = 1
    priority: int = 0
    timeout_us: int = 0
    requests: int | None = None
    burst: tuple[float, float] | None = None        # (on_s, off_s): bursty instead of Poisson

    def traffic(self, seed: int, requests: int, span_s: float | None = None) -> list:
        if (self.qps is None) == (self.concurrency is None):
            raise InvalidArgument(f"simulate: class '{self.name}' needs one of qps or concurrency")
        if self.concurrency is not None:
            return [closed(self.concurrency, self.requests or requests, rows=self.rows,
                           priority=self.priority, timeout_us=self.timeout_us, cls=self.name)]
        n = self.requests or (max(1, int(self.qps * span_s)) if span_s else requests)
        if self.burst is not None:
            return bursty(self.qps, *self.burst, n, rows=self.rows, priority=self.priority,
                          timeout_us=self.timeout_us, cls=self.name, seed=seed)
        return poisson(self.qps, n, rows=self.rows, priority=self.priority,
                       timeout_us=self.timeout_us, cls=self.name, seed=seed)


def mix(classes: Sequence[TrafficClass], seed: int = 0, requests: int = DEFAULT_REQUESTS) -> list:
    """The classes' traffic together over one span: the first open-loop class sends
    ``requests`` (or its own count), the others as many as their rates give in that time."""
    open_loop = [c for c in classes if c.qps is not None]
    span = None
    if open_loop:
        first = open_loop[0]
        span = (first.requests or requests) / first.qps
    out: list = []
    for i, c in enumerate(classes):
        out += c.traffic(seed + i, requests, span)
    return sorted((a for a in out if isinstance(a, Arrival)), key=lambda a: a.t_ns) + \
        [a for a in out if not isinstance(a, Arrival)]
