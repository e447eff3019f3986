"""Quantiles of the cumulative latency buckets that the statistics JSON carries
(``latency_histograms``: bounds in ms and cumulative counts, +Inf last). Pure arithmetic on
what the protocol returns, so both the server side and the notebook's dashboard read it here
(the kernel talks protocol only, never the engine)."""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Sequence


def quantile(cumulative: list[tuple[float, int]], q: float) -> float:
    """Prometheus' histogram_quantile over one histogram's cumulative buckets (ms); NaN when
    empty. Between two bounds the value is interpolated linearly, as Prometheus does."""
    total = cumulative[-1][1] if cumulative else 0
    if not total:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0
    for bound, count in cumulative:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


class RecentQuantiles:
    """Quantiles over the last ``seconds`` of one cumulative histogram, from snapshots taken
    as a dashboard polls (the difference between the newest snapshot and the newest one at
    least ``seconds`` older; the oldest kept while the window is not yet full)."""

    def __init__(self, seconds: float = 60.0, quantiles: Sequence[float] = (0.5, 0.95, 0.99)) -> None:
        self.seconds = seconds
        self.quantiles = tuple(quantiles)
        self._snapshots: deque[tuple[float, list[tuple[float, int]]]] = deque()

    def add(self, cumulative: list[tuple[float, int]], now: float | None = None) -> dict[str, float]:
        """Record a snapshot; {"p50": ms, "p95": ms, "p99": ms, "count": n} over the window
        (NaN quantiles when nothing finished in it)."""
        now = time.monotonic() if now is None else now
        snaps = self._snapshots
        snaps.append((now, list(cumulative)))
        # keep exactly one snapshot at or before the window's start
        while len(snaps) > 2 and snaps[1][0] <= now - self.seconds:
            snaps.popleft()
        base = snaps[0][1] if len(snaps) > 1 else [(b, 0) for b, _ in cumulative]
        if [b for b, _ in base] != [b for b, _ in cumulative]:     # buckets changed (reload)
            snaps.clear()
            snaps.append((now, list(cumulative)))
            base = [(b, 0) for b, _ in cumulative]
        window = [(b, n - n0) for (b, n), (_, n0) in zip(cumulative, base)]
        out = {f"p{round(q * 100):d}": quantile(window, q) for q in self.quantiles}
        out["count"] = window[-1][1] if window else 0
        return out
