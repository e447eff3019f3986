"""A row of the plan: one (config, load) simulated, its replicas pooled (``summarize``), and
what its figures say: whether its replicas disagree (``metastable``: a config with two states
that each last, chance deciding which one a run stays in), and whether two rows are within
noise of each other (``within_noise``: another seed, or a measurement, may rank either first).
"""
from __future__ import annotations

import math
import statistics as stats_
from typing import Sequence

from ..engine.batching import simulation as sim

#: replicas disagree materially where a figure's range (max - min) over the pooled figure
#: exceeds this, or 3 / sqrt(n) for replicas of n requests if more (what the draws alone move a
#: figure of n requests), well short of the two states at c=4 (benchmarks/results/planning-notes.md)
METASTABLE = {"mean_batch": 0.15, "throughput": 0.15}
#: each replica's figures kept in its row
REPLICA_FIGURES = ("throughput", "p50_ms", "p99_ms", "mean_batch")


def _q(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(result: sim.SimResult) -> dict:
    """A simulation's figures: client-seen latency percentiles (ms; an Outcome runs from the
    client's send to its receipt, the delay outside the server included: the simulation
    draws it per request), throughput (answers per second over the run), mean batch,
    refusals, and the same per traffic class."""

    def figures(outcomes: list[sim.Outcome]) -> dict:
        ok = sorted((o.end_ns - o.arrival_ns) / 1e6
                    for o in outcomes if o.status == "ok")
        span = result.duration_ns / 1e9 or 1e-9
        return {"throughput": len(ok) / span, "p50_ms": _q(ok, 0.50), "p95_ms": _q(ok, 0.95),
                "p99_ms": _q(ok, 0.99), "mean_ms": stats_.fmean(ok) if ok else float("nan"),
                "rejected": sum(o.status == "rejected" for o in outcomes),
                "timeouts": sum(o.status == "timeout" for o in outcomes), "requests": len(outcomes)}
    row = figures(result.requests)
    rows = [b[1] for b in result.batches]
    row["mean_batch"] = stats_.fmean(rows) if rows else 0.0
    hist: dict[int, int] = {}
    for r in rows:
        hist[r] = hist.get(r, 0) + 1
    row["batch_histogram"] = dict(sorted(hist.items()))
    classes = sorted({o.cls for o in result.requests})
    if classes != [""]:
        row["classes"] = {c: figures([o for o in result.requests if o.cls == c]) for c in classes}
    return row


def pool_replicas(results: Sequence[sim.SimResult]) -> sim.SimResult:
    """Replicas as one run: their requests and batches together, their durations end to end."""
    return sim.SimResult([o for r in results for o in r.requests], [b for r in results for b in r.batches],
                         sum(r.duration_ns for r in results))


def replica_range(row: dict, figure: str) -> tuple[float, float]:
    """The least and the most of ``figure`` over a row's replicas (the pooled figure when the
    row has none)."""
    values = [r[figure] for r in row.get("replicas") or [row]]
    return min(values), max(values)


def draw_noise(row: dict) -> float:
    """What the draws alone move a figure of a replica's requests, as a share of it (1/sqrt(n))."""
    return 1 / math.sqrt(max(1.0, row["requests"] / len(row.get("replicas") or [row])))


def metastable(row: dict) -> bool:
    """Whether a row's replicas disagree materially (``METASTABLE``) on mean batch or throughput."""
    noise = 3 * draw_noise(row)
    for figure, share in METASTABLE.items():
        lo, hi = replica_range(row, figure)
        if row[figure] and (hi - lo) / row[figure] > max(share, noise):
            return True
    return False


def describe_range(row: dict) -> str:
    """A metastable row's replica ranges in words; "" for a stable one."""
    if not row.get("metastable"):
        return ""
    (b0, b1), (t0, t1), (p0, p1) = (replica_range(row, f) for f in ("mean_batch", "throughput", "p99_ms"))
    return (f"metastable: replicas form batches of {b0:.2f} to {b1:.2f}, serve {t0:.0f} to {t1:.0f} "
            f"infer/s, p99 {p0:.2f} to {p1:.2f} ms")


def noise_range(row: dict, figure: str) -> tuple[float, float]:
    """Where another run may put a row's ``figure``: its replicas' range, widened by what the
    draws alone move it (``draw_noise``)."""
    lo, hi = replica_range(row, figure)
    return lo * (1 - draw_noise(row)), hi * (1 + draw_noise(row))


def within_noise(a: dict, b: dict) -> bool:
    """Whether two rows are within noise of each other: their p99s' and their throughputs'
    ``noise_range`` overlap (another seed, or a measurement, may rank either first)."""
    return all(max(noise_range(a, f)[0], noise_range(b, f)[0])
               <= min(noise_range(a, f)[1], noise_range(b, f)[1]) for f in ("p99_ms", "throughput"))


def noise_note(a: dict, b: dict) -> str:
    """Two rows within noise of each other, in words."""
    (a0, a1), (b0, b1) = noise_range(a, "p99_ms"), noise_range(b, "p99_ms")
    n = len(a.get("replicas") or [a])
    return (f"{_label(a)} and {_label(b)} at {a['load']} are within noise of each other: their p99 "
            f"over {n} replicas and what the draws move it, {a0:.2f} to {a1:.2f} ms and {b0:.2f} to "
            f"{b1:.2f} ms, overlap, their throughputs' too; another run may rank either first")


def _label(row: dict) -> str:
    return f"b{row['max_batch_size']} d{row['max_queue_delay_us']}us" + \
        (f" x{row['instances']}" if "instances" in row else "")
